"""Data-parallel scaling on one machine: host optimizer time and host memory per rank.

Run from the repository root: ``python benchmarks/scale_cpu.py [--params 8M] [--ranks 1,2,4]
[--record]`` (``--record`` rewrites ``results/scale_cpu.md``). For each rank count N a bf16 model
with fp32 optimizer copies (roundpipe.optim.Adam) trains a few synchronous steps on N processes
(gloo on loopback; with ``--backend nccl`` and one GPU per rank, the user's group is NCCL while
RoundPipe's own collectives stay on gloo), beside one process without torch.distributed.
``--reduce host|stage`` picks ``data_parallel_reduce``: the gradients summed on the optimizer
thread before the step, or at the end of each backward stage (each rank downloads and keeps only
its shard). Per rank it reports:

- fwd+bwd: ``forward_backward`` (with ``--reduce stage`` it includes the gradient reduce);
- step: the whole optimizer step (``model.step(is_async=False)``: gradient reduce with
  ``--reduce host``, the shard's Adam, weight all-gather, write-back), median over the timed
  steps;
- adam: the shard's ``optimizer.step()`` alone (what sharding divides by N);
- reduce-scatter vs all-reduce: one collective over the whole gradient arena each, on one gloo
  group (RoundPipe all-reduces: gloo's reduce-scatter is the slower of the two);
- RSS: resident host memory after the steps, its peak, and the growth over the process before
  the model was built (torch, gloo and the interpreter excluded), beside the per-rank formula of
  docs/guide.md (bf16 weights, fp32 copies, Adam): ``8P + 14P/N`` bytes with host reduces,
  ``4P + 18P/N`` with stage reduces, ``18P`` without a group.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from typing import Any

import torch
from results import parse_count, peak_rss, rss, write_result

WIDTH = 1024


def rank_main(cfg: dict[str, Any]) -> None:
    """One rank (world 0: one process without torch.distributed)."""
    import roundpipe
    import roundpipe.distributed as rd
    import torch.distributed as dist
    from torch import nn

    rank, world = cfg["rank"], cfg["world"]
    torch.set_num_threads(cfg["threads"])
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)
    group = None
    if world > 0:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group(
            cfg["backend"], rank=rank, world_size=world, timeout=datetime.timedelta(seconds=300)
        )
        group = dist.group.WORLD
    baseline = rss() / 2**20
    layers = max(1, cfg["params"] // (WIDTH * WIDTH))
    torch.manual_seed(0)
    model = roundpipe.RoundPipe(
        nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]).to(
            torch.bfloat16
        ),
        optim_dtype=torch.float32,
        name="scale",
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=1),
        data_parallel_group=group,
        data_parallel_reduce=cfg["reduce"],
    )
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-4)
    adam_times: list[float] = []

    def step_fn() -> None:
        start = time.perf_counter()
        optimizer.step()
        adam_times.append(time.perf_counter() - start)
        optimizer.zero_grad()

    x = torch.randn(1, WIDTH, dtype=torch.bfloat16)
    step_times, call_times = [], []
    for iteration in range(cfg["warmup"] + cfg["steps"]):
        start = time.perf_counter()
        model.forward_backward(input_args=(x,), loss_fn=lambda out, _: out.float().sum())
        middle = time.perf_counter()
        model.step(step_fn, is_async=False)
        if iteration >= cfg["warmup"]:
            call_times.append(middle - start)
            step_times.append(time.perf_counter() - middle)
    result = {
        "params": layers * WIDTH * WIDTH,
        "call_ms": statistics.median(call_times) * 1e3,
        "step_ms": statistics.median(step_times) * 1e3,
        "adam_ms": statistics.median(adam_times[cfg["warmup"] :]) * 1e3,
        "rss_mib": rss() / 2**20,
        "growth_mib": rss() / 2**20 - baseline,
        "peak_mib": peak_rss() / 2**20,
    }
    if world > 1:
        own = dist.new_group(backend="gloo")
        arena = torch.ones(layers * WIDTH * WIDTH, dtype=torch.bfloat16)
        shard = torch.empty(arena.numel() // world, dtype=torch.bfloat16)
        # torch 2.13 renamed reduce_scatter_tensor.
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        for name, run in (
            ("reduce_scatter_ms", lambda: scatter(shard, arena, group=own)),
            ("all_reduce_ms", lambda: rd.all_reduce(arena, dist.ReduceOp.SUM, own)),
        ):
            times = []
            for _ in range(cfg["steps"]):
                dist.barrier(own)
                start = time.perf_counter()
                run()
                times.append(time.perf_counter() - start)
            result[name] = statistics.median(times) * 1e3
    print("RESULT " + json.dumps(result), flush=True)
    if world > 0:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def measure(world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Run ``world`` ranks (0: one plain process) and return each rank's figures."""
    port = _free_port()
    base = {
        "world": world,
        "port": port,
        "params": args.params,
        "steps": args.steps,
        "warmup": 1,
        "threads": args.threads,
        "backend": args.backend,
        "reduce": args.reduce,
    }
    # The installed roundpipe (tools/setup.sh), as the other benchmarks use it: the source
    # folder has no compiled core.
    env = dict(os.environ)
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-config", json.dumps({**base, "rank": rank})],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in range(max(world, 1))
    ]
    results = []
    for proc in procs:
        output, _ = proc.communicate(timeout=1800)
        if proc.returncode != 0:
            raise SystemExit(f"a rank failed (exit {proc.returncode})")
        line = next(line for line in output.splitlines() if line.startswith("RESULT "))
        results.append(json.loads(line.removeprefix("RESULT ")))
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=parse_count, default=parse_count("8M"))
    parser.add_argument("--ranks", default="1,2,4", help="rank counts, comma separated")
    parser.add_argument("--steps", type=int, default=3, help="timed steps (after one warm-up)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--backend", default="gloo", help="the user's group: gloo or nccl")
    parser.add_argument(
        "--reduce", default="host", choices=("host", "stage"), help="data_parallel_reduce"
    )
    parser.add_argument("--record", action="store_true", help="write results/scale_cpu.md")
    parser.add_argument("--rank-config", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_config:
        rank_main(json.loads(args.rank_config))
        return

    rows = [
        "| ranks | reduce | params | fwd+bwd ms | step ms | adam ms | reduce-scatter ms | "
        "all-reduce ms | RSS MiB | peak RSS MiB | model RSS MiB | formula MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world in [0] + [int(n) for n in args.ranks.split(",")]:
        figures = measure(world, args)
        worst = max(figures, key=lambda f: f["step_ms"])

        def cell(key: str, figure: dict[str, Any] = worst) -> str:
            return f"{figure[key]:.1f}" if key in figure else "-"

        label = "1 process, no group" if world == 0 else f"{world}"
        rss = max(f["rss_mib"] for f in figures)
        peak = max(f["peak_mib"] for f in figures)
        growth = max(f["growth_mib"] for f in figures)
        params = worst["params"]
        if world <= 1:
            formula = 18 * params / 2**20
        elif args.reduce == "stage":
            formula = (4 * params + 18 * params / world) / 2**20
        else:
            formula = (8 * params + 14 * params / world) / 2**20
        reduce = args.reduce if world > 1 else "-"
        rows.append(
            f"| {label} | {reduce} | {params / 1e6:.1f}M | {cell('call_ms')} | "
            f"{cell('step_ms')} | {cell('adam_ms')} | "
            f"{cell('reduce_scatter_ms')} | {cell('all_reduce_ms')} | {rss:.0f} | {peak:.0f} | "
            f"{growth:.0f} | {formula:.0f} |"
        )
        print(rows[-1], flush=True)
    note = (
        "Per rank, the slowest rank's times (median of the timed steps) and the largest RSS; "
        f"{args.threads} torch thread(s) per rank, bf16 weights, fp32 copies, "
        f"roundpipe.optim.Adam, synchronous steps, user's group: {args.backend}."
    )
    text = "\n".join(rows) + "\n\n" + note
    print(text)
    if args.record:
        import roundpipe

        path = write_result(
            "scale_cpu.py",
            "Data-parallel scaling on one machine: host optimizer time and memory per rank",
            f"roundpipe {roundpipe.__version__}",
            text,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
