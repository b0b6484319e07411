"""One process of a data-parallel test (run by tests/test_distributed.py, never collected).

``python tests/dp_worker.py CONFIG_JSON``: trains a small model for a few iterations on the rank's
part of a fixed global batch and saves what the test compares to ``out``: the parameters, the
optimizer copies reassembled from the rank's shard pieces, the clipped norms and GradScaler
scales. ``world == 0`` is the reference: one process without torch.distributed on the whole batch.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import roundpipe
import roundpipe.distributed
import roundpipe.models
import torch
import torch.distributed as dist
from torch import nn

GLOBAL_BATCH = 12
ITERATIONS = 4


VOCAB = 64


def tied_lm() -> nn.Sequential:
    """A causal-LM-shaped model whose output layer is its embedding (tied weights): with 3
    ranks the embedding's second use spans a whole shard of the gradient arena."""
    embedding = nn.Embedding(VOCAB, 8)
    head = nn.Linear(8, VOCAB, bias=False)
    head.weight = embedding.weight
    return nn.Sequential(embedding, nn.Linear(8, 8), nn.Tanh(), nn.LayerNorm(8), head)


def build(cfg: dict[str, Any], rank: int) -> nn.Sequential:
    # "seed": rank 1 builds its replica from another seed; rank 0's weights are broadcast.
    torch.manual_seed(rank if cfg["scenario"] == "seed" else 0)
    if cfg["scenario"] == "tied":
        return tied_lm().double()
    if cfg["scenario"] in ("batchnorm", "buffer_mismatch", "buffer_shape"):
        # "buffer_mismatch": rank 1 keeps no running statistics; "buffer_shape": a buffer of
        # another size on rank 1.
        tracked = not (cfg["scenario"] == "buffer_mismatch" and rank == 1)
        norm = nn.BatchNorm1d(10, track_running_stats=tracked)
        if cfg["scenario"] == "buffer_shape":
            norm.register_buffer("extra", torch.ones(4 + rank))
        return nn.Sequential(nn.Linear(6, 10), norm, nn.Tanh(), nn.Linear(10, 3)).double()
    hidden = 10 + (1 if cfg["scenario"] == "mismatch" and rank == 1 else 0)
    layers: list[nn.Module] = [
        nn.Linear(6, hidden),
        nn.Tanh(),
        nn.Linear(hidden, hidden),
        nn.Tanh(),
        nn.Linear(hidden, 3),
    ]
    if cfg["dtype"] == "bf16":
        model = nn.Sequential(*layers).to(torch.bfloat16)
        # An fp32 norm among bf16 weights: gradients of two dtypes.
        model.insert(4, nn.LayerNorm(hidden))
        return model
    return nn.Sequential(*layers).to(torch.float16 if cfg["dtype"] == "fp16" else torch.float64)


def data(
    dtype: torch.dtype, iteration: int, tokens: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + iteration)
    if tokens:
        ids = torch.randint(VOCAB, (GLOBAL_BATCH + 1,), generator=generator)
        return ids[:-1], ids[1:]
    x = torch.randn(GLOBAL_BATCH, 6, generator=generator, dtype=torch.float64)
    y = torch.randn(GLOBAL_BATCH, 3, generator=generator, dtype=torch.float64)
    return x.to(dtype), y.to(dtype)


def delayed(collective: Any, rank: int) -> Any:
    """``collective`` after a random pause (up to 20 ms), different on every rank."""
    rng = random.Random(rank)

    def run(*args: Any, **kwargs: Any) -> Any:
        time.sleep(rng.random() * 0.02)
        return collective(*args, **kwargs)

    return run


def main() -> None:
    cfg = json.loads(sys.argv[1])
    rank, world, out = cfg["rank"], cfg["world"], cfg["out"]
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=2)
    group = None
    if world > 0:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.get("timeout", 60)),
        )
        group = dist.group.WORLD
    if cfg.get("chunk"):
        roundpipe.distributed.CHUNK_BYTES = cfg["chunk"]
    if cfg.get("delay"):
        for name in ("all_reduce", "all_gather", "reduce"):
            collective = getattr(roundpipe.distributed, name)
            setattr(roundpipe.distributed, name, delayed(collective, rank))
    result: dict[str, Any] = {"norms": [], "scales": []}
    tracing: Any = contextlib.nullcontext()
    if cfg.get("trace"):
        tracing = roundpipe.trace(os.path.join(out, f"trace{rank}.json"))
    try:
        with tracing:
            if cfg.get("ddp"):
                train_ddp(cfg, rank, world, result)
            else:
                train(cfg, rank, max(world, 1), group, result)
    except Exception as error:  # the test reads what each rank raised
        result["error"] = f"{type(error).__name__}: {error}"
    torch.save(result, os.path.join(out, f"{cfg.get('tag', 'rank')}{rank}.pt"))
    if world > 0:
        # A failed peer leaves nothing to synchronize with: leave without the exit barrier.
        sys.stdout.flush()
        os._exit(0)


def train(cfg: dict[str, Any], rank: int, world: int, group: Any, result: dict[str, Any]) -> None:
    scenario = cfg["scenario"]
    model_dtype = torch.float16 if cfg["dtype"] == "fp16" else torch.float64
    if cfg["dtype"] == "bf16":
        model_dtype = torch.bfloat16
    optim_dtype = None if cfg["dtype"] == "float64" else torch.float32
    tokens = scenario == "tied"
    # BatchNorm: one microbatch per rank, whose statistics are the rank's batch's (as DDP's).
    microbatches = 1 if scenario == "batchnorm" else 2
    model = roundpipe.RoundPipe(
        build(cfg, rank),
        optim_dtype=optim_dtype,
        name="dp",
        model_run_config=roundpipe.RoundPipeRunConfig(num_microbatch=microbatches),
        data_parallel_group=group,
        data_parallel_reduce=cfg.get("reduce", "auto"),
        optim_offload=cfg.get("offload"),
    )
    if cfg["dtype"] == "float64":
        optimizer: Any = torch.optim.Adam(model.optim_parameters(), lr=0.02)
    else:
        state_dtype = getattr(torch, cfg.get("state_dtype", "float32"))
        optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=0.01, state_dtype=state_dtype)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    scaler = roundpipe.GradScaler(init_scale=2.0**10) if scenario == "scaler" else None
    first = 0
    if cfg.get("from_file"):  # a one-process checkpoint file: weights and copies only
        try:
            roundpipe.load_checkpoint(cfg["from_file"], model, optimizer)
        except ValueError as error:
            result["file_error"] = str(error)
        model.load_state_dict(torch.load(cfg["from_file"], weights_only=True)["model"])
        first = ITERATIONS  # nothing to train: the test compares the loaded copies
    if cfg.get("resume"):  # from the checkpoint folder another run saved, at any world size
        extra = roundpipe.load_checkpoint(cfg["ckpt"], model, optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        first = extra["iteration"]
    local = GLOBAL_BATCH // world
    ours = slice(rank * local, (rank + 1) * local)

    def loss_fn(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        if tokens:
            loss = nn.functional.cross_entropy(output, label, reduction="sum") / local
        else:
            loss = ((output.double() - label.double()) ** 2).sum() / local
        return scaler.scale(loss) if scaler is not None else loss

    def step_fn(iteration: int) -> None:
        if scenario == "raise" and rank == 1 and iteration == 1:
            raise RuntimeError("rank 1 fails on purpose")
        if scaler is not None:
            if iteration == 1 and rank == world - 1:
                # An overflow that only this rank's shard sees: every rank must skip the step.
                next(iter(model.optim_parameters())).grad[0] = float("inf")
            scaler.step(optimizer)
            scaler.update()
        else:
            result["norms"].append(float(model.clip_grad_norm_(0.5)))
            optimizer.step()
        optimizer.zero_grad()
        scheduler.step()

    for iteration in range(first, ITERATIONS):
        if scenario == "exit" and rank == 1 and iteration == 1:
            os._exit(3)
        x, y = data(model_dtype, iteration, tokens)
        if scaler is not None:
            result["scales"].append(scaler.get_scale())
        model.forward_backward(input_args=(x[ours],), label=y[ours], loss_fn=loss_fn)
        if scenario == "extra_call" and rank == 1 and iteration == 1:
            model.forward_backward(input_args=(x[ours],), label=y[ours], loss_fn=loss_fn)
        model.step(step_fn, cfg["is_async"], iteration)
        if iteration == cfg.get("save_at"):  # with an asynchronous step in flight
            # The scheduler is stepped in step_fn: read once the step in flight has run.
            def extra(after: int = iteration + 1) -> dict[str, Any]:
                return {"scheduler": scheduler.state_dict(), "iteration": after}

            roundpipe.save_checkpoint(cfg["ckpt"], model, optimizer, extra=extra)
        if iteration == cfg.get("misuse_at"):
            misuse_checkpoint(cfg, rank, model, optimizer)
    model.synchronize()
    result["params"] = {k: v.detach().clone() for k, v in model.model.named_parameters()}
    result["buffers"] = {k: v.detach().clone() for k, v in model.model.named_buffers()}
    if cfg.get("final_ckpt"):
        roundpipe.save_checkpoint(cfg["final_ckpt"], model, optimizer)
    shard = model.data_parallel_shard()
    result["shard"] = [
        (piece.name, tuple(piece.shape), piece.start, piece.stop, piece.copy.detach().clone())
        for piece in shard.pieces
    ]
    result["rank_world"] = (shard.rank, shard.world_size)
    if world > 1:
        try:  # a data-parallel part under an AutoRoundPipe: its host glue would not be averaged
            roundpipe.models.AutoRoundPipe(nn.Sequential(model))
        except ValueError as error:
            result["auto_error"] = str(error)


def misuse_checkpoint(cfg: dict[str, Any], rank: int, model: Any, optimizer: Any) -> None:
    """Save a checkpoint the way the scenario gets it wrong: on rank 0 alone (DDP's habit), to
    a folder per rank, or with an ``extra`` per rank."""
    scenario, ckpt = cfg["scenario"], cfg["ckpt"]
    if scenario == "save_rank0" and rank == 0:
        roundpipe.save_checkpoint(ckpt, model, optimizer)
    elif scenario == "save_per_rank_folder":
        roundpipe.save_checkpoint(f"{ckpt}_{rank}", model, optimizer)
    elif scenario == "save_per_rank_extra":
        roundpipe.save_checkpoint(ckpt, model, optimizer, extra={"rank": rank})
    elif scenario == "save_extra_raises_on_rank1":

        def extra() -> dict[str, Any]:
            if rank == 1:
                raise KeyError("the user's extra fails on rank 1")
            return {}

        roundpipe.save_checkpoint(ckpt, model, optimizer, extra=extra)
    elif scenario == "save_folder_uncreatable_on_rank0":
        # The ranks do not share a filesystem: the folder's parent exists on rank 1's alone.
        parent = Path(ckpt).parent / ("missing" if rank == 0 else "present")
        (parent if rank == 1 else Path(ckpt)).mkdir(exist_ok=True)
        os.chdir(Path(ckpt) if rank == 0 else parent.parent)
        roundpipe.save_checkpoint(Path("present") / "ckpt", model, optimizer)
    elif scenario == "load_folder_missing_on_rank1":
        # The folder saved is where rank 0 looks for it, not where rank 1 does.
        roundpipe.save_checkpoint(ckpt, model, optimizer)
        os.chdir(Path(ckpt).parent if rank == 0 else Path(ckpt))
        roundpipe.load_checkpoint(Path(ckpt).name, model, optimizer)
    elif scenario == "save_extra_in_another_key_order":
        keys = ["a", "b"] if rank == 0 else ["b", "a"]
        roundpipe.save_checkpoint(ckpt, model, optimizer, extra={key: 1 for key in keys})


def train_ddp(cfg: dict[str, Any], rank: int, world: int, result: dict[str, Any]) -> None:
    """The "batchnorm" training of :func:`train` with plain PyTorch's DistributedDataParallel
    (buffers broadcast from rank 0 before each forward), for the buffers to compare with."""
    model = nn.parallel.DistributedDataParallel(build(cfg, rank))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.02)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    local = GLOBAL_BATCH // world
    ours = slice(rank * local, (rank + 1) * local)
    for iteration in range(ITERATIONS):
        x, y = data(torch.float64, iteration)
        loss = ((model(x[ours]) - y[ours]) ** 2).sum() / local
        loss.backward()
        result["norms"].append(float(nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    result["params"] = {k: v.detach().clone() for k, v in model.module.named_parameters()}
    result["buffers"] = {k: v.detach().clone() for k, v in model.module.named_buffers()}


if __name__ == "__main__":
    main()
