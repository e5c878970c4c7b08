"""What the stand-in CUDA driver sees: the host's scenario hardware and the driver's state.

Files (and, for tests, the environment variables naming them):
  GPUHOST_SANDBOX_HARDWARE  /etc/gpuhost-sandbox/hardware.json     the scenario's GPUs
  GPUHOST_SANDBOX_LOADED    /run/nvidia-sandbox/loaded-version     the loaded kernel module
  GPUHOST_SANDBOX_LIBCUDA   /usr/lib/x86_64-linux-gnu/nvidia-sandbox/libcuda1.version
                                                                   the installed libcuda
"""

import json
import os

HARDWARE = "/etc/gpuhost-sandbox/hardware.json"
LOADED = "/run/nvidia-sandbox/loaded-version"
LIBCUDA = "/usr/lib/x86_64-linux-gnu/nvidia-sandbox/libcuda1.version"


def _read(path):
    try:
        with open(path) as fh:
            return fh.read().strip()
    except OSError:
        return ""


def hardware():
    """The hardware document, or None when there is none."""
    text = _read(os.environ.get("GPUHOST_SANDBOX_HARDWARE", HARDWARE))
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def driver_problem():
    """None when CUDA can initialise; else (error code, message) as cuInit would fail."""
    libcuda = _read(os.environ.get("GPUHOST_SANDBOX_LIBCUDA", LIBCUDA))
    if not libcuda:
        return (
            35,
            (
                "Found no NVIDIA driver on your system. Please check that you have an "
                "NVIDIA GPU and installed a driver from "
                "http://www.nvidia.com/Download/index.aspx"
            ),
        )
    loaded_path = os.environ.get("GPUHOST_SANDBOX_LOADED", LOADED)
    loaded = _read(loaded_path)
    hw = hardware()
    if not loaded or hw is None:
        return (999, "CUDA driver initialization failed, you might not have a CUDA gpu.")
    if loaded != libcuda:
        return (803, "system has unsupported display driver / cuda driver combination")
    flavour = _read(os.path.join(os.path.dirname(loaded_path), "loaded-flavour")) or "open"
    if flavour != "open" and any(g.get("requires_open_kernel_modules") for g in hw["gpus"]):
        return (100, "no CUDA-capable device is detected")
    return None


def visible_gpus():
    """The GPUs CUDA enumerates, in CUDA_VISIBLE_DEVICES order; [] when CUDA cannot start."""
    if driver_problem() is not None:
        return []
    gpus = hardware()["gpus"]
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return list(gpus)
    chosen = []
    for item in mask.split(","):
        item = item.strip()
        match = [
            g
            for g in gpus
            if item == str(g["index"]) or (item.startswith("GPU-") and g["uuid"].startswith(item))
        ]
        if not match or match[0] in chosen:
            break  # CUDA stops at the first invalid entry
        chosen.append(match[0])
    return chosen


# --- peer transfers ------------------------------------------------------------------------------
# What the scenario's "peer_transfers" says happens to data that crosses between two GPUs over
# P2P: "intact", or "wrong-data" (peer writes silently lost, as behind ACS or a translating
# IOMMU); for NCCL's all-reduce also "hang". Copies between GPUs without peer access go through
# host memory and always arrive intact.

#: Stand-in transfer rates (bytes per second): PCIe Gen5 x16 peer-to-peer, and a copy staged
#: through host memory. Figures of the stand-in, not measurements.
PEER_BYTES_PER_S = 50e9
STAGED_BYTES_PER_S = 24e9


def peer_transfers():
    """{"copy": ..., "all_reduce": ...} of the scenario, "intact" where it says nothing."""
    hw = hardware() or {}
    given = hw.get("peer_transfers") or {}
    return {"copy": given.get("copy", "intact"), "all_reduce": given.get("all_reduce", "intact")}


def peer_access(a, b):
    """Whether CUDA reports peer access from visible GPU index a to b (the scenario's P2P read
    and write status both OK)."""
    gpus = visible_gpus()
    if a == b or not (0 <= a < len(gpus) and 0 <= b < len(gpus)):
        return False
    i, j = gpus[a]["index"], gpus[b]["index"]
    p2p = hardware()["p2p"]
    return p2p["r"][i][j] == "OK" and p2p["w"][i][j] == "OK"


def link(a, b):
    """The topology link between visible GPU indexes a and b (nvidia-smi topo -m's legend)."""
    gpus = visible_gpus()
    return hardware()["topology"][gpus[a]["index"]][gpus[b]["index"]]
