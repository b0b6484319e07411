"""Adam step throughput with compact moments: ``roundpipe.optim.Adam`` with
``state_dtype`` fp32, bf16 and int8 against ``torch.optim.Adam(fused=True)`` (torch has a fused
CPU Adam, so it is the baseline rather than foreach), the bytes each moves per parameter and the
memory-bandwidth bound, all measured in the same run.

Every contender updates the same fp32 parameters from the same fp32 gradients; each has its own
moments. The same ``--params`` elements come in three shapes (``--shapes``): one tensor (an LM's
embedding or head, torch's fused Adam at its best: one parallel loop over it), tensors of 6.25M
elements (a layer's weights) and tensors of 256K (many small ones). Per
parameter and step a contender reads the parameter, the gradient and both moments and writes the
parameter and both moments (plus, for int8 moments, one fp32 scale per block of 256 elements per
moment, read and written): 28 bytes with fp32 moments, 20 with bf16, 16.06 with int8. Their
ratios to 28 bound each form's speed-up over torch's fp32 state: 1.0, 1.4 and 1.74.

The bound is the machine's memory bandwidth, measured with streaming torch passes over 256 MiB
fp32 tensors (1 GiB in all, far beyond the caches) that take turns with the contenders:
``b.copy_(a)`` (8 bytes per element), ``b.add_(a)`` and ``b.lerp_(a, w)`` (12) and
``d.addcmul_(a, b)`` (16); the fastest pass of the shape's rounds counts. A kernel with more
concurrent streams than these passes (Adam has seven) can beat it somewhat: it is a measured
bound, not a datasheet one.

The contenders take turns, ``--rounds`` rounds of ``--steps`` timed steps each, at ``--threads``
threads (torch's and our optimizer's alike; by default our optimizer's own default,
``roundpipe.optim.get_num_threads()``). The tables give each contender's fastest step (what the
machine can do when nothing else runs) and the median over rounds of each round's fastest step;
ratios to torch's fused Adam: of the fastest steps, and the median of the per-round ratios (a
busy moment of a shared machine slows one round of every contender).

    python benchmarks/adam_state_step.py [--params 50M] [--shapes one,6.25M,256K] [--record]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import roundpipe.optim
import torch
from results import parse_count, write_result
from roundpipe import _C
from roundpipe.optim.adam_state import STATE_BLOCK

# Bytes per parameter of one step: param and grad read (8), param written (4), each moment read
# and written once.
MOMENT_BYTES = {torch.float32: 4.0, torch.bfloat16: 2.0, torch.int8: 1.0 + 4.0 / STATE_BLOCK}


def step_bytes(state_dtype: torch.dtype) -> float:
    """Bytes one Adam step moves per parameter with moments in ``state_dtype``."""
    return 8 + 4 + 2 * 2 * MOMENT_BYTES[state_dtype]


@dataclass(frozen=True)
class Contender:
    name: str
    state_dtype: torch.dtype
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer]


CONTENDERS = [
    Contender(
        "torch.optim.Adam(fused=True), fp32 state",
        torch.float32,
        lambda p: torch.optim.Adam(p, fused=True),
    ),
    Contender("ours, state_dtype=float32", torch.float32, roundpipe.optim.Adam),
    Contender(
        "ours, state_dtype=bfloat16",
        torch.bfloat16,
        lambda p: roundpipe.optim.Adam(p, state_dtype=torch.bfloat16),
    ),
    Contender(
        "ours, state_dtype=int8",
        torch.int8,
        lambda p: roundpipe.optim.Adam(p, state_dtype=torch.int8),
    ),
]
BASELINE = CONTENDERS[0].name


class BandwidthProbe:
    """Streaming passes over 256 MiB fp32 tensors; :meth:`turn` runs each once and keeps the
    fastest rate seen (bytes per second) and the pass that gave it."""

    def __init__(self) -> None:
        a, b, c, d = (torch.ones(64 * 2**20) for _ in range(4))
        self.passes: dict[str, tuple[Callable[[], object], int]] = {
            "copy_": (lambda: b.copy_(a), 8),
            "add_": (lambda: c.add_(a), 12),
            "lerp_": (lambda: b.lerp_(c, 0.5), 12),
            "addcmul_": (lambda: d.addcmul_(a, c), 16),
        }
        self.elements = a.numel()
        self.best, self.best_pass = 0.0, ""

    def turn(self) -> None:
        for name, (run, bytes_per_element) in self.passes.items():
            start = time.perf_counter()
            run()
            rate = bytes_per_element * self.elements / (time.perf_counter() - start)
            if rate > self.best:
                self.best, self.best_pass = rate, name


def make_params(total: int, tensor_size: int) -> list[torch.Tensor]:
    sizes = [tensor_size] * (total // tensor_size)
    sizes += [total % tensor_size] if total % tensor_size else []
    params = [torch.randn(n) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape) * 1e-3
    return params


def shape_of(text: str, total: int) -> tuple[str, int]:
    """A ``--shapes`` entry: ``one`` (a single tensor of ``total`` elements) or a tensor size."""
    if text == "one":
        return "one tensor", total
    size = parse_count(text)
    return f"tensors of {text}", size


def time_steps(
    optimizers: dict[str, torch.optim.Optimizer], probe: BandwidthProbe, steps: int, rounds: int
) -> dict[str, list[float]]:
    """Each optimizer's fastest step in each round, in seconds; the probe takes a turn in every
    round too."""
    seconds: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(rounds):
        probe.turn()
        for name, optimizer in optimizers.items():
            best = float("inf")
            for _ in range(steps):
                start = time.perf_counter()
                optimizer.step()
                best = min(best, time.perf_counter() - start)
            seconds[name].append(best)
    return seconds


# Speed-ups over torch's fused Adam that each form should reach, where its bytes allow: fp32 as
# fast as torch (same bytes), int8 near its bound of 28 / 16.06 = 1.74.
TARGETS = {
    "ours, state_dtype=float32": 1.0,
    "ours, state_dtype=bfloat16": None,
    "ours, state_dtype=int8": 1.7,
}


def target_cell(seconds: dict[str, list[float]], name: str, goal: float | None) -> str:
    base, own = seconds[BASELINE], seconds[name]
    median = statistics.median(b / s for b, s in zip(base, own, strict=True))
    fastest = min(base) / min(own)
    verdict = "" if goal is None else (": met" if median >= goal else ": MISSED")
    return f"{median:.2f} ({fastest:.2f}){verdict}"


def size_table(
    label: str, total: int, threads: int, seconds: dict[str, list[float]], probe: BandwidthProbe
) -> list[str]:
    base = seconds[BASELINE]
    lines = [
        f"### {total / 1e6:.0f}M fp32 parameters as {label}, {threads} thread(s)",
        "",
        f"Bound: {probe.best / 1e9:.1f} GB/s (`Tensor.{probe.best_pass}`, fastest probe pass).",
        "",
        "| contender | bytes/param | ms/step fastest | ms/step median | x fused, fastest "
        "| x fused, median | GB/s, fastest | of bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for contender in CONTENDERS:
        own = seconds[contender.name]
        fastest, median = min(own), statistics.median(own)
        per_round = statistics.median(b / s for b, s in zip(base, own, strict=True))
        moved = step_bytes(contender.state_dtype) * total / fastest
        lines.append(
            f"| {contender.name} | {step_bytes(contender.state_dtype):.2f} | "
            f"{fastest * 1e3:.1f} | {median * 1e3:.1f} | {min(base) / fastest:.2f} | "
            f"{per_round:.2f} | {moved / 1e9:.1f} | {100 * moved / probe.best:.0f}% |"
        )
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="50M", help="elements of the parameters, in all")
    parser.add_argument(
        "--shapes",
        default="one,6.25M,256K",
        help="comma-separated: 'one' (a single tensor) or the elements per tensor",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per turn")
    parser.add_argument("--rounds", type=int, default=7, help="turns each contender takes")
    parser.add_argument(
        "--threads",
        type=int,
        default=roundpipe.optim.get_num_threads(),
        help="threads, for torch and our optimizer alike (default: our optimizer's default)",
    )
    parser.add_argument("--record", action="store_true", help="write results/adam_state_step.md")
    args = parser.parse_args()

    total = parse_count(args.params)
    shapes = [shape_of(text, total) for text in args.shapes.split(",")]
    info = _C.build_info()
    lines = [
        f"SIMD {info['simd_active']}; {args.rounds} rounds of {args.steps} steps, contenders "
        f"interleaved",
        "",
    ]
    print("\n".join(lines), flush=True)
    probe = BandwidthProbe()
    bounds = {c.name: 28 / step_bytes(c.state_dtype) for c in CONTENDERS[1:]}
    targets = [
        "### Ratios to torch's fused Adam",
        "",
        "Median of the per-round ratios; the ratio of the fastest steps in brackets; the bytes' "
        "bound and the target in the header.",
        "",
        "| shape | "
        + " | ".join(
            f"{name.removeprefix('ours, state_dtype=')} (bound {bounds[name]:.2f}"
            + (f", target >= {goal}" if goal is not None else "")
            + ")"
            for name, goal in TARGETS.items()
        )
        + " |",
        "|---|---|---|---|",
    ]
    torch.set_num_threads(args.threads)
    roundpipe.optim.set_num_threads(args.threads)
    for label, tensor_size in shapes:
        params = make_params(total, tensor_size)
        optimizers = {c.name: c.make(params) for c in CONTENDERS}
        for optimizer in optimizers.values():
            optimizer.step()  # allocates the state, starts the threads
        probe.best = 0.0
        seconds = time_steps(optimizers, probe, args.steps, args.rounds)
        table = size_table(label, total, args.threads, seconds, probe)
        print("\n".join(table), flush=True)
        lines += table
        targets.append(
            f"| {label} | "
            + " | ".join(target_cell(seconds, name, goal) for name, goal in TARGETS.items())
            + " |"
        )
        del params, optimizers
    print("\n".join(targets), flush=True)
    lines += targets

    if args.record:
        path = write_result(
            "adam_state_step.py",
            "Adam step throughput with compact moments",
            f"roundpipe {info['version']} ({info['simd_compiled']} compiled, "
            f"{info['simd_active']} used)",
            "\n".join(lines),
        )
        print(f"written to {path}")


if __name__ == "__main__":
    main()
