"""The backward stages of a call: each recomputes its layers from the inputs the forward kept and
backpropagates the output gradients through them, microbatch by microbatch.

Three routes, the first that applies:

1. **kept**: the forward kept every input natively and each output gradient is a lone tensor:
   one native call runs the whole stage for every microbatch
   (``LayerLoop.recompute_backward_kept``);
2. **native**: a microbatch's inputs are lone tensors: one native call per microbatch
   (``LayerLoop.recompute_backward``), layer 0 and whatever a trace or NVTX ranges must mark
   excepted;
3. **Python**: the rest, a segment (stage grain) or each layer (layer grain) at a time.

Every route backpropagates through :func:`backward` and reports a failure as the layer that
really failed: the recomputed layer, or the backward's range of layers (one autograd pass)."""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol

import torch

from roundpipe._native import _C
from roundpipe.call.transfers import flatten, to_device, writable
from roundpipe.context import locate_error

if TYPE_CHECKING:
    from roundpipe.call.layer_loop import LayerCalls, Phase
    from roundpipe.call.saved_inputs import SavedInputs
    from roundpipe.call.stage import ResidentStage
    from roundpipe.gradients import GradientPolicy
    from roundpipe.scheduler import RunType


def grads_of(tree: Any) -> list[torch.Tensor | None]:
    """Gradients of ``tree``'s leaves in ``tree_flatten`` order, None where a leaf got none.

    Kept flat, never rebuilt into ``tree``'s type: some pytree types (Hugging Face
    ``ModelOutput``) drop ``None`` fields when rebuilt, which would misalign the leaves."""
    return [
        leaf.grad if isinstance(leaf, torch.Tensor) and leaf.requires_grad else None
        for leaf in flatten(tree)[0]
    ]


def backward(outputs: Any, grads: Sequence[torch.Tensor | None]) -> None:
    """Backpropagate ``grads`` (one per leaf of ``outputs``, None where absent)."""
    pairs = [
        (o, g)
        for o, g in zip(flatten(outputs)[0], grads, strict=True)
        if isinstance(o, torch.Tensor) and o.requires_grad and g is not None
    ]
    if pairs:
        # Natively: torch.autograd.backward's Python entry is a large part of a small layer's
        # backward, paid per layer x microbatch in layer grain.
        _C.backward([o for o, _ in pairs], [g for _, g in pairs])


class BackwardCall(Protocol):
    """What a backward stage reads of its call (``roundpipe.call.pipeline.Call``)."""

    @property
    def recompute_grain(self) -> str: ...
    @property
    def run_type(self) -> RunType: ...
    @property
    def policy(self) -> GradientPolicy: ...
    @property
    def nvtx(self) -> bool: ...
    @property
    def on_cuda(self) -> bool: ...
    @property
    def saved(self) -> SavedInputs | None: ...

    def differentiable_input(
        self, layer: int, microbatch: int, value: Any, device_index: int, landed: Any = None
    ) -> Any: ...

    def where(self, layers: int | range, phase: Phase, microbatch: int) -> str: ...

    def mark(
        self, kind: str, layers: range, microbatch: int | None = None
    ) -> AbstractContextManager[Any]: ...


class BackwardStage:
    """Recompute + backward of one resident backward stage, with the call's layer calls
    ``run`` for its device."""

    def __init__(self, call: BackwardCall, stage: ResidentStage, run: LayerCalls) -> None:
        assert call.saved is not None, "only a training call has backward stages"
        self.call, self.stage, self.run_layers, self.saved = call, stage, run, call.saved
        self.per_layer = call.recompute_grain == "layer"
        # Whether a later recompute may start from the kept inputs again: a second backward
        # through a retained graph does; the backward of forward_backward is the only one.
        self.graph_retained = call.run_type != "fused"

    def run(self, grads: list[Any]) -> list[Any]:
        """Every microbatch's backward through the stage, from its output gradients (one list of
        leaf gradients per microbatch); returns the input gradients in the same form."""
        call, stage = self.call, self.stage
        # The layers recomputed natively: not layer 0 (it takes the user's (args, kwargs)), and
        # none while a timeline or NVTX ranges mark each microbatch.
        native = range(max(stage.layers.start, 1), stage.layers.stop)
        if (not self.per_layer and stage.layers.start == 0) or stage.trace is not None or call.nvtx:
            native = range(0)
        # The backward of a forward() is one backward pass over every microbatch's graph, whose
        # gradients plain PyTorch's engine sums last microbatch first (its nodes came last); the
        # backward of forward_backward (and of a forward() it consumed) is one pass per
        # microbatch, in order.
        order = range(len(grads))
        if call.run_type == "train" and not call.policy.microbatch_passes:
            order = order[::-1]
        with stage.bound(keep_buffer_updates=False, runs_twice=True):
            if native == stage.layers:  # the whole stage natively, every microbatch at once
                kept = self._kept(order, grads)
                if kept is not None:
                    return kept
            new_grads: list[Any] = [None] * len(grads)
            for m in order:
                new_grads[m] = self._microbatch(native, m, grads[m])
            return new_grads

    def _microbatch(self, native: range, microbatch: int, grad: Any) -> Any:
        """One microbatch: ``native`` layers natively if their inputs allow it, the others in
        Python; returns the input gradients."""
        python = self.stage.layers
        native_grad = self._native(native, microbatch, grad)
        if native_grad is not None:
            grad = native_grad
            python = range(python.start, native.start)
        if python and self.per_layer:
            for layer in reversed(python):
                grad = self._python(range(layer, layer + 1), microbatch, grad)
        elif python:
            grad = self._python(python, microbatch, grad)
        return grad

    def _python(self, layers: range, microbatch: int, grad: Any) -> Any:
        """Recompute ``layers`` from their kept input and backpropagate ``grad`` through them."""
        call, stage, run = self.call, self.stage, self.run_layers
        trace = stage.trace
        mark = trace.mark() if trace is not None else None
        saved, landed = self.saved.find(layers.start, microbatch)
        inputs = call.differentiable_input(
            layers.start, microbatch, saved, stage.device_index, landed
        )
        with torch.enable_grad():
            result = run(layers, microbatch, writable(inputs, saved))
        if trace is not None:
            trace.span("recompute", mark, microbatch, layers)
            mark = trace.mark()
        start = run.clock.start()
        try:
            with call.mark("backward", layers, microbatch):
                backward(result, grad)
        except Exception as error:
            raise locate_error(error, call.where(layers, "backward", microbatch)) from error
        run.clock.stop(start, layers, "bwd")
        if trace is not None:
            trace.span("backward", mark, microbatch, layers)
        return grads_of(inputs)

    def _native(self, layers: range, microbatch: int, grad: list[Any]) -> list[Any] | None:
        """:meth:`_python` of ``layers`` (each layer on its own in layer grain) in one native
        call, when every input recomputed from is a lone tensor (what passes between layers
        nearly always); returns the input gradients. None when there are no layers or an input
        is not a lone tensor: the caller recomputes in Python."""
        if not layers or len(grad) != 1:
            return None
        starts = layers if self.per_layer else layers[:1]
        saved = [self.saved.find(layer, microbatch) for layer in starts]
        values = [value for value, _ in saved]
        if not all(type(value) is torch.Tensor for value in values):
            return None
        inputs = values
        if self.call.on_cuda:
            device = self.stage.device_index
            inputs = [to_device(value, device, landed) for value, landed in saved]
        reused = values if self.graph_retained else []
        loop = self.run_layers.loop
        try:
            result = loop.recompute_backward(
                first=layers.start,
                stop=layers.stop,
                microbatch=microbatch,
                inputs=inputs,
                saved=reused,
                grad=grad[0],
                per_layer=self.per_layer,
                fallback=backward,
            )
        except Exception as error:
            raise self._failed(error) from error
        return [result]

    def _kept(self, order: Sequence[int], grads: list[Any]) -> list[Any] | None:
        """:meth:`_native` of the whole stage for every microbatch, in ``order``, in one native
        call, when the forward kept every input recomputed from natively and every output
        gradient is a lone tensor; returns the input gradients per microbatch. None
        otherwise."""
        layers, kept = self.stage.layers, self.saved.native
        order = list(order)
        if any(len(grads[m]) != 1 for m in order) or not kept.covers(
            layers.start, layers.stop, order, self.per_layer
        ):
            return None
        try:
            results = self.run_layers.loop.recompute_backward_kept(
                first=layers.start,
                stop=layers.stop,
                microbatches=order,
                kept=kept,
                retained=self.graph_retained,
                grads=[grads[m][0] for m in order],
                per_layer=self.per_layer,
                fallback=backward,
            )
        except Exception as error:
            raise self._failed(error) from error
        new_grads: list[Any] = [None] * len(grads)
        for m, result in zip(order, results, strict=True):
            new_grads[m] = [result]
        return new_grads

    def _failed(self, error: Exception) -> BaseException:
        """``error`` of a native recompute + backward, annotated with the layer (recompute) or
        the segment's layers (backward) and the microbatch it failed in."""
        run, where = self.run_layers, self.call.where
        phase, first, stop, microbatch = run.loop.failure
        if phase == "recompute":
            return locate_error(error, where(run.context.layer, "recompute", microbatch))
        return locate_error(error, where(range(first, stop), "backward", microbatch))


__all__ = ["BackwardCall", "BackwardStage", "backward", "grads_of"]
