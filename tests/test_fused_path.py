"""The fused host path: RoundPipe's optimizer copies receive their gradients lazily, and
``roundpipe.optim.Adam`` (alone or through ``GradScaler``) reads them straight from the gradient
arena in its update pass. Everything is compared with plain PyTorch or with the unfused path."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import roundpipe
import torch
from reference import MICROBATCHES, batches, master_step, mse, plain_grads
from roundpipe import GradScaler, RoundPipe, RoundPipeRunConfig
from roundpipe.optim.copies import OptimizerCopy
from torch import nn

CONFIG = RoundPipeRunConfig(num_microbatch=MICROBATCHES)


def mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


class _Spy:
    """Stands in for ``roundpipe._C`` in ``roundpipe.optim``, recording the gradient dtypes that
    reach the native Adam kernel."""

    def __init__(self, native: Any) -> None:
        self._native = native
        self.grad_dtypes: list[set[torch.dtype]] = []  # one set per call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._native, name)

    def adam_step(self, params: Any, grads: list[torch.Tensor], *args: Any, **kwargs: Any) -> Any:
        self.grad_dtypes.append({grad.dtype for grad in grads})
        return self._native.adam_step(params, grads, *args, **kwargs)


@pytest.fixture
def casts(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """Dtypes of the pending gradients that were cast into ``.grad`` during the test."""
    seen: list[torch.dtype] = []
    resolve = OptimizerCopy.resolve_grad

    def counting(self: OptimizerCopy) -> None:
        if self._pending_grad is not None:
            seen.append(self._pending_grad.dtype)
        resolve(self)

    monkeypatch.setattr(OptimizerCopy, "resolve_grad", counting)
    return seen


def test_adam_reads_bf16_gradients_from_the_arena_without_casting(
    num_devices: int, casts: list[torch.dtype], monkeypatch: pytest.MonkeyPatch
) -> None:
    spy = _Spy(roundpipe.optim.adam._C)
    monkeypatch.setattr(roundpipe.optim.adam, "_C", spy)
    reference = mlp(torch.bfloat16)
    model = RoundPipe(copy.deepcopy(reference), optim_dtype=torch.float32)
    ours = roundpipe.optim.Adam(model.optim_parameters(), lr=0.01)
    masters = [p.detach().float().requires_grad_(True) for p in reference.parameters()]
    theirs = roundpipe.optim.Adam(masters, lr=0.01)
    for x, y in batches(3, torch.bfloat16):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        plain_grads(reference, x, y)
        master_step(reference, masters, theirs)
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)
    assert casts == []
    # Calls alternate: ours (bf16 gradients straight from the arena), then the reference's.
    assert spy.grad_dtypes == [{torch.bfloat16}, {torch.float32}] * 3


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "GradScaler"])
def test_an_fp64_models_fp32_copies_step_as_after_casting_the_gradients(
    num_devices: int, casts: list[torch.dtype], scaled: bool
) -> None:
    """The native pass does not read fp64 gradients: they are cast into the copies' fp32 .grad,
    as the unfused path (and the reference) casts them, so the step is bit for bit that path's
    (not torch's single-tensor Adam, which rounds differently)."""
    reference = mlp(torch.float64)
    model = RoundPipe(copy.deepcopy(reference), optim_dtype=torch.float32)
    ours = roundpipe.optim.Adam(model.optim_parameters(), lr=0.01)
    masters = [p.detach().float().requires_grad_(True) for p in reference.parameters()]
    theirs = roundpipe.optim.Adam(masters, lr=0.01)
    scaler = GradScaler(init_scale=2.0**4)

    def step_fn() -> None:
        if scaled:
            scaler.step(ours)
            scaler.update()
        else:
            ours.step()
        ours.zero_grad()

    for x, y in batches(3, torch.float64):
        loss_fn = (lambda o, t: scaler.scale(mse(o, t))) if scaled else mse
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=CONFIG)
        model.step(step_fn, is_async=False)
        plain_grads(reference, x, y)
        master_step(reference, masters, theirs)  # a power-of-two scale unscales exactly
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q)
        for copy_, master in zip(model.optim_parameters(), masters, strict=True):
            assert torch.equal(copy_, master)
    assert set(casts) == {torch.float64}


def test_asynchronous_fused_steps_equal_a_staleness_one_simulation(num_devices: int) -> None:
    """Asynchronous steps stage the bf16 weights and write them back one iteration later."""
    reference = mlp(torch.bfloat16)
    model = RoundPipe(copy.deepcopy(reference), optim_dtype=torch.float32)
    ours = roundpipe.optim.Adam(model.optim_parameters(), lr=0.01)
    live = copy.deepcopy(reference)
    masters = [p.detach().float().requires_grad_(True) for p in reference.parameters()]
    theirs = roundpipe.optim.Adam(masters, lr=0.01)
    for x, y in batches(4, torch.bfloat16):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        model.step(lambda: (ours.step(), ours.zero_grad()))
        plain_grads(live, x, y)
        with torch.no_grad():  # the previous step's weights arrive, then the next step runs
            for master, p in zip(masters, live.parameters(), strict=True):
                p.copy_(master)
                master.grad, p.grad = p.grad.float(), None
            theirs.step()
    model.synchronize()
    with torch.no_grad():
        for master, p in zip(masters, live.parameters(), strict=True):
            p.copy_(master)
    for p, q in zip(model.model.parameters(), live.parameters(), strict=True):
        assert torch.equal(p, q)


def _fp16_training(unscale_first: bool, steps: int, inf_at: int) -> list[torch.Tensor]:
    """fp16 model, fp32 copies, GradScaler + our Adam + an LR schedule; the loss of iteration
    ``inf_at`` is inf. Returns the weights, the scale and how often the step hook ran."""
    model = RoundPipe(mlp(torch.float16), optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=0.01, weight_decay=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
    hook_calls = []
    optimizer.register_step_post_hook(lambda *_: hook_calls.append(1))
    scaler = GradScaler(init_scale=2.0**12, growth_interval=2)

    def step_fn() -> None:
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
        schedule.step()

    for index, (x, y) in enumerate(batches(steps, torch.float16)):
        if index == inf_at:
            y[0, 0] = float("inf")
        model.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda o, t: scaler.scale(mse(o, t)),
            run_config=CONFIG,
        )
        model.step(step_fn)
    model.synchronize()
    return [p.detach().clone() for p in model.model.parameters()] + [
        torch.tensor(scaler.get_scale(up_to_date=True)),
        torch.tensor(len(hook_calls)),
    ]


@pytest.mark.filterwarnings("error::UserWarning")  # e.g. lr_scheduler.step() before a step
def test_grad_scaler_with_our_adam_is_fused_and_identical_to_unscaling_first(
    num_devices: int, casts: list[torch.dtype]
) -> None:
    unfused = _fp16_training(unscale_first=True, steps=6, inf_at=2)
    assert casts and set(casts) == {torch.float16}  # unscale_ reads .grad: cast, then unscaled
    casts.clear()
    fused = _fp16_training(unscale_first=False, steps=6, inf_at=2)
    assert casts == []
    for a, b in zip(fused, unfused, strict=True):
        assert torch.equal(a, b)
    # Grew after iterations 1 and 4 (growth_interval=2), backed off at the inf of iteration 2.
    assert fused[-2] == 2.0**12 * 2 * 0.5 * 2
    assert fused[-1] == 5  # optimizer.step() ran (hooks included) for every step not skipped


def test_step_fn_reading_grads_sees_the_moved_gradients(num_devices: int) -> None:
    """clip_grad_norm_ over the copies reads .grad (cast on access), then Adam steps."""
    reference = mlp(torch.bfloat16)
    model = RoundPipe(copy.deepcopy(reference), optim_dtype=torch.float32)
    ours = roundpipe.optim.Adam(model.optim_parameters(), lr=0.01)
    masters = [p.detach().float().requires_grad_(True) for p in reference.parameters()]
    theirs = torch.optim.Adam(masters, lr=0.01)

    def step_fn(max_norm: float) -> None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        ours.step()
        ours.zero_grad()

    for x, y in batches(3, torch.bfloat16):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        model.step(step_fn, False, 0.5)
        plain_grads(reference, x, y)
        with torch.no_grad():
            for master, p in zip(masters, reference.parameters(), strict=True):
                master.grad, p.grad = p.grad.float(), None
            torch.nn.utils.clip_grad_norm_(masters, 0.5)
            theirs.step()
            theirs.zero_grad()
            for master, p in zip(masters, reference.parameters(), strict=True):
                p.copy_(master)
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=2**-8 * p.abs().max().item())


@pytest.mark.parametrize("zero_grad", [None, False], ids=["never", "set_to_none=False"])
def test_copies_accumulate_gradients_over_steps_as_torch_does(
    num_devices: int, zero_grad: bool | None
) -> None:
    """Each step adds its iteration's gradient to the copies' .grad, unless zeroed."""
    reference = mlp(torch.float64)
    model = RoundPipe(copy.deepcopy(reference))
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.0)
    step_fn: Callable[[], Any] = (
        (lambda: None) if zero_grad is None else (lambda: ours.zero_grad(set_to_none=False))
    )
    totals = [torch.zeros_like(p) for p in reference.parameters()]
    for x, y in batches(3, torch.float64):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        model.step(step_fn, is_async=False)
        reference.zero_grad()
        plain_grads(reference, x, y)
        for total, p in zip(totals, reference.parameters(), strict=True):
            total.add_(p.grad)
    for copy_, total in zip(model.optim_parameters(), totals, strict=True):
        assert torch.equal(copy_.grad, torch.zeros_like(total) if zero_grad is False else total)


def test_pending_gradient_semantics() -> None:
    """A pending gradient reads as its cast; autograd writing meanwhile adds to it; setting,
    deleting and set_to_none drop it without casting."""
    copy_ = OptimizerCopy(torch.zeros(4))
    pending = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.bfloat16)
    copy_.hand_over_grad(pending)
    (copy_ * torch.arange(4.0)).sum().backward()  # autograd fills the slot directly
    assert torch.equal(copy_.grad, torch.tensor([1.0, 3.0, 5.0, 7.0]))
    assert copy_.grad.dtype == torch.float32

    for drop in (
        lambda p: setattr(p, "grad", None),
        lambda p: delattr(p, "grad"),
        lambda p: roundpipe.optim.Adam([p]).zero_grad(),
    ):
        copy_.grad = None
        copy_.hand_over_grad(pending)
        drop(copy_)
        assert copy_.grad is None and copy_._pending_grad is None

    copy_.hand_over_grad(pending)
    torch.optim.SGD([copy_]).zero_grad(set_to_none=False)
    assert torch.equal(copy_.grad, torch.zeros(4))
    assert type(copy.deepcopy(copy_)) is OptimizerCopy


@pytest.mark.parametrize("is_async", [False, True])
def test_changes_step_fn_makes_after_the_fused_pass_reach_the_model(
    num_devices: int, is_async: bool
) -> None:
    """A synchronous fused pass writes the bf16 weights as it updates the copies; a clamp of the
    copies after optimizer.step() (inside step_fn) must still reach the model: its weights are
    the copies' values, cast, as after any step."""
    model = RoundPipe(mlp(torch.bfloat16), optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=0.05)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()
        with torch.no_grad():
            for copy in model.optim_parameters():
                copy.clamp_(-0.05, 0.05)

    for x, y in batches(3, torch.bfloat16):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
        model.step(step_fn, is_async=is_async)
    model.synchronize()
    for param, master in zip(model.model.parameters(), model.optim_parameters(), strict=True):
        assert torch.equal(param, master.detach().to(torch.bfloat16))
        assert param.abs().max() <= 0.05
