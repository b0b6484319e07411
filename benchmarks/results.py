"""What the benchmark scripts share: size arguments, the machine's name and RESULTS.md entries."""

from __future__ import annotations

import datetime
import os
import platform
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
