"""Ctrl-C during training stops the process promptly, with native threads busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

SCRIPT = textwrap.dedent(
    """
    import signal
    # Ctrl-C raises KeyboardInterrupt even where the suite runs in the background (nohup, &),
    # whose children inherit SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    import torch
    from torch import nn
    from roundpipe import RoundPipe, RoundPipeRunConfig

    model = RoundPipe(nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]))
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=1e-3)
    config = RoundPipeRunConfig(num_microbatch=4)
    x = torch.randn(64, 64)
    print("ready", flush=True)
    while True:
        model.forward_backward(input_args=(x,), loss_fn=lambda o, l: o.square().mean(),
                               run_config=config)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    """
)


def test_sigint_interrupts_training_without_hanging() -> None:
    process = subprocess.Popen(
        [sys.executable, "-c", SCRIPT],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "ROUNDPIPE_DEVICE_KIND": "cpu", "ROUNDPIPE_CPU_DEVICES": "3"},
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == "ready"
        time.sleep(1.0)  # mid-training: copy engines and the optimizer thread are running
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode != 0
    assert "KeyboardInterrupt" in stderr
