"""The compute devices RoundPipe dispatches stages to.

CUDA devices are used when the build has CUDA and a GPU is visible; otherwise ``N`` virtual CPU
devices run the same scheduler, executors and copy engine on the host (``N`` defaults to 1).

Configuration, later sources overriding earlier ones:

* ``ROUNDPIPE_DEVICE_KIND`` = ``auto`` | ``cpu`` | ``cuda`` (environment, read at first use)
* ``ROUNDPIPE_CPU_DEVICES`` = ``N`` (environment, read at first use)
* :func:`configure_devices` (at run time)

Nothing is probed at import: the first query resolves the configuration.
"""

from __future__ import annotations

from typing import Literal

import torch

from roundpipe._native import _C

DeviceKind = Literal["auto", "cpu", "cuda"]


def configure_devices(kind: DeviceKind | None = None, num_cpu_devices: int | None = None) -> None:
    """Choose the device kind and/or the number of virtual CPU devices.

    Args:
        kind: ``"auto"`` (CUDA when available, else CPU), ``"cpu"`` or ``"cuda"``; ``None`` keeps
            the current choice.
        num_cpu_devices: how many virtual CPU devices to use when the kind resolves to CPU, in
            ``[1, 64]``; ``None`` keeps the current count.

    Raises:
        TypeError: an argument has the wrong type.
        ValueError: an argument is out of range.
        RuntimeError: ``kind="cuda"`` but no CUDA device is usable.
    """
    if kind is not None and not isinstance(kind, str):
        raise TypeError(f"kind must be 'auto', 'cpu', 'cuda' or None, got {type(kind).__name__}")
    if num_cpu_devices is not None and (
        isinstance(num_cpu_devices, bool) or not isinstance(num_cpu_devices, int)
    ):
        raise TypeError(
            f"num_cpu_devices must be an int or None, got {type(num_cpu_devices).__name__}"
        )
    _C.configure_devices(kind, num_cpu_devices)


def device_kind() -> Literal["cpu", "cuda"]:
    """The kind of device stages run on: ``"cuda"`` or ``"cpu"`` (virtual CPU devices)."""
    return "cuda" if _C.device_kind() == "cuda" else "cpu"


def device_count() -> int:
    """Number of devices in the pool; the default ``num_microbatch`` is this plus one."""
    return _C.device_count()


def devices() -> list[torch.device]:
    """The torch devices stages run on. Virtual CPU devices all map to ``torch.device("cpu")``."""
    if device_kind() == "cuda":
        return [torch.device("cuda", i) for i in range(device_count())]
    return [torch.device("cpu")] * device_count()


def device_total_memory(index: int) -> int:
    """Total memory of device ``index`` in bytes (host memory for a virtual CPU device)."""
    return _C.device_total_memory(index)


def min_device_memory() -> int:
    """Smallest total memory over the pool, in bytes."""
    return min(device_total_memory(i) for i in range(device_count()))


__all__ = [
    "configure_devices",
    "device_count",
    "device_kind",
    "device_total_memory",
    "devices",
    "min_device_memory",
]
