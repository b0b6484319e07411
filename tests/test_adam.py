"""roundpipe.optim.Adam and the host gradient kernels against plain PyTorch."""

from __future__ import annotations

import copy
import itertools
import os
import pickle
import subprocess
import sys
import textwrap
import warnings

import pytest
import roundpipe.optim.adam as rp_optim
import torch
from roundpipe import _C
from roundpipe.optim import Adam
from torch.optim.adam import adam as torch_functional_adam

SIZES = [0, 1, 7, 17, 1000, 4099, 1 << 20]
OPTIONS = [
    {"weight_decay": wd, "amsgrad": ams, "maximize": mx, "decoupled_weight_decay": dec}
    for wd, ams, mx, dec in itertools.product(
        [0.0, 0.1], [False, True], [False, True], [False, True]
    )
]


def make_params(sizes: list[int], seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=generator) for n in sizes]


def grads_for(params: list[torch.Tensor], step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


def run_both(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, steps: int) -> None:
    mine = [p for g in ours.param_groups for p in g["params"]]
    reference = [p for g in theirs.param_groups for p in g["params"]]
    for step in range(steps):
        for p, q, g in zip(mine, reference, grads_for(reference, step), strict=True):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        theirs.step()


def assert_same_optimizer_state(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer) -> None:
    mine = [p for g in ours.param_groups for p in g["params"]]
    reference = [p for g in theirs.param_groups for p in g["params"]]
    for p, q in zip(mine, reference, strict=True):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-6)
        assert ours.state[p].keys() == theirs.state[q].keys()
        for key, value in theirs.state[q].items():
            assert ours.state[p][key].dtype == value.dtype, key
            torch.testing.assert_close(ours.state[p][key], value, atol=1e-6, rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_matches_torch_adam_for_every_option(options: dict[str, object]) -> None:
    reference = make_params(SIZES)
    mine = [p.clone() for p in reference]
    ours = Adam(mine, lr=1e-2, **options)
    theirs = torch.optim.Adam(reference, lr=1e-2, foreach=False, **options)
    run_both(ours, theirs, steps=12)
    assert_same_optimizer_state(ours, theirs)


@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_matches_torch_adamw_and_torch_vectorised_paths(implementation: str) -> None:
    reference = make_params([4099, 17, 1])
    mine = [p.clone() for p in reference]
    ours = Adam(mine, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05, decoupled_weight_decay=True)
    theirs = torch.optim.AdamW(
        reference, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.05, **{implementation: True}
    )
    run_both(ours, theirs, steps=10)
    assert_same_optimizer_state(ours, theirs)


def test_tensor_lr_and_betas_scheduler_and_param_groups() -> None:
    reference = make_params([1000, 7, 33])
    mine = [p.clone() for p in reference]

    def groups(params: list[torch.Tensor]) -> list[dict[str, object]]:
        return [
            {"params": params[:2]},
            {
                "params": params[2:],
                "amsgrad": True,
                "betas": (torch.tensor(0.3), torch.tensor(0.9)),
            },
        ]

    lr = torch.tensor(0.02)
    ours = Adam(groups(mine), lr=lr.clone(), betas=(torch.tensor(0.9), torch.tensor(0.99)))
    theirs = torch.optim.Adam(
        groups(reference),
        lr=lr.clone(),
        betas=(torch.tensor(0.9), torch.tensor(0.99)),
        foreach=False,
    )
    schedulers = [
        torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (ours, theirs)
    ]
    for step in range(10):
        run_both(ours, theirs, steps=1)
        for scheduler in schedulers:
            scheduler.step()
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"], step
    assert_same_optimizer_state(ours, theirs)


def test_params_without_grad_are_skipped_like_torch() -> None:
    reference = make_params([10, 10])
    mine = [p.clone() for p in reference]
    ours, theirs = Adam(mine), torch.optim.Adam(reference, foreach=False)
    for optimizer, params in ((ours, mine), (theirs, reference)):
        params[0].grad = torch.ones(10)
        optimizer.step()
    assert_same_optimizer_state(ours, theirs)
    assert not ours.state.get(mine[1]) and not theirs.state.get(reference[1])


SIMD_SCRIPT = """
import sys, torch
from roundpipe import _C
from roundpipe.optim import Adam
assert _C.build_info()["simd_active"] == sys.argv[1], _C.build_info()
torch.manual_seed(0)
params = [torch.randn(n) for n in (0, 1, 7, 17, 1000, 4099)]
lowp = [torch.empty(p.shape, dtype=torch.bfloat16) for p in params]
optimizer = Adam(params, lr=1e-2, amsgrad=True, weight_decay=0.1)
for step in range(5):
    grads = [torch.randn(p.shape).to(torch.float16) for p in params]
    optimizer.step_fused(grads, grad_scale_inv=0.5, lowp_params=lowp)
torch.save({"params": params, "lowp": lowp, "state": optimizer.state_dict()}, sys.argv[2])
"""


@pytest.mark.slow
def test_every_simd_level_gives_identical_results(tmp_path: object) -> None:
    detected = _C.build_info()["simd_detected"]
    levels = ["scalar", "avx2", "avx512"]
    levels = levels[: levels.index(detected) + 1]
    results = []
    for level in levels:
        out = os.path.join(str(tmp_path), f"{level}.pt")
        result = subprocess.run(
            [sys.executable, "-c", SIMD_SCRIPT, level, out],
            env={**os.environ, "ROUNDPIPE_SIMD": level},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        results.append(torch.load(out))
    for other in results[1:]:
        for a, b in zip(
            results[0]["params"] + results[0]["lowp"], other["params"] + other["lowp"], strict=True
        ):
            assert torch.equal(a, b)
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
            for index, state in results[0]["state"]["state"].items():
                assert torch.equal(state[key], other["state"]["state"][index][key])


def test_state_dict_round_trips_with_torch_both_ways() -> None:
    reference = make_params([100, 7])
    mine = [p.clone() for p in reference]
    ours = Adam(mine, lr=1e-2, amsgrad=True)
    theirs = torch.optim.Adam(reference, lr=1e-2, amsgrad=True, foreach=False)
    run_both(ours, theirs, steps=3)
    ours_sd, theirs_sd = ours.state_dict(), theirs.state_dict()
    # Same keys and values; torch's foreach=False was passed only to pin its reference path.
    # Ours also holds state_dtype, which torch's Adam carries along unread.
    assert [
        {**g, "foreach": None, "state_dtype": torch.float32} for g in theirs_sd["param_groups"]
    ] == ours_sd["param_groups"]
    assert ours_sd["state"].keys() == theirs_sd["state"].keys()
    for index, state in theirs_sd["state"].items():
        assert ours_sd["state"][index].keys() == state.keys()
        assert ours_sd["state"][index]["step"].dtype == state["step"].dtype

    # Ours -> torch and torch -> ours, then both continue in lockstep with fresh references.
    swapped_theirs = torch.optim.Adam([p.clone() for p in mine], lr=1, foreach=False)
    # Deep copies, as a save and load would make: load_state_dict may share the tensors.
    swapped_theirs.load_state_dict(copy.deepcopy(ours_sd))
    swapped_ours = Adam([p.clone() for p in reference], lr=1)
    swapped_ours.load_state_dict(copy.deepcopy(theirs_sd))
    run_both(swapped_ours, swapped_theirs, steps=4)
    run_both(ours, theirs, steps=4)
    assert_same_optimizer_state(swapped_ours, theirs)
    assert_same_optimizer_state(ours, swapped_theirs)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("inv_scale", [1.0 / 1024, 1.0 / 3.0])
def test_fused_step_is_bit_identical_to_the_unfused_path(
    grad_dtype: torch.dtype, lowp_dtype: torch.dtype, inv_scale: float
) -> None:
    sizes = [0, 1, 7, 17, 4099, 100_003]
    fused_params = make_params(sizes)
    plain_params = [p.clone() for p in fused_params]
    fused = Adam(fused_params, lr=1e-2, weight_decay=0.01)
    plain = Adam(plain_params, lr=1e-2, weight_decay=0.01)
    lowp = [torch.empty(n, dtype=lowp_dtype) for n in sizes]
    for step in range(4):
        grads = [(g * 1000).to(grad_dtype) for g in grads_for(fused_params, step)]
        assert fused.step_fused(grads, grad_scale_inv=inv_scale, lowp_params=lowp)
        for p, g in zip(plain_params, grads, strict=True):
            p.grad = g.float() * inv_scale
        plain.step()
        for p, q, out in zip(fused_params, plain_params, lowp, strict=True):
            assert torch.equal(p, q)
            assert torch.equal(out, q.to(lowp_dtype))


@pytest.mark.parametrize("lowp_dtype", [torch.bfloat16, torch.float16])
def test_low_precision_write_back_rounds_exactly_like_torch(lowp_dtype: torch.dtype) -> None:
    # lr = 0 leaves the weights as they are, so the write-back converts exactly these values.
    bits = torch.arange(0, 1 << 16, 7, dtype=torch.int32).to(torch.int16)
    values = torch.cat(
        [
            torch.randn(5000) * 10.0 ** torch.randint(-9, 6, (5000,)),
            bits.view(lowp_dtype).float(),
            bits.view(lowp_dtype).float() * (1 + 2.0**-9),  # near and at rounding ties
            torch.tensor([65520.0, 65519.0, 7e4, 3e38, -3e38, 1e-40, 2.0**-25, 2.0**-24 * 1.5]),
        ]
    )
    values = values[torch.isfinite(values) | torch.isinf(values)]
    param = values.clone()
    out = torch.empty(values.shape, dtype=lowp_dtype)
    optimizer = Adam([param], lr=0.0)
    optimizer.step_fused([torch.ones_like(param)], lowp_params=[out])
    expected = values.to(lowp_dtype)
    nan = torch.isnan(expected)
    assert torch.equal(torch.isnan(out), nan)
    assert torch.equal(out[~nan].view(torch.int16), expected[~nan].view(torch.int16))


def test_fused_step_skips_on_inf_and_fused_writeback_context() -> None:
    params = make_params([50, 20])
    optimizer = Adam(params, lr=1e-2)
    before = [p.clone() for p in params]
    bad = [torch.ones(50, dtype=torch.bfloat16), torch.ones(20, dtype=torch.bfloat16)]
    bad[1][19] = float("inf")
    assert not optimizer.step_fused(bad)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    assert len(optimizer.state) == 0

    targets = {params[0]: torch.empty(50, dtype=torch.bfloat16)}
    params[0].grad = torch.ones(50)
    params[1].grad = torch.ones(20)
    with rp_optim.fused_writeback(targets) as written:
        optimizer.step()
    assert set(written) == {params[0]} and written[params[0]] == params[0]._version
    assert torch.equal(targets[params[0]], params[0].to(torch.bfloat16))
    optimizer.step()  # outside the context nothing is written back
    assert not torch.equal(targets[params[0]], params[0].to(torch.bfloat16))


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [0, 1, 7, 17, 4099, 300_001])
def test_grad_accumulate_matches_torch_and_detects_non_finite(
    src_dtype: torch.dtype, n: int
) -> None:
    src = (torch.randn(n) * 100).to(src_dtype)
    dst = torch.randn(n)
    expected = dst + src.float()
    assert _C.grad_accumulate(dst, src, False)
    assert torch.equal(dst, expected)
    assert _C.grad_accumulate(dst, src, True)
    assert torch.equal(dst, src.float())
    assert _C.all_finite([src, src])
    for position in {0, n // 2, n - 1} if n else set():
        for bad in (float("inf"), float("-inf"), float("nan")):
            poisoned = src.clone()
            poisoned[position] = bad
            assert not _C.grad_accumulate([dst, dst.clone()], [src, poisoned], False)
            assert not _C.all_finite([src, poisoned])
            assert _C.grad_accumulate([dst], [src], False)


@pytest.mark.slow
def test_optimizer_threads_follow_affinity_and_local_ranks_not_torch_and_exit_cleanly() -> None:
    # torchrun sets OMP_NUM_THREADS=1 for several ranks per machine; the optimizer ignores it.
    script = """
        import os, torch
        from roundpipe import _C, optim
        torch.set_num_threads(1)
        params = [torch.randn(2_000_000)]
        params[0].grad = torch.randn(2_000_000)
        optimizer = optim.Adam(params)
        os.sched_setaffinity(0, [min(os.sched_getaffinity(0))])
        optimizer.step()
        print(optim.get_num_threads(), _C.optimizer_threads_started())
        os.sched_setaffinity(0, range(os.cpu_count()))
        optimizer.step()
        print(optim.get_num_threads(), _C.optimizer_threads_started())
        optim.set_num_threads(3)
        print(optim.get_num_threads())
        optim.set_num_threads(None)
        print(optim.get_num_threads())
    """
    cpus = os.cpu_count() or 1
    for env, per_rank in (({}, cpus), ({"LOCAL_WORLD_SIZE": "2"}, max(1, cpus // 2))):
        result = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(script)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "OMP_NUM_THREADS": "1", **env},
        )
        assert result.returncode == 0, result.stderr
        lines = [list(map(int, line.split())) for line in result.stdout.splitlines()]
        assert lines[0] == [1, 0]  # one CPU allowed: no helper thread
        assert lines[1] == [per_rank, per_rank - 1]
        assert lines[2:] == [[3], [per_rank]]


@pytest.mark.slow
def test_optimizer_threads_environment_override_is_checked() -> None:
    script = "from roundpipe import optim; print(optim.get_num_threads())"
    for value, expected in (("3", "3"), ("zero", "ROUNDPIPE_OPTIMIZER_THREADS must be")):
        result = subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "ROUNDPIPE_OPTIMIZER_THREADS": value},
        )
        assert expected in result.stdout + result.stderr
    with pytest.raises(ValueError, match="at least 1"):
        rp_optim.set_num_threads(0)
    with pytest.raises(TypeError, match="int or None"):
        rp_optim.set_num_threads(2.0)  # type: ignore[arg-type]


def test_in_place_updates_bump_version_counters() -> None:
    param = torch.randn(10)
    param.grad = torch.randn(10)
    optimizer = Adam([param])
    version = param._version
    optimizer.step()
    assert param._version > version


def test_foreach_and_fused_warn_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rp_optim, "_warned", set())
    with pytest.warns(UserWarning, match="ignores foreach="):
        Adam([torch.zeros(1)], foreach=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Adam([torch.zeros(1)], foreach=False)
    with pytest.warns(UserWarning, match="ignores fused="):
        Adam([torch.zeros(1)], fused=True)


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"lr": -1.0}, ValueError, "Invalid learning rate"),
        ({"lr": torch.tensor([1.0, 2.0])}, ValueError, "Tensor lr must be 1-element"),
        ({"eps": -1.0}, ValueError, "Invalid epsilon value"),
        ({"betas": (1.0, 0.9)}, ValueError, "Invalid beta parameter at index 0"),
        ({"betas": (0.9, -0.1)}, ValueError, "Invalid beta parameter at index 1"),
        ({"betas": (torch.tensor(0.9), 0.9)}, ValueError, "both floats or both Tensors"),
        ({"weight_decay": -0.1}, ValueError, "Invalid weight_decay value"),
        ({"capturable": True}, ValueError, "capturable=True"),
        ({"differentiable": True}, ValueError, "differentiable=True"),
        ({"fused": True, "foreach": True}, ValueError, "`fused` and `foreach` cannot be"),
    ],
)
def test_invalid_hyper_parameters(kwargs: dict[str, object], error: type, fragment: str) -> None:
    with pytest.raises(error, match=fragment):
        Adam([torch.zeros(3)], **kwargs)  # type: ignore[arg-type]


def test_invalid_tensors_are_rejected_before_any_group_is_updated() -> None:
    # A host optimizer: a parameter on another device is misuse (meta stands in for CUDA here).
    with pytest.raises(ValueError, match="updates CPU parameters"):
        Adam([torch.zeros(3, device="meta")])
    first, second = torch.zeros(4), torch.zeros(4)
    optimizer = Adam([{"params": [first]}, {"params": [second]}])
    # torch refuses such .grad assignments, but step_fused takes gradients as they come.
    for bad, error, fragment in [
        (torch.ones(4, dtype=torch.float64), TypeError, "float32, bfloat16, float16"),
        (torch.ones(5), ValueError, "has 5 elements"),
    ]:
        with pytest.raises(error, match=fragment):
            optimizer.step_fused([torch.ones(4), bad])
    assert torch.equal(first, torch.zeros(4)) and len(optimizer.state) == 0
    with pytest.raises(ValueError, match=r"pass one \(or None\) per parameter"):
        optimizer.step_fused([torch.ones(4)])
    with pytest.raises(TypeError, match="bfloat16, float16"):
        optimizer.step_fused([torch.ones(4), None], lowp_params=[torch.empty(4), None])


def test_native_entry_points_name_the_bad_argument() -> None:
    p, g, m, v, s = torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(3), torch.zeros(())
    hyper = {
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
        "amsgrad": False,
        "maximize": False,
        "decoupled_weight_decay": False,
    }
    cases = [
        (([p], [g], [m], [v], None, [s.int()]), ValueError, r"steps\[0\] must be a one-element"),
        (([p], [g], [m.double()], [v], None, [s]), TypeError, r"exp_avgs\[0\] must be float32"),
        (([p], [g], [m], [v], None, [s, s]), ValueError, "steps has 2 tensors but params has 1"),
        (([p], [torch.zeros(3, device="meta")], [m], [v], None, [s]), ValueError, "CPU tensor"),
    ]
    for args, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            _C.adam_step(*args, **hyper)
    with pytest.raises(ValueError, match="max_exp_avg_sqs is required"):
        _C.adam_step([p], [g], [m], [v], None, [s], **{**hyper, "amsgrad": True})
    assert float(s) == 0.0  # nothing ran
    with pytest.raises(ValueError, match="dsts has 2 tensors"):
        _C.grad_accumulate([m, v], [g], True)


def test_a_step_saved_as_a_number_loads_as_in_torch() -> None:
    """torch < 1.12 saved ``step`` as a Python number; torch.optim.Adam.__setstate__ (run by
    load_state_dict) turns it into a tensor, and the run goes on."""
    reference = make_params([7, 100])
    mine = [p.clone() for p in reference]
    ours = Adam(mine, lr=1e-2, amsgrad=True)
    theirs = torch.optim.Adam(reference, lr=1e-2, amsgrad=True, foreach=False)
    run_both(ours, theirs, steps=2)
    for optimizer in (ours, theirs):
        legacy = copy.deepcopy(optimizer.state_dict())
        for state in legacy["state"].values():
            state["step"] = int(state["step"])
        optimizer.load_state_dict(legacy)
    for p, q in zip(mine, reference, strict=True):
        assert torch.is_tensor(ours.state[p]["step"])
        assert ours.state[p]["step"].dtype == theirs.state[q]["step"].dtype
    run_both(ours, theirs, steps=2)
    assert_same_optimizer_state(ours, theirs)


def test_another_optimizers_state_is_refused_where_torch_refuses_it() -> None:
    """SGD's momentum state has no ``step``: torch.optim.Adam.load_state_dict raises
    ``KeyError: 'step'`` (not the first step() with ``KeyError: 'exp_avg'``)."""
    params = make_params([7])
    sgd = torch.optim.SGD(params, lr=0.1, momentum=0.9)
    params[0].grad = torch.ones(7)
    sgd.step()
    errors = []
    for adam in (torch.optim.Adam, Adam):
        with pytest.raises(KeyError) as error:
            adam([params[0].clone()]).load_state_dict(copy.deepcopy(sgd.state_dict()))
        errors.append(error.value.args)
    assert errors[0] == errors[1] == ("step",)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("param_kind", ["strided float32", "float64"])
def test_torchs_adam_path_unscales_in_float32_as_the_native_pass(
    grad_dtype: torch.dtype, param_kind: str
) -> None:
    """Parameters the native pass does not take (torch's single-tensor Adam updates them) get
    their gradients unscaled as step_fused documents, as an fp32 (or wider) copy: unscaled in
    bf16/fp16, a scaled 1e-9 underflows to 0 in fp16 and every product rounds to bf16/fp16."""
    generator = torch.Generator().manual_seed(0)
    if param_kind == "float64":
        start = torch.randn(4, 6, generator=generator, dtype=torch.float64)
    else:
        start = torch.randn(6, 4, generator=generator).t()  # not contiguous
    mine, reference = start.clone(), start.clone()
    if param_kind != "float64":
        mine, reference = start.t().clone().t(), start.t().clone().t()
    assert mine.is_contiguous() == (param_kind == "float64")
    ours = Adam([mine], lr=1e-2)
    theirs = torch.optim.Adam([reference], lr=1e-2, foreach=False)
    inv_scale = 1.0 / 3.0 / 2.0**15  # not a power of two: the product rounds
    for step in range(3):
        true = torch.randn(4, 6, generator=generator) * 10.0 ** torch.randint(-9, 0, (4, 6))
        grad = (true / inv_scale).to(grad_dtype)
        assert ours.step_fused([grad], grad_scale_inv=inv_scale)
        reference.grad = grad.to(reference.dtype) * inv_scale
        theirs.step()
        assert torch.equal(mine, reference), step


def copied(optimizer: torch.optim.Optimizer, how: str, tmp_path: object) -> torch.optim.Optimizer:
    """A copy of ``optimizer`` (its parameters copied with it) made as a user would make one."""
    if how == "deepcopy":
        return copy.deepcopy(optimizer)
    if how == "pickle":
        return pickle.loads(pickle.dumps(optimizer))  # type: ignore[no-any-return]
    path = os.path.join(str(tmp_path), "optimizer.pt")
    torch.save(optimizer, path)
    return torch.load(path, weights_only=False)  # type: ignore[no-any-return]


@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_copies_of_the_optimizer_keep_every_setting_and_step_on(
    how: str, state_dtype: torch.dtype, tmp_path: object
) -> None:
    """torch's optimizers survive deepcopy, pickle and torch.save (their settings live in
    ``defaults`` and ``param_groups``); so does ours, state_dtype included, and the copy steps
    on exactly as the original does, as torch's copy does."""
    reference = make_params([600, 7])
    mine = [p.clone() for p in reference]
    options = {"lr": 1e-2, "weight_decay": 0.1, "decoupled_weight_decay": True}
    ours = Adam(mine, **options, state_dtype=state_dtype)  # type: ignore[arg-type]
    theirs = torch.optim.Adam(reference, **options, foreach=False)  # type: ignore[arg-type]
    run_both(ours, theirs, steps=2)
    ours_copy, theirs_copy = copied(ours, how, tmp_path), copied(theirs, how, tmp_path)
    assert ours_copy.defaults == ours.defaults and ours_copy.defaults["state_dtype"] == state_dtype
    assert [{**g, "params": None} for g in ours_copy.param_groups] == [
        {**g, "params": None} for g in ours.param_groups
    ]
    run_both(ours, theirs, steps=2)
    run_both(ours_copy, theirs_copy, steps=2)
    for optimizer, other in ((ours, ours_copy), (theirs, theirs_copy)):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        copies = [p for g in other.param_groups for p in g["params"]]
        for p, q in zip(params, copies, strict=True):
            assert torch.equal(p, q)
            for key, value in optimizer.state[p].items():
                assert torch.equal(value, other.state[q][key]), key
    if state_dtype == torch.float32:
        assert_same_optimizer_state(ours_copy, theirs_copy)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8], ids=str)
def test_an_optimizer_pickled_without_state_dtype_keeps_the_form_of_its_moments(
    state_dtype: torch.dtype,
) -> None:
    # One pickled before state_dtype was a group option holds it nowhere: its moments tell, and
    # the revived optimizer steps on exactly as the original does (fp32 also as torch's does).
    reference = make_params([600])
    mine = [p.clone() for p in reference]
    ours = Adam(mine, lr=1e-2, state_dtype=state_dtype)
    theirs = torch.optim.Adam(reference, lr=1e-2, foreach=False)
    run_both(ours, theirs, steps=2)
    old = copy.deepcopy(ours.__getstate__())  # type: ignore[no-untyped-call]
    old["defaults"] = {k: v for k, v in old["defaults"].items() if k != "state_dtype"}
    old["param_groups"] = [
        {k: v for k, v in g.items() if k != "state_dtype"} for g in old["param_groups"]
    ]
    revived = Adam.__new__(Adam)
    revived.__setstate__(old)
    assert revived.state_dtype == state_dtype
    assert revived.param_groups[0]["state_dtype"] == state_dtype
    copies = revived.param_groups[0]["params"]
    for step in range(2):
        for p, q, r in zip(mine, copies, reference, strict=True):
            p.grad = grads_for(mine, step)[0]
            q.grad, r.grad = p.grad.clone(), p.grad.clone()
        for optimizer in (ours, revived, theirs):
            optimizer.step()
    for p, q in zip(mine, copies, strict=True):
        assert torch.equal(p, q)
        for key, value in ours.state[p].items():
            assert torch.equal(value, revived.state[q][key]), key
    if state_dtype == torch.float32:
        assert_same_optimizer_state(revived, theirs)


def test_each_param_group_keeps_its_own_state_dtype_and_a_change_converts_it() -> None:
    reference = make_params([1000, 300])
    mine = [p.clone() for p in reference]
    ours = Adam(
        [{"params": mine[:1]}, {"params": mine[1:], "state_dtype": torch.int8}],
        lr=1e-2,
    )
    theirs = torch.optim.Adam(reference, lr=1e-2, foreach=False)
    run_both(ours, theirs, steps=3)
    assert ours.state[mine[0]]["exp_avg"].dtype == torch.float32
    assert ours.state[mine[1]]["exp_avg"].dtype == torch.int8
    torch.testing.assert_close(mine[0], reference[0], atol=1e-6, rtol=1e-6)
    # Back to fp32: the int8 moments are decoded at the next step, which then goes on as torch's
    # Adam does from the same state (which it loads decoded from our state_dict).
    ours.param_groups[1]["state_dtype"] = torch.float32
    restarted = torch.optim.Adam(
        [{"params": [mine[0].clone()]}, {"params": [mine[1].clone()]}], lr=1e-2, foreach=False
    )
    restarted.load_state_dict(copy.deepcopy(ours.state_dict()))
    for key in ("exp_avg_scale", "exp_avg_sq_scale"):  # carried along unread by torch
        restarted.state[restarted.param_groups[1]["params"][0]].pop(key)
    run_both(ours, restarted, steps=3)
    assert set(ours.state[mine[1]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert_same_optimizer_state(ours, restarted)
    with pytest.raises(ValueError, match=r"state_dtype must be torch\.float32"):
        ours.add_param_group({"params": [torch.zeros(2)], "state_dtype": torch.float16})
    with pytest.raises(ValueError, match=r"amsgrad=True needs state_dtype=torch\.float32"):
        ours.add_param_group(
            {"params": [torch.zeros(2)], "amsgrad": True, "state_dtype": torch.bfloat16}
        )


# ---- roundpipe.optim.adam.adam: the functional form ------------------------------------------


def functional_inputs(
    sizes: list[int], dtype: torch.dtype = torch.float32, amsgrad: bool = False
) -> dict[str, list[torch.Tensor]]:
    params = [p.to(dtype) for p in make_params(sizes)]
    return {
        "params": params,
        "grads": [g.to(dtype) for g in grads_for(params, 0)],
        "exp_avgs": [torch.zeros_like(p) for p in params],
        "exp_avg_sqs": [torch.zeros_like(p) for p in params],
        "max_exp_avg_sqs": [torch.zeros_like(p) for p in params] if amsgrad else [],
        "state_steps": [torch.tensor(0.0) for _ in params],
    }


@pytest.mark.parametrize(
    "options", OPTIONS, ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items())
)
def test_functional_adam_matches_torchs_functional_adam(options: dict[str, object]) -> None:
    amsgrad = bool(options["amsgrad"])
    ours = functional_inputs(SIZES, amsgrad=amsgrad)
    theirs = copy.deepcopy(ours)
    hyper = {"beta1": 0.9, "beta2": 0.99, "lr": 1e-2, "eps": 1e-8, **options}
    for step in range(5):
        grads = grads_for(ours["params"], step)
        ours["grads"], theirs["grads"] = grads, [g.clone() for g in grads]
        rp_optim.adam(**ours, **hyper)  # type: ignore[arg-type]
        torch_functional_adam(**theirs, **hyper, foreach=False)  # type: ignore[arg-type]
    for key, values in theirs.items():
        for mine, expected in zip(ours[key], values, strict=True):
            torch.testing.assert_close(mine, expected, atol=1e-6, rtol=1e-6)
    assert all(float(s) == 5.0 for s in ours["state_steps"])


def test_functional_adam_steps_the_class_and_torchs_other_tensors_alike() -> None:
    # The class's step is this same step: fp32 parameters natively, any other through torch's
    # own code (bit for bit), bf16 moments of an fp32 parameter as the compact state.
    hyper = {"amsgrad": False, "beta1": 0.9, "beta2": 0.999, "lr": 1e-2, "eps": 1e-8}
    hyper.update({"weight_decay": 0.0, "maximize": False})
    for dtype in (torch.bfloat16, torch.float64, torch.complex64):
        ours = functional_inputs([17, 300], dtype=dtype)
        theirs = copy.deepcopy(ours)
        rp_optim.adam(**ours, **hyper)  # type: ignore[arg-type]
        torch_functional_adam(**theirs, **hyper, foreach=False)  # type: ignore[arg-type]
        for key, values in theirs.items():
            for mine, expected in zip(ours[key], values, strict=True):
                assert torch.equal(mine, expected), (dtype, key)
    inputs = functional_inputs([1000])
    inputs["exp_avgs"] = [torch.zeros(1000, dtype=torch.bfloat16)]
    inputs["exp_avg_sqs"] = [torch.zeros(1000, dtype=torch.bfloat16)]
    param = inputs["params"][0].clone()
    optimizer = Adam([param], lr=1e-2, state_dtype=torch.bfloat16)
    param.grad = inputs["grads"][0].clone()
    optimizer.step()
    rp_optim.adam(**inputs, **hyper)  # type: ignore[arg-type]
    assert torch.equal(inputs["params"][0], param)
    assert torch.equal(inputs["exp_avg_sqs"][0], optimizer.state[param]["exp_avg_sq"])


def test_functional_adam_refuses_what_it_cannot_do() -> None:
    hyper = {"amsgrad": False, "beta1": 0.9, "beta2": 0.999, "lr": 1e-2, "eps": 1e-8}
    hyper.update({"weight_decay": 0.0, "maximize": False})
    cases: list[tuple[dict[str, object], type, str]] = [
        ({"capturable": True}, ValueError, "capturable=True"),
        ({"differentiable": True}, ValueError, "differentiable=True"),
        ({"grad_scale": torch.tensor(2.0)}, ValueError, "does not take grad_scale"),
        ({"found_inf": torch.tensor(0.0)}, ValueError, "does not take found_inf"),
        ({"amsgrad": True}, ValueError, "max_exp_avg_sqs has 0 tensors"),
    ]
    for extra, error, fragment in cases:
        inputs = functional_inputs([5])
        with pytest.raises(error, match=fragment):
            rp_optim.adam(**inputs, **{**hyper, **extra})  # type: ignore[arg-type]
        assert float(inputs["state_steps"][0]) == 0.0  # nothing ran
    inputs = functional_inputs([5])
    inputs["state_steps"] = [1]  # type: ignore[list-item]
    with pytest.raises(RuntimeError, match="singleton tensors"):
        rp_optim.adam(**inputs, **hyper)  # type: ignore[arg-type]
    assert rp_optim.Adam is Adam  # 0.1.1's module path still names the class
