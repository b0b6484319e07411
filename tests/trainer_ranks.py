"""One rank of tests/test_trainer.py's data-parallel case (run by torchrun, never collected):
trains the tiny Qwen3 of that file with ``RoundPipeTrainer`` or plain ``Trainer`` (argv[2])
on the global batch of 2 ranks and writes rank 0's per-step logs to argv[1]."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).parent))

from roundpipe.integrations.transformers import RoundPipeTrainer
from test_trainer import arguments, dataset, step_logs, tiny_qwen3
from transformers import Trainer


def main() -> None:
    out, which = Path(sys.argv[1]), sys.argv[2]
    args = arguments(out / which, ddp_backend="gloo")
    if which == "roundpipe":
        trainer: Trainer = RoundPipeTrainer(
            tiny_qwen3(), args, train_dataset=dataset(), async_step=False
        )
    else:
        trainer = Trainer(model=tiny_qwen3(), args=args, train_dataset=dataset())
    trainer.train()
    if dist.get_rank() == 0:
        (out / f"{which}.json").write_text(json.dumps(step_logs(trainer)))
    dist.barrier()
    # Leave without the interpreter's teardown: with torch 2.11 the process group's gloo
    # threads sometimes abort the exit of plain Trainer's ranks ("terminate called without an
    # active exception") after everything was written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
