"""The native helpers of the pipeline's hot path (csrc/call/, csrc/gradients/) against the PyTorch
calls they replace: ``_C.backward`` for ``torch.autograd.backward``, ``_C.typed_views`` for
``roundpipe.memory.typed_view``; and the copy engine's small copies on virtual CPU devices, run on
the calling thread when its worker is idle and on the worker otherwise."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator

import pytest
import roundpipe
import torch
from roundpipe._native import _C
from roundpipe.memory import typed_view
from torch import nn


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_backward_matches_torch_and_accumulates() -> None:
    ours, theirs = _model(), _model()
    x = torch.randn(5, 8)
    grad = torch.randn(5, 3)
    for _ in range(2):  # the second call accumulates into the leaves' .grad
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        _C.backward([ours(xa)], [grad])
        torch.autograd.backward([theirs(xb)], [grad])
        torch.testing.assert_close(xa.grad, xb.grad, rtol=0, atol=0)
    for a, b in zip(_grads(ours), _grads(theirs), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backward_of_several_outputs() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    a, b = x * 2, x.sin()
    ga, gb = torch.randn(4, 8), torch.randn(4, 8)
    _C.backward([a, b], [ga, gb])
    torch.testing.assert_close(x.grad, ga * 2 + gb * x.detach().cos())


def test_backward_raises_as_torch_does() -> None:
    model = _model()
    out = model(torch.randn(2, 8))
    _C.backward([out], [torch.ones(2, 3)])
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        _C.backward([out], [torch.ones(2, 3)])
    with pytest.raises(RuntimeError, match=r"got \[3, 3\] but expected shape compatible"):
        _C.backward([model(torch.randn(2, 8))], [torch.ones(3, 3)])
    with pytest.raises(RuntimeError, match="2 outputs but 1 gradients"):
        _C.backward([model(torch.randn(2, 8)), model(torch.randn(2, 8))], [torch.ones(2, 3)])


class _HookError(Exception):
    pass


def test_backward_keeps_python_exceptions_and_warnings() -> None:
    out = _model()(torch.randn(2, 8))

    def hook(grad: torch.Tensor) -> None:
        raise _HookError("raised in a hook")

    out.register_hook(hook)
    with pytest.raises(_HookError, match="raised in a hook"):
        _C.backward([out], [torch.ones(2, 3)])

    class Warns(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, value: torch.Tensor) -> torch.Tensor:
            return value * 2

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            warnings.warn("warned in backward", UserWarning, stacklevel=1)
            return grad * 2

    x = torch.randn(3, requires_grad=True)
    with pytest.warns(UserWarning, match="warned in backward"):
        _C.backward([Warns.apply(x)], [torch.ones(3)])
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))


def test_typed_views_match_typed_view() -> None:
    likes = [
        torch.randn(3, 5),
        torch.randn(7).to(torch.bfloat16),
        torch.randn(2, 2).to(torch.float64),
        torch.empty(0),
        torch.randn(4, 3, requires_grad=True),
    ]
    offsets, cursor = [], 16
    for like in likes:
        cursor = -(-cursor // 8) * 8  # aligned for every dtype, as the arenas are
        offsets.append(cursor)
        cursor += like.numel() * like.element_size()
    buffer = torch.randint(0, 256, (cursor - 16,), dtype=torch.uint8)
    arena = torch.cat([torch.zeros(16, dtype=torch.uint8), buffer])
    views = _C.typed_views(buffer, 16, offsets, likes)
    required = _C.typed_views(buffer, 16, offsets, likes, like_requires_grad=True)
    for view, grad_view, offset, like in zip(views, required, offsets, likes, strict=True):
        expected = typed_view(arena, offset, like)
        assert view.dtype == like.dtype and view.shape == like.shape
        assert view.stride() == like.stride() and not view.requires_grad
        assert grad_view.requires_grad == like.requires_grad
        # A parameter copy is a tensor of its own to autograd (no view of the buffer), over the
        # buffer's memory.
        assert grad_view._base is None and grad_view.is_leaf
        assert grad_view.dtype == like.dtype and grad_view.stride() == like.stride()
        torch.testing.assert_close(view, expected, rtol=0, atol=0)
        torch.testing.assert_close(grad_view.detach(), expected, rtol=0, atol=0)
        if like.numel():
            assert view.data_ptr() == buffer.data_ptr() + offset - 16
            assert grad_view.data_ptr() == view.data_ptr()


def test_typed_views_of_a_buffer_that_starts_inside_its_storage() -> None:
    """The buffer a slice of a larger one (a storage offset): the copies start where the
    views do, and a write through one shows in the buffer."""
    storage = torch.zeros(64, dtype=torch.uint8)
    buffer = storage[8:]
    like = torch.randn(2, 3)
    (copy,) = _C.typed_views(buffer, 0, [16], [like], like_requires_grad=True)
    (view,) = _C.typed_views(buffer, 0, [16], [like])
    assert copy.data_ptr() == view.data_ptr() == storage.data_ptr() + 24
    copy.detach().copy_(like)
    torch.testing.assert_close(view, like, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="aligned"):
        _C.typed_views(storage[2:], 0, [0], [like], like_requires_grad=True)


def test_upload_stage_copies_the_runs_and_attaches_the_gradient_views() -> None:
    """A stage of bytes [16, end) of an arena: the runs copied in (the skipped bytes not), views
    typed as the parameters, zeroed gradients attached to the trained ones only."""
    params = [torch.randn(3, 5, requires_grad=True), torch.randn(4), torch.randn(2, 2).double()]
    offsets, cursor = [], 16
    for param in params:
        offsets.append(cursor)
        cursor += -(-param.numel() * param.element_size() // 64) * 64
    arena = torch.zeros(cursor, dtype=torch.uint8)
    for param, offset in zip(params, offsets, strict=True):
        typed_view(arena, offset, param).copy_(param.detach())
    runs = [(offsets[0], offsets[1]), (offsets[2], cursor)]  # the second parameter is skipped
    buffer, uploaded, views, grads, reach = _C.upload_stage(
        0, torch.device("cpu"), arena, 16, cursor, runs, None, offsets, params,
        True, 0, 128, [0, 64], [0, 2],
    )  # fmt: skip
    uploaded.synchronize()
    assert buffer.numel() == cursor - 16 and grads is not None and grads.numel() == 128
    assert torch.equal(views[0], params[0].detach()) and torch.equal(views[2], params[2])
    assert views[0].requires_grad and not views[1].requires_grad
    assert views[0].grad is not None and torch.equal(views[0].grad, torch.zeros(3, 5))
    assert views[0].grad.data_ptr() == grads.data_ptr() and views[1].grad is None
    assert views[2].grad is not None and views[2].grad.dtype == torch.float64
    # The reach flags the trained views (indices into `trained`) a backward ran into.
    assert reach is not None and reach.reached() == []
    (views[0] * 2).sum().backward()
    assert reach.reached() == [0] and torch.equal(views[0].grad, torch.full((3, 5), 2.0))
    _, _, _, none, no_reach = _C.upload_stage(
        0, torch.device("cpu"), arena, 16, cursor, runs, None, offsets, params,
        False, 0, 0, [], [],
    )  # fmt: skip
    assert none is None and no_reach is None
    with pytest.raises(RuntimeError, match="is not within the stage's bytes"):
        _C.upload_stage(
            0, torch.device("cpu"), arena, 16, cursor, [(0, 16)], None, offsets, params,
            False, 0, 0, [], [],
        )  # fmt: skip
    # Without an arena the caller copies; from 1 MiB up a buffer is an arena of its own.
    _, uploaded, _, big, _ = _C.upload_stage(
        0, torch.device("cpu"), None, 0, 0, [], None, [], [], True, 0, 1 << 20, [], []
    )
    assert uploaded is None and big is not None
    assert big.numel() == 1 << 20 and not big.any()
    with pytest.raises(RuntimeError, match="need the arena"):
        _C.upload_stage(
            0, torch.device("cpu"), None, 0, 64, [(0, 64)], None, [], [], False, 0, 0, [], []
        )


def test_download_grads_accumulates_each_run_as_its_dtype() -> None:
    arena = torch.zeros(64, dtype=torch.uint8)
    arena[16:32].view(torch.float32).fill_(1.0)
    grads = torch.zeros(48, dtype=torch.uint8)  # the stage's bytes [16, 64) of the arena
    grads[0:16].view(torch.float32).fill_(2.0)
    grads[16:48].view(torch.float64).fill_(3.0)
    runs = [(16, 32, torch.float32), (32, 64, torch.float64)]
    for event in _C.download_grads(0, arena, grads, 16, runs, None):
        event.synchronize()
    assert torch.equal(arena[16:32].view(torch.float32), torch.full((4,), 3.0))  # 1 + 2
    assert torch.equal(arena[32:64].view(torch.float64), torch.full((4,), 3.0))
    assert not arena[:16].any()
    with pytest.raises(RuntimeError, match="is not within the stage's bytes"):
        _C.download_grads(0, arena, grads, 16, [(8, 16, torch.float32)], None)


def test_rebind_parameters_swaps_and_puts_back_as_setattr_would() -> None:
    """The copies stand in for the parameters (what the layer's forward then reads) and the
    parameters come back; a binding that cannot be made leaves every module as it was."""
    first, second = nn.Linear(2, 2), nn.Linear(2, 3)
    weights = [first.weight, second.bias]
    copies = [torch.zeros(2, 2), torch.ones(3)]
    before = _C.rebind_parameters([first, second], ["weight", "bias"], copies)
    assert before[0] is weights[0] and before[1] is weights[1]
    assert first.weight is copies[0] and second.bias is copies[1]
    assert torch.equal(first(torch.ones(1, 2)), first.bias.detach().unsqueeze(0))
    again = _C.rebind_parameters([first, second], ["weight", "bias"], before)
    assert again[0] is copies[0] and first.weight is weights[0] and second.bias is weights[1]
    with pytest.raises(KeyError):
        _C.rebind_parameters([first, second], ["weight", "missing"], copies)
    assert first.weight is weights[0]  # put back before the error went up
    with pytest.raises(RuntimeError, match="one of each per binding"):
        _C.rebind_parameters([first], ["weight", "bias"], copies)


def test_changed_in_place_names_the_tensors_whose_version_moved() -> None:
    tensors = [torch.zeros(2), torch.zeros(2), torch.zeros(2)]
    assert _C.changed_in_place(tensors) == []
    tensors[1].add_(1)
    with torch.no_grad():
        tensors[2].mul_(2)
    assert _C.changed_in_place(tensors) == [1, 2]


def test_typed_views_refuse_what_does_not_fit() -> None:
    buffer = torch.zeros(16, dtype=torch.uint8)
    like = torch.zeros(4)
    with pytest.raises(RuntimeError, match="does not lie aligned inside the buffer"):
        _C.typed_views(buffer, 0, [4], [like])
    with pytest.raises(RuntimeError, match="does not lie aligned inside the buffer"):
        _C.typed_views(buffer, 0, [2], [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="does not lie aligned inside the buffer"):
        _C.typed_views(buffer, 8, [4], [torch.zeros(1)])
    with pytest.raises(RuntimeError, match="contiguous 1-D uint8"):
        _C.typed_views(torch.zeros(4), 0, [0], [like])
    with pytest.raises(RuntimeError, match="1 offsets but 2 likes"):
        _C.typed_views(buffer, 0, [0], [like, like])


_OUT_OF_REACH = """
import torch, roundpipe
from roundpipe._native import _C
roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)
buffer, far = torch.zeros(64, dtype=torch.uint8), 2**63 - 8
for like_requires_grad in (False, True):  # a view, or a tensor of its own on the storage
    try:
        _C.typed_views(buffer, 0, [far], [torch.zeros(4, requires_grad=True)], like_requires_grad)
    except RuntimeError as error:
        assert "does not lie aligned inside the buffer" in str(error)
    else:
        raise AssertionError("a view past the buffer's end")
try:
    _C.typed_views(buffer, -(2**62), [2**62], [torch.zeros(4)])
except RuntimeError as error:
    assert "does not lie aligned inside the buffer" in str(error)
else:
    raise AssertionError("an offset before the buffer")
arena = torch.zeros(16, dtype=torch.uint8)
try:
    _C.upload_stage(0, torch.device("cpu"), arena, 0, 16, [(0, 16)], None, [far],
                    [torch.zeros(4)], False, 0, 0, [], [])
except RuntimeError as error:
    assert "does not lie aligned inside the buffer" in str(error)
else:
    raise AssertionError("a parameter view past the stage's buffer")
for make in (_C.KeptInputs, _C.RngStates):
    try:
        make(2**32, 2**32)
    except RuntimeError as error:
        assert "slots" in str(error)
    else:
        raise AssertionError("layers x microbatches past int64")
kept = _C.KeptInputs(4, 4)
assert kept.find(2**62, 1) is None and kept.find(3, 3) is None
print("ok")
"""


@pytest.mark.slow
def test_native_views_and_slots_refuse_what_lies_out_of_reach() -> None:
    """Offsets and counts so large that their sums or products overflow 64 bits were let
    through, giving tensors past the buffer (a crash on first use) or tables of no slots: each
    is refused with the error a smaller one gets. In a subprocess: a crash fails the test, not
    the suite."""
    result = subprocess.run(
        [sys.executable, "-c", _OUT_OF_REACH], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-3000:]


@pytest.fixture
def one_cpu_device() -> Iterator[None]:
    kind, count = roundpipe.device_kind(), roundpipe.device_count()
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)
    inline_bytes = _C.inline_copy_bytes()
    try:
        yield
    finally:
        _C.set_inline_copy_bytes(inline_bytes)
        if kind == "cpu":
            roundpipe.configure_devices(kind="cpu", num_cpu_devices=count)


def _block_the_engine() -> tuple[threading.Event, _C.Event]:
    """A job holding device 0's copy-engine worker until the returned flag is set."""
    release = threading.Event()
    held = _C.submit_optimizer_job(release.wait)
    # A large copy waiting for the held job occupies the engine's worker.
    busy = _C.copy_async(0, torch.empty(1 << 20), torch.ones(1 << 20), "parameter", held)
    return release, busy


@pytest.mark.usefixtures("one_cpu_device")
def test_small_copies_run_inline_only_when_nothing_is_queued() -> None:
    assert _C.inline_copy_bytes() == 64 << 10
    # Copies earlier tests left on device 0's worker (a loaded machine runs them late) would
    # queue the small ones behind them: one large copy drains it first, and the worker marks
    # itself idle just after it signals the copy's event.
    _C.copy_async(0, torch.empty(1 << 20), torch.ones(1 << 20), "activation").synchronize()
    time.sleep(0.05)
    dst = torch.zeros(8)
    done = _C.copy_async(0, dst, torch.ones(8), "activation")
    assert done.query() and dst.sum() == 8  # on the calling thread: done on return
    grads = torch.zeros(8)
    assert _C.accumulate_async(0, grads, torch.ones(8)).query() and grads.sum() == 8

    release, busy = _block_the_engine()
    queued = _C.copy_async(0, dst, torch.full((8,), 2.0), "activation")
    accumulated = _C.accumulate_async(0, grads, torch.ones(8))
    assert not queued.query() and not accumulated.query()  # behind the worker's job, in order
    assert dst.sum() == 8 and grads.sum() == 8
    release.set()
    busy.synchronize()
    queued.synchronize()
    accumulated.synchronize()
    assert dst.sum() == 16 and grads.sum() == 16


@pytest.mark.usefixtures("one_cpu_device")
def test_every_copy_goes_to_the_worker_with_threshold_zero() -> None:
    _C.set_inline_copy_bytes(0)
    release, busy = _block_the_engine()
    dst = torch.zeros(8)
    queued = _C.copy_async(0, dst, torch.ones(8), "activation")
    assert not queued.query()
    release.set()
    busy.synchronize()
    queued.synchronize()
    assert dst.sum() == 8
    with pytest.raises(RuntimeError, match="must be >= 0"):
        _C.set_inline_copy_bytes(-1)


@pytest.mark.usefixtures("one_cpu_device")
def test_an_inline_copy_reports_its_error_through_its_event() -> None:
    # The worker may still be finishing an earlier test's job: wait until a copy runs inline.
    deadline = time.monotonic() + 10
    while not _C.copy_async(0, torch.zeros(1), torch.ones(1), "activation").query():
        assert time.monotonic() < deadline, "the copy engine's worker never became idle"
        time.sleep(0.001)
    failed = _C.copy_async(0, torch.zeros(2, 4), torch.ones(8), "activation")  # not broadcastable
    ok = _C.copy_async(0, torch.zeros(4), torch.ones(4), "activation")
    assert ok.query()
    with pytest.raises(RuntimeError):
        failed.synchronize()


# --------------------------------------------------------------------------------------------
# The native layer loop (_C.LayerLoop)
# --------------------------------------------------------------------------------------------


class _Fails(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise KeyError("layer 2 is broken")


def _dropout_layers() -> list[nn.Module]:
    torch.manual_seed(1)
    return [nn.Linear(8, 8), nn.Dropout(0.5), nn.Linear(8, 8), nn.Dropout(0.5)]


def test_layer_loop_reseeds_and_calls_each_layer_as_python_would() -> None:
    from roundpipe.context import LayerCall, doing_recompute

    layers = _dropout_layers()
    x = torch.randn(4, 8)
    expected: torch.Tensor = x
    for index, layer in enumerate(layers):
        torch.default_generator.manual_seed(_C.layer_seed(99, index, 2, False))
        expected = layer(expected)
    seen: list[tuple[int, int, bool]] = []
    context = LayerCall({}, recompute=True, saving_enabled=True)
    hook = layers[2].register_forward_pre_hook(
        lambda *_: seen.append((context.layer, context.microbatch, doing_recompute()))
    )
    loop = _C.LayerLoop(layers, 99, False, [torch.default_generator], context, None, "host", 0)
    with context:
        first = loop.run(0, 1, 2, ((x,), {}))  # layer 0 takes (args, kwargs)
        got = loop.run(1, 4, 2, first)
    hook.remove()
    assert torch.equal(got, expected)
    assert seen == [(2, 2, True)]
    layers_run, times = loop.take_host_times()
    assert layers_run == [0, 1, 2, 3] and all(t >= 0 for t in times) and len(times) == 4
    assert loop.take_host_times() == ([], [])
    # fresh draws differ from the replayed ones
    assert _C.layer_seed(99, 1, 2, True) != _C.layer_seed(99, 1, 2, False)
    assert len({_C.layer_seed(99, layer, m, False) for layer in range(4) for m in range(4)}) == 16
    assert all(0 <= _C.layer_seed(s, 3, 1, False) < 2**63 for s in (0, 1, 2**62 - 1))


class _Draws(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(3) + torch.randn(1) + torch.empty(2).normal_()[:1]


def test_recompute_replays_the_kept_generator_states_exactly() -> None:
    """A forward loop keeps the CPU generator's seeded state per (layer, microbatch); a recompute
    loop starting from it draws what reseeding draws, and reseeds where nothing was kept."""
    from roundpipe.context import LayerCall

    layers: list[nn.Module] = [_Draws() for _ in range(4)]
    x = torch.zeros(3)
    states = _C.RngStates(4, 2)
    forward = _C.LayerLoop(
        layers, 7, False, [torch.default_generator], LayerCall({}, False, True), None, "off",
        0, states, False,
    )  # fmt: skip
    expected = [forward.run(1, 4, m, x) for m in range(2)]
    assert states.kept == 6
    torch.manual_seed(123)  # whatever the generator did in between
    replaying = _C.LayerLoop(
        layers, 7, False, [torch.default_generator], LayerCall({}, True, True), None, "off",
        0, states, True,
    )  # fmt: skip
    plain = _C.LayerLoop(
        layers, 7, False, [torch.default_generator], LayerCall({}, True, True), None, "off", 0
    )
    for m in range(2):
        assert torch.equal(replaying.run(1, 4, m, x), expected[m])
        assert torch.equal(plain.run(1, 4, m, x), expected[m])
    empty = _C.LayerLoop(
        layers, 7, False, [torch.default_generator], LayerCall({}, True, True), None, "off",
        0, _C.RngStates(4, 2), True,
    )  # fmt: skip
    assert torch.equal(empty.run(1, 4, 1, x), expected[1])  # nothing kept: reseeded
    with pytest.raises(RuntimeError, match="replay needs"):
        _C.LayerLoop(layers, 7, True, [], LayerCall({}, True, True), None, "off", 0, states, True)


def test_layer_loop_names_the_failing_layer_and_keeps_the_exception() -> None:
    from roundpipe.context import LayerCall

    layers: list[nn.Module] = [nn.Identity(), nn.Identity(), _Fails(), nn.Identity()]
    context = LayerCall({}, recompute=False, saving_enabled=False)
    loop = _C.LayerLoop(layers, 0, False, [], context, None, "off", 0)
    with pytest.raises(KeyError, match="layer 2 is broken"):
        loop.run(1, 4, 0, torch.zeros(1))
    assert context.layer == 2
    with pytest.raises(RuntimeError, match="not within the 4 layers"):
        loop.run(3, 5, 0, torch.zeros(1))
    with pytest.raises(RuntimeError, match="timing must be"):
        _C.LayerLoop(layers, 0, False, [], context, None, "wall", 0)


def test_layer_loop_enters_and_leaves_each_mark() -> None:
    from contextlib import contextmanager

    from roundpipe.context import LayerCall

    events: list[str] = []

    @contextmanager
    def mark(layer: int, microbatch: int) -> Iterator[None]:
        events.append(f"enter {layer}/{microbatch}")
        try:
            yield
        finally:
            events.append(f"exit {layer}")

    layers: list[nn.Module] = [nn.Identity(), _Fails()]
    loop = _C.LayerLoop(layers, 0, False, [], LayerCall({}, False, False), mark, "off", 0)
    with pytest.raises(KeyError):
        loop.run(0, 2, 3, ((torch.zeros(1),), {}))
    assert events == ["enter 0/3", "exit 0", "enter 1/3", "exit 1"]


def _train_step(
    model: roundpipe.RoundPipe, width: int, config: roundpipe.RoundPipeRunConfig
) -> None:
    """One forward_backward of ``model`` on random rows of ``width``, finished."""
    model.forward_backward(
        input_args=(torch.randn(4, width),),
        label=torch.randn(4, width),
        loss_fn=lambda out, label: ((out - label) ** 2).mean(),
        run_config=config,
    )
    model.synchronize()


def test_timings_of_a_stage_with_a_full_garbage_collection_are_dropped() -> None:
    """A full collection's pause would land in one layer's timing and skew the plan for many
    calls: the times the run's layer loop of that stage took are not handed to the timer (those
    of the forward stages here), the other loops' are."""
    from roundpipe import RoundPipe, RoundPipeRunConfig, doing_recompute

    class Collects(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not doing_recompute():
                gc.collect()
            return super().forward(x)

    torch.manual_seed(0)
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)
    model = RoundPipe(nn.Sequential(nn.Linear(4, 4), Collects(4, 4), nn.Linear(4, 4)))
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(0, 1), range(1, 2)]
    plan.bwd_plan = [range(2, 3), range(1, 2), range(0, 1)]
    _train_step(model, 4, RoundPipeRunConfig(num_microbatch=2, execute_plan=plan))
    timer = model._runtime.timer
    assert timer.estimate(1, "fwd") is None  # collected during its stage
    assert timer.estimate(0, "fwd") is None  # the same loop: forward stages on device 0
    assert timer.estimate(1, "re") is not None  # its recompute collected nothing
    assert timer.estimate(2, "fwd") is not None  # the fused stage's loop


class _CalledTwice(nn.Linear):
    """A layer class whose own __call__ changes the output."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(x) * 2


class _PatchedCallImpl(nn.Linear):
    """A layer class whose _call_impl is replaced (as torch._dynamo can do to a class)."""


def _shifted_call_impl(self: nn.Module, *args: object, **kwargs: object) -> torch.Tensor:
    return nn.Module._call_impl(self, *args, **kwargs) + 1


_PatchedCallImpl._call_impl = _shifted_call_impl  # type: ignore[method-assign]


class _Marked(nn.Linear):
    """Layers a process-wide forward hook of the test changes."""


def _layers_called_their_own_way() -> nn.Sequential:
    torch.manual_seed(0)
    hooked, pre_hooked, compiled = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)
    hooked.register_forward_hook(lambda module, args, output: output * 3)
    pre_hooked.register_forward_pre_hook(lambda module, args: (args[0] - 0.5,))
    # What module.compile() sets: the call goes through it instead of _call_impl.
    compiled._compiled_call_impl = lambda x: nn.Module._call_impl(compiled, x).neg()
    return nn.Sequential(
        nn.Linear(6, 6),
        hooked,
        nn.Tanh(),
        pre_hooked,
        _CalledTwice(6, 6),
        _PatchedCallImpl(6, 6),
        compiled,
        _Marked(6, 6),
        nn.Linear(6, 6),
    )


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_layers_are_called_as_module_call_would_hooks_and_overrides_included(grain: str) -> None:
    """The layer loop calls a layer's forward directly only when nn.Module.__call__ would do
    nothing else: hooks (the layer's and the process's), a compiled call, and a class's own
    __call__ or _call_impl all change what the layers compute here, and RoundPipe computes
    what plain PyTorch does, bitwise."""
    from roundpipe import RoundPipe, RoundPipeRunConfig

    handle = torch.nn.modules.module.register_module_forward_hook(
        lambda module, args, output: output + 0.25 if isinstance(module, _Marked) else None
    )
    try:
        plain = _layers_called_their_own_way()
        wrapped = RoundPipe(_layers_called_their_own_way())
        x, y = torch.randn(8, 6), torch.randn(8, 6)

        def loss_fn(out: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
            return ((out - label) ** 2).mean()

        losses = []
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            loss = loss_fn(plain(xm), ym)
            loss.backward()
            losses.append(loss.detach())
        plan = roundpipe.ModelExecutePlan()
        plan.fwd_plan = [range(0, 3), range(3, 6)]
        plan.bwd_plan = [range(6, 9), range(3, 6), range(0, 3)]
        for devices in (1, 3):
            roundpipe.configure_devices(kind="cpu", num_cpu_devices=devices)
            config = RoundPipeRunConfig(num_microbatch=2, recompute_grain=grain, execute_plan=plan)
            loss = wrapped.forward_backward(
                input_args=(x,), label=y, loss_fn=loss_fn, run_config=config
            )
            wrapped.synchronize()
            assert torch.equal(loss, torch.stack(losses).sum())
            for ours, theirs in zip(wrapped.model.parameters(), plain.parameters(), strict=True):
                assert ours.grad is not None and theirs.grad is not None
                assert torch.equal(ours.grad, theirs.grad)
                ours.grad = None
    finally:
        handle.remove()
        roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)


class _SeesItsCaller(nn.Linear):
    """Records the Python function that called its forward."""

    def __init__(self) -> None:
        super().__init__(6, 6)
        self.callers: list[str] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.callers.append(sys._getframe(1).f_code.co_name)
        return super().forward(x)


def test_a_layer_without_hooks_is_called_without_module_calls_frames() -> None:
    """The layer loop's shortcut is taken where it applies (nothing else shows it: it computes
    the same), and not once the layer has a hook."""
    from roundpipe import RoundPipe, RoundPipeRunConfig

    torch.manual_seed(0)
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)
    model = RoundPipe(nn.Sequential(nn.Linear(6, 6), _SeesItsCaller(), nn.Linear(6, 6)))
    layer = model.model[1]
    assert isinstance(layer, _SeesItsCaller)
    # Layer 1 in a forward stage and a backward stage, whatever the planner would choose from
    # timings taken on a busy machine (a fused stage over it would call it once per microbatch).
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(0, 2)]
    plan.bwd_plan = [range(2, 3), range(0, 2)]
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
    module_call = {"_call_impl", "inner"}  # nn.Module.__call__'s frames, without and with hooks
    _train_step(model, 6, config)
    assert len(layer.callers) == 4  # forward and recompute of 2 microbatches
    assert not module_call & set(layer.callers)
    layer.callers.clear()
    handle = layer.register_forward_hook(lambda *_: None)
    _train_step(model, 6, config)
    handle.remove()
    assert len(layer.callers) == 4 and set(layer.callers) <= module_call


def test_layer_loop_keeps_private_copies_of_the_inputs_asked_for() -> None:
    from roundpipe.context import LayerCall

    class Doubles(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2)  # in place: a kept input must not change with it

    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            return x, x + 1

    class First(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] * pair[1]

    layers: list[nn.Module] = [nn.Identity(), Doubles(), Pair(), First(), Doubles()]
    by_python: dict[tuple[int, int], object] = {}

    def keeper(layer: int, microbatch: int, value: object) -> None:
        by_python[(layer, microbatch)] = value

    loop = _C.LayerLoop(layers, 0, False, [], LayerCall({}, False, False), None, "host", 0)
    kept = _C.KeptInputs(5, 9)
    x = torch.ones(3, requires_grad=True) * 1  # an activation, not a leaf
    outputs = loop.run_keeping(1, 5, 7, [x, torch.ones(3)], [1, 3, 4], kept, keeper)
    assert torch.equal(outputs[0], torch.full((3,), 12.0))  # 2 * (2 + 1) * 2
    assert torch.equal(outputs[1], torch.full((3,), 12.0))
    first, fourth = kept.find(1, 7), kept.find(4, 7)
    assert first is not None and fourth is not None
    assert torch.equal(first, torch.ones(3))  # before layer 1 doubled it
    assert first.requires_grad and first.grad_fn is None  # as the input did, without its graph
    assert torch.equal(fourth, torch.full((3,), 6.0))
    second = kept.find(1, 8)  # the second microbatch's
    assert second is not None and not second.requires_grad and second is not first
    assert kept.find(3, 7) is None and list(by_python) == [(3, 7), (3, 8)]  # tuples: Python's
    assert kept.find(2, 7) is None and kept.find(1, 6) is None  # not asked for
    assert kept.covers(4, 5, [7, 8], True) and not kept.covers(3, 5, [7], True)
    assert kept.covers(1, 3, [7, 8], False) and not kept.covers(1, 3, [7, 6], False)
    assert not kept.covers(1, 3, [7], True)
    assert loop.take_host_times()[0] == [1, 2, 3, 4] * 2
    # Without a store every input goes to the keeper.
    by_python.clear()
    loop.run_keeping(1, 3, 0, [torch.ones(3)], [1, 2], None, keeper)
    assert list(by_python) == [(1, 0), (2, 0)]
    with pytest.raises(RuntimeError, match="ascending order"):
        loop.run_keeping(1, 3, 0, [torch.ones(3)], [2, 1], kept, keeper)
    with pytest.raises(RuntimeError, match="ascending order"):
        loop.run_keeping(1, 3, 0, [torch.ones(3)], [3], kept, keeper)  # not a layer it runs
    with pytest.raises(IndexError):
        loop.run_keeping(1, 3, 9, [torch.ones(3)], [1], kept, keeper)  # no microbatch 9


@pytest.mark.slow
@pytest.mark.usefixtures("one_cpu_device")
def test_layer_loop_runs_the_inputs_it_was_given_when_a_layer_empties_their_list() -> None:
    """A layer that changes the caller's list of inputs while the loop runs (here: empties it)
    changes nothing of the run: every input given is run, none read after it was freed."""
    from roundpipe.context import LayerCall

    values = [torch.full((2,), float(i)) for i in range(50)]

    class Empties(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            values.clear()
            gc.collect()
            return x + 1

    loop = _C.LayerLoop(
        [nn.Identity(), Empties()], 0, False, [], LayerCall({}, False, False), None, "off", 0
    )
    outputs = loop.run_keeping(1, 2, 0, values, [], None, lambda *_: None)
    assert len(outputs) == 50 and not values
    for i, output in enumerate(outputs):
        assert torch.equal(output, torch.full((2,), float(i + 1)))


class _Doubles(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(2)  # in place, on its input


@pytest.mark.parametrize("natively", [False, True], ids=["given", "kept"])
@pytest.mark.parametrize("per_layer", [False, True], ids=["stage", "layer"])
@pytest.mark.parametrize("reused", [False, True], ids=["once", "reused"])
def test_layer_loop_recompute_backward_matches_autograd(
    per_layer: bool, reused: bool, natively: bool
) -> None:
    """Recompute + backward of layers 1-4 (two of them change their input in place) from saved
    inputs, given or kept natively by the forward loop: the gradients are plain autograd's to the
    bit, the timings name the layers, and the saved inputs stay as they were when a later
    recompute may start from them again."""
    from roundpipe.call.layer_loop import cut_graphs
    from roundpipe.context import LayerCall

    def unused(*_: object) -> None:  # keeper and fallback: every value here is a lone tensor
        raise AssertionError("not a lone tensor")

    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Identity(), _Doubles(), nn.Linear(8, 8), _Doubles(), nn.Tanh()]
    x, grad = torch.randn(4, 8), torch.randn(4, 8)

    # Plain PyTorch: the input of layer 1 is a non-leaf, as the output of a layer before it.
    leaf = x.clone().requires_grad_(True)
    h = leaf * 1
    for layer in layers[1:]:
        h = layer(h)
    h.backward(grad)
    expected_weight = layers[2].weight.grad.clone()  # type: ignore[union-attr]
    expected_input = leaf.grad
    layers[2].zero_grad(set_to_none=True)

    # The inputs a forward pass keeps: each layer's (layer grain) or the first one's, requiring
    # grad as they did in the forward (the recompute's inputs then do too).
    store = _C.KeptInputs(5, 1)
    if natively:  # by the forward's layer loop, as a forward stage keeps them
        forward = _C.LayerLoop(
            layers, 0, False, [], LayerCall({}, False, True), None, "off", 0, cut=cut_graphs
        )
        with torch.enable_grad():
            forward.run_keeping(
                1, 5, 0, [x.clone().requires_grad_(True) * 1], [1, 2, 3, 4], store, unused
            )
        kept = [store.find(layer, 0) for layer in range(1, 5)]
        assert all(t is not None and t.requires_grad for t in kept)
    else:
        with torch.no_grad():
            kept, h = [], x.clone()
            for layer in layers[1:]:
                kept.append(h.clone().requires_grad_(True))
                h = layer(h)
    inputs = kept if per_layer else kept[:1]
    before = [t.clone() for t in inputs]
    loop = _C.LayerLoop(layers, 0, False, [], LayerCall({}, True, True), None, "host", 0)
    if natively:
        [got] = loop.recompute_backward_kept(1, 5, [0], store, reused, [grad], per_layer, unused)
    else:
        got = loop.recompute_backward(
            1, 5, 0, inputs, inputs if reused else [], grad, per_layer, unused
        )
    assert got is not None and torch.equal(got, expected_input)
    assert torch.equal(layers[2].weight.grad, expected_weight)  # type: ignore[union-attr,arg-type]
    # Layers 1 and 3 double their inputs in place: the saved ones only when not copied first.
    assert all(torch.equal(a, b) for a, b in zip(inputs, before, strict=True)) == reused
    backward_layers, seconds = loop.take_backward_host_times()
    assert backward_layers == ([4, 3, 2, 1] if per_layer else [1, 2, 3, 4])
    assert len(seconds) == 4 and all(s >= 0 for s in seconds)
    if not per_layer:  # one segment, its time split evenly
        assert len(set(seconds)) == 1
    assert loop.take_host_times()[0] == ([4, 3, 2, 1] if per_layer else [1, 2, 3, 4])


def test_stage_layout_matches_the_arena_layout_and_stays_bounded() -> None:
    """A stage's cached layout says what the per-layer layout says, and a plan that changes on
    every call cannot make the cache grow without bound."""
    from roundpipe.memory import ModelMemory

    torch.manual_seed(0)
    shared = nn.Linear(4, 4)
    layers: list[nn.Module] = [
        nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)),
        nn.Linear(4, 4, bias=False).requires_grad_(False),
        shared,
        shared,  # an alias of the parameters of layer 2
    ]
    memory = ModelMemory(layers, "off")
    layout = memory.stage_layout(range(1, 4))
    assert layout is memory.stage_layout(range(1, 4))
    slots = [slot for index in range(1, 4) for slot in memory.layers[index].slots]
    assert list(layout.slots) == slots
    assert layout.offsets == tuple(slot.offset for slot in slots)
    assert layout.param_begin == memory.layers[1].begin and layout.param_end == memory.layers[3].end
    assert [layout.slots[i] for i in layout.trained] == [
        s for s in slots if s.grad_offset is not None
    ]
    assert layout.frozen() == (0,)  # layer 1's weight
    assert layout.grad_runs == tuple(memory.grad_runs(range(1, 4)))
    assert layout.buffer_modules == ()
    bn = layers[0][1]
    assert memory.stage_layout(range(0, 1)).buffer_modules == (bn, bn, bn)  # BatchNorm1d's
    # Every use of a parameter in the stage is bound to the stage's first copy of it: autograd
    # sums the uses' gradients there, as in plain PyTorch. A module that several layers are
    # (layers 2 and 3) is bound once, so that unbinding gives it its parameter back.
    first = {id(slot.param): slot for slot in reversed(slots)}
    bindings = zip(layout.owner_modules, layout.owner_names, layout.owner_slots, strict=True)
    expected = {}
    for slot in slots:
        for owner, name in slot.owners:
            expected.setdefault((id(owner), name), (owner, name, first[id(slot.param)]))
    assert [(owner, name, slots[i]) for owner, name, i in bindings] == list(expected.values())
    assert len(layout.owner_slots) == 3  # layer 1's weight, the shared weight and bias
    assert memory.stage_layout(range(3, 4)).owner_slots == (0, 1)  # the alias alone: its own
    # A plan that changes every call caches new layouts every call; each adds only a few objects
    # the garbage collector tracks (the layout and its tuples of modules, parameters, slots), so
    # they do not set off full collections (see StageLayout).
    gc.collect()
    gc.collect()  # a tuple is untracked once its items are: nested ones take two passes
    tracked = [o for o in gc.get_referents(layout) if gc.is_tracked(o) and not isinstance(o, type)]
    assert len(tracked) <= 3, [type(o).__name__ for o in tracked]
    # Unfreezing is seen at once (requires_grad is asked per upload, not cached).
    layers[1].weight.requires_grad_(True)
    assert layout.frozen() == ()
    deep = ModelMemory([nn.Linear(2, 2) for _ in range(8)], "off")
    hot = deep.stage_layout(range(0, 8))
    for start in range(8):  # 36 ranges, more than the 32 kept
        for stop in range(start + 1, 9):
            deep.stage_layout(range(start, stop))
            assert len(deep._stage_layouts) <= 32
            assert deep.stage_layout(range(0, 8)) is hot  # used all along: never evicted
    assert deep.stage_layout(range(7, 8)).layers == range(7, 8)
    cold = deep.stage_layout(range(0, 1))
    for start in range(8):  # the 35 other ranges: the 4 not kept evict the least recent ones
        for stop in range(start + 1, 9):
            if (start, stop) != (0, 1):
                deep.stage_layout(range(start, stop))
    assert deep.stage_layout(range(0, 1)) is not cold  # the least recently used went first


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_at_most_two_stages_are_resident_at_once(
    grain: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The running stage and the prefetched next one, never more: a stage's buffers are freed
    before the upload after next is allocated (what ``model_memory_limit / 2`` per stage rests
    on), in forward, fused and backward stages, with either recompute grain."""
    import weakref

    from roundpipe import RoundPipe, RoundPipeRunConfig
    from roundpipe.call import pipeline

    alive: weakref.WeakSet[pipeline.ResidentStage] = weakref.WeakSet()
    init = pipeline.ResidentStage.__init__

    def tracked(self: pipeline.ResidentStage, *args: object, **kwargs: object) -> None:
        init(self, *args, **kwargs)  # type: ignore[arg-type]
        alive.add(self)

    monkeypatch.setattr(pipeline.ResidentStage, "__init__", tracked)
    seen: list[int] = []

    class Counts(nn.Linear):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen.append(len(alive))
            return super().forward(x)

    torch.manual_seed(0)
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=2)
    model = RoundPipe(nn.Sequential(*[Counts(4, 4) for _ in range(6)]))
    plan = roundpipe.ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(5)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(6))]
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan, recompute_grain=grain)
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    model.forward_backward(
        input_args=(x,),
        label=y,
        loss_fn=lambda out, label: ((out - label) ** 2).mean(),
        run_config=config,
    )
    train = roundpipe.ModelExecutePlan()
    train.fwd_plan = [range(i, i + 1) for i in range(6)]
    train.bwd_plan = plan.bwd_plan
    model(
        x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, execute_plan=train)
    ).sum().backward()
    model.synchronize()
    assert len(seen) > 24 and max(seen) == 2, seen
