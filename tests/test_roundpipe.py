"""RoundPipe against plain PyTorch: gradients, outputs, buffers, RNG replay, chaining, failures.

Every test builds the model twice (one copy for RoundPipe, one plain) and runs the plain one as the
per-microbatch loop that RoundPipe's semantics are defined by. Most tests run on 1 and on 3 virtual
CPU devices (the ``num_devices`` fixture).
"""

from __future__ import annotations

import copy
import gc
import os
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import roundpipe
import torch
from reference import assert_same_grads, make_plan, mlp
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from torch import nn


@pytest.fixture(autouse=True)
def float64_by_default() -> Iterator[None]:
    """Tight comparisons: every tensor and module of these tests is float64."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).sum()


def plain_forward_backward(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, loss_fn: Callable = mse
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-microbatch loop that defines forward_backward; returns (loss sum, outputs)."""
    total, outputs = 0.0, []
    for xm, ym in zip(x.tensor_split(n), y.tensor_split(n), strict=True):
        out = model(xm)
        loss = loss_fn(out, ym)
        torch.autograd.backward(loss)
        total = total + loss.detach()
        outputs.append(out.detach())
    return total, torch.cat(outputs)


SEED_FUSED = make_plan([range(0, 3)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)])
SEED_TRAIN = make_plan(
    [range(0, 2), range(2, 4)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)]
)
SPLIT_FUSED = make_plan([range(0, 1), range(1, 3)], [range(3, 4), range(1, 3), range(0, 1)])


@pytest.mark.parametrize("num_microbatch", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", [SEED_FUSED, SPLIT_FUSED, None], ids=["seed", "split", "auto"])
def test_forward_backward_matches_pytorch(
    num_devices: int, num_microbatch: int, grain: str, plan: ModelExecutePlan | None
) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference), name="fb")
    x, y = torch.randn(7, 6), torch.randn(7, 6)  # 7 rows: uneven microbatches
    config = RoundPipeRunConfig(
        num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan
    )
    loss, outputs = model.forward_backward(
        input_args=(x,), label=y, loss_fn=mse, return_outputs=True, run_config=config
    )
    model.synchronize()
    expected_loss, expected_outputs = plain_forward_backward(reference, x, y, num_microbatch)
    assert loss.device.type == "cpu" and not loss.requires_grad
    assert torch.equal(loss, expected_loss)
    assert torch.equal(outputs, expected_outputs)
    assert_same_grads(model.model, reference, exact=True)


@pytest.mark.parametrize("num_microbatch", [1, 3, 4])
@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("plan", [SEED_TRAIN, None], ids=["seed", "auto"])
def test_forward_then_backward_matches_pytorch(
    num_devices: int, num_microbatch: int, grain: str, plan: ModelExecutePlan | None
) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x, y = torch.randn(7, 6), torch.randn(7, 6)
    config = RoundPipeRunConfig(
        num_microbatch=num_microbatch, recompute_grain=grain, execute_plan=plan
    )
    out = model(x, roundpipe_run_config=config)
    assert out.requires_grad
    mse(out, y).backward()
    model.synchronize()
    expected = torch.cat([reference(xm) for xm in x.tensor_split(num_microbatch)])
    mse(expected, y).backward()
    assert torch.equal(out.detach(), expected.detach())
    assert_same_grads(model.model, reference)


def test_inference_matches_pytorch_and_keeps_no_graph(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(5, 6)
    with torch.no_grad():
        out = model(x)  # default: devices + 1 microbatches
        chunks = x.tensor_split(num_devices + 1)
        assert torch.equal(out, torch.cat([reference(chunk) for chunk in chunks]))
    assert not out.requires_grad
    assert all(p.grad is None for p in model.model.parameters())


def test_inference_mode_matches_pytorch(num_devices: int) -> None:
    """Under torch.inference_mode(), as plain PyTorch: the output, an inference tensor, and the
    BatchNorm statistics of a train-mode model (was: a RuntimeError, inference tensors having
    no version counter)."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.ReLU(inplace=True))
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(5, 6)
    config = RoundPipeRunConfig(num_microbatch=1)
    with torch.inference_mode():
        out = model(x, roundpipe_run_config=config)
        expected = reference(x)
    assert out.is_inference() and torch.equal(out, expected)
    assert torch.equal(model.model[1].running_mean, reference[1].running_mean)
    model.eval(), reference.eval()
    with torch.inference_mode():
        assert torch.equal(model(x, roundpipe_run_config=config), reference(x))


@pytest.mark.parametrize("by_reference", [False, True], ids=["as_kept", "by_reference"])
def test_input_changed_in_place_before_backward(
    num_devices: int, by_reference: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A forward() input changed in place before the backward: plain PyTorch raises its
    "modified by an inplace operation" error (Linear saved it); ours raises it too, or gives the
    gradients of the input the forward saw, never those of the changed one. ``by_reference``:
    the input kept as it is, as when the layers compute with a device copy (CUDA)."""
    if by_reference:
        monkeypatch.setattr(roundpipe.call.saved_inputs, "unshared", lambda saved, _: saved)
    reference = mlp()
    model = RoundPipe(
        copy.deepcopy(reference), model_run_config=RoundPipeRunConfig(num_microbatch=1)
    )
    x = torch.randn(5, 6)
    original, plain_x = x.clone(), x.clone()
    plain_out = reference(plain_x)
    plain_x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain_out.sum().backward()
    reference.zero_grad()  # the layers after the first got theirs before the error
    out = model(x)
    x.add_(1.0)
    try:
        out.sum().backward()
    except RuntimeError as error:
        assert "modified by an inplace operation" in str(error)
        assert all(p.grad is None for p in model.model.parameters())
    else:
        model.synchronize()
        reference(original).sum().backward()
        assert_same_grads(model.model, reference)
    model.zero_grad(), reference.zero_grad()
    reference(x).sum().backward()  # the model stays usable
    model(x).sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_hooks_on_the_wrapped_sequential_are_refused_not_skipped(num_devices: int) -> None:
    """Plain PyTorch runs hooks registered on the Sequential itself at every call; a RoundPipe
    call runs the layers one by one, so they are refused before any work (they were skipped,
    and the output differed), and the same hooks on the RoundPipe model act as on the
    Sequential."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(5, 6)
    for register in (
        lambda m: m.register_forward_pre_hook(lambda _, args: (args[0] * 3,)),
        lambda m: m.register_forward_hook(lambda _, args, out: out + 1),
        lambda m: m.register_full_backward_hook(lambda _, grad_in, grad_out: None),
    ):
        handle = register(model.model)
        with pytest.raises(RuntimeError, match="wrapped Sequential has hooks of its own"):
            model(x)
        with pytest.raises(RuntimeError, match="wrapped Sequential has hooks of its own"):
            model.forward_backward((x,), loss_fn=lambda out, _: out.sum())
        handle.remove()
    assert all(p.grad is None for p in model.model.parameters())
    for module in (reference, model):
        module.register_forward_pre_hook(lambda _, args: (args[0] * 3,))
        module.register_forward_hook(lambda _, args, out: out + 1)
    config = RoundPipeRunConfig(num_microbatch=1)
    expected = reference(x)
    out = model(x, roundpipe_run_config=config)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    expected.pow(2).sum().backward()
    out.pow(2).sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_gradients_accumulate_over_calls_until_cleared(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    batches = [(torch.randn(6, 6), torch.randn(6, 6)) for _ in range(2)]
    config = RoundPipeRunConfig(num_microbatch=3)
    for x, y in batches:
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        plain_forward_backward(reference, x, y, 3)
    out = model(batches[0][0], roundpipe_run_config=config)
    mse(out, batches[0][1]).backward()
    mse(reference(batches[0][0]), batches[0][1]).backward()
    model.synchronize()
    assert_same_grads(model.model, reference)

    # Cleared the usual way: the next gradients start from zero, as in plain PyTorch.
    for module in (model.model, reference):
        for p in module.parameters():
            p.grad = None
    x, y = batches[1]
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 3)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_gradients_stay_hidden_until_synchronize(num_devices: int) -> None:
    model = RoundPipe(mlp())
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    assert all(p.grad is None for p in model.model.parameters())
    model.synchronize()
    assert all(p.grad is not None for p in model.model.parameters())


def test_batchnorm_statistics_advance_once_per_forward(num_devices: int) -> None:
    torch.manual_seed(1)
    reference = nn.Sequential(
        nn.Linear(4, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8),
        nn.Linear(8, 3),
    )
    model = RoundPipe(copy.deepcopy(reference))
    plan = make_plan([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)])
    x, y = torch.randn(12, 4), torch.randn(12, 3)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=plan)
    for _ in range(2):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        plain_forward_backward(reference, x, y, 3)
    model.synchronize()
    assert_same_grads(model.model, reference)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        for index in (1, 4):
            assert torch.equal(getattr(model.model[index], name), getattr(reference[index], name))


class RecordingDropout(nn.Module):
    """Dropout that records the masks it draws in forward passes (not in recompute), so a plain
    reference can replay exactly the masks the forward pass used."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.masks: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replay is not None:
            mask = self.replay.pop(0)
        else:
            mask = (torch.rand_like(x) >= self.p).to(x.dtype)
            if not roundpipe.doing_recompute():
                self.masks.append(mask)
        return x * mask / (1 - self.p)


def dropout_model(seed: int = 2) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(6, 6), RecordingDropout(0.5), nn.Tanh()) for _ in range(5)]
    )


def run_dropout_check(preserve: bool, grain: str, iterations: int) -> list[bool]:
    """Per iteration: do RoundPipe's gradients equal plain PyTorch replaying the forward masks?"""
    plan = make_plan(
        [range(0, 2), range(2, 4)], [range(4, 5), range(3, 4), range(1, 3), range(0, 1)]
    )
    config = RoundPipeRunConfig(
        num_microbatch=3, preserve_rng_state=preserve, recompute_grain=grain, execute_plan=plan
    )
    results = []
    for iteration in range(iterations):
        reference = dropout_model(iteration)
        model = RoundPipe(copy.deepcopy(reference))
        x, y = torch.randn(6, 6), torch.randn(6, 6)
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        model.synchronize()
        dropouts = [m for m in model.model.modules() if isinstance(m, RecordingDropout)]
        replays = [m for m in reference.modules() if isinstance(m, RecordingDropout)]
        for recorded, replay in zip(dropouts, replays, strict=True):
            assert len(recorded.masks) == 3  # one forward per microbatch, none from recompute
            replay.replay = list(recorded.masks)
        plain_forward_backward(reference, x, y, 3)
        results.append(
            all(
                torch.allclose(p.grad, q.grad, rtol=1e-10, atol=1e-12)
                for p, q in zip(model.model.parameters(), reference.parameters(), strict=True)
            )
        )
    return results


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_replays_dropout_masks(num_devices: int, grain: str) -> None:
    assert all(run_dropout_check(preserve=True, grain=grain, iterations=6))


def test_dropout_check_detects_a_mask_mismatch() -> None:
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=3)
    assert not any(run_dropout_check(preserve=False, grain="stage", iterations=2))


def test_chained_models_pass_gradients_through_packed_outputs(num_devices: int) -> None:
    first_ref, second_ref = mlp(3, seed=3), mlp(2, seed=4)
    first, second = RoundPipe(copy.deepcopy(first_ref)), RoundPipe(copy.deepcopy(second_ref))
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    packed = first(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=3, merge_output=False))
    assert isinstance(packed, roundpipe.RoundPipePackedData) and len(packed) == 3
    loss = second.forward_backward(
        input_args=(packed,), label=y, loss_fn=mse, run_config=RoundPipeRunConfig(num_microbatch=3)
    )
    first.synchronize()
    second.synchronize()
    expected, _ = plain_forward_backward(nn.Sequential(first_ref, second_ref), x, y, 3)
    torch.testing.assert_close(loss, expected)
    assert_same_grads(first.model, first_ref)
    assert_same_grads(second.model, second_ref)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_a_model_chained_into_forward_backward_adds_each_microbatch_in_turn(
    num_devices: int, grain: str
) -> None:
    """forward_backward is one backward pass per microbatch, and so is the backward of the
    upstream model whose packed output it consumes: bit for bit the per-microbatch loop over
    both models, also when the gradients add to those of an earlier iteration, and a hook on an
    upstream parameter sees each microbatch's gradient in order, as in that loop."""
    first_ref, second_ref = mlp(3, width=16, seed=3), mlp(3, width=16, seed=4)
    first, second = RoundPipe(copy.deepcopy(first_ref)), RoundPipe(copy.deepcopy(second_ref))
    seen: list[torch.Tensor] = []
    expected_seen: list[torch.Tensor] = []
    first.model[0][0].weight.register_hook(lambda g: seen.append(g.clone()))
    first_ref[0][0].weight.register_hook(lambda g: expected_seen.append(g.clone()))
    config = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain)
    chained = RoundPipeRunConfig(num_microbatch=4, recompute_grain=grain, merge_output=False)
    for _ in range(2):  # the second adds to the first's gradients
        x, y = torch.randn(32, 16), torch.randn(32, 16)
        packed = first(x, roundpipe_run_config=chained)
        second.forward_backward(input_args=(packed,), label=y, loss_fn=mse, run_config=config)
        plain_forward_backward(nn.Sequential(first_ref, second_ref), x, y, 4)
    first.synchronize()
    second.synchronize()
    assert_same_grads(first.model, first_ref, exact=True)
    assert_same_grads(second.model, second_ref, exact=True)
    assert len(seen) == len(expected_seen) == 8
    assert all(torch.equal(a, b) for a, b in zip(seen, expected_seen, strict=True))


def test_input_gradients_reach_the_caller(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(6, 6, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y = torch.randn(6, 6)
    model.forward_backward(
        input_args=(x,), label=y, loss_fn=mse, run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    plain_forward_backward(reference, x_ref, y, 2)
    torch.testing.assert_close(x.grad, x_ref.grad)


class Boom(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)
        self.armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            raise ValueError("boom")
        return self.linear(x)


def os_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.mark.parametrize("where", ["forward", "fused", "loss"])
def test_failures_name_model_layer_phase_and_leave_the_model_usable(
    num_devices: int, where: str
) -> None:
    torch.manual_seed(5)
    reference = nn.Sequential(nn.Linear(6, 6), Boom(), nn.Tanh(), Boom())
    model = RoundPipe(copy.deepcopy(reference), name="boomer")
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    config = RoundPipeRunConfig(num_microbatch=2)
    # A successful call first, so the failed call's partial gradients must be rolled back. One
    # stage per layer (7 stages) reaches every device, so every copy engine has started before
    # threads are counted: automatic plans follow measured timings and could touch fewer.
    per_layer = make_plan(
        [range(0, 1), range(1, 2), range(2, 3)],
        [range(3, 4), range(2, 3), range(1, 2), range(0, 1)],
    )
    warm_up = RoundPipeRunConfig(num_microbatch=2, execute_plan=per_layer)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=warm_up)
    plain_forward_backward(reference, x, y, 2)
    threads = os_threads()

    def failing_loss(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        raise KeyError("bad label")

    if where == "loss":
        with pytest.raises(KeyError, match=r"'boomer'.*loss_fn failed.*layer 3.*microbatch 0"):
            model.forward_backward(
                input_args=(x,), label=y, loss_fn=failing_loss, run_config=config
            )
    else:
        layer = 1 if where == "forward" else 3
        model.model[layer].armed = True
        with pytest.raises(
            ValueError, match=rf"'boomer': layer {layer} \(Boom\) failed in forward"
        ):
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        model.model[layer].armed = False
    assert os_threads() == threads
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_failure_in_recompute_names_the_phase(num_devices: int) -> None:
    class FailOnRecompute(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if roundpipe.doing_recompute():
                raise RuntimeError("cannot recompute")
            return super().forward(x)

    model = RoundPipe(nn.Sequential(FailOnRecompute(6, 6), nn.Linear(6, 6)), name="rc")
    with pytest.raises(
        RuntimeError, match=r"'rc': layer 0 \(FailOnRecompute\) failed in recompute"
    ):
        model.forward_backward(
            input_args=(torch.randn(4, 6),), label=torch.randn(4, 6), loss_fn=mse
        )


def test_save_for_recompute_hands_forward_data_to_recompute(num_devices: int) -> None:
    seen: list[tuple[bool, object]] = []

    class Saver(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if roundpipe.doing_recompute():
                (token,) = roundpipe.get_recompute_data()
                seen.append((True, token))
            else:
                token = x.sum().item()
                roundpipe.save_for_recompute(token)
                seen.append((False, token))
            return super().forward(x)

    model = RoundPipe(nn.Sequential(Saver(6, 6), nn.Linear(6, 6)))
    model.forward_backward(
        input_args=(torch.randn(4, 6),),
        label=torch.randn(4, 6),
        loss_fn=mse,
        run_config=RoundPipeRunConfig(num_microbatch=2),
    )
    forward = [token for recompute, token in seen if not recompute]
    recompute = [token for recompute, token in seen if recompute]
    assert len(forward) == 2 and recompute == forward
    with pytest.raises(RuntimeError, match="only available during recompute"):
        roundpipe.get_recompute_data()
    roundpipe.save_for_recompute(1)  # outside a layer: a no-op


def test_save_for_recompute_rejects_misuse(num_devices: int) -> None:
    class Twice(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            roundpipe.save_for_recompute(1)
            roundpipe.save_for_recompute(2)
            return super().forward(x)

    class Grad(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            roundpipe.save_for_recompute(self.weight * 2)
            return super().forward(x)

    for layer, error, match in (
        (Twice, RuntimeError, "twice"),
        (Grad, ValueError, "requires grad"),
    ):
        # Last layer: the fused stage runs with grad enabled, so the weight product requires grad.
        model = RoundPipe(nn.Sequential(nn.Linear(6, 6), layer(6, 6)))
        with pytest.raises(error, match=match):
            model.forward_backward(
                input_args=(torch.randn(4, 6),), label=torch.randn(4, 6), loss_fn=mse
            )


def test_parameters_live_in_the_arena_and_user_loads_take_effect() -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    replacement = mlp(seed=9)
    model.model.load_state_dict(replacement.state_dict())
    x = torch.randn(3, 6)
    single = RoundPipeRunConfig(num_microbatch=1)
    with torch.no_grad():
        assert torch.equal(model(x, roundpipe_run_config=single), replacement(x))
    arena = model._runtime.memory.params
    begin, end = arena.data_ptr(), arena.data_ptr() + arena.numel()
    assert all(begin <= p.data_ptr() < end for p in model.model.parameters())


def test_pin_off_trains_memory_mapped_weights_where_they_are(num_devices: int, tmp_path) -> None:
    """pin_model="off" keeps every parameter in its own storage (here a memory-mapped checkpoint,
    never read into memory as a whole) and trains like PyTorch."""
    reference = mlp()
    torch.save(reference.state_dict(), tmp_path / "weights.pt")
    net = mlp(seed=5)
    net.load_state_dict(torch.load(tmp_path / "weights.pt", mmap=True), assign=True)
    storage = [p.data_ptr() for p in net.parameters()]
    model = RoundPipe(net, pin_model="off")
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = torch.randn(5, 6), torch.randn(5, 6)
    for _ in range(3):
        model.forward_backward(
            input_args=(x,), label=y, loss_fn=mse, run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        plain_forward_backward(reference, x, y, 2)
        theirs.step()
        theirs.zero_grad()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)
    assert [p.data_ptr() for p in model.model.parameters()] == storage


def test_models_without_a_run_config_do_not_share_one() -> None:
    first, second = RoundPipe(mlp()), RoundPipe(mlp())
    first.model_run_config.num_microbatch = 2
    assert second.model_run_config.num_microbatch is None
    x = torch.randn(6, 6)
    with torch.no_grad():
        expected = second.model(x)
        assert torch.allclose(second(x), expected)


def test_attribute_forwarding_and_original_model() -> None:
    inner = mlp()
    inner.custom = "inner"
    model = RoundPipe(inner)
    assert model.custom == "inner"
    model.custom = "changed"
    assert inner.custom == "changed"
    original = nn.Module()
    original.config = {"hidden": 6}
    model.set_original_model(original)
    assert model.config == {"hidden": 6}
    model.flag = True
    assert original.flag is True and inner.flag is True
    del model.flag
    assert not hasattr(original, "flag") and not hasattr(inner, "flag")
    model.eval()
    assert not inner.training and not model.training
    model.train()
    assert inner.training


def test_full_backward_hook_on_the_model_runs_as_on_the_module(num_devices: int) -> None:
    """register_full_backward_hook on a RoundPipe model runs once per backward with the output's
    gradient, as on the unwrapped module (it never ran: its flag went to the wrapped module)."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    seen: dict[str, list[torch.Tensor]] = {"plain": [], "ours": []}
    for key, module in (("plain", reference), ("ours", model)):
        module.register_full_backward_hook(
            lambda _, grad_in, grad_out, key=key: seen[key].append(grad_out[0])
        )
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1), requires_grad=True)
        module(x).pow(2).sum().backward()
    assert len(seen["ours"]) == len(seen["plain"]) == 1
    torch.testing.assert_close(seen["ours"][0], seen["plain"][0], rtol=1e-12, atol=1e-12)


def test_default_name_is_the_caller_location() -> None:
    model = RoundPipe(mlp())
    assert model.name.startswith("test_roundpipe.py:")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"pin_model": "pinned"}, ValueError, "pin_model must be one of"),
        ({"optim_dtype": torch.int32}, TypeError, "optim_dtype"),
        ({"name": 3}, TypeError, "name must be a str"),
        ({"model_run_config": {}}, TypeError, "model_run_config must be a RoundPipeRunConfig"),
    ],
)
def test_constructor_rejects_bad_arguments(kwargs: dict, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        RoundPipe(mlp(), **kwargs)


def test_constructor_rejects_non_modules() -> None:
    with pytest.raises(TypeError, match=r"model must be an nn\.Module"):
        RoundPipe(lambda x: x)  # type: ignore[arg-type]


def tied_lm(seed: int = 8) -> nn.Sequential:
    """Embedding and output head share one weight, in the first and the last layer."""
    torch.manual_seed(seed)
    embedding, head = nn.Embedding(11, 6), nn.Linear(6, 11, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(6, 6), nn.Tanh(), head)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")


@pytest.mark.parametrize("pin_model", ["alloc", "off"])
@pytest.mark.parametrize("plan", [SEED_FUSED, None], ids=["seed", "auto"])
def test_parameters_shared_across_layers_train_like_pytorch(
    num_devices: int, plan: ModelExecutePlan | None, pin_model: str
) -> None:
    reference = tied_lm()
    model = RoundPipe(copy.deepcopy(reference), pin_model=pin_model)
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    theirs = torch.optim.SGD(reference.parameters(), lr=0.1)
    assert len(list(model.optim_parameters())) == len(list(reference.parameters()))
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        tokens = torch.randint(0, 11, (4, 5), generator=generator)
        labels = torch.randint(0, 11, (4, 5), generator=generator)
        model.forward_backward(
            input_args=(tokens,), label=labels, loss_fn=cross_entropy, run_config=config
        )
        model.synchronize()
        plain_forward_backward(reference, tokens, labels, 2, cross_entropy)
        assert_same_grads(model.model, reference)
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        theirs.step()
        theirs.zero_grad()
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_shared_parameter_changed_by_the_user_reaches_every_layer(num_devices: int) -> None:
    reference = tied_lm()
    model = RoundPipe(copy.deepcopy(reference))
    with torch.no_grad():
        for module in (model.model, reference):
            module[0].weight.mul_(0.5)
    tokens = torch.randint(0, 11, (4, 5))
    single = RoundPipeRunConfig(num_microbatch=1)
    with torch.no_grad():
        assert torch.equal(model(tokens, roundpipe_run_config=single), reference(tokens))


def test_requires_grad_without_grad_mode_is_an_error() -> None:
    model = RoundPipe(mlp())
    with torch.no_grad(), pytest.raises(RuntimeError, match="requires_grad"):
        model(torch.randn(2, 6), roundpipe_run_config=RoundPipeRunConfig(requires_grad=True))
    with torch.no_grad(), pytest.raises(RuntimeError, match="forward_backward"):
        model.forward_backward(
            input_args=(torch.randn(2, 6),), label=torch.randn(2, 6), loss_fn=mse
        )


def test_bad_plan_is_rejected_before_work(num_devices: int) -> None:
    model = RoundPipe(mlp())
    bad = make_plan([range(0, 4)], [range(3, 4), range(2, 3), range(1, 2), range(0, 1)])
    with pytest.raises(ValueError):
        model.forward_backward(
            input_args=(torch.randn(2, 6),),
            label=torch.randn(2, 6),
            loss_fn=mse,
            run_config=RoundPipeRunConfig(execute_plan=bad),
        )
    assert all(p.grad is None for p in model.model.parameters())


def rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.slow
def test_soak_memory_and_threads_stay_flat() -> None:
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=3)
    model = RoundPipe(mlp(6, width=32))
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    config = RoundPipeRunConfig(num_microbatch=4)

    def iteration() -> None:
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        out = model(x, roundpipe_run_config=config)
        mse(out, y).backward()
        model.synchronize()
        for p in model.model.parameters():
            p.grad = None

    for _ in range(20):
        iteration()
    gc.collect()
    threads, rss = os_threads(), rss_bytes()
    for _ in range(200):
        iteration()
    gc.collect()
    assert os_threads() == threads
    assert rss_bytes() - rss < 8 * 2**20, "resident memory grew by more than 8 MiB"
    assert threading.active_count() >= 1


class Recorder(nn.Module):
    """Records (layer, forward call count) in execution order; recompute is not recorded."""

    def __init__(self, index: int, log: list[tuple[int, int]]) -> None:
        super().__init__()
        self.index, self.log, self.calls = index, log, 0
        self.linear = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not roundpipe.doing_recompute():
            self.log.append((self.index, self.calls))
            self.calls += 1
        return self.linear(x)


@pytest.mark.parametrize("devices", [2, 3])
def test_runtime_runs_stages_in_the_simulators_order(
    devices: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roundpipe import _C
    from roundpipe.call import stage

    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    log: list[tuple[int, int]] = []
    layers, microbatches = 5, 3
    model = RoundPipe(nn.Sequential(*[Recorder(i, log) for i in range(layers)]))
    assigned: list[int] = []
    next_device = stage.next_device
    monkeypatch.setattr(
        stage, "next_device", lambda: assigned.append(next_device()) or assigned[-1]
    )
    plan = make_plan([range(i, i + 1) for i in range(layers)], [])
    with torch.no_grad():
        model(
            torch.randn(6, 3),
            roundpipe_run_config=RoundPipeRunConfig(num_microbatch=microbatches, execute_plan=plan),
        )
    _, schedule = _C.simulate_schedule([1.0] * layers, devices, microbatches)
    # Stage s went to device (first + s) mod D in the runtime and to s mod D in the simulator.
    assert assigned == [(assigned[0] + s) % devices for s in range(layers)]
    for device in range(devices):
        simulated = [
            (stage, mb)
            for stage, mb, d, _, _ in sorted(schedule, key=lambda e: e[3])
            if d == device
        ]
        ran = [
            (stage, mb) for stage, mb in log if assigned[stage] == (assigned[0] + device) % devices
        ]
        assert ran == simulated


class Output(dict):
    """A pytree type that, like Hugging Face's ModelOutput, drops None fields when rebuilt."""


torch.utils._pytree.register_pytree_node(
    Output,
    lambda out: (
        [v for v in out.values() if v is not None],
        [k for k, v in out.items() if v is not None],
    ),
    lambda values, keys: Output(zip(keys, values, strict=True)),
    serialized_type_name="tests.Output",
)


class ToOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Output:
        return Output(
            hidden=self.linear(x), mask=torch.ones(x.shape[0], dtype=torch.long), cache=None
        )


class FromOutput(nn.Linear):
    def forward(self, out: Output) -> torch.Tensor:  # type: ignore[override]
        return super().forward(out["hidden"]) * out["mask"][:, None]


def test_outputs_that_drop_none_fields_between_stages(num_devices: int) -> None:
    torch.manual_seed(6)
    reference = nn.Sequential(ToOutput(), FromOutput(6, 6), nn.Tanh())
    model = RoundPipe(copy.deepcopy(reference))
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    plan = make_plan([range(0, 1)], [range(1, 3), range(0, 1)])
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_failed_merge_rolls_back_the_calls_gradients(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x, y = torch.randn(4, 6), torch.randn(4, 6)

    def bad_merge(outputs: list[torch.Tensor]) -> torch.Tensor:
        raise ValueError("cannot merge")

    config = RoundPipeRunConfig(num_microbatch=2, merge_output=bad_merge)
    with pytest.raises(ValueError, match="cannot merge"):
        model.forward_backward(
            input_args=(x,), label=y, loss_fn=mse, return_outputs=True, run_config=config
        )
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_backward_twice_with_retained_graph_doubles_gradients(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(4, 6)
    config = RoundPipeRunConfig(num_microbatch=2)
    loss = model(x, roundpipe_run_config=config).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    expected = torch.cat([reference(chunk) for chunk in x.tensor_split(2)]).sum()
    expected.backward(retain_graph=True)
    expected.backward()
    model.synchronize()
    assert_same_grads(model.model, reference)


@pytest.mark.parametrize("loss", [3.0, [], None])
def test_loss_fn_must_return_tensors(loss: object) -> None:
    model = RoundPipe(mlp(), name="lossy")
    with pytest.raises(TypeError, match=r"'lossy': loss_fn must return a tensor"):
        model.forward_backward(input_args=(torch.randn(4, 6),), loss_fn=lambda out, label: loss)


@pytest.mark.parametrize(
    ("loss_fn", "torch_message", "ours"),
    [
        (
            lambda out, label: out - label,
            "only for scalar outputs",
            r"result .* has shape \(2, 6\)",
        ),
        (
            lambda out, label: [(out - label).sum(), out - label],
            "only for scalar outputs",
            r"result\[1\] .* has shape \(2, 6\)",
        ),
        (
            lambda out, label: (out - label).sum().detach(),
            "does not require grad",
            "result .* does not require grad",
        ),
    ],
    ids=["not-scalar", "not-scalar-in-list", "detached"],
)
def test_a_loss_backward_cannot_take_names_loss_fn_and_the_model_trains_on(
    num_devices: int, loss_fn: Callable[..., object], torch_message: str, ours: str
) -> None:
    """PyTorch's backward() raises RuntimeError for such a loss; ours raises it naming loss_fn
    (not the layers), before any gradient of the call lands, and the next call is exact."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference), name="lossy")
    x, y = torch.randn(4, 6), torch.randn(4, 6)
    with pytest.raises(RuntimeError, match=torch_message):
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            torch.autograd.backward(loss_fn(copy.deepcopy(reference)(xm), ym))
    config = RoundPipeRunConfig(num_microbatch=2)
    with pytest.raises(RuntimeError, match=r"'lossy': loss_fn's " + ours) as raised:
        model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=config)
    assert "microbatch 0" in str(raised.value) and "layer" not in str(raised.value)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 2)
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)


def test_run_config_passed_under_another_name_is_a_type_error_naming_it() -> None:
    model = RoundPipe(mlp(), name="named")
    x = torch.randn(4, 6)
    config = RoundPipeRunConfig(num_microbatch=2)
    with pytest.raises(TypeError, match=r"roundpipe_run_config=\.\.\., got run_config="):
        model(x, run_config=config)
    with pytest.raises(TypeError, match="roundpipe_run_config must be a RoundPipeRunConfig"):
        model(x, roundpipe_run_config={"num_microbatch": 2})
    with pytest.raises(TypeError, match="run_config must be a RoundPipeRunConfig"):
        model.forward_backward(input_args=(x,), run_config=3)


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_clears_what_was_accumulated_before_synchronize(
    num_devices: int, set_to_none: bool
) -> None:
    """model.zero_grad() between two backward passes clears the first one's gradients, as in
    plain PyTorch, whether or not synchronize() published them; a step with none since gives
    the optimizer none (zeros with set_to_none=False), and the weights stay."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x, x2 = torch.randn(4, 6), torch.randn(4, 6)
    config = RoundPipeRunConfig(num_microbatch=1)
    model(x, roundpipe_run_config=config).sum().backward()
    model.zero_grad(set_to_none)
    model(x2, roundpipe_run_config=config).sum().backward()
    reference(x).sum().backward()
    reference.zero_grad(set_to_none)
    reference(x2).sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference, exact=True)
    model.zero_grad(set_to_none)
    assert all((p.grad is None) == set_to_none for p in model.model.parameters())
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.model.parameters()]
    seen: list[object] = []
    model.step(lambda: (seen.extend(p.grad for p in model.parameters()), optimizer.step()))
    model.synchronize()
    # As plain PyTorch's optimizer would see them: None, or zeros with set_to_none=False.
    assert seen and all((grad is None) == set_to_none for grad in seen)
    assert all(torch.equal(p, q) for p, q in zip(model.model.parameters(), before, strict=True))


def test_a_kv_cache_argument_is_refused_before_work() -> None:
    """A Hugging Face cache object would be shared by every microbatch (each layer appending
    every microbatch's keys to it): ValueError naming the argument, not wrong attention."""
    base = type("Cache", (), {"__module__": "transformers.cache_utils"})
    dynamic = type("DynamicCache", (base,), {"__module__": "transformers.cache_utils"})

    class TakesCache(nn.Module):
        def forward(self, x: torch.Tensor, past_key_values: object = None) -> torch.Tensor:
            return x * 2

    model = RoundPipe(nn.Sequential(TakesCache()), name="cached")
    with pytest.raises(ValueError, match=r"past_key_values is a transformers DynamicCache"):
        model(torch.randn(4, 6), past_key_values=dynamic())
    with pytest.raises(ValueError, match="use_cache=False"):
        model.forward_backward(input_args=(torch.randn(4, 6), dynamic()))


def test_wrapping_a_module_twice_is_refused_while_the_first_model_lives(num_devices: int) -> None:
    net = mlp()
    first = RoundPipe(net, name="first")
    with pytest.raises(ValueError, match="already wrapped by RoundPipe model 'first'"):
        RoundPipe(net)
    with pytest.raises(ValueError, match="already wrapped"):
        RoundPipe(nn.Sequential(*list(net)[1:]))  # a part of it holds the same parameters
    RoundPipe(copy.deepcopy(net))  # a copy is a model of its own
    cycle: list[object] = [first]
    cycle.append(cycle)  # the first model is garbage only once the collector runs
    del first, cycle
    again = RoundPipe(net)  # once the first model is gone, its module may be wrapped anew
    reference = copy.deepcopy(net)
    x = torch.randn(4, 6)
    with torch.no_grad():
        one = RoundPipeRunConfig(num_microbatch=1)
        assert torch.equal(again(x, roundpipe_run_config=one), reference(x))


@pytest.mark.parametrize("switch", ["eval", "train"])
def test_a_mode_switch_between_forward_and_backward_leaves_the_gradients_alone(
    num_devices: int, switch: str
) -> None:
    """Plain PyTorch's graph keeps what the forward computed: BatchNorm's batch statistics, the
    dropout mask. The recompute runs in the forward's train/eval mode, not in the new one."""
    torch.manual_seed(14)
    net = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Dropout(0.3), nn.Linear(6, 2))
    if switch == "train":
        net.eval()
    model = RoundPipe(copy.deepcopy(net))
    x = torch.randn(8, 6)
    config = RoundPipeRunConfig(num_microbatch=1)
    torch.manual_seed(15)
    out = model(x, roundpipe_run_config=config)
    getattr(model, switch)()
    out.square().sum().backward()
    model.synchronize()
    switched = [p.grad.clone() for p in model.model.parameters()]
    # The same call without the switch, from the same seeds.
    unswitched = RoundPipe(copy.deepcopy(net))
    torch.manual_seed(15)
    unswitched(x, roundpipe_run_config=config).square().sum().backward()
    unswitched.synchronize()
    for grad, p in zip(switched, unswitched.model.parameters(), strict=True):
        assert torch.equal(grad, p.grad)
    assert all(m.training == (switch == "train") for m in model.model.modules())


def test_two_models_may_share_a_frozen_module(num_devices: int) -> None:
    """Nothing trains a frozen parameter, so two models may hold the same frozen base."""
    torch.manual_seed(21)
    base = nn.Linear(6, 6).requires_grad_(False)
    first = RoundPipe(nn.Sequential(base, nn.Linear(6, 2)))
    second = RoundPipe(nn.Sequential(base, nn.Linear(6, 3)))
    x = torch.randn(4, 6)
    one = RoundPipeRunConfig(num_microbatch=1)
    with torch.no_grad():
        assert torch.equal(first(x, roundpipe_run_config=one), first.model(x))
        assert torch.equal(second(x, roundpipe_run_config=one), second.model(x))


@pytest.mark.parametrize("convert", ["half", "float", "to(bfloat16)", "to(meta)"])
def test_converting_the_model_after_wrapping_is_refused_and_it_trains_on(
    num_devices: int, convert: str
) -> None:
    """``.half()``, ``.to(dtype)``, ``.to(device)`` of a RoundPipe model would leave its host
    arenas laid out for the old data (its gradients were garbage): ``RuntimeError`` before
    anything changes, and the model trains as plain PyTorch. Conversions that change nothing
    are no-ops."""
    reference = mlp(layers=3)
    model = RoundPipe(copy.deepcopy(reference), name="converted")
    conversions: dict[str, Callable[[], object]] = {
        "half": model.half,
        "float": model.float,
        "to(bfloat16)": lambda: model.to(torch.bfloat16),
        "to(meta)": lambda: model.to("meta"),
    }
    with pytest.raises(RuntimeError, match=r"'converted'.*convert the module before wrapping"):
        conversions[convert]()
    assert model.cpu() is model and model.double() is model  # float64 already: no change
    x, y = torch.randn(6, 6), torch.randn(6, 6)
    config = RoundPipeRunConfig(num_microbatch=3)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_forward_backward(reference, x, y, 3)
    model.synchronize()
    assert_same_grads(model.model, reference)


def test_replacing_a_parameters_data_after_wrapping_is_an_error_naming_it(
    num_devices: int,
) -> None:
    """A conversion of the wrapped module itself (``model.model.float()``) or ``param.data =``
    moves a parameter out of the arenas: the next call and step raise, naming it, instead of
    computing with the bytes laid out for the old data."""
    model = RoundPipe(mlp(layers=3), name="replaced")
    model.model.float()
    x = torch.randn(4, 6, dtype=torch.float32)
    with pytest.raises(RuntimeError, match=r"'replaced'.*parameter '0\.0\.weight' was replaced"):
        model(x)
    with pytest.raises(RuntimeError, match=r"'replaced'.*was replaced after wrapping"):
        model.step(lambda: None)


def test_pickling_or_deep_copying_the_model_is_a_clear_type_error(num_devices: int) -> None:
    """A RoundPipe model owns arenas and threads: ``copy.deepcopy``, ``pickle`` and
    ``torch.save(model)`` raise a ``TypeError`` saying what to copy instead; a deep copy of the
    wrapped module, wrapped again, computes what the model does."""
    import io
    import pickle

    model = RoundPipe(mlp(layers=3), name="copied")
    for copy_it in (
        lambda: copy.deepcopy(model),
        lambda: pickle.dumps(model),
        lambda: torch.save(model, io.BytesIO()),
    ):
        with pytest.raises(TypeError, match=r"'copied' cannot be pickled.*model\.model"):
            copy_it()
    model.synchronize()
    again = RoundPipe(copy.deepcopy(model.model))
    x = torch.randn(4, 6)
    assert torch.equal(again(x), model(x))


@pytest.mark.parametrize("change", ["append", "replace", "delete"])
def test_changing_the_wrapped_layers_after_wrapping_is_an_error(
    num_devices: int, change: str
) -> None:
    """A layer appended to, removed from or replaced in the wrapped Sequential would not be
    what the calls run (the layers wrapped): the next call or step raises instead."""
    model = RoundPipe(mlp(layers=3), name="edited")
    sequential = model.model
    edits: dict[str, Callable[[], object]] = {
        "append": lambda: sequential.append(nn.Linear(6, 6)),
        "replace": lambda: sequential.__setitem__(0, nn.Linear(6, 6)),
        "delete": lambda: sequential.__delitem__(2),
    }
    edits[change]()
    with pytest.raises(RuntimeError, match=r"'edited'.*layers of the wrapped Sequential changed"):
        model(torch.randn(2, 6))
    with pytest.raises(RuntimeError, match=r"'edited'.*wrap the changed Sequential anew"):
        model.step(lambda: None)


def test_module_hooks_run_again_in_the_recompute_and_can_tell(num_devices: int) -> None:
    """A forward hook runs in the forward pass and again when its layer is recomputed (as with
    torch.utils.checkpoint), where ``roundpipe.doing_recompute()`` is true: a hook with side
    effects acts once per forward pass by skipping those."""
    model = RoundPipe(mlp(layers=3))
    seen: list[bool] = []
    model.model[2].register_forward_hook(lambda *_: seen.append(roundpipe.doing_recompute()))
    config = RoundPipeRunConfig(num_microbatch=2)
    model(torch.randn(4, 6), roundpipe_run_config=config).sum().backward()
    assert seen == [False, False, True, True]


class _Detached(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x * 2, x.detach()


@pytest.mark.parametrize(
    "frozen, input_grad",
    [((), False), ((0, 1, 2), False), ((0, 1, 2), True), ((0,), False)],
    ids=["trained", "frozen", "frozen-input-grad", "first-frozen"],
)
def test_outputs_require_grad_exactly_where_plain_pytorchs_do(
    num_devices: int, frozen: tuple[int, ...], input_grad: bool
) -> None:
    """An output that plain PyTorch's does not have requiring grad (detached, or from frozen
    layers and an input that requires none) does not require it: a backward through it raises
    as in plain PyTorch instead of running and reaching nothing. The others train alike."""
    reference = nn.Sequential(*mlp(layers=3), _Detached())
    for index in frozen:
        reference[index].requires_grad_(False)
    model = RoundPipe(copy.deepcopy(reference))
    x = torch.randn(4, 6)
    config = RoundPipeRunConfig(num_microbatch=2)
    ours = model(x.clone().requires_grad_(input_grad), roundpipe_run_config=config)
    plain_input = x.clone().requires_grad_(input_grad)
    plain = [reference(chunk) for chunk in plain_input.tensor_split(2)]
    for i in range(2):
        assert ours[i].requires_grad == plain[0][i].requires_grad
    assert not ours[1].requires_grad
    with pytest.raises(RuntimeError, match="does not require grad"):
        ours[1].sum().backward()
    if not plain[0][0].requires_grad:
        with pytest.raises(RuntimeError, match="does not require grad"):
            ours[0].sum().backward()
        return
    ours_input = x.clone().requires_grad_(input_grad)
    ours = model(ours_input, roundpipe_run_config=config)
    ours[0].sum().backward()
    sum(out[0].sum() for out in plain).backward()
    model.synchronize()
    for (name, p), q in zip(model.model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-10, atol=1e-12, msg=name)
    if input_grad:
        torch.testing.assert_close(ours_input.grad, plain_input.grad)


@pytest.mark.slow
def test_compile_compiles_the_models_own_call_as_on_a_plain_module() -> None:
    """``model.compile()`` compiles the RoundPipe model's call, as nn.Module.compile() compiles
    the module's (it used to land on the wrapped Sequential, leaving the model's call eager); the
    compiled call computes what plain PyTorch does, and the wrapped Sequential stays eager."""
    reference = mlp(layers=3)
    model = RoundPipe(copy.deepcopy(reference))
    graphs: list[object] = []

    def backend(graph: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> Callable[..., Any]:
        graphs.append(graph)
        return graph.forward

    model.compile(backend=backend)
    x = torch.randn(4, 6)
    out = model(x)
    assert graphs, "the model's call was not compiled"
    compiled = len(graphs)
    assert torch.equal(model.model(x), reference(x))
    assert len(graphs) == compiled
    torch.testing.assert_close(out, reference(x))  # in microbatches: matmuls may round otherwise
    out.sum().backward()
    reference(x).sum().backward()
    model.synchronize()
    assert_same_grads(model.model, reference)
