"""Optimizer state on disk (``optim_offload``): host bytes per parameter, the step's disk rate
and the iteration time, beside the same training with the state in host memory, in one run.

A bf16 model of ``--params`` parameters in 2048 x 2048 layers with fp32 optimizer copies and
``roundpipe.optim.Adam`` (``--state-dtype``, default int8) trains ``--iters`` iterations on
virtual CPU devices, four ways, each in a fresh subprocess (RSS is per process) and in turns:
state in memory or on disk (``--folder``), asynchronous or synchronous steps.

* ``B/param``: the peak RSS over the training (the zero point after torch's first-use costs, as
  ``host_memory.py`` takes it) per parameter, with ``MALLOC_MMAP_THRESHOLD_`` fixed at 1 MiB in
  every case (see ``MMAP``). Targets with the state on disk: at most 6.5 with
  asynchronous steps, 4.5 with synchronous ones.
* ``disk GB/s``: the step's bytes read and written (masters and moments) over the step's time
  (the median step), beside the folder's own sequential bandwidth measured just before and just
  after that case (their mean): a file of ``--probe-mib`` written then read with direct I/O where
  the filesystem allows it, in requests of the step's chunk size, as many in flight as the step
  has. Target: at least 80%.
* ``iteration s``: the median wall time of ``forward_backward`` + ``step`` (the asynchronous
  step overlaps the next iteration; a synchronous one adds to it).

    python benchmarks/optim_offload.py --params 300M --folder /nvme/scratch --record
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import parse_count, pay_first_use_costs, peak_rss, reset_peak_rss, rss, write_result

WIDTH = 2048
# glibc's malloc, left to itself, raises its mmap threshold to the size of the largest block
# freed (up to 32 MiB), after which this model's 8 MiB layers and gradients come from per-thread
# heaps that keep their freed memory: ~0.4-0.6 B/param more at 200-300M parameters, in memory and
# on disk alike. A fixed threshold (the guide's advice for large models) is set for every case.
MMAP = str(1 << 20)


def run_case(
    params: int, iters: int, folder: str | None, is_async: bool, state_dtype: str
) -> dict[str, float]:
    """One training run in this process; its figures."""
    import roundpipe
    from roundpipe import OptimOffload, RoundPipe, RoundPipeRunConfig
    from roundpipe.optim.offload import store_of

    roundpipe.configure_devices(kind="cpu", num_cpu_devices=2)
    layers = max(2, round(params / WIDTH**2))
    pay_first_use_costs(torch.bfloat16)
    zero = rss()
    reset_peak_rss()

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        *[torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=torch.bfloat16) for _ in range(layers)]
    )
    offload = None if folder is None else OptimOffload(folder)
    model = RoundPipe(net, optim_dtype=torch.float32, optim_offload=offload)
    optimizer = roundpipe.optim.Adam(
        model.optim_parameters(), lr=1e-4, state_dtype=getattr(torch, state_dtype)
    )
    step_seconds: list[float] = []
    disk_bytes: list[int] = []
    store = store_of(next(iter(model.optim_parameters())))  # its I/O counters

    def step_fn() -> None:
        start = time.perf_counter()
        optimizer.step()
        step_seconds.append(time.perf_counter() - start)
        optimizer.zero_grad()
        if store is not None:
            disk_bytes.append(store.last_stats[0] + store.last_stats[1])

    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(layers - 1)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(layers))]
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    x, y = torch.randn(8, WIDTH, dtype=torch.bfloat16), torch.randn(8, WIDTH)
    losses, iteration_seconds = [], []
    for _ in range(iters):
        start = time.perf_counter()
        loss = model.forward_backward(
            input_args=(x,),
            label=y,
            loss_fn=lambda o, t: ((o.float() - t) ** 2).mean(),
            run_config=config,
        )
        model.step(step_fn, is_async)
        iteration_seconds.append(time.perf_counter() - start)
        losses.append(float(loss))
    model.synchronize()
    peak = peak_rss() - zero
    total = sum(p.numel() for p in net.parameters())
    later = slice(1, None) if iters > 2 else slice(None)  # the first step creates the state
    return {
        "params": total,
        "peak": peak / total,
        "iteration": statistics.median(iteration_seconds[later]),
        "step": statistics.median(step_seconds[later]),
        "disk_bytes": statistics.median(disk_bytes[later]) if disk_bytes else 0.0,
        "first_loss": losses[0],
        "last_loss": losses[-1],
    }


def probe_bandwidth(folder: str, mib: int, chunk: int, in_flight: int) -> float:
    """Bytes per second of writing then reading a ``mib`` MiB file in ``folder`` in requests of
    ``chunk`` bytes, ``in_flight`` at a time, with direct I/O where the filesystem allows it."""
    handle, path = tempfile.mkstemp(dir=folder)
    os.close(handle)
    try:
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
        except OSError:
            fd = os.open(path, os.O_RDWR)
        buffers = [mmap.mmap(-1, chunk) for _ in range(in_flight)]
        for buffer in buffers:
            buffer.write(os.urandom(4096) * (chunk // 4096))
        count = mib * 2**20 // chunk
        with ThreadPoolExecutor(in_flight) as pool:
            # Written once untimed: the step overwrites regions it has written before, and a
            # fresh file's direct writes would also allocate its blocks as they go.
            list(pool.map(lambda i: os.pwrite(fd, buffers[i % in_flight], i * chunk), range(count)))
            start = time.perf_counter()
            # No fsync: a direct write has left the page cache when it returns, as the step's do
            # (which do not fsync either).
            list(pool.map(lambda i: os.pwrite(fd, buffers[i % in_flight], i * chunk), range(count)))
            list(
                pool.map(lambda i: os.preadv(fd, [buffers[i % in_flight]], i * chunk), range(count))
            )
        seconds = time.perf_counter() - start
        os.close(fd)
        return 2 * count * chunk / seconds
    finally:
        os.unlink(path)


def measure(args: argparse.Namespace, folder: str | None, is_async: bool) -> dict[str, float]:
    command = [
        sys.executable,
        __file__,
        "--case",
        json.dumps(
            {
                "params": args.params_count,
                "iters": args.iters,
                "folder": folder,
                "is_async": is_async,
                "state_dtype": args.state_dtype,
            }
        ),
    ]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_", MMAP)}
    out = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="100M", help="model size")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--state-dtype", default="int8", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--folder", default=None, help="offload folder (default: a temp dir)")
    parser.add_argument("--probe-mib", type=int, default=1024)
    parser.add_argument("--record", action="store_true", help="write results/optim_offload.md")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(**json.loads(args.case))))
        return
    args.params_count = parse_count(args.params)
    folder = args.folder or tempfile.mkdtemp(prefix="rp-offload-")
    from roundpipe import OptimOffload

    config = OptimOffload(folder)
    chunk_bytes = config.chunk_elements * 4

    def probe() -> float:
        return probe_bandwidth(folder, args.probe_mib, chunk_bytes, config.io_threads)

    # A shared or virtual disk's bandwidth drifts: each disk case is set against the mean of the
    # probes just before and just after it.
    rows = []
    for is_async in (True, False):
        memory = measure(args, None, is_async)
        before = probe()
        disk = measure(args, folder, is_async)
        rows.append((is_async, memory, disk, (before, probe())))
    lines = [
        f"bf16 weights, fp32 copies, {args.state_dtype} Adam state, {args.params} parameters, "
        f"offload folder {folder}; every case with MALLOC_MMAP_THRESHOLD_={MMAP}. The folder's "
        f"sequential write+read (direct I/O where allowed, {chunk_bytes >> 20} MiB requests, "
        f"{config.io_threads} in flight), GB/s before and after each disk case: "
        + ", ".join(
            f"{'async' if is_async else 'sync'} {before / 1e9:.2f} and {after / 1e9:.2f}"
            for is_async, _, _, (before, after) in rows
        ),
        "",
        "| steps | B/param in memory | B/param on disk | target | iteration s in memory | "
        "iteration s on disk | ratio | step s on disk | disk GB/s | of the folder's | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for is_async, memory, disk, probes in rows:
        rate = disk["disk_bytes"] / disk["step"] if disk["step"] else 0.0
        bandwidth = sum(probes) / len(probes)
        lines.append(
            f"| {'async' if is_async else 'sync'} | {memory['peak']:.2f} | {disk['peak']:.2f} | "
            f"<= {6.5 if is_async else 4.5} | {memory['iteration']:.3f} | "
            f"{disk['iteration']:.3f} | {disk['iteration'] / memory['iteration']:.2f} | "
            f"{disk['step']:.3f} | {rate / 1e9:.2f} | {rate / bandwidth:.0%} | "
            f"{disk['first_loss']:.4f} -> {disk['last_loss']:.4f} |"
        )
    lines += [
        "",
        "The disk rate is the synchronous step's: it runs alone. An asynchronous step shares the "
        "cores with the next iteration's forward and backward, so its time (and rate) is set by "
        "the CPU it gets, hidden behind that iteration as long as it is shorter.",
    ]
    body = "\n".join(lines)
    print(body)
    if args.record:
        import roundpipe

        path = write_result(
            "optim_offload.py",
            "Optimizer state on disk: host memory, disk rate, iteration time",
            f"roundpipe {roundpipe.__version__}",
            body,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
