"""Lifecycle and faults on the Python side: fork after training, Ctrl-C with a slow or blocked
step, errors of asynchronous work, and checkpoints with bad entries.

Cases that could hang run in subprocesses with timeouts, so a regression fails instead.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from roundpipe import GradScaler, RoundPipe, RoundPipeRunConfig, wrap_model_to_roundpipe
from roundpipe._native import _C as roundpipe_native
from torch import nn

CPU_ENV = {**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "3"}

PRELUDE = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    # Ctrl-C raises KeyboardInterrupt even where the suite runs in the background (nohup, &),
    # whose children inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    from torch import nn
    from roundpipe import RoundPipe, RoundPipeRunConfig

    def new_model(seed):
        torch.manual_seed(seed)
        return RoundPipe(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]))

    config = RoundPipeRunConfig(num_microbatch=2)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    loss_fn = lambda out, label: out.square().mean()

    def train(model, optimizer, steps, step_fn=None):
        losses = []
        for _ in range(steps):
            loss = model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=config)
            model.step(step_fn or (lambda: (optimizer.step(), optimizer.zero_grad())))
            losses.append(float(loss))
        return losses
    """
)


def _run(script: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=CPU_ENV,
    )


# -- fork ------------------------------------------------------------------------------------

FORK_SCRIPT = """
    model = new_model(0)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    train(model, optimizer, 3)  # the last step is still in flight when we fork

    def child(case):
        if case == "exit":
            sys.exit(0)
        if case == "inference":
            with torch.no_grad():
                out = model(x)
            print("inference", float(out.square().sum()), flush=True)
        elif case == "train":
            print("train", train(model, optimizer, 2), flush=True)
        elif case == "new_model":
            other = new_model(5)
            opt = torch.optim.SGD(other.optim_parameters(), lr=0.1)
            print("new_model", train(other, opt, 2), flush=True)
        sys.exit(0)

    case = sys.argv[1]
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(case)
    _, status = os.waitpid(pid, 0)
    print("child_status", os.waitstatus_to_exitcode(status), flush=True)
    print("child_seconds", time.monotonic() - started, flush=True)
    # The parent runs the same work as the child, unaffected by it.
    if case == "inference":
        with torch.no_grad():
            print("inference", float(model(x).square().sum()), flush=True)
    elif case == "train":
        print("train", train(model, optimizer, 2), flush=True)
    elif case == "new_model":
        other = new_model(5)
        opt = torch.optim.SGD(other.optim_parameters(), lr=0.1)
        print("new_model", train(other, opt, 2), flush=True)
    model.synchronize()
"""


@pytest.mark.slow
@pytest.mark.parametrize("case", ["exit", "inference", "train", "new_model"])
def test_forked_child_after_training_with_a_step_in_flight(case: str) -> None:
    result = _run(FORK_SCRIPT, case)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert "child_status 0" in lines, result.stdout + result.stderr
    seconds = next(float(line.split()[1]) for line in lines if line.startswith("child_seconds"))
    assert seconds < 30.0
    if case != "exit":
        # Child and parent both printed the same work's result from the same state.
        outputs = [line for line in lines if line.startswith(case)]
        assert len(outputs) == 2 and outputs[0] == outputs[1], result.stdout


FORK_DURING_A_CALL_SCRIPT = """
    import signal
    torch.set_num_threads(1)
    model = new_model(0)
    stop = threading.Event()

    def trainer():
        while not stop.is_set():
            model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=config)

    thread = threading.Thread(target=trainer)
    thread.start()
    time.sleep(0.3)
    pid = os.fork()  # waits for the call in flight on the trainer thread
    if pid == 0:
        signal.alarm(30)  # a hang fails the test instead of hanging it
        with torch.no_grad():
            out = model(x, roundpipe_run_config=config)
        plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        plain.load_state_dict(model.model.state_dict())
        with torch.no_grad():
            expected = torch.cat([plain(chunk) for chunk in x.tensor_split(2)])
        os._exit(0 if torch.equal(out, expected) else 3)
    _, status = os.waitpid(pid, 0)
    stop.set()
    thread.join()
    print("child_status", os.waitstatus_to_exitcode(status), flush=True)
"""


@pytest.mark.slow
def test_fork_while_another_thread_is_in_a_call_gives_the_child_a_usable_model() -> None:
    """fork() waits for calls in flight on other threads: the child does not inherit a model
    lock held by a thread it does not have (its first call would wait for ever), and computes
    what plain PyTorch computes with the inherited weights."""
    result = _run(FORK_DURING_A_CALL_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert "child_status 0" in result.stdout.splitlines(), result.stdout + result.stderr


CTRL_C_DURING_FORK_SCRIPT = """
    import signal
    model = new_model(0)
    model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=config)
    model.step(lambda: time.sleep(60))  # fork() waits for the step in flight
    threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
    started = time.monotonic()
    try:
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        print("fork_returned", flush=True)
    except KeyboardInterrupt:
        print("interrupted_after", time.monotonic() - started, flush=True)
    os._exit(0)  # not waiting for the sleeping step at exit
"""


def test_ctrl_c_while_fork_waits_for_a_step_reaches_the_caller() -> None:
    """An exception in a fork hook is only printed: the Ctrl-C is raised where fork() returns
    instead, within the second, not lost while the script carries on."""
    result = _run(CTRL_C_DURING_FORK_SCRIPT, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    interrupted = [float(line.split()[1]) for line in lines if line.startswith("interrupted")]
    assert interrupted and interrupted[0] < 5.0, result.stdout + result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


DATALOADER_SCRIPT = """
    from torch.utils.data import DataLoader, TensorDataset

    model = new_model(0)
    reference = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    reference.load_state_dict(model.model.state_dict())
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(32, 16, generator=torch.Generator().manual_seed(2)))
    # One step first: the optimizer thread has run before the workers fork.
    train(model, optimizer, 1)
    model.synchronize()
    ref_loss = lambda inputs: sum(reference(c).square().mean() for c in inputs.chunk(2))
    ref_loss(x).backward()  # forward_backward sums its microbatches' losses
    ref_optimizer.step()
    for epoch in range(2):
        loader = DataLoader(data, batch_size=8, num_workers=2, multiprocessing_context="fork")
        for (batch,) in loader:
            model.forward_backward(input_args=(batch,), loss_fn=loss_fn, run_config=config)
            model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
            ref_optimizer.zero_grad()
            ref_loss(batch).backward()
            ref_optimizer.step()
    model.synchronize()
    for got, want in zip(model.model.parameters(), reference.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    print("done", flush=True)
"""


@pytest.mark.slow
def test_dataloader_with_fork_workers_feeds_training_and_exits() -> None:
    result = _run(DATALOADER_SCRIPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["done"], result.stdout + result.stderr


# -- Ctrl-C ----------------------------------------------------------------------------------

SIGINT_SCRIPT = """
    model = new_model(0)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    never = threading.Event()

    def slow_step():
        print("in step", flush=True)
        time.sleep(3.0)
        optimizer.step()

    def blocked_step():
        print("in step", flush=True)
        never.wait()

    step_fn = {"slow": slow_step, "blocked": blocked_step}[sys.argv[1]]
    train(model, optimizer, 1, step_fn)
    try:
        if sys.argv[2] == "synchronize":
            model.synchronize()
        else:
            while True:  # training goes on; the next step() waits for the running one
                train(model, optimizer, 1, step_fn)
    except KeyboardInterrupt:
        print("interrupted at", time.monotonic(), file=sys.stderr, flush=True)
        raise
"""


def _interrupt(*args: str) -> tuple[float, float, int, str]:
    """Start the script, send SIGINT once the step runs; (seconds until the KeyboardInterrupt
    arrived, seconds until the process exited, exit status, stderr)."""
    process = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(SIGINT_SCRIPT), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=CPU_ENV,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "in step"
        time.sleep(0.3)  # the main thread is inside its wait
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=20)
        exited = time.monotonic() - sent
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    marks = [line.split()[-1] for line in stderr.splitlines() if line.startswith("interrupted at")]
    arrived = float(marks[0]) - sent if marks else float("inf")
    return arrived, exited, process.returncode, stderr


@pytest.mark.slow
@pytest.mark.parametrize("step", ["slow", "blocked"])
@pytest.mark.parametrize("where", ["synchronize", "training"])
def test_ctrl_c_exits_within_seconds_with_a_step_in_flight(step: str, where: str) -> None:
    arrived, exited, status, stderr = _interrupt(step, where)
    assert "KeyboardInterrupt" in stderr
    assert arrived < 1.0, stderr
    assert status == -signal.SIGINT, stderr  # as Python exits on an uncaught Ctrl-C
    assert exited < 5.0
    assert "Fatal Python error" not in stderr and "terminate called" not in stderr


# -- errors of asynchronous work -------------------------------------------------------------


class _SlowWrite:
    """A weight write whose first wait is interrupted by Ctrl-C (fault injection)."""

    def __init__(self) -> None:
        self.waits = 0

    def synchronize(self) -> None:
        self.waits += 1
        if self.waits == 1:
            raise KeyboardInterrupt

    def query(self) -> bool:
        return self.waits > 1


def test_ctrl_c_while_waiting_for_weight_writes_keeps_them_queued(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An interrupted wait must not forget the write: uploads still wait for it (its fence) and
    the next wait waits for it again."""
    from roundpipe.memory import ModelMemory

    write = _SlowWrite()
    monkeypatch.setattr(roundpipe_native, "writeback_async", lambda dsts, srcs: write)
    memory = ModelMemory([nn.Linear(4, 4)], "alloc")
    memory.write_async(0, [torch.zeros(1)], [torch.ones(1)])
    with pytest.raises(KeyboardInterrupt):
        memory.wait_writes()
    assert memory.fence(range(1)) is write
    memory.wait_writes()
    assert write.waits == 2 and memory.fence(range(1)) is None


def _trained(num_devices: int, steps: int = 1) -> tuple[RoundPipe, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = RoundPipe(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]), name="net")
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    config = RoundPipeRunConfig(num_microbatch=2)
    for _ in range(steps):
        model.forward_backward(
            input_args=(torch.randn(8, 16),),
            loss_fn=lambda o, _: o.square().mean(),
            run_config=config,
        )
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    return model, optimizer


class _ScaleTrouble(ArithmeticError):
    pass


def _failing_update(scaler: GradScaler) -> _ScaleTrouble:
    """Make the scaler's next update fail on the optimizer thread (fault injection)."""
    cause = _ScaleTrouble("update failed")

    def fail(*args: Any) -> None:
        raise cause

    scaler._update = fail  # type: ignore[method-assign]
    return cause


@pytest.mark.parametrize("where", ["step", "synchronize", "getter", "up_to_date_getter"])
def test_failed_async_scaler_update_reaches_the_caller(where: str, num_devices: int) -> None:
    model, optimizer = _trained(num_devices)
    scaler = GradScaler()
    cause = _failing_update(scaler)
    scaler.update(is_async=True)  # returns at once; the failure happens on the optimizer thread
    with pytest.raises(_ScaleTrouble) as raised:
        if where == "step":
            model.step(lambda: optimizer.step())
        elif where == "synchronize":
            model.synchronize()
        elif where == "getter":
            model.synchronize()  # the update has run by then
            scaler.get_scale()
        else:
            scaler.get_scale(up_to_date=True)
    assert raised.value is cause or raised.value.__cause__ is cause
    # Reported once; the model goes on training.
    model.synchronize()
    scaler.get_scale(up_to_date=True)


def test_step_fn_error_names_the_phase_and_keeps_type(num_devices: int) -> None:
    model, _ = _trained(num_devices)
    cause = KeyError("no such state")

    def bad_step() -> None:
        raise cause

    model.synchronize()
    model.forward_backward(input_args=(torch.randn(8, 16),), loss_fn=lambda o, _: o.square().mean())
    model.step(bad_step)
    with pytest.raises(KeyError) as raised:
        model.synchronize()
    assert raised.value.__cause__ is cause
    assert f"RoundPipe model '{model.name}': optimizer step (step_fn)" in str(raised.value)
    assert "no such state" in str(raised.value)
    model.synchronize()  # raised once


@pytest.mark.parametrize("is_async", [False, True], ids=["sync", "async"])
def test_a_model_whose_step_failed_is_freed_once_dropped(num_devices: int, is_async: bool) -> None:
    """After a failed step has reached the caller, dropping the model frees it, as a plain
    module and optimizer are freed (the step's error held its model alive, and with it its
    memory and an offload folder's lock, for the rest of the process)."""
    import gc
    import weakref

    model, _ = _trained(num_devices)

    def bad_step() -> None:
        raise ValueError("bad step")

    model.forward_backward(input_args=(torch.randn(8, 16),), loss_fn=lambda o, _: o.square().mean())
    with pytest.raises(ValueError, match="bad step"):
        model.step(bad_step, is_async=is_async)
        model.synchronize()
    dropped = weakref.ref(model)
    del model
    gc.collect()
    assert dropped() is None


def test_update_accepts_a_tensor_new_scale() -> None:
    scaler = GradScaler(init_scale=8.0)
    reference = torch.amp.GradScaler("cpu", init_scale=8.0)
    new_scale = torch.tensor(3.0)
    reference.scale(torch.ones(()))  # torch's scaler creates its scale lazily
    scaler.update(new_scale, is_async=False)
    reference.update(new_scale)
    assert scaler.get_scale(up_to_date=True) == reference.get_scale() == 3.0
    for bad in (torch.tensor([1.0, 2.0]), torch.tensor(2), torch.tensor(1.0, requires_grad=True)):
        with pytest.raises(ValueError, match="new_scale"):
            scaler.update(bad)
    with pytest.raises(ValueError, match="new_scale"):
        scaler.update(torch.tensor(float("nan")))


# -- checkpoints with bad entries ------------------------------------------------------------


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """Everything a load could change: weights, optimizer copies, pending gradients."""
    with torch.no_grad():
        state = {f"param.{k}": v.detach().clone() for k, v in model.named_parameters()}
        state.update({f"copy.{k}": v.detach().clone() for k, v in model.optim_named_parameters()})
    state.update({f"saved.{k}": v.clone() for k, v in model.state_dict().items()})
    return state


def _assert_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = _snapshot(model)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


def _model_with_pending_grads(num_devices: int) -> tuple[RoundPipe, dict[str, Any]]:
    model, _ = _trained(num_devices, steps=2)
    # Gradients accumulated but not stepped: saved as _roundpipe.grads.
    model.forward_backward(input_args=(torch.randn(8, 16),), loss_fn=lambda o, _: o.square().mean())
    # Differs from the model (the pending write-back's flag stays a bool).
    checkpoint = {k: v * 2 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    checkpoint["_roundpipe.grads"] = model.state_dict()["_roundpipe.grads"].flip(0)
    return model, checkpoint


@pytest.mark.parametrize(
    "corrupt",
    [
        ("_roundpipe.optim.model.1.weight", torch.ones(1, 16)),
        ("_roundpipe.optim.model.1.weight", torch.ones(16)),
        ("_roundpipe.optim.model.1.weight", torch.ones(16, 16, dtype=torch.int64)),
        ("model.2.weight", torch.ones(16)),
        ("model.2.bias", "not a tensor"),
        ("_roundpipe.grads", torch.zeros(8, dtype=torch.uint8)),
        ("_roundpipe.pending_writeback", torch.tensor(1.0)),
        ("_roundpipe.pending_writeback", torch.ones(2, dtype=torch.bool)),
    ],
    ids=[
        "copy-1x16",
        "copy-16",
        "copy-int",
        "weight-16",
        "bias-str",
        "grads-size",
        "pending-float",
        "pending-2",
    ],
)
@pytest.mark.parametrize("strict", [True, False])
def test_bad_entry_fails_the_load_and_changes_nothing(
    corrupt: tuple[str, Any], strict: bool, num_devices: int
) -> None:
    model, checkpoint = _model_with_pending_grads(num_devices)
    key, value = corrupt
    checkpoint[key] = value
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match=f"(?s)Error\\(s\\) in loading state_dict.*{key}"):
        model.load_state_dict(checkpoint, strict=strict)
    _assert_unchanged(model, before)


def test_unknown_and_missing_keys_as_pytorch_reports_them(num_devices: int) -> None:
    model, checkpoint = _model_with_pending_grads(num_devices)
    del checkpoint["model.3.bias"]
    checkpoint["_roundpipe.optim.model.9.weight"] = torch.ones(16, 16)
    checkpoint["_roundpipe.momentum"] = torch.ones(3)
    checkpoint["model.extra"] = torch.ones(3)
    before = _snapshot(model)
    with pytest.raises(RuntimeError) as raised:
        model.load_state_dict(checkpoint)
    message = str(raised.value)
    assert message.startswith("Error(s) in loading state_dict for RoundPipe:")
    assert 'Missing key(s) in state_dict: "model.3.bias".' in message
    for key in ("_roundpipe.optim.model.9.weight", "_roundpipe.momentum", "model.extra"):
        assert f'"{key}"' in message.split("Unexpected key(s)")[1]
    _assert_unchanged(model, before)

    # strict=False loads the rest and returns the keys, as nn.Module.load_state_dict does.
    plain = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    plain_result = plain.load_state_dict(
        {k.removeprefix("model."): v for k, v in checkpoint.items() if k.startswith("model.")},
        strict=False,
    )
    result = model.load_state_dict(checkpoint, strict=False)
    assert result.missing_keys == [f"model.{k}" for k in plain_result.missing_keys]
    assert sorted(result.unexpected_keys) == sorted(
        ["_roundpipe.optim.model.9.weight", "_roundpipe.momentum", "model.extra"]
    )
    torch.testing.assert_close(model.model[0].weight, checkpoint["model.0.weight"])
    torch.testing.assert_close(
        dict(model.optim_named_parameters())["model.0.weight"],
        checkpoint["_roundpipe.optim.model.0.weight"],
    )


def test_a_good_checkpoint_still_loads_exactly(num_devices: int) -> None:
    model, checkpoint = _model_with_pending_grads(num_devices)
    model.load_state_dict(checkpoint)
    saved = model.state_dict()
    assert saved.keys() == checkpoint.keys()
    for key, value in checkpoint.items():
        assert torch.equal(saved[key], value), key


class _Glued(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(16, 16)
        self.body = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.emb(x)))


@pytest.mark.parametrize("bad", ["shape", "unknown"])
def test_auto_roundpipe_glue_entries_are_validated(bad: str) -> None:
    torch.manual_seed(0)
    net = _Glued()
    # Skipped modules stay on the host: their parameters are the glue.
    model = wrap_model_to_roundpipe(net, skip_modules=[net.emb, net.head])
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    model(torch.randn(4, 16)).square().mean().backward()
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    checkpoint = {k: v + 1 for k, v in model.state_dict().items()}
    glue = [k for k in checkpoint if k.startswith("_roundpipe.glue.")]
    assert glue
    if bad == "shape":
        checkpoint[glue[0]] = checkpoint[glue[0]].reshape(-1)[:1]
    else:
        checkpoint["_roundpipe.glue.nothing.weight"] = torch.ones(2)
    before = _snapshot(model)
    with pytest.raises(RuntimeError, match="Error\\(s\\) in loading state_dict for AutoRoundPipe"):
        model.load_state_dict(checkpoint)
    _assert_unchanged(model, before)


@pytest.fixture
def ctrl_c_raises() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt in this process while the test runs, also where the suite
    runs in the background (nohup, &) and inherited SIGINT ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.mark.usefixtures("ctrl_c_raises")
@pytest.mark.parametrize("where", ["write-back", "hand-over"])
def test_ctrl_c_inside_a_steps_bookkeeping_is_held_until_it_is_done(
    monkeypatch: pytest.MonkeyPatch, num_devices: int, where: str
) -> None:
    """A Ctrl-C that lands while step() writes back the previous step's weights (layer by
    layer) or hands the gradients over still reaches the caller, but only once that work is
    done: retrying step() then trains exactly as without the interrupt (plain PyTorch with the
    asynchronous steps' staleness of one), never with some layers' weights or gradients lost."""
    from roundpipe.memory import ModelMemory

    def build() -> nn.Sequential:
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])

    def batch(i: int) -> torch.Tensor:
        return torch.randn(4, 8, generator=torch.Generator().manual_seed(i))

    def loss(out: torch.Tensor, _: object = None) -> torch.Tensor:
        return out.square().sum()

    # Plain PyTorch, each iteration on the weights before the previous step (staleness 1).
    reference, copies = build(), build()
    reference_optimizer = torch.optim.SGD(copies.parameters(), lr=0.1)
    for i in range(4):
        for chunk in batch(i).tensor_split(2):
            loss(reference(chunk)).backward()
        with torch.no_grad():
            for p, q in zip(reference.parameters(), copies.parameters(), strict=True):
                q.grad, p.grad = p.grad, None
                p.copy_(q)  # the previous step's weights land before this step runs
        reference_optimizer.step()
    with torch.no_grad():
        for p, q in zip(reference.parameters(), copies.parameters(), strict=True):
            p.copy_(q)

    model = RoundPipe(build())
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    target = ModelMemory.write_async if where == "write-back" else ModelMemory.fold_alias_grads
    calls = [0]

    def interrupted(self: ModelMemory, *args: Any) -> Any:
        calls[0] += 1
        if calls[0] == 2:  # the second step: the first one's write-back or this hand-over
            signal.raise_signal(signal.SIGINT)
        return target(self, *args)

    name = "write_async" if where == "write-back" else "fold_alias_grads"
    monkeypatch.setattr(ModelMemory, name, interrupted)
    interrupts = 0
    for i in range(4):
        model.forward_backward(
            input_args=(batch(i),), loss_fn=loss, run_config=RoundPipeRunConfig(num_microbatch=2)
        )
        while True:
            try:
                model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
                break
            except KeyboardInterrupt:
                interrupts += 1
    model.synchronize()
    assert interrupts == 1
    for p, q in zip(model.model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
