"""Manage the served model's weights: a complete local copy of a Hub repository at a revision."""

from __future__ import annotations

import json
import shlex
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, operation

from operations.runtime import remote
from operations.facts.model_facts import (
    ROOM_HEADROOM_GIB,
    STAMP,
    ModelSnapshot,
    is_current,
    model_download,
)
from operations.stages import model_copy
from operations.stages.p2p import LIB_DIR
from operations.stages.venvs import size_text

def model_room_problem(fact, settings, commit: str | None = None) -> str | None:
    """Why the model's download (:func:`model_download`) does not fit on its file system, or
    None. The need is the revision's files not there yet (the Hub's file listing) and
    ROOM_HEADROOM_GIB."""
    room = model_download(fact, settings, commit)
    if room is None:
        return None
    if "error" in room:
        logger.warning(f"{host.print_prefix}the model's room is checked at the download only: "
                       f"the Hub's file listing was not read while planning ({room['error']})")
        return None
    if room.get("unsized"):
        logger.warning(f"{host.print_prefix}the model's room check counts nothing for "
                       f"{room['unsized']} file(s) the Hub's file listing gives no size of")
    need = room["need"] + int(ROOM_HEADROOM_GIB * 2**30)
    if room["free"] >= need:
        return None
    return (f"no room for the model {settings.model}@{settings.model_revision} in "
            f"{settings.model_path}: {room['folder']} on the file system mounted on "
            f"{room['mount']} (df): {size_text(need // 1024)} needed "
            f"({size_text(room['need'] // 1024)} of the revision's files not there yet, from "
            f"the Hub's file listing, and {ROOM_HEADROOM_GIB:g} GiB kept free), "
            f"{size_text(room['free'] // 1024)} free: make room there, mount a larger file "
            "system, or set gpuhost_model_dir elsewhere")


@operation()
def weights(repo: str, revision: str, dest: str, endpoint: str, python: str,
            token_file: str | None = None, headroom_gib: float = 1.0,
            architecture: str | None = None, peers: list[model_copy.Peer] | None = None,
            bwlimit_kib: int | None = None, mirror: str | None = None, mtp: bool = False,
            commit: str | None = None):
    """Download ``repo`` at ``revision`` into ``dest`` unless a complete copy is there.

    + repo: the Hub repository id, e.g. ``lukealonso/GLM-5-NVFP4``
    + revision: branch, tag or commit sha, which the stamp records
    + commit: the commit of ``revision`` the fleet serves (operations/plans/model_revision.py): a
      copy of another is brought in line, a new one fetched at it; None: ``revision`` as the
      Hub names it at download time
    + dest: the local folder the server reads
    + endpoint: the Hub's URL (huggingface_hub's HF_ENDPOINT)
    + python: the venv's python, which has huggingface_hub
    + token_file: root-only file on the host holding the token (its path only travels)
    + headroom_gib: GiB that must stay free after the download (the disk preflight)
    + architecture: ``gpuhost_model_architecture``; a downloaded config.json that names
      another (or none) fails the host there (exit 3), before the unit is written or the
      server restarted: planning could not read a config.json that was not there yet
    + peers: other inventory hosts that may hold a complete copy (operations/stages/model_copy.py):
      the first whose stamp says so is copied from, before the Hub (directly where the host
      reaches its fleet address, else through the controller), once the disk preflight
      (model_fetch.py --check-room) found room for what is missing
    + bwlimit_kib: rsync's --bwlimit for that copy (KiB/s), None for no limit
    + mtp: the checkpoint must have its MTP layer (gpuhost_speculative_algorithm set): a
      downloaded weight index without its tensors fails the host there (exit 3), as
      ``architecture`` does
    + mirror: a folder on the host holding ``<repo>/`` copies (``gpuhost_model_mirror``),
      copied from before the peers and the Hub where its copy is of the same commit; where its
      stamp names no copy of ``revision`` (a missing, empty or other mirror), the peers are
      tried as without it

    The download runs operations/files/model_fetch.py on the host: model metadata, the disk
    preflight (exit 2: not enough space), snapshot_download, then every file's size checked
    against the metadata (with peers, every file copied by its hash too). Changes when the
    copy is missing, incomplete, of another repository, or of another revision.
    """
    snapshot = host.get_fact(ModelSnapshot, path=dest)
    if is_current(snapshot, repo, revision, commit):
        host.noop(f"{repo}@{snapshot.get('sha', '')[:12]} is complete in {dest}")
        return
    if commit and snapshot.get("repo") == repo and snapshot.get("sha") not in (None, commit):
        logger.warning(f"{host.print_prefix}model: {dest} holds {repo}@"
                       f"{str(snapshot['sha'])[:12]}, not {commit[:12]}, the fleet's commit of "
                       f"{revision}: brought in line (that commit is fetched, the server restarts)")
    if snapshot.get("extra"):
        logger.warning(f"{host.print_prefix}model: {dest} holds what {repo}'s revision does not "
                       f"list ({', '.join(snapshot['extra'])}): removed, and the weights "
                       "verified again")
    args = ["--repo", repo, "--revision", revision, "--dest", dest, "--endpoint", endpoint,
            "--headroom-gib", str(headroom_gib)]
    if token_file:
        args += ["--token-file", token_file]
    if architecture:
        args += ["--architecture", architecture]
    if mtp:
        args.append("--mtp")
    if commit:
        args += ["--commit", commit]
    if peers:
        # before the fetch: a mirror that holds the revision is left to it (model_fetch.py
        # copies from it first), one that does not leaves the copy to the peers
        room = shlex.join([python, f"{LIB_DIR}/model_fetch.py", *args, "--check-room"])
        yield FunctionCommand(model_copy.copy, (peers, repo, commit or revision, dest,
                                                bwlimit_kib, room),
                              {"mirror": mirror})
    # the peer the copy came from, as the copy recorded it on the host (not known while
    # planning); files already in dest from an earlier run's copy are verified all the same
    copied_from = ["--copied-from", f'"$(cat {model_copy.COPIED_FROM} 2>/dev/null || echo '
                                    f'{shlex.quote(EARLIER_COPY)})"'] if peers else []
    if mirror:
        args += ["--mirror", mirror]
    yield StringCommand(*(shlex.quote(a) for a in (python, f"{LIB_DIR}/model_fetch.py", *args)),
                        *copied_from)
    yield FunctionCommand(say_source, (dest,), {})


#: What files found in the model folder without this run's copy came from.
EARLIER_COPY: Final = "an earlier run's copy"


def say_source(state, host, dest: str) -> bool:
    """Print where the weights just fetched came from, as model_fetch.py's stamp records it."""
    ok, output = remote.shell(host, StringCommand("cat", shlex.quote(f"{dest}/{STAMP}")))
    try:
        source = json.loads("\n".join(output.stdout_lines)).get("source") or {}
    except ValueError:
        source = {}
    if ok and source:
        line = (f"{source.get('copied_files')} files ({source.get('copied_bytes')} bytes) from "
                f"{source['copied_from']}, verified against the Hub's metadata; "
                if source.get("copied_from") else "")
        logger.info(f"{host.print_prefix}weights source: {line}{source.get('hub_files')} files "
                    f"({source.get('hub_bytes')} bytes) from the Hub")
    return True
