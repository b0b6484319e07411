"""Run configuration of a RoundPipe call and its resolution against the model's."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch

from roundpipe import device
from roundpipe.batch import (
    MergeOutputFn,
    SplitInputFn,
    SplitLabelFn,
    check_spec,
    is_user_function,
    marker_kind,
)
from roundpipe.scheduler import ModelExecutePlan

RecomputeGrain = Literal["stage", "layer"]
_RECOMPUTE_GRAINS = ("stage", "layer")


def _check_bool(name: str, value: Any) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r}")
    return value


def _check_output_device(value: Any) -> torch.device | None:
    if value is None or isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise TypeError(
            "output_device must be a torch.device, a device string such as 'cpu' or 'cuda:0', "
            f"a CUDA index or None, got {value!r}"
        )
    try:
        return torch.device(value)
    except (RuntimeError, ValueError) as error:
        raise ValueError(f"output_device {value!r} is not a valid device: {error}") from error


def _check_output_device_present(device: torch.device) -> None:
    """An output device this process can use (checked per call: a config may be built on
    another machine)."""
    if device.type != "cuda":
        return
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count == 0:
        built = "built" if torch.version.cuda else "not built"
        raise ValueError(
            f"output_device is {device} but no CUDA device is available (torch "
            f"{torch.__version__}, CUDA {built}); use output_device='cpu' (the default)"
        )
    if device.index is not None and device.index >= count:
        raise ValueError(
            f"output_device is {device} but only {count} CUDA device(s) are visible; use an "
            f"index below {count}"
        )


def _check_recompute_grain(value: Any) -> RecomputeGrain | None:
    if value is not None and value not in _RECOMPUTE_GRAINS:
        raise ValueError(f"recompute_grain must be 'stage', 'layer' or None, got {value!r}")
    grain: RecomputeGrain | None = value
    return grain


def _check_num_microbatch(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"num_microbatch must be an int >= 1 or None, got {value!r}")
    if value < 1:
        raise ValueError(f"num_microbatch must be >= 1, got {value}")
    return value


def _check_split_input(value: Any) -> Any:
    if value is None or is_user_function(value):
        return value
    if not isinstance(value, tuple) or len(value) != 2:
        raise TypeError(
            "split_input must be None, a function fn(args, kwargs, num_microbatch) or a tuple "
            f"(args_spec, kwargs_spec), got {value!r}"
        )
    args_spec, kwargs_spec = value
    if not (args_spec is None or isinstance(args_spec, (tuple, list)) or marker_kind(args_spec)):
        raise TypeError(
            f"split_input's args spec must be None or a tuple shaped like the args, got "
            f"{args_spec!r}"
        )
    if not (kwargs_spec is None or isinstance(kwargs_spec, dict) or marker_kind(kwargs_spec)):
        raise TypeError(
            f"split_input's kwargs spec must be None or a dict shaped like the kwargs, got "
            f"{kwargs_spec!r}"
        )
    check_spec(args_spec, "split_input args spec", allow_reduce=False)
    check_spec(kwargs_spec, "split_input kwargs spec", allow_reduce=False)
    return value


def _check_split_label(value: Any) -> Any:
    if not is_user_function(value):
        check_spec(value, "split_label", allow_reduce=False)
    return value


def _check_merge_output(value: Any) -> Any:
    if not isinstance(value, bool) and not is_user_function(value):
        check_spec(value, "merge_output", allow_reduce=True)
    return value


def _check_execute_plan(value: Any) -> ModelExecutePlan | None:
    if value is not None and not isinstance(value, ModelExecutePlan):
        raise TypeError(
            "execute_plan must be a roundpipe.ModelExecutePlan or None (automatic), got "
            f"{type(value).__name__}"
        )
    return value


_VALIDATORS: dict[str, Callable[[Any], Any]] = {
    "requires_grad": lambda value: _check_bool("requires_grad", value),
    "output_device": _check_output_device,
    "preserve_rng_state": lambda value: _check_bool("preserve_rng_state", value),
    "recompute_grain": _check_recompute_grain,
    "num_microbatch": _check_num_microbatch,
    "split_input": _check_split_input,
    "split_label": _check_split_label,
    "merge_output": _check_merge_output,
    "execute_plan": _check_execute_plan,
}


class RoundPipeRunConfig:
    """Run configuration of a RoundPipe model, at model level or per call.

    Pass one as ``model_run_config`` when creating a RoundPipe (the model's defaults) or as the
    ``roundpipe_run_config`` / ``run_config`` argument of a call (overrides the model's). A field
    left ``None`` at both levels takes its default.

    Args:
        requires_grad: build the autograd graph; default ``torch.is_grad_enabled()``.
        output_device: where outputs are placed (device, string or CUDA index); default CPU.
        preserve_rng_state: replay the forward pass's randomness (dropout) in recompute; default
            ``True``.
        recompute_grain: ``"stage"`` (recompute whole backward stages, default) or ``"layer"``
            (keep every layer's input and recompute one layer at a time: less device memory).
        num_microbatch: microbatches per call; default the number of devices plus one.
        split_input: ``None`` (automatic), ``(args_spec, kwargs_spec)`` of
            ``TensorChunkSpec``/``_Replicate`` trees shaped like the inputs (a part ``None`` for
            automatic), or ``fn(args, kwargs, num_microbatch) -> (args_list, kwargs_list)``.
        split_label: ``None`` (automatic), a spec shaped like the label, or
            ``fn(label, num_microbatch) -> list``.
        merge_output: ``None``/``True`` (automatic), ``False`` (return ``RoundPipePackedData``
            leaves without merging), a ``TensorChunkSpec``/``_Replicate``/``_CustomReducer`` spec
            shaped like the output, or ``fn(outputs) -> merged``.
        execute_plan: a ``ModelExecutePlan``; default planned automatically from timings.

    Raises:
        TypeError: a field has the wrong type.
        ValueError: a field has an invalid value.

    Fields are validated whenever they are set, and misspelled fields are rejected.
    """

    __slots__ = tuple(_VALIDATORS)

    requires_grad: bool | None
    output_device: torch.device | None
    preserve_rng_state: bool | None
    recompute_grain: RecomputeGrain | None
    num_microbatch: int | None
    split_input: tuple[Any, Any] | SplitInputFn | None
    split_label: Any | SplitLabelFn | None
    merge_output: Any | MergeOutputFn | bool | None
    execute_plan: ModelExecutePlan | None

    def __init__(
        self,
        requires_grad: bool | None = None,
        output_device: torch.device | str | int | None = None,
        preserve_rng_state: bool | None = None,
        recompute_grain: RecomputeGrain | None = None,
        num_microbatch: int | None = None,
        split_input: tuple[Any, Any] | SplitInputFn | None = None,
        split_label: Any | SplitLabelFn | None = None,
        merge_output: Any | MergeOutputFn | bool | None = None,
        execute_plan: ModelExecutePlan | None = None,
    ) -> None:
        self.requires_grad = requires_grad
        # Normalised here already (to a torch.device) so the field has its stored type.
        self.output_device = _check_output_device(output_device)
        self.preserve_rng_state = preserve_rng_state
        self.recompute_grain = recompute_grain
        self.num_microbatch = num_microbatch
        self.split_input = split_input
        self.split_label = split_label
        self.merge_output = merge_output
        # A snapshot of the plan, as 0.1.1 takes: changing the plan object later changes no config.
        self.execute_plan = copy.deepcopy(execute_plan)

    def __setattr__(self, name: str, value: Any) -> None:
        validator = _VALIDATORS.get(name)
        if validator is None:
            raise AttributeError(
                f"RoundPipeRunConfig has no field {name!r}; the fields are {', '.join(_VALIDATORS)}"
            )
        object.__setattr__(self, name, validator(value))

    def __repr__(self) -> str:
        values = ((name, getattr(self, name)) for name in _VALIDATORS)
        fields = ", ".join(f"{name}={value!r}" for name, value in values if value is not None)
        return f"RoundPipeRunConfig({fields})"


@dataclass(frozen=True)
class ResolvedRunConfig:
    """The concrete configuration of one call, after call > model > default resolution.

    ``split_input``, ``split_label`` and ``merge_output`` keep ``None`` for automatic
    (``merge_output=True`` is resolved to ``None``; ``False`` means pack, see
    ``roundpipe.batch.pack_output``); ``execute_plan`` is ``None`` for an automatic plan.
    """

    requires_grad: bool
    output_device: torch.device
    preserve_rng_state: bool
    recompute_grain: RecomputeGrain
    num_microbatch: int
    split_input: tuple[Any, Any] | SplitInputFn | None
    split_label: Any | SplitLabelFn | None
    merge_output: Any | MergeOutputFn | Literal[False] | None
    execute_plan: ModelExecutePlan | None

    def fitted(self, microbatches: int) -> ResolvedRunConfig:
        """This configuration for the ``microbatches`` the inputs were split into (fewer than
        asked for when the batch has fewer rows)."""
        if microbatches == self.num_microbatch:
            return self
        return dataclasses.replace(self, num_microbatch=microbatches)


def resolve_run_config(call: RoundPipeRunConfig, model: RoundPipeRunConfig) -> ResolvedRunConfig:
    """Resolve each field from the call's config, else the model's, else its default.

    Defaults are computed now: ``requires_grad`` follows ``torch.is_grad_enabled()`` and
    ``num_microbatch`` is the current device count plus one.

    Raises:
        RuntimeError: ``requires_grad=True`` was requested while grad mode is disabled.
    """
    for name, config in (("call", call), ("model", model)):
        if not isinstance(config, RoundPipeRunConfig):
            raise TypeError(
                f"the {name} run config must be a RoundPipeRunConfig, got {type(config).__name__}"
            )

    def pick(field: str, default: Any) -> Any:
        value = getattr(call, field)
        if value is None:
            value = getattr(model, field)
        return default if value is None else value

    grad_enabled = torch.is_grad_enabled()
    requires_grad = pick("requires_grad", grad_enabled)
    if requires_grad and not grad_enabled:
        raise RuntimeError(
            "RoundPipeRunConfig requires_grad=True but grad mode is disabled (inside "
            "torch.no_grad() or torch.inference_mode()); run the call with grad mode enabled or "
            "leave requires_grad unset"
        )
    merge = pick("merge_output", None)
    output_device = pick("output_device", torch.device("cpu"))
    _check_output_device_present(output_device)
    return ResolvedRunConfig(
        requires_grad=requires_grad,
        output_device=output_device,
        preserve_rng_state=pick("preserve_rng_state", True),
        recompute_grain=pick("recompute_grain", "stage"),
        num_microbatch=pick("num_microbatch", None) or device.device_count() + 1,
        split_input=pick("split_input", None),
        split_label=pick("split_label", None),
        merge_output=None if merge is True else merge,
        execute_plan=pick("execute_plan", None),
    )


class FullRoundPipeRunConfig(ResolvedRunConfig):
    """roundpipe 0.1.1's name for a resolved configuration, kept as compatibility surface:
    ``FullRoundPipeRunConfig(function_run_config, model_run_config)`` (0.1.1's parameter names
    and order: the call's configuration, then the model's) is
    ``resolve_run_config(function_run_config, model_run_config)`` (``merge_output=False`` stays
    ``False``, automatic choices stay ``None``). ``model_run_config`` may be left out (an empty
    ``RoundPipeRunConfig()``)."""

    def __init__(
        self,
        function_run_config: RoundPipeRunConfig,
        model_run_config: RoundPipeRunConfig | None = None,
    ) -> None:
        resolved = resolve_run_config(function_run_config, model_run_config or RoundPipeRunConfig())
        super().__init__(
            **{item.name: getattr(resolved, item.name) for item in dataclasses.fields(resolved)}
        )


__all__ = [
    "FullRoundPipeRunConfig",
    "RecomputeGrain",
    "ResolvedRunConfig",
    "RoundPipeRunConfig",
    "resolve_run_config",
]
