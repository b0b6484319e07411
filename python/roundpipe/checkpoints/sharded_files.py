"""Sharded checkpoint folders: one file per rank through ``torch.distributed.checkpoint``, made
crash-safe and checksummed like the single-file checkpoints of ``roundpipe.checkpoints.checkpoint``.

Layout of a checkpoint folder::

    MANIFEST.json       names the complete data folder, its files, their sizes and CRC-32s;
                        replaced atomically, and only after every file of the save is on disk
    data-<id>/          what torch.distributed.checkpoint wrote: .metadata, __<rank>_0.distcp

A crash at any moment leaves ``MANIFEST.json`` naming the previous, complete data folder (or no
manifest at all: no checkpoint), so a save never damages the checkpoint it replaces. Data
folders that no manifest names (a crashed save, the previous checkpoint) are removed after the
new manifest has landed.

Entries are keyed by name. A *piece* is one rank's part ``[offset, offset + numel)`` of a
flattened tensor of ``global_numel`` elements: the ranks of a data-parallel model each hold the
pieces of their own shard, and a load at another number of ranks reads, for each of its pieces,
the overlapping parts that other ranks wrote. Other tensors are whole tensors that every rank
holds alike (written once); other objects are pickled with ``torch.save`` and read back with
``weights_only=True``, so a checkpoint cannot run code.
"""

from __future__ import annotations

import enum
import io
import json
import os
import pathlib
import pickle
import shutil
import uuid
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.state_dict_loader import load
from torch.distributed.checkpoint.state_dict_saver import save

from roundpipe._native import BUILD_INFO

FORMAT = "roundpipe.sharded_checkpoint"
FORMAT_VERSION = 1
MANIFEST = "MANIFEST.json"
_READ_BYTES = 8 << 20


class CheckpointError(RuntimeError):
    """A checkpoint (a file, or a folder of shards) is corrupt, truncated, incomplete, not a
    RoundPipe checkpoint, or does not match what it is loaded into."""


@dataclass(frozen=True)
class Piece:
    """The elements ``[offset, offset + numel)`` of a flattened tensor of ``global_numel``."""

    global_numel: int
    offset: int


def save_folder(
    folder: Path, entries: dict[str, Any], pieces: dict[str, Piece], group: Any
) -> None:
    """Write ``entries`` into the checkpoint folder ``folder`` (created if missing; its parent
    must exist). Called by every rank of ``group`` (None: this process alone) with its own
    pieces; returns once the new manifest is on disk on every rank."""
    ranks = _Ranks(group)
    failure: OSError | None = None
    if ranks.rank == 0:
        try:
            folder.mkdir(exist_ok=True)
            _remove_crashed_temporaries(folder)
        except OSError as error:
            failure = error
    name, problem = ranks.broadcast(
        (f"data-{uuid.uuid4().hex[:16]}", None if failure is None else str(failure))
    )
    if failure is not None:
        raise failure
    if problem is not None:  # every rank raises, none waits for rank 0's writes
        raise OSError(
            f"save_checkpoint: rank 0 could not create the checkpoint folder {str(folder)!r} "
            f"({problem}); nothing was written"
        )
    data = folder / name
    writer = FileSystemWriter(data, single_file_per_rank=True, sync_files=True)
    with _quiet(f"saving checkpoint {str(folder)!r}"):
        save(
            entries,
            storage_writer=writer,
            planner=_PieceSavePlanner(pieces),
            process_group=group,
            no_dist=ranks.alone,
        )
    own = _own_files(data, ranks.rank)
    with ThreadPoolExecutor(min(8, max(1, len(own)))) as pool:
        described = dict(zip(own, pool.map(_describe, [data / file for file in own]), strict=True))
    files: dict[str, Any] = {}
    for part in ranks.gather(described):
        files.update(part)
    _refuse_unseen_files(folder, data, files, ranks)
    if ranks.rank == 0:
        _fsync_folder(data)
        _write_manifest(
            folder,
            {
                "format": FORMAT,
                "format_version": FORMAT_VERSION,
                "roundpipe_version": str(BUILD_INFO["version"]),
                "torch_version": torch.__version__,
                "world_size": ranks.size,
                "data": name,
                "files": files,
            },
        )
        for stale in folder.glob("data-*"):
            if stale.name != name:
                shutil.rmtree(stale, ignore_errors=True)
    ranks.barrier()


def _refuse_unseen_files(folder: Path, data: Path, files: dict[str, Any], ranks: _Ranks) -> None:
    """Every rank must see every rank's file where the manifest will say it is: ranks that
    saved to different folders (per-rank paths, or a filesystem they do not share) would
    otherwise leave folders that none can load. ``ValueError`` on every rank naming the first
    file a rank cannot see; this save's files are removed and the manifest, so the previous
    checkpoint, stays."""
    unseen = [
        name
        for name, described in sorted(files.items())
        if not (data / name).is_file() or (data / name).stat().st_size != described["bytes"]
    ]
    verdicts = ranks.gather((str(folder.resolve()), unseen))
    for rank, (path, missing) in enumerate(verdicts):
        if missing:
            shutil.rmtree(data, ignore_errors=True)
            raise ValueError(
                f"save_checkpoint: rank {rank} cannot see {missing[0]!r} in its checkpoint folder "
                f"{path!r}: every rank must save to the same folder, on a filesystem every rank "
                f"sees (the ranks' folders: {sorted({where for where, _ in verdicts})}). The "
                "previous checkpoint is unchanged"
            )


def load_folder(
    folder: Path, entries: dict[str, Any], pieces: dict[str, Piece], group: Any
) -> None:
    """Fill ``entries`` from the checkpoint folder: tensors in place (pieces from whatever
    ranks wrote them), other objects replaced by the saved ones. Every file is checked against
    the manifest first (the ranks share the work); nothing is read into ``entries`` unless
    every check passed on every rank."""
    ranks = _Ranks(group)
    manifest = read_manifest(folder)
    data = folder / manifest["data"]
    names = sorted(manifest["files"])
    mine = [file for index, file in enumerate(names) if index % ranks.size == ranks.rank]
    errors = [error for error in map(_check_file(data, manifest["files"]), mine) if error]
    for part in ranks.gather(errors):
        if part:
            raise CheckpointError(part[0])
    reader = _SafeReader(data)
    saved = reader.read_metadata().state_dict_metadata
    _check_against(folder, entries, pieces, saved)
    with _quiet(f"loading checkpoint {str(folder)!r}"):
        load(
            entries,
            storage_reader=reader,
            planner=_PieceLoadPlanner(pieces),
            process_group=group,
            no_dist=ranks.alone,
        )


def read_saved_entries(folder: Path) -> dict[str, tuple[torch.Size | None, torch.dtype | None]]:
    """Name -> (size, dtype) of every entry in the checkpoint folder; (None, None) for objects.
    Reads the manifest and the metadata only (the files are checked by :func:`load_folder`)."""
    manifest = read_manifest(folder)
    data = folder / manifest["data"]
    error = _check_file(data, manifest["files"])(_METADATA)
    if error:
        raise CheckpointError(error)
    saved = _SafeReader(data).read_metadata().state_dict_metadata
    return {
        key: (meta.size, meta.properties.dtype)
        if isinstance(meta, TensorStorageMetadata)
        else (None, None)
        for key, meta in saved.items()
    }


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a checkpoint folder, after checking its own checksum."""
    path = folder / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(
            f"no complete checkpoint in folder {str(folder)!r} (it has no {MANIFEST})"
        )
    try:
        outer = json.loads(path.read_bytes())
        body = outer["manifest"]
        if zlib.crc32(json.dumps(body, sort_keys=True).encode()) != outer["crc32"]:
            raise ValueError("its checksum does not match")
        if body.get("format") != FORMAT:
            raise ValueError(f"format is {body.get('format')!r}, not {FORMAT!r}")
        if not isinstance(body.get("format_version"), int):
            raise ValueError(f"format_version is {body.get('format_version')!r}, not an int")
        data = body.get("data")
        if not isinstance(data, str) or "/" in data or data in ("", ".", ".."):
            raise ValueError(f"data is {data!r}, not the name of a data folder")
        files = body.get("files")
        if not isinstance(files, dict) or _METADATA not in files:
            raise ValueError(f"files does not list the data folder's {_METADATA}")
        for name, described in files.items():
            if "/" in name or not isinstance(described, dict) or set(described) != _DESCRIBED:
                raise ValueError(f"files[{name!r}] is not a (bytes, crc32) description")
    except (ValueError, KeyError, TypeError) as error:
        message = f"checkpoint manifest {str(path)!r} is corrupt: {error}"
        raise CheckpointError(message) from error
    if body["format_version"] > FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {str(folder)!r} has format version {body['format_version']}; this "
            f"roundpipe reads up to {FORMAT_VERSION}: upgrade roundpipe"
        )
    return dict(body)


class _Pieces:
    """What both planners keep: the pieces, which they plan themselves, and every entry; the
    default planner they extend sees the other entries only."""

    def __init__(self, pieces: dict[str, Piece]) -> None:
        # The default planners' own flattening would rename the entries.
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)  # type: ignore[call-arg]
        self.pieces = pieces
        self.all_entries: dict[str, Any] = {}

    def whole(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        self.all_entries = state_dict
        return {key: value for key, value in state_dict.items() if key not in self.pieces}


class _PieceSavePlanner(_Pieces, DefaultSavePlanner):
    """The default plan, with each piece written as its chunk of the whole tensor."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(self.whole(state_dict), storage_meta, is_coordinator)

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, piece in self.pieces.items():
            tensor = self.all_entries[key]
            items.append(
                WriteItem(
                    index=MetadataIndex(key, torch.Size([piece.offset])),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(
                            offsets=torch.Size([piece.offset]), sizes=tensor.shape
                        ),
                        properties=TensorProperties.create_from_tensor(tensor),
                        size=torch.Size([piece.global_numel]),
                    ),
                )
            )
        self.plan = plan = SavePlan(items, planner_data=plan.planner_data, usable=plan.usable)
        return plan

    def lookup_object(self, index: MetadataIndex) -> Any:
        if index.fqn in self.pieces:
            return self.all_entries[index.fqn]
        return super().lookup_object(index)


class _PieceLoadPlanner(_Pieces, DefaultLoadPlanner):
    """The default plan, with each piece read from the chunks that overlap it; pickled
    objects are read with ``weights_only=True``."""

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        metadata: Metadata | None = None,
        is_coordinator: bool = False,
    ) -> None:
        super().set_up_planner(self.whole(state_dict), metadata, is_coordinator)

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        assert self.metadata is not None
        items = list(plan.items)
        for key, piece in self.pieces.items():
            chunk = ChunkStorageMetadata(
                offsets=torch.Size([piece.offset]), sizes=self.all_entries[key].shape
            )
            saved = self.metadata.state_dict_metadata[key]
            assert isinstance(saved, TensorStorageMetadata)  # checked by _check_against
            items += create_read_items_for_chunk_list(key, saved, [chunk])
        return LoadPlan(items, planner_data=plan.planner_data)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        if index.fqn in self.pieces:
            tensor: torch.Tensor = self.all_entries[index.fqn]
            return tensor
        return super().lookup_tensor(index)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.all_entries[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _check_against(
    folder: Path, entries: dict[str, Any], pieces: dict[str, Piece], saved: dict[str, Any]
) -> None:
    """Every entry asked for is in the checkpoint, with the right size and dtype."""
    missing = sorted(key for key in entries if key not in saved)
    if missing:
        raise CheckpointError(
            f"checkpoint {str(folder)!r} lacks {len(missing)} entries: {', '.join(missing[:5])}"
        )
    for key, value in entries.items():
        if not isinstance(value, torch.Tensor):
            continue
        meta = saved[key]
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointError(f"checkpoint entry {key!r} is not a tensor")
        size = torch.Size([pieces[key].global_numel]) if key in pieces else value.shape
        if meta.size != size or meta.properties.dtype != value.dtype:
            raise CheckpointError(
                f"checkpoint entry {key!r} is {meta.properties.dtype} of size "
                f"{tuple(meta.size)}; the model expects {value.dtype} of size {tuple(size)}"
            )


class _Ranks:
    """The ranks of ``group`` (None or no initialised process group: this process alone)."""

    def __init__(self, group: Any) -> None:
        self.alone = group is None or not dist.is_initialized()
        self.group = group
        self.rank = 0 if self.alone else dist.get_rank(group)
        self.size = 1 if self.alone else dist.get_world_size(group)

    def broadcast(self, value: Any) -> Any:
        if self.alone:
            return value
        box = [value]
        dist.broadcast_object_list(box, group_src=0, group=self.group)
        return box[0]

    def gather(self, value: Any) -> list[Any]:
        if self.alone:
            return [value]
        gathered: list[Any] = [None] * self.size
        dist.all_gather_object(gathered, value, group=self.group)
        return gathered

    def barrier(self) -> None:
        if not self.alone:
            dist.barrier(group=self.group)


def _own_files(data: Path, rank: int) -> list[str]:
    """The files rank ``rank`` wrote (the coordinator also writes the metadata)."""
    own = sorted(path.name for path in data.glob(f"__{rank}_*"))
    return [*own, ".metadata"] if rank == 0 else own


def _describe(path: Path) -> dict[str, int]:
    crc = 0
    with open(path, "rb") as file:
        while block := file.read(_READ_BYTES):
            crc = zlib.crc32(block, crc)
        os.fsync(file.fileno())
    return {"bytes": path.stat().st_size, "crc32": crc}


_METADATA = ".metadata"  # torch.distributed.checkpoint's index of a data folder (a pickle)
_DESCRIBED = {"bytes", "crc32"}  # what the manifest says of each file


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles only what torch.distributed.checkpoint's metadata is made of (its metadata
    classes, tensor sizes, dtypes, layouts, paths): a tampered ``.metadata`` that names anything
    else (``os.system``, say) raises instead of running it. torch reads it with a plain
    ``pickle.load``, which ``weights_only`` does not cover."""

    _CLASSES: frozenset[tuple[str, str]] = frozenset(
        {
            ("torch", "Size"),
            ("torch.serialization", "_get_layout"),  # a layout by name
            ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
            ("pathlib", "PosixPath"),
            ("pathlib", "PurePosixPath"),
            ("pathlib", "WindowsPath"),
            ("pathlib", "PureWindowsPath"),
            # What other torch releases' metadata may use to rebuild the classes above.
            ("collections", "OrderedDict"),
            ("copyreg", "_reconstructor"),
            ("builtins", "object"),
        }
    )

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            raise pickle.UnpicklingError(f"{module}.{name} is not checkpoint metadata")
        return found

    def _allowed(self, module: str, name: str) -> bool:
        if (module, name) in self._CLASSES:
            return True
        if module == "torch":
            value = getattr(torch, name, None)
            return isinstance(value, (torch.dtype, torch.layout, torch.memory_format))
        if module == "torch.distributed.checkpoint.metadata":
            import torch.distributed.checkpoint.metadata as metadata

            value = getattr(metadata, name, None)
            # Its dataclasses and enums, nothing callable beyond building them.
            return isinstance(value, type) and (
                hasattr(value, "__dataclass_fields__") or issubclass(value, enum.Enum)
            )
        return False


class _SafeReader(FileSystemReader):
    """torch.distributed.checkpoint's reader of a data folder, its ``.metadata`` unpickled by
    :class:`_MetadataUnpickler`; one that does not unpickle is a :class:`CheckpointError`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = pathlib.Path(self.path) / _METADATA
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file).load()
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"it holds a {type(metadata).__name__}")
        except FileNotFoundError as error:
            raise CheckpointError(f"checkpoint file {str(path)!r} is missing") from error
        except Exception as error:
            raise CheckpointError(f"checkpoint file {str(path)!r} is corrupt: {error}") from error
        storage = getattr(metadata, "storage_meta", None)
        if storage is None:
            storage = metadata.storage_meta = StorageMeta()
        storage.load_id = self.load_id
        return metadata


def _check_file(data: Path, files: dict[str, dict[str, int]]) -> Any:
    def check(name: str) -> str | None:
        path = data / name
        if not path.is_file():
            return f"checkpoint file {str(path)!r} is missing"
        found = _describe(path)
        if found != files[name]:
            return (
                f"checkpoint file {str(path)!r} is corrupt or truncated: {found['bytes']} bytes "
                f"with CRC-32 {found['crc32']:#010x}, expected {files[name]['bytes']} bytes "
                f"with {files[name]['crc32']:#010x}"
            )
        return None

    return check


def _write_manifest(folder: Path, body: dict[str, Any]) -> None:
    """Replace the manifest atomically: a temporary file, fsync, rename, fsync of the folder."""
    text = json.dumps(
        {"manifest": body, "crc32": zlib.crc32(json.dumps(body, sort_keys=True).encode())},
        indent=1,
    ).encode()
    temporary = folder / f".{MANIFEST}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    try:
        with open(temporary, "xb") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, folder / MANIFEST)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(folder)


def _remove_crashed_temporaries(folder: Path) -> None:
    for stale in folder.glob(f".{MANIFEST}.*.tmp"):
        stale.unlink(missing_ok=True)


def _fsync_folder(folder: Path) -> None:
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextmanager
def _quiet(what: str) -> Iterator[None]:
    """Around torch.distributed.checkpoint: its failures (a ``BaseException`` holding every
    rank's error) become a ``CheckpointError`` caused by the first one, and its warning
    that a save or load without a process group runs in this process alone (what is meant
    here) is silenced."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            yield
        except CheckpointException as failed:
            rank, (error, _) = min(failed.failures.items())
            raise CheckpointError(
                f"{what} failed on rank {rank}: {type(error).__name__}: {error}"
            ) from error


__all__ = [
    "CheckpointError",
    "Piece",
    "load_folder",
    "read_manifest",
    "read_saved_entries",
    "save_folder",
]
