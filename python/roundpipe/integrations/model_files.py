"""The model as ``transformers.Trainer`` saves it, from a model that RoundPipe trains.

``wrap_model_to_roundpipe`` converts a model without a preset in place: its large submodules
become RoundPipes, whose ``state_dict`` entries carry a ``model.`` infix and RoundPipe's own
entries (``_roundpipe.*``: optimizer copies, pending gradients), and whose module paths are not
the ones PEFT and ``save_pretrained`` look for. Hugging Face files must hold the unwrapped
model's names, so that ``from_pretrained`` finds every weight and recognises the tied ones. And
while training runs asynchronously the newest weights are in the optimizer copies, one step
ahead of the parameters the next batch trains on.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from roundpipe.models import AutoRoundPipe
from roundpipe.models.wrap import unwrapped
from roundpipe.roundpipe import RoundPipe


def state_with(model: nn.Module, newest: dict[int, torch.Tensor]) -> dict[str, Any]:
    """``model.state_dict()`` with the value in ``newest`` (by the parameter's ``id``) for each
    parameter there; a tied weight stays one tensor under all its names."""
    return {
        key: newest.get(id(value), value).detach() if isinstance(value, torch.Tensor) else value
        for key, value in model.state_dict(keep_vars=True).items()
    }


def newest_weights(wrapped: RoundPipe | AutoRoundPipe) -> dict[int, torch.Tensor]:
    """The value of every trained parameter after the last optimizer step, by the parameter's
    ``id``, in the parameter's dtype, without writing anything back: a step in flight is waited
    for and its optimizer copies are read (what the next ``step()`` writes back). With data
    parallelism each rank holds a piece of every copy: every rank must call this (the pieces
    are exchanged), and each gets the whole weights."""
    if isinstance(wrapped, AutoRoundPipe):
        for _, part in wrapped.parts:
            part.wait_for_step()  # the last part's step runs the host glue's step too
        named_module: nn.Module = wrapped.model
    else:
        wrapped.wait_for_step()
        named_module = wrapped
    params = dict(named_module.named_parameters())
    if isinstance(wrapped, RoundPipe) and wrapped.data_parallel_size > 1:
        whole = _gathered(wrapped, params)
    else:
        whole = {name: copy.detach() for name, copy in wrapped.optim_named_parameters()}
    return {id(params[name]): value.to(params[name].dtype) for name, value in whole.items()}


def _gathered(wrapped: RoundPipe, params: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
    """Every trainable parameter's optimizer copy, whole and cast to the parameter's dtype,
    assembled from every data-parallel rank's pieces over the model's own process group."""
    import torch.distributed as dist

    shard = wrapped.data_parallel_shard()
    layouts: list[Any] = [None] * shard.world_size
    own = [(piece.name, piece.start, piece.stop) for piece in shard.pieces]
    dist.all_gather_object(layouts, own, group=shard.group)
    whole = {
        name: torch.empty(params[name].numel(), dtype=params[name].dtype)
        for layout in layouts
        for name, _, _ in layout
    }
    for rank, layout in enumerate(layouts):
        sizes = [(stop - start) * whole[name].element_size() for name, start, stop in layout]
        if not sum(sizes):
            continue
        if rank == shard.rank:
            buffer = torch.cat(
                [p.copy.detach().to(whole[p.name].dtype).view(torch.uint8) for p in shard.pieces]
            )
        else:
            buffer = torch.empty(sum(sizes), dtype=torch.uint8)
        dist.broadcast(buffer, src=dist.get_global_rank(shard.group, rank), group=shard.group)
        for (name, start, stop), chunk in zip(layout, torch.split(buffer, sizes), strict=True):
            size = whole[name].element_size()
            whole[name].view(torch.uint8)[start * size : stop * size].copy_(chunk)
    return {name: flat.view(params[name].shape) for name, flat in whole.items()}


__all__ = ["newest_weights", "state_with", "unwrapped"]
