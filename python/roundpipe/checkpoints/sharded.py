"""Checkpoints of data-parallel models: each rank writes its own shard of the optimizer, keyed by
parameter names, into one checkpoint folder (``checkpoints.sharded_files``), and a load at another
number of ranks reads each rank's new shard from whatever ranks wrote it.

What a folder holds, by entry name:

* ``model/<key>``: the model's ``state_dict()`` (weights, buffers, RoundPipe's own entries), whole
  tensors that every rank holds alike, written once, except the optimizer copies
  (``model/_roundpipe.optim.<name>``): each rank's pieces of the flattened parameter. (Gradients
  accumulated but not yet stepped differ per rank: a save refuses them.)
* ``optimizer/state/<name>/<key>``: the optimizer's per-element state as pieces, and its other
  per-parameter state (``step``) whole; ``optimizer/param_groups``: the hyperparameters. 8-bit
  moments (``roundpipe.optim.Adam(state_dtype=torch.int8)``) are saved decoded, as float32 values:
  their block scales belong to the saving rank's pieces, while values can be cut anywhere. The
  loading optimizer encodes them again (the same bits when the pieces are the same).
* ``scaler`` and ``extra``: objects, read back with ``weights_only=True``.
"""

from __future__ import annotations

import contextlib
import hashlib
import pickle
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from roundpipe.checkpoints.sharded_files import (
    CheckpointError,
    Piece,
    load_folder,
    read_saved_entries,
    save_folder,
)
from roundpipe.distributed import DataParallelShard, ShardPiece
from roundpipe.optim.adam import Adam
from roundpipe.optim.adam_state import elementwise_state
from roundpipe.optim.grad_scaler import GradScaler
from roundpipe.optim.step_thread import drain_optimizer_thread, wait_optimizer_thread
from roundpipe.state_dict import check_state_dict
from roundpipe.torch_internals import has_optimizer_load_hooks, tree_flatten

# The prefix of the optimizer copies' entries in a RoundPipe's state_dict().
_COPY = "_roundpipe.optim."
# A RoundPipe's state_dict() entry of gradients accumulated but not stepped.
_UNSTEPPED = "model/_roundpipe.grads"


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` is a data-parallel RoundPipe of more than one rank."""
    shard = _shard_of(model)
    return shard is not None and shard.world_size > 1


@contextlib.contextmanager
def checks_on_every_rank(model: nn.Module, action: str) -> Iterator[None]:
    """Around a collective checkpoint call's argument checks (``action``: ``"save_checkpoint"``
    or ``"load_checkpoint"``): when they raise on one rank of a data-parallel model (a folder
    only that rank cannot see, an optimizer only it got wrong), that rank tells the others at
    the agreement they are waiting in, so that every rank raises at once, this one its own
    error, instead of the others waiting for it until the group times out."""
    try:
        yield
    except Exception:
        shard = _shard_of(model)
        if shard is not None and shard.world_size > 1 and shard.agree is not None:
            with contextlib.suppress(ValueError):
                shard.agree(action, refused=True)
        raise


def save_sharded(
    folder: Path, model: nn.Module, optimizer: Any, scaler: Any, extra: Callable[[], Any]
) -> None:
    """Every rank of ``model``'s data-parallel group calls this with its own model replica and
    optimizer; ``extra()`` is taken after the model's state. See ``roundpipe.save_checkpoint``.

    Each rank gathers what it writes on its own first; the ranks then compare notes once, so
    that one rank's failure there (the user's ``extra`` raising, an optimizer on other
    parameters) or its different ``extra`` raises on every rank before anything is written,
    instead of leaving the others waiting in a collective."""
    shard = _shard_of(model)
    assert shard is not None
    if shard.agree is not None:
        shard.agree("save_checkpoint")
    failure: BaseException | None = None
    entries: dict[str, Any] = {}
    pieces: dict[str, Piece] = {}
    try:
        entries, pieces = _save_entries(model, optimizer, scaler, extra, shard)
        note = ("grads" if _UNSTEPPED in entries else "ok", _fingerprint(entries["extra"]))
    except Exception as error:
        failure, note = error, ("failed", f"{type(error).__name__}: {error}")
    notes: list[Any] = [None] * shard.world_size
    dist.all_gather_object(notes, note, group=shard.group)
    _refuse_notes(notes, failure)
    save_folder(folder, entries, pieces, shard.group)


def _save_entries(
    model: nn.Module,
    optimizer: Any,
    scaler: Any,
    extra: Callable[[], Any],
    shard: DataParallelShard,
) -> tuple[dict[str, Any], dict[str, Piece]]:
    """This rank's entries of the checkpoint and which of them are pieces."""
    by_copy = {id(piece.copy): piece for piece in shard.pieces}
    params = _optimizer_params(optimizer, by_copy) if optimizer is not None else []
    entries: dict[str, Any] = {}
    pieces: dict[str, Piece] = {}
    by_name = {piece.name: piece for piece in shard.pieces}
    for key, value in model.state_dict().items():
        piece = by_name.get(key.removeprefix(_COPY))
        if key.startswith(_COPY) and piece is not None:
            _add_piece(entries, pieces, f"model/{key}", piece, value)
        else:
            entries[f"model/{key}"] = value
    if optimizer is not None:
        state = optimizer.state_dict()
        for index, param in enumerate(params):
            piece = by_copy[id(param)]
            for key, value in elementwise_state(state["state"].get(index, {})).items():
                name = f"optimizer/state/{piece.name}/{key}"
                if (
                    isinstance(value, torch.Tensor)
                    and value.numel() == _numel(piece)
                    and value.dim()
                ):
                    _add_piece(entries, pieces, name, piece, value)
                else:
                    entries[name] = value
        entries["optimizer/param_groups"] = [
            {key: value for key, value in group.items() if key != "params"}
            for group in state["param_groups"]
        ]
    if scaler is not None:
        entries["scaler"] = scaler.state_dict()
    entries["extra"] = extra()
    return entries, pieces


def _refuse_notes(notes: list[tuple[str, str]], failure: BaseException | None) -> None:
    """Raise on every rank, before anything is written, when any rank's note (from
    :func:`save_sharded`) says it failed, holds gradients accumulated but not stepped, or has
    another ``extra`` than rank 0's. A rank that failed raises its own error."""
    for rank, (kind, detail) in enumerate(notes):
        if kind == "failed":
            if failure is not None:
                raise failure
            raise RuntimeError(
                f"save_checkpoint: rank {rank} failed before writing ({detail}); every rank "
                "raises, and nothing was written"
            )
    if any(kind == "grads" for kind, _ in notes):
        raise ValueError(
            "model: a data-parallel model cannot be saved with gradients accumulated but not "
            "stepped (they differ per rank); save right after step()"
        )
    for rank, (_, extra) in enumerate(notes):
        if extra != notes[0][1]:
            raise ValueError(
                f"save_checkpoint: extra differs on rank {rank} from rank 0's, but a "
                "data-parallel checkpoint holds it once: give every rank the same extra (state "
                "of each rank's own, such as its RNG state, belongs in files of your own). "
                "Nothing was written"
            )


def _fingerprint(value: Any) -> str:
    """A digest of ``value``'s structure and contents (tensors by dtype, shape and values);
    mappings by their items in key order, so equal dicts built in another order match."""
    leaves, spec = tree_flatten(_sorted_mappings(value))
    digest = hashlib.sha256(str(spec).encode())
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            tensor = leaf.detach().cpu()
            digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
            digest.update(pickle.dumps(tensor.reshape(-1).tolist()))
        else:
            digest.update(repr(leaf).encode())
    return digest.hexdigest()


def _sorted_mappings(value: Any) -> Any:
    """``value`` with every mapping replaced by its ``(repr(key), value)`` pairs sorted."""
    if isinstance(value, Mapping):
        items = ((repr(key), _sorted_mappings(item)) for key, item in value.items())
        return sorted(items, key=lambda pair: pair[0])
    if isinstance(value, list):
        return [_sorted_mappings(item) for item in value]
    if type(value) is tuple:
        return tuple(_sorted_mappings(item) for item in value)
    return value


def load_sharded(folder: Path, model: nn.Module, optimizer: Any, scaler: Any, strict: bool) -> Any:
    """Restore a folder written by :func:`save_sharded` (at any number of ranks) into this
    rank's ``model`` (a data-parallel RoundPipe, or a RoundPipe alone) and ``optimizer``;
    returns ``extra``. Nothing is changed when a file is bad, an entry is missing or the state
    does not fit: all is checked before the step in flight is drained and anything loaded."""
    shard = _shard_of(model)
    if shard is None:
        raise TypeError(
            "a sharded checkpoint folder (saved by data-parallel ranks) loads into a RoundPipe, "
            f"data-parallel or alone, got {type(model).__name__}"
        )
    # Each rank reads what it will load on its own first; one rank's failure there raises on
    # every rank (checks_on_every_rank), before anything is loaded.
    with checks_on_every_rank(model, "load_checkpoint"):
        entries, pieces = _load_entries(folder, shard, optimizer, scaler)
    if shard.agree is not None:
        shard.agree("load_checkpoint")
    # Ends the collectives in flight; the step is written back only once the load is known to
    # succeed (drain_for_load).
    wait_for_load(model)
    load_folder(folder, entries, pieces, shard.group if shard.world_size > 1 else None)

    where = f"checkpoint {str(folder)!r}"
    # What each rank loads must fit on every rank before any loads it: a rank whose optimizer
    # does not fit would otherwise stay behind while the others load.
    with checks_on_every_rank(model, "load_checkpoint"):
        model_state, optimizer_state = _loaded_state(entries, shard, optimizer, where)
        check_parts(
            where,
            model,
            model_state,
            strict,
            optimizer,
            optimizer_state,
            scaler,
            entries.get("scaler"),
        )
    if shard.agree is not None:
        shard.agree("load_checkpoint")
    drain_for_load(model)
    model.load_state_dict(model_state, strict=strict)
    if optimizer is not None:
        optimizer.load_state_dict(optimizer_state)
    if scaler is not None:
        scaler.load_state_dict(entries["scaler"])
    return entries["extra"]


def _load_entries(
    folder: Path, shard: DataParallelShard, optimizer: Any, scaler: Any
) -> tuple[dict[str, Any], dict[str, Piece]]:
    """Empty entries of what this rank loads from ``folder`` (its own pieces, every whole
    entry) and which of them are pieces."""
    saved = read_saved_entries(folder)
    wanted = {"optimizer": optimizer, "scaler": scaler}
    missing = [
        part
        for part, given in wanted.items()
        if given is not None and not any(key.startswith(part) for key in saved)
    ]
    if missing:
        raise CheckpointError(f"checkpoint {str(folder)!r} holds no {' or '.join(missing)} state")

    entries: dict[str, Any] = {}
    pieces: dict[str, Piece] = {}
    by_name = {piece.name: piece for piece in shard.pieces}
    for key, (size, dtype) in saved.items():
        if not key.startswith("model/"):
            continue
        copy_of = key.removeprefix(f"model/{_COPY}")
        if key.startswith(f"model/{_COPY}"):
            if copy_of in by_name:  # other ranks' pieces are not this rank's to load
                piece = by_name[copy_of]
                _add_piece(entries, pieces, key, piece, torch.empty(_numel(piece), dtype=dtype))
        else:
            entries[key] = torch.empty(size, dtype=dtype) if size is not None else None
    by_copy = {id(piece.copy): piece for piece in shard.pieces}
    params = _optimizer_params(optimizer, by_copy) if optimizer is not None else []
    if optimizer is not None:
        for param in params:
            piece = by_copy[id(param)]
            prefix = f"optimizer/state/{piece.name}/"
            for key, (size, dtype) in saved.items():
                if not key.startswith(prefix):
                    continue
                if size is not None and size == torch.Size([piece.shape.numel()]) and len(size):
                    empty = torch.empty(_numel(piece), dtype=dtype)
                    _add_piece(entries, pieces, key, piece, empty)
                else:
                    entries[key] = torch.empty(size, dtype=dtype) if size is not None else None
        entries["optimizer/param_groups"] = None
    if scaler is not None:
        entries["scaler"] = None
    entries["extra"] = None
    return entries, pieces


def _loaded_state(
    entries: dict[str, Any], shard: DataParallelShard, optimizer: Any, where: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The model's and the optimizer's state dicts from the loaded ``entries``."""
    by_name = {piece.name: piece for piece in shard.pieces}
    by_copy = {id(piece.copy): piece for piece in shard.pieces}
    params = _optimizer_params(optimizer, by_copy) if optimizer is not None else []
    model_state = {
        key[len("model/") :]: value for key, value in entries.items() if key.startswith("model/")
    }
    for name, piece in by_name.items():
        if f"{_COPY}{name}" in model_state:
            model_state[f"{_COPY}{name}"] = model_state[f"{_COPY}{name}"].view(piece.copy.shape)
    groups: Any = entries.get("optimizer/param_groups")
    optimizer_state: dict[str, Any] = {}
    if optimizer is not None:
        check_optimizer_groups(optimizer, groups, where, sizes=False)
        state: dict[int, dict[str, Any]] = {}
        for index, param in enumerate(params):
            piece = by_copy[id(param)]
            prefix = f"optimizer/state/{piece.name}/"
            own = {
                key[len(prefix) :]: _shaped(value, piece)
                for key, value in entries.items()
                if key.startswith(prefix)
            }
            if own:
                state[index] = own
        optimizer_state = {
            "state": state,
            "param_groups": [
                {**saved_group, "params": list(range(first, first + len(group["params"])))}
                for saved_group, group, first in zip(
                    groups, optimizer.param_groups, _firsts(optimizer), strict=True
                )
            ],
        }
    return model_state, optimizer_state


def check_parts(
    where: str,
    model: nn.Module,
    model_state: Any,
    strict: bool,
    optimizer: Any,
    optimizer_state: Any,
    scaler: Any,
    scaler_state: Any,
) -> None:
    """Raise, before anything is drained or loaded, what loading ``model_state`` (with
    ``strict``), ``optimizer_state`` and ``scaler_state`` would raise: the model's own
    ``load_state_dict`` error, or ``CheckpointError`` for optimizer or scaler state that the
    checkpoint lacks or that does not fit (``optimizer``/``scaler`` None: not checked)."""
    check_state_dict(model, model_state, strict)
    if optimizer is not None:
        check_optimizer_state(optimizer, optimizer_state, where)
    if scaler is not None:
        check_scaler_state(scaler, scaler_state, where)


def drain_for_load(model: nn.Module) -> None:
    """Finish the asynchronous step in flight (its weights written back) and the queued
    optimizer jobs: a load replaces what they would change. Only once the load is known to
    succeed: draining changes the training (the next iteration gets fresh weights)."""
    drain = getattr(model, "drain", None)
    if callable(drain):
        drain()
    drain_optimizer_thread()


def wait_for_load(model: nn.Module) -> None:
    """Wait for the step in flight and the queued optimizer jobs without writing the step back
    or settling anything (as a save does): with data parallelism their collectives must not
    interleave with those of a sharded load, which may still fail."""
    wait = getattr(model, "wait_for_step", None)
    if callable(wait):
        wait()
    wait_optimizer_thread()


# What a parameter's non-empty state holds for torch's Adam and AdamW and roundpipe.optim.Adam.
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")


def check_optimizer_state(optimizer: Any, saved: Any, where: str) -> None:
    """``CheckpointError`` unless ``optimizer.load_state_dict(saved)`` can take ``saved``: its
    parameter groups (:func:`check_optimizer_groups`) and, for Adam (torch's, AdamW, ours),
    every parameter's state, which must be Adam's (another optimizer's, such as SGD's momentum,
    would fail at the load or at the first step)."""
    if not isinstance(saved, Mapping) or not isinstance(saved.get("state"), Mapping):
        raise CheckpointError(
            f"{where} holds no optimizer state dict (with 'state' and 'param_groups'), got "
            f"{type(saved).__name__}"
        )
    check_optimizer_groups(optimizer, saved.get("param_groups"), where)
    if not isinstance(optimizer, (torch.optim.Adam, Adam)) or has_optimizer_load_hooks(optimizer):
        return  # a load pre-hook may convert the state
    for group in saved["param_groups"]:
        keys = _ADAM_STATE + (("max_exp_avg_sq",) if group.get("amsgrad") else ())
        for index in group["params"]:
            entry = saved["state"].get(index)
            if not entry:
                continue  # a parameter not stepped yet
            lacking = [key for key in keys if key not in entry]
            if lacking:
                raise CheckpointError(
                    f"{where}: the optimizer state of parameter {index} has no "
                    f"{', '.join(lacking)} (it holds {', '.join(map(str, entry))}): not the "
                    f"state of {type(optimizer).__name__}"
                )


# What torch.amp.GradScaler.load_state_dict reads.
_TORCH_SCALER_STATE = (
    "scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "_growth_tracker",
)


def check_scaler_state(scaler: Any, saved: Any, where: str) -> None:
    """``CheckpointError`` unless ``scaler.load_state_dict(saved)`` can take ``saved``: an enabled
    scaler needs the state of an enabled one (a disabled scaler saves ``{}``)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    if callable(is_enabled) and not is_enabled():
        return  # a disabled scaler ignores the state, as torch's does
    if isinstance(saved, Mapping) and not saved:
        raise CheckpointError(
            f"{where} holds no scaler state: it was saved with a disabled GradScaler "
            "(enabled=False); load it with scaler=None or a disabled scaler"
        )
    if not isinstance(saved, Mapping):
        raise CheckpointError(f"{where} holds no scaler state dict, got {type(saved).__name__}")
    if isinstance(scaler, GradScaler):
        try:
            scaler.check_state_dict(saved)
        except (KeyError, TypeError, ValueError, RuntimeError) as error:
            raise CheckpointError(
                f"{where} holds a scaler state that cannot be loaded: {error!r}"
            ) from error
        return
    if isinstance(scaler, torch.amp.GradScaler):
        lacking = [key for key in _TORCH_SCALER_STATE if key not in saved]
        if lacking:
            raise CheckpointError(f"{where}: the scaler state has no {', '.join(lacking)}")


def check_optimizer_groups(optimizer: Any, saved: Any, where: str, sizes: bool = True) -> None:
    """``CheckpointError`` before anything is loaded when the saved parameter groups cannot go
    into ``optimizer`` (``optimizer.load_state_dict`` would raise only after the model had been
    replaced): another number of groups, or, with ``sizes``, a group of another size (a sharded
    checkpoint's groups list every rank's pieces, so only their number is compared)."""
    groups = optimizer.param_groups
    if not isinstance(saved, (list, tuple)) or len(saved) != len(groups):
        count = len(saved) if isinstance(saved, (list, tuple)) else "no"
        raise CheckpointError(
            f"{where} has {count} optimizer parameter groups; the optimizer has {len(groups)}"
        )
    for index, (own, theirs) in enumerate(zip(groups, list(saved), strict=True)):
        params = theirs.get("params") if isinstance(theirs, dict) else None
        if sizes and (not isinstance(params, (list, tuple)) or len(params) != len(own["params"])):
            got = len(params) if isinstance(params, (list, tuple)) else "no"
            raise CheckpointError(
                f"{where}: optimizer parameter group {index} has {got} parameters; the "
                f"optimizer's has {len(own['params'])} (build it on the same parameters, in the "
                "same groups, as the one saved)"
            )


def _numel(piece: ShardPiece) -> int:
    return piece.stop - piece.start


def _shard_of(model: nn.Module) -> DataParallelShard | None:
    describe = getattr(model, "data_parallel_shard", None)
    return describe() if callable(describe) else None


def _add_piece(
    entries: dict[str, Any],
    pieces: dict[str, Piece],
    name: str,
    piece: ShardPiece,
    value: torch.Tensor,
) -> None:
    """Record ``value`` (a piece's worth of elements) as the piece ``name``; a rank that holds
    no element of the parameter records nothing."""
    if _numel(piece):
        entries[name] = value.reshape(-1)
        pieces[name] = Piece(piece.shape.numel(), piece.start)


def _shaped(value: Any, piece: ShardPiece) -> Any:
    """An optimizer state tensor read as a piece, in its optimizer copy's shape."""
    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == _numel(piece):
        return value.view(piece.copy.shape)
    return value


def _optimizer_params(optimizer: Any, by_copy: dict[int, ShardPiece]) -> list[torch.Tensor]:
    """The optimizer's parameters in ``state_dict()`` index order; each must be one of this
    rank's optimizer copies."""
    params = [param for group in optimizer.param_groups for param in group["params"]]
    for param in params:
        if id(param) not in by_copy:
            raise ValueError(
                "optimizer: a sharded checkpoint saves optimizers built on "
                "model.optim_parameters() only; this one holds another parameter of shape "
                f"{tuple(param.shape)}"
            )
    return params


def _firsts(optimizer: Any) -> list[int]:
    firsts, count = [], 0
    for group in optimizer.param_groups:
        firsts.append(count)
        count += len(group["params"])
    return firsts
