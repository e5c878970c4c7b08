"""A small static evaluator over an sglang wheel's modules: the values of module-level lists,
class attributes, enums and small helper functions, read with :mod:`ast` and never imported
(what tools/sglang_extract.py resolves ``choices=`` and defaults with)."""

from __future__ import annotations

import ast
import copy
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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

    def __init__(self, field_default: Callable[[str], Any]):
        self._field_default = field_default

    def field_default(self, name: str) -> Any:
        return self._field_default(name)


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
