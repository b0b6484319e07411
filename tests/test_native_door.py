"""The native code's shape: torch's private API is reached only through its one door
(csrc/torch_internals/, the rule stated atop torch_internals.h), and every C++ file holds one idea
in a size a reader takes in at once."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOOR = "csrc/torch_internals/"
MAX_LINES = 800

# The torch/csrc headers torch's extension docs use: pybind11 casters, error translation, the
# Python tensor wrapper.
PUBLIC_TORCH_CSRC = {
    "torch/csrc/utils/pybind.h",
    "torch/csrc/Exceptions.h",
    "torch/csrc/autograd/python_variable.h",
}
# Private ATen headers not caught by the patterns below: dispatch-key guards, saved-tensor hook
# and RecordFunction state.
PRIVATE_ATEN = {
    "ATen/core/LegacyTypeDispatch.h",
    "ATen/SavedTensorHooks.h",
    "ATen/record_function.h",
}
INCLUDE = re.compile(r"^\s*#\s*include\s*<([^>]+)>", re.MULTILINE)
# A name in one of torch's impl or detail namespaces (c10::impl::, torch::autograd::impl::, ...),
# or a tensor's TensorImpl.
PRIVATE_NAME = re.compile(
    r"\b(?:c10|at|torch|ag)::(?:\w+::)*(?:impl|detail)::|\bunsafeGetTensorImpl\b|\btorch::jit::"
)


def cxx_files() -> list[str]:
    """The tree's C++ files, tracked or new (what tools/lint.sh formats)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "*.cpp", "*.h"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    return [path for path in listed if (ROOT / path).exists()]


def is_private(header: str) -> bool:
    """Whether ``header`` is private torch API by the door's rule."""
    if header.startswith("torch/csrc/"):
        return header not in PUBLIC_TORCH_CSRC
    if not header.startswith(("torch/", "ATen/", "c10/")):
        return False
    return (
        "/impl/" in header
        or "/detail/" in header
        or header.endswith("Impl.h")
        or header in PRIVATE_ATEN
    )


def test_the_rule_tells_private_headers_from_public_ones() -> None:
    assert is_private("torch/csrc/autograd/function.h")
    assert is_private("torch/csrc/jit/frontend/tracer.h")
    assert is_private("c10/core/impl/DeviceGuardImplInterface.h")
    assert is_private("ATen/CPUGeneratorImpl.h")
    assert is_private("c10/core/TensorImpl.h")
    assert is_private("ATen/core/LegacyTypeDispatch.h")
    assert not is_private("torch/csrc/utils/pybind.h")
    assert not is_private("ATen/ATen.h")
    assert not is_private("c10/cuda/CUDAStream.h")
    assert not is_private("pybind11/stl.h")


def test_only_the_door_includes_private_torch_headers_or_names_private_api() -> None:
    files = cxx_files()
    assert any(path.startswith(DOOR) for path in files)  # the door is where the rule says
    wrong = []
    for path in files:
        if path.startswith(DOOR):
            continue
        text = (ROOT / path).read_text()
        wrong += [f"{path} includes <{h}>" for h in INCLUDE.findall(text) if is_private(h)]
        for number, line in enumerate(text.splitlines(), start=1):
            if not line.lstrip().startswith("//") and PRIVATE_NAME.search(line):
                wrong.append(f"{path}:{number} names private API: {line.strip()}")
    assert not wrong, "\n".join(wrong)


def test_no_cxx_file_is_over_the_size_limit() -> None:
    sizes = {path: len((ROOT / path).read_text().splitlines()) for path in cxx_files()}
    assert sizes  # the files were found
    over = [f"{path}: {lines} lines" for path, lines in sizes.items() if lines > MAX_LINES]
    assert not over, "\n".join(over)
