"""The planner's prediction as a trace: the native simulator's schedule of a model's calls, laid
out as the compute events a recording of them would hold."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from roundpipe._native import _C
from roundpipe.timeline.events import Trace, TraceEvent


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


__all__ = ["LayerCosts", "predict_trace"]
