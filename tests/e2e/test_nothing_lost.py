"""Nothing lost, nothing half-done (issue #30), end to end on one converged sandbox host: a
serving venv whose pip broke is never cleared (its replacement is built beside it and swapped
in once checked), a rollback checks that its venv imports the stack, the last known good record
survives a full disk and a hand edit and is rewritten by the next good run, and the venvs of
failed lock changes are pruned by the next run. Checked over ssh (the venv's python, the
server's command line and main PID, the record), never through pyinfra."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from operations.stages.venvs import REPLACEMENT_SUFFIX, VENVS_DIR, stack_venv
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECORD = "/var/lib/gpuhost/last-known-good.json"
SITE = "lib/python3*/site-packages"


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


@pytest.fixture(scope="module")
def sandbox_lock() -> Path:
    (listed,) = json.loads(lab.sandbox("status", "--json").stdout)
    return Path(listed["lock"])


def deploy_with(tmp_path: Path, *extra: str, **overrides) -> lab.Run:
    entries = [(h["name"], {**lab.inventory_data(h), **overrides})
               for h in json.loads(lab.sandbox("status", "--json").stdout)]
    path = tmp_path / f"inventory{time.monotonic_ns()}.py"
    path.write_text("import json\nsandbox = [tuple(e) for e in json.loads("
                    f"{json.dumps(json.dumps(entries))})]\n")
    return lab.deploy(*extra, inventory=str(path))


def served_venv(host: lab.Host) -> str:
    return host.process_args(host.main_pid())[0].removesuffix("/bin/python")


def serves(host: lab.Host) -> bool:
    host.http_get("http://127.0.0.1:8000/health")
    return host.ssh("systemctl is-active sglang.service", check=False).strip() == "active"


def imports_stack(host: lab.Host, venv: str) -> bool:
    return host.ssh(f"{venv}/bin/python -c 'import torch, sglang, flashinfer' && echo ok",
                    check=False).strip() == "ok"


def record(host: lab.Host) -> dict:
    return json.loads(host.ssh(f"cat {RECORD}"))


def sha256(host: lab.Host, path: str) -> str:
    return host.ssh(f"sha256sum {path}").split()[0]


def test_a_serving_venv_whose_pip_broke_is_never_cleared(host, sandbox_lock, tmp_path):
    """pip's __init__.py emptied in the serving venv, the index unreachable and no wheel
    cache: the venv the server runs from keeps its stack (a restart still serves), the run
    fails in one line; with the index back, a replacement is built beside it and served."""
    venv = served_venv(host)
    assert venv == stack_venv(sandbox_lock)
    host.ssh(f"truncate -s 0 {venv}/{SITE}/pip/__init__.py")
    run = deploy_with(tmp_path, gpuhost_pip_index_url="http://127.0.0.1:9/simple/",
                      gpuhost_wheel_cache=str(tmp_path / "no-wheels"))
    assert run.returncode != 0, run.output[-6000:]
    assert "\nTraceback" not in run.output, run.output[-6000:]
    assert "recreated" not in run.output, run.output[-6000:]
    assert (f"venv at {venv} does not run (pip exited 1") in run.output, run.output[-6000:]
    assert f"a replacement is built beside it, at {venv}{REPLACEMENT_SUFFIX}" in run.output
    assert imports_stack(host, venv)
    host.ssh("systemctl restart sglang.service")
    for _ in range(60):
        if host.ssh("systemctl is-active sglang.service", check=False).strip() == "active":
            break
        time.sleep(2)
    assert serves(host) and served_venv(host) == venv
    # the index back: the replacement is built, checked, and the server moved to it
    again = lab.deploy()
    assert again.returncode == 0, again.output[-6000:]
    assert served_venv(host) == venv + REPLACEMENT_SUFFIX and serves(host)
    assert record(host)["server"]["venv"] == venv + REPLACEMENT_SUFFIX
    assert "pip " in host.ssh(f"{venv}{REPLACEMENT_SUFFIX}/bin/python -m pip --version")
    assert host.ssh(f"ls {VENVS_DIR}").split() == [f"{venv.rsplit('/', 1)[1]}"
                                                    f"{REPLACEMENT_SUFFIX}"]
    quiet = lab.deploy("--json")
    assert quiet.returncode == 0 and quiet.results is not None, quiet.output[-3000:]
    assert [op["name"] for op in quiet.results["results"]["operations"]
            if op["success"] or op["error"]] == [], quiet.output[-3000:]


def test_a_rollback_to_a_venv_that_does_not_import_the_stack_is_refused(host):
    venv = record(host)["server"]["venv"]
    host.ssh(f"mv {venv}/{SITE}/sglang /root/sglang.aside")
    try:
        run = lab.deploy("--data", "gpuhost_rollback=true")
        assert run.returncode != 0, run.output[-6000:]
        assert (f"the last known good's venv {venv} does not import the serving stack "
                "(sglang: ModuleNotFoundError") in run.output, run.output[-6000:]
        assert "the host serves its last known good" not in run.output
        assert "\nTraceback" not in run.output
    finally:
        host.ssh(f"mv /root/sglang.aside $(echo {venv}/{SITE})/sglang")


def test_a_record_of_the_wrong_shape_is_set_aside_and_written_anew(host):
    host.ssh(f"python3 - <<'EOF'\nimport json\nd = json.load(open('{RECORD}'))\n"
             f"d['server']['venvs'] = 5\njson.dump(d, open('{RECORD}', 'w'))\nEOF")
    run = lab.deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert "\nTraceback" not in run.output and "TypeError" not in run.output, run.output[-6000:]
    assert "set aside as" in run.output and "recorded anew" in run.output, run.output[-6000:]
    fixed = record(host)["server"]
    assert fixed["venvs"] == [fixed["venv"]] and fixed["venv"] == served_venv(host)
    assert host.ssh(f"ls {RECORD}.bad-*").strip()


def test_a_full_disk_while_recording_is_one_line_and_the_next_run_records(host, tmp_path):
    """/var/lib/gpuhost on a tmpfs with one page free: the health gate passes, the record's
    write fails (ENOSPC): one line, the host serves; the next run records what serves."""
    lib = "/var/lib/gpuhost"
    host.ssh(f"cp -a {lib} /root/lib-gpuhost && mount -t tmpfs -o size=1m tmpfs {lib} && "
             f"cp -a /root/lib-gpuhost/. {lib}/ && "
             f"(dd if=/dev/zero of={lib}/.fill bs=4k 2>/dev/null || true) && "
             f"rm -f {lib}/.fill && dd if=/dev/zero of={lib}/.fill bs=4k "
             f"count=$(( $(df -Pk {lib} | tail -1 | awk '{{print $4}}') / 4 - 1 )) 2>/dev/null")
    try:
        run = deploy_with(tmp_path, gpuhost_server_env={
            "OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1", "GPUHOST_T30": "1"})
        assert "\nTraceback" not in run.output and "Errno 28" not in run.output, \
            run.output[-6000:]
        assert "could not write the last known good" in run.output, run.output[-6000:]
        assert "No space left on device" in run.output
        assert serves(host)
        assert "GPUHOST_T30=1" in host.ssh("cat /etc/gpuhost/server.env")
    finally:
        host.ssh(f"umount {lib}; rm -rf /root/lib-gpuhost", check=False)
    # the record on disk is the one from before (the tmpfs is gone): the next run rewrites it
    stale = record(host)["server"]
    assert stale["files"]["/etc/gpuhost/server.env"]["sha256"] != sha256(
        host, "/etc/gpuhost/server.env")
    again = deploy_with(tmp_path, gpuhost_server_env={
        "OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1", "GPUHOST_T30": "1"})
    assert again.returncode == 0, again.output[-6000:]
    fresh = record(host)["server"]
    assert fresh["files"]["/etc/gpuhost/server.env"]["sha256"] == sha256(
        host, "/etc/gpuhost/server.env")


def relocked(lock: Path, out: Path, n: int) -> Path:
    text = re.sub(r"(--hash=sha256:[0-9a-f]{64})", r"\1 --hash=sha256:" + f"{n:064x}",
                  lock.read_text(), count=1)
    out.write_text(text)
    return out


def test_venvs_of_failed_lock_changes_are_pruned_by_the_next_run(host, sandbox_lock, tmp_path):
    serving = served_venv(host)
    env = {"gpuhost_server_env": {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1",
                                  "GPUHOST_T30": "1", "SANDBOX_SGLANG_MODE": "crash-on-start"}}
    failed = []
    for n in (1, 2):
        lock = relocked(sandbox_lock, tmp_path / f"relocked{n}.txt", n)
        run = deploy_with(tmp_path, gpuhost_lock=str(lock), **env)
        assert run.returncode != 0 and "rolled back to the last known good" in run.output, \
            run.output[-6000:]
        failed.append(stack_venv(lock))
    assert set(host.ssh(f"ls -d {VENVS_DIR}/*").split()) == {serving, *failed}
    # host data as it served: no restart, and the failed changes' venvs go
    run = deploy_with(tmp_path, gpuhost_server_env={
        "OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1", "GPUHOST_T30": "1"})
    assert run.returncode == 0, run.output[-6000:]
    assert host.ssh(f"ls -d {VENVS_DIR}/*").split() == [serving]
    assert served_venv(host) == serving and serves(host)


def pip_list(host: lab.Host, venv: str) -> dict[str, str]:
    listed = json.loads(host.ssh(f"{venv}/bin/python -m pip list --format=json "
                                 "--disable-pip-version-check 2>/dev/null"))
    return {d["name"].lower().replace("_", "-"): d["version"] for d in listed}


def test_a_serving_venv_changed_by_hand_is_replaced_never_installed_into(host, tmp_path):
    """A locked distribution at another version and one the lock lacks, installed by hand in
    the venv the server runs from: the run builds the lock's other folder beside it, checks
    it and moves the server to it; the changed venv is never repaired in place (kept as it
    was by gpuhost_venvs_kept = 2, for the look afterwards)."""
    venv = served_venv(host)
    other = venv.removesuffix(REPLACEMENT_SUFFIX) if venv.endswith(REPLACEMENT_SUFFIX) \
        else venv + REPLACEMENT_SUFFIX
    locked = pip_list(host, venv)
    for name, version in (("flashinfer-cubin", "0.6.2"), ("gpuhost-e2e-extra", "1.0")):
        host.ssh(f"rm -rf /tmp/{name} && mkdir -p /tmp/{name} && printf '%s' "
                 f"\"from setuptools import setup; setup(name='{name}', version='{version}')\" "
                 f"> /tmp/{name}/setup.py && {venv}/bin/python -m pip install -q --no-deps "
                 f"--no-index --no-build-isolation /tmp/{name}")
    changed = pip_list(host, venv)
    assert changed["flashinfer-cubin"] == "0.6.2" and "gpuhost-e2e-extra" in changed
    pid = host.main_pid()
    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"venv at {venv} differs from its lock" in dry.output, dry.output[-6000:]
    assert "flashinfer-cubin 0.6.2 -> 0.6.3 (lock)" in dry.output
    assert f"a replacement will be built beside it, at {other}" in dry.output
    assert host.main_pid() == pid and host.ssh(f"test -e {other} || echo none").strip() == \
        "none"
    run = deploy_with(tmp_path, gpuhost_venvs_kept=2)
    assert run.returncode == 0, run.output[-6000:]
    assert f"a replacement is built beside it, at {other}" in run.output, run.output[-6000:]
    assert "\nTraceback" not in run.output
    assert served_venv(host) == other and serves(host)
    assert pip_list(host, other) == locked and imports_stack(host, other)
    assert record(host)["server"]["venv"] == other
    assert host.ssh("readlink /opt/gpuhost/venv").strip() == other
    assert pip_list(host, venv) == changed  # never installed into
    quiet = deploy_with(tmp_path, "--json", gpuhost_venvs_kept=2)
    assert quiet.returncode == 0 and quiet.results is not None, quiet.output[-3000:]
    assert [op["name"] for op in quiet.results["results"]["operations"]
            if op["success"] or op["error"]] == [], quiet.output[-3000:]
