"""Training past the host's memory: a model whose optimizer state would not fit this machine's
memory, trained a few iterations with ``optim_offload``, its host memory, step and disk figures
printed per iteration.

A bf16 model of ``--params`` parameters (residual blocks ``x + Linear(x)`` of ``--width`` x
``--width``) with fp32 optimizer copies and ``roundpipe.optim.Adam`` (``--state-dtype``, default
int8) regresses a fixed random target on virtual CPU devices, its copies and moments in files
under ``--folder``. Held in memory, the same state would take ``weights + gradients + copies +
moments (+ a second gradient arena with asynchronous steps)`` bytes per parameter (about 12
with int8 moments): the run says how that compares with the machine's memory, and refuses to
start where the offloaded run itself (about 6 bytes per parameter) would not fit.

Per iteration: the loss, the iteration's wall time, the step's (on the optimizer thread), the
step's disk rate (bytes read and written over the step's time) and the peak RSS so far per
parameter (over the zero point after torch's first-use costs, as ``optim_offload.py`` takes it).

    python benchmarks/beyond_ram.py --params 3G --folder /nvme/scratch --record
"""

from __future__ import annotations

import argparse
import tempfile
import time

import torch
from results import Output, meminfo, parse_count, pay_first_use_costs, peak_rss, rss, write_result


class Residual(torch.nn.Module):
    """``x + Linear(x)``, the branch initialised small: deep stacks keep their signal's scale,
    so the loss moves from the first step."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(width, width, bias=False, dtype=torch.bfloat16)
        with torch.no_grad():
            self.linear.weight.mul_(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(x)


def in_memory_bytes(state_dtype: torch.dtype, is_async: bool) -> float:
    """Bytes per parameter of the same training with the state in memory: bf16 weights and
    gradients (a second gradient arena with asynchronous steps: one fills while the step reads
    the other), fp32 copies, two moments (and their block scales)."""
    moment = {torch.float32: 4.0, torch.bfloat16: 2.0, torch.int8: 1.0 + 4 / 256}[state_dtype]
    return 2 + 2 + 4 + 2 * moment + (2 if is_async else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="3G", help="model size (suffixes K, M, G)")
    parser.add_argument("--width", type=int, default=8192)
    parser.add_argument("--rows", type=int, default=2, help="batch rows")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--iters", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument("--state-dtype", default="int8", choices=["float32", "bfloat16", "int8"])
    parser.add_argument("--sync", action="store_true", help="synchronous steps")
    parser.add_argument("--folder", default=None, help="offload folder (default: a temp dir)")
    parser.add_argument("--record", action="store_true", help="write results/beyond_ram.md")
    args = parser.parse_args()

    import roundpipe
    from roundpipe import RoundPipe, RoundPipeRunConfig
    from roundpipe.optim.offload import store_of

    out = Output()
    state_dtype = getattr(torch, args.state_dtype)
    is_async = not args.sync
    layers = max(1, round(parse_count(args.params) / args.width**2))
    params = layers * args.width**2
    total, available = meminfo("MemTotal"), meminfo("MemAvailable")
    in_memory = in_memory_bytes(state_dtype, is_async) * params
    offloaded = (6 if is_async else 4) * params
    out(
        f"{params / 1e9:.2f}B parameters ({layers} blocks of {args.width} x {args.width}), "
        f"bf16 weights, fp32 copies and {args.state_dtype} Adam state on disk, "
        f"{'asynchronous' if is_async else 'synchronous'} steps; this machine: "
        f"{total / 2**30:.1f} GiB of memory. In memory the state would take "
        f"{in_memory / 2**30:.1f} GiB ({in_memory / params:.2f} B/param): "
        f"{'more than' if in_memory > total else 'within'} the machine's memory."
    )
    if offloaded > 0.9 * available:
        raise SystemExit(
            f"even offloaded, {params / 1e9:.2f}B parameters need about {offloaded / 2**30:.1f} "
            f"GiB of the {available / 2**30:.1f} GiB available: give a smaller --params"
        )

    roundpipe.configure_devices(kind="cpu", num_cpu_devices=2)
    pay_first_use_costs(torch.bfloat16)
    zero = rss()

    torch.manual_seed(0)
    start = time.perf_counter()
    net = torch.nn.Sequential(*[Residual(args.width) for _ in range(layers)])
    folder = args.folder or tempfile.mkdtemp(prefix="rp-beyond-ram-")
    model = RoundPipe(net, optim_dtype=torch.float32, optim_offload=folder)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=args.lr, state_dtype=state_dtype)
    store = store_of(next(iter(model.optim_parameters())))
    assert store is not None
    out(
        f"built in {time.perf_counter() - start:.0f} s (the copies written to {folder}); "
        f"peak RSS so far {(peak_rss() - zero) / params:.2f} B/param"
    )

    steps: list[tuple[float, int]] = []

    def step_fn() -> None:
        begin = time.perf_counter()
        optimizer.step()
        seconds = time.perf_counter() - begin
        optimizer.zero_grad()
        steps.append((seconds, store.last_stats[0] + store.last_stats[1]))

    config = RoundPipeRunConfig(num_microbatch=args.microbatches)
    x = torch.randn(args.rows, args.width, dtype=torch.bfloat16)
    target = torch.randn(args.rows, args.width)
    out()
    out("| iteration | loss | iteration s | step s | disk GB/s | peak RSS B/param |")
    out("|---|---|---|---|---|---|")
    losses: list[float] = []
    for iteration in range(args.iters):
        begin = time.perf_counter()
        loss = model.forward_backward(
            input_args=(x,),
            label=target,
            loss_fn=lambda o, t: ((o.float() - t) ** 2).mean(),
            run_config=config,
        )
        model.step(step_fn, is_async)
        if iteration == args.iters - 1:
            model.synchronize()  # the last step's figures, for its row
        seconds = time.perf_counter() - begin
        losses.append(float(loss))
        if len(steps) > iteration:  # this iteration's step has finished
            step_seconds, nbytes = steps[iteration]
            out(
                f"| {iteration} | {losses[-1]:.4f} | {seconds:.1f} | {step_seconds:.1f} | "
                f"{nbytes / step_seconds / 1e9:.2f} | {(peak_rss() - zero) / params:.2f} |"
            )
        else:  # asynchronous: printed with the next one
            out(
                f"| {iteration} | {losses[-1]:.4f} | {seconds:.1f} | (in flight) | | "
                f"{(peak_rss() - zero) / params:.2f} |"
            )
    out()
    out(
        "steps (s, disk GB/s): "
        + ", ".join(f"{seconds:.1f} s at {nbytes / seconds / 1e9:.2f}" for seconds, nbytes in steps)
    )
    out(
        f"peak RSS {(peak_rss() - zero) / 2**30:.1f} GiB = {(peak_rss() - zero) / params:.2f} "
        f"B/param (in memory: {in_memory / 2**30:.1f} GiB); loss {losses[0]:.4f} -> "
        f"{losses[-1]:.4f}"
    )
    if args.record:
        path = write_result(
            "beyond_ram.py",
            "Training past the host's memory: optimizer state streamed from disk",
            f"roundpipe {roundpipe.__version__}",
            out.text(),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
