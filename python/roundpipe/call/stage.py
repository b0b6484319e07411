"""A stage of a call: its layers' parameters resident on one device.

:class:`Uploads` makes the stages of one run resident in order, each next one's upload issued
before the current one computes, on devices taken round-robin from the pool
(:func:`next_device`). A :class:`ResidentStage` uploads its byte range of the host arena (or
binds frozen parameters in place on a virtual CPU device), binds the device copies in place of
the layers' parameters and buffers while the stage computes, runs the parameters' hooks on the
summed gradients where asked, and downloads its gradients back into the host arena. Its
transfers are marked as NVTX ranges on CUDA (:func:`roundpipe.profile.stage_range`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

from roundpipe._native import _C
from roundpipe.call.transfers import on_cuda
from roundpipe.context import locate_error, run_param_hooks
from roundpipe.device import device_at, device_count
from roundpipe.profile import nvtx_usable, stage_range
from roundpipe.timeline.tracing import StageTrace, stage_trace
from roundpipe.torch_internals import (
    backward_hooks,
    buffer_slots,
    has_post_accumulate_grad_hooks,
    share_backward_hooks,
)

if TYPE_CHECKING:
    from roundpipe.memory import ModelMemory

StageKind = Literal["forward", "fused", "backward"]

# How the hooks registered on trained parameters (``param.register_hook``) run in a stage.
# "shared": the device copies share them, so the engine runs them per backward pass of each
# microbatch (forward_backward, plain PyTorch's per-microbatch loop). "on_sums": once, on the
# stage's sum over the microbatches (the backward of a forward(), one pass over them all:
# :meth:`ResidentStage.run_hooks_on_sums`). "later": not in the stage; the gradients are summed
# over the backward pass (it goes through several forward() calls, or a tied weight has hooks),
# whose end runs them on the sums (roundpipe.gradients.GradientState.accumulate_in_pass).
ParamHooks = Literal["shared", "on_sums", "later"]

_round_robin = itertools.count()


def next_device() -> int:
    """The device of the next stage: round-robin over the pool, across calls and models."""
    return next(_round_robin) % device_count()


def nvtx_enabled() -> bool:
    """Whether a call marks NVTX ranges: on CUDA devices, where a profiler may record them (with
    none attached a range costs next to nothing); never on virtual CPU devices."""
    return on_cuda() and nvtx_usable()


# --------------------------------------------------------------------------------------------
# Stage residency
# --------------------------------------------------------------------------------------------


def device_guard(device: torch.device) -> AbstractContextManager[Any]:
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
        with stage_range(nvtx_model, "upload", layers):
            # One native call: the buffers, the copies of the stage's byte runs of the arena (in
            # order on the parameter lane: the last one's event covers the stage), the
            # parameters' views and the gradient views attached to those that train. The views
            # require grad as the parameters do, also in forward stages (run without grad): a
            # layer that checks `p.requires_grad` sees what it would see on the parameter itself.
            # With gradients also which trained parameters a backward reaches (see
            # reached_params).
            self.buffer, uploaded, self.views, self.grad_buffer, self.reach = _C.upload_stage(
                device_index=device_index,
                device=device,
                arena=memory.params,
                param_begin=layout.param_begin,
                param_end=layout.param_end,
                runs=layout.param_runs(frozen) if memory.params is not None else [],
                fence=fence,
                offsets=layout.offsets,
                params=layout.params,
                with_grads=with_grads,
                grad_begin=layout.grad_begin,
                grad_end=layout.grad_end,
                grad_offsets=layout.grad_offsets,
                trained=layout.trained,
                grad_arena=self._grad_arena() if self.grads_from_arena else None,
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
            if has_post_accumulate_grad_hooks(param):
                owner, attribute = self.layout.slots[i].owners[0]
                raise RuntimeError(
                    f"RoundPipe model '{self.model}': parameter {attribute} of layer "
                    f"{self.layout.layer_of[i]} ({type(owner).__name__}) has a hook registered "
                    "with register_post_accumulate_grad_hook, which RoundPipe cannot run (its "
                    "gradients accumulate in a device copy, then in host memory); remove it "
                    "and act on the gradients in step_fn"
                )
            hooks = backward_hooks(param)
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
                share_backward_hooks(views[i], hooks)

    def run_hooks_on_sums(self) -> None:
        """Run the hooks of each trained parameter this stage's backward reached on its
        gradient, the sum over the microbatches (the backward of a ``forward()`` is one pass
        over them all, in which plain PyTorch runs a parameter's hooks once, on its whole
        gradient); what a hook returns replaces it. Nothing for other stages: their copies
        share the hooks, or the end of the backward pass runs them (see :data:`ParamHooks`).
        The hooks run with the stage's device current, as its backward did."""
        if self.hooks != "on_sums":
            return
        with device_guard(device_at(self.device_index)):
            self._run_hooks_on_sums()

    def _run_hooks_on_sums(self) -> None:
        layout = self.layout
        for j in self.reach.reached():
            i = layout.trained[j]
            param, grad = layout.params[i], self.views[i].grad
            if not backward_hooks(param) or grad is None:
                continue
            try:
                result = run_param_hooks(param, grad)
            except Exception as error:
                index, module, name = self._param_name(i)
                where = (
                    f"RoundPipe model '{self.model}': a hook of parameter '{name}' of layer "
                    f"{index} ({type(module).__name__})"
                )
                raise locate_error(error, where) from error
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
    def bound(self, keep_buffer_updates: bool, runs_twice: bool) -> Iterator[None]:
        """Bind the layers' modules to the device copies while the stage computes, with the
        stage's device as the current CUDA device.

        ``runs_twice``: the stage is a recompute, or a forward whose layers backward will
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
        memory.settle_buffers(self.layout.buffer_settle)
        bound_buffers: list[tuple[int, torch.nn.Module, str, torch.Tensor, torch.Tensor]] = []
        with device_guard(device):
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
                # One working copy per buffer tensor, which every module holding it is bound to.
                working_of: dict[int, torch.Tensor] = {}
                for index, owner, name in zip(*buffers, strict=True):
                    host = buffer_slots(owner)[name]
                    assert host is not None
                    working = working_of.get(id(host))
                    if working is None:
                        working = working_of[id(host)] = _buffer_to_device(host, device)
                    buffer_slots(owner)[name] = working
                    bound_buffers.append((index, owner, name, host, working))
                yield
                self._check_parameters_unchanged(keep_buffer_updates, runs_twice)
                if keep_buffer_updates:
                    # Every bound buffer, changed or not: an update through `.data` leaves no
                    # trace in `_version`, and the download is asynchronous and small.
                    for index, _, _, host, working in bound_buffers:
                        if working_of.pop(id(host), None) is not None:  # once per tensor
                            memory.defer_buffer_write(index, host, *self._buffer_to_host(working))
            finally:
                _C.rebind_parameters(*owners, before)
                for _, owner, name, host, _ in bound_buffers:
                    buffer_slots(owner)[name] = host

    def _check_parameters_unchanged(self, forward: bool, runs_twice: bool) -> None:
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
            if i in in_host and not runs_twice:
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
        with stage_range(self.nvtx_model, "download", self.layers):
            events = _C.download_grads(
                device_index=self.device_index,
                arena=self._grad_arena(),
                grads=self.grad_buffer,
                first_byte=self.layout.grad_begin,
                runs=runs,
                staging=staging,
                replace=self.grads_from_arena,
            )
        if self.trace is not None and events:
            self.trace.transfer("grad_download", "gradient download", events[-1])
        return events


@dataclass(frozen=True)
class Stage:
    """One stage of a call: what it runs (``kind``) over which layers."""

    kind: StageKind
    layers: range


class Uploads:
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

    def __enter__(self) -> Uploads:
        return self

    def __exit__(self, *exc: object) -> None:
        for uploaded in self.uploads:
            uploaded.synchronize()

    def _upload(self, index: int) -> None:
        stage = self.stages[index]
        # Outside inference mode (a call under torch.inference_mode()): the device copies must
        # have version counters, which the check for parameters changed in place reads.
        with torch.inference_mode(False):
            resident = ResidentStage(
                self.memory,
                stage.layers,
                next_device(),
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
    "ParamHooks",
    "ResidentStage",
    "Stage",
    "StageKind",
    "Uploads",
    "device_guard",
    "next_device",
    "nvtx_enabled",
]
