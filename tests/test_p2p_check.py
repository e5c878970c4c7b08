"""The host-side P2P check (operations/files/p2p_check.py) run as the deploy runs it, in a
python whose torch is the sandbox's stand-in (sandbox/standins/torch) and with the stand-in
nvidia-smi on PATH, for every scenario; and its bad inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from operations.stages.p2p import check_sha256, policy_sha256, record_is_current
from sandbox import nvidia_repo, scenarios

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "operations" / "files" / "p2p_check.py"
TORCH = ROOT / "sandbox" / "standins" / "torch"
DRIVER = "580.95.05"
NO_P2P = {"NCCL_IB_DISABLE": "1", "NCCL_P2P_LEVEL": "PHB", "NCCL_ALLOC_P2P_NET_LL_BUFFERS": "1",
          "NCCL_MIN_NCHANNELS": "8"}


@pytest.fixture
def check(tmp_path):
    """Run the check on a scenario (or a hardware document); returns (process, record, env)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(nvidia_repo.render("nvidia-smi", VERSION=DRIVER))
    smi.chmod(0o755)
    (tmp_path / "loaded").write_text(DRIVER + "\n")

    def run(scenario: str | dict, *args: str, smi_script: str | None = None):
        hardware = scenario if isinstance(scenario, dict) else scenarios.load(scenario)
        (tmp_path / "hw.json").write_text(json.dumps(hardware))
        if smi_script is not None:
            smi.write_text(smi_script)
        env = {
            **os.environ,
            "PATH": f"{bin_dir}:{os.environ['PATH']}",
            "PYTHONPATH": str(TORCH),
            "GPUHOST_SANDBOX_HARDWARE": str(tmp_path / "hw.json"),
            "GPUHOST_SANDBOX_LOADED": str(tmp_path / "loaded"),
            "GPUHOST_SANDBOX_LIBCUDA": str(tmp_path / "loaded"),
        }
        record, env_file = tmp_path / "p2p.json", tmp_path / "p2p.env"
        for f in (record, env_file):
            f.unlink(missing_ok=True)
        proc = subprocess.run(
            [sys.executable, str(CHECK), "--record", str(record), "--env-file", str(env_file),
             "--bytes", str(2**20), *args],
            env=env, capture_output=True, text=True, timeout=120, check=False,
        )
        loaded = json.loads(record.read_text()) if record.exists() else None
        values = None
        if env_file.exists():
            values = dict(line.split("=", 1) for line in env_file.read_text().splitlines()
                          if line and not line.startswith("#"))
        return proc, loaded, values

    return run


def test_single_gpu_says_no_pairs(check):
    proc, record, env = check("single-gpu")
    assert proc.returncode == 0, proc.stderr
    assert "one GPU: no pairs, nothing to verify" in proc.stdout
    assert record["decision"]["p2p"] == "n/a"
    assert record["verification"] == {"verified": None, "pairs": [], "all_reduce": None}
    assert env == {"NCCL_IB_DISABLE": "1", "GPUHOST_P2P_SERVER_ARGS": ""}


def test_bare_metal_all_ok_is_verified_and_on(check):
    proc, record, env = check("bare-metal-p2p")
    assert proc.returncode == 0, proc.stderr
    pairs = record["verification"]["pairs"]
    assert len(pairs) == 8 * 7
    assert all(p["peer_access"] and p["intact"] for p in pairs)
    assert all(p["seconds"] > 0 and p["gb_per_s"] > 0 for p in pairs)
    reduce = record["verification"]["all_reduce"]
    assert reduce["intact"] and reduce["expected"] == 36
    assert reduce["env"]["NCCL_NVLS_ENABLE"] == "0"
    assert record["decision"]["p2p"] == "on"
    assert "verified" in record["decision"]["reason"]
    assert env == {"NCCL_IB_DISABLE": "1", "GPUHOST_P2P_SERVER_ARGS": ""}
    # the 56 pairs in one line; each pair's copy is in the record
    assert "56 GPU pairs: 56 peer copies of 1 MiB intact, " in proc.stdout
    assert "GPU0 -> GPU1" not in proc.stdout


@pytest.mark.parametrize(("scenario", "code"), [("reference-lab", "NS"), ("q35-cns", "CNS")])
def test_unsupported_p2p_copies_nothing_and_turns_p2p_off(check, scenario, code):
    proc, record, env = check(scenario)
    assert proc.returncode == 0, proc.stderr
    assert not any(p["peer_access"] for p in record["verification"]["pairs"])
    # the all-reduce runs with the settings the server gets
    assert record["verification"]["all_reduce"]["env"] == {**NO_P2P, "NCCL_NVLS_ENABLE": "0"}
    assert record["verification"]["all_reduce"]["intact"]
    assert record["decision"]["p2p"] == "off" and code in record["decision"]["reason"]
    assert env == {**NO_P2P, "GPUHOST_P2P_SERVER_ARGS": "--disable-custom-all-reduce"}
    n = len(record["verification"]["pairs"])
    assert f"{n} GPU pairs: {n} with no peer access reported, not copied" in proc.stdout


def test_reported_ok_but_wrong_data_turns_p2p_off_with_the_causes(check):
    proc, record, env = check("p2p-ok-wrong-data")
    assert proc.returncode == 0, proc.stderr
    pairs = record["verification"]["pairs"]
    assert [p["intact"] for p in pairs] == [False, False]
    assert record["verification"]["all_reduce"]["intact"] is False
    assert record["verification"]["verified"] is False
    decision = record["decision"]
    assert decision["p2p"] == "off" and decision["server_args"] == ["--disable-custom-all-reduce"]
    (warning,) = decision["warnings"]
    for cause in ("ACS", "IOMMU", "q35", "pcie=1", "x-nv-gpudirect-clique"):
        assert cause in warning
    assert "2 GPU pairs: 2 WRONG DATA on arrival: GPU0 -> GPU1, GPU1 -> GPU0" in proc.stdout
    assert "WARNING:" in proc.stdout
    # P2P reported OK but broken: NCCL must be told, or it goes peer-to-peer again.
    assert env == {**NO_P2P, "NCCL_P2P_DISABLE": "1",
                   "GPUHOST_P2P_SERVER_ARGS": "--disable-custom-all-reduce"}


def test_a_hanging_all_reduce_times_out_and_fails_verification(check):
    hardware = scenarios.load("p2p-ok-wrong-data")
    hardware["peer_transfers"] = {"copy": "intact", "all_reduce": "hang"}
    proc, record, _ = check(hardware, "--timeout", "3")
    assert proc.returncode == 0, proc.stderr
    assert all(p["intact"] for p in record["verification"]["pairs"])
    assert "did not finish within 3 s" in record["verification"]["all_reduce"]["failure"]
    assert record["decision"]["p2p"] == "off" and record["decision"]["warnings"]


def test_override_on_contradicting_the_measurement_warns(check):
    proc, record, env = check("p2p-ok-wrong-data", "--override", "on")
    assert proc.returncode == 0, proc.stderr
    assert record["override"] == "on" and record["decision"]["p2p"] == "on"
    assert any("contradicts the measurement" in w for w in record["decision"]["warnings"])
    assert env["GPUHOST_P2P_SERVER_ARGS"] == ""


def test_bad_override_is_refused(check):
    proc, _, _ = check("q35-cns", "--override", "maybe")
    assert proc.returncode == 2 and "invalid choice: 'maybe'" in proc.stderr


def test_topology_that_does_not_parse_names_command_and_line(check, tmp_path):
    real = tmp_path / "nvidia-smi.real"
    real.write_text(nvidia_repo.render("nvidia-smi", VERSION=DRIVER))
    real.chmod(0o755)
    # topo -m garbled (a link type nvidia-smi never prints); everything else the stand-in's
    garbled = (
        "#!/bin/sh\n"
        'if [ "$1 $2" = "topo -m" ]; then\n'
        "  printf '\\tGPU0\\tGPU1\\tCPU Affinity\\tNUMA Affinity\\tGPU NUMA ID\\n'\n"
        "  printf 'GPU0\\t X \\tWARP\\t0-31\\t0\\t\\tN/A\\n'\n"
        "  printf 'GPU1\\tWARP\\t X \\t0-31\\t0\\t\\tN/A\\n'\n"
        "  exit 0\n"
        "fi\n"
        f'exec {real} "$@"\n'
    )
    proc, record, env = check("q35-cns", smi_script=garbled)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith("P2P check: nvidia-smi topo -m: unknown link type 'WARP'")
    assert "GPU0" in proc.stderr and "Traceback" not in proc.stderr
    assert record is None and env is None


def test_the_record_holds_until_driver_gpus_override_or_code_change(check):
    proc, record, _ = check("q35-cns")
    assert proc.returncode == 0, proc.stderr
    text = json.dumps(record)
    uuids = [g["uuid"] for g in scenarios.load("q35-cns")["gpus"]]
    assert record["policy_sha256"] == policy_sha256()
    assert record["check_sha256"] == check_sha256()
    assert record_is_current(text, DRIVER, uuids, None)
    assert not record_is_current(text, "580.105.08", uuids, None)
    assert not record_is_current(text, DRIVER, uuids[::-1], None)
    assert not record_is_current(text, DRIVER, uuids, "on")
    assert not record_is_current("{not json", DRIVER, uuids, None)
    assert not record_is_current(None, DRIVER, uuids, None)


def test_refuses_while_processes_hold_the_gpus(check, tmp_path):
    real = tmp_path / "nvidia-smi.real"
    real.write_text(nvidia_repo.render("nvidia-smi", VERSION=DRIVER))
    real.chmod(0o755)
    # nvidia-smi --query-compute-apps as the real tool answers it while the server runs
    busy = (
        "#!/bin/sh\n"
        'case "$1" in --query-compute-apps=*) echo "4242, /opt/gpuhost/venv/bin/python"; '
        "echo \"4243, /opt/gpuhost/venv/bin/python\"; exit 0;; esac\n"
        f'exec {real} "$@"\n'
    )
    proc, record, env = check("q35-cns", smi_script=busy)
    assert proc.returncode == 4
    assert "processes hold the GPUs (4242 /opt/gpuhost/venv/bin/python;" in proc.stderr
    assert "systemctl stop sglang.service" in proc.stderr and "Traceback" not in proc.stderr
    assert record is None and env is None
