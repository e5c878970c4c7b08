"""sglang's server arguments read out of its wheel's ``sglang/srt/server_args.py``: every
``parser.add_argument(...)`` reached from ``ServerArgs.add_cli_args`` and every annotated
``A[T, Arg(...)]`` field, written as locks/sglang-<version>.args.json
(``tools/sglang_args.py extract``)."""

from __future__ import annotations

import ast
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sglang_static import (
    MISSING,
    MUTATORS,
    Builtin,
    ClassRef,
    DefaultsScope,
    EnumMember,
    External,
    FieldDefaults,
    FuncRef,
    Module,
    Scope,
    Unresolved,
    UnresolvedLocal,
    Wheel,
    apply_mutation,
    call_builtin,
    call_function,
    class_attr,
    enum_members,
    evaluate,
    is_enum,
    iterate,
)
from sglang_wheel import log

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "locks"
SERVER_ARGS = "sglang/srt/server_args.py"

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
        return DefaultsScope(scope, FieldDefaults(self.field_default))


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
