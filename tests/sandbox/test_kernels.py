"""The sandbox's second kernel (sandbox/kernels.py): its release, its packages in NVIDIA's
stand-in repository, and the boot loader and uname stand-ins, run here on folders of their own."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from sandbox import kernels, nvidia_repo


@pytest.mark.parametrize(("running", "pending"), [
    ("6.1.0-28-amd64", "6.1.1-28-amd64"),
    ("6.18.44-fc-v1098", "6.18.45-fc-v1098"),
    ("6.8.0-51-generic", "6.8.1-51-generic"),
])
def test_the_pending_release_is_newer_by_sort_v_and_by_dpkg(running, pending):
    assert kernels.pending_release(running) == pending
    ordered = subprocess.run(["sort", "-V"], input=f"{pending}\n{running}\n", text=True,
                             capture_output=True, check=True, env={"LC_ALL": "C"}).stdout
    assert ordered.split() == [running, pending]
    dpkg = subprocess.run(["dpkg", "--compare-versions", pending, "gt", running], check=False)
    assert dpkg.returncode == 0


def test_a_release_without_a_version_is_refused():
    with pytest.raises(ValueError, match="does not start with a version"):
        kernels.pending_release("generic")


def test_the_repository_serves_the_pending_image_and_headers():
    debs = {d.name: d for d in nvidia_repo.packages("6.1.0-28-amd64", b"key")}
    image, headers = debs["linux-image-6.1.1-28-amd64"], debs["linux-headers-6.1.1-28-amd64"]
    assert image.version == "6.1.1-1"
    assert {"/boot/vmlinuz-6.1.1-28-amd64", "/boot/config-6.1.1-28-amd64",
            "/lib/modules/6.1.1-28-amd64/modules.order"} <= set(image.files)
    assert "/etc/kernel/postinst.d" in image.scripts["postinst"]
    assert headers.links == {"/lib/modules/6.1.1-28-amd64/build":
                             "/usr/src/linux-headers-6.1.1-28-amd64"}
    assert "/etc/kernel/header_postinst.d" in headers.scripts["postinst"]
    assert "linux-headers-6.1.0-28-amd64" in debs  # the running kernel's, as before


def _standin(name: str, tmp: Path) -> Path:
    """A copy of a stand-in whose /boot and /run/gpuhost-sandbox are folders under ``tmp``."""
    text = (kernels.STANDINS / name).read_text()
    text = text.replace("/run/gpuhost-sandbox", str(tmp / "run")).replace("/boot/",
                                                                          f"{tmp}/boot/")
    script = tmp / name
    script.write_text(text)
    script.chmod(0o755)
    return script


def test_a_boot_boots_the_newest_image_and_uname_answers_it(tmp_path):
    boot, uname = _standin("boot-kernel", tmp_path), _standin("uname", tmp_path)
    real = subprocess.run(["uname", "-r"], capture_output=True, text=True, check=True).stdout.strip()
    subprocess.run([str(boot)], check=True, capture_output=True)
    assert subprocess.run([str(uname), "-r"], capture_output=True, text=True, check=True).stdout.strip() \
        == real  # no image in /boot: the machine's own kernel
    (tmp_path / "boot").mkdir()
    for release in ("6.1.9-1-amd64", "6.1.10-1-amd64", "6.1.11-1-amd64.dpkg-new"):
        (tmp_path / "boot" / f"vmlinuz-{release}").write_text("")
    subprocess.run([str(boot)], check=True, capture_output=True)
    assert (tmp_path / "run" / "kernel-release").read_text().strip() == "6.1.10-1-amd64"
    assert subprocess.run([str(uname), "-r"], capture_output=True,
                          text=True, check=True).stdout.strip() == "6.1.10-1-amd64"
    everything = subprocess.run([str(uname), "-a"], capture_output=True, text=True, check=True).stdout
    assert " 6.1.10-1-amd64 " in everything and real not in everything
    assert subprocess.run([str(uname), "-m"], capture_output=True, text=True, check=True).stdout.strip() \
        == subprocess.run(["uname", "-m"], capture_output=True, text=True, check=True).stdout.strip()


def test_install_puts_the_standins_in_the_tree_and_enables_the_boot_unit(tmp_path):
    kernels.install(tmp_path)
    for _, dest, mode in kernels.FILES:
        assert (tmp_path / dest).stat().st_mode & 0o777 == mode
    wants = tmp_path / "etc/systemd/system/sysinit.target.wants" / kernels.BOOT_UNIT
    assert wants.is_symlink()
    unit = (tmp_path / "etc/systemd/system" / kernels.BOOT_UNIT).read_text()
    assert "Before=sysinit.target nvidia-sandbox-module.service" in unit
