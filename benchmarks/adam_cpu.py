"""CPU Adam throughput: roundpipe.optim.Adam against torch.optim.Adam and the physical bound.

Measures parameters updated per second for fp32 models of the given sizes (split into tensors
like a model's layers) for

* ours: ``roundpipe.optim.Adam`` (native SIMD kernel on the native thread pool);
* torch.optim.Adam: default (on CPU the per-tensor for-loop), ``foreach=True``, ``fused=True``;
* the pure-Python RoundPipe 0.1.1's JIT-compiled Adam, in a subprocess (same import name), when
  ``--rp011`` points at a folder holding it (``pip install --no-deps --target DIR
  roundpipe==0.1.1 beartype py-cpuinfo tqdm``);
* the memory-bandwidth bound: measured memory bandwidth / bytes an Adam step moves per parameter.

The contenders take turns (``--rounds``), each turn ``--steps`` timed steps, and the fastest step
counts: on a shared machine a busy moment then slows every contender, not just one.

Then the whole per-iteration host path of a bf16 model with fp32 master weights (bf16 gradients
-> fp32 master .grad -> unscale + inf/NaN check -> Adam -> bf16 write-back), unfused with torch
ops around either optimizer, and fused (our single-pass kernels).

Run from the repository root: ``python benchmarks/adam_cpu.py [--record]`` (``--record`` rewrites
``results/adam_cpu.md``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from results import parse_count, write_result

# Bytes per parameter of one fp32 Adam step: read param, grad, exp_avg, exp_avg_sq; write param,
# exp_avg, exp_avg_sq.
ADAM_BYTES = 7 * 4
# The fused host path: a read-only inf/NaN check of the bf16 grad (2), then read param, bf16 grad,
# exp_avg, exp_avg_sq (14) and write param, exp_avg, exp_avg_sq, bf16 param (14).
HOST_PATH_BYTES = 2 + 14 + 14
INV_SCALE = 1.0 / 1024


def best_seconds(step: Callable[[], object], steps: int) -> float:
    """Fastest of `steps` timed runs after a warm-up (state allocation, page faults, thread
    start). The fastest, not the median: the machine's cores are shared, and interference only
    ever slows a run down."""
    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return min(times)


# One turn of a contender: it runs a few timed steps and returns the fastest, in seconds.
Turn = Callable[[], float]


def interleaved_seconds(turns: dict[str, Turn], rounds: int) -> dict[str, float]:
    """Fastest step of each contender over `rounds` rounds in which they take turns. Taking
    turns spreads a busy moment of a shared machine over all of them instead of deciding the
    comparison by which one happened to run during it."""
    best = dict.fromkeys(turns, float("inf"))
    for _ in range(rounds):
        for name, turn in turns.items():
            best[name] = min(best[name], turn())
    return best


def memory_bandwidth() -> float:
    """Bytes per second moved by large multi-threaded torch passes, the best of a copy (read +
    write) and an in-place add (read 2 + write 1, no write-allocate traffic, like Adam's)."""
    a = torch.ones(64 * 2**20)
    b = torch.ones_like(a)
    copy = 2 * a.numel() * 4 / best_seconds(lambda: b.copy_(a), 5)
    add = 3 * a.numel() * 4 / best_seconds(lambda: b.add_(a), 5)
    return max(copy, add)


def make_model(
    total: int, tensor_size: int, dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    sizes = [tensor_size] * (total // tensor_size) + (
        [total % tensor_size] if total % tensor_size else []
    )
    params = [torch.randn(n, dtype=dtype) for n in sizes]
    for p in params:
        p.grad = torch.randn(p.shape, dtype=dtype) * 1e-3
    return params


def optimizer_rates(
    factories: dict[str, Callable[[list[torch.Tensor]], torch.optim.Optimizer]],
    others: dict[str, Turn],
    total: int,
    tensor_size: int,
    steps: int,
    rounds: int,
) -> dict[str, float]:
    """Params/s of each optimizer, each on its own model of `total` parameters, taking turns
    with each other and with `others` (contenders that run elsewhere)."""
    optimizers = {name: make(make_model(total, tensor_size)) for name, make in factories.items()}
    turns: dict[str, Turn] = {
        name: (lambda step=optimizer.step: best_seconds(step, steps))
        for name, optimizer in optimizers.items()
    }
    seconds = interleaved_seconds({**turns, **others}, rounds)
    del optimizers, turns
    gc.collect()
    return {name: total / s for name, s in seconds.items()}


RP011_SCRIPT = """
import json, sys, time, types, torch
# roundpipe 0.1.1's package __init__ queries GPU memory at import and fails without a GPU; its
# optimizer does not need that, so load the optim subpackage under a bare parent package.
package = types.ModuleType("roundpipe")
package.__path__ = [sys.argv[1] + "/roundpipe"]
sys.modules["roundpipe"] = package
from roundpipe.optim import Adam
total, tensor_size, steps = map(int, sys.argv[2:5])
sizes = [tensor_size] * (total // tensor_size)
sizes += [total % tensor_size] if total % tensor_size else []
params = [torch.randn(n) for n in sizes]
for p in params:
    p.grad = torch.randn(p.shape) * 1e-3
optimizer = Adam(params)
optimizer.step()
times = []
for _ in range(steps):
    start = time.perf_counter()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(json.dumps(min(times)))
"""


def rp011_turn(folder: str, total: int, tensor_size: int, steps: int) -> Turn | str:
    """A turn of roundpipe 0.1.1's Adam (a fresh subprocess each), or why there is none."""
    if not (Path(folder) / "roundpipe").is_dir():
        return (
            f"not found in {folder} (pip install --no-deps --target {folder} "
            "roundpipe==0.1.1 beartype py-cpuinfo tqdm)"
        )
    command = [sys.executable, "-c", RP011_SCRIPT, folder, str(total), str(tensor_size), str(steps)]

    def turn() -> float:
        result = subprocess.run(
            command,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": folder},
            timeout=1800,
            check=True,
        )
        return float(json.loads(result.stdout.strip().splitlines()[-1]))

    try:
        turn()  # fails here, before any timing, if it cannot run on this machine
    except subprocess.CalledProcessError as error:
        return "failed: " + error.stderr.strip().splitlines()[-1]
    return turn


def host_path_rates(total: int, tensor_size: int, steps: int, rounds: int) -> dict[str, float]:
    """Params/s of the whole host path of a bf16 model with fp32 master weights."""
    import roundpipe.optim
    from roundpipe import _C

    masters = make_model(total, tensor_size)
    for p in masters:
        p.grad = torch.zeros_like(p)
    grads = [(torch.randn(p.shape) * 1e-3 / INV_SCALE).to(torch.bfloat16) for p in masters]
    lowp = [p.to(torch.bfloat16) for p in masters]
    master_grads = [p.grad for p in masters]

    def unfused(optimizer: torch.optim.Optimizer) -> Callable[[], None]:
        found_inf = torch.zeros(())
        inv_scale = torch.full((), INV_SCALE)

        def step() -> None:
            torch._foreach_copy_(master_grads, grads)
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(master_grads, found_inf, inv_scale)
            if not found_inf.item():
                optimizer.step()
            torch._foreach_copy_(lowp, masters)

        return step

    ours = roundpipe.optim.Adam(masters)

    def accumulated() -> None:
        if _C.grad_accumulate(master_grads, grads, True):
            ours.step_fused(grad_scale_inv=INV_SCALE, lowp_params=lowp, check_finite=False)

    contenders = {
        "unfused: torch ops + torch Adam foreach": unfused(torch.optim.Adam(masters, foreach=True)),
        "unfused: torch ops + our Adam": unfused(roundpipe.optim.Adam(masters)),
        "fused: grad_accumulate pass + fused Adam pass": accumulated,
        "fused: check pass + Adam pass on bf16 grads": lambda: ours.step_fused(
            grads, grad_scale_inv=INV_SCALE, lowp_params=lowp
        ),
    }
    seconds = interleaved_seconds(
        {name: (lambda step=step: best_seconds(step, steps)) for name, step in contenders.items()},
        rounds,
    )
    return {name: total / s for name, s in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="10M,100M", help="comma-separated model sizes")
    parser.add_argument("--tensor-size", default="1M", help="elements per parameter tensor")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per turn")
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns each contender takes (fastest step reported)"
    )
    parser.add_argument("--rp011", default="/tmp/rp011", help="folder holding roundpipe==0.1.1")
    parser.add_argument("--record", action="store_true", help="write results/adam_cpu.md")
    args = parser.parse_args()

    import roundpipe.optim
    from roundpipe import _C

    tensor_size = parse_count(args.tensor_size)
    bandwidth = memory_bandwidth()
    info = _C.build_info()
    lines = [
        f"threads {torch.get_num_threads()}, SIMD {info['simd_active']}, memory bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, tensors of {tensor_size:,} elements, "
        f"contenders take {args.rounds} turns of {args.steps} steps, fastest step reported",
        "",
    ]
    printed = 0
    for total in map(parse_count, args.params.split(",")):
        peer = "roundpipe 0.1.1 Adam (JIT C++)"
        peer_turn = rp011_turn(args.rp011, total, tensor_size, args.steps)
        rates: dict[str, float | None] = dict(
            optimizer_rates(
                {
                    "ours: roundpipe.optim.Adam": roundpipe.optim.Adam,
                    "torch.optim.Adam default (for-loop)": torch.optim.Adam,
                    "torch.optim.Adam foreach=True": lambda p: torch.optim.Adam(p, foreach=True),
                    "torch.optim.Adam fused=True": lambda p: torch.optim.Adam(p, fused=True),
                },
                {} if isinstance(peer_turn, str) else {peer: peer_turn},
                total,
                tensor_size,
                args.steps,
                args.rounds,
            )
        )
        notes = {peer: peer_turn} if isinstance(peer_turn, str) else {}
        rates.setdefault(peer, None)
        bound = bandwidth / ADAM_BYTES
        ours = rates["ours: roundpipe.optim.Adam"]
        assert ours is not None
        lines.append(f"### {total:,} fp32 parameters: Adam step")
        lines.append("")
        lines.append("| implementation | Mparams/s | ours is x faster |")
        lines.append("|---|---:|---:|")
        for key, rate in rates.items():
            if rate is None:
                lines.append(f"| {key} | n/a ({notes[key]}) | |")
            else:
                lines.append(f"| {key} | {rate / 1e6:.0f} | {ours / rate:.2f} |")
        lines.append(
            f"| bound: {bandwidth / 1e9:.1f} GB/s / {ADAM_BYTES} B per param "
            f"| {bound / 1e6:.0f} | ours at {100 * ours / bound:.0f}% |"
        )
        lines.append("")

        host = host_path_rates(total, tensor_size, args.steps, args.rounds)
        best_fused = max(v for k, v in host.items() if k.startswith("fused"))
        host_bound = bandwidth / HOST_PATH_BYTES
        lines.append(
            f"### {total:,} parameters: host path "
            "(bf16 grads -> fp32 master -> unscale -> Adam -> bf16 write-back)"
        )
        lines.append("")
        lines.append("| path | Mparams/s | best fused is x faster |")
        lines.append("|---|---:|---:|")
        for key, rate in host.items():
            lines.append(f"| {key} | {rate / 1e6:.0f} | {best_fused / rate:.2f} |")
        lines.append(
            f"| bound: {bandwidth / 1e9:.1f} GB/s / {HOST_PATH_BYTES} B per param "
            f"| {host_bound / 1e6:.0f} | best fused at {100 * best_fused / host_bound:.0f}% |"
        )
        lines.append("")
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)

    if args.record:
        path = write_result(
            "adam_cpu.py",
            "CPU Adam throughput against torch's Adam and roundpipe 0.1.1",
            f"roundpipe {info['version']} ({info['simd_compiled']} compiled, "
            f"{info['simd_active']} used)",
            "\n".join(lines),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
