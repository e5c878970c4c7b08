"""operations/files/gpu_metrics.py: nvidia-smi's real outputs (an H200 under load, the capture in
tests/fixtures/h200-device/telemetry/) under DCGM exporter's names, checked by the real
promtool; and the script run whole against the nvidia-smi stand-in."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from sandbox import nvidia_repo, scenarios
from tests.conftest import promtool_check_metrics

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = ROOT / "tests" / "fixtures" / "h200-device" / "telemetry"
sys.path.insert(0, str(ROOT / "operations" / "facts"))  # the script imports telemetry as on the host
sys.path.insert(0, str(ROOT / "operations" / "files"))
import gpu_metrics  # noqa: E402

#: The H200's identity as nvidia-smi gave it (tests/fixtures/h200-1gpu/query-gpu.txt), in
#: IDENTITY_FIELDS' order.
IDENTITY = "0, GPU-344a91d1-8a67-8c10-7320-3e39f3672a46, 00000000:00:06.0, 700.00, NVIDIA H200\n"


def _loaded_line() -> str:
    """The capture's first line with the GPU held at its power cap (0x4, sw_power_cap)."""
    return next(line for line in (CAPTURE / "query.csv").read_text().splitlines()
                if ", 0x0000000000000004," in line)


def _samples(text: str) -> dict[str, str]:
    return {re.split(r"[{ ]", line)[0]: line for line in text.splitlines()
            if line and line[0] != "#"}


def test_a_real_reading_under_dcgm_exporters_names(promtool):
    dmon = "\n".join((CAPTURE / "dmon.txt").read_text().splitlines()[:3]) + "\n"
    text = gpu_metrics.render(IDENTITY, _loaded_line() + "\n", dmon)
    assert promtool_check_metrics(promtool, text) == []
    samples = _samples(text)
    labels = ('{gpu="0",UUID="GPU-344a91d1-8a67-8c10-7320-3e39f3672a46",device="nvidia0",'
              'pci_bus_id="00000000:00:06.0",modelName="NVIDIA H200"}')
    assert samples["DCGM_FI_DEV_POWER_USAGE"] == f"DCGM_FI_DEV_POWER_USAGE{labels} 389.23"
    assert samples["DCGM_FI_DEV_POWER_MGMT_LIMIT"].endswith("} 700")
    assert samples["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"].endswith("} 700")
    assert samples["DCGM_FI_DEV_SM_CLOCK"].endswith("} 1515")
    assert samples["DCGM_FI_DEV_MAX_SM_CLOCK"].endswith("} 1980")
    assert samples["DCGM_FI_DEV_MEM_CLOCK"].endswith("} 3201")
    assert samples["DCGM_FI_DEV_GPU_UTIL"].endswith("} 99")
    assert samples["DCGM_FI_DEV_MEM_COPY_UTIL"].endswith("} 23")
    assert samples["DCGM_FI_DEV_GPU_TEMP"].endswith("} 55")
    assert samples["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"].endswith("} 4")  # sw_power_cap
    # dmon: rxpci 9 MB/s, txpci 3 MB/s
    assert samples["DCGM_FI_PROF_PCIE_RX_BYTES"].endswith("} 9000000")
    assert samples["DCGM_FI_PROF_PCIE_TX_BYTES"].endswith("} 3000000")
    assert samples["gpuhost_gpu_metrics_ok"] == "gpuhost_gpu_metrics_ok 1"


def test_missing_fields_are_left_out_not_zero():
    line = _loaded_line().replace(", 389.23,", ", [N/A],")
    text = gpu_metrics.render(IDENTITY, line + "\n", "")
    assert "DCGM_FI_DEV_POWER_USAGE" not in text
    assert "DCGM_FI_PROF_PCIE_RX_BYTES" not in text  # no dmon line
    assert "DCGM_FI_DEV_SM_CLOCK{" in text


@pytest.fixture
def standin(tmp_path):
    script = tmp_path / "nvidia-smi"
    script.write_text("#!" + sys.executable + "\n"
                      + nvidia_repo.render("nvidia-smi", VERSION="580.159.04"))
    script.chmod(0o755)
    (tmp_path / "hardware.json").write_text(scenarios.hardware_json("reference-lab"))
    (tmp_path / "loaded").write_text("580.159.04\n")
    (tmp_path / "load.json").write_text(json.dumps({"active": 0}))
    env = dict(os.environ, GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hardware.json"),
               GPUHOST_SANDBOX_LOADED=str(tmp_path / "loaded"),
               GPUHOST_SANDBOX_LOAD=str(tmp_path / "load.json"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "operations" / "facts"),
                                           str(ROOT / "operations" / "files")]))
    return script, env


def test_the_script_writes_every_gpu_of_the_reference_lab(standin, tmp_path, promtool):
    script, env = standin
    out = tmp_path / "textfile" / "gpu.prom"
    out.parent.mkdir()
    done = subprocess.run([sys.executable, str(ROOT / "operations/files/gpu_metrics.py"),
                           "--output", str(out), "--nvidia-smi", str(script)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert promtool_check_metrics(promtool, text) == []
    power = [line for line in text.splitlines() if line.startswith("DCGM_FI_DEV_POWER_USAGE{")]
    assert len(power) == 8
    assert len([ln for ln in text.splitlines() if ln.startswith("DCGM_FI_PROF_PCIE_RX_BYTES{")]) \
        == 8
    assert list(out.parent.iterdir()) == [out]  # no temporary file left


def test_a_failed_reading_says_so_in_the_textfile(standin, tmp_path):
    script, env = standin
    (tmp_path / "loaded").write_text("580.95.05\n")  # a driver/library mismatch
    out = tmp_path / "gpu.prom"
    failed = tmp_path / "failed"
    done = subprocess.run([sys.executable, str(ROOT / "operations/files/gpu_metrics.py"),
                           "--output", str(out), "--nvidia-smi", str(script),
                           "--failed-file", str(failed)],
                          capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 1
    assert "no reading" in done.stderr and "exited" in done.stderr
    assert "\ngpuhost_gpu_metrics_ok 0\n" in out.read_text()
    # a reading that failed alone (the NVIDIA stage's reboot ends a mismatch): not failed GPUs
    assert "\ngpuhost_gpu_failed 0\n" in out.read_text() and not failed.exists()


def test_the_standins_faults_reach_the_textfile(standin, tmp_path, promtool):
    """The sandbox's faults (sandbox/standins/nvidia/nvidia-smi, sandbox/standins/kernel/dmesg):
    GPU 7 gone, GPU 2's link at x8, an Xid 79 of GPU 7 in the kernel log."""
    script, env = standin
    hw = json.loads((tmp_path / "hardware.json").read_text())
    bus = hw["gpus"][7]["pci_bus_id"]
    key = f"{int(bus[:8], 16):04x}:{bus[9:11].lower()}:{bus[12:14].lower()}"
    (tmp_path / "faults.json").write_text(json.dumps({
        "gpus": {"7": {"gone": True}, "2": {"pcie_width_current": 8},
                 "1": {"remapped_rows_pending": "Yes", "pcie_replays": 12}},
        "xids": [{"bus": key, "code": 79, "text": "GPU has fallen off the bus."}]}))
    dmesg = tmp_path / "dmesg"
    dmesg.write_text("#!" + sys.executable + "\n"
                     + (ROOT / "sandbox/standins/kernel/dmesg").read_text())
    dmesg.chmod(0o755)
    env = dict(env, GPUHOST_SANDBOX_FAULTS=str(tmp_path / "faults.json"))
    out = tmp_path / "gpu.prom"
    failed = tmp_path / "run" / "failed"
    failed.parent.mkdir()
    argv = [sys.executable, str(ROOT / "operations/files/gpu_metrics.py"), "--output", str(out),
            "--nvidia-smi", str(script), "--dmesg", str(dmesg), "--expected-gpus", "8",
            "--failed-file", str(failed)]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    text = out.read_text()
    assert promtool_check_metrics(promtool, text) == []
    assert "DCGM_FI_DEV_COUNT 7\n" in text and "gpuhost_gpu_expected_count 8\n" in text
    assert re.search(r'DCGM_FI_DEV_PCIE_LINK_WIDTH\{gpu="2",[^}]*\} 8\n', text)
    assert re.search(r'DCGM_FI_DEV_ROW_REMAP_PENDING\{gpu="1",[^}]*\} 1\n', text)
    assert re.search(r'DCGM_FI_DEV_PCIE_REPLAY_COUNTER\{gpu="1",[^}]*\} 12\n', text)
    assert f'gpuhost_gpu_xid_errors_total{{pci_bus_id="{bus}",xid="79"}} 1\n' in text
    assert f'DCGM_FI_DEV_XID_ERRORS{{pci_bus_id="{bus}"}} 79\n' in text
    assert "gpuhost_gpu_kernel_log_ok 1\n" in text
    # the host's verdict: failed, the GPUs named; the file the worker's gate reads says why
    words = failed.read_text()
    assert words.startswith("failed: 7 of 8 GPUs seen by the driver: reboot the host"), words
    assert f"Xid 79 (the GPU fell off the bus) x1 on GPU {bus}: reboot the host" in words
    assert oct(failed.stat().st_mode & 0o777) == "0o644"  # the gate's workers read it
    reason = re.search(r'^gpuhost_gpu_failed\{reason="([^"]*)"\} 1$', text, re.M)
    assert reason and reason.group(1) == words.removeprefix("failed: ").strip()
    # cleared (as a reboot clears them): healthy again, the file gone
    (tmp_path / "faults.json").write_text("{}")
    done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert "\ngpuhost_gpu_failed 0\n" in out.read_text() and not failed.exists()
    assert list(failed.parent.iterdir()) == []  # no temporary file left


def test_a_failed_reading_still_gives_the_kernel_logs_xids(standin, tmp_path):
    """nvidia-smi failing (here a driver/library mismatch; a GPU fallen off the bus can stop it
    answering too): the Xids of the kernel log are still written, beside the failed reading."""
    script, env = standin
    (tmp_path / "loaded").write_text("580.95.05\n")
    (tmp_path / "faults.json").write_text(json.dumps({"xids": [
        {"bus": "0000:01:00", "code": 79, "text": "GPU has fallen off the bus."}]}))
    dmesg = tmp_path / "dmesg"
    dmesg.write_text("#!" + sys.executable + "\n"
                     + (ROOT / "sandbox/standins/kernel/dmesg").read_text())
    dmesg.chmod(0o755)
    out = tmp_path / "gpu.prom"
    failed = tmp_path / "failed"
    done = subprocess.run([sys.executable, str(ROOT / "operations/files/gpu_metrics.py"),
                           "--output", str(out), "--nvidia-smi", str(script), "--dmesg",
                           str(dmesg), "--expected-gpus", "8", "--failed-file", str(failed)],
                          capture_output=True, text=True,
                          env=dict(env, GPUHOST_SANDBOX_FAULTS=str(tmp_path / "faults.json")),
                          timeout=60, check=False)
    assert done.returncode == 1
    text = out.read_text()
    assert 'gpuhost_gpu_xid_errors_total{pci_bus_id="00000000:01:00.0",xid="79"} 1\n' in text
    assert "DCGM_FI_DEV_COUNT" not in text and "\ngpuhost_gpu_metrics_ok 0\n" in text
    # the kernel log's Xid 79 alone fails the host (nvidia-smi's silence does not)
    assert failed.read_text() == ("failed: Xid 79 (the GPU fell off the bus) x1 on GPU "
                                  "00000000:01:00.0: reboot the host; reseat or replace the "
                                  "GPU if it recurs\n")
