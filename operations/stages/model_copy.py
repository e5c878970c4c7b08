"""Copy a model's weights from a peer host of the inventory, so that a rebuilt host does not
download them from the Hub again.

Every host lets one key, made by the deploy on the controller for this alone, read its model
folder and nothing else: an unprivileged user whose ``authorized_keys`` forces rsync's
``rrsync -ro <model dir>`` (rrsync(1) of rsync 3.2.7, ``/usr/bin/rrsync`` in Debian 12's and
Ubuntu 24.04's rsync package: "Allow only reading from the DIR"), with sshd's ``restrict``
option (sshd(8), AUTHORIZED_KEYS FILE FORMAT: no forwarding, no PTY, no ~/.ssh/rc). Its shell
is /bin/sh, not bash (rrsync(1), BASH SECURITY ISSUE). It is never a login key.

Before any byte moves, model_fetch.py's disk preflight (``--check-room``: the bytes the Hub's
metadata lists that are not there yet, plus the headroom, against the free space of the model
folder's file system) runs on the host: a disk too small fails the host there.

Where the peer has a ``gpuhost_fleet_address`` and the host reaches it there, the host pulls
the folder itself (operations/stages/model_copy_direct.py). Else the copy goes through the
controller: rsync from the peer into a staging folder on the controller with that key, then from
there into the host's model folder over the deploy's own SSH login. Every leg keeps partly copied
files (``--partial-dir``), so an interrupted copy resumes; the staging folder is removed once
the host has every file.
Only the revision's files are copied, each verified by its hash, from the same metadata the
download reads (huggingface_hub's ``model_info`` with ``files_metadata``: the Hub's sha256 of an
LFS file, the git blob id of any other; the disk preflight prints it). Before a peer serves as a
source, its own copy is checked there, over the deploy's own login to the peer (sudo), by
:data:`operations.stages.model_peers.PEER_CHECK`: a file whose hash is not the Hub's, a symbolic
link, and a file the revision does not list are said and not copied (rsync ``--files-from`` the
verified files alone, never following a link: ``--no-links``); what is not copied comes from
the Hub. That check is the peer's word: model_fetch.py then verifies each file on the host
itself against the Hub's metadata, removes every file and link the revision does not list, and
downloads from the Hub only what is missing or wrong. No token is used by the copy or travels
with it.

A copy dies with the run that started it: rsync and ssh here get SIGTERM when the controller's
process ends, however it ends (prctl(2) PR_SET_PDEATHSIG), and the host's side of a direct copy
stops its rsync when the deploy's SSH session ends (model_copy_direct.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
from io import StringIO
from pathlib import Path
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FactBase, StringCommand, deploy, operation
from pyinfra.api.exceptions import OperationError
from pyinfra.facts.deb import DebPackages
from pyinfra.operations import apt, files, server
from typing_extensions import override

from operations.runtime import remote
from operations.runtime.polled_lock import lock_exclusive
from operations.facts.host import PasswdEntry
from operations.plans.settings import PREFIX, Settings
from operations.stages import model_copy_direct
from operations.stages.model_copy_rsync import rsync, run_rsync
from operations.stages.model_peers import (
    CONNECT_TIMEOUT_S,
    Peer,
    check_peer,
    login_rsh,
    read_manifest,
)

#: The peer-side user the copy key logs in as (no password, no login shell of its own).
COPY_USER: Final = "gpuhost-models"
COPY_HOME: Final = "/var/lib/gpuhost-models"
RRSYNC: Final = "/usr/bin/rrsync"
#: The key pair on the controller, made on first use (ssh-keygen -t ed25519).
KEY_PATH: Final = Path("~/.cache/gpuhost/keys/model-copy").expanduser()
#: Where a copy is staged on the controller: ``<STAGING>/<repo>@<sha>/``.
STAGING: Final = Path("~/.cache/gpuhost/models").expanduser()
#: One lock file per staging folder (:func:`staging_lock`).
STAGING_LOCKS: Final = Path("~/.cache/gpuhost/model-copy-locks").expanduser()
#: rsync's flags for both legs (rsync(1)): archive, keep partial files in a folder of their own
#: for the next run to resume, never the Hub client's local cache or the stamp (model_fetch.py
#: writes the stamp once it verified every file), progress of the whole transfer on stdout;
#: modes set, not copied (a peer's 0600 files, left by a hardened umask, stay no one's copy).
RSYNC_FLAGS: Final = ("-a", "--chmod=D755,F644", "--partial", "--partial-dir=.rsync-partial", "--exclude=/.cache",
                      "--exclude=/.gpuhost-model.json*", "--no-owner", "--no-group", "--info=progress2",
                      "--no-inc-recursive")
STAMP: Final = ".gpuhost-model.json"
#: Which peer this run's copy came from ("peer gpu2"), for model_fetch.py's --copied-from
#: (operations/stages/model.py reads it into that argument on the host); removed before each copy.
COPIED_FROM: Final = "/run/gpuhost/model-copied-from"

#: What a copy never brings (rsync(1)): symbolic links (``-a`` implies ``--links``), devices
#: and special files; with ``--files-from``, only the files the peer check verified.
RSYNC_ONLY_FILES: Final = ("--no-links", "--no-devices", "--no-specials")



def copy_public_key() -> str:
    """The copy key's public half (``ssh-ed25519 AAAA... gpuhost model copy``), the pair made
    on the controller the first time it is asked for."""
    if not KEY_PATH.is_file():
        KEY_PATH.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C",
                        "gpuhost model copy", "-f", str(KEY_PATH)], check=True,
                       stdout=subprocess.DEVNULL)
    return KEY_PATH.with_name(KEY_PATH.name + ".pub").read_text().strip()


def authorized_keys(model_dir: str, public_key: str) -> str:
    """The copy user's ``authorized_keys``: the key may run rrsync, read-only, in ``model_dir``."""
    return f'restrict,command="{RRSYNC} -ro {model_dir}" {public_key}\n'


@deploy("Model copy access")
def copy_access(settings: Settings):
    """rsync, and the copy user (its key: :func:`copy_key`, once the weights are in place).

    + settings: the host's validated settings
    """
    # apt's lists are refreshed only where rsync is missing: a converged host's run stays a
    # no-op (apt.packages' update would run whenever the lists are older than cache_time)
    installed = host.get_fact(DebPackages) or {}
    apt.packages(name="rsync and ssh (the model copy)", packages=["rsync", "openssh-client"],
                 update=not {"rsync", "openssh-client"} <= set(installed))
    copy_user(name=f"User {COPY_USER} (reads the model folder for peers)")
    said = reach_message(settings.model_dir, host.get_fact(ModelFolderReach,
                                                           path=settings.model_dir,
                                                           user=COPY_USER))
    if said:
        logger.warning(f"{host.print_prefix}model copy: {said}")
    files.directory(name=f"{COPY_USER}'s .ssh", path=f"{COPY_HOME}/.ssh", user=COPY_USER,
                    group=COPY_USER, mode="700")


@operation()
def copy_user():
    """The copy user as pyinfra's ``server.user`` makes it: a system user, home COPY_HOME
    (created), shell /bin/sh. Where ``getent`` shows the account with that home and shell,
    only what ``server.user`` then does runs (pyinfra 3.10, ``operations/stages/server.py``: no
    usermod, and its ``ensure_home``, ``files.directory`` of the home owned by the user), without
    reading pyinfra's ``Users`` of every account (:class:`operations.facts.host.PasswdEntry`)."""
    entry = host.get_fact(PasswdEntry, user=COPY_USER)
    if entry and (entry["home"], entry["shell"]) == (COPY_HOME, "/bin/sh"):
        yield from files.directory._inner(path=COPY_HOME, user=COPY_USER, group=COPY_USER,
                                          _no_fail_on_link=True)
        return
    # its own group made first and named: useradd makes one of the user's name only where
    # login.defs says USERGROUPS_ENAB yes (a hardened host's is no: useradd(8), login.defs(5))
    yield from server.group._inner(group=COPY_USER, system=True)
    yield from server.user._inner(user=COPY_USER, group=COPY_USER, home=COPY_HOME,
                                  shell="/bin/sh", system=True, create_home=True)


#: rrsync's words (rsync 3.2.7's /usr/bin/rrsync) where its restricted folder fails
#: ``os.path.isdir``: missing, or not reachable by the user it runs as.
RRSYNC_NO_DIR: Final = "Restricted directory does not exist!"


class ModelFolderReach(FactBase[str]):
    """Whether the copy user can read ``path`` (gpuhost_model_dir), as rrsync, which runs as it,
    would: "readable", "missing", "no user" (the copy user not made yet), or "blocked <folder>
    <mode>": the first folder on the way it cannot pass, and that folder's mode.

    .. code:: python

        "blocked /opt/gpuhost 700"
    """

    @override
    def command(self, path: str, user: str) -> str:
        d, u = shlex.quote(path), shlex.quote(user)
        return (f"if ! id -u {u} >/dev/null 2>&1; then echo 'no user'; "
                f"elif [ ! -d {d} ]; then echo missing; "
                f"elif runuser -u {u} -- test -r {d} -a -x {d}; then echo readable; "
                f"else p=; for part in $(printf '%s' {d} | tr / ' '); do p=\"$p/$part\"; "
                f"if ! runuser -u {u} -- test -x \"$p\" -a -r \"$p\"; then "
                "echo \"blocked $p $(stat -c %a \"$p\")\"; exit 0; fi; done; "
                f"echo \"blocked {d} $(stat -c %a {d})\"; fi")

    @override
    def process(self, output: list[str]) -> str:
        return output[-1].strip() if output else "missing"


def reach_message(model_dir: str, reach: str) -> str | None:
    """What the source host's run says where its model folder exists but the copy user cannot
    read it (:class:`ModelFolderReach`), None otherwise."""
    if not reach.startswith("blocked "):
        return None
    folder, _, mode = reach.removeprefix("blocked ").rpartition(" ")
    return (f"{model_dir} exists but the copy user {COPY_USER} cannot read it ({folder} is "
            f"mode {mode}, a hardened umask's): peers cannot copy the model from this host "
            "until it can; gpuhost sets its folders' modes (0755) in this run")


def copy_key(settings: Settings):
    """The copy user's one key, which may only read ``gpuhost_model_dir`` with rrsync. After
    the weights' download: a run whose download fails (a wrong model) leaves peers' access to
    the folder as it was.

    + settings: the host's validated settings
    """
    files.put(name=f"{COPY_USER}'s authorized key (rrsync -ro {settings.model_dir})",
              src=StringIO(authorized_keys(settings.model_dir, copy_public_key())),
              dest=f"{COPY_HOME}/.ssh/authorized_keys", user=COPY_USER, group=COPY_USER,
              mode="600")


def _peer_rsh(peer: Peer) -> str:
    # a peer that is down is given up in seconds (the Hub is the way on), not TCP's minutes
    opts = ["ssh", "-i", str(KEY_PATH), "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
            "-o", f"ConnectTimeout={CONNECT_TIMEOUT_S}",
            "-o", f"StrictHostKeyChecking={peer.strict_host_key_checking}", "-p", str(peer.port)]
    if peer.known_hosts:
        opts += ["-o", f"UserKnownHostsFile={os.path.expanduser(peer.known_hosts)}"]
    return shlex.join(opts)


def _peer_stamp(peer: Peer, repo: str, prefix: str) -> dict | None:
    with tempfile.TemporaryDirectory() as tmp:
        ok, err = rsync(["rsync", "-e", _peer_rsh(peer),
                         f"{COPY_USER}@{peer.address}:{repo}/{STAMP}", f"{tmp}/stamp"],
                        prefix, "stamp")
        if not ok and RRSYNC_NO_DIR in err:
            # rrsync's words where os.path.isdir() is False: the folder missing, or there and
            # not reachable by the copy user (a folder above it 0700): the peer's own run says
            # which (ModelFolderReach)
            logger.info(f"{prefix}model copy: {peer.name}'s copy user cannot reach "
                        f"{peer.model_dir} (rrsync: {RRSYNC_NO_DIR!r}: the folder is missing "
                        f"there, or exists but is not readable by {COPY_USER}; {peer.name}'s "
                        "own run says which)")
            return None
        if not ok:
            # the usual case on a fresh fleet (no peer has a copy, nor the copy key yet): one
            # plain line for all of them follows (copy); rsync's words only with -v
            logger.debug(f"{prefix}model copy: {peer.name} has no complete copy of {repo} "
                         f"that the copy key can read ({err or 'rsync failed'})")
            return None
        try:
            stamp = json.loads(Path(f"{tmp}/stamp").read_text())
        except ValueError:
            return None
    return stamp if isinstance(stamp, dict) else None


def _mirror_holds(host, mirror: str, repo: str, revision: str) -> bool:
    """Whether the mirror folder on ``host`` has a stamp of ``repo`` at ``revision`` (its branch
    or commit), as a peer's stamp is read: model_fetch.py then copies from it."""
    ok, out = remote.shell(host, StringCommand("cat", shlex.quote(f"{mirror}/{repo}/{STAMP}")))
    try:
        stamp = json.loads("\n".join(out.stdout_lines)) if ok else None
    except ValueError:
        stamp = None
    return isinstance(stamp, dict) and stamp.get("repo") == repo and revision in (
        stamp.get("revision"), stamp.get("sha"))


@remote.callback("model copy")
def copy(state, host, peer_list: list[Peer], repo: str, revision: str, dest: str,
         bwlimit_kib: int | None, room_check: str, mirror: str | None = None) -> bool:
    """Copy ``repo`` from the first peer whose stamp says it holds ``revision`` complete into
    ``dest`` on ``host``: directly where the host reaches the peer's fleet address, else
    through the controller; nothing where ``mirror`` (gpuhost_model_mirror, on the host) holds
    it (model_fetch.py copies from there). ``room_check`` (model_fetch.py --check-room) runs
    first: a disk too small fails the host before any byte moves. A peer that fails is said
    and the next one tried; where no peer holds a copy, one plain line says so ("no peer has the
    model yet: from the Hub"); model_fetch.py, run next, copies from the mirror or downloads
    from the Hub what is not there. The peer copied from is recorded in :data:`COPIED_FROM`.
    """
    prefix = host.print_prefix
    remote.shell(host, f"rm -f {COPIED_FROM}")
    if mirror and _mirror_holds(host, mirror, repo, revision):
        logger.info(f"{prefix}model copy: the mirror {mirror} holds {repo}@{revision}: copied "
                    "from there, not from a peer")
        return True
    if not shutil.which("rsync"):
        logger.warning(f"{prefix}model copy: rsync is not installed on the controller: the "
                       "weights come from the Hub (apt install rsync to copy them from peers)")
        return True
    ok, output = remote.shell(host, StringCommand(room_check))
    if not ok:
        raise OperationError((output.stderr_lines or ["the disk preflight failed"])[-1])
    manifest = read_manifest(output.stdout_lines)
    if manifest is None:
        logger.warning(f"{prefix}model copy: the disk preflight gave no list of the revision's "
                       "files: the weights come from the Hub")
        return True
    limit = [f"--bwlimit={bwlimit_kib}"] if bwlimit_kib else []
    holders = []
    for peer in peer_list:
        stamp = _peer_stamp(peer, repo, prefix)
        if not stamp or stamp.get("repo") != repo or revision not in (stamp.get("revision"),
                                                                      stamp.get("sha")):
            continue
        holders.append(peer.name)
        sha = str(stamp.get("sha"))
        if sha != manifest["sha"]:
            logger.info(f"{prefix}model copy: {peer.name} holds {repo}@{sha[:12]}, not the "
                        f"revision's commit {manifest['sha'][:12]}: not copied from there")
            continue
        good = check_peer(peer, repo, manifest["files"], prefix)
        if not good:
            continue
        what = f"{repo}@{sha[:12]} from peer {peer.name}"
        why = (f"{PREFIX}fleet_address is not set for {peer.name}" if not peer.fleet_address
               else "")
        if peer.fleet_address:
            done, why = _direct(host, peer, repo, dest, limit, what, good)
            if done:
                logger.info(f"{prefix}model copy: {repo}@{sha[:12]} copied from {peer.name} "
                            "directly over the fleet network; verifying every file against the "
                            "Hub's metadata")
                return copied_from(host, peer.name)
        if relay(host, peer, repo, sha, dest, limit, what, why, good):
            return copied_from(host, peer.name)
    logger.info(f"{prefix}model copy: "
                + ("no peer has the model yet: from the Hub" if not holders else
                   f"no copy from {', '.join(holders)} went through (above): from the Hub"))
    return True


def copied_from(host, peer: str) -> bool:
    """Record on the host which peer this run's copy came from (:data:`COPIED_FROM`), for
    model_fetch.py's stamp and lines: that one peer, not every candidate."""
    folder = COPIED_FROM.rsplit("/", 1)[0]
    remote.shell(host, f"mkdir -p {folder} && printf %s {shlex.quote(f'peer {peer}')} > "
                       f"{COPIED_FROM}")
    return True


def _direct(host, peer: Peer, repo: str, dest: str, limit: list[str], what: str,
            good: list[str]) -> tuple[bool, str]:
    """Pull from ``peer``'s fleet address on the host: (whether it copied, why not: the host
    does not reach the peer there, or rsync's error; the copy through the controller is next)."""
    prefix = host.print_prefix
    assert peer.fleet_address is not None
    known = model_copy_direct.known_hosts_for(peer.address, peer.port, peer.fleet_address,
                                              peer.known_hosts)
    copy_public_key()
    rsh, target, remote_rsync = login_rsh(host.name, host.data.dict())
    logger.info(f"{prefix}model copy: {what} directly over the fleet network "
                f"({peer.fleet_address})")
    line = model_copy_direct.command(
        "sudo -n" if remote_rsync.startswith("sudo") else "", peer.fleet_address, peer.port,
        repo, dest, peer.strict_host_key_checking, known,
        [*RSYNC_FLAGS, *RSYNC_ONLY_FILES, *limit], good)
    code, err = run_rsync([*shlex.split(rsh), target, line], prefix,
                          f"model copy from {peer.name}", send=KEY_PATH.read_bytes())
    if code == model_copy_direct.UNREACHABLE:
        return False, err
    if code != 0:
        logger.warning(f"{prefix}model copy from {peer.name} over the fleet network failed "
                       f"({err}): what was copied is kept for the next run")
        return False, f"the direct copy failed: {err}"
    return True, ""




@contextlib.contextmanager
def staging_lock(staging: Path, prefix: str):
    """Hold ``<STAGING_LOCKS>/<staging's name>.lock`` (flock(2), exclusive) while a copy stages
    there: two hosts of one run rebuilt at once, or two runs from this controller, never write
    the same staged files, nor remove them under each other. Polled without blocking
    (LOCK_NB), so that the run's other hosts (gevent greenlets in one thread) go on while this
    one waits; the kernel lets go of the lock when the holder dies. The lock file stays (one
    removed while another run waits on it would let a third lock a new file beside it), in a
    folder of its own: the staging folder is empty once every copy is through."""
    STAGING_LOCKS.mkdir(parents=True, exist_ok=True)
    fd = os.open(STAGING_LOCKS / f"{staging.name}.lock",
                 os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    try:
        lock_exclusive(fd, lambda: logger.info(
            f"{prefix}model copy: waiting for another copy staging {staging.name} on this "
            "controller"), poll_s=1)
        yield
    finally:
        os.close(fd)


def relay(host, peer: Peer, repo: str, sha: str, dest: str, limit: list[str], what: str,
          why: str, good: list[str]) -> bool:
    """Copy the files ``good`` of ``repo`` from ``peer`` into ``dest`` on ``host`` through the
    controller (``why``: why not directly), one copy at a time per staging folder
    (:func:`staging_lock`); whether the host has them all now."""
    staging = STAGING / f"{repo.replace('/', '--')}@{sha}"
    with staging_lock(staging, host.print_prefix):
        return _relay(host, peer, repo, staging, dest, limit, what, why, good)


def _relay(host, peer: Peer, repo: str, staging: Path, dest: str, limit: list[str], what: str,
           why: str, good: list[str]) -> bool:
    prefix = host.print_prefix
    sha = staging.name.rsplit("@", 1)[1]
    staging.mkdir(parents=True, exist_ok=True)
    listed = STAGING / f"{staging.name}.files"
    listed.write_text("".join(f"{name}\n" for name in good))
    only = [*RSYNC_ONLY_FILES, f"--files-from={listed}"]
    staged = sum(f.stat().st_size for f in staging.rglob("*") if f.is_file())
    logger.info(f"{prefix}model copy: {what} through the controller"
                + (f" ({why})" if why else "")
                + (f", resuming: {staged} bytes already staged there by an earlier copy"
                   if staged else ""))
    ok, err = rsync(["rsync", *RSYNC_FLAGS, *only, *limit, "-e", _peer_rsh(peer),
                     f"{COPY_USER}@{peer.address}:{repo}/", f"{staging}/"],
                    prefix, f"model copy from {peer.name}")
    if not ok:
        logger.warning(f"{prefix}model copy from {peer.name} failed ({err}): what was "
                       "copied is kept for the next run")
        return False
    rsh, target, remote_rsync = login_rsh(host.name, host.data.dict())
    ok, err = rsync(["rsync", *RSYNC_FLAGS, *only, *limit, "-e", rsh, "--rsync-path",
                     remote_rsync, f"{staging}/", f"{target}:{dest}/"], prefix,
                    "model copy to the host")
    if not ok:
        logger.warning(f"{prefix}model copy into {dest} failed ({err}): what was copied is "
                       "kept for the next run")
        return True
    shutil.rmtree(staging, ignore_errors=True)
    listed.unlink(missing_ok=True)
    logger.info(f"{prefix}model copy: {repo}@{sha[:12]} copied from {peer.name} through the "
                "controller; verifying every file against the Hub's metadata")
    return True
