"""The step pipeline against plain PyTorch training: synchronous steps, staleness-1 asynchronous
steps, low-precision models with fp32 optimizer copies, and failures in ``step_fn``."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import roundpipe
import torch
from reference import MICROBATCHES, batches, master_step, mse, plain_grads, stale_step
from roundpipe import OptimizerCtx, RoundPipe, RoundPipeRunConfig
from torch import nn

CONFIG = RoundPipeRunConfig(num_microbatch=MICROBATCHES)


def mlp(dtype: torch.dtype = torch.float64, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 5), nn.Tanh(), nn.Linear(5, 3)
    ).to(dtype)


OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
def test_synchronous_steps_equal_plain_training(num_devices: int, optimizer: str) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    ours = OPTIMIZERS[optimizer](model.optim_parameters())
    theirs = OPTIMIZERS[optimizer](reference.parameters())

    def step_fn() -> None:
        ours.step()
        ours.zero_grad()

    for x, y in batches(5):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        model.step(step_fn, is_async=False)
        plain_grads(reference, x, y)
        theirs.step()
        theirs.zero_grad()
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


def test_asynchronous_steps_are_one_step_stale(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    # The weights each forward pass really computed with (the bound copies, not recompute).
    used: list[list[torch.Tensor]] = []

    def record(module: nn.Module, args: object) -> None:
        if not roundpipe.doing_recompute():
            used.append([p.detach().clone() for p in module.parameters()])

    for layer in model.model:
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(record)
    # Plain simulation: `live` is what the iterations train on, `master` what the optimizer holds.
    live, master = copy.deepcopy(reference), copy.deepcopy(reference)
    theirs = torch.optim.SGD(master.parameters(), lr=0.1)
    single = RoundPipeRunConfig(num_microbatch=1)

    for x, y in batches(5):
        used.clear()
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=single)
        model.step(lambda: (ours.step(), ours.zero_grad()))  # async: one step stale
        computed_with = [t for weights in used for t in weights]
        for a, b in zip(computed_with, live.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        mse(live(x), y).backward()
        stale_step(live, master, theirs)
    model.synchronize()
    for p, q in zip(model.model.parameters(), master.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("adam", [torch.optim.Adam, roundpipe.optim.Adam], ids=["torch", "native"])
def test_bf16_model_with_fp32_optimizer_copies(num_devices: int, adam: type) -> None:
    """fp32 copies stepped by Adam, then cast to bf16 (by torch in the reference). The native Adam
    takes the fused path: it writes the bf16 weights in its update pass, bit-identically."""
    reference = mlp(torch.bfloat16)
    model = RoundPipe(copy.deepcopy(reference), optim_dtype=torch.float32)
    copies = list(model.optim_parameters())
    assert all(c.dtype == torch.float32 for c in copies)
    ours = adam(copies, lr=0.01)
    masters = [p.detach().float().requires_grad_(True) for p in reference.parameters()]
    theirs = adam(masters, lr=0.01)

    def step_fn() -> None:
        ours.step()
        ours.zero_grad()

    for x, y in batches(4, torch.bfloat16):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        model.step(step_fn, is_async=False)
        fused = len(masters) if adam is roundpipe.optim.Adam else 0
        assert len(model._runtime.steps._fused) == fused
        plain_grads(reference, x, y)
        master_step(reference, masters, theirs)
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
            assert p.dtype == torch.bfloat16
            assert torch.equal(p, q)


def test_tied_parameters_have_one_copy_and_both_names() -> None:
    tied = nn.Linear(4, 4, bias=False)
    layer = nn.Sequential(tied, nn.Tanh(), tied)
    model = RoundPipe(nn.Sequential(layer))
    assert [n for n, _ in model.optim_named_parameters()] == ["model.0.0.weight"]
    both = list(model.optim_named_parameters(prefix="net", remove_duplicate=False))
    assert [n for n, _ in both] == ["net.model.0.0.weight", "net.model.0.2.weight"]
    assert both[0][1] is both[1][1]


def test_step_fn_sees_optimizer_copies_and_names() -> None:
    model = RoundPipe(mlp())
    names = [name for name, _ in model.optim_named_parameters()]
    assert names == [f"model.{name}" for name, _ in model.model.named_parameters()]
    copies = list(model.optim_parameters())
    assert all(c is not p for c, p in zip(copies, model.model.parameters(), strict=True))
    seen: list[list[nn.Parameter]] = []
    x, y = batches(1)[0]
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.step(lambda: seen.append(list(model.parameters())), is_async=False)
    assert [id(p) for p in seen[0]] == [id(c) for c in copies]
    with OptimizerCtx():
        with OptimizerCtx():
            assert next(iter(model.parameters())) is copies[0]
        assert next(iter(model.parameters())) is copies[0]
    assert next(iter(model.parameters())) is model.model[0].weight


def test_step_fn_failure_surfaces_later_and_training_continues(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    x, y = batches(1)[0]

    def failing() -> None:
        raise ArithmeticError("step exploded")

    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.step(failing)
    with pytest.raises(ArithmeticError, match="step exploded"):
        model.synchronize()
    # Weights unchanged by the failed step; the model keeps training.
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.step(failing)
    with pytest.raises(ArithmeticError):
        for _ in range(1000):  # raised by the first forward after the step finished
            model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
    assert any(
        not torch.equal(p, q)
        for p, q in zip(model.model.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.parametrize("is_async", [True, False])
def test_no_gradients_since_the_step_publish_none_as_zero_grad_leaves_them(
    num_devices: int, is_async: bool
) -> None:
    """After optimizer.zero_grad() plain PyTorch's .grad is None until the next backward; ours
    after a step (and before any training call) too, so `if p.grad is not None` code agrees."""
    model = RoundPipe(mlp())
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    model.synchronize()
    assert all(p.grad is None for p in model.model.parameters())
    x, y = batches(1)[0]
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.synchronize()
    assert all(p.grad is not None for p in model.model.parameters())
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=is_async)
    model.synchronize()
    assert all(p.grad is None for p in model.model.parameters())
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.synchronize()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.model.parameters())


@pytest.mark.parametrize("is_async", [True, False])
@pytest.mark.parametrize("error", [KeyboardInterrupt, GeneratorExit])
def test_a_step_fn_raising_keyboard_interrupt_fails_that_step_once(
    num_devices: int, is_async: bool, error: type[BaseException]
) -> None:
    """The step's own KeyboardInterrupt is its error, raised once like any other (not taken
    for a Ctrl-C during the wait, which would leave it pending for ever); training goes on."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    x, y = batches(1)[0]

    def interrupted() -> None:
        raise error("from step_fn")

    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    with pytest.raises(error, match="from step_fn"):
        model.step(interrupted, is_async=is_async)
        model.synchronize()
    model.synchronize()  # raised once
    # The failed step left its gradients in the optimizer's .grad, as a plain optimizer.step()
    # that raised would: the next step adds this iteration's.
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
    plain_grads(reference, x, y)
    plain_grads(reference, x, y)
    plain.step()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda m: m.step(3), TypeError, "step_fn must be callable"),
        (lambda m: m.step(lambda: None, "yes"), TypeError, "is_async must be a bool"),
    ],
)
def test_step_rejects_bad_arguments(call: Callable, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        call(RoundPipe(mlp()))


@pytest.mark.slow
def test_optimizer_thread_starts_lazily() -> None:
    import os
    import subprocess
    import sys

    code = (
        "import os, torch, roundpipe\n"
        "torch.set_num_threads(1)\n"
        "n = lambda: len(os.listdir(f'/proc/{os.getpid()}/task'))\n"
        "m = roundpipe.RoundPipe(torch.nn.Linear(2, 2))\n"
        "before = n()\n"
        "m.forward_backward(input_args=(torch.randn(2, 2),), loss_fn=lambda o, l: o.sum())\n"
        "m.step(lambda: None)\n"
        "m.synchronize()\n"
        "print(before, n())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ROUNDPIPE_CPU_DEVICES": "1"},
    )
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert after > before  # the copy engine and optimizer threads exist only once used
    assert roundpipe.device_count() >= 1


@pytest.mark.slow
def test_exit_right_after_asynchronous_work_is_clean() -> None:
    """Native workers must not release Python-owned tensors during interpreter shutdown: exits
    right after async steps, write-backs and copies end with status 0, every time."""
    import os
    import subprocess
    import sys

    code = (
        "import torch, roundpipe\n"
        "net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))\n"
        "m = roundpipe.RoundPipe(net)\n"
        "opt = torch.optim.SGD(m.optim_parameters(), lr=0.1)\n"
        "for _ in range(3):\n"
        "    m.forward_backward(input_args=(torch.randn(4, 8),), loss_fn=lambda o, l: o.sum())\n"
        "    m.step(lambda: (opt.step(), opt.zero_grad()))\n"
        "m.synchronize()\n"
    )
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        env = {**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "2"}
        for _ in range(8):
            result = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
            )
            assert result.returncode == 0, result.stderr
    finally:
        busy.kill()


def train_both(
    model: RoundPipe,
    ours: torch.optim.Optimizer,
    reference: nn.Module,
    plain: torch.optim.Optimizer,
    batch: tuple[torch.Tensor, torch.Tensor],
    is_async: bool = False,
) -> None:
    """One iteration (forward_backward, step) of ``model`` and of the plain ``reference``."""
    x, y = batch
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.step(lambda: (ours.step(), ours.zero_grad()), is_async=is_async)
    plain_grads(reference, x, y)
    plain.step()
    plain.zero_grad()


@pytest.mark.parametrize("is_async", [False, True])
@pytest.mark.parametrize("how", ["copy_", "load_state_dict of the wrapped model"])
def test_weights_the_user_changes_in_place_are_what_the_next_step_updates(
    num_devices: int, is_async: bool, how: str
) -> None:
    """After synchronize(), an in-place change of the weights (p.copy_, a load into the wrapped
    model) is what the next step updates, as with plain PyTorch's optimizer: the optimizer
    copies take it, and no write-back of an older step undoes it."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.05)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05)
    data = batches(3)

    def edit(net: nn.Module) -> None:
        with torch.no_grad():
            if how == "copy_":
                net[2].weight.copy_(torch.full_like(net[2].weight, 0.5))
            else:
                state = {k: v.clone() for k, v in net.state_dict().items()}
                state["0.bias"].fill_(-0.25)
                net.load_state_dict(state)

    train_both(model, ours, reference, plain, data[0], is_async)
    model.synchronize()
    edit(model.model)
    edit(reference)
    for batch in data[1:]:
        train_both(model, ours, reference, plain, batch)
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("is_async", [False, True])
def test_a_parameter_frozen_after_wrapping_stays_put_as_in_plain_pytorch(
    num_devices: int, is_async: bool
) -> None:
    """requires_grad_(False) between steps: no gradient reaches its copy (.grad stays None), so
    momentum and weight decay leave it alone, as plain PyTorch's optimizer skips it."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    make = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)  # noqa: E731
    ours, plain = make(model.optim_parameters()), make(reference.parameters())
    for i, batch in enumerate(batches(4)):
        if i == 2:
            model.synchronize()
            model.model[0].requires_grad_(False)
            reference[0].requires_grad_(False)
            frozen = reference[0].weight.detach().clone()
        train_both(model, ours, reference, plain, batch, is_async)
        if is_async:  # the weights of plain PyTorch's step: no staleness to model here
            model.synchronize()
    model.synchronize()
    assert torch.equal(model.model[0].weight, frozen)
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_unfreezing_a_parameter_frozen_at_wrapping_is_an_error_before_work() -> None:
    net = mlp()
    net[0].requires_grad_(False)
    model = RoundPipe(net, name="thawed")
    net[0].requires_grad_(True)
    x, y = batches(1)[0]
    with pytest.raises(RuntimeError, match=r"'thawed': parameter '0\.weight' was frozen"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    with pytest.raises(RuntimeError, match="was frozen"):
        model(x)
    with torch.no_grad():
        model(x)  # inference computes no gradient
    net[0].requires_grad_(False)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)


@pytest.mark.parametrize("is_async", [False, True])
def test_an_optimizer_over_the_model_parameters_is_refused(
    num_devices: int, is_async: bool
) -> None:
    """An optimizer built over model.parameters() (plain PyTorch's spelling) would find no
    gradient there (they go to the optimizer copies) and silently change nothing: its step
    raises, naming the fix, and an optimizer over optim_parameters() then trains as plain
    PyTorch."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference), name="misbuilt")
    wrong = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = batches(1)[0]
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    with pytest.raises(RuntimeError, match=r"'misbuilt'.*model\.optim_parameters\(\)"):
        model.step(lambda: (wrong.step(), wrong.zero_grad()), is_async=is_async)
        model.synchronize()
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    plain = torch.optim.SGD(reference.parameters(), lr=0.1)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
    plain_grads(reference, x, y)  # the failed step's gradients stayed, as for any failed step
    plain_grads(reference, x, y)
    plain.step()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("order", ["model first", "module first", "module, then synchronize"])
def test_gradients_of_the_wrapped_module_called_directly_add_to_the_models(
    num_devices: int, order: str
) -> None:
    """A backward through the wrapped module called directly (an auxiliary loss) leaves its
    gradients in .grad; plain PyTorch adds them to the model's, and so does the next call,
    step() or synchronize(), in the order they came."""
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    ours = torch.optim.SGD(model.optim_parameters(), lr=0.05)
    plain = torch.optim.SGD(reference.parameters(), lr=0.05)

    def through_model(x: torch.Tensor, y: torch.Tensor) -> None:
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
        plain_grads(reference, x, y)

    def through_module(x: torch.Tensor, y: torch.Tensor) -> None:
        mse(model.model(x), y).backward()
        mse(reference(x), y).backward()

    for x, y in batches(2):
        if order == "model first":
            through_model(x, y)
            through_module(x, y)
        else:
            through_module(x, y)
            if order == "module, then synchronize":
                model.synchronize()
                for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
                    assert torch.equal(p.grad, q.grad)
            through_model(x, y)
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        plain.step()
        plain.zero_grad()
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)


def test_zero_grad_clears_gradients_left_in_grad_while_none_is_published(num_devices: int) -> None:
    reference = mlp()
    model = RoundPipe(copy.deepcopy(reference))
    x, y = batches(1)[0]
    mse(model.model(x), y).backward()  # an auxiliary backward through the module itself
    model.zero_grad()
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=CONFIG)
    plain_grads(reference, x, y)
    model.synchronize()
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad)
    mse(model.model(x), y).backward()
    model.zero_grad()
    model.synchronize()
    assert all(p.grad is None for p in model.model.parameters())
