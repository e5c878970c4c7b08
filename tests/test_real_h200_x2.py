"""The P2P facts, check and decision on real outputs of two NVLinked H200s (the device tool's
nvidia-h200-x2; tests/fixtures/h200-x2-device/README.md: 2026-11-30, driver 580.159.04,
torch 2.11.0+cu130, NCCL 2.28.9)."""

import json
from pathlib import Path

import pytest

from operations.facts.gpu import NvidiaDriver
from operations.facts.host import HostResources
from operations.facts.nvsmi import parse_p2p_matrix, parse_topology
from operations.plans.p2p_policy import BASE_ENV, NO_P2P_ENV, P2P_DISABLED_ENV, decide, env_file
from operations.stages.mlenv import build_parallelism

REAL = Path(__file__).parent / "fixtures" / "h200-x2-device"


def recorded(name: str) -> list[str]:
    """A fixture's output lines, without its ``$ command`` and ``# rc=0`` lines."""
    lines = (REAL / f"{name}.txt").read_text().splitlines()
    assert lines[0].startswith("$ ") and lines[-1] == "# rc=0"
    return lines[1:-1]


def test_two_h200s_on_one_driver():
    state = NvidiaDriver().process(recorded("NvidiaDriver"))
    assert state.status == "ok" and state.driver_version == "580.159.04"
    assert [(g.index, g.name, g.compute_capability, g.memory_mib, g.power_limit_w)
            for g in state.gpus] == [(0, "NVIDIA H200", "9.0", 143771, 700.0),
                                     (1, "NVIDIA H200", "9.0", 143771, 700.0)]


def test_nvlink_topology_and_p2p_status():
    topo = parse_topology(recorded("topo-m"))
    assert topo.links.pairs() == [("GPU0", "GPU1", "NV18")]
    assert topo.cpu_affinity == ("0-31", "0-31") and topo.numa_affinity == ("0", "0")
    for name in ("topo-p2p-r", "topo-p2p-w"):
        assert parse_p2p_matrix(recorded(name)).pairs() == [("GPU0", "GPU1", "OK")]


def test_the_check_verified_p2p_and_the_decision_is_on():
    record = json.loads((REAL / "p2p.json").read_text())
    verification = record["verification"]
    assert verification["verified"] is True
    assert [(p["src"], p["dst"], p["peer_access"], p["intact"]) for p in verification["pairs"]] == [
        (0, 1, True, True), (1, 0, True, True)]
    reduce = verification["all_reduce"]
    assert reduce["gpus"] == 2 and reduce["intact"] and reduce["expected"] == 3.0
    assert reduce["env"]["NCCL_NVLS_ENABLE"] == "0"  # multicast off, as the device tool asks
    # Today's policy, fed the recorded matrices and verification, decides what the host got.
    decision = decide([list(r) for r in record["p2p_read"]], [list(r) for r in record["p2p_write"]],
                      verification["verified"], record["override"])
    assert json.loads(json.dumps(decision.to_json())) == record["decision"]
    assert (decision.p2p, decision.env, decision.server_args) == ("on", BASE_ENV, ())
    assert (REAL / "p2p.env").read_text() == env_file(decision)
    printed = (REAL / "p2p-check.txt").read_text()
    assert "P2P on: every GPU pair reports P2P OK (verified by peer copies" in printed
    assert "p2p_check exit status: 0" in printed


def nccl_runs() -> dict[str, tuple[dict, set[str]]]:
    """nccl-env.txt as {environment name: (the probe's result, NCCL's transports on rank 0)}."""
    runs, transports = {}, set()
    for line in (REAL / "nccl-env.txt").read_text().splitlines():
        if line.startswith("{"):
            result = json.loads(line)
            runs[result["env"]] = (result, transports)
            transports = set()
        elif " via " in line:
            transports.add(line.split(" via ", 1)[1])
    return runs


def test_phb_alone_keeps_nccl_on_p2p_and_p2p_disable_takes_it_off():
    runs = nccl_runs()
    assert set(runs) == {"on", "off", "off, P2P disabled"}
    for result, _ in runs.values():
        assert result["verified"] and result["all_reduce"]["intact"]
        assert result["all_reduce"]["env"]["NCCL_NVLS_ENABLE"] == "0"

    def nccl(result):
        return {k: v for k, v in result["all_reduce"]["env"].items()
                if k not in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS", "NCCL_NVLS_ENABLE")}

    assert nccl(runs["on"][0]) == BASE_ENV and runs["on"][1] == {"P2P/CUMEM"}
    # The reference launch's four: NCCL still goes peer-to-peer where the driver says OK ...
    assert nccl(runs["off"][0]) == NO_P2P_ENV and runs["off"][1] == {"P2P/CUMEM"}
    # ... which is why the policy adds NCCL_P2P_DISABLE=1 where P2P must not be used.
    assert nccl(runs["off, P2P disabled"][0]) == P2P_DISABLED_ENV
    assert runs["off, P2P disabled"][1] == {"SHM/direct/direct"}
    assert decide([["X", "OK"], ["OK", "X"]], [["X", "OK"], ["OK", "X"]], False).env == \
        P2P_DISABLED_ENV


def test_dry_run_on_the_two_gpu_host():
    text = (REAL / "dry-run.txt").read_text()
    assert "2 x NVIDIA H200, driver 580.159.04" in text
    assert "Preflight: refused" not in text
    assert "P2P will be measured" in text
    assert text.rstrip().endswith("dry rc=0")


def test_build_parallelism_on_32_cores():
    resources = HostResources().process(recorded("HostResources"))
    assert (resources.cores, resources.mem_available_gib) == (32, pytest.approx(251.14, 0.01))
    p = build_parallelism(resources.cores, resources.mem_available_gib)
    assert (p.max_jobs, p.nvcc_threads) == (12, 4)
