"""The recorder of a trace: :class:`Tracer` collects the spans the runtime reports and streams
them to the trace file; :class:`StageTrace` is what one stage of the pipeline holds of it.

Clocks: the host clock (``time.perf_counter_ns``) for host threads and virtual CPU devices. On
CUDA, compute spans are closed by CUDA events on the device's current stream and converted to host
time against a reference event recorded when the device is first seen; they are resolved in the
order they were recorded, whenever a later event finds them complete, and the rest when the trace
closes, so recording never waits for the device. Copies run on the native copy engines: a copy's
span starts when it was issued (or when the lane's previous copy ended, if later) and ends when its
completion is observed (CPU devices: at the next traced event that finds it complete; CUDA: by an
event a side stream records right after it), so a copy's end is an upper bound, accurate to about
one event.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Final

from roundpipe._native import _C
from roundpipe.timeline.events import (
    DEVICE_LANES,
    HOST_LANES,
    PHASES,
    Phase,
    SpanFields,
    Trace,
    TraceEvent,
    chrome_event,
    lane_names,
)
from roundpipe.timeline.file import TraceFile

#: A timestamp: host ``perf_counter_ns``, or a CUDA event recorded on a device stream.
Mark = Any
#: A recorded span in host nanoseconds: phase, lane, device, start, end, fields, args. Kept raw
#: while recording (cheap) and turned into TraceEvents when written (or when the trace closes).
_Span = tuple[str, str, int | None, int, int, SpanFields, dict[str, Any]]


@dataclass
class _Pending:
    """A span whose end (or start) is still a device event: resolved when it completes."""

    phase: str
    lane: str
    device: int | None
    start: Mark
    end: Mark
    fields: SpanFields
    args: dict[str, Any]
    done: Any = None  # a native copy-engine event whose completion is the end (CPU devices)


#: A trace file is written when this many events wait for it, or FLUSH_SECONDS after the first.
FLUSH_EVENTS: Final[int] = 1024
FLUSH_SECONDS: Final[float] = 0.05
#: A thread that records an event while this many wait writes them itself (bounded memory when
#: events come faster than the writer thread is given time).
_MAX_WAITING: Final[int] = 4 * FLUSH_EVENTS
#: How long a process that is ending waits for a recording thread or a write in progress.
_END_NOW_SECONDS: Final[float] = 1.0


class Tracer:
    """Collects the events of a trace; thread-safe. Obtain it with
    :func:`roundpipe.timeline.tracing.active_tracer`.

    With a path, the events are streamed to the file as the run goes (a writer thread, every
    ``FLUSH_SECONDS`` or ``FLUSH_EVENTS`` events), so memory stays bounded and the file is a
    valid trace at any time (see :mod:`roundpipe.timeline.file`). Without one, they stay in memory
    until :meth:`close`.

    ``error`` is the ``OSError`` that stopped the file from being written (None while fine):
    nothing more is recorded after it.
    """

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.origin_ns = time.perf_counter_ns()
        self.error: OSError | None = None
        self._lock = threading.Lock()
        self._spans: list[_Span] = []  # with a file: only those not written yet
        self._pending: collections.deque[_Pending] = collections.deque()
        self._lane_free: dict[tuple[int | None, str], int] = {}
        self._cuda: _CudaClock | None = None
        self._finished = False
        self._result: Trace | None = None
        self._file: TraceFile | None = None
        # Held while a batch is taken and written, so that batches reach the file in order.
        self._writing = threading.Lock()
        self._named_lanes: set[tuple[int | None, str]] = set()
        self._named_processes: set[int] = set()
        self._waiting = threading.Event()  # events (or copies in flight) wait to be written
        self._due = threading.Event()  # FLUSH_EVENTS wait, or the trace ends
        if self.path is None:
            return
        try:
            self._file = TraceFile(self.path, {"producer": "roundpipe", "kind": "measured"})
        except OSError as error:
            self.error = error
            self._finished = True
            return
        threading.Thread(
            target=self._write_continually, name="roundpipe-trace-writer", daemon=True
        ).start()

    # -- the runtime's API -------------------------------------------------------------------

    def mark(self, device: int | None = None) -> Mark:
        """Now, on ``device``'s clock: the host clock for host threads (``None``) and virtual
        CPU devices, an event on the current stream of a CUDA device."""
        if device is not None and self._on_cuda():
            return self._cuda_clock().mark(device)
        if self._pending:  # copies in flight: observe their completion as often as we can
            with self._lock:
                self._resolve_locked(final=False)
        return time.perf_counter_ns()

    def record(
        self,
        phase: Phase,
        *,
        model: str,
        device: int | None,
        lane: str,
        start: Mark,
        end: Mark,
        stage: int | None = None,
        layers: range | None = None,
        microbatch: int | None = None,
        **args: Any,
    ) -> None:
        """Add the span ``[start, end)`` (marks from :meth:`mark` of the same device)."""
        _check_lane(phase, lane, device)
        fields = (model, stage, layers, microbatch)
        with self._lock:
            if self._finished:
                return
            if isinstance(start, int) and isinstance(end, int):
                self._spans.append((phase, lane, device, start, end, fields, args))
            else:
                self._pending.append(_Pending(phase, lane, device, start, end, fields, args))
            self._resolve_locked(final=False)
            overflowing = self._note_waiting_locked()
        if overflowing:
            self._write_waiting()

    def record_transfer(
        self,
        phase: Phase,
        *,
        model: str,
        device: int | None,
        lane: str,
        done: Any,
        stage: int | None = None,
        layers: range | None = None,
        microbatch: int | None = None,
        **args: Any,
    ) -> None:
        """Add a copy issued just now on a copy-engine ``lane`` (or the host's ``writer``) whose
        completion is the native event ``done`` (the module docstring says how its start and end
        are found)."""
        _check_lane(phase, lane, device)
        issued = time.perf_counter_ns()
        fields = (model, stage, layers, microbatch)
        end: Mark = None
        if device is not None and self._on_cuda():
            end = self._cuda_clock().after(device, done)
        with self._lock:
            if self._finished:
                return
            self._pending.append(_Pending(phase, lane, device, issued, end, fields, args, done))
            self._resolve_locked(final=False)
            overflowing = self._note_waiting_locked()
        if overflowing:
            self._write_waiting()

    # -- closing -----------------------------------------------------------------------------

    def close(self, wait: bool = True) -> Trace:
        """Stop recording, resolve what is left and finish the file (if a path was given);
        returns the trace (read back from the file then). Later calls return the same trace.

        ``wait=False`` (at interpreter exit) only takes device events that already completed;
        spans still in flight are left out rather than risking a wait on a stopping runtime.

        Raises:
            OSError: the file could not be written (``error``).
        """
        self.finish(wait, cut_short=None)
        if self.error is not None:
            raise self.error
        if self._result is None:
            assert self.path is not None  # a trace in memory has its result once finished
            self._result = Trace.load(self.path)
        return self._result

    def finish(self, wait: bool, cut_short: str | None) -> None:
        """Stop recording and write what is left, the file's tail saying ``cut_short`` (None: a
        whole recording); a write error goes to ``error``. Later calls do nothing."""
        with self._lock:
            if self._finished:
                return
            self._finished = True
            self._resolve_locked(final=wait)
            spans, self._spans = self._spans, []
        if self._file is None:
            self._result = Trace([self._event(*span) for span in spans], kind="measured")
            return
        self._waiting.set()
        self._due.set()  # the writer thread ends
        with self._writing:
            if self._append(spans):
                try:
                    self._file.finish(cut_short)
                except OSError as error:
                    self.error = error

    def end_now(self, cut_short: str) -> None:
        """:meth:`finish` for a process that is about to end: what is recorded (device work in
        flight left out) is written without waiting more than about a second for a thread that
        records or writes."""
        if self._file is None:
            return  # a trace in memory dies with the process
        if not self._lock.acquire(timeout=_END_NOW_SECONDS):
            return  # the file keeps what was written, marked unfinished
        try:
            if self._finished:
                return
            self._finished = True
            self._resolve_locked(final=False)
            spans, self._spans = self._spans, []
        finally:
            self._lock.release()
        if not self._writing.acquire(timeout=_END_NOW_SECONDS):
            return
        try:
            if self._append(spans):
                with contextlib.suppress(OSError):  # nobody is left to tell
                    self._file.finish(cut_short)
        finally:
            self._writing.release()

    def abandon(self) -> None:
        """In a forked child: stop recording without writing (the file is the parent's); the
        locks may have been held by parent threads the child does not have."""
        self._lock, self._writing = threading.Lock(), threading.Lock()
        self._finished = True
        self._spans.clear()
        self._pending.clear()
        if self._file is not None:
            self._file.close_unfinished()

    # -- writing -----------------------------------------------------------------------------

    def _note_waiting_locked(self) -> bool:
        """Wake the writer thread for what waits; True if the caller must write it (too much)."""
        if self._file is None:
            return False
        if (self._spans or self._pending) and not self._waiting.is_set():
            self._waiting.set()
        if len(self._spans) >= FLUSH_EVENTS and not self._due.is_set():
            self._due.set()
        return len(self._spans) >= _MAX_WAITING

    def _write_continually(self) -> None:
        """The writer thread: what waits goes to the file at most ``FLUSH_SECONDS`` later."""
        while True:
            self._waiting.wait()
            self._due.wait(FLUSH_SECONDS)
            if self._finished:
                return
            self._waiting.clear()
            self._due.clear()
            self._write_waiting()
            if self._pending:  # keep observing the copies in flight
                self._waiting.set()

    def _write_waiting(self) -> None:
        with self._writing:
            with self._lock:
                if self._finished or self.error is not None:
                    return
                self._resolve_locked(final=False)
                spans, self._spans = self._spans, []
            self._append(spans)

    def _append(self, spans: list[_Span]) -> bool:
        """Write ``spans`` to the file, ``FLUSH_EVENTS`` at a time (the JSON of one batch at a
        time is in memory). A write error goes to ``error``, ends the recording and closes the
        file (keeping what it had); False then."""
        assert self._file is not None
        try:
            for first in range(0, len(spans), FLUSH_EVENTS):
                self._file.append(self._chrome(spans[first : first + FLUSH_EVENTS]))
        except OSError as error:
            with self._lock:
                self.error, self._finished = error, True
            self._file.close_unfinished()
            return False
        return True

    def _chrome(self, spans: list[_Span]) -> list[dict[str, Any]]:
        """The Chrome events of ``spans``, after the names of lanes not named in the file yet."""
        lanes = {(device, lane) for _, lane, device, *_ in spans} - self._named_lanes
        self._named_lanes |= lanes
        origin = self.origin_ns
        return lane_names(lanes, self._named_processes) + [
            chrome_event(
                phase, lane, device, (start - origin) / 1e3, max(0, end - start) / 1e3, fields, args
            )
            for phase, lane, device, start, end, fields, args in spans
        ]

    # -- internals ---------------------------------------------------------------------------

    def _on_cuda(self) -> bool:
        return _C.device_kind() == "cuda"

    def _cuda_clock(self) -> _CudaClock:
        with self._lock:
            if self._cuda is None:
                self._cuda = _CudaClock()
            return self._cuda

    def _event(
        self,
        phase: str,
        lane: str,
        device: int | None,
        start_ns: int,
        end_ns: int,
        fields: SpanFields,
        args: dict[str, Any],
    ) -> TraceEvent:
        model, stage, layers, microbatch = fields
        return TraceEvent(
            phase=phase,
            lane=lane,
            device=device,
            start_us=(start_ns - self.origin_ns) / 1e3,
            dur_us=max(0, end_ns - start_ns) / 1e3,
            model=model,
            stage=stage,
            layers=layers,
            microbatch=microbatch,
            args=args,
        )

    def _resolve_locked(self, final: bool) -> None:
        """Turn pending spans whose device events completed into events, oldest first; with
        ``final``, wait for the rest."""
        if not self._pending:
            return
        still: collections.deque[_Pending] = collections.deque()
        now = time.perf_counter_ns()
        while self._pending:
            pending = self._pending.popleft()
            times = self._times(pending, now, final)
            if times is None:
                still.append(pending)
                if pending.done is None and not final:
                    # CUDA events complete in stream order: later ones are not ready either.
                    still.extend(self._pending)
                    self._pending.clear()
                continue
            start, end = times
            if pending.done is not None:  # copies on a lane run one after the other
                lane = (pending.device, pending.lane)
                start = max(start, self._lane_free.get(lane, start))
                self._lane_free[lane] = end
            self._spans.append(
                (
                    pending.phase,
                    pending.lane,
                    pending.device,
                    start,
                    end,
                    pending.fields,
                    pending.args,
                )
            )
        self._pending = still

    def _times(self, pending: _Pending, now: int, final: bool) -> tuple[int, int] | None:
        if pending.done is not None and pending.end is None:  # a copy on a CPU device
            if not pending.done.query():
                if not final:
                    return None
                pending.done.synchronize()
                now = time.perf_counter_ns()
            return pending.start, now
        clock = self._cuda
        assert clock is not None
        start, end = pending.start, pending.end
        if not clock.ready(end, final):
            return None
        start_ns = start if isinstance(start, int) else clock.host_ns(pending.device, start)
        return start_ns, clock.host_ns(pending.device, end)


class StageTrace:
    """The events of one stage on one device, sharing model, stage index, layers and device:
    what the pipeline holds while a trace is recorded (see
    :func:`roundpipe.timeline.tracing.stage_trace`)."""

    def __init__(self, tracer: Tracer, model: str, device: int, stage: int, layers: range) -> None:
        self.tracer, self.model, self.device = tracer, model, device
        self.stage, self.layers = stage, layers

    def mark(self) -> Mark:
        """Now, on this stage's device."""
        return self.tracer.mark(self.device)

    def span(
        self,
        phase: Phase,
        start: Mark,
        microbatch: int | None = None,
        layers: range | None = None,
        lane: str = "compute",
    ) -> None:
        """Record ``phase`` from ``start`` until now (``layers`` default to the stage's)."""
        self.tracer.record(
            phase,
            model=self.model,
            device=self.device,
            lane=lane,
            start=start,
            end=self.mark(),
            stage=self.stage,
            layers=self.layers if layers is None else layers,
            microbatch=microbatch,
        )

    def transfer(self, phase: Phase, lane: str, done: Any, microbatch: int | None = None) -> None:
        """Record a copy of this stage issued just now that completes with ``done``."""
        self.tracer.record_transfer(
            phase,
            model=self.model,
            device=self.device,
            lane=lane,
            done=done,
            stage=self.stage,
            layers=self.layers,
            microbatch=microbatch,
        )


def _check_lane(phase: str, lane: str, device: int | None) -> None:
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    lanes = HOST_LANES if device is None else DEVICE_LANES
    if lane not in lanes:
        where = "host" if device is None else "device"
        raise ValueError(f"lane of a {where} event must be one of {lanes}, got {lane!r}")


class _CudaClock:
    """CUDA event marks converted to host time (see the module docstring). Untested without a GPU:
    kept to the few torch.cuda calls it needs."""

    def __init__(self) -> None:
        import torch

        self._torch: Any = torch  # torch.cuda's constructors are unannotated
        self._references: dict[int, tuple[Mark, int]] = {}
        self._side_streams: dict[int, Any] = {}
        self._lock = threading.Lock()  # first use of a device may come from several threads

    def mark(self, device: int) -> Mark:
        self._reference(device)
        event = self._torch.cuda.Event(enable_timing=True)
        event.record(self._torch.cuda.current_stream(_C.device_physical_index(device)))
        return event

    def after(self, device: int, done: Any) -> Mark:
        """An event that completes right after the native event ``done``, on an idle side stream."""
        self._reference(device)
        with self._lock:
            stream = self._side_streams.get(device)
            if stream is None:
                gpu = _C.device_physical_index(device)  # logical devices share their GPU
                stream = self._side_streams[device] = self._torch.cuda.Stream(gpu)
        event = self._torch.cuda.Event(enable_timing=True)
        with self._torch.cuda.stream(stream):
            done.block_current_stream(device)
            event.record(stream)
        return event

    def ready(self, event: Mark, final: bool) -> bool:
        if final:
            event.synchronize()
            return True
        return bool(event.query())

    def host_ns(self, device: int | None, event: Mark) -> int:
        assert device is not None
        reference, reference_ns = self._references[device]
        return reference_ns + round(float(reference.elapsed_time(event)) * 1e6)

    def _reference(self, device: int) -> None:
        if device in self._references:
            return
        with self._lock:
            if device in self._references:
                return
            # On a fresh stream the reference event fires at once, so its host time is now.
            stream = self._torch.cuda.Stream(_C.device_physical_index(device))
            event = self._torch.cuda.Event(enable_timing=True)
            event.record(stream)
            event.synchronize()
            self._references[device] = (event, time.perf_counter_ns())


__all__ = ["FLUSH_EVENTS", "FLUSH_SECONDS", "Mark", "StageTrace", "Tracer"]
