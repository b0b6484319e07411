"""GradScaler under the asynchronous pipeline, against unscaled plain PyTorch training."""

from __future__ import annotations

import copy
import re
from collections.abc import Callable

import pytest
import roundpipe
import torch
from reference import stale_step
from roundpipe import GradScaler, RoundPipe, RoundPipeRunConfig
from torch import nn

CONFIG = RoundPipeRunConfig(num_microbatch=2)


def mlp(dtype: torch.dtype) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2)).to(dtype)


def batches(count: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [
        (torch.randn(4, 4, generator=g).to(dtype), torch.randn(4, 2, generator=g).to(dtype))
        for _ in range(count)
    ]


def mse(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((out.float() - label.float()) ** 2).mean().to(out.dtype)


def plain_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
    for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
        mse(model(xm), ym).backward()


def test_scales_match_their_gradients_under_staleness_one(num_devices: int) -> None:
    """The scale doubles every step (growth_interval=1) while steps run one iteration behind;
    unscaling with any other iteration's scale would be off by a power of two."""
    reference = mlp(torch.float64)
    model = RoundPipe(copy.deepcopy(reference))
    scaler = GradScaler(init_scale=4.0, growth_interval=1)
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    live, master = copy.deepcopy(reference), copy.deepcopy(reference)
    theirs = torch.optim.SGD(master.parameters(), lr=0.1)

    def step_fn() -> None:
        scaler.step(ours)
        scaler.update()
        ours.zero_grad()

    def scaled(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return scaler.scale(mse(output, label))

    for x, y in batches(6, torch.float64):
        model.forward_backward(input_args=(x,), label=y, loss_fn=scaled, run_config=CONFIG)
        model.step(step_fn)
        plain_grads(live, x, y)
        stale_step(live, master, theirs)
    model.synchronize()
    for p, q in zip(model.model.parameters(), master.parameters(), strict=True):
        assert torch.equal(p, q)
    assert scaler.get_scale(up_to_date=True) == 4.0 * 2**6


def test_scaled_fp16_training_tracks_fp32_training(num_devices: int) -> None:
    reference = mlp(torch.float32)
    model = RoundPipe(copy.deepcopy(reference).half(), optim_dtype=torch.float32)
    scaler = GradScaler(init_scale=2.0**10)
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.05)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.05)
    for x, y in batches(5, torch.float32):
        model.forward_backward(
            input_args=(x.half(),),
            label=y.half(),
            loss_fn=lambda o, t: scaler.scale(((o.float() - t.float()) ** 2).mean()),
            run_config=CONFIG,
        )
        model.step(lambda: (scaler.step(ours), scaler.update(), ours.zero_grad()), is_async=False)
        plain_grads(reference, x, y)
        theirs.step()
        theirs.zero_grad()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.float(), q, rtol=2e-2, atol=2e-3)


def test_inf_gradients_skip_the_step_and_back_off(num_devices: int) -> None:
    model = RoundPipe(mlp(torch.float64))
    before = [p.detach().clone() for p in model.model.parameters()]
    scaler = GradScaler(init_scale=8.0, backoff_factor=0.25)
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    x, y = batches(1, torch.float64)[0]
    y[0, 0] = float("inf")
    model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)), run_config=CONFIG
    )
    model.step(lambda: (scaler.step(ours), scaler.update(), ours.zero_grad()))
    model.synchronize()
    assert scaler.get_scale(up_to_date=True) == 2.0
    for p, q in zip(model.model.parameters(), before, strict=True):
        assert torch.equal(p, q)


def test_update_from_the_main_thread_and_state_dict() -> None:
    scaler = GradScaler(init_scale=16.0, growth_factor=4.0, growth_interval=2)
    scaler.update(new_scale=32.0)  # queued on the optimizer thread
    assert scaler.get_scale(up_to_date=True) == 32.0
    # Without a step's inf check there is nothing to update from, as in torch.amp.GradScaler.
    plain = torch.amp.GradScaler("cpu", init_scale=16.0)
    plain.scale(torch.ones(()))
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        plain.update()
    with pytest.raises(AssertionError, match="No inf checks were recorded prior to update"):
        scaler.update(is_async=False)
    assert scaler.get_scale() == 32.0
    restored = GradScaler()
    restored.load_state_dict(scaler.state_dict())
    assert restored.get_scale() == 32.0 and restored.get_growth_factor() == 4.0
    assert restored.get_growth_interval() == 2 and restored.get_backoff_factor() == 0.5
    restored.set_growth_interval(5)
    restored.set_growth_factor(3.0)
    restored.set_backoff_factor(0.125)
    assert (restored.get_growth_interval(), restored.get_growth_factor()) == (5, 3.0)
    assert restored.get_backoff_factor(up_to_date=True) == 0.125


def test_disabled_scaler_is_a_passthrough() -> None:
    scaler = GradScaler(enabled=False)
    loss = torch.tensor(3.0)
    assert scaler.scale(loss) is loss
    assert scaler.get_scale() == 1.0 and not scaler.is_enabled()
    assert scaler.state_dict() == {}


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"init_scale": 0}, ValueError, "init_scale must be > 0"),
        ({"growth_factor": 1.0}, ValueError, "growth_factor must be > 1"),
        ({"backoff_factor": 1.5}, ValueError, "backoff_factor must be < 1"),
        ({"growth_interval": 0}, ValueError, "growth_interval must be a positive int"),
        ({"init_scale": "big"}, TypeError, "init_scale must be a number"),
        ({"enabled": 1}, TypeError, "enabled must be a bool"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        GradScaler(**kwargs)


def test_unscale_twice_is_an_error() -> None:
    param = nn.Parameter(torch.ones(2))
    param.grad = torch.ones(2)
    optimizer = torch.optim.SGD([param], lr=0.1)
    scaler = GradScaler(init_scale=2.0)
    scaler.unscale_(optimizer)
    assert torch.equal(param.grad, torch.full((2,), 0.5))
    with pytest.raises(RuntimeError, match="already called"):
        scaler.unscale_(optimizer)


def test_an_iterations_scale_does_not_depend_on_when_the_async_step_finished() -> None:
    """Iteration i+1 scales with what the steps the program waited for left, whether or not the
    asynchronous step i (and its update) happened to finish before i+1's first scale() call."""
    import time

    def run(step_delay: float, main_delay: float) -> list[float]:
        torch.manual_seed(0)
        model = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)))
        optimizer = torch.optim.SGD(model.optim_parameters(), lr=1e-3)
        scaler = GradScaler(init_scale=4.0, growth_interval=1)  # grows at every clean step

        def step_fn() -> None:
            time.sleep(step_delay)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()

        losses = []
        x = torch.randn(4, 4)
        for _ in range(4):
            loss = model.forward_backward(
                input_args=(x,), loss_fn=lambda out, _: scaler.scale(out.square().mean())
            )
            losses.append(float(loss))
            model.step(step_fn)
            time.sleep(main_delay)
        model.synchronize()
        return losses

    # The step finishes long before the next iteration, or long after it started.
    assert run(step_delay=0.0, main_delay=0.3) == run(step_delay=0.3, main_delay=0.0)


def test_the_scale_is_kept_in_float32_as_torch_keeps_it() -> None:
    ours = GradScaler(init_scale=0.1)
    plain = torch.amp.GradScaler("cpu", init_scale=0.1)
    plain.scale(torch.ones(()))
    assert ours.get_scale() == plain.get_scale() != 0.1
    ours.update(new_scale=0.3, is_async=False)
    plain.update(new_scale=0.3)
    assert ours.get_scale() == plain.get_scale() != 0.3


def test_a_plain_modules_loop_trains_as_with_torchs_scaler() -> None:
    """roundpipe.GradScaler in torch's loop on a plain module (no RoundPipe model): a step
    follows the update queued before it, so it never reuses the previous iteration's inf check
    (which stepped on scaled or inf gradients: the weights became NaN)."""

    def train(scaler: GradScaler | torch.amp.GradScaler) -> tuple[torch.Tensor, float]:
        torch.manual_seed(0)
        net = nn.Linear(16, 16)
        optimizer = torch.optim.SGD(net.parameters(), lr=1e-3)
        for i in range(200):
            x = torch.randn(8, 16)
            if i % 7 == 3:
                x[0, 0] = float("inf")
            scaler.scale(net(x).pow(2).mean()).backward()
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
        # Ours: the last update() is queued on the optimizer thread; up_to_date waits for it
        # (without it the read races the update and may return the scale before it).
        if isinstance(scaler, GradScaler):
            return net.weight.detach().clone(), scaler.get_scale(up_to_date=True)
        return net.weight.detach().clone(), float(scaler.get_scale())

    expected = train(torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3))
    weight, scale = train(GradScaler(init_scale=2.0**10, growth_interval=3))
    assert torch.equal(weight, expected[0]) and scale == expected[1]


@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int64]
)
@pytest.mark.parametrize("shape", [(), (1,), (3,)], ids=["0-dim", "1", "3"])
def test_scale_returns_the_dtype_and_value_torchs_scaler_returns(
    dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    """torch multiplies by its scale held as a 0-dim float32 tensor: a 0-dim fp16 loss becomes
    float32 (no overflow at 3 * 2**15), an n-dim one keeps its dtype."""
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**15)
    ours = GradScaler(init_scale=2.0**15)
    loss = torch.full(shape, 3, dtype=dtype)
    for outputs in (loss, [loss], (loss, loss)):
        expected, got = theirs.scale(outputs), ours.scale(outputs)
        pairs = [(expected, got)] if torch.is_tensor(expected) else zip(expected, got, strict=True)
        for a, b in pairs:
            assert (b.dtype, b.shape) == (a.dtype, a.shape)
            assert torch.equal(a, b)


@pytest.mark.parametrize("outputs", [1.0, None, [1.0], (torch.ones(()), 2)], ids=repr)
def test_scale_refuses_what_is_not_a_tensor_as_torch_does(outputs: object) -> None:
    with pytest.raises(ValueError) as theirs:
        torch.amp.GradScaler("cpu").scale(outputs)  # type: ignore[arg-type]
    with pytest.raises(ValueError) as ours:
        GradScaler().scale(outputs)
    assert str(ours.value) == str(theirs.value)


def _unscaling_outcome(
    scaler: GradScaler | torch.amp.GradScaler,
    call: str,
    optimizer_class: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
    grads: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor] | str:
    """(weights, gradients) after ``scaler.<call>(optimizer)``, or the ValueError's message, the
    parameter and its gradient then checked unchanged."""
    param = nn.Parameter(torch.zeros(4, dtype=grads.dtype))
    param.grad = grads.clone()
    optimizer = optimizer_class([param])
    scaler.scale(torch.ones(()))
    try:
        getattr(scaler, call)(optimizer)
    except ValueError as error:
        assert torch.equal(param.grad, grads) and not param.any()
        return str(error)
    return param.detach().clone(), param.grad.clone()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp16_gradients_are_refused_as_torch_refuses_them(dtype: torch.dtype) -> None:
    """torch.amp.GradScaler will not unscale fp16 gradients (the small ones would underflow in
    fp16): unscale_ and step raise ValueError and leave them as they were; bf16 ones are
    unscaled. Our Adam, stepped through the scaler, is held to torch's Adam's rule."""
    grads = torch.tensor([1e-3, 2e-3, 60000.0, 1.0]).to(dtype)

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=1.0)

    def torch_adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.Adam(params, lr=1.0, foreach=False)

    def our_adam(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return roundpipe.optim.Adam(params, lr=1.0)

    cases = [("unscale_", sgd, sgd), ("step", sgd, sgd), ("step", torch_adam, our_adam)]
    for call, theirs, ours in cases:
        expected = _unscaling_outcome(
            torch.amp.GradScaler("cpu", init_scale=2.0**16), call, theirs, grads
        )
        got = _unscaling_outcome(GradScaler(init_scale=2.0**16), call, ours, grads)
        if isinstance(expected, str):
            assert got == expected == "Attempting to unscale FP16 gradients."
        else:
            assert not isinstance(got, str)
            assert torch.equal(got[0], expected[0])  # the weights
            if ours is not our_adam:  # which unscales as it reads, leaving .grad scaled
                assert torch.equal(got[1], expected[1])
    assert isinstance(expected, str) == (dtype == torch.float16)


def test_an_fp16_model_without_fp32_copies_is_refused_as_by_torch(num_devices: int) -> None:
    """The realistic case: an fp16 model whose optimizer copies stay fp16 (optim_dtype=None)."""
    net = mlp(torch.float16)
    plain = copy.deepcopy(net)
    x, y = batches(1, torch.float16)[0]
    theirs = torch.amp.GradScaler("cpu")
    for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
        theirs.scale(mse(plain(xm), ym)).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as expected:
        theirs.step(torch.optim.Adam(plain.parameters(), foreach=False))
    model = RoundPipe(net)
    optimizer = roundpipe.optim.Adam(model.optim_parameters())
    scaler = GradScaler()
    before = [p.detach().clone() for p in model.parameters()]
    model.forward_backward(
        input_args=(x,), label=y, loss_fn=lambda o, t: scaler.scale(mse(o, t)), run_config=CONFIG
    )
    with pytest.raises(ValueError, match=re.escape(str(expected.value))):
        model.step(lambda: scaler.step(optimizer), is_async=False)
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("make", [GradScaler, lambda: torch.amp.GradScaler("cpu")])
def test_a_second_step_or_a_closure_is_refused_as_torch_refuses_it(make: Callable) -> None:
    # torch.amp.GradScaler refuses a second step() before update() (it would step the same
    # gradients twice) and a closure (its loss would not be scaled); ours stepped both.
    param = nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([param], lr=0.5)
    scaler = make()
    scaler.scale(param.sum()).backward()
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):
        scaler.step(optimizer, closure=lambda: param.sum())
    scaler.step(optimizer)
    stepped = param.detach().clone()
    with pytest.raises(RuntimeError, match=r"step\(\) has already been called"):
        scaler.step(optimizer)
    assert torch.equal(param.detach(), stepped)
    scaler.update()
    scaler.scale(param.sum()).backward()
    scaler.step(optimizer)  # after update() a step is allowed again
