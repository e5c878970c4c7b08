"""The inventory's peers that may hold a host's model: who they are and how the deploy logs in
to them, and the check of a peer's copy by hash against the revision's files before it serves
as a source."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from pyinfra import logger

from operations.plans.settings import Settings
from operations.stages.model_copy_rsync import parent_death_signal

#: Seconds to wait for a peer's sshd to answer.
CONNECT_TIMEOUT_S: Final = 10
#: How model_fetch.py --check-room's line of the revision's files starts (MANIFEST there).
MANIFEST: Final = "manifest "

#: Run on a peer by the deploy's login (as root): its model folder (argv[1]) against the
#: revision's files on stdin (``{"files": {path: [size, hash, is LFS]}}``, the disk preflight's
#: manifest); prints ``{"good", "wrong", "links", "extra", "missing"}``. Nothing is followed
#: (lstat, O_NOFOLLOW); the Hub client's top-level ``.cache`` and the stamp are not the
#: revision's and not said. Hashes as model_fetch.py: sha256 of an LFS file, the git blob id
#: (sha1 of ``blob <size>\0`` and the content) of another; in parallel (hashlib lets go of the
#: GIL on large updates).
PEER_CHECK: Final = r"""
import hashlib, json, os, stat, sys
from concurrent.futures import ThreadPoolExecutor
root = sys.argv[1]
files = json.load(sys.stdin)["files"]
out = {"good": [], "wrong": [], "links": [], "extra": [], "missing": []}
def check(name):
    size, want, lfs = files[name]
    path = os.path.join(root, name)
    try:
        st = os.lstat(path)
    except OSError:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "links"
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return "wrong"
    h = hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % size)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as fh:
        while True:
            chunk = fh.read(1 << 24)
            if not chunk:
                break
            h.update(chunk)
    return "good" if h.hexdigest() == want else "wrong"
with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
    for name, verdict in zip(files, pool.map(check, files)):
        out[verdict].append(name)
for top, dirs, names in os.walk(root):
    rel = os.path.relpath(top, root)
    if rel == ".":
        dirs[:] = [d for d in dirs if d != ".cache" or os.path.islink(os.path.join(top, d))]
    for n in names + [d for d in dirs if os.path.islink(os.path.join(top, d))]:
        p = n if rel == "." else rel + "/" + n
        if p not in files and not p.startswith(".gpuhost-model.json"):
            out["links" if os.path.islink(os.path.join(top, n)) else "extra"].append(p)
print(json.dumps({k: sorted(v) for k, v in out.items()}))
"""


@dataclass(frozen=True)
class Peer:
    """Another inventory host that may hold the same model: its name, SSH address and port,
    its known-hosts file and host key checking (from its host data), its model folder, and its
    address on the network the hosts share (``gpuhost_fleet_address``, None if not set)."""

    name: str
    address: str
    port: int
    known_hosts: str | None
    strict_host_key_checking: str
    model_dir: str
    fleet_address: str | None = None
    #: The deploy's own login to the peer (:func:`login_rsh`): ssh command, ``user@address``,
    #: whether commands go through sudo; None where not known (its check is then not run and
    #: the peer not copied from).
    login: tuple[str, str, bool] | None = None


def peers(me: str, settings: Mapping[str, Settings], data: Mapping[str, Mapping[str, Any]]
          ) -> list[Peer]:
    """The serving hosts other than ``me`` whose host data serves the same repository at the same
    revision (a copy there is used only when its stamp says it is complete), in inventory
    order.

    + me: this host's name
    + settings: every host's settings (operations.plans.settings.for_run)
    + data: every host's raw data, for its SSH address (``ssh_hostname``, ``ssh_port``,
      ``ssh_known_hosts_file``, ``ssh_strict_host_key_checking``; pyinfra's names)
    """
    mine = settings[me]
    found = []
    for name, other in settings.items():
        if name == me or not other.serving or other.model_is_local or other.model != mine.model \
                or other.model_revision != mine.model_revision:
            continue
        d = data.get(name, {})
        rsh, target, remote_rsync = login_rsh(name, d)
        found.append(Peer(name, str(d.get("ssh_hostname") or name), int(d.get("ssh_port") or 22),
                          d.get("ssh_known_hosts_file"),
                          str(d.get("ssh_strict_host_key_checking") or "accept-new"),
                          other.model_dir, other.fleet_address,
                          (rsh, target, remote_rsync.startswith("sudo"))))
    return found


def login_rsh(name: str, data: Mapping[str, Any]) -> tuple[str, str, str]:
    """The ssh command, ``user@address`` and remote rsync of the deploy's own login to a host,
    built as pyinfra's SSH connector builds its rsync (pyinfra 3.10, connectors/ssh.py,
    ``SSHConnector.rsync``)."""
    opts = ["ssh", "-o", "BatchMode=yes"]
    for key, option in (("ssh_known_hosts_file", "UserKnownHostsFile"),
                        ("ssh_strict_host_key_checking", "StrictHostKeyChecking")):
        if data.get(key):
            opts += ["-o", f"{option}={os.path.expanduser(str(data[key]))}"]
    if data.get("ssh_config_file"):
        opts += ["-F", str(data["ssh_config_file"])]
    if data.get("ssh_port"):
        opts += ["-p", str(data["ssh_port"])]
    if data.get("ssh_key"):
        opts += ["-i", os.path.expanduser(str(data["ssh_key"]))]
    user = f"{data['ssh_user']}@" if data.get("ssh_user") else ""
    return shlex.join(opts), f"{user}{data.get('ssh_hostname') or name}", (
        "sudo rsync" if data.get("_sudo") else "rsync")


def read_manifest(lines: list[str]) -> dict | None:
    """The revision's files from model_fetch.py --check-room's last line: ``{"sha": ...,
    "files": {path: [size, hash, is LFS]}}``; None where it is not there."""
    for line in reversed(lines):
        if line.startswith(MANIFEST):
            try:
                found = json.loads(line[len(MANIFEST):])
            except ValueError:
                return None
            ok = isinstance(found, dict) and isinstance(found.get("files"), dict)
            return found if ok and isinstance(found.get("sha"), str) else None
    return None


def _names(names: list[str], most: int = 5) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")


def check_peer(peer: Peer, repo: str, files: dict[str, list], prefix: str) -> list[str]:
    """The files of ``peer``'s copy of ``repo`` whose hash is the Hub's (:data:`PEER_CHECK`
    run there over the deploy's own login), in the revision's order; [] where none, or where
    the check could not run (said: the peer is not a source then). A file that differs, a
    symbolic link and a file the revision does not list are said, and left to the Hub."""
    if peer.login is None:
        logger.info(f"{prefix}model copy: {peer.name}'s copy cannot be checked (no login to it "
                    "in the inventory): not copied from there")
        return []
    rsh, target, sudo = peer.login
    folder = f"{peer.model_dir.rstrip('/')}/{repo}"
    command = shlex.join([*(["sudo", "-n"] if sudo else []), "python3", "-c", PEER_CHECK,
                          folder])
    began = time.monotonic()
    try:
        done = subprocess.run([*shlex.split(rsh), "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
                               target, command], input=json.dumps({"files": files}),
                              capture_output=True, text=True, check=False,
                              preexec_fn=parent_death_signal())
        verdict = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict) or not isinstance(verdict.get("good"), list):
        err = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        logger.info(f"{prefix}model copy: {peer.name}'s copy of {repo} could not be checked "
                    f"by its hashes ({err}): not copied from there")
        return []
    verified = set(verdict["good"])
    good = [n for n in files if n in verified and "\n" not in n]
    said = [f"{len(verdict[k])} {label} ({_names(verdict[k])})" for k, label in (
        ("wrong", "file(s) whose hash is not the Hub's"), ("links", "symbolic link(s)"),
        ("extra", "file(s) the revision does not list")) if verdict.get(k)]
    if said:
        logger.warning(f"{prefix}model copy: {peer.name}'s own copy of {repo} holds "
                       f"{'; '.join(said)}: not copied; only its {len(good)} file(s) verified "
                       f"there are (the rest from the Hub). {peer.name}'s model folder is not "
                       "what the Hub serves: look at that host")
    logger.info(f"{prefix}model copy: {peer.name}'s copy checked by hash in "
                f"{time.monotonic() - began:.0f} s: {len(good)} of {len(files)} files verified")
    return good
