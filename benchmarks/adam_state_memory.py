"""Host bytes per parameter with compact Adam state, and the largest model a given host
memory holds with each ``state_dtype``.

The cases are ``host_memory.py``'s (each in a fresh process, on virtual CPU devices, peak RSS
from before the model is built, so construction counts): a bf16 model with fp32 optimizer copies,
``roundpipe.optim.Adam`` with ``state_dtype`` float32 (today's default and the baseline), bfloat16
or int8, asynchronous steps (and int8 with synchronous steps, which hold one gradient arena
instead of two). ``host_memory.py`` describes the zero point and the floor (weights,
copies, moments and two gradient arenas).

With ``--marginal`` (default) every case is measured again at half the size; the marginal peak is
the growth of the peak RSS per parameter added, which is what a larger model pays. The largest
model that fits ``M`` GiB is then ``(M - fixed) / marginal peak``, where ``fixed`` is what does not
grow with the model (the process after its imports and torch's first-use costs, plus the peak's
part that the marginal figure does not explain). It leaves nothing for the OS, the data loader or
the page cache: a real run needs some headroom.

    python benchmarks/adam_state_memory.py [--params 200M] [--record]
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from host_memory import CASES, Case, marginal_peak, measure
from results import meminfo, parse_count, write_result

# Rows: Adam's state_dtype, and the case measured for it (asynchronous steps; the last row
# shows what a synchronous step, with one gradient arena instead of two, saves).
STATE_CASES = {
    "float32": CASES[0],
    "bfloat16": CASES[7],
    "int8": CASES[8],
    "int8, synchronous step": CASES[9],
}
# Issue 40's target for int8 state: peak bytes per parameter.
INT8_TARGET = 11.0
# A generous bound on the fp32 case's peak per parameter, to check the machine can hold it.
FP32_PEAK_ESTIMATE = 20.0


def largest_model(memory: float, per_param: float, fixed: float) -> float:
    """Parameters that ``memory`` bytes hold at ``per_param`` bytes each after ``fixed``."""
    return max(0.0, (memory - fixed) / per_param)


def fixed_bytes(result: dict[str, float], per_param: float) -> float:
    """What a case's peak holds that does not grow with the model: the zero point's RSS plus the
    peak above it that ``per_param`` does not explain."""
    return result["zero_rss"] + (result["peak"] - per_param) * result["params"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="200M", help="model size")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2, help="virtual CPU devices")
    parser.add_argument(
        "--no-marginal",
        dest="marginal",
        action="store_false",
        help="skip the half-size runs (capacities then use the peak per parameter)",
    )
    parser.add_argument(
        "--memory-gib", default="64,256,1024", help="host memories for the capacity table"
    )
    parser.add_argument("--record", action="store_true", help="write results/adam_state_memory.md")
    args = parser.parse_args()

    params = parse_count(args.params)
    available = meminfo("MemAvailable")
    notes = [f"MemAvailable at start: {available / 2**30:.1f} GiB."]
    if FP32_PEAK_ESTIMATE * params > 0.8 * available:
        params = int(0.8 * available / FP32_PEAK_ESTIMATE) // 10**6 * 10**6
        notes.append(f"Too little memory for {args.params}: measured at {params / 1e6:.0f}M.")
    print(" ".join(notes), flush=True)

    results: dict[str, tuple[Case, dict[str, float]]] = {}
    for state_dtype, case in STATE_CASES.items():
        result = measure(case, params, args.iters, args.devices)
        if args.marginal:
            half = measure(case, params // 2, args.iters, args.devices)
            result["marginal_peak"] = marginal_peak(result, half)
        results[state_dtype] = (case, result)
        print(f"{state_dtype}: peak {result['peak']:.2f} bytes/param", flush=True)

    base_peak = results["float32"][1]["peak"]
    lines = [
        f"{results['float32'][1]['params'] / 1e6:.0f}M parameters: bf16 weights, fp32 optimizer "
        f"copies, {args.devices} CPU devices, {args.iters} iterations. " + " ".join(notes),
        "",
        "Bytes per parameter (RSS above the zero point, construction included; floor: weights 2, "
        "copies 4, moments 8, 4 or 2.03, bf16 gradient arenas 2 each: two with asynchronous "
        "steps, one with synchronous):",
        "",
        "| Adam state_dtype | floor | construction peak | peak | steady | peak vs fp32 state "
        + ("| marginal peak " if args.marginal else "")
        + "| target |",
        "|---|---:|---:|---:|---:|---:|" + ("---:|" if args.marginal else "") + "---|",
    ]
    for state_dtype, (case, r) in results.items():
        target = ""
        if state_dtype == "int8":
            met = r["peak"] <= INT8_TARGET
            target = f"peak <= {INT8_TARGET:g}: {'met' if met else 'MISSED'}"
        lines.append(
            f"| {state_dtype}{' (baseline)' if state_dtype == 'float32' else ''} "
            f"| {case.floor():.2f} | {r['construction_peak']:.2f} | {r['peak']:.2f} "
            f"| {r['steady']:.2f} | {r['peak'] - base_peak:+.2f} "
            + (f"| {r['marginal_peak']:.2f} " if args.marginal else "")
            + f"| {target} |"
        )

    memories = [float(m) for m in args.memory_gib.split(",")]
    per = "marginal peak" if args.marginal else "peak"
    lines += [
        "",
        f"Largest model that fits (parameters, from the {per} per parameter and the fixed bytes "
        "measured above; no headroom for the OS or data):",
        "",
        "| Adam state_dtype | bytes/param | fixed | "
        + " | ".join(f"{m:g} GiB" for m in memories)
        + " |",
        "|---|---:|---:|" + "---:|" * len(memories),
    ]
    for state_dtype, (_, r) in results.items():
        per_param = r["marginal_peak"] if args.marginal else r["peak"]
        fixed = fixed_bytes(r, per_param)
        sizes = [largest_model(m * 2**30, per_param, fixed) / 1e9 for m in memories]
        lines.append(
            f"| {state_dtype} | {per_param:.2f} | {fixed / 2**20:.0f} MiB | "
            + " | ".join(f"{s:.2f}B" for s in sizes)
            + " |"
        )
    text = "\n".join(lines)
    print(text)
    if args.record:
        import roundpipe

        path = write_result(
            "adam_state_memory.py",
            "Host bytes per parameter with compact Adam state",
            f"roundpipe {roundpipe.__version__}",
            text,
        )
        print(f"written to {path}")


if __name__ == "__main__":
    main()
