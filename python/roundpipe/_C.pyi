# Typed surface of the compiled core; tests/test_package.py keeps it true.

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any, overload

import torch
from torch import Generator, Tensor
from torch.nn import Module

def build_info() -> dict[str, object]: ...
def configure_devices(
    kind: str | None = None,
    num_cpu_devices: int | None = None,
    num_cuda_devices: int | None = None,
) -> None: ...
def device_kind() -> str: ...
def device_count() -> int: ...
def device_physical_index(index: int) -> int: ...
def cuda_logical_devices() -> int: ...
def device_total_memory(index: int) -> int: ...

# Runtime: host arenas, events and the per-device copy engines (lane: activation | gradient |
# parameter, in priority order).
# Waits on an Event release the GIL and can be interrupted with Ctrl-C (KeyboardInterrupt).
# After os.fork() the child starts fresh native workers on first use; waiting there on an event
# that was unfinished in the parent at fork time raises RuntimeError.
class Event:
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def block_current_stream(self, device_index: int) -> None: ...

def record_event(device_index: int) -> Event: ...
def copy_async(
    device_index: int, dst: Tensor, src: Tensor, lane: str, after: Event | None = None
) -> Event: ...

# CUDA only: dsts[i] (device) <- srcs[i] (pageable host), contiguous uint8 pairs, staged through
# the engine's page-locked bounce buffers on its worker (pin_model="off" uploads).
def upload_pageable(
    device_index: int, dsts: list[Tensor], srcs: list[Tensor], after: Event | None = None
) -> Event: ...

# staging: on CUDA, a page-locked host tensor of src's dtype and numel (a view of an
# allocate_pinned_staging() buffer) that the download goes through instead of torch's caching
# host allocator; not to be reused before the returned event completed. Ignored on CPU devices.
def accumulate_async(
    device_index: int,
    dst: Tensor,
    src: Tensor,
    after: Event | None = None,
    staging: Tensor | None = None,
) -> Event: ...
def set_inline_copy_bytes(bytes: int) -> None: ...
def inline_copy_bytes() -> int: ...
def submit_optimizer_job(job: Callable[[], object]) -> Event: ...
def writeback_async(dsts: list[Tensor], srcs: list[Tensor]) -> Event: ...

# True once every native worker ran the jobs queued before the call; False if timeout_s passed
# first (the jobs still run). Ctrl-C interrupts the wait (KeyboardInterrupt).
def drain_workers(timeout_s: float | None = None) -> bool: ...
def note_fork_interrupt(interrupted: bool) -> None: ...
def fork_interrupted() -> bool: ...
def raise_fork_interrupt() -> None: ...

# pin_model "alloc" | "register" pin on CUDA; "off" is pageable on every device kind (for arenas
# no DMA touches, e.g. gradients). zero=False skips the zero fill (an arena the caller overwrites).
def allocate_host_arena(bytes: int, pin_model: str, *, zero: bool = True) -> Tensor: ...

# Exactly `bytes` bytes (no power-of-two rounding), uninitialised, page-locked (portable) when
# CUDA devices are in use, pageable otherwise: staging for device-to-host downloads.
def allocate_pinned_staging(bytes: int) -> Tensor: ...
def is_page_locked(tensor: Tensor) -> bool: ...

# Zeroes a contiguous CPU tensor; the whole pages it covers in a pageable arena of 1 MiB or more
# (its own mapping) are handed back to the OS instead, reading as zero when next touched.
def zero_host_memory(tensor: Tensor) -> None: ...

# glibc's malloc_trim(0): the C heap's free memory back to the OS; False where unsupported.
def trim_host_heap() -> bool: ...

# Planner (csrc/scheduler/scheduler.h). profiles: per model (forward_seconds, recompute_seconds,
# backward_seconds, forward_bytes, backward_bytes). Returns {"plans": [(forward, backward)] with
# (begin, end) pairs, "phases": [{"num_stages", "largest_stage_seconds", "objective",
# "predicted_seconds", "tied_plans"}], "objective": float, "predicted_seconds": float}.
def plan_stages(
    run_type: str,
    profiles: list[tuple[list[float], list[float], list[float], list[float], list[float]]],
    min_stages: int,
    upper_threshold: float,
    stage_memory_cap: float,
    num_devices: int,
    num_microbatches: int,
    upload_bytes_per_second: float = 0.0,
) -> dict[str, object]: ...

# Simulator (csrc/scheduler/simulator.h): (makespan, [(stage, microbatch, device, start, end)]).
def simulate_schedule(
    stage_seconds: list[float],
    num_devices: int,
    num_microbatches: int,
    upload_seconds: list[float] | None = None,
) -> tuple[float, list[tuple[int, int, int, float, float]]]: ...

# Host optimizer kernels (csrc/optim, csrc/optim/host_ops.cpp). Tensors are CPU and contiguous;
# master weights float32; moments float32, bfloat16, or 8-bit codes (int8 exp_avgs, uint8
# exp_avg_sqs) with float32 scales, one per state_block elements; grads float32/bfloat16/float16;
# lowp_params bfloat16/float16. num_threads=None uses optimizer_threads().
def adam_step(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    max_exp_avg_sqs: list[Tensor] | None,
    steps: list[Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    amsgrad: bool,
    maximize: bool,
    decoupled_weight_decay: bool,
    grad_scale_inv: float = 1.0,
    lowp_params: list[Tensor | None] | None = None,
    num_threads: int | None = None,
    exp_avg_scales: list[Tensor] | None = None,
    exp_avg_sq_scales: list[Tensor] | None = None,
) -> None: ...
def adam_step_streamed(
    files: list[tuple[int, str]],
    regions: list[list[int]],
    grads: list[Tensor],
    steps: list[Tensor],
    lowp_params: list[Tensor | None],
    *,
    state_dtype: torch.dtype,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    maximize: bool,
    decoupled_weight_decay: bool,
    grad_scale_inv: float,
    chunk_elements: int,
    buffers: int,
    io_threads: int,
    num_threads: int | None = None,
) -> tuple[int, int, float, float, list[tuple[bool, int, int, int]]]: ...
def disk_grain() -> int: ...
def disk_align() -> int: ...
def map_file_region(fd: int, path: str, offset: int, nbytes: int) -> Tensor: ...
def state_block() -> int: ...
def quantize_moment(
    is_exp_avg: bool, values: Tensor, codes: Tensor, scales: Tensor, given_scales: bool = False
) -> None: ...
def dequantize_moment(is_exp_avg: bool, codes: Tensor, scales: Tensor, values: Tensor) -> None: ...
def optimizer_threads() -> int: ...
def set_optimizer_threads(threads: int) -> None: ...
@overload
def grad_accumulate(
    dsts: list[Tensor], srcs: list[Tensor], overwrite: bool, num_threads: int | None = None
) -> bool: ...
@overload
def grad_accumulate(
    dst: Tensor, src: Tensor, overwrite: bool, num_threads: int | None = None
) -> bool: ...
def all_finite(tensors: list[Tensor], num_threads: int | None = None) -> bool: ...
def optimizer_threads_started() -> int: ...

# Smoothed per-layer timings (csrc/scheduler/timer.h); actions 0 fwd, 1 re, 2 bwd.
class LayerTimings:
    def __init__(self, layers: int, smoothing: float, change_threshold: float) -> None: ...
    def fold(self, action: int, layers: Sequence[int], seconds: Sequence[float]) -> int: ...
    def fold_reporting(
        self, action: int, layers: Sequence[int], seconds: Sequence[float]
    ) -> tuple[int, list[float]]: ...
    def estimate(self, action: int, layer: int) -> float | None: ...
    def estimates(self, action: int) -> list[float | None]: ...
    def records(self, action: int, layer: int) -> int: ...

# The call's backward, and the switch and counters of the local backward that runs it where it
# can (csrc/call/backward_stage.cpp; the local backward is in csrc/torch_internals/).
def backward(outputs: list[Tensor], grads: list[Tensor]) -> None: ...
def backward_counts() -> tuple[int, int]: ...
def local_backward_enabled() -> bool: ...

# Typed views of a stage's flat buffers and their .grad (csrc/gradients/gradients.cpp).
def typed_views(
    buffer: Tensor,
    first_byte: int,
    offsets: Sequence[int],
    likes: Sequence[Tensor],
    like_requires_grad: bool = False,
) -> list[Tensor]: ...
def set_grads(tensors: Sequence[Tensor], grads: Sequence[Tensor]) -> None: ...

# A stage's buffers from upload to gradient download (csrc/call/stage.cpp).
def download_grads(
    device_index: int,
    arena: Tensor,
    grads: Tensor,
    first_byte: int,
    runs: Sequence[tuple[int, int, torch.dtype]],
    staging: Tensor | None,
    replace: bool = False,
) -> list[Event]: ...
def upload_stage(
    device_index: int,
    device: torch.device,
    arena: Tensor | None,
    param_begin: int,
    param_end: int,
    runs: Sequence[tuple[int, int]],
    fence: Event | None,
    offsets: Sequence[int],
    params: Sequence[Tensor],
    with_grads: bool,
    grad_begin: int,
    grad_end: int,
    grad_offsets: Sequence[int],
    trained: Sequence[int],
    grad_arena: Tensor | None = None,
) -> tuple[Tensor, Event | None, list[Tensor], Tensor | None, GradReach | None]: ...
def rebind_parameters(
    owners: Sequence[Module], names: Sequence[str], tensors: Sequence[Tensor]
) -> list[Tensor]: ...
def changed_in_place(tensors: Sequence[Tensor]) -> list[int]: ...

# Which of `tensors` (leaves of a stage) an AccumulateGrad node ran for since construction.
class GradReach:
    def __init__(self, tensors: Sequence[Tensor]) -> None: ...
    def reached(self) -> list[int]: ...

# What a call keeps from its forward stages for its recompute (csrc/call/saved_inputs.h).

# The CPU generator states a call's forward layers were seeded with, kept (at most 4096) so that
# their recompute starts from a copy instead of seeding again.
class RngStates:
    def __init__(self, layers: int, microbatches: int) -> None: ...
    @property
    def kept(self) -> int: ...

# The lone-tensor layer inputs a call's forward stages keep for its recompute, per (layer,
# microbatch), held natively (no Python object per input).
class KeptInputs:
    def __init__(self, layers: int, microbatches: int) -> None: ...
    def find(self, layer: int, microbatch: int) -> Tensor | None: ...
    def covers(
        self, first: int, stop: int, microbatches: Sequence[int], per_layer: bool
    ) -> bool: ...

# The loop over a stage's layers (csrc/call/layer_loop.cpp).

# A timing event on a CUDA device's compute stream (the model timer's TimingEvent).
class TimingMark:
    def query(self) -> bool: ...
    def elapsed_time(self, end: TimingMark) -> float: ...

# The layer calls of one stage: per layer, reseed `generators` with layer_seed(call_seed, layer,
# microbatch, fresh), point `context` (roundpipe.context.LayerCall) at the layer, enter
# mark(layer, microbatch) if given (NVTX), call the module and time it (timing: off | host |
# device, the last on the current stream of CUDA device `device_index`).
class LayerLoop:
    def __init__(
        self,
        modules: list[Module],
        call_seed: int,
        fresh: bool,
        generators: list[Generator],
        context: object,
        mark: Callable[[int, int], AbstractContextManager[object]] | None,
        timing: str,
        device_index: int,
        rng_states: RngStates | None = None,
        replay: bool = False,
        cut: Callable[[Any], Any] | None = None,
    ) -> None: ...
    def run(self, first: int, stop: int, microbatch: int, value: object) -> Any: ...
    def run_keeping(
        self,
        first: int,
        stop: int,
        first_microbatch: int,
        values: list[Any],
        keep: list[int],
        kept: KeptInputs | None,
        keeper: Callable[[int, int, Any], None],
    ) -> list[Any]: ...
    def recompute_backward(
        self,
        first: int,
        stop: int,
        microbatch: int,
        inputs: list[Tensor],
        saved: list[Tensor],
        grad: Tensor | None,
        per_layer: bool,
        fallback: Callable[[Any, list[Tensor | None]], None],
    ) -> Tensor | None: ...
    def recompute_backward_kept(
        self,
        first: int,
        stop: int,
        microbatches: Sequence[int],
        kept: KeptInputs,
        retained: bool,
        grads: Sequence[Tensor | None],
        per_layer: bool,
        fallback: Callable[[Any, list[Tensor | None]], None],
    ) -> list[Tensor | None]: ...
    @property
    def failure(self) -> tuple[str, int, int, int]: ...
    def take_backward_host_times(self) -> tuple[list[int], list[float]]: ...
    def take_backward_device_times(self) -> list[tuple[int, int, TimingMark, TimingMark]]: ...
    def take_host_times(self) -> tuple[list[int], list[float]]: ...
    def take_device_times(self) -> list[tuple[int, TimingMark, TimingMark]]: ...

def layer_seed(call_seed: int, layer: int, microbatch: int, fresh: bool) -> int: ...

# Copies of a layer's inputs placed as their originals, and the forward's graph cut
# (csrc/call/transfers.cpp).
def empty_placed(tensor: Tensor, device: torch.device) -> Tensor: ...
def plain_copy(tensor: Tensor) -> Tensor: ...
def graph_cut(tensor: Tensor) -> Tensor: ...
