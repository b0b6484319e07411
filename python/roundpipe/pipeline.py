"""The pipelined execution of one call of one model.

A call (:class:`Call`) runs a sequence of *stages* itself: forward stages, then (for
``forward_backward``) the fused last stage that runs forward + loss + backward without recompute,
then backward stages that recompute their layers from saved inputs and backpropagate. Every stage
runs all microbatches on one device taken round-robin from the pool (the cursor continues across
calls and models); while a stage computes, the next stage's parameters are already being uploaded
to its device by that device's copy engine. Stage ``s`` of microbatch ``m`` starts once stage
``s - 1`` of microbatch ``m`` is ready (CUDA: a device-side event wait; CPU devices: compute runs
in issue order on one thread, which also keeps the shared CPU generator's draws in forward order,
so recompute replays them).

Activations that a backward stage recomputes from are kept in host memory; gradients of a
backward stage accumulate in a flat device buffer and go back to the host arena in one
accumulation per dtype run, asynchronously.
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import itertools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from roundpipe import context
from roundpipe._native import _C
from roundpipe.context import annotate, run_param_hooks
from roundpipe.device import device_at, device_count, devices
from roundpipe.memory import ModelMemory
from roundpipe.scheduler import ModelExecutePlan, RunType
from roundpipe.tracing import StageTrace, stage_trace

if TYPE_CHECKING:
    from roundpipe.distributed import DataParallel
    from roundpipe.timer import Action, ModelTimer

Phase = Literal["forward", "recompute", "backward", "loss"]
StageKind = Literal["forward", "fused", "backward"]
# How the hooks registered on trained parameters (``param.register_hook``) run in a stage.
# "shared": the device copies share them, so the engine runs them per backward pass of each
# microbatch (forward_backward, plain PyTorch's per-microbatch loop). "on_sums": once, on the
# stage's sum over the microbatches (the backward of a forward(), one pass over them all:
# :meth:`ResidentStage.run_hooks_on_sums`). "later": not in the stage; the gradients are summed
# over the backward pass (it goes through several forward() calls, or a tied weight has hooks),
# whose end runs them on the sums (roundpipe.gradients.GradientState.accumulating_in_pass).
ParamHooks = Literal["shared", "on_sums", "later"]

_round_robin = itertools.count()


def _next_device() -> int:
    """The device of the next stage: round-robin over the pool, across calls and models."""
    return next(_round_robin) % device_count()


# --------------------------------------------------------------------------------------------
# Transfers
# --------------------------------------------------------------------------------------------


def _on_cuda() -> bool:
    return _C.device_kind() == "cuda"


def to_device(tree: Any, device_index: int, after: Any = None) -> Any:
    """``tree`` with its tensors on device ``device_index`` (identity on virtual CPU devices).

    On CUDA the copies run on the activation lane and the device's current stream is made to wait
    for them. A copy from another device follows what was issued there so far; a copy from the
    host follows ``after`` (the event of the copy that filled that host memory, if any).
    """
    if not _on_cuda():
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
    if not _on_cuda():
        leaves, spec = _flatten(tree)
        return _unflatten([_detach_leaf(leaf) for leaf in leaves], spec), None
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


def _to_output_device(values: list[Any], device: torch.device) -> tuple[list[Any], list[Any]]:
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


# --------------------------------------------------------------------------------------------
# NVTX ranges (docs/profiling.md)
# --------------------------------------------------------------------------------------------


@functools.cache
def _nvtx_usable() -> bool:
    """Whether this torch can emit NVTX ranges (a CUDA build)."""
    try:
        torch.cuda.nvtx.range_push("roundpipe")  # type: ignore[no-untyped-call]
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError):
        return False
    return True


def _nvtx_enabled() -> bool:
    """Whether a call marks NVTX ranges: on CUDA devices, where a profiler may record them (with
    none attached a range costs next to nothing); never on virtual CPU devices."""
    return _on_cuda() and _nvtx_usable()


@contextmanager
def _nvtx_range(name: str) -> Iterator[None]:
    torch.cuda.nvtx.range_push(name)  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


def _marked(
    model: str | None, kind: str, layers: range, microbatch: int | None = None
) -> AbstractContextManager[Any]:
    """The NVTX range ``roundpipe/<model>/<kind>/L<first>[-<last>][/mb<microbatch>]``; nothing
    when ``model`` is None (ranges off)."""
    if model is None:
        return nullcontext()
    label = f"L{layers.start}" if len(layers) == 1 else f"L{layers.start}-{layers.stop - 1}"
    name = f"roundpipe/{model}/{kind}/{label}"
    return _nvtx_range(name if microbatch is None else f"{name}/mb{microbatch}")


# --------------------------------------------------------------------------------------------
# Stage residency
# --------------------------------------------------------------------------------------------


def _device_guard(device: torch.device) -> AbstractContextManager[Any]:
    """``device`` made the current CUDA device (for code that launches on the current device:
    Triton kernels, ``device="cuda"`` factories, ``torch.cuda.current_stream()``)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()


def _buffer_to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A working copy of a module buffer on ``device``. On CUDA it goes through page-locked
    memory, so the upload is asynchronous on the current stream (torch's host allocator keeps
    that memory until the copy ran)."""
    if device.type != "cuda":
        return host.clone()
    staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staging.copy_(host)
    return staging.to(device, non_blocking=True)


class ResidentStage:
    """A stage's parameters (and gradient buffer, for backward) resident on one device.

    On a virtual CPU device the stage computes in host memory anyway, so frozen parameters (see
    :attr:`ParamSlot.frozen`: nothing of RoundPipe writes them) are bound as they are, as plain
    PyTorch computes with them, instead of being copied into the stage's buffer: a frozen base
    model (LoRA) then costs no stage memory at all. Parameters that train are copied: the weight
    writer may be writing the next step's values into the arena while the stage computes.

    A backward stage's gradient buffer starts from zero, or, with ``grads_from_arena``, from the
    gradients that earlier calls accumulated in the host arena, which its download then replaces:
    each microbatch's gradients are then added to them in turn, as plain PyTorch adds each
    backward's into ``.grad`` (adding the call's sum instead would round differently).

    ``model``: the model's name, for errors; ``nvtx_model``: the model's name when its upload
    and download are marked as NVTX ranges. ``hooks``: how the hooks registered on trained
    parameters run (:data:`ParamHooks`). ``grad_arena``: the host arena the gradients go to (None:
    the model's)."""

    buffer: torch.Tensor  # the parameters, as laid out in the arena
    uploaded: Any  # the event of the upload
    views: list[torch.Tensor]  # one per parameter, in the arena's order
    grad_buffer: torch.Tensor | None  # backward stages: the gradients, as laid out in the arena
    reach: Any  # backward stages: which trained parameters a backward reached (_C.GradReach)

    def __init__(
        self,
        memory: ModelMemory,
        layers: range,
        device_index: int,
        with_grads: bool,
        model: str,
        nvtx_model: str | None = None,
        grads_from_arena: bool = False,
        hooks: ParamHooks = "shared",
        grad_arena: torch.Tensor | None = None,
    ) -> None:
        self.memory, self.layers, self.device_index = memory, layers, device_index
        self.model, self.nvtx_model = model, nvtx_model
        self.grads_from_arena = grads_from_arena and with_grads
        self.hooks, self.grad_arena = hooks, grad_arena
        self.trace: StageTrace | None = None  # set while a timeline trace is recorded
        self.layout = layout = memory.stage_layout(layers)
        device = device_at(device_index)
        in_host = device.type == "cpu"
        # On a virtual CPU device the frozen parameters are bound in host memory: their pages of
        # the buffer are never written, so they cost no memory.
        frozen = layout.frozen() if in_host else ()
        fence = memory.fence(layers)
        with _marked(nvtx_model, "upload", layers):
            # One native call: the buffers, the copies of the stage's byte runs of the arena (in
            # order on the parameter lane: the last one's event covers the stage), the
            # parameters' views and the gradient views attached to those that train. The views
            # require grad as the parameters do, also in forward stages (run without grad): a
            # layer that checks `p.requires_grad` sees what it would see on the parameter itself.
            # With gradients also which trained parameters a backward reaches (see
            # reached_params).
            self.buffer, uploaded, self.views, self.grad_buffer, self.reach = _C.upload_stage(
                device_index,
                device,
                memory.params,
                layout.param_begin,
                layout.param_end,
                layout.param_runs(frozen) if memory.params is not None else [],
                fence,
                layout.offsets,
                layout.params,
                with_grads,
                layout.grad_begin,
                layout.grad_end,
                layout.grad_offsets,
                layout.trained,
                self._grad_arena() if self.grads_from_arena else None,
            )
            self.uploaded = uploaded if uploaded is not None else self._upload_sources(fence)
        if with_grads:
            self._forward_tensor_hooks(share=hooks == "shared")
        # The frozen parameters bound in host memory, each a `.data` alias with a version counter
        # of its own, so an in-place change by the layer shows (see `bound`): (slot index, the
        # tensor bound).
        self.in_host: list[tuple[int, torch.Tensor]] = []
        for i in frozen:
            self.views[i] = layout.params[i].data
            self.in_host.append((i, self.views[i]))

    def _forward_tensor_hooks(self, share: bool) -> None:
        """Hooks registered on a trained parameter (``param.register_hook``) run on the
        gradients its device copy receives, as they would on the parameter's own: with
        ``share``, the copy shares the parameter's hook dictionary (hooks added later apply
        too), else they run on sums (see :data:`ParamHooks`). A hook run after accumulation
        (``register_post_accumulate_grad_hook``) is passed the tensor whose ``.grad`` was
        accumulated, which here is not the parameter: refused. So are shared hooks of a
        parameter that several layers use (tied weights): each use's copy would run them on its
        part of the gradient, where plain PyTorch runs them once, on the sum."""
        params, views = self.layout.params, self.views
        for i in self.layout.trained:
            param = params[i]
            if param._post_accumulate_grad_hooks:
                owner, attribute = self.layout.slots[i].owners[0]
                raise RuntimeError(
                    f"RoundPipe model '{self.model}': parameter {attribute} of layer "
                    f"{self.layout.layer_of[i]} ({type(owner).__name__}) has a hook registered "
                    "with register_post_accumulate_grad_hook, which RoundPipe cannot run (its "
                    "gradients accumulate in a device copy, then in host memory); remove it "
                    "and act on the gradients in step_fn"
                )
            hooks = param._backward_hooks
            if hooks and self.layout.slots[i].borrowed:
                _, module, name = self._param_name(i)
                raise RuntimeError(
                    f"RoundPipe model '{self.model}': parameter '{name}' of layer "
                    f"{self.layout.layer_of[i]} ({type(module).__name__}) is shared with "
                    "another RoundPipe part and has a hook registered with register_hook, "
                    "which would run on each part's share of its gradient instead of once on "
                    "the sum; remove the hook and act on the gradient in step_fn"
                )
            if hooks and share and id(param) in self.memory.tied:
                _, module, name = self._param_name(i)
                raise RuntimeError(
                    f"RoundPipe model '{self.model}': parameter '{name}' of layer "
                    f"{self.layout.layer_of[i]} ({type(module).__name__}) is used by several "
                    "layers and has a hook registered with register_hook: forward_backward "
                    "computes each use's gradient in its own stage, so the hook would run on "
                    "each part instead of once on their sum. Call the model and backward() "
                    "instead (one pass, which runs it on the sum), or act on the gradient in "
                    "step_fn"
                )
            if hooks and share:
                views[i]._backward_hooks = hooks

    def run_hooks_on_sums(self) -> None:
        """Run the hooks of each trained parameter this stage's backward reached on its
        gradient, the sum over the microbatches (the backward of a ``forward()`` is one pass
        over them all, in which plain PyTorch runs a parameter's hooks once, on its whole
        gradient); what a hook returns replaces it. Nothing for other stages: their copies
        share the hooks, or the end of the backward pass runs them (see :data:`ParamHooks`).
        The hooks run with the stage's device current, as its backward did."""
        if self.hooks != "on_sums":
            return
        with _device_guard(device_at(self.device_index)):
            self._run_hooks_on_sums()

    def _run_hooks_on_sums(self) -> None:
        layout = self.layout
        for j in self.reach.reached():
            i = layout.trained[j]
            param, grad = layout.params[i], self.views[i].grad
            if not param._backward_hooks or grad is None:
                continue
            try:
                result = run_param_hooks(param, grad)
            except Exception as error:
                index, module, name = self._param_name(i)
                where = (
                    f"RoundPipe model '{self.model}': a hook of parameter '{name}' of layer "
                    f"{index} ({type(module).__name__})"
                )
                raise annotate(error, where) from error
            if result is not grad:
                with torch.no_grad():
                    grad.copy_(result)

    def reached_params(self) -> list[int]:
        """``id`` of each trained parameter whose copy here received a gradient."""
        layout = self.layout
        return [id(layout.params[layout.trained[j]]) for j in self.reach.reached()]

    def _upload_sources(self, fence: Any) -> Any:
        """Without a parameter arena: each parameter copied into the buffer from its own storage
        (frozen ones too on CUDA; on a virtual CPU device those are bound in place); returns the
        event of the last copy."""
        begin, memory, device_index = self.layout.param_begin, self.memory, self.device_index
        if self.buffer.is_cuda:
            # Pageable sources: the engine's worker stages them through its page-locked bounce
            # buffers, so this thread goes on issuing compute meanwhile.
            sources = memory.param_sources(self.layers, skip_frozen=False)
            targets = [self.buffer[o - begin : o - begin + s.numel()] for o, s in sources]
            return _C.upload_pageable(
                device_index, targets, [source for _, source in sources], fence
            )
        # One copy per parameter, in order on the parameter lane as from the arena.
        uploaded = _C.record_event(device_index)
        for offset, source in memory.param_sources(self.layers, skip_frozen=True):
            target = self.buffer[offset - begin : offset - begin + source.numel()]
            uploaded = _C.copy_async(device_index, target, source, "parameter", fence)
        return uploaded

    @contextmanager
    def bound(self, keep_buffer_updates: bool, recomputed: bool) -> Iterator[None]:
        """Bind the layers' modules to the device copies while the stage computes, with the
        stage's device as the current CUDA device.

        ``recomputed``: the stage is a recompute, or a forward whose layers backward will
        recompute. A layer that then changes a frozen parameter bound in host memory in place
        would change it twice where plain PyTorch changes it once (a copy would lose the change
        instead): that is a ``RuntimeError`` at the end of the stage, naming layer and
        parameter. Without recompute (inference, the fused stage) the change stays, as in plain
        PyTorch.

        Buffers (BatchNorm statistics) are bound to device copies too, made from their host
        values after the buffer writes of earlier stages settled; with ``keep_buffer_updates``
        (forward passes) their new values are queued for writing back to the host buffers (see
        :meth:`ModelMemory.defer_buffer_write`; on CUDA the download is asynchronous), otherwise
        (recompute) they are dropped.
        """
        trace = self.trace
        device = device_at(self.device_index)
        memory = self.memory
        memory.settle_buffers(self.layers)
        bound_buffers: list[tuple[int, torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []
        with _device_guard(device):
            start = trace.mark() if trace is not None else None
            self.uploaded.block_current_stream(self.device_index)
            if trace is not None:
                trace.span("wait", start)
            layout, views = self.layout, self.views
            owners = layout.owner_modules, layout.owner_names
            # The device copies (plain tensors) stand in for the parameters. What was bound
            # before: the parameters, or an outer stage's copies when this stage is a nested
            # call of the same model (an inference call inside loss_fn), whose stage must compute
            # with its own copies again afterwards.
            before = _C.rebind_parameters(*owners, [views[i] for i in layout.owner_slots])
            try:
                buffers = layout.buffer_layers, layout.buffer_modules, layout.buffer_names
                for index, owner, name in zip(*buffers, strict=True):
                    host = owner._buffers[name]
                    assert host is not None
                    working = _buffer_to_device(host, device)
                    owner._buffers[name] = working
                    bound_buffers.append((index, owner, name, host, working))
                yield
                self._check_parameters_unchanged(keep_buffer_updates, recomputed)
                if keep_buffer_updates:
                    # Every bound buffer, changed or not: an update through `.data` leaves no
                    # trace in `_version`, and the download is asynchronous and small.
                    for index, _, _, host, working in bound_buffers:
                        memory.defer_buffer_write(index, host, *self._buffer_to_host(working))
            finally:
                _C.rebind_parameters(*owners, before)
                for _, owner, name, host, _ in bound_buffers:
                    owner._buffers[name] = host

    def _check_parameters_unchanged(self, forward: bool, recomputed: bool) -> None:
        """A layer that changed a parameter in place (``embedding_renorm_`` of an
        ``nn.Embedding(max_norm=...)``, a weight scaled under ``no_grad``) would make the change
        twice where it is recomputed (a frozen parameter bound in host memory) or lose it (a
        device copy, which is not written back), where plain PyTorch makes it once and keeps
        it: ``RuntimeError`` naming the layer and the parameter. Without recompute a frozen
        parameter bound in host memory keeps the change, as in plain PyTorch."""
        changed = _C.changed_in_place(self.views)
        if not changed:  # nearly always: nothing more to look at
            return
        in_host = {i for i, _ in self.in_host}
        for i in changed:
            if i in in_host and not recomputed:
                continue
            index, module, name = self._param_name(i)
            slot = self.layout.slots[i]
            phase = "forward" if forward else "recompute"
            kind = "trained" if slot.param.requires_grad else "frozen"
            why = (
                "backward recomputes the layer, so the change would be made twice where plain "
                "PyTorch makes it once (the parameter already holds the changed value)"
                if i in in_host
                else "the layer computes with a device copy of it, whose changes are not kept "
                "(plain PyTorch would keep the change)"
            )
            raise RuntimeError(
                f"RoundPipe model '{self.model}': layer {index} ({type(module).__name__}) changed "
                f"its {kind} parameter '{name}' in place during {phase}; {why}. Keep state that "
                "a layer's forward updates in a buffer (register_buffer: buffers advance once "
                "per forward pass, recompute leaves them unchanged), or change the parameter "
                "outside the layer's forward."
            )

    def _grad_arena(self) -> torch.Tensor:
        """The host arena the gradients go to (and, with ``grads_from_arena``, start from)."""
        return self.memory.grads if self.grad_arena is None else self.grad_arena

    def _param_name(self, i: int) -> tuple[int, torch.nn.Module, str]:
        """The layer index, the layer and the name in it of the stage's parameter ``i``."""
        index, slot = self.layout.layer_of[i], self.layout.slots[i]
        module = self.memory.layers[index].module
        owner, attribute = slot.owners[0]
        prefix = next(p for p, m in module.named_modules(remove_duplicate=False) if m is owner)
        return index, module, f"{prefix}.{attribute}" if prefix else attribute

    def _buffer_to_host(self, working: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """The host source of a buffer's write-back and the event after which it holds the
        values (None: already there)."""
        if not working.is_cuda:
            return working, None
        with torch.no_grad():
            staging = torch.empty(working.shape, dtype=working.dtype, pin_memory=True)
            staging.copy_(working, non_blocking=True)
        return staging, _C.record_event(self.device_index)

    def download_grads(self, only: Sequence[tuple[int, int]] | None = None) -> list[Any]:
        """Accumulate this stage's device gradients into the host arena (``only``: just the
        bytes in these disjoint, ordered ranges of the gradient arena), or copy them there when
        the buffer started from the arena's; returns the events.

        On CUDA the downloads go through the model's page-locked staging at the stage's own
        offsets (see :meth:`ModelMemory.download_staging`)."""
        assert self.grad_buffer is not None
        staging = self.memory.download_staging() if self.grad_buffer.is_cuda else None
        runs: Sequence[tuple[int, int, torch.dtype]] = self.layout.grad_runs
        if only is not None:
            clipped = [(max(b, lo), min(e, hi), t) for lo, hi in only for b, e, t in runs]
            runs = sorted((b, e, t) for b, e, t in clipped if b < e)
        with _marked(self.nvtx_model, "download", self.layers):
            events = _C.download_grads(
                self.device_index,
                self._grad_arena(),
                self.grad_buffer,
                self.layout.grad_begin,
                runs,
                staging,
                self.grads_from_arena,
            )
        if self.trace is not None and events:
            self.trace.transfer("grad_download", "gradient download", events[-1])
        return events


# --------------------------------------------------------------------------------------------
# One call
# --------------------------------------------------------------------------------------------


class _LoopClock:
    """Times the pieces of the stages one ``_LayerCalls`` runs for the model's timer (none: times
    nothing): the layers its ``_C.LayerLoop`` runs, and the backward passes (:meth:`start` /
    :meth:`stop`).

    Virtual CPU devices compute synchronously, so the host clock times them; on CUDA a piece is
    timed by events on the device's current stream, which the timer reads once they completed, so
    nothing waits for the GPU. Either way the times are handed to the timer once per run
    (:meth:`flush`), not once per layer x microbatch, and not at all when a full garbage
    collection ran meanwhile: its pause (a hundred milliseconds or more with torch loaded) would
    land in whichever layer was running, on the host clock and between a GPU's events alike, and
    mislead the planner for many calls."""

    def __init__(self, timer: ModelTimer | None, device_index: int, on_cuda: bool) -> None:
        self.timer = timer
        self.stream: torch.cuda.Stream | None = None
        if timer is not None and on_cuda:
            self.stream = torch.cuda.current_stream(device_at(device_index))
        self.times: list[tuple[range, Action, float]] = []
        self.events: list[tuple[range, Action, Any, Any]] = []
        self.collections = _full_collections()

    def start(self) -> Any:
        """The start of a piece (None without a timer)."""
        if self.timer is None:
            return None
        if self.stream is None:
            return time.perf_counter()
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record(self.stream)
        return start

    def stop(self, start: Any, layers: range, action: Action) -> None:
        """The time since ``start``, split evenly over ``layers``, recorded as ``action``."""
        if self.timer is None:
            return
        if self.stream is None:
            self.times.append((layers, action, time.perf_counter() - start))
            return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record(self.stream)
        self.events.append((layers, action, start, end))

    def flush(self, loop: Any, action: Action) -> None:
        """Hand the times taken to the timer: the pieces', and those ``loop`` (a
        ``_C.LayerLoop``) took of its layer runs, which did ``action``, and backward passes."""
        timer = self.timer
        if timer is None:
            return
        if self.stream is None:
            layers, seconds = loop.take_host_times()
            backward_layers, backward_seconds = loop.take_backward_host_times()
            if _full_collections() == self.collections:
                timer.record_layers(layers, action, seconds)
                timer.record_layers(backward_layers, "bwd", backward_seconds)
                if self.times:
                    timer.record_spans(self.times)
        else:
            marks = loop.take_device_times()
            backward_marks = loop.take_backward_device_times()
            if _full_collections() == self.collections:
                for layer, start, end in marks:
                    timer.record_later(range(layer, layer + 1), action, start, end)
                for piece in self.events:
                    timer.record_later(*piece)
                for a, b, start, end in backward_marks:
                    timer.record_later(range(a, b), "bwd", start, end)
        self.times, self.events = [], []
        self.collections = _full_collections()


_collections = [0]  # full garbage collections so far (see _count_full_collections)


def _count_full_collections(phase: str, info: dict[str, int]) -> None:
    if phase == "start" and info["generation"] == 2:
        _collections[0] += 1


gc.callbacks.append(_count_full_collections)


def _full_collections() -> int:
    """How many full (generation 2) garbage collections this process has begun (a gc callback
    counts them: ``gc.get_stats`` builds its dictionaries on every call)."""
    return _collections[0]


@dataclass(frozen=True)
class Stage:
    """One stage of a call: what it runs (``kind``) over which layers."""

    kind: StageKind
    layers: range


@dataclass
class LossSpec:
    """The fused stage's loss: per-microbatch labels, the loss function, and whether the
    outputs are kept for the caller."""

    labels: list[Any]
    loss_fn: Callable[[Any, Any], Any]
    keep_outputs: bool


def _flatten(tree: Any) -> tuple[list[Any], Any]:
    """``tree_flatten``, with a lone plain tensor (what passes between layers nearly always) taken
    as its own leaf without pytree's type dispatch, which costs about a microsecond a call on the
    per layer x microbatch path of layer-grain recompute. Rebuild with :func:`_unflatten`."""
    if type(tree) is torch.Tensor:
        return [tree], None
    return tree_flatten(tree)


def _unflatten(leaves: list[Any], spec: Any) -> Any:
    """The tree of ``leaves`` for a ``spec`` of :func:`_flatten`."""
    return leaves[0] if spec is None else tree_unflatten(leaves, spec)


def _grads_of(tree: Any) -> list[torch.Tensor | None]:
    """Gradients of ``tree``'s leaves in ``tree_flatten`` order, None where a leaf got none.

    Kept flat, never rebuilt into ``tree``'s type: some pytree types (Hugging Face
    ``ModelOutput``) drop ``None`` fields when rebuilt, which would misalign the leaves."""
    return [
        leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
        for leaf in _flatten(tree)[0]
    ]


def _backward(outputs: Any, grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grads`` (one per leaf of ``outputs``, None where absent)."""
    pairs = [
        (o, g)
        for o, g in zip(_flatten(outputs)[0], grads, strict=True)
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    if pairs:
        # Natively: torch.autograd.backward's Python entry costs a third of a small layer's
        # backward, paid per layer x microbatch in layer grain (see csrc/bindings/dispatch.cpp).
        _C.backward([o for o, _ in pairs], [g for _, g in pairs])


@dataclass
class LayerRunner:
    """What a call needs from its model: the layers, their memory, name and timer, and the
    data-parallel replica set when it reduces gradients at the end of each backward stage."""

    name: str
    layers: list[torch.nn.Module]  # a list: what the native layer loop indexes
    memory: ModelMemory
    timer: ModelTimer | None
    stage_reduce: DataParallel | None = None
    # The data-parallel replica set of a model with buffers: every training call ends with
    # rank 0's buffers on every rank (DataParallel.broadcast_buffers).
    replica_buffers: DataParallel | None = None


@dataclass
class Call:
    """One pipelined call of one model: it runs its stages (:meth:`forward`, :meth:`backward`,
    :meth:`forward_backward`) and holds their state: saved inputs, RNG states, the transfers in
    flight (``pending``) and the fused stage's losses and outputs."""

    runner: LayerRunner
    plan: ModelExecutePlan
    run_type: RunType
    num_microbatch: int
    recompute_grain: str
    preserve_rng_state: bool
    saving: bool = field(init=False)  # keep what backward stages need (grads on)
    backward_starts: set[int] = field(default_factory=set)
    # (inputs, event of their copy to the host or None) per (first layer, microbatch), for those
    # not in kept_inputs.
    saved_inputs: dict[tuple[int, int], tuple[Any, Any]] = field(default_factory=dict)
    # The inputs kept natively: lone tensors on virtual CPU devices (see _C.KeptInputs).
    kept_inputs: Any = field(init=False, default=None)
    # Every random draw of layer l for microbatch m comes from a generator seeded with
    # (rng_seed, l, m): the same whatever the plan, stage boundaries, device or device count.
    rng_seed: int = field(default_factory=lambda: _draw_call_seed())
    recompute_store: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    # Transfer events of inputs packed by an upstream RoundPipe, per microbatch.
    input_events: list[list[Any]] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    # The fused stage's outputs (if kept) on the output device, and the events of their copies.
    outputs: list[Any] = field(default_factory=list)
    output_events: list[Any] = field(default_factory=list)
    # Whether this call marks NVTX ranges and runs on CUDA devices (decided once per call).
    nvtx: bool = field(init=False, default_factory=_nvtx_enabled)
    on_cuda: bool = field(init=False, default_factory=_on_cuda)
    # Whether the data-parallel ranks agreed on this call's backward stages (stage reduces).
    reduce_agreed: bool = field(init=False, default=False)
    # Whether the host arena holds gradients of earlier calls when this call's backward stages
    # run (set by roundpipe.gradients.GradientState.accumulating).
    grads_in_arena: bool = field(init=False, default=False)
    # False: a backward that wants the inputs' gradients only (torch.autograd.grad), so the
    # parameters' are not downloaded.
    keep_param_grads: bool = field(init=False, default=True)
    # The backward of a forward() whose output a downstream model's forward_backward consumed
    # (chained with merge_output=False): one pass per microbatch there, so its gradients are
    # added one microbatch after the other, in order, onto the arena's, as forward_backward's
    # own (set by roundpipe.autograd.PipelineNode.run_backward).
    microbatch_passes: bool = field(init=False, default=False)
    # The backward of a forward() in a backward pass whose gradients are summed before they are
    # added (several forward() calls, a tied weight's hooks): they go into this arena of the
    # pass, whose sums are added to the model's when the pass ends (set by
    # roundpipe.gradients.GradientState.accumulating_in_pass).
    pass_arena: torch.Tensor | None = field(init=False, default=None)
    # ``id`` of each trained parameter a backward stage of this call gave a gradient (with
    # stage reduces: every trained parameter of those stages, as some rank may have).
    reached: set[int] = field(init=False, default_factory=set)
    # The CPU generator states the forward stages' layers were seeded with, for their recompute.
    rng_states: Any = field(init=False, default=None)
    # The layer calls of the run in progress, one per kind and device (see _layer_calls).
    layer_calls: dict[tuple[bool, bool, bool, int], _LayerCalls] = field(
        init=False, default_factory=dict
    )

    def __post_init__(self) -> None:
        self.saving = self.run_type != "infer"
        if self.saving:
            self.kept_inputs = _C.KeptInputs(len(self.runner.layers), self.num_microbatch)
        if self.saving and self.preserve_rng_state:
            self.rng_states = _C.RngStates(len(self.runner.layers), self.num_microbatch)
        if self.run_type == "train":
            self._plan_saving(self.plan.bwd_plan)
        elif self.run_type == "fused":
            self._plan_saving(self.plan.bwd_plan[1:])

    # -- running the stages ------------------------------------------------------------------

    def forward(
        self, inputs: list[Any], output_device: torch.device
    ) -> tuple[list[Any], list[Any]]:
        """The forward stages over the per-microbatch ``(args, kwargs)``; returns the outputs on
        ``output_device`` and the events of their copies (None where nothing is in flight)."""
        outputs = self.run([Stage("forward", layers) for layers in self.plan.fwd_plan], inputs)
        if self.saving:
            for m, value in enumerate(outputs):
                self._check_output(m, value)
        return _to_output_device(outputs, output_device)

    def backward(self, grads: list[Any]) -> list[Any]:
        """Recompute + backward stages from the output gradients (one list of leaf gradients per
        microbatch); returns the input gradients in the same form."""
        return self.run([Stage("backward", layers) for layers in self.plan.bwd_plan], grads)

    def forward_backward(
        self, inputs: list[Any], loss: LossSpec, output_device: torch.device
    ) -> list[Any]:
        """Forward, fused loss + backward, then backward stages; returns the input gradients and
        leaves the losses (and the outputs on ``output_device``, if kept) in ``losses`` /
        ``outputs``."""
        stages = (
            [Stage("forward", layers) for layers in self.plan.fwd_plan]
            + [Stage("fused", self.plan.bwd_plan[0])]
            + [Stage("backward", layers) for layers in self.plan.bwd_plan[1:]]
        )
        grads = self.run(stages, inputs, loss)
        self.outputs, self.output_events = _to_output_device(self.outputs, output_device)
        return grads

    def run(
        self, stages: Sequence[Stage], values: list[Any], loss: LossSpec | None = None
    ) -> list[Any]:
        """Run ``stages`` in order, each with its parameters resident on its device and the next
        one's upload already issued; ``values`` are the per-microbatch inputs of the first.

        Every upload issued is waited for before returning (also on errors), so no copy into or
        out of a freed buffer is left in flight, and the layers' buffers hold their new values.
        """
        memory = self.runner.memory
        # forward_backward is the per-microbatch loop, one backward per microbatch: its gradient
        # buffers start from the arena's gradients, so that the layers add each microbatch's to
        # them in turn, as plain PyTorch adds each backward's into .grad. (The backward of a
        # forward() is one backward pass: plain PyTorch adds its sum once, and so do we. Stage
        # reduces sum the call's own gradients over the ranks.) A backward pass through several
        # forward() calls sums them in the pass's arena: each call's microbatches add to what
        # the calls before it left there, as the engine sums a gradient over the whole pass.
        passes = self.run_type == "fused" or self.microbatch_passes
        from_arena = self.pass_arena is not None or (
            self.grads_in_arena and passes and self.runner.stage_reduce is None
        )
        hooks: ParamHooks = "shared"
        if not passes:  # the backward of a forward(): one pass
            hooks = "on_sums" if self.pass_arena is None else "later"
        uploads = _Uploads(
            memory, stages, self.runner.name, self.nvtx, from_arena, hooks, self.pass_arena
        )
        with _rng_scope(), uploads:
            try:
                for stage in stages:
                    # No reference to a stage outlives its turn: its device buffers are freed
                    # before the upload after next is allocated.
                    values = self._run_stage(stage.kind, uploads.next(), values, loss)
                # The layer times go to the timer once the run succeeded (a failed run's are
                # incomplete: none are kept).
                for calls in self.layer_calls.values():
                    calls.clock.flush(calls.loop, calls.action)
            finally:
                self.layer_calls.clear()
                memory.settle_buffers()
        replicas = self.runner.replica_buffers
        if replicas is not None and self.saving and stages[0].kind != "backward":
            try:
                replicas.broadcast_buffers()
            except Exception as error:
                where = f"RoundPipe model '{self.runner.name}': data-parallel buffer broadcast"
                raise annotate(error, where) from error
        return values

    def _run_stage(
        self, kind: StageKind, resident: ResidentStage, values: list[Any], loss: LossSpec | None
    ) -> list[Any]:
        if kind == "forward":
            return self.forward_stage(resident, values)
        if kind == "fused":
            assert loss is not None
            return self.fused_stage(resident, values, loss)
        return self.backward_stage(resident, values)

    def _plan_saving(self, backward_stages: Sequence[range]) -> None:
        """Decide which layer inputs the backward stages will recompute from."""
        if self.recompute_grain == "layer":
            self.backward_starts = {i for stage in backward_stages for i in stage}
        else:
            self.backward_starts = {stage.start for stage in backward_stages}

    # -- layer calls -------------------------------------------------------------------------

    def _layer_calls(
        self, stage: ResidentStage, recompute: bool, recomputed: bool = False, cut: bool = False
    ) -> _LayerCalls:
        """The layer calls of ``stage`` (see :class:`_LayerCalls` for the flags): one object per
        kind and device for the whole run, as building one per stage is measurable host work at
        short sequences; its times are handed to the timer at the end of the run. It holds no
        reference to the stage, whose buffers are freed after its turn."""
        key = (recompute, recomputed, cut, stage.device_index)
        calls = self.layer_calls.get(key)
        if calls is None:
            calls = _LayerCalls(self, stage.device_index, recompute, recomputed, cut)
            self.layer_calls[key] = calls
        return calls

    def _where(self, layers: int | range, phase: Phase, microbatch: int) -> str:
        """Who failed: one layer, or, for the backward of a stage (one autograd pass, whose
        failing node cannot be told apart), the stage's range of layers; never a guess."""
        if isinstance(layers, int):
            layers = range(layers, layers + 1)
        types = ", ".join(type(self.runner.layers[i]).__name__ for i in layers)
        who = (
            f"layer {layers.start} ({types})"
            if len(layers) == 1
            else f"one of layers {layers.start}-{layers.stop - 1} ({types})"
        )
        return (
            f"RoundPipe model '{self.runner.name}': {who} failed in {phase} of microbatch "
            f"{microbatch}"
        )

    def _mark(
        self, kind: str, layers: range, microbatch: int | None = None
    ) -> AbstractContextManager[Any]:
        """The NVTX range of ``kind`` over ``layers`` (see :func:`_marked`) if the call marks."""
        if not self.nvtx:
            return _NO_RANGE
        return _marked(self.runner.name, kind, layers, microbatch)

    def _model_input(self, microbatch: int, value: Any, device_index: int) -> Any:
        """Microbatch ``microbatch`` of the call's inputs on the device, once the upstream
        model's transfers of it (if any) have landed: ordered per microbatch on the device (no host
        wait on CUDA), so the first microbatches start while later ones are still in flight."""
        with self._mark("activation", range(0, 1), microbatch):
            return self._joined_input(microbatch, value, device_index)

    def _joined_input(self, microbatch: int, value: Any, device_index: int) -> Any:
        events = self.input_events[microbatch] if self.input_events else []
        if not self.on_cuda:
            for event in events:
                event.synchronize()
            return value
        if not events:
            return to_device(value, device_index)
        if len(events) == 1:
            return to_device(value, device_index, events[0])
        # Joined on the device, not on the host: the current stream waits for each (a host wait
        # only where a transfer's host part is still running) and an event recorded after those
        # waits orders the uploads.
        for event in events:
            event.block_current_stream(device_index)
        return to_device(value, device_index, _C.record_event(device_index))

    # -- stages ------------------------------------------------------------------------------

    def forward_stage(self, stage: ResidentStage, activations: list[Any]) -> list[Any]:
        outputs, trace = [], stage.trace
        # A training call's forward runs in grad mode, as plain PyTorch's (layers may branch on
        # it, kernels choose their path by requires_grad); each layer's output is cut from its
        # graph, which the recompute builds again.
        run = self._layer_calls(stage, recompute=False, recomputed=self.saving, cut=self.saving)
        grad_mode = torch.enable_grad() if self.saving else torch.no_grad()
        # The layers whose inputs backward recomputes from (layer 0's, the user's own, are kept
        # as they came in, below).
        kept = (
            [i for i in stage.layers if i > 0 and i in self.backward_starts] if self.saving else []
        )
        # Lone tensors are kept natively (a private copy) where keeping needs nothing more: on
        # virtual CPU devices, with no timeline or NVTX ranges to record. There one native call
        # runs every microbatch (activations need no move), past layer 0: its inputs, the call's
        # own, are kept right before each microbatch runs (a layer may change a tensor that
        # several microbatches share).
        native = not self.on_cuda and trace is None and not self.nvtx
        store = self.kept_inputs if native else None
        keeper = functools.partial(self._keep_input, stage)
        with stage.bound(keep_buffer_updates=True, recomputed=self.saving), grad_mode:
            if native and stage.layers.start > 0:
                return run.keeping(stage.layers, 0, activations, kept, store, keeper)
            for m, value in enumerate(activations):
                start = trace.mark() if trace is not None else None
                value = self._stage_input(stage, m, value)
                outputs.append(run.keeping(stage.layers, m, [value], kept, store, keeper)[0])
                if trace is not None:
                    trace.span("forward", start, m)
        return outputs

    def _stage_input(self, stage: ResidentStage, microbatch: int, value: Any) -> Any:
        """The input of a forward stage for ``microbatch`` on its device; the call's own, for
        layer 0, is kept for the backward pass as it came in (``requires_grad`` flags included:
        chained models)."""
        if stage.layers.start == 0:
            moved = self._model_input(microbatch, value, stage.device_index)
            if self.saving and 0 in self.backward_starts:
                self.saved_inputs[(0, microbatch)] = (_unshared(value, moved), None)
            return moved
        with self._mark("activation", stage.layers[:1], microbatch):
            return to_device(value, stage.device_index)

    def _keep_input(self, stage: ResidentStage, layer: int, microbatch: int, value: Any) -> None:
        """Keep the input of ``layer`` for the backward pass: in host memory, private (whatever
        the layer does to its input), with the event of its copy (None: already there)."""
        with self._mark("activation", range(layer, layer + 1), microbatch):
            host, event = to_host(value, stage.device_index)
        saved = _unshared(host, value)
        # Leaves requiring grad as the input's did: so do the recompute's (see
        # _differentiable_input).
        for kept, leaf in zip(_flatten(saved)[0], _flatten(value)[0], strict=True):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and not kept.requires_grad:
                kept.requires_grad_(True)
        if event is not None:
            # The backward stage, maybe on another device, uploads it after the copy landed.
            self.pending.append(event)
            if stage.trace is not None:
                stage.trace.transfer("activation", "activation", event, microbatch)
        self.saved_inputs[(layer, microbatch)] = (saved, event)

    def _saved_input(self, layer: int, microbatch: int) -> tuple[Any, Any]:
        """The input kept for ``layer``'s recompute and the event of its copy to the host."""
        saved = self.saved_inputs.get((layer, microbatch))
        if saved is not None:
            return saved
        kept = self.kept_inputs.find(layer, microbatch)
        if kept is None:
            raise KeyError((layer, microbatch))  # the plan's backward_starts say it was kept
        return kept, None

    def fused_stage(
        self, stage: ResidentStage, activations: list[Any], loss_spec: LossSpec
    ) -> list[Any]:
        """Forward + loss + backward of the last stage; returns the input grads and appends to
        ``losses`` (and ``outputs``, if kept)."""
        grads, trace = [], stage.trace
        run = self._layer_calls(stage, recompute=False)
        with stage.bound(keep_buffer_updates=True, recomputed=False), torch.enable_grad():
            for m, value in enumerate(activations):
                start_mark = trace.mark() if trace is not None else None
                first, device = stage.layers.start, stage.device_index
                inputs = self._differentiable_input(first, m, value, device)
                result = run(stage.layers, m, _writable(inputs))
                label = to_device(loss_spec.labels[m], stage.device_index)
                try:
                    loss = loss_spec.loss_fn(result, label)
                except Exception as error:
                    where = (
                        f"RoundPipe model '{self.runner.name}': loss_fn failed on the output "
                        f"of layer {stage.layers.stop - 1} for microbatch {m}"
                    )
                    raise annotate(error, where) from error
                _check_loss(loss, self.runner.name, m)
                start = run.clock.start()
                try:
                    with self._mark("backward", stage.layers, m):
                        if isinstance(loss, torch.Tensor):
                            torch.autograd.backward(loss)
                        else:
                            torch.autograd.backward(list(loss))
                except Exception as error:
                    raise annotate(error, self._where(stage.layers, "backward", m)) from error
                run.clock.stop(start, stage.layers, "bwd")
                self.losses.append(tree_map(lambda t: t.detach(), loss))
                if loss_spec.keep_outputs:
                    self.outputs.append(tree_map(_detach_leaf, result))
                grads.append(_grads_of(inputs))
                if trace is not None:
                    trace.span("fused", start_mark, m)
        self.pending.extend(self._download_grads(stage))
        return grads

    def backward_stage(self, stage: ResidentStage, grads: list[Any]) -> list[Any]:
        """Recompute + backward of one backward stage for every microbatch; returns input grads."""
        run = self._layer_calls(stage, recompute=True)
        per_layer = self.recompute_grain == "layer"
        # The layers recomputed natively: not layer 0 (it takes the user's (args, kwargs)), and
        # none while a timeline or NVTX ranges mark each microbatch.
        native = range(max(stage.layers.start, 1), stage.layers.stop)
        if (not per_layer and stage.layers.start == 0) or stage.trace is not None or self.nvtx:
            native = range(0)
        # The backward of a forward() is one backward pass over every microbatch's graph, whose
        # gradients plain PyTorch's engine sums last microbatch first (its nodes came last); the
        # backward of forward_backward (and of a forward() it consumed) is one pass per
        # microbatch, in order.
        order = range(len(grads))
        if self.run_type == "train" and not self.microbatch_passes:
            order = order[::-1]
        with stage.bound(keep_buffer_updates=False, recomputed=True):
            new_grads = None
            if native == stage.layers:  # the whole stage natively, for every microbatch at once
                new_grads = self._recompute_backward_kept(stage, order, grads, run)
            if new_grads is None:
                new_grads = [None] * len(grads)
                for m in order:
                    new_grads[m] = self._recompute_backward_microbatch(
                        stage, native, m, grads[m], run
                    )
        if self.keep_param_grads:
            self.pending.extend(self._download_grads(stage))
        return new_grads

    def _recompute_backward_microbatch(
        self, stage: ResidentStage, native: range, microbatch: int, grad: Any, run: _LayerCalls
    ) -> Any:
        """Recompute + backward of the stage for one microbatch: ``native`` layers natively if
        their inputs allow it, the others in Python; returns the input gradients."""
        python = stage.layers
        native_grad = self._recompute_backward_natively(stage, native, microbatch, grad, run)
        if native_grad is not None:
            grad = native_grad
            python = range(stage.layers.start, native.start)
        if python and self.recompute_grain == "layer":
            for layer in reversed(python):
                grad = self._recompute_backward(
                    stage, range(layer, layer + 1), microbatch, grad, run
                )
        elif python:
            grad = self._recompute_backward(stage, python, microbatch, grad, run)
        return grad

    def _download_grads(self, stage: ResidentStage) -> list[Any]:
        """The stage's gradients into the host arena. With stage reduces they are first summed
        over the data-parallel ranks on the device, and only the own shard is downloaded."""
        stage.run_hooks_on_sums()
        dp = self.runner.stage_reduce
        if dp is None:
            self.reached.update(stage.reached_params())
            return stage.download_grads()
        self.reached.update(id(stage.layout.params[i]) for i in stage.layout.trained)
        assert stage.grad_buffer is not None
        device = device_at(stage.device_index)
        trace = stage.trace
        start = trace.mark() if trace is not None else None
        try:
            if not self.reduce_agreed:
                backward = self.plan.bwd_plan
                dp.agree_on_call(backward, device)
                self.reduce_agreed = True
            with _device_guard(device):
                first_byte, _ = self.runner.memory.grad_range(stage.layers)
                own = dp.reduce_stage(stage.grad_buffer, first_byte, stage.layers, device)
        except Exception as error:
            where = (
                f"RoundPipe model '{self.runner.name}': layers {stage.layers.start}-"
                f"{stage.layers.stop - 1} (backward: data-parallel gradient reduce)"
            )
            raise annotate(error, where) from error
        if trace is not None and start is not None:
            trace.span("grad_reduce", start)
        return stage.download_grads(own)

    def _recompute_backward(
        self, stage: ResidentStage, layers: range, microbatch: int, grad: Any, run: _LayerCalls
    ) -> Any:
        trace = stage.trace
        mark = trace.mark() if trace is not None else None
        saved, landed = self._saved_input(layers.start, microbatch)
        inputs = self._differentiable_input(
            layers.start, microbatch, saved, stage.device_index, landed
        )
        with torch.enable_grad():
            result = run(layers, microbatch, _writable(inputs, saved))
        if trace is not None:
            trace.span("recompute", mark, microbatch, layers)
            mark = trace.mark()
        start = run.clock.start()
        try:
            with self._mark("backward", layers, microbatch):
                _backward(result, grad)
        except Exception as error:
            raise annotate(error, self._where(layers, "backward", microbatch)) from error
        run.clock.stop(start, layers, "bwd")
        if trace is not None:
            trace.span("backward", mark, microbatch, layers)
        return _grads_of(inputs)

    def _recompute_backward_natively(
        self,
        stage: ResidentStage,
        layers: range,
        microbatch: int,
        grad: list[Any],
        run: _LayerCalls,
    ) -> list[Any] | None:
        """:meth:`_recompute_backward` of ``layers`` (each layer on its own with layer grain) in
        one native call (``_C.LayerLoop.recompute_backward``), when every input recomputed from
        is a lone tensor (what passes between layers nearly always); returns the input
        gradients. None when there are no layers or an input is not a lone tensor: the caller
        recomputes in Python."""
        per_layer = self.recompute_grain == "layer"
        if not layers or len(grad) != 1:
            return None
        starts = layers if per_layer else layers[:1]
        saved = [self._saved_input(layer, microbatch) for layer in starts]
        values = [value for value, _ in saved]
        if not all(type(value) is torch.Tensor for value in values):
            return None
        inputs = values
        if self.on_cuda:
            device = stage.device_index
            inputs = [to_device(value, device, landed) for value, landed in saved]
        reused = values if self._graph_retained else []
        try:
            result = run.loop.recompute_backward(
                layers.start, layers.stop, microbatch, inputs, reused, grad[0], per_layer, _backward
            )
        except Exception as error:
            raise self._recompute_failed(error, run) from error
        return [result]

    def _recompute_backward_kept(
        self, stage: ResidentStage, order: Sequence[int], grads: list[Any], run: _LayerCalls
    ) -> list[Any] | None:
        """:meth:`_recompute_backward_natively` of the whole stage for every microbatch, in
        ``order``, in one native call (``_C.LayerLoop.recompute_backward_kept``), when the forward
        kept every input recomputed from natively and every output gradient is a lone tensor;
        returns the input gradients per microbatch. None otherwise."""
        layers, per_layer = stage.layers, self.recompute_grain == "layer"
        kept = self.kept_inputs
        order = list(order)
        if any(len(grads[m]) != 1 for m in order) or not kept.covers(
            layers.start, layers.stop, order, per_layer
        ):
            return None
        try:
            results = run.loop.recompute_backward_kept(
                layers.start,
                layers.stop,
                order,
                kept,
                self._graph_retained,
                [grads[m][0] for m in order],
                per_layer,
                _backward,
            )
        except Exception as error:
            raise self._recompute_failed(error, run) from error
        new_grads: list[Any] = [None] * len(grads)
        for m, result in zip(order, results, strict=True):
            new_grads[m] = [result]
        return new_grads

    @property
    def _graph_retained(self) -> bool:
        """Whether a later recompute may start from the kept inputs again: a second backward
        through a retained graph does; the backward of forward_backward is the only one."""
        return self.run_type != "fused"

    def _recompute_failed(self, error: Exception, run: _LayerCalls) -> BaseException:
        """``error`` of a native recompute + backward, annotated with the layer (recompute) or
        the segment's layers (backward) and the microbatch it failed in."""
        phase, first, stop, microbatch = run.loop.failure
        if phase == "recompute":
            return annotate(error, self._where(run.context.layer, "recompute", microbatch))
        return annotate(error, self._where(range(first, stop), "backward", microbatch))

    def _check_output(self, microbatch: int, value: Any) -> None:
        """A training forward's output must show autograd every tensor that carries a graph: one
        held in an object torch's pytree does not know would hand backward() nothing to send
        back into the pipeline, and the layers' gradients would be lost without an error."""
        self._refuse_hidden_gradients(
            _flatten(value)[0],
            requiring_grad=True,
            where=f"the output of layer {len(self.runner.layers) - 1} (microbatch {microbatch})",
            held="tensors that require grad",
            why="backward() through them could not reach the layers",
            instead="return",
        )

    def _refuse_hidden_gradients(
        self, leaves: list[Any], requiring_grad: bool, where: str, held: str, why: str, instead: str
    ) -> None:
        """``TypeError`` for the first of ``leaves`` that hides tensors gradients flow through
        (see :func:`_hides_gradients`): ``where`` holds ``held`` in it, so ``why``; register
        its type, or ``instead`` a tuple, list or dict."""
        for leaf in leaves:
            if not isinstance(leaf, torch.Tensor) and _hides_gradients(leaf, requiring_grad):
                raise TypeError(
                    f"RoundPipe model '{self.runner.name}': {where} holds {held} in a "
                    f"{type(leaf).__name__}, a type that torch's pytree does not know, so {why}; "
                    "register it (torch.utils._pytree.register_dataclass for a dataclass, "
                    f"register_pytree_node otherwise) or {instead} a tuple, list or dict"
                )

    def _differentiable_input(
        self, layer: int, microbatch: int, value: Any, device_index: int, landed: Any = None
    ) -> Any:
        """The stage input on the device as fresh leaves, requiring grad where the forward's
        did (activations downstream of trained parameters; of the user's tensors, those that
        required grad), as in plain PyTorch. ``landed``: the event of the copy that put
        ``value`` in host memory, if any."""
        leaves, spec = _flatten(value)
        wanted = [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves]
        self._refuse_hidden_gradients(
            leaves,
            requiring_grad=layer == 0,
            where=f"the input of layer {layer} (microbatch {microbatch})",
            held="tensors",
            why="their gradients cannot reach the layers before it",
            instead="pass",
        )
        if layer == 0:
            moved, _ = _flatten(self._model_input(microbatch, value, device_index))
        else:
            with self._mark("activation", range(layer, layer + 1), microbatch):
                moved, _ = _flatten(to_device(value, device_index, landed))
        fresh = []
        for leaf, wants_grad in zip(moved, wanted, strict=True):
            if isinstance(leaf, torch.Tensor):
                leaf = leaf.detach()
                if wants_grad and (leaf.is_floating_point() or leaf.is_complex()):
                    leaf.requires_grad_(True)
            fresh.append(leaf)
        return _unflatten(fresh, spec)


def _hides_gradients(leaf: Any, requiring_grad: bool, seen: set[int] | None = None) -> bool:
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
        or (not isinstance(t, torch.Tensor) and _hides_gradients(t, requiring_grad, seen))
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


_NO_RANGE = nullcontext()  # what a call that marks no NVTX ranges enters (reusable)


class _LayerCalls:
    """Runs runs of layers of stages on one device for a call (``run(layers, microbatch,
    value)``), in forward or in recompute, and times them (``clock``), for every stage of one
    kind on one device in a run (:meth:`Call._layer_calls`).

    At short sequences the host's work per layer x microbatch is what caps a GPU's throughput
    (benchmarks/overhead_cpu.py, the dispatch table), so the loop over the layers is native
    (``_C.LayerLoop``), and what does not change from layer to layer is given to it once: the
    modules, the kind of random stream, the generators to reseed, the recompute context (one
    object moved from layer to layer), the NVTX marking, the timing. The message naming layer,
    phase and microbatch is built only when a layer fails."""

    def __init__(
        self,
        call: Call,
        device_index: int,
        recompute: bool,
        recomputed: bool = False,
        cut: bool = False,
    ) -> None:
        """``recomputed``: a forward stage whose layers backward recomputes (it keeps the CPU
        generator's seeded states for the recompute, see ``_C.RngStates``). ``cut``: each
        layer's output is cut from its graph (``_C.graph_cut``)."""
        self.call = call
        self.phase: Phase = "recompute" if recompute else "forward"
        self.action: Action = "re" if recompute else "fwd"
        # Recompute replays the forward's draws, unless asked for fresh randomness.
        fresh = recompute and not call.preserve_rng_state
        generators = [torch.default_generator]
        if call.on_cuda:
            if recompute and not fresh:
                _warn_if_replay_differs(tuple(devices()))
            device = device_at(device_index)
            generators.append(torch.cuda.default_generators[device.index])
        self.context = context.LayerCall(call.recompute_store, recompute, call.saving)
        self.clock = _LoopClock(call.runner.timer, device_index, call.on_cuda)
        timing = "off" if self.clock.timer is None else "device" if call.on_cuda else "host"
        mark = functools.partial(_mark_layer, call, self.phase) if call.nvtx else None
        replay = recompute and not fresh
        self.loop = _C.LayerLoop(
            call.runner.layers,
            call.rng_seed,
            fresh,
            generators,
            self.context,
            mark,
            timing,
            device_index,
            call.rng_states if replay or recomputed else None,
            replay,
            _cut_graphs if cut else None,
        )

    def __call__(self, layers: range, microbatch: int, value: Any) -> Any:
        """Run ``layers`` on ``microbatch`` (layer 0 takes ``(args, kwargs)``)."""
        try:
            with self.context:
                return self.loop.run(layers.start, layers.stop, microbatch, value)
        except Exception as error:
            where = self.call._where(self.context.layer, self.phase, microbatch)
            raise annotate(error, where) from error

    def keeping(
        self,
        layers: range,
        first_microbatch: int,
        values: list[Any],
        kept: list[int],
        kept_natively: Any,
        keeper: Callable[[int, int, Any], None],
    ) -> list[Any]:
        """Run ``layers`` on consecutive microbatches from ``first_microbatch`` (one value each),
        keeping the inputs of the layers in ``kept`` for the backward pass (see
        ``_C.LayerLoop.run_keeping``: lone tensors in ``kept_natively`` if given, the others by
        ``keeper``); returns the outputs."""
        try:
            with self.context:
                return self.loop.run_keeping(
                    layers.start, layers.stop, first_microbatch, values, kept, kept_natively, keeper
                )
        except Exception as error:
            context = self.context
            where = self.call._where(context.layer, self.phase, context.microbatch)
            raise annotate(error, where) from error


def _mark_layer(call: Call, phase: Phase, layer: int, microbatch: int) -> Any:
    """The NVTX range of ``layer`` on ``microbatch`` in ``phase`` (what ``_C.LayerLoop`` enters
    around each layer when the call marks ranges)."""
    return call._mark(phase, range(layer, layer + 1), microbatch)


def _check_loss(loss: Any, name: str, microbatch: int) -> None:
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


def _detach_leaf(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _cut_graphs(tree: Any) -> Any:
    """``tree`` with its tensors cut from their graphs (``_C.graph_cut``)."""
    return tree_map(lambda t: _C.graph_cut(t) if isinstance(t, torch.Tensor) else t, tree)


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------


def _draw_call_seed() -> int:
    """One draw from the default CPU generator: the call's randomness follows the user's seed."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


@functools.cache
def _warn_if_replay_differs(pool: tuple[torch.device, ...]) -> None:
    """Warn (once per pool) when recompute may not replay the forward's random draws.

    A layer's draws come from a generator seeded per (call, layer, microbatch), so a recompute on
    another GPU replays them exactly when the GPUs are alike; but random kernels (dropout) size
    their grids by the SM count, and GPUs with different counts split the same random stream
    differently."""
    counts = sorted({torch.cuda.get_device_properties(d).multi_processor_count for d in pool})
    if len(counts) > 1:
        warnings.warn(
            "RoundPipe: preserve_rng_state=True on GPUs with different SM counts "
            f"({', '.join(map(str, counts))}): a layer recomputed on another GPU than its "
            "forward may draw different random values (dropout masks), so its gradients would "
            "not match the forward. Use GPUs of one model (CUDA_VISIBLE_DEVICES), or "
            "preserve_rng_state=False if fresh randomness in recompute is acceptable.",
            RuntimeWarning,
            stacklevel=2,
        )


@contextmanager
def _rng_scope() -> Iterator[None]:
    """Restore the generators the layers reseed, so the user's random stream after a call does not
    depend on which layer ran last (that is, on the plan)."""
    cpu = torch.get_rng_state()
    gpus = torch.cuda.get_rng_state_all() if _on_cuda() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gpus is not None:
            torch.cuda.set_rng_state_all(gpus)


# --------------------------------------------------------------------------------------------
# Aliasing
# --------------------------------------------------------------------------------------------


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


def _copies(leaves: list[Any], chosen: list[bool], differentiable: bool) -> list[Any]:
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


def _unshared(saved: Any, passed: Any) -> Any:
    """``saved`` with a private copy of every tensor that is also ``passed`` to a layer (virtual
    CPU devices, or inputs already on the device): whatever the layer does to its input, the
    recompute must see what the forward saw. Copies are laid out, placed and aliased as their
    originals (:func:`_copies`), so that the recompute computes and rounds as the forward did."""
    saved_leaves, spec = _flatten(saved)
    passed_leaves, _ = _flatten(passed)
    chosen = [_shares_memory(a, b) for a, b in zip(saved_leaves, passed_leaves, strict=True)]
    copies = _copies(saved_leaves, chosen, differentiable=False)
    for i, wanted in enumerate(chosen):
        if wanted and saved_leaves[i].requires_grad:
            copies[i].requires_grad_(True)
    return _unflatten(copies, spec)


def _writable(inputs: Any, saved: Any = None) -> Any:
    """What the first layer of a fused or recomputed stage receives: ``inputs`` with copies of
    the leaves that require grad (so an in-place first layer, ``ReLU(inplace=True)``, does not
    modify an autograd leaf; gradients still reach the leaves) and of those sharing memory with
    ``saved`` (a second backward with ``retain_graph`` recomputes from it again). Copies are
    laid out, placed and aliased as the leaves (:func:`_copies`)."""
    leaves, spec = _flatten(inputs)
    saved_leaves = _flatten(saved)[0] if saved is not None else [None] * len(leaves)
    chosen = [
        isinstance(leaf, torch.Tensor) and (leaf.requires_grad or _shares_memory(leaf, kept))
        for leaf, kept in zip(leaves, saved_leaves, strict=True)
    ]
    if not any(chosen):
        return inputs
    return _unflatten(_copies(leaves, chosen, differentiable=True), spec)


# --------------------------------------------------------------------------------------------
# Stage uploads
# --------------------------------------------------------------------------------------------


class _Uploads:
    """The stages of one run made resident in order, each next one's upload issued before the
    current one computes; on exit every upload issued has landed (those of stages already run
    too: on several devices, or behind a deferred copy, the last one's landing does not imply
    theirs, and the host arena must not change or go away while one still reads it)."""

    def __init__(
        self,
        memory: ModelMemory,
        stages: Sequence[Stage],
        model: str,
        nvtx: bool,
        grads_from_arena: bool,
        hooks: ParamHooks,
        grad_arena: torch.Tensor | None,
    ) -> None:
        self.memory, self.stages, self.model = memory, stages, model
        self.nvtx_model = model if nvtx else None
        self.grads_from_arena, self.hooks, self.grad_arena = grads_from_arena, hooks, grad_arena
        self.issued: list[ResidentStage] = []
        self.uploads: list[Any] = []
        self.index = 0

    def __enter__(self) -> _Uploads:
        return self

    def __exit__(self, *exc: object) -> None:
        for uploaded in self.uploads:
            uploaded.synchronize()

    def _upload(self, index: int) -> None:
        stage = self.stages[index]
        resident = ResidentStage(
            self.memory,
            stage.layers,
            _next_device(),
            stage.kind != "forward",
            self.model,
            self.nvtx_model,
            self.grads_from_arena,
            self.hooks,
            self.grad_arena,
        )
        resident.trace = stage_trace(self.model, resident.device_index, index, stage.layers)
        if resident.trace is not None:
            resident.trace.transfer("upload", "parameter upload", resident.uploaded)
        self.issued.append(resident)
        self.uploads.append(resident.uploaded)

    def next(self) -> ResidentStage:
        """The next stage, resident; issues the upload of the one after it."""
        if self.index == 0 and self.stages:
            self._upload(0)
        if self.index > 0:
            self.issued.pop(0)  # the previous stage is done with its upload
        self.index += 1
        if self.index < len(self.stages):
            self._upload(self.index)
        return self.issued[0]


__all__ = [
    "Call",
    "LayerRunner",
    "LossSpec",
    "ResidentStage",
    "Stage",
    "to_device",
    "to_host",
]
