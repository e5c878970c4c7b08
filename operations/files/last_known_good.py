"""Record what the server was last verified with, and put it back (gpuhost's rollback).

    python3 last_known_good.py record --venv DIR --lock-digest HEX --model M --revision R
        [--keep N --venvs-dir DIR] [--folder DIR]... PATH...
    python3 last_known_good.py check --venv DIR ... PATH...   (record's arguments)
    python3 last_known_good.py prune --keep N --venvs-dir DIR --venv DIR...
    python3 last_known_good.py restore --why TEXT
    python3 last_known_good.py finish

``record`` (run once the health gate passed) copies each PATH and each ``*.conf`` of each
--folder (a unit's drop-ins, the only ones systemd reads: systemd.unit(5)) into /var/lib/gpuhost/last-known-good/, named by the
SHA-256 of its content (mode 0600, the folder 0700: the server's environment file may hold a
secret), and writes the "server" entry of /var/lib/gpuhost/last-known-good.json; PATHs that do
not exist are recorded as absent. The entry's "venvs" lists the venvs verified, newest first,
at most --keep; with --venvs-dir, every other venv there (a folder named by a lock digest) is
removed. Other entries of that file (a "driver" one) are kept as they
are. Copies no entry names any more are removed.

``restore`` writes /var/lib/gpuhost/rollback.json (that a rollback began, and why), then puts
every recorded file back (atomically: a copy renamed over it), removes those recorded absent,
and runs ``systemctl daemon-reload``. It prints one line per file put back or removed; exit 4
when nothing is recorded, 5 when every file is already as recorded (nothing to roll back to),
6 when the record does not parse, a copy it names is missing or changed, or its venv is gone:
then nothing is changed (and an unfinished rollback's rollback.json is removed, as it cannot
finish). ``record`` writes a record that does not parse anew.
``check`` (record's arguments) prints "fresh" where the record names that venv and those files
as they are now, "unverified" where the server's units do not run as the health gate last
verified them (sglang.verified), else "stale: <why>" (a record missing, that does not parse or
that disagrees with what serves): the deploy then records again.
``prune`` removes the venvs under --venvs-dir that neither the record keeps nor a --venv names
(the one the server runs from, the one this run converges).
Every record is written whole or not at all (a temporary file, fsync, rename(2)); a write that
fails (ENOSPC) is said in one line, exit 7, the record as it was. A record that does not parse,
or whose shape is not the one described (``"venvs": 5``), is set aside
(``last-known-good.json.bad-<time>``) by ``record`` and written anew.
``finish`` removes rollback.json once the restored server passed the health gate: a rollback
interrupted before that is found by the next deploy, which restores and verifies again.

The record's format is operations/stages/last_known_good.py's docstring. Standard library only: runs
with the host's python3.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = "/var/lib/gpuhost"
RECORD = f"{ROOT}/last-known-good.json"
COPIES = f"{ROOT}/last-known-good"
MARKER = f"{ROOT}/rollback.json"
FORMAT = 1
#: A venv's folder name under the venvs folder: its lock's digest (operations/stages/venvs.py).
DIGEST = re.compile(r"[0-9a-f]{16}(-b)?")
#: The units whose InvocationIDs the health gate records once it passed
#: (operations/stages/server.py).
VERIFIED = f"{ROOT}/sglang.verified"
#: What a venv must import to serve (operations/stages/venvs.py SERVING_IMPORTS).
SERVING_IMPORTS = ("torch", "sglang", "flashinfer")
#: The exit status of a write that failed (ENOSPC, EIO...): said in one line.
WRITE_FAILED = 7


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _write(path: str, data: bytes, mode: int) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, fsync, rename(2), and
    the folder fsynced so that the rename survives a crash; a failed write leaves no temporary
    file and ``path`` as it was."""
    tmp = f"{path}.gpuhost-tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    folder = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(folder)
    finally:
        os.close(folder)


class RecordError(Exception):
    """The record, or what it names, cannot be rolled back to: one line, no traceback."""


def _load() -> dict:
    """The record, ``{"format": FORMAT}`` where there is none. Raises RecordError where it does
    not parse (a truncated or hand-edited file) or its "server" entry lacks what restore
    reads."""
    try:
        with open(RECORD, encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return {"format": FORMAT}
    except (OSError, ValueError) as exc:
        raise RecordError(f"the last known good record {RECORD} does not parse ({exc})") from None
    server = record.get("server") if isinstance(record, dict) else None
    if not isinstance(record, dict) or (server is not None and not _well_formed(server)):
        raise RecordError(f"the last known good record {RECORD} does not parse (not the "
                          "format operations/stages/last_known_good.py describes)")
    return record


def _well_formed(server) -> bool:
    files = server.get("files") if isinstance(server, dict) else None
    return (isinstance(server, dict) and isinstance(server.get("venv"), str)
            and isinstance(server.get("recorded_at"), str) and isinstance(files, dict)
            and all(isinstance(e, dict) and isinstance(e.get("sha256"), str)
                    and isinstance(e.get("mode"), str) and re.fullmatch(r"[0-7]{3,4}", e["mode"])
                    for e in files.values())
            and all(isinstance(server.get(k, []), list)
                    and all(isinstance(v, str) for v in server.get(k, []))
                    for k in ("absent", "folders", "venvs")))


def _save(record: dict) -> None:
    """Write the record whole, root's alone (0600): it holds the SHA-256 of server.env, which
    may hold a secret (an API key): one readable by any local user lets a guess at the secret
    be checked offline against it. A record an earlier gpuhost left 0644 is replaced by one of
    mode 0600 at its next write. Its folder is made 0755 whatever the umask."""
    os.makedirs(ROOT, mode=0o755, exist_ok=True)
    os.chmod(ROOT, 0o755)
    _write(RECORD, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode(), 0o600)


def _expand(folders: list[str]) -> list[str]:
    """The ``*.conf`` files in each folder, by name (none where a folder does not exist)."""
    return [p for folder in folders for p in sorted(glob.glob(os.path.join(folder, "*.conf")))]


def record(args: argparse.Namespace) -> int:
    os.makedirs(COPIES, mode=0o700, exist_ok=True)
    os.chmod(COPIES, 0o700)
    files, absent = {}, []
    for path in [*args.paths, *_expand(args.folder)]:
        try:
            with open(path, "rb") as f:
                data = f.read()
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            absent.append(path)
            continue
        digest = hashlib.sha256(data).hexdigest()
        copy = os.path.join(COPIES, digest)
        if not os.path.exists(copy):
            _write(copy, data, 0o600)
        files[path] = {"sha256": digest, "mode": f"{mode:04o}"}
    try:
        rec = _load()
    except RecordError as exc:
        # the gate passed: what runs now is the known good, whatever the old record said
        aside = f"{RECORD}.bad-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}"
        os.replace(RECORD, aside)
        print(f"{exc}: set aside as {aside} and recorded anew")
        rec = {"format": FORMAT}
    rec["format"] = FORMAT
    earlier = (rec.get("server") or {}).get("venvs") or []
    venvs = [args.venv, *(v for v in earlier if v != args.venv)][:args.keep]
    rec["server"] = {"recorded_at": _now(), "venv": args.venv, "lock_digest": args.lock_digest,
                     "model": args.model, "model_revision": args.revision, "files": files,
                     "absent": absent, "folders": list(args.folder), "venvs": venvs}
    _save(rec)
    if args.venvs_dir:
        _prune(args.venvs_dir, venvs, args.keep)
    wanted = {e["sha256"] for entry in rec.values() if isinstance(entry, dict)
              for e in (entry.get("files") or {}).values()}
    for name in os.listdir(COPIES):
        if name not in wanted:
            os.unlink(os.path.join(COPIES, name))
    print(f"recorded {len(files)} files, venv {args.venv}")
    return 0


def _prune(folder: str, kept: list[str], keep: int, also: list[str] = ()) -> None:
    """Remove the venvs in ``folder`` (named by a lock digest) that neither ``kept`` (the
    record's) nor ``also`` (the one serving, the one this run converges) names."""
    try:
        names = sorted(os.listdir(folder))
    except FileNotFoundError:
        return
    for name in names:
        path = os.path.join(folder, name)
        if (path in kept or path in also or not DIGEST.fullmatch(name)
                or not os.path.isdir(path) or os.path.islink(path)):
            continue
        shutil.rmtree(path)
        print(f"removed the venv {path} (gpuhost_venvs_kept = {keep}: it keeps "
              f"{', '.join(kept)})")


def prune(args: argparse.Namespace) -> int:
    """Remove the venvs the record does not keep, where a record names a venv (without one,
    nothing is known good and nothing is removed)."""
    try:
        server = _load().get("server")
    except RecordError as exc:
        print(f"{exc}: no venv removed")
        return 0
    if not server:
        return 0
    kept = [server["venv"], *(v for v in server.get("venvs", []) if v != server["venv"])]
    _prune(args.venvs_dir, kept, args.keep, args.venv)
    return 0


def _verified() -> bool:
    """Whether the server's units run as the health gate last verified them: sglang.verified
    holds their InvocationIDs, as ``systemctl show`` gives them now."""
    try:
        with open(VERIFIED, encoding="utf-8") as f:
            ids = f.read().split()
    except OSError:
        return False
    units = ["sglang.service", "sglang-gate.service"][:len(ids)]
    out = subprocess.run(["systemctl", "show", "-p", "InvocationID", "--value", *units],
                         capture_output=True, text=True, check=False)
    return bool(ids) and out.returncode == 0 and out.stdout.split() == ids


def check(args: argparse.Namespace) -> int:
    if not _verified():
        print("unverified")
        return 0
    try:
        server = _load().get("server")
    except RecordError as exc:
        print(f"stale: {exc}")
        return 0
    if not server:
        print("stale: no last known good is recorded")
        return 0
    paths = [*args.paths, *_expand(args.folder)]
    now = {p: _current(p) for p in paths}
    recorded = {p: e["sha256"] for p, e in server["files"].items()}
    recorded.update(dict.fromkeys(server.get("absent", [])))
    if server["venv"] != args.venv:
        print(f"stale: it names the venv {server['venv']}, the server runs from {args.venv}")
    elif now != recorded:
        differ = sorted(p for p in set(now) | set(recorded) if now.get(p) != recorded.get(p))
        print(f"stale: {', '.join(differ)} differ from what it recorded")
    else:
        print("fresh")
    return 0


def _current(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except FileNotFoundError:
        return None


def _differs(server: dict) -> list[str]:
    """The paths a rollback changes: recorded files that differ, recorded-absent files and
    drop-ins added since (a folder's *.conf the record does not have) that exist."""
    files, absent = server["files"], server.get("absent", [])
    extra = [p for p in _expand(server.get("folders", [])) if p not in files and p not in absent]
    return ([p for p, e in files.items() if _current(p) != e["sha256"]]
            + [p for p in [*absent, *extra] if os.path.lexists(p)])


def _check_restorable(server: dict) -> None:
    """Raise RecordError unless every copy the record names is there with its SHA-256 and the
    recorded venv's python exists: checked before any file changes, so a rollback that cannot
    finish changes nothing."""
    for path, entry in server["files"].items():
        copy = os.path.join(COPIES, entry["sha256"])
        if _current(copy) != entry["sha256"]:
            state = "missing" if not os.path.exists(copy) else "not what was recorded"
            raise RecordError(f"the last known good's copy of {path} ({copy}) is {state}")
    _check_venv(server["venv"])


def _check_venv(venv: str) -> None:
    """Raise RecordError unless the venv's python imports the serving stack."""
    python = os.path.join(venv, "bin", "python")
    if not os.path.lexists(python):
        raise RecordError(f"the last known good's venv {venv} is gone (no {python})")
    script = ("import importlib, sys\n"
              f"for name in {SERVING_IMPORTS!r}:\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except Exception as exc:\n"
              "        sys.exit(f'{name}: {type(exc).__name__}: {exc}')\n")
    try:
        out = subprocess.run([python, "-I", "-c", script], capture_output=True, text=True,
                             timeout=300, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RecordError(f"the last known good's venv {venv} does not run ({exc})") from None
    if out.returncode != 0:
        said = (out.stderr.strip().splitlines() or [f"exit {out.returncode}"])[-1][:300]
        raise RecordError(f"the last known good's venv {venv} does not import the serving "
                          f"stack ({said})")


def restore(args: argparse.Namespace) -> int:
    try:
        server = _load().get("server")
        differs = _differs(server) if server else []
        if differs:
            _check_restorable(server)
        elif server:
            # nothing to put back: the host runs the last known good's files, and its venv
            # must still import what serves (a venv cleared since would not)
            _check_venv(server["venv"])
    except RecordError as exc:
        # an earlier run's unfinished rollback cannot go on either: given up, so that the
        # next deploy converges the host from host data instead of failing here each time
        given_up = os.path.exists(MARKER)
        if given_up:
            os.unlink(MARKER)
        print(f"{exc}: no rollback" + (f" (the unfinished rollback's {MARKER} removed: the "
                                       "next deploy applies host data)" if given_up else ""))
        return 6
    if not server:
        print(f"no last known good is recorded ({RECORD})")
        return 4
    files = server["files"]
    if not differs:
        print("every file is as the last known good has it: nothing to roll back")
        return 5
    _save_marker(args.why, server)
    for path in differs:
        entry = files.get(path)
        if entry is None:
            os.unlink(path)
            print(f"removed {path}")
            continue
        with open(os.path.join(COPIES, entry["sha256"]), "rb") as f:
            data = f.read()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        _write(path, data, int(entry["mode"], 8))
        print(f"restored {path}")
    subprocess.run(["systemctl", "daemon-reload"], check=True)
    print(f"rolled back to the last known good of {server['recorded_at']}: venv "
          f"{server['venv']}")
    return 0


def _save_marker(why: str, server: dict) -> None:
    data = {"started_at": _now(), "why": why, "to": server["recorded_at"],
            "venv": server["venv"]}
    _write(MARKER, (json.dumps(data, sort_keys=True) + "\n").encode(), 0o644)


def finish(_args: argparse.Namespace) -> int:
    try:
        os.unlink(MARKER)
    except FileNotFoundError:
        pass
    return 0


def main() -> int:
    # what it makes is readable by the model copy user and operators whatever root's umask
    # (a hardened host's 077, from pam_umask and the profile): files 0644, folders 0755
    os.umask(0o022)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("--venv", required=True)
    rec.add_argument("--lock-digest", required=True)
    rec.add_argument("--model", required=True)
    rec.add_argument("--revision", required=True)
    rec.add_argument("--keep", type=int, default=1, help="venvs kept, the recorded one first")
    rec.add_argument("--venvs-dir", help="where the venvs are; the ones not kept are removed")
    rec.add_argument("--folder", action="append", default=[],
                     help="a folder whose *.conf files count (a unit's drop-ins)")
    rec.add_argument("paths", nargs="+")
    res = sub.add_parser("restore")
    res.add_argument("--why", required=True)
    sub.add_parser("finish")
    chk = sub.add_parser("check")
    for name in ("--lock-digest", "--model", "--revision", "--venvs-dir"):
        chk.add_argument(name)
    chk.add_argument("--venv", required=True)
    chk.add_argument("--keep", type=int, default=1)
    chk.add_argument("--folder", action="append", default=[])
    chk.add_argument("paths", nargs="+")
    pru = sub.add_parser("prune")
    pru.add_argument("--keep", type=int, default=1)
    pru.add_argument("--venvs-dir", required=True)
    pru.add_argument("--venv", action="append", default=[],
                     help="a venv kept whatever the record says (serving, converged now)")
    args = parser.parse_args()
    run = {"record": record, "restore": restore, "finish": finish, "check": check,
           "prune": prune}[args.command]
    try:
        return run(args)
    except OSError as exc:
        # a full disk (ENOSPC) or the like: one line, the record as it was
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"could not write the last known good{where}: {exc.strerror or exc}: the "
              f"record {RECORD} is as it was; free space there and run the deploy again, "
              "which records what serves")
        return WRITE_FAILED


if __name__ == "__main__":
    sys.exit(main())
