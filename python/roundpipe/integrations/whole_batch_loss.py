"""A preset's ``loss`` over the whole batch, as the unwrapped model computes it.

A preset computes each microbatch's loss in the pipeline: the mean over that microbatch's target
tokens, or its summed loss over ``num_items_in_batch``. The automatic merge averages the
microbatch losses, which weighs a token of a short microbatch more than one of a long one.
Inside :func:`whole_batch_losses` a call with ``labels`` gets the Hugging Face loss of the whole
batch instead, whether or not it passes ``num_items_in_batch``: without it, the batch's own
target-token count is passed for it (the mean over the whole batch), and the shares are added
up. So ``model(**inputs).loss`` in a ``Trainer.compute_loss`` is the loss plain ``Trainer`` sees.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from roundpipe.models import merge_summed_loss
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig

IGNORE_INDEX = -100  # Hugging Face's label of a position without a target


def _whole_batch_call(
    module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
    """A forward pre-hook: a call with ``labels`` (and no merge of the caller's own) gets
    ``num_items_in_batch`` and a merge that adds the microbatch losses up."""
    labels = kwargs.get("labels")
    config = kwargs.get("roundpipe_run_config")
    if labels is None or (config is not None and config.merge_output is not None):
        return None
    kwargs = dict(kwargs)
    if kwargs.get("num_items_in_batch") is None:
        # A causal LM's token t targets label t + 1, as Trainer counts num_items_in_batch.
        kwargs["num_items_in_batch"] = labels[..., 1:].ne(IGNORE_INDEX).sum()
    config = RoundPipeRunConfig() if config is None else copy.copy(config)
    config.merge_output = merge_summed_loss
    kwargs["roundpipe_run_config"] = config
    return args, kwargs


@contextmanager
def whole_batch_losses(model: RoundPipe) -> Iterator[None]:
    """For the duration, every call of ``model`` (a preset) with ``labels`` returns the whole
    batch's loss (see the module's docstring)."""
    handle = model.register_forward_pre_hook(_whole_batch_call, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


__all__ = ["whole_batch_losses"]
