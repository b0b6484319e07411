"""The import layers of docs/architecture.md hold: a module of the runtime imports only modules
of the layers below its own (imports for type annotations only may also name its own layer)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "roundpipe"


# The one upward reference the document allows: roundpipe.roundpipe serves AutoRoundPipe lazily.
ALLOWED = {("roundpipe", "models")}
# One module under two names: the compiled core and its loader.
SAME = {"_C": "_native"}


def layers() -> dict[str, float]:
    """Module name (``pipeline``, ``models``) -> rank, read from the document: its layer number,
    with ", then" inside a layer ranking the modules after it lower (layer 1 is the top)."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("## Arrows point one way", 1)[1].split("\n## ", 1)[0]
    found: dict[str, float] = {}
    for number, line in re.findall(r"^(\d+)\. (.+)$", section, flags=re.MULTILINE):
        for order, part in enumerate(line.split(", then ")):
            for name in re.findall(r"`(\w+)(?:\.py|/)`", part):
                found[name] = int(number) + order / 10
    return found


def runtime_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported roundpipe module, only for type checking) of every import in ``path``."""
    tree = ast.parse(path.read_text())
    checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module == "roundpipe":
            modules = [f"roundpipe.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules = [node.module]
        else:
            continue
        found += [
            (node.lineno, module.split(".")[1], id(node) in checking)
            for module in modules
            if module.startswith("roundpipe.")
        ]
    return found


def test_modules_import_only_lower_layers() -> None:
    layer = layers()
    assert layer["pipeline"] == layer["step"] == 3 and layer["context"] == 6  # the doc was read
    assert layer["models"] < layer["roundpipe"] < layer["autograd"]
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        own = relative.parts[0].removesuffix(".py")
        if own not in layer:
            continue
        for line, imported, annotation_only in runtime_imports(path):
            name = SAME.get(imported, imported)
            if name not in layer or name == own or (own, name) in ALLOWED:
                continue
            # Layer 1 is the top: a module may import the layers numbered above its own.
            if layer[name] < layer[own] or (layer[name] == layer[own] and not annotation_only):
                wrong.append(f"{relative}:{line} imports {name} (layer {layer[name]}, own {own})")
    assert not wrong, "\n".join(wrong)


def test_modules_hold_one_idea_each() -> None:
    """The call itself stays a sequencing of stages, and no module grows into several ideas:
    ``pipeline.py`` at most 600 lines, every other module at most 900."""
    sizes = {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert sizes["pipeline.py"] <= 600, sizes["pipeline.py"]
    large = {name: lines for name, lines in sizes.items() if lines > 900}
    assert not large, large
