"""Optimizer copies whose gradients arrive lazily.

``RoundPipe.step()`` hands each optimizer copy the iteration's gradient as a *pending* gradient: a
view of the model's gradient arena, in the model's dtype. Reading ``.grad`` turns it into a real
gradient (cast to the copy's dtype, added to a gradient already there), so every reader sees the
same values as if it had been moved eagerly. ``roundpipe.optim.Adam`` reads pending gradients
without that cast (:func:`gradient_of`) and ``Adam.zero_grad()`` drops them, so a step through
our Adam moves every gradient byte once: from the arena straight into the fused update pass.

A pending gradient lives only while the step that handed it over runs; the step pipeline
resolves what is left when ``step_fn`` returns (:meth:`OptimizerCopy.resolve_grad`).

:class:`OptimizerCopiesView` is how a model shows its optimizer copies: as its parameters inside
``OptimizerCtx``, and in its ``state_dict``.
"""

from __future__ import annotations

import threading
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from roundpipe.context import optimizer_context_active
from roundpipe.torch_internals import (
    NORM_CLASSES,
    loads_state_dict_plainly,
    set_slot_grad,
    slot_grad,
)


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


_saving = threading.local()


@contextmanager
def _regular_entries_only() -> Iterator[None]:
    """``state_dict()`` inside leaves out the runtime's own entries (nothing is cloned)."""
    _saving.regular_only = True
    try:
        yield
    finally:
        _saving.regular_only = False


def _quoted(keys: list[str]) -> str:
    return ", ".join(f'"{key}"' for key in keys)


def _load_error(module: nn.Module, error_msgs: list[str]) -> RuntimeError:
    """The error ``nn.Module.load_state_dict`` raises, with the same wording."""
    return RuntimeError(
        f"Error(s) in loading state_dict for {type(module).__name__}:\n\t" + "\n\t".join(error_msgs)
    )


def _views(module: nn.Module) -> list[tuple[str, OptimizerCopiesView]]:
    """(prefix of its own entries, view) of every OptimizerCopiesView in ``module``."""
    return [
        (f"{path}.{view._own_state_prefix}" if path else view._own_state_prefix, view)
        for path, view in module.named_modules(remove_duplicate=False)
        if isinstance(view, OptimizerCopiesView)
    ]


def _unstage(module: nn.Module) -> None:
    """Drop the own entries that a check staged in the views of ``module``."""
    for own, view in _views(module):
        view._load_own_state({}, own, [])


def _check_entries(
    module: nn.Module,
    state_dict: Any,
    strict: bool,
    same_kind: bool,
    optional: Collection[str] = (),
) -> None:
    """The checks of :meth:`OptimizerCopiesView._check_state_dict`, for any module: with
    ``same_kind`` an entry's dtype must be of its tensor's kind (see ``_check_entry``), else any
    tensor-like value of the right shape passes, as in ``nn.Module.load_state_dict`` (whose
    exceptions it keeps too: a 1-element entry for a 0-dim tensor, lazy parameters). Keys in
    ``optional`` may be missing."""
    if not isinstance(state_dict, Mapping):
        raise TypeError(f"Expected state_dict to be dict-like, got {type(state_dict)}.")
    with _regular_entries_only():
        expected = nn.Module.state_dict(module, keep_vars=True)
    error_msgs: list[str] = []
    missing = [key for key in expected if key not in state_dict and key not in optional]
    for key, like in expected.items():
        if key not in state_dict or not isinstance(like, Tensor):
            continue
        if same_kind:
            OptimizerCopiesView._check_entry(key, state_dict[key], like, error_msgs)
        elif key.rpartition(".")[2] != "_extra_state":  # set_extra_state takes any object
            _check_torch_entry(key, state_dict[key], like, error_msgs)
    unexpected = [key for key in state_dict if key not in expected]
    views = _views(module)
    for own, view in views:
        entries = {
            key.removeprefix(own): value for key, value in state_dict.items() if key.startswith(own)
        }
        view._load_own_state(entries, own, error_msgs)
        left = {f"{own}{key}" for key in entries}  # not taken: unexpected
        unexpected = [key for key in unexpected if not key.startswith(own) or key in left]
    if strict and (missing or unexpected):
        keys = [("Missing", missing), ("Unexpected", unexpected)]
        error_msgs[:0] = [
            f"{kind} key(s) in state_dict: {_quoted(found)}. " for kind, found in keys if found
        ]
    if error_msgs:
        _unstage(module)  # nothing staged stays behind
        raise _load_error(module, error_msgs)


def _check_torch_entry(key: str, value: Any, like: Tensor, error_msgs: list[str]) -> None:
    """``nn.Module._load_from_state_dict``'s checks of one entry, with its wording."""
    if not torch.overrides.is_tensor_like(value):  # type: ignore[no-untyped-call]
        error_msgs.append(
            f'While copying the parameter named "{key}", expected torch.Tensor or Tensor-like '
            f"object from checkpoint but received {type(value)}"
        )
        return
    if nn.parameter.is_lazy(like):
        return
    shape = value.shape
    if len(like.shape) == 0 and len(shape) == 1 and shape[0] == 1:
        shape = torch.Size([])  # torch loads a 1-element entry into a 0-dim tensor
    if shape != like.shape:
        error_msgs.append(
            f"size mismatch for {key}: copying a param with shape {value.shape} from "
            f"checkpoint, the shape in current model is {like.shape}."
        )


def check_state_dict(module: nn.Module, state_dict: Any, strict: bool) -> None:
    """Raise what ``module.load_state_dict(state_dict, strict)`` would raise for its entries
    (the wrong shape, not a tensor, and under ``strict`` missing or unexpected keys), changing
    nothing: ``roundpipe.load_checkpoint`` checks the whole file before it drains the step in
    flight or loads any part.

    A RoundPipe or AutoRoundPipe runs its own check (its own entries and dtypes included). A
    plain module is held to ``nn.Module``'s rules, and not checked at all (its load decides)
    where hooks or a custom ``_load_from_state_dict`` may rewrite the entries."""
    if isinstance(module, OptimizerCopiesView):
        module._check_state_dict_only(state_dict, strict)
        return
    modules = [m for _, m in module.named_modules(remove_duplicate=False)]
    if not all(loads_state_dict_plainly(m) for m in modules):
        return
    optional = {  # BatchNorm and the like load a checkpoint without it
        f"{path}.num_batches_tracked" if path else "num_batches_tracked"
        for path, m in module.named_modules(remove_duplicate=False)
        if isinstance(m, NORM_CLASSES)
    }
    _check_entries(module, state_dict, strict, same_kind=False, optional=optional)


class OptimizerCopiesView(nn.Module):
    """``parameters()`` / ``named_parameters()`` that return the optimizer copies inside
    :class:`OptimizerCtx` and the model's parameters otherwise, and ``state_dict`` entries of the
    runtime's own (the copies, for instance) under ``_own_state_prefix``. Subclasses define
    ``optim_named_parameters(prefix, remove_duplicate)``, ``_own_state`` and
    ``_load_own_state``.

    Loading is all or nothing: ``_check_state_dict`` validates every entry before anything
    changes, and ``_load_own_state`` only checks and stages the own entries (the subclass applies
    them once the parameters are loaded)."""

    _own_state_prefix = "_roundpipe."

    def _own_state(self) -> dict[str, Any]:
        """Entries to save beside the module's own, keyed without the prefix."""
        raise NotImplementedError

    def _load_own_state(self, entries: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        """Check the checkpoint's entries under ``prefix`` (their keys without it), note what is
        wrong in ``error_msgs``, stage them to apply after the load, and remove from ``entries``
        the keys taken: those left are unexpected keys. Changes nothing of the model."""
        raise NotImplementedError

    @staticmethod
    def _check_entry(key: str, value: Any, like: Tensor, error_msgs: list[str]) -> None:
        """Note in ``error_msgs`` why checkpoint entry ``value`` cannot be loaded into ``like``
        (shape exact, same kind of dtype: copying casts a float to another float, but never makes a
        float of an integer or drops an imaginary part)."""
        if not isinstance(value, Tensor):
            error_msgs.append(f'"{key}" must be a tensor, got {type(value).__name__}')
        elif value.shape != like.shape:
            error_msgs.append(
                f"size mismatch for {key}: copying a param with shape {value.shape} from "
                f"checkpoint, the shape in current model is {like.shape}."
            )
        elif (value.is_floating_point(), value.is_complex()) != (
            like.is_floating_point(),
            like.is_complex(),
        ) or (not like.is_floating_point() and not like.is_complex() and value.dtype != like.dtype):
            error_msgs.append(
                f"dtype mismatch for {key}: the checkpoint holds {value.dtype}, the current model "
                f"{like.dtype}."
            )

    def _check_state_dict(self, state_dict: Any, strict: bool) -> None:
        """Raise what ``load_state_dict(state_dict, strict)`` would raise, before it changes
        anything: a ``TypeError`` for a non-mapping, a ``RuntimeError`` worded as
        ``nn.Module.load_state_dict``'s for entries of the wrong shape or dtype and, under
        ``strict``, missing or unexpected keys (unknown own entries included). The own entries
        stay staged for the load that follows."""
        _check_entries(self, state_dict, strict, same_kind=True)

    def _check_state_dict_only(self, state_dict: Any, strict: bool) -> None:
        """:meth:`_check_state_dict`, leaving nothing staged (a check before any state is
        drained or loaded)."""
        try:
            self._check_state_dict(state_dict, strict)
        finally:
            _unstage(self)

    def _save_to_state_dict(
        self, destination: dict[str, Any], prefix: str, keep_vars: bool
    ) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if getattr(_saving, "regular_only", False):
            return
        for key, value in self._own_state().items():
            destination[f"{prefix}{self._own_state_prefix}{key}"] = value

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict[str, Any],
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        own = f"{prefix}{self._own_state_prefix}"
        unexpected_keys[:] = [key for key in unexpected_keys if not key.startswith(own)]
        entries = {
            key.removeprefix(own): value for key, value in state_dict.items() if key.startswith(own)
        }
        self._load_own_state(entries, own, error_msgs)
        unexpected_keys.extend(f"{own}{key}" for key in entries)

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


__all__ = ["OptimizerCopiesView", "OptimizerCopy", "check_state_dict", "grad_dtype", "gradient_of"]
