"""Surfaces the C++ unit tests of the torch-free core (tests/cpp) as pytest items.

The core is built once per session with CMake (ROUNDPIPE_CORE_ONLY: no torch headers, a few
seconds); each TEST_CASE in tests/cpp/*.cpp is then run as its own pytest item.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = sorted(
    name
    for source in (ROOT / "tests" / "cpp").glob("test_*.cpp")
    for name in re.findall(r'^TEST_CASE\("([^"]+)"\)', source.read_text(), re.MULTILINE)
)


@pytest.fixture(scope="session")
def core_tests_binary(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cmake = shutil.which("cmake")
    if cmake is None:
        pytest.fail("cmake is needed to build the C++ unit tests (pip install cmake)")
    build = tmp_path_factory.mktemp("core-build")
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    configure = [
        cmake,
        "-S",
        str(ROOT),
        "-B",
        str(build),
        *generator,
        "-DROUNDPIPE_CORE_ONLY=ON",
        "-DROUNDPIPE_BUILD_TESTS=ON",
    ]
    for command in (configure, [cmake, "--build", str(build), "--parallel"]):
        result = subprocess.run(command, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout + result.stderr
    return build / "roundpipe_core_tests"


def test_every_case_is_registered(core_tests_binary: Path) -> None:
    listed = subprocess.run(
        [core_tests_binary, "--list"], capture_output=True, text=True, check=True
    )
    assert sorted(listed.stdout.split()) == CASES


@pytest.mark.parametrize("case", CASES)
def test_cpp(core_tests_binary: Path, case: str) -> None:
    result = subprocess.run(
        [core_tests_binary, "--run", case], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
