"""The installed package: build facts, import hygiene and the typed native surface."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import roundpipe
import torch
from roundpipe import _C

STUB = Path(roundpipe.__file__).with_name("_C.pyi")


def run_python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_build_info_reports_what_was_compiled() -> None:
    info = _C.build_info()
    assert info["version"] == roundpipe.__version__
    assert info["torch_version"] == torch.__version__
    assert info["cuda"] == (torch.version.cuda is not None)
    assert info["cxx_standard"] >= 202002
    assert info["simd_compiled"].split(",")[0] == "scalar"
    assert info["simd_active"] in {"scalar", "avx2", "avx512"}


@pytest.mark.slow
def test_import_touches_no_device_and_starts_no_thread() -> None:
    result = run_python(
        """
        import threading, torch
        before = threading.active_count()
        import roundpipe
        assert threading.active_count() == before, threading.enumerate()
        if torch.cuda.is_available():
            assert not torch.cuda.is_initialized(), "import initialised CUDA"
        """
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.slow
def test_import_starts_no_native_thread() -> None:
    # OS-level threads, which threading.active_count() does not see.
    result = run_python(
        """
        import os, torch
        torch.set_num_threads(1)
        count = lambda: len(os.listdir(f"/proc/{os.getpid()}/task"))
        before = count()
        import roundpipe, roundpipe._C
        roundpipe._C.build_info()
        print(before, count())
        """
    )
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    assert after == before


@pytest.mark.slow
def test_mismatched_torch_build_is_refused_with_a_readable_error() -> None:
    result = run_python(
        """
        import torch
        torch.__version__ = "0.0.1-not-the-build-torch"
        import roundpipe
        """
    )
    assert result.returncode != 0
    assert "roundpipe was built against torch" in result.stderr
    assert "0.0.1-not-the-build-torch" in result.stderr
    assert "--no-build-isolation" in result.stderr


def test_native_stub_matches_the_module() -> None:
    tree = ast.parse(STUB.read_text())
    stubbed = {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.ClassDef)}
    exported = {name for name in dir(_C) if not name.startswith("_")}
    assert stubbed == exported


@pytest.mark.slow
def test_environment_variables_configure_the_devices() -> None:
    result = run_python(
        "import roundpipe; print(roundpipe.device_kind(), roundpipe.device_count())",
        ROUNDPIPE_DEVICE_KIND="cpu",
        ROUNDPIPE_CPU_DEVICES="4",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["cpu", "4"]


@pytest.mark.slow
def test_bad_environment_variable_names_itself() -> None:
    result = run_python("import roundpipe; roundpipe.device_count()", ROUNDPIPE_CPU_DEVICES="many")
    assert result.returncode != 0
    assert "ROUNDPIPE_CPU_DEVICES must be an integer" in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "65", "three"])
def test_bad_logical_cuda_device_count_names_itself(value: str) -> None:
    # Read at first use whatever the device kind, so a typo fails on a CPU machine too.
    result = run_python(
        "import roundpipe; roundpipe.device_count()", ROUNDPIPE_CUDA_LOGICAL_DEVICES=value
    )
    assert result.returncode != 0
    assert "ValueError: ROUNDPIPE_CUDA_LOGICAL_DEVICES must be an integer in [1, 64]" in (
        result.stderr
    )


@pytest.mark.slow
def test_logical_cuda_device_count_is_read_from_the_environment() -> None:
    result = run_python(
        "import roundpipe; print(roundpipe.device.num_cuda_devices())",
        ROUNDPIPE_CUDA_LOGICAL_DEVICES="3",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["3"]


@pytest.mark.cpu_devices
def test_num_devices_fixture_configures_virtual_cpu_devices(num_devices: int) -> None:
    assert roundpipe.device_kind() == "cpu"
    assert roundpipe.device_count() == num_devices
    assert roundpipe.devices() == [torch.device("cpu")] * num_devices


@pytest.mark.parametrize(
    ("kwargs", "error", "fragment"),
    [
        ({"kind": "gpu"}, ValueError, "kind must be 'auto', 'cpu' or 'cuda'"),
        ({"kind": 1}, TypeError, "kind must be"),
        ({"num_cpu_devices": 0}, ValueError, "num_cpu_devices must be an integer in [1, 64]"),
        ({"num_cpu_devices": 65}, ValueError, "num_cpu_devices"),
        ({"num_cpu_devices": 2.0}, TypeError, "num_cpu_devices must be an int"),
        ({"num_cpu_devices": True}, TypeError, "num_cpu_devices must be an int"),
        ({"num_cuda_devices": -1}, ValueError, "num_cuda_devices must be an integer in [1, 64]"),
        ({"num_cuda_devices": 65}, ValueError, "num_cuda_devices"),
        ({"num_cuda_devices": "3"}, TypeError, "num_cuda_devices must be an int"),
    ],
)
def test_configure_devices_rejects_bad_arguments(
    kwargs: dict[str, object], error: type[Exception], fragment: str
) -> None:
    before = (roundpipe.device_kind(), roundpipe.device_count())
    with pytest.raises(error, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        roundpipe.configure_devices(**kwargs)  # type: ignore[arg-type]
    assert (roundpipe.device_kind(), roundpipe.device_count()) == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error")
def test_cuda_kind_without_gpu_is_a_runtime_error() -> None:
    with pytest.raises(RuntimeError, match="no CUDA device is usable"):
        roundpipe.configure_devices(kind="cuda")


@pytest.mark.requires_cuda
def test_cuda_devices_are_the_default_pool_on_a_gpu_machine() -> None:
    assert roundpipe.device_kind() == "cuda"
    assert roundpipe.device_count() == torch.cuda.device_count()
    total = torch.cuda.get_device_properties(0).total_memory
    assert roundpipe.device.device_total_memory(0) == total


@pytest.mark.requires_cuda
def test_logical_cuda_devices_map_onto_the_gpus() -> None:
    gpus = torch.cuda.device_count()
    previous = roundpipe.device.num_cuda_devices()
    try:
        roundpipe.configure_devices(kind="cuda", num_cuda_devices=gpus + 2)
        assert roundpipe.device_count() == gpus + 2
        assert roundpipe.devices() == [torch.device("cuda", i % gpus) for i in range(gpus + 2)]
        total = torch.cuda.get_device_properties(0).total_memory
        assert roundpipe.device.device_total_memory(gpus) == total
    finally:
        roundpipe.configure_devices(kind="cuda", num_cuda_devices=previous)
