"""The lock a model's calls take turns by, which raises where a wait could never end.

Calls on one model from several threads take turns (``RoundPipe``'s calls, the backward of its
``forward()``, a load). A call may call another model from inside (in ``loss_fn``, a layer or a
hook: distillation from a teacher, a critic). Two threads that do so both ways would each hold
their own model and wait for the other's for ever, where plain PyTorch, which holds nothing,
runs both. A thread about to wait for a model therefore follows the chain of waits from that
model's holder; if it comes back to this thread, the wait is refused with a ``RuntimeError``
naming both models, the call unwinds, and the other thread goes on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from roundpipe import lifecycle
from roundpipe.optim.step_thread import in_step_job


class _Waits:
    """Which lock each waiting thread waits for, under one small lock of its own."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.waiting: dict[int, CallLock] = {}


_waits = _Waits()


class CallLock:
    """A reentrant lock for the calls of the model ``name``; ``with lock:`` takes it."""

    __slots__ = ("_depth", "_lock", "_owner", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.RLock()
        self._owner: int | None = None  # written by the holder only
        self._depth = 0

    def acquire(self, refuse_endless: bool = True) -> None:
        """Take the lock, waiting for its holder (interruptible by Ctrl-C). With
        ``refuse_endless``, ``RuntimeError`` instead of a wait that could never end."""
        if self._lock.acquire(blocking=False):
            self._taken()
            return
        me = threading.get_ident()
        waits = _waits
        with waits.lock:
            if refuse_endless:
                self._refuse_a_cycle(me, waits.waiting)
            waits.waiting[me] = self
        try:
            self._lock.acquire()
        finally:
            with waits.lock:
                waits.waiting.pop(me, None)
        self._taken()

    def release(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._owner = None
        self._lock.release()

    def __enter__(self) -> None:
        self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _taken(self) -> None:
        self._owner = threading.get_ident()
        self._depth += 1

    def _refuse_a_cycle(self, me: int, waiting: dict[int, CallLock]) -> None:
        """``RuntimeError`` if the chain of waits from this lock's holder leads back to ``me``."""
        chain: list[CallLock] = []
        lock: CallLock | None = self
        while lock is not None and len(chain) <= len(waiting):
            owner = lock._owner
            if owner is None:
                return
            if owner == me:
                held = chain[-1].name if chain else self.name
                through = " (through calls in other threads)" if len(chain) > 1 else ""
                raise RuntimeError(
                    f"RoundPipe model '{self.name}': this call would wait for ever. Another "
                    f"thread is in a call of model '{self.name}' that waits{through} for model "
                    f"'{held}', and this thread is in a call of '{held}' (it called "
                    f"'{self.name}' from inside: loss_fn, a layer or a hook). Calls of models "
                    "from inside each other's, in several threads at once, cannot all go on; "
                    "make such calls from one thread, or outside the other model's call."
                )
            lock = waiting.get(owner)
            if lock is not None:
                chain.append(lock)


# fork() while models are in use: the child inherits every model between two calls. Before
# fork() the calls in flight on other threads end first (every live model's lock is taken, in one
# order, and held until fork() returned), then the optimizer thread drains (the lifecycle's order).
# A child then never inherits a lock held by a thread it does not have (its first call would wait
# for ever), nor a stage's device copies bound in place of the parameters.
_held: list[CallLock] = []
_live: list[Callable[[], Iterable[CallLock]]] = []


def hold_for_fork(locks: Callable[[], Iterable[CallLock]]) -> None:
    """Have ``fork()`` hold the call locks ``locks()`` gives (the live models')."""
    _live.append(locks)


def _hold() -> None:
    """Wait for the calls in flight on other threads, holding every model's lock until fork()
    returned. Skipped on the optimizer thread (the main thread may be waiting there for the
    step, holding its model's lock); a Ctrl-C gives up the wait."""
    if in_step_job() or lifecycle.fork_interrupted():
        return
    try:
        locks = [lock for source in _live for lock in source()]
        for lock in sorted(locks, key=id):  # one order: two forking threads cannot cross
            lock.acquire(refuse_endless=False)  # a hook of fork() cannot raise
            _held.append(lock)
    except KeyboardInterrupt:
        _release()
        lifecycle.interrupted_before_fork()


def _release() -> None:
    while _held:
        _held.pop().release()


def _release_in_child() -> None:
    # The child has only the forking thread: no waits, and no lock a vanished thread held.
    global _waits
    _waits = _Waits()
    _release()


lifecycle.join(
    "call locks",
    lifecycle.Participant(
        before_fork=_hold, after_fork_in_parent=_release, after_fork_in_child=_release_in_child
    ),
)

__all__ = ["CallLock", "hold_for_fork"]
