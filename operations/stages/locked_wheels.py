"""The locked wheels of a fresh venv from the fleet: a cache on the controller keyed by sha256,
filled from the first host that downloaded them from the package index.

A fresh venv (a rebuilt host, or a new lock's venv) is installed in three steps
(:func:`fresh_install`):

1. the controller sends the host, into :data:`WHEEL_DIR`, every distribution of its cache whose
   sha256 the lock names (one tar stream over the deploy's own SSH login);
2. ``pip download --no-deps --require-hashes -d <dir>`` fetches from the index only the lock's
   lines the cache holds no file of; then ``pip install --no-deps --require-hashes --no-index
   --find-links <dir>`` installs from that folder alone. (Not the index and the folder
   together: pip ranks a link whose URL carries an allowed hash, as the index's do, above a
   local file's, which carries none, so it would download them all again: pip 26.3,
   PackageFinder ``_sort_key``, ``has_allowed_hash``; seen on the sandbox, every file fetched
   again with the folder full.)
3. the controller takes back the files it does not hold yet, each kept under its sha256 only
   when that is one of the lock's hashes, and the folder on the host is removed.

pip checks every file against the lock's hashes (--require-hashes) whatever its source: a
wrong file in the cache fails the install, it is never trusted. A venv that only drifted
(an upgrade in place) installs as before, from the index, only what changed.
"""

from __future__ import annotations

import hashlib
import os
import shlex
import subprocess
import tempfile
from io import StringIO
from collections.abc import Iterable
from pathlib import Path
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand
from pyinfra.api.exceptions import OperationError

from operations.runtime import remote
from operations.facts.model_facts import model_download
from operations.plans import proxy
from operations.plans.model_revision import fleet_commit
from operations.stages.disk import no_space_named
from operations.stages.model_peers import login_rsh
from operations.stages.pip_index import pip_index_args
from operations.stages.venvs import ROOM_FOLDERS, WHEEL_DIR, LockSizes, VenvRoom, lock_pins
from operations.stages.venvs import room_problem as venv_room_problem
from operations.files import wheel_sizes

#: The lock's lines the cache holds no file of, written beside the sent files.
MISSING: Final = "missing.txt"
#: The cache's folder under ``gpuhost_wheel_cache``: ``<root>/locked/<sha256>/<file name>``.
SUBDIR: Final = "locked"


def cache_dir(wheel_cache: str) -> Path:
    return Path(os.path.expanduser(wheel_cache)) / SUBDIR


def cached(wheel_cache: str, hashes: Iterable[str]) -> dict[str, Path]:
    """The cache's files whose sha256 is in ``hashes`` (hex): hex -> path."""
    found = {}
    for digest in hashes:
        folder = cache_dir(wheel_cache) / digest
        files = [f for f in folder.iterdir() if f.is_file()] if folder.is_dir() else []
        if len(files) == 1:
            found[digest] = files[0]
    return found


def room_problem(fact, settings, lock, new_venv: str) -> str | None:
    """:func:`operations.stages.venvs.room_problem` from the host's facts (``fact``:
    operations.plans.plan.fact): where no venv serves (a fresh host), with the sizes of the lock's
    files, each read from the controller's cache where it holds the file (its size, and its
    members' as wheel_sizes.py counts them), else off the package index from the host
    (:class:`operations.stages.venvs.LockSizes`). A name no size was found for is said, and counts
    nothing. The model's download the run makes later (operations.facts.model_facts.model_download)
    counts too where it goes to a file system of the venv's (the default folders share one:
    /opt)."""
    room = fact(VenvRoom, venv_path=settings.venv_path, folders=ROOM_FOLDERS)
    model = model_download(fact, settings, fleet_commit(settings))
    # the model's download, later in the run, on a file system of the venv's counts there too
    also = ({"mount": model["mount"], "kib": model["need"] // 1024,
             "what": f"the model's download into {settings.model_path}"}
            if model and "error" not in model else None)
    if room["serving_kib"]:
        return venv_room_problem(room, new_venv, also=also)
    sizes, uncached = {}, []
    for pin in lock.pins:
        found = cached(settings.wheel_cache, [h.removeprefix("sha256:") for h in pin.hashes])
        if found:
            path = max(found.values(), key=lambda f: f.stat().st_size)
            sizes[pin.name] = {"file": path.name, "download": path.stat().st_size,
                               "installed": wheel_sizes.local_installed_size(path)}
        else:
            uncached.append(pin)
    if uncached:
        sizes.update(fact(LockSizes, index_url=settings.pip_index_url,
                          pins=lock_pins(uncached)))
    unknown: dict[str, list[str]] = {}
    for name, size in sorted(sizes.items()):
        if "error" in size:
            unknown.setdefault(size["error"], []).append(name)
    if unknown:  # by error: one unreachable index is one line, not the lock's every name
        words = "; ".join(", ".join(names[:5]) + (f" and {len(names) - 5} more" if
                                                   len(names) > 5 else "") + f" ({error})"
                          for error, names in unknown.items())
        logger.warning(f"{host.print_prefix}ML venv: the room check counts nothing for "
                       f"{words}: no size found")
    return venv_room_problem(room, new_venv, sizes, also)


def lock_hashes(requirements_text: str) -> set[str]:
    """The sha256 hexes a requirements file with ``--hash=sha256:<hex>`` names."""
    return {word.split(":", 1)[1] for word in requirements_text.split()
            if word.startswith("--hash=sha256:")}


def _ssh(host) -> list[str]:
    rsh, target, remote_rsync = login_rsh(host.name, host.data.dict())
    return [*shlex.split(rsh), target, *(["sudo", "-n"] if remote_rsync.startswith("sudo")
                                         else [])]


@remote.callback("sending the fleet's cached wheels")
def send(state, host, wheel_cache: str, requirements_text: str) -> bool:
    """Put the cached files of the lock's hashes into WHEEL_DIR on ``host``, and beside them
    MISSING: the lock's lines of which the cache holds no file (step 1)."""
    hashes = lock_hashes(requirements_text)
    found = cached(wheel_cache, hashes)
    missing = [line for line in requirements_text.splitlines()
               if line.strip() and not lock_hashes(line) & set(found)]
    remote.shell(host, StringCommand("mkdir", "-p", WHEEL_DIR))
    remote.put(host, StringIO("".join(line + "\n" for line in missing)),
               f"{WHEEL_DIR}/{MISSING}")
    if not found:
        logger.info(f"{host.print_prefix}locked wheels: none of the lock's {len(hashes)} "
                    "hashes in the controller's cache: from the index")
        return True
    with tempfile.TemporaryDirectory() as tmp:
        for path in found.values():
            os.symlink(path, Path(tmp) / path.name)
        names = sorted(p.name for p in found.values())
        tar = subprocess.Popen(["tar", "-chf", "-", "-C", tmp, "--", *names],
                               stdout=subprocess.PIPE)
        done = subprocess.run([*_ssh(host), f"tar -xf - -C {WHEEL_DIR}"], stdin=tar.stdout,
                              capture_output=True, text=True, check=False)
        tar.wait()
    if done.returncode != 0 or tar.returncode != 0:
        raise OperationError(f"could not send the cached wheels ({done.stderr.strip()})")
    size = sum(p.stat().st_size for p in found.values())
    logger.info(f"{host.print_prefix}locked wheels: {len(found)} files ({size} bytes) from the "
                f"controller's cache, {len(missing)} of the lock's distributions from the index")
    return True


@remote.callback("caching the locked wheels")
def harvest(state, host, wheel_cache: str, hashes: list[str]) -> bool:
    """Fetch the files of WHEEL_DIR the cache lacks, keep those whose sha256 the lock names,
    remove WHEEL_DIR (step 3)."""
    ok, listed = remote.shell(host, StringCommand(
        "sh", "-c", shlex.quote(f"cd {WHEEL_DIR} && sha256sum -- *")))
    have = cached(wheel_cache, hashes)
    wanted = {}
    for line in listed.stdout_lines if ok else []:
        digest, _, name = line.partition("  ")
        if digest in hashes and digest not in have and "/" not in name:
            wanted[name] = digest
    if wanted:
        root = cache_dir(wheel_cache)
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=root, prefix=".fetch.") as tmp:
            command = "tar -cf - -C " + WHEEL_DIR + " -- " + shlex.join(sorted(wanted))
            ssh = subprocess.Popen([*_ssh(host), command], stdout=subprocess.PIPE,
                                   stderr=subprocess.PIPE)
            done = subprocess.run(["tar", "-xf", "-", "-C", tmp], stdin=ssh.stdout,
                                  capture_output=True, check=False)
            ssh.wait()
            kept = 0
            for name, digest in wanted.items():
                path = Path(tmp) / name
                if done.returncode or not path.is_file() or hashlib.sha256(
                        path.read_bytes()).hexdigest() != digest:
                    continue
                final = root / digest
                staged = Path(tmp) / f".{digest}"
                staged.mkdir()
                os.replace(path, staged / name)
                try:
                    os.replace(staged, final)
                    kept += 1
                except OSError:  # another host's copy got there first
                    pass
        logger.info(f"{host.print_prefix}locked wheels: {kept} files cached on the controller "
                    f"({root}) for the rest of the fleet")
    remote.shell(host, StringCommand("rm", "-rf", WHEEL_DIR))
    return True


def fresh_install(venv: str, requirements: str, requirements_text: str, index_url: str,
                  wheel_cache: str, pip_options: list[str]):
    """The commands that install a fresh venv's lock through the fleet's cache (the module's
    three steps); ``pip_options``: the install's own (``--no-build-isolation``)."""
    hashes = sorted(lock_hashes(requirements_text))
    pip = [f"{venv}/bin/python", "-m", "pip"]
    common = ["--no-deps", "--require-hashes", "--disable-pip-version-check"]
    yield FunctionCommand(send, (wheel_cache, requirements_text), {})
    download = no_space_named(f"pip download into {WHEEL_DIR}", WHEEL_DIR, [
        *pip, "download", *common, *pip_index_args(index_url), "--dest", WHEEL_DIR,
        "-r", f"{WHEEL_DIR}/{MISSING}"])
    failed = shlex.quote(f"the download of the lock's wheels from {index_url} "
                         f"{proxy.through(proxy.of_host(), index_url)} failed")
    # pip refuses an empty requirements file ("You must give at least one requirement")
    yield StringCommand("sh", "-c", shlex.quote(
        f"if [ -s {WHEEL_DIR}/{MISSING} ]; then {download.get_raw_value()} || {{ rc=$?; "
        f"echo {failed} \"(pip's exit status $rc)\" >&2; exit $rc; }}; fi"))
    yield no_space_named(f"pip install into {venv}", venv, [
        *pip, "install", *common, "--no-index", "--find-links", WHEEL_DIR, *pip_options,
        "-r", requirements])
    yield FunctionCommand(harvest, (wheel_cache, hashes), {})
