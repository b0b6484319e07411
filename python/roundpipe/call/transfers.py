"""Moving a call's values between devices and copying a layer's inputs.

Activations move on each device's copy engine (the activation lane): :func:`to_device` before a
stage computes on a CUDA device, :func:`to_host` for the values a later stage recomputes from,
and :func:`to_output_device` for a call's outputs; on virtual CPU devices nothing moves. A
layer's input is copied where the layer could change what the recompute needs or an autograd
leaf (:func:`writable`, :func:`unshared`); every copy is laid out and placed as its original,
and leaves that share memory are copied together so that they share the copy's
(:func:`copies_of`).
"""

from __future__ import annotations

from typing import Any

import torch

from roundpipe._native import _C
from roundpipe.device import device_at
from roundpipe.torch_internals import tree_flatten, tree_map, tree_unflatten


def on_cuda() -> bool:
    return _C.device_kind() == "cuda"


def to_device(tree: Any, device_index: int, after: Any = None) -> Any:
    """``tree`` with its tensors on device ``device_index`` (identity on virtual CPU devices).

    On CUDA the copies run on the activation lane and the device's current stream is made to wait
    for them. A copy from another device follows what was issued there so far; a copy from the
    host follows ``after`` (the event of the copy that filled that host memory, if any).
    """
    if not on_cuda():
        return tree
    device = device_at(device_index)
    copies: list[Any] = []

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or leaf.device == device:
            return leaf
        moved = _C.empty_placed(leaf, device)
        wants_grad = leaf.requires_grad  # an activation of a forward in grad mode: so is its copy
        source_ready = _C.record_event(leaf.device.index) if leaf.is_cuda else after
        leaf = leaf.detach()
        if not leaf.is_cuda and not leaf.is_pinned():
            # A pageable source would make the copy synchronous with the host (the driver stages
            # it on the calling thread); torch's host allocator keeps this one until it ran.
            leaf = leaf.pin_memory()
        copies.append(_C.copy_async(device_index, moved, leaf, "activation", source_ready))
        return _C.graph_cut(moved.detach().requires_grad_()) if wants_grad else moved

    moved_tree = tree_map(move, tree)
    # Every copy, not only the last: a copy whose `after` is still running on the host is issued
    # later by the engine's worker, out of order with the others.
    for copied in copies:
        copied.block_current_stream(device_index)
    return moved_tree


def to_host(tree: Any, device_index: int) -> tuple[Any, Any]:
    """``tree`` with its tensors copied to (pinned) host memory, and the one event of the copies.

    The copies run on device ``device_index``'s activation lane after what was issued there so
    far; a leaf on another device first moves to ``device_index`` (ordered by PyTorch on both
    devices' current streams), so the event covers every leaf. Identity with no event on virtual
    CPU devices (detached, since host copies never carry a graph)."""
    if not on_cuda():
        leaves, spec = flatten(tree)
        return unflatten([detach_leaf(leaf) for leaf in leaves], spec), None
    device = device_at(device_index)

    def gather(leaf: Any) -> Any:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda and leaf.device != device:
            return leaf.detach().to(device, non_blocking=True)
        return leaf

    tree = tree_map(gather, tree)
    after = _C.record_event(device_index)
    last: list[Any] = [None]

    def move(leaf: Any) -> Any:
        if not isinstance(leaf, torch.Tensor) or not leaf.is_cuda:
            return leaf
        host = torch.empty(leaf.shape, dtype=leaf.dtype, pin_memory=True)
        # One lane, issued in order (`after` is a device event, so none is deferred): the last
        # copy's event covers all of them.
        last[0] = _C.copy_async(device_index, host, leaf.detach(), "activation", after)
        return host

    return tree_map(move, tree), last[0]


def to_output_device(values: list[Any], device: torch.device) -> tuple[list[Any], list[Any]]:
    """Per-microbatch ``values`` moved to the call's ``output_device``, and the event of each
    one's copies (None when nothing is left in flight)."""
    moved, events = [], []
    for value in values:
        if device.type == "cpu":
            value, event = to_host(value, _device_of(value))
        else:
            value, event = (
                tree_map(
                    lambda t: (
                        t.detach().to(device, non_blocking=True)
                        if isinstance(t, torch.Tensor)
                        else t
                    ),
                    value,
                ),
                None,
            )
        moved.append(value)
        events.append(event)
    return moved, events


def _device_of(value: Any) -> int:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device.index
    return 0


def flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, with a lone plain tensor (what passes between layers nearly always) taken
    as its own leaf without pytree's type dispatch, which costs about a microsecond a call on the
    per layer x microbatch path of layer-grain recompute. Rebuild with :func:`unflatten`."""
    if type(tree) is torch.Tensor:
        return [tree], None
    return tree_flatten(tree)


def unflatten(leaves: list[Any], spec: Any) -> Any:
    """The tree of ``leaves`` for a ``spec`` of :func:`flatten`."""
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def detach_leaf(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _shares_memory(a: Any, b: Any) -> bool:
    return (
        isinstance(a, torch.Tensor)
        and isinstance(b, torch.Tensor)
        and a.device == b.device
        and a.numel() > 0
        and a.data_ptr() == b.data_ptr()
    )


def _span(tensor: torch.Tensor) -> int:
    """Elements of storage from ``tensor``'s first to its last, inclusive."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum(
        (size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride(), strict=True)
    )


def copies_of(leaves: list[Any], chosen: list[bool], differentiable: bool) -> list[Any]:
    """``leaves`` with copies of the chosen tensors, each laid out and placed as its original
    (``_C.empty_placed``). Chosen tensors that share memory are copied together, into one
    buffer, as views of it: they share the copy's memory as they shared theirs, so a layer that
    changes one in place changes the others, as in plain PyTorch (a layer returning ``(h, h)``,
    ``(h, h[:, :4])`` or ``(h, h.view(torch.int32))``). ``differentiable``: the copies carry
    gradients back to the originals, else they are plain copies that autograd does not know
    of."""
    groups: dict[tuple[torch.device, int], list[int]] = {}
    for i, (leaf, wanted) in enumerate(zip(leaves, chosen, strict=True)):
        if not (wanted and isinstance(leaf, torch.Tensor)):
            continue
        memory = leaf.untyped_storage().data_ptr() if leaf.numel() > 0 else -i - 1
        groups.setdefault((leaf.device, memory), []).append(i)
    copies = list(leaves)
    for members in groups.values():
        if len(members) == 1:
            leaf = leaves[members[0]]
            copies[members[0]] = (
                _C.empty_placed(leaf, leaf.device).copy_(leaf)
                if differentiable
                else _C.plain_copy(leaf)
            )
        else:
            for i, copy in zip(
                members, _copied_together([leaves[i] for i in members], differentiable), strict=True
            ):
                copies[i] = copy
    return copies


def _copied_together(tensors: list[torch.Tensor], differentiable: bool) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one storage) as views of one buffer, laid out as they are in it.

    The bytes from the first tensor's to the end of the last one's are copied at once. With
    ``differentiable``, the tensors that require grad (of one dtype) are views of one typed
    base whose history leads back to them; the others are plain views of the same memory."""
    starts = [int(t.storage_offset()) * t.element_size() for t in tensors]
    first = min(starts)
    stop = max(s + _span(t) * t.element_size() for s, t in zip(starts, tensors, strict=True))
    source = tensors[0]
    region = torch.empty(0, dtype=torch.uint8, device=source.device)
    region.set_(source.untyped_storage(), first, (stop - first,), (1,))
    buffer = _C.empty_placed(region, region.device)
    with torch.no_grad():
        buffer.copy_(region)
    storage, skew = buffer.untyped_storage(), buffer.storage_offset() - first

    def on_buffer(t: torch.Tensor, start: int) -> torch.Tensor:
        view = torch.empty(0, dtype=t.dtype, device=t.device)
        return view.set_(storage, (skew + start) // t.element_size(), t.shape, t.stride())

    copies = [on_buffer(t, start) for t, start in zip(tensors, starts, strict=True)]
    graded = [i for i, t in enumerate(tensors) if differentiable and t.requires_grad]
    if not graded:
        return copies
    dtypes = {tensors[i].dtype for i in graded}
    if len(dtypes) > 1:
        raise ValueError(
            "tensors of different dtypes that require grad share memory in a layer's input "
            f"({', '.join(str(d) for d in sorted(dtypes, key=str))}); RoundPipe cannot keep "
            "them shared through the recompute: pass one of them and view it in the layer"
        )
    dtype = dtypes.pop()
    item = torch.empty(0, dtype=dtype).element_size()
    base = torch.empty(0, dtype=dtype, device=source.device)
    base.set_(storage, 0, (storage.nbytes() // item,), (1,))

    def on_base(i: int) -> torch.Tensor:
        t = tensors[i]
        return base.as_strided(t.shape, t.stride(), (skew + starts[i]) // item)

    for i in graded:
        target, value = on_base(i), tensors[i]
        # The bytes are there already: the copy gives the base its history. An expanded
        # tensor (stride 0) is written through one element of each repeated dimension.
        for dim in range(value.dim()):
            if value.stride(dim) == 0 and value.size(dim) > 1:
                target, value = target.narrow(dim, 0, 1), value.narrow(dim, 0, 1)
        target.copy_(value)
    for i in graded:
        copies[i] = on_base(i)
    return copies


def unshared(saved: Any, passed: Any) -> Any:
    """``saved`` with a private copy of every tensor that is also ``passed`` to a layer (virtual
    CPU devices, or inputs already on the device): whatever the layer does to its input, the
    recompute must see what the forward saw. Copies are laid out, placed and aliased as their
    originals (:func:`copies_of`), so that the recompute computes and rounds as the forward did."""
    saved_leaves, spec = flatten(saved)
    passed_leaves, _ = flatten(passed)
    chosen = [_shares_memory(a, b) for a, b in zip(saved_leaves, passed_leaves, strict=True)]
    copies = copies_of(saved_leaves, chosen, differentiable=False)
    for i, wanted in enumerate(chosen):
        if wanted and saved_leaves[i].requires_grad:
            copies[i].requires_grad_(True)
    return unflatten(copies, spec)


def writable(inputs: Any, saved: Any = None) -> Any:
    """What the first layer of a fused or recomputed stage receives: ``inputs`` with copies of
    the leaves that require grad (so an in-place first layer, ``ReLU(inplace=True)``, does not
    modify an autograd leaf; gradients still reach the leaves) and of those sharing memory with
    ``saved`` (a second backward with ``retain_graph`` recomputes from it again). Copies are
    laid out, placed and aliased as the leaves (:func:`copies_of`)."""
    leaves, spec = flatten(inputs)
    saved_leaves = flatten(saved)[0] if saved is not None else [None] * len(leaves)
    chosen = [
        isinstance(leaf, torch.Tensor) and (leaf.requires_grad or _shares_memory(leaf, kept))
        for leaf, kept in zip(leaves, saved_leaves, strict=True)
    ]
    if not any(chosen):
        return inputs
    return unflatten(copies_of(leaves, chosen, differentiable=True), spec)


__all__ = [
    "copies_of",
    "detach_leaf",
    "flatten",
    "on_cuda",
    "to_device",
    "to_host",
    "to_output_device",
    "unflatten",
    "unshared",
    "writable",
]
