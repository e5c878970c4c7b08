"""operations/files/gpu_health.py: the health readings of a real H100 (driver 580, the capture in
tests/fixtures/h100-device/health/) under DCGM exporter's names, checked by the real promtool;
the formats a healthy GPU never prints (Xid lines, ECC errors, a pending or failed remap, a link
trained down) from NVIDIA's documented and publicly reported outputs; and the verdict."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from tests.conftest import promtool_check_metrics

ROOT = Path(__file__).resolve().parents[1]
CAPTURE = ROOT / "tests" / "fixtures" / "h100-device" / "health"
sys.path.insert(0, str(ROOT / "operations" / "facts"))
sys.path.insert(0, str(ROOT / "operations" / "files"))
import gpu_health  # noqa: E402
import gpu_metrics  # noqa: E402

#: The H100's identity, as the capture's nvidia-smi -L and -q give it, in IDENTITY_FIELDS' order.
IDENTITY = ("0, GPU-00d2e481-acd6-9e0a-0aeb-cf05f719c879, 00000000:00:06.0, 700.00, "
            "NVIDIA H100 80GB HBM3\n")
LABELS = {0: {"gpu": "0", "UUID": "GPU-00d2e481-acd6-9e0a-0aeb-cf05f719c879",
              "device": "nvidia0", "pci_bus_id": "00000000:00:06.0",
              "modelName": "NVIDIA H100 80GB HBM3"}}
#: Xid lines as NVIDIA's driver prints them (gpu_health.py's docstring names each source).
XID_79 = "[ 1843.308145] NVRM: Xid (PCI:0000:00:06): 79, GPU has fallen off the bus."
XID_63 = ("[ 2001.000001] NVRM: Xid (PCI:0000:00:06): 63, pid=1896, Row Remapper: New row "
          "marked for remapping, reset gpu to activate.")
XID_OLD = "[  100.000000] NVRM: Xid (0000:03:00): 14, Channel 00000001"


def _one_by_one() -> dict[str, str]:
    """Each field's answer when asked alone on the H100."""
    return dict(line.split(": ", 1) for line in
                (CAPTURE / "fields-one-by-one.txt").read_text().splitlines())


def health_line(**changed: str) -> str:
    """HEALTH_FIELDS' line as the H100 answered each field, with ``changed`` (field with
    underscores for dots) put in."""
    real = _one_by_one()
    return ", ".join(changed.get(f.replace(".", "_"), real[f])
                     for f in gpu_health.HEALTH_FIELDS) + "\n"


def real(name: str) -> str:
    return re.sub(r"# rc=\d+\n$", "", (CAPTURE / name).read_text())


def test_every_field_is_one_the_driver_answers():
    answered = _one_by_one()
    assert all(f in answered and "not a valid field" not in answered[f]
               for f in gpu_health.HEALTH_FIELDS)


def test_the_h100s_reading():
    parsed = gpu_health.parse_health(health_line())
    assert parsed[0]["memory.free"] == 81079 and parsed[0]["memory.used"] == 0
    assert parsed[0]["ecc.mode.current"] == 1 and parsed[0]["remapped_rows.pending"] == 0
    assert parsed[0]["pcie.link.width.current"] == 16 and parsed[0]["pcie.link.gen.max"] == 5
    assert parsed[0]["count"] == 1
    # the -q of the same GPU: its PCI section's replay counter, keyed like the kernel log's
    assert gpu_health.parse_replays(real("q.txt")) == {"0000:00:06": 0}
    # a healthy GPU's kernel log: NVRM lines, no Xid
    assert "NVRM:" in real("dmesg-nvrm.txt")
    assert gpu_health.parse_xids(real("dmesg-nvrm.txt")) == []


def _samples(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line and line[0] != "#":
            out.setdefault(re.split(r"[{ ]", line)[0], []).append(line)
    return out


def test_the_whole_textfile_of_a_real_reading(promtool):
    query = (ROOT / "tests/fixtures/h200-device/telemetry/query.csv").read_text().splitlines()[0]
    text = gpu_metrics.render(IDENTITY, query + "\n", "", health_line(), real("q.txt"),
                              real("dmesg-nvrm.txt"), 8)
    assert promtool_check_metrics(promtool, text) == []
    s = _samples(text)
    labels = ('{gpu="0",UUID="GPU-00d2e481-acd6-9e0a-0aeb-cf05f719c879",device="nvidia0",'
              'pci_bus_id="00000000:00:06.0",modelName="NVIDIA H100 80GB HBM3"}')
    assert s["DCGM_FI_DEV_FB_FREE"] == [f"DCGM_FI_DEV_FB_FREE{labels} 81079"]
    assert s["DCGM_FI_DEV_FB_USED"] == [f"DCGM_FI_DEV_FB_USED{labels} 0"]
    for name in ("ECC_SBE_VOL_TOTAL", "ECC_DBE_VOL_TOTAL", "ECC_SBE_AGG_TOTAL",
                 "ECC_DBE_AGG_TOTAL", "CORRECTABLE_REMAPPED_ROWS", "UNCORRECTABLE_REMAPPED_ROWS",
                 "ROW_REMAP_PENDING", "ROW_REMAP_FAILURE", "PCIE_REPLAY_COUNTER"):
        assert s[f"DCGM_FI_DEV_{name}"] == [f"DCGM_FI_DEV_{name}{labels} 0"], name
    assert s["DCGM_FI_DEV_PCIE_LINK_WIDTH"][0].endswith(" 16")
    assert s["DCGM_FI_DEV_PCIE_MAX_LINK_GEN"][0].endswith(" 5")
    assert s["DCGM_FI_DEV_XID_ERRORS"] == [f"DCGM_FI_DEV_XID_ERRORS{labels} 0"]
    assert "gpuhost_gpu_xid_errors_total" not in s
    assert s["DCGM_FI_DEV_COUNT"] == ["DCGM_FI_DEV_COUNT 1"]
    assert s["gpuhost_gpu_expected_count"] == ["gpuhost_gpu_expected_count 8"]
    assert s["gpuhost_gpu_kernel_log_ok"] == ["gpuhost_gpu_kernel_log_ok 1"]


def test_xids_by_code_and_the_last_one(promtool):
    log = "\n".join([real("dmesg-nvrm.txt"), XID_63, XID_63, XID_79, XID_OLD]) + "\n"
    assert gpu_health.parse_xids(log) == [("0000:00:06", 63), ("0000:00:06", 63),
                                          ("0000:00:06", 79), ("0000:03:00", 14)]
    lines = gpu_health.render(health_line(), "", log, LABELS, None)
    assert promtool_check_metrics(promtool, "\n".join(lines) + "\n") == []
    s = _samples("\n".join(lines))
    assert s["DCGM_FI_DEV_XID_ERRORS"][0].endswith('pci_bus_id="00000000:00:06.0",'
                                                   'modelName="NVIDIA H100 80GB HBM3"} 79')
    # a GPU the driver no longer lists keeps its Xids, under its bus id
    assert s["DCGM_FI_DEV_XID_ERRORS"][1] == \
        'DCGM_FI_DEV_XID_ERRORS{pci_bus_id="00000000:03:00.0"} 14'
    counts = {re.search(r'xid="(\d+)"', line).group(1): line.rsplit(" ", 1)[1]
              for line in s["gpuhost_gpu_xid_errors_total"]}
    assert counts == {"63": "2", "79": "1", "14": "1"}


def test_an_unread_kernel_log_says_so_and_gives_no_xid_series():
    lines = gpu_health.render(health_line(), "", None, LABELS, 8)
    assert "gpuhost_gpu_kernel_log_ok 0" in lines
    assert not any(line.startswith("DCGM_FI_DEV_XID_ERRORS") for line in lines)


def test_the_faults_a_healthy_gpu_never_shows():
    # nvidia-smi answers Yes where a remap is pending or failed (--help-query-remapped-rows)
    sick = gpu_health.parse_health(health_line(
        ecc_errors_uncorrected_volatile_total="2", remapped_rows_pending="Yes",
        remapped_rows_failure="Yes", pcie_link_width_current="8"))[0]
    assert sick["ecc.errors.uncorrected.volatile.total"] == 2
    assert sick["remapped_rows.pending"] == 1 and sick["remapped_rows.failure"] == 1
    assert sick["pcie.link.width.current"] == 8
    # ECC off: no ECC series (the GPU has no counts to give)
    off = gpu_health.render(health_line(ecc_mode_current="Disabled",
                                        ecc_errors_corrected_volatile_total="[N/A]"), "", "",
                            LABELS, None)
    assert not any(line.startswith("DCGM_FI_DEV_ECC_") for line in off)
    # replays on an older driver's -q: "Replays since reset"
    assert gpu_health.parse_replays("GPU 00000000:02:00.0\n    PCI\n"
                                    "        Replays since reset         : 7\n") == \
        {"0000:02:00": 7}


def test_bad_output_is_a_clear_error():
    with pytest.raises(gpu_health.HealthError, match="remapped_rows.pending: 'Maybe'"):
        gpu_health.parse_health(health_line(remapped_rows_pending="Maybe"))
    with pytest.raises(gpu_health.HealthError, match="fields, expected"):
        gpu_health.parse_health("0, 1, 2\n")


@pytest.mark.parametrize(("readings", "state", "words"), [
    ({}, "healthy", ""),
    ({"xids": {79: 1}}, "failed", "Xid 79 (the GPU fell off the bus) x1: reboot the host"),
    ({"xids": {13: 2}}, "degraded", "Xid 13 x2"),
    ({"gpus_seen": 7, "gpus_expected": 8}, "failed", "7 of 8 GPUs seen by the driver"),
    ({"ecc_uncorrected": 1}, "failed", "1 uncorrectable ECC error(s)"),
    ({"remap_failure": 1}, "failed", "a row remapping failed: replace the GPU"),
    ({"remap_pending": 1}, "degraded", "a row remapping is pending"),
    ({"link_width": 8, "link_width_max": 16}, "degraded", "a PCIe link at x8 of x16"),
    ({"link_gen": 1, "link_gen_max": 5, "busy": 0}, "healthy", ""),  # idle: gen drops
    ({"link_gen": 3, "link_gen_max": 5, "busy": 90}, "degraded", "at gen 3 of 5"),
    ({"fb_used_pct": 97, "serving": 0}, "degraded", "GPU memory 97 % used with no server"),
    ({"fb_used_pct": 97, "serving": 1}, "healthy", ""),
    ({"reading_ok": 0}, "failed", "nvidia-smi gives no reading"),
])
def test_the_verdict(readings, state, words):
    v = gpu_health.verdict(**readings)
    assert v.state == state and words in v.words()


def test_a_failed_host_lists_its_lesser_reasons_too():
    v = gpu_health.verdict(xids={79: 1}, remap_pending=1)
    assert v.state == "failed" and v.reasons[0].startswith("Xid 79") \
        and "pending" in v.reasons[1]


def test_the_alert_rules_fatal_xids_are_the_verdicts():
    rules = (ROOT / "templates" / "gpuhost-alerts.yml").read_text()
    listed = re.search(r'gpuhost_gpu_xid_errors_total\{xid=~"([0-9|]+)"\}', rules).group(1)
    assert sorted(int(x) for x in listed.split("|")) == sorted(gpu_health.FATAL_XIDS)


def test_the_verdict_names_the_failed_gpus():
    """From the textfile: the Xid's GPU by index and bus id, or by bus id alone where the
    driver no longer lists it; an uncorrectable ECC error's and a failed remap's by index."""
    log = "\n".join([XID_79, XID_OLD.replace(": 14,", ": 48,")]) + "\n"
    sick = health_line(ecc_errors_uncorrected_volatile_total="2", remapped_rows_failure="Yes")
    text = "\n".join(gpu_health.render(sick, "", log, LABELS, 1)) + "\n"
    v = gpu_health.gpu_faults(text)
    assert v.state == "failed"
    assert "Xid 48 (a double bit ECC error) x1 on GPU 00000000:03:00.0: reset the GPU" \
        in v.words()
    assert "Xid 79 (the GPU fell off the bus) x1 on GPU 0 (00000000:00:06.0): reboot" \
        in v.words()
    assert "2 uncorrectable ECC error(s) on GPU 0 (00000000:00:06.0): reset the GPU " \
        "(nvidia-smi -r)" in v.words()
    assert "a row remapping failed on GPU 0 (00000000:00:06.0): replace the GPU" in v.words()


def test_the_hosts_own_verdict_leaves_a_failed_reading_alone():
    """nvidia-smi's silence alone (a driver/library mismatch) fails status.py's verdict, not the
    host's own (the router and the deploy act on its GPUs' faults only)."""
    text = "# TYPE gpuhost_gpu_metrics_ok gauge\ngpuhost_gpu_metrics_ok 0\n"
    assert gpu_health.verdict(**gpu_health.readings(text)).state == "failed"
    assert gpu_health.gpu_faults(text).state == "healthy"
    assert gpu_health.gpu_faults("").state == "healthy"
