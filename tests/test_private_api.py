"""torch's private Python API is used in one module, ``roundpipe.torch_internals``, whose
lookups degrade safely where a torch release lacks them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from roundpipe import torch_internals
from torch import nn

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "roundpipe"

# The underscored attributes torch keeps on tensors and modules that the runtime needs.
PRIVATE_ATTRIBUTES = {
    "_backward_hooks",
    "_post_accumulate_grad_hooks",
    "_version",
    "_parameters",
    "_buffers",
    "_modules",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
    "_execution_engine",
}


def _dotted(node: ast.AST) -> str:
    """``torch._C._foo`` for the attribute chain ``node``; "" where it does not start at a name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def _private_uses(path: Path) -> list[str]:
    """Where ``path`` names one of torch's private modules or attributes: an underscored part of
    a ``torch.`` import or attribute chain, or one of :data:`PRIVATE_ATTRIBUTES` on any object
    other than ``self`` (the runtime's own classes may use such names)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted.startswith("torch."):
                names = [dotted]
            owner = node.value
            if node.attr in PRIVATE_ATTRIBUTES and not (
                isinstance(owner, ast.Name) and owner.id in ("self", "cls")
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
        for name in names:
            parts = name.split(".")
            if parts[0] == "torch" and any(
                part.startswith("_") and not part.startswith("__") for part in parts
            ):
                found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {name}")
    return found


def _torch_private_names() -> set[str]:
    """The underscored attribute names of torch's common objects (a module, a tensor, an
    optimizer, the ``torch`` namespaces): what a string passed to ``getattr`` could reach."""
    owners = [
        nn.Linear(1, 1),
        torch.zeros(1, requires_grad=True),
        torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1),
        torch,
        torch.autograd,
        torch.nn.functional,
        torch.optim.Optimizer,
        torch.utils,
    ]
    ours = {"_C"}  # roundpipe's compiled core has the name of torch's
    return {
        name
        for owner in owners
        for name in dir(owner)
        if name.startswith("_") and not name.startswith("__") and name not in ours
    }


def _private_strings(path: Path, private: set[str]) -> list[str]:
    """Where ``path`` holds one of torch's underscored names in a string literal (a name handed
    to ``getattr``/``hasattr``/``setattr`` reaches the private API as surely as an attribute)."""
    return [
        f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in private
    ]


def test_only_the_door_names_torch_private_attributes_in_strings() -> None:
    private = _torch_private_names()
    assert "_forward_hooks" in private  # the names were read
    assert "_optimizer_load_state_dict_pre_hooks" in private
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "torch_internals.py"
        for use in _private_strings(path, private)
    ]
    assert not found, "\n".join(sorted(set(found)))


def test_only_the_door_touches_private_torch_api() -> None:
    found = [
        use
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "torch_internals.py"
        for use in _private_uses(path)
    ]
    assert not found, "\n".join(sorted(set(found)))


def test_the_check_sees_what_it_looks_for() -> None:
    """The check above finds each kind of private use (it would pass vacuously otherwise)."""
    door = PACKAGE / "torch_internals.py"
    uses = "\n".join(_private_uses(door))
    for name in ("torch.utils._pytree", "torch._C.TensorBase", "._backward_hooks", "._version"):
        assert name in uses, (name, uses)


def test_the_door_is_what_it_wraps() -> None:
    """Each wrapper answers what torch's own attribute says (on the torch under test)."""
    w = torch.ones(2, requires_grad=True)
    assert torch_internals.backward_hooks(w) in (None, {})
    handle = w.register_hook(lambda g: g * 2)
    hooks = torch_internals.backward_hooks(w)
    assert hooks is not None and len(hooks) == 1
    copy = torch.ones(2, requires_grad=True)
    torch_internals.share_backward_hooks(copy, hooks)
    (copy * 3).sum().backward()
    assert torch.equal(copy.grad, torch.full((2,), 6.0))  # the shared hook doubled it
    handle.remove()
    assert not torch_internals.has_post_accumulate_grad_hooks(w)
    w.register_post_accumulate_grad_hook(lambda t: None)
    assert torch_internals.has_post_accumulate_grad_hooks(w)

    before = torch_internals.version_of(w.detach())
    with torch.no_grad():
        w.add_(1)
    assert torch_internals.version_of(w) == before + 1

    layer = nn.Linear(2, 2)
    assert torch_internals.parameter_slots(layer)["weight"] is layer.weight
    norm = nn.BatchNorm1d(2)
    assert torch_internals.buffer_slots(norm)["running_mean"] is norm.running_mean
    assert torch_internals.child_slots(nn.Sequential(layer))["0"] is layer
    assert isinstance(norm, torch_internals.NORM_CLASSES)
    assert torch_internals.loads_state_dict_plainly(layer)
    assert torch_internals.loads_state_dict_plainly(norm)
    layer.register_load_state_dict_post_hook(lambda module, keys: None)
    assert not torch_internals.loads_state_dict_plainly(layer)


def test_engine_lookups_inside_and_outside_a_pass() -> None:
    assert torch_internals.current_graph_task_id() == -1
    assert torch_internals.will_engine_execute_node(torch.ones(1, requires_grad=True).grad_fn)
    seen: list[tuple[int, bool]] = []
    ended: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = torch.ones(2, requires_grad=True)
    unused = (y * 2).sum()

    def hook(grad: torch.Tensor) -> None:
        seen.append(
            (
                torch_internals.current_graph_task_id(),
                torch_internals.will_engine_execute_node(unused.grad_fn),
            )
        )
        torch_internals.queue_engine_callback(lambda: ended.append(True))

    z = x * 3
    z.register_hook(hook)
    torch.autograd.grad(z.sum(), [x])
    assert len(seen) == 1 and seen[0][0] >= 0
    assert seen[0][1] is False  # torch.autograd.grad runs only what x's gradient needs
    assert ended == [True]


def test_missing_lookups_degrade_safely(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch_internals, "_will_engine_execute_node", None)
    assert torch_internals.will_engine_execute_node(object()) is True  # keep the gradients
    monkeypatch.setattr(torch_internals, "_current_graph_task_id", None)
    with pytest.raises(RuntimeError, match="_current_graph_task_id"):
        torch_internals.current_graph_task_id()
    monkeypatch.setattr(torch_internals, "_engine", None)
    with pytest.raises(RuntimeError, match="queue_callback"):
        torch_internals.queue_engine_callback(lambda: None)

    class Renamed(nn.Linear):
        """A module whose hook dicts a future torch might have renamed."""

        def __getattr__(self, name: str) -> object:
            if name.endswith("state_dict_hooks") or name.endswith("state_dict_pre_hooks"):
                raise AttributeError(name)
            return super().__getattr__(name)

    module = Renamed(2, 2)
    for name in ("_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks"):
        module.__dict__.pop(name, None)
    assert torch_internals.has_state_dict_hooks(module)  # unknown counts as hooked
