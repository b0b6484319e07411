"""A trace's events: the phases and lanes they name, :class:`Trace` (a timeline in memory), its
Chrome trace event format JSON both ways, and its summary (busy, bubble, hidden shares).

Layout of a trace: one process per device (``device 0``, ``device 1``, ...) with the lanes
``compute``, ``parameter upload``, ``gradient download`` and ``activation``, and one ``host``
process with the threads ``main``, ``optimizer`` and ``writer``. Every event is a complete event
(``ph: "X"``, microseconds since the trace started) named like the NVTX ranges,
``roundpipe/<model>/<phase>/L<first>-<last>/mb<m>``; ``cat`` is the phase and ``args`` hold the
model, stage, layer range and microbatch.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal, TypeVar, cast, get_args

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
    "disk_read",
    "disk_write",
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
HOST_LANES: Final[tuple[str, ...]] = ("main", "optimizer", "writer", "disk")
#: pid of the host process (devices use their index).
HOST_PID: Final[int] = 1 << 16

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
    """A timeline: measured (from :func:`roundpipe.trace`) or predicted (from
    :func:`roundpipe.timeline.tracing.predict_trace`).

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
            "traceEvents": lane_names(lanes, set())
            + [
                chrome_event(
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


# --------------------------------------------------------------------------------------------
# The Chrome trace event format: writing
# --------------------------------------------------------------------------------------------

#: model, stage, layers, microbatch of a span.
SpanFields = tuple[str, int | None, range | None, int | None]


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


def lane_names(lanes: Iterable[tuple[int | None, str]], named: set[int]) -> list[dict[str, Any]]:
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


def chrome_event(
    phase: str,
    lane: str,
    device: int | None,
    start_us: float,
    dur_us: float,
    fields: SpanFields,
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


# --------------------------------------------------------------------------------------------
# The Chrome trace event format: reading
# --------------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------------
# Summary: interval arithmetic
# --------------------------------------------------------------------------------------------


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


__all__ = [
    "COMPUTE_PHASES",
    "DEVICE_LANES",
    "HOST_LANES",
    "HOST_PID",
    "OPTIMIZER_PHASES",
    "PHASES",
    "Phase",
    "SpanFields",
    "Trace",
    "TraceEvent",
    "TraceSummary",
    "chrome_event",
    "lane_names",
    "range_name",
]
