"""Optimizer copies whose gradients arrive lazily.

``RoundPipe.step()`` hands each optimizer copy the iteration's gradient as a *pending* gradient: a
view of the model's gradient arena, in the model's dtype. Reading ``.grad`` turns it into a real
gradient (cast to the copy's dtype, added to a gradient already there), so every reader sees the
same values as if it had been moved eagerly. ``roundpipe.optim.Adam`` reads pending gradients
without that cast (:func:`gradient_of`) and ``Adam.zero_grad()`` drops them, so a step through
our Adam moves every gradient byte once: from the arena straight into the fused update pass.

A pending gradient lives only while the step that handed it over runs; the step pipeline
resolves what is left when ``step_fn`` returns (:meth:`OptimizerCopy.resolve_grad`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The gradient slot torch keeps for every tensor; the property below wraps it.
_grad_slot = torch._C.TensorBase.grad


class OptimizerCopy(nn.Parameter):
    """An optimizer copy (in ``optim_dtype``) of one model parameter.

    Behaves as an ``nn.Parameter``; only ``.grad`` may be backed by a pending gradient."""

    _pending_grad: Tensor | None = None

    def hand_over_grad(self, grad: Tensor) -> None:
        """Make ``grad`` (any floating dtype, same shape) this copy's pending gradient; the copy
        must hold no gradient yet."""
        assert self._pending_grad is None and _grad_slot.__get__(self) is None
        self._pending_grad = grad

    def resolve_grad(self) -> None:
        """Turn a pending gradient into ``.grad``: cast, or added to a gradient set meanwhile
        (for example by autograd, which writes the slot directly)."""
        pending, self._pending_grad = self._pending_grad, None
        if pending is None:
            return
        current = _grad_slot.__get__(self)
        with torch.no_grad():
            if current is None:
                _grad_slot.__set__(self, pending.to(self.dtype, copy=True))
            else:
                current.add_(pending)

    def drop_grad(self) -> None:
        """``.grad = None`` without casting a pending gradient first."""
        self._pending_grad = None
        _grad_slot.__set__(self, None)

    @property  # type: ignore[override]
    def grad(self) -> Tensor | None:
        self.resolve_grad()
        return _grad_slot.__get__(self)

    @grad.setter
    def grad(self, value: Tensor | None) -> None:
        self._pending_grad = None
        _grad_slot.__set__(self, value)

    @grad.deleter
    def grad(self) -> None:
        self.drop_grad()


def gradient_of(param: Tensor) -> Tensor | None:
    """``param.grad``, except that a pending gradient is returned as it is (in the model's dtype,
    not cast); it holds the same values."""
    if isinstance(param, OptimizerCopy):
        pending = param._pending_grad
        if pending is not None and _grad_slot.__get__(param) is None:
            return pending
    return param.grad


__all__ = ["OptimizerCopy", "gradient_of"]
