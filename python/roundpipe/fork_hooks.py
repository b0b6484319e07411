"""``fork()`` while models are in use: the child inherits every model between two calls.

Before ``fork()`` the calls in flight on other threads end first (every model's call lock is
taken, in one order, and held until ``fork()`` returned), after the step pipeline's own hooks
drained the optimizer thread. A child then never inherits a lock held by a thread it does not
have (its first call would wait for ever), nor a stage's device copies bound in place of the
parameters."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from roundpipe._native import _C
from roundpipe.call_lock import CallLock
from roundpipe.step import fork_interrupted, in_step_job, interrupted_before_fork

_held: list[CallLock] = []
_models: list[Callable[[], Iterable[CallLock]]] = []


def hold_for_fork(locks: Callable[[], Iterable[CallLock]]) -> None:
    """Have ``fork()`` hold the call locks ``locks()`` gives (the live models')."""
    _models.append(locks)


def _hold() -> None:
    """Wait for the calls in flight on other threads, holding every model's lock until fork()
    returned. Skipped on the optimizer thread (the main thread may be waiting there for the
    step, holding its model's lock); a Ctrl-C gives up the wait."""
    if in_step_job() or fork_interrupted():
        return
    try:
        locks = [lock for source in _models for lock in source()]
        for lock in sorted(locks, key=id):  # one order: two forking threads cannot cross
            lock.acquire(refuse_endless=False)  # a hook of fork() cannot raise
            _held.append(lock)
    except KeyboardInterrupt:
        _release()
        interrupted_before_fork()


def _release() -> None:
    while _held:
        _held.pop().release()


# Registered after roundpipe.step's hooks (imported above), so that before fork() the calls in
# flight end first (they may queue steps), then the optimizer thread drains.
os.register_at_fork(before=_hold, after_in_parent=_release, after_in_child=_release)
# Last of the parent's hooks (they run in the order registered): a Ctrl-C noted before fork()
# surfaces as KeyboardInterrupt where fork() returns, not inside a hook of ours.
os.register_at_fork(after_in_parent=_C.raise_fork_interrupt)

__all__ = ["hold_for_fork"]
