# Typed surface of the compiled core; tests/test_native_stubs.py keeps it true.

from typing import overload

from torch import Tensor

def build_info() -> dict[str, object]: ...
def configure_devices(kind: str | None = None, num_cpu_devices: int | None = None) -> None: ...
def device_kind() -> str: ...
def device_count() -> int: ...
def device_total_memory(index: int) -> int: ...
def cuda_available() -> bool: ...

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
