"""Checks of the committed locks (locks/) and of the tools that make them (tools/).

Offline: the lock parses (every requirement pinned with == and hashed), torch is the build
sglang pins and a CUDA 12.8 one, and the reference launch's flags and values are accepted by
the chosen sglang's argument data. The tool's static reading of server_args.py is exercised on
a small synthetic wheel. The one test marked ``network`` re-resolves the lock with uv.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LOCKS = REPO / "locks"
TOOLS = REPO / "tools"
STACK = "cuda12.8"
LOCK = LOCKS / f"{STACK}.txt"
LOCK_IN = LOCKS / f"{STACK}.in"
LAUNCH = LOCKS / "reference-launch.txt"

# What the sglang wheels' METADATA say (Requires-Dist), for the versions this stack may take.
SGLANG_TORCH = {"0.5.9": "2.9.1", "0.5.10": "2.9.1", "0.5.10.post1": "2.9.1"}

ARG_KEYS = {"flags", "dest", "action", "type", "choices", "nargs", "required", "default"}
NO_VALUE_ACTIONS = {"store_true", "store_false", "store_const", "count", "BooleanOptionalAction",
                    "DeprecatedStoreTrueAction"}


def load_tool(name: str):
    if str(TOOLS) not in sys.path:
        sys.path.insert(0, str(TOOLS))
    spec = importlib.util.spec_from_file_location(f"tools_{name}", TOOLS / f"{name}.py")
    if spec.name in sys.modules:
        return sys.modules[spec.name]
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lock_requirements(text: str) -> dict[str, dict]:
    """An independent reading of a hashed requirements file: {name: {version, hashes}}."""
    reqs: dict[str, dict] = {}
    current = None
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("#"):
            continue
        if not raw[0].isspace():
            m = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)(\s*;[^\\]*)?\s*\\?", raw)
            assert m, f"requirement not pinned with ==: {raw!r}"
            current = reqs.setdefault(norm(m.group(1)), {"version": m.group(2), "hashes": []})
        else:
            assert current is not None, f"continuation line without a requirement: {raw!r}"
            current["hashes"] += re.findall(r"--hash=sha256:[0-9a-f]{64}", raw)
    return reqs


@pytest.fixture(scope="module")
def lock() -> dict[str, dict]:
    return lock_requirements(LOCK.read_text())


@pytest.fixture(scope="module")
def chosen(lock) -> str:
    return lock["sglang"]["version"]


def launch_pairs() -> list[tuple[str, str | None]]:
    lines = [ln for ln in LAUNCH.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    argv = shlex.split(" ".join(lines))
    argv = argv[argv.index("-m") + 2:]
    pairs, i = [], 0
    while i < len(argv):
        assert argv[i].startswith("--"), argv[i]
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            pairs.append((argv[i], argv[i + 1]))
            i += 2
        else:
            pairs.append((argv[i], None))
            i += 1
    return pairs


# --- the lock ---------------------------------------------------------------


def test_every_requirement_is_pinned_and_hashed(lock):
    assert len(lock) > 50
    unhashed = [name for name, r in lock.items() if not r["hashes"]]
    assert not unhashed, f"requirements without --hash: {unhashed}"


def test_lock_header_names_its_generator():
    head = LOCK.read_text().split("\n\n")[0]
    assert f"python tools/lock.py {STACK}" in head
    assert "uv pip compile" in head and "--generate-hashes" in head
    assert "--python-platform x86_64-manylinux_2_28" in head and "--python-version 3.12" in head


def test_every_input_requirement_is_locked(lock):
    for line in LOCK_IN.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*(\S+))?", line.strip())
        assert norm(m.group(1)) in lock, f"{m.group(1)} is in {LOCK_IN.name} but not locked"
        if m.group(2):
            assert lock[norm(m.group(1))]["version"] == m.group(2)


def test_torch_matches_sglang_pin(lock, chosen):
    torch = lock["torch"]["version"]
    header = re.search(rf"# sglang {re.escape(chosen)} Requires-Dist[^:]*:(.*)", LOCK.read_text())
    assert header, "the lock header does not quote sglang's Requires-Dist"
    pinned = re.search(r"torch==([^\s,]+)", header.group(1))
    assert pinned and pinned.group(1).rstrip(".") == torch
    if chosen in SGLANG_TORCH:
        assert torch == SGLANG_TORCH[chosen]


def test_torch_is_the_cuda_12_8_build(lock):
    assert "+" not in lock["torch"]["version"], "a local (+cpu/+cuXXX) torch is not PyPI's"
    runtime = lock["nvidia-cuda-runtime-cu12"]["version"]
    assert runtime.startswith("12.8."), runtime
    assert not any(name.endswith("-cu13") for name in lock)


def test_the_cuda13_lock_is_sglangs_torch_a_cuda_13_0_build_and_builds_nothing():
    # locks/cuda13.0.txt (gpuhost_cuda_toolkit = "13.0"): sglang 0.5.17's METADATA pins
    # torch==2.11.0, whose PyPI wheel needs CUDA 13's runtime wheel (nvidia-cuda-runtime,
    # no -cu13 suffix from CUDA 13 on) and an R580 driver
    text = (LOCKS / "cuda13.0.txt").read_text()
    lock13 = lock_requirements(text)
    assert len(lock13) > 50 and all(r["hashes"] for r in lock13.values())
    head = text.split("\n\n")[0]
    assert "python tools/lock.py cuda13.0" in head
    assert "--python-platform x86_64-manylinux_2_34" in head and "--python-version 3.12" in head
    assert "Minimum NVIDIA driver: 580.65.06 (R580)." in head
    assert lock13["sglang"]["version"] == "0.5.17"
    pins = re.search(r"# sglang 0\.5\.17 Requires-Dist[^:]*:(.*)", text).group(1)
    assert "torch==2.11.0" in pins and lock13["torch"]["version"] == "2.11.0"
    assert lock13["nvidia-cuda-runtime"]["version"].startswith("13.0.")
    assert "nvidia-cuda-runtime-cu12" not in lock13 and "nvidia-nccl-cu13" in lock13
    assert "flash-attn" not in lock13 and "flash-attn-4" in lock13  # a wheel: nothing to build
    assert (LOCKS / "sglang-0.5.17.args.json").is_file()


def test_flash_attn_and_its_build_requirements_are_locked(lock):
    for name in ("flash-attn", "setuptools", "wheel", "packaging", "ninja", "psutil",
                 "huggingface-hub"):
        assert name in lock


# --- the args data ------------------------------------------------------------


def args_doc(version: str) -> dict:
    return json.loads((LOCKS / f"sglang-{version}.args.json").read_text())


@pytest.mark.parametrize("path", sorted(LOCKS.glob("sglang-*.args.json")), ids=lambda p: p.name)
def test_args_files_have_the_agreed_shape(path):
    doc = json.loads(path.read_text())
    assert set(doc) == {"package", "version", "source", "arguments"}
    assert doc["package"] == "sglang"
    assert re.fullmatch(
        rf"sglang-{re.escape(doc['version'])}-\S+\.whl sha256:[0-9a-f]{{64}} sglang/srt/server_args.py",
        doc["source"],
    )
    flags = set()
    for a in doc["arguments"]:
        extra = set(a) - ARG_KEYS
        assert extra <= {"choices_unresolved"}, extra
        assert ARG_KEYS <= set(a)
        if "choices_unresolved" in a:
            assert a["choices"] is None
        assert a["flags"] and all(f.startswith("-") for f in a["flags"])
        assert isinstance(a["action"], str) and isinstance(a["required"], bool)
        assert not flags & set(a["flags"]), f"flag registered twice: {flags & set(a['flags'])}"
        flags |= set(a["flags"])
    assert path.stat().st_size < 400_000


def find_argument(doc: dict, flag: str) -> dict | None:
    index = {f: a for a in doc["arguments"] for f in a["flags"]}
    if flag in index:
        return index[flag]
    prefixed = [f for f in index if f.startswith(flag)]  # argparse's allow_abbrev
    return index[prefixed[0]] if len(prefixed) == 1 else None


def test_reference_launch_is_accepted_by_the_chosen_sglang(chosen):
    doc = args_doc(chosen)
    for flag, value in launch_pairs():
        arg = find_argument(doc, flag)
        assert arg is not None, f"sglang {chosen} has no {flag}"
        if arg["action"] in NO_VALUE_ACTIONS:
            assert value is None, f"{flag} takes no value"
            continue
        assert value is not None, f"{flag} needs a value"
        if arg["choices"] is not None:
            typed = {"int": int, "float": float}.get(arg["type"], str)(value)
            assert typed in arg["choices"], f"{flag} {value} not in {arg['choices']}"


def test_the_reference_values_that_matter_are_real_choices(chosen):
    doc = args_doc(chosen)
    expected = {
        "--moe-runner-backend": "flashinfer_trtllm",
        "--nsa-decode-backend": "trtllm",
        "--nsa-prefill-backend": "trtllm",
        "--tool-call-parser": "glm47",
        "--reasoning-parser": "glm45",
        "--fp8-gemm-backend": "cutlass",
        "--attention-backend": "flashinfer",
        "--quantization": "modelopt_fp4",
        "--kv-cache-dtype": "auto",
    }
    for flag, value in expected.items():
        arg = find_argument(doc, flag)
        assert arg is not None and arg["choices"], f"{flag}: no resolved choices"
        assert value in arg["choices"], f"{flag} {value}"


def test_renames_translate_the_launch_to_the_newest_release():
    renames = json.loads((LOCKS / "sglang-flag-renames.json").read_text())
    newest = args_doc(renames["new"])
    newest_flags = {f for a in newest["arguments"] for f in a["flags"]}
    assert renames["renames"]["--nsa-decode-backend"] == "--dsa-decode-backend"
    assert renames["renames"]["--nsa-prefill-backend"] == "--dsa-prefill-backend"
    for flag, _ in launch_pairs():
        if find_argument(newest, flag) is None:
            target = renames["renames"].get(flag)
            assert target, f"{flag} is gone in {renames['new']} with no rename recorded"
            assert re.split(r"[=\s]", target)[0] in newest_flags


# --- the extractor on a synthetic wheel --------------------------------------

SERVER_ARGS_OLD = '''
import argparse
import dataclasses
from typing import List, Optional
from sglang.srt.choices import BACKENDS
from sglang.srt.parser import Parser

MODES = ["a", "b"]
MODES += ["c"]

@dataclasses.dataclass
class ServerArgs:
    model_path: str
    mode: str = "a"
    sizes: List[int] = dataclasses.field(default_factory=list)
    backend: Optional[str] = None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser):
        names = list(Parser.Registry.keys())
        parser.add_argument("--model-path", "--model", type=str, required=True)
        parser.add_argument("--mode", type=str, choices=MODES, default=ServerArgs.mode)
        parser.add_argument("--sizes", type=int, nargs="+", default=ServerArgs.sizes)
        parser.add_argument("--backend", choices=BACKENDS + ["x"], default=ServerArgs.backend)
        parser.add_argument("--parser", choices=["auto"] + names)
        parser.add_argument("--cfg", type=json.loads)
        parser.add_argument("--fast", action="store_true")
        parser.add_argument("--dyn", choices=get_choices_at_runtime())
        parser.add_argument("--old-mode", dest="mode", action=DeprecatedAliasStoreAction,
                            new_flag="--mode", help="[Deprecated] Use --mode instead.")
'''

SERVER_ARGS_NEW = '''
import argparse
from typing import Literal, Optional
from sglang.srt.arg_groups.arg_utils import A, Arg, add_cli_args_from_dataclass
from sglang.srt.choices import BACKENDS
import msgspec

class Exec(msgspec.Struct):
    _NS_PATH = "exec"
    backend: A[Optional[str], Arg(help="Backend.", choices=BACKENDS)] = None
    level: A[Literal["low", "high"], "Level."] = "low"
    fast: A[bool, "Go fast."] = False
    hidden: A[int, Arg(help="x", no_cli=True)] = 3
    tp_size: A[int, Arg(help="TP.", cli_name="--tp-size", aliases=["--tensor-parallel-size"])] = 1
    tf32: A[Optional[bool], Arg(help="tf32", action=argparse.BooleanOptionalAction)] = None

_INPUT_NAMESPACES = [Exec]
_a, _d, _n = collect_input_fields(_INPUT_NAMESPACES)

class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        add_cli_args_from_dataclass(parser, ServerArgs)
        parser.add_argument("--sampling", choices=sorted({"p", "f"}), default=_declared_default("sampling"))

ServerArgs = msgspec.defstruct("ServerArgs", [])
'''

SIBLINGS = {
    "sglang/__init__.py": "",
    "sglang/srt/__init__.py": "",
    "sglang/srt/choices.py": "BACKENDS = ['flashinfer', *('triton',)]\n",
    "sglang/srt/parser.py": "class Parser:\n    Registry = {'glm45': 1, 'qwen3': 2}\n",
}


def make_wheel(tmp_path: Path, server_args: str) -> Path:
    path = tmp_path / "sglang-9.9.9-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in SIBLINGS.items():
            z.writestr(name, text)
        z.writestr("sglang/srt/server_args.py", server_args)
    return path


def test_extractor_reads_add_argument_calls(tmp_path):
    tool = load_tool("sglang_args")
    doc, args = tool.extract(make_wheel(tmp_path, SERVER_ARGS_OLD), "0" * 64, "9.9.9")
    by = {a["flags"][0]: a for a in doc["arguments"]}
    assert by["--model-path"]["flags"] == ["--model-path", "--model"]
    assert by["--model-path"]["required"] is True and by["--model-path"]["type"] == "str"
    assert by["--mode"]["choices"] == ["a", "b", "c"] and by["--mode"]["default"] == "a"
    assert by["--sizes"]["nargs"] == "+" and by["--sizes"]["default"] == []
    assert by["--backend"]["choices"] == ["flashinfer", "triton", "x"]
    assert by["--parser"]["choices"] == ["auto", "glm45", "qwen3"]
    assert by["--cfg"]["type"] == "json"
    assert by["--fast"]["action"] == "store_true" and by["--fast"]["default"] is False
    assert by["--dyn"]["choices"] is None
    assert by["--dyn"]["choices_unresolved"].startswith("get_choices_at_runtime()")
    assert by["--old-mode"]["action"] == "DeprecatedAliasStoreAction"
    dep = {a.flags[0]: tool.deprecation(a) for a in args}
    assert dep["--old-mode"][:2] == (True, "--mode")
    assert dep["--mode"][0] is False


def test_extractor_reads_dataclass_fields(tmp_path):
    tool = load_tool("sglang_args")
    doc, _ = tool.extract(make_wheel(tmp_path, SERVER_ARGS_NEW), "0" * 64, "9.9.9")
    by = {a["flags"][0]: a for a in doc["arguments"]}
    assert "--hidden" not in by
    assert by["--backend"]["choices"] == ["flashinfer", "triton"]
    assert by["--level"]["choices"] == ["low", "high"] and by["--level"]["default"] == "low"
    assert by["--fast"]["action"] == "store_true"
    assert by["--tp-size"]["flags"] == ["--tp-size", "--tensor-parallel-size"]
    assert by["--tp-size"]["dest"] == "tp_size" and by["--tp-size"]["type"] == "int"
    assert by["--tf32"]["flags"] == ["--tf32", "--no-tf32"]
    assert by["--sampling"]["choices"] == ["f", "p"]


def test_renames_follow_deprecations_across_versions():
    tool = load_tool("sglang_args")

    def arg(flags, dest, action="store", help="", new_flag=None):
        return tool.Argument(flags=flags, dest=dest, action=action, type="str", choices=None,
                             nargs=None, required=False, default=None, help=help,
                             new_flag=new_flag, new_flag_kind="new_flag" if new_flag else "")

    chain = [
        ("1.0", [arg(["--nsa-x"], "nsa_x"), arg(["--gone"], "gone"), arg(["--keep"], "keep")]),
        ("1.1", [arg(["--dsa-x"], "dsa_x"),
                 arg(["--nsa-x"], "dsa_x", "DeprecatedAliasStoreAction", new_flag="--dsa-x"),
                 arg(["--keep"], "keep", "store_true", help="(Deprecated: use --keep2=auto) x")]),
        ("1.2", [arg(["--dsa-x"], "dsa_x"),
                 arg(["--keep"], "keep", "store_true", help="(Deprecated: use --keep2=auto) x")]),
    ]
    doc = tool.build_renames(chain, ["1.0"])
    assert doc["renames"] == {"--nsa-x": "--dsa-x"}
    assert doc["details"]["--nsa-x"]["removed_in"] == "1.2"
    assert [g["flag"] for g in doc["removed_without_named_replacement"]] == ["--gone"]
    assert doc["deprecated_but_accepted_in_new"]["--keep"]["replacement"] == "--keep2=auto"


# --- re-resolution -------------------------------------------------------------


@pytest.mark.network
def test_lock_equals_a_fresh_resolution(tmp_path, lock):
    uv = Path(sys.executable).parent / "uv"
    if not uv.exists() and not shutil.which("uv"):
        pytest.skip("uv is not installed")
    tool = load_tool("lock")
    out = tmp_path / f"{STACK}.txt"
    tool.resolve(STACK, out)
    fresh = lock_requirements(out.read_text())
    assert {k: v["version"] for k, v in fresh.items()} == {k: v["version"] for k, v in lock.items()}
    for name, req in fresh.items():
        assert set(req["hashes"]) == set(lock[name]["hashes"]), name
