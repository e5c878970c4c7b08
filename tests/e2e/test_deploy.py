"""The main job, end to end: a fresh sandbox host refuses a driver pin NVIDIA's repository
lacks, converges to a serving GLM-5 unit, and a second run changes nothing. It is also the
reference lab's P2P scenario (tests/e2e/test_p2p.py has the others): P2P measured off on the
first deploy, printed, recorded and turned into the server's NCCL environment and flags,
measured once."""

import json

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

NO_P2P_ENV = {
    "NCCL_IB_DISABLE": "1",
    "NCCL_P2P_LEVEL": "PHB",
    "NCCL_ALLOC_P2P_NET_LL_BUFFERS": "1",
    "NCCL_MIN_NCHANNELS": "8",
}


def changed_operations(run: lab.Run) -> list[str]:
    """Operations that pyinfra's --json results report as changed (or failed) on any host."""
    assert run.results is not None, run.output[-3000:]
    return [
        f"{op['name']}: changed on {op['success']}, failed on {op['error']}"
        for op in run.results["results"]["operations"]
        if op["success"] or op["error"]
    ]


def test_a_pin_the_repository_lacks_installs_no_driver(reference_host):
    """Before the fresh host's first deploy (the test below): host data pinning a driver
    version NVIDIA's repository lacks is refused while planning, nothing installed, no
    reboot (it was test_drift.py's, on a fresh host of its own)."""
    host = reference_host
    boot = host.ssh("cat /proc/sys/kernel/random/boot_id")
    run = lab.deploy("--data", "gpuhost_driver_version=580.82.07")
    assert run.returncode != 0, run.output[-6000:]
    assert "NVIDIA's repository has no nvidia-kernel-open-dkms 580.82.07-*" in run.output
    assert "Traceback" not in run.output
    assert host.ssh("dpkg-query -W nvidia-kernel-open-dkms 2>/dev/null || echo none").strip() \
        == "none"
    assert host.ssh("cat /proc/sys/kernel/random/boot_id") == boot  # no reboot

    dry = lab.deploy("--dry", "--data", "gpuhost_driver_version=580.82.07")
    assert ("NVIDIA: refused: NVIDIA's repository has no nvidia-kernel-open-dkms 580.82.07-* "
            "(gpuhost_driver_branch, gpuhost_driver_version): it has 580.105.08, 580.95.05."
            ) in dry.output, dry.output[-6000:]


def test_fresh_host_converges_then_nothing_changes(reference_host):
    host = reference_host
    first = lab.deploy()
    assert first.returncode == 0, first.output[-6000:]
    assert "P2P: P2P off: " in first.output, first.output[-6000:]
    record = json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))
    assert record["decision"]["p2p"] == "off" and record["verification"]["verified"] is True

    assert host.ssh("systemctl is-active sglang.service").strip() == "active"
    assert host.ssh("systemctl is-enabled sglang.service").strip() == "enabled"
    pid = host.main_pid()
    env = host.process_env(pid)
    for key, value in NO_P2P_ENV.items():
        assert env.get(key) == value, (key, env)
    assert "NCCL_P2P_DISABLE" not in env  # P2P off, its verification passed: not disabled
    assert env["CUDA_HOME"] == "/usr/local/cuda-12.8"
    args = host.process_args(pid)
    assert "--disable-custom-all-reduce" in args
    assert args[args.index("--tensor-parallel-size") + 1] == "8"
    assert args[args.index("--moe-runner-backend") + 1] == "cutlass"  # the launch profile's
    models = json.loads(host.http_get("http://127.0.0.1:8000/v1/models"))
    assert [m["id"] for m in models["data"]] == ["glm-5"]
    assert host.ssh("stat -c %a /etc/gpuhost/server.env").strip() == "600"
    assert "580." in host.ssh("nvidia-smi --query-gpu=driver_version --format=csv,noheader")
    assert "release 12.8" in host.ssh("/usr/local/cuda-12.8/bin/nvcc --version")
    held = host.ssh("apt-mark showhold").split()
    assert "nvidia-open" in held and "cuda-toolkit-12-8" in held

    second = lab.deploy("--json")
    assert second.returncode == 0, second.output[-6000:]
    assert changed_operations(second) == []
    assert host.main_pid() == pid
    assert json.loads(host.ssh("cat /var/lib/gpuhost/p2p.json"))["measured_at"] == \
        record["measured_at"]
    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert "P2P off: " in dry.output and "(measured " in dry.output

    # The weights are on the host now: their config.json's architecture is what the known
    # behaviour is matched against, and host data naming another is refused while planning.
    other = lab.deploy("--dry", "--data", "gpuhost_model_architecture=Qwen3MoeForCausalLM")
    assert ("names the architecture GlmMoeDsaForCausalLM, host data says "
            "gpuhost_model_architecture = 'Qwen3MoeForCausalLM'") in other.output, \
        other.output[-4000:]

    # A model folder with no weights yet: planning cannot read its config.json, so the
    # download checks it, and the host stops there, before the unit is written or the server
    # restarted (the converged host stays converged).
    unit = host.ssh("cat /etc/systemd/system/sglang.service")
    wrong = lab.deploy("--data", "gpuhost_model_dir=/opt/gpuhost/models2",
                       "--data", "gpuhost_model_architecture=DeepseekV3ForCausalLM")
    assert wrong.returncode != 0, wrong.output[-4000:]
    assert "Traceback" not in wrong.output
    assert "refused: the model's /opt/gpuhost/models2/" in wrong.output, wrong.output[-4000:]
    assert ("/config.json names the architecture GlmMoeDsaForCausalLM, host data says "
            "gpuhost_model_architecture = 'DeepseekV3ForCausalLM'") in wrong.output
    assert host.ssh("cat /etc/systemd/system/sglang.service") == unit
    assert host.main_pid() == pid
    again = lab.deploy("--json")
    assert again.returncode == 0 and changed_operations(again) == [], again.output[-4000:]
