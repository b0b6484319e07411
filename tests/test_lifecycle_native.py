"""Native lifecycle: a forked child uses roundpipe afresh, and waits on native events obey Ctrl-C.

Every case runs in a subprocess with a timeout, so a regression fails instead of hanging.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

CPU_ENV = {**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "3"}

FORK_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    import torch
    from torch import nn
    from roundpipe import RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    model = RoundPipe(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    config = RoundPipeRunConfig(num_microbatch=2)
    x = torch.randn(8, 16)
    loss_fn = lambda out, label: out.square().mean()

    def train_step():
        loss = model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=config)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
        return float(loss)

    for _ in range(3):
        train_step()
    model.synchronize()

    def after_fork():
        # The same work in parent and child, from the same state.
        with torch.no_grad():
            inference = model(x)
        loss = train_step()
        model.synchronize()
        with torch.no_grad():
            after = model(x)
        return torch.cat([inference.flatten(), torch.tensor([loss]), after.flatten()])

    result_path = sys.argv[1]
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        torch.save(after_fork(), result_path)
        sys.exit(0)  # a normal exit: atexit handlers drain the native workers
    expected = after_fork()
    _, status = os.waitpid(pid, 0)
    got = torch.load(result_path)
    print("child_status", os.waitstatus_to_exitcode(status))
    print("child_seconds", time.monotonic() - started)
    print("same", torch.equal(got, expected))
    """
)


@pytest.mark.slow
def test_forked_child_runs_inference_and_training_then_exits(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-c", FORK_SCRIPT, str(tmp_path / "child.pt")],
        capture_output=True,
        text=True,
        timeout=120,
        env=CPU_ENV,
    )
    assert result.returncode == 0, result.stderr
    lines = dict(line.split(" ", 1) for line in result.stdout.splitlines())
    assert lines["child_status"] == "0", result.stderr
    assert float(lines["child_seconds"]) < 30.0
    assert lines["same"] == "True", result.stdout + result.stderr


STALE_SCRIPT = textwrap.dedent(
    """
    import os, sys, time
    from roundpipe import _C

    running = _C.submit_optimizer_job(lambda: time.sleep(2.0))
    time.sleep(0.2)  # the job is running on the optimizer thread
    pid = os.fork()
    if pid == 0:
        started = time.monotonic()
        try:
            running.synchronize()
            print("stale: returned", flush=True)
        except RuntimeError as error:
            print("stale: RuntimeError", "fork" in str(error), flush=True)
        ran = []
        _C.submit_optimizer_job(lambda: ran.append(os.getpid())).synchronize()
        print("fresh:", ran == [os.getpid()], flush=True)
        _C.drain_workers()
        print("child_seconds", time.monotonic() - started, flush=True)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    running.synchronize()
    print("parent: done", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def test_forked_child_does_not_wait_on_the_parents_unfinished_work() -> None:
    result = subprocess.run(
        [sys.executable, "-c", STALE_SCRIPT],
        capture_output=True,
        text=True,
        timeout=60,
        env=CPU_ENV,
    )
    assert result.returncode == 0, result.stderr
    out = result.stdout.splitlines()
    assert "stale: RuntimeError True" in out, result.stdout + result.stderr
    assert "fresh: True" in out
    assert "parent: done 0" in out
    child_seconds = next(float(line.split()[1]) for line in out if line.startswith("child_seconds"))
    assert child_seconds < 1.5  # not the parent's 2 s job


WAIT_SCRIPT = textwrap.dedent(
    """
    import signal, sys, time
    from roundpipe import _C

    # Ctrl-C raises KeyboardInterrupt even where the suite runs in the background (nohup, &),
    # whose children inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    event = _C.submit_optimizer_job(lambda: time.sleep(20.0))
    print("ready", flush=True)
    try:
        if sys.argv[1] == "synchronize":
            event.synchronize()
        else:
            event.block_current_stream(0)
    except KeyboardInterrupt:
        print("interrupted", time.monotonic(), flush=True)
        import os
        os._exit(0)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("wait", ["synchronize", "block_current_stream"])
def test_ctrl_c_interrupts_a_wait_on_an_event(wait: str) -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", WAIT_SCRIPT, wait],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=CPU_ENV,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # inside the wait
        sent = time.monotonic()
        process.send_signal(signal.SIGINT)
        stdout, stderr = process.communicate(timeout=10)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 0, stderr
    word, when = stdout.split()
    assert word == "interrupted"
    assert float(when) - sent < 1.0


STUCK_COPY_SCRIPT = textwrap.dedent(
    """
    import signal, sys, threading
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in WAIT_SCRIPT
    import torch
    import roundpipe
    from roundpipe._native import _C

    # A copy that waits for a job that never finishes: what a copy waiting on a hung GPU is.
    never = threading.Event()
    blocker = _C.submit_optimizer_job(never.wait)
    _C.copy_async(0, torch.zeros(4), torch.ones(4), "activation", blocker)
    print("queued", flush=True)
    if sys.argv[1] == "error":
        raise RuntimeError("the program fails")
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("exit_kind", ["error", "ctrl_c"])
def test_exit_with_a_stuck_copy_is_bounded(exit_kind: str) -> None:
    """The exit's wait for queued native work gives up after an error (within the exit bound)
    and on Ctrl-C, instead of waiting for a stuck copy forever."""
    process = subprocess.Popen(
        [sys.executable, "-c", STUCK_COPY_SCRIPT, exit_kind],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=CPU_ENV,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "queued"
        started = time.monotonic()
        if exit_kind == "ctrl_c":
            time.sleep(0.5)  # the interpreter is in its exit wait
            process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
        seconds = time.monotonic() - started
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    if exit_kind == "error":
        assert process.returncode == 1 and "the program fails" in stderr, stderr
    else:
        assert process.returncode == -signal.SIGINT, stderr
    assert seconds < 10, stderr
    assert "Fatal Python error" not in stderr and "terminate called" not in stderr
