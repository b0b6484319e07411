"""What the benchmark scripts share: size arguments, the machine's name, RESULTS.md entries and
the result files under ``results/``."""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def parse_count(text: str) -> int:
    """``"10M"`` -> 10_000_000 (suffixes K, M, G)."""
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(text[-1].upper(), 1)
    return int(float(text.rstrip("KMGkmg")) * scale)


def machine() -> str:
    """The CPU model and core count."""
    model = platform.processor() or "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{model}, {os.cpu_count()} cores"


def record(script: str, versions: str, table: str) -> None:
    """Add ``table`` to RESULTS.md as its newest entry, under today's date, the machine,
    ``versions`` and the command that produced it."""
    entry = (
        f"## {datetime.date.today().isoformat()} — benchmarks/{script}\n\n"
        f"- machine: {machine()}\n"
        f"- torch {torch.__version__}, {versions}\n"
        f"- command: `python benchmarks/{script} {' '.join(sys.argv[1:])}`\n\n"
        f"{table.rstrip()}\n\n"
    )
    text = RESULTS.read_text()
    first = text.find("\n## ") + 1  # entries are newest first, after the file's header
    RESULTS.write_text(text[:first] + entry + text[first:] if first else text + "\n" + entry)


RESULT_FILES = Path(__file__).resolve().parent / "results"
# The load before the benchmark itself ran (this module is imported when it starts): whether other
# work shared the machine.
LOAD_AT_START = os.getloadavg()


def memory_total() -> str:
    """The machine's memory, as /proc/meminfo says."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def git_commit() -> str:
    """HEAD's short hash, and whether the measured code (python/, csrc/, benchmarks/) differs
    from it in the working tree."""
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        changed = subprocess.run(
            [*git, "status", "--porcelain", "--", "python", "csrc", "benchmarks"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return (
        f"{head} (with uncommitted changes to python/, csrc/ or benchmarks/)" if changed else head
    )


def write_result(script: str, title: str, versions: str, body: str) -> Path:
    """(Re)write ``results/<script's stem>.md``: ``title``, a table of the date, the machine (CPU,
    cores, memory, whether other work shared it), torch and ``versions``, the git commit and the
    command that produced it, then ``body`` (the tables as printed)."""
    before, after = (
        ", ".join(f"{v:.1f}" for v in load) for load in (LOAD_AT_START, os.getloadavg())
    )
    shared = LOAD_AT_START[0] > 0.5 or LOAD_AT_START[1] > 0.5
    rows = [
        ("date", datetime.date.today().isoformat()),
        ("machine", f"{machine()}, {memory_total()} memory"),
        (
            "shared",
            ("yes: other work ran on the machine" if shared else "no other work seen")
            + f" (load average 1, 5, 15 min: {before} before the run, {after} after it)",
        ),
        ("torch", torch.__version__),
        ("versions", versions),
        ("git commit", git_commit()),
        ("command", "`" + " ".join(["python", f"benchmarks/{script}", *sys.argv[1:]]) + "`"),
    ]
    lines = [f"# {title}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    RESULT_FILES.mkdir(exist_ok=True)
    path = RESULT_FILES / f"{Path(script).stem}.md"
    path.write_text("\n".join(lines) + "\n\n" + body.rstrip() + "\n")
    return path
