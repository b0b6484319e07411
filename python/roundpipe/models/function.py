"""roundpipe 0.1.1's ``"function"`` preset module: its loss functions for causal LMs and
``wrap_model(function)``, which runs a plain function as a RoundPipe (``EXPECTED_MODEL_CLASS`` is
``types.FunctionType``; ``roundpipe.models.wrap_model`` sends functions here).

Both compute Hugging Face's causal LM loss (``ForCausalLMLoss``): token ``t`` predicts token
``t + 1``, positions labelled ``ignore_index`` count for nothing, the logits are upcast to
float32, and the summed cross-entropy is divided by ``num_items_in_batch`` when given (the whole
batch's target-token count, for whole-batch weighting across microbatches), else averaged over
the targets. 0.1.1 ran them under ``torch.compile``; these run eagerly (same values).
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from roundpipe.models.presets._decoder import (
    DEFAULT_LOSS_CHUNK,
    IGNORE_INDEX,
    chunked_linear_cross_entropy,
)
from roundpipe.roundpipe import RoundPipe

EXPECTED_MODEL_CLASS = types.FunctionType


def _targets(
    labels: torch.Tensor, ignore_index: int, shift_labels: torch.Tensor | None
) -> torch.Tensor:
    """The shifted targets, with ``ignore_index`` written as Hugging Face's ``-100``."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    if ignore_index != IGNORE_INDEX:
        shift_labels = shift_labels.masked_fill(shift_labels == ignore_index, IGNORE_INDEX)
    return shift_labels


def CompileForCausalLMLoss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The causal LM loss of ``logits`` (``[..., vocab_size]``) against ``labels`` (see the
    module docstring); other keyword arguments are accepted and ignored, as Hugging Face's."""
    targets = _targets(labels, ignore_index, shift_labels).reshape(-1).to(logits.device)
    flat = logits.float().reshape(-1, vocab_size)
    if num_items_in_batch is None:
        return F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(flat, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    if isinstance(num_items_in_batch, torch.Tensor):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def ChunkedCompileLinearForCausalLMLoss(
    hidden_states: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = IGNORE_INDEX,
    shift_labels: torch.Tensor | None = None,
    **kwargs: Any,
) -> torch.Tensor:
    """The causal LM loss of ``lm_head(hidden_states)`` computed a chunk of tokens at a time,
    each chunk's logits recomputed in backward, so the whole logits never exist."""
    targets = _targets(labels, ignore_index, shift_labels)
    return chunked_linear_cross_entropy(
        hidden_states, lm_head, targets, num_items_in_batch, DEFAULT_LOSS_CHUNK
    )


class FunctionModule(nn.Module):
    """A function as a module without parameters: its forward calls the function."""

    def __init__(self, function: Callable[..., Any]) -> None:
        super().__init__()
        self.function = function

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.function(*args, **kwargs)


def wrap_model(func: types.FunctionType, **roundpipe_kwargs: Any) -> RoundPipe:
    """``func`` as a one-layer RoundPipe: each microbatch runs ``func`` on a device (a loss
    function, say, over the microbatch's logits and labels). ``roundpipe_kwargs`` go to
    ``RoundPipe`` (``name`` defaults to the function's name).

    Raises:
        NotImplementedError: ``func`` is not a Python function.
    """
    if not isinstance(func, EXPECTED_MODEL_CLASS):
        raise NotImplementedError(
            f"{type(func).__name__} is not an instance of the expected class types.FunctionType: "
            "roundpipe.models.function.wrap_model wraps Python functions; wrap a module with "
            "RoundPipe(module) or wrap_model_to_roundpipe(module)"
        )
    roundpipe_kwargs.setdefault("name", func.__qualname__)
    return RoundPipe(FunctionModule(func), **roundpipe_kwargs)


__all__ = [
    "EXPECTED_MODEL_CLASS",
    "ChunkedCompileLinearForCausalLMLoss",
    "CompileForCausalLMLoss",
    "FunctionModule",
    "wrap_model",
]
