"""The model copy from peers: who is a peer, the copy key's forced command, the verification of
a copied folder by model_fetch.py (huggingface_hub replaced by a fake with the Hub's metadata
shape), rsync's progress."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from operations.plans.settings import for_inventory
from operations.stages import model_copy, model_copy_rsync, model_peers

FILES = Path(__file__).resolve().parents[1] / "operations" / "files"

GOOD = b"\x00" * 4096
CONFIG = b'{"architectures": ["GlmMoeDsaForCausalLM"]}\n'

FAKE_HUB = '''
import json, os, types
from pathlib import Path
META = json.loads(os.environ["FAKE_META"])
class HfApi:
    def __init__(self, endpoint=None, token=None):
        pass
    def model_info(self, repo, revision=None, files_metadata=False):
        return types.SimpleNamespace(sha="b" * 40, siblings=[
            types.SimpleNamespace(rfilename=m["name"], size=m["size"], blob_id=m["blob_id"],
                                  lfs={"sha256": m["sha256"]} if m["sha256"] else None)
            for m in META])
def snapshot_download(*a, **k):
    raise AssertionError("must not download the whole snapshot")
def hf_hub_download(repo, name, revision=None, local_dir=None, token=None, endpoint=None):
    content = bytes.fromhex(os.environ["FAKE_CONTENT_" + name.replace(".", "_").replace("-", "_")])
    Path(local_dir, name).write_bytes(content)
    with open(os.environ["FAKE_LOG"], "a") as fh:
        fh.write(name + "\\n")
'''


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _fake_hub(tmp_path: Path, files: dict[str, bytes], lfs: set[str]) -> dict[str, str]:
    fake = tmp_path / "fake" / "huggingface_hub"
    (fake / "utils").mkdir(parents=True)
    (fake / "__init__.py").write_text(FAKE_HUB)
    (fake / "utils" / "__init__.py").write_text("class HfHubHTTPError(Exception):\n    pass\n")
    meta = [{"name": n, "size": len(d), "blob_id": _blob_id(d),
             "sha256": hashlib.sha256(d).hexdigest() if n in lfs else None}
            for n, d in files.items()]
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path / "fake"),
           "FAKE_META": json.dumps(meta), "FAKE_LOG": str(tmp_path / "downloads.log")}
    for name, data in files.items():
        env["FAKE_CONTENT_" + name.replace(".", "_").replace("-", "_")] = data.hex()
    return env


def _fetch(tmp_path: Path, env: dict[str, str], dest: Path, *extra: str):
    return subprocess.run(
        [sys.executable, str(FILES / "model_fetch.py"), "--repo", "org/m", "--revision", "main",
         "--dest", str(dest), "--endpoint", "http://127.0.0.1:9", "--headroom-gib", "0",
         *extra], env=env, capture_output=True, text=True, check=False)


def test_a_copied_file_that_does_not_match_its_hash_is_fetched_from_the_hub(tmp_path):
    files = {"config.json": CONFIG, "model-00001-of-00002.safetensors": GOOD,
             "model-00002-of-00002.safetensors": GOOD + b"\x01"}
    env = _fake_hub(tmp_path, files, lfs={n for n in files if n.endswith(".safetensors")})
    dest = tmp_path / "models" / "org" / "m"
    dest.mkdir(parents=True)
    (dest / "config.json").write_bytes(CONFIG)
    (dest / "model-00001-of-00002.safetensors").write_bytes(GOOD)
    # the peer's second shard: the right size, one byte flipped
    (dest / "model-00002-of-00002.safetensors").write_bytes(GOOD + b"\x02")
    result = _fetch(tmp_path, env, dest, "--copied-from", "peer gpu1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "downloads.log").read_text().split() == [
        "model-00002-of-00002.safetensors"]
    assert (dest / "model-00002-of-00002.safetensors").read_bytes() == GOOD + b"\x01"
    assert ("model-00002-of-00002.safetensors from peer gpu1 does not match the Hub's metadata"
            in result.stdout)
    assert "source: 2 files (0.000 GiB) from peer gpu1, verified; 1 files" in result.stdout
    stamp = json.loads((dest / ".gpuhost-model.json").read_text())
    assert stamp["sha"] == "b" * 40 and set(stamp["files"]) == set(files)


def test_a_complete_copy_downloads_nothing(tmp_path):
    files = {"config.json": CONFIG, "model.safetensors": GOOD}
    env = _fake_hub(tmp_path, files, lfs={"model.safetensors"})
    dest = tmp_path / "m"
    dest.mkdir()
    for name, data in files.items():
        (dest / name).write_bytes(data)
    result = _fetch(tmp_path, env, dest, "--copied-from", "peer gpu1")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "downloads.log").exists()
    assert "source: 2 files" in result.stdout and "0 files (0.000 GiB) from the Hub" in result.stdout


def test_a_small_file_is_checked_by_its_git_blob_id(tmp_path):
    files = {"config.json": CONFIG, "model.safetensors": GOOD}
    env = _fake_hub(tmp_path, files, lfs={"model.safetensors"})
    dest = tmp_path / "m"
    dest.mkdir()
    (dest / "model.safetensors").write_bytes(GOOD)
    (dest / "config.json").write_bytes(CONFIG.replace(b"G", b"g"))
    result = _fetch(tmp_path, env, dest, "--copied-from", "peer gpu1")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "downloads.log").read_text().split() == ["config.json"]
    assert (dest / "config.json").read_bytes() == CONFIG


def test_the_copy_key_may_only_run_rrsync_read_only_in_the_model_folder():
    line = model_copy.authorized_keys("/opt/gpuhost/models", "ssh-ed25519 AAAAC3Nz test")
    assert line == ('restrict,command="/usr/bin/rrsync -ro /opt/gpuhost/models" '
                    "ssh-ed25519 AAAAC3Nz test\n")


def test_peers_are_the_other_hosts_serving_the_same_model_and_revision():
    data = {
        "gpu1": {"ssh_hostname": "10.0.0.1", "ssh_known_hosts_file": "/k"},
        "gpu2": {"ssh_hostname": "10.0.0.2"},
        "gpu3": {"ssh_hostname": "10.0.0.3", "gpuhost_model_revision": "v2"},
        "gpu4": {"ssh_hostname": "10.0.0.4", "gpuhost_model": "other/model"},
        "gpu5": {"ssh_hostname": "10.0.0.5", "ssh_port": 2222,
                 "gpuhost_model_dir": "/srv/models"},
        "router": {"ssh_hostname": "10.0.0.9", "gpuhost_serving": False},  # a CPU-only VM
    }
    settings = for_inventory(data.items())
    found = model_peers.peers("gpu2", settings, data)
    assert [(p.name, p.address, p.port, p.model_dir) for p in found] == [
        ("gpu1", "10.0.0.1", 22, "/opt/gpuhost/models"), ("gpu5", "10.0.0.5", 2222, "/srv/models")]
    assert found[0].known_hosts == "/k" and found[1].strict_host_key_checking == "accept-new"


def test_rsync_progress_lines_are_read(monkeypatch, tmp_path):
    """--info=progress2's updates (rsync 3.2.7: bytes, percent, rate, time, xfr and to-chk
    counts, \\r-separated) give the progress line."""
    script = tmp_path / "fake-rsync"
    script.write_text("#!/bin/sh\nprintf '      1,024  10%%    1.00MB/s    0:00:01 (xfr#1, "
                      "to-chk=2/3)\\r     10,240 100%%    2.00MB/s    0:00:02 (xfr#3, to-chk=0/3)"
                      "\\n'\n")
    script.chmod(0o755)
    lines = []
    monkeypatch.setattr(model_copy_rsync, "PROGRESS_EVERY", 0)
    monkeypatch.setattr(model_copy.logger, "info", lines.append)
    ok, err = model_copy_rsync.rsync([str(script)], "[gpu2] ", "model copy")
    assert ok and err == ""
    assert lines and lines[-1].startswith("[gpu2] model copy: 10,240 bytes (100%) at 2.00MB/s")


def _mirror(tmp_path: Path, files: dict[str, bytes], sha: str) -> Path:
    folder = tmp_path / "nfs" / "org" / "m"
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / ".gpuhost-model.json").write_text(json.dumps(
        {"repo": "org/m", "revision": "main", "sha": sha,
         "files": {n: len(d) for n, d in files.items()}}))
    return tmp_path / "nfs"


def test_a_mirror_folder_of_the_same_commit_is_copied_and_verified(tmp_path):
    files = {"config.json": CONFIG, "model.safetensors": GOOD}
    env = _fake_hub(tmp_path, files, lfs={"model.safetensors"})
    mirror = _mirror(tmp_path, {**files, "model.safetensors": b"\x07" * len(GOOD)}, "b" * 40)
    dest = tmp_path / "models" / "org" / "m"
    result = _fetch(tmp_path, env, dest, "--mirror", str(mirror))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "downloads.log").read_text().split() == ["model.safetensors"]
    assert (dest / "model.safetensors").read_bytes() == GOOD
    assert f"source: 1 files (0.000 GiB) from the mirror {mirror}, verified" in result.stdout
    stamp = json.loads((dest / ".gpuhost-model.json").read_text())
    assert stamp["source"]["copied_from"] == f"the mirror {mirror}"


def test_a_mirror_of_another_commit_is_not_copied(tmp_path):
    files = {"config.json": CONFIG, "model.safetensors": GOOD}
    env = _fake_hub(tmp_path, files, lfs={"model.safetensors"})
    mirror = _mirror(tmp_path, files, "c" * 40)
    dest = tmp_path / "m"
    result = _fetch(tmp_path, env, dest, "--mirror", str(mirror))
    assert "is of another commit: downloading from the Hub" in result.stdout
    assert not (dest / "model.safetensors").exists()  # the fake's snapshot_download refuses


def test_the_copy_into_the_host_uses_the_deploys_own_login_as_pyinfra_builds_it():
    rsh, target, remote = model_peers.login_rsh("gpu2", {
        "ssh_hostname": "10.0.0.2", "ssh_user": "gpuops", "_sudo": True, "ssh_port": 2222,
        "ssh_key": "/keys/id", "ssh_known_hosts_file": "/keys/known",
        "ssh_strict_host_key_checking": "yes"})
    assert rsh == ("ssh -o BatchMode=yes -o UserKnownHostsFile=/keys/known "
                   "-o StrictHostKeyChecking=yes -p 2222 -i /keys/id")
    assert (target, remote) == ("gpuops@10.0.0.2", "sudo rsync")
    assert model_peers.login_rsh("gpu3", {})[1:] == ("gpu3", "rsync")


def _weights_commands(monkeypatch, **kwargs):
    """model.weights' commands for a host with no copy yet (its ModelSnapshot fact empty)."""
    import types

    from operations.stages import model
    monkeypatch.setattr(model, "host", types.SimpleNamespace(get_fact=lambda *a, **k: {}))
    return list(model.weights._inner(
        repo="org/m", revision="main", dest="/opt/gpuhost/models/org/m",
        endpoint="https://huggingface.co", python="/opt/gpuhost/venvs/ab/bin/python", **kwargs))


def test_with_a_mirror_the_peers_are_still_tried_where_the_mirror_has_no_copy(monkeypatch):
    peer = model_peers.Peer("gpu1", "10.0.0.1", 22, None, "yes", "/opt/gpuhost/models")
    copy, fetch, _ = _weights_commands(monkeypatch, peers=[peer], mirror="/mnt/models")
    assert copy.function is model_copy.copy and copy.kwargs == {"mirror": "/mnt/models"}
    fetch = str(fetch)
    assert "--mirror /mnt/models" in fetch
    assert f'--copied-from "$(cat {model_copy.COPIED_FROM} 2>/dev/null || echo' in fetch


def test_the_stamp_names_the_peer_the_files_came_from_not_every_candidate(monkeypatch,
                                                                          tmp_path):
    """"from peer gpu1 or gpu2 or gpu3 ..." named every candidate: the fetch's --copied-from is
    read on the host from what the copy recorded, the one peer it copied from."""
    import subprocess

    peers = [model_peers.Peer(n, "10.0.0.1", 22, None, "yes", "/m") for n in ("gpu1", "gpu3")]
    record = tmp_path / "copied-from"
    monkeypatch.setattr(model_copy, "COPIED_FROM", str(record))
    _, fetch, _ = _weights_commands(monkeypatch, peers=peers)
    line = str(fetch).replace("/opt/gpuhost/venvs/ab/bin/python", "printf '<%s>\\n'")

    def argument() -> str:
        out = subprocess.run(["sh", "-c", line], capture_output=True, text=True, check=True)
        words = out.stdout.splitlines()
        return words[words.index("<--copied-from>") + 1]

    record.write_text("peer gpu3")
    assert argument() == "<peer gpu3>"
    record.unlink()  # no copy this run: files there are an earlier run's, verified all the same
    assert argument() == "<an earlier run's copy>"


def test_no_peer_with_the_model_is_one_plain_line(monkeypatch):
    """A fresh fleet: no peer has the model, nor the copy key yet. That used to read as an SSH
    failure ("gpu1 has no complete copy ... Permission denied (publickey) ... code 255")."""
    import types

    said, commands = [], []
    manifest = {"sha": "c" * 40, "files": {"config.json": [2, "a" * 40, False]}}

    def shell(host, command, **kw):  # the disk preflight gives the revision's files
        commands.append(str(command))
        return True, types.SimpleNamespace(
            stdout_lines=[model_peers.MANIFEST + json.dumps(manifest)], stderr_lines=[])

    monkeypatch.setattr(model_copy.remote, "shell", shell)
    monkeypatch.setattr(model_copy, "rsync", lambda argv, prefix, what: (
        False, "gpuhost-models@10.0.0.1: Permission denied (publickey). (rsync error: "
               "unexplained error (code 255) at io.c(232) [Receiver=3.2.7])"))
    monkeypatch.setattr(model_copy.shutil, "which", lambda name: "/usr/bin/rsync")
    monkeypatch.setattr(model_copy.logger, "info", said.append)
    monkeypatch.setattr(model_copy.logger, "warning", said.append)
    peers = [model_peers.Peer(n, "10.0.0.1", 22, None, "yes", "/m") for n in ("gpu1", "gpu3")]
    assert model_copy.copy(None, _Host(), peers, "org/m", "main", "/d", None, "room check")
    assert said == ["[gpu2] model copy: no peer has the model yet: from the Hub"]
    assert commands[0] == f"rm -f {model_copy.COPIED_FROM}"  # no peer recorded from before

    # a peer that holds it and copies: that one peer is recorded
    monkeypatch.setattr(model_copy, "_peer_stamp", lambda peer, repo, prefix: {
        "repo": "org/m", "revision": "main", "sha": "c" * 40} if peer.name == "gpu3" else None)
    monkeypatch.setattr(model_copy, "relay", lambda *a: True)
    monkeypatch.setattr(model_copy, "check_peer", lambda *a: ["config.json"])
    assert model_copy.copy(None, _Host(), peers, "org/m", "main", "/d", None, "room check")
    assert commands[-1].endswith(f"printf %s 'peer gpu3' > {model_copy.COPIED_FROM}")


class _Host:
    print_prefix = "[gpu2] "
    name = "gpu2"


def test_the_copy_is_left_to_a_mirror_that_holds_the_revision(monkeypatch):
    stamps = {"/mnt/models/org/m/.gpuhost-model.json": {"repo": "org/m", "revision": "main",
                                                       "sha": "b" * 40}}
    asked, lines = [], []

    def shell(host, command, **kw):
        import types
        if str(command) == "room check":
            manifest = {"sha": "b" * 40, "files": {}}
            return True, types.SimpleNamespace(
                stdout_lines=[model_peers.MANIFEST + json.dumps(manifest)], stderr_lines=[])
        path = str(command).split()[-1]
        text = json.dumps(stamps[path]) if path in stamps else ""
        return bool(text), types.SimpleNamespace(stdout_lines=[text] if text else [],
                                                 stderr_lines=[])

    monkeypatch.setattr(model_copy.remote, "shell", shell)
    monkeypatch.setattr(model_copy, "_peer_stamp", lambda peer, repo, prefix: asked.append(peer))
    monkeypatch.setattr(model_copy.logger, "info", lines.append)
    peer = model_peers.Peer("gpu1", "10.0.0.1", 22, None, "yes", "/opt/gpuhost/models")
    assert model_copy.copy(None, _Host(), [peer], "org/m", "main", "/d", None, "room check",
                           mirror="/mnt/models")
    assert asked == [] and any("the mirror /mnt/models holds org/m@main" in line
                               for line in lines), lines
    assert model_copy.copy(None, _Host(), [peer], "org/m", "main", "/d", None, "room check",
                           mirror="/mnt/empty")
    assert asked == [peer]  # no copy there: the peers are tried


def test_a_failed_rsync_names_its_cause_not_only_its_exit(tmp_path):
    """rsync 3.2.7 ends a failed transfer with its generic 'rsync error: ... (code N)' line;
    the cause (ssh's refusal of the copy key, a missing file) is on a line before it."""
    script = tmp_path / "fake-rsync"
    script.write_text("#!/bin/sh\necho 'gpuhost-models@10.0.0.1: Permission denied (publickey).'"
                      " >&2\necho 'rsync: connection unexpectedly closed (0 bytes received so "
                      "far) [Receiver]' >&2\necho 'rsync error: unexplained error (code 255) at "
                      "io.c(232) [Receiver=3.2.7]' >&2\nexit 255\n")
    script.chmod(0o755)
    ok, err = model_copy_rsync.rsync([str(script)], "[gpu2] ", "stamp")
    assert not ok
    assert err == ("gpuhost-models@10.0.0.1: Permission denied (publickey). (rsync error: "
                   "unexplained error (code 255) at io.c(232) [Receiver=3.2.7])")


def test_a_peer_whose_model_folder_the_copy_user_cannot_reach_is_said_as_such(monkeypatch):
    """rrsync's "Restricted directory does not exist!" is not "no complete copy": the folder
    may be there and unreadable (a hardened umask); the peer's own run says which."""
    said = []
    monkeypatch.setattr(model_copy, "rsync", lambda argv, prefix, what: (
        False, "Restricted directory does not exist! (rsync error: error in rsync protocol "
               "data stream (code 12) at io.c(232) [Receiver=3.2.7])"))
    monkeypatch.setattr(model_copy.logger, "info", said.append)
    peer = model_peers.Peer("gpu3", "10.0.0.3", 22, None, "yes", "/opt/gpuhost/models")
    assert model_copy._peer_stamp(peer, "org/m", "[gpu2] ") is None
    (line,) = said
    assert "no complete copy" not in line
    assert ("gpu3's copy user cannot reach /opt/gpuhost/models (rrsync: 'Restricted directory "
            "does not exist!': the folder is missing there, or exists but is not readable by "
            "gpuhost-models") in line


def test_the_source_host_says_its_model_folder_exists_but_cannot_be_read():
    reach = model_copy.ModelFolderReach()
    assert reach.process(["blocked /opt/gpuhost 700"]) == "blocked /opt/gpuhost 700"
    assert "runuser -u gpuhost-models -- test -r" in reach.command("/opt/gpuhost/models",
                                                                   "gpuhost-models")
    line = model_copy.reach_message("/opt/gpuhost/models", "blocked /opt/gpuhost 700")
    assert line.startswith("/opt/gpuhost/models exists but the copy user gpuhost-models cannot "
                           "read it (/opt/gpuhost is mode 700")
    for fine in ("readable", "missing", "no user"):
        assert model_copy.reach_message("/opt/gpuhost/models", fine) is None


def test_the_copy_sets_modes_rather_than_keeping_a_peers():
    assert "--chmod=D755,F644" in model_copy.RSYNC_FLAGS


def test_files_the_revision_does_not_list_and_links_are_removed_before_the_copy_is_verified(
        tmp_path):
    """What a compromised peer planted (issue 29, 4): a ``modeling_*.py`` sglang would run with
    --trust-remote-code, a chat template it would load, links out of the folder, one named as
    a file of the revision. Only the revision's files stay; the linked one comes from the Hub."""
    files = {"config.json": CONFIG, "model.safetensors": GOOD}
    env = _fake_hub(tmp_path, files, lfs={"model.safetensors"})
    dest = tmp_path / "m"
    (dest / "sub").mkdir(parents=True)
    (dest / "model.safetensors").write_bytes(GOOD)
    secret = tmp_path / "shadow"
    secret.write_bytes(CONFIG)  # a link to a file that has the right content, even
    (dest / "config.json").symlink_to(secret)
    (dest / "modeling_evil.py").write_text("import os; os.system('id')\n")
    (dest / "chat_template.jinja").write_text("{{ evil }}\n")
    (dest / "sub" / "tokenizer.model").symlink_to("/etc/passwd")
    (dest / "linked-folder").symlink_to(tmp_path)
    (dest / ".cache" / "huggingface").mkdir(parents=True)
    (dest / ".cache" / "huggingface" / ".gitignore").write_text("*\n")
    result = _fetch(tmp_path, env, dest, "--copied-from", "peer gpu1")
    assert result.returncode == 0, result.stderr
    kept = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*"))
    assert kept == [".cache", ".cache/huggingface", ".cache/huggingface/.gitignore",
                    ".gpuhost-model.json", "config.json", "model.safetensors"]
    assert not (dest / "config.json").is_symlink() and (dest / "config.json").read_bytes() \
        == CONFIG
    assert (tmp_path / "downloads.log").read_text().split() == ["config.json"]
    for said in ("modeling_evil.py", "chat_template.jinja", "sub/tokenizer.model (a symbolic "
                 "link)", "linked-folder (a symbolic link)", "config.json (a symbolic link)"):
        assert f"{said} in {dest} is not a file of the revision: removed" in result.stdout
    assert secret.read_bytes() == CONFIG and Path("/etc/passwd").exists()


def test_the_peer_check_says_which_files_hash_as_the_hub_says(tmp_path):
    """PEER_CHECK, run on the peer: good, wrong (same size, one byte), links, extras, missing."""
    root = tmp_path / "org" / "m"
    (root / ".cache").mkdir(parents=True)
    (root / "model-1.safetensors").write_bytes(GOOD)
    (root / "model-2.safetensors").write_bytes(GOOD[:-1] + b"\x01")
    (root / "tokenizer.json").symlink_to(tmp_path / "elsewhere")
    (root / "modeling_evil.py").write_text("x\n")
    (root / ".gpuhost-model.json").write_text("{}")
    (root / ".cache" / "x").write_text("hub client's\n")
    manifest = {"files": {
        "config.json": [len(CONFIG), _blob_id(CONFIG), False],
        "model-1.safetensors": [len(GOOD), hashlib.sha256(GOOD).hexdigest(), True],
        "model-2.safetensors": [len(GOOD), hashlib.sha256(GOOD).hexdigest(), True],
        "tokenizer.json": [2, _blob_id(b"{}"), False]}}
    (root / "config.json").write_bytes(CONFIG)
    done = subprocess.run([sys.executable, "-c", model_peers.PEER_CHECK, str(root)],
                          input=json.dumps(manifest), capture_output=True, text=True, check=True)
    assert json.loads(done.stdout) == {
        "good": ["config.json", "model-1.safetensors"], "wrong": ["model-2.safetensors"],
        "links": ["tokenizer.json"], "extra": ["modeling_evil.py"], "missing": []}


def test_a_model_folder_holding_what_the_revision_does_not_list_is_not_complete(tmp_path):
    """ModelSnapshot: a file planted beside the revision's, or a link (even one named as a file
    of the revision), makes the copy incomplete, so the next converge cleans it up; the Hub
    client's .cache folder and the stamp do not count."""
    from operations.facts.model_facts import _SNAPSHOT_SCRIPT

    def snapshot() -> dict:
        return json.loads(subprocess.run([sys.executable, "-c", _SNAPSHOT_SCRIPT, str(dest)],
                                         capture_output=True, text=True, check=True).stdout)

    dest = tmp_path / "m"
    (dest / ".cache" / "huggingface").mkdir(parents=True)
    (dest / ".cache" / "huggingface" / "x.metadata").write_text("hub client's\n")
    (dest / "sub").mkdir()
    (dest / "config.json").write_bytes(CONFIG)
    (dest / "sub" / "model.safetensors").write_bytes(GOOD)
    (dest / ".gpuhost-model.json").write_text(json.dumps({
        "repo": "org/m", "revision": "main", "sha": "b" * 40,
        "files": {"config.json": len(CONFIG), "sub/model.safetensors": len(GOOD)}}))
    assert snapshot()["complete"] is True and snapshot()["extra"] == []
    (dest / "modeling_evil.py").write_text("x\n")
    (dest / "sub" / "link").symlink_to("/etc")
    found = snapshot()
    assert found["complete"] is False and found["extra"] == ["modeling_evil.py", "sub/link"]
    (dest / "modeling_evil.py").unlink()
    (dest / "sub" / "link").unlink()
    (dest / "config.json").unlink()
    (dest / "config.json").symlink_to(tmp_path / "elsewhere.json")
    (tmp_path / "elsewhere.json").write_bytes(CONFIG)
    found = snapshot()
    assert found["complete"] is False and found["wrong"] == ["config.json"]


def test_one_copy_at_a_time_stages_in_a_folder(tmp_path, monkeypatch):
    """A second copy into the same staging folder (another host of the run, another run) waits
    until the first lets go; the lock goes with its holder."""
    import threading
    import time as time_

    monkeypatch.setattr(model_copy, "STAGING", tmp_path / "models")
    monkeypatch.setattr(model_copy, "STAGING_LOCKS", tmp_path / "locks")
    staging = tmp_path / "models" / "org--model@abc"
    order: list[str] = []
    first_in = threading.Event()

    def first():
        with model_copy.staging_lock(staging, "[gpu1] "):
            order.append("first in")
            first_in.set()
            time_.sleep(1.5)
            order.append("first out")

    def second():
        first_in.wait()
        with model_copy.staging_lock(staging, "[gpu2] "):
            order.append("second in")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert order == ["first in", "first out", "second in"]
    assert oct((tmp_path / "locks" / "org--model@abc.lock").stat().st_mode & 0o777) == "0o600"
    assert not (tmp_path / "models").exists()  # the staging folder holds staged files only
