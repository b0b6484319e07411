"""Optimizer copies whose gradients arrive lazily.

``RoundPipe.step()`` hands each optimizer copy the iteration's gradient as a *pending* gradient: a
view of the model's gradient arena, in the model's dtype. Reading ``.grad`` turns it into a real
gradient (cast to the copy's dtype, added to a gradient already there), so every reader sees the
same values as if it had been moved eagerly. ``roundpipe.optim.Adam`` reads pending gradients
without that cast (:func:`gradient_of`) and ``Adam.zero_grad()`` drops them, so a step through
our Adam moves every gradient byte once: from the arena straight into the fused update pass.

A pending gradient lives only while the step that handed it over runs; the step pipeline
resolves what is left when ``step_fn`` returns (:meth:`OptimizerCopy.resolve_grad`).

:class:`OptimizerCopiesView` is how a model shows its optimizer copies as its parameters inside
``OptimizerCtx`` (its ``state_dict`` holds them too: :mod:`roundpipe.state_dict`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from roundpipe.context import optimizer_context_active
from roundpipe.torch_internals import set_slot_grad, slot_grad


class OptimizerCopy(nn.Parameter):
    """An optimizer copy (in ``optim_dtype``) of one model parameter.

    Behaves as an ``nn.Parameter``; only ``.grad`` may be backed by a pending gradient."""

    _pending_grad: Tensor | None = None

    def hand_over_grad(self, grad: Tensor) -> None:
        """Make ``grad`` (any floating dtype, same shape) this copy's pending gradient; the copy
        must hold no gradient yet."""
        assert self._pending_grad is None and slot_grad(self) is None
        self._pending_grad = grad

    def resolve_grad(self) -> None:
        """Turn a pending gradient into ``.grad``: cast, or added to a gradient set meanwhile
        (for example by autograd, which writes the slot directly)."""
        pending, self._pending_grad = self._pending_grad, None
        if pending is None:
            return
        current = slot_grad(self)
        with torch.no_grad():
            if current is None:
                set_slot_grad(self, pending.to(self.dtype, copy=True))
            else:
                current.add_(pending)

    def drop_grad(self) -> None:
        """``.grad = None`` without casting a pending gradient first."""
        self._pending_grad = None
        set_slot_grad(self, None)

    @property
    def grad(self) -> Tensor | None:
        self.resolve_grad()
        return slot_grad(self)

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self._pending_grad = None
        set_slot_grad(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.drop_grad()


# The dtypes in which roundpipe.optim.Adam's native pass reads gradients, casting them to float32
# exactly as .grad would be cast.
_READ_AS_IS = (torch.float32, torch.bfloat16, torch.float16)


def gradient_of(param: Tensor) -> Tensor | None:
    """``param.grad``, except that a pending gradient is returned as it is (in the model's dtype,
    not cast) when that reads the same as the cast: it is in the copy's dtype, or in one that
    ``roundpipe.optim.Adam``'s native pass reads (fp32, bf16, fp16) and casts as ``.grad``
    would be. Others (an fp64 model's gradients for fp32 copies) are cast into ``.grad``, so
    that a step on them takes the same path, with the same bits, as one after reading
    ``.grad``."""
    if isinstance(param, OptimizerCopy):
        pending = param._pending_grad
        if (
            pending is not None
            and slot_grad(param) is None
            and (pending.dtype in _READ_AS_IS or pending.dtype == param.dtype)
        ):
            return pending
    return param.grad


def grad_dtype(param: Tensor) -> torch.dtype | None:
    """The dtype of ``param.grad`` (``None`` without a gradient), without casting a pending
    gradient into it."""
    if isinstance(param, OptimizerCopy) and param._pending_grad is not None:
        current = slot_grad(param)
        return param.dtype if current is None else current.dtype
    grad = param.grad
    return None if grad is None else grad.dtype


class OptimizerCopiesView(nn.Module):
    """``parameters()`` / ``named_parameters()`` that return the optimizer copies inside
    :class:`OptimizerCtx` and the model's parameters otherwise. Subclasses define
    ``optim_named_parameters(prefix, remove_duplicate)``."""

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        raise NotImplementedError

    def optim_parameters(self) -> Iterator[nn.Parameter]:
        """The optimizer copies of every parameter that requires grad."""
        for _, param in self.optim_named_parameters():
            yield param

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named optimizer copies inside ``OptimizerCtx``, the model's parameters otherwise."""
        if optimizer_context_active():
            yield from self.optim_named_parameters(prefix, remove_duplicate)
        else:
            yield from super().named_parameters(prefix, recurse, remove_duplicate)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """Optimizer copies inside ``OptimizerCtx``, the model's parameters otherwise."""
        for _, param in self.named_parameters(recurse=recurse):
            yield param


__all__ = ["OptimizerCopiesView", "OptimizerCopy", "grad_dtype", "gradient_of"]
