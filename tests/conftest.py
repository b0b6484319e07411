"""Shared test conventions.

* Two tiers: ``pytest`` runs everything (the README's test command, CI); ``pytest -m "not slow"``
  is the quick tier (minutes on 2 cores), which leaves out the tests marked
  ``@pytest.mark.slow`` (long trainings, soaks, subprocess scenarios, parametrisations beyond the
  first) and keeps at least one test of every file, so that every part still runs.
* ``@pytest.mark.requires_cuda``: the test needs a CUDA device; it is skipped cleanly without one.
* ``num_devices`` fixture: runs a test on 1 and on 3 virtual CPU devices and, when this build has
  CUDA and a GPU is visible, twice more: on the CUDA devices (id ``cuda``; the value is then the
  number of GPUs) and on 3 logical CUDA devices mapped onto them (id ``cuda3``, so the
  multi-device round-robin path runs on a one-GPU machine too). The registry is restored
  afterwards. Tests that take it exercise the same scheduler and executors on every device kind.
  On 1 CPU device the copy engine runs small copies on the calling thread (its default); on 3 it
  sends every copy to its worker thread (``_C.set_inline_copy_bytes(0)``), so both paths run.
* ``@pytest.mark.cpu_devices``: the test checks something true of virtual CPU devices only (their
  count, host memory as device memory); ``num_devices`` then skips its ``cuda`` case.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import roundpipe
import torch
from roundpipe._native import _C, BUILD_INFO

CUDA_USABLE = bool(BUILD_INFO["cuda"]) and torch.cuda.is_available()
DEVICE_CASES = [pytest.param(1, id="1dev"), pytest.param(3, id="3dev")]
if CUDA_USABLE:
    DEVICE_CASES += [pytest.param("cuda", id="cuda"), pytest.param("cuda3", id="cuda3")]


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "cpu_devices: runs on virtual CPU devices only (no cuda case of num_devices)"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if CUDA_USABLE:
        return
    reason = (
        "needs a CUDA device and a CUDA build (torch.cuda.is_available()="
        f"{torch.cuda.is_available()}, roundpipe built with CUDA={BUILD_INFO['cuda']})"
    )
    skip = pytest.mark.skip(reason=reason)
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=DEVICE_CASES)
def num_devices(request: pytest.FixtureRequest) -> Iterator[int]:
    """The devices for the test: 1 virtual CPU device, 3, then the GPUs and 3 logical CUDA devices
    when usable."""
    if str(request.param).startswith("cuda") and request.node.get_closest_marker("cpu_devices"):
        pytest.skip("checks virtual CPU devices only")
    previous_kind, previous_count = roundpipe.device_kind(), roundpipe.device_count()
    previous_logical = roundpipe.device.num_cuda_devices()
    if request.param == "cuda":
        roundpipe.configure_devices(kind="cuda", num_cuda_devices=0)
    elif request.param == "cuda3":
        roundpipe.configure_devices(kind="cuda", num_cuda_devices=3)
    else:
        roundpipe.configure_devices(kind="cpu", num_cpu_devices=request.param)
    inline_bytes = _C.inline_copy_bytes()
    if request.param == 3:
        _C.set_inline_copy_bytes(0)
    try:
        yield roundpipe.device_count()
    finally:
        _C.set_inline_copy_bytes(inline_bytes)
        if previous_kind == "cpu":
            roundpipe.configure_devices(
                kind="cpu", num_cpu_devices=previous_count, num_cuda_devices=previous_logical
            )
        else:
            roundpipe.configure_devices(kind="cuda", num_cuda_devices=previous_logical)
