"""Shared test conventions.

* ``@pytest.mark.requires_cuda``: the test needs a CUDA device; it is skipped cleanly without one.
* ``num_devices`` fixture: runs a test once on 1 and once on 3 virtual CPU devices (the registry is
  restored afterwards). Tests that take it exercise the same scheduler and executors the GPUs use.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import roundpipe
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=[1, 3], ids=["1dev", "3dev"])
def num_devices(request: pytest.FixtureRequest) -> Iterator[int]:
    """Virtual CPU devices for the test: 1, then 3."""
    previous_kind, previous_count = roundpipe.device_kind(), roundpipe.device_count()
    roundpipe.configure_devices(kind="cpu", num_cpu_devices=request.param)
    try:
        yield request.param
    finally:
        if previous_kind == "cpu":
            roundpipe.configure_devices(kind="auto", num_cpu_devices=previous_count)
        else:
            roundpipe.configure_devices(kind="auto")
