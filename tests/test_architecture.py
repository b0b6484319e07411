"""docs/architecture.md is the map of the tree: its listing is what ``ls`` shows (every module and
native source named, nothing else), and its import layers hold: a module of the runtime imports
only modules of the layers below its own (imports for type annotations only may also name its own
layer)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "roundpipe"
DOC = (ROOT / "docs" / "architecture.md").read_text()

# The one upward reference the document allows: roundpipe.roundpipe serves AutoRoundPipe lazily.
ALLOWED = {("roundpipe.py", "models/")}
# One module under two names: the compiled core and its loader.
SAME = {"_C": "_native.py"}


def listed_tree() -> dict[str, set[str]]:
    """Root folder (``python/roundpipe``, ``csrc``) -> the paths its listing in "## The tree"
    names below it (folders end in ``/``), read from their indentation (two spaces a level)."""
    block = DOC.split("## The tree", 1)[1].split("```", 2)[1]
    trees: dict[str, set[str]] = {}
    parents: list[str] = []
    root = ""
    for line in block.splitlines():
        if not line.strip():
            continue
        depth = (len(line) - len(line.lstrip(" "))) // 2
        name = line.split()[0]
        if depth == 0:
            root, parents = name.rstrip("/"), []
            trees[root] = set()
            continue
        parents = parents[: depth - 1]
        path = "".join(parents) + name
        trees[root].add(path)
        if name.endswith("/"):
            parents.append(name)
    return trees


def on_disk(root: Path, suffixes: tuple[str, ...]) -> set[str]:
    """The files with ``suffixes`` below ``root`` and the folders that hold them."""
    found: set[str] = set()
    for path in root.rglob("*"):
        relative = path.relative_to(root)
        if "__pycache__" in relative.parts or not path.is_file() or path.suffix not in suffixes:
            continue
        found.add(relative.as_posix())
        found.update(f"{parent.as_posix()}/" for parent in relative.parents if parent.parts)
    return found


def test_the_listing_is_what_ls_shows() -> None:
    trees = listed_tree()
    assert "python/roundpipe" in trees and "csrc" in trees, sorted(trees)
    for root, suffixes in (("python/roundpipe", (".py",)), ("csrc", (".cpp", ".h", ".cu"))):
        listed, present = trees[root], on_disk(ROOT / root, suffixes)
        assert not present - listed, f"{root}: not in docs/architecture.md: {present - listed}"
        assert not listed - present, f"{root}: listed but absent: {listed - present}"


def layers() -> dict[str, float]:
    """Unit (``call/pipeline.py``, ``models/``) -> rank, read from the document: its layer
    number, with ", then" inside a layer ranking the units after it lower (layer 1 is the top)."""
    section = DOC.split("## Arrows point one way", 1)[1].split("\n## ", 1)[0]
    found: dict[str, float] = {}
    for number, line in re.findall(r"^(\d+)\. (.+)$", section, flags=re.MULTILINE):
        for order, part in enumerate(line.split(", then ")):
            for name in re.findall(r"`([\w/]+(?:\.py|/))`", part):
                found[name] = int(number) + order / 10
    return found


def unit_of(relative: str, layer: dict[str, float]) -> str | None:
    """The unit a module (path below the package) belongs to; None for a package's facade."""
    folder = relative.split("/", 1)[0] + "/"
    if folder in layer:
        return folder
    if relative.endswith("__init__.py"):
        return None
    return relative


def module_path(name: str) -> str | None:
    """``roundpipe.call.stage`` -> ``call/stage.py`` (a package: its ``__init__.py``); None if
    not a module of the package."""
    parts = name.split(".")[1:]
    if not parts:
        return "__init__.py"
    stem = "/".join(parts)
    if (PACKAGE / f"{stem}.py").is_file():
        return f"{stem}.py"
    if (PACKAGE / stem / "__init__.py").is_file():
        return f"{stem}/__init__.py"
    return SAME.get(parts[-1])


def runtime_imports(path: Path) -> list[tuple[int, str, bool]]:
    """(line, imported module's path below the package, only for type checking) of every import
    of ``path``. ``from package import module`` names the module."""
    tree = ast.parse(path.read_text())
    checking: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            checking.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            names = []
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                names.append(submodule if module_path(submodule) else node.module)
        else:
            continue
        for name in names:
            if name == "roundpipe" or name.startswith("roundpipe."):
                target = module_path(name)
                assert target is not None, f"{path}:{node.lineno} imports unknown {name}"
                found.append((node.lineno, target, id(node) in checking))
    return found


def test_every_module_is_known_and_imports_only_lower_layers() -> None:
    layer = layers()
    assert layer["call/pipeline.py"] < layer["call/stage.py"] < layer["torch_internals.py"]
    assert layer["models/"] < layer["roundpipe.py"] < layer["call/autograd.py"]  # the doc was read
    unknown, wrong = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE).as_posix()
        own = unit_of(relative, layer)
        if own is None:
            continue  # a package's facade re-exports names; nothing in the runtime imports it
        if own not in layer:
            unknown.append(relative)
            continue
        for line, imported, annotation_only in runtime_imports(path):
            name = unit_of(imported, layer)
            if name is None:
                if imported != "__init__.py" and not relative.startswith(imported[:-11]):
                    wrong.append(f"{relative}:{line} imports the package facade {imported}")
                continue
            if name == own or (own, name) in ALLOWED:
                continue
            if name not in layer:
                unknown.append(name)
                continue
            # Layer 1 is the top: a module may import the layers numbered above its own.
            if layer[name] < layer[own] or (layer[name] == layer[own] and not annotation_only):
                wrong.append(f"{relative}:{line} imports {name} (layer {layer[name]}, own {own})")
    assert not unknown, f"modules docs/architecture.md's layers do not name: {unknown}"
    assert not wrong, "\n".join(wrong)


def test_modules_hold_one_idea_each() -> None:
    """The call itself stays a sequencing of stages, the public face a delegation, and no module
    grows into several ideas: ``call/pipeline.py`` at most 600 lines, ``roundpipe.py`` at most
    750, every other module at most 900."""
    sizes = {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
    }
    assert sizes["call/pipeline.py"] <= 600, sizes["call/pipeline.py"]
    assert sizes["roundpipe.py"] <= 750, sizes["roundpipe.py"]
    large = {name: lines for name, lines in sizes.items() if lines > 900}
    assert not large, large


def test_one_owner_of_the_process_lifecycle() -> None:
    """Exit handlers, fork hooks and signal handlers are installed by ``lifecycle.py`` alone."""
    owners = {
        path.relative_to(PACKAGE).as_posix()
        for path in PACKAGE.rglob("*.py")
        if re.search(r"atexit\.register|register_at_fork|signal\.signal\(", path.read_text())
    }
    assert owners == {"lifecycle.py"}, owners
