"""Timeline traces: recording, the Chrome trace format, summaries, predictions and the plot."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import roundpipe
import torch
from roundpipe._native import _C
from roundpipe.scheduler import LayerProfile, ModelExecutePlan
from roundpipe.timeline import tracing as rt

PYTHON_PATH = os.pathsep.join(p for p in (str(Path(roundpipe.__file__).parents[1]), *sys.path) if p)


def make_plan(forward: list[range], backward: list[range]) -> ModelExecutePlan:
    plan = ModelExecutePlan()
    plan.fwd_plan, plan.bwd_plan = forward, backward
    return plan


def event(phase: str, device: int | None, lane: str, start: float, end: float) -> rt.TraceEvent:
    return rt.TraceEvent(phase, lane, device, start, end - start, model="m")


def check_chrome_trace(data: dict) -> None:
    """The fields Perfetto and chrome://tracing need, with their types."""
    assert isinstance(data["traceEvents"], list)
    for e in data["traceEvents"]:
        assert e["ph"] in ("X", "M"), e
        assert isinstance(e["name"], str) and isinstance(e["pid"], int)
        assert isinstance(e["tid"], int) and isinstance(e["args"], dict)
        if e["ph"] == "X":
            assert isinstance(e["ts"], (int, float)) and isinstance(e["dur"], (int, float))
            assert e["dur"] >= 0 and e["cat"] in rt.PHASES


# --------------------------------------------------------------------------------------------
# Format
# --------------------------------------------------------------------------------------------


def test_recorded_trace_is_a_chrome_trace_with_named_processes_and_lanes(
    tmp_path: Path,
) -> None:
    path = tmp_path / "run.json"
    with roundpipe.trace(path) as tracer:
        assert rt.active_tracer() is tracer
        start = tracer.mark(1)
        tracer.record(
            "forward",
            model="net",
            device=1,
            lane="compute",
            start=start,
            end=tracer.mark(1),
            stage=0,
            layers=range(2, 5),
            microbatch=3,
        )
        start = tracer.mark()
        tracer.record(
            "optimizer_step",
            model="net",
            device=None,
            lane="optimizer",
            start=start,
            end=tracer.mark(),
        )
    assert rt.active_tracer() is None
    data = json.loads(path.read_text())
    check_chrome_trace(data)
    complete = [e for e in data["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in complete] == [
        "roundpipe/net/forward/L2-4/mb3",
        "roundpipe/net/optimizer_step",
    ]
    assert complete[0]["args"] == {"model": "net", "stage": 0, "layers": [2, 4], "microbatch": 3}
    names = {
        (e["name"], e["pid"], e["tid"]): e["args"]["name"]
        for e in data["traceEvents"]
        if e["ph"] == "M" and e["name"] in ("process_name", "thread_name")
    }
    forward, step = complete
    assert names[("process_name", forward["pid"], 0)] == "device 1"
    assert names[("thread_name", forward["pid"], forward["tid"])] == "compute"
    assert names[("process_name", step["pid"], 0)] == "host"
    assert names[("thread_name", step["pid"], step["tid"])] == "optimizer"
    assert step["ts"] >= forward["ts"] + forward["dur"]


def test_load_round_trips_what_save_wrote(tmp_path: Path) -> None:
    events = [
        rt.TraceEvent("upload", "parameter upload", 0, 0.0, 2.5, "m", 1, range(3, 6)),
        rt.TraceEvent("backward", "compute", 2, 1.0, 4.0, "m", 1, range(3, 6), 2, {"x": 7}),
        rt.TraceEvent("writeback", "writer", None, 3.0, 1.0, "m"),
    ]
    rt.Trace(events, kind="predicted").save(tmp_path / "t.json")
    loaded = rt.Trace.load(tmp_path / "t.json")
    assert loaded.kind == "predicted"
    assert loaded.events == sorted(events, key=lambda e: e.start_us)


def test_load_rejects_a_file_that_is_not_a_trace(tmp_path: Path) -> None:
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="traceEvents"):
        rt.Trace.load(tmp_path / "x.json")


# --------------------------------------------------------------------------------------------
# Recording
# --------------------------------------------------------------------------------------------


def test_events_from_several_threads_are_all_kept() -> None:
    import threading

    def work(device: int) -> None:
        tracer = rt.active_tracer()
        assert tracer is not None
        for m in range(200):
            start = tracer.mark(device)
            tracer.record(
                "forward",
                model="t",
                device=device,
                lane="compute",
                start=start,
                end=tracer.mark(device),
                microbatch=m,
            )

    with rt.trace() as tracer:
        threads = [threading.Thread(target=work, args=(d,)) for d in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    result = tracer.close()
    for device in range(4):
        assert sorted(e.microbatch for e in result.events if e.device == device) == list(range(200))


def test_copy_spans_start_at_issue_and_end_once_the_copy_is_done() -> None:
    roundpipe.configure_devices("cpu", 2)
    source, target = torch.ones(4_000_000), torch.zeros(4_000_000)
    with rt.trace() as tracer:
        issued = (time.perf_counter_ns() - tracer.origin_ns) / 1e3
        done = _C.copy_async(1, target, source, "parameter")
        tracer.record_transfer(
            "upload",
            model="t",
            device=1,
            lane="parameter upload",
            done=done,
            stage=0,
            layers=range(0, 1),
        )
        second = _C.copy_async(1, source, target, "parameter", done)
        tracer.record_transfer(
            "upload",
            model="t",
            device=1,
            lane="parameter upload",
            done=second,
            stage=1,
            layers=range(1, 2),
        )
    first, then = tracer.close().events
    closed = (time.perf_counter_ns() - tracer.origin_ns) / 1e3
    assert target.sum().item() == 4_000_000
    assert issued <= first.start_us < first.end_us <= closed
    # The lane copies one after the other: the second starts once the first ended.
    assert then.start_us == pytest.approx(first.end_us) or then.start_us > first.end_us
    assert then.end_us <= closed


def test_nested_traces_and_bad_paths_are_refused() -> None:
    with pytest.raises(TypeError, match="path"):
        with rt.trace(3):  # type: ignore[arg-type]
            pass
    with rt.trace():
        with pytest.raises(RuntimeError, match="already being recorded"):
            with rt.trace():
                pass
    assert rt.active_tracer() is None


def test_unknown_phase_or_lane_raises() -> None:
    with rt.trace() as tracer:
        with pytest.raises(ValueError, match="phase"):
            tracer.record("jump", model="m", device=0, lane="compute", start=0, end=1)
        with pytest.raises(ValueError, match="lane"):
            tracer.record("forward", model="m", device=0, lane="optimizer", start=0, end=1)


@pytest.mark.slow
def test_environment_variable_traces_an_unchanged_script(tmp_path: Path) -> None:
    # A script that knows nothing of tracing and exits with an asynchronous step still running.
    script = (
        "import torch, roundpipe\n"
        "m = roundpipe.RoundPipe(torch.nn.Sequential(torch.nn.Linear(4, 4)), name='env')\n"
        "opt = torch.optim.SGD(m.optim_parameters(), lr=0.1)\n"
        "m.forward_backward(input_args=(torch.randn(2, 4),), loss_fn=lambda o, l: o.sum())\n"
        "m.step(lambda: opt.step())\n"
    )
    path = tmp_path / "env.json"
    env = {
        **os.environ,
        rt.ENV_VAR: str(path),
        "PYTHONPATH": PYTHON_PATH,
        "ROUNDPIPE_DEVICE_KIND": "cpu",
    }
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=120)
    data = json.loads(path.read_text())
    check_chrome_trace(data)
    names = [e["name"] for e in data["traceEvents"] if e["ph"] == "X"]
    assert "roundpipe/env/fused/L0-0/mb0" in names
    # Written after the native workers drained: the step that was still queued is in it.
    assert "roundpipe/env/optimizer_step" in names


# --------------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------------


def test_summary_of_a_hand_built_trace() -> None:
    trace = rt.Trace(
        [
            # device 0 computes [0, 4) and [6, 10) (overlapping spans count once)
            event("forward", 0, "compute", 0, 3),
            event("recompute", 0, "compute", 2, 4),
            event("backward", 0, "compute", 6, 10),
            event("wait", 0, "compute", 4, 6),  # waiting is not busy
            # device 1 computes [5, 7); its upload [1, 6) overlaps it for 1 of 5
            event("fused", 1, "compute", 5, 7),
            event("upload", 1, "parameter upload", 1, 6),
            # device 0's upload [8, 12) is under compute for 2 of 4
            event("upload", 0, "parameter upload", 8, 12),
            # optimizer [9, 20): under compute (any device) for 1 of 11
            event("optimizer_step", None, "optimizer", 9, 16),
            event("writeback", None, "writer", 16, 20),
        ]
    )
    summary = trace.summary()
    assert summary.window_us == 20
    assert summary.busy == pytest.approx({0: 8 / 20, 1: 2 / 20})
    assert summary.bubble == pytest.approx({0: 12 / 20, 1: 18 / 20})
    assert summary.upload_hidden == pytest.approx((1 + 2) / (5 + 4))
    assert summary.optimizer_hidden == pytest.approx(1 / 11)
    assert "device 0: busy 40%, bubble 60%" in summary.lines()


def test_summary_without_uploads_or_optimizer_reports_none() -> None:
    summary = rt.Trace([event("forward", 0, "compute", 0, 1)]).summary()
    assert summary.busy == {0: 1.0}
    assert summary.upload_hidden is None and summary.optimizer_hidden is None


# --------------------------------------------------------------------------------------------
# Prediction
# --------------------------------------------------------------------------------------------


def profile(layers: int, fwd: float = 1.0) -> LayerProfile:
    return LayerProfile(
        [fwd] * layers, [fwd] * layers, [2 * fwd] * layers, [100] * layers, [200] * layers
    )


def spans(trace: rt.Trace) -> list[tuple[str, int | None, int | None, int | None, float, float]]:
    return [
        (
            e.phase,
            e.device,
            e.stage,
            e.microbatch,
            round(e.start_us / 1e6, 9),
            round(e.end_us / 1e6, 9),
        )
        for e in trace.events
    ]


def test_predicted_fused_schedule_by_hand() -> None:
    # Layers of 1 s forward, 1 s recompute, 2 s backward; 2 devices, 2 microbatches.
    # Stage 0 (forward L0) on device 0: mb0 [0, 1), mb1 [1, 2).
    # Stage 1 (fused L1: forward + backward = 3 s) on device 1: mb0 [1, 4), mb1 [4, 7).
    # Stage 2 (backward L0: recompute 1 s + backward 2 s) on device 0: mb0 [4, 7), mb1 [7, 10).
    plan = make_plan([range(0, 1)], [range(1, 2), range(0, 1)])
    predicted = plan.simulate(
        profile(2), "fused", num_microbatch=2, num_devices=2, upload_bytes_per_second=0.0
    )
    assert predicted.kind == "predicted"
    assert spans(predicted) == [
        ("forward", 0, 0, 0, 0, 1),
        ("forward", 0, 0, 1, 1, 2),
        ("fused", 1, 1, 0, 1, 4),
        ("recompute", 0, 2, 0, 4, 5),
        ("fused", 1, 1, 1, 4, 7),
        ("backward", 0, 2, 0, 5, 7),
        ("recompute", 0, 2, 1, 7, 8),
        ("backward", 0, 2, 1, 8, 10),
    ]


def test_predicted_train_schedule_runs_backward_after_forward_on_the_next_devices() -> None:
    # Forward call: L0 on device 0 [0, 1), L1 on device 1 [1, 2) (one microbatch).
    # Backward call starts at 2 on the next device in round-robin order (device 0 again).
    plan = make_plan([range(0, 1), range(1, 2)], [range(0, 2)])
    predicted = plan.simulate(
        profile(2), "train", num_microbatch=1, num_devices=2, upload_bytes_per_second=0.0
    )
    assert spans(predicted) == [
        ("forward", 0, 0, 0, 0, 1),
        ("forward", 1, 1, 0, 1, 2),
        ("recompute", 0, 0, 0, 2, 4),
        ("backward", 0, 0, 0, 4, 8),
    ]


def test_predicted_uploads_delay_compute() -> None:
    # 100 bytes per layer at 50 B/s: the stage's upload takes 2 s before it can compute.
    plan = make_plan([range(0, 1)], [])
    predicted = plan.simulate(
        profile(1), "infer", num_microbatch=1, num_devices=1, upload_bytes_per_second=50.0
    )
    assert spans(predicted) == [("forward", 0, 0, 0, 2, 3)]


def test_simulate_rejects_bad_arguments() -> None:
    plan = make_plan([range(0, 2)], [])
    with pytest.raises(ValueError, match="num_microbatch"):
        plan.simulate(profile(2), "infer", num_microbatch=0, num_devices=1)
    with pytest.raises(TypeError, match="num_devices"):
        plan.simulate(profile(2), "infer", num_microbatch=1, num_devices=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="upload_bytes_per_second"):
        plan.simulate(profile(2), "infer", upload_bytes_per_second=-1.0)
    with pytest.raises(ValueError, match="layers"):
        plan.simulate(profile(3), "infer", num_microbatch=1, num_devices=1)
    with pytest.raises(ValueError, match="run_type"):
        plan.simulate(profile(2), "both")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="LayerProfile"):
        plan.simulate([1.0])  # type: ignore[arg-type]


# --------------------------------------------------------------------------------------------
# Plot
# --------------------------------------------------------------------------------------------


def test_plot_writes_a_png_that_opens(tmp_path: Path) -> None:
    from matplotlib.image import imread
    from roundpipe.timeline.plot import plot_trace

    plan = make_plan([range(0, 2), range(2, 4)], [range(4, 6), range(2, 4), range(0, 2)])
    predicted = plan.simulate(profile(6, 1e-3), "fused", num_microbatch=4, num_devices=3)
    measured = rt.Trace(
        [
            event("forward", 0, "compute", 0, 3000),
            event("upload", 1, "parameter upload", 0, 2000),
            event("optimizer_step", None, "optimizer", 3000, 5000),
        ]
    )
    output = tmp_path / "run.png"
    plot_trace(measured, output, predicted=predicted, dpi=50)
    image = imread(output)
    assert image.ndim == 3 and image.shape[0] > 50 and image.shape[1] > 100
    assert image.std() > 0  # not a blank canvas


def test_plot_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from roundpipe.timeline.plot import main

    trace_path = tmp_path / "run.json"
    rt.Trace([event("forward", 0, "compute", 0, 10)]).save(trace_path)
    main([str(trace_path), "--dpi", "40"])
    assert capsys.readouterr().out.strip() == str(tmp_path / "run.png")
    assert (tmp_path / "run.png").stat().st_size > 0


def test_plot_without_matplotlib_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from roundpipe.timeline.plot import plot_trace

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"roundpipe\[plot\]"):
        plot_trace(rt.Trace([event("forward", 0, "compute", 0, 1)]), tmp_path / "x.png")


DEVICE_0 = {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "device 0"}}
FORWARD = {"ph": "X", "cat": "forward", "name": "f", "ts": 0, "dur": 5, "pid": 0, "tid": 0}


@pytest.mark.parametrize(
    ("events", "problem"),
    [
        ([1, 2], r"traceEvents\[0\] is 1, not an event object"),
        ([{"ph": "M", "name": "process_name", "pid": 0}], r"traceEvents\[0\] .* has no 'args'"),
        ([DEVICE_0, {**FORWARD, "pid": None}], r"traceEvents\[1\] .* has pid None, not an int"),
        ([DEVICE_0, {k: v for k, v in FORWARD.items() if k != "tid"}], "has no 'tid'"),
        ([DEVICE_0, {**FORWARD, "args": {"layers": 3}}], "args.layers 3, not \\[first, last\\]"),
        ([DEVICE_0, {**FORWARD, "ts": "soon"}], "has ts 'soon', not a finite number"),
        ([DEVICE_0, {**FORWARD, "dur": -1}], "negative dur"),
    ],
)
def test_plot_command_line_says_in_one_line_what_is_wrong_with_a_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], events: list, problem: str
) -> None:
    from roundpipe.timeline.plot import main

    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"traceEvents": events}))
    with pytest.raises(SystemExit) as exited:
        main([str(path)])
    assert exited.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"python -m roundpipe.plot: error: {path}: ")
    assert re.search(problem, lines[0]), lines[0]
    assert not (tmp_path / "bad.png").exists()


def test_plot_command_line_without_matplotlib_says_how_to_install_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from roundpipe.timeline.plot import main

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    trace_path = tmp_path / "run.json"
    rt.Trace([event("forward", 0, "compute", 0, 10)]).save(trace_path)
    with pytest.raises(SystemExit) as exited:
        main([str(trace_path)])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "python -m roundpipe.plot: error: roundpipe.plot needs matplotlib; install it with: "
        "pip install 'roundpipe[plot]' (or pip install matplotlib)"
    ]


def test_events_on_lanes_without_a_thread_name_are_drawn(tmp_path: Path) -> None:
    import warnings

    from roundpipe.timeline.plot import _rows, plot_trace

    path = tmp_path / "unnamed.json"
    # No thread_name events: tid 1 is a device's second lane in our format, tid 9 no lane of ours.
    events = [DEVICE_0, {**FORWARD, "cat": "upload", "tid": 1}, {**FORWARD, "tid": 9}]
    path.write_text(json.dumps({"traceEvents": events}))
    trace = rt.Trace.load(path)
    assert sorted(e.lane for e in trace.events) == ["parameter upload", "thread 9"]
    assert _rows(trace) == [(0, "parameter upload"), (0, "thread 9")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_trace(trace, tmp_path / "unnamed.png", dpi=40)
    assert (tmp_path / "unnamed.png").stat().st_size > 0


def test_a_cut_short_trace_round_trips_and_says_so(tmp_path: Path) -> None:
    cut = rt.Trace([event("forward", 0, "compute", 0, 10)], cut_short="ended by SIGTERM")
    cut.save(tmp_path / "cut.json")
    loaded = rt.Trace.load(tmp_path / "cut.json")
    assert loaded.cut_short == "ended by SIGTERM" and "cut short" in repr(loaded)
    assert rt.Trace.load(tmp_path / "cut.json").events == cut.events


def test_plot_rejects_an_empty_trace(tmp_path: Path) -> None:
    from roundpipe.timeline.plot import plot_trace

    with pytest.raises(ValueError, match="no events"):
        plot_trace(rt.Trace([]), tmp_path / "x.png")


# --------------------------------------------------------------------------------------------
# The runtime's trace against the simulator's prediction
# --------------------------------------------------------------------------------------------


def compute_order(trace: rt.Trace, device: int) -> list[tuple[str, int | None, range | None, int]]:
    return [
        (e.phase, e.stage, e.layers, e.microbatch)  # type: ignore[misc]
        for e in trace.events
        if e.device == device and e.phase in rt.COMPUTE_PHASES
    ]


@pytest.mark.parametrize("run_type", ["fused", "train"])
def test_measured_trace_has_the_predicted_events_in_the_predicted_order(
    num_devices: int, run_type: str
) -> None:
    torch.manual_seed(0)
    layers, microbatches = 5, 3
    model = roundpipe.RoundPipe(
        torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(layers)]), name="cmp"
    )
    if run_type == "fused":
        plan = make_plan(
            [range(0, 1), range(1, 2), range(2, 3)],
            [range(3, 5), range(2, 3), range(1, 2), range(0, 1)],
        )
    else:
        plan = make_plan([range(0, 2), range(2, 4), range(4, 5)], [range(3, 5), range(0, 3)])
    config = roundpipe.RoundPipeRunConfig(num_microbatch=microbatches, execute_plan=plan)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    with roundpipe.trace() as tracer:
        if run_type == "fused":
            model.forward_backward(
                input_args=(x,), label=y, loss_fn=torch.nn.functional.mse_loss, run_config=config
            )
        else:
            torch.nn.functional.mse_loss(model(x, roundpipe_run_config=config), y).backward()
    measured = tracer.close()
    predicted = plan.simulate(
        model,
        run_type,  # type: ignore[arg-type]
        num_microbatch=microbatches,
        num_devices=num_devices,
    )
    assert {e.model for e in measured.events} == {"cmp"}
    first = next(e.device for e in measured.events if e.phase == "upload")
    assert first is not None
    for device in range(num_devices):
        expected = compute_order(predicted, device)
        assert expected, "every device has work in this plan"
        assert compute_order(measured, (first + device) % num_devices) == expected
    stages = len(plan.fwd_plan) + len(plan.bwd_plan)
    assert sum(e.phase == "upload" for e in measured.events) == stages
    assert sum(e.phase == "grad_download" for e in measured.events) == len(plan.bwd_plan)
    # Every stage waited for its upload once before computing.
    assert sum(e.phase == "wait" and e.device is not None for e in measured.events) == stages


def test_a_file_that_is_not_json_is_a_value_error_naming_it(tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\x00not json at all")
    with pytest.raises(ValueError, match=r"garbage\.json is not a JSON trace"):
        rt.Trace.load(garbage)
