"""The driver's pin under real apt's resolver (tests/apt_resolver.py): on Debian's real
nvidia-graphics-drivers metadata, fetched from Debian's archive when the test runs, and on the
sandbox's stand-in repository, which is derived from it (sandbox/debian_control.py).

The pin gpuhost wrote before (its text below) named the driver's packages by glob and missed
libgl1-nvidia-glvnd-glx, libegl-nvidia0 and libglx-nvidia0: real apt then took the newest
version of those, which nvidia-driver-libs' exact-version dependencies refuse ("held broken
packages"). Both repositories must refuse it, and resolve the product's pin."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from operations.stages.apt_simulation import pin_text
from sandbox import debian_control, nvidia_repo
from tests.apt_resolver import Apt, needs_apt

#: templates/apt-nvidia-pin.j2 before issue #28 (the failure this test keeps out)
GLOB_PIN = (
    "Package: nvidia-* libnvidia-* libcuda* libnvcuvid* libnvoptix* libxnvctrl* "
    "firmware-nvidia-* xserver-xorg-video-nvidia*\nPin: version {}\nPin-Priority: 1000\n"
)
DEBIAN = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
COMPONENTS = "main contrib non-free non-free-firmware"
BROKEN = "you have held broken packages"


def _tree_versions(inst: dict[str, str], names) -> dict[str, str]:
    return {n: v for n, v in inst.items() if n in names}


# --- Debian's real archive ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def debian(tmp_path_factory):
    """A private apt with Debian 12's lists and its backports, fetched now."""
    if not shutil.which("apt-get") or not shutil.os.path.exists(KEYRING):
        pytest.skip("needs apt-get and debian-archive-keyring")
    apt = Apt.make(tmp_path_factory.mktemp("debian-apt"), [
        f"deb [signed-by={KEYRING}] {DEBIAN} bookworm {COMPONENTS}",
        f"deb [signed-by={KEYRING}] {DEBIAN} bookworm-backports {COMPONENTS}",
    ])
    out = apt.run("update")
    assert out.returncode == 0, out.stdout + out.stderr
    return apt


@pytest.mark.network
def test_real_apt_installs_an_older_release_under_the_products_pin(debian):
    """Pointed at the older of the two releases of nvidia-driver in Debian's lists (bookworm
    and bookworm-backports), the product's pin installs the whole tree at that release."""
    out = debian.run("madison", "nvidia-driver", tool="apt-cache")
    versions = [line.split("|")[1].strip() for line in out.stdout.splitlines() if "|" in line]
    assert len(versions) >= 2, out.stdout
    older = min(versions, key=lambda v: [int(x) for x in re.findall(r"\d+", v)[:3]])
    glob = older.rsplit("-", 1)[0] + "-*"
    packages = ("nvidia-driver", "nvidia-kernel-dkms", "nvidia-smi", "libcuda1")

    debian.pin(GLOB_PIN.format(glob))
    rc, _inst, text = debian.simulate(*packages)
    assert rc != 0 and BROKEN in text and "libgl1-nvidia-glvnd-glx" in text, text

    debian.pin(pin_text(glob))
    rc, inst, text = debian.simulate(*packages)
    assert rc == 0, text
    tree = _tree_versions(inst, debian_control.load()["packages"])
    assert len(tree) >= 20 and set(tree.values()) == {older}, tree


@pytest.mark.network
def test_the_standin_tree_is_debians(debian):
    """The stand-in's tree (sandbox/data) is what Debian's lists say today, at its version."""
    data = debian_control.load()
    out = debian.run("show", *(f"{n}={data['version']}" for n in data["packages"]),
                     tool="apt-cache")
    if out.returncode != 0:
        pytest.skip(f"Debian's lists no longer have {data['version']}: refresh sandbox/data "
                    "with python -m sandbox.debian_control")
    stanzas = debian_control.parse_packages(out.stdout)
    assert debian_control.tree(stanzas, data["version"])["packages"] == data["packages"]


# --- the stand-in repository -------------------------------------------------------------------


needs_repo_tools = pytest.mark.skipif(
    any(shutil.which(t) is None for t in ("dpkg-deb", "apt-ftparchive", "gpg", "apt-get")),
    reason="needs dpkg-deb, apt-ftparchive (apt-utils), gpg and apt-get",
)


@pytest.fixture(scope="module")
def standin(tmp_path_factory):
    base = tmp_path_factory.mktemp("standin-repo")
    nvidia_repo.build(base / "www", "6.1.0-28-amd64", gnupg_home=base / "gnupg",
                      apt_archives=None)
    repo = base / "www" / nvidia_repo.CUDA_REPO_DIR.strip("/")
    apt = Apt.make(base / "apt", [f"deb [trusted=yes] file:{repo} /"],
                   installed={"python3": "3.11.2-1+b1"})
    out = apt.run("update")
    assert out.returncode == 0, out.stdout + out.stderr
    apt.repo = repo
    return apt


WANTED = ("nvidia-open", "nvidia-smi", "libcuda1", "nvidia-kernel-open-dkms")


@needs_repo_tools
@needs_apt
def test_the_standin_refuses_the_glob_pin_as_real_apt_does(standin):
    standin.pin(GLOB_PIN.format("580.*"))
    rc, _inst, text = standin.simulate(*WANTED)
    assert rc != 0 and BROKEN in text, text


@needs_repo_tools
@needs_apt
@pytest.mark.parametrize(("glob", "version"), [("580.*", "580.105.08-1"),
                                                 ("580.95.05-*", "580.95.05-1"),
                                                 ("575.*", "575.64.05-1")])
def test_the_products_pin_holds_the_whole_tree_beside_newer_branches(standin, glob, version):
    standin.pin(pin_text(glob))
    rc, inst, text = standin.simulate(*WANTED)
    assert rc == 0, text
    nvidia = {n: v for n, v in inst.items() if "nvidia" in n or n.startswith("libcuda")}
    assert len(nvidia) >= 24 and set(nvidia.values()) == {version}, nvidia


@needs_repo_tools
@needs_apt
def test_nvidias_pinning_package_alone_holds_its_branch(standin):
    """The stand-in's nvidia-driver-pinning-580 locks the branch as NVIDIA's does (its file is
    the stand-in's own; the product installs the real one beside its pin)."""
    out = standin.run("show", "nvidia-driver-pinning-580", tool="apt-cache")
    assert "APT driver pinning file for driver branch 580" in out.stdout
    standin.pin("")
    rc, inst, _text = standin.simulate(*WANTED)
    assert inst["nvidia-open"].startswith("590."), "without a pin apt takes the newest branch"
    deb = next(standin.repo.glob("nvidia-driver-pinning-580_*.deb"))
    unpacked = standin.root / "unpacked"
    subprocess.run(["dpkg-deb", "-x", str(deb), str(unpacked)], check=True)
    (pref,) = (unpacked / "etc/apt/preferences.d").iterdir()
    standin.pin(pref.read_text(), pref.name)
    rc, inst, text = standin.simulate(*WANTED)
    assert rc == 0 and inst["nvidia-open"] == "580.105.08-1", text
