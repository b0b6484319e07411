"""Timeline traces of pipelined runs (Chrome trace event format) and the planner's prediction.

Recording::

    with roundpipe.trace("run.json"):
        model.forward_backward(...)

or ``ROUNDPIPE_TRACE=run.json python train.py`` for an unchanged script (the variable is read at
the first traced event; the trace ends when the process does). The file is written as the run
goes and is a whole trace at any time, marked cut short (``otherData.cut_short``) until the
recording ends normally (:class:`Tracer`, :mod:`roundpipe.trace_file`). It opens in Perfetto
(ui.perfetto.dev), ``chrome://tracing`` and ``python -m roundpipe.plot run.json``.

Layout of a trace: one process per device (``device 0``, ``device 1``, ...) with the lanes
``compute``, ``parameter upload``, ``gradient download`` and ``activation``, and one ``host``
process with the threads ``main``, ``optimizer`` and ``writer``. Every event is a complete event
(``ph: "X"``, microseconds since the trace started) named like the NVTX ranges,
``roundpipe/<model>/<phase>/L<first>-<last>/mb<m>``; ``cat`` is the phase and ``args`` hold the
model, stage, layer range and microbatch.

Clocks: the host clock (``time.perf_counter_ns``) for host threads and virtual CPU devices. On
CUDA, compute spans are closed by CUDA events on the device's current stream and converted to host
time against a reference event recorded when the device is first seen; they are resolved in the
order they were recorded, whenever a later event finds them complete, and the rest when the trace
closes, so recording never waits for the device. Copies run on the native copy engines: a copy's
span starts when it was issued (or when the lane's previous copy ended, if later) and ends when its
completion is observed (CPU devices: at the next traced event that finds it complete; CUDA: by an
event a side stream records right after it), so a copy's end is an upper bound, accurate to about
one event.

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

import atexit
import collections
import contextlib
import json
import math
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, TypeVar, cast, get_args

from roundpipe._native import _C
from roundpipe.trace_file import TraceFile, TraceFileBusy

Phase = Literal[
    "forward",
    "recompute",
    "backward",
    "fused",
    "upload",
    "grad_download",
    "grad_reduce",
    "activation",
    "optimizer_step",
    "writeback",
    "wait",
]
PHASES: Final[tuple[str, ...]] = get_args(Phase)
#: Phases that keep a device busy computing (what busy % counts).
COMPUTE_PHASES: Final[frozenset[str]] = frozenset({"forward", "recompute", "backward", "fused"})
#: Host-side optimizer work that an asynchronous step hides behind the next iteration.
OPTIMIZER_PHASES: Final[frozenset[str]] = frozenset({"optimizer_step", "writeback"})
#: Lanes (Chrome trace threads) of each device process, in display order; tid = position.
DEVICE_LANES: Final[tuple[str, ...]] = (
    "compute",
    "parameter upload",
    "gradient download",
    "activation",
)
#: Threads of the host process, in display order; tid = position.
HOST_LANES: Final[tuple[str, ...]] = ("main", "optimizer", "writer")
#: pid of the host process (devices use their index).
HOST_PID: Final[int] = 1 << 16
#: Environment variable naming the file a whole process is traced to.
ENV_VAR: Final[str] = "ROUNDPIPE_TRACE"

#: A timestamp: host ``perf_counter_ns``, or a CUDA event recorded on a device stream.
Mark = Any
_T = TypeVar("_T")


def range_name(
    model: str, phase: str, layers: range | None = None, microbatch: int | None = None
) -> str:
    """The event (and NVTX range) name: ``roundpipe/<model>/<phase>[/L<first>-<last>][/mb<m>]``."""
    name = f"roundpipe/{model}/{phase}"
    if layers is not None and len(layers) > 0:
        name += f"/L{layers.start}-{layers.stop - 1}"
    if microbatch is not None:
        name += f"/mb{microbatch}"
    return name


@dataclass(frozen=True)
class TraceEvent:
    """One span of a timeline. ``device`` is None for host threads; times in microseconds."""

    phase: str
    lane: str
    device: int | None
    start_us: float
    dur_us: float
    model: str = ""
    stage: int | None = None
    layers: range | None = None
    microbatch: int | None = None
    args: Mapping[str, Any] = field(default_factory=dict)

    @property
    def end_us(self) -> float:
        return self.start_us + self.dur_us

    @property
    def name(self) -> str:
        return range_name(self.model, self.phase, self.layers, self.microbatch)


@dataclass(frozen=True)
class TraceSummary:
    """What :meth:`Trace.summary` reports; fractions are in [0, 1].

    ``busy``/``bubble``: per device, the share of the trace's window (first to last event) its
    compute lane spends computing / not computing. ``upload_hidden``: the share of parameter
    upload time that overlaps compute on the same device (None without uploads).
    ``optimizer_hidden``: the share of host optimizer time (step and write-back) that overlaps
    compute on any device, i.e. hidden behind the next iteration (None without optimizer work).
    """

    window_us: float
    busy: dict[int, float]
    bubble: dict[int, float]
    upload_hidden: float | None
    optimizer_hidden: float | None

    def lines(self) -> list[str]:
        """The summary as short text lines (what the plot prints beside the chart)."""
        out = [f"window {self.window_us / 1e3:.3f} ms"]
        for d in sorted(self.busy):
            out.append(f"device {d}: busy {self.busy[d]:.0%}, bubble {self.bubble[d]:.0%}")
        if self.upload_hidden is not None:
            out.append(f"upload hidden behind compute: {self.upload_hidden:.0%}")
        if self.optimizer_hidden is not None:
            out.append(f"optimizer hidden behind next iteration: {self.optimizer_hidden:.0%}")
        return out


class Trace:
    """A timeline: measured (from :func:`trace`) or predicted (from :func:`predict_trace`).

    ``cut_short`` is None for a whole recording, else why it ended early (the process ended
    while recording, or left without waiting for the work still in flight).
    """

    def __init__(
        self, events: Sequence[TraceEvent], kind: str = "measured", cut_short: str | None = None
    ) -> None:
        self.events: list[TraceEvent] = sorted(events, key=lambda e: (e.start_us, e.end_us))
        self.kind = kind
        self.cut_short = cut_short

    def __repr__(self) -> str:
        cut = "" if self.cut_short is None else ", cut short"
        return f"Trace(kind={self.kind!r}, events={len(self.events)}, devices={self.devices}{cut})"

    @property
    def devices(self) -> list[int]:
        """Indices of the devices that have events."""
        return sorted({e.device for e in self.events if e.device is not None})

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace event format object (``json.dump`` it)."""
        lanes = {(e.device, e.lane) for e in self.events}
        other: dict[str, Any] = {"producer": "roundpipe", "kind": self.kind}
        if self.cut_short is not None:
            other["cut_short"] = self.cut_short
        return {
            "traceEvents": _lane_names(lanes, set())
            + [
                _chrome_event(
                    e.phase,
                    e.lane,
                    e.device,
                    e.start_us,
                    e.dur_us,
                    (e.model, e.stage, e.layers, e.microbatch),
                    e.args,
                )
                for e in self.events
            ],
            "displayTimeUnit": "ms",
            "otherData": other,
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace JSON to ``path`` (replacing it atomically; nothing is left
        beside it when that fails)."""
        path = os.fspath(path)
        temporary = f"{path}.tmp{os.getpid()}"
        try:
            with open(temporary, "w", encoding="utf-8") as file:
                json.dump(self.to_chrome(), file)
            os.replace(temporary, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temporary)
            raise

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save` or a recording (other producers' events are
        skipped).

        Raises:
            OSError: the file cannot be read.
            ValueError: the file is not JSON, not a Chrome trace (no ``traceEvents`` list), or
                holds a malformed event (the message names it).
        """
        where = os.fspath(path)
        with open(path, encoding="utf-8") as file:
            try:
                data = json.load(file)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as error:
                raise ValueError(f"{where} is not a JSON trace: {error}") from error
        if isinstance(data, list):  # the bare-array variant of the format
            data = {"traceEvents": data}
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise ValueError(f"{where} is not a Chrome trace: no 'traceEvents' list")
        other = data.get("otherData")
        other = other if isinstance(other, dict) else {}
        cut_short = other.get("cut_short")
        return cls(
            _read_events(data["traceEvents"], where),
            kind=str(other.get("kind", "measured")),
            cut_short=None if cut_short is None else str(cut_short),
        )

    def summary(self) -> TraceSummary:
        """Busy and bubble shares per device, and how much upload and optimizer time is hidden."""
        if not self.events:
            return TraceSummary(0.0, {}, {}, None, None)
        begin = min(e.start_us for e in self.events)
        window = max(e.end_us for e in self.events) - begin
        compute = {
            d: _union(
                (e.start_us, e.end_us)
                for e in self.events
                if e.device == d and e.phase in COMPUTE_PHASES
            )
            for d in self.devices
        }
        busy = {d: (_length(spans) / window if window > 0 else 0.0) for d, spans in compute.items()}
        uploads = [e for e in self.events if e.phase == "upload" and e.device is not None]
        upload_hidden = _hidden(
            [(e.start_us, e.end_us, compute[e.device]) for e in uploads]  # type: ignore[index]
        )
        everywhere = _union(s for spans in compute.values() for s in spans)
        optimizer = [e for e in self.events if e.phase in OPTIMIZER_PHASES]
        optimizer_hidden = _hidden([(e.start_us, e.end_us, everywhere) for e in optimizer])
        return TraceSummary(
            window_us=window,
            busy=busy,
            bubble={d: 1.0 - b for d, b in busy.items()},
            upload_hidden=upload_hidden,
            optimizer_hidden=optimizer_hidden,
        )


def _pid(device: int | None) -> int:
    return HOST_PID if device is None else device


def _tid(device: int | None, lane: str) -> int:
    lanes = HOST_LANES if device is None else DEVICE_LANES
    return lanes.index(lane) if lane in lanes else len(lanes)


def _lane_order(key: tuple[int | None, str]) -> tuple[int, int]:
    device, lane = key
    return (_pid(device), _tid(device, lane))


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}


def _lane_names(lanes: Iterable[tuple[int | None, str]], named: set[int]) -> list[dict[str, Any]]:
    """The metadata events naming ``lanes``, each preceded by its process's unless that is in
    ``named`` (which gains the processes named here)."""
    out: list[dict[str, Any]] = []
    for device, lane in sorted(lanes, key=_lane_order):
        pid, tid = _pid(device), _tid(device, lane)
        if pid not in named:
            named.add(pid)
            label = "host" if device is None else f"device {device}"
            out.append(_meta("process_name", pid, 0, {"name": label}))
            out.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        out.append(_meta("thread_name", pid, tid, {"name": lane}))
        out.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
    return out


def _chrome_event(
    phase: str,
    lane: str,
    device: int | None,
    start_us: float,
    dur_us: float,
    fields: _Fields,
    extra: Mapping[str, Any],
) -> dict[str, Any]:
    """The complete event of a span (what :class:`TraceEvent` holds, unpacked: the recording
    writes spans without making TraceEvents of them)."""
    model, stage, layers, microbatch = fields
    args: dict[str, Any] = {"model": model}
    if stage is not None:
        args["stage"] = stage
    if layers is not None:
        args["layers"] = [layers.start, layers.stop - 1]
    if microbatch is not None:
        args["microbatch"] = microbatch
    args.update(extra)
    return {
        "name": range_name(model, phase, layers, microbatch),
        "cat": phase,
        "ph": "X",
        "ts": round(start_us, 3),
        "dur": round(dur_us, 3),
        "pid": _pid(device),
        "tid": _tid(device, lane),
        "args": args,
    }


class _Malformed(Exception):
    """What is wrong with one event of a trace being read."""


def _read_events(raw: list[Any], where: str) -> list[TraceEvent]:
    """The events of a ``traceEvents`` list that are RoundPipe's (see :meth:`Trace.load`)."""
    processes: dict[int, str] = {}
    threads: dict[tuple[int, int], str] = {}
    complete: list[tuple[int, dict[str, Any]]] = []
    for index, e in enumerate(raw):
        try:
            if not isinstance(e, dict):
                raise _Malformed(f"is {e!r}, not an event object")
            if e.get("ph") == "M" and e.get("name") == "process_name":
                processes[_get(e, "pid", int)] = _label(e)
            elif e.get("ph") == "M" and e.get("name") == "thread_name":
                threads[_get(e, "pid", int), _get(e, "tid", int)] = _label(e)
            elif e.get("ph") == "X" and e.get("cat") in PHASES:
                complete.append((index, e))
        except _Malformed as problem:
            raise ValueError(f"{where}: traceEvents[{index}] {problem}") from None
    events = []
    for index, e in complete:
        try:
            event = _read_event(e, processes, threads)
        except _Malformed as problem:
            raise ValueError(f"{where}: traceEvents[{index}] {problem}") from None
        if event is not None:
            events.append(event)
    return events


def _read_event(
    e: dict[str, Any], processes: dict[int, str], threads: dict[tuple[int, int], str]
) -> TraceEvent | None:
    """A complete event of one of RoundPipe's phases; None if its process is not RoundPipe's."""
    pid, tid = _get(e, "pid", int), _get(e, "tid", int)
    process = processes.get(pid, "")
    match = re.fullmatch(r"device (\d+)", process)
    if match is None and process != "host":
        return None
    device = int(match.group(1)) if match else None
    lanes = HOST_LANES if device is None else DEVICE_LANES
    # Without a thread name, the lane is the one our format puts at that tid.
    lane = threads.get((pid, tid)) or (lanes[tid] if 0 <= tid < len(lanes) else f"thread {tid}")
    args = dict(_get(e, "args", dict, {}))
    first_last = args.pop("layers", None)
    if first_last is not None and not (
        isinstance(first_last, list)
        and len(first_last) == 2
        and all(_is_int(i) for i in first_last)
        and first_last[0] <= first_last[1]
    ):
        raise _Malformed(
            f"({_describe(e)}) has args.layers {first_last!r}, not [first, last] layer indices"
        )
    stage, microbatch = args.pop("stage", None), args.pop("microbatch", None)
    for name, value in (("stage", stage), ("microbatch", microbatch)):
        if value is not None and not _is_int(value):
            raise _Malformed(f"({_describe(e)}) has args.{name} {value!r}, not an int")
    start, duration = _get(e, "ts", float), _get(e, "dur", float, 0.0)
    if duration < 0:
        raise _Malformed(f"({_describe(e)}) has a negative dur {duration!r}")
    return TraceEvent(
        phase=e["cat"],
        lane=lane,
        device=device,
        start_us=start,
        dur_us=duration,
        model=str(args.pop("model", "")),
        stage=stage,
        layers=range(first_last[0], first_last[1] + 1) if first_last else None,
        microbatch=microbatch,
        args=args,
    )


def _label(e: dict[str, Any]) -> str:
    """The name a process_name or thread_name event gives."""
    name = _get(e, "args", dict).get("name")
    if not isinstance(name, str):
        raise _Malformed(f"({_describe(e)}) has args.name {name!r}, not a string")
    return name


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_MISSING: Final = object()


def _get(e: dict[str, Any], key: str, kind: type[_T], default: Any = _MISSING) -> _T:
    """``e[key]`` checked to be a ``kind`` (a float: any finite number)."""
    value = e.get(key, default)
    if value is _MISSING:
        raise _Malformed(f"({_describe(e)}) has no {key!r}")
    if kind is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        ok = ok and math.isfinite(value)
    else:
        ok = _is_int(value) if kind is int else isinstance(value, kind)
    if not ok:
        raise _Malformed(f"({_describe(e)}) has {key} {value!r}, not {_KIND_NAMES[kind]}")
    return cast("_T", float(value) if kind is float else value)


_KIND_NAMES: Final[dict[type, str]] = {
    int: "an int",
    float: "a finite number",
    str: "a string",
    dict: "an object",
}


def _describe(e: dict[str, Any]) -> str:
    return f"ph {e.get('ph')!r}, name {e.get('name')!r}"


def _union(
    spans: Iterator[tuple[float, float]] | Sequence[tuple[float, float]],
) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering ``spans``."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _length(spans: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in spans)


def _hidden(items: Sequence[tuple[float, float, list[tuple[float, float]]]]) -> float | None:
    """Share of the total length of ``(start, end, cover)`` items that lies inside ``cover``."""
    total = sum(end - start for start, end, _ in items)
    if not items or total <= 0:
        return None
    inside = sum(
        max(0.0, min(end, c_end) - max(start, c_start))
        for start, end, cover in items
        for c_start, c_end in cover
    )
    return inside / total


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


#: model, stage, layers, microbatch of a span.
_Fields = tuple[str, int | None, range | None, int | None]
#: A recorded span in host nanoseconds: phase, lane, device, start, end, fields, args. Kept raw
#: while recording (cheap) and turned into TraceEvents when written (or when the trace closes).
_Span = tuple[str, str, int | None, int, int, _Fields, dict[str, Any]]


@dataclass
class _Pending:
    """A span whose end (or start) is still a device event: resolved when it completes."""

    phase: str
    lane: str
    device: int | None
    start: Mark
    end: Mark
    fields: _Fields
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
    """Collects the events of a trace; thread-safe. Obtain it with :func:`active_tracer`.

    With a path, the events are streamed to the file as the run goes (a writer thread, every
    ``FLUSH_SECONDS`` or ``FLUSH_EVENTS`` events), so memory stays bounded and the file is a
    valid trace at any time (see :mod:`roundpipe.trace_file`). Without one, they stay in memory
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
        self._finish(wait, cut_short=None)
        if self.error is not None:
            raise self.error
        if self._result is None:
            assert self.path is not None  # a trace in memory has its result once finished
            self._result = Trace.load(self.path)
        return self._result

    def _finish(self, wait: bool, cut_short: str | None) -> None:
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

    def _end_now(self, cut_short: str) -> None:
        """:meth:`_finish` for a process that is about to end: what is recorded (device work in
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

    def _abandon(self) -> None:
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
        return _lane_names(lanes, self._named_processes) + [
            _chrome_event(
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
        fields: _Fields,
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
    what the pipeline holds while a trace is recorded (see :func:`stage_trace`)."""

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


def stage_trace(model: str, device: int, stage: int, layers: range) -> StageTrace | None:
    """A :class:`StageTrace` when a trace is being recorded, else None."""
    tracer = active_tracer()
    return None if tracer is None else StageTrace(tracer, model, device, stage, layers)


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


# --------------------------------------------------------------------------------------------
# Activation: the context manager and the environment variable
# --------------------------------------------------------------------------------------------

_UNREAD: Final = object()
#: The recording Tracer, None when off, _UNREAD until the environment was read.
_active: Any = _UNREAD
_activation_lock = threading.Lock()
_environment_tracer: Tracer | None = None
#: Signals that end a process at once by default; while a trace is written (from the main
#: thread) they first finish its file.
_ENDING_SIGNALS: Final = (signal.SIGTERM, signal.SIGHUP)


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
        _catch_ending_signals()


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


@atexit.register
def _finish_at_exit() -> None:
    """Finish the trace being recorded (the ``ROUNDPIPE_TRACE`` one, or a block still open) at
    exit, marked cut short after an uncaught exception (Ctrl-C included). Registered when this
    module is imported, that is before the step pipeline registers its drain of the native
    workers, so it runs after that drain (exit handlers run last-registered first) and sees the
    last optimizer steps; when the drain gives up on work still running, the process leaves at
    once and the step pipeline calls :func:`end_trace_now` instead."""
    tracer = _active
    if not isinstance(tracer, Tracer):
        return
    error = getattr(sys, "last_value", None)
    ended_by = None
    if isinstance(error, BaseException):
        ended_by = f"the process ended with an uncaught {type(error).__name__}"
    tracer._finish(wait=False, cut_short=ended_by)
    if tracer.error is not None:
        warnings.warn(f"the trace was not finished: {tracer.error}", RuntimeWarning, stacklevel=1)


def end_trace_now(reason: str) -> None:
    """Finish the file of the trace being recorded, marked cut short for ``reason``, waiting at
    most about a second for threads that record or write: for a process that ends at once
    (``os._exit`` or a signal), which skips the exit handler that would finish it."""
    tracer = _active
    if isinstance(tracer, Tracer):
        tracer._end_now(reason)


def _catch_ending_signals() -> None:
    """Have the ending signals finish the trace file first, where their action is still the
    default and this is the main thread (the only one that may set handlers)."""
    if threading.current_thread() is not threading.main_thread():
        return
    for number in _ENDING_SIGNALS:
        if signal.getsignal(number) == signal.SIG_DFL:
            signal.signal(number, _end_on_signal)


def _release_ending_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for number in _ENDING_SIGNALS:
        if signal.getsignal(number) == _end_on_signal:
            signal.signal(number, signal.SIG_DFL)


def _end_on_signal(number: int, frame: Any) -> None:
    """Finish the trace file, then end the process by the signal's default action, as it would
    have ended without the trace."""
    end_trace_now(f"the process was ended by {signal.Signals(number).name}")
    signal.signal(number, signal.SIG_DFL)
    os.kill(os.getpid(), number)


def _forget_parent_trace() -> None:
    """In a forked child: the parent's trace is the parent's to write, and ``ROUNDPIPE_TRACE``
    traces the parent process only."""
    global _active, _environment_tracer, _activation_lock
    _activation_lock = threading.Lock()
    if isinstance(_active, Tracer):
        _active._abandon()
    _active = _environment_tracer = None
    _release_ending_signals()


os.register_at_fork(after_in_child=_forget_parent_trace)
if os.environ.get(ENV_VAR):
    # Now, on the importing (main) thread: the first traced event may come from another one.
    _catch_ending_signals()


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
        _catch_ending_signals()
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
    _release_ending_signals()
    tracer._finish(wait=True, cut_short=None)
    return tracer.error


# --------------------------------------------------------------------------------------------
# Prediction: the simulator's schedule as a trace
# --------------------------------------------------------------------------------------------


class LayerCosts(Protocol):
    """Per-layer estimates a prediction needs (``roundpipe.scheduler.LayerProfile`` has them)."""

    @property
    def forward_seconds(self) -> Sequence[float]: ...
    @property
    def recompute_seconds(self) -> Sequence[float]: ...
    @property
    def backward_seconds(self) -> Sequence[float]: ...
    @property
    def forward_bytes(self) -> Sequence[int]: ...


def predict_trace(
    calls: Sequence[Sequence[tuple[str, range]]],
    profile: LayerCosts,
    *,
    num_microbatch: int,
    num_devices: int,
    model: str = "model",
    upload_bytes_per_second: float = 0.0,
) -> Trace:
    """The schedule the native simulator predicts; the engine of
    :meth:`roundpipe.ModelExecutePlan.simulate`, which checks the arguments.

    ``calls``: the stages ``(kind, layers)`` of each call in the runtime's order, kind
    ``"forward"``, ``"fused"`` or ``"backward"``; a call starts when the previous one ended, on the
    next device of the round-robin. Stage ``s`` of the first call runs on device
    ``s mod num_devices``. Each (stage, microbatch) run becomes a compute event of the kind the
    runtime records: forward, fused, or a backward stage's recompute followed by its backward,
    split in proportion to their estimates. A call of backward stages only (the backward of a
    ``forward()``) runs the last microbatch first, as the runtime does: all of them are there
    when it starts, so its schedule is the in-order one with the microbatches renamed. Uploads
    and transfers are not predicted (the simulator does not report them), though upload time
    delays compute when ``upload_bytes_per_second > 0``.
    """

    def parts(kind: str, layers: range) -> list[tuple[str, float]]:
        fwd = sum(profile.forward_seconds[i] for i in layers)
        re_ = sum(profile.recompute_seconds[i] for i in layers)
        bwd = sum(profile.backward_seconds[i] for i in layers)
        if kind == "forward":
            return [("forward", fwd)]
        if kind == "fused":
            return [("fused", fwd + bwd)]
        return [("recompute", re_), ("backward", bwd)]

    events: list[TraceEvent] = []
    offset_s, first_device = 0.0, 0
    for steps in calls:
        stage_parts = [parts(kind, layers) for kind, layers in steps]
        seconds = [sum(t for _, t in p) for p in stage_parts]
        uploads = [
            sum(profile.forward_bytes[i] for i in layers) / upload_bytes_per_second
            if upload_bytes_per_second > 0
            else 0.0
            for _, layers in steps
        ]
        makespan, runs = _C.simulate_schedule(seconds, num_devices, num_microbatch, uploads)
        last_first = all(kind == "backward" for kind, _ in steps)
        for stage, run, device, start, end in runs:
            microbatch = num_microbatch - 1 - run if last_first else run
            at = offset_s + start
            total = seconds[stage]
            for phase, share in stage_parts[stage]:
                length = (end - start) * (
                    share / total if total > 0 else 1 / len(stage_parts[stage])
                )
                events.append(
                    TraceEvent(
                        phase=phase,
                        lane="compute",
                        device=(first_device + device) % num_devices,
                        start_us=at * 1e6,
                        dur_us=length * 1e6,
                        model=model,
                        stage=stage,
                        layers=steps[stage][1],
                        microbatch=microbatch,
                    )
                )
                at += length
        offset_s += makespan
        first_device = (first_device + len(steps)) % num_devices
    return Trace(events, kind="predicted")


__all__ = [
    "COMPUTE_PHASES",
    "DEVICE_LANES",
    "ENV_VAR",
    "HOST_LANES",
    "HOST_PID",
    "OPTIMIZER_PHASES",
    "PHASES",
    "LayerCosts",
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
