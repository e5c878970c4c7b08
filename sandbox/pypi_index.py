"""The sandbox lab's Python package index: stand-in distributions under the real names and
versions of the locked CUDA 12.8 stack (locks/cuda12.8.txt), a PEP 503 simple index, and a
stand-in lock pinning them by sha256.

    <www>/simple/index.html                       the project list
    <www>/simple/<project>/index.html             links carrying #sha256=<hex>
    <www>/simple/<project>/<file>                 the distributions
    <lock_path>                                   pip requirements with --hash=sha256: lines

Stand-ins (sources under sandbox/standins/, built here into reproducible wheels and one sdist):
torch 2.9.1 (torch.__version__ "2.9.1+cu128"), flash-attn 2.8.3.post2 (an sdist whose setup.py
imports torch and records its build environment), flashinfer-python 0.6.3, flashinfer-cubin
0.6.3, sgl-kernel 0.3.21 and sglang 0.5.9 (the versions sglang 0.5.9's METADATA pins). Beside
them, real wheels fetched once from PyPI into `cache`: flash-attn's build requirements under
--no-build-isolation (setuptools, wheel, packaging), and huggingface_hub 0.36.2 with its
dependencies (the product downloads the model with it), at the lock's versions and hashes; and
the router's, smg 1.13.0 and its dependencies at locks/router.txt's versions and hashes (the
real router runs on the hosts), which the stand-in lock leaves out.
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


STANDIN_DISTS = (
    StandIn(
        "torch",
        "2.9.1",
        "torch",
        "Tensors and Dynamic neural networks in Python with strong GPU acceleration",
    ),
    StandIn(
        "flashinfer-python",
        "0.6.3",
        "flashinfer",
        "FlashInfer: Kernel Library for LLM Serving",
        ("torch",),
    ),
    StandIn("flashinfer-cubin", "0.6.3", "flashinfer_cubin", "Pre-compiled cubins for FlashInfer"),
    StandIn("sgl-kernel", "0.3.21", "sgl_kernel", "Kernel Library for SGLang", ("torch",)),
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

LOCK_HEADER = """\
# Stand-in lock for the gpuhost sandbox lab -- generated by sandbox/pypi_index.py; do not edit.
# Every distribution below is a sandbox stand-in (or, for setuptools/wheel/packaging, the real
# wheel) under the real name and version of locks/cuda12.8.txt's stack, served by the lab's
# index. Install as the real lock: pip install --require-hashes --no-deps -r this file, with
# flash-attn last and --no-build-isolation once torch and its build requirements are in.
#   resolved for: --python-version 3.11 (the hosts' Debian 12 python3; the real wheels below
#   are CPython 3.11 builds), named as locks/cuda12.8.txt's header names its own.
"""


class PyPIIndexError(RuntimeError):
    """The index could not be built; the message says which step and why."""


def build(www: Path, cache: Path, lock_path: Path) -> None:
    """Build (or keep, when nothing changed) the index under www/simple and write the lock.

    + www: the HTTP root; the index goes to www/simple/
    + cache: where the real wheels from PyPI are kept (fetched with pip download when missing)
    + lock_path: the stand-in lock to write

    Raises PyPIIndexError when a real wheel cannot be fetched or does not have PyPI's sha256, or
    when locks/sglang-0.5.9.args.json (the real server's flags) is missing.
    """
    www, cache, lock_path = Path(www), Path(cache), Path(lock_path)
    real = [_real_wheel(w, cache) for w in REAL_WHEELS]
    if not SGLANG_ARGS.exists():
        raise PyPIIndexError(
            f"{SGLANG_ARGS} is missing: the sglang stand-in takes the real "
            "server's flags from it (python tools/sglang_args.py extract 0.5.9)"
        )
    stamp = {"inputs": _inputs_digest(real)}
    simple = www / "simple"
    if (simple / "index.html").exists() and lock_path.exists() and _read_json(www / STAMP) == stamp:
        if not lock_path.read_text().startswith(LOCK_HEADER):
            # An index built before the header changed: the same pins, the header of now.
            lock_path.write_text(lock_text(simple))
        return
    files: list[tuple[str, str, Path]] = []  # (project, version, file)
    with tempfile.TemporaryDirectory(prefix="gpuhost-pypi-") as tmp:
        out = Path(tmp)
        for dist in STANDIN_DISTS:
            path = build_sdist(dist, out) if dist.sdist else build_wheel(dist, out)
            files.append((dist.name, dist.version, path))
        for wheel, path in zip(REAL_WHEELS, real):
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
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    lock_path.write_text(lock_text(simple))
    (www / STAMP).parent.mkdir(parents=True, exist_ok=True)
    (www / STAMP).write_text(json.dumps(stamp) + "\n")


def lock_text(simple: Path) -> str:
    """The lock for the index at `simple`: one pin per project, a hash per file, sorted; the
    router's projects left out (they are locks/router.txt's)."""
    lines = [LOCK_HEADER]
    for project in sorted(p for p in simple.iterdir()
                          if p.is_dir() and p.name not in ROUTER_PROJECTS):
        dists = sorted(f for f in project.iterdir() if f.name != "index.html")
        version = _version_of(dists[0].name)
        hashes = " \\\n".join(f"    --hash=sha256:{_sha256(f)}" for f in dists)
        lines.append(f"{project.name}=={version} \\\n{hashes}\n")
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
    if dist.name == "sglang":
        out["sglang/_standin/server_args.json"] = SGLANG_ARGS.read_bytes()
    return out


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


def _inputs_digest(real: list[Path]) -> str:
    h = hashlib.sha256(Path(__file__).read_bytes())
    for dist in STANDIN_DISTS:
        for name, data in sorted(_sources(dist).items()):
            h.update(f"{dist.source}/{name}".encode() + b"\0" + data)
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
