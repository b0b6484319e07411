"""Host memory per parameter: peak and steady RSS of training with RoundPipe, beside the floor.

Each case runs in a fresh subprocess (RSS is per process) on virtual CPU devices:

1. the zero point: ``import roundpipe``, then torch's first-use costs paid once on a throwaway
   512 x 512 layer of the case's dtype (a ``torch.optim.Adam`` built over it, which imports
   ``torch._dynamo``: 27 MB; one forward and backward, which load the matmul kernels and start
   the autograd engine's and the thread pool's threads: about 10 MB). Every process that trains
   with torch pays these once, whatever the model's size, plain PyTorch as much as RoundPipe:
   they are not bytes per parameter. The kernel's peak-RSS mark is reset there. ``process peak``
   adds them back (the peak above the RSS right after the import);
2. the plain model is built (its weights count: wrapping must not double them) and wrapped;
3. the optimizer is built and ``--iters`` training iterations run (``forward_backward`` + ``step``;
   in the last case two ``forward_backward`` per ``step``, the second adding to the gradients of
   the first, which a failed call must leave as they were).

``peak`` is the kernel's high-water mark since the zero point (construction included), ``steady``
the RSS after the last iteration, both in bytes per parameter of the model. The floor counts
only what the design must hold: the model's weights, the optimizer copies (when they cannot be
the weights themselves), Adam's two moments and the gradient arena (two of them for
asynchronous steps, one filling while the optimizer consumes the other); the breakdown table
says where the rest goes.
One-layer stages keep the virtual devices' buffers (host memory here; GPU memory on GPUs) to 2/L
of the trained weights; frozen parameters are bound in place on virtual CPU devices, not copied.

The LoRA case: rank-8 adapters on a frozen bf16 base of 4096 x 4096 layers
(12 of them at 200M), the base kept in its own pageable storage (``pin_model="off"``, as
docs/guide.md advises for frozen bases). Beside it, the same model trained by the plain PyTorch
per-microbatch loop with ``torch.optim.Adam`` on the adapters, measured the same way.

``--marginal`` measures every case again at half the size and adds the marginal peak: the
growth of the peak RSS from the half-size model to the full one per parameter added. Whatever
does not grow with the model cancels out of it (what the first-use costs above miss), so it is
what decides how many parameters a given host memory holds.

    python benchmarks/host_memory.py --params 200M --record    # rewrites results/host_memory.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from results import parse_count, pay_first_use_costs, peak_rss, reset_peak_rss, rss, write_result
from roundpipe import RoundPipe
from roundpipe.optim.adam_state import STATE_BLOCK


@dataclass(frozen=True)
class Case:
    name: str
    dtype: str  # model weights
    optim_dtype: str | None  # optimizer copies (None: the weights' dtype)
    is_async: bool
    scaler: bool = False
    lora: bool = False
    plain: bool = False  # the plain PyTorch loop instead of RoundPipe
    accumulate: int = 1  # forward_backward calls per step (gradients of earlier calls kept)
    state_dtype: str = "float32"  # roundpipe.optim.Adam's state_dtype (its moments' form)

    def floor(self) -> float:
        """Bytes per parameter the design must hold."""
        weight = torch.empty(0, dtype=getattr(torch, self.dtype)).element_size()
        if self.lora:
            return float(weight)  # frozen base: only its weights (adapters are negligible)
        master = torch.empty(0, dtype=getattr(torch, self.optim_dtype or self.dtype)).element_size()
        moments = {"float32": 8.0, "bfloat16": 4.0, "int8": 2 + 8 / STATE_BLOCK}[self.state_dtype]
        return weight + master + moments + weight * (2 if self.is_async else 1)


CASES = [
    Case("bf16 + fp32 Adam, async", "bfloat16", "float32", True),
    Case("bf16 + fp32 Adam, sync", "bfloat16", "float32", False),
    Case("fp32 + Adam, async", "float32", None, True),
    Case("fp16 + fp32 Adam + GradScaler, async", "float16", "float32", True, scaler=True),
    Case("LoRA r=8 on a frozen bf16 base, async", "bfloat16", "float32", True, lora=True),
    Case(
        "the same LoRA, plain PyTorch + torch.optim.Adam",
        "bfloat16",
        None,
        False,
        lora=True,
        plain=True,
    ),
    Case("bf16 + fp32 Adam, sync, 2 calls per step", "bfloat16", "float32", False, accumulate=2),
    # Issue 40's compact Adam state (benchmarks/adam_state_memory.py; case 1 is its fp32 state).
    Case(
        "bf16 + fp32 Adam, bf16 state, async", "bfloat16", "float32", True, state_dtype="bfloat16"
    ),
    Case("bf16 + fp32 Adam, int8 state, async", "bfloat16", "float32", True, state_dtype="int8"),
    Case("bf16 + fp32 Adam, int8 state, sync", "bfloat16", "float32", False, state_dtype="int8"),
]


# ------------------------------------------------------------------------------------------
# The measured process
# ------------------------------------------------------------------------------------------


class LoRALinear(torch.nn.Module):
    """A frozen ``width x width`` weight plus a trainable rank-``rank`` update ``B @ A``."""

    def __init__(self, width: int, rank: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.base = torch.nn.Linear(width, width, bias=False, dtype=dtype).requires_grad_(False)
        self.lora_a = torch.nn.Parameter(torch.randn(rank, width, dtype=dtype) / width**0.5)
        self.lora_b = torch.nn.Parameter(torch.zeros(width, rank, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def run_case(case: Case, params: int, iters: int, devices: int) -> dict[str, float]:
    import roundpipe
    from roundpipe import GradScaler, RoundPipeRunConfig

    roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
    # Many layers in one-layer stages: on virtual CPU devices the resident stages' buffers (at
    # most two stages, 2/L of the trained weights) are host memory too, and are counted. The
    # LoRA base in 4096 x 4096 layers.
    if case.lora and params >= 10**8:
        width = 4096
    else:
        width = 2048 if params >= 20 * 10**6 else 512
    layers = max(2, round(params / width**2))
    dtype = getattr(torch, case.dtype)
    # `import roundpipe` already brought torch.fx.experimental.symbolic_shapes (which
    # torch.autograd.backward imports when given gradients) through torch.distributed.checkpoint.
    imported = rss()
    pay_first_use_costs(dtype)
    zero = rss()
    reset_peak_rss()

    torch.manual_seed(0)
    if case.lora:
        net = torch.nn.Sequential(*[LoRALinear(width, 8, dtype) for _ in range(layers)])
    else:
        net = torch.nn.Sequential(
            *[torch.nn.Linear(width, width, bias=False, dtype=dtype) for _ in range(layers)]
        )
    x, y = torch.randn(8, width, dtype=dtype), torch.randn(8, width)
    if case.plain:
        construction_peak = peak_rss() - zero
        optimizer: torch.optim.Optimizer = torch.optim.Adam(
            [p for p in net.parameters() if p.requires_grad], lr=1e-4
        )
        for _ in range(iters):
            for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
                ((net(xm).float() - ym) ** 2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
        peak = peak_rss()
        return _figures(
            peak - zero, peak - imported, rss() - zero, construction_peak, net, optimizer, net
        )
    model = RoundPipe(
        net,
        optim_dtype=None if case.optim_dtype is None else getattr(torch, case.optim_dtype),
        pin_model="off" if case.lora else "alloc",
    )
    construction_peak = peak_rss() - zero
    optimizer = roundpipe.optim.Adam(
        model.optim_parameters(), lr=1e-4, state_dtype=getattr(torch, case.state_dtype)
    )
    scaler = GradScaler() if case.scaler else None

    def step_fn() -> None:
        if scaler is None:
            optimizer.step()
        else:
            scaler.step(optimizer)
            scaler.update()
        optimizer.zero_grad()

    def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        loss = ((out.float() - label) ** 2).mean()
        return loss if scaler is None else scaler.scale(loss)

    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(layers - 1)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(layers))]
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    for _ in range(iters):
        for _ in range(case.accumulate):
            model.forward_backward(input_args=(x,), label=y, loss_fn=loss_fn, run_config=config)
        model.step(step_fn, case.is_async)
    steady = rss() - zero
    peak = peak_rss()
    model.synchronize()
    figures = _figures(
        peak - zero, peak - imported, steady, construction_peak, net, optimizer, model
    )
    figures["zero_rss"] = zero
    return figures


def _figures(
    peak: int,
    process_peak: int,
    steady: int,
    construction_peak: int,
    net: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trained: torch.nn.Module,
) -> dict[str, float]:
    """The measured figures and the design's parts, in bytes per parameter of ``net``."""
    total = sum(p.numel() for p in net.parameters())
    state_bytes = sum(
        t.numel() * t.element_size()
        for s in optimizer.state.values()
        for t in s.values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    copies = trained.optim_parameters() if isinstance(trained, RoundPipe) else iter(())
    return {
        "params": total,
        "construction_peak": construction_peak / total,
        "peak": peak / total,
        "process_peak": process_peak / total,
        "steady": steady / total,
        "weights": sum(p.numel() * p.element_size() for p in net.parameters()) / total,
        "grad_arena": sum(p.numel() * p.element_size() for p in net.parameters() if p.requires_grad)
        / total,
        "copies": sum(p.numel() * p.element_size() for p in copies) / total,
        "optimizer_state": state_bytes / total,
    }


# ------------------------------------------------------------------------------------------
# The driver
# ------------------------------------------------------------------------------------------


def measure(case: Case, params: int, iters: int, devices: int) -> dict[str, float]:
    """``run_case`` in a fresh interpreter."""
    command = [
        sys.executable,
        __file__,
        "--child",
        str(CASES.index(case)),
        "--params",
        str(params),
        "--iters",
        str(iters),
        "--devices",
        str(devices),
    ]
    out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def marginal_peak(full: dict[str, float], half: dict[str, float]) -> float:
    """Peak RSS growth from the ``half`` model to the ``full`` one, per parameter added."""
    added = full["params"] - half["params"]
    return (full["peak"] * full["params"] - half["peak"] * half["params"]) / added


def table(results: list[tuple[Case, dict[str, float]]]) -> str:
    marginal = all("marginal_peak" in r for _, r in results)
    lines = [
        "| case | floor | construction peak | peak | steady | peak - floor | process peak |"
        + (" marginal peak |" if marginal else ""),
        "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if marginal else ""),
    ]
    for case, r in results:
        lines.append(
            f"| {case.name} | {case.floor():.1f} | {r['construction_peak']:.2f} | "
            f"{r['peak']:.2f} | {r['steady']:.2f} | {r['peak'] - case.floor():+.2f} | "
            f"{r['process_peak']:.2f} |" + (f" {r['marginal_peak']:.2f} |" if marginal else "")
        )
    lines += [
        "",
        "Where the bytes go (per parameter): what the design holds, then the rest of the peak and "
        "of the steady RSS (torch's temporaries, fixed costs of torch and the runtime, allocator "
        "slack). Gradient arenas: as counted in the floor (plain PyTorch: its `.grad` tensors); "
        "a consumed arena's pages are handed back to the OS, so the steady RSS, taken after a "
        "step, holds at most the one the optimizer may still be reading.",
        "",
        "| case | weights | optimizer copies | Adam state | gradient arenas "
        "| rest of peak | steady - weights - copies - state |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for case, r in results:
        held = r["weights"] + r["copies"] + r["optimizer_state"]
        arenas = r["grad_arena"] * (2 if case.is_async else 1)
        lines.append(
            f"| {case.name} | {r['weights']:.2f} | {r['copies']:.2f} | "
            f"{r['optimizer_state']:.2f} | {arenas:.2f} | {r['peak'] - held - arenas:.2f} | "
            f"{r['steady'] - held:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="200M", help="model size, e.g. 50M, 200M")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--devices", type=int, default=2, help="virtual CPU devices")
    parser.add_argument("--cases", default="all", help="comma-separated case numbers (1-based)")
    parser.add_argument("--record", action="store_true", help="write results/host_memory.md")
    parser.add_argument(
        "--marginal",
        action="store_true",
        help="also measure each case at half the size and report the marginal peak",
    )
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    params = parse_count(str(args.params))
    if args.child is not None:
        print(json.dumps(run_case(CASES[args.child], params, args.iters, args.devices)))
        return

    chosen = CASES if args.cases == "all" else [CASES[int(i) - 1] for i in args.cases.split(",")]
    results = [(case, measure(case, params, args.iters, args.devices)) for case in chosen]
    if args.marginal:
        for case, r in results:
            half = measure(case, params // 2, args.iters, args.devices)
            r["marginal_peak"] = marginal_peak(r, half)
    header = (
        f"{results[0][1]['params'] / 1e6:.0f}M parameters, {args.devices} CPU devices, "
        f"{args.iters} iterations; bytes per parameter (RSS above the zero point: the process "
        "after its imports and torch's first-use costs; process peak: above the RSS after the "
        "imports"
        + ("; marginal peak: from half the size to this one" if args.marginal else "")
        + ")"
    )
    text = f"{header}\n\n{table(results)}"
    print(text)
    if args.record:
        import roundpipe

        path = write_result(
            "host_memory.py",
            "Host memory per parameter of training, beside the floor and plain PyTorch",
            f"roundpipe {roundpipe.__version__}",
            text,
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
