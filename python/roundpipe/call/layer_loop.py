"""The loop over a stage's layers, for one call: :class:`LayerCalls` runs runs of layers on one
device, in forward or in recompute, through the native ``_C.LayerLoop`` (reseeding, the
recompute context, NVTX marking and timing given once), and :class:`LoopClock` times them for the
planner. The random streams a call's layers draw from (:func:`draw_call_seed`, :func:`rng_scope`)
live here too: a layer's draws come from a generator seeded per (call, layer, microbatch), so a
recompute replays its forward's.
"""

from __future__ import annotations

import functools
import gc
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch

from roundpipe import context
from roundpipe._native import _C
from roundpipe.call.transfers import on_cuda
from roundpipe.context import locate_error
from roundpipe.device import device_at, devices
from roundpipe.torch_internals import tree_map

if TYPE_CHECKING:
    from torch import nn

    from roundpipe.timer import Action, ModelTimer

Phase = Literal["forward", "recompute", "backward", "loss"]


class LoopModel(Protocol):
    """What the layer loop reads of the model a call runs (``call.pipeline.CallModel``)."""

    @property
    def layers(self) -> list[nn.Module]: ...
    @property
    def timer(self) -> ModelTimer | None: ...


class LoopOwner(Protocol):
    """What the layer loop reads of the call it runs layers for (``call.pipeline.Call``)."""

    @property
    def model(self) -> LoopModel: ...
    @property
    def preserve_rng_state(self) -> bool: ...
    @property
    def on_cuda(self) -> bool: ...
    @property
    def nvtx(self) -> bool: ...
    @property
    def saving(self) -> bool: ...
    @property
    def rng_seed(self) -> int: ...
    @property
    def rng_states(self) -> Any: ...
    @property
    def recompute_store(self) -> dict[tuple[int, int], tuple[Any, ...]]: ...

    def where(self, layers: int | range, phase: Phase, microbatch: int) -> str: ...

    def mark(
        self, kind: str, layers: range, microbatch: int | None = None
    ) -> AbstractContextManager[Any]: ...


class LoopClock:
    """Times the pieces of the stages one ``LayerCalls`` runs for the model's timer (none: times
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


NO_RANGE = nullcontext()  # what a call that marks no NVTX ranges enters (reusable)


class LayerCalls:
    """Runs runs of layers of stages on one device for a call (``run(layers, microbatch,
    value)``), in forward or in recompute, and times them (``clock``), for every stage of one
    kind on one device in a run (a call keeps one per kind and device).

    At short sequences the host's work per layer x microbatch is what caps a GPU's throughput
    (benchmarks/overhead_cpu.py, the dispatch table), so the loop over the layers is native
    (``_C.LayerLoop``), and what does not change from layer to layer is given to it once: the
    modules, the kind of random stream, the generators to reseed, the recompute context (one
    object moved from layer to layer), the NVTX marking, the timing. The message naming layer,
    phase and microbatch is built only when a layer fails."""

    def __init__(
        self,
        call: LoopOwner,
        device_index: int,
        recompute: bool,
        runs_twice: bool = False,
        cut: bool = False,
    ) -> None:
        """``runs_twice``: a forward stage whose layers backward recomputes (it keeps the CPU
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
        self.clock = LoopClock(call.model.timer, device_index, call.on_cuda)
        timing = "off" if self.clock.timer is None else "device" if call.on_cuda else "host"
        mark = functools.partial(_mark_layer, call, self.phase) if call.nvtx else None
        replay = recompute and not fresh
        self.loop = _C.LayerLoop(
            modules=call.model.layers,
            call_seed=call.rng_seed,
            fresh=fresh,
            generators=generators,
            context=self.context,
            mark=mark,
            timing=timing,
            device_index=device_index,
            rng_states=call.rng_states if replay or runs_twice else None,
            replay=replay,
            cut=cut_graphs if cut else None,
        )

    def __call__(self, layers: range, microbatch: int, value: Any) -> Any:
        """Run ``layers`` on ``microbatch`` (layer 0 takes ``(args, kwargs)``)."""
        try:
            with self.context:
                return self.loop.run(layers.start, layers.stop, microbatch, value)
        except Exception as error:
            where = self.call.where(self.context.layer, self.phase, microbatch)
            raise locate_error(error, where) from error

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
                    first=layers.start,
                    stop=layers.stop,
                    first_microbatch=first_microbatch,
                    values=values,
                    keep=kept,
                    kept=kept_natively,
                    keeper=keeper,
                )
        except Exception as error:
            context = self.context
            where = self.call.where(context.layer, self.phase, context.microbatch)
            raise locate_error(error, where) from error


def _mark_layer(call: LoopOwner, phase: Phase, layer: int, microbatch: int) -> Any:
    """The NVTX range of ``layer`` on ``microbatch`` in ``phase`` (what ``_C.LayerLoop`` enters
    around each layer when the call marks ranges)."""
    return call.mark(phase, range(layer, layer + 1), microbatch)


def cut_graphs(tree: Any) -> Any:
    """``tree`` with its tensors cut from their graphs (``_C.graph_cut``)."""
    return tree_map(lambda t: _C.graph_cut(t) if isinstance(t, torch.Tensor) else t, tree)


# --------------------------------------------------------------------------------------------
# RNG
# --------------------------------------------------------------------------------------------


def draw_call_seed() -> int:
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
def rng_scope() -> Iterator[None]:
    """Restore the generators the layers reseed, so the user's random stream after a call does not
    depend on which layer ran last (that is, on the plan)."""
    cpu = torch.get_rng_state()
    gpus = torch.cuda.get_rng_state_all() if on_cuda() else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if gpus is not None:
            torch.cuda.set_rng_state_all(gpus)


__all__ = [
    "NO_RANGE",
    "LayerCalls",
    "LoopClock",
    "LoopModel",
    "LoopOwner",
    "Phase",
    "cut_graphs",
    "draw_call_seed",
    "rng_scope",
]
