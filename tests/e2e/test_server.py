"""The server stage end to end on one sandbox host: the model from the hub stand-in, the health
gate on each stand-in mode, restarts only on change, the API key gate, refusals while planning,
and no secret anywhere a user or a log can see it.

The stand-in's mode reaches the server through gpuhost_server_env (SANDBOX_SGLANG_MODE), as any
server environment does. Checks go through ssh, systemctl, journalctl and HTTP, not pyinfra.
"""

from __future__ import annotations

import json
import re
import secrets
import shlex
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sandbox import hub
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UNIT = "sglang.service"
KEY_FILE = "/root/sglang-api.key"


def write_inventory(path: Path, **overrides) -> str:
    """An inventory of the lab's hosts as inventory/sandbox.py makes it, with ``overrides``
    (host data) merged into each host's data."""
    hosts = json.loads(lab.sandbox("status", "--json").stdout)
    entries = [
        (h["name"], {**lab.inventory_data(h), **overrides})
        for h in hosts
    ]
    literal = json.dumps(json.dumps(entries))
    path.write_text(f"import json\nsandbox = [tuple(e) for e in json.loads({literal})]\n")
    return str(path)


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


@pytest.fixture
def deploy(tmp_path):
    def run(*extra: str, **overrides) -> lab.Run:
        inventory = write_inventory(tmp_path / f"inv{time.monotonic_ns()}.py", **overrides)
        return lab.deploy(*extra, inventory=inventory)
    return run


def env(mode: str, **more: str) -> dict:
    return {"gpuhost_server_env": {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1",
                                   "SANDBOX_SGLANG_MODE": mode, **more}}


def state(host: lab.Host) -> str:
    return host.ssh(f"systemctl is-active {UNIT}", check=False).strip()


def starts(host: lab.Host, since: float) -> int:
    """How many times the server process started since ``since`` (epoch seconds)."""
    journal = host.ssh(f"journalctl -u {UNIT} --since @{since:.0f} --no-pager -o cat",
                       check=False)
    return journal.count("server_args=ServerArgs(")


def changed(run: lab.Run) -> list[str]:
    assert run.results is not None, run.output[-3000:]
    return [op["name"] for op in run.results["results"]["operations"]
            if op["success"] or op["error"]]


def test_first_deploy_serves_the_downloaded_model(host):
    model = "/opt/gpuhost/models/gpuhost-sandbox/tiny-glm-5"
    stamp = json.loads(host.ssh(f"cat {model}/.gpuhost-model.json"))
    assert stamp["repo"] == "gpuhost-sandbox/tiny-glm-5" and len(stamp["sha"]) == 40
    for name, size in stamp["files"].items():
        assert int(host.ssh(f"stat -c %s {model}/{name}")) == size
    pid = host.main_pid()
    args = host.process_args(pid)
    assert args[args.index("--model") + 1] == model
    assert host.process_env(pid)["HF_HUB_OFFLINE"] == "1"
    # the launch profile's flags and environment (operations/plans/launch_profiles.py)
    for flag, value in (("--kv-cache-dtype", "bf16"), ("--moe-runner-backend", "cutlass"),
                        ("--mem-fraction-static", "0.85"), ("--chunked-prefill-size", "16384")):
        assert args[args.index(flag) + 1] == value, flag
    assert host.process_env(pid)["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"
    assert "--speculative-algorithm" not in args
    assert host.ssh("stat -c %a /etc/gpuhost/server.env").strip() == "600"
    show = host.ssh(f"systemctl show -p Restart -p LimitMEMLOCK -p StartLimitBurst {UNIT}")
    assert "Restart=on-failure" in show and "LimitMEMLOCK=infinity" in show
    assert "StartLimitBurst=3" in show


def test_slow_start_passes_with_progress(host, deploy):
    run = deploy(**env("slow-start", SANDBOX_SGLANG_STARTUP_SECONDS="25"))
    assert run.returncode == 0, run.output[-6000:]
    # shown without -v: the progress lines come through pyinfra's logger
    assert "waiting 1" in run.output and "waiting 2" in run.output, run.output[-3000:]
    assert "ready after" in run.output
    assert state(host) == "active"


@pytest.mark.parametrize("mode", ["crash-on-start", "crash-on-request"])
def test_crash_fails_with_the_journal(host, deploy, mode):
    # crash-on-request dies on the server's own warmup request, before /health answers
    run = deploy(**env(mode))
    assert run.returncode != 0
    assert "server not ready" in run.output
    assert "last 50 lines of the journal" in run.output
    assert f"{mode} mode" in run.output  # the journal's own line
    assert f"{UNIT} stopped" in run.output
    # then rolled back to what last passed the gate (operations/stages/last_known_good.py)
    assert "rolled back to the last known good" in run.output, run.output[-3000:]
    assert "it serves again, verified by the health gate" in run.output
    assert state(host) == "active"
    assert host.process_env(host.main_pid()).get("SANDBOX_SGLANG_MODE") != mode


def test_degenerate_output_fails_with_the_journal(host, deploy):
    run = deploy(**env("degenerate"))
    assert run.returncode != 0
    assert "degenerate" in run.output and "one character repeated" in run.output
    assert "last 50 lines of the journal" in run.output
    assert "it serves again, verified by the health gate" in run.output, run.output[-3000:]
    assert state(host) == "active"


def test_noop_keeps_pid_and_one_flag_restarts_once(host, deploy):
    back = deploy()
    assert back.returncode == 0, back.output[-6000:]
    pid = host.main_pid()
    again = deploy("--json")
    assert again.returncode == 0 and changed(again) == []
    assert host.main_pid() == pid

    since = time.time() - 1
    flag = deploy("--json", gpuhost_max_running_requests=32)
    assert flag.returncode == 0, flag.output[-6000:]
    assert starts(host, since) == 1
    new_pid = host.main_pid()
    assert new_pid != pid
    args = host.process_args(new_pid)
    assert args[args.index("--max-running-requests") + 1] == "32"
    settled = deploy("--json", gpuhost_max_running_requests=32)
    assert changed(settled) == [] and host.main_pid() == new_pid
    assert starts(host, since) == 1


def answer_as(host: lab.Host, user: str, url: str) -> str:
    """The status of a GET of ``url`` made on the host by ``user``'s process, or the error's
    last line (a refused connection: ``ConnectionRefusedError``)."""
    code = (f"import urllib.request as r\nprint(r.urlopen({url!r}, timeout=10).status)")
    return host.ssh(f"cd / && runuser -u {user} -- python3 -c {shlex.quote(code)} 2>&1 | tail -1",
                    check=False).strip()


def test_a_loopback_server_admits_root_and_named_local_users_only(host, deploy):
    """A server on the loopback keeps no key: the host's firewall admits root's processes and
    those of gpuhost_server_local_users, refuses every other local user's (``nobody``), and a
    change of the list reloads the firewall, never restarts the server."""
    url = "http://127.0.0.1:8000/v1/models"
    same = {"gpuhost_max_running_requests": 32}  # as the test before left the server
    pid = host.main_pid()
    assert answer_as(host, "root", url) == "200"
    assert "Connection refused" in answer_as(host, "nobody", url)

    host.ssh("id -u alice >/dev/null 2>&1 || useradd --no-create-home alice")
    missing = deploy("--dry", **same, gpuhost_server_local_users=["alice", "bob"])
    assert missing.returncode != 0
    assert ("gpuhost_server_local_users names bob, not a user of this host (getent passwd)"
            in missing.output), missing.output[-4000:]
    named = deploy("--json", **same, gpuhost_server_local_users=["alice"])
    assert named.returncode == 0, named.output[-6000:]
    assert answer_as(host, "alice", url) == "200"
    assert "Connection refused" in answer_as(host, "nobody", url)
    assert host.main_pid() == pid
    back = deploy(**same)
    assert back.returncode == 0, back.output[-6000:]
    assert "Connection refused" in answer_as(host, "alice", url)
    assert host.main_pid() == pid


def test_api_key_and_no_secret_anywhere(host, deploy):
    key = lab.GUARD.register("sk-" + secrets.token_hex(24), "API key")
    host.ssh(f"umask 077; printf '%s\\n' {key} > {KEY_FILE}")
    token = host.ssh("cat /root/hf_token").strip()
    # a new model folder: the download (with the token) runs inside this -vvv --diff run
    run = deploy("-vvv", "--diff", gpuhost_server_host="0.0.0.0",
                 gpuhost_api_key_file=KEY_FILE, gpuhost_model_dir="/opt/gpuhost/models2")
    assert run.returncode == 0, run.output[-6000:]

    base = f"http://{host.address}:8000"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/v1/models", timeout=10)
    assert refused.value.code == 401
    auth = {"Authorization": f"Bearer {key}"}
    ok = urllib.request.urlopen(urllib.request.Request(f"{base}/v1/models", headers=auth),
                                timeout=10)
    assert [m["id"] for m in json.loads(ok.read())["data"]] == ["glm-5"]
    info = urllib.request.urlopen(
        urllib.request.Request(f"{base}/get_server_info", headers=auth), timeout=10).read()
    assert key.encode() not in info

    units = host.ssh(f"cat /etc/systemd/system/{UNIT} /etc/systemd/system/sglang-gate.service")
    journal = host.ssh("journalctl --no-pager -o cat -u sglang.service -u sglang-gate.service")
    process = host.ssh(f"tr '\\0' ' ' < /proc/{host.main_pid()}/cmdline")
    for secret in (key, token):
        assert secret not in run.output
        assert secret not in units
        assert secret not in journal
        assert secret not in process
    # Each secret is in its own file and nowhere else on the host; those files, and every file
    # or folder the server's secrets could reach, are root's alone.
    holders = host.ssh(f"grep -rlsF -e {key} -e {token} /etc /opt /var /root /run /tmp /home "
                       "/srv || true").split()
    assert sorted(holders) == sorted([KEY_FILE, "/root/hf_token"])
    # the server's run-time folder is its user's (systemd's RuntimeDirectory=); the digests of
    # what it started with (server.env's among them) are written there by root
    modes = host.ssh(f"stat -c '%n %a %U %G' {KEY_FILE} /root/hf_token /etc/gpuhost/server.env "
                     "/run/gpuhost-sglang /run/gpuhost-sglang-gate").splitlines()
    assert modes == [f"{KEY_FILE} 600 root root", "/root/hf_token 600 root root",
                     "/etc/gpuhost/server.env 600 root root",
                     "/run/gpuhost-sglang 700 gpuhost-server gpuhost-server",
                     "/run/gpuhost-sglang-gate 700 root root"]
    inputs = host.ssh("stat -c '%U' /run/gpuhost-sglang/inputs /run/gpuhost-sglang/inputs.parts")
    assert inputs.split() == ["root", "root"], inputs


def test_bad_input_refused_while_planning(host, deploy):
    pid = host.main_pid()
    host.ssh("chmod 644 /root/hf_token")
    try:
        run = deploy(gpuhost_server_host="0.0.0.0", gpuhost_api_key_file=KEY_FILE,
                     gpuhost_model_dir="/opt/gpuhost/models2")
    finally:
        host.ssh("chmod 600 /root/hf_token")
    assert run.returncode != 0
    assert ("gpuhost_hf_token_file = '/root/hf_token' is not allowed: a file on the host owned "
            "by root with mode 0600 or 0400 (it is owned by root with mode 644)") in run.output

    run = deploy(gpuhost_server_host="0.0.0.0", gpuhost_api_key_file="/root/missing.key")
    assert run.returncode != 0
    assert "gpuhost_api_key_file = '/root/missing.key' is not allowed" in run.output
    assert "(it does not exist)" in run.output

    run = deploy(gpuhost_server_host="0.0.0.0")
    assert run.returncode != 0
    assert "gpuhost_server_host = '0.0.0.0' is not allowed: a loopback address" in run.output

    host.ssh("systemd-run --unit=gpuhost-test-squatter python3 -m http.server 8123 "
             "--bind 127.0.0.1")
    try:
        time.sleep(2)
        run = deploy(gpuhost_server_port=8123)
    finally:
        host.ssh("systemctl stop gpuhost-test-squatter", check=False)
    assert run.returncode != 0
    assert ("gpuhost_server_port = 8123 is not allowed: a port no other unit listens on "
            "(gpuhost-test-squatter.service listens on it)") in run.output
    assert host.main_pid() == pid  # nothing was changed


def test_mtp_refused_without_the_layer_and_served_with_it(host, deploy, tmp_path):
    """--dry names the launch profile and its source; MTP on the default checkpoint (its weight
    index lacks the MTP layer, as lukealonso/GLM-5-NVFP4's) is refused while planning, nothing
    changed; on the checkpoint with it (festr2/GLM-5-NVFP4-MTP's stand-in) the unit gets the
    speculative flags and SGLANG_ENABLE_SPEC_V2=True, the server restarts once, then stays."""
    back = deploy()
    assert back.returncode == 0, back.output[-6000:]
    pid = host.main_pid()
    dry = deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert "Stack: launch profile field-glm5-sm120-sglang0.5.9 (the first profile the locked " \
           "sglang 0.5.9 accepts; field-glm5-sm120 passed over: --fp4-gemm-backend cutlass" \
        in dry.output, dry.output[-6000:]
    assert "[source: https://github.com/voipmonitor/rtx6kpro/blob/" in dry.output
    assert "launch profile field-glm5-sm120-sglang0.5.9 sets --kv-cache-dtype bf16 " \
           "(gpuhost_kv_cache_dtype): " in dry.output

    refused = deploy(gpuhost_speculative_algorithm="NEXTN")
    assert refused.returncode != 0
    assert ("gpuhost_speculative_algorithm = 'NEXTN' is not allowed for "
            f"{hub.REPO_ID}: None, or a checkpoint with its MTP layer") in refused.output, \
        refused.output[-6000:]
    assert "has no tensor of the MTP layer (model.layers.2.*" in refused.output
    assert host.main_pid() == pid

    since = time.time() - 1
    mtp = {"gpuhost_model": hub.MTP_REPO_ID, "gpuhost_speculative_algorithm": "NEXTN"}
    run = deploy("--json", **mtp)
    assert run.returncode == 0, run.output[-6000:]
    assert starts(host, since) == 1
    new_pid = host.main_pid()
    args = host.process_args(new_pid)
    at = args.index("--speculative-algorithm")
    assert args[at:at + 8] == ["--speculative-algorithm", "NEXTN", "--speculative-num-steps",
                               "4", "--speculative-eagle-topk", "1",
                               "--speculative-num-draft-tokens", "5"]
    assert host.process_env(new_pid)["SGLANG_ENABLE_SPEC_V2"] == "True"
    settled = deploy("--json", **mtp)
    assert changed(settled) == [] and host.main_pid() == new_pid
    assert starts(host, since) == 1
    # the draft's weights (the MTP layer's tensors, read from the copy's safetensors headers)
    # outside a static fraction that leaves them no room: refused while planning, nothing
    # changed (operations/plans/memory_fit.py)
    tight = deploy(gpuhost_mem_fraction_static=0.9999999, **mtp)
    assert tight.returncode != 0
    assert ("Stack: refused: gpuhost_speculative_algorithm = 'NEXTN' with "
            "gpuhost_mem_fraction_static = 0.9999999 does not fit the MTP draft in GPU memory"
            ) in tight.output, tight.output[-6000:]
    assert "fits with gpuhost_mem_fraction_static 0.999 or less" in tight.output
    assert host.main_pid() == new_pid and starts(host, since) == 1

    # the sweep with MTP off and on (bench.py, operations/stages/sweep.py) on a server deployed with
    # MTP off: NEXTN served through the sweep's drop-in, its flags and SGLANG_ENABLE_SPEC_V2
    # there alone (the stand-in, as sglang, runs out of memory without it), then the server
    # as the deploy left it
    off = {"gpuhost_model": hub.MTP_REPO_ID}
    assert deploy(**off).returncode == 0
    assert "SGLANG_ENABLE_SPEC_V2" not in host.ssh("cat /etc/gpuhost/server.env")
    deployed = host.main_pid()
    sweep = '{"speculative_algorithm": [null, "NEXTN"]}'
    bench = lab.deploy("--data", "gpuhost_bench_levels=[1]", "--data", "gpuhost_bench_prompts=2",
                       "--data", f"gpuhost_bench_sweep={sweep}", deploy_file="bench.py",
                       inventory=write_inventory(tmp_path / "bench.py", **off))
    assert bench.returncode == 0, bench.output[-8000:]
    assert "sweep: speculative_algorithm = NEXTN: restarting" in bench.output
    dest = Path(re.search(r"bench: (\S+)/results\.json", bench.output).group(1))
    outcomes = {o["value"]: o["status"] for o in
                json.loads((dest / "results.json").read_text())["sweep"]["outcomes"]}
    assert outcomes == {None: "ok", "NEXTN": "ok"}, outcomes
    restored = host.main_pid()
    assert restored != deployed and "--speculative-algorithm" not in host.process_args(restored)
    assert host.ssh("ls /run/systemd/system/sglang.service.d 2>/dev/null | wc -l").strip() == "0"
    assert changed(deploy("--json", **off)) == [] and host.main_pid() == restored
