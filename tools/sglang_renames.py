"""Flags that later sglang releases renamed, removed or deprecated, read from the arguments of
a chain of releases (``tools/sglang_args.py renames``, locks/sglang-flag-renames.json)."""

from __future__ import annotations

import re

from packaging.version import Version
from sglang_extract import LOCKS, Argument

RENAMES_FILE = LOCKS / "sglang-flag-renames.json"

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
