"""The sandbox lab's scenarios: the stand-in hardware of /etc/gpuhost-sandbox/hardware.json.

A scenario file (sandbox/scenarios/<name>.json) is written for people: per-GPU values common to
every GPU sit in `gpu_defaults`. `hardware_json(name)` expands and checks it into the document the
stand-ins read (nvidia-smi, the torch stand-in, the flash-attn stand-in's build):

    {
      "schema": 1,
      "scenario": "reference-lab",
      "description": "...",
      "virtualization": {"systemd_detect_virt": "kvm",          # what systemd-detect-virt answers
                         "dmi": {"sys_vendor": "QEMU", "product_name": "...", ...} | null},
      "host": {"cpu_count": 128,                                # what the real host's nproc says
               "flash_attn_max_parallel_jobs": 64 | null,       # more compile jobs than this: OOM
               "dkms_build_seconds": 0,                         # the kernel module's DKMS build
               "flash_attn_build_seconds": 0,                   # flash-attn's compile (default 0)
               "secure_boot": false,                            # what mokutil --sb-state says
               "os_release": null | "ubuntu-24.04",             # /etc/os-release it presents
               "enrolled_mok": ["<sha256 of a DER cert>"]},     # MOKs the firmware holds ([])
      "gpus": [{"index": 0, "name": "...", "uuid": "GPU-...", "pci_bus_id": "00000000:01:00.0",
                # [] for a host without GPUs (cpu-only: topology and p2p then default to [])
                "compute_cap": "12.0", "memory_total_mib": 97887, "power_limit_w": 600.0,
                "power_max_limit_w": 600.0, "clocks_sm_mhz": 180, "clocks_max_sm_mhz": 2430,
                "persistence_mode": "Enabled", "cpu_affinity": "0-127", "numa_affinity": "0",
                "gpu_numa_id": "N/A", ...}],                    # every key of GPU_DEFAULTS, filled
      "topology": [["X", "PHB"], ["PHB", "X"]],                 # `nvidia-smi topo -m` link matrix
      "p2p": {"r": [[...]], "w": [[...]], "n": [[...]],         # `nvidia-smi topo -p2p r|w|n|a|p`
              "a": [[...]], "p": [[...]]},
      "peer_transfers": {"copy": "intact" | "wrong-data",       # what arrives over P2P (torch
                         "all_reduce": "intact" | "wrong-data" | "hang"},  # stand-in); intact
      "serving": {                                              # the sglang stand-in under load
        "output_tokens_per_s": {"<MoE runner backend> | default": {"1": 11, "64": 225}},
                                        # all streams' output tok/s at N concurrent (log-linear)
        "backend_modes": {"<MoE runner backend>": "crash-on-start" | "degenerate"},
        "load": {"1": {"power_pct": 40, "sm_clock_pct": 99.7, "utilization_gpu_pct": 100,
                       "utilization_memory_pct": 20, "temperature_c": 50, "pcie_mbps": 40,
                       "reasons": []}, "64": {...}}}   # nvidia-smi's figures at N generations
    }

Default serving (SERVING_DEFAULT): the reference lab's notes (../shared/reference-lab.md): 11
output tok/s for one stream, 225 at 64 concurrent requests with every GPU 100 % busy at 55 % of
its power limit, SM clocks at 2422 of 2430 MHz, no throttle reason, PCIe nearly idle; the
single-stream power and the figures between are the sandbox's own choice.

Link values are nvidia-smi's legend: X, PIX, PXB, PHB, NODE, SYS, NV<n>; P2P status values are
X, OK, CNS, GNS, TNS, NS, U (shared/fixtures/h200-1gpu/topo-m.txt and topo-p2p.txt).
"""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

SCENARIO_DIR = Path(__file__).with_name("scenarios")
DEFAULT_SCENARIO = "reference-lab"
SCHEMA = 1

LINK_VALUES = frozenset({"X", "PIX", "PXB", "PHB", "NODE", "SYS"})
_NVLINK = re.compile(r"^NV[1-9][0-9]*$")
P2P_VALUES = frozenset({"X", "OK", "CNS", "GNS", "TNS", "NS", "U"})
P2P_KINDS = ("r", "w", "n", "a", "p")  # read, write, nvlink, atomics, prop (nvidia-smi topo -h)
# What data crossing between GPUs over P2P turns into (read by the torch stand-in).
PEER_TRANSFERS = {"copy": ("intact", "wrong-data"), "all_reduce": ("intact", "wrong-data", "hang")}

SERVING_DEFAULT: dict[str, Any] = {
    "output_tokens_per_s": {"default": {"1": 11.0, "16": 120.0, "64": 225.0}},
    "backend_modes": {},
    "load": {
        "1": {"power_pct": 40.0, "sm_clock_pct": 99.7, "utilization_gpu_pct": 100.0,
              "utilization_memory_pct": 15.0, "temperature_c": 52.0, "pcie_mbps": 30.0,
              "reasons": []},
        "64": {"power_pct": 55.0, "sm_clock_pct": 99.7, "utilization_gpu_pct": 100.0,
               "utilization_memory_pct": 35.0, "temperature_c": 63.0, "pcie_mbps": 60.0,
               "reasons": []},
    },
}
SERVING_MODES = ("crash-on-start", "degenerate")
#: Distributions a host can present: /etc/os-release as read off a real host of each
#: (ubuntu-24.04: shared/fixtures/h200-1gpu/system.txt), kept in sandbox/data/os-release-<name>.
OS_RELEASES = ("ubuntu-24.04",)

# Values every GPU gets unless the scenario says otherwise: an idle, healthy GPU.
GPU_DEFAULTS: dict[str, Any] = {
    "architecture": None,
    "multiprocessor_count": None,
    "cuda_total_memory_bytes": None,  # torch's total_memory; None: memory_total_mib in bytes
    "memory_used_mib": 0,
    "power_draw_w": 0.0,
    "power_default_limit_w": None,  # None: power_limit_w
    "power_min_limit_w": None,
    "clocks_mem_mhz": None,
    "clocks_max_mem_mhz": None,
    "temperature_c": 30,
    "fan": "N/A",  # passive server cards report no fan
    "pstate": "P8",
    "utilization_gpu_pct": 0,
    "utilization_memory_pct": 0,
    "persistence_mode": "Enabled",
    "display_active": "Off",
    "ecc_mode": "Enabled",
    "volatile_ecc_errors": 0,  # uncorrected, volatile
    # the health readings (operations/files/gpu_health.py) of a healthy GPU: the H100 capture
    # in tests/fixtures/h100-device/health/
    "ecc_corrected_volatile": 0,
    "ecc_corrected_aggregate": 0,
    "ecc_uncorrected_aggregate": 0,
    "remapped_rows_correctable": 0,
    "remapped_rows_uncorrectable": 0,
    "remapped_rows_pending": "No",
    "remapped_rows_failure": "No",
    "pcie_replays": 0,
    "compute_mode": "Default",
    "mig_mode": "Disabled",
    "clocks_event_reasons_active": "0x0000000000000001",  # GPU idle
    "vbios_version": None,
    "serial": None,
    "pcie_gen_max": None,
    "pcie_gen_current": None,
    "pcie_width_max": None,
    "pcie_width_current": None,
    "requires_open_kernel_modules": None,  # None: compute capability >= 10.0 (Blackwell)
}
GPU_REQUIRED = (
    "index",
    "name",
    "uuid",
    "pci_bus_id",
    "compute_cap",
    "memory_total_mib",
    "power_limit_w",
    "power_max_limit_w",
    "clocks_sm_mhz",
    "clocks_max_sm_mhz",
    "cpu_affinity",
    "numa_affinity",
    "gpu_numa_id",
)

_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
_BUS_ID = re.compile(r"^[0-9A-F]{8}:[0-9A-F]{2}:[0-9A-F]{2}\.[0-7]$")
_COMPUTE_CAP = re.compile(r"^[1-9][0-9]?\.[0-9]$")
_NAME = re.compile(r"^[a-z0-9][a-z0-9-]*$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class ScenarioError(ValueError):
    """A scenario that does not exist or does not hold together; the message names it."""


def names() -> list[str]:
    """The scenarios there are, sorted: the stems of sandbox/scenarios/*.json."""
    return sorted(p.stem for p in SCENARIO_DIR.glob("*.json"))


def load(name: str) -> dict[str, Any]:
    """The expanded, checked hardware document of scenario `name` (shape: module docstring).

    Raises ScenarioError naming the scenario and the allowed names when there is no such
    scenario, or naming the key and the value when the file does not hold together.
    """
    allowed = names()
    if not isinstance(name, str) or not _NAME.match(name) or name not in allowed:
        raise ScenarioError(
            f"unknown scenario {name!r}: allowed scenarios are {', '.join(allowed)}"
        )
    path = SCENARIO_DIR / f"{name}.json"
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ScenarioError(f"scenario {name!r}: {path} is not valid JSON: {exc}") from exc
    return _expand(name, raw)


def hardware_json(name: str) -> str:
    """The text of /etc/gpuhost-sandbox/hardware.json for scenario `name` (see `load`)."""
    return json.dumps(load(name), indent=2) + "\n"


def _expand(name: str, raw: dict[str, Any]) -> dict[str, Any]:
    def fail(msg: str) -> ScenarioError:
        return ScenarioError(f"scenario {name!r}: {msg}")

    if not isinstance(raw, dict):
        raise fail("the file must hold a JSON object")
    if raw.get("schema") != SCHEMA:
        raise fail(f"schema must be {SCHEMA}, not {raw.get('schema')!r}")
    known = {
        "schema",
        "description",
        "virtualization",
        "host",
        "gpu_defaults",
        "gpus",
        "topology",
        "p2p",
        "peer_transfers",
        "serving",
    }
    unknown = sorted(set(raw) - known)
    if unknown:
        raise fail(f"unknown keys {unknown}; allowed: {sorted(known)}")

    virt = raw.get("virtualization")
    if not isinstance(virt, dict) or not isinstance(virt.get("systemd_detect_virt"), str):
        raise fail("virtualization.systemd_detect_virt must be a string (e.g. 'kvm', 'none')")
    dmi = virt.get("dmi")
    if dmi is not None and not (
        isinstance(dmi, dict) and all(isinstance(v, str) for v in dmi.values())
    ):
        raise fail("virtualization.dmi must be null or an object of strings")

    host = dict(raw.get("host") or {})
    if not isinstance(host.get("cpu_count"), int) or host["cpu_count"] < 1:
        raise fail(f"host.cpu_count must be a positive integer, not {host.get('cpu_count')!r}")
    jobs = host.setdefault("flash_attn_max_parallel_jobs", None)
    if jobs is not None and (not isinstance(jobs, int) or jobs < 1):
        raise fail(f"host.flash_attn_max_parallel_jobs must be null or >= 1, not {jobs!r}")
    # How long the slow builds take (real: minutes; 0 keeps the lab fast). Tests that stop a
    # deploy in the middle of one raise them on the host's copy of this document.
    for key in ("dkms_build_seconds", "flash_attn_build_seconds"):
        value = host.setdefault(key, 0)
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value < 0:
            raise fail(f"host.{key} must be a number of seconds >= 0, not {value!r}")
    # Secure Boot (the mokutil stand-in, sandbox/standins/secureboot/): on or off, and the
    # certificates enrolled as MOKs, each as the sha256 of its DER file. Tests that enrol one
    # add it to the host's copy of this document, as an operator at the console would.
    if not isinstance(host.setdefault("secure_boot", False), bool):
        raise fail(f"host.secure_boot must be true or false, not {host['secure_boot']!r}")
    # The distribution the host presents (/etc/os-release): None keeps the root filesystem's
    # Debian 12; a name of OS_RELEASES writes that release's os-release (sandbox/data/).
    release = host.setdefault("os_release", None)
    if release is not None and release not in OS_RELEASES:
        raise fail(f"host.os_release must be null or one of {', '.join(OS_RELEASES)}, "
                   f"not {release!r}")
    enrolled = host.setdefault("enrolled_mok", [])
    if not isinstance(enrolled, list) or not all(
        isinstance(v, str) and _SHA256.match(v) for v in enrolled
    ):
        raise fail(f"host.enrolled_mok must be a list of sha256 hex digests (lowercase, 64 "
                   f"digits) of DER certificates, not {enrolled!r}")

    defaults = raw.get("gpu_defaults") or {}
    gpus_raw = raw.get("gpus")
    if not isinstance(gpus_raw, list):
        raise fail("gpus must be a list ([]: a host without GPUs, such as a CPU-only router VM)")
    gpus = []
    for pos, entry in enumerate(gpus_raw):
        gpu = {**copy.deepcopy(GPU_DEFAULTS), **defaults, **entry}
        unknown = sorted(set(gpu) - set(GPU_DEFAULTS) - set(GPU_REQUIRED))
        if unknown:
            raise fail(f"gpus[{pos}] has unknown keys {unknown}")
        missing = [k for k in GPU_REQUIRED if k not in gpu]
        if missing:
            raise fail(f"gpus[{pos}] lacks {missing}")
        _check_gpu(fail, pos, gpu)
        gpus.append(gpu)
    if [g["index"] for g in gpus] != list(range(len(gpus))):
        raise fail("gpus must be listed by index 0..N-1")
    for key in ("uuid", "pci_bus_id"):
        values = [g[key] for g in gpus]
        if len(set(values)) != len(values):
            raise fail(f"two GPUs share a {key}")

    n = len(gpus)
    topology = raw.get("topology", [] if not n else None)
    _check_matrix(
        fail, "topology", topology, n, lambda v: v in LINK_VALUES or bool(_NVLINK.match(v))
    )
    p2p_raw = raw.get("p2p") or {}
    unknown = sorted(set(p2p_raw) - set(P2P_KINDS))
    if unknown:
        raise fail(f"p2p has unknown kinds {unknown}; allowed: {list(P2P_KINDS)}")
    p2p: dict[str, list[list[str]]] = {}
    for kind in P2P_KINDS:
        if kind in p2p_raw:
            p2p[kind] = p2p_raw[kind]
        elif not n:
            p2p[kind] = []
        elif kind in ("r", "w"):
            raise fail(
                f"p2p.{kind} (the P2P {'read' if kind == 'r' else 'write'} status) is required"
            )
        else:
            p2p[kind] = _default_p2p(kind, topology, p2p_raw["r"])
        _check_matrix(fail, f"p2p.{kind}", p2p[kind], n, lambda v: v in P2P_VALUES)

    transfers = {"copy": "intact", "all_reduce": "intact", **(raw.get("peer_transfers") or {})}
    for key, allowed in PEER_TRANSFERS.items():
        if transfers.get(key) not in allowed:
            raise fail(f"peer_transfers.{key} = {transfers.get(key)!r}: allowed {list(allowed)}")
    if set(transfers) - set(PEER_TRANSFERS):
        raise fail(f"peer_transfers has unknown keys {sorted(set(transfers) - set(PEER_TRANSFERS))}")

    serving = {**copy.deepcopy(SERVING_DEFAULT), **(raw.get("serving") or {})}
    if set(serving) - set(SERVING_DEFAULT):
        raise fail(f"serving has unknown keys {sorted(set(serving) - set(SERVING_DEFAULT))}")
    for backend, mode in serving["backend_modes"].items():
        if mode not in SERVING_MODES:
            raise fail(f"serving.backend_modes.{backend} = {mode!r}: allowed {list(SERVING_MODES)}")
    for table in (*serving["output_tokens_per_s"].values(), serving["load"]):
        if not table or not all(k.isdigit() and int(k) >= 1 for k in table):
            raise fail("serving tables are keyed by concurrency (\"1\", \"64\", ...)")

    return {
        "schema": SCHEMA,
        "scenario": name,
        "description": raw.get("description", ""),
        "virtualization": {"systemd_detect_virt": virt["systemd_detect_virt"], "dmi": dmi},
        "host": host,
        "gpus": gpus,
        "topology": topology,
        "p2p": p2p,
        "peer_transfers": transfers,
        "serving": serving,
    }


def _check_gpu(fail, pos: int, gpu: dict[str, Any]) -> None:
    where = f"gpus[{pos}]"
    if not isinstance(gpu["name"], str) or not gpu["name"]:
        raise fail(f"{where}.name must be a non-empty string")
    if not _UUID.match(str(gpu["uuid"])):
        raise fail(
            f"{where}.uuid {gpu['uuid']!r} is not of the form "
            "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
        )
    if not _BUS_ID.match(str(gpu["pci_bus_id"])):
        raise fail(f"{where}.pci_bus_id {gpu['pci_bus_id']!r} is not of the form 00000000:01:00.0")
    if not _COMPUTE_CAP.match(str(gpu["compute_cap"])):
        raise fail(f"{where}.compute_cap {gpu['compute_cap']!r} is not of the form '12.0'")
    for key in ("memory_total_mib", "clocks_sm_mhz", "clocks_max_sm_mhz", "multiprocessor_count"):
        if gpu[key] is not None and (not isinstance(gpu[key], int) or gpu[key] < 0):
            raise fail(f"{where}.{key} must be a non-negative integer, not {gpu[key]!r}")
    for key in ("power_limit_w", "power_max_limit_w", "power_draw_w"):
        if not isinstance(gpu[key], (int, float)) or gpu[key] < 0:
            raise fail(f"{where}.{key} must be a non-negative number of watts, not {gpu[key]!r}")
    if gpu["power_limit_w"] > gpu["power_max_limit_w"]:
        raise fail(f"{where}.power_limit_w exceeds power_max_limit_w")
    if gpu["persistence_mode"] not in ("Enabled", "Disabled"):
        raise fail(f"{where}.persistence_mode must be 'Enabled' or 'Disabled'")
    if gpu["power_default_limit_w"] is None:
        gpu["power_default_limit_w"] = gpu["power_limit_w"]
    if gpu["cuda_total_memory_bytes"] is None:
        gpu["cuda_total_memory_bytes"] = gpu["memory_total_mib"] * 1024 * 1024
    if gpu["requires_open_kernel_modules"] is None:
        gpu["requires_open_kernel_modules"] = int(gpu["compute_cap"].split(".")[0]) >= 10


def _check_matrix(fail, what: str, matrix: Any, n: int, valid) -> None:
    if not isinstance(matrix, list) or len(matrix) != n:
        raise fail(f"{what} must be a {n}x{n} matrix (one row per GPU)")
    for i, row in enumerate(matrix):
        if not isinstance(row, list) or len(row) != n:
            raise fail(f"{what} row {i} must have {n} entries")
        for j, value in enumerate(row):
            if not isinstance(value, str) or not valid(value):
                raise fail(f"{what}[{i}][{j}] = {value!r} is not a valid value")
            if (i == j) != (value == "X"):
                raise fail(f"{what}[{i}][{j}] = {value!r}: 'X' belongs on the diagonal only")


def _default_p2p(kind: str, topology: list[list[str]], read: list[list[str]]) -> list[list[str]]:
    """NVLink status: OK across NV# links, else NS; atomics NS; prop as read."""
    n = len(topology)
    out = []
    for i in range(n):
        row = []
        for j in range(n):
            if i == j:
                row.append("X")
            elif kind == "n":
                row.append("OK" if _NVLINK.match(topology[i][j]) else "NS")
            elif kind == "a":
                row.append("NS")
            else:
                row.append(read[i][j])
        out.append(row)
    return out
