"""The optimizer side of one training iteration, through the runtime: ``model.step(step_fn)``.

An fp16 model with fp32 optimizer copies and a ``roundpipe.GradScaler`` (the case with the most
host work per parameter): the gradients in the model's fp16 arena go to the copies, are unscaled
and checked for inf/NaN, Adam updates the copies, and the new fp16 weights are written back into
the parameter arena. Timed: ``model.step(step_fn, is_async=False)`` from call to return, the
``forward_backward`` that produces the gradients is not. Variants, each on a model of its own,
taking turns (the fastest step counts):

* fused: ``scaler.step(roundpipe.optim.Adam)``: a read-only inf/NaN check of the fp16 gradients,
  then one pass that reads them from the arena, unscales, updates and writes fp16 weights;
* ``scaler.unscale_`` first, then our Adam: the gradients are cast into fp32 ``.grad`` and
  unscaled in place (what a ``step_fn`` that clips gradients does), then the same Adam pass;
* torch's Adam (``fused=True`` and ``foreach=True``) behind the same GradScaler calls.

Run from the repository root: ``python benchmarks/step_cpu.py [--params 100M] [--record]``
(``--record`` rewrites ``results/step_cpu.md``).
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import roundpipe
import torch
from results import parse_count, write_result
from roundpipe import GradScaler, RoundPipe, RoundPipeRunConfig
from torch import nn

WIDTH = 2048


Variant = tuple[Callable[[list[nn.Parameter]], torch.optim.Optimizer], bool]

VARIANTS: dict[str, Variant] = {
    "fused: GradScaler.step + roundpipe.optim.Adam": (roundpipe.optim.Adam, False),
    "unscale_ (cast .grad) + roundpipe.optim.Adam": (roundpipe.optim.Adam, True),
    "unscale_ + torch.optim.Adam fused=True": (lambda p: torch.optim.Adam(p, fused=True), True),
    "unscale_ + torch.optim.Adam foreach=True": (
        lambda p: torch.optim.Adam(p, foreach=True),
        True,
    ),
}


def make_turn(total: int, variant: Variant, steps: int) -> Callable[[], float]:
    """A fresh model and optimizer for ``variant``, and its turn: ``steps`` iterations, returning
    the fastest ``model.step``. The first turn's first step (state allocation) is not counted."""
    factory, unscale_first = variant
    layers = max(1, total // (WIDTH * WIDTH))
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(layers)]).half()
    model = RoundPipe(net, optim_dtype=torch.float32)
    optimizer = factory(list(model.optim_parameters()))
    scaler = GradScaler(init_scale=2.0**8)
    config = RoundPipeRunConfig(num_microbatch=1)
    x = torch.randn(2, WIDTH).half()

    def step_fn() -> None:
        if unscale_first:
            scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()

    def loss_fn(output: torch.Tensor, _: object) -> torch.Tensor:
        return scaler.scale(output.float().square().mean())

    def iteration() -> float:
        model.forward_backward(input_args=(x,), loss_fn=loss_fn, run_config=config)
        start = time.perf_counter()
        model.step(step_fn, is_async=False)
        return time.perf_counter() - start

    iteration()
    return lambda: min(iteration() for _ in range(steps))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="25M", help="comma-separated model sizes")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per turn")
    parser.add_argument(
        "--rounds", type=int, default=3, help="turns each variant takes (fastest step reported)"
    )
    parser.add_argument("--record", action="store_true", help="write results/step_cpu.md")
    args = parser.parse_args()

    lines = [
        f"threads {torch.get_num_threads()}, variants take {args.rounds} turns of {args.steps} "
        "steps, fastest step reported",
        "",
    ]
    printed = 0
    for total in map(parse_count, args.params.split(",")):
        total = max(1, total // (WIDTH * WIDTH)) * WIDTH * WIDTH
        # The variants take turns, so a busy moment of a shared machine slows all of them.
        turns = {name: make_turn(total, v, args.steps) for name, v in VARIANTS.items()}
        seconds = dict.fromkeys(turns, float("inf"))
        for _ in range(args.rounds):
            for name, turn in turns.items():
                seconds[name] = min(seconds[name], turn())
        del turns
        gc.collect()  # the models' arenas and optimizer state
        fused = seconds["fused: GradScaler.step + roundpipe.optim.Adam"]
        lines += [
            f"### {total:,} fp16 parameters, fp32 copies: `model.step` (sync) with GradScaler",
            "",
            "| step_fn | ms | Mparams/s | fused is x faster |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {name} | {1e3 * s:.0f} | {total / s / 1e6:.0f} | {s / fused:.2f} |"
            for name, s in seconds.items()
        ]
        lines.append("")
        print("\n".join(lines[printed:]), flush=True)
        printed = len(lines)

    if args.record:
        path = write_result(
            "step_cpu.py",
            "model.step of an fp16 model with GradScaler: fused host path against unfused",
            f"roundpipe {roundpipe._C.build_info()['version']}",
            "\n".join(lines),
        )
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
