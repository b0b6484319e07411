"""What a layer can ask of the runtime while it runs: recompute data and the optimizer context;
how an error raised in a layer or a step is made to name where it happened (``locate_error``); and
how the hooks registered on a parameter run on a gradient the runtime summed (``run_param_hooks``).

``save_for_recompute`` lets a layer stash values computed in its forward pass (for example
positions or masks built once) so the recompute in the backward pass reuses them instead of
rebuilding them (and, on GPUs, without a host synchronisation).
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from roundpipe.torch_internals import backward_hooks, tree_leaves


class LayerCall:
    """The layer calls of one stage on this thread (entered by the runtime around the layers it
    runs): one object per stage, whose ``layer``, ``microbatch`` and ``saved`` the native layer
    loop (``_C.LayerLoop``) sets before each layer, because building one per layer x microbatch
    is measurable host work at short sequences. ``running`` is cleared while the loop runs a
    backward pass between the layers it recomputes: the call stays entered, but what runs then
    (hooks, autograd functions) is outside every layer of it, as if it had been left."""

    __slots__ = ("layer", "microbatch", "recompute", "running", "saved", "saving_enabled", "store")

    def __init__(
        self, store: dict[tuple[int, int], tuple[Any, ...]], recompute: bool, saving_enabled: bool
    ) -> None:
        self.store, self.recompute, self.saving_enabled = store, recompute, saving_enabled
        self.layer = self.microbatch = 0
        self.saved = False
        self.running = True

    def __enter__(self) -> None:
        _state.stack.append(_state.call)
        _state.call = self

    def __exit__(self, *exc: object) -> None:
        _state.call = _state.stack.pop()


@dataclass
class _State(threading.local):
    call: LayerCall | None = None
    optimizer_depth: int = 0
    stack: list[LayerCall | None] = field(default_factory=list)


_state = _State()


def _current() -> LayerCall | None:
    """The layer call running on this thread, if any: the innermost entered one that runs."""
    call = _state.call
    if call is None or call.running:
        return call
    return next((outer for outer in reversed(_state.stack) if outer and outer.running), None)


class RecomputeDataError(RuntimeError, AssertionError):
    """Misuse of :func:`save_for_recompute` / :func:`get_recompute_data`.

    Both a ``RuntimeError`` and an ``AssertionError``: roundpipe 0.1.1 raised ``AssertionError``
    here, so code written for either type catches it.
    """


class RecomputeDataValueError(RecomputeDataError, ValueError):
    """A value :func:`save_for_recompute` must not keep (a tensor that requires grad); also a
    ``ValueError``, as every invalid argument is."""


def save_for_recompute(*data: Any) -> None:
    """Keep ``data`` from this layer's forward pass for its recompute in the backward pass.

    Call at most once per layer per forward pass. Tensors must not require grad (save detached
    values). A no-op when gradients are off, outside a RoundPipe layer, and during the recompute
    itself (where :func:`get_recompute_data` returns what the forward pass saved).

    Raises:
        RecomputeDataError: a second call in one layer's forward pass.
        RecomputeDataValueError: a tensor that requires grad (recompute rebuilds the graph;
            save ``tensor.detach()``).
    """
    call = _current()
    if call is None or call.recompute or not call.saving_enabled:
        return
    if call.saved:
        raise RecomputeDataError(
            f"save_for_recompute was called twice in layer {call.layer} for one forward pass; "
            "save everything in a single call"
        )
    for leaf in tree_leaves(data):
        if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
            raise RecomputeDataValueError(
                f"save_for_recompute got a tensor that requires grad in layer {call.layer}; "
                "pass tensor.detach() (recompute rebuilds the graph)"
            )
    call.saved = True
    call.store[(call.layer, call.microbatch)] = data


def doing_recompute() -> bool:
    """True while RoundPipe recomputes a layer's forward pass for the backward pass."""
    call = _current()
    return call is not None and call.recompute


def get_recompute_data() -> tuple[Any, ...]:
    """What this layer passed to :func:`save_for_recompute` in its forward pass (a tuple).

    Raises:
        RecomputeDataError: outside a recompute, or when the forward pass saved nothing.
    """
    call = _current()
    if call is None or not call.recompute:
        raise RecomputeDataError(
            "get_recompute_data() is only available during recompute; check doing_recompute() first"
        )
    try:
        return call.store[(call.layer, call.microbatch)]
    except KeyError:
        raise RecomputeDataError(
            f"layer {call.layer} saved nothing with save_for_recompute in its forward pass"
        ) from None


class OptimizerCtx:
    """Inside this context, ``RoundPipe.parameters()`` / ``named_parameters()`` return the
    optimizer copies (in ``optim_dtype``) instead of the model's parameters. Nests."""

    def __enter__(self) -> OptimizerCtx:
        _state.optimizer_depth += 1
        return self

    def __exit__(self, *exc: object) -> None:
        _state.optimizer_depth -= 1


def optimizer_context_active() -> bool:
    """Whether an :class:`OptimizerCtx` is active on this thread."""
    return _state.optimizer_depth > 0


def doing_optimizer() -> bool:
    """Whether an :class:`OptimizerCtx` is active on this thread (roundpipe 0.1.1's name for
    :func:`optimizer_context_active`)."""
    return optimizer_context_active()


def run_param_hooks(param: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``grad`` after the hooks registered on ``param`` (``param.register_hook``) ran on it, in
    the order they were registered: what a hook returns replaces it, as in PyTorch's engine."""
    result = grad
    for hook in list((backward_hooks(param) or {}).values()):
        returned = hook(result)
        if returned is not None:
            result = returned
    return result


def locate_error(error: BaseException, where: str) -> BaseException:
    """``error`` with ``where`` (model, layer, phase) prefixed to its message, same type when the
    type allows it (so ``except ValueError`` in user code still works), else a RuntimeError."""
    if isinstance(error, (KeyboardInterrupt, SystemExit)):
        return error
    message = f"{where}: {error}"
    annotated: BaseException
    try:
        if isinstance(error, OSError) and error.errno is not None:
            # errno and file kept, so that the caller can tell a full disk from a missing file.
            annotated = type(error)(error.errno, message, error.filename)
        else:
            annotated = copy.copy(error)
            annotated.args = (message,)
        if message not in str(annotated):
            raise TypeError("message not taken from args")
    except Exception:
        annotated = RuntimeError(message)
    annotated.__cause__ = error
    annotated.__traceback__ = error.__traceback__
    return annotated


__all__ = [
    "OptimizerCtx",
    "RecomputeDataError",
    "RecomputeDataValueError",
    "doing_optimizer",
    "doing_recompute",
    "get_recompute_data",
    "optimizer_context_active",
    "save_for_recompute",
]
