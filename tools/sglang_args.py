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

The work is split by what it does: tools/sglang_wheel.py fetches and checks the wheels,
tools/sglang_static.py evaluates the wheel's modules statically, tools/sglang_extract.py reads
the arguments (``extract``), tools/sglang_renames.py the renames (``renames``),
tools/sglang_check.py checks the reference launch (``check``); this file is their command line.

Standard library only, plus ``packaging`` for version ordering.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path

from packaging.version import Version
from sglang_check import REFERENCE_LAUNCH, check_launch, format_check, launch_argv, parse_launch
from sglang_extract import REPO, Argument, args_file, extract, write_json
from sglang_renames import RENAMES_FILE, build_renames, deprecation
from sglang_wheel import (
    DEFAULT_CACHE,
    DEFAULT_INDEX,
    fetch_wheel,
    log,
    release_versions,
    resolve_version,
)

#: What tools/lock.py and tests/test_lock.py use of the tool, by this module's name.
__all__ = ["Argument", "build_renames", "deprecation", "extract", "fetch_wheel", "main"]


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
