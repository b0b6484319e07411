"""ModelExecutePlan: validation rules and ``auto`` against brute force."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator, Sequence

import pytest
import roundpipe
import torch
from roundpipe import _C, RoundPipe, RoundPipeRunConfig
from roundpipe.scheduler import (
    ASSUMED_UPLOAD_BYTES_PER_SECOND,
    GIB,
    LayerProfile,
    ModelExecutePlan,
    default_model_memory_limit,
)
from torch import nn


def make_plan(fwd: list[range], bwd: list[range]) -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = fwd, bwd
    return plan


class FakeModel:
    """Stands in for a RoundPipe: all ``auto`` asks of a model is its layer profile."""

    def __init__(self, profile: LayerProfile, name: str | None = None) -> None:
        self.profile = profile
        self.name = name

    def _layer_profile(self) -> LayerProfile:
        return self.profile


def uniform_profile(layers: int, seconds: float = 1.0, nbytes: int = 1000) -> LayerProfile:
    return LayerProfile(
        [seconds] * layers, [seconds] * layers, [2 * seconds] * layers,
        [nbytes] * layers, [2 * nbytes] * layers,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# validate
# ---------------------------------------------------------------------------------------------


def test_seed_examples_validate() -> None:
    make_plan([range(0, 2), range(2, 4)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
              ).validate(4, "train")  # fmt: skip
    make_plan([range(0, 2), range(2, 4)], []).validate(4, "infer")
    make_plan([range(0, 3)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]).validate(
        4, "fused"
    )
    make_plan([], [range(0, 4)]).validate(4, "fused")  # everything in the fused stage


@pytest.mark.parametrize(
    ("fwd", "bwd", "num_layers", "run_type", "fragment"),
    [
        ([range(0, 2), range(2, 2)], [], 4, "infer", r"fwd_plan\[1\] = range\(2, 2\) is empty"),
        ([range(0, 4, 2)], [], 4, "infer", "must have step 1"),
        ([range(1, 4)], [], 4, "infer", r"fwd_plan\[0\] = range\(1, 4\) must start at layer 0"),
        ([range(0, 2), range(3, 4)], [], 4, "infer", r"must start at fwd_plan\[0\].stop = 2"),
        ([range(0, 2)], [], 4, "infer", r"covers layers \[0, 2\) but the model has 4"),
        ([range(0, 5)], [], 4, "infer", "goes past the model's 4 layers"),
        ([range(0, 4)], [], 4, "train", r"bwd_plan is empty .*auto\('train', model\)"),
        ([range(0, 4)], [range(2, 4), range(0, 1)], 4, "train", r"bwd_plan\[1\] .* must stop at 2"),
        ([range(0, 4)], [range(0, 2), range(2, 4)], 4, "train", r"bwd_plan\[0\] .* must stop at 4"),
        ([range(0, 4)], [range(2, 4)], 4, "infer", "must continue down to layer 0"),
        ([range(0, 4)], [range(0, 4)], 4, "fused", "must stop before the last layer"),
        ([range(0, 2)], [range(3, 4), range(0, 3)], 4, "fused", r"exactly range\(2, 4\)"),
        ([range(0, 2)], [], 4, "fused", "got missing"),
        ([range(0, 2)], [range(2, 4), range(1, 2)], 4, "fused", "down to layer 0"),
        ([range(0, 2)], [range(2, 4)], 0, "fused", "num_layers must be at least 1"),
        ([range(0, 2)], [range(2, 4)], 4, "forward", "run_type must be"),
    ],
)
def test_validate_rejects_each_broken_rule(
    fwd: list[range], bwd: list[range], num_layers: int, run_type: str, fragment: str
) -> None:
    with pytest.raises(ValueError, match=fragment):
        make_plan(fwd, bwd).validate(num_layers, run_type)  # type: ignore[arg-type]


def test_an_inference_plan_with_gradients_on_says_what_to_use(num_devices: int) -> None:
    """An auto('infer') plan given to a call that trains: the error names the model's field and
    what to use instead, and the same plan runs under no_grad."""
    model = RoundPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), name="planned")
    plan = ModelExecutePlan.auto("infer", model)
    assert isinstance(plan, ModelExecutePlan)
    config = RoundPipeRunConfig(execute_plan=plan)
    x = torch.randn(6, 4)
    with pytest.raises(ValueError, match=r"'planned': execute_plan: .*bwd_plan is empty"):
        model(x, roundpipe_run_config=config)
    with torch.no_grad():
        torch.testing.assert_close(model(x, roundpipe_run_config=config), model.model(x))


def test_validate_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="fwd_plan must be a list of range, got tuple"):
        make_plan((range(0, 4),), []).validate(4, "infer")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"bwd_plan\[0\] must be a range, got list"):
        make_plan([range(0, 4)], [[3]]).validate(4, "train")  # type: ignore[list-item]
    with pytest.raises(TypeError, match="num_layers must be an int"):
        make_plan([range(0, 4)], []).validate(4.0, "infer")  # type: ignore[arg-type]


def test_equality_and_repr() -> None:
    a = make_plan([range(0, 2)], [range(2, 3), range(0, 2)])
    b = make_plan([range(0, 2)], [range(2, 3), range(0, 2)])
    assert a == b and a != make_plan([range(0, 2)], [range(2, 3), range(1, 2), range(0, 1)])
    assert a != "plan"
    assert repr(a) == (
        "ModelExecutePlan(fwd_plan=[range(0, 2)], bwd_plan=[range(2, 3), range(0, 2)])"
    )
    assert a.predicted_time is None


# ---------------------------------------------------------------------------------------------
# auto against brute force
# ---------------------------------------------------------------------------------------------


def partitions(begin: int, end: int) -> Iterator[list[range]]:
    """Every way to cut [begin, end) into contiguous non-empty stages, bottom up."""
    if begin == end:
        yield []
        return
    inner = list(range(begin + 1, end))
    for count in range(len(inner) + 1):
        for cuts in itertools.combinations(inner, count):
            bounds = [begin, *cuts, end]
            yield [range(a, b) for a, b in itertools.pairwise(bounds)]


def phase_plans(p: LayerProfile, run_type: str) -> Iterator[list[tuple[float, float]]]:
    """(time, memory) of every stage of every plan of one phase of one model."""
    layers = len(p.forward_seconds)

    def stages(parts: list[range], time: Sequence[float], memory: Sequence[int]) -> list:
        return [(sum(time[i] for i in s), sum(memory[i] for i in s)) for s in parts]

    back = [r + b for r, b in zip(p.recompute_seconds, p.backward_seconds, strict=True)]
    if run_type == "forward":
        for fwd in partitions(0, layers):
            yield stages(fwd, p.forward_seconds, p.forward_bytes)
    elif run_type == "backward":
        for bwd in partitions(0, layers):
            yield stages(bwd, back, p.backward_bytes)
    else:
        fused = [f + b for f, b in zip(p.forward_seconds, p.backward_seconds, strict=True)]
        for k in range(layers):
            for fwd in partitions(0, k):
                for bwd in partitions(0, k):
                    yield (
                        stages(fwd, p.forward_seconds, p.forward_bytes)
                        + stages([range(k, layers)], fused, p.backward_bytes)
                        + stages(bwd, back, p.backward_bytes)
                    )


def brute_phase(
    p: LayerProfile, phase: str, cap: float, min_stages: int, threshold: float
) -> float:
    valid = [plan for plan in phase_plans(p, phase) if all(m <= cap for _, m in plan)]
    lowest = min(max(t for t, _ in plan) for plan in valid)
    # A stage at the threshold fits, however its sum rounds (1e-9: the planner's slack).
    return min(
        max(len(plan), min_stages) * max(t for t, _ in plan)
        for plan in valid
        if max(t for t, _ in plan) <= threshold * lowest * (1 + 1e-9)
    )


def plan_objective(
    plan: ModelExecutePlan, p: LayerProfile, run_type: str, min_stages: int
) -> float:
    fwd = [sum(p.forward_seconds[i] for i in s) for s in plan.fwd_plan]
    back = [r + b for r, b in zip(p.recompute_seconds, p.backward_seconds, strict=True)]
    fused = [f + b for f, b in zip(p.forward_seconds, p.backward_seconds, strict=True)]
    bwd = [
        sum((fused if run_type == "fused" and n == 0 else back)[i] for i in s)
        for n, s in enumerate(plan.bwd_plan)
    ]
    if run_type == "train":
        return max(len(fwd), min_stages) * max(fwd) + max(len(bwd), min_stages) * max(bwd)
    return max(len(fwd) + len(bwd), min_stages) * max(fwd + bwd)


@pytest.mark.parametrize("unit", [1.0, 1e-3], ids=["seconds", "milliseconds"])
@pytest.mark.parametrize("run_type", ["infer", "train", "fused"])
def test_auto_matches_brute_force(run_type: str, unit: float) -> None:
    """In milliseconds the layer times are not exact in binary: stages whose layers add up to
    exactly the threshold (or the slowest layer) must still fit, however the sums round."""
    rng = random.Random(run_type)
    for _ in range(25):
        layers = rng.randint(1, 6)
        forward, recompute, backward = (
            [rng.randint(1, 9) * unit for _ in range(layers)] for _ in range(3)
        )
        nbytes = [rng.randint(1, 4) * GIB // 8 for _ in range(layers)]
        profile = LayerProfile(forward, recompute, backward, nbytes, [2 * b for b in nbytes])
        min_stages = rng.randint(1, 5)
        threshold = rng.choice([1.0, 1.1, 1.5, 3.0, 100.0])
        limit = 2 * max(profile.backward_bytes) / GIB * rng.choice([1.0, 1.5, 3.0])
        plan = ModelExecutePlan.auto(
            run_type, FakeModel(profile), min_stages=min_stages, upper_threshold=threshold,
            model_memory_limit=limit,
        )  # fmt: skip
        assert isinstance(plan, ModelExecutePlan)
        cap = limit * GIB / 2
        if run_type == "train":
            expected = brute_phase(profile, "forward", cap, min_stages, threshold) + brute_phase(
                profile, "backward", cap, min_stages, threshold
            )
        else:
            phase = "forward" if run_type == "infer" else "fused"
            expected = brute_phase(profile, phase, cap, min_stages, threshold)
        assert plan_objective(plan, profile, run_type, min_stages) == pytest.approx(expected)
        stage_bytes = [sum(profile.forward_bytes[i] for i in s) for s in plan.fwd_plan] + [
            sum(profile.backward_bytes[i] for i in s) for s in plan.bwd_plan
        ]
        assert max(stage_bytes) <= cap


@pytest.mark.parametrize(
    ("times", "min_stages", "threshold", "objective"),
    [
        # [3, 5) and [5, 8) add up to exactly 1.5 x the slowest layer
        ([1, 8, 5, 8, 3, 8, 2, 2], 4, 1.5, 4 * 12),
        # [5, 7) adds up to exactly the slowest layer
        ([5, 1, 5, 2, 8, 5, 3], 1, 1.0, 4 * 8),
    ],
)
def test_stages_at_the_threshold_fit_however_their_sums_round(
    times: list[int], min_stages: int, threshold: float, objective: int
) -> None:
    seconds = [t * 1e-3 for t in times]
    profile = LayerProfile(seconds, seconds, seconds, [1000] * len(times), [1000] * len(times))
    plan = ModelExecutePlan.auto(
        "infer", FakeModel(profile), min_stages=min_stages, upper_threshold=threshold,
        model_memory_limit=1.0,
    )  # fmt: skip
    assert isinstance(plan, ModelExecutePlan)
    assert plan_objective(plan, profile, "infer", min_stages) == pytest.approx(objective * 1e-3)


def test_auto_plans_several_models_jointly() -> None:
    first, second = uniform_profile(5), uniform_profile(3)
    plans = ModelExecutePlan.auto("fused", FakeModel(first), FakeModel(second), min_stages=2)
    assert isinstance(plans, list) and len(plans) == 2
    plans[0].validate(5, "train")
    plans[1].validate(3, "fused")
    assert plans[0].predicted_time == plans[1].predicted_time > 0
    # One stage-time bound for both: the slowest stage (3 s: recompute + backward of a layer) caps
    # the first model's forward stages too, which therefore pack three layers.
    assert sorted(len(stage) for stage in plans[0].fwd_plan) == [2, 3]
    trained = ModelExecutePlan.auto("train", FakeModel(first), FakeModel(second), min_stages=2)
    assert isinstance(trained, list)
    for plan, layers in zip(trained, (5, 3), strict=True):
        plan.validate(layers, "train")


@pytest.mark.cpu_devices
def test_predicted_time_is_the_simulated_schedule(num_devices: int) -> None:
    profile = LayerProfile(
        [1.0, 2.0, 1.5, 0.5], [1.0, 2.0, 1.5, 0.5], [2.0, 3.0, 2.0, 1.0],
        [10**8] * 4, [2 * 10**8] * 4,
    )  # fmt: skip
    plan = ModelExecutePlan.auto("fused", FakeModel(profile))
    assert isinstance(plan, ModelExecutePlan)
    back = [r + b for r, b in zip(profile.recompute_seconds, profile.backward_seconds, strict=True)]
    fused = [f + b for f, b in zip(profile.forward_seconds, profile.backward_seconds, strict=True)]
    seconds = [sum(profile.forward_seconds[i] for i in s) for s in plan.fwd_plan] + [
        sum((fused if n == 0 else back)[i] for i in s) for n, s in enumerate(plan.bwd_plan)
    ]
    stages = plan.fwd_plan + plan.bwd_plan
    uploads = [
        sum(profile.forward_bytes[i] for i in s) / ASSUMED_UPLOAD_BYTES_PER_SECOND["cpu"]
        for s in stages
    ]
    expected, _ = _C.simulate_schedule(seconds, num_devices, num_devices + 1, uploads)
    assert plan.predicted_time == pytest.approx(expected)


@pytest.mark.cpu_devices
def test_defaults_are_read_at_call_time(num_devices: int) -> None:
    model = FakeModel(uniform_profile(7))
    assert ModelExecutePlan.auto("fused", model) == ModelExecutePlan.auto(
        "fused", model, min_stages=num_devices, model_memory_limit=default_model_memory_limit()
    )
    host = roundpipe.device.device_total_memory(0)
    assert default_model_memory_limit() == pytest.approx(0.6 * host / num_devices / GIB)


def test_layer_larger_than_half_the_limit_raises_it_with_a_warning() -> None:
    profile = uniform_profile(3, nbytes=GIB // 4)  # backward: 0.5 GB per layer
    big = list(profile.backward_bytes)
    big[2] = 3 * GIB // 4
    profile = LayerProfile(
        profile.forward_seconds, profile.recompute_seconds, profile.backward_seconds,
        profile.forward_bytes, big,
    )  # fmt: skip
    expected = r"layer 2 of decoder needs 0.75 GB .* to 1.5 GB \(\+0.5 GB\)"
    with pytest.warns(UserWarning, match=expected):
        plan = ModelExecutePlan.auto("train", FakeModel(profile, "decoder"), model_memory_limit=1.0)
    assert isinstance(plan, ModelExecutePlan)
    assert all(len(stage) == 1 for stage in plan.bwd_plan)  # two layers never fit 0.75 GB


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "fragment"),
    [
        (("inference",), {}, ValueError, "run_type must be"),
        (("train",), {}, ValueError, "at least one model"),
        (("train", object()), {}, TypeError, "no _layer_profile"),
        (("train", FakeModel(uniform_profile(2))), {"min_stages": 0}, ValueError, "min_stages"),
        (("train", FakeModel(uniform_profile(2))), {"min_stages": 1.5}, TypeError, "min_stages"),
        (("train", FakeModel(uniform_profile(2))), {"upper_threshold": 0.9}, ValueError, ">= 1"),
        (("train", FakeModel(uniform_profile(2))), {"upper_threshold": "1"}, TypeError, "number"),
        (("train", FakeModel(uniform_profile(2))), {"model_memory_limit": 0}, ValueError,
         "positive"),
        (("train", FakeModel(uniform_profile(2))), {"model_memory_limit": float("inf")}, ValueError,
         "finite"),
        (("train", FakeModel(uniform_profile(0))), {}, ValueError, "has no layers"),
        (("train", FakeModel(LayerProfile([1.0], [1.0], [1.0, 2.0], [1], [1]))), {}, ValueError,
         "backward_seconds has 2 entries"),
        (("train", FakeModel(LayerProfile([1.0], [-1.0], [1.0], [1], [1]))), {}, ValueError,
         "recompute_seconds"),
        (("train", FakeModel("not a profile")), {}, TypeError, "must return a LayerProfile"),  # type: ignore[arg-type]
    ],
)  # fmt: skip
def test_auto_rejects_bad_arguments(
    args: tuple[object, ...], kwargs: dict[str, object], error: type[Exception], fragment: str
) -> None:
    with pytest.raises(error, match=fragment):
        ModelExecutePlan.auto(*args, **kwargs)  # type: ignore[arg-type]


def test_simulator_binding() -> None:
    makespan, runs = _C.simulate_schedule([1.0, 2.0, 1.0], 2, 2)
    assert makespan == 6.0
    assert runs[-1] == (2, 1, 0, 5.0, 6.0)
    with pytest.raises(ValueError, match="upload_seconds has 1 entries"):
        _C.simulate_schedule([1.0, 2.0], 2, 2, [0.0])
    with pytest.raises(ValueError, match="num_devices"):
        _C.simulate_schedule([1.0], 0, 2)
