"""Files short enough to hold in your head (issue 43): no product module over MODULE_LINES
lines and no function over FUNCTION_LINES. The ones over today are listed here with their
size, as debts: a new one fails, one that grows fails, and one brought under the limit must
leave the list (so the list stays true). The test prints the whole list either way.

Product code: deploy.py, bench.py, status.py and operations/ (its on-host programs under
operations/files/ included); tests, tools and the sandbox's stand-ins are not counted.
"""

from __future__ import annotations

import ast

from operations import REPO_ROOT

MODULE_LINES = 600
FUNCTION_LINES = 80

#: path: lines, for each product module over MODULE_LINES today.
MODULES_OVER: dict[str, int] = {}
#: "path:qualified name": lines, for each function over FUNCTION_LINES today.
FUNCTIONS_OVER: dict[str, int] = {}


def _product() -> list:
    return sorted([*(REPO_ROOT / n for n in ("deploy.py", "bench.py", "status.py")),
                   *(REPO_ROOT / "operations").rglob("*.py")])


def _functions(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")


def sizes() -> tuple[dict[str, int], dict[str, int]]:
    """(modules over MODULE_LINES, functions over FUNCTION_LINES), as MODULES_OVER and
    FUNCTIONS_OVER name them."""
    modules, functions = {}, {}
    for path in _product():
        text = path.read_text(encoding="utf-8")
        rel = path.relative_to(REPO_ROOT).as_posix()
        lines = len(text.splitlines())
        if lines > MODULE_LINES:
            modules[rel] = lines
        for name, n in _functions(ast.parse(text)):
            if n > FUNCTION_LINES:
                functions[f"{rel}:{name}"] = n
    return modules, functions


def _debts(now: dict[str, int], listed: dict[str, int], limit: int) -> list[str]:
    said = []
    for name, n in sorted(now.items()):
        if name not in listed:
            said.append(f"{name}: {n} lines, over {limit} (new)")
        elif n > listed[name]:
            said.append(f"{name}: {n} lines, grown from {listed[name]}")
    said += [f"{name}: now within {limit}: take it off the list"
             for name in sorted(set(listed) - set(now))]
    return said


def test_no_module_and_no_function_grows_past_its_limit():
    modules, functions = sizes()
    print(f"{len(modules)} module(s) over {MODULE_LINES} lines, {len(functions)} function(s) "
          f"over {FUNCTION_LINES}:")
    for name, n in sorted({**modules, **functions}.items(), key=lambda kv: -kv[1]):
        print(f"  {n:5d}  {name}")
    assert _debts(modules, MODULES_OVER, MODULE_LINES) + _debts(
        functions, FUNCTIONS_OVER, FUNCTION_LINES) == []


def test_the_debts_are_said():
    assert _debts({"a.py": 700}, {}, 600) == ["a.py: 700 lines, over 600 (new)"]
    assert _debts({"a.py": 700}, {"a.py": 650}, 600) == ["a.py: 700 lines, grown from 650"]
    assert _debts({}, {"a.py": 650}, 600) == ["a.py: now within 600: take it off the list"]
    assert _debts({"a.py": 640}, {"a.py": 650}, 600) == []
