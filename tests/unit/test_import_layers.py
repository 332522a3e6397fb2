"""Every import inside the package goes down the layers of trainer/architecture.py, and none goes round
in a circle: a module may import from its own folder and from lower layers only. Each folder sits as
low as its imports allow, so that the layers forbid what they should."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from trainer.architecture import LAYERS, layer_of

PACKAGE = Path(__file__).resolve().parents[2] / "trainer"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def _imports() -> dict[str, set[str]]:
    """Each module of the package (dotted, below `trainer`) and the package modules it imports,
    at the top or inside a function alike."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                continue
            for target in targets:
                if target.startswith("trainer.") and (PACKAGE / target[8:].replace(".", "/")).with_suffix(".py").exists() \
                        or target.startswith("trainer.") and (PACKAGE / target[8:].replace(".", "/") / "__init__.py").exists():
                    found.add(target[8:])
        graph[name] = found - {name}
    return graph


GRAPH = _imports()


def _folder(module: str) -> str:
    return module.split(".")[0]


def test_every_module_has_a_layer() -> None:
    for module in GRAPH:
        layer_of(module)  # raises, naming the module


def test_no_import_runs_up_or_sideways() -> None:
    wrong = []
    for module, targets in GRAPH.items():
        for target in targets:
            if _folder(target) == _folder(module):
                continue
            if layer_of(target) >= layer_of(module):
                wrong.append(f"trainer.{module} imports trainer.{target} "
                             f"({'its own layer' if layer_of(target) == layer_of(module) else 'a layer above'})")
    assert not wrong, "\n".join(wrong)


def test_no_circles() -> None:
    """No module reaches itself again through its imports (between folders or inside one)."""
    state: dict[str, int] = {}
    path: list[str] = []
    circles: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        path.append(module)
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH:
                continue  # a package whose __init__ is the module itself
            if state.get(target) == 1:
                circles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target)
        path.pop()
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module)
    assert not circles, "\n".join(circles)


@pytest.mark.parametrize("members", [members for members, _ in LAYERS])
def test_every_layer_names_something_that_exists(members: tuple[str, ...]) -> None:
    for member in members:
        assert (PACKAGE / member).is_dir() or (PACKAGE / f"{member}.py").is_file(), member


#: Members whose imports the graph cannot see: the package's public names are imported on first use,
#: by name (trainer/__init__.py), from every layer.
IMPORTS_BY_NAME = {"__init__"}


def test_every_member_sits_as_low_as_its_imports_allow() -> None:
    """A member declared higher than its imports need would let it import what it must not (deploy/
    the run, say): each sits just above the highest layer it imports from."""
    highest: dict[str, int] = {}
    for module, targets in GRAPH.items():
        for target in targets:
            if _folder(target) != _folder(module):
                highest[_folder(module)] = max(highest.get(_folder(module), -1), layer_of(target))
    too_high = [f"trainer.{member}: layer {index}, its imports allow layer {highest.get(member, -1) + 1}"
                for index, (members, _) in enumerate(LAYERS) for member in members
                if member not in IMPORTS_BY_NAME and index > highest.get(member, -1) + 1]
    assert not too_high, "\n".join(too_high)
