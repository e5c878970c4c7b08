"""The GPUs' compute capability against host data once the driver answers, and the machine code
in a flash-attn wheel (cuobjdump --list-elf) before it is cached or installed."""

import re
import stat
import zipfile
from pathlib import Path

import pytest

from operations.plans.gpu_arch import (
    ArchitectureError,
    WheelCode,
    check_compute_capability,
    check_wheel_code,
    parse_compute_caps,
    parse_list_elf,
    parse_wheel_check,
    wheel_check_command,
)
from operations.stages import flash_attn
from operations.stages.flash_attn import BuildKey, WheelCache
from tests.test_flash_attn import plan

FIXTURES = Path(__file__).parent / "fixtures" / "h200-device"


def output_of(fixture: str) -> tuple[str, int]:
    """A fixture's raw output (without its "$ command" and "# rc=N" lines) and its rc."""
    lines = (FIXTURES / fixture).read_text().splitlines()
    assert lines[0].startswith("$ ") and lines[-1].startswith("# rc=")
    return "\n".join(lines[1:-1]) + "\n", int(lines[-1].removeprefix("# rc="))


def test_list_elf_on_the_real_output():
    out, rc = output_of("cuobjdump-list-elf.txt")
    assert rc == 0
    assert parse_list_elf(out) == ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")
    out, rc = output_of("cuobjdump-list-elf-no-device-code.txt")
    assert (rc, parse_list_elf(out)) == (255, ())


def test_compute_cap_on_the_real_output():
    out, _ = output_of("nvidia-smi-compute-cap.txt")
    assert parse_compute_caps(out) == ["9.0"]
    check_compute_capability(["9.0"], "9.0")
    with pytest.raises(ArchitectureError, match="'No devices were found'"):
        parse_compute_caps("No devices were found\n")


def test_gpus_that_are_not_what_host_data_says():
    with pytest.raises(ArchitectureError) as exc:
        check_compute_capability(["12.0"] * 8, "9.0")
    assert str(exc.value) == (
        "the GPUs have compute capability 12.0 (nvidia-smi), host data says "
        "gpuhost_compute_capability = '9.0': set gpuhost_compute_capability = '12.0' in the "
        "inventory (nothing was built for 9.0)")
    with pytest.raises(ArchitectureError, match="lists no GPU"):
        check_compute_capability([], "12.0")


class ProbedHost:
    """The probe's one command, answered as a fresh host answers it after the driver stage."""

    def __init__(self, caps: str):
        self.caps, self.commands = caps, []

    def run(self, command, what, timeout=0):
        self.commands.append(command)
        return ("3.12\n2.9.1+cu128\n12.8\n--driver\n580.105.08\n--compute-cap\n" + self.caps
                + "--nvcc\nCuda compilation tools, release 12.8, V12.8.93\n")


def test_the_probe_stops_a_build_for_other_gpus():
    host = ProbedHost("12.0\n12.0\n")
    with pytest.raises(ArchitectureError, match="gpuhost_compute_capability = '9.0'"):
        flash_attn._probe(host, plan(archs="90", compute_capability="9.0"))
    assert "nvidia-smi --query-gpu=compute_cap --format=csv,noheader" in host.commands[0]
    key = flash_attn._probe(ProbedHost("12.0\n12.0\n"), plan())
    assert key == BuildKey("2.8.3.post2", "2.9.1+cu128", "12.8", "3.12", "120")


def wheel_check_output(*objects: tuple[str, str, int]) -> str:
    return "".join(f"--- file {name}\n{out}--- rc={rc}\n" for name, out, rc in objects)


def test_a_wheel_without_the_gpus_machine_code_is_refused():
    sm90 = "ELF file    1: flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.1.sm_90.cubin\n"
    none, _ = output_of("cuobjdump-list-elf-no-device-code.txt")
    code = parse_wheel_check(wheel_check_output(
        ("flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so", sm90, 0),
        ("flash_attn/libother.so", none, 255)))
    assert code == WheelCode({"flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so": ("sm_90",),
                              "flash_attn/libother.so": ()})
    check_wheel_code("fa.whl", code, "90")
    with pytest.raises(ArchitectureError) as exc:
        check_wheel_code("flash_attn-2.8.3.post2-cp312-cp312-linux_x86_64.whl", code, "120")
    assert str(exc.value) == (
        "flash_attn-2.8.3.post2-cp312-cp312-linux_x86_64.whl has sm_90 "
        "(flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so, flash_attn/libother.so), the GPUs "
        "need sm_120")
    with pytest.raises(ArchitectureError, match="has no machine code"):
        check_wheel_code("fa.whl", WheelCode({}), "120")
    with pytest.raises(ArchitectureError, match="failed \\(exit status 1\\)"):
        parse_wheel_check(wheel_check_output(("a.so", "cuobjdump fatal: bad\n", 1)))


def test_the_wheel_check_command_unpacks_and_lists(tmp_path):
    out, _ = output_of("cuobjdump-list-elf.txt")
    cuobjdump = tmp_path / "cuobjdump"
    cuobjdump.write_text(f"#!/bin/sh\ntest -f \"$2\" || exit 9\ncat <<'EOF'\n{out}EOF\n")
    cuobjdump.chmod(cuobjdump.stat().st_mode | stat.S_IXUSR)
    wheel = tmp_path / "fa.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so", b"\x7fELF")
        z.writestr("flash_attn/__init__.py", "")
    import subprocess
    import sys

    run = subprocess.run(["sh", "-c", wheel_check_command(sys.executable, str(wheel),
                                                          str(cuobjdump))],
                         capture_output=True, text=True, check=True)
    code = parse_wheel_check(run.stdout)
    assert code.objects == {"flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so":
                            ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120")}
    missing = subprocess.run(["sh", "-c", wheel_check_command(sys.executable, str(wheel),
                                                              str(tmp_path / "none"))],
                             capture_output=True, text=True)
    assert missing.returncode == 1


class BuildingHost:
    """A host whose build gave a wheel with sm_90 only; every command is kept."""

    def __init__(self):
        self.commands = []

    def run(self, command, what, timeout=0):
        self.commands.append(command)
        if "--list-elf" in command:
            return wheel_check_output(("flash_attn_2_cuda.so",
                                       "ELF file    1: flash_attn_2_cuda.1.sm_90.cubin\n", 0))
        return ""

    def get(self, src, dest):
        raise AssertionError("a refused wheel is not fetched into the cache")

    def put(self, src, dest):
        self.commands.append(f"put {dest}")


def test_a_refused_build_is_neither_cached_nor_installed(monkeypatch, tmp_path):
    host_ = BuildingHost()
    key = BuildKey("2.8.3.post2", "2.9.1+cu128", "12.8", "3.12", "120")
    monkeypatch.setattr(flash_attn, "_Remote", lambda h: host_)
    monkeypatch.setattr(flash_attn, "_probe", lambda on_host, p: key)
    monkeypatch.setattr(flash_attn, "_build", lambda on_host, p, k: "/b/wheels/fa.whl")

    class Host:
        name = "gpu1"
        print_prefix = ""

    with pytest.raises(ArchitectureError,
                       match="fa.whl has sm_90 .*: it is neither cached nor installed$"):
        flash_attn._converge(Host(), plan(cache_root=str(tmp_path)))
    assert WheelCache(tmp_path).lookup(key) is None
    assert not any("pip install" in c or c.startswith("put") for c in host_.commands)
    assert any("rm -rf /opt/gpuhost/build/flash-attn/wheels" in c for c in host_.commands)


class RebuildingHost(BuildingHost):
    """A host given a cached wheel with sm_90 only, whose own build has sm_120."""

    def run(self, command, what, timeout=0):
        command = str(command)  # the install is a StringCommand (operations/stages/disk.py)
        self.commands.append(command)
        if "--list-elf" in command:
            arch = "sm_120" if "/b/wheels/" in command else "sm_90"
            return wheel_check_output(("flash_attn_2_cuda.so",
                                       f"ELF file    1: flash_attn_2_cuda.1.{arch}.cubin\n", 0))
        return ""

    def get(self, src, dest):
        self.commands.append(f"get {src}")
        Path(dest).write_bytes(b"built wheel")


def test_a_refused_cached_wheel_leaves_the_cache_and_is_built_again(monkeypatch, tmp_path,
                                                                    caplog):
    host_ = RebuildingHost()
    key = BuildKey("2.8.3.post2", "2.9.1+cu128", "12.8", "3.12", "120")
    cache = WheelCache(tmp_path)
    wheel = tmp_path / "fa.whl"
    wheel.write_bytes(b"wheel")
    cache.store(key, wheel, "gpu0")
    monkeypatch.setattr(flash_attn, "_Remote", lambda h: host_)
    monkeypatch.setattr(flash_attn, "_probe", lambda on_host, p: key)
    monkeypatch.setattr(flash_attn, "_build", lambda on_host, p, k: "/b/wheels/fa-built.whl")

    class Host:
        name = "gpu1"
        print_prefix = ""

    flash_attn._converge(Host(), plan(cache_root=str(tmp_path)))
    assert re.search("fa.whl has sm_90 .*: not installed, and removed from the controller's "
                     "cache .*; building it on this host instead", caplog.text)
    installs = [c for c in host_.commands if "pip install" in c]
    assert len(installs) == 1 and "fa-built.whl" in installs[0]
    cached, _ = cache.lookup(key)
    assert cached.name == "fa-built.whl" and cached.read_bytes() == b"built wheel"
