"""systemd's sandboxing of every unit the deploy installs (operations/plans/unit_sandbox.py, issue
41): the rendered units, and their exposure as systemd-analyze scores them offline (where this
machine's systemd-analyze has --offline, systemd 250 and later); the e2e twin reads the
sandbox hosts' own scores (tests/e2e/test_tls.py)."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import jinja2
import pytest

from operations.plans.settings import from_host_data
from operations.plans.unit_sandbox import BASE, Sandbox
from operations.stages import (
    gate,
    loopback_guard,
    observability,
    router,
    server_unit,
    systemd_units,
)
from operations.stages.service_users import GATE_USER, SERVER_USER

ROOT = Path(__file__).resolve().parent.parent
ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "templates"))
#: Issue 41's targets (systemd-analyze security's overall exposure).
SERVER_TARGET = 4.9
OTHER_TARGET = 2.5


def render(template: str, context: dict) -> str:
    return ENV.get_template(template).render(**context)


@pytest.fixture
def units(tmp_path) -> dict[str, tuple[str, float]]:
    """Every unit the deploy installs on a public server that routes too, by name: its text
    and its target."""
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n")
    s = from_host_data("gpu1", {"gpuhost_lock": str(lock), "gpuhost_server_host": "0.0.0.0",
                                "gpuhost_api_key_file": "/root/key",
                                "gpuhost_router_api_key_file": "/root/router.key"})
    worker, front = server_unit.worker_gate(s), router.router_gate(s)
    metrics = observability.gpu_metrics_context(15, 8)
    return {
        "sglang.service": (render("sglang.service.j2", server_unit.unit_context(s)), SERVER_TARGET),
        "sglang-router.service": (render("sglang-router.service.j2", router.unit_context(s)),
                                  SERVER_TARGET),
        "sglang-gate.service": (render("gate.service.j2", server_unit.gate_context(s)),
                                OTHER_TARGET),
        "sglang-router-gate.service": (render("gate.service.j2", router.gate_context(s)),
                                       OTHER_TARGET),
        "sglang-gate-keys.service": (
            render("gate-keys.service.j2", gate.path_context(worker, systemd_units.systemd_quote)),
            OTHER_TARGET),
        "sglang-router-gate-keys.service": (
            render("gate-keys.service.j2", gate.path_context(front, systemd_units.systemd_quote)),
            OTHER_TARGET),
        "gpuhost-loopback-guard.service": (loopback_guard.unit(), OTHER_TARGET),
        "gpuhost-metrics-guard.service": (loopback_guard.metrics_unit(), OTHER_TARGET),
        "gpuhost-gpu-metrics.service": (render("gpuhost-gpu-metrics.service.j2", metrics),
                                        OTHER_TARGET),
    }


def service_lines(text: str) -> list[str]:
    section = text.split("[Service]\n", 1)[1].split("\n[", 1)[0]
    return [line for line in section.splitlines() if line and not line.startswith("#")]


def test_every_unit_gets_the_base_sandbox_and_an_explicit_capability_set(units):
    for name, (text, _) in units.items():
        lines = service_lines(text)
        # the GPU readings read the kernel's ring buffer (the driver's Xid lines)
        base = set(BASE) - ({"ProtectKernelLogs=yes"} if name == "gpuhost-gpu-metrics.service"
                            else set())
        assert base <= set(lines), name
        assert sum(line.startswith("CapabilityBoundingSet=") for line in lines) == 1, name
        assert any(line.startswith("RestrictAddressFamilies=") for line in lines), name
        assert "SystemCallFilter=@system-service" in lines, name


def test_the_gpu_units_see_the_gpus_through_device_allow_not_private_devices(units):
    for name in ("sglang.service", "gpuhost-gpu-metrics.service"):
        lines = service_lines(units[name][0])
        assert "PrivateDevices=yes" not in lines, name
        assert "DevicePolicy=closed" in lines, name
        # the open modules' "nvidia" and "nvidiactl", nvidia-uvm, nvidia-caps: one pattern
        assert "DeviceAllow=char-nvidia* rw" in lines, name
    sglang = service_lines(units["sglang.service"][0])
    # the JIT caches stay writable, the JIT compilers may map writable and executable memory
    assert "ReadWritePaths=/var/cache/gpuhost/kernels" in sglang
    assert "MemoryDenyWriteExecute=yes" not in sglang
    assert "Environment=HOME=/var/cache/gpuhost-sglang" in sglang


def test_only_the_gates_the_guards_and_the_gpu_readings_keep_capabilities(units):
    kept = {name: next(line for line in service_lines(text)
                       if line.startswith("CapabilityBoundingSet=")).split("=", 1)[1]
            for name, (text, _) in units.items()}
    assert kept.pop("sglang-gate.service") == "CAP_SETUID CAP_SETGID CAP_CHOWN"
    assert kept.pop("sglang-router-gate.service") == "CAP_SETUID CAP_SETGID CAP_CHOWN"
    assert kept.pop("gpuhost-loopback-guard.service") == "CAP_NET_ADMIN"
    assert kept.pop("gpuhost-metrics-guard.service") == "CAP_NET_ADMIN"
    assert kept.pop("gpuhost-gpu-metrics.service") == "CAP_SYSLOG"  # dmesg: the Xid lines
    assert set(kept.values()) == {""}


def test_the_gates_workers_run_as_their_own_user_with_their_temporary_files_apart():
    s = from_host_data("gpu1", {"gpuhost_server_host": "0.0.0.0",
                                "gpuhost_api_key_file": "/root/key"})
    g = server_unit.worker_gate(s)
    conf = render("gate-nginx.conf.j2", gate.conf_context(g))
    assert f"user {GATE_USER} {GATE_USER};" in conf.splitlines()
    assert "user root;" not in conf
    for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"):
        assert f"    {kind}_temp_path /var/cache/{g.runtime_dir}/{kind};" in conf.splitlines()
    unit = service_lines(render("gate.service.j2", server_unit.gate_context(s)))
    assert f"CacheDirectory={g.runtime_dir}" in unit
    assert "CacheDirectoryMode=0711" in unit  # the workers pass it to their own folders
    assert "RuntimeDirectoryMode=0700" in unit  # what the start read stays root's
    assert "ProtectHome=read-only" in unit  # key files may be anywhere, /root included


def test_the_server_runs_as_its_own_user_and_only_what_reads_root_files_runs_as_root(units):
    lines = service_lines(units["sglang.service"][0])
    assert f"User={SERVER_USER}" in lines and f"Group={SERVER_USER}" in lines
    root = [line for line in lines if line.split("=", 1)[1].startswith(("+", "-+"))]
    # the inputs' digest reads the root-only environment file; nvidia-uvm is loaded as root
    assert [line.split()[1 if "python3" in line else 0].rsplit("/", 1)[-1] for line in root] == [
        "unit_inputs.py", "nvidia-modprobe"]
    starts = [line for line in lines if line.startswith(("ExecStart=", "ExecStartPost="))]
    assert all("=+" not in line for line in starts)  # sglang and its /health poll: its user


def test_the_loopback_guard_admits_the_gates_user_by_name_to_the_ports_behind_the_gates():
    text = loopback_guard.rules((8000, 30000, 30100), {8000: (1001,)},
                                {30000: (GATE_USER,), 30100: (GATE_USER,)})
    lines = [line.strip() for line in text.splitlines()]
    assert ('oifname "lo" tcp dport 30000 meta skuid != { 0, "gpuhost-gate" } reject with tcp '
            'reset' in lines)
    assert ('oifname "lo" tcp dport 30100 meta skuid != { 0, "gpuhost-gate" } reject with tcp '
            'reset' in lines)
    assert 'oifname "lo" tcp dport 8000 meta skuid != { 0, 1001 } reject with tcp reset' in lines
    assert not any("meta skuid != 0" in line for line in lines)


def test_a_sandbox_without_network_has_no_address_at_all():
    lines = Sandbox(network=False).lines()
    assert "PrivateNetwork=yes" in lines and "IPAddressDeny=any" in lines
    assert "PrivateNetwork=yes" not in Sandbox(ip=False).lines()
    assert "IPAddressDeny=any" in Sandbox(ip=False).lines()


def _offline() -> bool:
    if not shutil.which("systemd-analyze"):
        return False
    run = subprocess.run(["systemd-analyze", "security", "--help"], capture_output=True,
                         text=True, check=False)
    return "--offline" in run.stdout


@pytest.mark.skipif(not _offline(), reason="no systemd-analyze security --offline here")
def test_each_unit_meets_its_exposure_target_offline(units, tmp_path):
    scores = {}
    for name, (text, target) in units.items():
        path = tmp_path / name
        path.write_text(text)
        run = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager",
                              str(path)], capture_output=True, text=True, check=False)
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", run.stdout)
        assert found, (name, run.stdout[-500:], run.stderr[-500:])
        scores[name] = (float(found.group(1)), target)
    assert {n: s for n, (s, t) in scores.items() if s > t} == {}, scores


def test_the_gpu_readings_may_read_the_kernel_log_and_nothing_else_may(units):
    """dmesg (operations/files/gpu_metrics.py, the Xid lines) under ProtectKernelLogs=yes gets
    no CAP_SYSLOG, no syslog(2) and no /dev/kmsg (systemd.exec(5)): the GPU readings' unit
    leaves it out and keeps exactly those; every other unit has it."""
    lines = service_lines(units["gpuhost-gpu-metrics.service"][0])
    assert "ProtectKernelLogs=yes" not in lines
    assert "CapabilityBoundingSet=CAP_SYSLOG" in lines and "DeviceAllow=/dev/kmsg r" in lines
    for name, (text, _) in units.items():
        if name != "gpuhost-gpu-metrics.service":
            assert "ProtectKernelLogs=yes" in service_lines(text), name
