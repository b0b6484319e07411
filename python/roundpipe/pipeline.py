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
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from roundpipe._native import _C
from roundpipe.context import annotate
from roundpipe.device import device_at
from roundpipe.gradients import GradientOutcome, GradientPolicy
from roundpipe.layer_loop import NO_RANGE, LayerCalls, Phase, draw_call_seed, rng_scope
from roundpipe.memory import ModelMemory
from roundpipe.scheduler import ModelExecutePlan, RunType
from roundpipe.stage import (
    ParamHooks,
    ResidentStage,
    Stage,
    StageKind,
    Uploads,
    device_guard,
    marked,
    nvtx_enabled,
)
from roundpipe.torch_internals import tree_flatten, tree_map
from roundpipe.transfers import (
    detach_leaf,
    flatten,
    on_cuda,
    to_device,
    to_host,
    to_output_device,
    unflatten,
    unshared,
    writable,
)

if TYPE_CHECKING:
    from roundpipe.distributed import DataParallel
    from roundpipe.timer import ModelTimer

# --------------------------------------------------------------------------------------------
# One call
# --------------------------------------------------------------------------------------------


@dataclass
class LossSpec:
    """The fused stage's loss: per-microbatch labels, the loss function, and whether the
    outputs are kept for the caller."""

    labels: list[Any]
    loss_fn: Callable[[Any, Any], Any]
    keep_outputs: bool


def _grads_of(tree: Any) -> list[torch.Tensor | None]:
    """Gradients of ``tree``'s leaves in ``tree_flatten`` order, None where a leaf got none.

    Kept flat, never rebuilt into ``tree``'s type: some pytree types (Hugging Face
    ``ModelOutput``) drop ``None`` fields when rebuilt, which would misalign the leaves."""
    return [
        leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
        for leaf in flatten(tree)[0]
    ]


def _backward(outputs: Any, grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grads`` (one per leaf of ``outputs``, None where absent)."""
    pairs = [
        (o, g)
        for o, g in zip(flatten(outputs)[0], grads, strict=True)
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
    rng_seed: int = field(default_factory=lambda: draw_call_seed())
    recompute_store: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    # Transfer events of inputs packed by an upstream RoundPipe, per microbatch.
    input_events: list[list[Any]] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    # The fused stage's outputs (if kept) on the output device, and the events of their copies.
    outputs: list[Any] = field(default_factory=list)
    output_events: list[Any] = field(default_factory=list)
    # Whether this call marks NVTX ranges and runs on CUDA devices (decided once per call).
    nvtx: bool = field(init=False, default_factory=nvtx_enabled)
    on_cuda: bool = field(init=False, default_factory=on_cuda)
    # Whether the data-parallel ranks agreed on this call's backward stages (stage reduces).
    reduce_agreed: bool = field(init=False, default=False)
    # What the backward stages of the run in progress do with the parameters' gradients (given
    # to backward() / forward_backward()).
    policy: GradientPolicy = field(init=False, default_factory=lambda: GradientPolicy())
    # ``id`` of each trained parameter a backward stage of this call gave a gradient (with
    # stage reduces: every trained parameter of those stages, as some rank may have).
    reached: set[int] = field(init=False, default_factory=set)
    # The CPU generator states the forward stages' layers were seeded with, for their recompute.
    rng_states: Any = field(init=False, default=None)
    # The layer calls of the run in progress, one per kind and device (see _layer_calls).
    layer_calls: dict[tuple[bool, bool, bool, int], LayerCalls] = field(
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
        return to_output_device(outputs, output_device)

    def backward(
        self, grads: list[Any], policy: GradientPolicy
    ) -> tuple[list[Any], GradientOutcome]:
        """Recompute + backward stages from the output gradients (one list of leaf gradients per
        microbatch), the parameters' gradients handled as ``policy`` says; returns the input
        gradients in the same form, and what the stages reached and left in flight."""
        self.policy = policy
        stages = [Stage("backward", layers) for layers in self.plan.bwd_plan]
        return self.run(stages, grads), self._outcome()

    def forward_backward(
        self, inputs: list[Any], loss: LossSpec, output_device: torch.device, policy: GradientPolicy
    ) -> tuple[list[Any], GradientOutcome]:
        """Forward, fused loss + backward, then backward stages (the parameters' gradients
        handled as ``policy`` says); returns the input gradients and what the stages reached and
        left in flight, and leaves the losses (and the outputs on ``output_device``, if kept) in
        ``losses`` / ``outputs``."""
        self.policy = policy
        stages = (
            [Stage("forward", layers) for layers in self.plan.fwd_plan]
            + [Stage("fused", self.plan.bwd_plan[0])]
            + [Stage("backward", layers) for layers in self.plan.bwd_plan[1:]]
        )
        grads = self.run(stages, inputs, loss)
        self.outputs, self.output_events = to_output_device(self.outputs, output_device)
        return grads, self._outcome()

    def _outcome(self) -> GradientOutcome:
        return GradientOutcome(pending=list(self.pending), reached=set(self.reached))

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
        policy = self.policy
        passes = self.run_type == "fused" or policy.microbatch_passes
        from_arena = policy.pass_arena is not None or (
            policy.arena_holds_grads and passes and self.runner.stage_reduce is None
        )
        hooks: ParamHooks = "shared"
        if not passes:  # the backward of a forward(): one pass
            hooks = "on_sums" if policy.pass_arena is None else "later"
        uploads = Uploads(
            memory, stages, self.runner.name, self.nvtx, from_arena, hooks, policy.pass_arena
        )
        with rng_scope(), uploads:
            try:
                for stage in stages:
                    # No reference to a stage outlives its turn: its device buffers are freed
                    # before the upload after next is allocated.
                    values = self._run_stage(stage.kind, uploads.next(), values, loss)
                # The layer times go to the timer once the run succeeded (a failed run's are
                # incomplete: none are kept).
                for calls in self.layer_calls.values():
                    calls.clock.flush(calls.loop, calls.action)
            except BaseException:
                self.settle_transfers()
                raise
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
    ) -> LayerCalls:
        """The layer calls of ``stage`` (see :class:`LayerCalls` for the flags): one object per
        kind and device for the whole run, as building one per stage is measurable host work at
        short sequences; its times are handed to the timer at the end of the run. It holds no
        reference to the stage, whose buffers are freed after its turn."""
        key = (recompute, recomputed, cut, stage.device_index)
        calls = self.layer_calls.get(key)
        if calls is None:
            calls = LayerCalls(self, stage.device_index, recompute, recomputed, cut)
            self.layer_calls[key] = calls
        return calls

    def where(self, layers: int | range, phase: Phase, microbatch: int) -> str:
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

    def mark(
        self, kind: str, layers: range, microbatch: int | None = None
    ) -> AbstractContextManager[Any]:
        """The NVTX range of ``kind`` over ``layers`` (see :func:`marked`) if the call marks."""
        if not self.nvtx:
            return NO_RANGE
        return marked(self.runner.name, kind, layers, microbatch)

    def _model_input(self, microbatch: int, value: Any, device_index: int) -> Any:
        """Microbatch ``microbatch`` of the call's inputs on the device, once the upstream
        model's transfers of it (if any) have landed: ordered per microbatch on the device (no host
        wait on CUDA), so the first microbatches start while later ones are still in flight."""
        with self.mark("activation", range(0, 1), microbatch):
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
                self.saved_inputs[(0, microbatch)] = (unshared(value, moved), None)
            return moved
        with self.mark("activation", stage.layers[:1], microbatch):
            return to_device(value, stage.device_index)

    def _keep_input(self, stage: ResidentStage, layer: int, microbatch: int, value: Any) -> None:
        """Keep the input of ``layer`` for the backward pass: in host memory, private (whatever
        the layer does to its input), with the event of its copy (None: already there)."""
        with self.mark("activation", range(layer, layer + 1), microbatch):
            host, event = to_host(value, stage.device_index)
        saved = unshared(host, value)
        # Leaves requiring grad as the input's did: so do the recompute's (see
        # _differentiable_input).
        for kept, leaf in zip(flatten(saved)[0], flatten(value)[0], strict=True):
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
                result = run(stage.layers, m, writable(inputs))
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
                    with self.mark("backward", stage.layers, m):
                        if isinstance(loss, torch.Tensor):
                            torch.autograd.backward(loss)
                        else:
                            torch.autograd.backward(list(loss))
                except Exception as error:
                    raise annotate(error, self.where(stage.layers, "backward", m)) from error
                run.clock.stop(start, stage.layers, "bwd")
                self.losses.append(tree_map(lambda t: t.detach(), loss))
                if loss_spec.keep_outputs:
                    self.outputs.append(tree_map(detach_leaf, result))
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
        if self.run_type == "train" and not self.policy.microbatch_passes:
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
        if self.policy.keep:
            self.pending.extend(self._download_grads(stage))
        return new_grads

    def settle_transfers(self) -> None:
        """Wait for the transfers of a failed run, whatever their outcome (the run's own error
        is what its caller needs), so that the gradient state may roll back what they wrote."""
        for event in self.pending:
            try:
                event.synchronize()
            except Exception:
                pass

    def _recompute_backward_microbatch(
        self, stage: ResidentStage, native: range, microbatch: int, grad: Any, run: LayerCalls
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
            with device_guard(device):
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
        self, stage: ResidentStage, layers: range, microbatch: int, grad: Any, run: LayerCalls
    ) -> Any:
        trace = stage.trace
        mark = trace.mark() if trace is not None else None
        saved, landed = self._saved_input(layers.start, microbatch)
        inputs = self._differentiable_input(
            layers.start, microbatch, saved, stage.device_index, landed
        )
        with torch.enable_grad():
            result = run(layers, microbatch, writable(inputs, saved))
        if trace is not None:
            trace.span("recompute", mark, microbatch, layers)
            mark = trace.mark()
        start = run.clock.start()
        try:
            with self.mark("backward", layers, microbatch):
                _backward(result, grad)
        except Exception as error:
            raise annotate(error, self.where(layers, "backward", microbatch)) from error
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
        run: LayerCalls,
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
        self, stage: ResidentStage, order: Sequence[int], grads: list[Any], run: LayerCalls
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

    def _recompute_failed(self, error: Exception, run: LayerCalls) -> BaseException:
        """``error`` of a native recompute + backward, annotated with the layer (recompute) or
        the segment's layers (backward) and the microbatch it failed in."""
        phase, first, stop, microbatch = run.loop.failure
        if phase == "recompute":
            return annotate(error, self.where(run.context.layer, "recompute", microbatch))
        return annotate(error, self.where(range(first, stop), "backward", microbatch))

    def _check_output(self, microbatch: int, value: Any) -> None:
        """A training forward's output must show autograd every tensor that carries a graph: one
        held in an object torch's pytree does not know would hand backward() nothing to send
        back into the pipeline, and the layers' gradients would be lost without an error."""
        self._refuse_hidden_gradients(
            flatten(value)[0],
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
        leaves, spec = flatten(value)
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
            moved, _ = flatten(self._model_input(microbatch, value, device_index))
        else:
            with self.mark("activation", range(layer, layer + 1), microbatch):
                moved, _ = flatten(to_device(value, device_index, landed))
        fresh = []
        for leaf, wants_grad in zip(moved, wanted, strict=True):
            if isinstance(leaf, torch.Tensor):
                leaf = leaf.detach()
                if wants_grad and (leaf.is_floating_point() or leaf.is_complex()):
                    leaf.requires_grad_(True)
            fresh.append(leaf)
        return unflatten(fresh, spec)


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


__all__ = ["Call", "LayerRunner", "LossSpec"]
