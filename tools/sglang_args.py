#!/usr/bin/env python3
"""Read sglang's server arguments out of its real wheels, without importing sglang.

For each requested version the wheel is fetched from PyPI with
``pip download --no-deps --only-binary=:all:`` into a cache outside the repo, its sha256 is
checked against the index, and ``sglang/srt/server_args.py`` is parsed with :mod:`ast`:
every ``parser.add_argument(...)`` reached from ``ServerArgs.add_cli_args`` is recorded, and
choices that name module-level lists, class attributes (``ReasoningParser.DetectorMap``),
enums or small helper functions are resolved statically, following imports into sibling
modules of the same wheel. Newer sglang releases declare most arguments as annotated fields
(``A[T, Arg(...)]``) registered by ``add_cli_args_from_dataclass``; those are read the same
way, mirroring that helper's rules. A choices expression that cannot be resolved statically
is written as ``"choices": null`` with a ``"choices_unresolved"`` note.

Subcommands (run from the repository root; see locks/README.md):

    python tools/sglang_args.py extract 0.5.9 0.5.10 latest   # locks/sglang-<v>.args.json
    python tools/sglang_args.py renames --old 0.5.9 0.5.10 --new latest
                                                             # locks/sglang-flag-renames.json
    python tools/sglang_args.py check 0.5.9 0.5.10 latest    # reference launch vs. each version
    python tools/sglang_args.py all                          # the three above, in order

Standard library only, plus ``packaging`` for version ordering.
"""

from __future__ import annotations

import argparse
import ast
import copy
import hashlib
import json
import math
import os
import re
import shlex
import subprocess
import sys
import urllib.request
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import parse_wheel_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "locks"
DEFAULT_CACHE = Path(os.environ.get("SGLANG_WHEEL_CACHE", "/tmp/sglang-wheels"))
DEFAULT_INDEX = os.environ.get("SGLANG_ARGS_INDEX_URL", "https://pypi.org/simple")
REFERENCE_LAUNCH = LOCKS / "reference-launch.txt"
RENAMES_FILE = LOCKS / "sglang-flag-renames.json"
SERVER_ARGS = "sglang/srt/server_args.py"

# The deployment target: CPython 3.12 on Linux x86_64 (Ubuntu 24.04, glibc 2.39). pip does
# not widen a manylinux_2_N --platform to older tags, so every tag is listed.
TARGET_PYTHON = "3.12"
TARGET_PLATFORMS = [f"manylinux_2_{m}_x86_64" for m in range(39, 16, -1)] + [
    "manylinux2014_x86_64",
    "linux_x86_64",
]


def log(msg: str) -> None:
    print(msg, file=sys.stderr)


# ---------------------------------------------------------------------------
# Fetching wheels
# ---------------------------------------------------------------------------


def index_files(package: str, index_url: str = DEFAULT_INDEX) -> dict:
    """PEP 691 JSON listing of a project on the index: {"versions": [...], "files": [...]}."""
    req = urllib.request.Request(
        f"{index_url.rstrip('/')}/{package}/",
        headers={"Accept": "application/vnd.pypi.simple.v1+json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.load(resp)


def release_versions(package: str = "sglang", index_url: str = DEFAULT_INDEX) -> list[Version]:
    """Final (non-pre-release) versions that have at least one non-yanked wheel, ascending."""
    data = index_files(package, index_url)
    found = set()
    for f in data["files"]:
        if not f["filename"].endswith(".whl") or f.get("yanked"):
            continue
        _, ver, _, _ = parse_wheel_filename(f["filename"])
        if not ver.is_prerelease and not ver.is_devrelease:
            found.add(ver)
    return sorted(found)


def resolve_version(spec: str, index_url: str = DEFAULT_INDEX) -> str:
    if spec == "latest":
        return str(release_versions("sglang", index_url)[-1])
    return str(Version(spec))


def fetch_wheel(version: str, cache: Path = DEFAULT_CACHE, index_url: str = DEFAULT_INDEX):
    """Return (path, sha256) of sglang==version's wheel for the target, downloading if needed.

    ``--isolated`` keeps the machine's pip configuration (extra indexes, find-links,
    constraints) out of it, so the wheel comes from ``index_url`` alone.
    """
    cache.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "pip", "--isolated", "download",
        "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
        "--index-url", index_url,
        "--python-version", TARGET_PYTHON, "--implementation", "cp",
        "--abi", "cp" + TARGET_PYTHON.replace(".", ""),
    ]
    for plat in TARGET_PLATFORMS:
        cmd += ["--platform", plat]
    cmd += ["-d", str(cache), f"sglang=={version}"]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wheels = []
    for p in cache.glob("sglang-*.whl"):
        _, ver, _, _ = parse_wheel_filename(p.name)
        if ver == Version(version):
            wheels.append(p)
    if not wheels:
        raise SystemExit(f"pip download left no wheel for sglang=={version} in {cache}")
    # A py3-none-any wheel and a cp312 wheel of one version cannot both be chosen by pip;
    # prefer whichever pip just touched.
    wheel = max(wheels, key=lambda p: p.stat().st_mtime)
    sha = hashlib.sha256(wheel.read_bytes()).hexdigest()
    try:
        listed = {
            f["filename"]: f["hashes"].get("sha256")
            for f in index_files("sglang", index_url)["files"]
        }
    except OSError as exc:  # the index answered pip; a failure here is worth a note only
        log(f"note: could not cross-check {wheel.name} against the index: {exc}")
    else:
        if listed.get(wheel.name) != sha:
            raise SystemExit(f"{wheel.name}: sha256 {sha} does not match the index's listing")
    return wheel, sha


# ---------------------------------------------------------------------------
# A small static evaluator over the wheel's modules
# ---------------------------------------------------------------------------


class Unresolved(Exception):
    """An expression whose value cannot be known without running sglang."""


MISSING = object()


@dataclass(eq=False)
class ModuleRef:
    module: Module


@dataclass(eq=False)
class ClassRef:
    module: Module
    node: ast.ClassDef


@dataclass(eq=False)
class FuncRef:
    module: Module
    node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda


@dataclass(frozen=True)
class EnumMember:
    cls: str
    name: str
    value: Any


@dataclass(eq=False)
class Builtin:
    name: str


@dataclass(eq=False)
class BoundMethod:
    obj: Any
    name: str


@dataclass(eq=False)
class External:
    """A name imported from outside the wheel (argparse, typing, msgspec, ...)."""

    dotted: str


BUILTINS = {"list", "tuple", "set", "frozenset", "sorted", "dict", "str", "int", "float",
            "bool", "len", "reversed"}
ENUM_BASES = {"Enum", "IntEnum", "StrEnum", "IntFlag", "Flag"}
MUTATORS = {"append", "extend", "add", "update", "insert"}


class Wheel:
    """The Python modules of one wheel, parsed on demand."""

    def __init__(self, path: Path):
        self.path = path
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())
        self.modules: dict[str, Module] = {}
        self.read: list[str] = []

    def module_file(self, dotted: str) -> str | None:
        base = dotted.replace(".", "/")
        for cand in (base + ".py", base + "/__init__.py"):
            if cand in self.names:
                return cand
        return None

    def is_package(self, dotted: str) -> bool:
        return (dotted.replace(".", "/") + "/__init__.py") in self.names

    def module(self, dotted: str) -> Module:
        if dotted not in self.modules:
            fname = self.module_file(dotted)
            if fname is None:
                raise Unresolved(f"module {dotted} is not in the wheel")
            tree = ast.parse(self.zip.read(fname).decode("utf-8"), filename=fname)
            self.modules[dotted] = Module(self, dotted, fname, tree)
            self.read.append(fname)
        return self.modules[dotted]


@dataclass
class Event:
    kind: str  # "bind", "import", "augassign", "mutate"
    node: ast.AST


class Module:
    def __init__(self, wheel: Wheel, name: str, fname: str, tree: ast.Module):
        self.wheel, self.name, self.fname, self.tree = wheel, name, fname, tree
        self.package = name if fname.endswith("__init__.py") else name.rpartition(".")[0]
        self.events: dict[str, list[Event]] = {}
        self.cache: dict[str, Any] = {}
        self._busy: set[str] = set()
        self._index(tree.body, top=True)

    def _add(self, name: str, kind: str, node: ast.AST) -> None:
        self.events.setdefault(name, []).append(Event(kind, node))

    def _index(self, body: list[ast.stmt], top: bool) -> None:
        for st in body:
            if isinstance(st, (ast.Import, ast.ImportFrom)):
                for alias in st.names:
                    if alias.name == "*":
                        continue
                    local = alias.asname or alias.name.split(".")[0]
                    self._add(local, "import", (st, alias))
            elif isinstance(st, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                self._add(st.name, "bind", st)
            elif not top:
                continue  # only imports are taken from conditional blocks
            elif isinstance(st, ast.Assign):
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        self._add(t.id, "bind", st.value)
            elif isinstance(st, ast.AnnAssign) and st.value is not None:
                if isinstance(st.target, ast.Name):
                    self._add(st.target.id, "bind", st.value)
            elif isinstance(st, ast.AugAssign) and isinstance(st.target, ast.Name):
                self._add(st.target.id, "augassign", st)
            elif (
                isinstance(st, ast.Expr)
                and isinstance(st.value, ast.Call)
                and isinstance(st.value.func, ast.Attribute)
                and isinstance(st.value.func.value, ast.Name)
                and st.value.func.attr in MUTATORS
            ):
                self._add(st.value.func.value.id, "mutate", st.value)
            if isinstance(st, ast.Try):
                self._index(st.body, top=False)
            elif isinstance(st, ast.If):
                self._index(st.body, top=False)
                self._index(st.orelse, top=False)

    def resolve_import(self, st: ast.Import | ast.ImportFrom, alias: ast.alias) -> Any:
        if isinstance(st, ast.Import):
            if alias.asname:
                return import_module_ref(self.wheel, alias.name)
            return import_module_ref(self.wheel, alias.name.split(".")[0])
        if st.level:
            parts = self.package.split(".")
            if st.level > 1:
                parts = parts[: len(parts) - (st.level - 1)]
            base = ".".join(parts + ([st.module] if st.module else []))
        else:
            base = st.module or ""
        if self.wheel.module_file(base) is None:
            return External(f"{base}.{alias.name}")
        mod = self.wheel.module(base)
        try:
            return mod.lookup(alias.name)
        except Unresolved:
            sub = f"{base}.{alias.name}"
            if self.wheel.module_file(sub):
                return ModuleRef(self.wheel.module(sub))
            raise

    def lookup(self, name: str) -> Any:
        if name in self.cache:
            return self.cache[name]
        if name not in self.events:
            raise Unresolved(f"{self.name}.{name} is not defined at module level")
        if name in self._busy:
            raise Unresolved(f"{self.name}.{name} refers to itself")
        self._busy.add(name)
        try:
            value: Any = MISSING
            scope = Scope(self)
            for ev in self.events[name]:
                if ev.kind == "import":
                    value = self.resolve_import(*ev.node)
                elif ev.kind == "bind":
                    node = ev.node
                    if isinstance(node, ast.ClassDef):
                        value = ClassRef(self, node)
                    elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                        value = FuncRef(self, node)
                    else:
                        value = evaluate(node, scope)
                elif ev.kind == "augassign":
                    value = apply_binop(ev.node.op, value, evaluate(ev.node.value, scope))
                elif ev.kind == "mutate":
                    value = apply_mutation(value, ev.node, scope)
            if value is MISSING:
                raise Unresolved(f"{self.name}.{name} has no value")
            self.cache[name] = value
            return value
        finally:
            self._busy.discard(name)


def import_module_ref(wheel: Wheel, dotted: str) -> Any:
    if wheel.module_file(dotted) is None:
        return External(dotted)
    return ModuleRef(wheel.module(dotted))


class Scope:
    def __init__(self, module: Module, local: dict | None = None):
        self.module = module
        self.local = dict(local or {})

    def lookup(self, name: str) -> Any:
        if name in self.local:
            v = self.local[name]
            if isinstance(v, UnresolvedLocal):
                raise Unresolved(f"{name} = {v.text}")
            return v
        try:
            return self.module.lookup(name)
        except Unresolved:
            if name in BUILTINS:
                return Builtin(name)
            raise


@dataclass
class UnresolvedLocal:
    text: str


class FieldDefaults:
    """``ServerArgs.<field>`` inside add_cli_args: the field's declared default."""

    def __init__(self, extractor: Extractor):
        self.extractor = extractor

    def field_default(self, name: str) -> Any:
        return self.extractor.field_default(name)


class DefaultsScope(Scope):
    """The scope of add_argument's keywords: ``ServerArgs``/``cls`` and
    ``_declared_default("<field>")`` name declared field defaults."""

    def __init__(self, inner: Scope, defaults: FieldDefaults):
        super().__init__(inner.module, inner.local)
        self.defaults = defaults

    def lookup(self, name: str) -> Any:
        if name in ("ServerArgs", "cls"):
            return self.defaults
        return super().lookup(name)


class ClassBodyScope(Scope):
    """Inside a class body, earlier class-level names are visible (``ALL = (FULL, ...)``)."""

    def __init__(self, ref: ClassRef, busy: frozenset):
        super().__init__(ref.module)
        self.ref, self.busy = ref, busy

    def lookup(self, name: str) -> Any:
        if name not in self.busy:
            try:
                return class_attr(self.ref, name, busy=self.busy | {name}, bases=False)
            except Unresolved:
                pass
        return super().lookup(name)


def class_attr(ref: ClassRef, name: str, seen: frozenset = frozenset(),
               busy: frozenset = frozenset(), bases: bool = True) -> Any:
    scope = ClassBodyScope(ref, busy | {name})
    value: Any = MISSING
    for st in ref.node.body:
        targets = []
        if isinstance(st, ast.Assign):
            targets = [t.id for t in st.targets if isinstance(t, ast.Name)]
            expr = st.value
        elif isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name) and st.value:
            targets, expr = [st.target.id], st.value
        elif isinstance(st, (ast.FunctionDef, ast.AsyncFunctionDef)) and st.name == name:
            value = FuncRef(ref.module, st)
            continue
        if name in targets:
            if is_enum(ref):
                value = EnumMember(ref.node.name, name, evaluate(expr, scope))
            else:
                value = evaluate(expr, scope)
    if value is not MISSING:
        return value
    if not bases:
        raise Unresolved(f"{ref.node.name}.{name} is not a class attribute")
    for base in ref.node.bases:
        try:
            b = evaluate(base, scope)
        except Unresolved:
            continue
        if isinstance(b, ClassRef) and id(b.node) not in seen:
            try:
                return class_attr(b, name, seen | {id(b.node)})
            except Unresolved:
                pass
    raise Unresolved(f"{ref.node.name}.{name} is not a class attribute")


def is_enum(ref: ClassRef) -> bool:
    for base in ref.node.bases:
        text = ast.unparse(base).rpartition(".")[2]
        if text in ENUM_BASES:
            return True
    return False


def enum_members(ref: ClassRef) -> list[EnumMember]:
    scope = Scope(ref.module)
    out = []
    for st in ref.node.body:
        if isinstance(st, ast.Assign) and len(st.targets) == 1 and isinstance(st.targets[0], ast.Name):
            name = st.targets[0].id
            if not name.startswith("_"):
                out.append(EnumMember(ref.node.name, name, evaluate(st.value, scope)))
    return out


def iterate(value: Any) -> list:
    if isinstance(value, dict):
        return list(value.keys())
    if isinstance(value, (list, tuple, set, frozenset, str)):
        return list(sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value)
    if isinstance(value, ClassRef) and is_enum(value):
        return enum_members(value)
    raise Unresolved(f"cannot iterate over {type(value).__name__}")


def apply_binop(op: ast.operator, a: Any, b: Any) -> Any:
    try:
        if isinstance(op, ast.Add):
            if isinstance(a, tuple) and isinstance(b, list):
                return list(a) + b
            return a + b
        if isinstance(op, ast.BitOr):
            return a | b
        if isinstance(op, ast.Sub):
            return a - b
        if isinstance(op, ast.Mult):
            return a * b
        if isinstance(op, ast.LShift):
            return a << b
    except TypeError as exc:
        raise Unresolved(str(exc)) from None
    raise Unresolved(f"operator {type(op).__name__}")


def apply_mutation(value: Any, call: ast.Call, scope: Scope) -> Any:
    value = copy.copy(value)
    method = call.func.attr
    args = [evaluate(a, scope) for a in call.args]
    try:
        getattr(value, method)(*args)
    except (AttributeError, TypeError) as exc:
        raise Unresolved(f"{method} on {type(value).__name__}: {exc}") from None
    return value


def call_builtin(name: str, args: list) -> Any:
    if name == "len":
        return len(args[0])
    if name in ("str", "int", "float", "bool"):
        return {"str": str, "int": int, "float": float, "bool": bool}[name](*args)
    if not args:
        return {"list": [], "tuple": (), "set": set(), "frozenset": frozenset(), "dict": {}}[name]
    items = iterate(args[0]) if name != "dict" else args[0]
    if name == "list":
        return list(items)
    if name == "tuple":
        return tuple(items)
    if name in ("set", "frozenset"):
        return set(items)
    if name == "sorted":
        return sorted(items)
    if name == "reversed":
        return list(reversed(items))
    if name == "dict":
        return dict(items)
    raise Unresolved(name)


STR_METHODS = {"lower", "upper", "strip", "replace", "split", "join", "format", "title"}
DICT_METHODS = {"keys", "values", "items", "get", "copy"}


def call_function(ref: FuncRef, args: list) -> Any:
    """Value of a helper function: its parameters must go unused; its fall-through
    ``return`` (the last top-level one) is evaluated with the function's own imports."""
    node = ref.node
    if isinstance(node, ast.Lambda):
        if args or node.args.args:
            raise Unresolved("lambda with arguments")
        return evaluate(node.body, Scope(ref.module))
    if args:
        raise Unresolved(f"{node.name}() called with arguments")
    local: dict = {}
    ret = None
    for st in node.body:
        if isinstance(st, (ast.Import, ast.ImportFrom)):
            for alias in st.names:
                local[alias.asname or alias.name.split(".")[0]] = ref.module.resolve_import(st, alias)
        elif isinstance(st, ast.Assign) and all(isinstance(t, ast.Name) for t in st.targets):
            try:
                v = evaluate(st.value, Scope(ref.module, local))
            except Unresolved:
                v = UnresolvedLocal(ast.unparse(st.value))
            for t in st.targets:
                local[t.id] = v
        elif isinstance(st, ast.Return) and st.value is not None:
            ret = st.value
    if ret is None:
        raise Unresolved(f"{node.name}() has no top-level return")
    return evaluate(ret, Scope(ref.module, local))


def evaluate(node: ast.AST, scope: Scope) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        out: list = []
        for elt in node.elts:
            if isinstance(elt, ast.Starred):
                out.extend(iterate(evaluate(elt.value, scope)))
            else:
                out.append(evaluate(elt, scope))
        if isinstance(node, ast.Tuple):
            return tuple(out)
        if isinstance(node, ast.Set):
            return set(out)
        return out
    if isinstance(node, ast.Dict):
        d: dict = {}
        for k, v in zip(node.keys, node.values):
            if k is None:
                d.update(evaluate(v, scope))
            else:
                d[evaluate(k, scope)] = evaluate(v, scope)
        return d
    if isinstance(node, ast.Name):
        return scope.lookup(node.id)
    if isinstance(node, ast.Attribute):
        base = evaluate(node.value, scope)
        return get_attribute(base, node.attr)
    if isinstance(node, ast.BinOp):
        return apply_binop(node.op, evaluate(node.left, scope), evaluate(node.right, scope))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, scope)
    if isinstance(node, ast.JoinedStr):
        parts = []
        for v in node.values:
            if isinstance(v, ast.Constant):
                parts.append(str(v.value))
            else:
                parts.append(str(evaluate(v.value, scope)))
        return "".join(parts)
    if isinstance(node, ast.Subscript):
        base = evaluate(node.value, scope)
        key = evaluate(node.slice, scope)
        try:
            return base[key]
        except (KeyError, IndexError, TypeError) as exc:
            raise Unresolved(f"subscript: {exc}") from None
    if isinstance(node, (ast.ListComp, ast.SetComp, ast.GeneratorExp)):
        if len(node.generators) != 1 or not isinstance(node.generators[0].target, ast.Name):
            raise Unresolved("comprehension with several loops")
        gen = node.generators[0]
        out = []
        for item in iterate(evaluate(gen.iter, scope)):
            inner = Scope(scope.module, {**scope.local, gen.target.id: item})
            if all(evaluate(cond, inner) for cond in gen.ifs):
                out.append(evaluate(node.elt, inner))
        return set(out) if isinstance(node, ast.SetComp) else out
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b = evaluate(node.left, scope), evaluate(node.comparators[0], scope)
        ops = {ast.Eq: lambda: a == b, ast.NotEq: lambda: a != b, ast.In: lambda: a in b,
               ast.NotIn: lambda: a not in b}
        if type(node.ops[0]) in ops:
            return ops[type(node.ops[0])]()
    if isinstance(node, ast.Call):
        if (
            isinstance(scope, DefaultsScope)
            and isinstance(node.func, ast.Name)
            and node.func.id == "_declared_default"
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            return scope.defaults.field_default(node.args[0].value)
        func = evaluate(node.func, scope)
        if node.keywords:
            raise Unresolved("call with keyword arguments")
        args = [evaluate(a, scope) for a in node.args]
        if isinstance(func, Builtin):
            return call_builtin(func.name, args)
        if isinstance(func, BoundMethod):
            obj, name = func.obj, func.name
            if isinstance(obj, str) and name in STR_METHODS:
                return getattr(obj, name)(*args)
            if isinstance(obj, dict) and name in DICT_METHODS:
                r = getattr(obj, name)(*args)
                return list(r) if name in ("keys", "values", "items") else r
            raise Unresolved(f"method {name} of {type(obj).__name__}")
        if isinstance(func, FuncRef):
            return call_function(func, args)
        raise Unresolved(f"call of {ast.unparse(node.func)}")
    if isinstance(node, ast.Lambda):
        return FuncRef(scope.module, node)
    raise Unresolved(f"{type(node).__name__} expression")


def get_attribute(base: Any, attr: str) -> Any:
    if isinstance(base, FieldDefaults):
        return base.field_default(attr)
    if isinstance(base, ModuleRef):
        mod = base.module
        try:
            return mod.lookup(attr)
        except Unresolved:
            sub = f"{mod.name}.{attr}"
            if mod.wheel.module_file(sub):
                return ModuleRef(mod.wheel.module(sub))
            raise
    if isinstance(base, ClassRef):
        return class_attr(base, attr)
    if isinstance(base, EnumMember):
        if attr == "name":
            return base.name
        if attr == "value":
            return base.value
    if isinstance(base, External):
        return External(f"{base.dotted}.{attr}")
    if isinstance(base, (str, dict)):
        return BoundMethod(base, attr)
    raise Unresolved(f"attribute {attr} of {type(base).__name__}")


# ---------------------------------------------------------------------------
# Arguments
# ---------------------------------------------------------------------------

STORE_TRUE_LIKE = {"store_true", "store_false", "store_const", "count", "help", "version",
                   "append_const", "BooleanOptionalAction"}


@dataclass
class Argument:
    flags: list[str]
    dest: str
    action: str
    type: str | None
    choices: list | None
    nargs: Any
    required: bool
    default: Any
    choices_unresolved: str | None = None
    # Kept in memory for the renames analysis; never written to the args files.
    help: str = ""
    new_flag: str | None = None
    new_flag_kind: str = ""  # "new_flag" or "error_message"
    origin: str = ""

    def to_json(self) -> dict:
        d = {
            "flags": self.flags,
            "dest": self.dest,
            "action": self.action,
            "type": self.type,
            "choices": self.choices,
            "nargs": self.nargs,
            "required": self.required,
            "default": self.default,
        }
        if self.choices is None and self.choices_unresolved:
            d["choices_unresolved"] = self.choices_unresolved
        return d


def json_safe(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, EnumMember):
        return json_safe(value.value)
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((json_safe(v) for v in value), key=lambda v: (type(v).__name__, repr(v)))
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    raise Unresolved(f"{type(value).__name__} is not JSON-safe")


def choices_json(value: Any) -> list:
    if isinstance(value, dict):
        value = list(value.keys())
    if isinstance(value, ClassRef) and is_enum(value):
        value = enum_members(value)
    out = json_safe(value)
    if not isinstance(out, list):
        raise Unresolved("choices is not a collection")
    return out


def callable_name(node: ast.AST, scope: Scope) -> str:
    text = ast.unparse(node)
    if text in ("json.loads", "loads"):
        return "json"
    return text.rpartition(".")[2]


def string_of(node: ast.AST | None, scope: Scope) -> str:
    if node is None:
        return ""
    try:
        v = evaluate(node, scope)
        if isinstance(v, str):
            return v
    except Unresolved:
        pass
    return ast.unparse(node)


def argparse_dest(flags: list[str]) -> str:
    long = [f for f in flags if f.startswith("--")]
    name = (long or flags)[0]
    return name.lstrip("-").replace("-", "_")


def boolean_optional_flags(flags: list[str]) -> list[str]:
    out = []
    for f in flags:
        out.append(f)
        if f.startswith("--"):
            out.append("--no-" + f[2:])
    return out


def evaluate_choices(node: ast.AST, scope: Scope) -> tuple[list | None, str | None]:
    try:
        return choices_json(evaluate(node, scope)), None
    except Unresolved as exc:
        note = ast.unparse(node)
        reason = str(exc)
        if reason and reason not in note:
            note = f"{note} [{reason}]"
        return None, note


def record_add_argument(call: ast.Call, scope: Scope, origin: str) -> Argument | None:
    try:
        flags = [evaluate(a, scope) for a in call.args]
    except Unresolved as exc:
        log(f"  skipped add_argument({ast.unparse(call)[:80]}...): {exc}")
        return None
    if not flags or not all(isinstance(f, str) for f in flags):
        return None
    kw = {k.arg: k.value for k in call.keywords if k.arg}
    if any(k.arg is None for k in call.keywords):
        log(f"  note: **kwargs in add_argument{tuple(flags)} are not followed")
    action_node = kw.get("action")
    if action_node is None:
        action = "store"
    elif isinstance(action_node, ast.Constant):
        action = action_node.value
    else:
        action = ast.unparse(action_node).rpartition(".")[2]
    if action == "BooleanOptionalAction":
        flags = boolean_optional_flags(flags)
    dest = string_of(kw["dest"], scope) if "dest" in kw else argparse_dest(flags)
    type_name = callable_name(kw["type"], scope) if "type" in kw else None
    choices, unresolved = (None, None)
    if "choices" in kw:
        choices, unresolved = evaluate_choices(kw["choices"], scope)
    nargs = None
    if "nargs" in kw:
        try:
            nargs = json_safe(evaluate(kw["nargs"], scope))
        except Unresolved:
            nargs = ast.unparse(kw["nargs"])
    required = False
    if "required" in kw:
        try:
            required = bool(evaluate(kw["required"], scope))
        except Unresolved:
            required = False
    if "default" in kw:
        default = default_value(kw["default"], scope)
    else:
        default = {"store_true": False, "store_false": True}.get(action)
        if action_node is not None and not isinstance(action_node, ast.Constant):
            default = action_class_defaults(action_node, scope).get("default", default)
    new_flag, new_flag_kind = None, ""
    for key in ("new_flag", "error_message"):
        if key in kw:
            new_flag, new_flag_kind = string_of(kw[key], scope), key
            break
    return Argument(
        flags=flags, dest=dest, action=action, type=type_name, choices=choices, nargs=nargs,
        required=required, default=default, choices_unresolved=unresolved,
        help=string_of(kw.get("help"), scope), new_flag=new_flag, new_flag_kind=new_flag_kind,
        origin=origin,
    )


def default_value(node: ast.AST, scope: Scope) -> Any:
    """A default as a JSON-safe literal; null where it is only known at run time."""
    try:
        v = evaluate(node, scope)
        if isinstance(v, ClassRef):
            return None
        return json_safe(v)
    except Unresolved:
        return None


def field_default_node(node: ast.AST | None, scope: Scope) -> Any:
    """MISSING, or the JSON-safe default of a dataclass/msgspec field's right-hand side."""
    if node is None:
        return MISSING
    if isinstance(node, ast.Call) and ast.unparse(node.func).rpartition(".")[2] == "field":
        kw = {k.arg: k.value for k in node.keywords}
        if "default" in kw:
            return default_value(kw["default"], scope)
        if "default_factory" in kw:
            try:
                fac = evaluate(kw["default_factory"], scope)
                if isinstance(fac, Builtin):
                    return json_safe(call_builtin(fac.name, []))
                if isinstance(fac, FuncRef):
                    return json_safe(call_function(fac, []))
            except (Unresolved, KeyError):
                return None
            return None
        return MISSING
    return default_value(node, scope)


# --- dataclass layout (add_cli_args_from_dataclass) -------------------------


@dataclass
class FieldDecl:
    name: str
    annotation: ast.AST
    value: ast.AST | None
    module: Module


def class_fields(ref: ClassRef, seen: frozenset = frozenset()) -> list[FieldDecl]:
    out: list[FieldDecl] = []
    scope = Scope(ref.module)
    for base in ref.node.bases:
        try:
            b = evaluate(base, scope)
        except Unresolved:
            continue
        if isinstance(b, ClassRef) and id(b.node) not in seen:
            out.extend(class_fields(b, seen | {id(b.node)}))
    for st in ref.node.body:
        if isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name):
            if "ClassVar" in ast.unparse(st.annotation):
                continue
            decl = FieldDecl(st.target.id, st.annotation, st.value, ref.module)
            # A redeclared field keeps its first position, as dataclasses do.
            at = next((i for i, f in enumerate(out) if f.name == decl.name), None)
            if at is None:
                out.append(decl)
            else:
                out[at] = decl
    return out


def server_args_fields(sa: ClassRef) -> list[FieldDecl]:
    """Fields of ServerArgs: its own, or (0.5.20+) those collected from namespace classes."""
    mod = sa.module
    own = class_fields(sa)
    namespaces = collector = None
    for st in mod.tree.body:
        value = st.value if isinstance(st, (ast.Assign, ast.Expr)) else None
        if isinstance(value, ast.Call) and ast.unparse(value.func).endswith("collect_input_fields"):
            namespaces = evaluate(value.args[0], Scope(mod))
            try:
                collector = evaluate(value.func, Scope(mod))
            except Unresolved:
                collector = None
            break
    if namespaces is None:
        return own
    collected: list[FieldDecl] = []
    for ns in namespaces:
        if not isinstance(ns, ClassRef):
            raise Unresolved("a namespace in collect_input_fields is not a class")
        collected.extend(class_fields(ns))
    # collect_input_fields orders by the POSITIONAL_FIELD_ORDER its own module sees.
    order: list = []
    for where in (mod, getattr(collector, "module", None)):
        if where is None:
            continue
        try:
            order = list(where.lookup("POSITIONAL_FIELD_ORDER"))
            break
        except Unresolved:
            continue
    rank = {n: i for i, n in enumerate(order)}
    known = sorted((f for f in collected if f.name in rank), key=lambda f: rank[f.name])
    rest = [f for f in collected if f.name not in rank]
    merged = {f.name: f for f in known + rest}
    for f in own:
        merged[f.name] = f
    return list(merged.values())


def annotated_parts(ann: ast.AST) -> tuple[ast.AST, list[ast.AST]] | None:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):
        ann = ast.parse(ann.value, mode="eval").body
    if isinstance(ann, ast.Subscript) and ast.unparse(ann.value).rpartition(".")[2] in (
        "A", "Annotated"
    ):
        sl = ann.slice
        elts = list(sl.elts) if isinstance(sl, ast.Tuple) else [sl]
        return elts[0], elts[1:]
    return None


def unwrap_optional(tp: ast.AST) -> ast.AST:
    if isinstance(tp, ast.BinOp) and isinstance(tp.op, ast.BitOr):
        sides = [tp.left, tp.right]
        non_none = [s for s in sides if not (isinstance(s, ast.Constant) and s.value is None)]
        if len(non_none) == 1:
            return non_none[0]
    if isinstance(tp, ast.Subscript):
        head = ast.unparse(tp.value).rpartition(".")[2]
        if head == "Optional":
            return tp.slice
        if head == "Union":
            elts = tp.slice.elts if isinstance(tp.slice, ast.Tuple) else [tp.slice]
            non_none = [e for e in elts if not (isinstance(e, ast.Constant) and e.value is None)
                        and ast.unparse(e) != "NoneType"]
            if len(non_none) == 1:
                return non_none[0]
    return tp


def infer_type_name(tp: Any) -> str:
    # arg_utils._infer_type_func: str, int, float map to themselves, anything else to str.
    return {"str": "str", "int": "int", "float": "float"}.get(tp, "str")


def dataclass_arguments(fields: list[FieldDecl], origin: str) -> list[Argument]:
    """Mirror sglang.srt.arg_groups.arg_utils.add_cli_args_from_dataclass."""
    out = []
    for f in fields:
        parts = annotated_parts(f.annotation)
        if parts is None:
            continue
        raw_type, metas = parts
        scope = Scope(f.module)
        meta: dict[str, ast.AST] | None = None
        for m in metas:
            if isinstance(m, ast.Call) and ast.unparse(m.func).rpartition(".")[2] == "Arg":
                meta = {k.arg: k.value for k in m.keywords if k.arg}
                if m.args:
                    meta.setdefault("help", m.args[0])
                break
            try:
                if isinstance(evaluate(m, scope), str):
                    meta = {"help": m}
                    break
            except Unresolved:
                continue
        if meta is None:
            continue

        def opt(key, default=None, meta=meta, scope=scope):
            if key not in meta:
                return default
            try:
                return evaluate(meta[key], scope)
            except Unresolved:
                return default

        if opt("no_cli", False):
            continue
        cli_name = opt("cli_name") or "--" + f.name.replace("_", "-")
        flags = [cli_name] + list(opt("aliases") or [])
        default_raw = field_default_node(f.value, scope)
        has_default = default_raw is not MISSING
        default = default_raw if has_default else None
        help_text = string_of(meta.get("help"), scope)
        common = {"dest": f.name, "help": help_text, "origin": origin}
        choices, unresolved = (None, None)
        if "choices" in meta:
            choices, unresolved = evaluate_choices(meta["choices"], scope)
        type_parser = (callable_name(meta["type_parser"], scope)
                       if "type_parser" in meta and not is_none(meta["type_parser"]) else None)
        nargs = opt("nargs")
        const_new_flag = None
        if "action" in meta and not is_none(meta["action"]):
            action = ast.unparse(meta["action"]).rpartition(".")[2]
            if isinstance(meta["action"], ast.Constant):
                action = meta["action"].value
            akw = opt("action_kwargs") or {}
            if action == "BooleanOptionalAction":
                flags = boolean_optional_flags(flags)
            if not has_default:
                default = {"store_true": False, "store_false": True}.get(action)
                if not isinstance(meta["action"], ast.Constant):
                    default = action_class_defaults(meta["action"], scope).get("default", default)
            ak_choices = None
            if isinstance(akw, dict) and "choices" in akw:
                try:
                    ak_choices = choices_json(akw["choices"])
                except Unresolved:
                    ak_choices = None
            kind = ""
            if isinstance(akw, dict):
                for key in ("new_flag", "error_message"):
                    if isinstance(akw.get(key), str):
                        const_new_flag, kind = akw[key], key
                        break
            out.append(Argument(
                flags=flags, action=action,
                type=value_type_name(akw.get("type")) if isinstance(akw, dict) else None,
                choices=ak_choices, nargs=akw.get("nargs") if isinstance(akw, dict) else None,
                required=False,
                default=safe_default(akw["default"]) if isinstance(akw, dict) and "default" in akw
                else default,
                new_flag=const_new_flag, new_flag_kind=kind, **common,
            ))
            continue
        inner = unwrap_optional(raw_type)
        inner_head = inner.value if isinstance(inner, ast.Subscript) else inner
        head = ast.unparse(inner_head).rpartition(".")[2]
        if head == "Literal":
            sl = inner.slice
            lit_nodes = list(sl.elts) if isinstance(sl, ast.Tuple) else [sl]
            try:
                lits = [evaluate(n, scope) for n in lit_nodes]
            except Unresolved:
                lits = None
            if choices is None and unresolved is None:
                if lits is not None:
                    choices = json_safe(lits)
                else:
                    unresolved = ast.unparse(inner)
            first = type(lits[0]).__name__ if lits else "str"
            out.append(Argument(
                flags=flags, action="store", type=type_parser or infer_type_name(first),
                choices=choices, nargs=None, required=False, default=default,
                choices_unresolved=unresolved, **common,
            ))
            continue
        if head in ("List", "list") and type_parser is None:
            elem = "str"
            if isinstance(inner, ast.Subscript):
                elem = ast.unparse(inner.slice).rpartition(".")[2]
            out.append(Argument(
                flags=flags, action="store", type=infer_type_name(elem),
                choices=choices, nargs=nargs or "+", required=False, default=default,
                choices_unresolved=unresolved, **common,
            ))
            continue
        if head == "bool":
            out.append(Argument(
                flags=flags, action="store_true", type=None, choices=None, nargs=None,
                required=False, default=default if has_default else False, **common,
            ))
            continue
        required_meta = opt("required")
        required = required_meta is True or (required_meta is None and not has_default)
        out.append(Argument(
            flags=flags, action="store", type=type_parser or infer_type_name(head),
            choices=choices, nargs=nargs, required=bool(required), default=default,
            choices_unresolved=unresolved, **common,
        ))
    return out


def value_type_name(value: Any) -> str | None:
    """Name of an evaluated ``type=`` value (builtin, helper function, json.loads)."""
    if value is None:
        return None
    if isinstance(value, Builtin):
        return value.name
    if isinstance(value, FuncRef) and not isinstance(value.node, ast.Lambda):
        return value.node.name
    if isinstance(value, External):
        return "json" if value.dotted.endswith("json.loads") else value.dotted.rpartition(".")[2]
    return None


def safe_default(value: Any) -> Any:
    try:
        return json_safe(value)
    except Unresolved:
        return None


def action_class_defaults(action_node: ast.AST, scope: Scope) -> dict:
    """Keyword defaults of a custom Action class's __init__ (``default=False, nargs=0``)."""
    try:
        ref = evaluate(action_node, scope)
    except Unresolved:
        return {}
    if not isinstance(ref, ClassRef):
        return {}
    init = next((st for st in ref.node.body
                 if isinstance(st, ast.FunctionDef) and st.name == "__init__"), None)
    if init is None:
        return {}
    out = {}
    positional = init.args.args[-len(init.args.defaults):] if init.args.defaults else []
    pairs = list(zip(positional, init.args.defaults))
    pairs += [(a, d) for a, d in zip(init.args.kwonlyargs, init.args.kw_defaults) if d is not None]
    for a, d in pairs:
        try:
            out[a.arg] = json_safe(evaluate(d, Scope(ref.module)))
        except Unresolved:
            continue
    return out


def is_none(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value is None


# --- walking add_cli_args ---------------------------------------------------


class Extractor:
    def __init__(self, wheel: Wheel):
        self.wheel = wheel
        self.sa_module = wheel.module("sglang.srt.server_args")
        # The class statement itself: newer releases rebind the name afterwards
        # (``ServerArgs = msgspec.defstruct("ServerArgs", ...)``).
        node = next((st for st in self.sa_module.tree.body
                     if isinstance(st, ast.ClassDef) and st.name == "ServerArgs"), None)
        if node is None:
            raise SystemExit("no class ServerArgs in server_args.py")
        self.server_args = ClassRef(self.sa_module, node)
        self.arguments: list[Argument] = []
        self._fields: list[FieldDecl] | None = None
        self._depth = 0

    def fields(self) -> list[FieldDecl]:
        if self._fields is None:
            self._fields = server_args_fields(self.server_args)
        return self._fields

    def run(self) -> list[Argument]:
        fn = next(
            (st for st in self.server_args.node.body
             if isinstance(st, ast.FunctionDef) and st.name == "add_cli_args"),
            None,
        )
        if fn is None:
            raise SystemExit("ServerArgs.add_cli_args not found")
        self.walk(fn.body, Scope(self.sa_module), self.sa_module, conditional=False)
        return self.arguments

    def field_default(self, name: str) -> Any:
        for f in self.fields():
            if f.name == name:
                v = field_default_node(f.value, Scope(f.module))
                return None if v is MISSING else v
        return None

    def walk(self, body: list[ast.stmt], scope: Scope, module: Module, conditional: bool):
        for st in body:
            if isinstance(st, ast.Expr) and isinstance(st.value, ast.Call):
                self.call(st.value, scope, module, conditional)
            elif isinstance(st, ast.Assign):
                try:
                    value = evaluate(st.value, scope)
                except Unresolved:
                    value = UnresolvedLocal(ast.unparse(st.value))
                for t in st.targets:
                    if isinstance(t, ast.Name):
                        scope.local[t.id] = value
                    if isinstance(st.value, ast.Call) and isinstance(value, UnresolvedLocal):
                        self.call(st.value, scope, module, conditional)
            elif isinstance(st, ast.If):
                self.walk(st.body, scope, module, True)
                self.walk(st.orelse, scope, module, True)
            elif isinstance(st, (ast.With, ast.Try)):
                self.walk(st.body, scope, module, conditional)
            elif isinstance(st, ast.For) and isinstance(st.target, ast.Name):
                try:
                    items = iterate(evaluate(st.iter, scope))
                except Unresolved as exc:
                    log(f"  note: loop over {ast.unparse(st.iter)} not followed: {exc}")
                    continue
                for item in items:
                    scope.local[st.target.id] = item
                    self.walk(st.body, scope, module, conditional)

    def call(self, call: ast.Call, scope: Scope, module: Module, conditional: bool):
        func = call.func
        fname = ast.unparse(func)
        if isinstance(func, ast.Attribute) and func.attr == "add_argument":
            arg = record_add_argument(call, self.default_scope(scope), module.fname)
            if arg is not None:
                self.arguments.append(arg)
            return
        if fname.rpartition(".")[2] == "add_cli_args_from_dataclass":
            target = None
            if len(call.args) > 1:
                if ast.unparse(call.args[1]) in ("ServerArgs", "cls"):
                    target = self.server_args
                else:
                    try:
                        target = evaluate(call.args[1], scope)
                    except Unresolved:
                        target = None
            if isinstance(target, ClassRef) and target.node is self.server_args.node:
                fields = self.fields()
            elif isinstance(target, ClassRef):
                fields = class_fields(target)
            else:
                log(f"  note: {fname}({ast.unparse(call.args[1])}) not followed")
                return
            self.arguments.extend(dataclass_arguments(fields, module.fname))
            return
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS and isinstance(func.value, ast.Name):
            name = func.value.id
            if not conditional and name in scope.local and not isinstance(scope.local[name], UnresolvedLocal):
                try:
                    scope.local[name] = apply_mutation(scope.local[name], call, scope)
                except Unresolved:
                    scope.local[name] = UnresolvedLocal(f"{name} after {ast.unparse(call)}")
            return
        # A helper that registers more arguments: ServerArgs._add_x(parser), add_x(parser).
        if not any(isinstance(a, ast.Name) and a.id == "parser" for a in call.args):
            return
        target = None
        if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id in (
            "ServerArgs", "cls", "self"
        ):
            try:
                target = class_attr(self.server_args, func.attr)
            except Unresolved:
                target = None
        else:
            try:
                target = evaluate(func, scope)
            except Unresolved:
                target = None
        if isinstance(target, FuncRef) and isinstance(target.node, ast.FunctionDef) and self._depth < 8:
            self._depth += 1
            try:
                self.walk(target.node.body, Scope(target.module), target.module, conditional)
            finally:
                self._depth -= 1
        else:
            log(f"  note: call {fname}(parser, ...) not followed")

    def default_scope(self, scope: Scope) -> Scope:
        return DefaultsScope(scope, FieldDefaults(self))


def extract(wheel_path: Path, sha256: str, version: str) -> tuple[dict, list[Argument]]:
    wheel = Wheel(wheel_path)
    log(f"reading {wheel_path.name}")
    args = Extractor(wheel).run()
    seen: dict[str, int] = {}
    for a in args:
        for f in a.flags:
            if f in seen:
                log(f"  note: {f} is registered twice (argparse would refuse it)")
            seen[f] = 1
    unresolved = [a for a in args if a.choices is None and a.choices_unresolved]
    log(f"  {len(args)} arguments, {len(unresolved)} with unresolved choices; "
        f"{len(wheel.read)} modules read")
    doc = {
        "package": "sglang",
        "version": version,
        "source": f"{wheel_path.name} sha256:{sha256} {SERVER_ARGS}",
        "arguments": [a.to_json() for a in args],
    }
    return doc, args


def args_file(version: str) -> Path:
    return LOCKS / f"sglang-{version}.args.json"


def write_json(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    # one argument per line keeps the files small and diffs readable
    if "arguments" in doc:
        head = {k: v for k, v in doc.items() if k != "arguments"}
        lines = [json.dumps(a, ensure_ascii=False) for a in doc["arguments"]]
        text = json.dumps(head, indent=1, ensure_ascii=False)[:-2] + ',\n "arguments": [\n  '
        text += ",\n  ".join(lines) + "\n ]\n}"
    path.write_text(text + "\n")


# ---------------------------------------------------------------------------
# Renames
# ---------------------------------------------------------------------------

REPLACEMENT_RE = re.compile(
    r"(?:\buse\b|\busing\b|replaced (?:by|with)|renamed to|in favou?r of|superseded by|"
    r"switch to|moved to)\s*:?\s*[`'\"]?(--[A-Za-z0-9][A-Za-z0-9_-]*(?:=[^\s`'\",;)]+)?)",
    re.IGNORECASE,
)


DEPRECATED_HELP_RE = re.compile(
    r"^\W*(?:note\W+)?deprecated\b|\bthis (?:flag|option|argument) is deprecated\b",
    re.IGNORECASE,
)
FLAG_RE = re.compile(r"--[A-Za-z0-9][^\s`'\"]*(?:\s<[^>]+>)?")


def deprecation(arg: Argument) -> tuple[bool, str | None, str]:
    """(is deprecated, replacement or None, evidence) as the argument's own code says it.

    Deprecated: a ``Deprecated*Action``, or a help text that calls the flag deprecated
    ("[Deprecated] ...", "... is deprecated now", not "replaces the deprecated --x").
    Replacement: ``new_flag=`` verbatim, else a flag named after "use"/"renamed to"/...
    in ``error_message=`` or the help text.
    """
    deprecated = (
        arg.action.startswith("Deprecated")
        or bool(DEPRECATED_HELP_RE.search(arg.help))
        or any(f"{f} is deprecated" in arg.help for f in arg.flags)
    )
    if not deprecated:
        return False, None, ""
    if arg.new_flag and arg.new_flag_kind == "new_flag":
        m = FLAG_RE.search(arg.new_flag)
        if m:
            return True, m.group(0), f"{arg.action}(new_flag={arg.new_flag!r})"
    for source, text in (("error_message", arg.new_flag or ""), ("help", arg.help)):
        for m in REPLACEMENT_RE.finditer(text):
            if m.group(1).split("=")[0] not in arg.flags:
                return True, m.group(1), f"{arg.action}; {source}: {text.strip()[:160]!r}"
    return True, None, f"{arg.action}; help: {arg.help.strip()[:160]!r}"


def flag_index(args: list[Argument]) -> dict[str, Argument]:
    return {f: a for a in args for f in a.flags}


def base_flag(replacement: str) -> str:
    return re.split(r"[=\s]", replacement, maxsplit=1)[0]


def build_renames(chain: list[tuple[str, list[Argument]]], old_versions: list[str]) -> dict:
    """chain: [(version, arguments)] ascending; the last one is the newest."""
    newest_v, newest = chain[-1]
    newest_flags = flag_index(newest)
    by_version = dict(chain)
    old_flags: dict[str, str] = {}
    for v in old_versions:
        for f in flag_index(by_version[v]):
            old_flags.setdefault(f, v)

    # Every deprecation any version of the chain declares, newest first.
    declared: dict[str, dict] = {}
    for v, args in reversed(chain):
        for a in args:
            dep, repl, evidence = deprecation(a)
            if not dep:
                continue
            for f in a.flags:
                if f.startswith("--no-") and a.action == "BooleanOptionalAction":
                    continue
                entry = declared.setdefault(f, {"deprecated_in": v, "replacement": None})
                entry["deprecated_in"] = v  # walking back: ends on the earliest
                if repl and entry["replacement"] is None:
                    entry.update(replacement=repl, evidence=f"sglang {v}: {evidence}")
                elif entry["replacement"] is None and "evidence" not in entry:
                    entry["evidence"] = f"sglang {v}: {evidence}"

    def present_in(flag: str) -> list[str]:
        return [v for v, args in chain if flag in flag_index(args)]

    def follow(repl: str) -> str:
        seen = set()
        while base_flag(repl) not in newest_flags and base_flag(repl) in declared and repl not in seen:
            seen.add(repl)
            nxt = declared[base_flag(repl)].get("replacement")
            if not nxt:
                break
            repl = nxt
        return repl

    renames, details, gone = {}, {}, []
    for flag, first_v in sorted(old_flags.items()):
        if flag in newest_flags:
            continue
        seen_in = present_in(flag)
        last = seen_in[-1] if seen_in else first_v
        later = [v for v, _ in chain if Version(v) > Version(last)]
        info = {"last_accepted_in": last, "removed_in": later[0] if later else None}
        entry = declared.get(flag)
        repl = entry.get("replacement") if entry else None
        evidence = entry.get("evidence") if entry else None
        if repl is None:
            # Same destination under another flag in the newest version: a rename in code.
            old_arg = flag_index(by_version[first_v])[flag]
            same = [a for a in newest if a.dest == old_arg.dest and not a.action.startswith("Deprecated")]
            if same:
                repl = same[0].flags[0]
                evidence = f"sglang {newest_v}: {repl} stores into the same dest {old_arg.dest!r}"
        if repl is not None:
            final = follow(repl)
            renames[flag] = final
            info.update(replacement=final, evidence=evidence)
            if entry:
                info["deprecated_in"] = entry["deprecated_in"]
            if final != repl:
                info["via"] = repl
            details[flag] = info
        else:
            if entry:
                info.update(deprecated_in=entry["deprecated_in"], evidence=entry.get("evidence"))
            gone.append({"flag": flag, **info})

    still = {}
    for flag, entry in sorted(declared.items()):
        if flag in newest_flags:
            a = newest_flags[flag]
            dep, repl, evidence = deprecation(a)
            if dep:
                still[flag] = {"replacement": repl, "evidence": f"sglang {newest_v}: {evidence}"}
    return {
        "package": "sglang",
        "old": old_versions,
        "new": newest_v,
        "versions_compared": [v for v, _ in chain],
        "renames": renames,
        "details": details,
        "removed_without_named_replacement": gone,
        "deprecated_but_accepted_in_new": still,
    }


# ---------------------------------------------------------------------------
# Checking a launch command
# ---------------------------------------------------------------------------


def launch_argv(path: Path = REFERENCE_LAUNCH) -> list[str]:
    """Arguments of the launch command kept in locks/reference-launch.txt."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    argv = shlex.split(" ".join(ln.rstrip("\\") for ln in lines))
    if "-m" in argv:
        argv = argv[argv.index("-m") + 2:]
    return argv


def parse_launch(argv: list[str]) -> list[tuple[str, str | None]]:
    """[(flag, value-or-None)] as written: a flag followed by a non-flag token has a value."""
    out, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if not tok.startswith("-"):
            raise ValueError(f"stray token {tok!r}")
        if "=" in tok:
            flag, value = tok.split("=", 1)
            out.append((flag, value))
            i += 1
            continue
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out.append((tok, argv[i + 1]))
            i += 2
        else:
            out.append((tok, None))
            i += 1
    return out


def takes_value(arg: dict) -> bool:
    if arg["action"] in STORE_TRUE_LIKE:
        return False
    if arg["nargs"] in (0, "0"):
        return False
    if arg["action"].startswith("Deprecated") and arg["action"] != "DeprecatedAliasStoreAction":
        return arg["type"] is not None or arg["choices"] is not None
    return True


def convert(value: str, type_name: str | None) -> Any:
    if type_name == "int":
        return int(value)
    if type_name == "float":
        return float(value)
    return value


def check_launch(doc: dict, launch: list[tuple[str, str | None]], renames: dict | None = None) -> list[dict]:
    """One row per launch flag: ok, problem, the matched flag and the choices."""
    args = doc["arguments"]
    index = {f: a for a in args for f in a["flags"]}
    deprecated = (renames or {}).get("deprecated_but_accepted_in_new", {})
    rows = []
    for flag, value in launch:
        row: dict = {"flag": flag, "value": value, "ok": True, "problems": [], "notes": []}
        arg = index.get(flag)
        if arg is None:
            # argparse (allow_abbrev=True) accepts a unique prefix of a long option.
            matches = sorted({f for f in index if f.startswith(flag)})
            if len(matches) == 1:
                arg = index[matches[0]]
                row["notes"].append(f"accepted only as argparse's abbreviation of {matches[0]}")
            elif matches:
                row["ok"] = False
                row["problems"].append(f"ambiguous abbreviation: {', '.join(matches)}")
            else:
                row["ok"] = False
                row["problems"].append("unknown flag")
        if arg is not None:
            row["dest"] = arg["dest"]
            if takes_value(arg):
                if value is None and arg["nargs"] not in ("?", "*"):
                    row["ok"] = False
                    row["problems"].append("needs a value")
                elif value is not None:
                    if arg["choices"] is not None:
                        try:
                            v = convert(value, arg["type"])
                        except ValueError:
                            v = value
                        if v not in arg["choices"]:
                            row["ok"] = False
                            row["problems"].append(
                                f"{value!r} is not among the choices {arg['choices']}")
                    elif arg.get("choices_unresolved"):
                        row["notes"].append(
                            f"choices not resolved statically: {arg['choices_unresolved']}")
                    if arg["type"] in ("int", "float"):
                        try:
                            convert(value, arg["type"])
                        except ValueError:
                            row["ok"] = False
                            row["problems"].append(f"{value!r} is not a {arg['type']}")
            elif value is not None:
                row["ok"] = False
                row["problems"].append(f"takes no value ({arg['action']}) but {value!r} follows")
            if arg["action"].startswith("Deprecated"):
                row["notes"].append(f"deprecated ({arg['action']})")
            if doc["version"] == (renames or {}).get("new") and flag in deprecated:
                repl = deprecated[flag].get("replacement")
                row["notes"].append(f"deprecated in {doc['version']}" + (f"; use {repl}" if repl else ""))
        rows.append(row)
    return rows


def format_check(version: str, rows: list[dict]) -> str:
    bad = [r for r in rows if not r["ok"]]
    lines = [f"sglang {version}: " + ("accepts every flag and value of the launch" if not bad
                                      else f"{len(bad)} of {len(rows)} flags rejected")]
    for r in rows:
        shown = r["flag"] + (f" {r['value']}" if r["value"] is not None else "")
        mark = "ok  " if r["ok"] else "FAIL"
        extra = "; ".join(r["problems"] + r["notes"])
        lines.append(f"  {mark} {shown}" + (f"  -- {extra}" if extra else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------


def cmd_extract(ns) -> None:
    for spec in ns.versions:
        version = resolve_version(spec, ns.index_url)
        wheel, sha = fetch_wheel(version, ns.cache, ns.index_url)
        doc, _ = extract(wheel, sha, version)
        out = args_file(version)
        write_json(out, doc)
        log(f"  wrote {out.relative_to(REPO)}")


def cmd_renames(ns) -> None:
    new = resolve_version(ns.new, ns.index_url)
    old = [resolve_version(v, ns.index_url) for v in ns.old]
    if ns.via == "all":
        lo = min(Version(v) for v in old)
        versions = [str(v) for v in release_versions("sglang", ns.index_url)
                    if lo <= v <= Version(new)]
    else:
        versions = sorted(set(old + [new]), key=Version)
    for v in old + [new]:
        if v not in versions:
            versions.append(v)
    versions.sort(key=Version)
    chain, wheels = [], {}
    for v in versions:
        wheel, sha = fetch_wheel(v, ns.cache, ns.index_url)
        _, args = extract(wheel, sha, v)
        chain.append((v, args))
        wheels[v] = f"{wheel.name} sha256:{sha}"
    doc = build_renames(chain, old)
    doc["wheels"] = wheels
    write_json(RENAMES_FILE, doc)
    log(f"wrote {RENAMES_FILE.relative_to(REPO)}: {len(doc['renames'])} renames, "
        f"{len(doc['removed_without_named_replacement'])} removed without a named replacement")
    for old_flag, new_flag in doc["renames"].items():
        print(f"{old_flag} -> {new_flag}")


def cmd_check(ns) -> int:
    launch = parse_launch(launch_argv(ns.launch))
    renames = json.loads(RENAMES_FILE.read_text()) if RENAMES_FILE.exists() else None
    failed = 0
    for spec in ns.versions:
        version = resolve_version(spec, ns.index_url) if spec == "latest" else spec
        path = args_file(version)
        if not path.exists():
            log(f"{path.relative_to(REPO)} is missing: run `extract {version}` first")
            failed += 1
            continue
        rows = check_launch(json.loads(path.read_text()), launch, renames)
        print(format_check(version, rows))
        if any(not r["ok"] for r in rows):
            failed += 1
            if renames:
                for r in rows:
                    if not r["ok"] and r["flag"] in renames.get("renames", {}):
                        print(f"       {r['flag']} was renamed: {renames['renames'][r['flag']]}")
    return 1 if failed and ns.strict else 0


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help="where wheels are downloaded (never the repo); default %(default)s")
    p.add_argument("--index-url", default=DEFAULT_INDEX, help="default %(default)s")
    sub = p.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract", help="write locks/sglang-<version>.args.json")
    e.add_argument("versions", nargs="+", help="versions, or 'latest'")
    r = sub.add_parser("renames", help="write locks/sglang-flag-renames.json")
    r.add_argument("--old", nargs="+", default=["0.5.9", "0.5.10"])
    r.add_argument("--new", default="latest")
    r.add_argument("--via", choices=["all", "endpoints"], default="all",
                   help="read every release in between (deprecations live there) or only the ends")
    c = sub.add_parser("check", help="check the reference launch against args files")
    c.add_argument("versions", nargs="+")
    c.add_argument("--launch", type=Path, default=REFERENCE_LAUNCH)
    c.add_argument("--strict", action="store_true", help="exit 1 when a version rejects a flag")
    a = sub.add_parser("all", help="extract 0.5.9 0.5.10 latest, renames, check")
    a.add_argument("--launch", type=Path, default=REFERENCE_LAUNCH)
    ns = p.parse_args(list(argv) if argv is not None else None)
    if ns.cmd == "extract":
        cmd_extract(ns)
    elif ns.cmd == "renames":
        cmd_renames(ns)
    elif ns.cmd == "check":
        return cmd_check(ns)
    else:
        latest = resolve_version("latest", ns.index_url)
        cmd_extract(argparse.Namespace(**vars(ns), versions=["0.5.9", "0.5.10", latest]))
        cmd_renames(argparse.Namespace(**vars(ns), old=["0.5.9", "0.5.10"], new=latest, via="all"))
        return cmd_check(argparse.Namespace(**vars(ns), versions=["0.5.9", "0.5.10", latest],
                                            strict=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
