"""``RoundPipe``: pipelined training of an ``nn.Sequential`` (or any module) from host memory."""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from roundpipe.autograd import PipelineFunction, PipelineNode, backward_into_inputs
from roundpipe.batch import (
    Batch,
    RoundPipePackedData,
    merge_output,
    pack_output,
    packed_events,
    split_input,
    split_label,
)
from roundpipe.context import OptimizerCopiesView
from roundpipe.device import device_count
from roundpipe.memory import ModelMemory
from roundpipe.pipeline import Call, LayerRunner, ResidentStage, Step, run_steps, to_host
from roundpipe.run_config import ResolvedRunConfig, RoundPipeRunConfig, resolve_run_config
from roundpipe.scheduler import LayerProfile, ModelExecutePlan
from roundpipe.step import StepPipeline, in_step_job
from roundpipe.timer import ModelTimer

_PIN_MODES = ("alloc", "register", "off")


def _default_name() -> str:
    frame = sys._getframe(2)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _sum_losses(losses: list[Any]) -> Any:
    """Element-wise sum over microbatches, as detached CPU tensors (a list for sequences)."""
    if isinstance(losses[0], torch.Tensor):
        total = losses[0]
        for loss in losses[1:]:
            total = total + loss.to(total.device)
        return total.detach().cpu()
    return [_sum_losses([loss[i] for loss in losses]) for i in range(len(losses[0]))]


_Method = TypeVar("_Method", bound=Callable[..., Any])


def serialized(method: _Method) -> _Method:
    """Run ``method`` under the model's lock: calls on one model from several threads take turns
    (the result equals running them one after the other). Refused on the optimizer thread, where
    it would wait for the step that is running it."""

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if in_step_job():
            raise RuntimeError(
                f"RoundPipe model '{self.__dict__['name']}': {method.__name__}() was called from "
                "step_fn, which runs on the optimizer thread while the model waits for it; call "
                "it after step() returns"
            )
        with self.__dict__["_lock"]:
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class RoundPipe(OptimizerCopiesView):
    """Pipelined execution of ``model`` with its state in host memory.

    Args:
        model: an ``nn.Sequential`` (one layer per child) or any module (a single layer). Layer 0
            receives the call's ``(*args, **kwargs)``; every later layer receives exactly one
            positional argument, the previous layer's output (any pytree).
        optim_dtype: dtype of the optimizer copies of the parameters (default: each parameter's
            own dtype), e.g. ``torch.float32`` for a bf16 model.
        name: shown in errors, logs and traces; default ``"<caller file>:<line>"``.
        model_run_config: model-level defaults for every call (see ``RoundPipeRunConfig``).
        pin_model: host memory for the parameters: ``"alloc"`` (exact-size pinned allocation),
            ``"register"`` (page-locked in place, CUDA) or ``"off"`` (the parameters stay in
            their own pageable storage, memory-mapped weights included, and upload one copy
            each). On virtual CPU devices there is nothing to pin and all three are pageable.
    """

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),  # noqa: B008
        pin_model: str = "alloc",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        if optim_dtype is not None and not (
            isinstance(optim_dtype, torch.dtype) and optim_dtype.is_floating_point
        ):
            raise TypeError(
                f"optim_dtype must be a floating-point torch.dtype, got {optim_dtype!r}"
            )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name must be a str or None, got {type(name).__name__}")
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError(
                "model_run_config must be a RoundPipeRunConfig, got "
                f"{type(model_run_config).__name__}"
            )
        if pin_model not in _PIN_MODES:
            raise ValueError(f"pin_model must be one of {_PIN_MODES}, got {pin_model!r}")
        super().__init__()
        # `training` is read from and written to the wrapped model like any other attribute.
        del self.__dict__["training"]
        # list(Sequential) keeps a module that appears twice (children() would drop the repeat).
        layers = list(model) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ValueError("model is an empty nn.Sequential; give it at least one layer")
        state = self.__dict__
        state["model"] = model
        self._modules["model"] = model
        state["name"] = name if name is not None else _default_name()
        state["optim_dtype"] = optim_dtype
        state["model_run_config"] = model_run_config
        state["pin_model"] = pin_model
        state["layers"] = layers
        state["original_model"] = None
        state["_param_names"] = list(model.named_parameters(remove_duplicate=False))
        memory = ModelMemory(layers, pin_model)
        state["_memory"] = memory
        state["_timer"] = ModelTimer(
            len(layers), [layer.param_bytes for layer in memory.layers], state["name"]
        )
        state["_runner"] = LayerRunner(state["name"], layers, memory, state["_timer"])
        state["_plans"] = {}
        state["_pending"] = []
        state["_grads_dirty"] = False
        state["_grads_published"] = False
        state["_steps"] = StepPipeline(state["_memory"], optim_dtype)
        state["_anchor"] = torch.empty(0, requires_grad=True)
        state["_lock"] = threading.RLock()
        state["_constructed"] = True

    # -- attribute forwarding ----------------------------------------------------------------

    def set_original_model(self, original_model: nn.Module) -> None:
        """Forward attribute reads and writes to ``original_model`` (e.g. the Hugging Face model
        that a preset turned into a Sequential)."""
        self.__dict__["original_model"] = original_model

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            pass
        state = self.__dict__
        target = state.get("original_model") or state.get("model")
        if target is None:
            raise AttributeError(name)
        return getattr(target, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if not self.__dict__.get("_constructed"):
            super().__setattr__(name, value)
            return
        for target in self._forwarding_targets():
            setattr(target, name, value)

    def __delattr__(self, name: str) -> None:
        if not self.__dict__.get("_constructed"):
            super().__delattr__(name)
            return
        for target in self._forwarding_targets():
            if hasattr(target, name):
                delattr(target, name)

    def _forwarding_targets(self) -> list[nn.Module]:
        original = self.__dict__["original_model"]
        model = self.__dict__["model"]
        return [model] if original is None or original is model else [original, model]

    # -- parameters --------------------------------------------------------------------------

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named optimizer copies; names are the model's parameter names prefixed ``model.``.

        Safe on the optimizer thread while a call runs (the names were recorded at
        construction; the module tree is bound to device copies during a stage)."""
        copies = self.__dict__["_steps"].copies()
        dotted = f"{prefix}." if prefix else ""
        for name, param in self._trainable_named_parameters(remove_duplicate):
            yield f"{dotted}model.{name}", copies[id(param)]

    # -- calls -------------------------------------------------------------------------------

    @serialized
    def forward(
        self,
        *args: Any,
        roundpipe_run_config: RoundPipeRunConfig = RoundPipeRunConfig(),  # noqa: B008
        **kwargs: Any,
    ) -> Any:
        """Pipelined forward of the batch; the merged output lands on ``output_device``.

        With gradients enabled the output is connected to autograd: a later ``.backward()`` runs
        the pipelined recompute + backward, accumulating parameter gradients in host memory.
        """
        config = self._resolve(roundpipe_run_config)
        self.__dict__["_steps"].raise_if_failed()
        n = config.num_microbatch
        args_list, kwargs_list = split_input(args, kwargs, n, config.split_input)
        inputs = list(zip(args_list, kwargs_list, strict=True))
        run_type = "train" if config.requires_grad else "infer"
        plan = self._plan(config, run_type)
        call = self._new_call(config, saving=config.requires_grad)
        call.input_events = packed_events((args, kwargs), n)
        if config.requires_grad:
            call.plan_saving(plan.fwd_plan, plan.bwd_plan)
            self._begin_gradient_call()
        steps = [Step("forward", stage) for stage in plan.fwd_plan]
        if not config.requires_grad:
            with torch.no_grad():
                outputs = self._run_forward(call, steps, inputs)
            return self._finish_outputs(outputs, config)
        # Inputs that require grad become inputs of the autograd node, so their gradients flow.
        input_leaves = [
            leaf
            for leaf in tree_flatten(inputs)[0]
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        node = PipelineNode(self, call, plan, steps, inputs, config)
        flat_outputs = PipelineFunction.apply(node, self.__dict__["_anchor"], *input_leaves)
        per_microbatch = node.rebuild_outputs(flat_outputs)
        return self._merge(per_microbatch, config)

    @serialized
    def forward_backward(
        self,
        input_args: tuple[Any, ...] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], Any] = lambda outputs, labels: outputs,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig = RoundPipeRunConfig(),  # noqa: B008
    ) -> Any:
        """Forward, loss and backward of every microbatch, fused into one pipeline.

        Equivalent to ``for each microbatch: loss = loss_fn(model(input), label);
        torch.autograd.backward(loss)``. Returns the element-wise sum of the microbatch losses as
        a detached CPU tensor (a list if ``loss_fn`` returns a sequence), and with
        ``return_outputs=True`` also the merged outputs. Gradients reach the host arena (visible
        after ``synchronize()``); gradients of inputs that require grad reach the caller's graph
        before this returns.
        """
        if not isinstance(input_args, tuple):
            raise TypeError(f"input_args must be a tuple, got {type(input_args).__name__}")
        if input_kwargs is None:
            input_kwargs = {}
        if not isinstance(input_kwargs, dict):
            raise TypeError(f"input_kwargs must be a dict, got {type(input_kwargs).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        config = self._resolve(run_config)
        self.__dict__["_steps"].raise_if_failed()
        if not config.requires_grad:
            raise RuntimeError(
                "forward_backward computes gradients but requires_grad resolved to False; call it "
                "with gradients enabled, or use forward() for inference"
            )
        n = config.num_microbatch
        batch = Batch()
        args_list, kwargs_list = split_input(input_args, input_kwargs, n, config.split_input, batch)
        labels = split_label(label, n, config.split_label, batch)
        inputs = list(zip(args_list, kwargs_list, strict=True))
        plan = self._plan(config, "fused")
        call = self._new_call(config, saving=True)
        call.input_events = packed_events((input_args, input_kwargs), n)
        call.plan_saving(plan.fwd_plan, plan.bwd_plan[1:])
        steps = (
            [Step("forward", stage) for stage in plan.fwd_plan]
            + [Step("fused", plan.bwd_plan[0])]
            + [Step("backward", stage) for stage in plan.bwd_plan[1:]]
        )
        results: dict[str, Any] = {"values": inputs}

        def body(step: Step, stage: ResidentStage) -> None:
            if step.kind == "forward":
                results["values"] = call.forward_step(stage, results["values"])
            elif step.kind == "fused":
                losses, outputs, grads = call.fused_step(
                    stage, results["values"], labels, loss_fn, return_outputs
                )
                results.update(losses=losses, outputs=outputs, values=grads)
            else:
                results["values"] = call.backward_step(stage, results["values"])

        self._begin_gradient_call()
        with self._gradient_transaction(call):
            run_steps(call, steps, body)
            loss = _sum_losses(results["losses"])
            outputs = self._finish_outputs(results["outputs"], config) if return_outputs else None
            backward_into_inputs(inputs, results["values"])
        return (loss, outputs) if return_outputs else loss

    @serialized
    def step(
        self, step_fn: Callable[..., Any], is_async: bool = True, *args: Any, **kwargs: Any
    ) -> None:
        """Run ``step_fn(*args, **kwargs)`` on the optimizer thread over this iteration's
        gradients, moved into the optimizer copies' ``.grad`` (cast to ``optim_dtype``).

        ``step_fn`` runs with ``OptimizerCtx`` active, so ``model.parameters()`` inside it are
        the optimizer copies. Asynchronous by default: returns at once and the next iteration
        trains on weights one step stale. ``is_async=False`` waits and publishes fresh weights.
        An exception in ``step_fn`` is raised by the next ``step``, ``synchronize`` or forward.
        """
        if not callable(step_fn):
            raise TypeError(f"step_fn must be callable, got {type(step_fn).__name__}")
        if not isinstance(is_async, bool):
            raise TypeError(f"is_async must be a bool, got {type(is_async).__name__}")
        self._wait_pending()
        self._absorb_user_grads()
        self.__dict__["_memory"].fold_alias_grads()
        self.__dict__["_steps"].step(step_fn, is_async, args, kwargs)
        self.__dict__["_grads_dirty"] = False

    @serialized
    def synchronize(self) -> None:
        """Wait for pending work and publish the accumulated gradients into ``param.grad``.

        Also waits for the optimizer thread and writes the newest weights into the model. The
        gradients stay in the host arena too, so a following ``step()`` still sees them.
        """
        self._wait_pending()
        self.__dict__["_steps"].finish()
        memory = self.__dict__["_memory"]
        memory.wait_writes()
        memory.fold_alias_grads()
        for slot in memory.slots():
            if slot.grad_offset is not None:
                slot.param.grad = memory.grad_view(slot)
        self.__dict__["_grads_published"] = True

    # -- checkpoints -------------------------------------------------------------------------

    @serialized
    def state_dict(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The model's state after draining pending work (the optimizer thread included), plus
        RoundPipe's own: the optimizer copies (``_roundpipe.optim.<name>``) and gradients
        accumulated but not yet stepped (``_roundpipe.grads``).

        Checkpoint recipe (consistent with the asynchronous optimizer)::

            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            torch.save(state, path)
            ...
            model.load_state_dict(state["model"])  # before creating or loading the optimizer
            optimizer.load_state_dict(state["optimizer"])
        """
        self._drain()
        return super().state_dict(*args, **kwargs)

    @serialized
    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Load a ``state_dict()`` of this (or a plain) model; pending work is drained first.

        Without ``_roundpipe.optim.*`` entries (a plain model's checkpoint), existing optimizer
        copies are refreshed from the loaded parameters."""
        if assign:
            raise ValueError(
                "assign=True would replace the parameters that RoundPipe keeps in its host arena; "
                "load with assign=False"
            )
        self._drain()
        result = super().load_state_dict(state_dict, strict=strict)
        self._refresh_copies()
        return result

    def _refresh_copies(self) -> None:
        """After a load: optimizer copies from the checkpoint's ``_roundpipe.optim.*`` entries,
        or from the loaded parameters (existing copies only, unless the checkpoint has some)."""
        state = self.__dict__
        saved_copies = state.pop("_loaded_copies", {})
        if saved_copies or state["_steps"].has_copies():
            with torch.no_grad():
                for (name, copy), (_, param) in zip(
                    self.optim_named_parameters(), self._trainable_named_parameters(), strict=True
                ):
                    copy.copy_(saved_copies.get(name, param))

    def _own_state(self) -> dict[str, Any]:
        """The optimizer copies (``optim.<name>``) and gradients accumulated but not yet stepped
        (``grads``)."""
        state = self.__dict__
        entries: dict[str, Any] = {}
        if state["_steps"].has_copies():
            for name, copy in self.optim_named_parameters():
                entries[f"optim.{name}"] = copy.detach().clone()
        if state["_grads_dirty"]:
            entries["grads"] = state["_memory"].grads.clone()
        return entries

    def _load_own_state(self, entries: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        state = self.__dict__
        grads = entries.get("grads")
        arena = state["_memory"].grads
        if grads is not None:
            if grads.shape != arena.shape:
                error_msgs.append(
                    f"{prefix}grads holds {grads.numel()} bytes but this model's gradient arena "
                    f"{arena.numel()}: the checkpoint is of another model"
                )
            else:
                with torch.no_grad():
                    arena.copy_(grads)
                state["_grads_dirty"] = True
        state["_loaded_copies"] = {
            key.removeprefix("optim."): value
            for key, value in entries.items()
            if key.startswith("optim.")
        }

    def _trainable_named_parameters(
        self, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of every parameter that requires grad, recorded at construction."""
        seen: set[int] = set()
        for name, param in self.__dict__["_param_names"]:
            if param.requires_grad and not (remove_duplicate and id(param) in seen):
                seen.add(id(param))
                yield name, param

    # -- internals ---------------------------------------------------------------------------

    def _drain(self) -> None:
        """Finish every pending transfer and optimizer step (weights written back)."""
        self._wait_pending()
        self.__dict__["_steps"].finish()
        self.__dict__["_memory"].wait_writes()

    def _resolve(self, call_config: RoundPipeRunConfig) -> ResolvedRunConfig:
        if not isinstance(call_config, RoundPipeRunConfig):
            raise TypeError(
                f"run config must be a RoundPipeRunConfig, got {type(call_config).__name__}"
            )
        return resolve_run_config(call_config, self.__dict__["model_run_config"])

    def _plan(self, config: ResolvedRunConfig, run_type: str) -> ModelExecutePlan:
        """The call's plan: the explicit one (validated), or an automatic one that is re-planned
        only when the layer timings or the device pool changed."""
        state = self.__dict__
        plan = config.execute_plan
        if plan is not None:
            plan.validate(len(state["layers"]), run_type)  # type: ignore[arg-type]
            return plan
        key = (run_type, device_count())
        version = state["_timer"].version
        cached = state["_plans"].get(key)
        if cached is None or cached[0] != version:
            cached = (version, ModelExecutePlan.auto(run_type, self))
            state["_plans"][key] = cached
        return cached[1]

    def _layer_profile(self) -> LayerProfile:
        """Per-layer time estimates and device memory, for ``ModelExecutePlan.auto``."""
        layers = self.__dict__["_memory"].layers
        return self.__dict__["_timer"].profile(
            [layer.param_bytes for layer in layers],
            [layer.param_bytes + layer.grad_bytes for layer in layers],
        )

    def _new_call(self, config: ResolvedRunConfig, saving: bool) -> Call:
        """A call about to run (arguments validated): shared parameters are refreshed first."""
        self.__dict__["_memory"].sync_aliases()
        return Call(
            self.__dict__["_runner"],
            config.num_microbatch,
            config.recompute_grain,
            config.preserve_rng_state,
            saving,
        )

    def _run_forward(self, call: Call, steps: list[Step], inputs: list[Any]) -> list[Any]:
        values: dict[str, list[Any]] = {"values": inputs}

        def body(step: Step, stage: ResidentStage) -> None:
            values["values"] = call.forward_step(stage, values["values"])

        run_steps(call, steps, body)
        return values["values"]

    def _finish_outputs(self, outputs: list[Any], config: ResolvedRunConfig) -> Any:
        """Move per-microbatch outputs to ``output_device``, then merge or pack them."""
        moved, events = [], []
        for value in outputs:
            value, event = self._to_output_device(value, config.output_device)
            moved.append(value)
            events.append(event)
        if config.merge_output is False:
            return pack_output(moved, events)
        for event in events:
            if event is not None:
                event.synchronize()
        return merge_output(moved, config.merge_output)

    def _merge(self, outputs: list[Any], config: ResolvedRunConfig) -> Any:
        if config.merge_output is False:
            return pack_output(outputs, [None] * len(outputs))
        return merge_output(outputs, config.merge_output)

    @staticmethod
    def _to_output_device(value: Any, device: torch.device) -> tuple[Any, Any]:
        if device.type == "cpu":
            return to_host(value, _device_of(value))
        return tree_map(
            lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t, value
        ), None

    def _begin_gradient_call(self) -> None:
        """Before a call that accumulates gradients: finish the previous call's accumulation and
        take over gradients the user changed after ``synchronize()``."""
        self._wait_pending()
        self._absorb_user_grads()

    def _absorb_user_grads(self) -> None:
        """Gradients published by ``synchronize()`` go back into the arena as the user left them:
        cleared (``None``) means zero, a replaced tensor is copied in, views are kept."""
        state = self.__dict__
        if not state["_grads_published"]:
            return
        memory = state["_memory"]
        dirty = False
        with torch.no_grad():
            for slot in memory.slots():
                if slot.grad_offset is None:
                    continue
                view = memory.grad_view(slot)
                grad = slot.param.grad
                if grad is None:
                    view.zero_()
                elif grad.data_ptr() != view.data_ptr():
                    view.copy_(grad)
                    dirty = True
                else:
                    dirty = True
                slot.param.grad = None
        state["_grads_published"] = False
        state["_grads_dirty"] = dirty

    def _gradient_transaction(self, call: Call) -> _GradientTransaction:
        return _GradientTransaction(self, call)

    def _wait_pending(self) -> None:
        pending = self.__dict__["_pending"]
        try:
            while pending:
                pending[0].synchronize()
                pending.pop(0)
        finally:
            pending.clear()


def _device_of(value: Any) -> int:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device.index
    return 0


class _GradientTransaction:
    """Keeps the host gradients consistent when a call fails half-way: the gradients it already
    accumulated are rolled back, so the next call trains as if the failed one never ran."""

    def __init__(self, model: RoundPipe, call: Call) -> None:
        self.model, self.call = model, call
        state = model.__dict__
        self.backup = state["_memory"].grads.clone() if state["_grads_dirty"] else None

    def __enter__(self) -> None:
        return None

    def __exit__(self, error_type: type[BaseException] | None, *exc: object) -> None:
        state = self.model.__dict__
        pending = self.call.pending
        if error_type is None:
            state["_pending"].extend(pending)
            state["_grads_dirty"] = True
            return
        for event in pending:
            try:
                event.synchronize()
            except Exception:  # the call's own error is what the caller needs
                pass
        grads = state["_memory"].grads
        if self.backup is None:
            grads.zero_()
        else:
            grads.copy_(self.backup)


def __getattr__(name: str) -> Any:
    # AutoRoundPipe builds on RoundPipe, so it is defined in roundpipe.models and served lazily.
    if name == "AutoRoundPipe":
        from roundpipe.models.wrap import AutoRoundPipe

        return AutoRoundPipe
    raise AttributeError(f"module 'roundpipe.roundpipe' has no attribute {name!r}")


__all__ = ["AutoRoundPipe", "RoundPipe", "RoundPipePackedData"]  # noqa: F822 (lazy, above)
