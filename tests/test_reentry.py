"""Calls into a RoundPipe from its own step_fn (which runs on the optimizer thread) raise a clear
RuntimeError at the next step()/synchronize(); they never deadlock, and the model keeps training.
Each case runs in a subprocess with a timeout, so a regression fails instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from roundpipe import RoundPipe, RoundPipeRunConfig

    call, is_async = sys.argv[1], sys.argv[2] == "async"
    model = RoundPipe(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), name="inner")
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.1)
    x = torch.randn(4, 4)
    config = RoundPipeRunConfig(num_microbatch=2)

    def reentering_step():
        if call == "synchronize":
            model.synchronize()
        elif call == "state_dict":
            model.state_dict()
        elif call == "step":
            model.step(lambda: None)
        elif call == "forward":
            model(x)
        optimizer.step()
        optimizer.zero_grad()

    model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum(), run_config=config)
    try:
        model.step(reentering_step, is_async)
        model.synchronize()
    except RuntimeError as error:
        assert "step_fn" in str(error), error
        assert f"{call}()" in str(error), error
        print("raised", flush=True)
    # The model still trains and steps.
    model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.sum(), run_config=config)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async)
    model.synchronize()
    print("done", flush=True)
    """
)


# The quick tier keeps one case (a subprocess each): synchronize from an asynchronous step.
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    "call",
    [
        "synchronize",
        pytest.param("state_dict", marks=SLOW),
        pytest.param("step", marks=SLOW),
        pytest.param("forward", marks=SLOW),
    ],
)
@pytest.mark.parametrize("mode", ["async", pytest.param("sync", marks=SLOW)])
def test_calls_from_step_fn_raise_instead_of_deadlocking(call: str, mode: str) -> None:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, call, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "2"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["raised", "done"], result.stdout + result.stderr
