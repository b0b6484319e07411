"""Convergence with compact Adam state: the same model trained from the same start on
the same batches by ``roundpipe.optim.Adam`` with ``state_dtype`` fp32, bf16 and int8, beside
``torch.optim.Adam`` (the baseline; ours with fp32 state should match it), final losses and
their ratios to fp32's.

* ``mlp``: regression of a fixed random teacher network (32 -> 128 -> 8, tanh) by a wider
  student (32 -> 256 -> 256 -> 8, GELU), fresh batches of 128 each step, 400 steps at lr 1e-3;
  the final loss is the mean squared error on 4,096 held-out inputs.
* ``lm``: a tiny causal LM built from a transformers ``LlamaConfig`` (2 layers, width 128,
  vocabulary 32; no download) on synthetic text from a fixed order-2 Markov chain (every pair of
  tokens has 4 possible successors, probabilities 0.6/0.2/0.1/0.1, so the loss cannot go below
  the chain's entropy, printed beside it), fresh batches of 16 x 64 tokens, 300 steps at lr 1e-3;
  the final loss is the cross entropy on 32 held-out sequences.

Each seed gives every optimizer the same initial weights and batches; a ratio is that seed's
final loss over fp32's. Targets: int8 within 5% of fp32, bf16 within 2%.

    python benchmarks/adam_state_convergence.py [--seeds 3] [--lm-seeds 1] [--record]
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import roundpipe
import roundpipe.optim
import torch
from results import write_result

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "torch.optim.Adam (baseline)": torch.optim.Adam,
    "ours, state_dtype=float32": roundpipe.optim.Adam,
    "ours, state_dtype=bfloat16": lambda p, lr: roundpipe.optim.Adam(
        p, lr=lr, state_dtype=torch.bfloat16
    ),
    "ours, state_dtype=int8": lambda p, lr: roundpipe.optim.Adam(p, lr=lr, state_dtype=torch.int8),
}
REFERENCE = "ours, state_dtype=float32"
# Largest ratio of final losses to fp32's that each compact state is meant to stay within.
TARGETS = {"ours, state_dtype=bfloat16": 1.02, "ours, state_dtype=int8": 1.05}


@dataclass
class Task:
    """A model factory, a batch source and a held-out loss, all deterministic given the seed."""

    model: Callable[[], torch.nn.Module]
    loss: Callable[[torch.nn.Module, object], torch.Tensor]
    batch: Callable[[torch.Generator], object]
    held_out: object
    steps: int
    lr: float
    floor: str = ""


def mlp_task(seed: int, steps: int) -> Task:
    torch.manual_seed(10_000 + seed)
    teacher = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 8)
    ).requires_grad_(False)

    def batch(generator: torch.Generator, rows: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(rows, 32, generator=generator)
        return x, teacher(x)

    def model() -> torch.nn.Module:
        torch.manual_seed(seed)
        return torch.nn.Sequential(
            torch.nn.Linear(32, 256),
            torch.nn.GELU(),
            torch.nn.Linear(256, 256),
            torch.nn.GELU(),
            torch.nn.Linear(256, 8),
        )

    def loss(net: torch.nn.Module, xy: object) -> torch.Tensor:
        x, y = xy  # type: ignore[misc]
        return torch.nn.functional.mse_loss(net(x), y)

    return Task(
        model, loss, batch, batch(torch.Generator().manual_seed(-1 - seed), 4096), steps, 1e-3
    )


VOCAB, SUCCESSORS, PROBS = 32, 4, (0.6, 0.2, 0.1, 0.1)


def lm_task(seed: int, steps: int) -> Task:
    from transformers import LlamaConfig, LlamaForCausalLM

    chain = torch.Generator().manual_seed(20_000 + seed)
    # successors[a, b] = the 4 tokens that may follow "a b", in order of probability.
    successors = torch.stack(
        [torch.randperm(VOCAB, generator=chain)[:SUCCESSORS] for _ in range(VOCAB * VOCAB)]
    ).view(VOCAB, VOCAB, SUCCESSORS)
    probs = torch.tensor(PROBS)
    entropy = -sum(p * math.log(p) for p in PROBS)

    def batch(generator: torch.Generator, rows: int = 16, length: int = 64) -> torch.Tensor:
        tokens = torch.empty(rows, length, dtype=torch.long)
        tokens[:, :2] = torch.randint(VOCAB, (rows, 2), generator=generator)
        for t in range(2, length):
            pick = torch.multinomial(probs.expand(rows, -1), 1, generator=generator).squeeze(1)
            tokens[:, t] = successors[tokens[:, t - 2], tokens[:, t - 1], pick]
        return tokens

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )

    def model() -> torch.nn.Module:
        torch.manual_seed(seed)
        return LlamaForCausalLM(config)

    def loss(net: torch.nn.Module, tokens: object) -> torch.Tensor:
        return net(input_ids=tokens, labels=tokens).loss  # type: ignore[no-any-return]

    return Task(
        model,
        loss,
        batch,
        batch(torch.Generator().manual_seed(-1 - seed), 32),
        steps,
        1e-3,
        floor=f"the chain's entropy: {entropy:.3f} nats (predicting tokens 3 onwards)",
    )


def train(task: Task, make_optimizer: Callable[..., torch.optim.Optimizer], seed: int) -> float:
    """The held-out loss after ``task.steps`` steps."""
    net = task.model()
    optimizer = make_optimizer(net.parameters(), lr=task.lr)
    generator = torch.Generator().manual_seed(seed)
    for _ in range(task.steps):
        loss = task.loss(net, task.batch(generator))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        return float(task.loss(net, task.held_out))


def run(name: str, make_task: Callable[[int, int], Task], seeds: int, steps: int) -> list[str]:
    finals: dict[str, list[float]] = {key: [] for key in OPTIMIZERS}
    start = time.perf_counter()
    floor = ""
    for seed in range(seeds):
        task = make_task(seed, steps)
        floor = task.floor
        for key, make in OPTIMIZERS.items():
            finals[key].append(train(task, make, seed))
    lines = [
        f"### {name}: {steps} steps, lr {task.lr:g}, {seeds} seed(s) "
        f"({time.perf_counter() - start:.0f} s)",
        "",
        "| optimizer | final loss per seed | ratio to fp32 (mean) | ratio (worst seed) "
        "| target | met |",
        "|---|---|---:|---:|---:|---|",
    ]
    for key, losses in finals.items():
        ratios = [a / b for a, b in zip(losses, finals[REFERENCE], strict=True)]
        target = TARGETS.get(key)
        worst = max(ratios)
        lines.append(
            f"| {key} | {', '.join(f'{v:.5g}' for v in losses)} | "
            f"{statistics.mean(ratios):.4f} | {worst:.4f} | "
            + (f"<= {target:.2f} | {'yes' if worst <= target else 'NO'} |" if target else "| |")
        )
    if floor:
        lines += ["", f"Lower bound: {floor}."]
    lines.append("")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="mlp,lm", help="comma-separated: mlp, lm")
    parser.add_argument("--seeds", type=int, default=3, help="seeds of the MLP regression")
    parser.add_argument("--lm-seeds", type=int, default=1, help="seeds of the causal LM")
    parser.add_argument("--mlp-steps", type=int, default=400)
    parser.add_argument("--lm-steps", type=int, default=300)
    parser.add_argument(
        "--record", action="store_true", help="write results/adam_state_convergence.md"
    )
    args = parser.parse_args()

    lines = [f"torch threads {torch.get_num_threads()}", ""]
    print("\n".join(lines), flush=True)
    chosen = args.tasks.split(",")
    if "mlp" in chosen:
        part = run("MLP regression", mlp_task, args.seeds, args.mlp_steps)
        print("\n".join(part), flush=True)
        lines += part
    if "lm" in chosen:
        part = run(
            "tiny Llama causal LM, order-2 Markov text", lm_task, args.lm_seeds, args.lm_steps
        )
        print("\n".join(part), flush=True)
        lines += part
    if args.record:
        import transformers

        path = write_result(
            "adam_state_convergence.py",
            "Convergence with compact Adam state",
            f"roundpipe {roundpipe.__version__}, transformers {transformers.__version__}",
            "\n".join(lines),
        )
        print(f"written to {path}")


if __name__ == "__main__":
    main()
