"""Instructions per layer x microbatch of the dispatch case, counted by valgrind's callgrind.

The dispatch table of ``overhead_cpu.py`` times 256 ``nn.Linear(8, 8)`` + ReLU layers, 4
microbatches of 4 rows, on a shared machine whose timings drift by 10-50% between runs. Executed
instructions do not drift: this script runs each contender under ``valgrind --tool=callgrind``
twice, with ``--warmup`` calls then ``0`` and ``--calls`` more calls, and reports the difference
per layer x microbatch beside plain PyTorch's forward + backward, and the ratio. The same
binary, inputs and environment give the same count, whatever else the machine is doing.

    python benchmarks/dispatch_instructions.py                 # plain, stage, layer on 1 device
    python benchmarks/dispatch_instructions.py --devices 3 --contenders plain layer

Each run takes about a minute (valgrind runs Python about 50 times slower). A count is not a
time (cache misses, which a deep model's first touch of its weights makes, cost more than one
instruction), so this shows where the host's work goes; the timed table stays the target.
``--record`` rewrites ``results/dispatch_instructions.md``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import torch
from results import Output, write_result

LAYERS, WIDTH, MICROBATCHES, ROWS = 256, 8, 4, 4


def run_calls(contender: str, devices: int, warmup: int, calls: int) -> None:
    """What runs under valgrind: ``warmup + calls`` training calls of ``contender``."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import overhead_cpu
    import roundpipe

    torch.set_num_threads(1)
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    torch.manual_seed(0)
    model = overhead_cpu.deep_narrow(LAYERS, WIDTH)
    x, y = torch.randn(MICROBATCHES * ROWS, WIDTH), torch.randn(MICROBATCHES * ROWS, WIDTH)
    if contender == "plain":

        def step() -> None:
            overhead_cpu.plain_step(model, x, y, MICROBATCHES)

    else:
        wrapped = roundpipe.RoundPipe(model)

        def step() -> None:
            overhead_cpu.roundpipe_step(wrapped, x, y, MICROBATCHES, contender)

    for _ in range(warmup + calls):
        step()


def count(contender: str, devices: int, warmup: int, calls: int) -> int:
    """Instructions callgrind counts for the whole process."""
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        command = [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            os.path.abspath(__file__),
            "--run",
            contender,
            "--devices",
            str(devices),
            "--warmup",
            str(warmup),
            "--calls",
            str(calls),
        ]
        subprocess.run(command, check=True, capture_output=True)
        with open(out) as file:
            totals = re.search(r"^totals: (\d+)", file.read(), re.MULTILINE)
        if totals is None:
            raise RuntimeError(f"no totals in callgrind's output for {contender}")
        return int(totals.group(1))


def valgrind_version() -> str:
    result = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=True)
    return result.stdout.strip()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contenders", nargs="+", default=["plain", "stage", "layer"])
    parser.add_argument("--devices", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--calls", type=int, default=6)
    parser.add_argument(
        "--record", action="store_true", help="write results/dispatch_instructions.md"
    )
    parser.add_argument("--run", help=argparse.SUPPRESS)  # the process valgrind runs
    args = parser.parse_args()
    if args.run:
        run_calls(args.run, args.devices, args.warmup, args.calls)
        return
    per_call = LAYERS * MICROBATCHES
    results = {}
    for contender in args.contenders:
        base = count(contender, args.devices, args.warmup, 0)
        more = count(contender, args.devices, args.warmup, args.calls)
        results[contender] = (more - base) / args.calls / per_call
    out = Output()
    out(
        f"{LAYERS} layers of width {WIDTH}, {MICROBATCHES} microbatches x {ROWS} rows, "
        f"{args.devices} CPU device(s); instructions per layer x microbatch over {args.calls} "
        f"calls after {args.warmup}"
    )
    out()
    out("| contender | instructions | x plain fwd+bwd |")
    out("|---|---:|---:|")
    plain = results.get("plain")
    for contender, value in results.items():
        ratio = f"{value / plain:.2f}x" if plain else ""
        out(f"| {contender} | {value:,.0f} | {ratio} |")
    if args.record:
        import roundpipe

        path = write_result(
            "dispatch_instructions.py",
            "Instructions per layer x microbatch of the dispatch case (callgrind)",
            f"roundpipe {roundpipe.__version__}, {valgrind_version()}",
            out.text(),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
