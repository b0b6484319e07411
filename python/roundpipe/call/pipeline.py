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

The call sequences its stages and runs the forward and fused ones here; the backward stages are
:mod:`~roundpipe.call.backward_stage`'s, the inputs they recompute from are kept in host memory by
:mod:`roundpipe.call.saved_inputs`, and what flows through the call is checked by
:mod:`roundpipe.call.checks`. Gradients of a stage accumulate in a flat device buffer and go back to
the host arena in one accumulation per dtype run, asynchronously."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from roundpipe._native import _C
from roundpipe.call.backward_stage import BackwardStage, grads_of
from roundpipe.call.checks import check_loss, check_output, refuse_hidden_gradients
from roundpipe.call.layer_loop import NO_RANGE, LayerCalls, Phase, draw_call_seed, rng_scope
from roundpipe.call.saved_inputs import SavedInputs
from roundpipe.call.stage import (
    ParamHooks,
    ResidentStage,
    Stage,
    StageKind,
    Uploads,
    device_guard,
    nvtx_enabled,
)
from roundpipe.call.transfers import (
    detach_leaf,
    flatten,
    on_cuda,
    to_device,
    to_host,
    to_output_device,
    unflatten,
    writable,
)
from roundpipe.context import locate_error
from roundpipe.device import device_at
from roundpipe.gradients import GradientOutcome, GradientPolicy
from roundpipe.memory import ModelMemory
from roundpipe.profile import stage_range
from roundpipe.scheduler import ModelExecutePlan, RunType
from roundpipe.torch_internals import tree_map

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


@dataclass
class CallModel:
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

    model: CallModel
    plan: ModelExecutePlan
    run_type: RunType
    num_microbatch: int
    recompute_grain: str
    preserve_rng_state: bool
    # Transfer events of inputs packed by an upstream RoundPipe, per microbatch (none: [])
    input_events: list[list[Any]]
    saving: bool = field(init=False)  # keep what backward stages need (grads on)
    # The layer inputs the backward stages recompute from (none for inference).
    saved: SavedInputs | None = field(init=False, default=None)
    # Every random draw of layer l for microbatch m comes from a generator seeded with
    # (rng_seed, l, m): the same whatever the plan, stage boundaries, device or device count.
    rng_seed: int = field(default_factory=lambda: draw_call_seed())
    recompute_store: dict[tuple[int, int], tuple[Any, ...]] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    losses: list[Any] = field(default_factory=list)
    # The fused stage's outputs (if kept) on the output device, and the events of their copies.
    outputs: list[Any] = field(default_factory=list)
    output_events: list[Any] = field(default_factory=list)
    # Per tensor of a training forward()'s outputs (microbatch by microbatch, in pytree order):
    # whether it requires grad, as plain PyTorch's would (their copies to the output device are
    # detached).
    outputs_requiring_grad: list[bool] = field(init=False, default_factory=list)
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
            # The fused stage recomputes nothing: it keeps its own graph.
            backward = self.plan.bwd_plan[1:] if self.run_type == "fused" else self.plan.bwd_plan
            self.saved = SavedInputs(
                len(self.model.layers),
                self.num_microbatch,
                backward,
                self.recompute_grain,
                self.model.name,
            )
        if self.saving and self.preserve_rng_state:
            self.rng_states = _C.RngStates(len(self.model.layers), self.num_microbatch)

    # -- running the stages ------------------------------------------------------------------

    def forward(
        self, inputs: list[Any], output_device: torch.device
    ) -> tuple[list[Any], list[Any]]:
        """The forward stages over the per-microbatch ``(args, kwargs)``; returns the outputs on
        ``output_device`` and the events of their copies (None where nothing is in flight)."""
        outputs = self.run([Stage("forward", layers) for layers in self.plan.fwd_plan], inputs)
        if self.saving:
            last = len(self.model.layers) - 1
            for m, value in enumerate(outputs):
                leaves = flatten(value)[0]
                check_output(self.model.name, last, m, leaves)
                self.outputs_requiring_grad.extend(
                    leaf.requires_grad for leaf in leaves if isinstance(leaf, torch.Tensor)
                )
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

    def summed_losses(self) -> Any:
        """The element-wise sum of the fused stage's microbatch losses, as detached CPU tensors
        (a list when ``loss_fn`` returns a sequence)."""
        return _sum(self.losses)

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
        memory = self.model.memory
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
            policy.arena_holds_grads and passes and self.model.stage_reduce is None
        )
        hooks: ParamHooks = "shared"
        if not passes:  # the backward of a forward(): one pass
            hooks = "on_sums" if policy.pass_arena is None else "later"
        uploads = Uploads(
            memory, stages, self.model.name, self.nvtx, from_arena, hooks, policy.pass_arena
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
        replicas = self.model.replica_buffers
        if replicas is not None and self.saving and stages[0].kind != "backward":
            try:
                replicas.broadcast_buffers()
            except Exception as error:
                where = f"RoundPipe model '{self.model.name}': data-parallel buffer broadcast"
                raise locate_error(error, where) from error
        return values

    def _run_stage(
        self, kind: StageKind, resident: ResidentStage, values: list[Any], loss: LossSpec | None
    ) -> list[Any]:
        if kind == "forward":
            return self.forward_stage(resident, values)
        if kind == "fused":
            assert loss is not None
            return self.fused_stage(resident, values, loss)
        run = self._layer_calls(resident, recompute=True)
        grads = BackwardStage(self, resident, run).run(values)
        if self.policy.keep:
            self.pending.extend(self.download_grads(resident))
        return grads

    # -- layer calls -------------------------------------------------------------------------

    def _layer_calls(
        self, stage: ResidentStage, recompute: bool, runs_twice: bool = False, cut: bool = False
    ) -> LayerCalls:
        """The layer calls of ``stage`` (see :class:`LayerCalls` for the flags): one object per
        kind and device for the whole run, as building one per stage is measurable host work at
        short sequences; its times are handed to the timer at the end of the run. It holds no
        reference to the stage, whose buffers are freed after its turn."""
        key = (recompute, runs_twice, cut, stage.device_index)
        calls = self.layer_calls.get(key)
        if calls is None:
            calls = LayerCalls(self, stage.device_index, recompute, runs_twice, cut)
            self.layer_calls[key] = calls
        return calls

    def where(self, layers: int | range, phase: Phase, microbatch: int) -> str:
        """Who failed: one layer, or, for the backward of a stage (one autograd pass, whose
        failing node cannot be told apart), the stage's range of layers; never a guess."""
        if isinstance(layers, int):
            layers = range(layers, layers + 1)
        types = ", ".join(type(self.model.layers[i]).__name__ for i in layers)
        who = (
            f"layer {layers.start} ({types})"
            if len(layers) == 1
            else f"one of layers {layers.start}-{layers.stop - 1} ({types})"
        )
        return (
            f"RoundPipe model '{self.model.name}': {who} failed in {phase} of microbatch "
            f"{microbatch}"
        )

    def mark(
        self, kind: str, layers: range, microbatch: int | None = None
    ) -> AbstractContextManager[Any]:
        """The NVTX range of ``kind`` over ``layers`` if the call marks ranges
        (:func:`roundpipe.profile.stage_range`)."""
        if not self.nvtx:
            return NO_RANGE
        return stage_range(self.model.name, kind, layers, microbatch)

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
        run = self._layer_calls(stage, recompute=False, runs_twice=self.saving, cut=self.saving)
        grad_mode = torch.enable_grad() if self.saving else torch.no_grad()
        # The layers whose inputs backward recomputes from (layer 0's, the user's own, are kept
        # as they came in, below).
        kept = [i for i in stage.layers if i > 0 and i in self.saved.starts] if self.saved else []
        # Lone tensors are kept natively (a private copy) where keeping needs nothing more: on
        # virtual CPU devices, with no timeline or NVTX ranges to record. There one native call
        # runs every microbatch (activations need no move), past layer 0: its inputs, the call's
        # own, are kept right before each microbatch runs (a layer may change a tensor that
        # several microbatches share).
        native = not self.on_cuda and trace is None and not self.nvtx
        store = self.saved.native if native and self.saved else None
        keeper = functools.partial(self._keep_input, stage)
        with stage.bound(keep_buffer_updates=True, runs_twice=self.saving), grad_mode:
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
            if self.saved is not None and 0 in self.saved.starts:
                # A chained model's packed outputs may still be written by its transfers.
                in_flight = bool(self.input_events and self.input_events[microbatch])
                self.saved.keep_call_input(microbatch, value, moved, check=not in_flight)
            return moved
        with self.mark("activation", stage.layers[:1], microbatch):
            return to_device(value, stage.device_index)

    def _keep_input(self, stage: ResidentStage, layer: int, microbatch: int, value: Any) -> None:
        """Keep the input of ``layer`` for the backward pass in host memory; the backward stage,
        maybe on another device, uploads it once its copy landed."""
        with self.mark("activation", range(layer, layer + 1), microbatch):
            host, event = to_host(value, stage.device_index)
        if event is not None:
            self.pending.append(event)
            if stage.trace is not None:
                stage.trace.transfer("activation", "activation", event, microbatch)
        self._saved().keep(layer, microbatch, value, host, event)

    def _saved(self) -> SavedInputs:
        assert self.saved is not None, "only a training call keeps inputs"
        return self.saved

    def fused_stage(
        self, stage: ResidentStage, activations: list[Any], loss_spec: LossSpec
    ) -> list[Any]:
        """Forward + loss + backward of the last stage; returns the input grads and appends to
        ``losses`` (and ``outputs``, if kept)."""
        grads, trace = [], stage.trace
        run = self._layer_calls(stage, recompute=False)
        with stage.bound(keep_buffer_updates=True, runs_twice=False), torch.enable_grad():
            for m, value in enumerate(activations):
                start_mark = trace.mark() if trace is not None else None
                first, device = stage.layers.start, stage.device_index
                inputs = self.differentiable_input(first, m, value, device)
                result = run(stage.layers, m, writable(inputs))
                label = to_device(loss_spec.labels[m], stage.device_index)
                try:
                    loss = loss_spec.loss_fn(result, label)
                except Exception as error:
                    where = (
                        f"RoundPipe model '{self.model.name}': loss_fn failed on the output "
                        f"of layer {stage.layers.stop - 1} for microbatch {m}"
                    )
                    raise locate_error(error, where) from error
                check_loss(loss, self.model.name, m)
                start = run.clock.start()
                try:
                    with self.mark("backward", stage.layers, m):
                        if isinstance(loss, torch.Tensor):
                            torch.autograd.backward(loss)
                        else:
                            torch.autograd.backward(list(loss))
                except Exception as error:
                    raise locate_error(error, self.where(stage.layers, "backward", m)) from error
                run.clock.stop(start, stage.layers, "bwd")
                self.losses.append(tree_map(lambda t: t.detach(), loss))
                if loss_spec.keep_outputs:
                    self.outputs.append(tree_map(detach_leaf, result))
                grads.append(grads_of(inputs))
                if trace is not None:
                    trace.span("fused", start_mark, m)
        self.pending.extend(self.download_grads(stage))
        return grads

    def settle_transfers(self) -> None:
        """Wait for the transfers of a failed run, whatever their outcome (the run's own error
        is what its caller needs), so that the gradient state may roll back what they wrote."""
        for event in self.pending:
            try:
                event.synchronize()
            except Exception:
                pass

    def download_grads(self, stage: ResidentStage) -> list[Any]:
        """The stage's gradients into the host arena. With stage reduces they are first summed
        over the data-parallel ranks on the device, and only the own shard is downloaded."""
        stage.run_hooks_on_sums()
        dp = self.model.stage_reduce
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
                first_byte, _ = self.model.memory.grad_range(stage.layers)
                own = dp.reduce_stage(stage.grad_buffer, first_byte, stage.layers, device)
        except Exception as error:
            where = (
                f"RoundPipe model '{self.model.name}': layers {stage.layers.start}-"
                f"{stage.layers.stop - 1} (backward: data-parallel gradient reduce)"
            )
            raise locate_error(error, where) from error
        if trace is not None and start is not None:
            trace.span("grad_reduce", start)
        return stage.download_grads(own)

    def differentiable_input(
        self, layer: int, microbatch: int, value: Any, device_index: int, landed: Any = None
    ) -> Any:
        """The stage input on the device as fresh leaves, requiring grad where the forward's
        did (activations downstream of trained parameters; of the user's tensors, those that
        required grad), as in plain PyTorch. ``landed``: the event of the copy that put
        ``value`` in host memory, if any."""
        leaves, spec = flatten(value)
        wanted = [isinstance(leaf, torch.Tensor) and leaf.requires_grad for leaf in leaves]
        refuse_hidden_gradients(
            self.model.name,
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


def _sum(losses: list[Any]) -> Any:
    if isinstance(losses[0], torch.Tensor):
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss.to(total.device)
        return total.detach().cpu()
    return [_sum([loss[i] for loss in losses]) for i in range(len(losses[0]))]


__all__ = ["Call", "CallModel", "LossSpec"]
