"""LoRA fine-tuning with PEFT and RoundPipe: frozen base weights, trainable adapters.

The base model stays in pageable host memory (``pin_model="off"``, which also suits weights
loaded with mmap); only the adapters get gradients and optimizer copies. The PEFT wrapper stays
the user-facing model: ``save_pretrained`` on the RoundPipe saves just the adapters.

    .venv/bin/python examples/lora.py --steps 20 --out /tmp/lora-adapter
"""

from __future__ import annotations

import argparse

import torch
from peft import LoraConfig, get_peft_model
from roundpipe import wrap_model_to_roundpipe
from tqdm import tqdm
from transformers import Qwen3Config, Qwen3ForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--out", default=None, help="folder to save the adapter into")
    args = parser.parse_args()

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=False,
    )
    lora = LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(Qwen3ForCausalLM(config), lora)
    model.print_trainable_parameters()
    wrapped = wrap_model_to_roundpipe(model, pin_model="off")
    optimizer = torch.optim.AdamW(wrapped.optim_parameters(), lr=1e-2)

    def step_fn() -> None:
        optimizer.step()
        optimizer.zero_grad()

    progress = tqdm(range(args.steps), desc="lora", unit="step")
    for _ in progress:
        starts = torch.randint(0, config.vocab_size, (8, 1))
        input_ids = (starts + torch.arange(32)) % config.vocab_size
        loss = wrapped.forward_backward(
            input_kwargs={"input_ids": input_ids, "labels": input_ids},
            loss_fn=lambda output, _: output.loss,
        )
        wrapped.step(step_fn)
        progress.set_postfix(loss=f"{loss.item():.4f}")
    wrapped.synchronize()
    if args.out:
        wrapped.save_pretrained(args.out)  # the PEFT model's: adapter weights only
        print(f"adapter saved to {args.out}")


if __name__ == "__main__":
    main()
