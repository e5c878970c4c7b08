#!/usr/bin/env python3
"""Read sglang.bench_serving's command line and result fields out of the real wheel, without
importing sglang: locks/sglang-<version>.bench_serving.json.

    pip download --no-deps sglang==0.5.9 -d /tmp/sgl
    python tools/bench_serving_args.py /tmp/sgl/sglang-0.5.9-py3-none-any.whl

``sglang/bench_serving.py`` is parsed with :mod:`ast`: every ``add_argument(...)`` call (its
flags, type, default, action, choices: a literal list, or ``list(X.keys())`` of a module-level
dict literal ``X``), and the keys of the ``result = {...}`` dict that the tool writes to
``--output-file``. bench.py's command line (operations/files/bench_run.py), the sandbox's stand-in
tool and the report's fields are tested against this file (tests/test_bench_serving_spec.py).
Standard library only.
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

SOURCE = "sglang/bench_serving.py"
LOCKS = Path(__file__).resolve().parent.parent / "locks"


def _literal(node: ast.AST, dicts: dict[str, list[str]]):
    try:
        return ast.literal_eval(node)
    except ValueError:
        pass
    # list(ASYNC_REQUEST_FUNCS.keys())
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id == "list" and node.args
            and isinstance(node.args[0], ast.Call)
            and isinstance(node.args[0].func, ast.Attribute)
            and node.args[0].func.attr == "keys"
            and isinstance(node.args[0].func.value, ast.Name)):
        return dicts.get(node.args[0].func.value.id)
    if isinstance(node, ast.Name):
        return {"int": "int", "float": "float", "str": "str"}.get(node.id, node.id)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
            and node.func.id == "float" and node.args:
        return f"float({ast.literal_eval(node.args[0])})"
    return ast.unparse(node)


def extract(source: str) -> dict:
    tree = ast.parse(source)
    dicts = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            dicts[node.targets[0].id] = keys
    arguments = {}
    result_fields: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                and node.func.attr == "add_argument":
            flags = [a.value for a in node.args if isinstance(a, ast.Constant)]
            spec = {k.arg: _literal(k.value, dicts) for k in node.keywords
                    if k.arg in ("type", "default", "action", "choices", "nargs")}
            for flag in flags:
                if flag.startswith("--"):
                    arguments[flag] = {"flags": flags, **spec}
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict) \
                and any(isinstance(t, ast.Name) and t.id == "result" for t in node.targets):
            keys = [k.value for k in node.value.keys if isinstance(k, ast.Constant)]
            if "output_throughput" in keys:
                result_fields = keys
    return {"arguments": arguments, "result_fields": result_fields}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__.splitlines()[3].strip(), file=sys.stderr)
        return 2
    wheel = Path(argv[0])
    version = re.match(r"sglang-([^-]+)-", wheel.name)
    if not version:
        print(f"{wheel}: not an sglang wheel", file=sys.stderr)
        return 2
    with zipfile.ZipFile(wheel) as archive:
        spec = extract(archive.read(SOURCE).decode())
    spec = {"sglang": version.group(1), "source": SOURCE, **spec}
    dest = LOCKS / f"sglang-{version.group(1)}.bench_serving.json"
    dest.write_text(json.dumps(spec, indent=1, default=str) + "\n")
    print(f"{dest}: {len(spec['arguments'])} arguments, {len(spec['result_fields'])} result "
          "fields")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
