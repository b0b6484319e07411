"""Online per-layer timing: the estimates :meth:`ModelExecutePlan.auto` plans with.

The runtime measures every layer's forward (``"fwd"``), recompute (``"re"``) and backward
(``"bwd"``) time of each microbatch: with the host clock on virtual CPU devices, handed over
once per stage with :meth:`ModelTimer.record_layers` and :meth:`ModelTimer.record_spans` (the same
as :meth:`ModelTimer.record` of each in order); the moving averages themselves are native
(``_C.LayerTimings``, csrc/scheduler/timer.h); on GPUs with timing CUDA events on the
compute stream, handed over with :meth:`ModelTimer.record_later` and read once they completed
(never waiting for the GPU) when the timer is next asked for its ``version`` or ``profile``.

Estimates are exponential moving averages with bias correction (as in Adam): after ``t`` records
``x_1..x_t`` the estimate is ``sum(beta**(t-i) * (1-beta) * x_i) / (1 - beta**t)``, so the first
record is taken as is and old records fade with ``SMOOTHING = beta``.

Before a layer has a timing, its parameter bytes stand in: forward time = bytes x the seconds per
byte of the layers already timed (or ``STAND_IN_SECONDS_PER_BYTE`` before any), recompute = the
forward estimate, backward = 2 x the forward estimate. Only relative costs matter to the planner.

``version`` increases when an estimate moves by more than ``CHANGE_THRESHOLD`` (relative) from the
value it had at the last increase, or a layer gets its first timing; the runtime re-plans only
when the version changed. Set ``ModelTimer.VERBOSE = True`` to print every record and the new
estimate to stderr, one ``Layer {i} {action}  new record: {x:.3f} ms  new estimate: {y:.3f} ms``
line per record.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Sequence
from typing import Any, ClassVar, Literal, Protocol

from roundpipe._native import _C
from roundpipe.scheduler import LayerProfile

Action = Literal["fwd", "re", "bwd"]
_ACTIONS: tuple[Action, ...] = ("fwd", "re", "bwd")
_INDEX: dict[Action, int] = {"fwd": 0, "re": 1, "bwd": 2}  # the native table's action numbers


class TimingEvent(Protocol):
    """What :meth:`ModelTimer.record_later` needs of an event (``torch.cuda.Event`` with
    ``enable_timing=True``)."""

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Any, /) -> float: ...


class ModelTimer:
    """Smoothed per-layer, per-action timings of one model. Thread-safe."""

    VERBOSE: ClassVar[bool] = False
    #: Decay of the exponential moving average (weight of the previous estimate).
    SMOOTHING: ClassVar[float] = 0.9
    #: Relative change of an estimate that makes re-planning worthwhile.
    CHANGE_THRESHOLD: ClassVar[float] = 0.05
    #: Forward seconds per parameter byte assumed before any layer has been timed.
    STAND_IN_SECONDS_PER_BYTE: ClassVar[float] = 1e-10
    #: Device timings waiting for their events beyond which record_later folds in the finished
    #: ones (and keeps at most half as many).
    MAX_UNREAD: ClassVar[int] = 4096

    def __init__(self, num_layers: int, layer_bytes: Sequence[int], name: str = "model") -> None:
        """Args:
        num_layers: layers of the model.
        layer_bytes: parameter bytes of each layer (the stand-in before timings).
        name: the model it times (for diagnostics).
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
            raise ValueError(f"num_layers must be a positive int, got {num_layers!r}")
        if len(layer_bytes) != num_layers:
            raise ValueError(
                f"layer_bytes has {len(layer_bytes)} entries for {num_layers} layers; "
                "give one per layer"
            )
        if any(b < 0 for b in layer_bytes):
            raise ValueError("layer_bytes must be non-negative")
        self.name = name
        self._bytes = [float(b) for b in layer_bytes]
        self._lock = threading.Lock()
        # The estimates (native: the runtime folds in every layer x microbatch it timed).
        self._timings = _C.LayerTimings(num_layers, self.SMOOTHING, self.CHANGE_THRESHOLD)
        self._version = 0
        # Device timings not read yet: (layers sharing the time, action, start, end).
        self._unread: list[tuple[range, Action, TimingEvent, TimingEvent]] = []

    @property
    def num_layers(self) -> int:
        return len(self._bytes)

    @property
    def version(self) -> int:
        """Increases only when estimates changed enough to re-plan (see the module docstring)."""
        self.collect()
        with self._lock:
            return self._version

    def record_later(
        self, layers: range, action: Action, start: TimingEvent, end: TimingEvent
    ) -> None:
        """Record the device time from ``start`` to ``end`` (milliseconds, as CUDA events tell
        it), split evenly over ``layers``, once ``end`` has completed (see :meth:`collect`)."""
        if action not in _ACTIONS:
            raise ValueError(f"action must be 'fwd', 're' or 'bwd', got {action!r}")
        if not layers or layers.start < 0 or layers.stop > self.num_layers:
            raise ValueError(f"layers must be a non-empty range within [0, {self.num_layers})")
        with self._lock:
            self._unread.append((layers, action, start, end))
            crowded = len(self._unread) > self.MAX_UNREAD
        if crowded:  # nobody plans by this timer (explicit plans): keep the list short
            self.collect()
            with self._lock:
                # Still crowded: the GPU is far behind; keep the newest timings.
                del self._unread[: len(self._unread) - self.MAX_UNREAD // 2]

    def collect(self) -> None:
        """Record the device timings whose end event has completed; never waits."""
        with self._lock:
            unread, self._unread = self._unread, []
        waiting = []
        for layers, action, start, end in unread:
            if not end.query():
                waiting.append((layers, action, start, end))
                continue
            share = max(start.elapsed_time(end), 0.0) / 1e3 / len(layers)
            for layer in layers:
                self.record(layer, action, share)
        if waiting:
            with self._lock:
                self._unread[:0] = waiting

    def record(self, layer: int, action: Action, seconds: float) -> None:
        """Fold one measured time of ``layer`` doing ``action`` into its estimate."""
        in_range = isinstance(layer, int) and 0 <= layer < self.num_layers
        if isinstance(layer, bool) or not in_range:
            raise ValueError(f"layer must be an int in [0, {self.num_layers}), got {layer!r}")
        if action not in _ACTIONS:
            raise ValueError(f"action must be 'fwd', 're' or 'bwd', got {action!r}")
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"seconds must be a finite non-negative number, got {seconds!r}")
        self._fold(action, [layer], [seconds])

    def record_spans(self, spans: Sequence[tuple[range, Action, float]]) -> None:
        """:meth:`record` of host-clock times, in order: each ``(layers, action, seconds)`` split
        evenly over ``layers``. The runtime hands over a stage's timings at once (one lock, checks
        per span rather than per layer x microbatch)."""
        per_action: dict[Action, tuple[list[int], list[float]]] = {a: ([], []) for a in _ACTIONS}
        for layers, action, seconds in spans:
            valid_layers = layers and 0 <= layers.start and layers.stop <= self.num_layers
            if not (valid_layers and action in _ACTIONS and 0 <= seconds < math.inf):
                raise ValueError(
                    f"a timing span needs layers within [0, {self.num_layers}), an action "
                    f"'fwd', 're' or 'bwd' and finite non-negative seconds, got "
                    f"{(layers, action, seconds)!r}"
                )
            share = seconds / len(layers)
            folded_layers, folded_seconds = per_action[action]
            folded_layers.extend(layers)
            folded_seconds.extend([share] * len(layers))
        for action, (layers_of, seconds_of) in per_action.items():
            if layers_of:
                self._fold(action, layers_of, seconds_of)

    def record_layers(
        self, layers: Sequence[int], action: Action, seconds: Sequence[float]
    ) -> None:
        """:meth:`record` of host-clock times, in order: ``seconds[i]`` of ``layers[i]`` doing
        ``action`` (the runtime hands over a stage's layer timings at once)."""
        if action not in _ACTIONS:
            raise ValueError(f"action must be 'fwd', 're' or 'bwd', got {action!r}")
        self._fold(action, layers, seconds)

    def _fold(self, action: Action, layers: Sequence[int], seconds: Sequence[float]) -> None:
        """Fold ``seconds[i]`` of ``layers[i]`` doing ``action``, in order (all checked first:
        ValueError); with ``VERBOSE``, report each record."""
        if not ModelTimer.VERBOSE:
            with self._lock:
                self._version += self._timings.fold(_INDEX[action], layers, seconds)
            return
        with self._lock:
            moved, estimates = self._timings.fold_reporting(_INDEX[action], layers, seconds)
            self._version += moved
        for layer, time, estimate in zip(layers, seconds, estimates, strict=True):
            self._report(layer, action, time, estimate)

    @staticmethod
    def _report(layer: int, action: Action, seconds: float, estimate: float) -> None:
        if ModelTimer.VERBOSE:
            # The line format of roundpipe 0.1.1's documentation, which users may parse.
            print(
                f"Layer {layer} {action}  new record: {seconds * 1e3:.3f} ms  "
                f"new estimate: {estimate * 1e3:.3f} ms",
                file=sys.stderr,
            )

    def estimate(self, layer: int, action: Action) -> float | None:
        """The smoothed time of ``layer`` doing ``action``, or None before its first record."""
        if action not in _ACTIONS:
            raise ValueError(f"action must be 'fwd', 're' or 'bwd', got {action!r}")
        with self._lock:
            return self._timings.estimate(_INDEX[action], layer)

    def profile(self, forward_bytes: Sequence[int], backward_bytes: Sequence[int]) -> LayerProfile:
        """Current estimates of every layer, with byte-size stand-ins for untimed ones."""
        self.collect()
        with self._lock:
            timed_forward, timed_recompute, timed_backward = (
                self._timings.estimates(_INDEX[a]) for a in _ACTIONS
            )
        timed = [(b, t) for b, t in zip(self._bytes, timed_forward, strict=True) if t is not None]
        timed_bytes = sum(b for b, _ in timed)
        per_byte = (
            sum(t for _, t in timed) / timed_bytes
            if timed_bytes > 0
            else self.STAND_IN_SECONDS_PER_BYTE
        )
        forward = [
            b * per_byte if t is None else t
            for b, t in zip(self._bytes, timed_forward, strict=True)
        ]
        recompute = [f if t is None else t for f, t in zip(forward, timed_recompute, strict=True)]
        backward = [2 * f if t is None else t for f, t in zip(forward, timed_backward, strict=True)]
        return LayerProfile(forward, recompute, backward, list(forward_bytes), list(backward_bytes))


__all__ = ["Action", "ModelTimer", "TimingEvent"]
