"""The autograd node of a ``forward()`` call with gradients enabled.

``forward()`` runs the pipelined forward inside one ``torch.autograd.Function``, whose inputs are
the user's tensors that require grad and whose outputs are the per-microbatch output tensors.
Its backward runs the pipelined recompute + backward stages and returns the input gradients, so
``loss.backward()`` on anything built from the output drives the pipeline.

The model's parameters are not in the graph: a view of the model's *anchor* (an empty leaf that
requires grad) stands for them. A backward that does not reach the anchor
(``torch.autograd.grad`` or ``backward(inputs=...)`` for the inputs only) leaves the parameters'
gradients alone, as plain PyTorch does. As PyTorch refuses to backpropagate through tensors
changed in place since the forward, the backward refuses to run when the parameters changed
since the forward (a step, a load, an in-place edit): it would recompute with other weights.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from roundpipe.call.lock import CallLock
from roundpipe.call.pipeline import Call
from roundpipe.gradients import GradientOutcome, GradientPolicy, GradientState
from roundpipe.torch_internals import tree_flatten, tree_unflatten, will_engine_execute_node


def input_grads(
    inputs: list[Any], grads: list[list[torch.Tensor | None]]
) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """(input leaf that requires grad, its gradient on that leaf's device) for every microbatch;
    ``grads[m]`` holds one entry per leaf of ``inputs[m]``."""
    pairs = []
    for value, grad in zip(inputs, grads, strict=True):
        for leaf, leaf_grad in zip(tree_flatten(value)[0], grad, strict=True):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                pairs.append((leaf, None if leaf_grad is None else leaf_grad.to(leaf.device)))
    return pairs


def backward_into_inputs(inputs: list[Any], grads: list[list[torch.Tensor | None]]) -> None:
    """Send the gradients of the user's inputs (those that require grad) into their graph.

    ``forward_backward`` is one backward pass per microbatch: where an input is the output of an
    upstream model's ``forward()`` (chained with ``merge_output=False``), that model's backward
    then adds each microbatch's gradients in turn, as the per-microbatch loop of plain PyTorch
    would, instead of as the one pass over them all its own backward is."""
    pairs = [(leaf, grad) for leaf, grad in input_grads(inputs, grads) if grad is not None]
    if not pairs:
        return
    # The autograd nodes of forward() calls (PipelineFunction's) whose outputs these are.
    nodes: set[Any] = {leaf.grad_fn for leaf, _ in pairs}
    upstream = [node for node in nodes if isinstance(getattr(node, "node", None), NodeState)]
    for ctx in upstream:
        ctx.microbatch_passes = True
    try:
        torch.autograd.backward([leaf for leaf, _ in pairs], [grad for _, grad in pairs])
    finally:
        for ctx in upstream:
            ctx.microbatch_passes = False


_TENSOR = object()  # marks where an output leaf was a tensor


class NodeState:
    """What the autograd node of one ``forward()`` call keeps for its backward: the call, the
    model's gradient state it accumulates into and the model's call lock (a backward is a call of
    the model too), and the shape of its outputs."""

    def __init__(
        self,
        call: Call,
        gradients: GradientState,
        lock: CallLock,
        inputs: list[Any],
        output_device: torch.device,
        weights_version: Callable[[], Any],
    ) -> None:
        self.call, self.gradients, self.lock = call, gradients, lock
        self.inputs, self.output_device = inputs, output_device
        # What the forward ran with; the backward recomputes with the weights of its own time.
        self.weights_version = weights_version
        self.forward_weights = weights_version()
        # The train/eval mode of every module the forward ran with: the recompute runs with it
        # (plain PyTorch's graph keeps what the forward computed, whatever model.eval() since).
        self.modules = [m for layer in call.model.layers for m in layer.modules()]
        self.forward_modes = [m.training for m in self.modules]
        self.output_specs: list[Any] = []
        self.output_leaves: list[list[Any]] = []

    def run_forward(self) -> list[torch.Tensor]:
        outputs, events = self.call.forward(self.inputs, self.output_device)
        for event in events:
            if event is not None:
                event.synchronize()
        flat: list[torch.Tensor] = []
        for value in outputs:
            leaves, spec = tree_flatten(value)
            self.output_specs.append(spec)
            # Tensors are replaced by a marker: the node must not keep its own outputs alive.
            self.output_leaves.append(
                [_TENSOR if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves]
            )
            flat.extend(leaf for leaf in leaves if isinstance(leaf, torch.Tensor))
        return flat

    def rebuild_outputs(self, flat: Sequence[torch.Tensor]) -> list[Any]:
        """Per-microbatch outputs whose tensors are the autograd node's outputs."""
        iterator = iter(flat)
        return [
            tree_unflatten(
                [next(iterator) if leaf is _TENSOR else leaf for leaf in leaves],
                spec,
            )
            for leaves, spec in zip(self.output_leaves, self.output_specs, strict=True)
        ]

    def run_backward(
        self,
        grad_outputs: Sequence[torch.Tensor | None],
        param_grads: bool,
        graph_node: Any,
        microbatch_passes: bool = False,
    ) -> list[Any]:
        """The pipelined recompute + backward of the autograd node ``graph_node``; returns
        per-microbatch input gradients. The parameters' gradients are accumulated in the host
        arena with ``param_grads``, else dropped. When the backward pass goes through other
        forward() calls of the model too, or hooks of tied weights need their whole gradient,
        they are summed over the pass first (``GradientState.accumulate_in_pass``); not with
        stage reduces, which sum each call's over the ranks (hooks then run once per call, on
        each use's part). Otherwise ``microbatch_passes`` (the pass is a downstream model's
        ``forward_backward``) adds them one microbatch after the other, in order, as its
        per-microbatch passes would (``GradientPolicy.microbatch_passes``)."""
        iterator = iter(grad_outputs)
        grads = [
            [next(iterator) if leaf is _TENSOR else None for leaf in leaves]
            for leaves in self.output_leaves
        ]
        with self.lock:
            if self.weights_version() != self.forward_weights:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by "
                    f"an inplace operation: the parameters of RoundPipe model "
                    f"'{self.call.model.name}' changed after the forward() whose output this "
                    "backward goes through (a step(), a load or an in-place edit); its "
                    "recompute would use other weights. Call backward before changing them."
                )
            call = self.call
            with self._forward_modes():
                # Decided per backward pass: a torch.autograd.grad through a retained graph may
                # come before a backward() that wants the parameters' gradients.
                if not param_grads:
                    return call.backward(grads, GradientPolicy(keep=False))[0]
                # Under the lock: forward() calls of other threads add to forward_nodes.
                gradients = self.gradients
                in_pass = _shares_pass(graph_node, gradients.forward_nodes)
                in_pass = in_pass or gradients.hooks_on_tied()

                def run(policy: GradientPolicy) -> tuple[list[Any], GradientOutcome]:
                    return call.backward(grads, policy)

                if in_pass and call.model.stage_reduce is None:
                    return gradients.accumulate_in_pass(run, self.lock)
                return gradients.accumulate(run, microbatch_passes)

    @contextlib.contextmanager
    def _forward_modes(self) -> Iterator[None]:
        """The modules in the train/eval mode of the forward while the backward recomputes."""
        now = [m.training for m in self.modules]
        if now == self.forward_modes:
            yield
            return
        for module, training in zip(self.modules, self.forward_modes, strict=True):
            module.training = training
        try:
            yield
        finally:
            for module, training in zip(self.modules, now, strict=True):
                module.training = training


def _wants_param_grads(params_node: Any) -> bool:
    """Whether the running backward pass reaches the anchor (a plain ``backward()``), rather
    than only the inputs (``torch.autograd.grad``, ``backward(inputs=...)``). Where the engine
    cannot tell (not inside one of its passes), the parameters' gradients are kept, as before."""
    return will_engine_execute_node(params_node)


def _shares_pass(ctx: Any, nodes: weakref.WeakSet[Any]) -> bool:
    """Whether the running backward pass also goes through another of ``nodes`` (the model's
    forward() calls) and wants the parameters' gradients there."""
    return any(other is not ctx and _wants_param_grads(other.params_node) for other in list(nodes))


def connect(node: NodeState, anchor: torch.Tensor, inputs: list[torch.Tensor]) -> Any:
    """Run ``node``'s forward as one autograd node over ``anchor`` and the user's ``inputs``
    that require grad; returns its flat output tensors."""
    apply: Callable[..., tuple[torch.Tensor, ...]] = PipelineFunction.apply
    # A view: its node (not a leaf's) tells in backward whether the parameters are wanted.
    return apply(node, anchor.view_as(anchor), *inputs)


class PipelineFunction(torch.autograd.Function):
    """The autograd node of a ``forward()`` call: backward runs the pipelined backward stages."""

    @staticmethod
    def forward(
        ctx: Any, node: NodeState, anchor: torch.Tensor, *input_leaves: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.node = node
        ctx.params_node = anchor.grad_fn
        node.gradients.forward_nodes.add(ctx)
        ctx.set_materialize_grads(False)
        # Saved only to be read in backward: autograd frees it after a backward without
        # retain_graph, so a second backward raises exactly as PyTorch does for its own nodes.
        ctx.save_for_backward(anchor)
        outputs = tuple(node.run_forward())
        # Outputs that plain PyTorch's would not have requiring grad (a detached one, or none of
        # the parameters and inputs they come from requiring grad) stay so: backward through
        # them raises as in plain PyTorch, where it would otherwise run and reach nothing.
        requiring_grad = node.call.outputs_requiring_grad
        ctx.mark_non_differentiable(
            *(t for t, wanted in zip(outputs, requiring_grad, strict=True) if not wanted)
        )
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor | None) -> tuple[Any, ...]:
        node: NodeState = ctx.node
        ctx.saved_tensors  # noqa: B018  (raises "backward through the graph a second time")
        if torch.is_grad_enabled():
            # The pipelined backward computes plain gradients: a graph of them (create_graph=True,
            # a gradient penalty) would silently have no history.
            raise RuntimeError(
                f"RoundPipe model '{node.call.model.name}': backward with create_graph=True "
                "(double backward, e.g. a gradient penalty) through a forward() output is not "
                "supported; compute such terms with a plain PyTorch model"
            )
        grads = node.run_backward(
            grad_outputs,
            _wants_param_grads(ctx.params_node),
            ctx,
            microbatch_passes=getattr(ctx, "microbatch_passes", False),
        )
        return (None, None, *(grad for _, grad in input_grads(node.inputs, grads)))


__all__ = ["NodeState", "PipelineFunction", "backward_into_inputs", "connect", "input_grads"]
