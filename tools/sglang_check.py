"""The reference launch (locks/reference-launch.txt) checked against an sglang version's
args file (``tools/sglang_args.py check``)."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

from sglang_extract import LOCKS, STORE_TRUE_LIKE

REFERENCE_LAUNCH = LOCKS / "reference-launch.txt"


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
