"""The runtime on CUDA devices against plain PyTorch on the same GPU (or, where the semantics are
RoundPipe's own, against the same run on virtual CPU devices).

Skipped without CUDA; run them on a GPU machine after building with CUDA
(``bash benchmarks/gpu/run.sh build test``). Besides the equivalence tests, a few are aimed at the
findings of the CUDA review: a race amplifier (GPU-side sleeps let the host run ahead), RNG replay
through ``save_for_recompute``, hidden host synchronisations (``set_sync_debug_mode("error")``),
GPU memory that must stay flat over asynchronous steps, and an overlap smoke test.
"""

from __future__ import annotations

import copy
import gc
import mmap
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import roundpipe
import torch
from roundpipe import ModelExecutePlan, RoundPipe, RoundPipeRunConfig
from roundpipe._native import _C
from torch import nn

pytestmark = pytest.mark.requires_cuda

PIN_MODES = ["alloc", "register", "off"]


@pytest.fixture(autouse=True)
def on_cuda() -> Iterator[None]:
    """Every test here runs on the CUDA devices; the registry is restored afterwards."""
    previous_kind, previous_count = roundpipe.device_kind(), roundpipe.device_count()
    roundpipe.configure_devices(kind="cuda")
    try:
        yield
    finally:
        if previous_kind == "cpu":
            roundpipe.configure_devices(kind="cpu", num_cpu_devices=previous_count)
        else:
            roundpipe.configure_devices(kind="cuda")


def mlp(
    seed: int = 0, width: int = 32, layers: int = 6, dtype: torch.dtype = torch.float32
) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(layers)]
    ).to(dtype)


def mse(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    return ((output.float() - label.to(output.device).float()) ** 2).sum()


def per_layer_plan(layers: int) -> ModelExecutePlan:
    """One layer per stage for ``forward_backward``: the most stages, uploads and hand-offs."""
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(layers - 1)]
    plan.bwd_plan = [range(i, i + 1) for i in reversed(range(layers))]
    return plan


def plain_on_gpu(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, n: int, loss_fn: Callable = mse
) -> torch.Tensor:
    """The per-microbatch loop that defines ``forward_backward``, on the GPU."""
    total = torch.zeros((), device="cuda")
    for xm, ym in zip(x.cuda().tensor_split(n), y.cuda().tensor_split(n), strict=True):
        loss = loss_fn(model(xm), ym)
        loss.backward()
        total += loss.detach().float()
    return total.cpu()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    expected = expected.detach().double().cpu()
    return float(
        (actual.detach().double().cpu() - expected).norm() / expected.norm().clamp_min(1e-30)
    )


def assert_grads_close(model: nn.Module, reference: nn.Module, bound: float = 1e-5) -> None:
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert p.grad is not None, name
        assert relative_error(p.grad, q.grad) < bound, name


def assert_params_close(model: nn.Module, reference: nn.Module, bound: float) -> None:
    for (name, p), (_, q) in zip(
        model.named_parameters(), reference.named_parameters(), strict=True
    ):
        assert relative_error(p, q) < bound, name


@pytest.mark.parametrize("grain", ["stage", "layer"])
@pytest.mark.parametrize("pin_model", PIN_MODES)
def test_forward_backward_on_cuda_matches_pytorch(grain: str, pin_model: str) -> None:
    reference = mlp().cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu(), pin_model=pin_model)
    for param in model.model.parameters():
        assert param.is_pinned() == (pin_model != "off")
    x, y = torch.randn(10, 32), torch.randn(10, 32)
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    expected = plain_on_gpu(reference, x, y, 3)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(model.model, reference)


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recomputed_segments_backpropagate_on_the_calling_thread_on_cuda(grain: str) -> None:
    """On a GPU a recomputed segment's graph is torch's own nodes on the device's current stream:
    its backward runs on the calling thread (csrc/torch_internals/), not on the
    engine's device thread, and the gradients are plain PyTorch's on the GPU."""
    if not _C.local_backward_enabled():
        pytest.skip(
            "passes on the calling thread are off here (no graph exec groups in this torch, a "
            "torch release they were not checked on, or ROUNDPIPE_LOCAL_BACKWARD=0)"
        )
    reference = mlp().cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    x, y = torch.randn(10, 32), torch.randn(10, 32)
    config = RoundPipeRunConfig(num_microbatch=3, recompute_grain=grain)
    here, engine = _C.backward_counts()
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    ran_here, ran_in_engine = _C.backward_counts()
    assert ran_here > here and ran_in_engine == engine
    torch.testing.assert_close(loss, plain_on_gpu(reference, x, y, 3), rtol=1e-5, atol=1e-5)
    assert_grads_close(model.model, reference)


def test_forward_then_backward_and_chaining_on_cuda() -> None:
    first_ref, second_ref = mlp(1).cuda(), mlp(2).cuda()
    first = RoundPipe(copy.deepcopy(first_ref).cpu())
    second = RoundPipe(copy.deepcopy(second_ref).cpu())
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    packed = first(x, roundpipe_run_config=RoundPipeRunConfig(num_microbatch=2, merge_output=False))
    second.forward_backward(
        input_args=(packed,), label=y, loss_fn=mse, run_config=RoundPipeRunConfig(num_microbatch=2)
    )
    first.synchronize()
    second.synchronize()
    plain_on_gpu(nn.Sequential(first_ref, second_ref), x, y, 2)
    for model, reference in ((first, first_ref), (second, second_ref)):
        assert_grads_close(model.model, reference)


@pytest.mark.parametrize(("dtype", "bound"), [(torch.bfloat16, 2e-2), (torch.float16, 5e-3)])
def test_half_precision_gradients_match_pytorch_on_the_gpu(
    dtype: torch.dtype, bound: float
) -> None:
    reference = mlp(3, width=64, dtype=dtype).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu(), optim_dtype=torch.float32)
    x, y = torch.randn(12, 64, dtype=dtype), torch.randn(12, 64, dtype=dtype)
    config = RoundPipeRunConfig(num_microbatch=3)
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    expected = plain_on_gpu(reference, x, y, 3)
    assert relative_error(loss, expected) < bound
    assert all(p.dtype == dtype for p in model.model.parameters())
    assert_grads_close(model.model, reference, bound)


class TiedLM(nn.Sequential):
    """Embedding and head share one weight across the first and the last layer."""

    def __init__(self, vocab: int = 50, width: int = 32) -> None:
        torch.manual_seed(4)
        embedding = nn.Embedding(vocab, width)
        head = nn.Linear(width, vocab, bias=False)
        head.weight = embedding.weight
        super().__init__(embedding, nn.Sequential(nn.Linear(width, width), nn.Tanh()), head)


def test_tied_weights_get_the_sum_of_both_uses_and_stay_tied() -> None:
    reference = TiedLM().cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    tokens = torch.randint(0, 50, (6, 5))
    labels = torch.randint(0, 50, (6, 5))

    def ce(logits: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.flatten(0, 1), label.to(logits.device).flatten())

    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=per_layer_plan(3))
    model.forward_backward(input_args=(tokens,), label=labels, loss_fn=ce, run_config=config)
    model.synchronize()
    plain_on_gpu(reference, tokens, labels, 2, ce)
    assert model.model[0].weight is model.model[2].weight
    assert_grads_close(model.model, reference)
    optimizer = torch.optim.SGD(model.optim_parameters(), lr=0.5)
    model.step(lambda: (optimizer.step(), optimizer.zero_grad()), is_async=False)
    assert torch.equal(model.model[0].weight, model.model[2].weight)
    with torch.no_grad():
        for p in reference.parameters():
            p -= 0.5 * p.grad
    assert_params_close(model.model, reference, 1e-5)


class MaskDropout(nn.Module):
    """Dropout drawing its mask with ``torch.rand_like``; records forward masks, or replays."""

    def __init__(self, p: float = 0.5) -> None:
        super().__init__()
        self.p = p
        self.masks: list[torch.Tensor] = []
        self.replay: list[torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.replay is not None:
            mask = self.replay.pop(0)
        else:
            mask = (torch.rand_like(x) >= self.p).to(x.dtype) / (1 - self.p)
            if not roundpipe.doing_recompute():
                self.masks.append(mask.detach().clone())
        return x * mask


@pytest.mark.parametrize("grain", ["stage", "layer"])
def test_recompute_replays_dropout_masks_on_cuda(grain: str) -> None:
    torch.manual_seed(6)
    layers = [nn.Sequential(nn.Linear(32, 32), MaskDropout(), nn.Tanh()) for _ in range(5)]
    reference = nn.Sequential(*layers).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    x, y = torch.randn(9, 32), torch.randn(9, 32)
    config = RoundPipeRunConfig(
        num_microbatch=3, recompute_grain=grain, execute_plan=per_layer_plan(5)
    )
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    recorded = [m for m in model.model.modules() if isinstance(m, MaskDropout)]
    replays = [m for m in reference.modules() if isinstance(m, MaskDropout)]
    for source, target in zip(recorded, replays, strict=True):
        assert len(source.masks) == 3  # one forward per microbatch, none from recompute
        target.replay = [mask.cuda() for mask in source.masks]
    plain_on_gpu(reference, x, y, 3)
    assert_grads_close(model.model, reference)


def test_output_device_on_cuda_then_backward_matches_pytorch() -> None:
    reference = mlp(7).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    x, y = torch.randn(8, 32), torch.randn(8, 32).cuda()
    config = RoundPipeRunConfig(num_microbatch=4, output_device="cuda:0")
    out = model(x, roundpipe_run_config=config)
    assert out.device == torch.device("cuda", 0)
    expected = reference(x.cuda())
    assert relative_error(out, expected) < 1e-5
    mse(out, y).backward()
    mse(expected, y).backward()
    model.synchronize()
    assert_grads_close(model.model, reference)


class Boom(nn.Linear):
    """Raises inside a CUDA stage when armed, in forward or only in recompute."""

    def __init__(self) -> None:
        super().__init__(32, 32)
        self.armed: str | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed == "forward" or (self.armed == "recompute" and roundpipe.doing_recompute()):
            raise ValueError("boom")
        return super().forward(x)


@pytest.mark.parametrize("phase", ["forward", "recompute"])
def test_failure_inside_a_cuda_stage_names_it_and_leaves_the_model_usable(phase: str) -> None:
    torch.manual_seed(8)
    reference = nn.Sequential(nn.Linear(32, 32), Boom(), nn.Tanh(), nn.Linear(32, 32)).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu(), name="gpu-boom")
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=per_layer_plan(4))
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_on_gpu(reference, x, y, 2)
    model.model[1].armed = phase
    with pytest.raises(ValueError, match=rf"'gpu-boom': layer 1 \(Boom\) failed in {phase}"):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.model[1].armed = None
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    plain_on_gpu(reference, x, y, 2)
    model.synchronize()
    assert_grads_close(model.model, reference)


class Sleepy(nn.Module):
    """A layer whose kernels wait on the GPU first, so the host runs ahead of the device."""

    def __init__(self, width: int, cycles: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            torch.cuda._sleep(self.cycles)
        return torch.tanh(self.linear(x))


def sleepy_model(cycles: int, layers: int = 6, width: int = 256) -> nn.Sequential:
    torch.manual_seed(9)
    return nn.Sequential(*[Sleepy(width, cycles) for _ in range(layers)])


def test_race_amplifier_synchronous_steps_match_pytorch() -> None:
    """GPU-side sleeps keep the device behind the host: uploads, activation copies and buffer
    reuse across >= 4 stages must still be ordered. Synchronous SGD steps vs plain PyTorch."""
    reference = sleepy_model(cycles=20_000_000).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    ours = torch.optim.SGD(model.optim_parameters(), lr=1e-3)
    theirs = torch.optim.SGD(reference.parameters(), lr=1e-3)
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=per_layer_plan(6))
    torch.manual_seed(10)
    for _ in range(4):
        x, y = torch.randn(12, 256), torch.randn(12, 256)
        loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
        expected = plain_on_gpu(reference, x, y, 3)
        theirs.step()
        theirs.zero_grad()
        assert relative_error(loss, expected) < 1e-4
        assert_params_close(model.model, reference, 1e-5)


def train_async(
    net: nn.Sequential, steps: int, config: RoundPipeRunConfig, pin_model: str = "alloc"
) -> nn.Sequential:
    """``steps`` iterations with asynchronous Adam steps; the synchronised model afterwards."""
    model = RoundPipe(net, optim_dtype=torch.float32, pin_model=pin_model)
    optimizer = roundpipe.optim.Adam(model.optim_parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(11)
    dtype = next(net.parameters()).dtype
    for _ in range(steps):
        x = torch.randn(12, 256, generator=generator).to(dtype)
        y = torch.randn(12, 256, generator=generator).to(dtype)
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        model.step(lambda: (optimizer.step(), optimizer.zero_grad()))
    model.synchronize()
    return model.model


def on_cpu_devices(run: Callable[[], nn.Sequential]) -> nn.Sequential:
    """``run()`` on one virtual CPU device: the same semantics (staleness one), no GPU."""
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=1)
    try:
        return run()
    finally:
        roundpipe.configure_devices(kind="cuda")


def test_race_amplifier_asynchronous_steps_match_cpu_devices() -> None:
    """The same amplifier with asynchronous steps (finding 10: the arena written during uploads)."""
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=per_layer_plan(6))
    expected = on_cpu_devices(lambda: train_async(sleepy_model(0), 5, config))
    trained = train_async(sleepy_model(20_000_000), 5, config)
    assert_params_close(trained, expected, 1e-4)


class Noisy(nn.Linear):
    """Multiplies by a ``torch.rand_like`` draw saved with ``save_for_recompute``; in recompute it
    draws again and records both, so the test can check that the RNG replayed the same values."""

    def __init__(self) -> None:
        super().__init__(32, 32)
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.forward_draws: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)
        if roundpipe.doing_recompute():
            (saved,) = roundpipe.get_recompute_data()
            self.pairs.append((saved.detach().clone(), noise.detach().clone()))
        else:
            roundpipe.save_for_recompute(noise)
            self.forward_draws.append(noise.detach().clone())
        return super().forward(x * noise)


def test_rng_replay_through_save_for_recompute() -> None:
    torch.manual_seed(12)
    model = RoundPipe(nn.Sequential(Noisy(), Noisy(), nn.Linear(32, 32)))
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    config = RoundPipeRunConfig(num_microbatch=4, execute_plan=per_layer_plan(3))
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    for layer in (model.model[0], model.model[1]):
        assert len(layer.forward_draws) == 4 and len(layer.pairs) == 4
        drawn = [d.cpu() for d in layer.forward_draws]
        for saved, redrawn in layer.pairs:
            assert torch.equal(redrawn.cpu(), saved.cpu())  # the RNG replayed the same draw
            # the saved tensor arrived intact (recompute may visit microbatches in any order)
            assert sum(torch.equal(saved.cpu(), d) for d in drawn) == 1


class WithBuffer(nn.Module):
    """Layer 0 of the sync test: reads a buffer (like a rotary embedding's ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 32))
        self.linear = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x * self.scale)


def test_pipeline_makes_no_hidden_host_synchronisation() -> None:
    torch.manual_seed(13)
    reference = nn.Sequential(WithBuffer(), nn.Tanh(), nn.Linear(32, 32), nn.Linear(32, 32)).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    x, y = torch.randn(9, 32), torch.randn(9, 32).cuda()
    config = RoundPipeRunConfig(num_microbatch=3, output_device="cuda:0")
    with torch.no_grad():  # warm-up: allocations and threads start outside the check
        model(x, roundpipe_run_config=config)
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = model(x, roundpipe_run_config=config)
        mse(out, y).backward()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    model.synchronize()
    for xm, ym in zip(x.cuda().tensor_split(3), y.tensor_split(3), strict=True):
        mse(reference(xm), ym).backward()
    assert_grads_close(model.model, reference)


@pytest.mark.parametrize("pin_model", PIN_MODES)
def test_bf16_async_steps_keep_gpu_memory_flat_and_match_cpu_devices(pin_model: str) -> None:
    torch.manual_seed(14)
    net = nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.GELU()) for _ in range(6)])
    net = net.bfloat16()
    config = RoundPipeRunConfig(num_microbatch=3)
    expected = on_cpu_devices(lambda: train_async(copy.deepcopy(net), 6, config, pin_model="off"))

    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    train_async(copy.deepcopy(net), 2, config, pin_model)  # warm-up: caches settle
    torch.cuda.reset_peak_memory_stats()
    train_async(copy.deepcopy(net), 2, config, pin_model)
    two_steps_peak = torch.cuda.max_memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trained = train_async(copy.deepcopy(net), 6, config, pin_model)
    six_steps_peak = torch.cuda.max_memory_allocated()
    gc.collect()  # the RoundPipe objects of the runs above
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated()
    # nothing grows per iteration
    assert six_steps_peak <= two_steps_peak * 1.05 + 2**20, (
        f"peak GPU memory over 6 steps {six_steps_peak / 2**20:.1f} MiB, over 2 steps "
        f"{two_steps_peak / 2**20:.1f} MiB (allowed: 5% + 1 MiB more)"
    )
    # and nothing stays behind
    assert left <= baseline + 2**20, (
        f"GPU memory after the runs and gc.collect(): {left / 2**20:.1f} MiB, "
        f"{(left - baseline) / 2**20:.1f} MiB more than before them (allowed: 1 MiB)"
    )
    assert all(p.dtype == torch.bfloat16 for p in trained.parameters())
    assert_params_close(trained, expected, 2e-2)


def cuda_seconds(run: Callable[[], object]) -> float:
    """Best of three wall times of ``run()`` up to the GPU finishing its work."""
    best = float("inf")
    for _ in range(3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


@pytest.mark.parametrize("pin_model", ["alloc", "off"])
def test_uploads_overlap_compute(pin_model: str) -> None:
    """Smoke test, not a benchmark: with upload time per stage about equal to compute time, the
    pipelined forward must beat doing both back to back by a wide margin (the bound is loose)."""
    layers, width = 8, 4096  # 64 MiB of fp32 weights per layer
    plan = ModelExecutePlan()
    plan.fwd_plan = [range(i, i + 1) for i in range(layers)]  # one upload per layer
    config = RoundPipeRunConfig(num_microbatch=1, output_device="cuda:0", execute_plan=plan)
    x = torch.randn(4, width)

    def forward_of(cycles: int) -> Callable[[], object]:
        torch.manual_seed(15)
        model = RoundPipe(
            nn.Sequential(*[Sleepy(width, cycles) for _ in range(layers)]), pin_model=pin_model
        )

        def run() -> object:
            with torch.no_grad():
                return model(x, roundpipe_run_config=config)

        return run

    upload_only = cuda_seconds(forward_of(0))
    cycles_per_second = 1e7 / cuda_seconds(lambda: torch.cuda._sleep(10_000_000))
    cycles = int(cycles_per_second * upload_only / layers)
    compute_only = cuda_seconds(lambda: [torch.cuda._sleep(cycles) for _ in range(layers)])
    both = cuda_seconds(forward_of(cycles))
    ratio = both / (upload_only + compute_only)
    assert ratio < 0.85, (
        f"pipelined forward {both:.3f} s against uploads alone {upload_only:.3f} s + compute "
        f"alone {compute_only:.3f} s: {ratio:.2f}x their sum (bound 0.85x)"
    )


class OnCurrentDevice(nn.Linear):
    """Adds a tensor made on the *current* CUDA device (as Triton kernels and ``device="cuda"``
    factories do) and records which device was current."""

    def __init__(self) -> None:
        super().__init__(32, 32)
        self.seen: list[tuple[int, int | None]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((torch.cuda.current_device(), x.device.index))
        return super().forward(x) + torch.zeros(32, device="cuda")


def test_stage_compute_runs_with_its_device_current() -> None:
    """Finding 3 (meaningful with 2+ GPUs; on one the current device is always right)."""
    torch.manual_seed(17)
    reference = nn.Sequential(*[OnCurrentDevice() for _ in range(4)]).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    config = RoundPipeRunConfig(num_microbatch=2, execute_plan=per_layer_plan(4))
    loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
    model.synchronize()
    expected = plain_on_gpu(reference, x, y, 2)
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
    assert_grads_close(model.model, reference)
    for layer in model.model:
        assert layer.seen and all(current == device for current, device in layer.seen)


def test_batchnorm_buffers_advance_as_in_pytorch() -> None:
    """Finding 4: buffers bound and written back asynchronously, read back by recompute."""
    torch.manual_seed(18)
    reference = nn.Sequential(
        nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 32), nn.BatchNorm1d(32)
    ).cuda()
    model = RoundPipe(copy.deepcopy(reference).cpu())
    config = RoundPipeRunConfig(num_microbatch=3, execute_plan=per_layer_plan(5))
    for _ in range(3):
        x, y = torch.randn(12, 32), torch.randn(12, 32)
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
        plain_on_gpu(reference, x, y, 3)
    model.synchronize()
    for (name, ours), (_, theirs) in zip(
        model.model.named_buffers(), reference.named_buffers(), strict=True
    ):
        assert ours.device.type == "cpu", name
        torch.testing.assert_close(ours, theirs.cpu(), rtol=1e-5, atol=1e-6)
    assert_grads_close(model.model, reference)


def test_layers_are_timed_on_cuda() -> None:
    """Finding 9: the timer gets device times; a slow layer shows up as slow."""
    torch.manual_seed(19)
    layers = [Sleepy(256, 20_000_000 if i == 2 else 0) for i in range(4)]
    model = RoundPipe(nn.Sequential(*layers))
    x, y = torch.randn(6, 256), torch.randn(6, 256)
    for _ in range(2):
        model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.synchronize()
    torch.cuda.synchronize()
    timer = model._runtime.timer
    timer.collect()
    forward = [timer.estimate(i, "fwd") for i in range(4)]
    assert all(seconds is not None and seconds > 0 for seconds in forward), forward
    others = max(s for i, s in enumerate(forward) if i != 2 and s is not None)
    assert forward[2] is not None and forward[2] > 5 * others, forward
    assert all(timer.estimate(i, "bwd") is not None for i in range(4))


def test_gradient_arenas_are_pageable_and_downloads_use_exact_pinned_staging() -> None:
    """Finding 8."""
    from roundpipe._native import _C

    model = RoundPipe(mlp())
    x, y = torch.randn(6, 32), torch.randn(6, 32)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.step(lambda: None)
    model.forward_backward(input_args=(x,), label=y, loss_fn=mse)
    model.synchronize()
    memory = model._runtime.memory
    assert not _C.is_page_locked(memory.grads)
    staging = memory.download_staging()
    assert _C.is_page_locked(staging) and staging.numel() == memory.grads.numel()


@pytest.mark.parametrize("logical_devices", [0, 3], ids=["per-gpu", "3-logical"])
def test_pageable_uploads_larger_than_the_bounce_ring_match_pytorch(logical_devices: int) -> None:
    """pin_model="off" stages of 3 x 12 MiB, more than the engine's 4 x 8 MiB of bounce buffers,
    so each upload wraps the ring and reuses buffers whose previous DMA must have drained first;
    the GPU sleeps in every layer (the host runs ahead) and synchronous SGD steps change the
    parameters between calls. Compared with plain PyTorch."""
    torch.manual_seed(18)
    reference = nn.Sequential(*[Sleepy(1792, 5_000_000) for _ in range(6)]).cuda()
    roundpipe.configure_devices(kind="cuda", num_cuda_devices=logical_devices)
    try:
        model = RoundPipe(copy.deepcopy(reference).cpu(), pin_model="off")
        assert not any(p.is_pinned() for p in model.model.parameters())
        ours = torch.optim.SGD(model.optim_parameters(), lr=1e-3)
        theirs = torch.optim.SGD(reference.parameters(), lr=1e-3)
        plan = ModelExecutePlan()
        plan.fwd_plan = [range(0, 3)]
        plan.bwd_plan = [range(3, 6), range(0, 3)]
        config = RoundPipeRunConfig(num_microbatch=2, execute_plan=plan)
        torch.manual_seed(19)
        for _ in range(3):
            x, y = torch.randn(4, 1792), torch.randn(4, 1792)
            loss = model.forward_backward(input_args=(x,), label=y, loss_fn=mse, run_config=config)
            model.step(lambda: (ours.step(), ours.zero_grad()), is_async=False)
            expected = plain_on_gpu(reference, x, y, 2)
            theirs.step()
            theirs.zero_grad()
            assert relative_error(loss, expected) < 1e-4
            assert_params_close(model.model, reference, 1e-5)
    finally:
        roundpipe.configure_devices(kind="cuda", num_cuda_devices=0)


def test_pageable_upload_does_not_block_the_calling_thread() -> None:
    """Finding 6: a pageable upload (pin_model="off") is issued by the copy engine's worker. Queued
    behind a second of GPU work on the compute stream, with 40 MiB in pieces that wrap the bounce
    ring (so the worker itself must wait for the GPU), the call returns at once and the copy
    lands intact afterwards."""
    generator = torch.Generator().manual_seed(21)
    sizes = [17 << 20, 3, 23 << 20]  # odd sizes: pieces straddle bounce buffers
    sources = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=generator) for n in sizes]
    targets = [torch.zeros(n, dtype=torch.uint8, device="cuda:0") for n in sizes]
    cycles_per_second = 1e7 / cuda_seconds(lambda: torch.cuda._sleep(10_000_000))
    torch.cuda.synchronize()
    start = time.perf_counter()
    torch.cuda._sleep(int(cycles_per_second * 1.0))
    done = _C.upload_pageable(0, targets, sources)
    issued = time.perf_counter() - start
    assert issued < 0.3, f"upload_pageable returned after {issued:.3f} s (bound 0.3 s)"
    assert not done.query(), "the upload completed before the GPU's 1 s sleep ended"
    done.synchronize()
    for target, source in zip(targets, sources, strict=True):
        assert torch.equal(target.cpu(), source)


def test_a_wait_on_an_event_is_not_held_up_by_an_earlier_slower_one() -> None:
    """A host wait on a CUDA event is notified by a host function queued behind the event on a
    private stream; a wait queued after one on a slower event (another stream) returns when its
    own event completes, not when the slower one does."""
    cycles_per_second = 1e7 / cuda_seconds(lambda: torch.cuda._sleep(10_000_000))
    slow_stream, fast_stream = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(slow_stream):
        torch.cuda._sleep(int(cycles_per_second * 3.0))
        slow = _C.record_event(0)
    waiter = threading.Thread(target=slow.synchronize)
    waiter.start()
    time.sleep(0.2)  # its host notification is queued
    with torch.cuda.stream(fast_stream):
        torch.cuda._sleep(int(cycles_per_second * 0.3))
        fast = _C.record_event(0)
    start = time.perf_counter()
    fast.synchronize()
    waited = time.perf_counter() - start
    slow_running = not slow.query()
    waiter.join(30)
    assert slow_running, "the 3 s event completed before the 0.3 s one was waited for"
    assert waited < 1.5, (
        f"a wait for an event 0.3 s away took {waited:.2f} s behind a wait for one 3 s away"
    )


def test_small_arenas_page_locked_in_place_have_pages_of_their_own() -> None:
    """pin_model="register" page-locks whole pages: two small arenas must not share one, or the
    driver refuses the second registration (cudaErrorHostMemoryAlreadyRegistered)."""
    sizes = [1, 3, 64, 100, mmap.PAGESIZE - 1, mmap.PAGESIZE, mmap.PAGESIZE + 1]
    arenas = [_C.allocate_host_arena(n, "register") for n in sizes]
    arenas += [_C.allocate_host_arena(n, "register", zero=False) for n in sizes]
    for arena, size in zip(arenas, sizes * 2, strict=True):
        assert arena.numel() == size
        assert _C.is_page_locked(arena)
        assert arena.data_ptr() % mmap.PAGESIZE == 0
    assert all(int(arena.count_nonzero()) == 0 for arena in arenas[: len(sizes)])
    del arenas[::2]  # unregistered and unmapped; new ones may take their pages
    arenas += [_C.allocate_host_arena(n, "register") for n in sizes]
    assert all(_C.is_page_locked(arena) for arena in arenas)
    pages = [arena.data_ptr() // mmap.PAGESIZE for arena in arenas]
    assert len(set(pages)) == len(pages)


def test_parameter_hooks_on_summed_gradients_run_with_their_stages_device_current() -> None:
    """The backward of a forward() runs a parameter's hooks once, on its summed gradient, at the
    end of the parameter's stage, with that stage's device current (meaningful with 2+ GPUs;
    on one the current device is always right) and as plain PyTorch runs them."""
    seen: list[tuple[int, int | None]] = []

    def hooked(record: bool) -> nn.Sequential:
        net = mlp(21, layers=4)
        for layer in net:
            if record:
                layer[0].weight.register_hook(
                    lambda g: (seen.append((torch.cuda.current_device(), g.device.index)), g * 2)[1]
                )
            else:
                layer[0].weight.register_hook(lambda g: g * 2)
        return net

    reference = hooked(record=False).cuda()
    model = RoundPipe(hooked(record=True))
    x, y = torch.randn(8, 32), torch.randn(8, 32)
    config = RoundPipeRunConfig(num_microbatch=2)
    mse(model(x, roundpipe_run_config=config), y).backward()
    model.synchronize()
    plain_on_gpu(reference, x, y, 2)
    assert seen and all(current == device for current, device in seen), seen
    assert_grads_close(model.model, reference)
