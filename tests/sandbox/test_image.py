"""Images of host trees (sandbox/image.py): what an image keeps and leaves out, and that `up`
refuses one made under another scenario before it touches anything."""

from __future__ import annotations

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
