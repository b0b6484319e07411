"""Drop-in for roundpipe 0.1.1: each test checks one documented contract of 0.1.1 (its docs/API
and docs/UserGuide pages), against plain PyTorch where there is a numerical result."""

from __future__ import annotations

import copy
import importlib
import itertools
import os
import subprocess
import sys
import types
from typing import Any

import pytest
import roundpipe
import torch
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.optim import Adam
from torch import nn

# --------------------------------------------------------------------------------------------
# roundpipe.optim.Adam accepts every parameter torch.optim.Adam accepts on CPU


def mixed_params() -> list[torch.Tensor]:
    """Shapes and kinds torch's Adam takes in one group: empty, one element, matrices, a strided
    view's copy, complex."""
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(0, generator=generator),
        torch.randn(1, generator=generator),
        torch.randn((), generator=generator),
        torch.randn(3, 5, generator=generator),
        torch.randn(17, generator=generator),
        torch.randn(4, 3, generator=generator).t(),  # non-contiguous parameter
        torch.randn(6, dtype=torch.complex64, generator=generator),
        torch.randn(2, 3, dtype=torch.complex64, generator=generator),
    ]


def run_ten_steps(
    ours: torch.optim.Optimizer,
    theirs: torch.optim.Optimizer,
    strided_grads: bool = False,
) -> None:
    mine = [p for g in ours.param_groups for p in g["params"]]
    reference = [p for g in theirs.param_groups for p in g["params"]]
    for step in range(10):
        generator = torch.Generator().manual_seed(100 + step)
        for p, q in zip(mine, reference, strict=True):
            if strided_grads and p.dim() == 1 and p.numel() > 1:
                wide = torch.randn(p.numel() * 2, dtype=p.dtype, generator=generator)
                grad = wide[::2]
            else:
                grad = torch.randn(p.shape, dtype=p.dtype, generator=generator)
            p.grad, q.grad = grad.clone() if not strided_grads else grad, grad.clone()
        ours.step()
        theirs.step()


def assert_matches(
    ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, exact: bool = False
) -> None:
    tolerance = {"atol": 0.0, "rtol": 0.0} if exact else {"atol": 1e-6, "rtol": 1e-6}
    mine = [p for g in ours.param_groups for p in g["params"]]
    reference = [p for g in theirs.param_groups for p in g["params"]]
    for p, q in zip(mine, reference, strict=True):
        torch.testing.assert_close(p, q, **tolerance)
        assert ours.state[p].keys() == theirs.state[q].keys()
        for key, value in theirs.state[q].items():
            assert ours.state[p][key].dtype == value.dtype, key
            torch.testing.assert_close(ours.state[p][key], value, **tolerance)


OPTIONS = [
    {"weight_decay": wd, "amsgrad": ams, "maximize": mx, "decoupled_weight_decay": dec}
    for wd, ams, mx, dec in itertools.product(
        [0.0, 0.1], [False, True], [False, True], [False, True]
    )
]


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_adam_takes_any_cpu_parameter_torch_takes(options: dict[str, Any]) -> None:
    # Contract: roundpipe.optim.Adam is a drop-in for torch.optim.Adam (0.1.1 docs/API/optimizer):
    # complex, 0-d, empty and strided parameters mixed in one group, within 1e-6 over 10 steps.
    params = mixed_params()
    reference = [p.clone() for p in params]
    ours = Adam(params, lr=1e-2, **options)
    theirs = torch.optim.Adam(reference, lr=1e-2, **options)
    run_ten_steps(ours, theirs)
    assert_matches(ours, theirs)


def test_adam_tensor_lr_and_betas_and_strided_gradients() -> None:
    # Contract: lr and betas may be tensors (0.1.1 signature); gradients may be strided views.
    params = [p for p in mixed_params() if not p.is_complex()]
    reference = [p.clone() for p in params]
    hyper: dict[str, Any] = {"betas": (torch.tensor(0.8), torch.tensor(0.99)), "amsgrad": True}
    ours = Adam(params, lr=torch.tensor(5e-3), **hyper)
    theirs = torch.optim.Adam(reference, lr=torch.tensor(5e-3), **hyper)
    run_ten_steps(ours, theirs, strided_grads=True)
    assert_matches(ours, theirs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_low_precision_parameters_match_torch_bit_for_bit(
    dtype: torch.dtype, decoupled: bool
) -> None:
    # Contract: parameters handed over directly in any floating dtype work as with torch's Adam,
    # which computes in the parameter's dtype; ours gives the same bits.
    generator = torch.Generator().manual_seed(3)
    params = [torch.randn(n, generator=generator).to(dtype) for n in (0, 1, 33)]
    params.append(torch.randn(8, generator=generator))  # fp32 beside them in one group
    reference = [p.clone() for p in params]
    hyper: dict[str, Any] = {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": decoupled}
    ours = Adam(params, **hyper)
    theirs = torch.optim.Adam(reference, **hyper)
    run_ten_steps(ours, theirs)
    mine = [p for p in params if p.dtype == dtype]
    expected = [q for q in reference if q.dtype == dtype]
    for p, q in zip(mine, expected, strict=True):
        assert torch.equal(p, q)
        for key, value in theirs.state[q].items():
            assert torch.equal(ours.state[p][key], value), key
    torch.testing.assert_close(params[-1], reference[-1], atol=1e-6, rtol=1e-6)


def test_adam_state_dict_round_trips_with_torch_for_every_kind() -> None:
    # Contract: same state keys and state_dict layout as torch.optim.Adam, loadable both ways.
    params = [*mixed_params(), torch.randn(5).bfloat16()]
    ours = Adam([p.clone() for p in params], lr=1e-2, amsgrad=True)
    theirs = torch.optim.Adam([p.clone() for p in params], lr=1e-2, amsgrad=True)
    run_ten_steps(ours, theirs)
    swapped_ours = Adam([p.detach().clone() for g in theirs.param_groups for p in g["params"]])
    swapped_ours.load_state_dict(copy.deepcopy(theirs.state_dict()))
    swapped_theirs = torch.optim.Adam(
        [p.detach().clone() for g in ours.param_groups for p in g["params"]]
    )
    swapped_theirs.load_state_dict(copy.deepcopy(ours.state_dict()))
    run_ten_steps(swapped_ours, swapped_theirs)
    assert_matches(swapped_ours, swapped_theirs)


def test_adam_still_refuses_real_misuse() -> None:
    # Contract: sparse gradients are not supported (RuntimeError, as torch), nor device params.
    param = torch.zeros(4)
    optimizer = Adam([param])
    param.grad = torch.zeros(4).to_sparse()
    with pytest.raises(RuntimeError, match="sparse gradients"):
        optimizer.step()
    with pytest.raises(ValueError, match="updates CPU parameters"):
        Adam([torch.zeros(2, device="meta")])


# --------------------------------------------------------------------------------------------
# Recompute data (0.1.1 docs/API/context)


def test_get_recompute_data_outside_recompute_is_an_assertion_and_runtime_error() -> None:
    # Contract: "Calling it outside a recomputation context will raise an AssertionError".
    with pytest.raises(AssertionError, match="only available during recompute"):
        roundpipe.get_recompute_data()
    with pytest.raises(RuntimeError, match="only available during recompute"):
        roundpipe.get_recompute_data()


class ReadsWithoutSaving(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if roundpipe.doing_recompute():
            roundpipe.get_recompute_data()
        return super().forward(x)


@pytest.mark.parametrize("error", [AssertionError, RuntimeError])
def test_get_recompute_data_without_a_save_raises_either_type(
    num_devices: int, error: type[Exception]
) -> None:
    # Contract: get_recompute_data returns what save_for_recompute kept; a layer that saved
    # nothing gets an error that code written for 0.1.1's AssertionError catches too.
    model = RoundPipe(nn.Sequential(ReadsWithoutSaving(4, 4), nn.Linear(4, 4)))
    output = model(torch.randn(6, 4))
    with pytest.raises(error, match="saved nothing"):
        output.sum().backward()


class SavesItsInput(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not roundpipe.doing_recompute():
            roundpipe.save_for_recompute(x)
        return super().forward(x)


class SavesAProduct(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not roundpipe.doing_recompute():
            roundpipe.save_for_recompute(self.weight * 2)
        return super().forward(x)


def test_saving_a_tensor_that_requires_grad_raises(num_devices: int) -> None:
    # Contract: "Saved tensors must not require gradients" (0.1.1 raised AssertionError); ours is
    # also a ValueError, as every invalid argument is.
    model = RoundPipe(nn.Sequential(SavesItsInput(4, 4), nn.Linear(4, 4)))
    x = torch.randn(6, 4, requires_grad=True)
    for error in (AssertionError, ValueError):
        with pytest.raises(error, match="requires grad"):
            model(x)
    # The fused last stage runs with grad enabled: the product requires grad there.
    fused = RoundPipe(nn.Sequential(nn.Linear(4, 4), SavesAProduct(4, 4)))
    with pytest.raises(AssertionError, match="requires grad"):
        fused.forward_backward(input_args=(torch.randn(6, 4),), loss_fn=lambda out, _: out.sum())


def test_save_for_recompute_is_a_no_op_without_gradients(num_devices: int) -> None:
    # Contract: "If gradient computation is not currently enabled, this function is a no-op";
    # outside a RoundPipe layer it is a no-op too (as in 0.1.1).
    model = RoundPipe(nn.Sequential(SavesItsInput(4, 4), nn.Linear(4, 4)))
    x = torch.randn(6, 4, requires_grad=True)
    with torch.no_grad():
        expected = model.model(x)
        torch.testing.assert_close(model(x), expected)
    config = RoundPipeRunConfig(requires_grad=False)
    torch.testing.assert_close(model(x, roundpipe_run_config=config), expected)
    roundpipe.save_for_recompute(x)


# --------------------------------------------------------------------------------------------
# Module paths and names (0.1.1 docs/API and docs/Developer/internal_apis)

MODULE_NAMES = {
    "roundpipe": [
        "RoundPipe",
        "RoundPipeRunConfig",
        "ModelExecutePlan",
        "wrap_model_to_roundpipe",
        "GradScaler",
        "OptimizerCtx",
        "save_for_recompute",
        "doing_recompute",
        "get_recompute_data",
        "optim",
        "ModelTimer",
        "__version__",
    ],
    "roundpipe.roundpipe": ["RoundPipe", "AutoRoundPipe", "RoundPipeBase"],
    "roundpipe.run_config": ["RoundPipeRunConfig"],
    "roundpipe.scheduler": ["ModelExecutePlan"],
    "roundpipe.context": [
        "save_for_recompute",
        "doing_recompute",
        "get_recompute_data",
        "OptimizerCtx",
        "doing_optimizer",
    ],
    "roundpipe.grad_scaler": ["GradScaler"],
    "roundpipe.optim": ["Adam"],
    "roundpipe.timer": ["ModelTimer"],
    "roundpipe.profile": ["annotate", "PROFILER_TYPE"],
    "roundpipe.models": ["AutoRoundPipe", "wrap_model", "wrap_model_to_roundpipe"],
    "roundpipe.wrapper": ["wrap_model_to_roundpipe", "AutoRoundPipe", "RoundPipe"],
    "roundpipe.batch": ["RoundPipePackedData", "guess_split_spec", "AvgReducer", "avg_reducer"],
    "roundpipe.device": ["get_num_devices", "get_min_gpu_memory", "get_next_device", "gc_collect"],
    "roundpipe.models.function": ["EXPECTED_MODEL_CLASS", "wrap_model", "CompileForCausalLMLoss"],
}


@pytest.mark.parametrize("module", sorted(MODULE_NAMES))
def test_documented_module_paths_expose_their_names(module: str) -> None:
    # Contract: the module paths 0.1.1 users import from exist with the documented names.
    imported = importlib.import_module(module)
    missing = [name for name in MODULE_NAMES[module] if not hasattr(imported, name)]
    assert not missing, f"{module} lacks {missing}"
    wrapper = importlib.import_module("roundpipe.wrapper")
    assert roundpipe.roundpipe.RoundPipe is wrapper.RoundPipe is RoundPipe
    assert roundpipe.ModelTimer.VERBOSE is False  # documented default


def test_a_bare_import_exposes_the_documented_submodules() -> None:
    # 0.1.1's `import roundpipe` made roundpipe.profile and roundpipe.wrapper attributes; the
    # averaging reducer still loads torch.distributed.pipelining only when it is asked for.
    code = (
        "import sys, roundpipe\n"
        "assert callable(roundpipe.profile.annotate), 'profile'\n"
        "assert roundpipe.wrapper.wrap_model_to_roundpipe is roundpipe.wrap_model_to_roundpipe\n"
        "assert 'torch.distributed.pipelining.microbatch' not in sys.modules, 'pipelining'\n"
        "from roundpipe.batch import AvgReducer, avg_reducer\n"
        "assert isinstance(avg_reducer, AvgReducer)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr


def test_annotate_is_a_no_op_context_manager_and_decorator_without_cuda() -> None:
    # Contract: annotate(name, color=None) returns a context usable with `with` whether or not
    # a profiler is there (0.1.1: nullcontext when not profiling).
    from roundpipe.profile import annotate

    with annotate("block", color="red") as context:
        assert context is not None

    @annotate("function")
    def add_one(value: int) -> int:
        return value + 1

    assert add_one(1) == 2
    with pytest.raises(TypeError, match="name must be a str"):
        annotate(3)  # type: ignore[arg-type]


def test_annotate_opens_and_closes_one_nvtx_range_on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    # Contract: on CUDA the annotated block is one NVTX range (what Nsight Systems shows).
    import sys

    from roundpipe.profile import annotate

    calls: list[tuple[str, ...]] = []
    monkeypatch.setitem(sys.modules, "nvtx", None)  # torch's own NVTX binding
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda name: calls.append(("push", name)))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: calls.append(("pop",)))
    with annotate("layer 0"):
        calls.append(("body",))
    with pytest.raises(KeyError), annotate("failing"):
        raise KeyError("x")
    assert calls == [("push", "layer 0"), ("body",), ("pop",), ("push", "failing"), ("pop",)]


VERBOSE_LINE = r"^Layer \d+ (fwd|re|bwd)  new record: \d+\.\d{3} ms  new estimate: \d+\.\d{3} ms$"


def test_verbose_timer_prints_the_documented_lines(
    num_devices: int, capsys: pytest.CaptureFixture[str]
) -> None:
    # Contract: ModelTimer.VERBOSE prints "Layer {i} {action}  new record: {t:.3f} ms  new
    # estimate: {t:.3f} ms" to stderr for the layers and actions timed.
    import re

    model = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)))
    roundpipe.ModelTimer.VERBOSE = True
    try:
        model.forward_backward(input_args=(torch.randn(6, 4),), loss_fn=lambda out, _: out.sum())
    finally:
        roundpipe.ModelTimer.VERBOSE = False
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and all(re.match(VERBOSE_LINE, line) for line in lines), lines
    seen = {tuple(line.split()[1:3]) for line in lines}
    assert {(str(i), "fwd") for i in range(3)} <= seen
    assert {(str(i), "bwd") for i in range(3)} <= seen


# --------------------------------------------------------------------------------------------
# Wrapping models (0.1.1 docs/API/model: wrap_model_to_roundpipe, AutoRoundPipe; internal APIs)


class TwoBranch(nn.Module):
    """Not a Sequential: two parametrised branches and a parameterless activation."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.a(x)) + 2 * self.b(x)


def two_branch_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(6, 8, generator=generator), torch.randn(6, 8, generator=generator)


def mse(model: nn.Module, seed: int) -> torch.Tensor:
    x, y = two_branch_batch(seed)
    return nn.functional.mse_loss(model(x), y)


def assert_same_params(wrapped: nn.Module, reference: nn.Module, grads: bool) -> None:
    ours = {n.replace(".model.", "."): p for n, p in wrapped.model.named_parameters()}
    theirs = dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, param in theirs.items():
        torch.testing.assert_close(
            ours[name].grad if grads else ours[name], param.grad if grads else param, msg=name
        )


def test_recursive_rule_wraps_children_of_a_two_branch_root(num_devices: int) -> None:
    # Contract: own params >= lower_threshold bytes or total <= upper_threshold -> RoundPipe;
    # total < lower_threshold -> num_microbatch=1; the root becomes an AutoRoundPipe over them.
    torch.manual_seed(0)
    reference = TwoBranch()
    wrapped = roundpipe.wrap_model_to_roundpipe(
        copy.deepcopy(reference), lower_threshold=1, upper_threshold=1
    )
    assert isinstance(wrapped, roundpipe.roundpipe.AutoRoundPipe)
    assert isinstance(wrapped.a, RoundPipe) and isinstance(wrapped.b, RoundPipe)
    assert isinstance(wrapped.act, RoundPipe) and wrapped.act.model_run_config.num_microbatch == 1
    assert wrapped.a.model_run_config.num_microbatch is None
    mse(wrapped, 0).backward()
    mse(reference, 0).backward()
    wrapped.synchronize()
    assert_same_params(wrapped, reference, grads=True)


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_optimizer_ctx_and_step_train_the_wrapped_tree_as_plain_pytorch(
    num_devices: int, is_async: bool
) -> None:
    # Contract: under OptimizerCtx, parameters() are the optimizer copies; step(step_fn) updates
    # them (asynchronously with staleness 1) and synchronize() publishes the weights.
    torch.manual_seed(0)
    reference = TwoBranch()
    wrapped = roundpipe.wrap_model_to_roundpipe(
        copy.deepcopy(reference), lower_threshold=1, upper_threshold=1
    )
    with roundpipe.OptimizerCtx():
        optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    steps = 3
    for seed in range(steps):
        mse(wrapped, seed).backward()
        wrapped.step(step_fn, is_async=is_async)
        if is_async:
            wrapped.synchronize()  # train every iteration on the newest weights, as the reference
        mse(reference, seed).backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    wrapped.synchronize()
    assert_same_params(wrapped, reference, grads=False)


def test_thresholds_count_bytes() -> None:
    # Contract: lower_threshold is in bytes: a float32 Linear(4, 4) (20 parameters, 80 bytes)
    # is wrapped from lower_threshold=80, not from 20.
    def wrap(lower: int, dtype: torch.dtype = torch.float32) -> nn.Module:
        model = nn.Module()
        model.a = nn.Linear(4, 4).to(dtype)
        model.forward = lambda x: model.a(x)
        return roundpipe.wrap_model_to_roundpipe(model, lower_threshold=lower, upper_threshold=0)

    assert isinstance(wrap(80).a, RoundPipe)
    assert not isinstance(wrap(81).a, RoundPipe)
    assert isinstance(wrap(160, torch.float64).a, RoundPipe)


def test_skip_modules_takes_module_instances(num_devices: int) -> None:
    # Contract: skip_modules=[model.b] keeps that module unwrapped (it runs on the host).
    torch.manual_seed(0)
    reference = TwoBranch()
    model = copy.deepcopy(reference)
    wrapped = roundpipe.wrap_model_to_roundpipe(
        model, lower_threshold=1, upper_threshold=1, skip_modules=[model.b]
    )
    assert isinstance(wrapped.a, RoundPipe)
    assert type(wrapped.b) is nn.Linear and wrapped.b.weight.device.type == "cpu"
    mse(wrapped, 0).backward()
    mse(reference, 0).backward()
    wrapped.synchronize()
    assert_same_params(wrapped, reference, grads=True)


def test_override_config_takes_module_to_run_config() -> None:
    # Contract: override_config={module: RoundPipeRunConfig} is the run config of that module's
    # RoundPipe.
    model = TwoBranch()
    config = RoundPipeRunConfig(num_microbatch=2)
    wrapped = roundpipe.wrap_model_to_roundpipe(
        model, lower_threshold=1, upper_threshold=1, override_config={model.a: config}
    )
    assert repr(wrapped.a.model_run_config) == repr(config)  # a snapshot of it, as in 0.1.1
    assert repr(wrapped.b.model_run_config) != repr(config)


def test_auto_roundpipe_constructs_from_one_module(num_devices: int) -> None:
    # Contract: AutoRoundPipe(model, name=None, optim_dtype=None, **kwargs) wraps a model whose
    # submodules are RoundPipes; forward, backward and step behave as the plain model.
    from roundpipe.roundpipe import AutoRoundPipe

    torch.manual_seed(0)
    reference = TwoBranch()
    model = copy.deepcopy(reference)
    model.a = RoundPipe(model.a)
    wrapped = AutoRoundPipe(model, "two-branch", torch.float32, pin_model="off")
    assert wrapped.name == "two-branch" and [path for path, _ in wrapped.parts] == ["a"]
    optimizer = torch.optim.SGD(wrapped.optim_parameters(), lr=0.1)
    assert len(optimizer.param_groups[0]["params"]) == 4  # a's two and b's two (host glue)
    mse(wrapped, 0).backward()
    wrapped.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    mse(reference, 0).backward()
    torch.optim.SGD(reference.parameters(), lr=0.1).step()
    assert_same_params(wrapped, reference, grads=False)
    plain = AutoRoundPipe(TwoBranch())  # no RoundPipe inside: everything is host glue
    assert plain.parts == [] and plain.name == "TwoBranch"
    with pytest.raises(TypeError, match="unexpected keyword"):
        AutoRoundPipe(TwoBranch(), num_microbatch=2)


def test_auto_roundpipe_forwards_attributes_as_a_roundpipe() -> None:
    # Contract: AutoRoundPipe reads, writes and deletes attributes on original_model if set,
    # else on the wrapped model, as RoundPipe does.
    from roundpipe.roundpipe import AutoRoundPipe

    inner = TwoBranch()
    inner.tag = "inner"
    wrapped = AutoRoundPipe(inner)
    assert wrapped.tag == "inner"
    wrapped.tag = "written"
    assert inner.tag == "written"
    del wrapped.tag
    assert not hasattr(inner, "tag")
    original = nn.Module()
    original.vocab_size = 7
    wrapped.set_original_model(original)
    assert wrapped.vocab_size == 7
    wrapped.flag = True
    assert original.flag is True and inner.flag is True
    del wrapped.flag
    assert not hasattr(original, "flag") and not hasattr(inner, "flag")


def test_wrap_model_without_a_preset_raises_not_implemented() -> None:
    # Contract: roundpipe.models.wrap_model raises NotImplementedError for a model type without
    # a sequential preset.
    from roundpipe.models import wrap_model

    with pytest.raises(NotImplementedError, match="preset"):
        wrap_model(TwoBranch())


def per_row_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((prediction - target) ** 2).mean(dim=1)


def test_wrap_model_runs_a_function_as_a_roundpipe(num_devices: int) -> None:
    # Contract: SUPPORTED_MODELS["function"] is the module of the "function" preset:
    # wrap_model(function) is a RoundPipe running the function, microbatch by microbatch.
    from roundpipe.models import SUPPORTED_MODELS, function, wrap_model

    module = importlib.import_module(SUPPORTED_MODELS["function"], "roundpipe.models")
    assert module is function and function.EXPECTED_MODEL_CLASS is types.FunctionType
    wrapped = wrap_model(per_row_mse)
    assert isinstance(wrapped, RoundPipe) and wrapped.name == "per_row_mse"
    torch.manual_seed(0)
    prediction, target = torch.randn(6, 3, requires_grad=True), torch.randn(6, 3)
    reference = prediction.detach().clone().requires_grad_()
    out = wrapped(prediction, target, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3))
    expected = per_row_mse(reference, target)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    torch.testing.assert_close(prediction.grad, reference.grad)
    with pytest.raises(NotImplementedError, match="FunctionType"):
        function.wrap_model(nn.Linear(2, 2))  # type: ignore[arg-type]


def test_preset_lookup_with_none_prints_a_line(capsys: pytest.CaptureFixture[str]) -> None:
    # Contract: use_sequential_preset=None prints a message when a preset replaces the model;
    # True and False print nothing.
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    roundpipe.wrap_model_to_roundpipe(transformers.LlamaForCausalLM(config))
    assert "[INFO]" in capsys.readouterr().err
    roundpipe.wrap_model_to_roundpipe(
        transformers.LlamaForCausalLM(config), use_sequential_preset=True
    )
    assert "[INFO]" not in capsys.readouterr().err


def test_doing_optimizer_reports_optimizer_ctx() -> None:
    # Contract: roundpipe.context.doing_optimizer() is True exactly inside OptimizerCtx.
    from roundpipe.context import OptimizerCtx, doing_optimizer

    assert not doing_optimizer()
    with OptimizerCtx():
        assert doing_optimizer()
    assert not doing_optimizer()


# --------------------------------------------------------------------------------------------
# Parameters and buffers as a layer sees them


class SeesItsParameters(nn.Linear):
    """Records ``requires_grad`` of its parameters in every forward pass (recompute included)."""

    def __init__(self) -> None:
        super().__init__(4, 4)
        self.bias.requires_grad_(False)
        self.seen: list[tuple[bool, bool]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.weight.requires_grad, self.bias.requires_grad))
        return super().forward(x)


def test_parameters_keep_requires_grad_in_every_stage(num_devices: int) -> None:
    # 0.1.1 ran layers on device copies of the parameters with their requires_grad flags; a
    # layer that checks the flag sees the parameter's, in inference too.
    model = RoundPipe(nn.Sequential(SeesItsParameters(), nn.Tanh(), SeesItsParameters()))
    x = torch.randn(6, 4)
    model(x).sum().backward()
    model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum())
    with torch.no_grad():
        model(x)
    for layer in (model.model[0], model.model[2]):
        assert layer.seen and set(layer.seen) == {(True, False)}


def mse_sum(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).sum()


class BranchesOnGradMode(nn.Linear):
    """Doubles its output when grad mode is on: what plain PyTorch's training loop runs with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = super().forward(x)
        return y * 2 if torch.is_grad_enabled() else y


class SeesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[bool, bool, int]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not roundpipe.doing_recompute():
            edges = len(x.grad_fn.next_functions) if x.grad_fn is not None else -1
            self.seen.append((x.requires_grad, x.is_leaf, edges))
        return x.relu_()  # in place, as on a plain activation


def test_training_forward_runs_in_grad_mode_as_plain_pytorch(num_devices: int) -> None:
    # Contract: forward_backward is the per-microbatch loop forward -> loss -> backward, which
    # plain PyTorch (and 0.1.1) runs in grad mode: a layer that branches on it computes the same
    # in every stage, and in forward() with gradients; inference runs without.
    torch.manual_seed(5)
    net = nn.Sequential(nn.Linear(4, 4), BranchesOnGradMode(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(net)
    model = RoundPipe(net)
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 2), range(2, 3)], [range(3, 4), range(0, 3)]
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum, run_config=config)
    pairs = zip(x.tensor_split(2), y.tensor_split(2), strict=True)
    expected = torch.stack([mse_sum(reference(xm), ym) for xm, ym in pairs]).sum()
    expected.backward()
    assert torch.allclose(loss, expected.detach())
    out = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))
    assert torch.allclose(out, torch.cat([reference(xm) for xm in x.tensor_split(2)]))
    mse_sum(out, y).backward()
    mse_sum(torch.cat([reference(xm) for xm in x.tensor_split(2)]), y).backward()
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    with torch.no_grad():
        assert torch.allclose(model(x), reference(x))


def test_a_forward_stage_passes_activations_that_require_grad_and_keep_no_graph(
    num_devices: int,
) -> None:
    # As in plain PyTorch a layer's input requires grad and is no leaf (so it may be changed in
    # place); the graph that made it is not kept (the recompute rebuilds it).
    seer = SeesItsInput()
    model = RoundPipe(nn.Sequential(nn.Linear(4, 4), seer, nn.Linear(4, 1)))
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 2)], [range(2, 3), range(0, 2)]
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    model.forward_backward(
        input_args=(torch.randn(6, 4),), loss_fn=lambda o, _: o.sum(), run_config=config
    )
    assert seer.seen == [(True, False, 0), (True, False, 0)]


def test_saving_a_product_that_requires_grad_raises_in_a_forward_stage(num_devices: int) -> None:
    # The forward stages of forward_backward run in grad mode too, so 0.1.1's check holds there.
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [range(0, 1)], [range(1, 2), range(0, 1)]
    model = RoundPipe(nn.Sequential(SavesAProduct(4, 4), nn.Linear(4, 4)))
    with pytest.raises(AssertionError, match="requires grad"):
        model.forward_backward(
            input_args=(torch.randn(6, 4),),
            loss_fn=lambda out, _: out.sum(),
            run_config=RoundPipeRunConfig(execute_plan=plan),
        )


class SavesItsWeight(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        roundpipe.save_for_recompute(self.weight)
        return super().forward(x)


def test_saving_a_parameter_for_recompute_raises_in_a_forward_stage(num_devices: int) -> None:
    # The parameter requires grad (0.1.1 refused it as any such tensor); saving .detach() works.
    model = RoundPipe(nn.Sequential(SavesItsWeight(4, 4), nn.Linear(4, 4)))
    with pytest.raises(ValueError, match="requires grad"):
        model(torch.randn(6, 4))


class CountsThroughData(nn.Module):
    """Advances a buffer through ``.data`` (which leaves the tensor's version counter alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.count.data.add_(1)
        return x * 2


def test_buffer_updates_through_data_are_kept(num_devices: int) -> None:
    model = RoundPipe(nn.Sequential(CountsThroughData(), nn.Linear(4, 4), CountsThroughData()))
    config = RoundPipeRunConfig(num_microbatch=3)
    model.forward_backward(
        input_args=(torch.randn(6, 4),), loss_fn=lambda out, _: out.sum(), run_config=config
    )
    # Once per microbatch in the forward (fused last stage included), never in recompute.
    assert model.model[0].count.item() == 3 and model.model[2].count.item() == 3
    with torch.no_grad():
        model(torch.randn(6, 4), roundpipe_run_config=config)
    assert model.model[0].count.item() == 6 and model.model[2].count.item() == 6


@pytest.mark.parametrize("how", ["forward_backward", "forward"])
def test_a_batch_smaller_than_num_microbatch_runs_one_row_per_microbatch(
    num_devices: int, how: str
) -> None:
    # 0.1.1 split as torch.distributed.pipelining does: 3 rows and 8 microbatches make 3 (a
    # short last batch against the default of devices + 1 on a large machine).
    torch.manual_seed(6)
    net = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    reference = copy.deepcopy(net)
    model = RoundPipe(net, model_run_config=RoundPipeRunConfig(num_microbatch=8))
    x, y = torch.randn(3, 4), torch.randn(3, 2)
    rows = zip(x.tensor_split(3), y.tensor_split(3), strict=True)
    if how == "forward_backward":
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
        expected = torch.zeros(())
        for xm, ym in rows:  # the per-microbatch loop forward_backward is
            one = mse_sum(reference(xm), ym)
            one.backward()
            expected = expected + one.detach()
        assert torch.equal(loss, expected)
    else:
        out = model(x)
        assert torch.equal(out, torch.cat([reference(xm) for xm, _ in rows]))
        out.sum().backward()
        torch.cat([reference(xm) for xm in x.tensor_split(3)]).sum().backward()
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)


def test_input_args_may_be_a_list(num_devices: int) -> None:
    # 0.1.1 only warned about a list (a collate function's batch); it runs as the tuple.
    torch.manual_seed(7)
    model = RoundPipe(nn.Sequential(nn.Linear(4, 2)))
    x = torch.randn(4, 4)
    assert torch.equal(
        model.forward_backward(input_args=[x], loss_fn=lambda out, _: out.sum()),
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum()),
    )


def test_forward_backward_without_gradients_raises_what_0_1_1_asserted(num_devices: int) -> None:
    model = RoundPipe(nn.Sequential(nn.Linear(4, 2)))
    for error in (AssertionError, RuntimeError):
        with torch.no_grad(), pytest.raises(error, match="requires_grad resolved to False"):
            model.forward_backward(input_args=(torch.randn(4, 4),))
    with pytest.raises(AssertionError, match="requires_grad resolved to False"):
        model.forward_backward(
            input_args=(torch.randn(4, 4),), run_config=RoundPipeRunConfig(requires_grad=False)
        )


def test_run_configs_and_plans_are_snapshots(num_devices: int) -> None:
    # 0.1.1 deep-copied the model's run config and a config's plan: changing them afterwards
    # changes nothing already built.
    config = RoundPipeRunConfig(num_microbatch=2)
    model = RoundPipe(nn.Sequential(nn.Linear(4, 2)), model_run_config=config)
    config.num_microbatch = 4
    calls: list[int] = []

    def counting(out: torch.Tensor, _: Any) -> torch.Tensor:
        calls.append(1)
        return out.sum()

    model.forward_backward(input_args=(torch.randn(4, 4),), loss_fn=counting)
    assert len(calls) == 2
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = [], [range(0, 1)]
    with_plan = RoundPipeRunConfig(execute_plan=plan)
    plan.bwd_plan = [range(0, 2)]
    assert with_plan.execute_plan is not None and with_plan.execute_plan.bwd_plan == [range(0, 1)]


# --------------------------------------------------------------------------------------------
# Internal APIs 0.1.1 documents (docs/Developer/internal_apis)


def test_roundpipe_reports_its_layers_and_timer(num_devices: int) -> None:
    # Contract: num_layers, layer_size (each layer's parameters and buffers in GB of 10**9
    # bytes), model_timer (the per-layer timings); both wrappers derive from RoundPipeBase.
    layers = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))
    model = RoundPipe(copy.deepcopy(layers))
    assert model.num_layers == 4
    sizes = [
        sum(t.numel() * t.element_size() for t in layer.state_dict().values()) / 1e9
        for layer in layers
    ]
    assert model.layer_size == pytest.approx(sizes) and sizes[1] > 0 and sizes[2] == 0
    assert isinstance(model.model_timer, roundpipe.timer.ModelTimer)
    assert model.model_timer.estimate(0, "fwd") is None
    model.forward_backward(input_args=(torch.randn(16, 4),), loss_fn=lambda out, _: out.sum())
    assert all(model.model_timer.estimate(i, "fwd") is not None for i in range(4))
    with pytest.raises(NotImplementedError, match="synchronize"):
        model.layer_attrs  # noqa: B018
    base = roundpipe.roundpipe.RoundPipeBase
    assert isinstance(model, base) and issubclass(base, nn.Module)
    assert isinstance(roundpipe.roundpipe.AutoRoundPipe(nn.Sequential(model)), base)


def test_sync_optim_param_writes_the_step_into_the_model(num_devices: int) -> None:
    # Contract: sync_optim_param() copies the optimizer's results into the parameters (here
    # after an asynchronous step), without publishing gradients.
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model = RoundPipe(copy.deepcopy(reference))
    optimizer = Adam(model.optim_parameters(), lr=0.1)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.1)
    x, y = torch.randn(6, 4), torch.randn(6, 2)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse_sum)
    model.step(lambda: optimizer.step(), is_async=True)
    mse_sum(reference(x), y).backward()
    reference_optimizer.step()
    model.sync_optim_param()
    for got, want in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want)
        assert got.grad is None
    # It waits for the step, so step_fn (on the optimizer thread) cannot call it.
    with pytest.raises(RuntimeError, match="called from step_fn"):
        model.step(model.sync_optim_param, is_async=False)


def test_device_helpers_of_0_1_1(num_devices: int) -> None:
    # get_min_gpu_memory(): the smallest device memory in GB (2**30 bytes), 60% of which is
    # ModelExecutePlan.auto's default model_memory_limit; virtual CPU devices share the host's.
    from roundpipe import device

    if roundpipe.device_kind() == "cuda":
        indices = {d.index for d in roundpipe.devices()}
        smallest = min(torch.cuda.get_device_properties(i).total_memory for i in indices)
    else:
        smallest = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / num_devices
    assert device.get_min_gpu_memory() == pytest.approx(smallest / 2**30)
    limit = roundpipe.scheduler.default_model_memory_limit()
    assert limit == pytest.approx(0.6 * device.get_min_gpu_memory())
    assert device.gc_collect() is None
    # 0.1.1's per-GPU device managers do not exist here: a clear error naming what to use.
    with pytest.raises(NotImplementedError, match=r"roundpipe\.devices\(\)"):
        device.get_next_device()
    for name in ("device_list", "cur_device"):
        with pytest.raises(NotImplementedError, match=rf"{name}: .*device_count"):
            getattr(device, name)
    with pytest.raises(AttributeError):
        device.no_such_name  # noqa: B018


def test_grad_scaler_enabled_is_a_read_only_attribute() -> None:
    assert roundpipe.GradScaler().enabled is True
    scaler = roundpipe.GradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.enabled is False and scaler.scale(loss) is loss  # disabled: a no-op
    with pytest.raises(AttributeError):
        scaler.enabled = True  # type: ignore[misc]


def test_check_valid_takes_the_documented_plans() -> None:
    # The user guide's plans for a 4-layer model: forward(), then forward_backward().
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(0, 2), range(2, 4)]
    plan.bwd_plan = [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
    plan.check_valid(4, "train")
    plan.check_valid(4, "infer")
    with pytest.raises(ValueError, match="fused"):
        plan.check_valid(4, "fused")
    plan.fwd_plan = [range(0, 3)]
    plan.check_valid(4, "fused")
    with pytest.raises(ValueError, match="cover"):
        plan.check_valid(4, "train")
