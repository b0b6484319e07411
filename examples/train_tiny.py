"""The minimal API example: a small training run on the default devices (CPU ones without a GPU).

A stack of residual MLP blocks learns a fixed random teacher. Parameters live in host memory,
stages run round-robin on the device pool, and the optimizer steps asynchronously on the host.
The loss must fall; the script exits non-zero if it does not.

    .venv/bin/python examples/train_tiny.py
    ROUNDPIPE_CPU_DEVICES=3 .venv/bin/python examples/train_tiny.py --trace run.json
    .venv/bin/python -m roundpipe.plot run.json --predicted run.predicted.json -o run.png

``--trace run.json`` records a timeline of one iteration in the middle of training and of the
next one's forward and backward, beside which the first one's optimizer step runs, and writes
the planner's prediction for one iteration beside it (``run.predicted.json``); the plot draws
both (docs/trace_train_tiny.png is this picture; guide §11 explains its figures).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time

import roundpipe
import torch
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--trace", help="write a timeline of two iterations here")
    args = parser.parse_args()

    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh())
    model = RoundPipe(
        nn.Sequential(
            *[Block(args.width) for _ in range(args.blocks)], nn.Linear(args.width, args.width)
        ),
        name="train_tiny",
    )
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=2e-3, decoupled_weight_decay=True)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(output, target)

    print(
        f"roundpipe {roundpipe.__version__}: {roundpipe.device_count()} {roundpipe.device_kind()} "
        f"device(s), {sum(p.numel() for p in model.model.parameters()) / 1e6:.2f}M parameters"
    )
    config = RoundPipeRunConfig(num_microbatch=roundpipe.device_count() + 1)
    first = last = None
    start = time.perf_counter()
    tracing = contextlib.ExitStack()
    traced = max(1, args.steps // 2)
    for step in range(1, args.steps + 1):
        if args.trace and step == traced:
            tracing.enter_context(roundpipe.trace(args.trace))
        x = torch.randn(args.batch, args.width)
        with torch.no_grad():
            y = teacher(x)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=config)
        if args.trace and step == traced + 1:  # the traced step ran beside this iteration
            model.wait_for_step()
            tracing.close()
        model.step(step_fn)
        loss = loss.item() / config.num_microbatch
        first = loss if first is None else first
        last = loss
        if step % 10 == 0 or step == 1:
            rate = step * args.batch / (time.perf_counter() - start)
            print(f"step {step:4d}  loss {loss:.4f}  {rate:,.0f} samples/s")
    model.synchronize()
    tracing.close()
    if args.trace:
        plan = roundpipe.ModelExecutePlan.auto("fused", model)
        predicted = plan.simulate(model, "fused", num_microbatch=config.num_microbatch)
        predicted.save(os.path.splitext(args.trace)[0] + ".predicted.json")
        print(f"trace written to {args.trace}; plan {plan}")
    print(f"loss {first:.4f} -> {last:.4f}")
    if not last < 0.5 * first:
        raise SystemExit("the loss did not fall by half: something is wrong")


if __name__ == "__main__":
    main()
