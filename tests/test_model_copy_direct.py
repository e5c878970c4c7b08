"""The direct copy between hosts and its fallback through the controller, and the disk
preflight before any copy: the copy's controller side with its commands replaced by fakes (no
host), the host's script run here against a closed port, the known-hosts lines ssh-keygen finds."""

from __future__ import annotations

import dataclasses
import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from operations.stages import model_copy, model_copy_direct, model_copy_rsync, model_peers

PEER = model_peers.Peer("gpu1", "10.213.1.2", 22, "/keys/known", "yes", "/opt/gpuhost/models",
                       "10.213.0.1")
STAMP = {"repo": "org/m", "revision": "main", "sha": "b" * 40}


class _Output:
    def __init__(self, stderr: list[str], stdout: list[str] | None = None):
        self.stderr_lines = stderr
        self.stdout_lines = stdout or []


#: The revision's files as the disk preflight prints them (model_fetch.py --check-room).
MANIFEST = {"sha": "b" * 40, "files": {"config.json": [52, "c" * 40, False],
                                       "model.safetensors": [4096, "d" * 64, True]}}


class _Host:
    name = "gpu2"
    print_prefix = "[gpu2] "

    def __init__(self):
        self.data = types.SimpleNamespace(dict=lambda: {"ssh_hostname": "10.213.2.2",
                                                        "ssh_user": "gpuops", "_sudo": True})
        self.errors: list[str] = []

    def log_styled(self, text, **kwargs):
        self.errors.append(text)


@pytest.fixture
def copying(monkeypatch, tmp_path):
    """The copy's outside world: the room check's answer, the peer's stamp, every rsync run
    (the direct one answering ``direct_code``), the lines printed."""
    world = types.SimpleNamespace(room=(True, []), runs=[], direct_code=0, lines=[],
                                  checked=[], good=list(MANIFEST["files"]))
    monkeypatch.setattr(model_copy.shutil, "which", lambda name: "/usr/bin/rsync")
    monkeypatch.setattr(model_copy.remote, "shell", lambda host, command, **kw: (
        world.room[0], _Output(world.room[1], ["org/m@...: 2 files",
                                               model_peers.MANIFEST + json.dumps(MANIFEST)])))
    monkeypatch.setattr(model_copy, "_peer_stamp", lambda peer, repo, prefix: STAMP)

    def check_peer(peer, repo, files, prefix):
        world.checked.append((peer.name, repo, files))
        return world.good

    monkeypatch.setattr(model_copy, "check_peer", check_peer)
    monkeypatch.setattr(model_copy, "copy_public_key", lambda: "ssh-ed25519 AAAA test")
    monkeypatch.setattr(model_copy_direct, "known_hosts_for", lambda *a: "10.213.0.1 ssh-ed25519 K")
    monkeypatch.setattr(model_copy, "STAGING", tmp_path / "staging")
    monkeypatch.setattr(model_copy, "STAGING_LOCKS", tmp_path / "locks")
    key = tmp_path / "key"
    key.write_bytes(b"PRIVATE KEY\n-----END OPENSSH PRIVATE KEY-----\n")
    monkeypatch.setattr(model_copy, "KEY_PATH", key)

    def run_rsync(argv, prefix, what, send=None):
        world.runs.append((argv, send))
        if send is not None:
            return world.direct_code, ("10.213.0.1 port 22 does not answer from gpu2"
                                       if world.direct_code == 75 else "")
        return 0, ""

    monkeypatch.setattr(model_copy, "run_rsync", run_rsync)
    monkeypatch.setattr(model_copy_rsync, "run_rsync", run_rsync)  # the relay's rsync legs
    monkeypatch.setattr(model_copy.logger, "info", world.lines.append)
    monkeypatch.setattr(model_copy.logger, "warning", world.lines.append)
    return world


def _copy(peer=PEER):
    host = _Host()
    done = model_copy.copy(None, host, [peer], "org/m", "main", "/opt/gpuhost/models/org/m",
                           None, "python model_fetch.py --check-room")
    return done, host


def test_a_host_that_reaches_the_peer_pulls_from_it_directly(copying):
    done, _ = _copy()
    assert done
    [(argv, stdin)] = copying.runs
    # the key travels on stdin, never on a command line
    assert stdin == b"PRIVATE KEY\n-----END OPENSSH PRIVATE KEY-----\n"
    assert copying.checked == [("gpu1", "org/m", MANIFEST["files"])]
    assert "config.json\nmodel.safetensors" in argv[-1]  # the verified files alone
    assert argv[-2] == "gpuops@10.213.2.2" and argv[-1].startswith("sudo -n sh -c ")
    assert "gpuhost-models@$at:$src/" in argv[-1] and "10.213.0.1" in argv[-1]
    assert "[gpu2] model copy: org/m@bbbbbbbbbbbb from peer gpu1 directly over the fleet network " \
           "(10.213.0.1)" in copying.lines


def test_a_peer_the_host_cannot_reach_is_copied_through_the_controller(copying):
    copying.direct_code = model_copy_direct.UNREACHABLE
    done, _ = _copy()
    assert done
    direct, leg1, leg2 = copying.runs
    assert direct[1] is not None and leg1[1] is None and leg2[1] is None
    assert leg1[0][-1].startswith(str(model_copy.STAGING))
    assert leg2[0][-1] == "gpuops@10.213.2.2:/opt/gpuhost/models/org/m/"
    assert ("[gpu2] model copy: org/m@bbbbbbbbbbbb from peer gpu1 through the controller "
            "(10.213.0.1 port 22 does not answer from gpu2)") in copying.lines


def test_a_peer_without_a_fleet_address_is_copied_through_the_controller(copying):
    done, _ = _copy(dataclasses.replace(PEER, fleet_address=None))
    assert done and len(copying.runs) == 2 and all(s is None for _, s in copying.runs)
    assert ("[gpu2] model copy: org/m@bbbbbbbbbbbb from peer gpu1 through the controller "
            "(gpuhost_fleet_address is not set for gpu1)") in copying.lines


def test_a_disk_too_small_fails_the_host_before_any_byte_moves(copying):
    refusal = ("not enough disk for org/m@" + "b" * 40 + " in /opt/gpuhost/models/org/m: "
               "400.00 GiB to copy or download + 1 GiB headroom, 20.00 GiB free")
    copying.room = (False, [refusal])
    done, host = _copy()
    assert done is False and copying.runs == []
    assert host.errors == [f"model copy: {refusal}"]


def test_the_hosts_script_gives_up_at_once_on_a_peer_that_does_not_answer(tmp_path):
    """A closed port: exit UNREACHABLE (the fallback's signal), nothing written, the key unread."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        line = model_copy_direct.command("", "127.0.0.1", port, "org/m", str(tmp_path / "m"),
                                         "yes", "", ["-a"], ["config.json"])
        done = subprocess.run(["sh", "-c", line], input=b"PRIVATE KEY", capture_output=True,
                              timeout=30, check=False)
    assert done.returncode == model_copy_direct.UNREACHABLE
    assert f"127.0.0.1 port {port} does not answer from" in done.stderr.decode()
    assert not (tmp_path / "m").exists()


def test_the_peers_host_key_is_pinned_for_its_fleet_address(tmp_path):
    known = tmp_path / "known_hosts"
    key = "AAAAC3NzaC1lZDI1NTE5AAAAIB" + "x" * 42
    known.write_text(f"10.213.1.2 ssh-ed25519 {key}\n10.213.3.2 ssh-ed25519 other\n"
                     f"[10.213.1.2]:2222 ssh-rsa rsakey\n")
    assert model_copy_direct.known_hosts_for("10.213.1.2", 22, "10.213.0.1", str(known)) == \
        f"10.213.0.1 ssh-ed25519 {key}"
    assert model_copy_direct.known_hosts_for("10.213.1.2", 2222, "10.213.0.1", str(known)) == \
        "[10.213.0.1]:2222 ssh-rsa rsakey"
    assert model_copy_direct.known_hosts_for("10.213.9.2", 22, "10.213.0.1", str(known)) == ""
    # a hashed file (ssh-keygen -H) is found the same way
    subprocess.run(["ssh-keygen", "-H", "-f", str(known)], capture_output=True, check=True)
    assert "10.213.1.2" not in known.read_text()
    assert model_copy_direct.known_hosts_for("10.213.1.2", 22, "10.213.0.1", str(known)) == \
        f"10.213.0.1 ssh-ed25519 {key}"


FILES = Path(__file__).resolve().parents[1] / "operations" / "files"
FAKE_HUB = '''
import os, types
class HfApi:
    def __init__(self, endpoint=None, token=None):
        pass
    def model_info(self, repo, revision=None, files_metadata=False):
        return types.SimpleNamespace(sha="a" * 40, siblings=[types.SimpleNamespace(
            rfilename="model.safetensors", size=int(os.environ["FAKE_SIZE"]),
            blob_id="b" * 40, lfs={"sha256": "c" * 64, "size": int(os.environ["FAKE_SIZE"]),
                                   "pointer_size": 134})])
def snapshot_download(*a, **k):
    raise AssertionError("must not download")
'''


@pytest.mark.parametrize("size, code", [(1024**5, 2), (4096, 0)])
def test_the_room_check_only_checks(tmp_path, size, code):
    fake = tmp_path / "fake" / "huggingface_hub"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_HUB)
    (fake / "utils" / "__init__.py").write_text("class HfHubHTTPError(Exception):\n    pass\n")
    dest = tmp_path / "models" / "org" / "big"
    result = subprocess.run(
        [sys.executable, str(FILES / "model_fetch.py"), "--repo", "org/big", "--revision",
         "main", "--dest", str(dest), "--endpoint", "http://127.0.0.1:9", "--check-room"],
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake"),
             "FAKE_SIZE": str(size)}, capture_output=True, text=True, check=False)
    assert result.returncode == code, result.stderr
    assert not dest.exists()  # nothing written, no stamp
    if code:
        assert ("not enough disk for org/big@" + "a" * 40 + f" in {dest}: 1048576.00 GiB to "
                "copy or download + 1 GiB headroom") in result.stderr
        assert "gpuhost_model_dir" in result.stderr
    else:
        assert "0.00 GiB still to fetch" in result.stdout
        # the copy's list: each file with its size and the hash the Hub gives it
        manifest = result.stdout.splitlines()[-1]
        assert manifest.startswith(model_peers.MANIFEST)
        assert json.loads(manifest[len(model_peers.MANIFEST):]) == {
            "sha": "a" * 40, "files": {"model.safetensors": [4096, "c" * 64, True]}}


def test_the_hosts_copy_stops_when_the_run_that_started_it_is_gone(tmp_path):
    """WATCH: rsync (here a sleep writing its pid) runs while the session's stdin is open; when
    it closes (the controller killed with -9 closes it too), it is stopped: exit 143."""
    pidfile = tmp_path / "pid"
    proc = subprocess.Popen([sys.executable, "-c", model_copy_direct.WATCH, "sh", "-c",
                             f"echo $$ > {pidfile}; exec sleep 60"],
                            stdin=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not pidfile.exists() or not pidfile.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pidfile.read_text())
    time.sleep(1.5)
    assert proc.poll() is None  # stdin open: copying
    proc.stdin.close()
    assert proc.wait(timeout=10) == 143
    assert b"the run that started this copy is gone" in proc.stderr.read()
    with pytest.raises(ProcessLookupError):
        for _ in range(50):
            os.kill(child, 0)
            time.sleep(0.1)


def test_the_copy_ends_with_rsync_while_the_run_lives():
    done = subprocess.run([sys.executable, "-c", model_copy_direct.WATCH, "sh", "-c", "exit 23"],
                          input=b"", capture_output=True, timeout=30)
    assert done.returncode == 23


def test_a_peer_whose_copy_is_not_the_hubs_is_said_and_only_its_verified_files_copied(
        monkeypatch):
    lines = []
    monkeypatch.setattr(model_copy.logger, "info", lines.append)
    monkeypatch.setattr(model_copy.logger, "warning", lines.append)
    sent = []

    def run(argv, input, **kw):
        sent.append((argv, json.loads(input)))
        return types.SimpleNamespace(returncode=0, stderr="", stdout=json.dumps({
            "good": ["config.json"], "wrong": ["model.safetensors"], "links": ["x.json"],
            "extra": ["modeling_evil.py"], "missing": []}))

    monkeypatch.setattr(model_copy.subprocess, "run", run)
    peer = dataclasses.replace(PEER, login=("ssh -o BatchMode=yes", "gpuops@10.213.1.2", True))
    assert model_peers.check_peer(peer, "org/m", MANIFEST["files"], "[gpu2] ") == ["config.json"]
    [(argv, stdin)] = sent
    assert argv[:3] == ["ssh", "-o", "BatchMode=yes"] and "gpuops@10.213.1.2" in argv
    assert argv[-1].startswith("sudo -n python3 -c ") and argv[-1].endswith(
        " /opt/gpuhost/models/org/m")
    assert stdin == {"files": MANIFEST["files"]}
    assert ("[gpu2] model copy: gpu1's own copy of org/m holds 1 file(s) whose hash is not the "
            "Hub's (model.safetensors); 1 symbolic link(s) (x.json); 1 file(s) the revision "
            "does not list (modeling_evil.py): not copied; only its 1 file(s) verified there "
            "are (the rest from the Hub)") in lines[0]


def test_a_peer_whose_copy_cannot_be_checked_is_no_source(monkeypatch):
    lines = []
    monkeypatch.setattr(model_copy.logger, "info", lines.append)
    monkeypatch.setattr(model_copy.subprocess, "run", lambda argv, input, **kw:
                        types.SimpleNamespace(returncode=1, stdout="",
                                              stderr="sudo: a password is required\n"))
    peer = dataclasses.replace(PEER, login=("ssh", "gpuops@10.213.1.2", True))
    assert model_peers.check_peer(peer, "org/m", MANIFEST["files"], "[gpu2] ") == []
    assert lines == ["[gpu2] model copy: gpu1's copy of org/m could not be checked by its "
                     "hashes (sudo: a password is required): not copied from there"]
