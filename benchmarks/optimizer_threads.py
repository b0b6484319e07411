"""The host optimizer's threads under torchrun: ``roundpipe.optim.Adam`` with its default threads
against the same optimizer on one thread (what torch's intra-op setting gives under torchrun) and
``torch.optim.Adam(fused=True)`` (which runs on torch's intra-op threads), every rank of one
torchrun launch timing its own steps at the same time.

torchrun sets ``OMP_NUM_THREADS=1`` when it starts several processes per machine, so torch's
intra-op threads are 1 on every rank. Our optimizer's default is the CPUs of the process's
affinity divided by the ranks on the machine (``LOCAL_WORLD_SIZE``). With ``--nproc 1`` torchrun
sets nothing; the launch sets ``OMP_NUM_THREADS=1`` itself then, as torchrun would for several
processes, and says so in the table.

Each rank updates ``--params`` fp32 parameters (tensors of 1M elements) from fp32 gradients; the
contenders take turns, ``--rounds`` rounds of ``--steps`` timed steps, and the table gives each
rank's median over rounds of the round's fastest step.

    python benchmarks/optimizer_threads.py [--params 20M] [--nproc 2] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

TENSOR = 1_000_000
CONTENDERS = ("ours, default threads", "ours, 1 thread", "torch")


def _time_steps(optimizer: torch.optim.Optimizer, steps: int) -> float:
    """The fastest of ``steps`` optimizer steps, in seconds."""
    fastest = float("inf")
    for _ in range(steps):
        start = time.perf_counter()
        optimizer.step()
        fastest = min(fastest, time.perf_counter() - start)
    return fastest


def worker(params: int, rounds: int, steps: int, out: Path) -> None:
    """One rank: time the contenders, write ``out/rank<r>.json``."""
    import roundpipe.optim

    torch.manual_seed(int(os.environ.get("RANK", "0")))
    tensors = [torch.randn(TENSOR) for _ in range(max(1, params // TENSOR))]
    default_threads = roundpipe.optim.get_num_threads()

    def make(kind: str) -> torch.optim.Optimizer:
        weights = [torch.nn.Parameter(t.clone()) for t in tensors]
        for w in weights:
            w.grad = torch.randn_like(w) * 1e-2
        if kind == "torch":
            return torch.optim.Adam(weights, lr=1e-3, fused=True)
        return roundpipe.optim.Adam(weights, lr=1e-3)

    contenders = {name: make("torch" if name == "torch" else "ours") for name in CONTENDERS}
    times: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    for _ in range(rounds):
        for name, optimizer in contenders.items():
            roundpipe.optim.set_num_threads(1 if name == "ours, 1 thread" else None)
            optimizer.step()  # warm: the first step allocates the moments
            times[name].append(_time_steps(optimizer, steps))
    roundpipe.optim.set_num_threads(None)
    report = {
        "rank": int(os.environ.get("RANK", "0")),
        "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS", "unset"),
        "torch_threads": torch.get_num_threads(),
        "our_threads": default_threads,
        "affinity": len(os.sched_getaffinity(0)),
        "ms": {name: 1e3 * statistics.median(values) for name, values in times.items()},
    }
    (out / f"rank{report['rank']}.json").write_text(json.dumps(report))


def launch(args: argparse.Namespace, out: Path) -> list[dict[str, object]]:
    """Run the workers under torchrun; their reports, by rank."""
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        torchrun,
        "--standalone",
        f"--nproc-per-node={args.nproc}",
        __file__,
        "--worker",
        f"--params={args.params}",
        f"--rounds={args.rounds}",
        f"--steps={args.steps}",
        f"--out={out}",
    ]
    subprocess.run(command, env=env, check=True, timeout=1800)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(args.nproc)]


def table(reports: list[dict[str, object]], nproc: int) -> str:
    lines = [
        "| rank | CPUs (affinity) | OMP_NUM_THREADS | torch threads | our threads | "
        "ours, default threads (ms) | ours, 1 thread (ms) | torch fused Adam (ms) | "
        "x ours on 1 thread | x torch |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for report in reports:
        ms = report["ms"]
        assert isinstance(ms, dict)
        ours, single, fused = (ms[name] for name in CONTENDERS)
        lines.append(
            f"| {report['rank']} | {report['affinity']} | {report['omp_num_threads']} | "
            f"{report['torch_threads']} | {report['our_threads']} | {ours:.1f} | {single:.1f} | "
            f"{fused:.1f} | {single / ours:.2f} | {fused / ours:.2f} |"
        )
    note = (
        "OMP_NUM_THREADS=1 set by the launch (torchrun sets it for several processes per machine)"
        if nproc == 1
        else "OMP_NUM_THREADS=1 as torchrun sets it for several processes per machine"
    )
    return "\n".join(lines) + f"\n\n{note}.\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="20M", help="fp32 parameters per rank")
    parser.add_argument(
        "--nproc",
        type=int,
        default=2 if (os.cpu_count() or 1) >= 4 else 1,
        help="ranks on this machine (default: 2 with at least 4 CPUs, else 1)",
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--record", action="store_true", help="write results/optimizer_threads.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    from results import parse_count, write_result

    params = parse_count(args.params)
    if args.worker:
        assert args.out is not None
        worker(params, args.rounds, args.steps, args.out)
        return
    with tempfile.TemporaryDirectory() as folder:
        reports = launch(args, Path(folder))
    title = (
        f"{params / 1e6:.0f}M fp32 parameters per rank, {args.nproc} rank(s) under torchrun, "
        f"median of {args.rounds} rounds of the fastest of {args.steps} steps"
    )
    body = f"### {title}\n\n{table(reports, args.nproc)}"
    print(body, flush=True)
    if args.record:
        import roundpipe

        path = write_result(
            "optimizer_threads.py",
            "The host optimizer's threads under torchrun",
            f"roundpipe {roundpipe.__version__}",
            body,
        )
        print(f"written to {path}")


if __name__ == "__main__":
    main()
