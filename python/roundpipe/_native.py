"""Loads the compiled core ``roundpipe._C`` and checks it was built for the running torch."""

from __future__ import annotations

import torch

_REINSTALL = (
    "rebuild it against the installed torch: "
    "pip install --no-build-isolation --force-reinstall --no-deps <path to roundpipe source>"
)

try:
    from roundpipe import _C
except ImportError as error:  # typically undefined symbols from a build for another torch
    raise ImportError(
        f"roundpipe's native module failed to load with torch {torch.__version__}: {error}. "
        f"If roundpipe was built for another torch, {_REINSTALL}"
    ) from error

BUILD_INFO: dict[str, object] = dict(_C.build_info())

if BUILD_INFO["torch_version"] != torch.__version__:
    raise ImportError(
        f"roundpipe was built against torch {BUILD_INFO['torch_version']} but torch "
        f"{torch.__version__} is running; {_REINSTALL}"
    )

__all__ = ["BUILD_INFO", "_C"]
