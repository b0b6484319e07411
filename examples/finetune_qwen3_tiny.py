"""Fine-tune a small, randomly initialised Qwen3-style model with RoundPipe.

The config is built here (no downloads) and the data is synthetic: sequences that count up
from a random start, so the loss visibly falls within a few dozen steps. The progress bar shows
the loss and the training throughput in tokens per second.

    .venv/bin/python examples/finetune_qwen3_tiny.py --steps 30
    .venv/bin/python examples/finetune_qwen3_tiny.py --loss-chunk-size 256  # no full logits
"""

from __future__ import annotations

import argparse
import time

import roundpipe
import torch
from roundpipe import RoundPipeRunConfig, wrap_model_to_roundpipe
from tqdm import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--num-microbatch", type=int, default=None)
    parser.add_argument("--loss-chunk-size", type=int, default=None)
    parser.add_argument("--bf16", action="store_true", help="bf16 model, fp32 optimizer copies")
    return parser.parse_args()


def tiny_qwen3(args: argparse.Namespace) -> Qwen3ForCausalLM:
    config = Qwen3Config(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=args.hidden // 4,
        max_position_embeddings=4 * args.seq_len,
        tie_word_embeddings=False,  # RoundPipe layers cannot share parameters yet
    )
    return Qwen3ForCausalLM(config)


def counting_batch(args: argparse.Namespace) -> dict[str, torch.Tensor]:
    """Sequences start, start + 1, ... (mod vocab): next-token prediction is learnable."""
    starts = torch.randint(0, args.vocab, (args.batch_size, 1))
    input_ids = (starts + torch.arange(args.seq_len)) % args.vocab
    return {"input_ids": input_ids, "labels": input_ids.clone()}


def main() -> None:
    args = parse_args()
    torch.manual_seed(0)
    model = tiny_qwen3(args)
    optim_dtype = None
    if args.bf16:
        model = model.to(torch.bfloat16)
        optim_dtype = torch.float32
    wrapped = wrap_model_to_roundpipe(
        model,
        optim_dtype=optim_dtype,
        loss_chunk_size=args.loss_chunk_size,
        model_run_config=RoundPipeRunConfig(num_microbatch=args.num_microbatch),
    )
    optimizer = torch.optim.AdamW(wrapped.optim_parameters(), lr=args.lr)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    print(
        f"roundpipe {roundpipe.__version__}: {roundpipe.device_count()} x "
        f"{roundpipe.device_kind()} device(s), {len(wrapped.layers)} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters"
    )
    tokens_per_step = args.batch_size * args.seq_len
    progress = tqdm(range(args.steps), desc="fine-tune", unit="step")
    start = time.perf_counter()
    for step in progress:
        loss = wrapped.forward_backward(
            input_kwargs=counting_batch(args), loss_fn=lambda output, _: output.loss
        )
        wrapped.step(step_fn)
        rate = tokens_per_step * (step + 1) / (time.perf_counter() - start)
        progress.set_postfix(loss=f"{loss.item():.4f}", tokens_per_s=f"{rate:,.0f}")
    wrapped.synchronize()
    elapsed = time.perf_counter() - start
    print(
        f"done: {args.steps} steps in {elapsed:.1f} s, "
        f"{tokens_per_step * args.steps / elapsed:,.0f} tokens/s, final loss {loss.item():.4f}"
    )


if __name__ == "__main__":
    main()
