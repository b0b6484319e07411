"""``RoundPipe``: pipelined training of an ``nn.Sequential`` (or any module) from host memory."""

from __future__ import annotations

import copy
import functools
import gc
import os
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import torch
from torch import nn

from roundpipe.batch import (
    BatchRows,
    RoundPipePackedData,
    merge_or_pack,
    packed_events,
    split_input,
    split_label,
)
from roundpipe.call.autograd import NodeState, backward_into_inputs, connect
from roundpipe.call.checks import (
    refuse_added_parameters,
    refuse_changed_layers,
    refuse_sequential_hooks,
)
from roundpipe.call.lock import CallLock, hold_for_fork
from roundpipe.call.pipeline import Call, CallModel, LossSpec
from roundpipe.checkpoints.model_state import ModelState
from roundpipe.context import optimizer_context_active
from roundpipe.device import device_count
from roundpipe.distributed import (
    NO_GROUP,
    DataParallelShard,
    ShardPiece,
    check_group,
    check_reduce_mode,
    replicas_of,
)
from roundpipe.forwarding import ForwardingModule
from roundpipe.gradients import GradientOutcome, GradientPolicy, GradientState
from roundpipe.memory import ModelMemory, checked_shared_parameters, module_bytes
from roundpipe.optim.offload import OptimOffload, check_optim_offload, open_store
from roundpipe.optim.step import StepPipeline
from roundpipe.optim.step_thread import in_step_job
from roundpipe.run_config import ResolvedRunConfig, RoundPipeRunConfig, resolve_run_config
from roundpipe.scheduler import LayerProfile, ModelExecutePlan, RunType
from roundpipe.timer import ModelTimer
from roundpipe.torch_internals import tree_flatten, version_of

_PIN_MODES = ("alloc", "register", "off")


def _default_name() -> str:
    frame = sys._getframe(2)
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class GradientsDisabledError(RuntimeError, AssertionError):
    """``forward_backward`` called with gradients off (``torch.no_grad()`` or
    ``requires_grad=False``). Both a ``RuntimeError`` and an ``AssertionError``: roundpipe 0.1.1
    asserted here, so code written for either type catches it."""


@dataclass(eq=False)  # identity: the live ones are kept in a WeakSet
class _Runtime:
    """Everything a RoundPipe keeps behind its public attributes."""

    memory: ModelMemory
    timer: ModelTimer
    model: CallModel
    gradients: GradientState
    steps: StepPipeline
    param_names: list[tuple[str, nn.Parameter]]
    # The runtime's own state-dict entries (optimizer copies, gradients, pending write-back).
    state: ModelState
    # Calls on the model take turns (see ``serialized``).
    lock: CallLock
    # The autograd node's input that ties a forward() with gradients into the graph.
    anchor: torch.Tensor = field(default_factory=lambda: torch.empty(0, requires_grad=True))
    # Automatic plans by (run type, device count): (timer version, plan).
    plans: dict[tuple[str, int], tuple[int, ModelExecutePlan]] = field(default_factory=dict)

    def weights_version(self) -> tuple[int, int]:
        """Changes whenever the parameters' values may have: with each step (its weights land
        in the parameter arena without touching the parameters' version counters) and with every
        in-place change of a parameter (a load, the user's own)."""
        return self.steps.submitted, sum(version_of(param) for _, param in self.param_names)


_Method = TypeVar("_Method", bound=Callable[..., Any])
RoundPipeBase = ForwardingModule  # roundpipe 0.1.1's base class of RoundPipe and AutoRoundPipe

# Every live model's runtime: whose parameters are wrapped, and whose calls fork() waits for.
_runtimes: weakref.WeakSet[_Runtime] = weakref.WeakSet()
hold_for_fork(lambda: [runtime.lock for runtime in list(_runtimes)])


def _refuse_wrapped_twice(layers: list[nn.Module], shared: frozenset[int]) -> None:
    """A trained parameter lives in one model's host arena: wrapping it again would leave the
    first model training weights the module no longer shows. ``ValueError`` naming that model.
    (Frozen parameters may be shared: nothing trains them; so may ``shared``, which another
    owner trains.)"""
    ours = {
        id(p)
        for layer in layers
        for p in layer.parameters()
        if p.requires_grad and id(p) not in shared
    }
    if not ours:
        return
    owner = _owner_of(ours)
    if owner is not None:
        gc.collect()  # a model dropped but still in a reference cycle lets go of them
        owner = _owner_of(ours)
    if owner is not None:
        raise ValueError(
            f"the module's parameters are already wrapped by RoundPipe model '{owner}' (its "
            "host arena holds them); wrap a copy (copy.deepcopy(module)), or use that model"
        )


def _owner_of(params: set[int]) -> str | None:
    """The name of a live model that trains one of ``params`` (ids), if any; holds no model."""
    for runtime in list(_runtimes):
        if any(id(p) in params and p.requires_grad for _, p in runtime.param_names):
            return runtime.model.name
    return None


def serialized(method: _Method) -> _Method:
    """Run ``method`` under the model's lock: calls on one model from several threads take turns
    (the result equals running them one after the other). Refused on the optimizer thread, where
    it would wait for the step that is running it."""

    @functools.wraps(method)
    def run(self: RoundPipe, *args: Any, **kwargs: Any) -> Any:
        with self._locked(method.__name__):
            return method(self, *args, **kwargs)

    return run  # type: ignore[return-value]


class RoundPipe(ForwardingModule):
    """Pipelined execution of ``model`` with its state in host memory.

    Args:
        model: an ``nn.Sequential`` (one layer per child) or any module (a single layer). Layer 0
            receives the call's ``(*args, **kwargs)``; every later layer receives exactly one
            positional argument, the previous layer's output (any pytree).
        optim_dtype: dtype of the optimizer copies of the parameters (default: each parameter's
            own dtype), e.g. ``torch.float32`` for a bf16 model.
        name: shown in errors, logs and traces; default ``"<caller file>:<line>"``.
        model_run_config: model-level defaults for every call (see ``RoundPipeRunConfig``);
            default: a new, empty ``RoundPipeRunConfig()`` of this model's own.
        pin_model: host memory for the parameters: ``"alloc"`` (exact-size pinned allocation),
            ``"register"`` (page-locked in place, CUDA) or ``"off"`` (the parameters stay in
            their own pageable storage, memory-mapped weights included, and upload one copy
            each). On virtual CPU devices there is nothing to pin and all three are pageable.
        data_parallel_group: a ``torch.distributed.ProcessGroup`` (e.g. ``dist.group.WORLD``)
            whose ranks each run a replica of this model on their own part of the global batch:
            gradients are averaged across them at every ``step()`` and the optimizer copies are
            sharded (see ``docs/guide.md``, "Scaling out"). Every rank must create the same model
            with the same settings, in the same order as its other data-parallel models. Left
            out, or a group of one rank: no data parallelism. ``None`` too, except in a process
            launched as one of several ranks (``WORLD_SIZE`` > 1) before ``init_process_group``,
            where it is ``dist.group.WORLD`` read too early: ``ValueError``.
        data_parallel_reduce: where the ranks' gradients are summed: ``"host"`` (the whole
            gradient arena, on the optimizer thread, before the step), ``"stage"`` (at the end
            of every backward stage, on the stage's device, so that each rank downloads only
            its own shard: every rank must then run the same backward calls with the same
            plan), or ``"auto"`` (``"stage"`` on CUDA GPUs, ``"host"`` on virtual CPU devices).
        shared_parameters: parameters of ``model`` that another owner trains, typically a weight
            tied across the parts of an ``AutoRoundPipe`` (whose host glue then holds its
            optimizer copy; ``wrap_model_to_roundpipe`` sets this). This model computes with a
            copy of each, refreshed before every call, and adds its gradient to the
            parameter's ``.grad`` when its gradients are handed over (``step()``,
            ``synchronize()``, :meth:`hand_over_shared_grads`); it keeps no optimizer copy of
            them. Not with data parallelism.
        optim_offload: a folder on a fast local disk (or a ``roundpipe.OptimOffload``, which
            also sizes the I/O buffers) that keeps the fp32 optimizer copies, and the moments of
            ``roundpipe.optim.Adam`` given them, in files instead of host memory (needs
            ``optim_dtype=torch.float32``; ``docs/guide.md``, "Optimizer state on disk"). Other
            optimizers cannot step them (``TypeError``). An existing, writable folder serving
            one model per rank at a time (else ``ValueError``); its files are scratch space.
    """

    name: str
    optim_dtype: torch.dtype | None
    model_run_config: RoundPipeRunConfig
    pin_model: str
    layers: list[nn.Module]
    shared_parameters: tuple[nn.Parameter, ...]
    num_layers: int  # roundpipe 0.1.1's attributes: the number of layers,
    layer_size: list[float]  # each layer's parameters and buffers in GB (10**9 bytes),
    model_timer: ModelTimer  # and the layer timings the automatic plans use
    _runtime: _Runtime

    def __init__(
        self,
        model: nn.Module,
        optim_dtype: torch.dtype | None = None,
        name: str | None = None,
        model_run_config: RoundPipeRunConfig | None = None,
        pin_model: str = "alloc",
        data_parallel_group: Any = NO_GROUP,
        data_parallel_reduce: str = "auto",
        *,
        shared_parameters: Iterable[nn.Parameter] = (),
        optim_offload: str | os.PathLike[str] | OptimOffload | None = None,
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
        if model_run_config is None:
            model_run_config = RoundPipeRunConfig()
        if not isinstance(model_run_config, RoundPipeRunConfig):
            raise TypeError(
                "model_run_config must be a RoundPipeRunConfig, got "
                f"{type(model_run_config).__name__}"
            )
        # A snapshot, as 0.1.1 takes: changing the config object later changes no model.
        model_run_config = copy.deepcopy(model_run_config)
        if pin_model not in _PIN_MODES:
            raise ValueError(f"pin_model must be one of {_PIN_MODES}, got {pin_model!r}")
        offload_config = check_optim_offload(optim_offload, optim_dtype)
        data_parallel_size = check_group(data_parallel_group)
        check_reduce_mode(data_parallel_reduce)
        shared = checked_shared_parameters(model, shared_parameters)
        if shared and data_parallel_size > 1:
            raise ValueError(
                "shared_parameters cannot be used with data_parallel_group: their gradients "
                "leave the model through .grad, which the ranks would not average; put every "
                "use of a shared weight in one data-parallel RoundPipe (an nn.Sequential or a "
                "preset)"
            )
        # list(Sequential) keeps a module that appears twice (children() would drop the repeat).
        layers = list(model) if isinstance(model, nn.Sequential) else [model]
        if not layers:
            raise ValueError("model is an empty nn.Sequential; give it at least one layer")
        name = name if name is not None else _default_name()
        _refuse_wrapped_twice(layers, frozenset(id(p) for p in shared))
        memory = ModelMemory(layers, pin_model, frozenset(id(p) for p in shared))
        data_parallel = replicas_of(
            data_parallel_group,
            model,
            memory,
            name,
            {"optim_dtype": str(optim_dtype), "pin_model": pin_model},
            data_parallel_reduce,
        )
        timer = ModelTimer(len(layers), [layer.param_bytes for layer in memory.layers], name)
        stage_reduce = data_parallel
        if data_parallel is None or data_parallel.reduce_mode != "stage":
            stage_reduce = None
        param_names = list(model.named_parameters(remove_duplicate=False))
        gradients = GradientState(memory, name, {id(p): n for n, p in param_names})
        rank = 0 if data_parallel is None else data_parallel.rank
        offload = open_store(offload_config, name, rank)  # optimizer copies on disk, or None
        steps = StepPipeline(memory, optim_dtype, name, data_parallel, offload)
        runtime = _Runtime(
            memory=memory,
            timer=timer,
            model=CallModel(
                name,
                layers,
                memory,
                timer,
                stage_reduce,
                data_parallel if data_parallel is not None and data_parallel.has_buffers else None,
            ),
            gradients=gradients,
            steps=steps,
            param_names=param_names,
            state=ModelState(memory, gradients, steps),
            lock=CallLock(name),
        )
        _runtimes.add(runtime)
        super().__init__(
            model,
            name=name,
            optim_dtype=optim_dtype,
            model_run_config=model_run_config,
            pin_model=pin_model,
            layers=layers,
            shared_parameters=shared,
            num_layers=len(layers),
            layer_size=[module_bytes(layer) / 1e9 for layer in layers],
            model_timer=timer,
            _runtime=runtime,
        )

    # -- parameters --------------------------------------------------------------------------

    def optim_named_parameters(
        self, prefix: str = "", remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """Named optimizer copies; names are the model's parameter names prefixed ``model.``.

        Safe on the optimizer thread while a call runs (the names were recorded at
        construction; the module tree is bound to device copies during a stage)."""
        copies = self._runtime.steps.copies()
        dotted = f"{prefix}." if prefix else ""
        for name, param in self._trainable_named_parameters(remove_duplicate):
            if id(param) in copies:  # with data parallelism: the own shard's only
                yield f"{dotted}model.{name}", copies[id(param)]

    @property
    def data_parallel_size(self) -> int:
        """The number of data-parallel ranks (1 without data parallelism)."""
        dp = self._runtime.steps.data_parallel
        return 1 if dp is None else dp.world_size

    def data_parallel_shard(self) -> DataParallelShard:
        """This rank's part of the optimizer: rank, world size and one :class:`ShardPiece`
        (name, whole shape, flattened element range, optimizer copy) per optimizer copy, in
        ``optim_named_parameters()`` order. Without data parallelism: rank 0 of 1, whole
        parameters."""
        steps = self._runtime.steps
        copies = steps.copies()
        pieces = [
            ShardPiece(f"model.{name}", param.shape, *steps.elements_of(param), copies[id(param)])
            for name, param in self._trainable_named_parameters()
            if id(param) in copies
        ]
        dp = steps.data_parallel
        if dp is None:
            return DataParallelShard(0, 1, pieces)
        return DataParallelShard(dp.rank, dp.world_size, pieces, dp.group, dp.agree)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients of the optimizer copies to a total norm of ``max_norm``, as
        ``torch.nn.utils.clip_grad_norm_(model.optim_parameters(), ...)``, but with data
        parallelism over the whole model: the norm is combined across the ranks. Call it in
        ``step_fn`` (on every rank). Returns the total norm before clipping."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)):
            raise TypeError(f"max_norm must be a number, got {type(max_norm).__name__}")
        if isinstance(norm_type, bool) or not isinstance(norm_type, (int, float)):
            raise TypeError(f"norm_type must be a number, got {type(norm_type).__name__}")
        steps = self._runtime.steps
        if steps.data_parallel is not None and not in_step_job():
            raise RuntimeError(
                f"RoundPipe model '{self.name}': with data parallelism clip_grad_norm_() combines "
                "the ranks' norms in the optimizer step; call it inside step_fn"
            )
        return steps.clip_grad_norm_(float(max_norm), float(norm_type))

    # -- calls -------------------------------------------------------------------------------

    @serialized
    def forward(
        self,
        *args: Any,
        roundpipe_run_config: RoundPipeRunConfig | None = None,
        **kwargs: Any,
    ) -> Any:
        """Pipelined forward of the batch; the merged output lands on ``output_device``.

        With gradients enabled the output is connected to autograd: a later ``.backward()`` runs
        the pipelined recompute + backward, accumulating parameter gradients in host memory.
        """
        misplaced = [key for key, value in kwargs.items() if isinstance(value, RoundPipeRunConfig)]
        if misplaced:
            raise TypeError(
                f"forward() takes the run config as roundpipe_run_config=..., got "
                f"{misplaced[0]}=RoundPipeRunConfig(...), which would be passed to layer 0 as a "
                f"keyword argument (other keyword arguments go to layer 0 as they are)"
            )
        config = self._resolve(roundpipe_run_config, "roundpipe_run_config")
        runtime = self._runtime
        runtime.steps.raise_if_failed()
        args_list, kwargs_list = split_input(
            args, kwargs, config.num_microbatch, config.split_input
        )
        config = config.fitted(len(args_list))
        n = config.num_microbatch
        inputs = list(zip(args_list, kwargs_list, strict=True))
        call = self._new_call(
            config, "train" if config.requires_grad else "infer", packed_events((args, kwargs), n)
        )
        if not config.requires_grad:
            with torch.no_grad():
                outputs, events = call.forward(inputs, config.output_device)
            return merge_or_pack(outputs, events, config.merge_output)
        runtime.gradients.begin_call()
        # Inputs that require grad become inputs of the autograd node, so their gradients flow.
        input_leaves = [
            leaf
            for leaf in tree_flatten(inputs)[0]
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
        ]
        node = NodeState(
            call,
            runtime.gradients,
            runtime.lock,
            inputs,
            config.output_device,
            runtime.weights_version,
        )
        flat_outputs = connect(node, runtime.anchor, input_leaves)
        per_microbatch = node.rebuild_outputs(flat_outputs)
        return merge_or_pack(per_microbatch, [None] * len(per_microbatch), config.merge_output)

    @serialized
    def forward_backward(
        self,
        input_args: tuple[Any, ...] | list[Any] = (),
        input_kwargs: dict[str, Any] | None = None,
        label: Any = None,
        loss_fn: Callable[[Any, Any], Any] = lambda outputs, labels: outputs,
        return_outputs: bool = False,
        run_config: RoundPipeRunConfig | None = None,
    ) -> Any:
        """Forward, loss and backward of every microbatch, fused into one pipeline.

        Equivalent to ``for each microbatch: loss = loss_fn(model(input), label);
        torch.autograd.backward(loss)``. Returns the element-wise sum of the microbatch losses as
        a detached CPU tensor (a list if ``loss_fn`` returns a sequence), and with
        ``return_outputs=True`` also the merged outputs. Gradients reach the host arena (visible
        after ``synchronize()``); gradients of inputs that require grad reach the caller's graph
        before this returns.
        """
        if isinstance(input_args, list):  # 0.1.1 took one too (a collate function's batch)
            input_args = tuple(input_args)
        if not isinstance(input_args, tuple):
            raise TypeError(
                f"input_args must be a tuple (or list), got {type(input_args).__name__}"
            )
        if input_kwargs is None:
            input_kwargs = {}
        if not isinstance(input_kwargs, dict):
            raise TypeError(f"input_kwargs must be a dict, got {type(input_kwargs).__name__}")
        if not callable(loss_fn):
            raise TypeError(f"loss_fn must be callable, got {type(loss_fn).__name__}")
        config = self._resolve(run_config, "run_config")
        runtime = self._runtime
        runtime.steps.raise_if_failed()
        if not config.requires_grad:
            raise GradientsDisabledError(
                "forward_backward computes gradients but requires_grad resolved to False; call it "
                "with gradients enabled, or use forward() for inference"
            )
        batch = BatchRows()
        args_list, kwargs_list = split_input(
            input_args, input_kwargs, config.num_microbatch, config.split_input, batch
        )
        config = config.fitted(len(args_list))
        n = config.num_microbatch
        labels = split_label(label, n, config.split_label, batch)
        inputs = list(zip(args_list, kwargs_list, strict=True))
        call = self._new_call(config, "fused", packed_events((input_args, input_kwargs), n))
        spec = LossSpec(labels, loss_fn, return_outputs)

        def run(policy: GradientPolicy) -> tuple[tuple[Any, Any], GradientOutcome]:
            grads, outcome = call.forward_backward(inputs, spec, config.output_device, policy)
            try:
                loss = call.summed_losses()
                outputs = (
                    merge_or_pack(call.outputs, call.output_events, config.merge_output)
                    if return_outputs
                    else None
                )
                backward_into_inputs(inputs, grads)
            except BaseException:
                call.settle_transfers()  # before the gradient state rolls back what they wrote
                raise
            return (loss, outputs), outcome

        loss, outputs = runtime.gradients.accumulate(run)
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
        runtime = self._runtime
        self._check_as_wrapped()
        with runtime.gradients.handing_over():
            runtime.steps.step(
                step_fn, is_async, args, kwargs, frozenset(runtime.gradients.reached)
            )

    @serialized
    def synchronize(self) -> None:
        """Wait for pending work and publish the accumulated gradients into ``param.grad``.

        Also waits for the optimizer thread and writes the newest weights into the model. The
        gradients stay in the host arena too, so a following ``step()`` still sees them.
        """
        runtime = self._runtime
        runtime.gradients.wait_pending()
        runtime.steps.finish()
        runtime.gradients.publish()

    @serialized
    def hand_over_shared_grads(self) -> None:
        """Add the gradients accumulated for ``shared_parameters`` to their ``.grad`` (waiting
        for the transfers in flight) and clear them here, for their owner to step; ``step()``
        and ``synchronize()`` do it too. Nothing without shared parameters."""
        self._runtime.gradients.hand_over_shared()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``nn.Module.zero_grad``: clear the gradients accumulated so far, in the host arena
        whether or not ``synchronize()`` published them (the next call accumulates from zero).
        Inside ``step_fn`` (``OptimizerCtx``), the optimizer copies' gradients, which are the
        model's parameters there."""
        if optimizer_context_active():
            super().zero_grad(set_to_none)
            return
        self._clear_grads(set_to_none)

    @serialized
    def _clear_grads(self, set_to_none: bool) -> None:
        self._runtime.gradients.clear(set_to_none)

    @serialized
    def drain(self) -> None:
        """Finish every pending gradient transfer and optimizer step (new weights written back),
        without publishing gradients into ``param.grad``."""
        runtime = self._runtime
        runtime.gradients.wait_pending()
        runtime.steps.finish()
        runtime.memory.wait_writes()

    def sync_optim_param(self) -> None:
        """roundpipe 0.1.1's name for :meth:`drain` (the step's new weights in the model)."""
        self.drain()

    @property
    def layer_attrs(self) -> NoReturn:
        """roundpipe 0.1.1's per-layer transfer events; the runtime orders transfers natively."""
        raise NotImplementedError(
            f"'{self.name}': layer_attrs (0.1.1's per-layer transfer events) does not exist here; "
            "use synchronize() or sync_optim_param(), model_timer, layer_size"
        )

    # -- checkpoints -------------------------------------------------------------------------

    @serialized
    def wait_for_step(self) -> None:
        """Wait for pending gradient transfers, the asynchronous step in flight and the weight
        writes queued so far, without writing that step's weights back (what ``state_dict()``
        does first; ``synchronize()`` would publish them and change the training): the optimizer
        copies and the optimizer's state are then after the step, the parameters the weights
        the next iteration uses. A failed step raises a ``RuntimeError`` here (its error as the
        cause), and its error again at the next ``step()`` or ``synchronize()``."""
        runtime = self._runtime
        runtime.gradients.wait_pending()
        try:
            runtime.steps.wait_step()
        except Exception as error:
            raise RuntimeError(
                f"RoundPipe model {self.name!r}: the optimizer step in flight failed, so there "
                "is no consistent state to read; its error is raised again by the next step() "
                "or synchronize()"
            ) from error
        runtime.memory.wait_writes()  # the parameters: earlier write-backs landed

    def _locked(self, method: str) -> CallLock:
        """The model's lock, for ``method`` (see :func:`serialized`)."""
        if in_step_job():
            raise RuntimeError(
                f"RoundPipe model '{self.name}': {method}() was called from step_fn, which runs "
                "on the optimizer thread while the model waits for it; call it after step() "
                "returns"
            )
        return self._runtime.lock

    def _state_lock(self) -> CallLock:
        return self._locked("state_dict")

    @serialized
    def _check_state_dict_only(self, state_dict: Any, strict: bool) -> None:
        """As the base class's, under the model's lock (a load in another thread stages its own
        entries meanwhile)."""
        super()._check_state_dict_only(state_dict, strict)

    def refresh_copies(self) -> None:
        """Set the optimizer copies after the parameters were loaded: from the checkpoint's
        ``_roundpipe.optim.*`` entries, or from the loaded parameters (existing copies only,
        unless the checkpoint has some); then restore the checkpoint's pending write-back."""
        self._runtime.state.apply(list(self._trainable_named_parameters()))

    def _own_state(self) -> dict[str, Any]:
        return self._runtime.state.entries(self.optim_named_parameters())

    def _load_own_state(self, entries: dict[str, Any], prefix: str, error_msgs: list[str]) -> None:
        self._runtime.state.stage(
            list(self._trainable_named_parameters()), entries, prefix, error_msgs
        )

    def _trainable_named_parameters(
        self, remove_duplicate: bool = True
    ) -> Iterator[tuple[str, nn.Parameter]]:
        """(name, parameter) of every parameter that requires grad, recorded at construction."""
        seen: set[int] = set()
        for name, param in self._runtime.param_names:
            if param.requires_grad and not (remove_duplicate and id(param) in seen):
                seen.add(id(param))
                yield name, param

    # -- internals ---------------------------------------------------------------------------

    def _resolve(self, call_config: RoundPipeRunConfig | None, argument: str) -> ResolvedRunConfig:
        """The call's run config (passed as ``argument``) resolved over the model's."""
        if call_config is None:
            call_config = RoundPipeRunConfig()
        if not isinstance(call_config, RoundPipeRunConfig):
            raise TypeError(
                f"{argument} must be a RoundPipeRunConfig (or None), got "
                f"{type(call_config).__name__}"
            )
        return resolve_run_config(call_config, self.model_run_config)

    def _check_as_wrapped(self) -> None:
        """``RuntimeError`` if the wrapped Sequential's layers changed since wrapping (one
        appended, removed or replaced: the calls would run the layers wrapped), a parameter was
        added to the module (it would be neither uploaded nor trained), or a parameter's data
        was replaced (the wrapped module converted, ``param.data = ...``: the arenas hold the
        data it was wrapped with)."""
        refuse_changed_layers(self.name, self.model, self.layers)
        # By name: a call nested in a running one sees the layers bound to device copies.
        refuse_added_parameters(self.name, self.model, {n for n, _ in self._runtime.param_names})
        slot = self._runtime.memory.replaced_param()
        if slot is None:
            return
        names = {id(p): n for n, p in self._runtime.param_names}
        raise RuntimeError(
            f"RoundPipe model '{self.name}': the data of parameter "
            f"'{names.get(id(slot.param), '?')}' was replaced after wrapping (now "
            f"{slot.param.dtype} on {slot.param.device}): a .to(), .half() or .cuda() of the "
            "wrapped module, or 'param.data = ...'. RoundPipe keeps the parameters in host "
            "arenas laid out when it wrapped the module; convert the module before wrapping it "
            "and change parameters in place (param.copy_(...), load_state_dict)"
        )

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        """What ``.to()``, ``.half()``, ``.cuda()``, ``.float()`` and the like do: a
        ``RuntimeError`` before anything changes when ``fn`` would change the dtype or device
        of a parameter or buffer (the host arenas were laid out for them when the module was
        wrapped, and RoundPipe moves each stage to the devices itself); nothing when it would
        change none (``.cpu()``, ``.float()`` of an fp32 model)."""
        tensors = [*self.model.parameters(), *self.model.buffers()]
        for dtype, device in {(t.dtype, t.device) for t in tensors}:
            converted = fn(torch.empty(0, dtype=dtype, device=device))
            if converted.dtype != dtype or converted.device != device:
                raise RuntimeError(
                    f"RoundPipe model '{self.name}': this would convert its {dtype} parameters "
                    f"or buffers on {device} to {converted.dtype} on {converted.device}. "
                    "RoundPipe keeps the model in host arenas laid out when it wrapped the "
                    "module, and moves each stage to the devices itself: convert the module "
                    "before wrapping it (RoundPipe(module.to(torch.bfloat16))); inputs may be "
                    "on any device"
                )
        return self

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Refused: a RoundPipe model owns host arenas and native threads, which neither
        ``pickle`` (``torch.save(model)``) nor ``copy.deepcopy`` can copy."""
        raise TypeError(
            f"RoundPipe model '{self.name}' cannot be pickled or deep-copied (it owns host "
            "arenas and native threads): save model.state_dict(), or copy the wrapped module "
            "after synchronize() (copy.deepcopy(model.model)) and wrap the copy"
        )

    def _plan(self, config: ResolvedRunConfig, run_type: RunType) -> ModelExecutePlan:
        """The call's plan: the explicit one (validated), or an automatic one that is re-planned
        only when the layer timings or the device pool changed."""
        runtime = self._runtime
        plan = config.execute_plan
        if plan is not None:
            try:
                plan.validate(len(self.layers), run_type)
            except (TypeError, ValueError) as error:
                raise type(error)(f"RoundPipe model '{self.name}': execute_plan: {error}") from None
            return plan
        key = (run_type, device_count())
        version = runtime.timer.version
        cached = runtime.plans.get(key)
        if cached is None or cached[0] != version:
            auto = ModelExecutePlan.auto(run_type, self)
            assert isinstance(auto, ModelExecutePlan)  # one model, one plan
            cached = (version, auto)
            runtime.plans[key] = cached
        return cached[1]

    def _layer_profile(self) -> LayerProfile:
        """Per-layer time estimates and device memory, for ``ModelExecutePlan.auto``."""
        runtime = self._runtime
        layers = runtime.memory.layers
        return runtime.timer.profile(
            [layer.param_bytes for layer in layers],
            [layer.param_bytes + layer.grad_bytes for layer in layers],
        )

    def _new_call(
        self, config: ResolvedRunConfig, run_type: RunType, input_events: list[list[Any]]
    ) -> Call:
        """The checked, planned call on inputs whose upstream transfers are ``input_events``."""
        self._check_as_wrapped()
        refuse_sequential_hooks(self.name, self.model)
        plan = self._plan(config, run_type)
        self._runtime.memory.sync_aliases()
        return Call(
            self._runtime.model,
            plan,
            run_type,
            config.num_microbatch,
            config.recompute_grain,
            config.preserve_rng_state,
            input_events,
        )


def __getattr__(name: str) -> Any:
    # AutoRoundPipe builds on RoundPipe, so it is defined in roundpipe.models and served lazily.
    if name == "AutoRoundPipe":
        from roundpipe.models.wrap import AutoRoundPipe

        return AutoRoundPipe
    raise AttributeError(f"module 'roundpipe.roundpipe' has no attribute {name!r}")


__all__ = ["AutoRoundPipe", "GradientsDisabledError", "RoundPipe", "RoundPipePackedData"]  # noqa: F822 (lazy, above)
