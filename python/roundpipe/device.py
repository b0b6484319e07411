"""The compute devices RoundPipe dispatches stages to.

CUDA devices are used when the build has CUDA and a GPU is visible; otherwise ``N`` virtual CPU
devices run the same scheduler, executors and copy engine on the host (``N`` defaults to 1).

Configuration, later sources overriding earlier ones:

* ``ROUNDPIPE_DEVICE_KIND`` = ``auto`` | ``cpu`` | ``cuda`` (environment, read at first use)
* ``ROUNDPIPE_CPU_DEVICES`` = ``N`` (environment, read at first use)
* ``ROUNDPIPE_CUDA_LOGICAL_DEVICES`` = ``N`` (environment, read at first use): ``N`` logical CUDA
  devices mapped round-robin onto the visible GPUs (default: one per GPU)
* :func:`configure_devices` (at run time)

Logical CUDA devices each have their own copy engine (own copy lanes) and share their GPU's
compute stream, so a one-GPU machine runs the multi-device round-robin path.

Nothing is probed at import: the first query resolves the configuration.

On a torch built without CUDA, ``torch.cuda.Event()`` cannot be created at all (torch's class is
a placeholder that raises); importing roundpipe makes it :class:`HostEvent`, the event of the
virtual CPU devices, so code written against roundpipe 0.1.1, which creates events to pair with
packed data, runs on CPU devices unchanged. A torch with CUDA keeps its own class.
"""

from __future__ import annotations

import time
from typing import Any, Literal, NoReturn

import torch

from roundpipe._native import _C

DeviceKind = Literal["auto", "cpu", "cuda"]


def configure_devices(
    kind: DeviceKind | None = None,
    num_cpu_devices: int | None = None,
    num_cuda_devices: int | None = None,
) -> None:
    """Choose the device kind, the number of virtual CPU devices and/or of logical CUDA devices.

    Args:
        kind: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``; ``None`` keeps
            the current choice.
        num_cpu_devices: how many virtual CPU devices to use when the kind resolves to CPU, in
            ``[1, 64]``; ``None`` keeps the current count.
        num_cuda_devices: how many logical CUDA devices to use when the kind resolves to CUDA, in
            ``[1, 64]``, mapped round-robin onto the visible GPUs (3 on one GPU runs the
            multi-device path there); ``0`` means one per GPU (the default); ``None`` keeps the
            current choice.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.
        RuntimeError: ``kind="cuda"`` but no CUDA device is usable.
    """
    if kind is not None and not isinstance(kind, str):
        raise TypeError(f"kind must be 'auto', 'cpu', 'cuda' or None, got {type(kind).__name__}")
    counts = {"num_cpu_devices": num_cpu_devices, "num_cuda_devices": num_cuda_devices}
    for name, count in counts.items():
        if count is not None and (isinstance(count, bool) or not isinstance(count, int)):
            raise TypeError(f"{name} must be an int or None, got {type(count).__name__}")
    _C.configure_devices(kind, num_cpu_devices, num_cuda_devices)


def num_cuda_devices() -> int:
    """The configured number of logical CUDA devices; ``0`` means one per GPU."""
    return _C.cuda_logical_devices()


def device_kind() -> Literal["cpu", "cuda"]:
    """The kind of device stages run on: ``"cuda"`` or ``"cpu"`` (virtual CPU devices)."""
    return "cuda" if _C.device_kind() == "cuda" else "cpu"


def device_count() -> int:
    """Number of devices in the pool; the default ``num_microbatch`` is this plus one."""
    return _C.device_count()


def devices() -> list[torch.device]:
    """The torch devices stages run on. Virtual CPU devices all map to ``torch.device("cpu")``;
    logical CUDA devices to the GPU they run on."""
    if device_kind() == "cuda":
        return [torch.device("cuda", _C.device_physical_index(i)) for i in range(device_count())]
    return [torch.device("cpu")] * device_count()


_CPU = torch.device("cpu")
_GIB = 1 << 30


def device_at(index: int) -> torch.device:
    """``devices()[index]`` without building the list (once per stage on the dispatch path)."""
    if _C.device_kind() == "cuda":
        return torch.device("cuda", _C.device_physical_index(index))
    if not 0 <= index < device_count():
        raise IndexError(f"device index {index} out of range for {device_count()} devices")
    return _CPU


def device_total_memory(index: int) -> int:
    """Total memory of device ``index`` in bytes (host memory for a virtual CPU device)."""
    return _C.device_total_memory(index)


def min_device_memory() -> int:
    """Smallest total memory over the pool, in bytes."""
    return min(device_total_memory(i) for i in range(device_count()))


def get_num_devices() -> int:
    """roundpipe 0.1.1's name for :func:`device_count`."""
    return device_count()


def get_min_gpu_memory() -> float:
    """roundpipe 0.1.1's smallest device memory, in GB (2**30 bytes): what
    ``ModelExecutePlan.auto``'s default ``model_memory_limit`` is 60% of. The smallest GPU's
    memory on CUDA; on virtual CPU devices, which share the host's memory, each one's share."""
    if device_kind() == "cuda":
        return min_device_memory() / _GIB
    return device_total_memory(0) / device_count() / _GIB


_NO_DEVICE_MANAGERS = (
    "roundpipe 0.1.1 drove each GPU from a Python DeviceManager thread, handed out round-robin; "
    "this runtime dispatches stages from its native scheduler and has no device managers. Use "
    "roundpipe.devices() (the devices), roundpipe.device_count() (how many) or "
    "roundpipe.configure_devices() (which and how many)"
)


def get_next_device() -> NoReturn:
    """roundpipe 0.1.1's round-robin over its per-GPU device managers, which this runtime does
    not have: raises ``NotImplementedError`` saying what to use instead."""
    raise NotImplementedError(f"get_next_device(): {_NO_DEVICE_MANAGERS}")


def gc_collect() -> None:
    """roundpipe 0.1.1's release of the tensors its copy streams still held back for later
    freeing. Here a tensor used on several streams is recorded on them with torch's caching
    allocator, which reuses its memory once that work completed: nothing waits for this call,
    so it returns at once."""


def __getattr__(name: str) -> NoReturn:
    # roundpipe 0.1.1's device_list / cur_device: its device managers and their cursor.
    if name in ("device_list", "cur_device"):
        raise NotImplementedError(f"roundpipe.device.{name}: {_NO_DEVICE_MANAGERS}")
    raise AttributeError(f"module 'roundpipe.device' has no attribute {name!r}")


class HostEvent:
    """An event of the virtual CPU devices, with ``torch.cuda.Event``'s methods: their work is
    done on the host by the time the call that issues it returns, so a recorded event has
    completed; ``elapsed_time`` measures the host clock between two recorded events."""

    def __init__(
        self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False
    ) -> None:
        self.recorded_at: float | None = None

    def record(self, stream: Any = None) -> None:
        """Mark now."""
        self.recorded_at = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for: host work is ordered already."""

    def query(self) -> bool:
        """Always complete."""
        return True

    def synchronize(self) -> None:
        """Returns at once (complete)."""

    def elapsed_time(self, end_event: HostEvent) -> float:
        """Milliseconds from this event's record to ``end_event``'s, as ``torch.cuda.Event``."""
        if self.recorded_at is None or end_event.recorded_at is None:
            raise RuntimeError("both events must be recorded before calculating elapsed time")
        return (end_event.recorded_at - self.recorded_at) * 1e3


if not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
    torch.cuda.Event = HostEvent  # type: ignore[misc,assignment]


__all__ = [
    "HostEvent",
    "configure_devices",
    "device_at",
    "device_count",
    "device_kind",
    "device_total_memory",
    "devices",
    "gc_collect",
    "get_min_gpu_memory",
    "get_next_device",
    "get_num_devices",
    "min_device_memory",
    "num_cuda_devices",
]
