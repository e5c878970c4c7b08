"""Rebuilding a host with its weights from a peer: two hosts, the first converged from the hub
stand-in (no peer holds the model yet), the second from the first directly over the lab switch
(hub bytes for the weights: 0; its locked wheels from the controller's cache, none from the
index), then, with the first off the switch, a copy through the
controller interrupted half way and resumed by the next run, which catches a file corrupted on
the peer and fetches it from the hub. The hub stand-in's byte count (sandbox/hub.py) says what came from
outside the lab; the files' hashes are read over plain ssh."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.request

import pytest

from sandbox import hub
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL_DIR = f"/opt/gpuhost/models/{hub.REPO_ID}"
SHARDS = [f.path for f in hub.repository() if f.lfs]
SIZES = {f.path: len(f.data) for f in hub.repository()}
TOTAL = sum(SIZES.values())
STAGING = os.path.expanduser("~/.cache/gpuhost/models")


def hub_bytes() -> dict:
    """The hub stand-in's bytes served, per client address and file."""
    gateway = json.loads(lab.sandbox("status", "--json").stdout)[0]["gateway"]
    with urllib.request.urlopen(f"http://{gateway}:{hub.PORT}/_sandbox/bytes-served") as r:
        return json.loads(r.read())


def weight_bytes(before: dict, after: dict, host: lab.Host) -> dict[str, int]:
    """Bytes of each shard the hub served ``host`` between two counts."""
    old = before.get(host.address, {}).get("files", {})
    new = after.get(host.address, {}).get("files", {})
    return {s: new.get(s, 0) - old.get(s, 0) for s in SHARDS}


def hashes(host: lab.Host) -> dict[str, str]:
    out = host.ssh(f"cd {MODEL_DIR} && sha256sum " + " ".join(sorted(SIZES)))
    return {line.split()[1]: line.split()[0] for line in out.splitlines()}


def deploy_gpu2(*extra: str) -> lab.Run:
    return lab.deploy("--limit", "gpu2", *extra)


@pytest.fixture(scope="module")
def hosts():
    gpu1, gpu2 = lab.up(hosts=2, scenario="reference-lab")
    before = hub_bytes()
    first = lab.deploy("--limit", "gpu1")
    assert first.returncode == 0, first.output[-6000:]
    yield gpu1, gpu2, first, before
    lab.sandbox("down", check=False)


def test_a_host_with_no_peer_holding_the_model_downloads_it_from_the_hub(hosts):
    gpu1, _, first, before = hosts
    assert "[gpu1] model copy: no peer has the model yet: from the Hub" in first.output
    assert "Permission denied" not in first.output
    assert f"[gpu1] weights source: {len(SIZES)} files ({TOTAL} bytes) from the Hub" \
        in first.output
    assert weight_bytes(before, hub_bytes(), gpu1) == {s: SIZES[s] for s in SHARDS}


def index_wheel_bytes(host: lab.Host) -> dict[str, int]:
    """The distributions (not pages) the lab's HTTP server sent ``host`` from the package index
    stand-in, by path (sandbox/httpd.py's count)."""
    gateway = json.loads(lab.sandbox("status", "--json").stdout)[0]["gateway"]
    with urllib.request.urlopen(f"http://{gateway}:8080/_sandbox/bytes-served") as r:
        files = json.loads(r.read()).get(host.address, {}).get("files", {})
    return {p: n for p, n in files.items()
            if p.startswith("/simple/") and not p.endswith(("/", ".html")) and n}


def switch_address(host: lab.Host) -> str:
    listed = json.loads(lab.sandbox("status", "--json").stdout)
    return next(h["switch_address"] for h in listed if h["name"] == host.name)


def test_a_second_host_pulls_its_weights_from_the_first_over_the_switch(hosts):
    """Directly: gpu2 pulls from gpu1's switch address with the copy key, placed on gpu2 for
    the copy alone; nothing is staged on the controller. Its locked wheels come from the
    controller's cache, none from the index. 128 KiB/s: the 1.5 MiB take about
    12 s, long enough for a progress line."""
    gpu1, gpu2, _, _ = hosts
    before = hub_bytes()
    run = deploy_gpu2("--data", "gpuhost_model_copy_bwlimit=128")
    assert run.returncode == 0, run.output[-6000:]
    assert "model copy: gpuhost-sandbox/tiny-glm-5@" in run.output
    assert (f"from peer gpu1 directly over the fleet network ({switch_address(gpu1)})"
            in run.output), run.output[-6000:]
    assert "through the controller" not in run.output
    assert re.search(r"\[gpu2\] model copy from gpu1: [\d,]+ bytes \(\d+%\) at \S+/s, \d+ s",
                     run.output), run.output[-6000:]
    assert not os.path.exists(STAGING) or not any(os.scandir(STAGING))
    # the locked wheels came from the controller's cache (filled by gpu1, or an earlier run),
    # each checked by pip against the lock's hashes
    assert index_wheel_bytes(gpu2) == {}, index_wheel_bytes(gpu2)
    assert re.search(r"\[gpu2\] locked wheels: \d+ files \(\d+ bytes\) from the controller's "
                     r"cache, 0 of the lock's distributions from the index", run.output), \
        run.output[-6000:]
    assert gpu2.ssh("test -e /opt/gpuhost/wheels/locked && echo present || echo absent"
                    ).strip() == "absent"
    # the key was on gpu2 for the copy only
    assert gpu2.ssh("test -e /run/gpuhost-model-copy && echo present || echo absent"
                    ).strip() == "absent"
    assert (f"[gpu2] weights source: {len(SIZES)} files ({TOTAL} bytes) from peer gpu1, "
            "verified against the Hub's metadata; 0 files (0 bytes) from the Hub") in run.output
    assert weight_bytes(before, hub_bytes(), gpu2) == {s: 0 for s in SHARDS}
    assert hashes(gpu2) == hashes(gpu1) == {f.path: f.sha256 for f in hub.repository()}
    assert gpu2.ssh("systemctl is-active sglang.service").strip() == "active"
    # the copy key reads the model folder, and nothing else: no shell, no writes
    key = os.path.expanduser("~/.cache/gpuhost/keys/model-copy")
    refused = subprocess.run(
        ["ssh", "-i", key, "-o", "IdentitiesOnly=yes", "-o", "BatchMode=yes",
         "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
         f"gpuhost-models@{gpu1.address}", "id"], capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "uid=" not in refused.stdout


def test_with_roots_umask_077_what_gpuhost_makes_has_its_own_modes(hosts):
    """The sandbox's hosts are hardened (sandbox/rootfs.py: pam_umask, UMASK 077): the copy
    above went through, and what gpuhost made is readable as its modes say, not 0700/0600."""
    gpu1, gpu2, _, _ = hosts
    for host in (gpu1, gpu2):
        assert host.ssh("umask").strip() == "0077"
        venv = host.ssh("readlink -f /opt/gpuhost/venv").strip()
        modes = dict(line.split(" ", 1)[::-1] for line in host.ssh(
            "stat -c '%a %n' /opt/gpuhost /opt/gpuhost/models /opt/gpuhost/models/gpuhost-sandbox "
            f"{MODEL_DIR} {MODEL_DIR}/config.json /var/lib/gpuhost /opt/gpuhost/venvs {venv} "
            f"{venv}/pyvenv.cfg /var/lib/gpuhost/last-known-good.json").splitlines())
        # the last known good record is root's alone on purpose: it holds server.env's sha256
        # (issue 29, 5); everything else is readable as its mode says
        assert modes.pop("/var/lib/gpuhost/last-known-good.json") == "600", modes
        assert set(modes.values()) == {"755", "644"}, modes
        assert modes[f"{MODEL_DIR}/config.json"] == "644" and modes[venv] == "755", modes
        assert host.ssh(f"runuser -u gpuhost-models -- test -r {MODEL_DIR}/config.json && "
                        "echo readable").strip() == "readable"
        # the venv's installed files too (pip under no_space.py's umask 022)
        assert host.ssh(f"find {venv}/lib -type f ! -perm -004 | head -n 3").strip() == ""


def restore(gpu1: lab.Host, gpu2: lab.Host, shard: str) -> None:
    """gpu1's shard as gpu2 holds it (verified), over plain ssh through this machine."""
    opts = ["-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR"]
    data = subprocess.run(["ssh", "-i", gpu2.ssh_key, *opts, f"root@{gpu2.address}",
                           f"cat {MODEL_DIR}/{shard}"], capture_output=True, timeout=60,
                          check=True).stdout
    subprocess.run(["ssh", "-i", gpu1.ssh_key, *opts, f"root@{gpu1.address}",
                    f"cat > {MODEL_DIR}/{shard}"], input=data, timeout=60, check=True)


def test_a_copy_stopped_half_way_resumes_and_a_corrupted_peer_file_comes_from_the_hub(
        hosts, tmp_path):
    """One scenario on the same hosts: gpu1 is off the switch (gpu2 does not reach it, the
    controller does), so gpu2's copy from gpu1 goes through the controller; it is stopped half
    way (Ctrl-C) and resumed by the next run, which also catches a file corrupted on gpu1 (one
    byte changed, the size kept: only the hash tells) and fetches it alone from the hub."""
    gpu1, gpu2, _, _ = hosts
    lab.sandbox("link", "gpu1", "down", "--switch")
    try:
        _interrupted_and_resumed(gpu1, gpu2, tmp_path)
    finally:
        lab.sandbox("link", "gpu1", "up", "--switch")


def _interrupted_and_resumed(gpu1: lab.Host, gpu2: lab.Host, tmp_path) -> None:
    shard = SHARDS[-1]
    good = hashes(gpu1)[shard]
    gpu1.ssh(f"printf 'X' | dd of={MODEL_DIR}/{shard} bs=1 seek=4096 conv=notrunc status=none")
    gpu2.ssh(f"rm -rf {MODEL_DIR}")
    log = tmp_path / "interrupted.log"
    # 64 KiB/s: the 1.5 MiB of shards take about 24 s, long enough to stop the copy in them
    proc = subprocess.Popen(
        [str(lab.PYINFRA), "-y", "--limit", "gpu2", "--data", "gpuhost_model_copy_bwlimit=64",
         "inventory/sandbox.py", "deploy.py"], cwd=lab.ROOT, stdout=log.open("w"),
        stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            staged = sum(os.path.getsize(os.path.join(d, f))
                         for d, _, names in os.walk(STAGING) for f in names)
            if staged >= 256 * 1024:
                break
            assert proc.poll() is None, log.read_text()[-6000:]
            time.sleep(0.2)
        else:
            pytest.fail("the copy did not start:\n" + log.read_text()[-6000:])
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C: rsync keeps the partial file
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        lab.GUARD.observe("interrupted deploy", log.read_text())
    try:
        # stopped in the copy, before the verification (pyinfra's exit status after a Ctrl-C
        # says nothing here: it was 0)
        assert "model copy: gpuhost-sandbox/tiny-glm-5@" in log.read_text()
        assert "weights source:" not in log.read_text()
        before = hub_bytes()
        run = deploy_gpu2()
        assert run.returncode == 0, run.output[-6000:]
        assert (f"from peer gpu1 through the controller ({switch_address(gpu1)} port 22 does "
                "not answer from gpu2), resuming: ") in run.output, run.output[-6000:]
        assert "bytes already staged there" in run.output
        assert (f"[gpu2] weights source: {len(SIZES) - 1} files ({TOTAL - SIZES[shard]} "
                "bytes) from peer gpu1, verified against the Hub's metadata; 1 files "
                f"({SIZES[shard]} bytes) from the Hub") in run.output
        assert weight_bytes(before, hub_bytes(), gpu2) == {
            s: SIZES[s] if s == shard else 0 for s in SHARDS}
        assert hashes(gpu2) == {f.path: f.sha256 for f in hub.repository()}
        assert not os.path.exists(STAGING) or not any(os.scandir(STAGING))
    finally:
        restore(gpu1, gpu2, shard)
    assert hashes(gpu1)[shard] == good


def converged(gpu2: lab.Host) -> None:
    """gpu2 converged (as the tests above leave it), so that a deploy of it only copies the
    weights: no driver install and reboot in the middle of a test run alone (``-k``)."""
    if gpu2.ssh("systemctl is-active sglang.service", check=False).strip() != "active":
        run = deploy_gpu2()
        assert run.returncode == 0, run.output[-6000:]


def test_a_copy_dies_with_the_run_that_started_it(hosts, tmp_path):
    """``kill -9`` of the controller in the middle of a direct copy: rsync on gpu2 stops within
    seconds (its SSH session's stdin closes), and the copy key goes with it."""
    gpu1, gpu2, _, _ = hosts
    converged(gpu2)
    gpu2.ssh(f"rm -rf {MODEL_DIR}")
    log = tmp_path / "killed.log"
    # 16 KiB/s: the 1.5 MiB take minutes, the copy is caught running
    proc = subprocess.Popen(
        [str(lab.PYINFRA), "-y", "--limit", "gpu2", "--data", "gpuhost_model_copy_bwlimit=16",
         "inventory/sandbox.py", "deploy.py"], cwd=lab.ROOT, stdout=log.open("w"),
        stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 600
        while not gpu2.ssh("pgrep -x rsync || true", check=False).strip():
            assert proc.poll() is None, log.read_text()[-6000:]
            assert time.monotonic() < deadline, "no copy started:\n" + log.read_text()[-6000:]
            time.sleep(1)
        os.kill(proc.pid, signal.SIGKILL)  # the controller alone, as the OOM killer would
        proc.wait(timeout=30)
        stopped = time.monotonic() + 30
        while running := gpu2.ssh("pgrep -ax rsync || true", check=False).strip():
            assert time.monotonic() < stopped, f"rsync outlived its run on gpu2: {running}"
            time.sleep(1)
        assert gpu2.ssh("test -e /run/gpuhost-model-copy && echo present || echo absent"
                        ).strip() == "absent"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        lab.GUARD.observe("killed deploy", log.read_text())


def test_a_peer_copy_brings_exactly_the_revisions_files_each_verified(hosts):
    """Planted on the source (issue 29, 4): code sglang runs with --trust-remote-code, a chat
    template, a link out of the folder, and a shard of the right size with one byte changed.
    gpu1's copy is checked by hash before it serves; gpu2 gets the revision's files alone, the
    corrupted shard from the hub; its served folder holds nothing else."""
    gpu1, gpu2, _, _ = hosts
    converged(gpu2)
    shard = SHARDS[0]
    good = hashes(gpu1)[shard]
    gpu1.ssh(f"cd {MODEL_DIR} && printf 'import os\\n' > modeling_evil.py "
             "&& printf '{{ messages }}\\n' > chat_template.jinja "
             "&& ln -s /etc/shadow tokenizer.model "
             f"&& printf 'X' | dd of={shard} bs=1 seek=4096 conv=notrunc status=none")
    gpu2.ssh(f"rm -rf {MODEL_DIR}")
    try:
        before = hub_bytes()
        run = deploy_gpu2()
        assert run.returncode == 0, run.output[-6000:]
        listing = gpu2.ssh(f"cd {MODEL_DIR} && find . -path ./.cache -prune -o \\( -type f "
                           "-o -type l \\) -print | sort").split()
        assert listing == sorted([f"./{p}" for p in SIZES] + ["./.gpuhost-model.json"])
        assert gpu2.ssh(f"find {MODEL_DIR} -type l").strip() == ""
        assert (f"[gpu2] model copy: gpu1's own copy of {hub.REPO_ID} holds 1 file(s) whose "
                f"hash is not the Hub's ({shard}); 1 symbolic link(s) (tokenizer.model); 2 "
                "file(s) the revision does not list (chat_template.jinja, modeling_evil.py): "
                "not copied") in run.output, run.output[-6000:]
        assert (f"[gpu2] weights source: {len(SIZES) - 1} files ({TOTAL - SIZES[shard]} "
                "bytes) from peer gpu1, verified against the Hub's metadata; 1 files "
                f"({SIZES[shard]} bytes) from the Hub") in run.output, run.output[-6000:]
        assert weight_bytes(before, hub_bytes(), gpu2) == {
            s: SIZES[s] if s == shard else 0 for s in SHARDS}
        assert hashes(gpu2) == {f.path: f.sha256 for f in hub.repository()}
        assert gpu2.ssh("systemctl is-active sglang.service").strip() == "active"
    finally:
        gpu1.ssh(f"cd {MODEL_DIR} && rm -f modeling_evil.py chat_template.jinja tokenizer.model")
        restore(gpu1, gpu2, shard)
    assert hashes(gpu1)[shard] == good
