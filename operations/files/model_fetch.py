"""Download a model repository into a local folder with huggingface_hub, and check it is
complete.

Runs on the GPU host with the ML venv's python (huggingface_hub comes with the lock). Steps:

1. the repository's metadata at the revision (HfApi.model_info with files_metadata=True: the
   commit sha, every file with its size), with the token read from --token-file (root-only);
   with --commit (the fleet's commit of the revision, operations/plans/model_revision.py), at that
   commit, the stamp still naming --revision;
2. a disk-space preflight: the bytes still missing plus --headroom-gib must fit in the free
   space of the destination's file system, else exit 2 before downloading anything (a disk
   that fills up all the same, ENOSPC on any write, exits 2 with one line: what was being
   written, the space free there, what the snapshot needs; no_space.py, shipped beside). With
   --check-room the script stops here (exit 0 when it fits): the deploy runs it before a copy
   from a peer (operations/stages/model_copy.py), so a disk too small is refused before any byte
   moves; its last line (``manifest {"sha": ..., "files": {path: [size, hash, is LFS]}}``) tells the
   copy which files to take from the peer and what each must hash to;
3. every symbolic link in --dest and every file the revision does not list is removed (a peer's,
   a mirror's or a hand's: with --trust-remote-code sglang would run a ``modeling_*.py`` it
   finds; the Hub client's ``.cache`` folder and the stamp stay); then
   snapshot_download of that commit into --dest (resumes what is partly there). With
   --copied-from (the deploy copied the folder from a peer first: operations/stages/model_copy.py),
   every file already there is verified first against the metadata's hash, the sha256 of an
   LFS file or the git blob id of another (huggingface_hub 0.36.2, hf_api.py RepoSibling:
   ``blob_id``, ``lfs.sha256``); a file that does not match is removed, and only the missing
   ones are downloaded (hf_hub_download, file by file). The source of the files is printed:
   how many (and how many bytes) verified from the copy, how many from the Hub. With
   --mirror (``gpuhost_model_mirror``: a lab's mirror folder on the host, an NFS mount say),
   ``<mirror>/<repo>/`` is copied in first with rsync (resumable, as operations/stages/model_copy.py
   copies from a peer) where its stamp names the same commit, then verified the same way;
4. completeness: every file of the metadata present with its size, else exit 1 naming them;
5. the stamp ``<dest>/.gpuhost-model.json``: {"repo", "revision", "sha", "files": {path: size},
   "source": where this run's files came from (copied_from, copied_files, copied_bytes,
   hub_files, hub_bytes)}, what the deploy's ModelSnapshot fact compares with host data;
6. with --architecture (gpuhost_model_architecture): the downloaded config.json must name it
   (model_config.py, shipped beside), else exit 3 naming the key and both values. The stamp
   is written first: the copy is complete and right, host data is what is wrong, and the
   Stack stage of the next run reads the same config.json while planning;
7. with --mtp (gpuhost_speculative_algorithm set): the downloaded weight index must name the MTP
   layer's tensors (model_config.missing_mtp), else exit 3 the same way.

The token file must hold one line of header-safe text (secret_file.py, shipped beside this
script): else exit 1 saying so. The token is passed to huggingface_hub only, never printed:
once it is loaded, an unexpected error is reported as its type alone (secret_file.describe;
an OSError with its strerror), never as a traceback (requests' InvalidHeader quotes the header).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from model_config import WEIGHT_INDEX, mismatch, missing_mtp
from no_space import enospc, human, where
from secret_file import SecretFileError, describe, read_secret

STAMP = ".gpuhost-model.json"
GIB = 1024**3
#: How --check-room's last line starts: the revision's files, each [size, hash, is LFS].
MANIFEST = "manifest "


def _free_bytes(path: Path) -> int:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


#: Whether the token is loaded in this process (see describe).
_SECRET_LOADED = False
#: What the download is at, for a full disk's message: repo, dest, and once the metadata is
#: read, the snapshot's size and the bytes still missing.
_AT: dict = {}


def file_hash(path: Path, lfs: bool) -> str:
    """The hash the Hub's metadata gives for a file: sha256 of the content for an LFS file, its
    git blob id (sha1 of ``blob <size>\\0`` and the content) for any other."""
    h = hashlib.sha256() if lfs else hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as fh:
        while chunk := fh.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def verify_copy(dest: Path, files: dict[str, int], hashes: dict[str, tuple[str, bool]]
                ) -> tuple[list[str], list[str]]:
    """(the files in ``dest`` whose size and hash match the metadata, those that do not, which
    are removed); files not there are in neither. Hashed in parallel (hashlib releases the GIL
    on large reads)."""
    present = [n for n, size in files.items()
               if (dest / n).is_file() and (dest / n).stat().st_size == size]
    wrong_size = [n for n in files if (dest / n).is_file() and n not in present]

    def check(name: str) -> bool:
        want, lfs = hashes.get(name, ("", False))
        return bool(want) and file_hash(dest / name, lfs) == want

    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        results = list(pool.map(check, present))
    good = [n for n, ok in zip(present, results) if ok]
    bad = sorted(wrong_size + [n for n, ok in zip(present, results) if not ok])
    for name in bad:
        (dest / name).unlink()
    return good, bad


def revision_files(siblings) -> dict[str, tuple[int, str, bool]]:
    """Each file of the revision from model_info's siblings (huggingface_hub 0.36.2, hf_api.py
    ``RepoSibling``: ``rfilename``, ``size``, ``blob_id``, ``lfs`` a ``BlobLfsInfo`` with
    ``sha256``; the Hub's ``/api/models/<repo>?blobs=True`` JSON): (size, the hash its content
    must have, whether that is the LFS sha256 rather than the git blob id)."""
    return {s.rfilename: (s.size, s.lfs["sha256"], True) if s.lfs else (s.size, s.blob_id or "",
                                                                        False)
            for s in siblings or []}


def tidy(dest: Path, files) -> list[str]:
    """Remove from ``dest`` every symbolic link (never followed: a link named as a revision
    file is removed too, and fetched again) and every file that is not one of ``files`` (the
    revision's, by path), keeping the Hub client's ``.cache`` folder and the stamp; folders left
    empty go too. Returns what was removed, each as ``path`` or ``path (a symbolic link)``, and
    prints it: a peer, a mirror or a hand put them there, and sglang (with
    --trust-remote-code) would load a ``modeling_*.py`` or a ``chat_template.jinja`` it finds."""
    removed = []
    if not dest.is_dir() or dest.is_symlink():
        return removed
    for top, folders, names in os.walk(dest, topdown=True, followlinks=False):
        here = Path(top)
        if here == dest:
            folders[:] = [f for f in folders if f != ".cache" or (here / f).is_symlink()]
        for name in [*names, *folders]:
            path = here / name
            rel = path.relative_to(dest).as_posix()
            if path.is_symlink():
                path.unlink()
                removed.append(f"{rel} (a symbolic link)")
                if name in folders:
                    folders.remove(name)
            elif name in names and rel not in files and not (here == dest and name.startswith(
                    STAMP)):
                path.unlink()
                removed.append(rel)
    for top, _, _ in sorted(os.walk(dest), key=lambda w: -len(w[0])):
        if Path(top) != dest and not any(Path(top).iterdir()):
            Path(top).rmdir()
    for entry in removed:
        print(f"{entry} in {dest} is not a file of the revision: removed", flush=True)
    return removed


def copy_from_mirror(folder: Path, dest: Path, sha: str) -> bool:
    """rsync ``folder`` into ``dest`` where its stamp is of commit ``sha`` (the Hub client's
    cache and the stamp left out, partial files kept for the next run); whether it copied."""
    try:
        stamp = json.loads((folder / STAMP).read_text())
    except (OSError, ValueError):
        print(f"the mirror has no complete copy in {folder}: downloading from the Hub",
              flush=True)
        return False
    if not isinstance(stamp, dict) or stamp.get("sha") != sha:
        print(f"the mirror's copy in {folder} is of another commit: downloading from the Hub",
              flush=True)
        return False
    dest.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["rsync", "-a", "--chmod=D755,F644", "--no-owner", "--no-group",
                           "--partial",
                           "--partial-dir=.rsync-partial", "--exclude=/.cache",
                           f"--exclude=/{STAMP}*", f"{folder}/", f"{dest}/"],
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["rsync failed"])[-1]
        print(f"copy from the mirror {folder} failed ({last}): the Hub", flush=True)
    return done.returncode == 0


def no_room(args: argparse.Namespace, sha: str, need: int) -> str | None:
    """The refusal when ``need`` bytes and the headroom do not fit in the free space of
    ``--dest``'s file system (shutil.disk_usage: statvfs's blocks available to unprivileged
    users), else None."""
    free = _free_bytes(args.dest)
    if need + args.headroom_gib * GIB <= free:
        return None
    verb = "to copy or download" if args.check_room else "to download"
    return (f"not enough disk for {args.repo}@{sha} in {args.dest}: {need / GIB:.2f} GiB {verb} "
            f"+ {args.headroom_gib:g} GiB headroom, {free / GIB:.2f} GiB free (gpuhost_model_dir's "
            "file system): free space there or set gpuhost_model_dir to a larger one; nothing "
            "was fetched")


def main() -> int:
    # what it makes is readable by the model copy user and operators whatever root's umask
    # (a hardened host's 077, from pam_umask and the profile): files 0644, folders 0755
    os.umask(0o022)
    try:
        return _main()
    except Exception as exc:  # no traceback, and no token, whatever went wrong
        full = enospc(exc)
        if full is not None:
            print(no_space_line(full), file=sys.stderr)
            return 2
        endpoint = _AT.get("endpoint")
        print(f"model download failed: {describe(exc, _SECRET_LOADED)}"
              + (f" (the Hub at {endpoint}, {route(endpoint)})" if endpoint else ""),
              file=sys.stderr)
        return 1


def route(url: str) -> str:
    """How a request to ``url`` leaves this host, as requests (huggingface_hub's client)
    chooses: the proxy of its scheme from the environment unless ``no_proxy`` names its host
    (requests.utils.get_environ_proxies: urllib.request's getproxies and proxy_bypass, which
    read the same variables); never a user or password."""
    import urllib.parse
    import urllib.request

    parts = urllib.parse.urlsplit(url)
    proxies = urllib.request.getproxies_environment()
    proxy = proxies.get(parts.scheme)
    if not proxy or urllib.request.proxy_bypass_environment(parts.hostname or "", proxies):
        return "directly, through no proxy"
    shown = urllib.parse.urlsplit(proxy)
    try:
        port = f":{shown.port}" if shown.port else ""
    except ValueError:
        port = ""
    return f"through the proxy {shown.scheme}://{shown.hostname}{port}"


def no_space_line(exc: OSError) -> str:
    """One line for a download that ran out of disk: what was written, where it is and what is
    free there, and what the snapshot needs where the metadata said."""
    written = exc.filename or _AT.get("dest", "")
    line = (f"model download of {_AT.get('repo', '?')} into {_AT.get('dest', '?')} failed: no "
            f"space left on the device (ENOSPC) writing {written}: {where(str(written))}")
    if "total" in _AT:
        line += (f"; the snapshot needs {human(_AT['total'])} in all, {human(_AT['need'])} of "
                 "it still to download when this run began")
    return line


def arguments() -> argparse.Namespace:
    """The command line (the module docstring says what each does)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True)
    parser.add_argument("--revision", required=True, help="branch, tag or commit sha")
    parser.add_argument("--dest", required=True, type=Path)
    parser.add_argument("--endpoint", required=True, help="the Hub's URL (HF_ENDPOINT)")
    parser.add_argument("--token-file", help="root-only file holding the Hub token")
    parser.add_argument("--headroom-gib", type=float, default=1.0)
    parser.add_argument("--architecture", help="what config.json must name (architectures[0])")
    parser.add_argument("--mtp", action="store_true", help="the checkpoint must have its MTP "
                        "layer (gpuhost_speculative_algorithm set)")
    parser.add_argument("--copied-from", help="where the files already in --dest were copied "
                        "from (a peer), for the message: each is verified by its hash")
    parser.add_argument("--mirror", type=Path, help="a folder holding <repo>/ copies with their "
                        "stamps, copied from before the Hub")
    parser.add_argument("--check-room", action="store_true", help="only the disk preflight "
                        "(the bytes still missing + --headroom-gib against the free space), "
                        "before a copy from a peer")
    parser.add_argument("--commit", help="the commit of --revision to fetch (the fleet's: "
                        "operations/plans/model_revision.py); the stamp records --revision")
    return parser.parse_args()


def _main() -> int:
    args = arguments()
    _AT.update(repo=f"{args.repo}@{args.revision}", dest=str(args.dest), endpoint=args.endpoint)

    os.environ["HF_ENDPOINT"] = args.endpoint
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.pop("HF_HUB_OFFLINE", None)
    from huggingface_hub import HfApi, snapshot_download  # after HF_ENDPOINT is set
    from huggingface_hub.utils import HfHubHTTPError

    loaded, token = _token(args)
    if not loaded:
        return 1
    info = _revision_info(args, token, HfApi, HfHubHTTPError)
    if info is None:
        return 1
    sha = info.sha
    files = {s.rfilename: s.size for s in info.siblings or []}
    if not files or any(size is None for size in files.values()):
        print(f"{args.repo}@{sha}: the Hub gave no file list with sizes", file=sys.stderr)
        return 1
    if args.check_room:
        return _room_checked(args, info, files)
    copied = _copies_kept(args, info, files)
    todo = _missing_bytes(args.dest, files)
    need = sum(todo.values())
    _AT.update(repo=f"{args.repo}@{sha}", total=sum(files.values()), need=need)
    free = _free_bytes(args.dest)
    refused = no_room(args, sha, need)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    print(f"{args.repo}@{args.revision} is commit {sha}: {len(files)} files, "
          f"{sum(files.values()) / GIB:.2f} GiB, {need / GIB:.2f} GiB to download "
          f"({free / GIB:.1f} GiB free)", flush=True)
    source = _downloaded(args, sha, files, todo, copied, token, snapshot_download)
    wrong = _missing_bytes(args.dest, files)
    if wrong:
        print(f"incomplete download of {args.repo}@{sha}: "
              + ", ".join(f"{name} (want {size} bytes)" for name, size in sorted(wrong.items())),
              file=sys.stderr)
        return 1
    stamp = {"repo": args.repo, "revision": args.revision, "sha": sha, "files": files,
             "source": source}
    tmp = args.dest / (STAMP + ".tmp")
    tmp.write_text(json.dumps(stamp, indent=1, sort_keys=True) + "\n")
    tmp.replace(args.dest / STAMP)
    print(f"{args.repo}@{sha} complete in {args.dest}", flush=True)
    return _served_as_configured(args)


def _token(args: argparse.Namespace) -> tuple[bool, str | None]:
    """(whether the token could be read, the token or None where no token file is given);
    a token file that is not a secret file is said on stderr."""
    global _SECRET_LOADED
    if not args.token_file:
        return True, None
    try:
        token = read_secret(args.token_file, "token file")
    except SecretFileError as exc:
        print(f"cannot download {args.repo}: {exc}", file=sys.stderr)
        return False, None
    _SECRET_LOADED = True
    return True, token


def _revision_info(args: argparse.Namespace, token: str | None, HfApi, HfHubHTTPError):
    """The Hub's model_info of the revision with its files' metadata (``HfApi``,
    ``HfHubHTTPError``: huggingface_hub's, imported once HF_ENDPOINT is set); None where the
    Hub refuses it (said on stderr)."""
    api = HfApi(endpoint=args.endpoint, token=token)
    try:
        return api.model_info(args.repo, revision=args.commit or args.revision,
                              files_metadata=True)
    except HfHubHTTPError as exc:
        print(f"cannot read {args.repo}@{args.revision} from {args.endpoint}: "
              f"{str(exc).splitlines()[0]} ({route(args.endpoint)}; is the token in "
              f"{args.token_file} allowed to read it?)", file=sys.stderr)
        return None


def _missing_bytes(dest: Path, files: dict[str, int]) -> dict[str, int]:
    """The files whose size in ``dest`` is not the revision's: name -> the size wanted."""
    out = {}
    for name, size in files.items():
        local = dest / name
        have = local.stat().st_size if local.is_file() else 0
        if have != size:
            out[name] = size
    return out


def _room_checked(args: argparse.Namespace, info, files: dict[str, int]) -> int:
    """--check-room: 2 where the disk has no room for what is missing (said), else 0 after
    the line of sizes and the revision's files with their hashes (MANIFEST)."""
    sha = info.sha
    refused = no_room(args, sha, sum(_missing_bytes(args.dest, files).values()))
    if refused:
        print(refused, file=sys.stderr)
        return 2
    print(f"{args.repo}@{sha}: {len(files)} files, {sum(files.values()) / GIB:.2f} GiB, "
          f"{sum(_missing_bytes(args.dest, files).values()) / GIB:.2f} GiB still to fetch, "
          f"{_free_bytes(args.dest) / GIB:.1f} GiB free in {args.dest}", flush=True)
    # what a copy from a peer may bring, each file with its hash (operations/stages/model_peers.py)
    print(MANIFEST + json.dumps({"sha": sha, "files": revision_files(info.siblings)},
                                separators=(",", ":")), flush=True)
    return 0


def _copies_kept(args: argparse.Namespace, info, files: dict[str, int]) -> list[str]:
    """The mirror's copy brought in where it holds the commit, the files the revision does
    not list removed, and the copied files verified against the Hub's metadata (a file that
    does not match removed, said); the names of those kept."""
    if args.mirror is not None and copy_from_mirror(args.mirror / args.repo, args.dest,
                                                    info.sha):
        args.copied_from = f"the mirror {args.mirror}"
    copied: list[str] = []
    tidy(args.dest, files)
    if args.copied_from and args.dest.is_dir():
        hashes = {name: (want, lfs) for name, (_, want, lfs) in
                  revision_files(info.siblings).items()}
        copied, bad = verify_copy(args.dest, files, hashes)
        for name in bad:
            print(f"{name} from {args.copied_from} does not match the Hub's metadata "
                  f"(size or hash): removed, downloading it from the Hub", flush=True)
    return copied


def _downloaded(args: argparse.Namespace, sha: str, files: dict[str, int],
                todo: dict[str, int], copied: list[str], token: str | None,
                snapshot_download) -> dict:
    """Download from the Hub what ``todo`` lists (the whole snapshot, huggingface_hub's
    ``snapshot_download``, where nothing was copied), saying where the files came from; the
    stamp's ``source``."""
    need = sum(todo.values())
    args.dest.mkdir(parents=True, exist_ok=True)
    if copied:
        from huggingface_hub import hf_hub_download
        for name in sorted(todo):
            hf_hub_download(args.repo, name, revision=sha, local_dir=args.dest, token=token,
                            endpoint=args.endpoint)
    else:
        snapshot_download(args.repo, revision=sha, local_dir=args.dest, token=token,
                          endpoint=args.endpoint)
    source = {"copied_from": args.copied_from if copied else None, "copied_files": len(copied),
              "copied_bytes": sum(files[n] for n in copied), "hub_files": len(todo),
              "hub_bytes": need}
    if copied:
        print(f"source: {len(copied)} files ({source['copied_bytes'] / GIB:.3f} GiB) "
              f"from {args.copied_from}, verified; {len(todo)} files "
              f"({need / GIB:.3f} GiB) from the Hub", flush=True)
    else:
        print(f"source: the Hub ({args.endpoint}): {len(todo)} files "
              f"({need / GIB:.3f} GiB)", flush=True)
    return source


def _served_as_configured(args: argparse.Namespace) -> int:
    """3 where the model is not what host data says it serves (said): another architecture,
    or no MTP layer with a speculative algorithm set; else 0."""
    if args.architecture:
        config = args.dest / "config.json"
        wrong_arch = (mismatch(config.read_text(errors="replace"), str(config),
                               args.architecture) if config.is_file()
                      else f"the model has no {config}: sglang reads the architecture from it; "
                           f"host data says gpuhost_model_architecture = {args.architecture!r}")
        if wrong_arch is not None:
            print(f"refused: {wrong_arch}", file=sys.stderr)
            return 3
    if args.mtp:
        config, index = args.dest / "config.json", args.dest / WEIGHT_INDEX
        no_mtp = missing_mtp(config.read_text(errors="replace") if config.is_file() else "",
                             index.read_text(errors="replace") if index.is_file() else None,
                             str(args.dest))
        if no_mtp is not None:
            print(f"refused: gpuhost_speculative_algorithm is set, but {no_mtp}: set it to "
                  "null, or serve a checkpoint with its MTP layer (for GLM-5-NVFP4: "
                  "festr2/GLM-5-NVFP4-MTP)", file=sys.stderr)
            return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())
