"""Our facts on real outputs of the lent H200 machine (tests/fixtures/h200-device/README.md:
2026-11-29, Ubuntu 24.04.3, driver 580.159.04 open module mounted from the host)."""

import json
from pathlib import Path

import pytest
from pyinfra.facts.server import LinuxDistribution

from operations.facts.gpu import NvidiaDriver
from operations.facts.host import AptListsPresent, HeldPackages, HostResources
from operations.facts.nvsmi import parse_p2p_matrix, parse_topology
from operations.stages.mlenv import build_parallelism
from operations.stages.preflight import InitSystem, Virtualization
from operations.stages.secureboot import SecureBoot

REAL = Path(__file__).parent / "fixtures" / "h200-device"


def recorded(name: str) -> tuple[str, list[str], int]:
    """A fixture's command, output lines and exit status."""
    lines = (REAL / f"{name}.txt").read_text().splitlines()
    assert lines[0].startswith("$ ") and lines[-1].startswith("# rc=")
    return lines[0][2:], lines[1:-1], int(lines[-1][len("# rc="):])


@pytest.mark.parametrize(
    "fact",
    [NvidiaDriver, HostResources, HeldPackages, AptListsPresent, InitSystem, Virtualization,
     SecureBoot],
)
def test_fact_commands_are_the_ones_that_ran(fact):
    command, _, rc = recorded(fact.__name__)
    assert str(fact().command()) == command
    assert rc == 0


def test_no_efi_no_secure_boot():
    _, lines, _ = recorded("SecureBoot")
    state = SecureBoot().process(lines)
    assert (state.enabled, state.source) == (False, "none")
    assert state.said == "no EFI: legacy boot, no Secure Boot"


def test_driver_mounted_from_the_host():
    _, lines, _ = recorded("NvidiaDriver")
    state = NvidiaDriver().process(lines)
    assert state.status == "ok"
    assert state.driver_version == "580.159.04"
    (gpu,) = state.gpus
    assert (gpu.name, gpu.compute_capability, gpu.memory_mib) == ("NVIDIA H200", "9.0", 143771)
    _, owner, rc = recorded("nvidia-smi-owner")
    assert rc == 1 and "no path found" in owner[0]


def test_resources_and_build_parallelism():
    _, lines, _ = recorded("HostResources")
    resources = HostResources().process(lines)
    assert resources.cores == 16 and resources.mem_available_gib == pytest.approx(125.32, 0.01)
    p = build_parallelism(resources.cores, resources.mem_available_gib)
    assert (p.max_jobs, p.nvcc_threads, p.thread_bound) == (6, 4, 24)


def test_holds_lists_and_init():
    assert HeldPackages().process(recorded("HeldPackages")[1]) == {
        "libcublas-13-0", "libcublas-dev-13-0", "libcudnn9-cuda-13", "libnccl-dev", "libnccl2"}
    assert AptListsPresent().process(recorded("AptListsPresent")[1]) is False
    assert InitSystem().process(recorded("InitSystem")[1]) == "process_api"
    assert Virtualization().process(recorded("Virtualization")[1]) == "unknown"


def test_os():
    _, lines, _ = recorded("LinuxDistribution")
    distro = LinuxDistribution().process(lines)
    assert distro["release_meta"]["ID"] == "ubuntu"
    assert distro["release_meta"]["VERSION_ID"] == "24.04"


def test_topology_and_p2p_single_gpu():
    topo = parse_topology(recorded("topo-m")[1])
    assert topo.links.gpus == ("GPU0",) and topo.cpu_affinity == ("0-15",)
    for name in ("topo-p2p-r", "topo-p2p-w"):
        assert parse_p2p_matrix(recorded(name)[1]).pairs() == []


def test_p2p_check_said_no_pairs():
    record = json.loads((REAL / "p2p.json").read_text())
    assert record["decision"]["p2p"] == "n/a"
    assert record["measured_on"]["driver_version"] == "580.159.04"


def test_dry_run_planned_or_refused_every_stage():
    text = (REAL / "dry-run.txt").read_text()
    assert "Traceback" not in text
    assert "driver installed 580.159.04 by no package (kept)" in text
    assert "kept as it is (gpuhost_unpackaged_driver = 'keep')" in text
    assert "no reboot" in text
    assert "NVIDIA driver and CUDA toolkit | CUDA toolkit 12.8" in text
    assert "SGLang server: refused: PID 1 is 'process_api', not systemd" in text
    assert "(MAX_JOBS=6, NVCC_THREADS=4, arch 90)" in text
    assert "P2P | Measure P2P between GPUs" in text


def test_torch_calls_of_the_p2p_check_on_real_torch():
    text = (REAL / "torch-probe.txt").read_text()
    assert "torch 2.11.0+cu130 devices 1" in text
    assert "equal after corruption False" in text
    assert "all-reduce 1 rank True" in text
