"""roundpipe.optim.Adam with compact moments (state_dtype=torch.bfloat16 / torch.int8).

References here are written from the format's definition (a table of every 8-bit code's value,
plain fp32 Adam in torch ops), never from the code under test."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import roundpipe
import torch
from roundpipe import _C
from roundpipe.optim import Adam
from roundpipe.optim.adam_state import moment_values
from torch import nn

BLOCK = 256
COMPACT = [torch.bfloat16, torch.int8]
ODD_SIZES = [0, 1, 7, 17, 255, 256, 257, 1000, 4099]


def code_table(is_exp_avg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The magnitude codes a moment uses and their values in units of the block scale, from the
    format: code c is the fp16 with bits c << 7 (exponent c >> 3 with bias 15, mantissa c & 7,
    codes below 8 subnormal steps of 2^-17); exp_avg's reach 1.0 at code 120, exp_avg_sq's are
    that fp16 times 2^-15 (1.0 at code 240) and never below code 8."""
    codes = torch.arange(121) if is_exp_avg else torch.arange(8, 241)
    halves = torch.tensor([c << 7 for c in codes.tolist()], dtype=torch.int16).view(torch.float16)
    values = halves.double() * (1.0 if is_exp_avg else 2.0**-15)
    return codes, values


def nearest_codes(values: torch.Tensor, is_exp_avg: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference block-wise encoding (round to nearest, ties to the even code); exp_avg's int8
    codes hold the sign in bit 7 (as int8: magnitude - 128 for a negative value)."""
    codes_used, table = code_table(is_exp_avg)
    flat = values.reshape(-1).double()
    codes = torch.empty(flat.numel(), dtype=torch.int64)
    scales = torch.empty(-(-flat.numel() // BLOCK), dtype=torch.float64)
    for block in range(scales.numel()):
        part = flat[block * BLOCK : (block + 1) * BLOCK]
        scale = part.abs().max().float().double()
        scales[block] = scale
        y = part.abs() / scale if scale > 0 else torch.zeros_like(part)
        above = torch.bucketize(y, table).clamp(max=table.numel() - 1)
        below = (above - 1).clamp(min=0)
        up_closer = (table[above] - y) < (y - table[below])
        tie = (table[above] - y) == (y - table[below])
        chosen = codes_used[
            torch.where(up_closer | (tie & (codes_used[above] % 2 == 0)), above, below)
        ]
        signed = torch.where(torch.signbit(part), chosen - 128, chosen) if is_exp_avg else chosen
        codes[block * BLOCK : block * BLOCK + part.numel()] = signed
    return codes, scales.float()


def spread_values(n: int, seed: int, signed: bool) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    magnitudes = torch.exp(torch.empty(n).uniform_(-25, 0, generator=generator))
    signs = torch.randint(0, 2, (n,), generator=generator) * 2 - 1 if signed else 1
    return (magnitudes * signs).float()


@pytest.mark.parametrize("is_exp_avg", [True, False], ids=["exp_avg", "exp_avg_sq"])
@pytest.mark.parametrize("n", ODD_SIZES)
def test_codes_match_the_formats_nearest_value_and_decode_exactly(is_exp_avg: bool, n: int):
    values = spread_values(n, n, signed=is_exp_avg)
    codes = torch.empty(n, dtype=torch.int8 if is_exp_avg else torch.uint8)
    scales = torch.empty(-(-n // BLOCK))
    _C.quantize_moment(is_exp_avg, values, codes, scales)
    expected_codes, expected_scales = nearest_codes(values, is_exp_avg)
    assert torch.equal(codes.long(), expected_codes)
    assert torch.equal(scales, expected_scales)
    decoded = torch.empty(n)
    _C.dequantize_moment(is_exp_avg, codes, scales, decoded)
    codes_used, table = code_table(is_exp_avg)
    value_of = dict(zip(codes_used.tolist(), table.tolist(), strict=True))
    magnitude = expected_codes.remainder(128) if is_exp_avg else expected_codes
    sign = torch.where(expected_codes < 0, -1.0, 1.0).double()
    block_scale = scales.double().repeat_interleave(BLOCK)[:n]
    values = torch.tensor([value_of[c] for c in magnitude.tolist()], dtype=torch.float64)
    expected = (values * sign * block_scale).float()
    assert torch.equal(decoded, expected)
    # Decoding and encoding again gives the same codes: a loaded state is kept bit for bit.
    again = torch.empty_like(codes)
    _C.quantize_moment(is_exp_avg, decoded, again, scales.clone())
    assert torch.equal(again, codes)


def test_state_dtype_is_validated() -> None:
    param = torch.zeros(3, requires_grad=True)
    with pytest.raises(ValueError, match=r"state_dtype must be torch\.float32, torch\.bfloat16"):
        Adam([param], state_dtype=torch.float16)
    with pytest.raises(TypeError, match=r"state_dtype must be a torch\.dtype"):
        Adam([param], state_dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"amsgrad=True needs state_dtype=torch\.float32"):
        Adam([param], amsgrad=True, state_dtype=torch.int8)
    optimizer = Adam([param], state_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="amsgrad=True needs"):
        optimizer.add_param_group({"params": [torch.zeros(2)], "amsgrad": True})


def reference_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    lr: float,
    weight_decay: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One fp32 AdamW step in plain torch ops (the textbook formula, not our op order)."""
    beta1, beta2, eps = 0.9, 0.999, 1e-8
    param = param * (1 - lr * weight_decay)
    exp_avg = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
    denom = exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5 + eps
    return param - lr / (1 - beta1**step) * exp_avg / denom, exp_avg, exp_avg_sq


@pytest.mark.parametrize("state_dtype", COMPACT, ids=str)
def test_each_step_is_fp32_adam_from_the_decoded_state(state_dtype: torch.dtype) -> None:
    # A step reads the stored moments, runs fp32 AdamW and stores the new moments within one
    # step of their format (stochastic rounding: the neighbour on either side).
    generator = torch.Generator().manual_seed(0)
    param = torch.randn(3 * BLOCK + 5, generator=generator)
    optimizer = Adam(
        [param], lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True, state_dtype=state_dtype
    )
    relative_step = 2.0**-7 if state_dtype == torch.bfloat16 else 2.0**-3
    for step in range(1, 5):
        grad = torch.randn(param.shape, generator=generator) * 10.0**-step
        param.grad = grad
        state = optimizer.state.get(param, {})
        exp_avg = moment_values(state, "exp_avg") if state else torch.zeros_like(param)
        exp_avg_sq = moment_values(state, "exp_avg_sq") if state else torch.zeros_like(param)
        expected = reference_step(param.clone(), grad, exp_avg, exp_avg_sq, step, 1e-2, 0.1)
        optimizer.step()
        torch.testing.assert_close(param, expected[0], rtol=1e-6, atol=1e-7)
        for key, value in zip(("exp_avg", "exp_avg_sq"), expected[1:], strict=True):
            stored = moment_values(optimizer.state[param], key)
            if state_dtype == torch.bfloat16:
                bound = value.abs() * relative_step
            else:  # one code step: relative, or exp_avg's subnormal step, or exp_avg_sq's floor
                block_max = value.abs().reshape(-1)
                block_max = torch.nn.functional.pad(block_max, (0, -block_max.numel() % BLOCK))
                scale = block_max.reshape(-1, BLOCK).amax(1).repeat_interleave(BLOCK)
                tiny = scale[: value.numel()] * 2.0 ** (-17 if key == "exp_avg" else -29)
                bound = torch.maximum(value.abs() * relative_step, tiny)
            assert bool(((stored - value).abs() <= bound * 1.0001 + 1e-30).all()), key


@pytest.mark.parametrize("state_dtype", COMPACT, ids=str)
def test_stochastic_rounding_lets_the_second_moment_decay(state_dtype: torch.dtype) -> None:
    # After one gradient, exp_avg_sq decays by beta2 = 0.999 per step without gradients: a
    # change below half a step of bf16 (and of the 8-bit code), which rounding to nearest
    # would lose every time (v would stay 22% too large after 200 steps).
    n = 1 << 16
    generator = torch.Generator().manual_seed(1)
    param = torch.zeros(n)
    optimizer = Adam([param], lr=1e-3, state_dtype=state_dtype)
    param.grad = torch.randn(n, generator=generator)
    first = param.grad.square() * (1 - 0.999)
    optimizer.step()
    param.grad = torch.zeros(n)
    for _ in range(200):
        optimizer.step()
    decayed = moment_values(optimizer.state[param], "exp_avg_sq").double().sum()
    expected = first.double().sum() * 0.999**200
    assert abs(float(decayed / expected) - 1) < 0.01


SIMD_SCRIPT = """
import sys, torch
from roundpipe.optim import Adam
sizes = [int(s) for s in sys.argv[2].split(",")]
torch.manual_seed(0)
out = {}
for state_dtype in (torch.bfloat16, torch.int8):
    for grad_dtype in (torch.float32, torch.bfloat16):
        params = [torch.randn(n) for n in sizes]
        lowp = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
        optimizer = Adam(params, lr=1e-2, weight_decay=0.1, state_dtype=state_dtype)
        for step in range(3):
            grads = [(torch.randn(n) * 1e3).to(grad_dtype) for n in sizes]
            optimizer.step_fused(grads, grad_scale_inv=1e-3, lowp_params=lowp)
        out[(str(state_dtype), str(grad_dtype))] = (params, lowp, optimizer.state_dict()["state"])
torch.save(out, sys.argv[1])
"""


@pytest.mark.slow
def test_every_simd_level_gives_identical_compact_states(tmp_path: Path) -> None:
    detected = _C.build_info()["simd_detected"]
    levels = ["scalar", "avx2", "avx512"]
    levels = levels[: levels.index(detected) + 1]
    results = []
    for level in levels:
        out = tmp_path / f"{level}.pt"
        result = subprocess.run(
            [sys.executable, "-c", SIMD_SCRIPT, str(out), ",".join(map(str, ODD_SIZES))],
            env={**os.environ, "ROUNDPIPE_SIMD": level},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        results.append(torch.load(out))
    for other in results[1:]:
        for case, (params, lowp, state) in results[0].items():
            their_params, their_lowp, their_state = other[case]
            for a, b in zip(params + lowp, their_params + their_lowp, strict=True):
                assert torch.equal(a, b), case
            for index, entry in state.items():
                for key, value in entry.items():
                    assert torch.equal(value, their_state[index][key]), (case, key)


def test_parallel_chunks_give_the_same_bits_as_one_thread() -> None:
    sizes = [100_003, 7, 65_536 + 300]
    states = []
    for threads in (1, 2):
        roundpipe.optim.set_num_threads(threads)
        try:
            torch.manual_seed(0)
            params = [torch.randn(n) for n in sizes]
            optimizer = Adam(params, state_dtype=torch.int8)
            for _ in range(2):
                for p in params:
                    p.grad = torch.randn(p.shape)
                optimizer.step()
            states.append((params, optimizer.state_dict()["state"]))
        finally:
            roundpipe.optim.set_num_threads(None)
    for a, b in zip(states[0][0], states[1][0], strict=True):
        assert torch.equal(a, b)
    for index, entry in states[0][1].items():
        for key, value in entry.items():
            assert torch.equal(value, states[1][1][index][key]), key


def trained(state_dtype: torch.dtype, steps: int = 3, n: int = 600) -> tuple[Any, Adam]:
    torch.manual_seed(0)
    params = [torch.randn(n), torch.randn(4, 5)]
    optimizer = Adam(params, lr=1e-2, state_dtype=state_dtype)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape)
        optimizer.step()
    return params, optimizer


def legacy_state_dict(optimizer: Adam) -> dict[str, Any]:
    """The state_dict of roundpipe versions that saved 8-bit moments as their codes (the
    optimizer's in-memory form, with the code's tag), deep copied."""
    saved = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    saved["state"] = {
        index: {key: value.clone() for key, value in optimizer.state[p].items()}
        for index, p in enumerate(params)
    }
    return saved


@pytest.mark.parametrize("state_dtype", COMPACT, ids=str)
def test_compact_state_dict_round_trips_bit_for_bit(state_dtype: torch.dtype, tmp_path: Path):
    params, optimizer = trained(state_dtype)
    path = tmp_path / "state.pt"
    torch.save(optimizer.state_dict(), path)
    copies = [p.clone() for p in params]
    loaded = Adam(copies, lr=1e-2, state_dtype=state_dtype)
    loaded.load_state_dict(torch.load(path, weights_only=True))
    for p, q in zip(params, copies, strict=True):
        g = torch.randn(p.shape)
        p.grad, q.grad = g, g.clone()
    optimizer.step()
    loaded.step()
    for p, q in zip(params, copies, strict=True):
        assert torch.equal(p, q)
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, loaded.state[q][key]), key
    if state_dtype == torch.int8:
        assert {key for key in optimizer.state[params[0]]} == {
            "step",
            "exp_avg",
            "exp_avg_sq",
            "exp_avg_scale",
            "exp_avg_sq_scale",
            "int8_code",
        }
        assert optimizer.state[params[0]]["exp_avg"].dtype == torch.int8
        assert optimizer.state[params[0]]["exp_avg_sq"].dtype == torch.uint8


@pytest.mark.parametrize("source", [torch.float32, *COMPACT], ids=str)
@pytest.mark.parametrize("target", [torch.float32, *COMPACT], ids=str)
def test_a_state_of_any_form_loads_into_any_other(source: torch.dtype, target: torch.dtype):
    params, optimizer = trained(source)
    saved = optimizer.state_dict()
    loaded = Adam([p.clone() for p in params], state_dtype=target)
    loaded.load_state_dict(saved)
    for index, param in enumerate(loaded.param_groups[0]["params"]):
        state = loaded.state[param]
        for key in ("exp_avg", "exp_avg_sq"):
            expected = moment_values(saved["state"][index], key)
            got = moment_values(state, key)
            assert got.shape == param.shape
            if target == torch.float32 or target == source:
                torch.testing.assert_close(got, expected, rtol=0, atol=0)
            else:  # rounded to nearest: within half a step of the target's format
                half = 2.0**-8 if target == torch.bfloat16 else 2.0**-4
                scale = expected.abs().max() if target == torch.int8 else 0.0
                bound = expected.abs() * half + scale * 2.0**-17
                assert bool(((got - expected).abs() <= bound).all()), key
    # torch's own Adam takes a compact optimizer's state once it was loaded as fp32.
    fp32 = Adam([p.clone() for p in params])
    fp32.load_state_dict(saved)
    torch.optim.Adam([p.clone() for p in params]).load_state_dict(fp32.state_dict())


@pytest.mark.parametrize("state_dtype", [torch.float32, *COMPACT], ids=str)
def test_state_dict_hooks_see_what_torchs_adam_hooks_see(state_dtype: torch.dtype) -> None:
    # torch's Adam: a state-dict post hook sees (and may replace) the dict state_dict()
    # returns, a load pre hook's result is what loads, a load post hook sees the loaded moments.
    params, optimizer = trained(state_dtype)
    seen: dict[str, Any] = {}

    def halve(_: Any, saved: dict[str, Any]) -> dict[str, Any]:
        seen["saved"] = saved["state"][0]["exp_avg"].dtype
        state = {
            i: {**entry, "exp_avg": entry["exp_avg"] / 2} for i, entry in saved["state"].items()
        }
        return {**saved, "state": state}

    optimizer.register_state_dict_post_hook(lambda _, saved: seen.update(out=saved) or None)
    saved = optimizer.state_dict()
    exported = torch.float32 if state_dtype == torch.int8 else state_dtype  # codes decoded
    assert seen["out"] is saved and saved["state"][0]["exp_avg"].dtype == exported
    loaded = Adam([p.clone() for p in params], lr=1e-2, state_dtype=state_dtype)
    loaded.register_load_state_dict_pre_hook(halve)
    loaded.register_load_state_dict_post_hook(
        lambda opt: seen.update(
            loaded=moment_values(opt.state[opt.param_groups[0]["params"][0]], "exp_avg")
        )
    )
    loaded.load_state_dict(saved)
    assert seen["saved"] == exported
    expected = Adam([p.clone() for p in params], lr=1e-2, state_dtype=state_dtype)
    expected.load_state_dict(halve(None, saved))
    first = expected.param_groups[0]["params"][0]
    assert torch.equal(seen["loaded"], moment_values(expected.state[first], "exp_avg"))


def test_codes_without_their_scales_are_refused_naming_the_key() -> None:
    params, optimizer = trained(torch.int8)
    saved = legacy_state_dict(optimizer)
    del saved["state"][0]["exp_avg_sq_scale"]
    with pytest.raises(ValueError, match="exp_avg_sq_scale"):
        Adam([p.clone() for p in params], state_dtype=torch.float32).load_state_dict(saved)


@pytest.mark.parametrize("code", [None, 1, 3])
def test_codes_in_another_version_of_the_8bit_code_are_refused(code: int | None) -> None:
    params, optimizer = trained(torch.int8)
    saved = legacy_state_dict(optimizer)
    assert saved["state"][0]["int8_code"].item() == 2
    for entry in saved["state"].values():
        if code is None:
            del entry["int8_code"]
        else:
            entry["int8_code"] = torch.tensor(code)
    for state_dtype in (torch.int8, torch.float32):
        with pytest.raises(ValueError, match=r"version .* of roundpipe's 8-bit code"):
            Adam([p.clone() for p in params], state_dtype=state_dtype).load_state_dict(saved)


def test_a_state_saved_as_codes_still_loads_bit_for_bit() -> None:
    params, optimizer = trained(torch.int8)
    loaded = Adam([p.clone() for p in params], lr=1e-2, state_dtype=torch.int8)
    loaded.load_state_dict(legacy_state_dict(optimizer))
    for p, q in zip(params, loaded.param_groups[0]["params"], strict=True):
        for key, value in optimizer.state[p].items():
            assert torch.equal(value, loaded.state[q][key]), key


def reference_decode(codes: torch.Tensor, scales: torch.Tensor, is_exp_avg: bool) -> torch.Tensor:
    """The values 8-bit codes stand for, from the format's table (see code_table)."""
    codes_used, table = code_table(is_exp_avg)
    value_of = dict(zip(codes_used.tolist(), table.tolist(), strict=True))
    flat = codes.reshape(-1).long()
    magnitude = flat.remainder(128) if is_exp_avg else flat
    sign = torch.where(flat < 0, -1.0, 1.0).double()
    values = torch.tensor([value_of[c] for c in magnitude.tolist()], dtype=torch.float64)
    block_scale = scales.double().repeat_interleave(BLOCK)[: flat.numel()]
    return (values * sign * block_scale).float().reshape(codes.shape)


def lockstep(ours: torch.optim.Optimizer, theirs: torch.optim.Optimizer, steps: int) -> None:
    mine = [p for g in ours.param_groups for p in g["params"]]
    reference = [p for g in theirs.param_groups for p in g["params"]]
    generator = torch.Generator().manual_seed(7)
    for _ in range(steps):
        for p, q in zip(mine, reference, strict=True):
            p.grad = torch.randn(p.shape, generator=generator)
            q.grad = p.grad.clone()
        ours.step()
        theirs.step()


@pytest.mark.parametrize("state_dtype", COMPACT, ids=str)
def test_torchs_adam_loads_the_state_dict_and_goes_on_alike(state_dtype: torch.dtype) -> None:
    # state_dict() holds what torch's Adam reads: the moments' values (8-bit ones decoded, as
    # the format defines them), so torch continues the same trajectory as ours.
    params, ours = trained(state_dtype, n=1000)
    saved = ours.state_dict()
    for index, p in enumerate(params):
        state, entry = ours.state[p], saved["state"][index]
        for key in ("exp_avg", "exp_avg_sq"):
            assert entry[key].dtype == (torch.float32 if state_dtype == torch.int8 else state_dtype)
            if state_dtype == torch.int8:
                expected = reference_decode(state[key], state[f"{key}_scale"], key == "exp_avg")
                assert torch.equal(entry[key], expected), key
    start = [p.clone() for p in params]
    theirs = torch.optim.Adam([p.clone() for p in params], lr=1e-2, foreach=False)
    theirs.load_state_dict(saved)
    for index, q in enumerate(theirs.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(theirs.state[q][key], saved["state"][index][key].float())
    lockstep(ours, theirs, steps=5)
    for p, q, s in zip(params, theirs.param_groups[0]["params"], start, strict=True):
        moved = (q - s).abs().mean()
        assert float((p - q).abs().mean()) < 0.05 * float(moved)


@pytest.mark.parametrize("state_dtype", COMPACT, ids=str)
def test_torchs_state_loads_and_goes_on_alike_and_stale_scales_are_not_trusted(
    state_dtype: torch.dtype,
) -> None:
    # A torch Adam that loaded our state and stepped on saves its own moments beside our old
    # block scales, which it carried along unread: the values are encoded afresh.
    params, ours = trained(state_dtype, n=1000)
    theirs = torch.optim.Adam([p.clone() for p in params], lr=1e-2, foreach=False)
    theirs.load_state_dict(ours.state_dict())
    lockstep(ours, theirs, steps=2)
    saved = theirs.state_dict()
    copies = [p.clone() for p in theirs.param_groups[0]["params"]]
    reloaded = Adam(copies, lr=1e-2, state_dtype=state_dtype)
    reloaded.load_state_dict(saved)
    for index, p in enumerate(reloaded.param_groups[0]["params"]):
        for key in ("exp_avg", "exp_avg_sq"):
            expected, got = saved["state"][index][key], moment_values(reloaded.state[p], key)
            half = 2.0**-8 if state_dtype == torch.bfloat16 else 2.0**-4
            scale = expected.abs().max() if state_dtype == torch.int8 else 0.0
            bound = expected.abs() * half + scale * 2.0**-17
            assert bool(((got - expected).abs() <= bound).all()), key
    start = [p.clone() for p in copies]
    lockstep(reloaded, theirs, steps=5)
    for p, q, s in zip(copies, theirs.param_groups[0]["params"], start, strict=True):
        assert float((p - q).abs().mean()) < 0.05 * float((q - s).abs().mean())


def test_a_positive_second_moment_never_decodes_to_zero() -> None:
    # Gradients of 2^-16 beside one of 1 in a block: their exp_avg is still a (subnormal) code,
    # but their exp_avg_sq, 2^-32 of the block's largest, is below the smallest code. Stored as
    # zero it would make the next update m / eps (over a thousand times lr); the floor keeps every
    # update of this and the next step (with zero gradients) within 2 lr.
    lr = 1e-3
    param = torch.zeros(BLOCK)
    optimizer = Adam([param], lr=lr, state_dtype=torch.int8)
    param.grad = torch.full((BLOCK,), 2.0**-16)
    param.grad[0] = 1.0
    optimizer.step()
    assert bool((moment_values(optimizer.state[param], "exp_avg")[1:] > 0).all())
    assert bool((moment_values(optimizer.state[param], "exp_avg_sq")[1:] > 0).all())
    param.grad = torch.zeros(BLOCK)
    optimizer.step()
    assert float(param.abs().max()) <= 2 * lr


ALL_FORMS = [torch.float32, *COMPACT]
# Our weights' distance from torch's after a few steps, per weight on average and at most, in
# units of torch's average movement: float rounding for fp32 moments, and the compact formats'
# (stochastic) rounding, which is larger for 8-bit codes (6% on average at ordinary magnitudes).
TOLERANCE = {torch.float32: (1e-6, 2e-5), torch.bfloat16: (0.01, 0.5), torch.int8: (0.1, 2.0)}


def assert_tracks(mine: torch.Tensor, reference: torch.Tensor, start: torch.Tensor, state_dtype):
    moved = float((reference - start).abs().mean())
    mean, largest = TOLERANCE[state_dtype]
    assert moved > 0
    assert float((mine - reference).abs().mean()) <= mean * moved
    assert float((mine - reference).abs().max()) <= largest * moved


def against_torch(
    state_dtype: torch.dtype, grads: list[torch.Tensor], start: torch.Tensor, lr: float = 1e-2
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our weights and torch's Adam's after a step with each gradient, from ``start``."""
    mine, reference = start.clone(), start.clone()
    ours = Adam([mine], lr=lr, state_dtype=state_dtype)
    theirs = torch.optim.Adam([reference], lr=lr, foreach=False)
    for grad in grads:
        mine.grad, reference.grad = grad.clone(), grad.clone()
        ours.step()
        theirs.step()
    return mine, reference


@pytest.mark.parametrize("state_dtype", ALL_FORMS, ids=str)
@pytest.mark.parametrize("magnitude", [1e-30, 1e-20, 1e-8, 1.0, 1e20, 1.5e20])
def test_gradients_of_any_finite_magnitude_move_the_weights_as_torchs_adam(
    state_dtype: torch.dtype, magnitude: float
) -> None:
    # Adam's step does not depend on the gradients' scale (but for eps): from the tiniest
    # gradients to those whose second moment nears float32's largest value (1e20 squared,
    # accumulated over 20 steps), every form moves the weights as torch's Adam does. Zero
    # weights show even a step of 1e-24 (1e-30 / eps).
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(4 * BLOCK, generator=generator) * magnitude for _ in range(20)]
    start = torch.zeros(4 * BLOCK) if magnitude < 1e-8 else torch.randn(4 * BLOCK)
    mine, reference = against_torch(state_dtype, grads, start)
    assert_tracks(mine, reference, start, state_dtype)


@pytest.mark.parametrize("state_dtype", ALL_FORMS, ids=str)
def test_a_second_moment_that_overflows_freezes_its_weight_as_in_torch(state_dtype: torch.dtype):
    # 1e21 squared overflows float32: torch's exp_avg_sq is inf and the update m / inf is 0, so
    # those weights stay put, while their neighbours' gradients (of 1e19, so that 8-bit codes
    # of their moments' block hold both) move theirs.
    grads = []
    generator = torch.Generator().manual_seed(0)
    for _ in range(5):
        grad = torch.randn(2 * BLOCK, generator=generator) * 1e19
        grad[::7] = 1e21
        grads.append(grad)
    start = torch.randn(2 * BLOCK)
    mine, reference = against_torch(state_dtype, grads, start)
    assert torch.equal(reference[::7], start[::7]) and torch.equal(mine[::7], start[::7])
    assert_tracks(mine, reference, start, state_dtype)


@pytest.mark.parametrize("state_dtype", ALL_FORMS, ids=str)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_gradient_makes_its_weight_nan_and_no_other_as_in_torch(
    state_dtype: torch.dtype, bad: float
) -> None:
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(2 * BLOCK + 44, generator=generator) for _ in range(4)]
    grads[1][3] = bad
    start = torch.randn(2 * BLOCK + 44)
    mine, reference = against_torch(state_dtype, grads, start)
    assert reference.isnan().nonzero().flatten().tolist() == [3]
    assert mine.isnan().nonzero().flatten().tolist() == [3]
    finite = ~reference.isnan()
    assert_tracks(mine[finite], reference[finite], start[finite], state_dtype)


@pytest.mark.parametrize("state_dtype", COMPACT, ids=str)
def test_strided_gradients_are_read_through_a_dense_copy(state_dtype: torch.dtype) -> None:
    param = torch.randn(8, 6)
    reference = param.clone()
    grad = torch.randn(6, 8).t()
    param.grad, reference.grad = grad, grad.contiguous()
    Adam([param], state_dtype=state_dtype).step()
    Adam([reference], state_dtype=state_dtype).step()
    assert torch.equal(param, reference)


# ---- the runtime: async steps, GradScaler skips, clipping, checkpoints, LoRA ------------------

TRAIN = textwrap.dedent(
    """
    import sys, torch, roundpipe
    from torch import nn
    mode, path, state_dtype = sys.argv[1], sys.argv[2], getattr(torch, sys.argv[3])
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(300, 300) for _ in range(3)]).to(torch.float16)
    model = roundpipe.RoundPipe(net, optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-3, state_dtype=state_dtype)
    scaler = roundpipe.GradScaler(init_scale=2.0**8)
    def step_fn(iteration):
        if iteration == 2:  # an overflow: the step is skipped, the state untouched
            next(iter(model.optim_parameters())).grad[0, 0] = float("inf")
        scaler.unscale_(optimizer)
        model.clip_grad_norm_(1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    first = 0
    if mode == "load":
        first = roundpipe.load_checkpoint(path, model, optimizer, scaler)["iteration"]
    for iteration in range(first, 6):
        x = torch.randn(8, 300, generator=torch.Generator().manual_seed(iteration)).half()
        model.forward_backward(
            input_args=(x,), label=x.float(),
            loss_fn=lambda out, y: scaler.scale(((out.float() - y) ** 2).mean()),
        )
        model.step(step_fn, True, iteration)
        if mode == "save" and iteration == 2:
            roundpipe.save_checkpoint(path, model, optimizer, scaler, extra={"iteration": 3})
        if mode == "save" and iteration == 1:
            model.synchronize()
            before = {k: v.clone() for k, v in optimizer.state_dict()["state"][0].items()}
        if mode == "save" and iteration == 2:
            model.synchronize()
            after = optimizer.state_dict()["state"][0]
            assert all(torch.equal(before[k], after[k]) for k in before), "skip changed state"
    model.synchronize()
    torch.save({k: v.clone() for k, v in model.state_dict().items()}, path + "." + mode)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("state_dtype", ["bfloat16", "int8"])
def test_checkpoint_mid_async_training_with_compact_state_continues_bit_identically(
    tmp_path: Path, state_dtype: str
) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    checkpoint = str(tmp_path / "ckpt.pt")
    for mode in ("save", "load"):
        result = subprocess.run(
            [sys.executable, str(script), mode, checkpoint, state_dtype],
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "2"},
        )
        assert result.returncode == 0, result.stderr
    saved, loaded = torch.load(checkpoint + ".save"), torch.load(checkpoint + ".load")
    assert saved.keys() == loaded.keys()
    for name in saved:
        assert torch.equal(saved[name], loaded[name]), name


def test_lora_adapters_train_with_int8_state() -> None:
    torch.manual_seed(0)
    base = nn.Linear(64, 64).requires_grad_(False)
    adapter_a = nn.Parameter(torch.randn(4, 64) * 0.1)
    adapter_b = nn.Parameter(torch.zeros(64, 4))

    class LoRA(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base, self.a, self.b = base, adapter_a, adapter_b

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.a.t() @ self.b.t()

    model = roundpipe.RoundPipe(nn.Sequential(LoRA()))
    optimizer = Adam(model.optim_parameters(), lr=1e-2, state_dtype=torch.int8)
    x, y = torch.randn(16, 64), torch.randn(16, 64)
    losses = []
    for _ in range(20):
        losses.append(
            float(
                model.forward_backward(
                    input_args=(x,), label=y, loss_fn=lambda o, t: ((o - t) ** 2).mean()
                )
            )
        )
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    assert len(optimizer.state) == 2  # the adapters only
    assert losses[-1] < 0.9 * losses[0]


@pytest.mark.slow
def test_data_parallel_int8_state_matches_one_process_and_resumes_at_other_world_sizes(
    tmp_path: Path,
) -> None:
    from test_distributed import _folder, assert_matches, run

    ckpt = str(tmp_path / "ckpt")
    cfg = {"dtype": "fp16", "state_dtype": "int8", "is_async": True}
    _, ref, _ = run(_folder(tmp_path, "ref"), 0, **cfg)
    saved, _, _ = run(_folder(tmp_path, "save"), 2, reference=False, save_at=1, ckpt=ckpt, **cfg)
    # Each rank's pieces have their own blocks: close to one process, not the same bits.
    assert_matches(saved, ref, rtol=0.05, atol=2e-2, norm_rtol=0.05)
    resumed, _, _ = run(
        _folder(tmp_path, "resume2"), 2, reference=False, resume=True, ckpt=ckpt, **cfg
    )
    for ours, theirs in zip(resumed, saved, strict=True):  # same pieces: the same bits
        assert ours is not None and theirs is not None
        for name, value in theirs["params"].items():
            assert torch.equal(ours["params"][name], value), name
    resumed3, _, _ = run(
        _folder(tmp_path, "resume3"), 3, reference=False, resume=True, ckpt=ckpt, **cfg
    )
    assert ref is not None
    assert_matches(
        resumed3, {**ref, "norms": ref["norms"][2:]}, rtol=0.05, atol=2e-2, norm_rtol=0.05
    )
