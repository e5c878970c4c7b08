"""Which CUDA a venv needs and whether a driver can run it (NVIDIA's minimum driver per CUDA
release, operations/settings.CUDA_MIN_DRIVER)."""

from __future__ import annotations

import re
from collections.abc import Mapping

from packaging.version import Version

from operations.plans.settings import CUDA_MIN_DRIVER


def _cuda_from_local(version: str) -> str | None:
    # torch's local version: +cu128 is CUDA 12.8, +cu130 is 13.0
    match = re.search(r"\+cu(\d+)(\d)$", version)
    return f"{int(match.group(1))}.{match.group(2)}" if match else None


def venv_cuda(versions: Mapping[str, str]) -> tuple[str, str] | None:
    """The CUDA version a venv (or a lock) needs, and where it was read: ``("12.8", "torch
    2.9.1+cu128")``. Sources: torch's local version (+cu128), the CUDA runtime wheel
    (nvidia-cuda-runtime-cu12 12.8.90 gives 12.8), any other *-cu13 wheel (at least 13.0).
    The newest wins; None where nothing names a CUDA version."""
    found: list[tuple[Version, str, str]] = []
    torch = versions.get("torch")
    if torch and (cuda := _cuda_from_local(torch)):
        found.append((Version(cuda), cuda, f"torch {torch}"))
    for name, version in versions.items():
        runtime = re.fullmatch(r"nvidia-cuda-runtime(-cu\d+)?", name)
        if runtime and re.match(r"\d+\.\d+", version):
            cuda = ".".join(version.split(".")[:2])
            found.append((Version(cuda), cuda, f"{name} {version}"))
        elif re.search(r"-cu(\d+)$", name):
            major = re.search(r"-cu(\d+)$", name).group(1)
            found.append((Version(f"{major}.0"), f"{major}.0", f"{name} {version}"))
    if not found:
        return None
    _, cuda, source = max(found)
    return cuda, source


def min_driver_for(cuda: str) -> str | None:
    """The minimum Linux driver for a CUDA major.minor (operations/settings.CUDA_MIN_DRIVER):
    its own entry, else the nearest older entry of the same major version; None if unknown."""
    if cuda in CUDA_MIN_DRIVER:
        return CUDA_MIN_DRIVER[cuda]
    wanted = Version(cuda)
    older = [Version(k) for k in CUDA_MIN_DRIVER
             if Version(k).major == wanted.major and Version(k) <= wanted]
    return CUDA_MIN_DRIVER[str(max(older))] if older else None


def driver_problem(cuda: str, source: str, driver: str) -> str | None:
    """Why ``driver`` (a version such as "570.124.06", or a branch "570") cannot run a venv
    that needs CUDA ``cuda``; None when it can. The message names both."""
    minimum = min_driver_for(cuda)
    if minimum is None:
        return (f"the venv needs CUDA {cuda} ({source}), for which no minimum driver is known "
                "(operations/settings.CUDA_MIN_DRIVER)")
    have = Version(driver)
    ok = have >= Version(minimum) if "." in driver else have.major >= Version(minimum).major
    if ok:
        return None
    supported = [k for k, v in CUDA_MIN_DRIVER.items()
                 if ("." in driver and have >= Version(v))
                 or ("." not in driver and have.major >= Version(v).major)]
    upto = f"CUDA {max(supported, key=Version)} at most" if supported else "no CUDA this toolkit knows"
    return (f"the venv needs CUDA {cuda} ({source}), which needs NVIDIA driver >= {minimum}; "
            f"driver {driver} supports {upto}: install a newer driver (gpuhost_driver_branch) "
            "or use a lock for an older CUDA (gpuhost_lock)")
