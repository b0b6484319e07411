"""RoundPipe (native): train models far larger than one GPU's memory.

Model state lives in host memory, GPUs are a stateless compute pool, layers are grouped into
stages that are uploaded and dispatched round-robin, activations are recomputed, and the optimizer
runs asynchronously on the host. Importing this package touches no device and starts no thread.
"""

from __future__ import annotations

from roundpipe import optim, profile, wrapper
from roundpipe._native import BUILD_INFO
from roundpipe.batch import RoundPipePackedData
from roundpipe.checkpoints.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from roundpipe.context import (
    OptimizerCtx,
    doing_recompute,
    get_recompute_data,
    save_for_recompute,
)
from roundpipe.device import configure_devices, device_count, device_kind, devices
from roundpipe.models import wrap_model_to_roundpipe
from roundpipe.optim.grad_scaler import GradScaler
from roundpipe.optim.offload import OptimOffload
from roundpipe.roundpipe import RoundPipe
from roundpipe.run_config import RoundPipeRunConfig
from roundpipe.scheduler import ModelExecutePlan
from roundpipe.timeline.tracing import trace
from roundpipe.timer import ModelTimer

__version__: str = str(BUILD_INFO["version"])

__all__ = [
    "CheckpointError",
    "GradScaler",
    "ModelExecutePlan",
    "ModelTimer",
    "OptimOffload",
    "OptimizerCtx",
    "RoundPipe",
    "RoundPipePackedData",
    "RoundPipeRunConfig",
    "__version__",
    "configure_devices",
    "device_count",
    "device_kind",
    "devices",
    "doing_recompute",
    "get_recompute_data",
    "load_checkpoint",
    "optim",
    "profile",
    "save_checkpoint",
    "save_for_recompute",
    "trace",
    "wrap_model_to_roundpipe",
    "wrapper",
]
