"""One rank of tests/test_trainer.py's data-parallel cases (run by torchrun, never collected):
trains the tiny Qwen3 of that file with ``RoundPipeTrainer`` or plain ``Trainer`` (argv[2])
on the global batch of 2 ranks and writes rank 0's per-step logs to argv[1]; or ("checkpoint")
trains asynchronously for 6 steps with checkpoint-3 and for 3 steps, saving the model."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from roundpipe.integrations.transformers import RoundPipeTrainer
from test_trainer import arguments, dataset, step_logs, tiny_qwen3
from transformers import Trainer


def main() -> None:
    out, which = Path(sys.argv[1]), sys.argv[2]
    args = arguments(out / which, ddp_backend="gloo")
    if which == "checkpoint":
        checkpoints(out)
        leave()
    if which == "roundpipe":
        trainer: Trainer = RoundPipeTrainer(
            tiny_qwen3(), args, train_dataset=dataset(), async_step=False
        )
    else:
        trainer = Trainer(model=tiny_qwen3(), args=args, train_dataset=dataset())
    trainer.train()
    if dist.get_rank() == 0:
        (out / f"{which}.json").write_text(json.dumps(step_logs(trainer)))
    leave()


def checkpoints(out: Path) -> None:
    """checkpoint-3 of a 6-step run (asynchronous steps, so step 3 is in flight when it is
    written, and each rank holds a piece of its weights) and the model after a 3-step run.
    Untied embeddings: with data parallelism the gradient of a tied weight differs in its last
    bits from one run to the next (seen on embed_tokens, 4e-9 after 3 steps)."""
    for steps, folder, save in ((6, "saving", "steps"), (3, "short", "no")):
        args = arguments(
            out / folder,
            ddp_backend="gloo",
            max_steps=steps,
            save_strategy=save,
            save_steps=3,
            lr_scheduler_type="constant_with_warmup",
        )
        trainer = RoundPipeTrainer(tiny_qwen3(tied=False), args, train_dataset=dataset(96))
        trainer.train()
    trainer.save_model(str(out / "short_files"))


def leave() -> NoReturn:
    dist.barrier()
    # Leave without the interpreter's teardown: with torch 2.11 the process group's gloo
    # threads sometimes abort the exit of plain Trainer's ranks ("terminate called without an
    # active exception") after everything was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
