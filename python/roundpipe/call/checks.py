"""Checks of what flows through a call that plain PyTorch would not need: values autograd
cannot see into, and losses that cannot be backpropagated. Each raises before any work of the
stage it guards, naming the model, the layer or microbatch, and the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from roundpipe.torch_internals import call_hook_kinds, tree_flatten


def check_output(model: str, last_layer: int, microbatch: int, leaves: list[Any]) -> None:
    """A training forward's output must show autograd every tensor that carries a graph: one
    held in an object torch's pytree does not know would hand backward() nothing to send
    back into the pipeline, and the layers' gradients would be lost without an error."""
    refuse_hidden_gradients(
        model,
        leaves,
        requiring_grad=True,
        where=f"the output of layer {last_layer} (microbatch {microbatch})",
        held="tensors that require grad",
        why="backward() through them could not reach the layers",
        instead="return",
    )


def refuse_hidden_gradients(
    model: str,
    leaves: list[Any],
    requiring_grad: bool,
    where: str,
    held: str,
    why: str,
    instead: str,
) -> None:
    """``TypeError`` for the first of ``leaves`` that hides tensors gradients flow through
    (see :func:`hides_gradients`): ``where`` holds ``held`` in it, so ``why``; register
    its type, or ``instead`` a tuple, list or dict."""
    for leaf in leaves:
        if not isinstance(leaf, torch.Tensor) and hides_gradients(leaf, requiring_grad):
            raise TypeError(
                f"RoundPipe model '{model}': {where} holds {held} in a "
                f"{type(leaf).__name__}, a type that torch's pytree does not know, so {why}; "
                "register it (torch.utils._pytree.register_dataclass for a dataclass, "
                f"register_pytree_node otherwise) or {instead} a tuple, list or dict"
            )


def hides_gradients(leaf: Any, requiring_grad: bool, seen: set[int] | None = None) -> bool:
    """Whether ``leaf``, a pytree leaf that is not a tensor, is an object (a dataclass, or any
    instance with attributes) holding tensors that gradients would flow through in plain PyTorch
    (floating point activations; with ``requiring_grad``, as for the user's own inputs and the
    model's outputs, those that require grad), which the pipeline cannot reach. Modules are not
    looked into (their tensors are parameters)."""
    attributes = _attributes(leaf)
    if not attributes:
        return False
    seen = set() if seen is None else seen
    if id(leaf) in seen:
        return False
    seen.add(id(leaf))
    inner, _ = tree_flatten(attributes)
    return any(
        (
            isinstance(t, torch.Tensor)
            and (t.requires_grad if requiring_grad else t.is_floating_point() or t.is_complex())
        )
        or (not isinstance(t, torch.Tensor) and hides_gradients(t, requiring_grad, seen))
        for t in inner
    )


def _attributes(leaf: Any) -> list[Any]:
    """The values of ``leaf``'s fields (a dataclass) or instance attributes (``__dict__``,
    ``__slots__``); none for classes, modules and objects without attributes."""
    if isinstance(leaf, (type, torch.nn.Module)):
        return []
    if dataclasses.is_dataclass(leaf):
        return [getattr(leaf, f.name) for f in dataclasses.fields(leaf)]
    values = list(getattr(leaf, "__dict__", {}).values())
    for cls in type(leaf).__mro__:
        slots = cls.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and hasattr(leaf, name):
                values.append(getattr(leaf, name))
    return values


def check_loss(loss: Any, name: str, microbatch: int) -> None:
    """What ``loss_fn`` returned can be backpropagated as PyTorch's ``backward()`` would: a
    tensor, or a non-empty sequence of them, each a scalar that requires grad. PyTorch's own
    errors for the others (``RuntimeError``) name ``loss_fn`` here, not the layers."""
    losses = [loss] if isinstance(loss, torch.Tensor) else loss
    if not (
        isinstance(losses, (list, tuple))
        and losses
        and all(isinstance(x, torch.Tensor) for x in losses)
    ):
        raise TypeError(
            f"RoundPipe model '{name}': loss_fn must return a tensor or a non-empty sequence of "
            f"tensors to backpropagate, got {type(loss).__name__}"
        )
    for i, value in enumerate(losses):
        which = "loss_fn's result" if value is loss else f"loss_fn's result[{i}]"
        if value.numel() != 1:
            raise RuntimeError(
                f"RoundPipe model '{name}': {which} for microbatch {microbatch} has shape "
                f"{tuple(value.shape)}; backward needs a scalar loss (grad can be implicitly "
                f"created only for scalar outputs): reduce it, e.g. with .sum() or .mean()"
            )
        if not value.requires_grad:
            raise RuntimeError(
                f"RoundPipe model '{name}': {which} for microbatch {microbatch} does not require "
                f"grad and has no grad_fn: compute it from the model's output"
            )


def refuse_sequential_hooks(model: str, module: torch.nn.Module) -> None:
    """``RuntimeError`` for hooks registered on a wrapped Sequential itself: a call runs its
    layers one by one and never calls the Sequential, so they would be skipped silently where
    plain PyTorch runs them (hooks on the layers run, as in plain PyTorch)."""
    kinds = call_hook_kinds(module) if isinstance(module, torch.nn.Sequential) else []
    if kinds:
        raise RuntimeError(
            f"RoundPipe model '{model}': the wrapped Sequential has hooks of its own "
            f"({', '.join(kinds)}), which RoundPipe cannot run: it runs the Sequential's "
            "layers one by one, never the Sequential itself. Register forward hooks and "
            "pre-hooks on the RoundPipe model instead (it runs them on each call's whole "
            "batch, as PyTorch runs them on the Sequential), backward hooks on a layer"
        )


def refuse_changed_layers(model: str, module: torch.nn.Module, layers: Sequence[Any]) -> None:
    """``RuntimeError`` if the wrapped Sequential's layers are no longer the ``layers`` wrapped
    (one appended, removed or replaced: the calls would run the layers wrapped)."""
    if isinstance(module, torch.nn.Sequential) and (
        len(module) != len(layers) or any(a is not b for a, b in zip(module, layers, strict=True))
    ):
        raise RuntimeError(
            f"RoundPipe model '{model}': the layers of the wrapped Sequential changed "
            f"after wrapping ({len(layers)} wrapped, {len(module)} now; a layer appended, "
            "removed or replaced). RoundPipe laid its arenas and plans out for the layers "
            "it wrapped: wrap the changed Sequential anew"
        )


def refuse_added_parameters(model: str, module: torch.nn.Module, wrapped: set[str]) -> None:
    """``RuntimeError`` naming the first parameter of ``module`` whose name is not among the
    ``wrapped`` ones: added after wrapping, it would be neither uploaded nor trained."""
    added = [n for n, _ in module.named_parameters(remove_duplicate=False) if n not in wrapped]
    if added:
        raise RuntimeError(
            f"RoundPipe model '{model}': parameter '{added[0]}' is not one it wrapped "
            "(a module inserted into the wrapped model after wrapping, e.g. get_peft_model() "
            "of the RoundPipe): RoundPipe would neither upload nor train it. Add adapters "
            "before wrapping: wrap_model_to_roundpipe(get_peft_model(model, config))"
        )


__all__ = [
    "check_loss",
    "check_output",
    "hides_gradients",
    "refuse_added_parameters",
    "refuse_changed_layers",
    "refuse_hidden_gradients",
    "refuse_sequential_hooks",
]
