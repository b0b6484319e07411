"""The accounting that the compact Adam state benchmarks report (benchmarks/adam_state_*.py):
bytes per parameter of each Adam state form against what the optimizer really holds, the
capacity arithmetic, and the result files' header."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import roundpipe.optim
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import adam_state_memory  # noqa: E402
import adam_state_step  # noqa: E402
import results  # noqa: E402
from host_memory import CASES  # noqa: E402


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_moment_bytes_are_what_the_optimizer_holds(state_dtype: torch.dtype) -> None:
    param = torch.zeros(4 * 256 * 3, requires_grad=True)
    param.grad = torch.ones_like(param)
    optimizer = roundpipe.optim.Adam([param], state_dtype=state_dtype)
    optimizer.step()
    held = sum(
        t.numel() * t.element_size()
        for t in optimizer.state[param].values()
        if isinstance(t, torch.Tensor) and t.numel() > 1
    )
    assert held / param.numel() == 2 * adam_state_step.MOMENT_BYTES[state_dtype]


def test_step_bytes() -> None:
    assert adam_state_step.step_bytes(torch.float32) == 28
    assert adam_state_step.step_bytes(torch.bfloat16) == 20
    assert adam_state_step.step_bytes(torch.int8) == pytest.approx(16.0625)


def test_floors_of_the_state_cases() -> None:
    # bf16 weights 2, fp32 copies 4, bf16 gradient arenas (two for asynchronous steps, one for
    # synchronous ones) 2 each, and the moments.
    floors = {name: case.floor() for name, case in adam_state_memory.STATE_CASES.items()}
    assert floors == {
        "float32": 18.0,
        "bfloat16": 14.0,
        "int8": pytest.approx(12.03125),
        "int8, synchronous step": pytest.approx(10.03125),
    }
    assert all(case in CASES for case in adam_state_memory.STATE_CASES.values())


def test_largest_model() -> None:
    result = {"zero_rss": 2**30, "peak": 12.0, "params": 1e8}
    fixed = adam_state_memory.fixed_bytes(result, per_param=11.0)
    assert fixed == 2**30 + 1e8
    assert adam_state_memory.largest_model(64 * 2**30, 11.0, fixed) == pytest.approx(
        (63 * 2**30 - 1e8) / 11
    )
    assert adam_state_memory.largest_model(2**29, 11.0, fixed) == 0.0


def test_write_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(results, "RESULT_FILES", tmp_path / "results")
    monkeypatch.setattr(sys, "argv", ["x.py", "--params", "10M"])
    path = results.write_result("adam_state_step.py", "Title", "roundpipe x", "| a |\n|---|\n")
    assert path == tmp_path / "results" / "adam_state_step.md"
    text = path.read_text()
    assert text.startswith("# Title\n")
    assert "| command | `python benchmarks/adam_state_step.py --params 10M` |" in text
    assert "| torch | " + torch.__version__ in text
    assert "GiB memory" in text and "| git commit | " in text
    assert text.endswith("| a |\n|---|\n")
