"""Runtime overhead on virtual CPU devices: a deep, narrow model shows the pipeline's own cost.

Two tables, both timed in this process with the contenders alternating (median of the iterations):

**Dispatch** (width 8: 256 ``nn.Linear(8, 8)`` + ReLU layers, 4 microbatches of 4 rows). Compute is
next to nothing, so the figure is the host's own work per layer x microbatch (Python, autograd,
RNG, bookkeeping), which caps tokens/s at short sequences on a GPU. Reported in us per layer x
microbatch for the plain PyTorch forward + backward (per microbatch: forward, loss, backward), the
same with every layer checkpointed (``torch.utils.checkpoint``, ``use_reentrant=False``) and
RoundPipe's ``forward_backward`` with ``recompute_grain`` "stage" and "layer", each as a ratio to
the plain forward + backward. Target: RoundPipe at most 2x plain forward + backward
(recomputing the forward alone makes 1.33x).

**Compute** (width 256, 16 rows per microbatch): RoundPipe against the plain loop with every layer
checkpointed (the same recompute work RoundPipe does):

    overhead per layer x microbatch = (ours - baseline) / (layers * microbatches)

Target: under 30 us and a ratio under 1.5 for 256 layers of width 256, 4 microbatches.

``--mode stages`` (not part of ``all``) shows the per-stage share: the dispatch model under
explicit plans of 2, 8, 32 and 127 stages per direction (the layer x microbatch work the same in
each), and the cost of one more stage in situ.

``--clock thread`` times by the calling thread's CPU time instead of the wall clock: it leaves out
waits and the copy engines' worker threads, and is the steadier figure on a loaded machine.

``--trace`` adds to the compute table RoundPipe with a timeline trace being recorded
(``roundpipe.trace()``, in memory) and the cost of tracing per layer x microbatch:
(traced - ours) / (layers * microbatches).

``--record`` rewrites ``results/overhead_cpu.md`` with the tables of the run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import itertools
import platform
import statistics
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import roundpipe
import torch
from results import Output, write_result
from roundpipe import RoundPipe, RoundPipeRunConfig
from torch import nn
from torch.utils.checkpoint import checkpoint


def deep_narrow(layers: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    )


def loss_fn(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output - label) ** 2).mean()


def plain_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    """Plain PyTorch forward + loss + backward per microbatch: no recompute."""
    for xm, ym in zip(x.tensor_split(n), y.tensor_split(n), strict=True):
        loss_fn(model(xm), ym).backward()
    for p in model.parameters():
        p.grad = None


def baseline_step(model: nn.Sequential, x: torch.Tensor, y: torch.Tensor, n: int) -> None:
    """The plain loop with every layer checkpointed (the recompute work RoundPipe does)."""
    for xm, ym in zip(x.tensor_split(n), y.tensor_split(n), strict=True):
        h = xm
        for layer in model:
            h = checkpoint(layer, h, use_reentrant=False)
        loss_fn(h, ym).backward()
    for p in model.parameters():
        p.grad = None


def roundpipe_step(
    model: RoundPipe,
    x: torch.Tensor,
    y: torch.Tensor,
    n: int,
    grain: str = "stage",
    plan: roundpipe.ModelExecutePlan | None = None,
) -> None:
    config = RoundPipeRunConfig(num_microbatch=n, recompute_grain=grain, execute_plan=plan)
    model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=config)
    model.synchronize()
    for p in model.model.parameters():
        p.grad = None


_Key = TypeVar("_Key")

CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "thread": time.thread_time}
clock = CLOCKS["wall"]  # set by --clock
out = Output()  # what is printed, kept for --record


def timed(fn: Callable[..., object], *args: object) -> float:
    start = clock()
    fn(*args)
    return clock() - start


def median_times(
    contenders: Mapping[_Key, Callable[[], object]], iters: int, warmups: int
) -> dict[_Key, float]:
    """Seconds each contender takes, the median of ``iters`` rounds in which the contenders
    alternate, after ``warmups`` rounds of each untimed."""
    for _ in range(warmups):
        for step in contenders.values():
            step()
    times: dict[_Key, list[float]] = {key: [] for key in contenders}
    for _ in range(iters):
        for key, step in contenders.items():
            times[key].append(timed(step))
    return {key: statistics.median(t) for key, t in times.items()}


def traced_step(model: RoundPipe, x: torch.Tensor, y: torch.Tensor, n: int) -> int:
    """One traced iteration; returns the number of events it recorded."""
    with roundpipe.trace() as tracer:
        roundpipe_step(model, x, y, n)
    return len(tracer.close().events)


DISPATCH_WIDTH, DISPATCH_ROWS = 8, 4
GRAINS = ("stage", "layer")


def measure_dispatch(layers: int, n: int, devices: int, iters: int) -> dict:
    """Per layer x microbatch times (us) of the plain loop, the checkpointed loop and RoundPipe
    with each recompute grain, at width 8; and the stage count of the automatic plan after them."""
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    plain = deep_narrow(layers, DISPATCH_WIDTH)
    ours = RoundPipe(copy.deepcopy(plain), name=f"dispatch-{layers}")
    x = torch.randn(DISPATCH_ROWS * n, DISPATCH_WIDTH)
    y = torch.randn(DISPATCH_ROWS * n, DISPATCH_WIDTH)
    contenders: dict[str, Callable[[], None]] = {
        "plain": lambda: plain_step(plain, x, y, n),
        "checkpoint": lambda: baseline_step(plain, x, y, n),
    }
    for grain in GRAINS:
        contenders[grain] = functools.partial(roundpipe_step, ours, x, y, n, grain)
    # Warm-up: allocator, timings, plans.
    medians = median_times(contenders, iters, warmups=2)
    per_unit = 1e6 / (layers * n)
    result = {name: seconds * per_unit for name, seconds in medians.items()}
    # The automatic plan follows the measured layer times, so its stage count (which sets the
    # per-stage share of the figure) varies from run to run: reported beside it.
    plan = roundpipe.ModelExecutePlan.auto("fused", ours)
    result["stages"] = len(plan.fwd_plan) + len(plan.bwd_plan)
    return result


def print_dispatch(args: argparse.Namespace) -> None:
    out("### Dispatch")
    out()
    out(
        f"{args.dispatch_layers} layers of width {DISPATCH_WIDTH}, "
        f"{args.microbatches} microbatches x {DISPATCH_ROWS} rows, median of {args.iters}; "
        "us per layer x microbatch (x plain forward + backward)"
    )
    out()
    out(
        "| CPU devices | plain fwd+bwd | plain + checkpoint | RoundPipe, grain stage "
        "| RoundPipe, grain layer | stages (fwd + bwd) of the last plan |"
    )
    out("|---:" * 6 + "|")
    for devices in args.devices:
        r = measure_dispatch(args.dispatch_layers, args.microbatches, devices, args.iters)
        cells = [f"{r['plain']:.1f}"] + [
            f"{r[name]:.1f} ({r[name] / r['plain']:.2f}x)" for name in ("checkpoint", *GRAINS)
        ]
        out(f"| {devices} | " + " | ".join(cells) + f" | {r['stages']:.0f} |")
    out()


STAGE_COUNTS = (2, 8, 32, 127)


def even_plan(layers: int, stages: int) -> roundpipe.ModelExecutePlan:
    """A forward_backward plan whose last 2 layers form the fused stage and whose other layers
    form ``stages`` even stages in each direction: the layer x microbatch work stays the same
    whatever ``stages`` is, only the per-stage work grows with it."""
    body = layers - 2
    bounds = [round(i * body / stages) for i in range(stages + 1)]
    ranges = [range(a, b) for a, b in itertools.pairwise(bounds)]
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = ranges
    plan.bwd_plan = [range(body, layers), *ranges[::-1]]
    return plan


def measure_stages(
    layers: int, n: int, devices: int, iters: int, counts: tuple[int, ...]
) -> dict[tuple[str, int], float]:
    """Per layer x microbatch times (us) of RoundPipe at width 8 with explicit plans of each of
    ``counts`` stages per direction, per recompute grain."""
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    ours = RoundPipe(deep_narrow(layers, DISPATCH_WIDTH), name=f"stages-{layers}")
    x = torch.randn(DISPATCH_ROWS * n, DISPATCH_WIDTH)
    y = torch.randn(DISPATCH_ROWS * n, DISPATCH_WIDTH)
    contenders = {
        (grain, count): functools.partial(
            roundpipe_step, ours, x, y, n, grain, even_plan(layers, count)
        )
        for grain in GRAINS
        for count in counts
    }
    per_unit = 1e6 / (layers * n)
    return {
        key: seconds * per_unit
        for key, seconds in median_times(contenders, iters, warmups=1).items()
    }


def print_stages(args: argparse.Namespace) -> None:
    """The per-stage cost: the same model and work under explicit plans of more and more
    stages; the last column is the cost of one more stage (forward or backward), from the
    fewest and the most stages."""
    layers, n = args.dispatch_layers, args.microbatches
    counts = tuple(c for c in STAGE_COUNTS if c <= layers - 2)  # at least a layer per stage
    if len(counts) < 2:
        raise SystemExit(f"--mode stages needs at least {STAGE_COUNTS[1] + 2} layers")
    out("### Stages")
    out()
    out(
        f"{layers} layers of width {DISPATCH_WIDTH}, {n} microbatches x "
        f"{DISPATCH_ROWS} rows, explicit plans (fused stage: the last 2 layers), median of "
        f"{args.iters}; us per layer x microbatch"
    )
    out()
    out(
        "| CPU devices | grain | "
        + " | ".join(f"{c} stages per direction" for c in counts)
        + " | us per stage |"
    )
    out("|---:|---|" + "---:|" * (len(counts) + 1))
    fewest, most = counts[0], counts[-1]
    added_stages = 2 * (most - fewest)  # forward and backward stages alike
    for devices in args.devices:
        r = measure_stages(layers, n, devices, args.iters, counts)
        for grain in GRAINS:
            cells = [f"{r[(grain, c)]:.1f}" for c in counts]
            per_stage = (r[(grain, most)] - r[(grain, fewest)]) * layers * n / added_stages
            out(f"| {devices} | {grain} | " + " | ".join(cells) + f" | {per_stage:.0f} |")
    out()


def measure(
    layers: int, width: int, n: int, rows: int, devices: int, iters: int, trace: bool
) -> dict:
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    plain = deep_narrow(layers, width)
    ours = RoundPipe(copy.deepcopy(plain), name=f"overhead-{layers}")
    x, y = torch.randn(rows * n, width), torch.randn(rows * n, width)
    for _ in range(2):  # warm-up: allocator, timings, plan
        baseline_step(plain, x, y, n)
        roundpipe_step(ours, x, y, n)
    base_times, our_times, traced_times = [], [], []
    for _ in range(iters):
        base_times.append(timed(baseline_step, plain, x, y, n))
        our_times.append(timed(roundpipe_step, ours, x, y, n))
        if trace:
            traced_times.append(timed(traced_step, ours, x, y, n))
    base, mine = statistics.median(base_times), statistics.median(our_times)
    result = {
        "layers": layers,
        "devices": devices,
        "baseline_ms": base * 1e3,
        "roundpipe_ms": mine * 1e3,
        "overhead_us": (mine - base) / (layers * n) * 1e6,
        "ratio": mine / base,
    }
    if trace:
        traced = statistics.median(traced_times)
        result["traced_ms"] = traced * 1e3
        result["trace_us"] = (traced - mine) / (layers * n) * 1e6
        result["events"] = traced_step(ours, x, y, n)
    return result


def print_compute(args: argparse.Namespace) -> None:
    out("### Compute")
    out()
    out(
        f"width {args.width}, {args.microbatches} microbatches x {args.rows} rows, "
        f"median of {args.iters}; ratio: RoundPipe / plain + checkpoint"
    )
    out()
    traced = (
        " traced (ms) | trace cost / layer x mb (us) | events / iteration |" if args.trace else ""
    )
    out(
        "| layers | CPU devices | plain + checkpoint (ms) | RoundPipe (ms) "
        f"| overhead / layer x mb (us) | ratio |{traced}"
    )
    out("|---:" * (9 if args.trace else 6) + "|")
    for layers in args.layers:
        for devices in args.devices:
            r = measure(
                layers, args.width, args.microbatches, args.rows, devices, args.iters, args.trace
            )
            traced = (
                f" {r['traced_ms']:.1f} | {r['trace_us']:.1f} | {r['events']} |"
                if args.trace
                else ""
            )
            out(
                f"| {r['layers']} | {r['devices']} | {r['baseline_ms']:.1f} | "
                f"{r['roundpipe_ms']:.1f} | {r['overhead_us']:.1f} | {r['ratio']:.2f} |{traced}"
            )
    out()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--mode",
        choices=["all", "dispatch", "compute", "stages"],
        default="all",
        help="which table: the width-8 dispatch figure, the width-256 compute one, or both; "
        "stages: the per-stage cost at width 8 (explicit plans of more and more stages)",
    )
    parser.add_argument("--dispatch-layers", type=int, default=256)
    parser.add_argument("--layers", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--width", type=int, default=256, help="width of the compute table")
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rows", type=int, default=16, help="rows per microbatch (compute)")
    parser.add_argument("--devices", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument(
        "--trace", action="store_true", help="also time RoundPipe with a trace being recorded"
    )
    parser.add_argument("--record", action="store_true", help="write results/overhead_cpu.md")
    parser.add_argument(
        "--clock",
        choices=list(CLOCKS),
        default="wall",
        help="wall: elapsed time; thread: the calling thread's CPU time (leaves out waits and "
        "the copy engines' worker threads; steadier on a loaded machine)",
    )
    args = parser.parse_args()
    global clock
    clock = CLOCKS[args.clock]
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    out(
        f"torch {torch.__version__}, roundpipe {roundpipe.__version__}, "
        f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"{args.clock} clock"
    )
    out()
    if args.mode in ("all", "dispatch"):
        print_dispatch(args)
    if args.mode in ("all", "compute"):
        print_compute(args)
    if args.mode == "stages":
        print_stages(args)
    if args.record:
        path = write_result(
            "overhead_cpu.py",
            "Runtime overhead on virtual CPU devices",
            f"roundpipe {roundpipe.__version__}",
            out.text(),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
