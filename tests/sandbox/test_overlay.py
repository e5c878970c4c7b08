"""sandbox/overlay.py: host roots as overlays of one lower tree per tarball (needs root, as the
lab does, for mount(8))."""

from __future__ import annotations

import os
import subprocess
import tarfile
import sys
from pathlib import Path

import pytest

from sandbox import overlay, rootfs

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mount(8) needs root")

ARCHIVES = "/var/cache/apt/archives"


def _tarball(tmp_path: Path, name: str = "root.tar") -> Path:
    src = tmp_path / "src"
    (src / "var/cache/apt/archives/partial").mkdir(parents=True)
    (src / "var/cache/apt/archives/partial").chmod(0o700)
    (src / "var/cache").chmod(0o751)
    (src / "etc").mkdir()
    (src / "etc/hostname").write_text("image\n")
    (src / "opt/venv").mkdir(parents=True)
    tar = tmp_path / name
    with tarfile.open(tar, "w") as t:
        t.add(src, arcname=".")
    return tar


def test_hosts_share_one_lower_tree_and_write_only_their_own_upper(tmp_path: Path) -> None:
    tar = _tarball(tmp_path)
    pool = tmp_path / "pool"
    pool.mkdir()
    (pool / "a_1.0_amd64.deb").write_bytes(b"deb")
    roots = []
    try:
        for name in ("gpu1", "gpu2"):
            roots.append(overlay.mount(tmp_path / name, tar, pool, ARCHIVES))
        (roots[0] / "etc/hostname").write_text("gpu1\n")
        os.replace(roots[0] / "opt/venv", roots[0] / "opt/venv-old")  # a lower folder renamed
        assert (roots[1] / "etc/hostname").read_text() == "image\n"
        assert (roots[1] / "opt/venv").is_dir()
        assert [p.name for p in tmp_path.glob("root.tar.tree-*")] == [overlay._lower_name(tar)]
        seeded = roots[0] / ARCHIVES.lstrip("/") / "a_1.0_amd64.deb"
        assert seeded.read_bytes() == b"deb"
        upper_deb = overlay.upper(tmp_path / "gpu1") / ARCHIVES.lstrip("/") / "a_1.0_amd64.deb"
        assert os.path.samefile(upper_deb, pool / "a_1.0_amd64.deb")  # a hard link, no copy
        # the upper folders made for the seed keep the lower tree's owners and modes
        assert (roots[0] / "var/cache").stat().st_mode & 0o7777 == 0o751
        assert (roots[0] / ARCHIVES.lstrip("/") / "partial").stat().st_mode & 0o7777 == 0o700
        (roots[0] / ARCHIVES.lstrip("/") / "b_2.0_amd64.deb").write_bytes(b"new")
        assert rootfs.harvest_apt_archives(overlay.upper(tmp_path / "gpu1"), pool) == 1
    finally:
        for name in ("gpu1", "gpu2"):
            overlay.unmount_below(tmp_path / name)
    assert rootfs.mounts_below(tmp_path) == []
    assert (pool / "b_2.0_amd64.deb").read_bytes() == b"new"


def test_a_rebuilt_tarball_gets_a_new_tree_and_the_old_one_goes_once_unused(
        tmp_path: Path) -> None:
    tar = _tarball(tmp_path)
    pool = tmp_path / "pool"
    first = overlay.lower(tar)
    root = overlay.mount(tmp_path / "gpu1", tar, pool, ARCHIVES)
    try:
        os.utime(tar, ns=(1, 1))  # the tarball rebuilt
        second = overlay.lower(tar)
        assert second != first and first.is_dir()  # still the lower tree of a mounted host
    finally:
        overlay.unmount_below(tmp_path / "gpu1")
    os.utime(tar, ns=(2, 2))
    third = overlay.lower(tar)
    assert not first.exists() and not second.exists() and third.is_dir()
    assert not root.is_mount()


def test_labs_asking_at_once_extract_it_once(tmp_path: Path) -> None:
    """Processes, as labs are (in the suite's process pyinfra_cli's gevent patches threads into
    greenlets, which flock(2) would block all at once). A second extraction would fail its
    rename onto the first's tree: every process answers the one tree, none left partial."""
    tar = _tarball(tmp_path)
    program = ("import sys; from pathlib import Path; from sandbox import overlay; "
               "print(overlay.lower(Path(sys.argv[1])))")
    root = Path(__file__).resolve().parents[2]
    procs = [subprocess.Popen([sys.executable, "-c", program, str(tar)], cwd=root,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    answers = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert [p.returncode for p in procs] == [0] * 4
    assert len(set(answers)) == 1
    assert [p.name for p in tmp_path.iterdir() if ".partial-" in p.name] == []


def test_a_failed_mount_names_the_tree_and_the_root(tmp_path: Path, monkeypatch) -> None:
    tar = _tarball(tmp_path)
    real = subprocess.run
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: real(
        [*cmd[:-1], str(tmp_path / "missing")] if cmd[0] == "mount" else cmd, **kw))
    with pytest.raises(overlay.OverlayError, match=r"mounting the overlay of .*tree-.* at "):
        overlay.mount(tmp_path / "gpu1", tar, tmp_path / "pool", ARCHIVES)
