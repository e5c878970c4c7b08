"""What a systemd service was started with: one SHA-256 over the files it reads and, with
--venv, the distributions installed in its venv.

    python3 unit_inputs.py [--venv DIR] [--write FILE] PATH...

Prints the digest (64 hex digits). The server's unit runs it as ExecStartPre with --write, so
the file under /run says what the running process read; the deploy runs it without --write and
compares (operations/server.py, ServiceState). A deploy stopped after changing a file and
before restarting the service leaves the two different: the next deploy restarts it.

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

#: flash-attn's build stamp in the venv (operations/flash_attn.py, STAMP_NAME).
FLASH_ATTN_STAMP = "gpuhost-flash-attn.json"


def _file(digest, path: str) -> None:
    digest.update(f"{path}\0".encode())
    try:
        with open(path, "rb") as fh:
            digest.update(hashlib.sha256(fh.read()).hexdigest().encode())
    except FileNotFoundError:
        digest.update(b"absent")
    digest.update(b"\n")


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
    parser.add_argument("paths", nargs="*")
    args = parser.parse_args(argv)
    value = inputs_digest(args.paths, args.venv)
    if args.write:
        os.makedirs(os.path.dirname(args.write) or ".", exist_ok=True)
        tmp = f"{args.write}.tmp"
        with open(tmp, "w") as fh:
            fh.write(value + "\n")
        os.replace(tmp, args.write)
    print(value)
    return 0


if __name__ == "__main__":
    sys.exit(main())
