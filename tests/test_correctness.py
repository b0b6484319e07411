"""Never silently wrong: what plain PyTorch computes (or rejects), RoundPipe computes (or rejects).

Each test drives RoundPipe the way users do beyond the happy path (threads, in-place layers,
layers that mutate their input, a second backward, mismatched batches, randomness under different
schedules) and compares with the plain PyTorch per-microbatch loop, on 1 and 3 virtual CPU devices.
"""

from __future__ import annotations

import copy
import dataclasses
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import ClassVar, cast

import pytest
import roundpipe
import torch
from reference import assert_same_grads, make_plan, mlp
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe.context import RecomputeDataError
from torch import nn


@pytest.fixture(autouse=True)
def float64_by_default() -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def single_layer_plan(layers: int) -> ModelExecutePlan:
    """Every layer its own stage: every layer starts a forward and a backward stage."""
    return make_plan(
        [range(i, i + 1) for i in range(layers - 1)],
        [range(i, i + 1) for i in reversed(range(layers))],
    )


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).sum()


def plain_forward_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int
) -> torch.Tensor:
    total = torch.zeros(())
    for xm, ym in zip(x.tensor_split(n), y.tensor_split(n), strict=True):
        loss = mse(model(xm), ym)
        loss.backward()
        total = total + loss.detach()
    return total


# --------------------------------------------------------------------------------------------
# 1, 2: threads
# --------------------------------------------------------------------------------------------


def test_two_threads_on_one_model_accumulate_both_calls(num_devices: int) -> None:
    """Plain PyTorch accumulates both threads' gradients; ours must too (calls serialise)."""
    reference = mlp(layers=6)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)
    torch.manual_seed(1)
    batches = [(torch.randn(6, 6), torch.randn(6, 6)) for _ in range(2)]
    errors: list[BaseException] = []
    for _ in range(5):
        barrier = threading.Barrier(2)

        def train(x: torch.Tensor, y: torch.Tensor, barrier: threading.Barrier = barrier) -> None:
            try:
                barrier.wait()
                model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
            except BaseException as error:  # reported below
                errors.append(error)

        threads = [threading.Thread(target=train, args=batch) for batch in batches]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        for x, y in batches:
            plain_forward_backward(reference, x, y, 3)
    assert not errors, errors
    model.synchronize()
    assert_same_grads(model.model, reference)


_CROSSED_CALLS = """
import copy, threading, torch, roundpipe
from torch import nn
from roundpipe import RoundPipe, RoundPipeRunConfig
roundpipe.configure_devices(kind="cpu", num_cpu_devices=NUM_DEVICES)
torch.manual_seed(0)
plain = [nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]) for _ in range(MODELS)]
models = [RoundPipe(copy.deepcopy(p), name=f"m{i}") for i, p in enumerate(plain)]
x, y = torch.randn(8, 8), torch.randn(8, 8)
config = RoundPipeRunConfig(num_microbatch=2)
inside = threading.Barrier(MODELS)
first = [True] * MODELS
errors = {}

def train(i):
    def loss_fn(out, label):
        if first[i]:  # every thread holds its own model here
            first[i] = False
            inside.wait(timeout=60)
        with torch.no_grad():
            teacher = models[(i + 1) % MODELS](label)  # the next model, from inside its call
        return nn.functional.mse_loss(out, label) + 0 * teacher.sum()
    try:
        models[i].forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=config)
    except RuntimeError as error:
        errors[i] = str(error)

threads = [threading.Thread(target=train, args=(i,)) for i in range(MODELS)]
for t in threads:
    t.start()
for t in threads:
    t.join()
assert len(errors) == 1, errors
(message,) = errors.values()
assert "would wait for ever" in message, message
assert MODELS == 3 or ("'m0'" in message and "'m1'" in message), message
assert MODELS == 2 or "through calls in other threads" in message, message
# Every model trains as plain PyTorch afterwards (no step ran: the weights are the same).
mse = nn.functional.mse_loss
for model, reference in zip(models, plain):
    model.zero_grad()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    for xm, ym in zip(x.tensor_split(2), y.tensor_split(2)):
        mse(reference(xm), ym).backward()
    for p, q in zip(model.model.parameters(), reference.parameters()):
        assert torch.equal(p.grad, q.grad)
print("ok")
"""


@pytest.mark.slow
@pytest.mark.parametrize("models", [2, 3])
def test_threads_calling_each_others_model_from_inside_a_call_do_not_hang(
    num_devices: int, models: int
) -> None:
    """Each thread's loss_fn calls the next thread's model (mutual distillation; with three, a
    ring) while every thread is inside its own model's call: plain PyTorch runs them all, and
    waiting for each other would never end. One call raises a RuntimeError naming the models,
    the others go on, and every model trains as plain PyTorch afterwards. In a subprocess: a
    hang fails the test by its timeout instead of stopping the suite."""
    code = _CROSSED_CALLS.replace("NUM_DEVICES", str(num_devices)).replace("MODELS", str(models))
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


def test_synchronize_while_another_thread_trains(num_devices: int) -> None:
    """synchronize() from a second thread waits for in-flight work; training is unaffected."""
    reference = mlp(layers=5)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)
    torch.manual_seed(2)
    batches = [(torch.randn(6, 6), torch.randn(6, 6)) for _ in range(6)]

    def sgd() -> None:
        with torch.no_grad():
            for p in model.optim_parameters():
                p -= 0.01 * p.grad
                p.grad = None

    done = threading.Event()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            for x, y in batches:
                model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
                model.step(sgd, is_async=False)
        except BaseException as error:
            errors.append(error)
        finally:
            done.set()

    thread = threading.Thread(target=train)
    thread.start()
    while not done.is_set():
        try:
            model.synchronize()
        except BaseException as error:
            errors.append(error)
            break
    thread.join(timeout=120)
    assert not errors, errors
    model.synchronize()

    plain_opt = torch.optim.SGD(reference.parameters(), lr=0.01)
    for x, y in batches:
        plain_forward_backward(reference, x, y, 3)
        plain_opt.step()
        plain_opt.zero_grad()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-10, atol=1e-12)
    # The model still trains afterwards.
    model.forward_backward(input_args=(batches[0][0],), label=batches[0][1], loss_fn=mse)


# --------------------------------------------------------------------------------------------
# 3, 4: in-place layers
# --------------------------------------------------------------------------------------------


def inplace_model(seed: int = 3) -> nn.Sequential:
    """In-place ReLUs that land at the start of stages under single-layer plans."""
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(6, 6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 6),
        nn.ReLU(inplace=True),
    )


INPLACE_PLANS = {
    "single": single_layer_plan(6),
    # the fused stage starts with an in-place ReLU
    "fused-relu": make_plan([range(0, 3)], [range(3, 6), range(1, 3), range(0, 1)]),
    "auto": None,
}


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", INPLACE_PLANS, ids=list(INPLACE_PLANS))
def test_inplace_relu_at_stage_starts_trains_like_pytorch(
    num_devices: int, grain: str, plan: str
) -> None:
    reference = inplace_model()
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(
        num_microbatch=3, recompute_grain=grain, execute_plan=INPLACE_PLANS[plan]
    )
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    expected = plain_forward_backward(reference, x, y, 3)
    torch.testing.assert_close(loss, expected)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_inplace_relu_through_forward_then_backward(num_devices: int) -> None:
    reference = inplace_model()
    model = RoundPipe(copy.deepcopy(reference))
    plan = make_plan(
        [range(0, 1), range(1, 3), range(3, 6)], [range(3, 6), range(1, 3), range(0, 1)]
    )
    x = torch.randn(6, 6)
    out = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, execute_plan=plan))
    out.pow(2).sum().backward()
    torch.cat([reference(chunk) for chunk in x.tensor_split(3)]).pow(2).sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference)


class Doubler(nn.Module):
    """Doubles its input in place outside autograd, then applies a linear map."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            x.mul_(2)
        return self.linear(x)


def mutating_model(seed: int = 4) -> nn.Sequential:
    torch.manual_seed(seed)
    # Linear before each Doubler: its backward does not read its output, which the Doubler
    # changes, so plain PyTorch accepts the mutation.
    return nn.Sequential(nn.Linear(6, 6), Doubler(), nn.Linear(6, 6), Doubler(), nn.Linear(6, 6))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_layer_mutating_its_input_recomputes_what_forward_saw(num_devices: int, grain: str) -> None:
    reference = mutating_model()
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(
        num_microbatch=3, recompute_grain=grain, execute_plan=single_layer_plan(5)
    )
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    expected = plain_forward_backward(reference, x, y, 3)
    torch.testing.assert_close(loss, expected)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_first_layer_mutating_the_users_input_recomputes_what_forward_saw(
    num_devices: int,
) -> None:
    torch.manual_seed(5)
    reference = nn.Sequential(Doubler(), nn.Linear(6, 6), Doubler(), nn.Linear(6, 6))
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=single_layer_plan(4))
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    model.forward_backward(input_args=(x.clone(),), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x.clone(), y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference)


# --------------------------------------------------------------------------------------------
# 5: a second backward
# --------------------------------------------------------------------------------------------


def test_second_backward_without_retain_graph_raises_like_pytorch(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(4, 6)
    plain_loss = torch.cat([reference(chunk) for chunk in x.tensor_split(2)]).sum()
    plain_loss.backward()
    with pytest.raises(RuntimeError, match="second time") as plain_error:
        plain_loss.backward()
    loss = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2)).sum()
    loss.backward()
    with pytest.raises(type(plain_error.value), match="second time"):
        loss.backward()
    model.synchronize()
    assert_same_grads(model.model, reference)  # not doubled


def assert_two_backwards_match_plain(
    reference: nn.Module, config: RoundPipeRunConfig, exact: bool = False
) -> None:
    """Two backwards through one retained graph of a loss that saves its input: RoundPipe's
    gradients against the plain per-microbatch loop's."""
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(4, 6)
    loss = model(x, roundpipe_run_config=config).pow(2).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    plain = torch.cat([reference(chunk) for chunk in x.tensor_split(2)]).pow(2).sum()
    plain.backward(retain_graph=True)
    plain.backward()
    model.synchronize()
    assert_same_grads(model.model, reference, exact=exact)


def test_retain_graph_allows_a_second_backward_through_a_loss_that_saves(
    num_devices: int,
) -> None:
    assert_two_backwards_match_plain(mlp(), RoundPipeRunConfig(num_microbatch=2))


class ShiftsThenSquares(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.add_(1).pow(2)  # in place on its input; the gradient depends on the input


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_retained_graph_recomputes_in_place_layers_from_their_own_inputs(
    num_devices: int, grain: str
) -> None:
    """The second backward recomputes from the saved inputs again: layers that changed their
    inputs in place during the first recompute must not have changed what it starts from."""
    torch.manual_seed(0)
    layers = [
        nn.Linear(6, 6),
        ShiftsThenSquares(),
        nn.Linear(6, 6),
        nn.ReLU(inplace=True),
        nn.Linear(6, 6),
    ]
    plan = make_plan([range(0, 1), range(1, 5)], [range(3, 5), range(1, 3), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    assert_two_backwards_match_plain(nn.Sequential(*layers), config, exact=True)


class _SeesRecompute(torch.autograd.Function):
    """Identity whose backward records what a layer's code sees while backward runs."""

    seen: ClassVar[list[bool]] = []

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        _SeesRecompute.seen.append(roundpipe.doing_recompute())
        with pytest.raises(RecomputeDataError):
            roundpipe.get_recompute_data()
        return grad


class _RecordsRecompute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.during_recompute: list[bool] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.during_recompute.append(roundpipe.doing_recompute())
        return _SeesRecompute.apply(self.linear(x))


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_code_run_by_backward_is_outside_the_recomputed_layers(
    num_devices: int, grain: str
) -> None:
    """A layer's own code sees doing_recompute() in its recompute, and not in the backward pass
    between recomputes (plain PyTorch runs that code outside any layer call)."""
    torch.manual_seed(0)
    layers = [_RecordsRecompute() for _ in range(4)]
    model = RoundPipe(nn.Sequential(*layers))
    plan = make_plan([range(0, 1), range(1, 3)], [range(3, 4), range(1, 3), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    _SeesRecompute.seen.clear()
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    assert _SeesRecompute.seen and not any(_SeesRecompute.seen)
    # Layers 1 and 2: forward, then recompute, per microbatch.
    assert layers[1].during_recompute == [False, False, True, True]


class _InterruptsRecompute(nn.Module):
    """A layer that raises KeyboardInterrupt (Ctrl-C) in its next recompute once armed."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and roundpipe.doing_recompute():
            self.armed = False
            raise KeyboardInterrupt
        return self.linear(x)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_ctrl_c_in_a_recompute_leaves_the_model_usable(num_devices: int, grain: str) -> None:
    """Ctrl-C inside a recomputed layer stops the call, leaves no layer context behind, and the
    next call's gradients are plain PyTorch's (the interrupted call's are rolled back)."""
    torch.manual_seed(0)
    reference = nn.Sequential(*[_InterruptsRecompute() for _ in range(4)])
    model = RoundPipe(copy.deepcopy(reference))
    plan = make_plan([range(0, 1), range(1, 3)], [range(3, 4), range(1, 3), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    cast(_InterruptsRecompute, model.model[2]).armed = True
    with pytest.raises(KeyboardInterrupt):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    assert not roundpipe.doing_recompute()
    with pytest.raises(RecomputeDataError):
        roundpipe.get_recompute_data()  # outside every layer again
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)


# --------------------------------------------------------------------------------------------
# 6: batch-size mismatches
# --------------------------------------------------------------------------------------------


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.linear(a) + self.linear(b).sum(0)


def test_inputs_of_different_batch_sizes_are_rejected_before_work(num_devices: int) -> None:
    model = RoundPipe(nn.Sequential(TwoInputs(), nn.Linear(6, 6)))
    with pytest.raises(
        ValueError, match=r"args\[0\].*12.*args\[1\].*6|args\[1\].*6.*args\[0\].*12"
    ):
        model.forward_backward(
            input_args=(torch.randn(12, 6), torch.randn(6, 6)),
            label=torch.randn(12, 6),
            loss_fn=mse,
            run_config=RoundPipeRunConfig(num_microbatch=3),
        )
    model.synchronize()
    assert all(p.grad is None or not p.grad.any() for p in model.model.parameters())


def test_label_of_another_batch_size_is_rejected_before_work(num_devices: int) -> None:
    model = RoundPipe(mlp())
    with pytest.raises(ValueError, match=r"label.*8.*12|12.*label.*8"):
        model.forward_backward(
            input_args=(torch.randn(12, 6),),
            label=torch.randn(8, 6),
            loss_fn=mse,
            run_config=RoundPipeRunConfig(num_microbatch=3),
        )
    model.synchronize()
    assert all(p.grad is None or not p.grad.any() for p in model.model.parameters())


def test_explicit_split_specs_still_allow_different_sizes(num_devices: int) -> None:
    from torch.distributed.pipelining.microbatch import TensorChunkSpec, _Replicate

    reference = nn.Sequential(TwoInputs(), nn.Linear(6, 6))
    model = RoundPipe(copy.deepcopy(reference))
    a, b, y = torch.randn(6, 6), torch.randn(4, 6), torch.randn(6, 6)
    config = RoundPipeRunConfig(
        num_microbatch=2, split_input=((TensorChunkSpec(0), _Replicate), {})
    )
    model.forward_backward(input_args=(a, b), label=y, loss_fn=mse, run_config=config)
    for am, ym in zip(a.tensor_split(2), y.tensor_split(2), strict=True):
        mse(reference[1](reference[0](am, b)), ym).backward()
    model.synchronize()
    assert_same_grads(model.model, reference)


# --------------------------------------------------------------------------------------------
# 7: randomness independent of the schedule
# --------------------------------------------------------------------------------------------


def dropout_net(seed: int = 6) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Tanh()) for _ in range(6)]
    )


def train_with_dropout(
    devices: int, plan: ModelExecutePlan | None, grain: str, seed: int = 0
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    model = RoundPipe(dropout_net())
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.05)

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad()

    torch.manual_seed(seed)
    data = [(torch.randn(8, 8), torch.randn(8, 8)) for _ in range(3)]
    torch.manual_seed(seed + 100)
    config = RoundPipeRunConfig(num_microbatch=4, execute_plan=plan, recompute_grain=grain)
    losses = []
    for x, y in data:
        losses.append(
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        )
        model.step(step)
    model.synchronize()
    return losses, [p.detach().clone() for p in model.model.parameters()]


SCHEDULES: dict[str, tuple[int, ModelExecutePlan | None, str]] = {
    "1dev-single": (1, single_layer_plan(6), "stage"),
    "3dev-single": (3, single_layer_plan(6), "stage"),
    "3dev-pairs": (
        3,
        make_plan([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)]),
        "stage",
    ),
    "2dev-fused-big": (2, make_plan([], [range(0, 6)]), "layer"),
    "1dev-auto": (1, None, "stage"),
    "3dev-auto-layer": (3, None, "layer"),
}


def test_same_seed_same_bits_whatever_the_schedule() -> None:
    runs = {name: train_with_dropout(*schedule) for name, schedule in SCHEDULES.items()}
    base_losses, base_weights = runs["1dev-single"]
    for name, (losses, weights) in runs.items():
        for a, b in zip(losses, base_losses, strict=True):
            assert torch.equal(a, b), name
        for a, b in zip(weights, base_weights, strict=True):
            assert torch.equal(a, b), name
    # Dropout is really active: another seed gives other losses.
    other_losses, _ = train_with_dropout(1, single_layer_plan(6), "stage", seed=1)
    assert not torch.equal(other_losses[0], base_losses[0])


def test_recompute_replays_the_forward_draws_under_any_schedule(num_devices: int) -> None:
    """Gradients equal plain PyTorch replaying the masks that RoundPipe's forward drew."""

    class MaskRecorder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.masks: list[torch.Tensor] = []
            self.replay: list[torch.Tensor] | None = None

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.replay is not None:
                return x * self.replay.pop(0)
            mask = (torch.rand_like(x) > 0.4).to(x.dtype)
            if not roundpipe.doing_recompute():
                self.masks.append(mask)
            return x * mask

    torch.manual_seed(7)
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(6, 6), MaskRecorder()) for _ in range(4)])
    model = RoundPipe(copy.deepcopy(reference))
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=single_layer_plan(4))
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    for mine, theirs in zip(model.model, reference, strict=True):
        theirs[1].replay = list(mine[1].masks)
    plain_forward_backward(reference, x, y, 3)
    model.synchronize()
    assert_same_grads(model.model, reference)


# --------------------------------------------------------------------------------------------
# 8: output_device without CUDA
# --------------------------------------------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error without CUDA")
def test_cuda_output_device_without_cuda_is_a_value_error() -> None:
    model = RoundPipe(mlp())
    with pytest.raises(ValueError, match="output_device"):
        model(torch.randn(4, 6), roundpipe_run_config=RoundPipeRunConfig(output_device="cuda:0"))
    with pytest.raises(ValueError, match="output_device"):
        RoundPipe(mlp(), model_run_config=RoundPipeRunConfig(output_device="cuda:0"))(
            torch.randn(4, 6)
        )


# --------------------------------------------------------------------------------------------
# The failing layer is named, never a wrong one
# --------------------------------------------------------------------------------------------


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        raise ValueError("backward exploded")


class BackwardBoom(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FailInBackward.apply(x)


@pytest.mark.parametrize(
    ("plan", "grain", "expected"),
    [
        # a backward stage, recomputed layer by layer: the exact layer
        (
            make_plan([range(0, 4)], [range(4, 5), range(0, 4)]),
            "layer",
            r"layer 2 \(BackwardBoom\)",
        ),
        # a backward stage recomputed whole: its range, which holds layer 2
        (make_plan([range(0, 4)], [range(4, 5), range(0, 4)]), "stage", r"one of layers 0-3 \("),
        # the fused stage: its range
        (make_plan([range(0, 2)], [range(2, 5), range(0, 2)]), "stage", r"one of layers 2-4 \("),
        # the fused stage is never recomputed: its range in either grain
        (make_plan([range(0, 2)], [range(2, 5), range(0, 2)]), "layer", r"one of layers 2-4 \("),
    ],
)
def test_backward_failure_names_the_layer_or_its_stage_never_another(
    num_devices: int, plan: ModelExecutePlan, grain: str, expected: str
) -> None:
    torch.manual_seed(8)
    net = nn.Sequential(
        nn.Linear(6, 6), nn.Linear(6, 6), BackwardBoom(), nn.Linear(6, 6), nn.Tanh()
    )
    model = RoundPipe(net, name="boom")
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    with pytest.raises(ValueError, match=rf"'boom': {expected}.*failed in backward") as error:
        model.forward_backward(
            input_args=(torch.randn(4, 6),), label=torch.randn(4, 6), loss_fn=mse, run_config=config
        )
    assert "layer 3" not in str(error.value) and "layer 4 (" not in str(error.value)
    assert isinstance(error.value.__cause__, ValueError)


# --------------------------------------------------------------------------------------------
# Frozen parameters (bound in host memory on virtual CPU devices)
# --------------------------------------------------------------------------------------------


class Adapted(nn.Module):
    """A frozen linear map plus a trainable low-rank update (LoRA)."""

    def __init__(self, base: nn.Linear) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.down = nn.Parameter(torch.randn(2, 6) / 3)
        self.up = nn.Parameter(torch.randn(6, 2) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.base(x) + (x @ self.down.t()) @ self.up.t())


def assert_grads_equal(model: nn.Module, reference: nn.Module) -> None:
    """Bit for bit the reference's gradients, and none where it has none (frozen)."""
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            assert torch.equal(p.grad, q.grad), name


def adapted_model(seed: int = 8) -> nn.Sequential:
    """Four adapted layers; the first and the last share their frozen base (an alias slot)."""
    torch.manual_seed(seed)
    shared = nn.Linear(6, 6)
    return nn.Sequential(
        Adapted(shared), Adapted(nn.Linear(6, 6)), Adapted(nn.Linear(6, 6)), Adapted(shared)
    )


@pytest.mark.parametrize("pin_model", ["alloc", "off"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_frozen_base_trains_like_pytorch(num_devices: int, pin_model: str, grain: str) -> None:
    """Adapters on a frozen base, three synchronous steps: losses, gradients and weights bit for
    bit those of the plain loop; the frozen weights unchanged, without gradients."""
    reference = adapted_model()
    model = RoundPipe(copy.deepcopy(reference), pin_model=pin_model)
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    theirs = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.1)
    config = RoundPipeRunConfig(
        num_microbatch=2, recompute_grain=grain, execute_plan=single_layer_plan(4)
    )
    frozen = [p.clone() for p in reference.parameters() if not p.requires_grad]
    for _ in range(3):
        x, y = torch.randn(4, 6), torch.randn(4, 6)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        torch.testing.assert_close(loss, plain_forward_backward(reference, x, y, 2), rtol=0, atol=0)
        model.synchronize()
        assert_grads_equal(model.model, reference)
        model.step(ours.step, is_async=False)
        theirs.step()
        model.synchronize()
        ours.zero_grad()
        theirs.zero_grad()
    for mine, plain in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, plain, rtol=0, atol=0)
    still = [p for p in model.model.parameters() if not p.requires_grad]
    assert len(still) == len(frozen) == 6  # weight and bias of three bases
    assert all(torch.equal(p, q) for p, q in zip(still, frozen, strict=True))


class Scaling(nn.Module):
    """Halves its frozen weight in place on every forward (state kept in a parameter)."""

    def __init__(self, skip_in_recompute: bool = False) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6).requires_grad_(False)
        self.skip_in_recompute = skip_in_recompute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.skip_in_recompute and roundpipe.doing_recompute()):
            with torch.no_grad():
                self.linear.weight.mul_(0.5)
        return self.linear(x)


def scaling_model(seed: int = 9) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 6), Scaling(), nn.Linear(6, 6))


@pytest.mark.cpu_devices
def test_layer_changing_its_frozen_weight_in_inference_does_what_pytorch_does(
    num_devices: int,
) -> None:
    """Without recompute the layer computes with the live weight, and the change stays."""
    reference = scaling_model()
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(4, 6)
    with torch.no_grad():
        out = model(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2))
        expected = torch.cat([reference(chunk) for chunk in x.tensor_split(2)])
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(model.model[1].linear.weight, reference[1].linear.weight)


@pytest.mark.parametrize("how", ["forward_backward", "forward", "inference"])
def test_layer_changing_its_trained_weight_in_place_is_an_error(num_devices: int, how: str) -> None:
    """A trainable nn.Embedding(max_norm=...) renormalises its weight in place in every
    forward; the layer computes with a device copy, whose change would be lost where plain
    PyTorch keeps it: RuntimeError naming the layer and the parameter, in every stage kind, and
    the model trains as plain PyTorch once the layer stops doing it."""
    torch.manual_seed(19)
    net = nn.Sequential(nn.Embedding(10, 4, max_norm=0.5), nn.Linear(4, 2))
    reference = copy.deepcopy(net)
    model = RoundPipe(net, name="renorm")
    ids = torch.randint(0, 10, (6,))
    message = r"'renorm': layer 0 \(Embedding\) changed its trained parameter 'weight' in place"
    with pytest.raises(RuntimeError, match=message):
        if how == "forward_backward":
            model.forward_backward(input_args=(ids,), loss_fn=lambda out, _: out.sum())
        elif how == "forward":
            model(ids)
        else:
            with torch.no_grad():
                model(ids)
    assert torch.equal(model.model[0].weight, reference[0].weight)
    model.model[0].max_norm = reference[0].max_norm = None
    config = RoundPipeRunConfig(num_microbatch=1)
    model.forward_backward(input_args=(ids,), loss_fn=lambda out, _: out.sum(), run_config=config)
    reference(ids).sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)


@pytest.mark.cpu_devices
@pytest.mark.parametrize("skip_in_recompute", [False, True], ids=["always", "forward-only"])
def test_layer_changing_its_frozen_weight_in_a_recomputed_forward_is_an_error(
    num_devices: int, skip_in_recompute: bool
) -> None:
    """A recomputed layer would change the weight twice: a RuntimeError naming the layer and the
    parameter, after which the model trains on; a change in the fused stage (no recompute) is
    what plain PyTorch makes."""
    torch.manual_seed(9)
    model = RoundPipe(nn.Sequential(nn.Linear(6, 6), Scaling(skip_in_recompute), nn.Linear(6, 6)))
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=single_layer_plan(3))
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(RuntimeError, match=r"layer 1 \(Scaling\).*'linear\.weight' in place"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.model[1].skip_in_recompute = True
    reference = copy.deepcopy(model.model)
    fused = make_plan([range(0, 1)], [range(1, 3), range(0, 1)])  # layer 1 in the fused stage
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=fused)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    torch.testing.assert_close(loss, plain_forward_backward(reference, x, y, 2), rtol=0, atol=0)
    model.synchronize()
    assert_grads_equal(model.model, reference)
    torch.testing.assert_close(model.model[1].linear.weight, reference[1].linear.weight)


# --------------------------------------------------------------------------------------------
# The native recompute + backward of backward stages (lone tensors between layers)
# --------------------------------------------------------------------------------------------


class FailOnRecompute(nn.Linear):
    armed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed and roundpipe.doing_recompute():
            raise KeyError("cannot recompute")
        return super().forward(x)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_failure_inside_a_stage_names_that_layer(num_devices: int, grain: str) -> None:
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), FailOnRecompute(6, 6), nn.Tanh(), nn.Linear(6, 6)
    )
    model = RoundPipe(net, name="rc")
    plan = make_plan([range(0, 1), range(1, 4)], [range(4, 5), range(1, 4), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(
        KeyError, match=r"'rc': layer 2 \(FailOnRecompute\) failed in recompute of microbatch 0"
    ):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    # The model is usable afterwards, with the same gradients as plain PyTorch.
    model.model[2].armed = False
    reference = copy.deepcopy(net)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference)


class FailOnCall(nn.Linear):
    """Raises on its ``n``-th call in ``phase`` ("forward" or "recompute")."""

    def __init__(self, n: int, phase: str) -> None:
        super().__init__(6, 6)
        self.n, self.phase, self.calls = n, phase, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if roundpipe.doing_recompute() == (self.phase == "recompute"):
            self.calls += 1
            if self.calls == self.n:
                raise KeyError("failing on purpose")
        return super().forward(x)


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("phase", ["forward", "recompute"])
@pytest.mark.parametrize("entry", ["forward_backward", "forward"])
def test_failure_names_the_microbatch_it_happened_in(
    num_devices: int, grain: str, phase: str, entry: str
) -> None:
    """The stages that run every microbatch in one native call name the one that failed: the
    layer fails on its second call of the phase, which is microbatch 1, except in the recompute
    of a forward()'s backward, which runs the microbatches last first (as plain PyTorch's engine
    does)."""
    torch.manual_seed(3)
    net = nn.Sequential(
        nn.Linear(6, 6), nn.Tanh(), FailOnCall(2, phase), nn.Tanh(), nn.Linear(6, 6)
    )
    model = RoundPipe(net, name="mb")
    forward = [range(0, 1), range(1, 4)] + ([range(4, 5)] if entry == "forward" else [])
    plan = make_plan(forward, [range(4, 5), range(1, 4), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    microbatch = 0 if (phase, entry) == ("recompute", "forward") else 1
    expected = rf"'mb': layer 2 \(FailOnCall\) failed in {phase} of microbatch {microbatch}"
    with pytest.raises(KeyError, match=expected):
        if entry == "forward_backward":
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        else:
            mse(model(x, roundpipe_run_config=config), y).backward()


class TupleOut(nn.Module):
    """Returns its input as a 1-tuple: the next layer gets a tuple, not a lone tensor."""

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor]:
        return (torch.sin(x),)


class TupleIn(nn.Linear):
    def forward(self, x: tuple[torch.Tensor]) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x[0])


class InPlaceFirst(nn.Module):
    """Changes its input in place (a ReLU(inplace=True) that starts a stage)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2).relu_()


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize(
    "plan",
    [
        make_plan([range(0, 2), range(2, 5)], [range(5, 6), range(2, 5), range(0, 2)]),
        make_plan(
            [range(0, 1), range(1, 3), range(3, 5)],
            [range(5, 6), range(3, 5), range(1, 3), range(0, 1)],
        ),
        # layer 1's tuple output is the end of a stage recomputed from a lone tensor
        make_plan(
            [range(0, 1), range(1, 2), range(2, 5)],
            [range(5, 6), range(2, 5), range(1, 2), range(0, 1)],
        ),
        make_plan([], [range(0, 6)]),
    ],
)
def test_tuples_and_in_place_inputs_between_layers_match_plain_pytorch(
    num_devices: int, grain: str, plan: ModelExecutePlan
) -> None:
    torch.manual_seed(4)
    net = nn.Sequential(
        nn.Linear(6, 6), TupleOut(), TupleIn(6, 6), InPlaceFirst(), nn.Linear(6, 6), nn.Tanh()
    )
    reference = copy.deepcopy(net)
    model = RoundPipe(net)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan, recompute_grain=grain)
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    for _ in range(2):  # gradients accumulate across calls as in plain PyTorch
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        expected = plain_forward_backward(reference, x, y, 3)
    model.synchronize()
    assert torch.equal(torch.as_tensor(loss), torch.as_tensor(expected))
    assert_same_grads(model.model, reference)


class ShiftedView(nn.Module):
    """Returns a strided view that starts one element past a row: the next layer's input is
    misaligned and not dense, as a slice of a wider activation is."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return torch.cat([h, h[:, :1]], dim=1)[:, 1:]


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("how", ["forward_backward", "forward then backward"])
def test_copies_of_misaligned_inputs_round_as_the_originals(
    num_devices: int, grain: str, how: str
) -> None:
    """The second microbatch of a 6 x 5 float64 batch starts 120 bytes into it, not on a 16-byte
    boundary, and MKL rounds a GEMM on such an input otherwise than on an aligned copy; so does a
    layer's strided, offset view. With every layer recomputed from a kept copy, the copies must be
    laid out and placed as the originals for gradients to match plain PyTorch bit for bit."""
    torch.manual_seed(12)
    net = nn.Sequential(
        nn.Sequential(nn.Linear(5, 7), nn.Tanh()),  # tanh's backward uses the recomputed output
        ShiftedView(),
        nn.Sequential(nn.Linear(7, 7), nn.Tanh()),
        nn.Linear(7, 3),
    )
    reference = copy.deepcopy(net)
    model = RoundPipe(net)
    plan = single_layer_plan(4)
    if how != "forward_backward":
        plan = make_plan([range(i, i + 1) for i in range(4)], plan.bwd_plan)
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    for step in range(3):
        x, y = torch.randn(6, 5), torch.randn(6, 3)
        if how == "forward_backward":
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
            expected = plain_forward_backward(reference, x, y, 2)
            assert torch.equal(torch.as_tensor(loss), expected), step
        else:
            out = model(x, roundpipe_run_config=config)
            plain = torch.cat([reference(xm) for xm in x.tensor_split(2)])
            assert torch.equal(out, plain), step
            mse(out, y).backward()
            mse(plain, y).backward()
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)


class Transposed(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1)  # a strided 3-D activation, as an LSTM's batch_first output


class LastOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 4, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rnn(x)[0]


@pytest.mark.parametrize("first", ["transposed", "lstm"])
def test_inference_and_forward_match_plain_pytorch_where_kernels_look_at_requires_grad(
    num_devices: int, first: str
) -> None:
    """Inside nn.Linear a strided 3-D input goes through matmul, which folds it into a matrix
    when the (transposed) weight requires grad, and a transpose made in no-grad mode requires
    grad only when the parameter is no view; the LSTM's kernels look at requires_grad too. The
    stage copies must behave as the parameters, in inference and in forward() with gradients."""
    torch.manual_seed(13)
    net = nn.Sequential(Transposed() if first == "transposed" else LastOutput(), nn.Linear(4, 4))
    reference = copy.deepcopy(net)
    model = RoundPipe(net)
    x = torch.randn(5, 6, 4)
    config = RoundPipeRunConfig(num_microbatch=1)
    with torch.no_grad():
        assert torch.equal(model(x, roundpipe_run_config=config), reference(x))
    assert torch.equal(model(x, roundpipe_run_config=config), reference(x))


def assert_forward_then_backward_match_plain(
    net: nn.Sequential, config: RoundPipeRunConfig
) -> None:
    """forward() of a 6 x 6 batch in two microbatches, then a backward, against plain PyTorch's
    per-microbatch graph: the output and every gradient bit for bit."""
    reference = copy.deepcopy(net)
    model = RoundPipe(net)
    x = torch.randn(6, 6)
    out = model(x, roundpipe_run_config=config)
    plain = torch.cat([reference(xm) for xm in x.tensor_split(2)])
    assert torch.equal(out, plain)
    out.square().sum().backward()
    plain.square().sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)


class TwoOfIt(nn.Module):
    """Two leaves sharing memory (a hidden state and its residual): ``(h, h)``,
    ``(h, h[:, :3])``, ``(h, h.view(torch.int64))`` or ``(h, h[:, :1].expand(-1, 6))``."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.how = how

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.how == "view":
            return h, h[:, :3]
        if self.how == "dtype":
            return h, h.view(torch.int64)
        if self.how == "expanded":
            return h, h[:, :1].expand(-1, 6)
        return h, h


class ChangesOneOfThem(nn.Module):
    def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        a, b = pair
        a.add_(1.0)  # plain PyTorch: b sees the change, as it shares a's memory
        return torch.cat([a, b.view(a.dtype)], dim=1) * 0.5


@pytest.mark.parametrize("how", ["same", "view", "dtype", "expanded"])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_inputs_sharing_memory_share_it_in_the_recompute(
    num_devices: int, grain: str, how: str
) -> None:
    """A kept input whose leaves share memory is copied as one: the recompute of a layer that
    changes one of them in place sees the other change too, as the forward and plain PyTorch
    did. The user's own arguments likewise (``model(x, x)``)."""
    torch.manual_seed(16)
    width = 9 if how == "view" else 12
    net = nn.Sequential(nn.Linear(6, 6), TwoOfIt(how), ChangesOneOfThem(), nn.Linear(width, 2))
    boundary = make_plan([range(0, 2), range(2, 4)], [range(2, 4), range(0, 2)])
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=boundary, recompute_grain=grain)
    assert_forward_then_backward_match_plain(net, config)
    # The user's own argument, whose leaves share memory; the first layer changes one of them.
    torch.manual_seed(17)
    first = nn.Sequential(ChangesOneOfThem(), nn.Linear(12, 2))
    plain_first = copy.deepcopy(first)
    model = RoundPipe(first)
    plan = make_plan([range(0, 1), range(1, 2)], [range(1, 2), range(0, 1)])
    one = RoundPipeRunConfig(num_microbatch=1, execute_plan=plan, recompute_grain=grain)
    x = torch.randn(4, 6, requires_grad=True)
    y = x.detach().clone().requires_grad_(True)
    h, g = x * 2, y * 2
    out = model((h, h), roundpipe_run_config=one)
    plain = plain_first((g, g))
    assert torch.equal(out, plain)
    out.square().sum().backward()
    plain.square().sum().backward()
    model.synchronize()
    assert torch.equal(x.grad, y.grad)
    assert_same_grads(model.model, plain_first, exact=True)


class BranchesOnRequiresGrad(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * (2.0 if x.requires_grad else 1.0)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_layers_input_requires_grad_in_the_recompute_as_in_the_forward(
    num_devices: int, grain: str
) -> None:
    """After parameter-free layers on the user's input, plain PyTorch's activation does not
    require grad; the recompute must not make it require grad either."""
    torch.manual_seed(20)
    net = nn.Sequential(nn.Tanh(), BranchesOnRequiresGrad(6, 6), nn.Tanh(), nn.Linear(6, 2))
    plan = make_plan(
        [range(i, i + 1) for i in range(4)], [range(i, i + 1) for i in range(3, -1, -1)]
    )
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    assert_forward_then_backward_match_plain(net, config)


# --------------------------------------------------------------------------------------------
# Gradients accumulated over calls, bit for bit
# --------------------------------------------------------------------------------------------


def accumulation_case(dtype: torch.dtype) -> tuple[nn.Sequential, list[torch.Tensor]]:
    """A model in ``dtype`` and three batches of 6 rows: the rounding of every sum shows."""
    torch.manual_seed(11)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    return net.to(dtype), [torch.randn(6, 8, dtype=dtype) for _ in range(3)]


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().pow(2).sum()


def train_both(
    model: RoundPipe, reference: nn.Module, x: torch.Tensor, config: RoundPipeRunConfig
) -> None:
    """One forward_backward call of ``model`` on ``x``, the per-microbatch loop on
    ``reference``."""
    model.forward_backward(
        input_args=(x,), label=x, loss_fn=lambda out, _: loss_of(out), run_config=config
    )
    for chunk in x.tensor_split(cast(int, config.num_microbatch)):
        loss_of(reference(chunk)).backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_forward_backward_calls_accumulate_as_the_per_microbatch_loop_does(
    num_devices: int, dtype: torch.dtype, grain: str
) -> None:
    """Each microbatch's gradients are added to what earlier calls left, one after the other,
    as plain PyTorch's loop adds each backward's into .grad (adding each call's sum instead
    rounds differently: 1% of the largest bf16 gradient after four calls)."""
    reference, batches = accumulation_case(dtype)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    for x in batches:
        train_both(model, reference, x, config)
    model.synchronize()
    assert_grads_equal(model.model, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_then_backward_calls_accumulate_as_one_pass_each(
    num_devices: int, dtype: torch.dtype
) -> None:
    """The backward of a forward() is one pass: plain PyTorch's engine sums the microbatches'
    gradients (the last microbatch's first) and adds the sum to .grad once."""
    reference, batches = accumulation_case(dtype)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)
    for x in batches:
        loss_of(model(x, roundpipe_run_config=config)).backward()
        loss_of(torch.cat([reference(chunk) for chunk in x.tensor_split(3)])).backward()
    model.synchronize()
    assert_grads_equal(model.model, reference)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_pass_through_several_forward_calls_accumulates_as_one_pass(
    num_devices: int, dtype: torch.dtype
) -> None:
    """One backward pass through the outputs of two forward() calls (two views of a batch), with
    gradients of earlier passes in .grad: plain PyTorch's engine sums each parameter's gradient
    over the whole pass, both calls' microbatches, last first, and adds the sum to .grad once
    (adding each call's sum in turn rounds differently)."""
    reference, (x1, x2, x3) = accumulation_case(dtype)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)

    def plain(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([reference(chunk) for chunk in x.tensor_split(3)])

    loss_of(model(x3, roundpipe_run_config=config)).backward()
    loss_of(plain(x3)).backward()
    for _ in range(2):
        ours = model(x1, roundpipe_run_config=config) * model(x2, roundpipe_run_config=config)
        loss_of(ours).backward()
        loss_of(plain(x1) * plain(x2)).backward()
    model.synchronize()
    assert_grads_equal(model.model, reference)


def test_a_failure_in_a_pass_through_several_forward_calls_adds_none_of_it(
    num_devices: int,
) -> None:
    """The backward of the second forward() call fails after the first one's ran: none of the
    pass's gradients reach the parameters, and the next pass is plain PyTorch's again."""

    class FailsOnLargeInputs(nn.Linear):
        armed = False

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if self.armed and x.abs().max() > 100:
                raise RuntimeError("large input")
            return super().forward(x)

    torch.manual_seed(21)
    reference = nn.Sequential(FailsOnLargeInputs(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model = RoundPipe(copy.deepcopy(reference), name="pair")
    small, large, y = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    config = RoundPipeRunConfig(num_microbatch=2)
    loss_of(model(small, roundpipe_run_config=config)).backward()
    loss_of(torch.cat([reference(c) for c in small.tensor_split(2)])).backward()
    # The pass runs the later call's backward first: the large one's recompute fails second.
    loss = mse(model(large * 1000, roundpipe_run_config=config), y)
    loss = loss + mse(model(large, roundpipe_run_config=config), y)
    model.model[0].armed = True
    with pytest.raises(RuntimeError, match=r"'pair'.*large input"):
        loss.backward()
    model.model[0].armed = False
    model.synchronize()
    assert_grads_equal(model.model, reference)
    loss = mse(model(small, roundpipe_run_config=config), y)
    loss = loss + mse(model(large, roundpipe_run_config=config), -y)
    loss.backward()
    expected = mse(torch.cat([reference(c) for c in small.tensor_split(2)]), y)
    expected = expected + mse(torch.cat([reference(c) for c in large.tensor_split(2)]), -y)
    expected.backward()
    model.synchronize()
    assert_grads_equal(model.model, reference)


def test_accumulation_goes_on_exactly_after_a_failed_call_and_user_changed_grads(
    num_devices: int,
) -> None:
    """A failed call leaves what earlier calls accumulated as it was, and gradients the user
    changed after synchronize() are what the next call adds to."""
    reference, (x, x2, x3) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)

    def train(x: torch.Tensor, loss_fn: object = None) -> None:
        model.forward_backward(
            input_args=(x,),
            label=x,
            loss_fn=loss_fn or (lambda out, _: loss_of(out)),
            run_config=config,
        )

    def failing(out: torch.Tensor, _: object) -> torch.Tensor:
        if failing.calls == 2:  # type: ignore[attr-defined]
            raise RuntimeError("boom")
        failing.calls += 1  # type: ignore[attr-defined]
        return loss_of(out)

    failing.calls = 0  # type: ignore[attr-defined]
    train(x)
    with pytest.raises(RuntimeError, match="boom"):
        train(x2, failing)
    train(x3)
    model.synchronize()
    with torch.no_grad():
        for p in model.model.parameters():
            p.grad.mul_(0.5)
    train(x2)
    for batch in (x, x3):
        for chunk in batch.tensor_split(3):
            loss_of(reference(chunk)).backward()
    with torch.no_grad():
        for q in reference.parameters():
            q.grad.mul_(0.5)
    for chunk in x2.tensor_split(3):
        loss_of(reference(chunk)).backward()
    model.synchronize()
    assert_grads_equal(model.model, reference)


# --------------------------------------------------------------------------------------------
# The backward of a forward(): only what the engine asks for, with the forward's weights
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["autograd.grad", "backward(inputs=)"])
def test_input_only_backward_leaves_the_parameters_gradients_alone(
    num_devices: int, how: str
) -> None:
    """torch.autograd.grad (or backward(inputs=[x])) through a forward() output computes the
    input's gradient and, as in plain PyTorch, adds nothing to the parameters' gradients."""
    reference, (x, x2, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)

    def input_grad(net: nn.Module, forward: object) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        loss = loss_of(forward(leaf))  # type: ignore[operator]
        if how == "autograd.grad":
            return torch.autograd.grad(loss, leaf)[0]
        loss.backward(inputs=[leaf])
        assert leaf.grad is not None
        return leaf.grad

    ours = input_grad(model, lambda leaf: model(leaf, roundpipe_run_config=config))
    expected = input_grad(reference, lambda leaf: torch.cat([reference(c) for c in leaf.split(2)]))
    assert torch.equal(ours, expected)
    assert all(q.grad is None for q in reference.parameters())
    # A training call then accumulates from nothing, as in plain PyTorch.
    train_both(model, reference, x2, config)
    model.synchronize()
    assert_grads_equal(model.model, reference)


def test_backward_after_an_input_only_pass_through_a_retained_graph_keeps_param_grads(
    num_devices: int,
) -> None:
    """torch.autograd.grad(..., retain_graph=True) and then backward() through the same
    forward() output: the second pass gives the parameters their gradients, as in plain
    PyTorch (the first pass's choice is not kept for it)."""
    reference, (x, _, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)

    def both_passes(forward: object) -> torch.Tensor:
        leaf = x.clone().requires_grad_()
        loss = loss_of(forward(leaf))  # type: ignore[operator]
        first = torch.autograd.grad(loss, leaf, retain_graph=True)[0]
        loss.backward()
        return first

    ours = both_passes(lambda leaf: model(leaf, roundpipe_run_config=config))
    expected = both_passes(lambda leaf: torch.cat([reference(c) for c in leaf.split(2)]))
    assert torch.equal(ours, expected)
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


def test_double_backward_through_a_forward_output_raises(num_devices: int) -> None:
    """create_graph=True (a gradient penalty) through a forward() output would get gradients
    without history, so the penalty would silently add nothing: it raises instead, and the
    model trains on."""
    reference, (x, x2, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference), name="penalised")
    config = RoundPipeRunConfig(num_microbatch=3)
    leaf = x.clone().requires_grad_()
    out = model(leaf, roundpipe_run_config=config)
    with pytest.raises(RuntimeError, match=r"'penalised'.*create_graph=True"):
        torch.autograd.grad(loss_of(out), leaf, create_graph=True)
    train_both(model, reference, x2, config)
    model.synchronize()
    assert_grads_equal(model.model, reference)


class _ComplexMix(nn.Module):
    """A real layer whose output to the next layer is complex (an FFT), or back to real."""

    def __init__(self, to_complex: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.to_complex = to_complex

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.to_complex:
            return torch.fft.fft(self.linear(x))
        return self.linear(torch.fft.ifft(x).real)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_complex_activations_between_stages_carry_gradients(num_devices: int, grain: str) -> None:
    """Complex tensors passed between stages are differentiable, as in plain PyTorch: every
    layer, in every stage, gets its gradient (forward_backward and forward() + backward())."""
    torch.manual_seed(3)
    reference = nn.Sequential(*[_ComplexMix(to_complex=i % 2 == 0) for i in range(4)])
    model = RoundPipe(copy.deepcopy(reference))
    plan = make_plan(
        [range(0, 1), range(1, 2), range(2, 3)],
        [range(3, 4), range(2, 3), range(1, 2), range(0, 1)],
    )
    config = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
    x = torch.randn(4, 8)
    train_both(model, reference, x, config)
    model.synchronize()
    assert_grads_equal(model.model, reference)
    for p in (*model.model.parameters(), *reference.parameters()):
        p.grad = None
    two_call = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain)
    loss_of(model(x, roundpipe_run_config=two_call)).backward()
    loss_of(torch.cat([reference(c) for c in x.split(2)])).backward()
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_tensor_hooks_on_parameters_run_as_in_pytorch(num_devices: int, grain: str) -> None:
    """A hook registered on a parameter (``weight.register_hook``) changes the gradients it
    receives, in every stage and both call paths, as in the plain per-microbatch loop; one
    added after wrapping applies too."""

    def hooked() -> nn.Sequential:
        reference, _ = accumulation_case(torch.float32)
        reference[0][0].bias.register_hook(lambda g: g * 3)
        reference[3][0].weight.register_hook(lambda g: g.clamp(-0.5, 0.5))
        return reference

    reference = hooked()
    model = RoundPipe(hooked())
    reference[1][0].weight.register_hook(lambda g: -g)
    model.model[1][0].weight.register_hook(lambda g: -g)
    _, (x, _, _) = accumulation_case(torch.float32)
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    train_both(model, reference, x, config)
    model.synchronize()
    assert_grads_equal(model.model, reference)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_parameter_hooks_run_once_per_backward_pass_of_a_forward(
    num_devices: int, grain: str
) -> None:
    """The backward of a forward() output is one pass over every microbatch: plain PyTorch runs
    a parameter's hook once, on its whole gradient (a clamp clips the sum, not each part)."""

    def clipped(calls: list[int]) -> nn.Sequential:
        torch.manual_seed(18)
        net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
        net[0].weight.register_hook(lambda g: (calls.append(1), g.clamp(-0.01, 0.01))[1])
        return net

    ours, plain = [], []
    model, reference = RoundPipe(clipped(ours)), clipped(plain)
    x, y = torch.randn(6, 6), torch.randn(6, 3)
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    mse(model(x, roundpipe_run_config=config), y).backward()
    mse(torch.cat([reference(c) for c in x.tensor_split(3)]), y).backward()
    model.synchronize()
    assert len(ours) == len(plain) == 1
    assert_same_grads(model.model, reference)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_parameter_hooks_run_once_per_pass_through_several_forward_calls(
    num_devices: int, grain: str
) -> None:
    """One backward pass through the outputs of two forward() calls (two views of a batch, a
    contrastive loss): plain PyTorch runs a parameter's hook once, on the sum of both calls'
    gradients, and once per pass again through a retained graph. A clamp shows the difference
    from clamping each call's part."""

    def clipped(calls: list[int]) -> nn.Sequential:
        torch.manual_seed(19)
        net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3))
        net[0].weight.register_hook(lambda g: (calls.append(1), g.clamp(-0.01, 0.01))[1])
        net[2].bias.register_hook(lambda g: g * 2)
        return net

    ours, plain = [], []
    model, reference = RoundPipe(clipped(ours)), clipped(plain)
    x1, x2, y = torch.randn(4, 6), torch.randn(4, 6), torch.randn(4, 3)
    config = RoundPipeRunConfig(num_microbatch=1, recompute_grain=grain)
    loss = mse(model(x1, roundpipe_run_config=config), y)
    loss = loss + mse(model(x2, roundpipe_run_config=config), -y)
    expected = mse(reference(x1), y) + mse(reference(x2), -y)
    loss.backward(retain_graph=True)
    expected.backward(retain_graph=True)
    model.synchronize()
    assert len(ours) == len(plain) == 1
    assert_same_grads(model.model, reference, exact=True)
    loss.backward()
    expected.backward()
    model.synchronize()
    assert len(ours) == len(plain) == 2
    assert_same_grads(model.model, reference, exact=True)


def test_a_failing_parameter_hook_names_it_and_the_model_trains_on(num_devices: int) -> None:
    """A parameter hook that raises fails the backward with the hook's error, naming model and
    parameter; the next backward is plain PyTorch's again."""
    fail = [True]

    def hook(grad: torch.Tensor) -> torch.Tensor:
        if fail[0]:
            raise ValueError("hook refused")
        return grad * 3

    torch.manual_seed(20)
    reference = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 2))
    model = RoundPipe(copy.deepcopy(reference), name="hooked")
    model.model[2].weight.register_hook(hook)
    reference[2].weight.register_hook(lambda g: g * 3)
    x, y = torch.randn(4, 5), torch.randn(4, 2)
    with pytest.raises(ValueError, match=r"'hooked'.*a hook of parameter 'weight'.*hook refused"):
        mse(model(x), y).backward()
    with pytest.raises(ValueError, match=r"'hooked'.*a hook of parameter '2\.weight'.*refused"):
        (mse(model(x), y) + mse(model(x * 2), y)).backward()
    fail[0] = False
    model.zero_grad()
    config = RoundPipeRunConfig(num_microbatch=1)
    mse(model(x, roundpipe_run_config=config), y).backward()
    mse(reference(x), y).backward()
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)


def tied(seed: int = 22) -> nn.Sequential:
    """Three layers, the first and the last sharing one trained weight."""
    torch.manual_seed(seed)
    first, last = nn.Linear(5, 5), nn.Linear(5, 5)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), last)


def clamp_counted(calls: list[int]) -> Callable[[torch.Tensor], torch.Tensor]:
    def hook(grad: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return grad.clamp(-0.1, 0.1)

    return hook


def test_a_hook_on_a_tied_weight_runs_once_on_its_whole_gradient(num_devices: int) -> None:
    """A weight two layers share gets one gradient per backward pass, the sum of both uses':
    its hook runs once, on the sum, as in plain PyTorch (not on each use's part)."""
    ours, plain = [], []
    model, reference = RoundPipe(tied()), tied()
    model.model[0].weight.register_hook(clamp_counted(ours))
    reference[0].weight.register_hook(clamp_counted(plain))
    config = RoundPipeRunConfig(num_microbatch=1)
    for x in torch.randn(2, 4, 5):
        loss_of(model(x, roundpipe_run_config=config)).backward()
        loss_of(reference(x)).backward()
    model.synchronize()
    assert len(ours) == len(plain) == 2
    assert_grads_equal(model.model, reference)


def test_forward_backward_refuses_a_hook_on_a_tied_weight(num_devices: int) -> None:
    """forward_backward computes each use of a shared weight in its own stage, so a hook on it
    would run on each part: refused, naming the parameter; the model trains on without it."""
    model, reference = RoundPipe(tied(), name="tied"), tied()
    handle = model.model[0].weight.register_hook(lambda g: g.clamp(-0.1, 0.1))
    x = torch.randn(4, 5)
    config = RoundPipeRunConfig(num_microbatch=2)
    with pytest.raises(RuntimeError, match=r"'tied'.*'weight' of layer \d.*several layers"):
        train_both(model, reference, x, config)
    handle.remove()
    train_both(model, reference, x, config)
    model.synchronize()
    for (name, p), (_, q) in zip(
        model.model.named_parameters(), reference.named_parameters(), strict=True
    ):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7, msg=name)


def test_post_accumulate_grad_hooks_are_refused_and_the_model_trains_on(num_devices: int) -> None:
    """register_post_accumulate_grad_hook hands the hook the tensor that accumulated, which
    would not be the parameter: the call raises, naming it, and after its removal the model
    trains as plain PyTorch."""
    reference, (x, _, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference), name="posthooked")
    handle = model.model[2][0].weight.register_post_accumulate_grad_hook(lambda p: None)
    config = RoundPipeRunConfig(num_microbatch=3)
    with pytest.raises(RuntimeError, match=r"'posthooked': parameter weight of layer 2 \(Linear\)"):
        train_both(model, copy.deepcopy(reference), x, config)
    handle.remove()
    model.zero_grad()
    train_both(model, reference, x, config)
    model.synchronize()
    assert_grads_equal(model.model, reference)


@dataclasses.dataclass
class _Hidden:
    h: torch.Tensor


@dataclasses.dataclass
class _Registered:
    h: torch.Tensor


class _Plain:
    """A class of the user's own, not a dataclass."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class _Slotted:
    __slots__ = ("h",)

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


torch.utils._pytree.register_dataclass(_Registered)


class _ToState(nn.Module):
    def __init__(self, kind: type) -> None:
        super().__init__()
        self.linear, self.kind = nn.Linear(8, 8), kind

    def forward(self, x: torch.Tensor) -> object:
        return self.kind(self.linear(x))


class _FromState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, state: _Hidden | _Registered | _Plain | _Slotted) -> torch.Tensor:
        return self.linear(state.h)


@pytest.mark.parametrize("hidden_kind", [_Hidden, _Plain, _Slotted])
@pytest.mark.parametrize("path", ["forward_backward", "forward"])
def test_activations_in_objects_pytree_cannot_see_raise_and_registered_ones_train(
    num_devices: int, path: str, hidden_kind: type
) -> None:
    """A layer returning an object torch's pytree does not know (a dataclass, a class of the
    user's own, one with __slots__) hides its tensors from the pipeline, which could not pass
    their gradients back: a TypeError saying how to register it, never zero gradients.
    Registered (register_dataclass), it trains as plain PyTorch."""
    plan = make_plan([range(0, 1)], [range(1, 2), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    x = torch.randn(4, 8)

    def run(model: RoundPipe) -> None:
        if path == "forward_backward":
            model.forward_backward(
                input_args=(x,), label=x, loss_fn=lambda o, _: loss_of(o), run_config=config
            )
        else:
            two_call = RoundPipeRunConfig(num_microbatch=2)
            loss_of(model(x, roundpipe_run_config=two_call)).backward()

    torch.manual_seed(5)
    hidden = RoundPipe(nn.Sequential(_ToState(hidden_kind), _FromState()), name="hidden")
    with pytest.raises(TypeError, match=rf"'hidden'.*{hidden_kind.__name__}.*register"):
        run(hidden)
    torch.manual_seed(5)
    reference = nn.Sequential(_ToState(_Registered), _FromState())
    model = RoundPipe(copy.deepcopy(reference))
    run(model)
    if path == "forward_backward":
        for chunk in x.tensor_split(2):
            loss_of(reference(chunk)).backward()
    else:
        loss_of(torch.cat([reference(c) for c in x.tensor_split(2)])).backward()
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rows", [8, 7])
def test_a_token_label_flattened_over_the_batch_trains_as_the_per_microbatch_loop(
    num_devices: int, rows: int
) -> None:
    """Token labels flattened to (batch * tokens,), as language-model losses take them, split
    automatically with their samples (as 0.1.1's even cut does): forward_backward gives the
    per-microbatch loop's gradients and losses, bit for bit, also where the batch does not
    split evenly."""
    torch.manual_seed(3)
    tokens, classes = 5, 6
    reference = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, classes))
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(rows, tokens, 8)
    label = torch.randint(0, classes, (rows * tokens,))

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, classes), target)

    config = RoundPipeRunConfig(num_microbatch=3)
    losses = model.forward_backward(
        input_args=(x,), label=label, loss_fn=loss_fn, run_config=config
    )
    expected, first = torch.tensor(0.0), 0
    for chunk in x.tensor_split(3):
        target = label[first : first + chunk.size(0) * tokens]
        first += target.numel()
        loss = loss_fn(reference(chunk), target)
        loss.backward()
        expected = expected + loss.detach()
    model.synchronize()
    assert_grads_equal(model.model, reference)
    torch.testing.assert_close(losses, expected)


@pytest.mark.parametrize("hidden_kind", [_Hidden, _Plain, _Slotted])
def test_outputs_in_objects_pytree_cannot_see_raise_and_registered_ones_train(
    num_devices: int, hidden_kind: type
) -> None:
    """A model whose output holds its tensors in an object torch's pytree does not know gives
    backward() nothing that reaches the layers (a merge function that takes them out is
    connected to nothing of the pipeline): a TypeError saying how to register it, never
    gradients lost without an error; without grad the call runs. Registered, forward() +
    backward() gives plain PyTorch's gradients."""
    config = RoundPipeRunConfig(
        num_microbatch=2, merge_output=lambda outs: torch.cat([out.h for out in outs])
    )
    x = torch.randn(4, 8)
    torch.manual_seed(5)
    hidden = RoundPipe(nn.Sequential(nn.Linear(8, 8), _ToState(hidden_kind)), name="hidden")
    with pytest.raises(TypeError, match=rf"'hidden'.*output of layer 1.*{hidden_kind.__name__}"):
        hidden(x, roundpipe_run_config=config)
    with torch.no_grad():
        assert hidden(x, roundpipe_run_config=config).shape == (4, 8)
    torch.manual_seed(5)
    reference = nn.Sequential(nn.Linear(8, 8), _ToState(_Registered))
    model = RoundPipe(copy.deepcopy(reference))
    loss_of(model(x, roundpipe_run_config=config)).backward()
    loss_of(torch.cat([reference(c).h for c in x.tensor_split(2)])).backward()
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        assert torch.equal(p.grad, q.grad)


class _Routed(nn.Module):
    """Two experts, the second run only while ``both`` (a router that sends it no token in
    some batches), and a side head whose output the loss ignores."""

    both = True

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.side = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x[0] if isinstance(x, tuple) else x
        out = self.experts[0](h)
        if _Routed.both:
            out = out + self.experts[1](h)
        return torch.tanh(out), self.side(h)


def _routed_loss(output: tuple[torch.Tensor, torch.Tensor], _: object = None) -> torch.Tensor:
    return output[0].pow(2).sum()


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("optimizer", ["torch", "roundpipe"])
def test_parameters_no_backward_reaches_get_no_gradient(
    num_devices: int, is_async: bool, optimizer: str
) -> None:
    """A parameter no backward reaches (an unused expert, a head the loss ignores) has .grad
    None, as in plain PyTorch, also after zero_grad(set_to_none=False), and a step gives its
    optimizer copy no gradient, so Adam leaves it alone: synchronous steps give plain
    PyTorch's weights bit for bit; asynchronous ones (a step late, by design) leave the
    unreached weights as they were."""
    torch.manual_seed(4)
    reference = nn.Sequential(*[_Routed() for _ in range(3)])
    model = RoundPipe(copy.deepcopy(reference))
    adam = torch.optim.Adam if optimizer == "torch" else roundpipe.optim.Adam
    ours, theirs = adam(model.optim_parameters(), lr=0.1), adam(reference.parameters(), lr=0.1)
    config = RoundPipeRunConfig(num_microbatch=2)
    torch.manual_seed(6)
    batches = [torch.randn(4, 8) for _ in range(3)]
    for iteration, x in enumerate(batches):
        # The second expert trains in the first iteration only: Adam's moments then move it
        # in later steps unless they skip it, as plain PyTorch's do.
        _Routed.both = iteration == 0
        model.forward_backward(input_args=(x,), loss_fn=_routed_loss, run_config=config)
        for chunk in x.tensor_split(2):
            _routed_loss(reference(chunk)).backward()
        model.synchronize()
        if not is_async:
            assert_grads_equal(model.model, reference)
        assert (model.model[1].experts[1].weight.grad is None) == (iteration > 0)
        assert model.model[2].side.bias.grad is None
        model.zero_grad(set_to_none=False)
        reference.zero_grad(set_to_none=False)
        for chunk in x.tensor_split(2):
            _routed_loss(reference(chunk)).backward()
        model.forward_backward(input_args=(x,), loss_fn=_routed_loss, run_config=config)
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async)
        theirs.step()
        theirs.zero_grad()
    _Routed.both = True
    model.synchronize()
    for (name, p), q in zip(model.model.named_parameters(), reference.parameters(), strict=True):
        if not is_async or "side" in name:
            assert torch.equal(p, q), name


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_an_inference_call_of_the_same_model_inside_loss_fn_changes_nothing(
    num_devices: int, grain: str
) -> None:
    """loss_fn may call the model it is the loss of (a metric on a fixed batch, under no_grad):
    that nested call binds the layers to its own copies and back to the outer stage's, so the
    gradients are plain PyTorch's with the same loss_fn, bit for bit."""
    reference, (x, probe, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    seen: list[torch.Tensor] = []

    def loss_fn(out: torch.Tensor, _: object, net: nn.Module) -> torch.Tensor:
        with torch.no_grad():
            seen.append(net(probe))
        return loss_of(out)

    model.forward_backward(
        input_args=(x,), label=x, loss_fn=lambda o, y: loss_fn(o, y, model), run_config=config
    )
    ours = seen[:]
    seen.clear()
    for chunk in x.tensor_split(3):
        loss_fn(reference(chunk), None, reference).backward()
    model.synchronize()
    assert_grads_equal(model.model, reference)
    for a, b in zip(ours, seen, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("change", ["step", "sync step", "in-place edit", "load_state_dict"])
def test_backward_after_the_weights_changed_raises_like_pytorch(
    num_devices: int, change: str
) -> None:
    """Plain PyTorch refuses to backpropagate through a graph whose saved weights changed in
    place since its forward; ours would recompute with other weights, so it refuses too (and
    the model trains on)."""
    reference, (x, x2, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference), name="changed")
    config = RoundPipeRunConfig(num_microbatch=3)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    out = model(x, roundpipe_run_config=config)
    if change in ("step", "sync step"):
        model.forward_backward(
            input_args=(x2,), label=x2, loss_fn=lambda o, _: loss_of(o), run_config=config
        )
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()), change == "sync step")
        model.step(lambda: None)  # the first step's weights land in the parameters
    elif change == "in-place edit":
        with torch.no_grad():
            model.model[1][0].weight.mul_(0.5)
    else:
        model.load_state_dict(copy.deepcopy(model.state_dict()))
    plain = reference(x)
    with torch.no_grad():
        reference[1][0].weight.mul_(0.5)  # saved by its layer's backward (layer 0's is not)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss_of(plain).backward()
    with pytest.raises(RuntimeError, match=r"modified by an inplace operation: .* 'changed'"):
        loss_of(out).backward()
    model.synchronize()
    loss_of(model(x, roundpipe_run_config=config)).backward()  # a fresh forward is fine


def test_synchronize_between_forward_and_backward_changes_nothing(num_devices: int) -> None:
    reference, (x, _, _) = accumulation_case(torch.float32)
    model = RoundPipe(copy.deepcopy(reference))
    config = RoundPipeRunConfig(num_microbatch=3)
    out = model(x, roundpipe_run_config=config)
    model.synchronize()
    model.state_dict()
    loss_of(out).backward()
    loss_of(torch.cat([reference(chunk) for chunk in x.tensor_split(3)])).backward()
    model.synchronize()
    assert_grads_equal(model.model, reference)
