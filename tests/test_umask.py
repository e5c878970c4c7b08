"""What gpuhost makes has its own mode whatever root's umask (issue #30 item 7: a hardened
host's 077): the commands no_space.py wraps (the venv's creation, pip), the shipped record
scripts, and the folders above gpuhost's own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from operations.stages.folders import TOP_FOLDERS, folders_down_to

ROOT = Path(__file__).resolve().parents[1]


def test_a_wrapped_command_makes_0755_folders_and_0644_files_under_umask_077(tmp_path):
    made = tmp_path / "made"
    out = subprocess.run(
        ["sh", "-c", f"umask 077; {sys.executable} {ROOT}/operations/files/no_space.py "
                     f"--what test --path {tmp_path} -- sh -c 'mkdir {made} && : > {made}/f'"],
        capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert made.stat().st_mode & 0o777 == 0o755
    assert (made / "f").stat().st_mode & 0o777 == 0o644


def test_the_last_known_good_folder_is_0755_under_umask_077(tmp_path):
    script = ROOT / "operations/files/last_known_good.py"
    code = (f"import importlib.util, sys\n"
            f"spec = importlib.util.spec_from_file_location('lkg', {str(script)!r})\n"
            "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
            f"m.ROOT = {str(tmp_path / 'lib')!r}; m.RECORD = m.ROOT + '/r.json'\n"
            f"m.COPIES = m.ROOT + '/c'\n"
            f"sys.argv = ['x', 'prune', '--venvs-dir', {str(tmp_path / 'v')!r}]\n"
            "m.main(); m._save({'format': 1})\n")
    out = subprocess.run(["sh", "-c", f"umask 077; {sys.executable} -c \"$0\"", code],
                         capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "lib").stat().st_mode & 0o777 == 0o755
    # the record is root's alone: it holds server.env's sha256 (issue 29, 5)
    assert (tmp_path / "lib/r.json").stat().st_mode & 0o777 == 0o600


def test_the_top_folders_and_the_models_owner_folder():
    assert TOP_FOLDERS == ("/opt/gpuhost", "/var/lib/gpuhost")
    assert folders_down_to("/opt/gpuhost/models", "/opt/gpuhost/models/org/m") == [
        "/opt/gpuhost/models", "/opt/gpuhost/models/org"]
    assert folders_down_to("/srv/m/", "/srv/m/org/m") == ["/srv/m/", "/srv/m/org"]


def test_the_sandbox_hosts_have_a_hardened_umask():
    from sandbox import rootfs
    assert rootfs.UMASK == "077" and "pam_umask.so" in rootfs.UMASK_PAM_LINE
