"""Timeline traces of pipelined runs (Chrome trace event format) and the planner's prediction:
the public entry point, and what turns recording on and off for a block or a whole process.

Recording::

    with roundpipe.trace("run.json"):
        model.forward_backward(...)

or ``ROUNDPIPE_TRACE=run.json python train.py`` for an unchanged script (the variable is read at
the first traced event; the trace ends when the process does). The file is written as the run
goes and is a whole trace at any time, marked cut short (``otherData.cut_short``) until the
recording ends normally (:class:`Tracer`, :mod:`roundpipe.timeline.file`). It opens in Perfetto
(ui.perfetto.dev), ``chrome://tracing`` and ``python -m roundpipe.plot run.json``.

The parts: :mod:`roundpipe.timeline.events` (the events, :class:`Trace`, its JSON and summary),
:mod:`roundpipe.timeline.tracer` (the recorder and its clocks),
:mod:`roundpipe.timeline.prediction` (the simulator's schedule as a trace); this module
re-exports their public names.

Runtime API (what the pipeline calls; cheap when tracing is off)::

    tracer = active_tracer()          # None unless a trace is being recorded
    if tracer is not None:
        start = tracer.mark(device)
    ...
    if tracer is not None:
        tracer.record("forward", model=name, device=device, lane="compute", start=start,
                      end=tracer.mark(device), stage=s, layers=stage_layers, microbatch=m)
"""

from __future__ import annotations

import os
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Final, cast

from roundpipe import lifecycle
from roundpipe.lifecycle import catch_ending_signals, release_ending_signals
from roundpipe.timeline.events import (
    COMPUTE_PHASES,
    DEVICE_LANES,
    HOST_LANES,
    HOST_PID,
    OPTIMIZER_PHASES,
    PHASES,
    Phase,
    Trace,
    TraceEvent,
    TraceSummary,
    range_name,
)
from roundpipe.timeline.file import TraceFileBusy
from roundpipe.timeline.prediction import LayerCosts, predict_trace
from roundpipe.timeline.tracer import FLUSH_EVENTS, FLUSH_SECONDS, Mark, StageTrace, Tracer

#: Environment variable naming the file a whole process is traced to.
ENV_VAR: Final[str] = "ROUNDPIPE_TRACE"

_UNREAD: Final = object()
#: The recording Tracer, None when off, _UNREAD until the environment was read.
_active: Any = _UNREAD
_activation_lock = threading.Lock()
_environment_tracer: Tracer | None = None


def active_tracer() -> Tracer | None:
    """The tracer recording now, or None: the runtime checks this before recording anything.

    The first call reads ``ROUNDPIPE_TRACE``; when it names a file, the whole process is traced to
    it, written as the run goes and finished at exit.
    """
    tracer = _active
    if tracer is _UNREAD:
        with _activation_lock:
            _read_environment_locked()
            tracer = _active
    return cast("Tracer | None", tracer)


def _read_environment_locked() -> None:
    global _active, _environment_tracer
    if _active is not _UNREAD:
        return
    path = os.environ.get(ENV_VAR) or None
    _active = _environment_tracer = None if path is None else _environment_trace(path)
    if _environment_tracer is not None:
        catch_ending_signals()


def _environment_trace(path: str) -> Tracer | None:
    """The tracer ``ROUNDPIPE_TRACE=path`` asks for. A path another process writes (ranks of a
    job sharing the variable) gives this process ``<name>.<pid><suffix>`` beside it; a path that
    cannot be written leaves the process untraced. Both are warnings, not errors: the training
    goes on."""
    tracer = Tracer(path)
    if isinstance(tracer.error, TraceFileBusy):
        root, suffix = os.path.splitext(path)
        tracer = Tracer(f"{root}.{os.getpid()}{suffix}")
        if tracer.error is None:
            warnings.warn(
                f"{ENV_VAR}: another process writes {path}; this one traces to {tracer.path}",
                RuntimeWarning,
                stacklevel=4,
            )
    if tracer.error is None:
        return tracer
    warnings.warn(
        f"{ENV_VAR}: {tracer.error}; this process is not traced", RuntimeWarning, stacklevel=4
    )
    return None


def _finish_at_exit(seconds: float | None) -> bool:
    """Finish the trace being recorded (the ``ROUNDPIPE_TRACE`` one, or a block still open) at
    exit, marked cut short after an uncaught exception (Ctrl-C included). The lifecycle runs it
    after the drain of the optimizer thread, so it sees the last optimizer steps; when the drain
    gives up on work still running, the process leaves at once through :func:`end_trace_now`."""
    tracer = _active
    if not isinstance(tracer, Tracer):
        return True
    error = getattr(sys, "last_value", None)
    ended_by = None
    if isinstance(error, BaseException):
        ended_by = f"the process ended with an uncaught {type(error).__name__}"
    tracer.finish(wait=False, cut_short=ended_by)
    if tracer.error is not None:
        warnings.warn(f"the trace was not finished: {tracer.error}", RuntimeWarning, stacklevel=1)
    return True


def end_trace_now(reason: str) -> None:
    """Finish the file of the trace being recorded, marked cut short for ``reason``, waiting at
    most about a second for threads that record or write: for a process that ends at once
    (``os._exit`` or a signal), which skips the exit handler that would finish it."""
    tracer = _active
    if isinstance(tracer, Tracer):
        tracer.end_now(reason)


def _forget_parent_trace() -> None:
    """In a forked child: the parent's trace is the parent's to write, and ``ROUNDPIPE_TRACE``
    traces the parent process only."""
    global _active, _environment_tracer, _activation_lock
    _activation_lock = threading.Lock()
    if isinstance(_active, Tracer):
        _active.abandon()
    _active = _environment_tracer = None
    release_ending_signals()


lifecycle.join(
    "trace",
    lifecycle.Participant(
        at_exit=_finish_at_exit, leave_now=end_trace_now, after_fork_in_child=_forget_parent_trace
    ),
)
if os.environ.get(ENV_VAR):
    # Now, on the importing (main) thread: the first traced event may come from another one.
    catch_ending_signals()


@contextmanager
def trace(path: str | os.PathLike[str] | None = None) -> Iterator[Tracer]:
    """Record a timeline of every RoundPipe call made inside the block.

    Args:
        path: the file the Chrome trace JSON is streamed to as the block runs (a valid trace at
            any time, finished when the block ends, also when it raises); None keeps the trace in
            memory only.

    Yields:
        The :class:`Tracer`; after the block, its ``close()`` returns the finished :class:`Trace`.

    Raises:
        TypeError: ``path`` is not a path or None.
        RuntimeError: a trace is already being recorded (a nested block, or ``ROUNDPIPE_TRACE``).
        OSError: when the block ends, if ``path`` could not be written (a missing folder, a
            folder, no permission, a full disk; nothing was recorded from then on). If the block
            raised, its exception is raised instead, with this failure in a note.
    """
    global _active
    if path is not None and not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str, os.PathLike or None, got {type(path).__name__}")
    with _activation_lock:
        _read_environment_locked()
        if _active is not None:
            where = _active.path or "memory"
            raise RuntimeError(
                f"a trace is already being recorded (to {where}); end it before starting another"
            )
        tracer = Tracer(path)
        _active = tracer
    if path is not None:
        catch_ending_signals()
    try:
        yield tracer
    except BaseException as error:
        failure = _end_block(tracer)
        if failure is not None:
            _report_beside(error, f"roundpipe.trace could not write its file: {failure}")
        raise
    failure = _end_block(tracer)
    if failure is not None:
        raise failure


def _report_beside(error: BaseException, message: str) -> None:
    """Tell ``message`` with ``error``: a note in its traceback (Python 3.11+), else a warning."""
    add_note = getattr(error, "add_note", None)
    if add_note is not None:
        add_note(message)
    else:
        warnings.warn(message, RuntimeWarning, stacklevel=4)


def _end_block(tracer: Tracer) -> OSError | None:
    """Stop the block's trace and finish its file; the error that kept the file from being
    written, if any."""
    global _active
    with _activation_lock:
        _active = None
    release_ending_signals()
    tracer.finish(wait=True, cut_short=None)
    return tracer.error


def stage_trace(model: str, device: int, stage: int, layers: range) -> StageTrace | None:
    """A :class:`StageTrace` when a trace is being recorded, else None."""
    tracer = active_tracer()
    return None if tracer is None else StageTrace(tracer, model, device, stage, layers)


__all__ = [
    "COMPUTE_PHASES",
    "DEVICE_LANES",
    "ENV_VAR",
    "FLUSH_EVENTS",
    "FLUSH_SECONDS",
    "HOST_LANES",
    "HOST_PID",
    "OPTIMIZER_PHASES",
    "PHASES",
    "LayerCosts",
    "Mark",
    "Phase",
    "StageTrace",
    "Trace",
    "TraceEvent",
    "TraceSummary",
    "Tracer",
    "active_tracer",
    "end_trace_now",
    "predict_trace",
    "range_name",
    "stage_trace",
    "trace",
]
