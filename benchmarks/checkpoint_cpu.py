"""Checkpoint save speed: ``roundpipe.save_checkpoint`` against a plain ``torch.save`` of the same
state and ``torch.distributed.checkpoint`` (DCP, one process, ``FileSystemWriter``).

The state: a bf16 RoundPipe with fp32 optimizer copies and ``roundpipe.optim.Adam`` state after
one step (about 14 bytes per parameter: bf16 weights, fp32 copies, two fp32 moments). Every
contender takes ``model.state_dict()`` and ``optimizer.state_dict()`` itself and its time runs
until the bytes are on disk (fsync included, written to ``--dir`` on the real disk, not a tmpfs):

* ``roundpipe.save_checkpoint``: checksummed, temporary file, fsync, rename, folder fsync;
* ``torch.save`` to the path, then fsync (the guide's old recipe; not atomic, no checksum);
* DCP ``dcp.save`` with ``FileSystemWriter(sync_files=True, thread_count=k)`` for each ``k``;
* bound: the same number of bytes from one buffer in memory, written and fsynced (the disk).

Contenders take turns (the machine may be shared), each file is deleted after its turn; the
fastest turn counts and the spread of the turns is printed beside it.

Run from the repository root: ``python benchmarks/checkpoint_cpu.py [--params 100M,500M]
[--record]`` (``--record`` rewrites ``results/checkpoint_cpu.md``).
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import roundpipe
import torch
import torch.distributed.checkpoint as dcp
from results import parse_count, write_result
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn

WIDTH = 2048


def build(total: int) -> tuple[RoundPipe, torch.optim.Optimizer]:
    """A bf16 RoundPipe of ``total`` parameters with fp32 copies and Adam state."""
    layers = max(1, total // (WIDTH * WIDTH))
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)])
    model = RoundPipe(net.bfloat16(), optim_dtype=torch.float32)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-4)
    model.forward_backward(
        input_args=(torch.randn(2, WIDTH).bfloat16(),),
        loss_fn=lambda out, _: out.float().square().mean(),
        run_config=RoundPipeRunConfig(num_microbatch=1),
    )
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    return model, optimizer


def fsync_path(path: Path) -> None:
    with open(path, "rb") as file:
        os.fsync(file.fileno())


OURS = "roundpipe.save_checkpoint"


def contenders(
    model: RoundPipe,
    optimizer: torch.optim.Optimizer,
    folder: Path,
    threads: list[int],
    sizes: dict[str, int],
) -> dict[str, Callable[[], int]]:
    """Each contender saves once and returns the bytes it wrote; the bound writes as many bytes
    as ours did last (``sizes``), so ours goes first."""

    def state() -> dict[str, Any]:
        return {"model": model.state_dict(), "optimizer": optimizer.state_dict()}

    def ours() -> int:
        path = folder / "ours.rp"
        roundpipe.save_checkpoint(path, model, optimizer)
        return path.stat().st_size

    def plain() -> int:
        path = folder / "plain.pt"
        torch.save(state(), path)
        fsync_path(path)
        return path.stat().st_size

    def distributed(thread_count: int) -> Callable[[], int]:
        def save() -> int:
            path = folder / f"dcp{thread_count}"
            writer = dcp.FileSystemWriter(path, sync_files=True, thread_count=thread_count)
            with warnings.catch_warnings():  # "no process group": one process is intended here
                warnings.simplefilter("ignore")
                dcp.save(state(), storage_writer=writer)
            return sum(f.stat().st_size for f in path.iterdir())

        return save

    def bound() -> int:
        size = sizes[OURS]
        block = torch.zeros(64 << 20, dtype=torch.uint8).numpy()
        path = folder / "bound.bin"
        with open(path, "wb") as file:
            for start in range(0, size, len(block)):
                file.write(block[: min(len(block), size - start)])
            file.flush()
            os.fsync(file.fileno())
        return size

    table: dict[str, Callable[[], int]] = {
        OURS: ours,
        "torch.save + fsync": plain,
    }
    for k in threads:
        table[f"DCP FileSystemWriter thread_count={k}"] = distributed(k)
    table["bound: write + fsync of one buffer of that size"] = bound
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="100M", help="comma-separated model sizes")
    parser.add_argument("--rounds", type=int, default=3, help="turns each contender takes")
    parser.add_argument("--threads", default="1,4", help="DCP thread_count values to try")
    parser.add_argument("--dir", default="/tmp/roundpipe-checkpoint-bench", help="target folder")
    parser.add_argument("--record", action="store_true", help="write results/checkpoint_cpu.md")
    args = parser.parse_args()
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    threads = [int(k) for k in args.threads.split(",")]

    lines = [
        f"folder {folder} (real disk), fsync included, contenders take {args.rounds} turns, "
        f"fastest reported with the range of all turns; torch threads {torch.get_num_threads()}",
        "",
    ]
    printed = 0
    for total in map(parse_count, args.params.split(",")):
        model, optimizer = build(total)
        params = sum(p.numel() for p in model.parameters())
        sizes: dict[str, int] = {}
        turns = contenders(model, optimizer, folder, threads, sizes)
        seconds: dict[str, list[float]] = {name: [] for name in turns}
        for _ in range(args.rounds):
            for name, turn in turns.items():
                start = time.perf_counter()
                sizes[name] = turn()
                seconds[name].append(time.perf_counter() - start)
                for leftover in folder.iterdir():
                    if leftover.is_dir():
                        shutil.rmtree(leftover)
                    else:
                        leftover.unlink()
        plain = min(seconds["torch.save + fsync"])
        lines += [
            f"### {params:,} bf16 parameters, fp32 copies + Adam state: save",
            "",
            "| contender | GB written | s (fastest) | GB/s (fastest) | GB/s range | "
            "torch.save time / this |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, times in seconds.items():
            gigabytes = sizes[name] / 1e9
            lines.append(
                f"| {name} | {gigabytes:.2f} | {min(times):.2f} | {gigabytes / min(times):.2f} | "
                f"{gigabytes / max(times):.2f}-{gigabytes / min(times):.2f} | "
                f"{plain / min(times):.2f} |"
            )
        lines.append("")
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)
        del model, optimizer, turns
        gc.collect()
    if args.record:
        path = write_result(
            "checkpoint_cpu.py",
            "Checkpoint save speed against torch.save and torch.distributed.checkpoint",
            f"roundpipe {roundpipe.__version__}",
            "\n".join(lines),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
