"""ModelTimer: bias-corrected moving averages, byte stand-ins, versioning and VERBOSE output."""

from __future__ import annotations

import threading

import pytest
from roundpipe.scheduler import LayerProfile
from roundpipe.timer import ModelTimer


def reference_estimate(records: list[float], beta: float) -> float:
    """Bias-corrected EMA written out as the weighted sum it is."""
    t = len(records)
    weighted = sum(beta ** (t - 1 - i) * (1 - beta) * x for i, x in enumerate(records))
    return weighted / (1 - beta**t)


def test_estimate_is_bias_corrected_moving_average() -> None:
    timer = ModelTimer(2, [10, 20])
    records = [1.0, 3.0, 2.0, 2.5, 0.5]
    for seconds in records:
        timer.record(1, "bwd", seconds)
    assert timer.estimate(1, "bwd") == pytest.approx(reference_estimate(records, 0.9))
    assert timer.estimate(1, "fwd") is None
    assert timer.estimate(0, "bwd") is None
    timer.record(0, "re", 4.0)
    assert timer.estimate(0, "re") == pytest.approx(4.0)  # first record taken as is


def test_profile_stands_in_byte_sizes_before_timing() -> None:
    timer = ModelTimer(3, [100, 300, 0])
    profile = timer.profile([100, 300, 0], [200, 600, 0])
    assert isinstance(profile, LayerProfile)
    assert profile.forward_seconds[1] == pytest.approx(3 * profile.forward_seconds[0])
    assert profile.forward_seconds[0] > 0 and profile.forward_seconds[2] == 0
    assert list(profile.recompute_seconds) == list(profile.forward_seconds)
    assert list(profile.backward_seconds) == [2 * f for f in profile.forward_seconds]
    assert list(profile.forward_bytes) == [100, 300, 0]
    assert list(profile.backward_bytes) == [200, 600, 0]


def test_stand_ins_take_the_scale_of_timed_layers() -> None:
    timer = ModelTimer(3, [100, 300, 50])
    timer.record(0, "fwd", 2.0)  # 0.02 s per byte
    timer.record(0, "bwd", 5.0)
    profile = timer.profile([100, 300, 50], [200, 600, 100])
    assert profile.forward_seconds == pytest.approx([2.0, 6.0, 1.0])
    assert profile.recompute_seconds == pytest.approx([2.0, 6.0, 1.0])
    assert profile.backward_seconds == pytest.approx([5.0, 12.0, 2.0])


def test_version_moves_only_on_changes_that_matter() -> None:
    timer = ModelTimer(2, [1, 1])
    assert timer.version == 0
    timer.record(0, "fwd", 1.0)
    assert timer.version == 1  # first timing replaces a stand-in
    timer.record(0, "fwd", 1.02)  # estimate moves ~1%: below the 5% threshold
    timer.record(0, "fwd", 0.98)
    assert timer.version == 1
    timer.record(0, "fwd", 10.0)  # one record moving the estimate by far more than 5%
    assert timer.version == 2
    for _ in range(200):
        timer.record(0, "fwd", 10.0)
    converged = timer.version
    assert converged > 2
    for _ in range(20):
        timer.record(0, "fwd", 10.0)
    assert timer.version == converged  # a settled estimate no longer asks for a new plan


def test_verbose_prints_record_and_estimate(capsys: pytest.CaptureFixture[str]) -> None:
    timer = ModelTimer(2, [1, 1], name="encoder")
    ModelTimer.VERBOSE = True
    try:
        timer.record(1, "re", 0.004)
        timer.record(1, "re", 0.002)
    finally:
        ModelTimer.VERBOSE = False
    timer.record(1, "re", 0.002)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 2
    # The documented 0.1.1 format: "Layer {i} {action}  new record: {t} ms  new estimate: {t} ms".
    assert lines[0] == "Layer 1 re  new record: 4.000 ms  new estimate: 4.000 ms"
    expected = reference_estimate([0.004, 0.002], 0.9) * 1e3
    assert lines[1] == f"Layer 1 re  new record: 2.000 ms  new estimate: {expected:.3f} ms"


def test_records_from_many_threads_are_all_counted() -> None:
    timer = ModelTimer(4, [1, 1, 1, 1])

    def work(layer: int) -> None:
        for _ in range(500):
            timer.record(layer, "fwd", 1.0 + layer)
            timer.profile([1] * 4, [2] * 4)

    threads = [threading.Thread(target=work, args=(i % 4,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert [timer._timings.records(0, layer) for layer in range(4)] == [1000] * 4
    for layer in range(4):
        assert timer.estimate(layer, "fwd") == pytest.approx(1.0 + layer)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        ((5, "fwd", 1.0), "layer must be an int in [0, 2)"),
        ((0, "up", 1.0), "action must be"),
        ((0, "fwd", -1.0), "finite non-negative"),
        ((0, "fwd", float("nan")), "finite"),
    ],
)
def test_record_rejects_bad_arguments(args: tuple[object, ...], fragment: str) -> None:
    timer = ModelTimer(2, [1, 1])
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace(")", r"\)")):
        timer.record(*args)  # type: ignore[arg-type]


def test_constructor_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_layers"):
        ModelTimer(0, [])
    with pytest.raises(ValueError, match="one per layer"):
        ModelTimer(2, [1])
    with pytest.raises(ValueError, match="non-negative"):
        ModelTimer(1, [-1])


class FakeEvent:
    """A stand-in for a timing CUDA event: completes when told, at a given time in ms."""

    def __init__(self, at_ms: float) -> None:
        self.at_ms, self.done = at_ms, False

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end_event: FakeEvent) -> float:
        assert self.done and end_event.done  # CUDA raises on events not yet complete
        return end_event.at_ms - self.at_ms


def test_device_timings_are_read_only_once_complete_and_split_over_layers() -> None:
    timer = ModelTimer(3, [10, 10, 10])
    first = (FakeEvent(0.0), FakeEvent(6.0))
    second = (FakeEvent(10.0), FakeEvent(11.0))
    timer.record_later(range(1, 3), "bwd", *first)
    timer.record_later(range(0, 1), "fwd", *second)
    version = timer.version  # reads what completed; nothing has
    assert timer.estimate(1, "bwd") is None and timer.estimate(0, "fwd") is None
    for event in second:
        event.done = True
    assert timer.version > version
    assert timer.estimate(0, "fwd") == pytest.approx(1e-3)
    assert timer.estimate(1, "bwd") is None  # still in flight, kept for later
    for event in first:
        event.done = True
    profile = timer.profile([10, 10, 10], [10, 10, 10])
    assert profile.backward_seconds[1] == pytest.approx(3e-3)  # 6 ms over two layers
    assert profile.backward_seconds[2] == pytest.approx(3e-3)
    assert timer.estimate(0, "bwd") is None


def test_record_later_rejects_bad_arguments() -> None:
    timer = ModelTimer(2, [1, 1])
    with pytest.raises(ValueError, match="action"):
        timer.record_later(range(0, 1), "forward", FakeEvent(0), FakeEvent(1))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="layers"):
        timer.record_later(range(1, 3), "fwd", FakeEvent(0), FakeEvent(1))


def test_unread_device_timings_stay_bounded() -> None:
    timer = ModelTimer(1, [1])
    timer.MAX_UNREAD = 8  # type: ignore[misc]
    pending = [(FakeEvent(0.0), FakeEvent(1.0)) for _ in range(20)]
    for start, end in pending:
        timer.record_later(range(0, 1), "fwd", start, end)
    assert len(timer._unread) <= 8
    for start, end in pending:
        start.done = end.done = True
    assert timer.estimate(0, "fwd") is None
    timer.collect()
    assert timer.estimate(0, "fwd") == pytest.approx(1e-3)


def test_host_spans_split_over_layers_fold_in_order(capsys: pytest.CaptureFixture[str]) -> None:
    timer = ModelTimer(3, [1, 1, 1])
    spans = [(range(0, 2), "fwd", 4.0), (range(1, 2), "fwd", 1.0), (range(2, 3), "bwd", 0.5)]
    ModelTimer.VERBOSE = True
    try:
        timer.record_spans(spans)  # type: ignore[arg-type]
    finally:
        ModelTimer.VERBOSE = False
    assert timer.estimate(0, "fwd") == pytest.approx(2.0)
    assert timer.estimate(1, "fwd") == pytest.approx(reference_estimate([2.0, 1.0], 0.9))
    assert timer.estimate(2, "bwd") == pytest.approx(0.5)
    assert timer.estimate(2, "fwd") is None
    # First timings of (0, fwd), (1, fwd), (2, bwd), then (1, fwd) moving by far more than 5%.
    assert timer.version == 4
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[0].startswith("Layer 0 fwd  new record: 2000.000 ms")
    assert len(lines) == 4


@pytest.mark.parametrize(
    "span",
    [
        (range(2, 4), "fwd", 1.0),
        (range(0, 0), "fwd", 1.0),
        (range(0, 1), "forward", 1.0),
        (range(0, 1), "fwd", -1.0),
        (range(0, 1), "fwd", float("nan")),
    ],
)
def test_record_spans_rejects_bad_spans(span: tuple[range, str, float]) -> None:
    timer = ModelTimer(3, [1, 1, 1])
    with pytest.raises(ValueError, match="timing span"):
        timer.record_spans([span])  # type: ignore[list-item]


def test_record_layers_is_record_of_each_in_order() -> None:
    ours, theirs = ModelTimer(3, [1, 1, 1]), ModelTimer(3, [1, 1, 1])
    layers, seconds = [0, 1, 1, 2, 0], [1.0, 2.0, 0.5, 3.0, 4.0]
    ours.record_layers(layers, "re", seconds)
    for layer, time in zip(layers, seconds, strict=True):
        theirs.record(layer, "re", time)
    for layer in range(3):
        assert ours.estimate(layer, "re") == theirs.estimate(layer, "re")
    assert ours.version == theirs.version


@pytest.mark.parametrize(
    ("layers", "action", "seconds", "match"),
    [
        ([0, 1], "fwd", [1.0], "one time per layer"),
        ([0], "forward", [1.0], "action"),
        ([3], "fwd", [1.0], "within"),
        ([0], "fwd", [float("nan")], "finite"),
        ([0], "fwd", [-1.0], "finite"),
    ],
)
def test_record_layers_rejects_bad_input(
    layers: list[int], action: str, seconds: list[float], match: str
) -> None:
    timer = ModelTimer(3, [1, 1, 1])
    with pytest.raises(ValueError, match=match):
        timer.record_layers(layers, action, seconds)  # type: ignore[arg-type]
    assert all(timer.estimate(i, "fwd") is None for i in range(3))
