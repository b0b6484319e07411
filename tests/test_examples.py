"""The README's examples run as a newcomer runs them (the main job with fewer steps)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TIMEOUT = 600


def run_example(name: str, *args: str, cwd: Path) -> str:
    """Run ``examples/<name>`` in ``cwd``; its standard output (a failure shows both streams)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd,
        env=os.environ.copy(),
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.slow
def test_the_main_job_trains_and_draws_its_pictures(tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="the main job trains through RoundPipeTrainer")
    out = run_example("finetune_trainer.py", "--steps", "60", "--out", "job", cwd=tmp_path)
    first, last = out.split("60 steps in ")[1].split("loss ")[1].split("\n")[0].split(" -> ")
    assert float(last) < 0.7 * float(first), out
    assert "sums right" in out and "bytes/parameter" in out, out
    for line, name in (
        ("loss curve: ", "loss.png"),
        ("schedule of one iteration: ", "iteration.png"),
    ):
        path = out.split(line)[1].split("\n")[0]
        assert Path(path).name == name, out
        assert (tmp_path / path).read_bytes().startswith(b"\x89PNG"), path


def test_the_minimal_example_trains(tmp_path: Path) -> None:
    out = run_example("train_tiny.py", cwd=tmp_path)
    assert "loss" in out, out
