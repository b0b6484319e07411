"""Data-parallel training with torch.distributed: one RoundPipe replica per rank.

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_distributed.py

(gloo: works on a CPU-only machine; one GPU per rank works the same). Every rank builds the same
bf16 model (fp32 optimizer copies), trains on its own ``1 / world_size`` of each global batch,
and steps only its shard of the optimizer; gradients are averaged like
``DistributedDataParallel``. The loss must fall; the script exits non-zero if it does not.
"""

from __future__ import annotations

import argparse
import datetime

import roundpipe
import torch
import torch.distributed as dist
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args()

    # A bounded timeout: a rank that fails or dies makes the others raise after it.
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} must divide by {world} ranks")
    local = args.global_batch // world

    torch.manual_seed(0)  # the same initial weights on every rank
    teacher = nn.Sequential(nn.Linear(args.width, args.width), nn.Tanh())
    layers: list[nn.Module] = []
    for _ in range(args.layers):
        layers += [nn.Linear(args.width, args.width), nn.GELU()]
    model = RoundPipe(
        nn.Sequential(*layers, nn.Linear(args.width, args.width)).to(torch.bfloat16),
        optim_dtype=torch.float32,
        name="train_distributed",
        model_run_config=RoundPipeRunConfig(num_microbatch=2),
        data_parallel_group=dist.group.WORLD,
    )
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-2)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)

    def step_fn() -> None:
        model.clip_grad_norm_(1.0)  # the norm over every rank's shard
        optimizer.step()
        optimizer.zero_grad()
        schedule.step()

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Mean over the rank's batch; averaging over ranks gives the global batch's mean.
        return ((output.float() - target) ** 2).mean(dim=-1).sum() / local

    data = torch.Generator().manual_seed(1)  # the same global batches on every rank
    losses = []
    for step in range(args.steps):
        x = torch.randn(args.global_batch, args.width, generator=data)
        y = teacher(x).detach()
        ours = slice(rank * local, (rank + 1) * local)
        loss = model.forward_backward(
            input_args=(x[ours].to(torch.bfloat16),), label=y[ours], loss_fn=loss_fn
        )
        model.step(step_fn)
        # The global loss for the log (the user's collectives use WORLD, RoundPipe its own group).
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        losses.append(float(loss) / world)
        if rank == 0 and step % 10 == 0:
            print(f"step {step:3d}  loss {losses[-1]:.4f}", flush=True)
    model.synchronize()
    shard = model.data_parallel_shard()
    stepped = sum(piece.stop - piece.start for piece in shard.pieces)
    total = sum(p.numel() for p in model.model.parameters())
    print(f"rank {rank}/{world}: stepped {stepped} of {total} parameters", flush=True)
    dist.destroy_process_group()
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    if rank == 0:
        print(f"loss {first:.4f} -> {last:.4f}")
    if not last < 0.7 * first:
        raise SystemExit(f"rank {rank}: the loss did not fall enough ({first:.4f} -> {last:.4f})")


if __name__ == "__main__":
    main()
