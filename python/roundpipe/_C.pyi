# Typed surface of the compiled core; tests/test_package.py keeps it true.

from collections.abc import Callable
from typing import overload

from torch import Tensor

def build_info() -> dict[str, object]: ...
def configure_devices(kind: str | None = None, num_cpu_devices: int | None = None) -> None: ...
def device_kind() -> str: ...
def device_count() -> int: ...
def device_total_memory(index: int) -> int: ...
def cuda_available() -> bool: ...

# Runtime: host arenas, events and the per-device copy engines (lane: activation | gradient |
# parameter, in priority order).
class Event:
    def synchronize(self) -> None: ...
    def query(self) -> bool: ...
    def block_current_stream(self, device_index: int) -> None: ...

def record_event(device_index: int) -> Event: ...
def copy_async(
    device_index: int, dst: Tensor, src: Tensor, lane: str, after: Event | None = None
) -> Event: ...
def accumulate_async(
    device_index: int, dst: Tensor, src: Tensor, after: Event | None = None
) -> Event: ...
def submit_optimizer_job(job: Callable[[], object]) -> Event: ...
def writeback_async(dsts: list[Tensor], srcs: list[Tensor]) -> Event: ...
def drain_workers() -> None: ...
def allocate_host_arena(bytes: int, pin_model: str) -> Tensor: ...
def is_page_locked(tensor: Tensor) -> bool: ...

# Planner (csrc/planner/planner.h). profiles: per model (forward_seconds, recompute_seconds,
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

# Simulator (csrc/planner/simulator.h): (makespan, [(stage, microbatch, device, start, end)]).
def simulate_schedule(
    stage_seconds: list[float],
    num_devices: int,
    num_microbatches: int,
    upload_seconds: list[float] | None = None,
) -> tuple[float, list[tuple[int, int, int, float, float]]]: ...

# Host optimizer kernels (csrc/optim, csrc/bindings/optim.cpp). Tensors are CPU and contiguous;
# master weights and moments float32; grads float32/bfloat16/float16; lowp_params bfloat16/float16.
# num_threads=None uses torch.get_num_threads().
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
) -> None: ...
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
