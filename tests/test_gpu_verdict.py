"""operations/plans/gpu_verdict.py: the server stage's refusal on failed GPUs, from the host's GPU
textfile as gpu_metrics.py writes it (the nvidia-smi outputs of a real H100, the capture in
tests/fixtures/h100-device/health/, with the faults a healthy GPU never shows)."""

from __future__ import annotations

from operations.plans import gpu_verdict
from operations.files import gpu_health
from tests.test_gpu_health import LABELS, XID_79, health_line


def textfile(health: str, log: str = "", expected: int = 1) -> str:
    return "\n".join(gpu_health.render(health, "", log, LABELS, expected)) + "\n"


def test_healthy_or_unread_gpus_are_not_refused():
    assert gpu_verdict.restart_refusal("gpu2", None, "restarted") is None
    assert gpu_verdict.restart_refusal("gpu2", textfile(health_line()), "restarted") is None
    # degraded (a remap pending) is served on, and restarted
    assert gpu_verdict.restart_refusal(
        "gpu2", textfile(health_line(remapped_rows_pending="Yes")), "restarted") is None


def test_a_fatal_xid_refuses_the_restart_naming_host_gpu_reason_and_what_to_do():
    said = gpu_verdict.restart_refusal("gpu2", textfile(health_line(), XID_79 + "\n"),
                                       "restarted")
    assert said == ("gpu2's GPUs failed, so its server is not restarted: Xid 79 (the GPU fell "
                    "off the bus) x1 on GPU 0 (00000000:00:06.0): reboot the host; reseat or "
                    "replace the GPU if it recurs. Drain it, then reset the GPU (nvidia-smi -r "
                    "-i <GPU>), reboot the host or replace the GPU as said, and deploy again "
                    "once status.py says its GPUs are healthy")
    assert "\n" not in said


def test_a_missing_gpu_and_an_uncorrectable_ecc_error_refuse_a_start():
    said = gpu_verdict.restart_refusal(
        "gpu1", textfile(health_line(ecc_errors_uncorrected_volatile_total="3"), expected=2),
        "started")
    assert said is not None and said.startswith("gpu1's GPUs failed, so its server is not "
                                                 "started: 1 of 2 GPUs seen by the driver: "
                                                 "reboot the host")
    assert "3 uncorrectable ECC error(s) on GPU 0 (00000000:00:06.0): reset the GPU" in said


def test_the_paths_the_units_share():
    from operations.plans.settings import from_host_data
    from operations.stages import observability
    from operations.stages.server_unit import worker_gate

    context = observability.gpu_metrics_context(5, 8)
    assert context["failed_file"] == gpu_verdict.FAILED_FILE == \
        f"/run/{context['runtime_dir']}/failed"
    s = from_host_data("gpu1", {"gpuhost_server_host": "10.0.0.5",
                                "gpuhost_api_key_file": "/root/k"})
    assert worker_gate(s).failed_file == gpu_verdict.FAILED_FILE


def test_the_server_stage_reads_the_gpus_only_before_a_start_or_restart(monkeypatch):
    """A run that leaves the server alone neither reads the GPU textfile nor is refused; a
    restart or a start on failed GPUs is refused under the server stage's name."""
    read, refused = [], []
    failed = textfile(health_line(), XID_79 + "\n")
    monkeypatch.setattr(gpu_verdict, "fact", lambda cls, **kw: read.append(kw) or failed)
    monkeypatch.setattr(gpu_verdict, "refuse", lambda stage, said: refused.append((stage, said)))
    monkeypatch.setattr(gpu_verdict, "host", type("H", (), {"name": "gpu2"})())
    gpu_verdict.refusal(running=True, changes=False)
    assert read == [] and refused == []
    gpu_verdict.refusal(running=True, changes=True)
    gpu_verdict.refusal(running=False, changes=False)
    assert read == [{"path": gpu_verdict.GPU_METRICS_FILE}] * 2
    assert [(stage, said.split(": ", 1)[0]) for stage, said in refused] == [
        ("SGLang server", "gpu2's GPUs failed, so its server is not restarted"),
        ("SGLang server", "gpu2's GPUs failed, so its server is not started")]
