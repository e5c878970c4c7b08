"""Images of host trees (sandbox/image.py): what an image keeps and leaves out, and that `up`
refuses one made under another scenario before it touches anything."""

from __future__ import annotations

import contextlib
import json
import subprocess

import pytest

from sandbox import image, lab


def test_an_image_keeps_the_tree_without_the_apt_cache_debs_and_names_its_scenario(tmp_path):
    root = tmp_path / "root"
    (root / "opt/gpuhost/venvs").mkdir(parents=True)
    (root / "opt/gpuhost/venvs/marker").write_text("converged\n")
    archives = root / "var/cache/apt/archives"
    (archives / "partial").mkdir(parents=True)
    (archives / "gcc-12_12.2.0-14_amd64.deb").write_bytes(b"!<arch>\n")
    tar = tmp_path / "images" / "converged.tar"
    image.save(root, tar, "reference-lab", "gpu1")
    names = subprocess.run(["tar", "-tf", str(tar)], capture_output=True, text=True,
                           check=True).stdout.split()
    assert "./opt/gpuhost/venvs/marker" in names
    assert "./var/cache/apt/archives/partial/" in names
    assert not [n for n in names if n.endswith(".deb")]
    assert image.describe(tar) == {"scenario": "reference-lab", "host": "gpu1"}
    assert not tar.with_name(tar.name + ".partial").exists()


def test_no_image_is_named(tmp_path):
    with pytest.raises(image.ImageError, match="no image at .*missing.tar"):
        image.describe(tmp_path / "missing.tar")


def test_up_refuses_an_image_of_another_scenario(tmp_path, monkeypatch):
    root = tmp_path / "root"
    root.mkdir()
    tar = tmp_path / "single.tar"
    image.save(root, tar, "single-gpu", "gpu1")
    monkeypatch.setattr(lab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab, "_exclusive", lambda: pytest.fail("the lab was touched"))
    with pytest.raises(lab.LabError, match="made under scenario 'single-gpu', not 'reference-lab'"):
        lab.up(1, "reference-lab", from_image=tar)


def test_with_an_image_a_host_of_another_scenario_starts_from_the_bare_tree(tmp_path,
                                                                             monkeypatch):
    """A router VM (cpu-only) beside GPU hosts from an image of a GPU host: the GPU hosts'
    trees come from the image, the router's from the bare root filesystem, each with its own
    scenario's hardware."""
    root = tmp_path / "root"
    root.mkdir()
    tar = tmp_path / "converged.tar"
    image.save(root, tar, "reference-lab", "gpu1")
    trees: dict = {}
    hardware: dict = {}

    def prepare(specs, state, key, hw, given):
        trees.update(given)
        hardware.update({name: json.loads(text)["gpus"] for name, text in hw.items()})

    monkeypatch.setattr(lab.os, "geteuid", lambda: 0)
    monkeypatch.setattr(lab, "_exclusive", contextlib.nullcontext)
    monkeypatch.setattr(lab, "_shared_cache", contextlib.nullcontext)
    for name in ("ensure_tools", "_start_services", "_boot", "_save_state"):
        monkeypatch.setattr(lab, name, lambda *a, **k: None)
    monkeypatch.setattr(lab, "_down", lambda **k: None)
    monkeypatch.setattr(lab, "ensure_ssh_key", lambda: "ssh-ed25519 AAAA test")
    monkeypatch.setattr(lab.rootfs, "ensure_tarball", lambda: False)
    monkeypatch.setattr(lab.network, "create_switch", lambda: None)
    monkeypatch.setattr(lab.trash, "delete_in_background", lambda entries: None)
    monkeypatch.setattr(lab.trash, "entries", lambda: [])
    monkeypatch.setattr(lab, "status", lambda: [])
    monkeypatch.setattr(lab, "_prepare", prepare)
    lab.up(3, "reference-lab", from_image=tar, host_scenarios={"gpu3": "cpu-only"})
    assert trees == {"gpu1": tar, "gpu2": tar, "gpu3": lab.ROOTFS_TAR}
    assert hardware["gpu3"] == [] and len(hardware["gpu1"]) == 8
