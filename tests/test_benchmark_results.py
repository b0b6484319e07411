"""The benchmarks' result files: every benchmark rewrites its own file under benchmarks/results/
with ``--record`` (through results.write_result), and benchmarks/RESULTS.md is one headline table
that links to them."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import cpp_bench  # noqa: E402
import results  # noqa: E402

SCRIPTS = sorted(path for path in BENCHMARKS.glob("*.py") if path.name != "results.py")
HEADER = "| benchmark | metric | ours | baseline | ratio | machine | date | results |"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_every_benchmark_records_its_own_result_file(script: Path) -> None:
    text = script.read_text()
    assert '"--record"' in text and "write_result(" in text


def test_nothing_appends_to_the_headline_file() -> None:
    # RESULTS.md is edited by hand, one row per headline figure.
    assert not hasattr(results, "record")
    assert "RESULTS.md" not in (BENCHMARKS / "results.py").read_text()


def test_results_md_is_one_headline_table_linking_to_the_result_files() -> None:
    text = (BENCHMARKS / "RESULTS.md").read_text()
    assert not re.search(r"^#+ .*\d{4}-\d\d-\d\d", text, re.MULTILINE), "a dated journal entry"
    tables = re.findall(r"(?:^\|.*\|\n)+", text, re.MULTILINE)
    assert len(tables) == 1
    rows = tables[0].splitlines()
    assert rows[0] == HEADER and set(rows[1]) <= set("|-: ")
    cells = [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]
    assert cells and all(len(row) == HEADER.count("|") - 1 for row in cells)
    linked = set(re.findall(r"\]\(results/([^)]+\.md)\)", text))
    assert linked == {path.name for path in (BENCHMARKS / "results").glob("*.md")}
    for row in cells:  # a figure names its file; a missing one says why and how to measure it
        assert "](results/" in row[-1] or "not measured yet" in row[2], row


def test_write_result_names_the_file_and_may_write_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(results.RESULTS_DIR_VARIABLE, str(tmp_path / "out" / "results"))
    monkeypatch.setattr(sys, "argv", ["cpp_bench.py", "--record", "build/b/roundpipe_copy_bench"])
    path = results.write_result("cpp_bench.py", "T", "v", "body\n", name="roundpipe_copy_bench")
    assert path == tmp_path / "out" / "results" / "roundpipe_copy_bench.md"
    text = path.read_text()
    assert (
        "| command | `python benchmarks/cpp_bench.py --record build/b/roundpipe_copy_bench` |"
        in (text)
    )
    assert "| shared | " in text and "load average" in text
    assert text.endswith("\n\nbody\n")


def test_cpp_bench_makes_a_table_of_each_report() -> None:
    report = {
        "bench": "stage_upload",
        "rows": [
            {"name": "upload 16 MiB", "raw_GBps": 24.5, "ours_GBps": 23.9, "ours/raw": 0.97551}
        ],
    }
    assert cpp_bench.table(report) == [
        "### stage_upload",
        "",
        "| case | raw_GBps | ours_GBps | ours/raw |",
        "|---|---:|---:|---:|",
        "| upload 16 MiB | 24.50 | 23.90 | 0.976 |",
        "",
    ]


def _fake_bench(folder: Path, output: str) -> Path:
    executable = folder / "roundpipe_fake_bench"
    executable.write_text("#!/bin/sh\ncat <<'EOF'\n" + output + "EOF\n")
    executable.chmod(executable.stat().st_mode | stat.S_IXUSR)
    return executable


def _run_cpp_bench(executable: Path, results_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(BENCHMARKS / "cpp_bench.py"), "--record", str(executable)],
        env={**os.environ, results.RESULTS_DIR_VARIABLE: str(results_dir)},
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )


@pytest.mark.slow
def test_cpp_bench_records_what_the_executable_measured(tmp_path: Path) -> None:
    rows = [{"name": "hand-over, 1 CPU device(s)", "issue_us": 1.25, "total_us": 2.5}]
    output = (
        "8 stages x 4 microbatches; CUDA: skipped: no CUDA device\n"
        "case                              issue_us       total_us\n"
        "hand-over, 1 CPU device(s)           1.250          2.500\n"
        "BENCH_JSON " + json.dumps({"bench": "dispatch", "rows": rows}) + "\n"
    )
    done = _run_cpp_bench(_fake_bench(tmp_path, output), tmp_path / "results")
    assert done.stdout.startswith(output)
    text = (tmp_path / "results" / "roundpipe_fake_bench.md").read_text()
    assert "8 stages x 4 microbatches; CUDA: skipped: no CUDA device\n\n### dispatch\n" in text
    assert "| hand-over, 1 CPU device(s) | 1.25 | 2.50 |" in text


@pytest.mark.slow
def test_cpp_bench_writes_nothing_when_the_executable_skipped(tmp_path: Path) -> None:
    done = _run_cpp_bench(_fake_bench(tmp_path, "skipped: no CUDA device\n"), tmp_path / "results")
    assert "measured nothing" in done.stdout
    assert not (tmp_path / "results").exists()
