"""Runs one C++ microbenchmark of ``benchmarks/cpp`` and prints what it prints; with ``--record``
also rewrites ``results/<executable>.md`` with its tables.

    python benchmarks/cpp_bench.py [--record] build/bench/roundpipe_copy_bench [--iters 10]

The executables (built with ``ROUNDPIPE_BUILD_BENCHMARKS=ON``, see README.md) print a line that
says what was measured, a fixed-width table per benchmark and, per table, one
``BENCH_JSON {"bench": ..., "rows": [...]}`` line; the result file holds the first lines as they
are and each ``BENCH_JSON`` line as a table. An executable that measured nothing (``skipped:
no CUDA device``) writes no file, so the one in ``results/`` keeps the last figures measured.
Exits with the executable's status.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from results import write_result

TITLES = {
    "roundpipe_copy_bench": "Stage upload and gradient download through the copy engine, beside "
    "raw cudaMemcpyAsync",
    "roundpipe_dispatch_bench": "Host cost of the activation hand-over per stage x microbatch",
}


def cell(column: str, value: float) -> str:
    # Ratios (ours/raw) decide the copy targets to the third digit; the rest are GB/s and us.
    return f"{value:.3f}" if "/" in column else f"{value:,.2f}"


def table(report: dict[str, Any]) -> list[str]:
    """A ``BENCH_JSON`` report as a markdown table, its columns in the executable's order."""
    rows: list[dict[str, Any]] = report["rows"]
    columns = [key for key in rows[0] if key != "name"]
    lines = [
        f"### {report['bench']}",
        "",
        "| case | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for row in rows:
        values = " | ".join(cell(column, float(row[column])) for column in columns)
        lines.append(f"| {row['name']} | {values} |")
    return [*lines, ""]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help="write results/<executable>.md")
    parser.add_argument("executable", help="a built roundpipe_*_bench")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="passed to the executable")
    args = parser.parse_args()
    executable = Path(args.executable)
    # Its lines are passed on as they come, so a caller's deadline leaves what was printed.
    with subprocess.Popen(
        [str(executable), *args.arguments], stdout=subprocess.PIPE, text=True
    ) as process:
        assert process.stdout is not None
        lines = []
        for line in process.stdout:
            print(line, end="", flush=True)
            lines.append(line.rstrip("\n"))
    returncode = process.returncode
    # What precedes the first fixed-width table ("case ..." header) says what was measured.
    first_table = next((i for i, line in enumerate(lines) if line.startswith("case ")), len(lines))
    tables = [
        text
        for line in lines
        if line.startswith("BENCH_JSON ")
        for text in table(json.loads(line.removeprefix("BENCH_JSON ")))
    ]
    if args.record and returncode == 0:
        if not tables:
            print(f"{executable.name} measured nothing: no result file written", flush=True)
        else:
            path = write_result(
                "cpp_bench.py",
                TITLES.get(executable.name, executable.name),
                f"{executable} (roundpipe {importlib.metadata.version('roundpipe')} sources), "
                + (f"torch's CUDA {torch.version.cuda}" if torch.version.cuda else "no CUDA"),
                "\n".join([*lines[:first_table], "", *tables]),
                name=executable.name,
            )
            print(f"wrote {path}", flush=True)
    sys.exit(returncode)


if __name__ == "__main__":
    main()
