"""The native helpers of the pipeline's hot path (csrc/bindings/dispatch.cpp) against the PyTorch
calls they replace: ``_C.backward`` for ``torch.autograd.backward``, ``_C.typed_views`` for
``roundpipe.memory.typed_view``; and the copy engine's small copies on virtual CPU devices, run on
the calling thread when its worker is idle and on the worker otherwise."""

from __future__ import annotations

import threading
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
        torch.testing.assert_close(view, expected, rtol=0, atol=0)
        if like.numel():
            assert view.data_ptr() == buffer.data_ptr() + offset - 16


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
    failed = _C.copy_async(0, torch.zeros(2, 4), torch.ones(8), "activation")  # not broadcastable
    ok = _C.copy_async(0, torch.zeros(4), torch.ones(4), "activation")
    assert ok.query()
    with pytest.raises(RuntimeError):
        failed.synchronize()
