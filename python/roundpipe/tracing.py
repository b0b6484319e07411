"""Timeline traces of pipelined runs (Chrome trace event format) and the planner's prediction.

Recording::

    with roundpipe.trace("run.json"):
        model.forward_backward(...)

or ``ROUNDPIPE_TRACE=run.json python train.py`` for an unchanged script (the variable is read at
the first traced event and the file is written when the process exits). The file opens in
Perfetto (ui.perfetto.dev), ``chrome://tracing`` and ``python -m roundpipe.plot run.json``.

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
import json
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Final, Literal, Protocol, cast, get_args

from roundpipe._native import _C

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
    """A timeline: measured (from :func:`trace`) or predicted (from :func:`predict_trace`)."""

    def __init__(self, events: Sequence[TraceEvent], kind: str = "measured") -> None:
        self.events: list[TraceEvent] = sorted(events, key=lambda e: (e.start_us, e.end_us))
        self.kind = kind

    def __repr__(self) -> str:
        return f"Trace(kind={self.kind!r}, events={len(self.events)}, devices={self.devices})"

    @property
    def devices(self) -> list[int]:
        """Indices of the devices that have events."""
        return sorted({e.device for e in self.events if e.device is not None})

    def to_chrome(self) -> dict[str, Any]:
        """The trace as a Chrome trace event format object (``json.dump`` it)."""
        out: list[dict[str, Any]] = []
        lanes = sorted({(e.device, e.lane) for e in self.events}, key=_lane_order)
        for device in sorted({d for d, _ in lanes}, key=lambda d: HOST_PID if d is None else d):
            pid = _pid(device)
            label = "host" if device is None else f"device {device}"
            out.append(_meta("process_name", pid, 0, {"name": label}))
            out.append(_meta("process_sort_index", pid, 0, {"sort_index": pid}))
        for device, lane in lanes:
            pid, tid = _pid(device), _tid(device, lane)
            out.append(_meta("thread_name", pid, tid, {"name": lane}))
            out.append(_meta("thread_sort_index", pid, tid, {"sort_index": tid}))
        for e in self.events:
            args: dict[str, Any] = {"model": e.model}
            if e.stage is not None:
                args["stage"] = e.stage
            if e.layers is not None:
                args["layers"] = [e.layers.start, e.layers.stop - 1]
            if e.microbatch is not None:
                args["microbatch"] = e.microbatch
            args.update(e.args)
            out.append(
                {
                    "name": e.name,
                    "cat": e.phase,
                    "ph": "X",
                    "ts": round(e.start_us, 3),
                    "dur": round(e.dur_us, 3),
                    "pid": _pid(e.device),
                    "tid": _tid(e.device, e.lane),
                    "args": args,
                }
            )
        return {
            "traceEvents": out,
            "displayTimeUnit": "ms",
            "otherData": {"producer": "roundpipe", "kind": self.kind},
        }

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace JSON to ``path`` (replacing it atomically)."""
        path = os.fspath(path)
        temporary = f"{path}.tmp{os.getpid()}"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(self.to_chrome(), file)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Trace:
        """Read a trace written by :meth:`save` (other producers' events are skipped).

        Raises:
            ValueError: the file is not JSON, or not a Chrome trace (no ``traceEvents`` list).
        """
        with open(path, encoding="utf-8") as file:
            try:
                data = json.load(file)
            except (json.JSONDecodeError, UnicodeDecodeError) as error:
                raise ValueError(f"{os.fspath(path)} is not a JSON trace: {error}") from error
        if isinstance(data, list):  # the bare-array variant of the format
            data = {"traceEvents": data}
        if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
            raise ValueError(f"{os.fspath(path)} is not a Chrome trace: no 'traceEvents' list")
        raw = data["traceEvents"]
        processes = {
            e["pid"]: e["args"]["name"]
            for e in raw
            if e.get("ph") == "M" and e.get("name") == "process_name"
        }
        threads = {
            (e["pid"], e["tid"]): e["args"]["name"]
            for e in raw
            if e.get("ph") == "M" and e.get("name") == "thread_name"
        }
        events = []
        for e in raw:
            if e.get("ph") != "X" or e.get("cat") not in PHASES:
                continue
            process = processes.get(e["pid"], "")
            match = re.fullmatch(r"device (\d+)", process)
            if match is None and process != "host":
                continue
            args = dict(e.get("args", {}))
            first_last = args.pop("layers", None)
            events.append(
                TraceEvent(
                    phase=e["cat"],
                    lane=threads.get((e["pid"], e["tid"]), str(e["tid"])),
                    device=int(match.group(1)) if match else None,
                    start_us=float(e["ts"]),
                    dur_us=float(e.get("dur", 0.0)),
                    model=str(args.pop("model", "")),
                    stage=args.pop("stage", None),
                    layers=range(first_last[0], first_last[1] + 1) if first_last else None,
                    microbatch=args.pop("microbatch", None),
                    args=args,
                )
            )
        kind = data.get("otherData", {}).get("kind", "measured")
        return cls(events, kind=str(kind))

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
#: while recording (cheap) and turned into TraceEvents when the trace closes.
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


class Tracer:
    """Collects the events of a trace; thread-safe. Obtain it with :func:`active_tracer`."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self.path = None if path is None else os.fspath(path)
        self.origin_ns = time.perf_counter_ns()
        self._lock = threading.Lock()
        self._spans: list[_Span] = []
        self._pending: collections.deque[_Pending] = collections.deque()
        self._lane_free: dict[tuple[int | None, str], int] = {}
        self._cuda: _CudaClock | None = None
        self._result: Trace | None = None

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
            if isinstance(start, int) and isinstance(end, int):
                self._spans.append((phase, lane, device, start, end, fields, args))
            else:
                self._pending.append(_Pending(phase, lane, device, start, end, fields, args))
            self._resolve_locked(final=False)

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
            self._pending.append(_Pending(phase, lane, device, issued, end, fields, args, done))
            self._resolve_locked(final=False)

    # -- closing -----------------------------------------------------------------------------

    def close(self, wait: bool = True) -> Trace:
        """Stop recording, resolve what is left and write the file (if a path was given); returns
        the trace. Later calls return the same trace and write nothing.

        ``wait=False`` (at interpreter exit) only takes device events that already completed;
        spans still in flight are left out rather than risking a wait on a stopping runtime.
        """
        with self._lock:
            if self._result is not None:
                return self._result
            self._resolve_locked(final=wait)
            self._result = Trace([self._event(*span) for span in self._spans], kind="measured")
        if self.path is not None:
            self._result.save(self.path)
        return self._result

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


def active_tracer() -> Tracer | None:
    """The tracer recording now, or None: the runtime checks this before recording anything.

    The first call reads ``ROUNDPIPE_TRACE``; when it names a file, the whole process is traced to
    it and the file is written at exit.
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
    _active = _environment_tracer = None if path is None else Tracer(path)


_environment_tracer: Tracer | None = None


@atexit.register
def _write_environment_trace() -> None:
    """Write the ``ROUNDPIPE_TRACE`` file at exit. Registered when this module is imported, that
    is before the step pipeline registers its drain of the native workers, so it runs after that
    drain (exit handlers run last-registered first) and sees the last optimizer steps."""
    if _environment_tracer is not None:
        _environment_tracer.close(wait=False)


@contextmanager
def trace(path: str | os.PathLike[str] | None = None) -> Iterator[Tracer]:
    """Record a timeline of every RoundPipe call made inside the block.

    Args:
        path: where the Chrome trace JSON is written when the block ends (also when it raises);
            None keeps it in memory only.

    Yields:
        The :class:`Tracer`; after the block, its ``close()`` returns the finished :class:`Trace`.

    Raises:
        TypeError: ``path`` is not a path or None.
        RuntimeError: a trace is already being recorded (a nested block, or ``ROUNDPIPE_TRACE``).
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
    try:
        yield tracer
    finally:
        with _activation_lock:
            _active = None
        tracer.close()


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
    "predict_trace",
    "range_name",
    "stage_trace",
    "trace",
]
