"""Model state in host memory: flat parameter and gradient arenas and per-layer bindings.

Every parameter of the model lives in one flat host arena (pinned per ``pin_model``) with the
layers back to back, and each ``nn.Parameter`` becomes a view into it, so user code that reads or
loads parameters keeps working. A stage, being a contiguous range of layers, uploads in a single
copy; its gradients come back in one accumulation per dtype run. Gradients of parameters that
require grad live in a second flat arena with the same layer order. That one is pageable (only
host code reads and writes it: accumulation, the optimizer); device gradients come back through
one page-locked staging area of the same layout.

With ``pin_model="off"`` the parameters stay where they are (pageable memory, for example
memory-mapped weights, which are then never read into anonymous memory as a whole): the arena
layout still gives each one its place in a stage's device buffer, and a stage uploads one copy per
parameter from its own storage.

A parameter shared by several layers (tied embeddings) lives in its first layer; every later
layer that uses it gets an *alias* slot, a copy in its own part of the arenas, so each stage
still uploads in one copy. Aliases are refreshed from the parameter before each call and their
gradients are folded into the parameter's before they are published, reduced across ranks or
stepped. Within a stage every use is bound to the stage's first copy, so autograd sums the uses
there as plain PyTorch does. A parameter that another owner trains (``shared``: a weight tied
across the parts of an ``AutoRoundPipe``, whose host glue steps it) is *borrowed*: its first use
here is an alias too, without a primary, and its gradient goes to the parameter's ``.grad``.

Host memory is the capacity limit of the design, so the arenas are anonymous mappings of their own
(native ``allocate_host_arena``): a zeroed arena costs nothing until written, a gradient arena
handed to the optimizer is cleared by dropping its pages (:func:`clear_arena`), and the storage
the parameters had before they moved in is returned to the operating system as the copy goes, so
wrapping never holds the weights twice.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn

from roundpipe._native import _C
from roundpipe.torch_internals import buffer_slots, parameter_slots

_Key = TypeVar("_Key")

_ALIGN = 64  # bytes; keeps every dtype view aligned and SIMD-friendly
# While parameters move into the arena, the C heap's free memory (their old storage) is handed
# back to the operating system after every this many bytes, so the peak stays near one copy.
_TRIM_EVERY = 64 << 20


def _aligned(nbytes: int) -> int:
    return (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class ParamSlot:
    """One parameter: where it is bound in the model and where it lives in the arenas."""

    param: nn.Parameter
    owners: list[tuple[nn.Module, str]]
    offset: int  # bytes into the parameter arena
    grad_offset: int | None  # bytes into the gradient arena; None when frozen
    primary: ParamSlot | None = None  # for an alias: the slot in the parameter's first layer
    layer: int = 0
    # Another owner trains the parameter (see ModelMemory): this slot is a copy refreshed before
    # each call, and its gradient is handed to the parameter's ``.grad``.
    borrowed: bool = False

    @property
    def nbytes(self) -> int:
        return self.param.numel() * self.param.element_size()

    @property
    def frozen(self) -> bool:
        """Frozen since construction: no gradient, no optimizer copy, so nothing of RoundPipe's
        writes it (the weight writer and the step write only parameters that train)."""
        return self.grad_offset is None and not self.param.requires_grad


@dataclass
class LayerMemory:
    """The parameters and buffers of one layer and its byte ranges in the arenas."""

    index: int
    module: nn.Module
    slots: list[ParamSlot] = field(default_factory=list)
    buffers: list[tuple[nn.Module, str]] = field(default_factory=list)
    begin: int = 0
    end: int = 0
    grad_begin: int = 0
    grad_end: int = 0

    @property
    def param_bytes(self) -> int:
        return self.end - self.begin

    @property
    def grad_bytes(self) -> int:
        return self.grad_end - self.grad_begin


def module_bytes(module: nn.Module, recurse: bool = True) -> int:
    """Bytes of ``module``'s parameters and buffers (its own only unless ``recurse``)."""
    tensors = itertools.chain(module.parameters(recurse), module.buffers(recurse))
    return sum(t.numel() * t.element_size() for t in tensors)


def clear_arena(arena: torch.Tensor) -> None:
    """Zero ``arena`` (contiguous host memory); the whole pages of an arena of this module go back
    to the operating system until written again, so a cleared arena costs no memory."""
    _C.zero_host_memory(arena)


def typed_view(arena: torch.Tensor, offset: int, like: torch.Tensor) -> torch.Tensor:
    """A view of ``arena`` (uint8) at byte ``offset`` with ``like``'s dtype and shape."""
    nbytes = like.numel() * like.element_size()
    return arena[offset : offset + nbytes].view(like.dtype).view(like.shape)


@dataclass(frozen=True, slots=True)
class StageLayout:
    """What a stage over ``layers`` needs of the arena layout, worked out once per range and
    reused by every call whose plan has that stage (:meth:`ModelMemory.stage_layout`): the host
    work a stage repeats per call is then a few native calls and the binding itself.

    Only what cannot change after wrapping is kept: which parameters are frozen follows
    ``requires_grad``, which the user may flip, so it is asked per upload (:meth:`frozen`).

    A plan that changes from call to call caches new layouts every call, which outlive the
    call and so end up in the garbage collector's oldest generation, where enough of them set
    off a full collection (which walks all of torch's objects too). So a layout is made of few
    objects the collector tracks: flat tuples, mostly of ints and strings, which it does not
    track."""

    layers: range
    param_begin: int
    param_end: int
    grad_begin: int
    grad_end: int
    slots: tuple[ParamSlot, ...]
    #: Parameter byte offsets and the parameters, in ``slots`` order (for ``typed_views``).
    offsets: tuple[int, ...]
    params: tuple[nn.Parameter, ...]
    #: The layer of each slot.
    layer_of: tuple[int, ...]
    #: Indices into ``slots`` of the parameters with a gradient slot, their gradient offsets.
    trained: tuple[int, ...]
    grad_offsets: tuple[int, ...]
    #: Where each slot's device copy is bound, one entry per binding in the three tuples:
    #: module, attribute and the slot's index.
    owner_modules: tuple[nn.Module, ...]
    owner_names: tuple[str, ...]
    owner_slots: tuple[int, ...]
    #: The layers' buffers, one entry per buffer in the three tuples: its home layer (where its
    #: updates are queued, see :meth:`ModelMemory.defer_buffer_write`), module, attribute.
    buffer_layers: tuple[int, ...]
    buffer_modules: tuple[nn.Module, ...]
    buffer_names: tuple[str, ...]
    #: The layers whose queued buffer writes the stage settles before binding: its own and the
    #: homes of its buffers.
    buffer_settle: tuple[int, ...]
    #: Maximal runs of same-dtype gradients: (begin, end, dtype) in the gradient arena.
    grad_runs: tuple[tuple[int, int, torch.dtype], ...]
    #: Slots that may be frozen (no gradient slot): indices into ``slots``.
    maybe_frozen: tuple[int, ...]

    def frozen(self) -> tuple[int, ...]:
        """Indices into ``slots`` of the parameters frozen now (see :attr:`ParamSlot.frozen`)."""
        return tuple(i for i in self.maybe_frozen if self.slots[i].frozen)

    def param_runs(self, frozen: tuple[int, ...]) -> list[tuple[int, int]]:
        """Maximal byte runs ``(begin, end)`` of the parameter arena over the stage, leaving out
        the parameters at ``frozen`` (indices into ``slots``)."""
        if not frozen:
            return [(self.param_begin, self.param_end)]
        skipped = set(frozen)
        spans = (
            (slot.offset, slot.offset + _aligned(slot.nbytes), None)
            for i, slot in enumerate(self.slots)
            if i not in skipped
        )
        return [(begin, end) for begin, end, _ in _coalesced(spans)]


class ModelMemory:
    """Flat host arenas for a list of layers; the parameters are moved into them in place."""

    def __init__(
        self, layers: list[nn.Module], pin_model: str, shared: frozenset[int] = frozenset()
    ) -> None:
        """Lay out ``layers`` and move their parameters into the arenas, but those whose ``id``
        is in ``shared`` (trained by another owner: borrowed, see the module docstring)."""
        self.pin_model = pin_model
        self.layers: list[LayerMemory] = []
        first_slot: dict[int, ParamSlot] = {}
        self.aliases: list[ParamSlot] = []
        buffer_home: dict[int, int] = {}  # id of a buffer tensor: its first layer
        #: ``(id(module), attribute)`` of each buffer: the first layer holding it (its home).
        self.buffer_home: dict[tuple[int, str], int] = {}
        param_cursor = grad_cursor = 0
        for index, module in enumerate(layers):
            layer = LayerMemory(index, module, begin=param_cursor, grad_begin=grad_cursor)
            by_param: dict[int, ParamSlot] = {}
            layer_buffers: set[tuple[int, str]] = set()  # a module used twice in the layer
            for _, owner in module.named_modules(remove_duplicate=False):
                for name, param in parameter_slots(owner).items():
                    if param is None:
                        continue
                    key = id(param)
                    if key in by_param:
                        by_param[key].owners.append((owner, name))
                        continue
                    primary = first_slot.get(key)
                    borrowed = primary is None and key in shared
                    slot = ParamSlot(param, [(owner, name)], 0, None, primary, index, borrowed)
                    first_slot.setdefault(key, slot)
                    if primary is not None or borrowed:
                        self.aliases.append(slot)
                    by_param[key] = slot
                    layer.slots.append(slot)
                for name, buffer in buffer_slots(owner).items():
                    if buffer is None or (id(owner), name) in layer_buffers:
                        continue
                    layer_buffers.add((id(owner), name))
                    layer.buffers.append((owner, name))
                    # A buffer that several layers hold (a module with BatchNorm statistics
                    # used twice) has one home, its first layer: every use's update is queued
                    # there, and a stage settles it before binding the buffer.
                    home = buffer_home.setdefault(id(buffer), index)
                    self.buffer_home.setdefault((id(owner), name), home)
            # Same-dtype parameters side by side: their gradients accumulate in one run.
            layer.slots.sort(key=lambda s: str(s.param.dtype))
            for slot in layer.slots:
                slot.offset = param_cursor
                param_cursor += _aligned(slot.nbytes)
                if slot.param.requires_grad:
                    slot.grad_offset = grad_cursor
                    grad_cursor += _aligned(slot.nbytes)
            layer.end, layer.grad_end = param_cursor, grad_cursor
            self.layers.append(layer)
        # ``id`` of each trained parameter that several layers use (tied weights): its gradient
        # is the sum of the uses' parts, each accumulated in its own slot (fold_alias_grads).
        self.tied = frozenset(
            id(a.param) for a in self.aliases if a.grad_offset is not None and not a.borrowed
        )
        # The slots of borrowed parameters that train here (their gradients leave through
        # GradientState.hand_over_shared).
        self.borrowed = [a for a in self.aliases if a.borrowed and a.grad_offset is not None]

        # None with pin_model="off": every parameter keeps its own storage.
        self.params: torch.Tensor | None = (
            None if pin_model == "off" else _C.allocate_host_arena(param_cursor, pin_model)
        )
        self.grads = _C.allocate_host_arena(grad_cursor, "off")
        self._download_staging: torch.Tensor | None = None
        # Buffer values a stage computed, per layer, not yet written into the module's buffer:
        # (buffer, source, event after which source holds the values, or None).
        self._buffer_writes: dict[int, list[tuple[torch.Tensor, torch.Tensor, Any]]] = {}
        # Writes into the parameter arena queued on the weight writer: per layer, the sequence
        # number and event of the latest one. The writer is first in first out.
        self._writes: dict[int, tuple[int, Any]] = {}
        self._write_count = 0
        self._last_write: Any = None
        self._stage_layouts: dict[tuple[int, int], StageLayout] = {}
        with torch.no_grad():
            moved = 0
            for slot in self.slots():
                if self.params is None:
                    if not slot.param.is_contiguous():  # uploaded and written back flat
                        slot.param.data = slot.param.data.contiguous()
                    continue
                view = typed_view(self.params, slot.offset, slot.param)
                view.copy_(slot.param.data)
                slot.param.data = view  # the old storage is freed here unless the user holds it
                moved += slot.nbytes
                if moved >= _TRIM_EVERY:
                    _C.trim_host_heap()
                    moved = 0
            if self.params is not None:
                for alias in self.aliases:
                    self.alias_view(alias).copy_(alias.param)
                _C.trim_host_heap()
        # What the arenas and the stage layouts were laid out for (see replaced_param): each
        # parameter's dtype, and where a trained one's data lives (a frozen one may be moved by
        # another model wrapping the same frozen module; nothing writes it).
        self._placed = [
            (slot, slot.param.dtype, None if slot.frozen else slot.param.data_ptr())
            for slot in self.slots()
        ]

    def replaced_param(self) -> ParamSlot | None:
        """The first parameter whose data was replaced since wrapping (``param.data = ...``, a
        ``.to()`` or ``.half()`` of the wrapped module), which the arenas no longer hold: a
        stage would compute with the bytes laid out for the old data. None if there is none."""
        for slot, dtype, data_ptr in self._placed:
            param = slot.param
            if param.dtype != dtype or (data_ptr is not None and param.data_ptr() != data_ptr):
                return slot
        return None

    def alias_view(self, alias: ParamSlot) -> torch.Tensor:
        assert self.params is not None
        return typed_view(self.params, alias.offset, alias.param)

    def stage_layout(self, layers: range) -> StageLayout:
        """The layout of a stage over ``layers`` (worked out on first use, then cached). Plans
        that keep changing (timings near a boundary) could ask for a different range each call:
        the cache holds at most ``4 x layers`` of them, the least recently used going first."""
        key = (layers.start, layers.stop)
        layouts = self._stage_layouts
        layout = layouts.pop(key, None)
        if layout is None:
            if len(layouts) >= 4 * len(self.layers):
                del layouts[next(iter(layouts))]
            layout = self._new_stage_layout(layers)
        layouts[key] = layout  # the most recently used last (dicts keep insertion order)
        return layout

    def _new_stage_layout(self, layers: range) -> StageLayout:
        # One pass over the slots (a plan that keeps changing asks for new ranges every call).
        slots: list[ParamSlot] = []
        layer_of: list[int] = []
        trained: list[int] = []
        grad_offsets: list[int] = []
        maybe_frozen: list[int] = []
        owners: tuple[list[nn.Module], list[str], list[int]] = ([], [], [])
        buffers: tuple[list[int], list[nn.Module], list[str]] = ([], [], [])
        # A parameter that several layers of the stage use is bound to one device copy, its
        # first: autograd sums its uses' gradients there, as plain PyTorch sums them into the
        # parameter's (one module used twice could not be bound to two copies at once anyway).
        first_use: dict[int, int] = {}
        bound_once: set[tuple[int, str]] = set()  # (module, attribute): one binding each
        # A buffer is bound once per stage too, and its queued updates (of any layer that holds
        # it, queued at its home) are settled before: each use updates it in turn.
        buffers_once: set[tuple[int, str]] = set()
        settle = set(layers)
        for index in layers:
            layer = self.layers[index]
            for slot in layer.slots:
                i = len(slots)
                bound = first_use.setdefault(id(slot.param), i)
                slots.append(slot)
                layer_of.append(index)
                if slot.grad_offset is None:
                    maybe_frozen.append(i)
                else:
                    trained.append(i)
                    grad_offsets.append(slot.grad_offset)
                for owner, name in slot.owners:
                    if (id(owner), name) in bound_once:  # one module used by several layers
                        continue
                    bound_once.add((id(owner), name))
                    owners[0].append(owner)
                    owners[1].append(name)
                    owners[2].append(bound)
            for owner, name in layer.buffers:
                key = (id(owner), name)
                if key in buffers_once:  # a module that several layers of the stage share
                    continue
                buffers_once.add(key)
                home = self.buffer_home[key]
                buffers[0].append(home)
                buffers[1].append(owner)
                buffers[2].append(name)
                settle.add(home)
        return StageLayout(
            layers=layers,
            param_begin=self.layers[layers.start].begin,
            param_end=self.layers[layers.stop - 1].end,
            grad_begin=self.layers[layers.start].grad_begin,
            grad_end=self.layers[layers.stop - 1].grad_end,
            slots=tuple(slots),
            offsets=tuple(slot.offset for slot in slots),
            params=tuple(slot.param for slot in slots),
            layer_of=tuple(layer_of),
            trained=tuple(trained),
            grad_offsets=tuple(grad_offsets),
            owner_modules=tuple(owners[0]),
            owner_names=tuple(owners[1]),
            owner_slots=tuple(owners[2]),
            buffer_layers=tuple(buffers[0]),
            buffer_modules=tuple(buffers[1]),
            buffer_names=tuple(buffers[2]),
            buffer_settle=tuple(sorted(settle)),
            grad_runs=tuple(
                _coalesced(run for index in layers for run in self._layer_grad_runs[index])
            ),
            maybe_frozen=tuple(maybe_frozen),
        )

    @functools.cached_property
    def _layer_grad_runs(self) -> list[list[tuple[int, int, torch.dtype]]]:
        """:meth:`grad_runs` of each layer on its own (stage layouts join them)."""
        return [self.grad_runs(range(index, index + 1)) for index in range(len(self.layers))]

    def param_sources(self, layers: range, skip_frozen: bool) -> list[tuple[int, torch.Tensor]]:
        """Without an arena: ``(byte offset in the arena layout, bytes)`` of every parameter of
        ``layers`` (but the frozen ones, with ``skip_frozen``), aliases included (they read their
        parameter's own storage)."""
        return [
            (slot.offset, slot.param.detach().reshape(-1).view(torch.uint8))
            for index in layers
            for slot in self.layers[index].slots
            if not (skip_frozen and slot.frozen)
        ]

    def write_async(self, layer: int, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> Any:
        """Queue ``dsts[i].copy_(srcs[i])`` into layer ``layer``'s parameters on the weight
        writer; uploads of that layer wait for it (see :meth:`fence`)."""
        event = _C.writeback_async(dsts, srcs)
        self._write_count += 1
        self._writes[layer] = (self._write_count, event)
        self._last_write = event
        return event

    def fence(self, layers: range) -> Any:
        """The event after which every queued write into ``layers`` has landed, or None."""
        if not self._writes:  # no step since the last wait (or none yet): asked once per stage
            return None
        latest = max(
            (self._writes[i] for i in layers if i in self._writes),
            key=lambda write: write[0],
            default=None,
        )
        return None if latest is None else latest[1]

    def wait_writes(self) -> None:
        """Wait for every queued write (the host parameters are then current). A wait
        interrupted by Ctrl-C keeps the writes queued, to be waited for next time; a failed write
        raises once."""
        try:
            if self._last_write is not None:
                self._last_write.synchronize()
        except KeyboardInterrupt:
            raise
        except BaseException:
            self._last_write = None
            self._writes.clear()
            raise
        self._last_write = None
        self._writes.clear()

    def sync_aliases(self) -> None:
        """Queue a copy of each shared parameter into its aliases, after pending writes (without
        an arena, aliases read the parameter itself)."""
        if self.params is None:
            return
        for alias in self.aliases:
            self.write_async(alias.layer, [self.alias_view(alias)], [alias.param.detach()])

    def fold_alias_grads(self, arena: torch.Tensor | None = None) -> None:
        """Add the aliases' gradients into their parameters' and clear them, in ``arena``
        (default: the current one); a borrowed parameter's sum stays in its borrowed slot."""
        with torch.no_grad():
            for alias in self.aliases:
                if alias.grad_offset is not None and alias.primary is not None:
                    alias_grad = self.grad_view(alias, arena)
                    self.grad_view(alias.primary, arena).add_(alias_grad)
                    alias_grad.zero_()

    def new_grad_arena(self) -> torch.Tensor:
        """Another zeroed (pageable) gradient arena of the same layout."""
        return _C.allocate_host_arena(self.grads.numel(), "off")

    def download_staging(self) -> torch.Tensor:
        """Page-locked staging for gradient downloads, exactly the size and layout of the gradient
        arena (allocated on first use). A range may be used again once the download through it
        completed: the stages of one call have disjoint ranges, and a call that downloads
        gradients first waits for the downloads of the calls before it."""
        if self._download_staging is None:
            self._download_staging = _C.allocate_pinned_staging(self.grads.numel())
        return self._download_staging

    def defer_buffer_write(
        self, layer: int, buffer: torch.Tensor, source: torch.Tensor, landed: Any
    ) -> None:
        """Queue ``buffer.copy_(source)`` for when ``landed`` (the event of the copy that fills
        ``source``, or None) completed: new buffer values of ``layer``, applied by
        :meth:`settle_buffers` without stalling the stage that computed them."""
        self._buffer_writes.setdefault(layer, []).append((buffer, source, landed))

    def settle_buffers(self, layers: Iterable[int] | None = None) -> None:
        """Apply the queued buffer writes of ``layers`` (default: all), in the order queued."""
        if not self._buffer_writes:  # nearly always (no buffers): checked once, not per layer
            return
        for layer in list(self._buffer_writes) if layers is None else layers:
            with torch.no_grad():
                for buffer, source, landed in self._buffer_writes.pop(layer, []):
                    if landed is not None:
                        landed.synchronize()
                    buffer.copy_(source)

    def buffers(self) -> list[torch.Tensor]:
        """Every buffer of the layers once (their host tensors, outside a call), in layer
        order."""
        found: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            for owner, name in layer.buffers:
                buffer = buffer_slots(owner).get(name)
                if buffer is not None:
                    found.setdefault(id(buffer), buffer)
        return list(found.values())

    def slots(self) -> Iterator[ParamSlot]:
        """Every parameter this model holds once, in its first layer (aliases excluded, and
        so borrowed parameters)."""
        for layer in self.layers:
            yield from (slot for slot in layer.slots if slot.primary is None and not slot.borrowed)

    def grad_view(self, slot: ParamSlot, arena: torch.Tensor | None = None) -> torch.Tensor:
        """The host gradient of ``slot``: a view into ``arena`` (default: the current one)."""
        assert slot.grad_offset is not None
        return typed_view(self.grads if arena is None else arena, slot.grad_offset, slot.param)

    def grad_range(self, layers: range) -> tuple[int, int]:
        return self.layers[layers.start].grad_begin, self.layers[layers.stop - 1].grad_end

    def layer_grad_runs(self, layer: int) -> list[tuple[int, int, torch.dtype, bool]]:
        """Maximal byte runs ``(begin, end, dtype, alias)`` of layer ``layer``'s gradients, split
        where aliases (later uses of a shared parameter) begin and end: ``alias`` tells which."""
        runs = _coalesced(
            (
                slot.grad_offset,
                slot.grad_offset + _aligned(slot.nbytes),
                (slot.param.dtype, slot.primary is not None),
            )
            for slot in self.layers[layer].slots
            if slot.grad_offset is not None
        )
        return [(begin, end, dtype, alias) for begin, end, (dtype, alias) in runs]

    def grad_runs(self, layers: range) -> list[tuple[int, int, torch.dtype]]:
        """Maximal byte runs ``(begin, end, dtype)`` of same-dtype gradients over ``layers``."""
        return _coalesced(
            (slot.grad_offset, slot.grad_offset + _aligned(slot.nbytes), slot.param.dtype)
            for index in layers
            for slot in self.layers[index].slots
            if slot.grad_offset is not None
        )


def _coalesced(spans: Iterable[tuple[int, int, _Key]]) -> list[tuple[int, int, _Key]]:
    """Byte spans ``(begin, end, key)`` in order, adjacent ones with equal keys merged."""
    runs: list[tuple[int, int, _Key]] = []
    for begin, end, key in spans:
        if runs and runs[-1][2] == key and runs[-1][1] == begin:
            runs[-1] = (runs[-1][0], end, key)
        else:
            runs.append((begin, end, key))
    return runs


def checked_shared_parameters(model: nn.Module, shared: Any) -> tuple[nn.Parameter, ...]:
    """``shared_parameters`` (parameters of ``model`` that another owner trains) validated:
    parameters of ``model``, each once."""
    if isinstance(shared, torch.Tensor) or not isinstance(shared, Iterable):
        raise TypeError(
            f"shared_parameters must be an iterable of nn.Parameter, got {type(shared).__name__}"
        )
    params = tuple(shared)
    mine = {id(p) for p in model.parameters()}
    for param in params:
        if not isinstance(param, nn.Parameter):
            raise TypeError(
                f"shared_parameters must hold nn.Parameter objects, got {type(param).__name__}"
            )
        if id(param) not in mine:
            raise ValueError(
                "shared_parameters holds a parameter that is not one of the model's: list only "
                "parameters the wrapped model uses"
            )
    return tuple({id(p): p for p in params}.values())


__all__ = [
    "LayerMemory",
    "ModelMemory",
    "ParamSlot",
    "StageLayout",
    "checked_shared_parameters",
    "clear_arena",
    "module_bytes",
    "typed_view",
]
