"""Sharded checkpoint folders (roundpipe.checkpoints.sharded_files) in one process: round trip,
pieces read back across layouts, corruption, crashes during a save. The multi-rank cases are in
tests/test_distributed.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from roundpipe.checkpoints import sharded_files
from roundpipe.checkpoints.sharded_files import (
    MANIFEST,
    CheckpointError,
    Piece,
    load_folder,
    save_folder,
)


def _data_files(folder: Path) -> list[Path]:
    data = folder / sharded_files.read_manifest(folder)["data"]
    return sorted(path for path in data.iterdir() if path.is_file())


def test_round_trip_of_whole_tensors_pieces_and_objects(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    weight = torch.randn(4, 6, dtype=torch.float64)
    state = {
        "weight": weight.clone(),
        "piece": torch.arange(10, dtype=torch.float32),
        "step": torch.tensor(7),
        "extra": {"epoch": 3, "name": "run"},
    }
    save_folder(folder, state, {"piece": Piece(10, 0)}, None)
    assert (folder / MANIFEST).is_file()

    loaded = {
        "weight": torch.zeros(4, 6, dtype=torch.float64),
        "piece": torch.zeros(4),
        "step": torch.tensor(0),
        "extra": None,
    }
    # Only elements 3..7 of the saved piece are asked for: a piece reads what overlaps it.
    load_folder(folder, loaded, {"piece": Piece(10, 3)}, None)
    assert torch.equal(loaded["weight"], weight)
    assert torch.equal(loaded["piece"], torch.arange(3, 7, dtype=torch.float32))
    assert loaded["step"].item() == 7
    assert loaded["extra"] == {"epoch": 3, "name": "run"}


def test_a_flipped_byte_is_an_error_naming_the_file(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.randn(1000)}, {}, None)
    victim = next(path for path in _data_files(folder) if path.name.endswith(".distcp"))
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    victim.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match=victim.name):
        load_folder(folder, {"w": torch.zeros(1000)}, {}, None)


def test_a_missing_file_or_manifest_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    with pytest.raises(FileNotFoundError, match=MANIFEST):
        load_folder(folder, {"w": torch.zeros(3)}, {}, None)
    save_folder(folder, {"w": torch.randn(3)}, {}, None)
    _data_files(folder)[0].unlink()
    with pytest.raises(CheckpointError, match="missing"):
        load_folder(folder, {"w": torch.zeros(3)}, {}, None)


def test_a_corrupt_manifest_is_an_error(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.randn(3)}, {}, None)
    manifest = folder / MANIFEST
    manifest.write_text(manifest.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(CheckpointError, match="checksum"):
        load_folder(folder, {"w": torch.zeros(3)}, {}, None)


def test_entries_must_match_in_name_size_and_dtype(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.randn(3), "p": torch.randn(5)}, {"p": Piece(5, 0)}, None)
    target = {"w": torch.zeros(3), "p": torch.zeros(5)}
    with pytest.raises(CheckpointError, match="lacks 1 entries: q"):
        load_folder(folder, {**target, "q": torch.zeros(1)}, {"p": Piece(5, 0)}, None)
    with pytest.raises(CheckpointError, match="size"):
        load_folder(folder, {"w": torch.zeros(4), "p": torch.zeros(5)}, {"p": Piece(5, 0)}, None)
    with pytest.raises(CheckpointError, match="float64"):
        load_folder(folder, {"w": torch.zeros(3, dtype=torch.float64)}, {}, None)
    with pytest.raises(CheckpointError, match="size"):
        load_folder(folder, {"p": torch.zeros(5)}, {"p": Piece(6, 0)}, None)
    assert torch.equal(target["w"], torch.zeros(3))  # nothing was read


def test_objects_are_loaded_without_running_code(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"extra": _Unsafe()}, {}, None)
    with pytest.raises(CheckpointError, match=r"weights_only|Unsupported global"):
        load_folder(folder, {"extra": None}, {}, None)


class _Unsafe:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (print, ("this must never run on load",))


class _Touch:
    """Unpickling it creates the file at ``path`` (what an attacker's payload would run)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[object, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def _rewrite_manifest(folder: Path, change: object) -> None:
    """Apply ``change`` to the manifest's body and give it a matching checksum: a deliberate
    edit, which no checksum catches."""
    import json
    import zlib

    path = folder / MANIFEST
    outer = json.loads(path.read_text())
    change(outer["manifest"])  # type: ignore[operator]
    outer["crc32"] = zlib.crc32(json.dumps(outer["manifest"], sort_keys=True).encode())
    path.write_text(json.dumps(outer))


def test_a_tampered_index_of_the_folder_runs_no_code(tmp_path: Path) -> None:
    """torch.distributed.checkpoint indexes a data folder with a plain pickle (.metadata):
    one that names anything but checkpoint metadata is a CheckpointError, with its checksum
    updated in the manifest too, and nothing of it runs."""
    import pickle
    import zlib

    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.randn(3)}, {}, None)
    index = next(path for path in _data_files(folder) if path.name == ".metadata")
    marker = tmp_path / "ran"
    index.write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_folder(folder, {"w": torch.zeros(3)}, {}, None)
    raw = index.read_bytes()

    def described(body: dict) -> None:
        body["files"][".metadata"] = {"bytes": len(raw), "crc32": zlib.crc32(raw)}

    _rewrite_manifest(folder, described)
    for read in (
        lambda: load_folder(folder, {"w": torch.zeros(3)}, {}, None),
        lambda: sharded_files.read_saved_entries(folder),
    ):
        with pytest.raises(CheckpointError, match="is not checkpoint metadata"):
            read()
    assert not marker.exists()


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda body: body.update(format_version="1"), "format_version"),
        (lambda body: body.pop("data"), "data is None"),
        (lambda body: body.update(files={}), "does not list"),
        (lambda body: body.update(data="../elsewhere"), "not the name of a data folder"),
    ],
)
def test_an_edited_manifest_is_a_checkpoint_error(
    tmp_path: Path, change: object, match: str
) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.randn(3)}, {}, None)
    _rewrite_manifest(folder, change)
    with pytest.raises(CheckpointError, match=match):
        load_folder(folder, {"w": torch.zeros(3)}, {}, None)


def test_a_failed_save_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.full((3,), 1.0)}, {}, None)

    def crash(*args: object) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(sharded_files.os, "replace", crash)
    with pytest.raises(OSError, match="disk full"):
        save_folder(folder, {"w": torch.full((3,), 2.0)}, {}, None)
    monkeypatch.undo()
    loaded = {"w": torch.zeros(3)}
    load_folder(folder, loaded, {}, None)
    assert torch.equal(loaded["w"], torch.full((3,), 1.0))
    assert len(list(folder.glob("data-*"))) == 2  # the crashed save's data stays until the next

    save_folder(folder, {"w": torch.full((3,), 3.0)}, {}, None)
    load_folder(folder, loaded, {}, None)
    assert torch.equal(loaded["w"], torch.full((3,), 3.0))
    assert len(list(folder.glob("data-*"))) == 1
    assert not list(folder.glob(".*.tmp"))


_KILLED_SAVE = textwrap.dedent(
    """
    import os, signal, sys, torch
    from pathlib import Path
    from roundpipe.checkpoints import sharded_files
    folder = Path(sys.argv[1])
    real = sharded_files._describe
    def die(path):
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 after the data, before the manifest
    sharded_files._describe = die
    sharded_files.save_folder(folder, {"w": torch.full((1000,), 2.0)}, {}, None)
    """
)


@pytest.mark.slow
def test_kill_9_during_a_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    save_folder(folder, {"w": torch.full((1000,), 1.0)}, {}, None)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    result = subprocess.run(
        [sys.executable, "-c", _KILLED_SAVE, str(folder)], env=env, timeout=120, check=False
    )
    assert result.returncode == -9
    loaded = {"w": torch.zeros(1000)}
    load_folder(folder, loaded, {}, None)
    assert torch.equal(loaded["w"], torch.full((1000,), 1.0))
