# setup.py of the flash-attn 2.8.3.post2 sandbox stand-in (gpuhost sandbox lab), not the real one.
#
# Like the real one it imports torch (so pip needs --no-build-isolation and torch installed
# first), needs nvcc under CUDA_HOME, compares nvcc's release with torch.version.cuda, honours
# FLASH_ATTENTION_FORCE_BUILD / FLASH_ATTENTION_SKIP_CUDA_BUILD / FLASH_ATTN_CUDA_ARCHS /
# NVCC_THREADS / MAX_JOBS, and compiles nothing: it records what it was given in
# flash_attn/build_env.json inside the built package, and writes a stand-in of the extension
# module (flash_attn_2_cuda<EXT_SUFFIX>, at the wheel's top level as in the real wheel) naming
# the cubins the real build would give it (sm_<arch> for each of FLASH_ATTN_CUDA_ARCHS), which
# the CUDA toolkit stand-in's cuobjdump lists. When the host's scenario caps the
# parallel compile jobs (host.flash_attn_max_parallel_jobs), more jobs fail the build as the
# compiler being killed for memory would.
import json
import os
import subprocess
import sys
import sysconfig
import time
import warnings

from packaging.version import Version, parse
from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel as _bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel as _bdist_wheel

import torch
from torch.utils.cpp_extension import CUDA_HOME

PACKAGE_NAME = "flash_attn"
VERSION = "2.8.3.post2"
BASE_WHEEL_URL = (
    "https://github.com/Dao-AILab/flash-attention/releases/download/{tag_name}/{wheel_name}"
)
FORCE_BUILD = os.getenv("FLASH_ATTENTION_FORCE_BUILD", "FALSE") == "TRUE"
SKIP_CUDA_BUILD = os.getenv("FLASH_ATTENTION_SKIP_CUDA_BUILD", "FALSE") == "TRUE"
HARDWARE = os.environ.get("GPUHOST_SANDBOX_HARDWARE", "/etc/gpuhost-sandbox/hardware.json")
# The first line of a stand-in shared object (sandbox/standins/nvidia/cuobjdump reads it).
STANDIN_SO_MAGIC = "gpuhost sandbox stand-in shared object"


def get_cuda_bare_metal_version(cuda_dir):
    raw_output = subprocess.check_output([cuda_dir + "/bin/nvcc", "-V"], universal_newlines=True)
    output = raw_output.split()
    release_idx = output.index("release") + 1
    bare_metal_version = parse(output[release_idx].split(",")[0])
    return raw_output, bare_metal_version


def check_if_cuda_home_none(global_option):
    if CUDA_HOME is not None:
        return
    warnings.warn(
        f"{global_option} was requested, but nvcc was not found.  Are you sure your environment "
        "has nvcc available?  If you're installing within a container from "
        "https://hub.docker.com/r/pytorch/pytorch, only images whose names contain 'devel' will "
        "provide nvcc."
    )


def scenario_host():
    try:
        with open(HARDWARE) as fh:
            return json.load(fh).get("host", {})
    except (OSError, ValueError):
        return {}


def build_record():
    """Check the toolchain as the real build does; return what build_env.json records."""
    record = {
        "MAX_JOBS": os.environ.get("MAX_JOBS"),
        "NVCC_THREADS": os.environ.get("NVCC_THREADS"),
        "FLASH_ATTN_CUDA_ARCHS": os.environ.get("FLASH_ATTN_CUDA_ARCHS"),
        "FLASH_ATTENTION_FORCE_BUILD": os.environ.get("FLASH_ATTENTION_FORCE_BUILD"),
        "FLASH_ATTENTION_SKIP_CUDA_BUILD": os.environ.get("FLASH_ATTENTION_SKIP_CUDA_BUILD"),
        "CUDA_HOME": CUDA_HOME,
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "python": sys.version.split()[0],
    }
    if SKIP_CUDA_BUILD:
        return record
    print(f"\n\ntorch.__version__  = {torch.__version__}\n\n")
    check_if_cuda_home_none(PACKAGE_NAME)
    if CUDA_HOME is None:
        raise OSError(
            "CUDA_HOME environment variable is not set. Please set it to your CUDA install root."
        )
    raw, nvcc_version = get_cuda_bare_metal_version(CUDA_HOME)
    record["nvcc_release"] = str(nvcc_version)
    record["nvcc_version"] = raw.strip().splitlines()[-2] if raw.strip() else ""
    print(
        f"nvcc (CUDA_HOME={CUDA_HOME}): release {nvcc_version}; "
        f"torch.version.cuda: {torch.version.cuda}"
    )
    if nvcc_version < Version("11.7"):
        raise RuntimeError(
            "FlashAttention is only supported on CUDA 11.7 and above.  "
            "Note: make sure nvcc has a supported version by running nvcc -V."
        )
    # torch.utils.cpp_extension's check when it builds a CUDA extension
    torch_cuda = Version(torch.version.cuda)
    if nvcc_version.major != torch_cuda.major:
        raise RuntimeError(
            f"The detected CUDA version ({nvcc_version}) mismatches the version that was used to "
            f"compile PyTorch ({torch.version.cuda}). Please make sure to use the same CUDA "
            "versions."
        )
    if nvcc_version.minor != torch_cuda.minor:
        warnings.warn(
            f"The detected CUDA version ({nvcc_version}) has a minor version mismatch with the "
            f"version that was used to compile PyTorch ({torch.version.cuda}). Most likely this "
            "shouldn't be a problem."
        )
    archs = os.getenv("FLASH_ATTN_CUDA_ARCHS", "80;90;100;120").split(";")
    record["cuda_archs"] = archs
    record["nvcc_threads"] = int(os.getenv("NVCC_THREADS") or 4)
    host = scenario_host()
    if os.environ.get("MAX_JOBS"):
        jobs = int(os.environ["MAX_JOBS"])
    else:
        # flash-attn 2.8's NinjaBuildExtension: half the cores (its memory estimate aside)
        jobs = max(1, (host.get("cpu_count") or os.cpu_count() or 2) // 2)
    record["jobs"] = jobs
    limit = host.get("flash_attn_max_parallel_jobs")
    if limit is not None and jobs > limit:
        print(f"[1/73] ninja -j {jobs}: compiling flash_api.cpp and 72 CUDA kernels", flush=True)
        print("nvcc error   : 'cicc' died due to signal 9 (Kill signal)", file=sys.stderr)
        print("c++: fatal error: Killed signal terminated program cc1plus", file=sys.stderr)
        print("ninja: build stopped: subcommand failed.", file=sys.stderr)
        raise RuntimeError("Error compiling objects for extension")
    seconds = float(host.get("flash_attn_build_seconds") or 0)
    for step in range(1, 73):
        if seconds:
            print(f"[{step}/73] nvcc: flash_fwd_hdim... (sandbox stand-in)", flush=True)
            time.sleep(seconds / 72)
    print(f"[73/73] ninja -j {jobs}: flash_attn_2_cuda (sandbox stand-in: nothing compiled)")
    return record


class BuildPyRecordingEnv(build_py):
    def run(self):
        record = build_record()
        super().run()
        target = os.path.join(self.build_lib, PACKAGE_NAME, "build_env.json")
        with open(target, "w") as fh:
            json.dump(record, fh, indent=2, sort_keys=True)
            fh.write("\n")
        if "cuda_archs" in record:
            module = "flash_attn_2_cuda" + sysconfig.get_config_var("EXT_SUFFIX")
            with open(os.path.join(self.build_lib, module), "w") as fh:
                fh.write(STANDIN_SO_MAGIC + "\n")
                json.dump({"cubins": [f"sm_{a}" for a in record["cuda_archs"]]}, fh)
                fh.write("\n")


class CachedWheelsCommand(_bdist_wheel):
    """The real one fetches a prebuilt wheel from GitHub unless FLASH_ATTENTION_FORCE_BUILD; the
    sandbox has no route there, so it always falls back to building, as the real one does then."""

    def run(self):
        if not FORCE_BUILD:
            torch_version = f"{torch.__version__.split('.')[0]}.{torch.__version__.split('.')[1]}"
            wheel_name = (
                f"{PACKAGE_NAME}-{VERSION}+cu{torch.version.cuda.split('.')[0]}torch"
                f"{torch_version}cxx11abiTRUE-cp{sys.version_info.major}"
                f"{sys.version_info.minor}-cp{sys.version_info.major}"
                f"{sys.version_info.minor}-linux_x86_64.whl"
            )
            print(
                "Guessing wheel URL: ",
                BASE_WHEEL_URL.format(tag_name=f"v{VERSION}", wheel_name=wheel_name),
            )
            print("Precompiled wheel not found. Building from source...")
        super().run()


setup(
    name="flash_attn",
    version=VERSION,
    packages=find_packages(include=["flash_attn", "flash_attn.*"]),
    author="Tri Dao",
    author_email="tri@tridao.me",
    description="Flash Attention: Fast and Memory-Efficient Exact Attention (sandbox stand-in)",
    url="https://github.com/Dao-AILab/flash-attention",
    cmdclass={"bdist_wheel": CachedWheelsCommand, "build_py": BuildPyRecordingEnv},
    python_requires=">=3.9",
    install_requires=["torch"],
)
