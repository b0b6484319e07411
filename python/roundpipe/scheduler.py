"""Execution plans: which layers form each forward and backward stage, and how they are chosen.

:class:`ModelExecutePlan` holds a model's stage partition; :meth:`ModelExecutePlan.auto`
computes one from per-layer time and memory estimates with the native planner
(``csrc/scheduler/scheduler.h``), which is exact for its objective and breaks ties with a simulation
of round-robin dispatch.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

from roundpipe import device
from roundpipe._native import _C
from roundpipe.timeline.tracing import Trace, predict_trace

RunType = Literal["infer", "train", "fused"]
_RUN_TYPES: tuple[str, ...] = get_args(RunType)

#: ``model_memory_limit`` is in GB of 2**30 bytes.
GIB = 1 << 30
#: Default ``model_memory_limit``: this fraction of the smallest device's memory on CUDA, and of the
#: host's memory divided by the number of devices on virtual CPU devices (they share the host).
DEFAULT_MEMORY_FRACTION = 0.6
#: Parameter upload bandwidth assumed when simulating plans (host-to-device copies over PCIe on
#: CUDA, memcpy between host buffers on CPU devices). It only affects tie-breaks and
#: ``predicted_time``.
ASSUMED_UPLOAD_BYTES_PER_SECOND = {"cuda": 25e9, "cpu": 10e9}


@dataclass(frozen=True)
class LayerProfile:
    """Per-layer estimates of one model, one entry per layer (see ``roundpipe.timer``)."""

    forward_seconds: Sequence[float]  # forward time of one microbatch
    recompute_seconds: Sequence[float]  # forward again, before the backward
    backward_seconds: Sequence[float]  # backward only
    forward_bytes: Sequence[int]  # device memory in a forward stage: parameters
    backward_bytes: Sequence[int]  # device memory in a backward stage: parameters + gradients


class ProfiledModel(Protocol):
    """What :meth:`ModelExecutePlan.auto` needs of a model: its current layer estimates."""

    def _layer_profile(self) -> LayerProfile: ...


class ModelExecutePlan:
    """The stage partition of one model: ``fwd_plan`` and ``bwd_plan`` are lists of layer ranges.

    Forward stages ascend from layer 0; backward stages descend. For ``forward_backward`` ("fused")
    the first backward stage holds the last layers, which run forward + loss + backward without
    recompute and therefore do not appear in ``fwd_plan``.

    ``predicted_time`` is set by :meth:`auto`: the simulated seconds of one iteration (of all the
    models planned together), with ``device_count() + 1`` microbatches; ``None`` otherwise.
    """

    def __init__(self) -> None:
        self.fwd_plan: list[range] = []
        self.bwd_plan: list[range] = []
        self.predicted_time: float | None = None

    def __repr__(self) -> str:
        return f"ModelExecutePlan(fwd_plan={self.fwd_plan}, bwd_plan={self.bwd_plan})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ModelExecutePlan):
            return NotImplemented
        return self.fwd_plan == other.fwd_plan and self.bwd_plan == other.bwd_plan

    # Defining __eq__ leaves __hash__ None: a plan is mutable, hence unhashable.

    def validate(self, num_layers: int, run_type: RunType) -> None:
        """Check that this plan can run a model of ``num_layers`` layers as ``run_type``.

        Rules (docs/guide.md, section 5): stages are non-empty ranges with step 1; forward stages
        ascend contiguously from layer 0 and backward stages descend contiguously. ``"infer"`` and
        ``"train"`` forward stages cover every layer; ``"train"`` backward stages cover every layer
        from the top down (``"infer"`` may leave ``bwd_plan`` empty). A ``"fused"`` plan's forward
        stages cover ``[0, k)``, ``bwd_plan[0]`` is exactly ``range(k, num_layers)`` and the other
        backward stages cover ``[0, k)`` from the top down.

        Raises:
            TypeError: ``fwd_plan``/``bwd_plan`` is not a list of ``range``, or an argument has the
                wrong type.
            ValueError: a rule is broken; the message names the stage and the fix.
        """
        if isinstance(num_layers, bool) or not isinstance(num_layers, int):
            raise TypeError(f"num_layers must be an int, got {type(num_layers).__name__}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be at least 1, got {num_layers}")
        _check_run_type(run_type)
        for field in ("fwd_plan", "bwd_plan"):
            stages = getattr(self, field)
            if not isinstance(stages, list):
                raise TypeError(f"{field} must be a list of range, got {type(stages).__name__}")
            for index, stage in enumerate(stages):
                if not isinstance(stage, range):
                    raise TypeError(f"{field}[{index}] must be a range, got {type(stage).__name__}")
                if stage.step != 1:
                    raise ValueError(f"{field}[{index}] = {stage} must have step 1")
                if len(stage) == 0:
                    raise ValueError(f"{field}[{index}] = {stage} is empty; stages need layers")

        top = _check_ascending(self.fwd_plan, num_layers)
        if run_type == "fused":
            if top >= num_layers:
                raise ValueError(
                    "a 'fused' plan's fwd_plan must stop before the last layer "
                    f"({num_layers - 1}), which runs in the fused stage bwd_plan[0]; "
                    f"it covers [0, {top})"
                )
            if not self.bwd_plan or self.bwd_plan[0] != range(top, num_layers):
                first = self.bwd_plan[0] if self.bwd_plan else "missing"
                raise ValueError(
                    f"a 'fused' plan's bwd_plan[0] must be exactly range({top}, {num_layers}) (the "
                    f"layers after fwd_plan, run forward + backward without recompute), got {first}"
                )
            _check_descending(self.bwd_plan[1:], top, first_index=1)
            return
        if top != num_layers:
            raise ValueError(
                f"fwd_plan covers layers [0, {top}) but the model has {num_layers} layers; "
                f"{'an' if run_type == 'infer' else 'a'} '{run_type}' plan's forward stages "
                "must cover them all"
            )
        if run_type == "train" and not self.bwd_plan:
            raise ValueError(
                "a 'train' plan needs backward stages but bwd_plan is empty (an inference plan, "
                "such as ModelExecutePlan.auto('infer', ...)); with gradients on, use "
                "ModelExecutePlan.auto('train', model), or call under torch.no_grad() "
                "(or requires_grad=False) to run it as inference"
            )
        if run_type == "train" or self.bwd_plan:
            _check_descending(self.bwd_plan, num_layers, first_index=0)

    def check_valid(self, num_layers: int, run_type: RunType) -> None:
        """roundpipe 0.1.1's name for :meth:`validate`."""
        self.validate(num_layers, run_type)

    @classmethod
    def auto(
        cls,
        run_type: RunType,
        *models: ProfiledModel,
        min_stages: int | None = None,
        upper_threshold: float = 1.1,
        model_memory_limit: float | None = None,
    ) -> ModelExecutePlan | list[ModelExecutePlan]:
        """Compute the best plan for one model, or jointly balanced plans for several.

        Minimises ``max(#stages, min_stages) x (largest stage time)`` per pipeline phase, with
        every stage's memory at most ``model_memory_limit / 2`` (the next stage is prefetched) and
        stage times at most ``upper_threshold`` x the slowest layer's. The result is exact for that
        objective; among plans that tie, the one with the shortest simulated iteration wins.
        With several models, a non-last model gets a ``"train"`` plan and the last a ``"fused"``
        one when ``run_type`` is ``"fused"``; all stages of a phase share one stage-time bound.

        Args:
            run_type: ``"infer"`` (forward only), ``"train"`` (separate forward and backward
                calls) or ``"fused"`` (``forward_backward``).
            *models: RoundPipe models (anything with ``_layer_profile()``), in execution order.
            min_stages: fewest stages worth having; default ``roundpipe.device_count()``, read at
                call time.
            upper_threshold: largest allowed ratio of a stage's time to the slowest layer's, >= 1.
            model_memory_limit: device memory for parameters and gradients, in GB (2**30 bytes).
                Default: 60% of the smallest GPU's memory, or on virtual CPU devices 60% of host
                memory divided by the device count, read at call time. A layer larger than half
                the limit raises it, with a warning naming the layer.

        Returns:
            One plan for one model, otherwise a list in model order. Each plan's
            ``predicted_time`` is the simulated iteration time of all of them.

        Raises:
            ValueError: unknown ``run_type``, no model, a model without layers, ``min_stages < 1``,
                ``upper_threshold < 1``, a non-positive memory limit, or inconsistent estimates.
            TypeError: an argument of the wrong type, or a model without ``_layer_profile``.
        """
        _check_run_type(run_type)
        if not models:
            raise ValueError("ModelExecutePlan.auto needs at least one model")
        for index, model in enumerate(models):
            if not callable(getattr(model, "_layer_profile", None)):
                raise TypeError(
                    f"models[{index}] ({type(model).__name__}) is not a RoundPipe model: it has "
                    "no _layer_profile(); pass RoundPipe instances"
                )
        if min_stages is None:
            min_stages = device.device_count()
        _check_int(min_stages, "min_stages", minimum=1)
        _check_real(upper_threshold, "upper_threshold")
        if not upper_threshold >= 1.0:
            raise ValueError(f"upper_threshold must be >= 1, got {upper_threshold}")
        if model_memory_limit is None:
            model_memory_limit = default_model_memory_limit()
        _check_real(model_memory_limit, "model_memory_limit")
        if not model_memory_limit > 0:
            raise ValueError(f"model_memory_limit must be positive (GB), got {model_memory_limit}")

        profiles = [_checked_profile(model, index) for index, model in enumerate(models)]
        limit = _fit_memory_limit(run_type, models, profiles, float(model_memory_limit))
        num_devices = device.device_count()
        result = _parse_planner_result(
            _C.plan_stages(
                run_type=run_type,
                profiles=[
                    (
                        [float(x) for x in p.forward_seconds],
                        [float(x) for x in p.recompute_seconds],
                        [float(x) for x in p.backward_seconds],
                        [float(x) for x in p.forward_bytes],
                        [float(x) for x in p.backward_bytes],
                    )
                    for p in profiles
                ],
                min_stages=min_stages,
                upper_threshold=float(upper_threshold),
                stage_memory_cap=limit * GIB / 2,
                num_devices=num_devices,
                num_microbatches=num_devices + 1,
                upload_bytes_per_second=ASSUMED_UPLOAD_BYTES_PER_SECOND[device.device_kind()],
            )
        )
        plans: list[ModelExecutePlan] = []
        for index, (forward, backward) in enumerate(result.stages):
            plan = cls()
            plan.fwd_plan = forward
            plan.bwd_plan = backward
            plan.predicted_time = result.predicted_seconds
            is_last = index == len(models) - 1
            model_run_type: RunType = "train" if run_type == "fused" and not is_last else run_type
            plan.validate(len(profiles[index].forward_seconds), model_run_type)
            plans.append(plan)
        return plans[0] if len(plans) == 1 else plans

    def simulate(
        self,
        model: ProfiledModel | LayerProfile,
        run_type: RunType = "fused",
        *,
        num_microbatch: int | None = None,
        num_devices: int | None = None,
        upload_bytes_per_second: float | None = None,
    ) -> Trace:
        """The schedule the planner's simulator predicts for this plan: a
        :class:`roundpipe.timeline.tracing.Trace` like a measured one (``.save(path)``,
        ``roundpipe.timeline.plot.plot_trace(measured, out, predicted=...)``, ``.summary()``).

        Args:
            model: a RoundPipe model (its current layer estimates are used) or a
                :class:`LayerProfile`.
            run_type: ``"infer"`` (forward call), ``"train"`` (forward call, then backward call)
                or ``"fused"`` (``forward_backward``).
            num_microbatch: default ``num_devices + 1``, as a call's default.
            num_devices: default ``roundpipe.device_count()``.
            upload_bytes_per_second: parameter upload rate; default the planner's assumption
                for the device kind (``ASSUMED_UPLOAD_BYTES_PER_SECOND``); 0 ignores uploads.

        Raises:
            TypeError / ValueError: a bad argument, or a plan that cannot run the model as
                ``run_type``.
        """
        _check_run_type(run_type)
        if isinstance(model, LayerProfile):
            profile, name = _check_profile(model, "profile"), "model"
        elif callable(getattr(model, "_layer_profile", None)):
            profile, name = _checked_profile(model, 0), getattr(model, "name", None) or "model"
        else:
            raise TypeError(
                f"model must be a RoundPipe model or a LayerProfile, got {type(model).__name__}"
            )
        if num_devices is None:
            num_devices = device.device_count()
        _check_int(num_devices, "num_devices", minimum=1)
        if num_microbatch is None:
            num_microbatch = num_devices + 1
        _check_int(num_microbatch, "num_microbatch", minimum=1)
        if upload_bytes_per_second is None:
            upload_bytes_per_second = ASSUMED_UPLOAD_BYTES_PER_SECOND[device.device_kind()]
        _check_real(upload_bytes_per_second, "upload_bytes_per_second")
        if upload_bytes_per_second < 0:
            raise ValueError(
                f"upload_bytes_per_second must be >= 0 (0: uploads take no time), got "
                f"{upload_bytes_per_second}"
            )
        self.validate(len(profile.forward_seconds), run_type)
        forward = [("forward", layers) for layers in self.fwd_plan]
        backward = [("backward", layers) for layers in self.bwd_plan]
        if run_type == "infer":
            calls = [forward]
        elif run_type == "train":
            calls = [forward, backward]
        else:
            calls = [[*forward, ("fused", self.bwd_plan[0]), *backward[1:]]]
        return predict_trace(
            calls,
            profile,
            num_microbatch=num_microbatch,
            num_devices=num_devices,
            model=name,
            upload_bytes_per_second=float(upload_bytes_per_second),
        )


@dataclass(frozen=True)
class _PlannerResult:
    """The native planner's answer: per model, its forward and backward stages, and the
    simulated seconds of one iteration of all the models."""

    stages: list[tuple[list[range], list[range]]]
    predicted_seconds: float


def _parse_planner_result(result: dict[str, object]) -> _PlannerResult:
    """Type the dictionary ``_C.plan_stages`` returns (its layout is in ``_C.pyi``)."""
    plans = result["plans"]
    predicted = result["predicted_seconds"]
    assert isinstance(plans, list) and isinstance(predicted, (int, float))
    return _PlannerResult(
        [
            (
                [range(begin, end) for begin, end in forward],
                [range(begin, end) for begin, end in backward],
            )
            for forward, backward in plans
        ],
        float(predicted),
    )


def default_model_memory_limit() -> float:
    """The default ``model_memory_limit`` in GB (2**30 bytes), computed from the current devices.

    CUDA: ``DEFAULT_MEMORY_FRACTION`` of the smallest device's memory. Virtual CPU devices share
    the host's memory, so each gets ``DEFAULT_MEMORY_FRACTION`` of it divided by their count.
    """
    return DEFAULT_MEMORY_FRACTION * device.get_min_gpu_memory()


def _check_run_type(run_type: object) -> None:
    if run_type not in _RUN_TYPES:
        raise ValueError(f"run_type must be 'infer', 'train' or 'fused', got {run_type!r}")


def _check_int(value: object, name: str, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be at least {minimum}, got {value}")


def _check_real(value: object, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _check_ascending(stages: list[range], num_layers: int) -> int:
    """Checks forward stages run contiguously upward from layer 0; returns where they stop."""
    top = 0
    for index, stage in enumerate(stages):
        if stage.start != top:
            where = "layer 0" if index == 0 else f"fwd_plan[{index - 1}].stop = {top}"
            raise ValueError(
                f"fwd_plan[{index}] = {stage} must start at {where}: forward stages ascend "
                "contiguously from layer 0"
            )
        if stage.stop > num_layers:
            raise ValueError(
                f"fwd_plan[{index}] = {stage} goes past the model's {num_layers} layers"
            )
        top = stage.stop
    return top


def _check_descending(stages: list[range], top: int, first_index: int) -> None:
    """Checks backward stages run contiguously downward from ``top`` to layer 0."""
    for offset, stage in enumerate(stages):
        index = first_index + offset
        if stage.stop != top:
            raise ValueError(
                f"bwd_plan[{index}] = {stage} must stop at {top}: backward stages descend "
                f"contiguously, each ending where the previous one started"
            )
        top = stage.start
    if top != 0:
        raise ValueError(
            f"bwd_plan stops at layer {top}; backward stages must continue down to layer 0"
        )


def _checked_profile(model: ProfiledModel, index: int) -> LayerProfile:
    profile = model._layer_profile()
    if not isinstance(profile, LayerProfile):
        raise TypeError(
            f"models[{index}]._layer_profile() must return a LayerProfile, got "
            f"{type(profile).__name__}"
        )
    return _check_profile(profile, f"models[{index}]")


def _check_profile(profile: LayerProfile, where: str) -> LayerProfile:
    layers = len(profile.forward_seconds)
    if layers == 0:
        raise ValueError(f"{where} has no layers; a plan needs at least one layer")
    for field in ("recompute_seconds", "backward_seconds", "forward_bytes", "backward_bytes"):
        if len(getattr(profile, field)) != layers:
            raise ValueError(
                f"{where}: {field} has {len(getattr(profile, field))} entries but "
                f"forward_seconds has {layers}; the profile needs one per layer"
            )
    return profile


def _fit_memory_limit(
    run_type: RunType,
    models: Sequence[ProfiledModel],
    profiles: Sequence[LayerProfile],
    limit: float,
) -> float:
    """Raises ``limit`` (GB) so that the largest layer fits a stage (half the limit), warning."""
    largest, where = 0.0, ""
    for index, profile in enumerate(profiles):
        for layer, (forward, backward) in enumerate(
            zip(profile.forward_bytes, profile.backward_bytes, strict=True)
        ):
            size = forward if run_type == "infer" else max(forward, backward)
            if size > largest:
                name = getattr(models[index], "name", None) or f"models[{index}]"
                largest, where = float(size), f"layer {layer} of {name}"
    needed = 2 * largest / GIB
    if needed <= limit:
        return limit
    # Significant digits, not decimals: a test model's layers are millionths of a GB.
    warnings.warn(
        f"{where} needs {largest / GIB:.4g} GB of device memory, more than half of "
        f"model_memory_limit={limit:.4g} GB (one stage plus the prefetched next one must fit); "
        f"raising model_memory_limit to {needed:.4g} GB (+{needed - limit:.4g} GB)",
        stacklevel=3,
    )
    return needed


__all__ = [
    "ASSUMED_UPLOAD_BYTES_PER_SECOND",
    "DEFAULT_MEMORY_FRACTION",
    "GIB",
    "LayerProfile",
    "ModelExecutePlan",
    "RunType",
    "default_model_memory_limit",
]
