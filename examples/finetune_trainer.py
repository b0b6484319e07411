"""The main job: a small causal LM learns to add, through Hugging Face's Trainer on RoundPipe.

A Qwen3-style model is built from a config (no download) and trained with
``RoundPipeTrainer`` on text such as ``"07+85=290"``: every number has its full width of digits
(the sum one more), the sum is written least significant digit first (092 reversed), as one
adds by hand, and the loss counts only the answer's characters, so the model must learn to add,
carries included, not just to copy digits. The
model's state (weights, gradients, fp32 optimizer copies, Adam moments) lives in host memory;
each batch streams the layers through the device pool (the GPU, or virtual CPU devices), and the
optimizer steps on a host thread while the next batch trains. At the end it writes two pictures
and prints their paths: the loss curve and the schedule of one training iteration in the middle
of training, with its optimizer update beside the next iteration (a RoundPipe trace drawn with
``roundpipe.plot``; guide §11 explains its figures), answers a few sums and, with a GPU, says
how much larger than the GPU's memory a model trained this way could be.

    .venv/bin/python examples/finetune_trainer.py           # 2 to 3 minutes on 2 CPU cores
    .venv/bin/python examples/finetune_trainer.py --help    # steps, learning rate, digits, size

How many of the twenty sums at the end come out right depends on when the model finds the
carries: 15 with the defaults on a 2-core CPU machine, fewer with a learning rate a little
lower or higher (the step in the loss curve is that moment).
"""

from __future__ import annotations

import argparse
import os
import random
import time
from typing import Any

import roundpipe
import torch
from roundpipe import RoundPipeRunConfig
from roundpipe.integrations.transformers import RoundPipeTrainer
from transformers import (
    Qwen3Config,
    Qwen3ForCausalLM,
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

CHARS = "0123456789+=\n"  # one token per character; the newline ends an answer
PAD = len(CHARS)
TOKEN = {c: i for i, c in enumerate(CHARS)}


def sum_prompt(a: int, b: int, digits: int) -> str:
    """``a+b=`` with both numbers written with ``digits`` digits."""
    return f"{a:0{digits}d}+{b:0{digits}d}="


def sum_answer(a: int, b: int, digits: int) -> str:
    """``a + b`` with ``digits + 1`` digits, least significant first."""
    return f"{a + b:0{digits + 1}d}"[::-1]


def encode(text: str) -> list[int]:
    return [TOKEN[c] for c in text]


def decode(ids: list[int]) -> str:
    return "".join(CHARS[i] for i in ids if i < len(CHARS))


class Sums(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``a+b=c`` lines (``c`` reversed), padded to one length; labels only on ``c`` and the
    newline after it."""

    def __init__(self, count: int, seed: int, digits: int) -> None:
        rng = random.Random(seed)
        top = 10**digits
        self.digits = digits
        self.length = 2 * digits + 2 + digits + 2
        self.rows = [(rng.randrange(top), rng.randrange(top)) for _ in range(count)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        a, b = self.rows[index]
        prompt = encode(sum_prompt(a, b, self.digits))
        answer = encode(sum_answer(a, b, self.digits) + "\n")
        ids = prompt + answer
        pad = self.length - len(ids)
        labels = [-100] * len(prompt) + answer + [-100] * pad
        mask = [1] * len(ids) + [0] * pad
        return {
            "input_ids": torch.tensor(ids + [PAD] * pad),
            "attention_mask": torch.tensor(mask),
            "labels": torch.tensor(labels),
        }


class TraceStepAndNext(TrainerCallback):
    """Records the RoundPipe schedule of one training step in the middle of training and of the
    next one's forward and backward: the picture shows the step's optimizer update running on
    the host beside the next iteration, as it does throughout training.

    The recording ends just before the next step's update is queued, after waiting for the
    traced update (which that queueing would wait for anyway; the weights are not published, so
    the training is unchanged). The traced step is one that is neither logged nor evaluated:
    logging reads the update's gradient norm, so it waits for the update before going on."""

    def __init__(self, step: int, path: str, model: roundpipe.RoundPipe) -> None:
        self.step, self.path, self.model = step, path, model
        self.recording: Any = None

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if state.global_step == self.step - 1:
            self.recording = roundpipe.trace(self.path)
            self.recording.__enter__()

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.recording is not None and state.global_step == self.step:  # the next step's
            self.end()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **_: Any
    ) -> None:
        if self.recording is not None:  # no next step: the update alone
            self.end()

    def end(self) -> None:
        self.model.wait_for_step()
        self.recording.__exit__(None, None, None)
        self.recording = None


def traced_step(args: argparse.Namespace, logging_steps: int, eval_steps: int) -> int:
    """The middle step, or the first after it that is neither logged nor evaluated."""
    step = max(1, args.steps // 2)
    while step < args.steps - 1 and (step % logging_steps == 0 or step % eval_steps == 0):
        step += 1
    return step


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--digits", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-microbatch", type=int, default=None)
    parser.add_argument("--out", default="finetune_trainer_out", help="checkpoints and pictures")
    return parser.parse_args()


def build_model(args: argparse.Namespace) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=len(CHARS) + 1,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=PAD,
        eos_token_id=TOKEN["\n"],
        bos_token_id=TOKEN["\n"],
    )
    return Qwen3ForCausalLM(config)


def plot_losses(log_history: list[dict[str, float]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e]
    figure, axes = plt.subplots(figsize=(7, 4))
    axes.plot(*zip(*train, strict=True), label="training loss (answer tokens)")
    if evals:
        axes.plot(*zip(*evals, strict=True), "o-", label="evaluation loss")
    axes.set_xlabel("optimizer step")
    axes.set_ylabel("cross-entropy")
    axes.set_yscale("log")
    axes.set_title("RoundPipeTrainer: a small Qwen3 learns to add")
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def answer(model: Qwen3ForCausalLM, a: int, b: int, digits: int) -> str:
    """The model's greedy answer to ``a+b=``, as it writes it (least significant digit first)."""
    ids = torch.tensor([encode(sum_prompt(a, b, digits))])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=digits + 2, do_sample=False, pad_token_id=PAD)
    return decode(out[0, ids.shape[1] :].tolist()).split("\n")[0]


def host_state_report(trainer: RoundPipeTrainer, parameters: int) -> str:
    """Measured host bytes per parameter, and what they mean next to the GPU's memory."""
    optimizer = trainer.optimizer.optimizer  # type: ignore[union-attr]
    model_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    state_bytes = sum(
        t.numel() * t.element_size()
        for group in optimizer.param_groups
        for p in group["params"]
        for t in [p, *optimizer.state[p].values()]
        if isinstance(t, torch.Tensor) and t.dim() > 0
    )
    per_parameter = (2 * model_bytes + state_bytes) / parameters  # weights, gradients, optimizer
    line = f"host state: {per_parameter:.0f} bytes/parameter (weights, gradients, optimizer)"
    if not torch.cuda.is_available():
        return line + "; no GPU here: the device pool was virtual CPU devices"
    gpu = torch.cuda.get_device_properties(0).total_memory
    peak = torch.cuda.max_memory_allocated(0)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    largest = ram / per_parameter
    weights = largest * model_bytes / parameters
    return (
        f"{line}; the GPU held at most {peak / 2**20:.0f} MiB of its {gpu / 2**30:.0f} GiB.\n"
        f"With this machine's {ram / 2**30:.0f} GiB of host memory, RoundPipe could train about "
        f"{largest / 1e9:.1f}B parameters this way: weights alone {weights / gpu:.1f}x the GPU's "
        f"memory, state {ram / gpu:.1f}x (plain PyTorch keeps all {per_parameter:.0f} bytes/"
        f"parameter on the GPU: at most {gpu / per_parameter / 1e9:.2f}B parameters)"
    )


def main() -> None:
    args = parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    model = build_model(args)
    parameters = sum(p.numel() for p in model.parameters())
    print(
        f"roundpipe {roundpipe.__version__}: {roundpipe.device_count()} x "
        f"{roundpipe.device_kind()} device(s); a {parameters / 1e6:.2f}M-parameter Qwen3 learns "
        f"{args.digits}-digit addition"
    )
    training = TrainingArguments(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=64,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=args.steps // 20,
        weight_decay=0.01,
        logging_steps=max(1, args.steps // 30),
        eval_strategy="steps",
        eval_steps=max(1, args.steps // 5),
        save_strategy="no",
        report_to="none",
        use_cpu=not torch.cuda.is_available(),
        dataloader_num_workers=0,
        seed=0,
    )
    trace_path = os.path.join(args.out, "iteration.json")
    trainer = RoundPipeTrainer(
        model,
        training,
        train_dataset=Sums(args.steps * args.batch_size, seed=1, digits=args.digits),
        eval_dataset=Sums(256, seed=2, digits=args.digits),
        run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
    )
    assert isinstance(trainer.roundpipe_model, roundpipe.RoundPipe)  # Qwen3 has a preset
    traced = traced_step(args, training.logging_steps, training.eval_steps)
    trainer.add_callback(TraceStepAndNext(traced, trace_path, trainer.roundpipe_model))
    start = time.perf_counter()
    trainer.train()
    elapsed = time.perf_counter() - start

    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(f"{args.steps} steps in {elapsed:.0f} s: loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    rng = random.Random(3)
    top = 10**args.digits
    trials = [(rng.randrange(top), rng.randrange(top)) for _ in range(20)]
    right = sum(
        answer(model, a, b, args.digits) == sum_answer(a, b, args.digits) for a, b in trials
    )
    a, b = trials[0]
    said = answer(model, a, b, args.digits)[::-1].lstrip("0") or "0"
    print(f"{a} + {b} = {said}, says the model ({right}/20 sums right)")
    print(host_state_report(trainer, parameters))

    from roundpipe.timeline.plot import plot_trace

    loss_png = os.path.join(args.out, "loss.png")
    schedule_png = os.path.join(args.out, "iteration.png")
    plot_losses(trainer.state.log_history, loss_png)
    plot_trace(
        trace_path,
        schedule_png,
        title=f"training step {traced} of {args.steps}, then the next one's forward and backward",
    )
    print(f"loss curve: {loss_png}\nschedule of one iteration: {schedule_png}")
    if not losses[-1] < 0.7 * losses[0]:
        raise SystemExit("the loss did not fall by 30%: something is wrong")


if __name__ == "__main__":
    main()
