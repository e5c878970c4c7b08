"""The server's kernel caches: a folder keyed by flashinfer, torch, CUDA and the compute
capability, set explicitly in the unit; superseded folders removed."""

import dataclasses
from pathlib import Path

import pytest
from pyinfra.api.util import get_template

from operations.plans.lock import read_lock
from operations.plans.settings import SettingsError, from_host_data
from operations.stages.kernel_cache import (
    KERNEL_CACHE_ROOT,
    KernelCacheFolders,
    cache_env,
    cache_key,
    superseded,
)
from operations.stages.server_unit import unit_context

ROOT = Path(__file__).resolve().parent.parent
SLUG = "flashinfer0.6.3-torch2.9.1-cuda12.8-sm120"


def settings(**data):
    return from_host_data("gpu1", data)


def test_the_key_of_the_default_stack():
    # the real lock (locks/cuda12.8.txt): flashinfer-python 0.6.3, torch 2.9.1
    key = cache_key(settings())
    assert key.slug() == SLUG
    assert cache_key(settings()) == key  # stable: a second run renders the same unit


def test_a_change_starts_a_fresh_folder():
    s = settings(gpuhost_compute_capability="9.0")
    assert cache_key(s).slug() == "flashinfer0.6.3-torch2.9.1-cuda12.8-sm90"
    # another toolkit (the CUDA 13 stack's lock aside)
    s = dataclasses.replace(settings(), cuda_toolkit="13.0")
    assert cache_key(s).slug() == "flashinfer0.6.3-torch2.9.1-cuda13.0-sm120"


def test_a_lock_change_starts_a_fresh_folder(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.9 --hash=sha256:" + "2" * 64 + "\n"
                    "torch==2.9.2 --hash=sha256:" + "0" * 64 + "\n"
                    "flashinfer-python==0.6.7 --hash=sha256:" + "1" * 64 + "\n")
    s = settings(gpuhost_lock=str(lock))
    assert cache_key(s, read_lock(s.lock_path)).slug() == (
        "flashinfer0.6.7-torch2.9.2-cuda12.8-sm120")


def test_the_unit_sets_every_kernel_cache():
    text = get_template(str(ROOT / "templates" / "sglang.service.j2")).render(
        **unit_context(settings()))
    folder = f"{KERNEL_CACHE_ROOT}/{SLUG}"
    for line in (f"Environment=FLASHINFER_WORKSPACE_BASE={folder}/flashinfer",
                 f"Environment=TRITON_CACHE_DIR={folder}/triton",
                 f"Environment=TORCHINDUCTOR_CACHE_DIR={folder}/torchinductor",
                 f"Environment=TORCH_EXTENSIONS_DIR={folder}/torch_extensions"):
        assert line in text.splitlines()
    assert set(cache_env(cache_key(settings()))) == {
        "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
        "TORCH_EXTENSIONS_DIR"}


def test_superseded_folders():
    key = cache_key(settings())
    present = KernelCacheFolders().process(
        ["flashinfer0.6.2-torch2.9.1-cuda12.8-sm120", SLUG, ""])
    assert present == ["flashinfer0.6.2-torch2.9.1-cuda12.8-sm120", SLUG]
    assert superseded(present, key) == ["flashinfer0.6.2-torch2.9.1-cuda12.8-sm120"]
    assert superseded([SLUG], key) == []


def test_host_data_cannot_move_a_kernel_cache():
    with pytest.raises(SettingsError, match="TRITON_CACHE_DIR"):
        settings(gpuhost_server_env={"TRITON_CACHE_DIR": "/tmp/t"})
