"""Planner benchmark: planning time, and simulated iteration time against the lower bound.

Part 1 times ``_C.plan_stages`` (the native core of ``ModelExecutePlan.auto``) for 100, 1,000 and
10,000 layers (target: under 50 ms for 10,000), median of repeats, beside a same-run baseline:
greedy packing at ``upper_threshold`` x the slowest layer (the greedy approach, in Python).

Part 2 plans model-shaped profiles for 1, 2, 4 and 8 devices with ``devices + 1`` microbatches
("fused" run type, min_stages = devices) and prints simulated iteration time / lower bound for our
plan and for the greedy baseline. Lower bound = max(total work / devices, critical path) with
total work = microbatches x per-microbatch work of the plan's stages and critical path = one
microbatch's work through every stage.

    python benchmarks/planner.py [--repeats 5] [--record]

``--record`` rewrites ``results/planner.md`` with both tables.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from results import Output, write_result
from roundpipe import _C

Profile = tuple[list[float], list[float], list[float], list[float], list[float]]
MB = 1 << 20


def profile_from(forward: list[float], nbytes: list[float]) -> Profile:
    return (forward, list(forward), [2 * f for f in forward], nbytes, [2 * b for b in nbytes])


def uniform(layers: int) -> Profile:
    return profile_from([1e-3] * layers, [100.0 * MB] * layers)


def qwen_like(layers: int) -> Profile:
    """Embedding (cheap, large), decoder layers, head (norm + lm_head, ~3x a layer)."""
    decoder = layers - 2
    forward = [0.05e-3] + [1e-3] * decoder + [3e-3]
    nbytes = [622.0 * MB] + [100.0 * MB] * decoder + [622.0 * MB]
    return profile_from(forward, nbytes)


def moe_like(layers: int, seed: int = 0) -> Profile:
    """Uneven layers: expert routing makes MoE layers cost 1-2.5x a dense one; head 3x."""
    rng = random.Random(seed)
    forward = [rng.uniform(1.0, 2.5) * 1e-3 for _ in range(layers - 1)] + [3e-3]
    nbytes = [rng.uniform(400, 700) * MB for _ in range(layers - 1)] + [622.0 * MB]
    return profile_from(forward, nbytes)


def greedy_fused(p: Profile, threshold: float) -> list[float]:
    """Baseline: fused stage = last layer; others packed greedily up to threshold x slowest."""
    forward, recompute, backward = p[0], p[1], p[2]
    back = [r + b for r, b in zip(recompute, backward, strict=True)]
    bound = threshold * max([*forward, *back])

    def pack(times: list[float]) -> list[float]:
        stages, current = [], 0.0
        for t in times:
            if current > 0 and current + t > bound:
                stages.append(current)
                current = 0.0
            current += t
        return [*stages, current] if current > 0 else stages

    last = len(forward) - 1
    fused = forward[last] + backward[last]
    return [*pack(forward[:last]), fused, *reversed(pack(list(reversed(back[:last]))))]


def our_stage_seconds(p: Profile, result: dict) -> list[float]:
    (forward_ranges, backward_ranges) = result["plans"][0]
    forward, backward = p[0], p[2]
    back = [r + b for r, b in zip(p[1], backward, strict=True)]
    seconds = [sum(forward[a:b]) for a, b in forward_ranges]
    for index, (a, b) in enumerate(backward_ranges):
        seconds.append(
            sum(forward[i] + backward[i] for i in range(a, b)) if index == 0 else sum(back[a:b])
        )
    return seconds


def ratio(stage_seconds: list[float], devices: int) -> float:
    microbatches = devices + 1
    simulated, _ = _C.simulate_schedule(stage_seconds, devices, microbatches)
    work = sum(stage_seconds)
    return simulated / max(microbatches * work / devices, work)


def plan(p: Profile, devices: int) -> dict:
    return _C.plan_stages("fused", [p], devices, 1.1, 40.0 * (1 << 30), devices, devices + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--record", action="store_true", help="write results/planner.md")
    args = parser.parse_args()
    out = Output()

    out("### Planning time, run type 'fused', 8 devices")
    out()
    out(f"median of {args.repeats}; baseline: greedy packing at 1.1 x the slowest layer, in Python")
    out()
    out("| profile | layers | ours ms | greedy ms | stages |")
    out("|---|---:|---:|---:|---:|")
    for name, make in (("uniform", uniform), ("qwen-like", qwen_like), ("moe-like", moe_like)):
        for layers in (100, 1_000, 10_000):
            p = make(layers)
            ours, greedy = [], []
            for _ in range(args.repeats):
                start = time.perf_counter()
                result = plan(p, 8)
                ours.append(time.perf_counter() - start)
                start = time.perf_counter()
                greedy_fused(p, 1.1)
                greedy.append(time.perf_counter() - start)
            stages = result["phases"][0]["num_stages"]
            out(
                f"| {name} | {layers:,} | {statistics.median(ours) * 1e3:.2f} | "
                f"{statistics.median(greedy) * 1e3:.2f} | {stages} |"
            )

    out()
    out("### Simulated iteration time / lower bound, run type 'fused', devices + 1 microbatches")
    out()
    out("1.00 is the bound; greedy: the baseline's plan, simulated the same way")
    out()
    out("| profile | devices | ours | greedy | stages |")
    out("|---|---:|---:|---:|---:|")
    shapes = (
        ("uniform 32", uniform(32)),
        ("qwen3-1.7B-like", qwen_like(30)),
        ("moe-like 48", moe_like(48)),
    )
    for name, p in shapes:
        for devices in (1, 2, 4, 8):
            result = plan(p, devices)
            ours_ratio = ratio(our_stage_seconds(p, result), devices)
            baseline = ratio(greedy_fused(p, 1.1), devices)
            stages = result["phases"][0]["num_stages"]
            out(f"| {name} | {devices} | {ours_ratio:.3f} | {baseline:.3f} | {stages} |")
    if args.record:
        import roundpipe

        path = write_result(
            "planner.py",
            "Planner: planning time and simulated iteration time against the lower bound",
            f"roundpipe {roundpipe.__version__}",
            out.text(),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
