"""Saving never changes the training, and loading continues the very same trajectory.

As in plain PyTorch, reading state (``state_dict()``, ``save_checkpoint``) must not change the
computation: a run that saves every k iterations gives the same losses and final weights, bit
for bit, as one that never saves, although each save happens while an asynchronous step is in
flight. A fresh model loaded from any of those saves continues the same trajectory: the pending
write-back and the scaler's pending scale take effect where the saving run applied them."""

from __future__ import annotations

import io
from typing import Any

import pytest
import roundpipe
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn

from tests.reference import make_plan

WIDTH, LAYERS, ITERATIONS = 16, 4, 6
PLAN = make_plan([range(0, 2), range(2, 3)], [range(3, 4), range(1, 3), range(0, 1)])
CONFIG = RoundPipeRunConfig(num_microbatch=2, execute_plan=PLAN)

# name: (parameter dtype, optim_dtype, optimizer, GradScaler arguments or None)
SETUPS: dict[str, tuple[torch.dtype, torch.dtype | None, str, dict[str, Any] | None]] = {
    # bf16 weights, fp32 copies, our Adam: the fused pass stages the new bf16 weights.
    "bf16-fused": (torch.bfloat16, torch.float32, "roundpipe.Adam", None),
    "fp32-torch-adamw": (torch.float32, None, "torch.AdamW", None),
    # A scale that overflows fp16 at first (skipped steps, backoff), then grows every step.
    "fp16-scaler": (
        torch.float16,
        torch.float32,
        "roundpipe.Adam",
        {"init_scale": 2.0**24, "growth_interval": 1},
    ),
}


def batch(i: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(8, WIDTH, generator=g).to(dtype), torch.randn(8, WIDTH, generator=g)


def round_trip(state: Any) -> Any:
    """Through bytes, loaded as a checkpoint must be: with ``weights_only=True``."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class Run:
    """One training run of a setup; ``saves`` are the points (iteration, "before"/"after" its
    step) where it reads its whole state, kept by point."""

    def __init__(
        self,
        setup: str,
        saves: frozenset[tuple[int, str]] = frozenset(),
        synchronize_after_save: bool = False,
    ) -> None:
        dtype, optim_dtype, optimizer, scaler = SETUPS[setup]
        torch.manual_seed(0)
        net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]).to(dtype)
        self.dtype = dtype
        self.model = RoundPipe(net, optim_dtype=optim_dtype, name="traj")
        params = self.model.optim_parameters()
        self.optimizer: torch.optim.Optimizer = (
            roundpipe.optim.Adam(params, lr=1e-2)
            if optimizer == "roundpipe.Adam"
            else torch.optim.AdamW(params, lr=1e-2)
        )
        self.scaler = None if scaler is None else roundpipe.GradScaler(**scaler)
        self.saves, self.synchronize_after_save = saves, synchronize_after_save
        self.saved: dict[tuple[int, str], dict[str, Any]] = {}
        self.losses: dict[int, float] = {}

    def loss_fn(self, out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        loss = ((out.float() - label) ** 2).mean()
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step_fn(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.optimizer.zero_grad()

    def state(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.scaler is not None:
            state["scaler"] = self.scaler.state_dict()
        if self.synchronize_after_save:  # publishes fresh weights: the trajectory changes here
            self.model.synchronize()
        return round_trip(state)

    def load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
        if self.synchronize_after_save:
            self.model.synchronize()

    def forward_backward(self, i: int) -> None:
        x, y = batch(i, self.dtype)
        loss = self.model.forward_backward(
            input_args=(x,), label=y, loss_fn=self.loss_fn, run_config=CONFIG
        )
        self.losses[i] = float(loss)

    def train(self, iterations: range, step_first: bool = False) -> None:
        """Train ``iterations``; ``step_first``: the first one's gradients are there already."""
        for i in iterations:
            if not (step_first and i == iterations.start):
                self.forward_backward(i)
            if (i, "before") in self.saves:
                self.saved[(i, "before")] = self.state()
            self.model.step(self.step_fn)
            if (i, "after") in self.saves:
                self.saved[(i, "after")] = self.state()

    def final(self) -> dict[str, Any]:
        self.model.synchronize()
        final = {
            "losses": self.losses,
            "weights": {n: p.detach().clone() for n, p in self.model.named_parameters()},
            "copies": {n: c.detach().clone() for n, c in self.model.optim_named_parameters()},
            "optimizer": self.optimizer.state_dict()["state"],
        }
        if self.scaler is not None:
            final["scale"] = self.scaler.get_scale()
        return final


def assert_bits(a: Any, b: Any, where: str = "") -> None:
    if torch.is_tensor(a):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_bits(a[key], b[key], f"{where}.{key}")
    else:
        assert a == b, f"{where}: {a} != {b}"


@pytest.mark.slow
@pytest.mark.parametrize("setup", list(SETUPS))
def test_saving_does_not_change_training_and_loading_continues_it(
    setup: str, num_devices: int
) -> None:
    plain = Run(setup)
    plain.train(range(ITERATIONS))
    expected = plain.final()

    # Every 2 iterations after the step (a step in flight), and once with gradients pending.
    saves = frozenset({(1, "after"), (3, "after"), (2, "before")})
    saving = Run(setup, saves)
    saving.train(range(ITERATIONS))
    assert_bits(saving.final(), expected, "saving run")
    assert saving.saved[(3, "after")]["model"]["_roundpipe.pending_writeback"].item() is True
    if saving.scaler is not None:  # the saves hold a scale the next iteration does not use yet
        scalers = [state["scaler"] for state in saving.saved.values()]
        assert any(state["scale"] != state["_iteration_scale"] for state in scalers)

    for (i, when), state in sorted(saving.saved.items()):
        resumed = Run(setup)
        resumed.train(range(1))  # progress of its own, replaced by the load
        resumed.losses.clear()
        resumed.load(state)
        if when == "before":
            resumed.train(range(i, ITERATIONS), step_first=True)
        else:
            resumed.train(range(i + 1, ITERATIONS))
        losses = {k: v for k, v in expected["losses"].items() if k > i}
        assert_bits(resumed.final(), {**expected, "losses": losses}, f"resumed at {(i, when)}")


class _StepTrouble(ArithmeticError):
    pass


@pytest.mark.parametrize("then", ["step", "synchronize"])
def test_state_dict_of_a_failed_step_raises_and_leaves_the_error_to_step(
    then: str, num_devices: int
) -> None:
    """Nothing consistent can be saved after a failed step: state_dict() says so (the step's
    error as the cause), and the error still reaches the next step() or synchronize()."""
    run = Run("fp32-torch-adamw")
    run.train(range(2))
    cause = _StepTrouble("step failed")

    def failing_step() -> None:
        raise cause

    run.forward_backward(2)
    run.model.step(failing_step)
    refused = "'traj': the optimizer step in flight failed"
    with pytest.raises(RuntimeError, match=refused) as raised:
        run.model.state_dict()
    assert raised.value.__cause__ is not None and raised.value.__cause__.__cause__ is cause
    with pytest.raises(_StepTrouble) as again:
        if then == "step":
            run.model.step(run.step_fn)
        else:
            run.model.synchronize()
    assert again.value.__cause__ is cause
    # Reported; the model saves and trains again.
    assert "_roundpipe.pending_writeback" not in run.model.state_dict()
    run.train(range(3, 5))
    assert run.model.state_dict()["_roundpipe.pending_writeback"].item() is True


def test_a_resumed_run_follows_a_synchronize_after_the_save(num_devices: int) -> None:
    """A save followed by ``synchronize()`` (which does publish the step in flight): loaded and
    followed by the same call, the resumed run takes the same weights and loss scales."""
    saves = frozenset({(1, "after"), (2, "before")})
    saving = Run("fp16-scaler", saves, synchronize_after_save=True)
    saving.train(range(ITERATIONS))
    expected = saving.final()
    for (i, when), state in sorted(saving.saved.items()):
        resumed = Run("fp16-scaler", synchronize_after_save=True)
        resumed.load(state)
        resumed.train(
            range(i, ITERATIONS) if when == "before" else range(i + 1, ITERATIONS),
            step_first=when == "before",
        )
        losses = {k: v for k, v in expected["losses"].items() if k > i}
        assert_bits(resumed.final(), {**expected, "losses": losses}, f"resumed at {(i, when)}")


class _Glued(nn.Module):
    """Two RoundPipe parts with host glue between them: a parameter of its own."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.first = RoundPipe(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()), name="first")
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH))
        self.second = RoundPipe(nn.Sequential(nn.Linear(WIDTH, WIDTH)), name="second")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * self.gain)


def _auto_run(
    iterations: range, saves: frozenset[int] = frozenset(), state: Any = None
) -> tuple[dict[str, Any], dict[int, Any]]:
    """Train an AutoRoundPipe (async steps); read its state after the steps in ``saves``, or
    start from ``state``. Returns the final losses, weights and copies, and the states read."""
    model = roundpipe.models.AutoRoundPipe(_Glued())
    optimizer = torch.optim.AdamW(model.optim_parameters(), lr=1e-2)
    if state is not None:
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    losses, saved = {}, {}
    for i in iterations:
        x, y = batch(i, torch.float32)
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        losses[i] = float(loss.detach())
        model.step(step_fn)
        if i in saves:
            saved[i] = round_trip(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            )
    model.synchronize()
    final = {
        "losses": losses,
        "weights": {n: p.detach().clone() for n, p in model.named_parameters()},
        "copies": {n: c.detach().clone() for n, c in model.optim_named_parameters()},
    }
    return final, saved


def test_auto_roundpipe_saving_does_not_change_training_and_loading_continues_it() -> None:
    expected, _ = _auto_run(range(ITERATIONS))
    final, saved = _auto_run(range(ITERATIONS), frozenset({1, 3}))
    assert_bits(final, expected, "saving run")
    assert saved[3]["model"]["_roundpipe.glue.pending_writeback"].item() is True
    for i, state in saved.items():
        resumed, _ = _auto_run(range(i + 1, ITERATIONS), state=state)
        losses = {k: v for k, v in expected["losses"].items() if k > i}
        assert_bits(resumed, {**expected, "losses": losses}, f"resumed after {i}")
