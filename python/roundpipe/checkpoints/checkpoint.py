"""Checkpoint files that survive a crash: atomic, checksummed, loadable without running code.

:func:`save_checkpoint` writes the model's, optimizer's and scaler's state dicts (and any
``extra`` object) into one file and :func:`load_checkpoint` restores them, after checking every
byte. A save never damages the checkpoint already at the path: it writes a temporary file in
the same folder, flushes and fsyncs it, renames it over the path (atomic on POSIX) and fsyncs the
folder, so a crash at any moment leaves either the old checkpoint or the new one.

File format (version 1), one file::

    payload     the bytes of torch.save({"model": ..., "optimizer": ..., "scaler": ..., "extra": x})
    manifest    UTF-8 JSON: format, format_version, roundpipe_version, torch_version, entries,
                payload bytes and the CRC-32 of every CHUNK_BYTES-long chunk of the payload
    trailer     24 bytes: manifest length (u64 LE), CRC-32 of the manifest (u32 LE), 4 zero
                bytes, magic b"RPCKPT01"

The payload starts at offset 0 and PyTorch's zip reader ignores what follows the archive, so
``torch.load(path, weights_only=True)`` also reads the file, unverified. Each chunk's checksum
is computed as soon as torch.save has written it, while later chunks are still being written,
and all are verified in parallel on load; a mismatch names the file and the byte range. A
sharded checkpoint (one file per rank, for ``torch.distributed``) extends this as a folder of
such files, each with its own manifest, plus a top-level manifest of the shards (names, sizes,
manifest checksums) written last with the same atomic write, so the folder is complete exactly
when that manifest exists.
"""

from __future__ import annotations

import errno
import functools
import glob
import io
import json
import os
import socket
import struct
import threading
import uuid
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn

from roundpipe._native import BUILD_INFO
from roundpipe.checkpoints.sharded import (
    check_parts,
    checks_on_every_rank,
    drain_for_load,
    is_sharded,
    load_sharded,
    save_sharded,
)
from roundpipe.checkpoints.sharded_files import CheckpointError

FORMAT = "roundpipe.checkpoints.checkpoint"
FORMAT_VERSION = 1
CHUNK_BYTES = 64 << 20
MAGIC = b"RPCKPT01"
_READ_BYTES = 8 << 20
_TRAILER = struct.Struct("<QII8s")
_ENTRIES = ("model", "optimizer", "scaler", "extra")


def save_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    extra: Any = None,
) -> None:
    """Write a checkpoint of ``model`` (and ``optimizer``, ``scaler``, ``extra``) to ``path``.

    ``model.state_dict()`` is taken first: for a ``RoundPipe`` it waits for pending transfers
    and the asynchronous step in flight (without writing that step back, so saving does not
    change the training; an ``AutoRoundPipe`` drains), so the optimizer's and scaler's states
    read afterwards belong to the same step. The write is atomic (a temporary file in the same
    folder, fsync, rename over ``path``, fsync of the folder): a crash leaves the previous
    checkpoint intact. Every chunk of the file is checksummed for :func:`load_checkpoint`.

    A data-parallel model (``data_parallel_group`` of several ranks) saves a checkpoint
    *folder* instead, and every rank of its group must call this with its own replica and
    optimizer: each writes its shard of the optimizer, keyed by parameter names, through
    ``torch.distributed.checkpoint``, and a manifest naming the files and their checksums is
    replaced atomically once all are on disk (``roundpipe.checkpoints.sharded``).

    Args:
        path: the checkpoint file (its folder must exist), or for a data-parallel model the
            checkpoint folder (created if missing; its parent must exist).
        model: any ``nn.Module``, ``RoundPipe`` and ``AutoRoundPipe`` included.
        optimizer: a ``torch.optim.Optimizer`` (``roundpipe.optim.Adam`` included), or None.
        scaler: a ``roundpipe.GradScaler`` or ``torch.amp.GradScaler``, or None.
        extra: any object ``torch.load(..., weights_only=True)`` accepts (numbers, strings,
            tensors, dicts, lists, tuples: epoch, step, RNG states), or a callable returning
            one, called after the model's state was taken: for state that ``step_fn`` changes
            while an asynchronous step is in flight (an LR scheduler stepped in ``step_fn``),
            which read before the call would miss that step.

    Raises:
        TypeError / ValueError: an invalid argument, before anything is drained or written.
        FileNotFoundError: the folder of ``path`` does not exist.
    """
    sharded = is_sharded(model)
    with checks_on_every_rank(model, "save_checkpoint"):
        target = _checked_path(path)
        _check_parts(model, optimizer, scaler)
        if not target.parent.is_dir():
            raise FileNotFoundError(f"path: the folder {str(target.parent)!r} does not exist")
        if sharded and target.is_file():
            raise ValueError(
                f"path {str(target)!r} is a file; a data-parallel model saves a checkpoint folder"
            )
        if not sharded and target.is_dir():
            raise ValueError(f"path {str(target)!r} is a folder; pass a file name")
        if not callable(extra):
            _check_weights_only(extra)
    if sharded:
        save_sharded(target, model, optimizer, scaler, lambda: _resolved(extra))
        return

    # Waits for a RoundPipe's step first.
    state: dict[str, Any] = {"model": _one_dtype_per_storage(model.state_dict())}
    if optimizer is not None:
        state["optimizer"] = optimizer.state_dict()
    if scaler is not None:
        state["scaler"] = scaler.state_dict()
    state["extra"] = _resolved(extra)

    _remove_stale_temporaries(target)
    temporary = target.with_name(
        f".{target.name}.{socket.gethostname()}.{os.getpid()}.{uuid.uuid4().hex[:12]}.tmp"
    )
    try:
        with open(temporary, "x+b") as file:
            with ThreadPoolExecutor(_threads()) as pool, ThreadPoolExecutor(1) as follower:
                # Checksum each chunk as soon as torch.save has written it (from the page
                # cache), while later chunks are still being written and flushed.
                written = threading.Event()
                following = follower.submit(_follow, file.fileno(), written, pool)
                try:
                    # To a path: torch's native writer is far faster than a Python file object.
                    with _record_crcs_off():
                        torch.save(state, temporary)
                finally:
                    written.set()
                crcs = following.result()
                if os.stat(temporary).st_ino != os.fstat(file.fileno()).st_ino:
                    raise RuntimeError("torch.save replaced the file instead of writing it")
                os.fsync(file.fileno())
                chunks = [crc.result() for crc in crcs]
            payload = os.fstat(file.fileno()).st_size
            manifest = json.dumps(
                {
                    "format": FORMAT,
                    "format_version": FORMAT_VERSION,
                    "roundpipe_version": str(BUILD_INFO["version"]),
                    "torch_version": torch.__version__,
                    "entries": [name for name in _ENTRIES if name in state],
                    "payload_bytes": payload,
                    "checksum": "crc32",
                    "chunk_bytes": CHUNK_BYTES,
                    "chunks": chunks,
                }
            ).encode()
            file.seek(payload)
            file.write(manifest)
            file.write(_TRAILER.pack(len(manifest), zlib.crc32(manifest), 0, MAGIC))
            file.flush()
            os.fsync(file.fileno())
        _check_loadable(temporary)
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    _fsync_folder(target.parent)


def load_checkpoint(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scaler: Any = None,
    *,
    strict: bool = True,
) -> Any:
    """Restore a checkpoint written by :func:`save_checkpoint` and return its ``extra``.

    Every byte is checked against the file's checksums before anything is deserialised; the
    payload is read with ``torch.load(..., weights_only=True)``, so a checkpoint cannot run
    code. Then every part asked for is checked against what it goes into: the model's entries
    (what ``model.load_state_dict`` would refuse), the optimizer's parameter groups (and for
    Adam its per-parameter state) and the scaler's state. Only then is the asynchronous step in
    flight finished (its weights written back) and the model loaded (weights, optimizer copies,
    pending gradients), then the optimizer, then the scaler. So nothing is changed, not even the
    step in flight, when the file is bad, lacks a part that was asked for or does not fit.
    Optimizer or scaler state in the file is ignored when the argument is None.

    A checkpoint folder (saved by a data-parallel model) loads at any number of ranks (every
    rank of the model's group calls this), or into a RoundPipe without data parallelism: each
    rank reads its own shard of the optimizer from whatever ranks wrote it.

    Args:
        path: the checkpoint file, or folder.
        model: the model to load into (the same architecture and wrapping as when saved).
        optimizer: an optimizer built on ``model.optim_parameters()`` (or None).
        scaler: a ``roundpipe.GradScaler`` or ``torch.amp.GradScaler`` (or None).
        strict: passed to ``model.load_state_dict``.

    Raises:
        TypeError / ValueError: an invalid argument, before the file is opened.
        FileNotFoundError: no file at ``path``.
        CheckpointError: the file is corrupt or truncated, is not a RoundPipe checkpoint, or
            lacks the optimizer or scaler state asked for (another optimizer's state for an
            Adam, a disabled scaler's ``{}`` for an enabled one).
        RuntimeError: the model's entries do not fit (``model.load_state_dict``'s error).
    """
    with checks_on_every_rank(model, "load_checkpoint"):
        target = _checked_path(path)
        _check_parts(model, optimizer, scaler)
        if not isinstance(strict, bool):
            raise TypeError(f"strict must be a bool, got {type(strict).__name__}")
        if not target.exists():
            raise FileNotFoundError(f"no checkpoint file or folder at {str(target)!r}")
        if not target.is_dir() and is_sharded(model):
            raise ValueError(
                f"path {str(target)!r} is a checkpoint file of one process; a data-parallel "
                "model loads checkpoint folders saved by data-parallel ranks (at any number of "
                "them). To start from this file, load torch.load(path, weights_only=True)"
                "['model'] with model.load_state_dict (weights and optimizer copies; the "
                "optimizer starts afresh)"
            )
    if target.is_dir():
        return load_sharded(target, model, optimizer, scaler, strict)
    if not target.is_file():
        raise FileNotFoundError(f"no checkpoint file at {str(target)!r}")

    # One open file serves the check and the load, so a save replacing the path meanwhile
    # cannot slip an unchecked file in between.
    with open(target, "rb") as file:
        manifest = _verified_manifest(file, target)
        file.seek(0)
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as error:
            raise CheckpointError(
                f"checkpoint {str(target)!r} cannot be loaded with weights_only=True (a "
                f"checkpoint must not be able to run code): {error}"
            ) from error
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {str(target)!r} holds a {type(state).__name__}")
    wanted = {"model": model, "optimizer": optimizer, "scaler": scaler}
    missing = [name for name, part in wanted.items() if part is not None and name not in state]
    if missing:
        raise CheckpointError(
            f"checkpoint {str(target)!r} holds no {' or '.join(missing)} state "
            f"(it holds: {', '.join(manifest['entries'])})"
        )
    # Everything is checked before the step in flight is drained: draining writes its weights
    # back, which changes the training, so a load that fails must not have done it.
    check_parts(
        f"checkpoint {str(target)!r}",
        model,
        state["model"],
        strict,
        optimizer,
        state.get("optimizer"),
        scaler,
        state.get("scaler"),
    )
    # The step in flight ends first: it would change the optimizer state being replaced.
    drain_for_load(model)
    model.load_state_dict(state["model"], strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])
    if scaler is not None:
        scaler.load_state_dict(state["scaler"])
    return state.get("extra")


def _record_crcs_off() -> AbstractContextManager[None]:
    """``torch.save``'s CRC-32 of each zip record switched off while the block runs, for this
    thread only; where torch cannot do that for one thread, left on.

    Our chunk checksums cover every byte, so torch's own (a second pass, never checked by
    ``torch.load``) is wasted work. ``torch.serialization.set_crc32_options`` writes torch's
    serialization config, whose ``patch`` makes a temporary override. torch 2.13 keeps such
    overrides per thread (context variables), so a ``torch.save`` of another thread meanwhile
    still writes its CRCs, and overlapping saves cannot leave the setting changed; torch 2.11's
    are process-wide, and there the CRCs stay on rather than change another thread's setting."""
    if not _config_overrides_per_thread():
        return nullcontext()
    from torch.utils.serialization import config

    # `patch` is installed on the config module at import (install_config_module).
    patched: AbstractContextManager[None] = config.patch(  # type: ignore[attr-defined]
        {"save.compute_crc32": False}
    )
    return patched


@functools.cache
def _config_overrides_per_thread() -> bool:
    """Whether an override of torch's serialization config (``config.patch``) holds for the
    calling thread only. Checked once by trying it: another thread reads the setting while this
    one overrides it (for that instant, on a torch whose overrides are process-wide, another
    thread's ``torch.save`` may skip its record CRCs, which ``torch.load`` does not need)."""
    from torch.utils.serialization import config

    original = bool(config.save.compute_crc32)
    seen: list[bool] = []
    with config.patch({"save.compute_crc32": not original}):  # type: ignore[attr-defined]
        reader = threading.Thread(
            target=lambda: seen.append(bool(config.save.compute_crc32)),
            name="roundpipe-config-probe",
        )
        reader.start()
        reader.join()
    return seen == [original]


def _follow(
    descriptor: int, written: threading.Event, pool: ThreadPoolExecutor
) -> list[Future[int]]:
    """While a writer appends to the file, queue the CRC-32 of each chunk once it is complete,
    and of the last, partial one once ``written`` is set. torch.save writes sequentially and
    never goes back, so a complete chunk is final."""
    crcs: list[Future[int]] = []
    offset = 0
    while True:
        finished = written.is_set()  # before the size, so that no byte can be missed
        size = os.fstat(descriptor).st_size
        while size - offset >= CHUNK_BYTES or (finished and offset < size):
            length = min(CHUNK_BYTES, size - offset)
            crcs.append(pool.submit(_crc_at, descriptor, offset, length))
            offset += length
        if finished:
            return crcs
        written.wait(0.005)


def _crc_at(descriptor: int, offset: int, length: int) -> int:
    """CRC-32 of ``length`` bytes of the file at ``offset``, read in pieces to bound memory."""
    crc = 0
    for start in range(offset, offset + length, _READ_BYTES):
        crc = zlib.crc32(
            os.pread(descriptor, min(_READ_BYTES, offset + length - start), start), crc
        )
    return crc


def _verified_manifest(file: io.BufferedReader, target: Path) -> dict[str, Any]:
    """The manifest of an open checkpoint file, after checking the trailer, the manifest and
    every payload chunk; ``CheckpointError`` naming the file otherwise."""
    name = str(target)
    size = os.fstat(file.fileno()).st_size
    if size < _TRAILER.size:
        raise CheckpointError(f"checkpoint {name!r} is truncated ({size} bytes)")
    file.seek(size - _TRAILER.size)
    length, manifest_crc, _, magic = _TRAILER.unpack(file.read(_TRAILER.size))
    if magic != MAGIC:
        file.seek(0)
        hint = (
            "; it looks like a plain torch.save file: load it with torch.load"
            if file.read(4) == b"PK\x03\x04"
            else ""
        )
        raise CheckpointError(
            f"checkpoint {name!r} is truncated, corrupt or not a RoundPipe checkpoint "
            f"(no trailer){hint}"
        )
    if length > size - _TRAILER.size:
        raise CheckpointError(f"checkpoint {name!r} is corrupt (manifest length {length})")
    file.seek(size - _TRAILER.size - length)
    raw = file.read(length)
    if zlib.crc32(raw) != manifest_crc:
        raise CheckpointError(f"checkpoint {name!r} is corrupt: its manifest fails its checksum")
    try:
        manifest: dict[str, Any] = json.loads(raw)
        if not isinstance(manifest, dict):
            raise TypeError(f"a JSON {type(manifest).__name__}, not an object")
        payload, chunk = int(manifest["payload_bytes"]), int(manifest["chunk_bytes"])
        if payload < 0 or chunk <= 0:
            raise ValueError(f"payload_bytes {payload}, chunk_bytes {chunk}")
    except (KeyError, TypeError, ValueError) as error:
        raise CheckpointError(f"checkpoint {name!r} has a malformed manifest: {error}") from error
    if manifest.get("format") != FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {name!r} has format {manifest.get('format')!r} version "
            f"{manifest.get('format_version')} (written by roundpipe "
            f"{manifest.get('roundpipe_version')}); this roundpipe reads {FORMAT!r} "
            f"version {FORMAT_VERSION}"
        )
    expected_chunks = -(-payload // chunk)
    if payload + length + _TRAILER.size != size or len(manifest["chunks"]) != expected_chunks:
        raise CheckpointError(f"checkpoint {name!r} is truncated or corrupt (size {size} bytes)")
    with ThreadPoolExecutor(_threads()) as pool:
        crcs = list(
            pool.map(
                lambda start: _crc_at(file.fileno(), start, min(chunk, payload - start)),
                range(0, payload, chunk),
            )
        )
    for index, (actual, expected) in enumerate(zip(crcs, manifest["chunks"], strict=True)):
        if actual != expected:
            start = index * chunk
            raise CheckpointError(
                f"checkpoint {name!r} is corrupt: bytes {start}..{min(start + chunk, payload)} "
                "fail their checksum"
            )
    return manifest


def _checked_path(path: Any) -> Path:
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be a str or os.PathLike, got {type(path).__name__}")
    target = Path(path)
    if not target.name:
        raise ValueError(f"path {str(path)!r} names no file")
    return target


def _check_parts(model: Any, optimizer: Any, scaler: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer or None, got {type(optimizer).__name__}"
        )
    if scaler is not None and not (
        callable(getattr(scaler, "state_dict", None))
        and callable(getattr(scaler, "load_state_dict", None))
    ):
        raise TypeError(
            "scaler must be a roundpipe.GradScaler or torch.amp.GradScaler (with state_dict and "
            f"load_state_dict) or None, got {type(scaler).__name__}"
        )


def _one_dtype_per_storage(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as ``torch.save`` can write it: a RoundPipe's parameters are views of one host
    arena, and ``torch.save`` refuses views of one storage as different dtypes (bf16 weights
    beside fp32 norms). The views of the dtype holding the most bytes of each such storage are
    kept (the storage is written once, as that dtype); the others are copied, which costs the
    minority's bytes only."""
    views: dict[int, dict[torch.dtype, int]] = {}
    for value in state.values():
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            key = value.untyped_storage().data_ptr()
            by_dtype = views.setdefault(key, {})
            by_dtype[value.dtype] = by_dtype.get(value.dtype, 0) + value.nbytes
    kept = {key: max(by_dtype, key=by_dtype.__getitem__) for key, by_dtype in views.items()}
    return {
        name: value.clone()
        if isinstance(value, torch.Tensor)
        and value.device.type == "cpu"
        and len(views[value.untyped_storage().data_ptr()]) > 1
        and value.dtype != kept[value.untyped_storage().data_ptr()]
        else value
        for name, value in state.items()
    }


def _resolved(extra: Any) -> Any:
    """``extra``, or what it returns if it is a callable (checked like an object given)."""
    if not callable(extra):
        return extra
    value = extra()
    _check_weights_only(value)
    return value


def _check_weights_only(extra: Any) -> None:
    """``ValueError`` unless ``extra`` survives ``torch.save`` and then
    ``torch.load(..., weights_only=True)`` (an object that cannot be pickled at all, such as a
    lambda, a generator or a lock, included)."""
    buffer = io.BytesIO()
    try:
        torch.save(extra, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as error:
        raise ValueError(
            "extra must be loadable with torch.load(..., weights_only=True) (numbers, strings, "
            "tensors, dicts, lists, tuples; convert numpy arrays with torch.from_numpy): "
            f"{error}"
        ) from error


def _check_loadable(file: Path) -> None:
    """``ValueError`` unless the written file loads with ``weights_only=True``; memory-mapped,
    so only the pickled structure is read, not the tensors."""
    try:
        torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as error:
        raise ValueError(
            "the model's, optimizer's or scaler's state holds objects that "
            f"torch.load(..., weights_only=True) refuses, so it could not be loaded: {error}"
        ) from error


def _remove_stale_temporaries(target: Path) -> None:
    """Delete temporary files that saves to ``target`` from dead processes of this host left."""
    host = socket.gethostname()
    for stale in target.parent.glob(f".{glob.escape(target.name)}.{glob.escape(host)}.*.tmp"):
        pid = stale.name[len(f".{target.name}.{host}.") :].split(".")[0]
        if pid.isdigit() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fsync_folder(folder: Path) -> None:
    """Make the rename durable: the folder's entry, not only the file's bytes."""
    descriptor = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(descriptor)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP):  # filesystems without folder fsync
            raise
    finally:
        os.close(descriptor)


def _threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]
