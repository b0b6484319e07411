"""Data-parallel RoundPipe replicas over ``torch.distributed`` with a sharded host optimizer.

Every rank of a data-parallel group holds the whole model in its host arenas and trains on its own
part of the global batch. The optimizer state is sharded: the flat gradient arena (see
``roundpipe.memory``) is cut into ``world_size`` contiguous byte ranges of equal size (multiples
of 64 bytes; the last one padded), and a rank keeps optimizer copies only for the parameter
elements inside its own range. A parameter may straddle two shards; each rank then holds a 1-D
piece of it (elements ``[start, stop)`` of the flattened parameter).

One optimizer step, on the optimizer thread of every rank, in the same order everywhere:

1. the handed-over gradient arena is summed across ranks, in place, by an all-reduce per
   same-dtype run in chunks of at most :data:`CHUNK_BYTES` (no temporary arena), and the own
   shard is divided by ``world_size`` (the mean, as ``DistributedDataParallel``). A
   reduce-scatter would move half the bytes, but gloo's (torch 2.13) is slower than its
   all-reduce at every size measured (``benchmarks/scale_cpu.py``) and would need one dtype per
   collective where a shard may hold several;
2. the own pieces receive their gradients, ``step_fn`` runs (``GradScaler`` and
   ``RoundPipe.clip_grad_norm_`` agree across ranks through :func:`any_rank` and
   :meth:`DataParallel.all_reduce_scalar`);
3. the new weights of the own pieces are cast to the parameters' dtypes into a staging arena with
   the gradient arena's layout, which is then all-gathered, so that every rank writes every new
   weight into its parameter arena at the next ``step()``, as on one process.

With ``data_parallel_reduce="stage"`` step 1 happens earlier, on the devices: at the end of
every backward stage the stage's device gradients are summed into the rank that owns each byte
(one ``reduce`` per layer and shard it touches, layers in descending order, so the sequence of
collectives is the same on every rank whatever its plan), and each rank downloads only the bytes
of its own shard: 1/N of every gradient crosses PCIe. The step then only divides the own shard.

The collectives run on process groups of RoundPipe's own created over the ranks of the user's
group, so they never interleave with the user's collectives: one (gloo, over host tensors) for the
optimizer thread's steps, and with stage reduces one for the calling thread (gloo), plus one NCCL
group per GPU of the device pool when the devices are CUDA GPUs. Their timeout is the user's
group's (``init_process_group(timeout=...)``): a rank that fails or dies makes the others raise
within it instead of waiting forever.
"""

from __future__ import annotations

import math
import os
import threading
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Literal, Protocol

import torch
import torch.distributed as dist
from torch import nn

from roundpipe.context import locate_error
from roundpipe.device import devices

if TYPE_CHECKING:
    from roundpipe.memory import ModelMemory, ParamSlot
    from roundpipe.optim.copies import OptimizerCopy

# Bytes in one all-reduce of the gradient reduce: bounds gloo's own buffers whatever the model
# size, and lets the ranks' transfers of one chunk overlap the reduction of the previous one.
CHUNK_BYTES = 16 << 20
_ALIGN = 64

# torch 2.13 renamed all_gather_into_tensor; older releases have only the old name.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

REDUCE_MODES: tuple[str, ...] = ("auto", "host", "stage")

# What the ranks agree on before the calling thread's collectives (DataParallel.agree).
AGREED_ACTIONS: tuple[str, ...] = (
    "backward call",
    "step",
    "buffer broadcast",
    "save_checkpoint",
    "load_checkpoint",
)

_active = threading.local()


# The collectives RoundPipe issues, one function each (tests wrap them to inject delays).


def all_reduce(tensor: torch.Tensor, op: Any, group: Any) -> None:
    """``tensor`` reduced with ``op`` over ``group``, in place."""
    dist.all_reduce(tensor, op=op, group=group)


def all_gather(output: torch.Tensor, input: torch.Tensor, group: Any) -> None:
    """Every rank's ``input`` side by side in ``output`` (rank order)."""
    _ALL_GATHER(output, input, group=group)


def reduce(tensor: torch.Tensor, dst: int, group: Any) -> None:
    """``tensor`` summed over ``group`` into the rank ``dst`` (a global rank), in place there."""
    dist.reduce(tensor, dst, op=dist.ReduceOp.SUM, group=group)


class Agreement(Protocol):
    """:meth:`DataParallel.agree` as a sharded checkpoint calls it."""

    def __call__(self, action: str, *, refused: bool = False) -> None: ...


@dataclass(frozen=True)
class ShardPiece:
    """The part of one trainable parameter that a rank's optimizer steps.

    ``copy`` is its optimizer copy: elements ``[start, stop)`` of the flattened parameter as a
    1-D tensor in ``optim_dtype`` with data parallelism, the whole parameter in its own shape
    (``start == 0``, ``stop == shape.numel()``) without."""

    name: str  # as optim_named_parameters() names it
    shape: torch.Size  # of the whole parameter
    start: int
    stop: int
    copy: OptimizerCopy


@dataclass(frozen=True)
class DataParallelShard:
    """What a rank of a data-parallel RoundPipe steps: its rank, the world size and its pieces,
    in ``optim_named_parameters()`` order."""

    rank: int
    world_size: int
    pieces: list[ShardPiece]
    # RoundPipe's own process group over the ranks (gloo, host tensors); None without data
    # parallelism. Collectives about this model's state (sharded checkpoints) run on it.
    group: Any = None
    # ``agree(action)``: checks that every rank is about to do ``action`` at the same point of
    # training; ``agree(action, refused=True)``: this rank refuses its arguments to ``action``
    # (DataParallel.agree). None without data parallelism.
    agree: Agreement | None = None


@dataclass(frozen=True)
class _Slice:
    """A trainable parameter's elements ``[start, stop)`` inside the own shard, ``offset``
    bytes into it."""

    slot: ParamSlot
    start: int
    stop: int
    offset: int


def _group_timeout(group: Any) -> timedelta | None:
    """The timeout the user's group was created with (None: unknown, torch's default applies).
    torch has no public getter; the gloo backend's options hold it."""
    try:
        timeout = group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None
    return timeout if isinstance(timeout, timedelta) else None


def check_reduce_mode(mode: Any) -> None:
    """Validate ``data_parallel_reduce``."""
    if not isinstance(mode, str):
        raise TypeError(
            f"data_parallel_reduce must be a str, one of {REDUCE_MODES}, got {type(mode).__name__}"
        )
    if mode not in REDUCE_MODES:
        raise ValueError(f"data_parallel_reduce must be one of {REDUCE_MODES}, got {mode!r}")


def resolve_reduce_mode(mode: str, pool: Sequence[torch.device]) -> Literal["host", "stage"]:
    """``"auto"``: reduce on the device when the pool is one CUDA GPU (its logical devices
    included) and NCCL is there (only the own shard is downloaded); on the host otherwise
    (virtual CPU devices are host memory, nothing to save; several GPUs per rank pair their
    collectives by GPU, which needs the same plan on every rank, so they ask for it).
    ``"stage"`` on GPUs without NCCL is a ValueError."""
    on_gpus = bool(pool) and pool[0].type == "cuda"
    if mode == "auto":
        one_gpu = len({d.index for d in pool}) == 1
        return "stage" if on_gpus and one_gpu and dist.is_nccl_available() else "host"
    if mode == "stage" and on_gpus and not dist.is_nccl_available():
        raise ValueError(
            "data_parallel_reduce='stage' on CUDA devices needs NCCL, which this torch build "
            "lacks: use data_parallel_reduce='host'"
        )
    return "stage" if mode == "stage" else "host"


class _NoGroup:
    """The type of :data:`NO_GROUP`."""

    def __repr__(self) -> str:
        return "NO_GROUP"


#: ``data_parallel_group``'s default: no data parallelism, asked for by leaving it out.
NO_GROUP = _NoGroup()


def check_group(group: Any) -> int:
    """Validate ``data_parallel_group`` and return its size (1 for :data:`NO_GROUP` and None).

    ``None`` passed while this process was launched as one of several ranks (``WORLD_SIZE`` >
    1, as torchrun sets it) and ``torch.distributed`` is not initialised is a ``ValueError``:
    that is ``dist.group.WORLD`` read before ``init_process_group``, which would have every
    rank train alone."""
    if isinstance(group, _NoGroup):
        return 1
    if group is None:
        world = os.environ.get("WORLD_SIZE", "1")
        if not dist.is_initialized() and world.isdigit() and int(world) > 1:
            raise ValueError(
                "data_parallel_group is None, but this process is one of "
                f"WORLD_SIZE={world} ranks and torch.distributed is not initialised: "
                "dist.group.WORLD is None until init_process_group() runs, so every rank would "
                "train alone. Call torch.distributed.init_process_group(...) before creating the "
                "RoundPipe (or leave data_parallel_group out to train each rank alone)"
            )
        return 1
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            "data_parallel_group must be a torch.distributed.ProcessGroup (for example "
            f"dist.group.WORLD) or None, got {type(group).__name__}"
        )
    if not dist.is_initialized():
        raise ValueError(
            "data_parallel_group needs the default process group: call "
            "torch.distributed.init_process_group(...) before creating the RoundPipe"
        )
    return int(dist.get_world_size(group))


def _first_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str | None:
    for key, value in mine.items():
        other = theirs.get(key)
        if value == other:
            continue
        if isinstance(value, list) and isinstance(other, list):
            for index, (a, b) in enumerate(zip(value, other, strict=False)):
                if a != b:
                    return f"{key}[{index}] is {a} there but {b} on rank 0"
            return f"{key} has {len(value)} entries there but {len(other)} on rank 0"
        return f"{key} is {value!r} there but {other!r} on rank 0"
    return None


class DataParallel:
    """The shard layout and the collectives of one data-parallel model on one rank."""

    def __init__(
        self,
        group: Any,
        memory: ModelMemory,
        name: str,
        signature: dict[str, Any],
        reduce_mode: Literal["host", "stage"] = "host",
        pool: Sequence[torch.device] = (),
    ) -> None:
        """Create RoundPipe's own groups over ``group``'s ranks (collective calls: every rank
        creates its models in the same order) and check that every rank built the same model
        (``signature``: what must agree, compared with rank 0's; ValueError naming the first
        difference and the rank). ``reduce_mode="stage"`` reduces gradients at the end of each
        backward stage on the devices of ``pool`` (see the module docstring)."""
        ranks = dist.get_process_group_ranks(group)
        timeout = _group_timeout(group)
        self.group = dist.new_group(
            ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
        )
        self.ranks = ranks
        self.world_size = len(ranks)
        self.rank = dist.get_rank(self.group)
        self.name = name
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, signature, group=self.group)
        for rank, other in enumerate(gathered):
            difference = _first_difference(other, gathered[0])
            if difference is not None:
                raise ValueError(
                    f"RoundPipe model {name!r}: the data-parallel ranks must build the same model "
                    f"with the same settings, but on rank {rank} {difference}"
                )
        self._broadcast_initial_state(memory)
        self.reduce_mode = reduce_mode
        # Stage reduces on GPUs: one NCCL group per GPU of the pool (in the order of their
        # indices: a GPU's ordinal pairs it with the others' same ordinal).
        self.gpus: list[int] = []
        self.gpu_groups: list[Any] = []
        # Steps submitted, and backward calls since the last one (what the ranks agree on).
        self.steps = 0
        self.calls = 0
        # Buffers are broadcast from rank 0 after each training call (broadcast_buffers).
        self.has_buffers = bool(memory.buffers())
        # The calling thread's collectives: the agreements (see agree), stage reduces on CPU
        # devices and the buffer broadcasts.
        self.call_group = dist.new_group(
            ranks=ranks, backend="gloo", timeout=timeout, use_local_synchronization=True
        )
        if reduce_mode == "stage":
            self.gpus = sorted({d.index or 0 for d in pool if d.type == "cuda"})
            self.gpu_groups = [
                dist.new_group(
                    ranks=ranks, backend="nccl", timeout=timeout, use_local_synchronization=True
                )
                for _ in self.gpus
            ]

        self.memory = memory
        total = memory.grads.numel()
        self.total = total
        per_rank = -(-total // self.world_size)
        self.shard_bytes = -(-per_rank // _ALIGN) * _ALIGN
        self.begin = self.rank * self.shard_bytes
        end = self.begin + self.shard_bytes
        self.slices: list[_Slice] = []
        for slot in memory.slots():
            if slot.grad_offset is None:
                continue
            first, last = slot.grad_offset, slot.grad_offset + slot.nbytes
            low, high = max(first, self.begin), min(last, end)
            if low < high:
                size = slot.param.element_size()
                self.slices.append(
                    _Slice(slot, (low - first) // size, (high - first) // size, low - self.begin)
                )
        if not self.slices:
            self.slices = self._placeholder_slice()
        self.piece_by_param = {id(piece.slot.param): piece for piece in self.slices}
        self.runs = memory.grad_runs(range(len(memory.layers)))
        # The own shard's averaged gradients (the arena is zeroed for the next iteration while
        # step_fn may still hold them).
        self.shard_grads = torch.zeros(self.shard_bytes, dtype=torch.uint8)
        # New weights in the gradient arena's layout, padded to world_size shards.
        self.staging = torch.zeros(self.world_size * self.shard_bytes, dtype=torch.uint8)

    def _placeholder_slice(self) -> list[_Slice]:
        """A shard that holds no trainable element (more ranks than the arena has bytes for, or
        a shard inside a shared parameter's second use) still steps: an empty piece of the
        first trainable parameter stands in, so the rank's ``optim_parameters()`` is not empty
        (an optimizer refuses an empty parameter list) while it steps nothing."""
        first = next((slot for slot in self.memory.slots() if slot.grad_offset is not None), None)
        return [] if first is None else [_Slice(first, 0, 0, 0)]

    def _broadcast_initial_state(self, memory: ModelMemory) -> None:
        """Every rank starts from rank 0's parameters and buffers, as DistributedDataParallel
        makes it at construction: replicas built from different seeds would otherwise train
        apart without a word. The parameter arena goes in one broadcast (parameters kept in
        storages of their own one by one); aliases follow their parameters before each call."""
        source = self.ranks[0]
        tensors: list[torch.Tensor] = []
        if memory.params is not None:
            tensors.append(memory.params)
        else:
            tensors.extend(slot.param.data for slot in memory.slots())
        tensors.extend(buffer.data for buffer in memory.buffers())
        with torch.no_grad():
            for tensor in tensors:
                if tensor.numel() > 0:
                    dist.broadcast(tensor, src=source, group=self.group)

    def broadcast_buffers(self) -> None:
        """Rank 0's buffers into every rank's, one broadcast per dtype, on the calling thread's
        group: after every training call (a ``forward_backward``, or a ``forward()`` with
        gradients), so that the replicas compute with rank 0's statistics as under
        ``DistributedDataParallel(broadcast_buffers=True)``, and hold them alike at rest."""
        self.agree("buffer broadcast")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for buffer in self.memory.buffers():
            by_dtype.setdefault(buffer.dtype, []).append(buffer)
        with torch.no_grad():
            for buffers in by_dtype.values():
                flat = torch.cat([buffer.reshape(-1) for buffer in buffers])
                dist.broadcast(flat, src=self.ranks[0], group=self.call_group)
                offset = 0
                for buffer in buffers:
                    buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
                    offset += buffer.numel()

    # -- layout ------------------------------------------------------------------------------

    def staged(self) -> torch.Tensor:
        """The staging arena as a gradient arena (unpadded): the new weights after a step."""
        return self.staging[: self.total]

    def _shard_view(self, arena: torch.Tensor, piece: _Slice) -> torch.Tensor:
        """``piece``'s elements in a shard-sized ``arena`` (1-D, the parameter's dtype)."""
        param = piece.slot.param
        nbytes = (piece.stop - piece.start) * param.element_size()
        return arena[piece.offset : piece.offset + nbytes].view(param.dtype)

    def grad_of(self, piece: _Slice) -> torch.Tensor:
        """The averaged gradient of ``piece`` (valid after :meth:`reduce_gradients`)."""
        return self._shard_view(self.shard_grads, piece)

    def target_of(self, piece: _Slice) -> torch.Tensor:
        """Where ``piece``'s new weights go before the all-gather."""
        own = self.staging[self.begin : self.begin + self.shard_bytes]
        return self._shard_view(own, piece)

    # -- collectives ---------------------------------------------------------------------------

    def reduce_gradients(self, arena: torch.Tensor) -> None:
        """Sum ``arena`` (a gradient arena) over the ranks, in place, chunk by chunk of every
        same-dtype run (with stage reduces its own shard already holds the sum); the own shard
        divided by the world size goes to ``shard_grads``."""
        if self.shard_bytes == 0:
            return
        for begin, end, dtype in self.runs if self.reduce_mode == "host" else ():
            for low in range(begin, end, CHUNK_BYTES):
                all_reduce(
                    arena[low : min(end, low + CHUNK_BYTES)].view(dtype),
                    dist.ReduceOp.SUM,
                    self.group,
                )
        own = arena[self.begin : min(self.total, self.begin + self.shard_bytes)]
        self.shard_grads[: own.numel()].copy_(own)
        self.shard_grads[own.numel() :].zero_()
        with torch.no_grad():
            for piece in self.slices:
                self.grad_of(piece).div_(self.world_size)

    def note_step(self) -> None:
        """A step was submitted (on the calling thread): the next backward call is the first
        of the next iteration."""
        self.steps += 1
        self.calls = 0

    def agree_on_call(self, plan: Sequence[range], device: torch.device) -> None:
        """Before a call's first stage reduce: check that every rank is at the same backward
        call of the same iteration and, with several GPUs per rank (a layer's reduce runs on
        the GPU of its stage), has the same backward stages with the first on the same GPU
        ordinal; ValueError on every rank naming the first rank that differs. The sequence of
        reduces (layers in descending order) does not depend on the plan otherwise."""
        layout, ordinal = 0, -1
        if len(self.gpus) > 1:
            layout = zlib.crc32(repr([(r.start, r.stop) for r in plan]).encode())
            gpu = device.index or 0
            ordinal = self.gpus.index(gpu) if gpu in self.gpus else -2  # reduce_stage raises
        self.agree("backward call", layout, ordinal)
        self.calls += 1

    def agree(
        self, action: str, layout: int = 0, ordinal: int = -1, *, refused: bool = False
    ) -> None:
        """Check, on the calling thread, that every rank is about to do the same collective
        ``action`` (one of :data:`AGREED_ACTIONS`) at the same point of training: the same
        number of steps and of backward calls since the last one. A rank out of step (one more
        backward call, a save on rank 0 alone) would otherwise pair its collectives with the
        other ranks' different ones: wait out the group timeout, or make gloo abort the
        process. ``ValueError`` on every rank, naming the first rank that differs and the rule
        it broke, instead.

        ``refused``: this rank refused its arguments to ``action`` (a collective call's
        argument checks can fail on one rank alone: a folder that rank cannot see). Every rank
        raises ``ValueError`` naming it; the refusing rank's caller raises its own error."""
        kind = AGREED_ACTIONS.index(action)
        row = [self.steps, self.calls, kind, layout, ordinal, int(refused)]
        mine = torch.tensor(row, dtype=torch.int64)
        everyone = torch.empty(self.world_size * mine.numel(), dtype=torch.int64)
        try:
            all_gather(everyone, mine, self.call_group)
            rows = everyone.view(self.world_size, -1).tolist()
            for rank, row in enumerate(rows):
                if row[5] and row[2] == kind:
                    raise ValueError(
                        f"rank {rank} refused its arguments to {action} (its own error says "
                        "why); every rank raises, so that none waits for it"
                    )
            for rank, row in enumerate(rows):
                if row != rows[0]:
                    raise ValueError(_disagreement(self.reduce_mode, rank, row, rows[0]))
        except Exception as error:
            if action in ("backward call", "buffer broadcast"):
                raise  # the call names the layers and the phase
            phase = "optimizer step" if action == "step" else action
            where = f"RoundPipe model {self.name!r}: {phase} (data-parallel agreement)"
            raise locate_error(error, where) from error

    def reduce_stage(
        self, buffer: torch.Tensor, first_byte: int, layers: range, device: torch.device
    ) -> list[tuple[int, int]]:
        """Sum a backward stage's device gradients (``buffer``: the gradient arena's bytes from
        ``first_byte`` on, on ``device``) into the ranks that own them, layer by layer in
        descending order; returns the byte ranges to download, disjoint and in order.

        Those are the own shard and every alias (a later use of a shared parameter): an alias's
        gradient is summed into every rank, which folds it into its parameter's before the step
        (see ``ModelMemory.fold_alias_grads``), wherever the two lie in the shards."""
        group, gpu = self.call_group, device.index or 0
        if device.type == "cuda" and gpu in self.gpus:
            group = self.gpu_groups[self.gpus.index(gpu)]
        elif device.type == "cuda" or self.gpus:
            raise RuntimeError(
                f"the device pool changed since the model was built (its stage reduces were set "
                f"up for {'GPUs ' + str(self.gpus) if self.gpus else 'CPU devices'}, this stage "
                f"ran on {device}): build data-parallel models after configure_devices()"
            )
        size = self.shard_bytes
        if size == 0:
            return []
        ranges = [(self.begin, self.begin + size)]
        for layer in reversed(layers):
            for begin, end, dtype, alias in self.memory.layer_grad_runs(layer):
                if alias:
                    local = buffer[begin - first_byte : end - first_byte].view(dtype)
                    all_reduce(local, dist.ReduceOp.SUM, group)
                    ranges.append((begin, end))
                    continue
                for owner in range(begin // size, -(-end // size)):
                    low, high = max(begin, owner * size), min(end, (owner + 1) * size)
                    local = buffer[low - first_byte : high - first_byte].view(dtype)
                    reduce(local, self.ranks[owner], group)
        return _union(ranges)

    def gather_weights(self) -> None:
        """Every rank's staged new weights into every rank's staging arena (as bytes)."""
        if self.shard_bytes == 0:
            return
        own = self.staging[self.begin : self.begin + self.shard_bytes]
        all_gather(self.staging, own, self.group)

    def all_reduce_scalar(self, value: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        """``value`` (a one-element tensor) reduced with ``op`` over the ranks; a failure is
        raised as a RuntimeError naming ``what`` was being agreed on."""
        result = value.detach().reshape(1).clone()
        try:
            all_reduce(result, op, self.group)
        except Exception as error:
            raise RuntimeError(f"data-parallel {what} across ranks failed: {error}") from error
        return result.reshape(value.shape)

    def grad_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        """The ``norm_type``-norm of every rank's ``grads`` together (accumulated in float64),
        in the dtype of the gradients."""
        zero = torch.zeros((), dtype=torch.float64)
        if norm_type == math.inf:
            local = max((g.abs().max().double() for g in grads), default=zero)
            total = self.all_reduce_scalar(local, dist.ReduceOp.MAX, "gradient norm")
        else:
            powers = [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]
            local = sum((power**norm_type for power in powers), zero)
            summed = self.all_reduce_scalar(local, dist.ReduceOp.SUM, "gradient norm")
            total = summed ** (1.0 / norm_type)
        return total.to(grads[0].dtype if grads else torch.float32)

    @contextmanager
    def active(self) -> Iterator[None]:
        """Around ``step_fn``: :func:`any_rank` agrees over this model's ranks."""
        previous = getattr(_active, "model", None)
        _active.model = self
        try:
            yield
        finally:
            _active.model = previous


def replicas_of(
    group: Any,
    model: nn.Module,
    memory: ModelMemory,
    name: str,
    settings: dict[str, Any],
    reduce: str,
) -> DataParallel | None:
    """The data parallelism of a RoundPipe over ``model`` (wrapped as ``memory``'s layers) on
    ``group`` (a ``ProcessGroup``, :data:`NO_GROUP` or None, see :func:`check_group`) with
    gradients reduced where ``reduce`` says (see :func:`resolve_reduce_mode`), over the device
    pool: None for no group or a group of one rank. Every rank must have built the same model
    with the same ``settings`` (the wrapper's arguments that shape the replicas): compared with
    rank 0's, with the parameters' and buffers' names, shapes and dtypes."""
    size = check_group(group)
    check_reduce_mode(reduce)
    if size <= 1:
        return None
    pool = devices()
    reduce_mode = resolve_reduce_mode(reduce, pool)
    signature = {
        "world size": size,
        "layer count": len(memory.layers),
        **settings,
        "data_parallel_reduce": reduce_mode,
        "parameters": [
            (n, tuple(p.shape), str(p.dtype), p.requires_grad)
            for n, p in model.named_parameters(remove_duplicate=False)
        ],
        "buffers": [
            (n, tuple(b.shape), str(b.dtype))
            for n, b in model.named_buffers(remove_duplicate=False)
        ],
    }
    if reduce_mode == "stage":  # one group per GPU: the ranks need as many
        signature["GPUs"] = len({d.index for d in pool if d.type == "cuda"})
    return DataParallel(group, memory, name, signature, reduce_mode, pool)


def _doing(row: list[int]) -> str:
    """What a rank's agreement row says it is doing, in words."""
    steps, calls, kind = row[0], row[1], AGREED_ACTIONS[row[2]]
    if kind == "backward call":
        return f"runs backward call {calls + 1} since step {steps}"
    counted = f" and {calls} backward calls since" if calls else ""
    return f"{'steps' if kind == 'step' else 'calls ' + kind} after {steps} steps{counted}"


def _disagreement(reduce_mode: str, rank: int, row: list[int], first: list[int]) -> str:
    """The error of an agreement whose rows differ at ``rank`` (see DataParallel.agree)."""
    kinds = AGREED_ACTIONS[row[2]], AGREED_ACTIONS[first[2]]
    if "save_checkpoint" in kinds or "load_checkpoint" in kinds:
        rule = (
            "save_checkpoint and load_checkpoint of a data-parallel model are collective: every "
            "rank calls them with its own replica at the same point of training (not rank 0 "
            "alone, as with DistributedDataParallel)"
        )
    elif row[:2] == first[:2] and row[2] == first[2]:
        rule = (
            "the data-parallel ranks reduce gradients stage by stage, so they must run the "
            "same backward calls with the same plan: pass the same fixed ModelExecutePlan on "
            "every rank"
        )
        field = (
            "plan's backward stages" if row[3] != first[3] else "GPU of the first backward stage"
        )
        return f"{rule}, but the {field} differs on rank {rank} from rank 0's"
    else:
        rule = (
            "every rank must run the same backward calls (forward_backward, or forward() and "
            "backward()) between steps, and the same steps"
        )
        if reduce_mode == "stage":
            rule += ", since data_parallel_reduce='stage' reduces each call's gradients (or use "
            rule += "data_parallel_reduce='host')"
    return (
        f"the data-parallel ranks are out of step: rank {rank} {_doing(row)} while rank 0 "
        f"{_doing(first)}; {rule} (the point of training differs on rank {rank} from rank "
        "0's)"
    )


def _union(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges ``(begin, end)`` covering ``ranges``, disjoint and in order."""
    merged: list[tuple[int, int]] = []
    for begin, end in sorted(ranges):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((begin, end))
    return merged


def any_rank(flag: bool) -> bool:
    """``flag`` or-ed over the data-parallel ranks of the step running on this thread (``flag``
    itself outside a data-parallel step): GradScaler's inf/NaN verdict, so that every rank skips
    the same steps."""
    model: DataParallel | None = getattr(_active, "model", None)
    if model is None:
        return flag
    verdict = model.all_reduce_scalar(
        torch.tensor([float(flag)]), dist.ReduceOp.MAX, "GradScaler inf/NaN check"
    )
    return bool(verdict.item() > 0)


__all__ = [
    "AGREED_ACTIONS",
    "CHUNK_BYTES",
    "NO_GROUP",
    "REDUCE_MODES",
    "DataParallel",
    "DataParallelShard",
    "ShardPiece",
    "all_gather",
    "all_reduce",
    "any_rank",
    "check_group",
    "check_reduce_mode",
    "reduce",
    "replicas_of",
    "resolve_reduce_mode",
]
