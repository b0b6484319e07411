"""CPU Adam throughput: roundpipe.optim.Adam against torch.optim.Adam and the physical bound.

Measures parameters updated per second for fp32 models of the given sizes (split into tensors
like a model's layers) for

* ours: ``roundpipe.optim.Adam`` (native SIMD kernel on the native thread pool);
* torch.optim.Adam: default (on CPU the per-tensor for-loop), ``foreach=True``, ``fused=True``;
* the pure-Python RoundPipe 0.1.1's JIT-compiled Adam, in a subprocess (same import name), when
  ``--rp011`` points at a folder holding it (``pip install --no-deps --target DIR
  roundpipe==0.1.1 beartype py-cpuinfo tqdm``);
* the memory-bandwidth bound: measured memory bandwidth / bytes an Adam step moves per parameter.

Then the whole per-iteration host path of a bf16 model with fp32 master weights (bf16 gradients
-> fp32 master .grad -> unscale + inf/NaN check -> Adam -> bf16 write-back), unfused with torch
ops around either optimizer, and fused (our single-pass kernels).

Run from the repository root: ``python benchmarks/adam_cpu.py [--record]``.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
# Bytes per parameter of one fp32 Adam step: read param, grad, exp_avg, exp_avg_sq; write param,
# exp_avg, exp_avg_sq.
ADAM_BYTES = 7 * 4
# The fused host path: a read-only inf/NaN check of the bf16 grad (2), then read param, bf16 grad,
# exp_avg, exp_avg_sq (14) and write param, exp_avg, exp_avg_sq, bf16 param (14).
HOST_PATH_BYTES = 2 + 14 + 14
INV_SCALE = 1.0 / 1024


def parse_count(text: str) -> int:
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1].upper(), 1)
    return int(float(text.rstrip("KMGkmg")) * scale)


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


def optimizer_rate(
    factory: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    total: int,
    tensor_size: int,
    steps: int,
) -> float:
    params = make_model(total, tensor_size)
    optimizer = factory(params)
    seconds = best_seconds(optimizer.step, steps)
    del optimizer, params
    gc.collect()
    return total / seconds


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
print(json.dumps(total / min(times)))
"""


def rp011_rate(folder: str, total: int, tensor_size: int, steps: int) -> tuple[float | None, str]:
    if not (Path(folder) / "roundpipe").is_dir():
        return (
            None,
            f"not found in {folder} (pip install --no-deps --target {folder} "
            "roundpipe==0.1.1 beartype py-cpuinfo tqdm)",
        )
    env = {**os.environ, "PYTHONPATH": folder}
    result = subprocess.run(
        [sys.executable, "-c", RP011_SCRIPT, folder, str(total), str(tensor_size), str(steps)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if result.returncode != 0:
        return None, "failed: " + result.stderr.strip().splitlines()[-1]
    return float(json.loads(result.stdout.strip().splitlines()[-1])), ""


def host_path_rates(total: int, tensor_size: int, steps: int) -> dict[str, float]:
    """Params/s of the whole host path of a bf16 model with fp32 master weights."""
    import roundpipe.optim
    from roundpipe import _C

    masters = make_model(total, tensor_size)
    for p in masters:
        p.grad = torch.zeros_like(p)
    grads = [(torch.randn(p.shape) * 1e-3 / INV_SCALE).to(torch.bfloat16) for p in masters]
    lowp = [p.to(torch.bfloat16) for p in masters]
    master_grads = [p.grad for p in masters]
    rates = {}

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

    for name, optimizer in (
        ("unfused: torch ops + torch Adam foreach", torch.optim.Adam(masters, foreach=True)),
        ("unfused: torch ops + our Adam", roundpipe.optim.Adam(masters)),
    ):
        rates[name] = total / best_seconds(unfused(optimizer), steps)
        del optimizer
        gc.collect()

    ours = roundpipe.optim.Adam(masters)

    def accumulated() -> None:
        if _C.grad_accumulate(master_grads, grads, True):
            ours.step_fused(grad_scale_inv=INV_SCALE, lowp_params=lowp, check_finite=False)

    rates["fused: grad_accumulate pass + fused Adam pass"] = total / best_seconds(
        accumulated, steps
    )
    rates["fused: check pass + Adam pass on bf16 grads"] = total / best_seconds(
        lambda: ours.step_fused(grads, grad_scale_inv=INV_SCALE, lowp_params=lowp), steps
    )
    return rates


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="10M,100M", help="comma-separated model sizes")
    parser.add_argument("--tensor-size", default="1M", help="elements per parameter tensor")
    parser.add_argument(
        "--steps", type=int, default=5, help="timed steps (the fastest is reported)"
    )
    parser.add_argument("--rp011", default="/tmp/rp011", help="folder holding roundpipe==0.1.1")
    parser.add_argument("--record", action="store_true", help="append the table to RESULTS.md")
    args = parser.parse_args()

    import roundpipe.optim
    from roundpipe import _C

    tensor_size = parse_count(args.tensor_size)
    bandwidth = memory_bandwidth()
    info = _C.build_info()
    lines = [
        f"threads {torch.get_num_threads()}, SIMD {info['simd_active']}, memory bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s, tensors of {tensor_size:,} elements, "
        f"best of {args.steps} steps",
        "",
    ]
    printed = 0
    for total in map(parse_count, args.params.split(",")):
        rates: dict[str, float | None] = {}
        notes: dict[str, str] = {}
        rates["ours: roundpipe.optim.Adam"] = optimizer_rate(
            roundpipe.optim.Adam, total, tensor_size, args.steps
        )
        rates["torch.optim.Adam default (for-loop)"] = optimizer_rate(
            torch.optim.Adam, total, tensor_size, args.steps
        )
        rates["torch.optim.Adam foreach=True"] = optimizer_rate(
            lambda p: torch.optim.Adam(p, foreach=True), total, tensor_size, args.steps
        )
        rates["torch.optim.Adam fused=True"] = optimizer_rate(
            lambda p: torch.optim.Adam(p, fused=True), total, tensor_size, args.steps
        )
        name = "roundpipe 0.1.1 Adam (JIT C++)"
        rates[name], notes[name] = rp011_rate(args.rp011, total, tensor_size, args.steps)
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

        host = host_path_rates(total, tensor_size, args.steps)
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

    table = "\n".join(lines)
    if args.record:
        entry = textwrap.dedent(
            f"""
            ## {datetime.date.today().isoformat()} — benchmarks/adam_cpu.py

            - machine: {machine()}
            - torch {torch.__version__}, roundpipe {info["version"]} """
            f"""({info["simd_compiled"]} compiled, {info["simd_active"]} used)
            - command: `python benchmarks/adam_cpu.py {" ".join(sys.argv[1:])}`

            """
        )
        results = HERE / "RESULTS.md"
        results.write_text(results.read_text() + entry + table + "\n")


if __name__ == "__main__":
    main()
