"""Profiler annotations: NVTX ranges that Nsight Systems shows on its timeline.

``annotate(name)`` opens an NVTX range named ``name`` while its block (or the function it
decorates) runs, on machines where torch has CUDA; elsewhere it does nothing, so code can use it
unconditionally. ``color`` is honoured when the ``nvtx`` package is installed (torch's own NVTX
binding has no colours). ``PROFILER_TYPE`` is ``"nsys"`` when the process runs under Nsight
Systems, else ``None``.
"""

from __future__ import annotations

import contextlib
import os
from types import ModuleType

import torch

__all__ = ["PROFILER_TYPE", "annotate"]

PROFILER_TYPE: str | None = "nsys" if os.environ.get("NSYS_PROFILING_SESSION_ID") else None


def _nvtx_package() -> ModuleType | None:
    try:
        import nvtx
    except ImportError:
        return None
    module: ModuleType = nvtx
    return module


class annotate(contextlib.ContextDecorator):  # lower case: the 0.1.1 name, used like a function
    """An NVTX range named ``name`` around a ``with`` block or a decorated function.

    A no-op without CUDA. Whether the range is emitted is decided when the annotation is
    created, so one instance can decorate a function that runs on many threads at once.
    """

    def __init__(self, name: str, color: str | None = None) -> None:
        if not isinstance(name, str):
            raise TypeError(f"annotate: name must be a str, got {type(name).__name__}")
        if color is not None and not isinstance(color, str):
            raise TypeError(f"annotate: color must be a str or None, got {type(color).__name__}")
        self.name, self.color = name, color
        self._enabled = torch.cuda.is_available()
        self._nvtx = _nvtx_package() if self._enabled else None

    def __enter__(self) -> annotate:
        if self._nvtx is not None:
            self._nvtx.push_range(self.name, color=self.color)
        elif self._enabled:
            torch.cuda.nvtx.range_push(self.name)  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._nvtx is not None:
            self._nvtx.pop_range()
        elif self._enabled:
            torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]
