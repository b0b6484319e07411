"""RoundPipeRunConfig validation and call > model > default resolution (docs/guide.md,
section 4)."""

from __future__ import annotations

import copy
import pickle
from typing import Any

import pytest
import roundpipe
import torch
from roundpipe.run_config import ResolvedRunConfig, RoundPipeRunConfig, resolve_run_config
from roundpipe.scheduler import ModelExecutePlan
from torch.distributed.pipelining.microbatch import TensorChunkSpec, _CustomReducer, _Replicate

FIELDS = (
    "requires_grad",
    "output_device",
    "preserve_rng_state",
    "recompute_grain",
    "num_microbatch",
    "split_input",
    "split_label",
    "merge_output",
    "execute_plan",
)


def _split_fn(args: tuple, kwargs: dict, n: int) -> tuple[list, list]:
    return [args] * n, [kwargs] * n


def _merge_fn(outputs: list) -> Any:
    return outputs


def test_fields_default_to_none() -> None:
    config = RoundPipeRunConfig()
    assert all(getattr(config, name) is None for name in FIELDS)
    assert repr(config) == "RoundPipeRunConfig()"


def test_repr_shows_set_fields() -> None:
    assert repr(RoundPipeRunConfig(num_microbatch=4, recompute_grain="layer")) == (
        "RoundPipeRunConfig(recompute_grain='layer', num_microbatch=4)"
    )


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cpu", torch.device("cpu")),
        ("cuda:1", torch.device("cuda", 1)),
        (torch.device("meta"), torch.device("meta")),
    ],
)
def test_output_device_is_normalised(value: Any, expected: torch.device) -> None:
    assert RoundPipeRunConfig(output_device=value).output_device == expected


def test_valid_values_are_kept() -> None:
    plan = ModelExecutePlan()
    split_spec = ((TensorChunkSpec(0), _Replicate), None)
    label_spec = (_Replicate, TensorChunkSpec(1), _Replicate)
    merge_spec = {"loss": _CustomReducer(torch.tensor(0.0), lambda x, y: x + y), "n": None}
    config = RoundPipeRunConfig(
        requires_grad=False,
        preserve_rng_state=True,
        recompute_grain="layer",
        num_microbatch=7,
        split_input=split_spec,
        split_label=label_spec,
        merge_output=merge_spec,
        execute_plan=plan,
    )
    assert config.requires_grad is False and config.preserve_rng_state is True
    assert config.recompute_grain == "layer" and config.num_microbatch == 7
    assert config.split_input is split_spec and config.split_label is label_spec
    # The plan is a snapshot (0.1.1 deep-copied it): equal, not the object given.
    assert config.merge_output is merge_spec and config.execute_plan == plan
    assert config.execute_plan is not plan
    config = RoundPipeRunConfig(split_input=_split_fn, split_label=len, merge_output=_merge_fn)
    assert config.split_input is _split_fn and config.merge_output is _merge_fn
    assert RoundPipeRunConfig(merge_output=False).merge_output is False
    assert RoundPipeRunConfig(split_label=TensorChunkSpec(1)).split_label.split_dim == 1


@pytest.mark.parametrize(
    ("field", "value", "error"),
    [
        ("requires_grad", 1, TypeError),
        ("preserve_rng_state", "yes", TypeError),
        ("output_device", 1.5, TypeError),
        ("output_device", True, TypeError),
        ("output_device", "nowhere", ValueError),
        ("recompute_grain", "block", ValueError),
        ("num_microbatch", 0, ValueError),
        ("num_microbatch", -2, ValueError),
        ("num_microbatch", 2.0, TypeError),
        ("num_microbatch", True, TypeError),
        ("split_input", [None, None], TypeError),
        ("split_input", (None,), TypeError),
        ("split_input", ({"x": TensorChunkSpec(0)}, None), TypeError),
        ("split_input", (None, (TensorChunkSpec(0),)), TypeError),
        ("split_input", ((0,), None), TypeError),
        ("split_input", ((TensorChunkSpec(0),), {"k": "chunk"}), TypeError),
        ("split_input", ((TensorChunkSpec("0"),), None), TypeError),
        ("split_label", (_Replicate, 1), TypeError),
        ("split_label", _CustomReducer(0, max), ValueError),
        ("merge_output", "cat", TypeError),
        ("merge_output", _CustomReducer(0, 3), TypeError),
        ("execute_plan", [range(0, 2)], TypeError),
    ],
)
def test_invalid_values_raise_naming_the_field(field: str, value: Any, error: type) -> None:
    with pytest.raises(error, match=field):
        RoundPipeRunConfig(**{field: value})


def test_assignment_is_validated_and_misspellings_rejected() -> None:
    config = RoundPipeRunConfig()
    config.num_microbatch = 3
    assert config.num_microbatch == 3
    with pytest.raises(ValueError, match="num_microbatch"):
        config.num_microbatch = 0
    assert config.num_microbatch == 3
    with pytest.raises(AttributeError, match="num_microbatches"):
        config.num_microbatches = 4


def test_resolution_defaults(num_devices: int) -> None:
    resolved = resolve_run_config(RoundPipeRunConfig(), RoundPipeRunConfig())
    assert resolved == ResolvedRunConfig(
        requires_grad=True,
        output_device=torch.device("cpu"),
        preserve_rng_state=True,
        recompute_grain="stage",
        num_microbatch=num_devices + 1,
        split_input=None,
        split_label=None,
        merge_output=None,
        execute_plan=None,
    )
    assert roundpipe.device_count() == num_devices
    with torch.no_grad():
        assert resolve_run_config(RoundPipeRunConfig(), RoundPipeRunConfig()).requires_grad is False


def test_default_num_microbatch_follows_device_count_at_call_time() -> None:
    previous_kind, previous_count = roundpipe.device_kind(), roundpipe.device_count()
    try:
        counts = []
        for devices in (2, 5):
            roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
            config = resolve_run_config(RoundPipeRunConfig(), RoundPipeRunConfig())
            counts.append(config.num_microbatch)
        assert counts == [3, 6]
    finally:
        if previous_kind == "cpu":
            roundpipe.configure_devices(kind="auto", num_cpu_devices=previous_count)
        else:
            roundpipe.configure_devices(kind="auto")


_PLAN_A, _PLAN_B = ModelExecutePlan(), ModelExecutePlan()
_SPEC_A = ((TensorChunkSpec(0),), None)
_SPEC_B = (None, {"mask": _Replicate})


@pytest.mark.parametrize(
    ("field", "call_value", "model_value", "default"),
    [
        ("requires_grad", False, True, True),
        ("output_device", torch.device("meta"), torch.device("cpu", 0), torch.device("cpu")),
        ("preserve_rng_state", False, True, True),
        ("recompute_grain", "layer", "stage", "stage"),
        ("num_microbatch", 2, 5, None),
        ("split_input", _SPEC_A, _SPEC_B, None),
        ("split_label", TensorChunkSpec(1), _Replicate, None),
        ("merge_output", False, _merge_fn, None),
        ("execute_plan", _PLAN_A, _PLAN_B, None),
    ],
)
def test_call_overrides_model_overrides_default(
    field: str, call_value: Any, model_value: Any, default: Any
) -> None:
    def resolved(call: dict, model: dict) -> Any:
        config = resolve_run_config(RoundPipeRunConfig(**call), RoundPipeRunConfig(**model))
        return getattr(config, field)

    assert resolved({field: call_value}, {field: model_value}) == call_value
    assert resolved({}, {field: model_value}) == model_value
    assert resolved({field: call_value}, {}) == call_value
    if default is not None:
        assert resolved({}, {}) == default


def test_merge_output_true_resolves_to_automatic() -> None:
    model = RoundPipeRunConfig(merge_output=False)
    assert resolve_run_config(RoundPipeRunConfig(merge_output=True), model).merge_output is None
    assert resolve_run_config(RoundPipeRunConfig(), model).merge_output is False


def test_requires_grad_true_without_grad_mode_raises() -> None:
    with torch.no_grad(), pytest.raises(RuntimeError, match="grad mode is disabled"):
        resolve_run_config(RoundPipeRunConfig(), RoundPipeRunConfig(requires_grad=True))
    with torch.inference_mode(), pytest.raises(RuntimeError, match="requires_grad=True"):
        resolve_run_config(RoundPipeRunConfig(requires_grad=True), RoundPipeRunConfig())
    with torch.no_grad():
        config = resolve_run_config(RoundPipeRunConfig(requires_grad=False), RoundPipeRunConfig())
    assert config.requires_grad is False


def test_resolution_rejects_other_config_types() -> None:
    with pytest.raises(TypeError, match="call run config"):
        resolve_run_config({"num_microbatch": 2}, RoundPipeRunConfig())  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="model run config"):
        resolve_run_config(RoundPipeRunConfig(), None)  # type: ignore[arg-type]


def test_config_survives_copy_and_pickle() -> None:
    config = RoundPipeRunConfig(num_microbatch=3, output_device="cpu", recompute_grain="layer")
    for clone in (copy.deepcopy(config), pickle.loads(pickle.dumps(config))):
        assert all(getattr(clone, name) == getattr(config, name) for name in FIELDS)
        assert clone is not config
