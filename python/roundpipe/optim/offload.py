"""The optimizer's master copies and Adam's moments in files on a fast disk (``optim_offload``).

``RoundPipe(..., optim_dtype=torch.float32, optim_offload="/nvme/scratch")`` keeps the model's
fp32 optimizer copies in a file under that folder instead of host memory, and
:class:`roundpipe.optim.Adam` given those copies keeps its moments (any ``state_dtype``) in a
second one. Host memory then holds the model's low-precision weights, its gradient arenas and
:attr:`OptimOffload.buffers` chunks of :attr:`OptimOffload.chunk_elements` elements each: Adam's
step streams every tensor's state through them in native code (``csrc/optim/disk_state.h``),
reading ahead and writing behind on a few I/O threads, with direct I/O where the filesystem
allows it, and computes the same bits as the step in memory.

The copies and moments stay ordinary tensors for everything else (``state_dict``, checkpoints,
``clip_grad_norm_``, a user's edits): each is a shared memory map of its region of the file, so
those read and write through the page cache, which the step's direct I/O keeps coherent (it
writes out dirty pages before it reads, and drops cached ones after it writes). Only
:class:`roundpipe.optim.Adam` streams; any other optimizer's ``step`` on offloaded copies raises
``TypeError``.

The folder is scratch space: its files are unlinked as soon as they are opened, so they vanish
when the model is gone or the process ends (even by ``kill -9``); checkpoints are written
elsewhere, as always. A lock file (``roundpipe-rank<r>.lock``, held with ``flock``) refuses a
second model or process on the same folder and rank; it is removed when the model is gone or at
interpreter exit (:mod:`roundpipe.lifecycle`).
"""

from __future__ import annotations

import errno
import fcntl
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, cast

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from roundpipe import lifecycle
from roundpipe._native import _C
from roundpipe.optim import adam_state
from roundpipe.optim.copies import OptimizerCopy
from roundpipe.timeline.tracing import active_tracer

__all__ = ["OffloadStore", "OptimOffload", "check_optim_offload", "open_store", "store_of"]

_ALIGN: int = _C.disk_align()
# Bytes Python writes per request when it fills a region (a master copy at creation).
_WRITE_SLICE = 1 << 26
# Elements of a parameter converted to fp32 at a time when its master copy is written.
_CONVERT_ELEMENTS = 1 << 18
# The largest buffers and io_threads the native step takes (a C int), and chunk_elements (its
# buffers' byte counts must stay far from overflowing).
_MOST_INT = (1 << 31) - 1
_MOST_CHUNK = 1 << 40


@dataclass(frozen=True)
class OptimOffload:
    """Where and how the optimizer state is streamed from disk (RoundPipe's ``optim_offload``).

    Args:
        folder: an existing, writable directory on a fast local disk (NVMe). Every rank of a
            data-parallel model may share it (each has its own files).
        buffers: chunks of state held in host memory at once (at least 3): one being updated,
            one being written, the rest read ahead.
        chunk_elements: parameters per chunk (rounded up to a multiple of 262,144; at most
            2**40). A chunk of fp32 state costs 12 bytes per element (master and two moments),
            int8 state 6.
        io_threads: read and write requests in flight (at most 2**31 - 1, as ``buffers``).
    """

    folder: str | os.PathLike[str]
    buffers: int = 4
    chunk_elements: int = 1 << 20
    io_threads: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.folder, str | os.PathLike):
            raise TypeError(
                f"OptimOffload.folder must be a path (str or os.PathLike), got "
                f"{type(self.folder).__name__}"
            )
        if os.fspath(self.folder) == "":
            raise ValueError("OptimOffload.folder is empty: name a folder on a fast local disk")
        for name, least, most in (
            ("buffers", 3, _MOST_INT),
            ("chunk_elements", 1, _MOST_CHUNK),
            ("io_threads", 1, _MOST_INT),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"OptimOffload.{name} must be an int, got {type(value).__name__}")
            if not least <= value <= most:
                raise ValueError(
                    f"OptimOffload.{name} must be between {least} and {most}, got {value}"
                )

    def buffer_bytes(self, state_dtype: torch.dtype = torch.float32) -> int:
        """Host memory of the step's buffers for moments in ``state_dtype``."""
        grain = int(_C.disk_grain())
        chunk = -(-self.chunk_elements // grain) * grain
        moment = {torch.float32: 4, torch.bfloat16: 2, torch.int8: 1}[state_dtype]
        scales = 2 * 4 * adam_state.blocks(chunk) if state_dtype == torch.int8 else 0
        return self.buffers * (chunk * (4 + 2 * moment) + scales)


def check_optim_offload(value: Any, optim_dtype: torch.dtype | None) -> OptimOffload | None:
    """RoundPipe's ``optim_offload`` argument as an :class:`OptimOffload` (None: off)."""
    if value is None:
        return None
    if isinstance(value, str | os.PathLike):
        value = OptimOffload(value)
    if not isinstance(value, OptimOffload):
        raise TypeError(
            f"optim_offload must be a folder (str or os.PathLike), a roundpipe.OptimOffload or "
            f"None, got {type(value).__name__}"
        )
    if optim_dtype != torch.float32:
        raise ValueError(
            f"optim_offload needs optim_dtype=torch.float32 (the master copies it keeps on disk "
            f"are fp32), got optim_dtype={optim_dtype}"
        )
    return value


def open_store(config: OptimOffload | None, name: str, rank: int) -> OffloadStore | None:
    """The store of model ``name``'s optimizer state on disk for ``config`` (None: off)."""
    return None if config is None else OffloadStore(config, name, rank)


@dataclass(frozen=True)
class _Region:
    file: int  # index into the store's files
    offset: int
    nbytes: int


class _StateFile:
    """One unlinked file of a store, open twice: for direct I/O (the step) and buffered (its
    memory maps and the Python side's writes)."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)
        self.buffered = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                self.direct = os.open(path, os.O_RDWR | getattr(os, "O_DIRECT", 0))
            except OSError as error:
                if error.errno != errno.EINVAL:
                    raise
                self.direct = os.open(path, os.O_RDWR)  # tmpfs and others refuse O_DIRECT
        except BaseException:
            os.close(self.buffered)
            raise
        finally:
            os.unlink(path)
        self.size = 0
        self._open = True

    def allocate(self, nbytes: int) -> int:
        """A new region of ``nbytes`` (rounded up to whole pages), reading zeros; its offset.
        Its disk space is taken now: a full disk raises here, not as a SIGBUS where a memory
        map of a hole is touched (a state_dict saved after the disk filled)."""
        offset = self.size
        length = -(-max(nbytes, 1) // _ALIGN) * _ALIGN
        try:
            os.posix_fallocate(self.buffered, offset, length)
        except OSError as error:
            raise OSError(
                error.errno,
                f"allocating {length} bytes of {self.path} failed: {error.strerror}",
                self.path,
            ) from error
        self.size += length
        return offset

    def close(self) -> None:
        """Closes the file: its space is freed once its memory maps are gone too."""
        if not getattr(self, "_open", False):
            return
        self._open = False
        for fd in (self.direct, self.buffered):
            os.close(fd)

    def __del__(self) -> None:
        self.close()


class _FolderLock:
    """The ``flock`` on a folder's lock file; released (and the file removed) when its store is
    gone, or at interpreter exit."""

    live: ClassVar[weakref.WeakSet[_FolderLock]] = weakref.WeakSet()

    def __init__(self, fd: int, path: str) -> None:
        self.fd: int | None = fd
        self.path = path
        self.pid = os.getpid()  # a forked child shares the lock: only its owner removes it
        _FolderLock.live.add(self)

    def release(self) -> None:
        fd, self.fd = self.fd, None
        if fd is None:
            return
        if os.getpid() == self.pid:
            try:
                os.unlink(self.path)
            except OSError:
                pass
        os.close(fd)

    def __del__(self) -> None:
        self.release()


def _release_all_locks(_seconds: float | None) -> bool:
    for lock in list(_FolderLock.live):
        lock.release()
    return True


_hook_installed = False


lifecycle.join(
    "optimizer offload",
    lifecycle.Participant(at_exit=_release_all_locks, unfinished="offload lock files"),
)


def _refuse_other_optimizers(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    """Global optimizer step pre-hook: only an optimizer that streams offloaded state may step
    offloaded copies."""
    if getattr(optimizer, "streams_offloaded_state", False):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            if store_of(param) is not None:
                raise TypeError(
                    f"{type(optimizer).__module__}.{type(optimizer).__qualname__} cannot step "
                    f"optimizer copies kept on disk (RoundPipe's optim_offload): use "
                    f"roundpipe.optim.Adam, which streams them, or drop optim_offload"
                )


_stores: weakref.WeakValueDictionary[int, OffloadStore] = weakref.WeakValueDictionary()


def _names_file(path: Path, fd: int) -> bool:
    """Whether ``path`` is still the file open as ``fd``."""
    try:
        return os.path.samestat(os.stat(path), os.fstat(fd))
    except FileNotFoundError:
        return False


def store_of(param: Tensor) -> OffloadStore | None:
    """The store whose file holds ``param`` (an offloaded optimizer copy), else None, also for a
    copy of one (``copy.deepcopy``, ``pickle``, ``torch.load``), which lives in memory."""
    store_id = getattr(param, "_offload_store", None)
    store = None if store_id is None else _stores.get(store_id)
    return store if store is not None and store.holds(param) else None


class OffloadStore:
    """One model's (one rank's) optimizer state under an :class:`OptimOffload` folder: the
    master copies' file and the moments' file, their regions and memory maps."""

    def __init__(self, config: OptimOffload, name: str, rank: int = 0) -> None:
        global _hook_installed
        self.config, self.name = config, name
        # Absolute: the files are created later (the moments' at the first step), maybe after
        # the working directory changed.
        folder = Path(os.path.abspath(config.folder))
        if not folder.is_dir():
            raise ValueError(
                f"optim_offload folder {str(folder)!r} of model {name!r} "
                f"{'is not a directory' if folder.exists() else 'does not exist'}: create it "
                f"on a fast local disk, or drop optim_offload"
            )
        lock_path = folder / f"roundpipe-rank{rank}.lock"
        while True:
            try:
                lock = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
            except OSError as error:
                raise ValueError(
                    f"optim_offload folder {str(folder)!r} of model {name!r} is not writable "
                    f"({error.strerror}); give a folder this process may write"
                ) from error
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(lock)
                raise ValueError(
                    f"optim_offload folder {str(folder)!r} of model {name!r} is in use by "
                    f"another model or process (it holds {str(lock_path)!r}); give each model "
                    f"its own folder"
                ) from None
            if _names_file(lock_path, lock):
                break
            # Its holder released the file (and removed it) between the open and the flock: the
            # lock of a file nobody else can see any more protects nothing.
            os.close(lock)
        if not os.access(folder, os.W_OK | os.X_OK):
            os.close(lock)
            raise ValueError(
                f"optim_offload folder {str(folder)!r} of model {name!r} is not writable; give "
                f"a folder this process may write"
            )
        self._lock = _FolderLock(lock, str(lock_path))
        self._prefix = folder / f"roundpipe-rank{rank}-{os.getpid()}-{id(self):x}"
        self._files: list[_StateFile] = []
        # id of the copy -> the copy (weakly: `holds`) and its region
        self._masters: dict[int, tuple[weakref.ref[Tensor], _Region]] = {}
        # (id of the optimizer, id of the copy, key) -> region: each optimizer its own moments
        self._moments: dict[tuple[int, int, str], _Region] = {}
        self._maps: dict[tuple[int, int], Tensor] = {}  # (file, offset) -> its memory map
        self._map_regions: dict[int, _Region] = {}  # data_ptr of a memory map -> its region
        # The last step's bytes read and written, and the I/O threads' seconds reading and
        # writing (summed over the threads).
        self.last_stats: tuple[int, int, float, float] = (0, 0, 0.0, 0.0)
        _stores[id(self)] = self
        if not _hook_installed:
            register_optimizer_step_pre_hook(_refuse_other_optimizers)
            _hook_installed = True

    def holds(self, param: Tensor) -> bool:
        """Whether ``param`` is one of this store's optimizer copies (not a copy of one)."""
        entry = self._masters.get(id(param))
        return entry is not None and entry[0]() is param

    def _file(self, index: int, kind: str) -> _StateFile:
        while len(self._files) <= index:
            self._files.append(_StateFile(Path(f"{self._prefix}-{kind}.bin")))
        return self._files[index]

    def _map(self, region: _Region, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """The region as a tensor (a shared memory map of it)."""
        key = (region.file, region.offset)
        mapped = self._maps.get(key)
        if mapped is not None and mapped.dtype == dtype and mapped.shape == shape:
            return mapped
        numel = shape.numel()
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        file = self._files[region.file]
        # Mapped natively: Python's mmap would keep a descriptor per tensor.
        view = _C.map_file_region(file.buffered, file.path, region.offset, region.nbytes)
        mapped = view[: numel * dtype.itemsize].view(dtype).view(shape)
        self._maps[key] = mapped
        self._map_regions[mapped.data_ptr()] = region
        return mapped

    def _write(self, region: _Region, values: Tensor) -> None:
        """Writes ``values`` (contiguous, on the host) at the start of ``region``."""
        raw = memoryview(
            cast(Any, values.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
        )
        file = self._files[region.file]
        for start in range(0, len(raw), _WRITE_SLICE):
            piece = raw[start : start + _WRITE_SLICE]
            try:
                os.pwrite(file.buffered, piece, region.offset + start)
            except OSError as error:
                raise OSError(error.errno, f"writing {file.path} failed", file.path) from error

    def masters(self, values: Mapping[int, Tensor]) -> dict[int, OptimizerCopy]:
        """Optimizer copies (fp32) of ``values`` (keyed like the returned dict), written to the
        masters' file; each a memory map of its region."""
        self._file(0, "masters")
        copies: dict[int, OptimizerCopy] = {}
        for key, value in values.items():
            nbytes = value.numel() * 4
            region = _Region(0, self._files[0].allocate(nbytes), nbytes)
            flat = value.detach().reshape(-1)
            # Converted slice by slice: no fp32 copy of a whole parameter in memory.
            for start in range(0, flat.numel(), _CONVERT_ELEMENTS):
                piece = flat[start : start + _CONVERT_ELEMENTS].to(torch.float32)
                self._write(_Region(0, region.offset + start * 4, piece.numel() * 4), piece)
            copy = OptimizerCopy(self._map(region, value.shape, torch.float32))
            copy._offload_store = id(self)  # type: ignore[attr-defined]
            self._masters[id(copy)] = (weakref.ref(copy), region)
            copies[key] = copy
        return copies

    def fresh_moments(
        self, param: Tensor, state_dtype: torch.dtype, owner: object
    ) -> dict[str, Tensor]:
        """Zero moments for the offloaded copy ``param`` in ``state_dtype``'s form
        (:func:`roundpipe.optim.adam_state.fresh_moments`), in the moments' file, for the
        optimizer ``owner``."""
        self._file(1, "moments")

        def zeros(shape: torch.Size, dtype: torch.dtype) -> Tensor:
            nbytes = shape.numel() * torch.empty(0, dtype=dtype).element_size()
            region = _Region(1, self._files[1].allocate(nbytes), nbytes)  # reads zeros
            return self._map(region, shape, dtype)

        return self.placed(param, adam_state.fresh_moments(param, state_dtype, zeros), owner)

    def placed(
        self, param: Tensor, moments: Mapping[str, Tensor], owner: object
    ) -> dict[str, Tensor]:
        """``moments`` (the tensor entries of ``param``'s state in the optimizer ``owner``) with
        every moment and scale in the moments' file: those already there as they are, others
        written into ``param``'s region of ``owner`` for that key (a new region if its size
        changed, say with ``state_dtype``)."""
        self._file(1, "moments")
        placed = dict(moments)
        for key in (*adam_state.MOMENT_KEYS, *adam_state.SCALE_KEYS.values()):
            value = moments.get(key)
            if value is None:
                continue
            nbytes = value.numel() * value.element_size()
            region = self._moments.get((id(owner), id(param), key))
            own = self._map_regions.get(value.data_ptr()) if value.numel() else None
            if region is None and own is not None and own.nbytes == nbytes:
                self._moments[(id(owner), id(param), key)] = own  # a fresh moment, mapped already
                continue
            if region is None or region.nbytes != nbytes:
                region = _Region(1, self._files[1].allocate(nbytes), nbytes)
                self._moments[(id(owner), id(param), key)] = region
                mapped = self._map(region, value.shape, value.dtype)
                if bool(value.any()):  # a new region reads zeros
                    self._write(region, value)
            else:
                mapped = self._map(region, value.shape, value.dtype)
                if mapped.data_ptr() != value.data_ptr():
                    self._write(region, value)
            placed[key] = mapped
        return placed

    def adam_step(
        self,
        group: Mapping[str, Any],
        params: Sequence[Tensor],
        grads: Sequence[Tensor],
        states: Sequence[dict[str, Any]],
        lowp: Sequence[Tensor | None],
        grad_scale_inv: float,
        hyper: Mapping[str, Any],
        owner: object,
    ) -> None:
        """One streamed Adam step over ``params`` (offloaded copies of this store) with their
        ``states`` in the optimizer ``owner`` (moved into the moments' file first where they
        are not there)."""
        state_dtype = group["state_dtype"]
        regions: list[list[int]] = []
        for param, state in zip(params, states, strict=True):
            state.update(self.placed(param, state, owner))
            master = self._masters[id(param)][1]
            row = [master.file, master.offset]
            keys = (*adam_state.MOMENT_KEYS, *adam_state.SCALE_KEYS.values())
            for key in keys:
                region = self._moments.get((id(owner), id(param), key))
                row += [-1, 0] if region is None else [region.file, region.offset]
            regions.append(row)
        files = [(file.direct, file.path) for file in self._files]
        *totals, spans = _C.adam_step_streamed(
            files,
            regions,
            list(grads),
            [state["step"] for state in states],
            list(lowp),
            state_dtype=state_dtype,
            grad_scale_inv=float(grad_scale_inv),
            chunk_elements=self.config.chunk_elements,
            buffers=self.config.buffers,
            io_threads=self.config.io_threads,
            **hyper,
        )
        # A gradient whose memory now holds the new weights is gone: as after zero_grad().
        for param, grad, target in zip(params, grads, lowp, strict=True):
            if target is not None and target.data_ptr() == grad.data_ptr():
                if isinstance(param, OptimizerCopy):
                    param.drop_grad()
        read, written, read_seconds, write_seconds = totals
        self.last_stats = (int(read), int(written), float(read_seconds), float(write_seconds))
        tracer = active_tracer()
        if tracer is not None:
            for write, start, end, nbytes in spans:
                tracer.record(
                    "disk_write" if write else "disk_read",
                    model=self.name,
                    device=None,
                    lane="disk",
                    start=start,
                    end=end,
                    bytes=nbytes,
                )
