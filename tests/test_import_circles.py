"""No import circle among the modules of operations/ (the house rule): every import counts,
at the top of a module, inside a function or under ``if TYPE_CHECKING``, since each says the
importer depends on the imported module and a circle of them means neither can be read alone."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

OPERATIONS = Path(__file__).resolve().parent.parent / "operations"


def _module(path: Path) -> str:
    parts = path.relative_to(OPERATIONS.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(source: str, module: str, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``source`` (the text of ``module``) imports, anywhere."""
    found = set()
    package = module if module in {"operations"} else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # `from operations import remote` imports operations.runtime.remote.
            names = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        found |= {name for name in names if name in known and name != module}
    return found


def graph(root: Path = OPERATIONS) -> dict[str, set[str]]:
    paths = {_module(p): p for p in root.rglob("*.py")}
    known = set(paths)
    return {name: imports(path.read_text(), name, known) for name, path in paths.items()}


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Each import circle once, as the modules along it (Tarjan's strongly connected
    components of more than one module, or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def test_no_import_circle_in_operations() -> None:
    found = circles(graph())
    assert not found, "import circles among operations/ modules: " + "; ".join(
        " <-> ".join(c) for c in found)


@pytest.mark.parametrize("source, expected", [
    ("from operations.a import x", {"operations.a"}),
    ("from operations import a", {"operations.a"}),
    ("import operations.a", {"operations.a"}),
    ("def f():\n    from operations.a import x", {"operations.a"}),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from operations.a import A",
     {"operations.a"}),
    ("from .a import x", {"operations.a"}),
])
def test_every_kind_of_import_counts(source: str, expected: set[str]) -> None:
    known = {"operations", "operations.a", "operations.b"}
    assert imports(source, "operations.b", known) - {"operations"} == expected


def test_a_circle_is_found() -> None:
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) == 3 else None


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own (operations.LAYERS, lowest first),
    and each import of gpuhost by a program of operations/files/ (run on hosts that have no
    gpuhost package), as "importer -> imported"."""
    from operations import LAYERS

    rank = {layer: n for n, layer in enumerate(LAYERS)}
    found = []
    for module, imported in sorted(edges.items()):
        layer = _layer(module)
        for other in sorted(imported):
            if other == "operations":
                if layer == "files":
                    found.append(f"{module} -> {other}")
                continue
            if layer == "files" and _layer(other) != "files":
                found.append(f"{module} -> {other}")
            elif layer in rank and rank.get(_layer(other), -1) > rank[layer]:
                found.append(f"{module} -> {other}")
    return found


def test_every_module_lives_in_a_layer():
    """operations/ holds only its package's __init__.py and the layers' folders."""
    from operations import LAYERS

    loose = sorted(p.name for p in OPERATIONS.glob("*.py") if p.name != "__init__.py")
    folders = sorted(p.name for p in OPERATIONS.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert loose == [] and folders == sorted([*LAYERS, "files"])
    for layer in [*LAYERS, "files"]:
        assert (OPERATIONS / layer / "README.md").is_file(), layer


def test_imports_flow_down_the_layers():
    assert upward_imports(graph()) == []


def test_an_upward_import_is_found():
    edges = {"operations.facts.a": {"operations.stages.b"}, "operations.stages.b": {"operations.facts.a"},
             "operations.files.c": {"operations.facts.a"}}
    assert upward_imports(edges) == ["operations.facts.a -> operations.stages.b",
                                     "operations.files.c -> operations.facts.a"]
