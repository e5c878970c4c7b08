"""operations/files/metrics_credentials.py, run as the hosts run it (``python3 -c``, through
operations/stages/metrics_auth.py's command line) on files in a temporary folder: what it writes,
that a check tells a current file from a stale one, and that no key or password reaches its
output."""

from __future__ import annotations

import grp
import json
import os
import stat
import subprocess
import sys

import bcrypt
import pytest

from operations.stages import metrics_auth
from operations.files import metrics_credentials as mc

KEY = "sk-" + "f" * 48
GROUP = grp.getgrgid(os.getgid()).gr_name


def run(check: bool, mode: str, key_file, dest, user: str = "prometheus"):
    command = metrics_auth._command(check, mode, str(key_file), str(dest), GROUP, user)
    # the command line as the host gets it, with this interpreter for python3 (bcrypt)
    done = subprocess.run(["sh", "-c", command.replace("python3", sys.executable, 1)],
                          capture_output=True, text=True, check=False)
    assert KEY not in done.stdout + done.stderr and mc.password(KEY) not in done.stdout
    return done


def state(mode, key_file, dest):
    done = run(True, mode, key_file, dest)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "fleet.key"
    path.write_text(KEY + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.skipif(os.geteuid() != 0, reason="writes files owned by root")
@pytest.mark.parametrize(("mode", "expected"), [("copy", KEY + "\n"),
                                                ("password", mc.password(KEY) + "\n")])
def test_a_copy_and_the_password_are_root_and_the_groups_alone(tmp_path, key_file, mode,
                                                                expected):
    dest = tmp_path / "out"
    assert state(mode, key_file, dest) == {"current": False, "why": "it does not exist"}
    assert run(False, mode, key_file, dest).returncode == 0
    assert dest.read_text() == expected
    st = dest.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o640)
    assert state(mode, key_file, dest) == {"current": True, "why": None}
    key_file.write_text("sk-another\n")
    assert state(mode, key_file, dest)["current"] is False
    dest.chmod(0o644)
    key_file.write_text(KEY + "\n")
    assert state(mode, key_file, dest) == {"current": False, "why": f"it is not root:{GROUP} 640"}


@pytest.mark.skipif(os.geteuid() != 0, reason="writes files owned by root")
def test_the_web_config_holds_a_bcrypt_hash_of_the_password(tmp_path, key_file):
    dest = tmp_path / "web.yml"
    assert run(False, "web-config", key_file, dest).returncode == 0
    text = dest.read_text()
    assert text.startswith("# Managed by gpuhost")
    assert "basic_auth_users:\n  prometheus: '$2" in text
    hashed = text.rsplit("'", 2)[1]
    assert bcrypt.checkpw(mc.password(KEY).encode(), hashed.encode())
    assert not bcrypt.checkpw(KEY.encode(), hashed.encode())
    # a new salt each time: current is a hash that checks, not equal bytes
    assert state("web-config", key_file, dest) == {"current": True, "why": None}
    key_file.write_text("sk-rotated\n")
    assert state("web-config", key_file, dest) == {
        "current": False, "why": "its hash is another password's"}


def test_a_missing_key_is_named_never_shown(tmp_path):
    assert state("copy", tmp_path / "absent.key", tmp_path / "out") == {
        "current": False,
        "why": f"the key file {tmp_path / 'absent.key'} cannot be read: No such file or directory"}
    done = run(False, "copy", tmp_path / "absent.key", tmp_path / "out")
    assert done.returncode == 1 and "cannot be read" in done.stderr
    assert not (tmp_path / "out").exists()


def test_the_password_is_64_hex_characters_derived_from_the_key():
    assert len(mc.password(KEY)) == 64 and mc.password(KEY) != mc.password(KEY + "x")
    assert int(mc.password(KEY), 16) >= 0
