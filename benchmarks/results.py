"""What the benchmark scripts share: size arguments, the machine's name and the result files under
``results/`` (one per benchmark, rewritten by its ``--record``)."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch


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


class Output:
    """Lines printed as they come and kept for the result file (``text()``)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, text: str = "") -> None:
        print(text, flush=True)
        self.lines.append(text)

    def text(self) -> str:
        return "\n".join(self.lines)


RESULT_FILES = Path(__file__).resolve().parent / "results"
# Where --record writes instead of RESULT_FILES, when set: benchmarks/gpu/run.sh points it at its
# results folder, so that a run's figures (a --cpu-smoke rehearsal's tiny ones included) never
# replace recorded ones unless copied over.
RESULTS_DIR_VARIABLE = "ROUNDPIPE_BENCH_RESULTS"
# The load before the benchmark itself ran (this module is imported when it starts): whether other
# work shared the machine.
LOAD_AT_START = os.getloadavg()


def meminfo(key: str) -> int:
    """A field of /proc/meminfo (``"MemTotal"``, ``"MemAvailable"``...), in bytes."""
    with open("/proc/meminfo") as fields:
        for line in fields:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/meminfo")


def rss() -> int:
    """This process's resident memory now, in bytes."""
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss() -> int:
    """This process's peak resident memory (VmHWM) since it started or reset_peak_rss()."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def pay_first_use_costs(dtype: torch.dtype) -> None:
    """What a process pays once when it first trains with torch, whatever its model's size: run
    before taking the zero point of a memory measurement."""
    layer = torch.nn.Linear(512, 512, dtype=dtype)
    torch.optim.Adam(layer.parameters())  # imports torch._dynamo
    layer(torch.randn(8, 512, dtype=dtype)).float().sum().backward()


def reset_peak_rss() -> None:
    """Sets the peak resident memory (VmHWM) to the current one."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")


def memory_total() -> str:
    """The machine's memory, as /proc/meminfo says."""
    try:
        return f"{meminfo('MemTotal') / 2**30:.1f} GiB"
    except (OSError, RuntimeError):
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


def gpus() -> str:
    """The CUDA devices torch sees, or "" without any."""
    if not torch.cuda.is_available():
        return ""
    names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return ", " + ", ".join(f"GPU {i}: {name}" for i, name in enumerate(names))


def write_result(
    script: str, title: str, versions: str, body: str, *, name: str | None = None
) -> Path:
    """(Re)write ``results/<name>.md`` (``name``: the script's stem unless given): ``title``, a
    table of the date, the machine (CPU, cores, memory, GPUs, whether other work shared it),
    torch and ``versions``, the git commit and the command that produced it, then ``body`` (the
    tables as printed)."""
    before, after = (
        ", ".join(f"{v:.1f}" for v in load) for load in (LOAD_AT_START, os.getloadavg())
    )
    shared = LOAD_AT_START[0] > 0.5 or LOAD_AT_START[1] > 0.5
    rows = [
        ("date", datetime.date.today().isoformat()),
        ("machine", f"{machine()}, {memory_total()} memory{gpus()}"),
        (
            "shared",
            ("yes: other work ran on the machine" if shared else "no other work seen")
            + f" (load average 1, 5, 15 min: {before} before the run, {after} after it)",
        ),
        ("torch", torch.__version__),
        ("versions", versions),
        ("git commit", git_commit()),
        ("command", "`" + shlex.join(["python", f"benchmarks/{script}", *sys.argv[1:]]) + "`"),
    ]
    lines = [f"# {title}", "", "| | |", "|---|---|"]
    lines += [f"| {key} | {value} |" for key, value in rows]
    folder = Path(os.environ.get(RESULTS_DIR_VARIABLE) or RESULT_FILES)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name or Path(script).stem}.md"
    path.write_text("\n".join(lines) + "\n\n" + body.rstrip() + "\n")
    return path
