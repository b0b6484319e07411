"""The process around RoundPipe: interpreter exit, ``fork()`` and the signals it handles.

This module owns the one exit handler, the ``fork()`` hooks and every signal handler RoundPipe
installs. The parts that need them take part by name, and :data:`PARTICIPANTS` fixes the order in
which each event reaches them, whatever the order their modules were imported in:

1. ``call locks`` (:mod:`roundpipe.call.lock`): before ``fork()`` every live model's call lock is
   taken, so the calls in flight on other threads end first (they may queue steps); released
   after it, and in the child the waits of threads it does not have are forgotten.
2. ``optimizer thread`` (:mod:`roundpipe.optim.step_thread`): at exit the queued optimizer steps
   and native workers are drained (bounded after an uncaught exception); before ``fork()`` too,
   so the child inherits finished steps; the child forgets the parent's jobs.
3. ``optimizer offload`` (:mod:`roundpipe.optim.offload`): at exit, after the last steps, the
   lock files of offload folders are released and removed.
4. ``trace`` (:mod:`roundpipe.timeline.tracing`): at exit the trace being recorded is finished,
   after the last steps it shows; the child forgets the parent's trace.

Then, last of the parent's ``fork()`` hooks, a Ctrl-C that came during those waits is raised
where ``fork()`` returns (:func:`interrupted_before_fork`). When the exit drain gives up on work
that still runs, or SIGTERM/SIGHUP ends the process while a part asked for them
(:func:`catch_ending_signals`), every participant's ``leave_now`` runs and the process ends at
once, as it would have ended without RoundPipe.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from roundpipe._native import _C

PARTICIPANTS: Final = ("call locks", "optimizer thread", "optimizer offload", "trace")

# How long interpreter exit waits for work in flight after a KeyboardInterrupt (or another
# uncaught exception) before it leaves without it.
EXIT_AFTER_ERROR_SECONDS: Final = 2.0

_ENDING_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Participant:
    """What one part does at each event (None: nothing).

    ``at_exit(seconds)`` finishes the part's work within ``seconds`` (None: no bound) and returns
    whether it did; False makes the process leave at once (``unfinished`` names what it left).
    ``leave_now(reason)`` keeps what it can when the process ends at once, for ``reason``."""

    at_exit: Callable[[float | None], bool] | None = None
    unfinished: str = "work"
    leave_now: Callable[[str], None] | None = None
    before_fork: Callable[[], None] | None = None
    after_fork_in_parent: Callable[[], None] | None = None
    after_fork_in_child: Callable[[], None] | None = None


_joined: dict[str, Participant] = {}


def join(name: str, participant: Participant) -> None:
    """Have the part ``name`` (one of :data:`PARTICIPANTS`) take part in the process's events."""
    if name not in PARTICIPANTS:
        raise ValueError(f"unknown lifecycle participant {name!r}; known: {PARTICIPANTS}")
    _joined[name] = participant


def _in_order() -> list[Participant]:
    return [_joined[name] for name in PARTICIPANTS if name in _joined]


def exiting_after_error() -> bool:
    """Whether the interpreter is exiting because of an uncaught exception (Ctrl-C included):
    the exception was printed and kept in ``sys.last_value``."""
    return isinstance(getattr(sys, "last_value", None), BaseException)


@atexit.register
def _at_exit() -> None:
    """Each participant finishes in order while the interpreter is still alive; after an uncaught
    exception within ``EXIT_AFTER_ERROR_SECONDS`` in all. A Ctrl-C during the wait gives it up."""
    bound = EXIT_AFTER_ERROR_SECONDS if exiting_after_error() else None
    deadline = None if bound is None else time.monotonic() + bound
    for participant in _in_order():
        if participant.at_exit is None:
            continue
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        try:
            finished = participant.at_exit(left)
        except KeyboardInterrupt:
            sys.last_value = KeyboardInterrupt()
            finished = False
        if not finished:
            ended_by = type(getattr(sys, "last_value", None)).__name__
            _leave_now(
                f"the process ended with an uncaught {ended_by} while {participant.unfinished} "
                f"still ran (left after {EXIT_AFTER_ERROR_SECONDS:g} s): spans not finished by "
                "then are missing"
            )


def _leave_now(reason: str) -> None:
    """Exit at once, without waiting for work that still runs on native threads: a normal
    interpreter shutdown would stop such a thread mid-Python when it next takes the GIL (which
    aborts the process) or wait for it forever. The participants keep what they can, output is
    flushed; the exit status is what an uncaught KeyboardInterrupt gives (killed by SIGINT), 1
    for another error."""
    for participant in _in_order():
        if participant.leave_now is not None:
            participant.leave_now(reason)
    if "logging" in sys.modules:
        sys.modules["logging"].shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    if isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(130)  # SIGINT is ignored or blocked: the shell's code for it
    os._exit(1)


def interrupted_before_fork() -> None:
    """Note a Ctrl-C that came during a wait before ``fork()``: the waits left are skipped, and
    the parent raises it once ``fork()`` returned (an exception in a fork hook is only printed,
    and the fork goes ahead)."""
    _C.note_fork_interrupt(True)


def fork_interrupted() -> bool:
    """Whether a wait before the ``fork()`` under way was interrupted by Ctrl-C."""
    return bool(_C.fork_interrupted())


def _before_fork() -> None:
    for participant in _in_order():
        if participant.before_fork is not None:
            participant.before_fork()


def _after_fork_in_parent() -> None:
    for participant in _in_order():
        if participant.after_fork_in_parent is not None:
            participant.after_fork_in_parent()


def _after_fork_in_child() -> None:
    _C.note_fork_interrupt(False)  # the parent's Ctrl-C is not the child's
    for participant in _in_order():
        if participant.after_fork_in_child is not None:
            participant.after_fork_in_child()


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
# Last of the parent's hooks (they run in the order registered), and native: it runs no Python
# code after it notes the Ctrl-C, which then surfaces where fork() returns (a KeyboardInterrupt
# raised inside a hook would only be printed).
os.register_at_fork(after_in_parent=_C.raise_fork_interrupt)


def catch_ending_signals() -> None:
    """Have SIGTERM and SIGHUP let the participants keep what they can (``leave_now``) before
    the process ends by the signal's default action, where that action is still the default
    and this is the main thread (the only one that may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in _ENDING_SIGNALS:
        if signal.getsignal(number) == signal.SIG_DFL:
            signal.signal(number, _end_on_signal)


def release_ending_signals() -> None:
    """Undo :func:`catch_ending_signals` (on the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in _ENDING_SIGNALS:
        if signal.getsignal(number) == _end_on_signal:
            signal.signal(number, signal.SIG_DFL)


def _end_on_signal(number: int, frame: Any) -> None:
    """Let the participants keep what they can, then end the process by the signal's default
    action, as it would have ended without RoundPipe."""
    reason = f"the process was ended by {signal.Signals(number).name}"
    for participant in _in_order():
        if participant.leave_now is not None:
            participant.leave_now(reason)
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold a Ctrl-C that arrives inside the block until it ends, then raise it as Python's
    handler would: for bookkeeping that must not stop half-way (the gradients handed to a
    step and the step queued, the weights written back after it), none of which waits. On
    other threads (where Python delivers no Ctrl-C) and under a handler Python did not install,
    the block runs as it is."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if not callable(previous):  # SIG_IGN, SIG_DFL or a handler installed outside Python
        yield
        return
    caught: list[Any] = []
    signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            previous(signal.SIGINT, caught[0])


__all__ = [
    "EXIT_AFTER_ERROR_SECONDS",
    "PARTICIPANTS",
    "Participant",
    "catch_ending_signals",
    "exiting_after_error",
    "fork_interrupted",
    "interrupted_before_fork",
    "interrupts_deferred",
    "join",
    "release_ending_signals",
]
