"""The sandbox lab's Python package index: stand-in distributions under the real names and
versions of the locked stacks, CUDA 12.8's (locks/cuda12.8.txt) and CUDA 13.0's
(locks/cuda13.0.txt), a PEP 503 simple index serving both, and one stand-in lock per stack
pinning its files by sha256.

    <www>/simple/index.html                       the project list
    <www>/simple/<project>/index.html             links carrying #sha256=<hex>
    <www>/simple/<project>/<file>                 the distributions (both stacks' versions)
    <lock_path>                                   CUDA 12.8's: pip requirements with --hash lines
    <other lock paths>                            CUDA 13.0's (build's ``stack_locks``)

Stand-ins (sources under sandbox/standins/, built here into reproducible wheels and one sdist):
torch 2.9.1 (torch.__version__ "2.9.1+cu128"), flash-attn 2.8.3.post2 (an sdist whose setup.py
imports torch and records its build environment), flashinfer-python 0.6.3, flashinfer-cubin
0.6.3, sgl-kernel 0.3.21 and sglang 0.5.9 (the versions sglang 0.5.9's METADATA pins). Beside
them, real wheels fetched once from PyPI into `cache`: flash-attn's build requirements under
--no-build-isolation (setuptools, wheel, packaging), and huggingface_hub 0.36.2 with its
dependencies (the product downloads the model with it), at the lock's versions and hashes; and
the router's, smg 1.13.0 and its dependencies at locks/router.txt's versions and hashes (the
real router runs on the hosts), which the stand-in lock leaves out.

The CUDA 13.0 stack (CUDA13_STANDINS, CUDA13_REAL_WHEELS): locks/cuda13.0.txt's pins, and the
real wheels' own files, read off PyPI on 2026-12-07 (METADATA, WHEEL and the version modules,
through range requests on each wheel's zip directory) of

    torch-2.11.0-cp311-cp311-manylinux_2_28_x86_64.whl
    sglang-0.5.17-cp311-cp311-manylinux_2_34_x86_64.whl
    sglang_kernel-0.4.5-cp310-abi3-manylinux2014_x86_64.whl
    flashinfer_python-0.6.15.post1-py3-none-any.whl
    flash_attn_4-4.0.0b19-py3-none-any.whl

torch 2.11.0 (torch/version.py: ``__version__ = '2.11.0+cu130'``, ``cuda = '13.0'``), sglang
0.5.17 (its server's flags from locks/sglang-0.5.17.args.json), sglang-kernel 0.4.5 (import
package sgl_kernel, sgl_kernel/version.py), flashinfer-python 0.6.15.post1 (no flashinfer-cubin
in that lock) and flash-attn-4 4.0.0b19 (a wheel whose files lie under flash_attn/cute/: no
build). Beside them, real wheels: nvidia-cuda-runtime 13.0.96 (the pin that tells the product
the lock's CUDA, as it does in locks/cuda13.0.txt) and huggingface_hub 1.33.0 with its
dependencies (its METADATA's Requires-Dist and theirs, at the lock's versions).

Python: the real locks are resolved for CPython 3.12 (their headers' --python-version), the
sandbox's hosts run Debian 12's python3, 3.11 (sandbox/rootfs.py: bookworm). Each stand-in lock
is therefore resolved for 3.11: its real binary wheels are PyPI's CPython 3.11 (or abi3, or
py3) builds of the same versions, and its header says ``--python-version 3.11``, so that the
product's own check (operations/stages/mlenv.py python_problem) passes on the sandbox's hosts for
the same reason it passes on a real lab's. manylinux_2_34 (sglang 0.5.17's tag, cuda13.0.in) needs
glibc >= 2.34; Debian 12 has 2.36, so the tag would install there too; the stand-ins themselves
are py3-none-any.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import html
import io
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

STANDINS = Path(__file__).with_name("standins")
REPO_ROOT = Path(__file__).resolve().parent.parent
SGLANG_ARGS = REPO_ROOT / "locks" / "sglang-0.5.9.args.json"
STAMP = Path(".stamps") / "pypi-index.json"  # under www: what the index was built from

EPOCH = 1735689600  # 2025-01-01T00:00:00Z: every archive member's mtime
ZIP_TIME = (2025, 1, 1, 0, 0, 0)


@dataclass(frozen=True)
class RealWheel:
    """A wheel fetched from PyPI as it is: name, version, file name and its sha256 (PyPI's)."""

    name: str
    version: str
    filename: str
    sha256: str
    # pip download's --platform tags for a binary wheel (fetched for CPython 3.11, the hosts'
    # Debian 12 python, whatever this machine runs); () for a pure-Python wheel
    platforms: tuple[str, ...] = ()


# huggingface_hub and its dependencies (the product downloads model weights with it), as
# locks/cuda12.8.txt pins them; binary wheels for CPython 3.11 on x86_64
_HUB_WHEELS = (
    ("huggingface-hub", "0.36.2", "huggingface_hub-0.36.2-py3-none-any.whl", ()),
    ("filelock", "4.3.1", "filelock-4.3.1-py3-none-any.whl", ()),
    ("fsspec", "2026.6.0", "fsspec-2026.6.0-py3-none-any.whl", ()),
    ("hf-xet", "1.8.0", "hf_xet-1.8.0-cp38-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
     ("manylinux_2_17_x86_64",)),
    ("pyyaml", "6.0.4",
     ("pyyaml-6.0.4-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64"
      ".whl"), ("manylinux_2_17_x86_64",)),
    ("requests", "2.34.2", "requests-2.34.2-py3-none-any.whl", ()),
    ("certifi", "2026.10.19.post1", "certifi-2026.10.19.post1-py3-none-any.whl", ()),
    ("charset-normalizer", "3.5.3",
     ("charset_normalizer-3.5.3-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64"
      ".manylinux_2_5_x86_64.whl"), ("manylinux_2_28_x86_64",)),
    ("idna", "3.20", "idna-3.20-py3-none-any.whl", ()),
    ("urllib3", "2.8.0", "urllib3-2.8.0-py3-none-any.whl", ()),
    ("tqdm", "4.70.1", "tqdm-4.70.1-py3-none-any.whl", ()),
    ("typing-extensions", "4.16.0", "typing_extensions-4.16.0-py3-none-any.whl", ()),
)
_HUB_SHA256 = {
    "certifi-2026.10.19.post1-py3-none-any.whl":
        "1324c476b4811eff41a8bc2122cd0bbd4d9c7234c725446d99ab1612b3a7fdd2",
    "charset_normalizer-3.5.3-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64.manylinux_2_5_x86_64.whl":
        "2a6f937e0b70133d1f826d0a253331b6fe1a4c874808cc12e16f2fb8177042f4",
    "filelock-4.3.1-py3-none-any.whl":
        "79e43df8e9fe509cd83a3899a7c186c8077cbbe4d200a1ed3705c2f3bb6bc487",
    "fsspec-2026.6.0-py3-none-any.whl":
        "02e0b71817df9b2169dc30a16832045764def1191b43dcff5bb85bdee212d2a1",
    "hf_xet-1.8.0-cp38-abi3-manylinux2014_x86_64.manylinux_2_17_x86_64.whl":
        "29dab7c904cd1914a0439c6e1306c12c7497c8bd32290fbe563ebf51ca4b6d6d",
    "huggingface_hub-0.36.2-py3-none-any.whl":
        "48f0c8eac16145dfce371e9d2d7772854a4f591bcb56c9cf548accf531d54270",
    "idna-3.20-py3-none-any.whl":
        "ab7ae7122974553370f0bdb919e1a960b2cd1bc1ef0276416d896db81c14582c",
    "pyyaml-6.0.4-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl":
        "622aa875fa6533f25fedcffe23079357d65a690d462200afed5d8e9d0e01ebee",
    "requests-2.34.2-py3-none-any.whl":
        "2a0d60c172f83ac6ab31e4554906c0f3b3588d37b5cb939b1c061f4907e278e0",
    "tqdm-4.70.1-py3-none-any.whl":
        "c293e525e6fef9c20e8728fd4612df02a0aa31bb5fe91ecd93e123b1b7bffa73",
    "typing_extensions-4.16.0-py3-none-any.whl":
        "481caa481374e813c1b176ada14e97f1f67a4539ce9cfeb3f350d78d6370c2e8",
    "urllib3-2.8.0-py3-none-any.whl":
        "0cf3cae568d36aa9576b28dfb35f11328f1cb974ca7647d9475ebb86c75ac6e3",
}

# The router (locks/router.txt: smg 1.13.0 and its dependencies), the real wheels for CPython
# 3.11 on x86_64, served beside the stand-ins; pyyaml and typing-extensions are the hub's above.
# They are the router's lock's, not the stand-in ML lock's (ROUTER_PROJECTS: left out of it).
ROUTER_WHEELS = (
    RealWheel("smg", "1.13.0", "smg-1.13.0-cp38-abi3-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
              "cfae8171dac68a74b4822263b1864fa79952992ee472a25ba7266ccd200399b4",
              ("manylinux_2_17_x86_64",)),
    RealWheel("grpcio", "1.85.3",
              "grpcio-1.85.3-cp311-cp311-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
              "f2948333a1f462c0e559b5ea436655ed36822fa448f5713d6de2d483bed6e03f",
              ("manylinux_2_17_x86_64",)),
    RealWheel("grpcio-health-checking", "1.85.1", "grpcio_health_checking-1.85.1-py3-none-any.whl",
              "05e1cb0cc69706f89e884d219c9b2b9da4f561c1c610e9987ee4492b9c826ad1"),
    RealWheel("protobuf", "7.36.2", "protobuf-7.36.2-cp310-abi3-manylinux2014_x86_64.whl",
              "89f23aa53c24553a2416fd4fd1ec06f74fa42b14b546d8883128813f775bbfd2",
              ("manylinux2014_x86_64",)),
    RealWheel("setproctitle", "1.3.8",
              ("setproctitle-1.3.8-cp311-cp311-manylinux1_x86_64.manylinux_2_28_x86_64"
               ".manylinux_2_5_x86_64.whl"),
              "1a6f6a3b2920f4362e8d924f9e5b084f0b2692a2c140e348abd2e3a07a1def73",
              ("manylinux_2_28_x86_64",)),
)
ROUTER_PROJECTS = frozenset(w.name for w in ROUTER_WHEELS)

# flash-attn's build requirements without build isolation (locks/cuda12.8.txt's versions)
REAL_WHEELS = (
    RealWheel(
        "setuptools",
        "84.2.1",
        "setuptools-84.2.1-py3-none-any.whl",
        "ca140b45d5325a9478f880e351484f62fef15f336462e449ca0c03c873d589c2",
    ),
    RealWheel(
        "wheel",
        "0.48.0",
        "wheel-0.48.0-py3-none-any.whl",
        "3217dcc807155e45db462d7ef2431f5ddda0d7273b700d05a67b271ceb1287ab",
    ),
    RealWheel(
        "packaging",
        "26.4",
        "packaging-26.4-py3-none-any.whl",
        "81383611a09c1bc0b08b76e0fd5829d7c6824c65b27a6aee339da133f4233ea2",
    ),
) + tuple(RealWheel(n, v, f, _HUB_SHA256[f], plat) for n, v, f, plat in _HUB_WHEELS) \
    + ROUTER_WHEELS



@dataclass(frozen=True)
class StandIn:
    """A stand-in distribution built from sandbox/standins/<source>."""

    name: str  # the distribution name, as PyPI spells it
    version: str
    source: str  # folder under sandbox/standins/
    summary: str
    requires: tuple[str, ...] = ()
    sdist: bool = False
    # (archive path, text): files the build writes over the source's (a version module)
    generated: tuple[tuple[str, str], ...] = ()
    # the real server's flags (tools/sglang_args.py extract), for the sglang stand-in
    args: Path | None = None


def _version_module(what: str, version: str, **fields: object) -> str:
    """A stand-in's version module: ``__version__`` and the real module's other fields."""
    lines = [f'"""{what}: sandbox stand-in (gpuhost sandbox lab), written by '
             'sandbox/pypi_index.py."""', "", f"__version__ = {version!r}"]
    lines += [f"{name} = {value!r}" for name, value in fields.items()]
    return "\n".join(lines) + "\n"


def _torch_version(version: str, cuda: str) -> str:
    # torch/version.py's fields as PyPI's wheels have them (torch-2.11.0-cp311-cp311-
    # manylinux_2_28_x86_64.whl: '2.11.0+cu130', cuda '13.0', hip None)
    return _version_module(f"torch.version of PyTorch {version}", version, cuda=cuda,
                           hip=None, debug=False, git_version="sandbox-stand-in")


STANDIN_DISTS = (
    StandIn(
        "torch",
        "2.9.1",
        "torch",
        "Tensors and Dynamic neural networks in Python with strong GPU acceleration",
        generated=(("torch/version.py", _torch_version("2.9.1+cu128", "12.8")),),
    ),
    StandIn(
        "flashinfer-python",
        "0.6.3",
        "flashinfer",
        "FlashInfer: Kernel Library for LLM Serving",
        ("torch",),
        generated=(("flashinfer/version.py", _version_module("flashinfer", "0.6.3")),),
    ),
    StandIn("flashinfer-cubin", "0.6.3", "flashinfer_cubin", "Pre-compiled cubins for FlashInfer"),
    StandIn("sgl-kernel", "0.3.21", "sgl_kernel", "Kernel Library for SGLang", ("torch",),
            generated=(("sgl_kernel/version.py", _version_module("sgl_kernel", "0.3.21")),)),
    StandIn(
        "sglang",
        "0.5.9",
        "sglang",
        "SGLang is a fast serving framework for large language models and vision language models.",
        (
            "torch==2.9.1",
            "flashinfer_python==0.6.3",
            "flashinfer_cubin==0.6.3",
            "sgl-kernel==0.3.21",
        ),
        generated=(("sglang/version.py", _version_module("sglang", "0.5.9")),),
        args=SGLANG_ARGS,
    ),
    StandIn(
        "flash-attn",
        "2.8.3.post2",
        "flash_attn",
        "Flash Attention: Fast and Memory-Efficient Exact Attention",
        ("torch",),
        sdist=True,
    ),
)

#: The CUDA 13.0 stack's stand-ins (locks/cuda13.0.txt's versions). Summaries and the
#: requirements among the stand-ins are the real wheels' METADATA (sglang 0.5.17: torch==2.11.0,
#: flashinfer_python[cu13]==0.6.15.post1, sglang-kernel==0.4.5, flash-attn-4>=4.0.0b18; the
#: others' torch); the rest of their Requires-Dist is left out, as the 12.8 stand-ins leave it
#: (the product installs with --no-deps).
CUDA13_STANDINS = (
    StandIn(
        "torch",
        "2.11.0",
        "torch",
        "Tensors and Dynamic neural networks in Python with strong GPU acceleration",
        generated=(("torch/version.py", _torch_version("2.11.0+cu130", "13.0")),),
    ),
    StandIn(
        "flashinfer-python",
        "0.6.15.post1",
        "flashinfer",
        "FlashInfer: Kernel Library for LLM Serving",
        ("torch",),
        generated=(("flashinfer/version.py", _version_module("flashinfer", "0.6.15.post1")),),
    ),
    # the distribution sgl-kernel was renamed to; its import package is still sgl_kernel
    StandIn("sglang-kernel", "0.4.5", "sgl_kernel", "Kernel Library for SGLang",
            generated=(("sgl_kernel/version.py", _version_module("sgl_kernel", "0.4.5")),)),
    StandIn(
        "flash-attn-4",
        "4.0.0b19",
        "flash_attn_4",
        "Flash Attention CUTE (CUDA Template Engine) implementation",
        ("torch",),
    ),
    StandIn(
        "sglang",
        "0.5.17",
        "sglang",
        "SGLang is a fast serving framework for large language models and vision language models.",
        (
            "torch==2.11.0",
            "flashinfer_python[cu13]==0.6.15.post1",
            "sglang-kernel==0.4.5",
            "flash-attn-4>=4.0.0b18",
        ),
        generated=(("sglang/version.py", _version_module("sglang", "0.5.17")),),
        args=REPO_ROOT / "locks" / "sglang-0.5.17.args.json",
    ),
)

# huggingface_hub 1.33.0 and its dependencies at locks/cuda13.0.txt's pins (hub's METADATA:
# click, filelock, fsspec, hf-xet, httpx, packaging, pyyaml, tqdm, typing-extensions; httpx
# 0.29.0's: anyio, certifi, httpcore, idna; httpcore 1.0.9's: certifi, h11), and the CUDA
# runtime wheel; sha256 PyPI's (its simple index, 2026-12-07). Those the 12.8 stack has at the
# same version are its wheels (the same files).
_CUDA13_NEW = (
    RealWheel("huggingface-hub", "1.33.0", "huggingface_hub-1.33.0-py3-none-any.whl",
              "04e434b06e100eddbce9a6e817d72693a7884b10a79bd67ab48080d5c07eb899"),
    RealWheel("click", "8.5.1", "click-8.5.1-py3-none-any.whl",
              "8bb5376d2006950386f8c6427613334a2acadc5f559cb80e638d00b4df957e37"),
    RealWheel("filelock", "4.3.2", "filelock-4.3.2-py3-none-any.whl",
              "02a8801bc6b2a80921bf3d7895c63084d53bae2a3c86783adce5ae2b89a1825b"),
    RealWheel("fsspec", "2026.9.0", "fsspec-2026.9.0-py3-none-any.whl",
              "8dd6e646e99ea382bd85f97a45e6b526a442d79423a7dc673f1e2756d05fcb5f"),
    RealWheel("httpx", "0.29.0", "httpx-0.29.0-py3-none-any.whl",
              "6734dcf742ced6e8018e45d3f9f7728975b6b3e1085a24f3e2c056069d858bd1"),
    RealWheel("httpcore", "1.0.9", "httpcore-1.0.9-py3-none-any.whl",
              "2d400746a40668fc9dec9810239072b40b4484b640a8c38fd654a024c7a1bf55"),
    RealWheel("h11", "0.16.0", "h11-0.16.0-py3-none-any.whl",
              "63cf8bbe7522de3bf65932fda1d9c2772064ffb3dae62d55932da54b31cb6c86"),
    RealWheel("anyio", "4.16.0", "anyio-4.16.0-py3-none-any.whl",
              "c66ae634e0b8228396b801741beb3294326d4b6102f7bba4041c0dfb58c29026"),
    # the runtime wheel torch's cuda-toolkit[cudart] brings: the lock's pin that tells its CUDA
    RealWheel("nvidia-cuda-runtime", "13.0.96",
              ("nvidia_cuda_runtime-13.0.96-py3-none-manylinux2014_x86_64.manylinux_2_17_x86_64"
               ".whl"),
              "7f82250d7782aa23b6cfe765ecc7db554bd3c2870c43f3d1821f1d18aebf0548",
              ("manylinux_2_17_x86_64",)),
)
_SHARED_WITH_12_8 = ("certifi", "hf-xet", "idna", "packaging", "pyyaml", "tqdm",
                     "typing-extensions")
CUDA13_REAL_WHEELS = _CUDA13_NEW + tuple(
    w for w in REAL_WHEELS if w.name in _SHARED_WITH_12_8)

LOCK_HEADER = """\
# Stand-in lock for the gpuhost sandbox lab -- generated by sandbox/pypi_index.py; do not edit.
# Every distribution below is a sandbox stand-in (or, for setuptools/wheel/packaging, the real
# wheel) under the real name and version of locks/cuda12.8.txt's stack, served by the lab's
# index. Install as the real lock: pip install --require-hashes --no-deps -r this file, with
# flash-attn last and --no-build-isolation once torch and its build requirements are in.
#   resolved for: --python-version 3.11 (the hosts' Debian 12 python3; the real wheels below
#   are CPython 3.11 builds), named as locks/cuda12.8.txt's header names its own.
"""

CUDA13_LOCK_HEADER = """\
# Stand-in lock for the gpuhost sandbox lab -- generated by sandbox/pypi_index.py; do not edit.
# Every distribution below is a sandbox stand-in (or, for huggingface_hub and its dependencies
# and nvidia-cuda-runtime, the real wheel) under the real name and version of
# locks/cuda13.0.txt's stack, served by the lab's index. Install as the real lock: pip install
# --require-hashes --no-deps -r this file (no flash-attn build: flash-attn-4 is a wheel).
#   resolved for: --python-version 3.11 (the hosts' Debian 12 python3; the real wheels below
#   are CPython 3.11, abi3 or py3 builds), named as locks/cuda13.0.txt's header names its own.
"""


class PyPIIndexError(RuntimeError):
    """The index could not be built; the message says which step and why."""


@dataclass(frozen=True)
class Stack:
    """One locked stack's stand-ins and real wheels, and its stand-in lock's header."""

    cuda: str  # gpuhost_cuda_toolkit's value for it
    standins: tuple[StandIn, ...]
    real: tuple[RealWheel, ...]
    header: str


def stacks() -> dict[str, Stack]:
    """The stacks the index serves, by CUDA release: "12.8" (the lab's default lock) and
    "13.0". Read at each call, so that a test's replacement of REAL_WHEELS or
    CUDA13_REAL_WHEELS holds."""
    ml_real = tuple(w for w in REAL_WHEELS if w.name not in ROUTER_PROJECTS)
    return {
        "12.8": Stack("12.8", STANDIN_DISTS, ml_real, LOCK_HEADER),
        "13.0": Stack("13.0", CUDA13_STANDINS, CUDA13_REAL_WHEELS, CUDA13_LOCK_HEADER),
    }


def build(www: Path, cache: Path, lock_path: Path,
          stack_locks: dict[str, Path] | None = None) -> None:
    """Build (or keep, when nothing changed) the index under www/simple and write the locks.

    + www: the HTTP root; the index goes to www/simple/
    + cache: where the real wheels from PyPI are kept (fetched with pip download when missing)
    + lock_path: the CUDA 12.8 stack's stand-in lock to write
    + stack_locks: the other stacks' stand-in locks to write, by CUDA release ({"13.0": path});
      the index serves every stack's files either way

    Raises PyPIIndexError when a real wheel cannot be fetched or does not have PyPI's sha256, or
    when a stand-in sglang's args file (locks/sglang-<version>.args.json, the real server's
    flags) is missing.
    """
    www, cache, lock_path = Path(www), Path(cache), Path(lock_path)
    all_stacks = stacks()
    locks = {"12.8": lock_path, **{k: Path(v) for k, v in (stack_locks or {}).items()}}
    unknown = sorted(set(locks) - set(all_stacks))
    if unknown:
        raise PyPIIndexError(f"no stand-in stack for CUDA {', '.join(unknown)}: "
                             f"the index has {', '.join(all_stacks)}")
    wheels: dict[str, RealWheel] = {}  # by file name: a wheel two stacks share is served once
    for wheel in (*REAL_WHEELS, *(w for st in all_stacks.values() for w in st.real)):
        wheels.setdefault(wheel.filename, wheel)
    real = [_real_wheel(w, cache) for w in wheels.values()]
    dists: dict[tuple[str, str], StandIn] = {}
    for stack in all_stacks.values():
        for dist in stack.standins:
            dists.setdefault((dist.name, dist.version), dist)
    for dist in dists.values():
        if dist.args is not None and not dist.args.exists():
            raise PyPIIndexError(
                f"{dist.args} is missing: the sglang stand-in takes the real "
                f"server's flags from it (python tools/sglang_args.py extract {dist.version})"
            )
    stamp = {"inputs": _inputs_digest(real, dists.values())}
    simple = www / "simple"
    if (simple / "index.html").exists() and all(p.exists() for p in locks.values()) \
            and _read_json(www / STAMP) == stamp:
        for cuda, path in locks.items():
            if not path.read_text().startswith(all_stacks[cuda].header):
                # An index built before the header changed: the same pins, the header of now.
                path.write_text(lock_text(simple, all_stacks[cuda]))
        return
    files: list[tuple[str, str, Path]] = []  # (project, version, file)
    with tempfile.TemporaryDirectory(prefix="gpuhost-pypi-") as tmp:
        out = Path(tmp)
        for dist in dists.values():
            path = build_sdist(dist, out) if dist.sdist else build_wheel(dist, out)
            files.append((dist.name, dist.version, path))
        for wheel, path in zip(wheels.values(), real):
            files.append((wheel.name, wheel.version, path))
        new = www / ".simple.new"
        shutil.rmtree(new, ignore_errors=True)
        _write_index(new, files)
        old = www / ".simple.old"
        shutil.rmtree(old, ignore_errors=True)
        if simple.exists():
            simple.rename(old)
        new.rename(simple)
        shutil.rmtree(old, ignore_errors=True)
    for cuda, path in locks.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(lock_text(simple, all_stacks[cuda]))
    (www / STAMP).parent.mkdir(parents=True, exist_ok=True)
    (www / STAMP).write_text(json.dumps(stamp) + "\n")


def lock_text(simple: Path, stack: Stack | None = None) -> str:
    """The stand-in lock of `stack` (default: CUDA 12.8's) for the index at `simple`: one pin
    per distribution of the stack, a hash per file of its version, sorted by project; the
    router's projects are never in it (they are locks/router.txt's)."""
    stack = stack or stacks()["12.8"]
    pins = {normalize(d.name): d.version for d in stack.standins}
    pins.update({normalize(w.name): w.version for w in stack.real})
    lines = [stack.header]
    for project in sorted(p for p in pins if p not in ROUTER_PROJECTS):
        version = pins[project]
        dists = sorted(f for f in (simple / project).iterdir()
                       if f.name != "index.html" and _version_of(f.name) == version)
        hashes = " \\\n".join(f"    --hash=sha256:{_sha256(f)}" for f in dists)
        lines.append(f"{project}=={version} \\\n{hashes}\n")
    return "".join(lines)


def normalize(name: str) -> str:
    """PEP 503 name normalisation."""
    return re.sub(r"[-_.]+", "-", name).lower()


# --- stand-ins ---------------------------------------------------------------------------------


def _sources(dist: StandIn) -> dict[str, bytes]:
    """Archive path -> bytes of a stand-in's package files (caches and setup.py left out)."""
    root = STANDINS / dist.source
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if path.is_dir() or "__pycache__" in rel or path.suffix == ".pyc":
            continue
        if not dist.sdist and rel == "setup.py":
            continue
        out[rel] = path.read_bytes()
    for rel, text in dist.generated:
        out[rel] = text.encode()
    if dist.args is not None:
        out["sglang/_standin/server_args.json"] = dist.args.read_bytes()
    return dict(sorted(out.items()))


def _metadata(dist: StandIn) -> str:
    lines = [
        "Metadata-Version: 2.1",
        f"Name: {dist.name}",
        f"Version: {dist.version}",
        f"Summary: {dist.summary} (gpuhost sandbox stand-in)",
        "Requires-Python: >=3.9",
    ]
    lines += [f"Requires-Dist: {r}" for r in dist.requires]
    return (
        "\n".join(lines) + "\n\nSandbox stand-in of this distribution: it installs under the "
        "real name and version and does no real work.\n"
    )


def build_wheel(dist: StandIn, out: Path) -> Path:
    """A py3-none-any wheel of the stand-in with METADATA, WHEEL and RECORD; byte-reproducible."""
    stem = f"{re.sub(r'[-_.]+', '_', dist.name)}-{dist.version}"
    info = f"{stem}.dist-info"
    members = dict(_sources(dist))
    members[f"{info}/METADATA"] = _metadata(dist).encode()
    members[f"{info}/WHEEL"] = (
        b"Wheel-Version: 1.0\nGenerator: gpuhost-sandbox "
        b"(sandbox/pypi_index.py)\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n"
    )
    members[f"{info}/top_level.txt"] = "".join(
        sorted({p.split("/")[0] + "\n" for p in _sources(dist)})
    ).encode()
    record = "".join(
        f"{p},sha256={_b64(hashlib.sha256(b).digest())},{len(b)}\n"
        for p, b in sorted(members.items())
    )
    members[f"{info}/RECORD"] = (record + f"{info}/RECORD,,\n").encode()
    path = out / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        # package files first, dist-info last, RECORD at the very end (as wheel tools write)
        order = sorted(members, key=lambda p: (p.startswith(info), p == f"{info}/RECORD", p))
        for name in order:
            zi = zipfile.ZipInfo(name, ZIP_TIME)
            zi.compress_type = zipfile.ZIP_DEFLATED
            zi.external_attr = 0o644 << 16
            zf.writestr(zi, members[name])
    return path


def build_sdist(dist: StandIn, out: Path) -> Path:
    """A .tar.gz sdist (PKG-INFO, setup.py, the package); byte-reproducible."""
    stem = f"{re.sub(r'[-_.]+', '_', dist.name)}-{dist.version}"
    members = dict(_sources(dist))
    members["PKG-INFO"] = _metadata(dist).encode()
    path = out / f"{stem}.tar.gz"
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.GNU_FORMAT) as tf:
        for name in sorted(members):
            data = members[name]
            ti = tarfile.TarInfo(f"{stem}/{name}")
            ti.size, ti.mtime, ti.mode = len(data), EPOCH, 0o644
            ti.uid = ti.gid = 0
            ti.uname = ti.gname = "root"
            tf.addfile(ti, io.BytesIO(data))
    with open(path, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
        gz.write(buf.getvalue())
    return path


# --- real wheels -------------------------------------------------------------------------------


def _real_wheel(wheel: RealWheel, cache: Path) -> Path:
    """The cached real wheel, fetched with pip download when missing; checked against PyPI's
    sha256 either way."""
    path = cache / wheel.filename
    if not path.exists():
        cache.mkdir(parents=True, exist_ok=True)
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--disable-pip-version-check",
            "-d",
            str(cache),
            f"{wheel.name}=={wheel.version}",
        ]
        if wheel.platforms:
            cmd[4:4] = ["--python-version", "3.11", "--implementation", "cp"] + [
                a for tag in wheel.platforms for a in ("--platform", tag)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not path.exists():
            raise PyPIIndexError(
                f"could not fetch {wheel.filename} from PyPI into {cache}: "
                f"{proc.stderr.strip() or proc.stdout.strip()}"
            )
    digest = _sha256(path)
    if digest != wheel.sha256:
        raise PyPIIndexError(
            f"{path} has sha256 {digest}, PyPI's is {wheel.sha256}: delete it to fetch it again"
        )
    return path


# --- index -------------------------------------------------------------------------------------


def _write_index(simple: Path, files: list[tuple[str, str, Path]]) -> None:
    by_project: dict[str, list[Path]] = {}
    for name, _version, path in files:
        project = simple / normalize(name)
        project.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, project / path.name)
        by_project.setdefault(normalize(name), []).append(project / path.name)
    head = (
        '<!DOCTYPE html>\n<html>\n  <head>\n    <meta name="pypi:repository-version" '
        'content="1.0">\n    <title>{title}</title>\n  </head>\n  <body>\n'
    )
    tail = "  </body>\n</html>\n"
    for project, paths in sorted(by_project.items()):
        links = "".join(
            f'    <a href="{html.escape(p.name)}#sha256={_sha256(p)}" '
            f'data-requires-python="&gt;=3.9">{html.escape(p.name)}</a><br>\n'
            for p in sorted(paths)
        )
        (simple / project / "index.html").write_text(
            head.format(title=f"Links for {project}")
            + f"    <h1>Links for {project}</h1>\n"
            + links
            + tail
        )
    projects = "".join(f'    <a href="{p}/">{p}</a><br>\n' for p in sorted(by_project))
    (simple / "index.html").write_text(head.format(title="Simple index") + projects + tail)


def _version_of(filename: str) -> str:
    if filename.endswith(".whl"):
        return filename.split("-")[1]
    return filename[: -len(".tar.gz")].rsplit("-", 1)[1]


def _inputs_digest(real: list[Path], dists) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for dist in dists:
        for name, data in sorted(_sources(dist).items()):
            h.update(f"{dist.name}-{dist.version}/{name}".encode() + b"\0" + data)
    for path in real:
        h.update(path.name.encode() + _sha256(path).encode())
    return h.hexdigest()


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
