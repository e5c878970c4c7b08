"""Host trees as overlays: a tarball (the bare root filesystem, an image of a converged host) is
extracted once into a shared lower tree, and each host's root is an overlayfs mount of that
tree with an upper folder of its own, as a VM's disk is a copy-on-write layer over its image.

    <host dir>/root     the overlay mount: the host's / (HostSpec.root)
    <host dir>/upper    what the host wrote (and the .debs seeded before it booted)
    <host dir>/work     overlayfs's work folder

Why: extracting a tree per host and deleting it again was the lab's own largest cost in the
suite (sandbox/trash.py: a converged tree is about 0.9 GB in 22,000 files, its delete 13 s idle
and 34 s at load 5 on this 2-core machine, the root file system mounted ``discard``; the bare
tarball's extraction took 4.1 s of system time, measured with /usr/bin/time). Now a host costs
one mount, and its delete what it wrote.

The lower tree lies beside its tarball (``<tar>.tree-<size>-<mtime ns>``, so a rebuilt tarball
gets a new one and a tree in use is never changed), made under a lock by one lab while the
others wait (labs boot side by side), extracted into a partial folder then renamed. Trees of
an older tarball are removed once no mount names them. The images' trees go with the run's
images folder (tests/lanes.py removes it).

Mount options, from the kernel's Documentation/filesystems/overlayfs.rst: ``redirect_dir=on``
lets a host rename a directory of the lower tree (without it rename(2) fails with EXDEV, which
Python's os.replace does not work around: a rollback renaming a venv of the image would fail).
All layers lie on one file system here, so st_dev and st_ino stay stable ("Inode properties").
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
from pathlib import Path

from sandbox import rootfs


class OverlayError(RuntimeError):
    """A lower tree could not be made, or a host's overlay mounted; the message says which."""


def upper(host_dir: Path) -> Path:
    return host_dir / "upper"


def _lower_name(tar: Path) -> str:
    st = tar.stat()
    return f"{tar.name}.tree-{st.st_size}-{st.st_mtime_ns}"


def _mounted_lowers() -> set[str]:
    """Every lowerdir named by an overlay mount of this machine (/proc/self/mountinfo's super
    options: the fields after " - " are type, source, options)."""
    named: set[str] = set()
    with open("/proc/self/mountinfo") as f:
        for line in f:
            _, _, tail = line.partition(" - ")
            fields = tail.split()
            if len(fields) >= 3 and fields[0] == "overlay":
                for option in fields[2].split(","):
                    if option.startswith("lowerdir="):
                        named.update(option[len("lowerdir="):].split(":"))
    return named


def lower(tar: Path) -> Path:
    """The shared lower tree of `tar`, extracted now if no lab did yet."""
    tree = tar.with_name(_lower_name(tar))
    if tree.is_dir():
        return tree
    with open(tar.with_name(tar.name + ".tree.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not tree.is_dir():
            partial = tree.with_name(tree.name + f".partial-{os.getpid()}")
            shutil.rmtree(partial, ignore_errors=True)
            rootfs.extract(partial, tar)
            os.replace(partial, tree)
        in_use = _mounted_lowers()
        for old in tar.parent.glob(tar.name + ".tree-*"):
            if old != tree and old.is_dir() and str(old) not in in_use:
                shutil.rmtree(old, ignore_errors=True)
    return tree


def _mkdirs_like(path: Path, upper_dir: Path, lower_dir: Path) -> None:
    """Folders from `upper_dir` down to `path` (inside it), each with the owner and mode of the
    lower tree's folder of that name (an upper folder's attributes are the merged folder's)."""
    for folder in reversed([path, *path.parents]):
        if folder == upper_dir or upper_dir not in folder.parents or folder.is_dir():
            continue
        like = (lower_dir / folder.relative_to(upper_dir)).stat()
        folder.mkdir(mode=0o700)
        os.chown(folder, like.st_uid, like.st_gid)
        os.chmod(folder, like.st_mode & 0o7777)


def mount(host_dir: Path, tar: Path, seed: Path, archives: str) -> Path:
    """The host's root at `host_dir`/root: an overlay of `tar`'s lower tree, its upper folder
    seeded first with hard links of the .debs in `seed` into `archives` (the guest's apt
    archives folder: a hard link cannot cross into the mount, a different file system, so it
    goes into the upper folder, which lies on the same one as `seed`). Returns the root."""
    base = lower(tar)
    root, top, work = host_dir / "root", upper(host_dir), host_dir / "work"
    for folder in (root, top, work):
        folder.mkdir(parents=True, mode=0o755)
    root.chmod(0o755)
    top.chmod(0o755)
    target = top / archives.lstrip("/")
    if (base / archives.lstrip("/")).is_dir():
        _mkdirs_like(target, top, base)
        rootfs.link_debs(seed, target)
    options = f"lowerdir={base},upperdir={top},workdir={work},redirect_dir=on"
    proc = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(root)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise OverlayError(f"mounting the overlay of {base} at {root} failed: "
                           f"{proc.stderr.strip()}")
    return root


def unmount_below(folder: Path) -> None:
    """Unmount everything mounted at or below `folder`, the deepest first (a host's overlay,
    anything a test mounted on it from here); lazily where a mount is still busy."""
    for point in sorted(rootfs.mounts_below(folder), key=len, reverse=True):
        if subprocess.run(["umount", point], capture_output=True, check=False).returncode != 0:
            with contextlib.suppress(subprocess.SubprocessError):
                subprocess.run(["umount", "-l", point], capture_output=True, check=False)
