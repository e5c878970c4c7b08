"""nvidia-smi parsers on real outputs (tests/fixtures/h200-1gpu) and outputs in the same
format for 2 and 8 GPUs."""

import pytest

from operations.facts import nvsmi
from operations.facts.gpu import NvidiaDriver
from tests.conftest import command_output

ESC_U, ESC_0 = "\x1b[4m", "\x1b[0m"
LEGEND = ["", "Legend:", "", "  X    = Self", "  OK   = Status Ok", "  NS   = Not supported"]


def p2p_output(codes: list[list[str]]) -> list[str]:
    """A ``topo -p2p`` output laid out as the real tool lays out the 1-GPU fixture."""
    n = len(codes)
    header = " \t" + ESC_U + "".join(f"GPU{i}\t" for i in range(n)) + ESC_0
    rows = [f" GPU{i}\t" + "".join(f"{c}\t" for c in row) for i, row in enumerate(codes)]
    return [header, *rows, *LEGEND]


def matrix(n: int, code: str) -> list[list[str]]:
    return [["X" if i == j else code for j in range(n)] for i in range(n)]


def query_line_from_fixture(text: str) -> str:
    """Reorder the fixture's real --query-gpu line into QUERY_FIELDS' order."""
    command = text.splitlines()[0]
    fields = command.split("--query-gpu=")[1].split(" ")[0].split(",")
    values = text.splitlines()[1].split(", ")
    by_field = dict(zip(fields, values, strict=True))
    return ", ".join(by_field[f] for f in nvsmi.QUERY_FIELDS)


def test_query_gpu_real_h200(fixture_text):
    line = query_line_from_fixture(fixture_text("h200-1gpu/query-gpu.txt"))
    (gpu,) = nvsmi.parse_query_gpu([line])
    assert gpu.name == "NVIDIA H200"
    assert gpu.memory_mib == 143771
    assert gpu.power_limit_w == 700.0
    assert gpu.max_sm_clock_mhz == 1980
    assert gpu.compute_capability == "9.0"
    assert gpu.driver_version == "580.159.04"
    assert gpu.uuid == "GPU-344a91d1-8a67-8c10-7320-3e39f3672a46"


def test_query_gpu_not_supported_values():
    line = "0, NVIDIA RTX PRO 6000 Blackwell Server Edition, GPU-1, 00000000:01:00.0, " \
           "580.95.05, 97887, [N/A], [N/A], 12.0"
    (gpu,) = nvsmi.parse_query_gpu([line])
    assert gpu.power_limit_w is None and gpu.max_sm_clock_mhz is None


def test_query_gpu_bad_line_names_it():
    with pytest.raises(nvsmi.ParseError, match="expected 9 fields, got 2 in line 'a, b'"):
        nvsmi.parse_query_gpu(["a, b"])


def test_driver_state_ok(fixture_text):
    line = query_line_from_fixture(fixture_text("h200-1gpu/query-gpu.txt"))
    state = NvidiaDriver().process([line, "rc=0"])
    assert state.status == "ok" and state.driver_version == "580.159.04"
    assert len(state.gpus) == 1


@pytest.mark.parametrize(
    ("lines", "status", "library"),
    [
        (["rc=127"], "absent", None),
        (["NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
          "Make sure that the latest NVIDIA driver is installed and running.", "", "rc=9"],
         "not-loaded", None),
        (["Failed to initialize NVML: Driver/library version mismatch",
          "NVML library version: 580.105", "rc=18"], "mismatch", "580.105"),
        (["No devices were found", "rc=6"], "error", None),
    ],
)
def test_driver_states(lines, status, library):
    state = nvsmi.parse_driver_state(lines)
    assert state.status == status
    assert state.library_version == library
    assert state.gpus == ()


def test_driver_state_without_status_line():
    with pytest.raises(nvsmi.ParseError, match="no exit status line"):
        nvsmi.parse_driver_state(["something"])


@pytest.mark.parametrize("flag", ["r", "w", "n", "a", "p"])
def test_p2p_real_single_gpu(fixture_text, flag):
    lines = command_output(fixture_text("h200-1gpu/topo-p2p.txt"), f"nvidia-smi topo -p2p {flag}")
    m = nvsmi.parse_p2p_matrix(lines)
    assert m.gpus == ("GPU0",)
    assert m.cells == (("X",),)
    assert m.pairs() == []


@pytest.mark.parametrize(("n", "code"), [(2, "OK"), (2, "CNS"), (8, "NS"), (8, "OK")])
def test_p2p_multi_gpu(n, code):
    m = nvsmi.parse_p2p_matrix(p2p_output(matrix(n, code)))
    assert len(m.gpus) == n
    assert len(m.pairs()) == n * (n - 1) // 2
    assert {c for _, _, c in m.pairs()} == {code}


def test_p2p_unknown_code_names_command_and_line():
    lines = p2p_output([["X", "MAYBE"], ["MAYBE", "X"]])
    with pytest.raises(nvsmi.ParseError, match=r"nvidia-smi topo -p2p r: unknown status code.*GPU0"):
        nvsmi.parse_p2p_matrix(lines)


def test_p2p_garbage():
    with pytest.raises(nvsmi.ParseError, match="nvidia-smi topo -p2p w: bad header line"):
        nvsmi.parse_p2p_matrix(["Failed to initialize NVML"], "nvidia-smi topo -p2p w")
    with pytest.raises(nvsmi.ParseError, match="no matrix"):
        nvsmi.parse_p2p_matrix([])


def test_topology_real_single_gpu(fixture_text):
    topo = nvsmi.parse_topology(fixture_text("h200-1gpu/topo-m.txt").splitlines())
    assert topo.links.gpus == ("GPU0",)
    assert topo.cpu_affinity == ("0-15",)
    assert topo.numa_affinity == ("0",)


def test_topology_eight_gpus_phb():
    header = "\t" + ESC_U + "".join(f"GPU{i}\t" for i in range(8)) + \
        "CPU Affinity\tNUMA Affinity\tGPU NUMA ID" + ESC_0
    rows = [
        f"GPU{i}\t" + "\t".join(" X " if i == j else "PHB" for j in range(8)) + "\t0-31\t0\t\tN/A"
        for i in range(8)
    ]
    topo = nvsmi.parse_topology([header, *rows, "", "Legend:"])
    assert len(topo.links.pairs()) == 28
    assert {c for _, _, c in topo.links.pairs()} == {"PHB"}
    assert topo.cpu_affinity == ("0-31",) * 8


def test_topology_unknown_link():
    header = "\t" + ESC_U + "GPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID" + ESC_0
    rows = ["GPU0\t X \tWARP\t0-1\t0\t\tN/A", "GPU1\tWARP\t X \t0-1\t0\t\tN/A"]
    with pytest.raises(nvsmi.ParseError, match="unknown link type 'WARP'"):
        nvsmi.parse_topology([header, *rows])


def test_topology_two_gpus_behind_one_switch():
    header = "\t" + ESC_U + "GPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID" + ESC_0
    rows = ["GPU0\t X \tPIX\t0-31\t0\t\tN/A", "GPU1\tPIX\t X \t0-31\t0\t\tN/A"]
    topo = nvsmi.parse_topology([header, *rows, "", "Legend:"])
    assert topo.links.pairs() == [("GPU0", "GPU1", "PIX")]
    assert topo.numa_affinity == ("0", "0")


def test_bad_line_is_quoted_as_printed():
    lines = p2p_output([["X", "OK"], ["OK", "X", "OK"]])
    with pytest.raises(nvsmi.ParseError) as exc:
        nvsmi.parse_p2p_matrix(lines, "nvidia-smi topo -p2p w")
    assert str(exc.value) == "nvidia-smi topo -p2p w: bad line 'GPU1\\tOK\\tX\\tOK'"


@pytest.mark.parametrize("scenario", ["q35-cns", "p2p-ok-wrong-data", "reference-lab",
                                      "bare-metal-p2p"])
def test_standin_outputs_for_2_and_8_gpus_parse(tmp_path, scenario):
    """The sandbox's nvidia-smi prints topo -m and -p2p in the real tool's format (escape
    sequences included): the parsers read back the scenario's matrices."""
    import json
    import os
    import subprocess
    import sys

    from sandbox import nvidia_repo, scenarios

    hardware = scenarios.load(scenario)
    (tmp_path / "hw.json").write_text(json.dumps(hardware))
    (tmp_path / "loaded").write_text("580.95.05\n")
    smi = tmp_path / "nvidia-smi"
    smi.write_text(nvidia_repo.render("nvidia-smi", VERSION="580.95.05"))
    env = {**os.environ, "GPUHOST_SANDBOX_HARDWARE": str(tmp_path / "hw.json"),
           "GPUHOST_SANDBOX_LOADED": str(tmp_path / "loaded")}

    def run(*args):
        out = subprocess.run([sys.executable, str(smi), *args], env=env, capture_output=True,
                             text=True, check=True).stdout
        assert "\x1b[4m" in out  # the underlined header, as the real tool prints it
        return out.splitlines()

    topo = nvsmi.parse_topology(run("topo", "-m"))
    assert [list(r) for r in topo.links.cells] == hardware["topology"]
    assert len(topo.cpu_affinity) == len(hardware["gpus"])
    for kind in ("r", "w"):
        m = nvsmi.parse_p2p_matrix(run("topo", "-p2p", kind), f"nvidia-smi topo -p2p {kind}")
        assert [list(r) for r in m.cells] == hardware["p2p"][kind]
