"""The native code's shape: torch's private API is reached only through its one door
(csrc/torch_internals/, the rule stated atop torch_internals.h), whether by a header, a C++ name
or the name of a private Python attribute in a string, and every C++ file holds one idea in a size
a reader takes in at once."""

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

# A string literal that names a private Python attribute: an identifier with one leading
# underscore ("_call_impl", "_forward_hooks"), alone or in a dotted path
# ("torch.nn.modules.module._global_forward_hooks"). Dunders ("__call__") are public protocol.
PRIVATE_ATTRIBUTE = re.compile(r"^(?:\w+\.)*_[a-z]\w*(?:\.\w+)*$")


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


def string_literals(text: str) -> list[tuple[int, str]]:
    """(line, contents) of each string literal in C++ source ``text``, comments skipped."""
    literals: list[tuple[int, str]] = []
    i, line = 0, 1
    while i < len(text):
        char = text[i]
        if text.startswith("//", i):
            end = text.find("\n", i)
            i = len(text) if end < 0 else end
        elif text.startswith("/*", i):
            end = text.index("*/", i) + 2
            line += text.count("\n", i, end)
            i = end
        elif char in "\"'":
            end = i + 1
            while text[end] != char:
                end += 2 if text[end] == "\\" else 1
            if char == '"':
                literals.append((line, text[i + 1 : end]))
            i = end + 1
        else:
            line += char == "\n"
            i += 1
    return literals


def names_private_attribute(literal: str) -> bool:
    """Whether a string literal names a private Python attribute (of torch's, in our code)."""
    return PRIVATE_ATTRIBUTE.match(literal) is not None


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


def test_the_rule_tells_private_attribute_names_in_strings() -> None:
    source = """
        // "_forward_hooks" in a comment is no lookup
        /* nor "_call_impl" here */
        call_impl = type.attr("_call_impl");  hooks = module.attr(
            "torch.nn.modules.module._global_forward_hooks");
        call = type.attr("__call__"); note = "owner._parameters[name] = tensor per binding";
        quote = '"'; escaped = "say \\"_hi\\"";
    """
    literals = string_literals(source)
    assert [literal for _, literal in literals if names_private_attribute(literal)] == [
        "_call_impl",
        "torch.nn.modules.module._global_forward_hooks",
    ]
    assert (4, "_call_impl") in literals  # lines count from 1, comments included
    assert not names_private_attribute("forward")
    assert not names_private_attribute("__call__")
    assert not names_private_attribute("owner._parameters[name] = tensor per binding")


def test_only_the_door_names_private_attributes_in_strings() -> None:
    wrong = []
    for path in cxx_files():
        if path.startswith(DOOR):
            continue
        for number, literal in string_literals((ROOT / path).read_text()):
            if names_private_attribute(literal):
                wrong.append(f'{path}:{number} names a private attribute: "{literal}"')
    assert not wrong, "\n".join(wrong)


def test_no_cxx_file_is_over_the_size_limit() -> None:
    sizes = {path: len((ROOT / path).read_text().splitlines()) for path in cxx_files()}
    assert sizes  # the files were found
    over = [f"{path}: {lines} lines" for path, lines in sizes.items() if lines > MAX_LINES]
    assert not over, "\n".join(over)
