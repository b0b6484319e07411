"""Traces written as the run goes: a valid file at any time, bounded memory, whatever ends the
process (an exception or Ctrl-C with a step still running, SIGTERM), unwritable paths, forks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import pytest
import roundpipe
from roundpipe.timeline import tracing as rt
from roundpipe.timeline.file import UNFINISHED, TraceFile

PYTHON_PATH = os.pathsep.join(p for p in (str(Path(roundpipe.__file__).parents[1]), *sys.path) if p)


def record(tracer: rt.Tracer, count: int, device: int = 0) -> None:
    for m in range(count):
        start = tracer.mark(device)
        tracer.record(
            "forward",
            model="net",
            device=device,
            lane="compute",
            start=start,
            end=tracer.mark(device),
            stage=0,
            layers=range(0, 2),
            microbatch=m,
        )


def complete_events(path: Path) -> list[dict]:
    return [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]


# --------------------------------------------------------------------------------------------
# The file
# --------------------------------------------------------------------------------------------


def test_every_write_leaves_a_whole_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.json"
    file = TraceFile(str(path), {"producer": "test"})
    assert json.loads(path.read_text()) == {
        "traceEvents": [],
        "displayTimeUnit": "ms",
        "otherData": {"producer": "test", "cut_short": UNFINISHED},
    }
    file.append([{"ph": "M", "name": "a", "args": {"path": Path("p")}}])
    file.append([])
    file.append([{"ph": "M", "name": "b"}, {"ph": "M", "name": "c"}])
    data = json.loads(path.read_text())
    assert [e["name"] for e in data["traceEvents"]] == ["a", "b", "c"]
    assert data["traceEvents"][0]["args"] == {"path": "p"}  # what JSON cannot hold, as str()
    assert data["otherData"]["cut_short"] == UNFINISHED
    # The final tail is shorter than the unfinished one: the file still parses.
    file.finish(cut_short=None)
    data = json.loads(path.read_text())
    assert [e["name"] for e in data["traceEvents"]] == ["a", "b", "c"]
    assert data["otherData"] == {"producer": "test"}
    file.finish(cut_short="again")  # finished: nothing changes
    assert json.loads(path.read_text()) == data


@pytest.mark.parametrize("cut_short", [None, "why"])
def test_a_file_finished_without_events_is_a_whole_trace(
    tmp_path: Path, cut_short: str | None
) -> None:
    path = tmp_path / "t.json"
    TraceFile(str(path), {"producer": "test"}).finish(cut_short)
    other = {"producer": "test"} if cut_short is None else {"producer": "test", "cut_short": "why"}
    assert json.loads(path.read_text())["otherData"] == other


def test_a_second_writer_of_the_same_file_is_refused(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    first = TraceFile(path, {})
    with pytest.raises(BlockingIOError, match="another process"):
        TraceFile(path, {})  # another open file description: flock refuses it as it would
    first.finish(cut_short=None)
    TraceFile(path, {}).finish(cut_short=None)  # free again once finished


def test_the_file_is_a_valid_trace_while_recording(tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    with roundpipe.trace(path) as tracer:
        record(tracer, 3)
        deadline = time.monotonic() + 10
        while len(complete_events(path)) < 3:  # the writer thread writes within FLUSH_SECONDS
            assert time.monotonic() < deadline, "the events were not written while recording"
            time.sleep(rt.FLUSH_SECONDS)
        assert json.loads(path.read_text())["otherData"]["cut_short"] == UNFINISHED
        record(tracer, 2, device=1)
    data = json.loads(path.read_text())
    assert "cut_short" not in data["otherData"]
    assert [e["args"]["microbatch"] for e in complete_events(path)] == [0, 1, 2, 0, 1]
    result = tracer.close()
    assert result.cut_short is None and result.devices == [0, 1]
    assert sorted((e.device, e.microbatch) for e in result.events) == [
        (0, 0),
        (0, 1),
        (0, 2),
        (1, 0),
        (1, 1),
    ]
    assert rt.Trace.load(path).events == result.events


@pytest.mark.slow
def test_memory_stays_bounded_however_long_the_trace(tmp_path: Path) -> None:
    # Held in memory, events cost about 1 KB each; streamed, only those not yet written stay.
    count = 5 * 8 * rt.FLUSH_EVENTS

    def peak_bytes(path: Path | None) -> int:
        tracemalloc.start()
        try:
            with rt.trace(path) as tracer:
                record(tracer, count)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    in_memory = peak_bytes(None)
    streamed = peak_bytes(tmp_path / "long.json")
    assert len(complete_events(tmp_path / "long.json")) == count
    assert streamed < in_memory / 3, (streamed, in_memory)


# --------------------------------------------------------------------------------------------
# Whatever ends the process
# --------------------------------------------------------------------------------------------

# Trains a step, then queues one that is still running when the process ends; "ready" once the
# events before it are recorded.
SCRIPT = textwrap.dedent(
    """
    import signal, sys, time, torch, roundpipe
    signal.signal(signal.SIGINT, signal.default_int_handler)  # inherited ignored under nohup
    m = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4)), name="end")
    opt = torch.optim.SGD(m.optim_parameters(), lr=0.1)
    m.forward_backward(input_args=(torch.randn(2, 4),), loss_fn=lambda o, l: o.sum())
    m.step(lambda: opt.step())
    m.forward_backward(input_args=(torch.randn(2, 4),), loss_fn=lambda o, l: o.sum())
    m.step(lambda: (opt.step(), time.sleep(120)))
    print("ready", flush=True)
    if sys.argv[1] == "raise":
        raise ValueError("the user's own error")
    for _ in range(1200):  # short sleeps: a signal landing just before one is seen 0.1 s later
        time.sleep(0.1)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("ending", "cause", "returncode"),
    [
        ("raise", "uncaught ValueError while optimizer work still ran", 1),
        ("SIGINT", "uncaught KeyboardInterrupt while optimizer work still ran", -signal.SIGINT),
        ("SIGTERM", "ended by SIGTERM", -signal.SIGTERM),
    ],
)
def test_the_trace_survives_whatever_ends_the_process(
    tmp_path: Path, ending: str, cause: str, returncode: int
) -> None:
    path = tmp_path / "end.json"
    env = {
        **os.environ,
        rt.ENV_VAR: str(path),
        "PYTHONPATH": PYTHON_PATH,
        "ROUNDPIPE_DEVICE_KIND": "cpu",
    }
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, ending],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        assert child.stdout.readline().strip() == "ready"
        if ending != "raise":
            child.send_signal(getattr(signal, ending))
        _, stderr = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == returncode, stderr
    data = json.loads(path.read_text())
    assert cause in data["otherData"]["cut_short"]
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    # Both iterations and the first step are in it; the step still running is not.
    assert names.count("roundpipe/end/fused/L0-0/mb0") == 2
    assert names.count("roundpipe/end/optimizer_step") == 1
    loaded = rt.Trace.load(path)
    assert loaded.cut_short is not None and cause in loaded.cut_short


@pytest.mark.slow
def test_a_process_that_ends_normally_writes_a_whole_trace(tmp_path: Path) -> None:
    path = tmp_path / "ok.json"
    script = (
        "import torch, roundpipe\n"
        "m = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4)), name='ok')\n"
        "m.forward_backward(input_args=(torch.randn(2, 4),), loss_fn=lambda o, l: o.sum())\n"
    )
    env = {**os.environ, rt.ENV_VAR: str(path), "PYTHONPATH": PYTHON_PATH}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    data = json.loads(path.read_text())
    assert "cut_short" not in data["otherData"]
    assert "roundpipe/ok/fused/L0-0/mb0" in [e["name"] for e in data["traceEvents"]]


@pytest.mark.slow
def test_processes_sharing_roundpipe_trace_write_files_of_their_own(tmp_path: Path) -> None:
    path = tmp_path / "shared.json"
    held = TraceFile(str(path), {})  # as if another rank were writing it
    script = (
        "import os, torch, roundpipe\n"
        "m = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4)), name='rank')\n"
        "m.forward_backward(input_args=(torch.randn(2, 4),), loss_fn=lambda o, l: o.sum())\n"
        "print(os.getpid())\n"
    )
    env = {**os.environ, rt.ENV_VAR: str(path), "PYTHONPATH": PYTHON_PATH}
    run = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert run.returncode == 0, run.stderr
    own = tmp_path / f"shared.{run.stdout.strip()}.json"
    assert f"another process writes {path}; this one traces to {own}" in run.stderr
    assert "roundpipe/rank/fused/L0-0/mb0" in [e["name"] for e in complete_events(own)]
    held.finish(cut_short=None)
    assert complete_events(path) == []


@pytest.mark.slow
def test_a_forked_child_leaves_the_parents_trace_alone(tmp_path: Path) -> None:
    path = tmp_path / "fork.json"
    script = textwrap.dedent(
        f"""
        import os, roundpipe
        from roundpipe.timeline import tracing as rt
        with roundpipe.trace({str(path)!r}) as tracer:
            pid = os.fork()
            if pid == 0:
                assert rt.active_tracer() is None
                tracer.record("forward", model="child", device=0, lane="compute", start=0, end=1)
            else:
                tracer.record("forward", model="parent", device=0, lane="compute", start=0, end=1)
        if pid == 0:
            os._exit(0)
        assert os.waitpid(pid, 0)[1] == 0
        """
    )
    env = {**os.environ, "PYTHONPATH": PYTHON_PATH}
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    assert [e["args"]["model"] for e in complete_events(path)] == ["parent"]


# --------------------------------------------------------------------------------------------
# Paths that cannot be written
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["missing folder", "folder"])
def test_the_users_exception_wins_over_an_unwritable_path(tmp_path: Path, where: str) -> None:
    path = tmp_path / "missing" / "t.json" if where == "missing folder" else tmp_path
    before = sorted(tmp_path.parent.iterdir())
    with pytest.raises(ZeroDivisionError) as caught:
        with roundpipe.trace(path):
            1 / 0  # noqa: B018
    assert caught.value.__context__ is None
    notes = getattr(caught.value, "__notes__", [])
    assert any(f"cannot write a trace to {path}" in note for note in notes), notes
    assert sorted(tmp_path.parent.iterdir()) == before  # nothing stray beside it
    assert list(tmp_path.iterdir()) == []
    assert rt.active_tracer() is None


def test_an_unwritable_path_is_an_os_error_when_the_block_ends(tmp_path: Path) -> None:
    ran = []
    with pytest.raises(FileNotFoundError, match=r"cannot write a trace to .*missing.*folder"):
        with roundpipe.trace(tmp_path / "missing" / "t.json") as tracer:
            ran.append(True)
            record(tracer, 2)  # recorded nowhere, without failing
    assert ran == [True]
    assert rt.active_tracer() is None
    with roundpipe.trace(tmp_path / "t.json"):  # the next trace starts as usual
        pass


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a full disk)")
def test_a_full_disk_is_an_os_error_naming_the_path_and_keeps_no_lock() -> None:
    # /dev/full opens and locks, then every write fails with ENOSPC: the failed file used to stay
    # open with its lock, so the next trace to it said "another process is writing".
    fds = len(os.listdir("/proc/self/fd"))
    for _ in range(2):
        with pytest.raises(OSError, match="cannot write a trace to /dev/full: No space left"):
            with roundpipe.trace("/dev/full"):
                pass
        with pytest.raises(ZeroDivisionError) as caught:
            with roundpipe.trace("/dev/full"):
                1 / 0  # noqa: B018
        assert any("/dev/full: No space left" in note for note in caught.value.__notes__)
    assert len(os.listdir("/proc/self/fd")) == fds
    with roundpipe.trace("/dev/null") as tracer:  # a device without a length takes the writes
        record(tracer, 2)


def test_a_write_that_fails_later_names_the_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "t.json"
    file = TraceFile(str(path), {})
    file.append([{"ph": "M", "name": "a"}])

    def full(*_: object) -> int:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match=f"cannot write a trace to {path}: No space left"):
        file.append([{"ph": "M", "name": "b"}])
    monkeypatch.undo()
    file.close_unfinished()
    assert [e["name"] for e in json.loads(path.read_text())["traceEvents"]] == ["a"]


def test_save_leaves_nothing_beside_a_path_it_cannot_replace(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    with pytest.raises(IsADirectoryError):
        rt.Trace([]).save(tmp_path / "folder")
    assert [p.name for p in tmp_path.iterdir()] == ["folder"]
