"""What a systemd service was started with: one SHA-256 over the files it reads and, with
--venv, the distributions installed in its venv.

    python3 unit_inputs.py [--venv DIR] [--write FILE | --changed FILE] PATH...

Prints the digest (64 hex digits). The server's unit runs it as ExecStartPre with --write, so
the file under /run says what the running process read (and FILE.parts, one line per input,
what each was); the deploy runs it without --write and compares (operations/stages/server.py,
ServiceState). A file changed since the service started (by an earlier run stopped before the
restart, by hand, by a host-data change that names other inputs) leaves the two different: the
next deploy restarts it. With --changed, prints instead which inputs differ from FILE.parts,
separated by "|" (nothing when FILE.parts was not written).

Each PATH counts with its name and content, or as absent; a folder (a unit's drop-in folder)
with each ``*.conf`` file in it, by name order (the drop-ins systemd reads, systemd.unit(5)).
The venv counts with the names of its ``*.dist-info`` folders (name and version of every
installed distribution) and flash-attn's build stamp, not with every file: pip replaces a
distribution's dist-info with its files.
Standard library only: runs with the host's python3.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import os
import sys

#: flash-attn's build stamp in the venv (operations/stages/flash_attn.py, STAMP_NAME).
FLASH_ATTN_STAMP = "gpuhost-flash-attn.json"


def _file(digest, path: str) -> None:
    digest.update(f"{path}\0".encode())
    try:
        with open(path, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).hexdigest().encode())
    except FileNotFoundError:
        digest.update(b"absent")
    digest.update(b"\n")


def _part(path: str) -> str:
    try:
        with open(path, "rb") as fh:
            return hashlib.sha256(fh.read()).hexdigest()
    except FileNotFoundError:
        return "absent"


def inputs_parts(paths: list[str], venv: str | None = None) -> dict[str, str]:
    """Each input by name (a path, each drop-in of a folder; "<venv>'s installed
    distributions"), with a digest of what it is now ("absent" for a missing file)."""
    parts = {}
    for path in paths:
        if os.path.isdir(path):  # a drop-in folder: each drop-in on its own
            for name in sorted(os.listdir(path)):
                if name.endswith(".conf"):
                    parts[os.path.join(path, name)] = _part(os.path.join(path, name))
        else:
            parts[path] = _part(path)
    if venv:
        dists = sorted(os.path.basename(p) for p in
                       glob.glob(os.path.join(venv, "lib", "python3*", "site-packages",
                                              "*.dist-info")))
        parts[f"{venv}'s installed distributions"] = hashlib.sha256(
            "\n".join(dists).encode()).hexdigest()
        stamp = os.path.join(venv, FLASH_ATTN_STAMP)
        parts[stamp] = _part(stamp)
    return parts


def changed_inputs(recorded: dict[str, str], now: dict[str, str]) -> list[str]:
    """The inputs that differ between a record (FILE.parts) and now, each named as in
    :func:`inputs_parts`; an input only one of them has is named with which."""
    out = []
    for name, value in now.items():
        if name not in recorded:
            out.append(f"{name} (not an input at its start)")
        elif recorded[name] != value:
            out.append(name)
    out += [f"{name} (an input at its start, no longer)" for name in recorded if name not in now]
    return out


def _read_parts(path: str) -> dict[str, str] | None:
    try:
        with open(path) as fh:
            return dict(reversed(line.rstrip("\n").split("\t", 1)) for line in fh
                        if "\t" in line)
    except FileNotFoundError:
        return None


def inputs_digest(paths: list[str], venv: str | None = None) -> str:
    """The digest (module docstring) of ``paths`` and, if given, the venv at ``venv``."""
    digest = hashlib.sha256()
    for path in paths:
        if os.path.isdir(path):
            digest.update(f"dir {path}\0".encode())
            for name in sorted(os.listdir(path)):
                if name.endswith(".conf"):
                    _file(digest, os.path.join(path, name))
        else:
            _file(digest, path)
    if venv:
        dists = sorted(os.path.basename(p) for p in
                       glob.glob(os.path.join(venv, "lib", "python3*", "site-packages",
                                              "*.dist-info")))
        digest.update(f"venv {venv}\0{chr(10).join(dists)}\n".encode())
        _file(digest, os.path.join(venv, FLASH_ATTN_STAMP))
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--venv", help="a venv whose installed distributions count")
    parser.add_argument("--write", help="also write the digest to this file (atomically)")
    parser.add_argument("--changed", help="print which inputs differ from this file's record")
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args(argv)
    if args.changed:
        recorded = _read_parts(f"{args.changed}.parts")
        if recorded is not None:
            print("|".join(changed_inputs(recorded, inputs_parts(args.paths, args.venv))))
        return 0
    value = inputs_digest(args.paths, args.venv)
    if args.write:
        os.makedirs(os.path.dirname(args.write) or ".", exist_ok=True)
        parts = inputs_parts(args.paths, args.venv)
        for target, text in ((f"{args.write}.parts",
                              "".join(f"{v}\t{k}\n" for k, v in parts.items())),
                             (args.write, value + "\n")):
            tmp = f"{target}.tmp"
            with open(tmp, "w") as fh:
                fh.write(text)
            os.replace(tmp, target)
    print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
