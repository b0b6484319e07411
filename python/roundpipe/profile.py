"""Profiler annotations: the NVTX ranges that Nsight Systems shows on its timeline.

Every range RoundPipe emits goes through here: a call's stage ranges
(``roundpipe/<model>/<kind>/L<first>[-<last>][/mb<m>]``, :func:`stage_range`, marked on CUDA
devices only) and the user's own ``annotate(name)`` blocks. ``annotate`` opens an NVTX range
named ``name`` while its block (or the function it decorates) runs, on machines where torch has
CUDA; elsewhere it does nothing, so code can use it unconditionally. ``color`` is honoured when
the ``nvtx`` package is installed (torch's own NVTX binding has no colours). ``PROFILER_TYPE`` is
``"nsys"`` when the process runs under Nsight Systems, else ``None``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch

__all__ = ["PROFILER_TYPE", "annotate", "nvtx_usable", "stage_range"]

PROFILER_TYPE: str | None = "nsys" if os.environ.get("NSYS_PROFILING_SESSION_ID") else None


@functools.cache
def nvtx_usable() -> bool:
    """Whether this torch can emit NVTX ranges (a CUDA build)."""
    try:
        torch.cuda.nvtx.range_push("roundpipe")  # type: ignore[no-untyped-call]
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]
    except (RuntimeError, AttributeError):
        return False
    return True


def _nvtx_package() -> ModuleType | None:
    try:
        import nvtx
    except ImportError:
        return None
    module: ModuleType = nvtx
    return module


def _push(name: str, package: ModuleType | None, color: str | None) -> None:
    if package is not None:
        package.push_range(name, color=color)
    else:
        torch.cuda.nvtx.range_push(name)  # type: ignore[no-untyped-call]


def _pop(package: ModuleType | None) -> None:
    if package is not None:
        package.pop_range()
    else:
        torch.cuda.nvtx.range_pop()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _range(name: str) -> Iterator[None]:
    _push(name, None, None)
    try:
        yield
    finally:
        _pop(None)


def stage_range(
    model: str | None, kind: str, layers: range, microbatch: int | None = None
) -> contextlib.AbstractContextManager[Any]:
    """The NVTX range ``roundpipe/<model>/<kind>/L<first>[-<last>][/mb<microbatch>]``; nothing
    when ``model`` is None (the call marks no ranges)."""
    if model is None:
        return contextlib.nullcontext()
    label = f"L{layers.start}" if len(layers) == 1 else f"L{layers.start}-{layers.stop - 1}"
    name = f"roundpipe/{model}/{kind}/{label}"
    return _range(name if microbatch is None else f"{name}/mb{microbatch}")


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
        if self._enabled:
            _push(self.name, self._nvtx, self.color)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._enabled:
            _pop(self._nvtx)
