"""The sandbox lab's stand-ins, without root or hosts: scenarios, the nvidia-smi stand-in against
the real outputs in tests/fixtures/h200-1gpu, the NVIDIA apt repository, the package index, and
the torch / sglang / flash-attn stand-ins."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from sandbox import nvidia_repo, pypi_index, scenarios

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "h200-1gpu"
PYTHON = sys.executable


def fixture_output(name: str, command: str) -> str:
    """What a fixture recorded for `$ command`, up to its `# rc=` line, newlines kept."""
    lines = (FIXTURES / name).read_text().splitlines(keepends=True)
    start = lines.index(f"$ {command}\n") + 1
    end = next(i for i in range(start, len(lines)) if lines[i].startswith("# rc="))
    return "".join(lines[start:end])


# --- scenarios ---------------------------------------------------------------------------------


def test_scenario_names():
    assert {"reference-lab", "bare-metal-p2p", "q35-cns", "single-gpu"} <= set(scenarios.names())
    for name in scenarios.names():
        assert json.loads(scenarios.hardware_json(name))["scenario"] == name


def test_unknown_scenario_names_it_and_the_allowed_ones():
    with pytest.raises(scenarios.ScenarioError) as exc:
        scenarios.hardware_json("h100-lab")
    assert "'h100-lab'" in str(exc.value)
    for name in scenarios.names():
        assert name in str(exc.value)


def test_reference_lab_is_the_reference_lab():
    hw = json.loads(scenarios.hardware_json("reference-lab"))
    assert len(hw["gpus"]) == 8
    for gpu in hw["gpus"]:
        assert gpu["name"] == "NVIDIA RTX PRO 6000 Blackwell Server Edition"
        assert (gpu["compute_cap"], gpu["memory_total_mib"], gpu["power_limit_w"]) == (
            "12.0",
            97887,
            600.0,
        )
        assert gpu["clocks_max_sm_mhz"] == 2430
    off_diagonal = {v for i, row in enumerate(hw["topology"]) for j, v in enumerate(row) if i != j}
    assert off_diagonal == {"PHB"}
    for kind in ("r", "w"):
        assert {
            v for i, row in enumerate(hw["p2p"][kind]) for j, v in enumerate(row) if i != j
        } == {"NS"}
    assert hw["virtualization"]["systemd_detect_virt"] == "kvm"
    assert hw["virtualization"]["dmi"]["sys_vendor"] == "QEMU"


def test_p2p_scenarios():
    bare = json.loads(scenarios.hardware_json("bare-metal-p2p"))
    assert len(bare["gpus"]) == 8
    assert {v for i, row in enumerate(bare["p2p"]["r"]) for j, v in enumerate(row) if i != j} == {
        "OK"
    }
    cns = json.loads(scenarios.hardware_json("q35-cns"))
    assert len(cns["gpus"]) == 2 and cns["p2p"]["r"][0][1] == cns["p2p"]["w"][1][0] == "CNS"


def test_a_bad_scenario_file_is_named(tmp_path, monkeypatch):
    raw = json.loads((scenarios.SCENARIO_DIR / "q35-cns.json").read_text())
    raw["topology"][0][1] = "PCIE"
    (tmp_path / "broken.json").write_text(json.dumps(raw))
    monkeypatch.setattr(scenarios, "SCENARIO_DIR", tmp_path)
    with pytest.raises(
        scenarios.ScenarioError, match=r"scenario 'broken': topology\[0\]\[1\] = 'PCIE'"
    ):
        scenarios.load("broken")


# --- nvidia-smi --------------------------------------------------------------------------------


@pytest.fixture
def smi(tmp_path):
    """Run the nvidia-smi stand-in of a driver version against a scenario, loaded as asked."""

    def run(*args, scenario="single-gpu", version="580.159.04", loaded="580.159.04", flavour=None):
        script = tmp_path / f"nvidia-smi-{version}"
        script.write_text(nvidia_repo.render("nvidia-smi", VERSION=version))
        (tmp_path / "hardware.json").write_text(scenarios.hardware_json(scenario))
        state = tmp_path / "run"
        shutil.rmtree(state, ignore_errors=True)
        state.mkdir()
        if loaded:
            (state / "loaded-version").write_text(loaded + "\n")
        if flavour:
            (state / "loaded-flavour").write_text(flavour + "\n")
        env = dict(
            os.environ,
            GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hardware.json"),
            GPUHOST_SANDBOX_LOADED=str(state / "loaded-version"),
        )
        return subprocess.run(
            [PYTHON, str(script), *args], capture_output=True, text=True, env=env, check=False
        )

    return run


def test_summary_table_is_the_real_one(smi):
    out = smi()
    assert out.returncode == 0
    real = fixture_output("nvidia-smi.txt", "nvidia-smi").splitlines(keepends=True)
    lines = out.stdout.splitlines(keepends=True)
    # the first line is the time, "Sun Nov 29 09:50:26 2026" and 7 spaces
    assert re.fullmatch(r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4} {7}\n", lines[0])
    assert lines[1:] == real[1:]


def test_list_query_topology_are_the_real_ones(smi):
    assert smi("-L").stdout == fixture_output("nvidia-smi-L.txt", "nvidia-smi -L")
    fields = (
        "index,name,uuid,pci.bus_id,driver_version,memory.total,power.limit,"
        "power.max_limit,power.draw,clocks.sm,clocks.max.sm,utilization.gpu,"
        "temperature.gpu,compute_cap,persistence_mode"
    )
    command = f"nvidia-smi --query-gpu={fields} --format=csv,noheader,nounits"
    assert smi(f"--query-gpu={fields}", "--format=csv,noheader,nounits").stdout == fixture_output(
        "query-gpu.txt", command
    )
    topo = smi("topo", "-m").stdout
    assert topo == fixture_output("topo-m.txt", "nvidia-smi topo -m")
    assert topo.startswith("\t\x1b[4mGPU0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n")
    for kind in "rwnap":
        assert smi("topo", "-p2p", kind).stdout == fixture_output(
            "topo-p2p.txt", f"nvidia-smi topo -p2p {kind}"
        )


def test_version_and_header_with_units(smi):
    # shared/fixtures/h200-1gpu/system2.txt, "== nvidia-smi version" and "== query extra"
    assert smi("--version").stdout == (
        "NVIDIA-SMI version  : 580.159.04\nNVML version        : 580.159\n"
        "DRIVER version      : 580.159.04\nCUDA Version        : 13.0\n"
    )
    out = smi(
        "--query-gpu=index,pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,"
        "pcie.link.width.current,pcie.link.width.max,clocks_throttle_reasons.active,"
        "power.draw,enforced.power.limit,memory.used,ecc.mode.current,mig.mode.current,"
        "vbios_version",
        "--format=csv",
    ).stdout.splitlines()
    assert out[0] == (
        "index, pci.bus_id, pcie.link.gen.current, pcie.link.gen.max, "
        "pcie.link.width.current, pcie.link.width.max, clocks_event_reasons.active, "
        "power.draw [W], enforced.power.limit [W], memory.used [MiB], "
        "ecc.mode.current, mig.mode.current, vbios_version"
    )
    assert out[1] == (
        "0, 00000000:00:06.0, 5, 5, 16, 16, 0x0000000000000001, 136.42 W, "
        "700.00 W, 0 MiB, Enabled, Disabled, 96.00.A5.00.1A"
    )


def test_eight_gpus_of_the_reference_lab(smi):
    p2p = smi("topo", "-p2p", "r", scenario="reference-lab").stdout.splitlines()
    assert p2p[0] == " \t\x1b[4m" + "".join(f"GPU{i}\t" for i in range(8)) + "\x1b[0m"
    for i in range(8):
        assert p2p[1 + i] == f" GPU{i}\t" + "".join("X\t" if j == i else "NS\t" for j in range(8))
    topo = smi("topo", "-m", scenario="reference-lab").stdout.splitlines()
    assert topo[1] == "GPU0\t X \t" + "PHB\t" * 7 + "0-127\t0\t\tN/A"
    csv = smi(
        "--query-gpu=index,name,compute_cap,memory.total,power.limit,clocks.max.sm",
        "--format=csv",
        scenario="reference-lab",
    ).stdout.splitlines()
    assert (
        csv[0]
        == "index, name, compute_cap, memory.total [MiB], power.limit [W], clocks.max.sm [MHz]"
    )
    assert csv[1:] == [
        f"{i}, NVIDIA RTX PRO 6000 Blackwell Server Edition, 12.0, 97887 MiB, 600.00 W, 2430 MHz"
        for i in range(8)
    ]
    table = smi(scenario="reference-lab").stdout.splitlines()
    assert (
        "|   7  NVIDIA RTX PRO 6000 Blac...    On  |   00000000:08:00.0 Off |"
        "                    0 |" in table
    )
    assert len([line for line in table if "RTX PRO 6000" in line]) == 8
    assert all(len(line) == 91 for line in table[1:] if line)


def test_driver_library_mismatch(smi):
    out = smi(version="580.105.08", loaded="580.95.05")
    assert out.returncode == 18
    assert out.stdout == (
        "Failed to initialize NVML: Driver/library version mismatch\n"
        "NVML library version: 580.105\n"
    )


def test_no_driver_loaded(smi):
    out = smi("-L", loaded=None)
    assert out.returncode == 9
    assert out.stdout == (
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA "
        "driver. Make sure that the latest NVIDIA driver is installed and "
        "running.\n"
    )


def test_proprietary_module_sees_no_blackwell(smi):
    out = smi(scenario="reference-lab", flavour="proprietary")
    assert (out.returncode, out.stdout) == (6, "No devices were found\n")
    assert smi("-L", flavour="proprietary").returncode == 0  # Hopper runs either flavour


def test_bad_arguments(smi):
    out = smi("--query-gpu=index,bogus", "--format=csv")
    assert (out.returncode, out.stdout) == (2, 'Field "bogus" is not a valid field to query.\n')
    out = smi("--bogus")
    assert out.returncode == 2 and "--bogus is not recognized" in out.stdout
    assert smi("topo", "-p2p", "x").returncode == 2


# --- the NVIDIA repository ---------------------------------------------------------------------

needs_repo_tools = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("dpkg-deb", "apt-ftparchive", "gpg", "gpgv")),
    reason="needs dpkg-deb, apt-ftparchive (apt-utils), gpg and gpgv",
)
KERNEL = "6.1.0-99-amd64"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("repo")
    result = nvidia_repo.build(base / "www", KERNEL, gnupg_home=base / "gnupg", apt_archives=None)
    return base, result, base / "www" / nvidia_repo.CUDA_REPO_DIR.strip("/")


def _stanzas(text: str) -> list[dict[str, str]]:
    out = []
    for block in text.strip().split("\n\n"):
        fields = dict(re.findall(r"^([A-Za-z-]+): (.*)$", block, flags=re.MULTILINE))
        out.append(fields)
    return out


@needs_repo_tools
def test_repository_lists_every_package(repo):
    _, result, repo_dir = repo
    listed = {(s["Package"], s["Version"]) for s in _stanzas((repo_dir / "Packages").read_text())}
    keyring = (repo_dir / "cuda-archive-keyring.gpg").read_bytes()
    expected = {(d.name, d.version) for d in nvidia_repo.packages(KERNEL, keyring)}
    assert listed == expected
    for name in (
        "nvidia-open",
        "nvidia-driver",
        "libnvidia-ml1",
        "nvidia-smi",
        "nvidia-kernel-open-dkms",
        "nvidia-kernel-dkms",
    ):
        for version in ("570.172.08-1", "580.95.05-1", "580.105.08-1"):
            assert (name, version) in listed
    for pkg in (
        ("cuda-keyring", "1.1-1"),
        ("cuda-toolkit-12-8", "12.8.1-1"),
        ("cuda-toolkit-13-0", "13.0.2-1"),
        (f"linux-headers-{KERNEL}", "6.1.0-1"),
    ):
        assert pkg in listed
    assert result["keyring_sha256"] == hashlib.sha256(keyring).hexdigest()


@needs_repo_tools
def test_repository_is_signed_and_cached(repo):
    base, result, repo_dir = repo
    keyring = str(repo_dir / "cuda-archive-keyring.gpg")
    for args in (["InRelease"], ["Release.gpg", "Release"]):
        subprocess.run(
            ["gpgv", "--keyring", keyring, *[str(repo_dir / a) for a in args]],
            check=True,
            capture_output=True,
        )
    release = (repo_dir / "Release").read_text()
    assert "Label: NVIDIA CUDA" in release
    assert hashlib.sha256((repo_dir / "Packages.gz").read_bytes()).hexdigest() in release
    before = (repo_dir / "InRelease").stat().st_mtime_ns, (repo_dir / "InRelease").read_bytes()
    assert (
        nvidia_repo.build(base / "www", KERNEL, gnupg_home=base / "gnupg", apt_archives=None)
        == result
    )
    assert (
        (repo_dir / "InRelease").stat().st_mtime_ns,
        (repo_dir / "InRelease").read_bytes(),
    ) == before


@needs_repo_tools
def test_debs_are_reproducible(repo, tmp_path):
    base, result, repo_dir = repo
    # a host's apt cache holding one stale stand-in and one current one
    archives = tmp_path / "apt-archives"
    archives.mkdir()
    (archives / "nvidia-smi_580.95.05-1_amd64.deb").write_bytes(b"an older stand-in")
    current = archives / "cuda-keyring_1.1-1_all.deb"
    current.write_bytes((repo_dir / current.name).read_bytes())
    again = nvidia_repo.build(
        tmp_path / "www", KERNEL, gnupg_home=base / "gnupg", apt_archives=archives
    )
    assert again == result
    other = tmp_path / "www" / nvidia_repo.CUDA_REPO_DIR.strip("/")
    for deb in repo_dir.glob("*.deb"):
        assert (other / deb.name).read_bytes() == deb.read_bytes(), deb.name
    assert [p.name for p in archives.iterdir()] == [current.name]


@needs_repo_tools
def test_installed_standins_answer(repo, tmp_path):
    _, _, repo_dir = repo
    root = tmp_path / "root"
    for deb in (
        "nvidia-smi_580.105.08-1_amd64.deb",
        "cuda-nvcc-12-8_12.8.93-1_amd64.deb",
        "cuda-nvcc-13-0_13.0.88-1_amd64.deb",
        "cuda-cuobjdump-13-0_13.0.85-1_amd64.deb",
        "cuda-keyring_1.1-1_all.deb",
        f"linux-headers-{KERNEL}_6.1.0-1_amd64.deb",
    ):
        subprocess.run(["dpkg-deb", "-x", str(repo_dir / deb), str(root)], check=True)
    nvcc = subprocess.run(
        [str(root / "usr/local/cuda-12.8/bin/nvcc"), "--version"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert nvcc.splitlines()[3] == "Cuda compilation tools, release 12.8, V12.8.93"
    nvcc13 = subprocess.run(
        [str(root / "usr/local/cuda-13.0/bin/nvcc"), "-V"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert nvcc13 == fixture_like_nvcc_13()
    cuobjdump = str(root / "usr/local/cuda-13.0/bin/cuobjdump")
    standin_so = tmp_path / "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu.so"
    standin_so.write_text("gpuhost sandbox stand-in shared object\n"
                          '{"cubins": ["sm_90", "sm_120"]}\n')
    listed = subprocess.run([cuobjdump, "--list-elf", str(standin_so)], capture_output=True,
                            text=True, check=True).stdout
    # the real one's lines (tests/fixtures/h200-device/cuobjdump-list-elf.txt)
    stem = "flash_attn_2_cuda.cpython-311-x86_64-linux-gnu"
    assert listed == (f"ELF file    1: {stem}.1.sm_90.cubin\n"
                      f"ELF file    2: {stem}.2.sm_120.cubin\n")
    (tmp_path / "plain.so").write_bytes(b"\x7fELF")
    plain = subprocess.run([cuobjdump, "--list-elf", str(tmp_path / "plain.so")],
                           capture_output=True, text=True, check=False)
    assert plain.returncode == 255
    assert plain.stderr == (f"cuobjdump info    : File '{tmp_path / 'plain.so'}' does not "
                            "contain device code\n")
    (tmp_path / "hw.json").write_text(scenarios.hardware_json("q35-cns"))
    (tmp_path / "loaded").write_text("580.105.08\n")
    out = subprocess.run(
        [str(root / "usr/bin/nvidia-smi"), "-L"],
        capture_output=True,
        text=True,
        check=False,
        env=dict(
            os.environ,
            GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hw.json"),
            GPUHOST_SANDBOX_LOADED=str(tmp_path / "loaded"),
        ),
    )
    assert out.returncode == 0 and out.stdout.count("NVIDIA RTX PRO 6000") == 2
    source = (root / "etc/apt/sources.list.d/cuda-debian12-x86_64.list").read_text()
    assert source.startswith("deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] http://")
    assert source.rstrip().endswith("/compute/cuda/repos/debian12/x86_64/ /")
    assert (root / "lib/modules" / KERNEL / "build").is_symlink()


def fixture_like_nvcc_13() -> str:
    # shared/fixtures/h200-1gpu/system.txt, "== nvcc"
    return (
        "nvcc: NVIDIA (R) Cuda compiler driver\nCopyright (c) 2005-2025 NVIDIA Corporation\n"
        "Built on Wed_Aug_20_01:58:59_PM_PDT_2025\n"
        "Cuda compilation tools, release 13.0, V13.0.88\n"
        "Build cuda_13.0.r13.0/compiler.36424714_0\n"
    )


@needs_repo_tools
def test_kernel_module_postinst_needs_the_headers(tmp_path):
    script = tmp_path / "postinst"
    script.write_text(
        nvidia_repo.render(
            "kernel-module.postinst",
            PACKAGE="nvidia-kernel-open-dkms",
            VERSION="580.95.05-1",
            DRIVER="580.95.05",
            FLAVOUR="open",
        )
    )
    release = os.uname().release
    if (
        Path(f"/lib/modules/{release}/build").is_dir()
        or Path(f"/usr/src/linux-headers-{release}").is_dir()
    ):
        pytest.skip("this machine has its kernel's headers")
    out = subprocess.run(
        ["sh", str(script), "configure"], capture_output=True, text=True, check=False
    )
    assert out.returncode == 1
    assert f"Your kernel headers for kernel {release} cannot be found" in out.stderr


def test_kernel_release_must_name_a_package(tmp_path):
    with pytest.raises(ValueError, match="cannot name a linux-headers package"):
        nvidia_repo.build(tmp_path, "5.15.0-WSL2", gnupg_home=tmp_path / "g", apt_archives=None)


# --- the package index -------------------------------------------------------------------------


def _fakes(wheels):
    """Small files under the real wheels' names, and RealWheels with their sha256."""
    return tuple(pypi_index.RealWheel(w.name, w.version, w.filename,
                                      hashlib.sha256(f"not really {w.filename}".encode())
                                      .hexdigest(), w.platforms) for w in wheels)


@pytest.fixture(scope="module")
def index(tmp_path_factory):
    """The index built offline: the real wheels replaced by small files of the same names; both
    stacks' locks (lock.txt: CUDA 12.8's, lock-cuda13.0.txt: CUDA 13.0's)."""
    base = tmp_path_factory.mktemp("index")
    cache = base / "cache"
    cache.mkdir()
    for wheel in (*pypi_index.REAL_WHEELS, *pypi_index.CUDA13_REAL_WHEELS):
        (cache / wheel.filename).write_bytes(f"not really {wheel.filename}".encode())
    saved = pypi_index.REAL_WHEELS, pypi_index.CUDA13_REAL_WHEELS
    pypi_index.REAL_WHEELS = _fakes(saved[0])
    pypi_index.CUDA13_REAL_WHEELS = _fakes(saved[1])
    try:
        pypi_index.build(base / "www", cache, base / "lock.txt",
                         {"13.0": base / "lock-cuda13.0.txt"})
    finally:
        pypi_index.REAL_WHEELS, pypi_index.CUDA13_REAL_WHEELS = saved
    return base


def test_index_hashes_match_the_files(index):
    simple = index / "www" / "simple"
    projects = re.findall(r'href="([^"/]+)/"', (simple / "index.html").read_text())
    assert set(projects) == {
        "torch",
        "flash-attn",
        "flashinfer-python",
        "flashinfer-cubin",
        "sgl-kernel",
        "sglang",
        "setuptools",
        "wheel",
        "packaging",
        # huggingface_hub and its dependencies (real wheels)
        "huggingface-hub", "filelock", "fsspec", "hf-xet", "pyyaml", "requests", "certifi",
        "charset-normalizer", "idna", "urllib3", "tqdm", "typing-extensions",
        # the router (locks/router.txt: real wheels)
        "smg", "grpcio", "grpcio-health-checking", "protobuf", "setproctitle",
        # the CUDA 13.0 stack's own (locks/cuda13.0.txt): stand-ins, then real wheels
        "sglang-kernel", "flash-attn-4",
        "nvidia-cuda-runtime", "click", "httpx", "httpcore", "h11", "anyio",
    }
    for project in projects:
        page = (simple / project / "index.html").read_text()
        links = re.findall(r'href="([^"#]+)#sha256=([0-9a-f]{64})"', page)
        assert links, project
        for filename, digest in links:
            assert hashlib.sha256((simple / project / filename).read_bytes()).hexdigest() == digest


def test_router_wheels_are_served_at_the_router_locks_pins_and_left_out_of_the_ml_lock(index):
    from operations.plans.lock import read_lock

    router = read_lock(Path(__file__).resolve().parents[2] / "locks" / "router.txt")
    for wheel in pypi_index.ROUTER_WHEELS:
        pin = router.get(wheel.name)
        assert pin is not None and pin.version == wheel.version, wheel.name
        assert f"sha256:{wheel.sha256}" in pin.hashes, wheel.filename  # PyPI's file, locked
    stand_in = read_lock(index / "lock.txt")
    assert not {w.name for w in pypi_index.ROUTER_WHEELS} & set(stand_in.versions())


def test_lock_pins_every_file_by_hash(index):
    lock = (index / "lock.txt").read_text()
    assert lock.startswith("# Stand-in lock")
    assert "do not edit" in lock.splitlines()[0]
    pins = dict(re.findall(r"^([a-z0-9-]+)==(\S+) \\$", lock, flags=re.MULTILINE))
    assert pins == {
        "torch": "2.9.1",
        "flash-attn": "2.8.3.post2",
        "flashinfer-python": "0.6.3",
        "flashinfer-cubin": "0.6.3",
        "sgl-kernel": "0.3.21",
        "sglang": "0.5.9",
        "setuptools": "84.2.1",
        "wheel": "0.48.0",
        "packaging": "26.4",
        "huggingface-hub": "0.36.2",
        "filelock": "4.3.1",
        "fsspec": "2026.6.0",
        "hf-xet": "1.8.0",
        "pyyaml": "6.0.4",
        "requests": "2.34.2",
        "certifi": "2026.10.19.post1",
        "charset-normalizer": "3.5.3",
        "idna": "3.20",
        "urllib3": "2.8.0",
        "tqdm": "4.70.1",
        "typing-extensions": "4.16.0",
    }
    simple = index / "www" / "simple"
    hashes = set(re.findall(r"--hash=sha256:([0-9a-f]{64})", lock))
    twelve = {(pypi_index.normalize(d.name), d.version) for d in pypi_index.STANDIN_DISTS} | {
        (w.name, w.version) for w in pypi_index.REAL_WHEELS}
    files = {
        hashlib.sha256(f.read_bytes()).hexdigest()
        for f in simple.rglob("*")
        if f.is_file() and f.name != "index.html"
        and f.parent.name not in pypi_index.ROUTER_PROJECTS  # locks/router.txt's
        and (f.parent.name, pypi_index._version_of(f.name)) in twelve  # not CUDA 13.0's
    }
    assert hashes == files


def test_standin_wheels_are_reproducible_and_well_formed(index, tmp_path):
    for dist in (*pypi_index.STANDIN_DISTS, *pypi_index.CUDA13_STANDINS):
        if dist.sdist:
            continue
        path = pypi_index.build_wheel(dist, tmp_path)
        served = index / "www" / "simple" / pypi_index.normalize(dist.name) / path.name
        assert path.read_bytes() == served.read_bytes()
        with zipfile.ZipFile(path) as zf:
            info = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
            record = zf.read(info).decode().splitlines()
            assert len(record) == len(zf.namelist())
            metadata = zf.read(info.replace("RECORD", "METADATA")).decode()
            assert f"Name: {dist.name}\nVersion: {dist.version}\n" in metadata


def _unpack(index: Path, target: Path, *projects: str, stack: str = "12.8") -> Path:
    """The projects' wheels of `stack`'s versions (the index serves both stacks') unpacked."""
    pins = {pypi_index.normalize(d.name): d.version for d in pypi_index.stacks()[stack].standins}
    for project in projects:
        for wheel in (index / "www" / "simple" / project).glob(f"*-{pins[project]}-*.whl"):
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(target)
    return target


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def sglang_env(index, tmp_path):
    site = _unpack(index, tmp_path / "site", "sglang", "torch")

    def env(scenario="single-gpu", loaded="580.159.04", **extra):
        (tmp_path / "hw.json").write_text(scenarios.hardware_json(scenario))
        (tmp_path / "loaded").write_text(loaded + "\n")
        (tmp_path / "libcuda").write_text("580.159.04\n")
        return dict(
            os.environ,
            PYTHONPATH=str(site),
            GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hw.json"),
            GPUHOST_SANDBOX_LOADED=str(tmp_path / "loaded"),
            GPUHOST_SANDBOX_LIBCUDA=str(tmp_path / "libcuda"),
            **extra,
        )

    return env


def test_sglang_rejects_an_unknown_flag(sglang_env):
    out = subprocess.run(
        [PYTHON, "-m", "sglang.launch_server", "--model", "x", "--no-such-flag"],
        capture_output=True,
        text=True,
        env=sglang_env(),
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in out.stderr


def test_sglang_accepts_the_reference_launch_and_counts_gpus(sglang_env):
    launch = (Path(__file__).resolve().parents[2] / "locks" / "reference-launch.txt").read_text()
    argv = " ".join(line for line in launch.splitlines() if not line.startswith("#")).split()
    assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
    # the reference launch asks for 8 GPUs: one H200 is not enough, and it says so
    out = subprocess.run(
        [PYTHON, *argv[1:]],
        capture_output=True,
        text=True,
        env=sglang_env("single-gpu"),
        timeout=60,
        check=False,
    )
    assert out.returncode == 1
    assert "not enough GPUs" in out.stderr and "torch.cuda.device_count() is 1" in out.stderr
    # a driver/library mismatch leaves torch without CUDA
    out = subprocess.run(
        [PYTHON, "-m", "sglang.launch_server", "--model", "x"],
        capture_output=True,
        text=True,
        env=sglang_env(loaded="580.95.05"),
        timeout=60,
        check=False,
    )
    assert out.returncode == 1 and "CUDA is not available" in out.stderr


def test_sglang_serves(sglang_env):
    port = _free_port()
    proc = subprocess.Popen(
        [
            PYTHON,
            "-m",
            "sglang.launch_server",
            "--model",
            "x",
            "--served-model-name",
            "glm-5",
            "--tp",
            "8",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--api-key",
            "k",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=sglang_env("reference-lab"),
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        headers = {"Authorization": "Bearer k", "Content-Type": "application/json"}
        with pytest.raises(urllib.error.HTTPError) as exc:
            urllib.request.urlopen(url + "/v1/models", timeout=5)
        assert exc.value.code == 401
        req = urllib.request.Request(url + "/v1/models", headers=headers)
        models = json.load(urllib.request.urlopen(req, timeout=5))
        assert models["object"] == "list"
        assert models["data"][0]["id"] == "glm-5" and models["data"][0]["owned_by"] == "sglang"
        body = json.dumps({"model": "glm-5", "messages": [{"role": "user", "content": "Hi"}]})
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=body.encode(), headers=headers
        )
        answer = json.load(urllib.request.urlopen(req, timeout=5))
        assert answer["object"] == "chat.completion"
        assert answer["choices"][0]["message"]["content"]
        assert answer["choices"][0]["finish_reason"] == "stop"
        stream = json.dumps(
            {"model": "glm-5", "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        )
        req = urllib.request.Request(
            url + "/v1/chat/completions", data=stream.encode(), headers=headers
        )
        events = urllib.request.urlopen(req, timeout=5).read().decode().split("\n\n")
        assert events[-2] == "data: [DONE]"
        chunks = [json.loads(e[len("data: ") :]) for e in events[:-2]]
        text = "".join(
            c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]
        )
        assert text == answer["choices"][0]["message"]["content"]
        req = urllib.request.Request(url + "/get_server_info", headers=headers)
        info = json.load(urllib.request.urlopen(req, timeout=5))
        assert info["tp_size"] == 8 and info["served_model_name"] == "glm-5"
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    assert "The server is fired up and ready to roll!" in err


def test_sglang_streams_generate_and_bench_serving_loads_it_natively(sglang_env, tmp_path):
    """/generate streamed as sglang 0.5.9 streams it (each chunk all the text so far, then
    [DONE]) and bench_serving's native backend (what the fleet bench sends through the router)
    counting its tokens."""
    port = _free_port()
    env = sglang_env("reference-lab")
    proc = subprocess.Popen([PYTHON, "-m", "sglang.launch_server", "--model", "x",
                             "--served-model-name", "glm-5", "--tp", "8", "--host", "127.0.0.1",
                             "--port", str(port)], stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        body = {"input_ids": [1, 2, 3], "stream": True,
                "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}}
        req = urllib.request.Request(url + "/generate", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        events = urllib.request.urlopen(req, timeout=30).read().decode().split("\n\n")
        assert events[-2] == "data: [DONE]"
        chunks = [json.loads(e[len("data: "):]) for e in events[:-2]]
        assert [c["meta_info"]["completion_tokens"] for c in chunks] == [1, 2, 3, 4, 5]
        assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:]))
        assert chunks[0]["meta_info"]["prompt_tokens"] == 3
        assert [c["meta_info"]["finish_reason"] for c in chunks][-2:] == [
            None, {"type": "length", "length": 5}]
        (tmp_path / "tok").mkdir()
        out = subprocess.run(
            [PYTHON, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", url,
             "--model", str(tmp_path / "tok"), "--served-model-name", "glm-5",
             "--tokenizer", str(tmp_path / "tok"), "--dataset-name", "random-ids",
             "--random-input-len", "8", "--random-output-len", "6", "--random-range-ratio",
             "1.0", "--num-prompts", "4", "--max-concurrency", "2", "--warmup-requests", "1",
             "--output-file", str(tmp_path / "r.json"), "--disable-tqdm"],
            capture_output=True, text=True, env=env, timeout=120, check=False)
        assert out.returncode == 0, out.stdout + out.stderr
        result = json.loads((tmp_path / "r.json").read_text())
        assert result["backend"] == "sglang" and result["completed"] == 4
        assert result["total_output_tokens"] == 24 and result["median_ttft_ms"] > 0
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_torch_reads_the_scenario(index, tmp_path):
    site = _unpack(index, tmp_path / "site", "torch")
    (tmp_path / "hw.json").write_text(scenarios.hardware_json("bare-metal-p2p"))
    (tmp_path / "v").write_text("580.105.08\n")
    (tmp_path / "old").write_text("580.95.05\n")
    code = (
        "import torch, json; print(json.dumps([torch.__version__, torch.version.cuda, "
        "torch.cuda.is_available(), torch.cuda.device_count(), "
        "torch.cuda.get_device_capability(0), torch.cuda.get_device_name(1), "
        "torch.cuda.can_device_access_peer(0, 7)]))"
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(site),
        GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hw.json"),
        GPUHOST_SANDBOX_LOADED=str(tmp_path / "v"),
        GPUHOST_SANDBOX_LIBCUDA=str(tmp_path / "v"),
    )
    out = subprocess.run([PYTHON, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert json.loads(out.stdout) == [
        "2.9.1+cu128",
        "12.8",
        True,
        8,
        [12, 0],
        "NVIDIA RTX PRO 6000 Blackwell Server Edition",
        True,
    ]
    env["GPUHOST_SANDBOX_LOADED"] = str(tmp_path / "old")  # upgraded, not rebooted
    out = subprocess.run(
        [PYTHON, "-c", "import torch; print(torch.cuda.is_available())"],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    assert out.stdout.strip() == "False" and "Error 803" in out.stderr


@pytest.fixture(scope="module")
def real_index(tmp_path_factory):
    """The index as the lab builds it, with the real wheels from PyPI and both stacks' locks
    (lock.txt: CUDA 12.8's, lock-cuda13.0.txt: CUDA 13.0's), built once for the tests that
    install from it. Its cache starts with copies of the lab's own (sandbox/layout.py
    PYPI_CACHE) that have PyPI's sha256: fetching the 55 MB again took 30 to 80 s of a run."""
    from sandbox.layout import PYPI_CACHE
    base = tmp_path_factory.mktemp("real-index")
    cache = base / "cache"
    cache.mkdir()
    for wheel in (*pypi_index.REAL_WHEELS, *pypi_index.CUDA13_REAL_WHEELS):
        seen = PYPI_CACHE / wheel.filename
        if seen.is_file() and hashlib.sha256(seen.read_bytes()).hexdigest() == wheel.sha256:
            shutil.copyfile(seen, cache / wheel.filename)
    pypi_index.build(base / "www", cache, base / "lock.txt", {"13.0": base / "lock-cuda13.0.txt"})
    return base


@pytest.mark.slow
@pytest.mark.network
def test_stack_installs_from_the_index_and_flash_attn_records_its_build(real_index, tmp_path):
    """As the product installs it: the lock without flash-attn (--require-hashes --no-deps),
    then flash-attn's sdist without build isolation, against the stand-in torch and nvcc."""
    www, lock = real_index / "www", real_index / "lock.txt"
    pins = re.split(r"\n(?=[a-z])", lock.read_text().split("\n", 5)[-1])
    (tmp_path / "stack.txt").write_text(
        "\n".join(p for p in pins if not p.startswith("flash-attn"))
    )
    (tmp_path / "flash.txt").write_text(next(p for p in pins if p.startswith("flash-attn")))
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else PYTHON
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    pip = [
        str(venv / "bin/python"),
        "-m",
        "pip",
        "install",
        "--require-hashes",
        "--no-deps",
        "--disable-pip-version-check",
        "--index-url",
        (www / "simple").as_uri(),
    ]
    subprocess.run([*pip, "-r", str(tmp_path / "stack.txt")], check=True, capture_output=True)
    cuda = tmp_path / "cuda-12.8"
    (cuda / "bin").mkdir(parents=True)
    nvcc = cuda / "bin" / "nvcc"
    nvcc.write_text(
        nvidia_repo.render(
            "nvcc",
            RELEASE="12.8",
            NVCC_VERSION="12.8.93",
            BUILT_ON="Fri_Feb_21_20:23:50_PST_2025",
            BUILD="cuda_12.8.r12.8/compiler.35583870_0",
        )
    )
    nvcc.chmod(0o755)
    (tmp_path / "hw.json").write_text(scenarios.hardware_json("reference-lab"))
    env = dict(
        os.environ,
        CUDA_HOME=str(cuda),
        FLASH_ATTENTION_FORCE_BUILD="TRUE",
        GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hw.json"),
    )
    env.pop("MAX_JOBS", None)
    flash = [*pip, "--no-build-isolation", "-r", str(tmp_path / "flash.txt")]
    # The reference lab's 128 cores: MAX_JOBS unset means 64 jobs, more than its memory bears
    out = subprocess.run(flash, capture_output=True, text=True, env=env, check=False)
    assert out.returncode != 0
    assert "Killed signal terminated program cc1plus" in out.stdout + out.stderr
    out = subprocess.run(
        flash,
        capture_output=True,
        text=True,
        env=dict(env, MAX_JOBS="20", NVCC_THREADS="4", FLASH_ATTN_CUDA_ARCHS="120"),
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    got = subprocess.run(
        [
            str(venv / "bin/python"),
            "-c",
            "import flash_attn, json; print(json.dumps(flash_attn.build_env()))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    recorded = json.loads(got.stdout)
    assert (recorded["MAX_JOBS"], recorded["NVCC_THREADS"], recorded["FLASH_ATTN_CUDA_ARCHS"]) == (
        "20",
        "4",
        "120",
    )
    assert (recorded["nvcc_release"], recorded["torch_cuda"]) == ("12.8", "12.8")
    # the extension module's stand-in names the cubins of the architectures it was given
    (module,) = (venv / "lib").glob("python3*/site-packages/flash_attn_2_cuda.*.so")
    assert module.read_text().splitlines() == ["gpuhost sandbox stand-in shared object",
                                               '{"cubins": ["sm_120"]}']
    listed = json.loads(
        subprocess.run(
            [str(venv / "bin/python"), "-m", "pip", "list", "--format=json"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )
    versions = {p["name"].lower().replace("_", "-"): p["version"] for p in listed}
    assert versions["flash-attn"] == "2.8.3.post2" and versions["torch"] == "2.9.1"


@pytest.mark.parametrize(
    ("scenario", "args", "env", "expected"),
    [
        ("p2p-ok-wrong-data", {"tp_size": 2}, {}, "the custom all-reduce"),
        ("p2p-ok-wrong-data", {"tp_size": 2, "disable_custom_all_reduce": True},
         {"NCCL_P2P_LEVEL": "PHB"}, "NCCL's all-reduce (via P2P)"),
        ("p2p-ok-wrong-data", {"tp_size": 2, "disable_custom_all_reduce": True},
         {"NCCL_P2P_LEVEL": "PHB", "NCCL_P2P_DISABLE": "1"}, "None"),
        ("p2p-ok-wrong-data", {"tp_size": 1}, {}, "None"),
        ("bare-metal-p2p", {"tp_size": 2}, {}, "None"),
    ],
)
def test_sglang_degenerates_when_its_all_reduce_goes_over_corrupting_p2p(
        sglang_env, scenario, args, env, expected):
    """The server stand-in answers "!!!" (NaN logits) where the tensor parallel all-reduce would
    go peer-to-peer on a host whose P2P corrupts data; NCCL_P2P_LEVEL=PHB alone does not keep
    NCCL off a PIX link (tests/fixtures/h200-x2-device/nccl-env.txt: on a real host neither)."""
    code = ("import json, sys; from sglang._standin.server import corrupting_all_reduce; "
            "print(corrupting_all_reduce(json.loads(sys.argv[1])))")
    base = {k: v for k, v in sglang_env(scenario).items() if not k.startswith("NCCL_")}
    out = subprocess.run([PYTHON, "-c", code, json.dumps(args)], capture_output=True, text=True,
                         env={**base, **env}, timeout=60, check=True)
    assert out.stdout.strip().startswith(expected), out.stdout


def _launch_node(sglang_env, rank, rendezvous, port, *extra):
    return subprocess.Popen(
        [PYTHON, "-m", "sglang.launch_server", "--model", "x", "--served-model-name", "glm-5",
         "--tp", "16", "--nnodes", "2", "--node-rank", str(rank), "--dist-init-addr",
         f"127.0.0.1:{rendezvous}", "--host", "127.0.0.1", "--port", str(port), *extra],
        stderr=subprocess.PIPE, text=True, env=sglang_env("reference-lab"))


def _status(url):
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return None


def test_sglang_across_two_nodes_meets_at_rank_0_and_falls_with_a_peer(sglang_env):
    """--nnodes 2: rank 0 waits for rank 1 at --dist-init-addr, serves the model; rank 1 serves
    the dummy /health only; killing rank 1 ends rank 0 with NCCL's words."""
    rendezvous, port0, port1 = _free_port(), _free_port(), _free_port()
    rank0 = _launch_node(sglang_env, 0, rendezvous, port0)
    try:
        time.sleep(1.5)
        assert _status(f"http://127.0.0.1:{port0}/health") is None  # waiting for rank 1
        assert rank0.poll() is None
        rank1 = _launch_node(sglang_env, 1, rendezvous, port1)
        deadline = time.time() + 30
        while _status(f"http://127.0.0.1:{port0}/v1/models") != 200:
            assert time.time() < deadline and rank0.poll() is None
            time.sleep(0.2)
        assert _status(f"http://127.0.0.1:{port1}/health") == 200
        assert _status(f"http://127.0.0.1:{port1}/v1/models") == 404
        rank1.kill()
        rank1.wait(timeout=10)
        assert rank0.wait(timeout=20) == 1
        err = rank0.stderr.read()
        assert "node rank 1 closed the connection (ncclRemoteError)" in err
        assert "node_rank=0 of 2 joined" in err
    finally:
        for proc in (rank0,):
            if proc.poll() is None:
                proc.kill()


def test_sglang_rank_0_alone_times_out_as_the_tcpstore(sglang_env):
    rank0 = _launch_node(sglang_env, 0, _free_port(), _free_port(), "--dist-timeout", "2")
    assert rank0.wait(timeout=30) == 1
    assert "Timed out after 2 seconds waiting for clients. 1/2 clients joined." \
        in rank0.stderr.read()


def test_the_all_reduce_across_nodes_meets_and_prints_its_bandwidth(sglang_env, tmp_path):
    """operations/files/internode_check.py on two "nodes" of 8 stand-in GPUs each (one machine,
    two processes): 16 ranks in one group, the sum intact, the bandwidth printed; a node alone
    times out."""
    script = Path(__file__).resolve().parents[2] / "operations/files/internode_check.py"
    env_file = tmp_path / "nodes.env"
    env_file.write_text("# comment\nNCCL_SOCKET_IFNAME=lo\nNCCL_IB_DISABLE=1\n")
    init = f"127.0.0.1:{_free_port()}"

    def node(rank, timeout="60"):
        return subprocess.Popen(
            [PYTHON, str(script), "--nnodes", "2", "--node-rank", str(rank), "--gpus", "8",
             "--dist-init-addr", init, "--env-file", str(env_file), "--bytes", "1048576",
             "--timeout", timeout],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            env=sglang_env("reference-lab"))

    nodes = [node(0), node(1)]
    outs = [p.communicate(timeout=120) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], outs
    assert "NCCL all-reduce across 2 nodes (16 GPUs, this node rank 0): intact" in outs[0][0]
    assert "bus bandwidth" in outs[0][0]
    alone = node(0, timeout="3")
    out, err = alone.communicate(timeout=120)
    assert alone.returncode == 1 and "across 2 nodes" in err


def test_a_driver_release_whose_module_never_loads(repo, tmp_path):
    """590.44.01's module package ships a boot-time loader that loads nothing; the others' load
    the built module (the rollback's tests need one driver that fails after its reboot)."""
    _, _, repo_dir = repo
    loaders = {}
    for version in ("580.95.05", "590.44.01"):
        root = tmp_path / version
        subprocess.run(["dpkg-deb", "-x", str(repo_dir / f"nvidia-kernel-open-dkms_{version}-1"
                                                 "_amd64.deb"), str(root)], check=True)
        loaders[version] = (root / "usr/lib/nvidia-sandbox/load-module").read_text()
    assert loaders["580.95.05"] == nvidia_repo.render("load-module")
    broken = loaders["590.44.01"]
    assert "could not insert 'nvidia': Unknown symbol in module" in broken
    assert "loaded-version" in broken and "cp " not in broken
    assert nvidia_repo.MODULE_FAILS_TO_LOAD == ("590.44.01",)


def _sglang_metric_names() -> set[str]:
    path = Path(__file__).resolve().parents[1] / "fixtures" / "sglang-0.5.9-metric-names.txt"
    return {line for line in path.read_text().splitlines() if line and not line.startswith("#")}


def _families(text: str) -> dict[str, str]:
    """Each family of an exposition text with its TYPE; a counter's family as prometheus_client
    names it (without _total), its samples with it."""
    return {m[1]: m[2] for m in re.finditer(r"^# TYPE (\S+) (\S+)$", text, re.M)}


def test_sglang_metrics_are_the_real_servers_names_in_prometheus_format(sglang_env, promtool):
    """GET /metrics with --enable-metrics: every family one sglang 0.5.9 defines, the text
    accepted by the real promtool, and a streamed completion counted (tokens, requests, the
    TTFT histogram); without the flag, 404 as the real server (no route)."""
    port = _free_port()
    env = sglang_env("reference-lab")
    proc = subprocess.Popen([PYTHON, "-m", "sglang.launch_server", "--model", "x",
                             "--served-model-name", "glm-5", "--tp", "8", "--host", "127.0.0.1",
                             "--port", str(port), "--enable-metrics"],
                            stderr=subprocess.DEVNULL, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        before = urllib.request.urlopen(url + "/metrics", timeout=5).read().decode()
        body = {"prompt": "one two three", "stream": True, "max_tokens": 4, "ignore_eos": True}
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        urllib.request.urlopen(req, timeout=30).read()
        with urllib.request.urlopen(url + "/metrics", timeout=5) as r:
            assert r.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            text = r.read().decode()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    from tests.conftest import promtool_check_metrics

    # sglang's own names' colons are allowed (Prometheus reserves them for recording rules)
    assert promtool_check_metrics(promtool, text) == []
    real = _sglang_metric_names()
    families = _families(text)
    for family, kind in families.items():
        assert family in real or family + "_total" in real, family
    assert {"sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage",
            "sglang:time_to_first_token_seconds", "sglang:inter_token_latency_seconds",
            "sglang:generation_tokens"} <= set(families)

    def value(sample: str, in_text: str) -> float:
        (line,) = [ln for ln in in_text.splitlines() if ln.startswith(sample)]
        return float(line.rsplit(" ", 1)[1])

    # the warmup request the server sends itself counts too: compare with the reading before
    generated = 'sglang:generation_tokens_total{model_name="glm-5"}'
    assert value(generated, text) - value(generated, before) == 4
    requests = 'sglang:num_requests_total{model_name="glm-5"}'
    assert value(requests, text) - value(requests, before) == 1
    ttft = 'sglang:time_to_first_token_seconds_count{model_name="glm-5"}'
    assert value(ttft, text) - value(ttft, before) == 1


def test_sglang_metrics_need_the_flag(sglang_env):
    port = _free_port()
    proc = subprocess.Popen([PYTHON, "-m", "sglang.launch_server", "--model", "x",
                             "--host", "127.0.0.1", "--port", str(port)],
                            stderr=subprocess.DEVNULL, env=sglang_env())
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.time() + 30
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.time() > deadline or proc.poll() is not None:
                    raise
                time.sleep(0.1)
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(url + "/metrics", timeout=5)
        assert err.value.code == 404
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@pytest.mark.parametrize(("mtp", "spec_v2", "expected"), [
    (True, "True", "None"),
    (False, "True", "Scheduler hit an exception: ValueError: MTP speculative decoding layer 2 "
                    "weights missing from checkpoint."),
    (True, None, "Scheduler hit an exception: torch.OutOfMemoryError"),
])
def test_sglang_serves_nextn_with_spec_v2_and_the_mtp_layer_only(sglang_env, tmp_path, mtp,
                                                                 spec_v2, expected):
    """The stand-in takes the speculative flags as sglang 0.5.9's parser does and serves NEXTN
    where the real server would: with SGLANG_ENABLE_SPEC_V2=True and a checkpoint whose weight
    index maps the MTP layer (the hub stand-in's two repositories)."""
    from sandbox import hub

    model = tmp_path / "model"
    model.mkdir()
    for f in hub.repository(mtp=mtp):
        if f.path in ("config.json", "model.safetensors.index.json"):
            (model / f.path).write_bytes(f.data)
    code = ("import json, sys; from sglang._standin.args import build_parser, load_spec, "
            "server_args; from sglang._standin.server import check_speculative; "
            "args = server_args(build_parser(load_spec()).parse_args(sys.argv[1:])); "
            "print(check_speculative(args))")
    env = {k: v for k, v in sglang_env().items() if k != "SGLANG_ENABLE_SPEC_V2"}
    if spec_v2:
        env["SGLANG_ENABLE_SPEC_V2"] = spec_v2
    out = subprocess.run(
        [PYTHON, "-c", code, "--model", str(model), "--speculative-algorithm", "NEXTN",
         "--speculative-num-steps", "4", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "5"],
        capture_output=True, text=True, env=env, timeout=60, check=True)
    assert out.stdout.strip().splitlines()[-1].startswith(expected), out.stdout + out.stderr


# --- the CUDA 13.0 stack -----------------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[2]


def _args_flags(version: str) -> set[str]:
    spec = json.loads((ROOT / "locks" / f"sglang-{version}.args.json").read_text())
    return {flag for arg in spec["arguments"] for flag in arg["flags"]}


def test_cuda13_stack_is_locks_cuda13_at_its_versions_and_pypis_files():
    """Every distribution of the CUDA 13.0 stand-in lock is pinned at locks/cuda13.0.txt's
    version; each real wheel is a file that lock lists (its sha256 among the pin's hashes)."""
    from operations.plans.lock import read_lock

    real = read_lock(ROOT / "locks" / "cuda13.0.txt")
    stack = pypi_index.stacks()["13.0"]
    for dist in stack.standins:
        pin = real.get(dist.name)
        assert pin is not None and pin.version == dist.version, dist.name
    for wheel in stack.real:
        pin = real.get(wheel.name)
        assert pin is not None and pin.version == wheel.version, wheel.name
        assert f"sha256:{wheel.sha256}" in pin.hashes, wheel.filename
    assert real.get("flash-attn") is None and real.get("flashinfer-cubin") is None
    names = {pypi_index.normalize(d.name) for d in stack.standins}
    assert names == {"torch", "sglang", "sglang-kernel", "flashinfer-python", "flash-attn-4"}


def test_cuda13_real_wheels_close_over_the_hubs_requirements():
    """huggingface_hub 1.33.0's Requires-Dist (its wheel's METADATA, Linux x86_64, Python 3.11)
    and its dependencies' are all in the stand-in lock: pip installs it with --no-deps."""
    hub_requires = {  # huggingface_hub-1.33.0-py3-none-any.whl METADATA, without extras
        "huggingface-hub": {"click", "filelock", "fsspec", "hf-xet", "httpx", "packaging",
                            "pyyaml", "tqdm", "typing-extensions"},
        "httpx": {"anyio", "certifi", "httpcore", "idna"},  # httpx-0.29.0
        "httpcore": {"certifi", "h11"},  # httpcore-1.0.9
        "anyio": {"idna", "typing-extensions"},  # anyio-4.16.0 (3.11: no exceptiongroup)
    }
    served = {w.name for w in pypi_index.stacks()["13.0"].real}
    for name, requires in hub_requires.items():
        assert name in served and requires <= served, (name, requires - served)


def test_cuda13_lock_pins_its_stack_for_the_hosts_python(index):
    from operations.plans.lock import read_lock
    from operations.plans.settings import torch_cuda

    path = index / "lock-cuda13.0.txt"
    text = path.read_text()
    assert text.startswith(pypi_index.CUDA13_LOCK_HEADER) and "do not edit" in text.splitlines()[0]
    lock = read_lock(path)
    assert lock.python_version == "3.11"  # Debian 12's python3, the sandbox hosts'
    assert torch_cuda(lock) == "13.0"  # from its nvidia-cuda-runtime pin, as the real lock's
    stack = pypi_index.stacks()["13.0"]
    assert lock.versions() == {**{pypi_index.normalize(d.name): d.version for d in stack.standins},
                               **{w.name: w.version for w in stack.real}}
    assert not set(lock.versions()) & pypi_index.ROUTER_PROJECTS
    simple = index / "www" / "simple"
    for pin in lock.pins:
        files = [f for f in (simple / pin.name).iterdir()
                 if f.name != "index.html" and pypi_index._version_of(f.name) == pin.version]
        assert {f"sha256:{hashlib.sha256(f.read_bytes()).hexdigest()}" for f in files} == set(
            pin.hashes), pin.name
    # the 12.8 lock beside it is unchanged by the second stack
    twelve = read_lock(index / "lock.txt")
    assert twelve.versions()["torch"] == "2.9.1" and twelve.get("sglang-kernel") is None
    assert torch_cuda(twelve) == "12.8"


def test_cuda13_stand_ins_say_the_real_versions(index, tmp_path):
    site = _unpack(index, tmp_path / "site", "torch", "sglang", "flashinfer-python",
                   "sglang-kernel", "flash-attn-4", stack="13.0")
    script = ("import json, torch, sglang, flashinfer, sgl_kernel, flash_attn.cute as fa\n"
              "print(json.dumps([torch.__version__, torch.version.cuda, sglang.__version__, "
              "flashinfer.__version__, sgl_kernel.__version__, fa.__version__]))")
    out = subprocess.run([PYTHON, "-c", script], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(site)}, timeout=60)
    # torch/version.py of torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl: '2.11.0+cu130'
    assert json.loads(out.stdout) == ["2.11.0+cu130", "13.0", "0.5.17", "0.6.15.post1", "0.4.5",
                                      "4.0.0b19"]


def test_cuda13_sglang_takes_exactly_0_5_17s_flags(index, tmp_path):
    site = _unpack(index, tmp_path / "site", "sglang", "torch", stack="13.0")
    embedded = json.loads((site / "sglang" / "_standin" / "server_args.json").read_text())
    assert embedded == json.loads((ROOT / "locks" / "sglang-0.5.17.args.json").read_text())
    gone, new = sorted(_args_flags("0.5.9") - _args_flags("0.5.17")), sorted(
        _args_flags("0.5.17") - _args_flags("0.5.9"))
    assert gone and new
    env = {**os.environ, "PYTHONPATH": str(site)}
    check = ("import sys\nfrom sglang._standin.args import build_parser, load_spec\n"
             "build_parser(load_spec()).parse_args(sys.argv[1:])")

    def parse(*argv):
        return subprocess.run([PYTHON, "-c", check, "--model-path", "x", *argv],
                              capture_output=True, text=True, env=env, timeout=60, check=False)

    refused = parse(gone[0])  # a flag of 0.5.9 that 0.5.17 no longer has
    assert refused.returncode == 2 and f"unrecognized arguments: {gone[0]}" in refused.stderr
    # a choice 0.5.9's --fp4-gemm-backend lacks, and one 0.5.17's lacks (launch_profiles.py)
    assert parse("--fp4-gemm-backend", "flashinfer_cutedsl").returncode == 0
    wrong = parse("--fp4-gemm-backend", "cutlass")
    assert wrong.returncode == 2 and "invalid choice: 'cutlass'" in wrong.stderr
    store_true = [a["flags"][0] for a in embedded["arguments"]
                  if a["flags"][0] in new and a.get("action") == "store_true"]
    assert parse(store_true[0]).returncode == 0, store_true[0]


@pytest.mark.slow
@pytest.mark.network
def test_cuda13_stack_installs_from_the_index_on_the_hosts_python(real_index, tmp_path):
    """As the product installs a lock without flash-attn (pip --require-hashes --no-deps, from
    the index alone), the CUDA 13.0 stand-in lock into a venv of a Python 3.11 (the sandbox
    hosts' Debian 12 python3); the real wheels fetched from PyPI."""
    www, lock = real_index / "www", real_index / "lock-cuda13.0.txt"
    python = "/usr/bin/python3" if Path("/usr/bin/python3").exists() else PYTHON
    found = subprocess.run([python, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True, check=True).stdout.strip()
    if found != "3.11":
        pytest.skip(f"{python} is Python {found}: the lock's real wheels are CPython 3.11's")
    venv = tmp_path / "venv"
    subprocess.run([python, "-m", "venv", str(venv)], check=True)
    out = subprocess.run(
        [str(venv / "bin/python"), "-m", "pip", "install", "-q", "--isolated", "--require-hashes",
         "--no-deps", "--disable-pip-version-check", "--index-url", (www / "simple").as_uri(),
         "-r", str(lock)],
        capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    script = ("import json, torch, sglang, flashinfer, sgl_kernel, huggingface_hub, httpx\n"
              "print(json.dumps([torch.__version__, sglang.__version__, "
              "huggingface_hub.__version__]))")
    got = subprocess.run([str(venv / "bin/python"), "-c", script], capture_output=True,
                         text=True, check=True)
    assert json.loads(got.stdout) == ["2.11.0+cu130", "0.5.17", "1.33.0"]
