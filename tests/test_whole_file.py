"""Files written whole (operations/stages/whole_file.py, operations/files/write_whole.py): the
upload goes to /dev/shm, the file is put in place by a rename in its own folder, and a full disk is
one line with the old file left as it was (issue 40 finding 4)."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from io import StringIO

from pyinfra.api import FileUploadCommand, StringCommand

from operations.stages import whole_file
from operations.files import write_whole


def test_an_upload_to_the_file_becomes_a_staged_upload_and_a_rename():
    other = StringCommand("chmod", "600", "/etc/gpuhost/tls/host.pem")
    src = StringIO("-----BEGIN CERTIFICATE-----\n")
    out = list(whole_file.whole(iter([FileUploadCommand(src, "/etc/gpuhost/tls/host.pem"),
                                      other]), "/etc/gpuhost/tls/host.pem", "600"))
    stage = whole_file.staged("/etc/gpuhost/tls/host.pem")
    assert stage.startswith("/dev/shm/gpuhost-whole-")
    assert len(out) == 4 and out[3] is other
    assert str(out[0]) == f"sh -c 'umask 077 && rm -f {stage} && : > {stage}'"
    assert isinstance(out[1], FileUploadCommand) and out[1].src is src
    assert out[1].dest == stage and out[1].remote_temp_filename == f"{stage}.up"
    assert str(out[2]).startswith("python3 -c ") and str(out[2]).endswith(
        f" {stage} /etc/gpuhost/tls/host.pem 600")
    # an upload to another file is left as it is
    again = FileUploadCommand(src, "/etc/other")
    assert list(whole_file.whole(iter([again]), "/etc/gpuhost/tls/host.pem", "600")) == [again]


def run(*args: str) -> subprocess.CompletedProcess:
    """write_whole.py as the host runs it: ``python3 -c`` with its text."""
    return subprocess.run([sys.executable, "-c", whole_file.SCRIPT, *args], text=True,
                          capture_output=True, check=False)


def test_the_file_is_replaced_whole_with_its_mode_and_the_stage_is_gone(tmp_path):
    dest, stage = tmp_path / "host.pem", tmp_path / "stage"
    dest.write_text("old\n")
    stage.write_text("new\n")
    done = run(str(stage), str(dest), "600")
    assert done.returncode == 0 and done.stderr == ""
    assert dest.read_text() == "new\n" and oct(dest.stat().st_mode)[-3:] == "600"
    assert sorted(os.listdir(tmp_path)) == ["host.pem"]


def test_a_full_disk_is_one_line_and_the_old_file_stays(tmp_path, monkeypatch, capsys):
    dest, stage = tmp_path / "host.pem", tmp_path / "stage"
    dest.write_text("old certificate\n")
    stage.write_text("new certificate\n")

    def full(src, dst, *args):
        dst.write(b"new")  # a part written, then the disk is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(write_whole.shutil, "copyfileobj", full)
    assert write_whole.main([str(stage), str(dest), "600"]) == 28
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        f"{dest}: no space left on the device (ENOSPC) writing it (")
    assert "the old one is left as it was, serving; free space there and run again" in err
    assert dest.read_text() == "old certificate\n"
    assert sorted(os.listdir(tmp_path)) == ["host.pem"]  # no part left, the stage removed


def test_a_real_full_file_system_leaves_the_old_file(tmp_path):
    """On a file system that is really full (a tiny tmpfs, where this machine allows mounting
    one): the same line, the old file whole."""
    mount = tmp_path / "small"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                      capture_output=True, check=False).returncode != 0:
        import pytest
        pytest.skip("no tmpfs mount here")
    try:
        dest = mount / "host.pem"
        dest.write_text("old\n")
        stage = tmp_path / "stage"
        stage.write_bytes(b"x" * 256 * 1024)
        done = run(str(stage), str(dest), "600")
        assert done.returncode == 28, done.stderr
        assert "no space left on the device (ENOSPC)" in done.stderr
        assert dest.read_text() == "old\n" and sorted(os.listdir(mount)) == ["host.pem"]
        assert not stage.exists()
    finally:
        subprocess.run(["umount", str(mount)], check=False)
