"""The one Python module that touches torch's private API.

Everything here is a name torch does not document as public: its pytree, its autograd engine's
pass bookkeeping, a tensor's hook dicts, gradient slot and version counter, ``nn.Module``'s own
attribute dicts and its state-dict hooks. The rest of the runtime calls these wrappers, so a torch
release that moves one of them is fixed in one place. Each wrapper was checked on torch 2.11,
2.12 and 2.13 (the range ``pyproject.toml`` allows); each lookup that may be missing from another
release degrades to the safe answer named in its docstring, or fails with an error naming it.

The native twin is ``csrc/torch_internals`` (the local backward's view of the engine)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

try:
    # torch has no public pytree module yet; these five are what its own code relies on.
    from torch.utils._pytree import (
        TreeSpec,
        register_pytree_node,
        tree_flatten,
        tree_leaves,
        tree_map,
        tree_unflatten,
    )
except ImportError as error:  # pragma: no cover - only on a torch outside the checked range
    raise ImportError(
        f"roundpipe needs torch.utils._pytree's tree_flatten, tree_unflatten, tree_map, "
        f"tree_leaves, TreeSpec and register_pytree_node, which torch {torch.__version__} does "
        "not have; install a torch in pyproject.toml's range"
    ) from error

# -- the autograd engine ---------------------------------------------------------------------

_current_graph_task_id: Callable[[], int] | None = getattr(torch._C, "_current_graph_task_id", None)
_will_engine_execute_node: Callable[[Any], bool] | None = getattr(
    torch._C, "_will_engine_execute_node", None
)
_engine: Any = getattr(torch.autograd.Variable, "_execution_engine", None)


def current_graph_task_id() -> int:
    """The id of the engine's backward pass running on this thread, -1 outside one.

    Missing lookup: ``RuntimeError`` naming it (a pass's gradients cannot be summed safely
    without knowing which pass is running)."""
    if _current_graph_task_id is None:
        raise RuntimeError(
            f"torch {torch.__version__} has no torch._C._current_graph_task_id, which RoundPipe "
            "needs to sum a backward pass's gradients; install a torch in pyproject.toml's range"
        )
    return int(_current_graph_task_id())


def queue_engine_callback(callback: Callable[[], None]) -> None:
    """Have the running backward pass call ``callback`` once it has finished (on its thread).

    Missing lookup: ``RuntimeError`` naming it."""
    queue = getattr(_engine, "queue_callback", None)
    if queue is None:
        raise RuntimeError(
            f"torch {torch.__version__}'s autograd engine has no queue_callback, which RoundPipe "
            "needs to end a backward pass's sums; install a torch in pyproject.toml's range"
        )
    queue(callback)


def will_engine_execute_node(node: Any) -> bool:
    """Whether the running backward pass will run ``node`` (``torch.autograd.grad`` and
    ``backward(inputs=...)`` run only the nodes their inputs need).

    Outside a pass, or where the lookup is missing: True (the caller then keeps gradients it may
    not need, never drops one it needs)."""
    if _will_engine_execute_node is None:
        return True
    try:
        return bool(_will_engine_execute_node(node))
    except RuntimeError:
        return True


# -- tensors -----------------------------------------------------------------------------------

# The gradient slot of every tensor (a descriptor on the C++ base class): read and written past
# any ``.grad`` property a Parameter subclass defines.
_grad_slot: Any = torch._C.TensorBase.grad


def slot_grad(tensor: torch.Tensor) -> torch.Tensor | None:
    """``tensor``'s own ``.grad``, whatever its class defines ``grad`` to be."""
    grad: torch.Tensor | None = _grad_slot.__get__(tensor)
    return grad


def set_slot_grad(tensor: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Set ``tensor``'s own ``.grad`` (see :func:`slot_grad`)."""
    _grad_slot.__set__(tensor, grad)


def backward_hooks(tensor: torch.Tensor) -> dict[int, Callable[..., Any]] | None:
    """The hooks ``tensor.register_hook`` registered, in order (None or empty: none)."""
    hooks: dict[int, Callable[..., Any]] | None = tensor._backward_hooks
    return hooks


def share_backward_hooks(tensor: torch.Tensor, hooks: dict[int, Callable[..., Any]]) -> None:
    """Make ``tensor`` run the very hook dict of another tensor (a device copy of a parameter
    runs the parameter's hooks, including those registered later)."""
    tensor._backward_hooks = hooks


def has_post_accumulate_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether ``tensor.register_post_accumulate_grad_hook`` registered a hook on it."""
    return bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def version_of(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: it grows with every in-place change of its data."""
    return int(tensor._version)


# -- modules -----------------------------------------------------------------------------------


def parameter_slots(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """``module``'s own parameters by attribute name, as the dict it keeps them in (writing to
    it rebinds one without ``register_parameter``'s checks)."""
    slots: dict[str, nn.Parameter | None] = module._parameters
    return slots


def buffer_slots(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """``module``'s own buffers by attribute name, as the dict it keeps them in."""
    slots: dict[str, torch.Tensor | None] = module._buffers
    return slots


def child_slots(module: nn.Module) -> dict[str, nn.Module | None]:
    """``module``'s own submodules by attribute name, as the dict it keeps them in."""
    slots: dict[str, nn.Module | None] = module._modules
    return slots


def has_state_dict_hooks(module: nn.Module) -> bool:
    """Whether hooks may rewrite ``module``'s state-dict entries on saving or loading."""
    names = (
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
    )
    # A dict torch renamed counts as hooked: the caller then leaves the entries to torch.
    return any(getattr(module, name, True) for name in names)


# The attributes nn.Module sets on a module about how its own call runs: compile()'s compiled
# call and register_full_backward_hook's flag.
CALL_STATE = frozenset({"_compiled_call_impl", "_is_full_backward_hook"})


def call_hook_kinds(module: nn.Module) -> list[str]:
    """The registration methods of the hooks registered on ``module`` itself that run when it is
    called (forward pre-hooks, forward hooks, backward pre-hooks and backward hooks)."""
    kinds = {
        "_forward_pre_hooks": "register_forward_pre_hook",
        "_forward_hooks": "register_forward_hook",
        "_backward_pre_hooks": "register_full_backward_pre_hook",
        "_backward_hooks": "register_full_backward_hook",
    }
    return [method for name, method in kinds.items() if getattr(module, name, None)]


def has_optimizer_load_hooks(optimizer: torch.optim.Optimizer) -> bool:
    """Whether a load pre-hook (``register_load_state_dict_pre_hook``) may rewrite the state
    ``optimizer.load_state_dict`` is given."""
    # A dict torch renamed counts as hooked: the caller then leaves the state to the optimizer.
    return bool(getattr(optimizer, "_optimizer_load_state_dict_pre_hooks", True))


def _norm_base() -> tuple[type[nn.Module], ...]:
    return tuple(
        cls
        for cls in (
            getattr(nn.modules.batchnorm, "_NormBase", None),
            getattr(nn.modules.instancenorm, "_InstanceNorm", None),
        )
        if isinstance(cls, type)
    )


# The classes of BatchNorm and InstanceNorm, whose state-dict loading only adds a missing
# ``num_batches_tracked`` to checkpoints of old versions.
NORM_CLASSES: tuple[type[nn.Module], ...] = _norm_base()


def loads_state_dict_plainly(module: nn.Module) -> bool:
    """Whether ``module`` loads its state-dict entries by ``nn.Module``'s rules: its class's
    ``_load_from_state_dict`` is ``nn.Module``'s or a norm layer's (see :data:`NORM_CLASSES`),
    and no hook rewrites entries."""
    loader = type(module)._load_from_state_dict
    plain = {nn.Module._load_from_state_dict} | {cls._load_from_state_dict for cls in NORM_CLASSES}
    return loader in plain and not has_state_dict_hooks(module)


__all__ = [
    "CALL_STATE",
    "NORM_CLASSES",
    "TreeSpec",
    "backward_hooks",
    "buffer_slots",
    "call_hook_kinds",
    "child_slots",
    "current_graph_task_id",
    "has_optimizer_load_hooks",
    "has_post_accumulate_grad_hooks",
    "has_state_dict_hooks",
    "loads_state_dict_plainly",
    "parameter_slots",
    "queue_engine_callback",
    "register_pytree_node",
    "set_slot_grad",
    "share_backward_hooks",
    "slot_grad",
    "tree_flatten",
    "tree_leaves",
    "tree_map",
    "tree_unflatten",
    "version_of",
    "will_engine_execute_node",
]
