"""A second kernel for the sandbox's hosts: a newer one installed but not booted yet, as
unattended-upgrades leaves a ``linux-image`` upgrade until the next reboot.

A host under nspawn runs this machine's kernel and cannot boot another; so the boot loader and
``uname`` are stand-ins (sandbox/standins/kernel/), put into each host tree at ``up`` by
:func:`install`:

    /usr/local/bin/uname                           coreutils' uname, the booted release in place
                                                   of the real one (-r, -a)
    /usr/local/lib/gpuhost-sandbox/boot-kernel     at each boot: GRUB's default entry, the newest
                                                   /boot/vmlinuz-* (sort -V), to
                                                   /run/gpuhost-sandbox/kernel-release
    /usr/local/sbin/dkms                           `dkms autoinstall -k KERNEL`: the stand-in
                                                   NVIDIA module package's build, for KERNEL
    /usr/local/bin/dmesg                           the kernel log's NVRM lines: the driver's
                                                   loading line and the injected Xids

A host without kernel images in /boot (every host at ``up``) runs this machine's release, as
before. NVIDIA's stand-in repository (sandbox/nvidia_repo.py) also serves, from
:func:`packages`, ``linux-image-<pending>`` (the kernel image, its config and its modules
folder, whose postinst runs /etc/kernel/postinst.d as Debian's does) and
``linux-headers-<pending>`` (its build tree, whose postinst runs /etc/kernel/header_postinst.d)
for two newer releases (:func:`newer_releases` of the machine's release). A test installs an
image (``dpkg -i`` of the repository's .deb, as unattended-upgrades would), and the next reboot
boots it.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

STANDINS = Path(__file__).with_name("standins") / "kernel"
BOOT_UNIT = "gpuhost-sandbox-boot-kernel.service"

#: (stand-in, where it goes in the host tree, mode)
FILES = (
    ("uname", "usr/local/bin/uname", 0o755),
    ("boot-kernel", "usr/local/lib/gpuhost-sandbox/boot-kernel", 0o755),
    ("dkms", "usr/local/sbin/dkms", 0o755),
    ("dmesg", "usr/local/bin/dmesg", 0o755),
    (BOOT_UNIT, f"etc/systemd/system/{BOOT_UNIT}", 0o644),
)

#: Debian's linux-image postinst (linux-image-6.1.0-28-amd64): the kernel's hooks, among them
#: DKMS's /etc/kernel/postinst.d/dkms, with the release and the image path.
_IMAGE_POSTINST = """#!/bin/sh
# linux-image-{release} postinst: sandbox stand-in (gpuhost sandbox lab), as Debian's.
set -e
if [ "$1" != configure ]; then exit 0; fi
if [ -d /etc/kernel/postinst.d ]; then
    DEB_MAINT_PARAMS="$*" run-parts --report --exit-on-error --arg={release} \\
        --arg=/boot/vmlinuz-{release} /etc/kernel/postinst.d
fi
exit 0
"""

#: Debian's linux-headers postinst: the header hooks (DKMS's /etc/kernel/header_postinst.d/dkms
#: builds its modules for the release).
_HEADERS_POSTINST = """#!/bin/sh
# linux-headers-{release} postinst: sandbox stand-in (gpuhost sandbox lab), as Debian's.
set -e
if [ "$1" != configure ]; then exit 0; fi
if [ -d /etc/kernel/header_postinst.d ]; then
    DEB_MAINT_PARAMS="$*" run-parts --report --exit-on-error --arg={release} \\
        /etc/kernel/header_postinst.d
fi
exit 0
"""


def pending_release(release: str) -> str:
    """The release of the newer kernel: ``release``'s last upstream number plus one
    ("6.1.0-28-amd64" gives "6.1.1-28-amd64", "6.18.44-fc-v1098" gives "6.18.45-fc-v1098"), newer
    by ``sort -V`` and by dpkg's version order alike. Raises ValueError for a release that
    does not start with a version."""
    match = re.match(r"((?:[0-9]+\.)*)([0-9]+)(.*)$", release)
    if not match or not re.fullmatch(r"[0-9][a-z0-9.+-]*", release):
        raise ValueError(f"kernel release {release!r} does not start with a version")
    head, last, tail = match.groups()
    return f"{head}{int(last) + 1}{tail}"


def package_version(release: str) -> str:
    """The Debian version of a stand-in kernel package: "6.18.45-fc-v1098" gives "6.18.45-1"
    (Debian: linux-image-6.1.0-28-amd64 is version 6.1.119-1, upstream then revision)."""
    upstream = re.match(r"[0-9]+(\.[0-9]+)*", release)
    return (upstream.group(0) if upstream else "0") + "-1"


#: How many newer kernels the repository serves: a host can get one, be deployed and booted
#: into it, and then get the next (the upgrade after, on a converged host).
NEWER_KERNELS = 2


def newer_releases(release: str) -> list[str]:
    """The releases of the newer kernels the repository serves, oldest first."""
    releases = [pending_release(release)]
    while len(releases) < NEWER_KERNELS:
        releases.append(pending_release(releases[-1]))
    return releases


def packages(kernel_release: str) -> list:
    """The newer kernels' stand-in packages for NVIDIA's stand-in repository:
    ``linux-image-<newer>`` and ``linux-headers-<newer>`` of each of :func:`newer_releases`
    (``kernel_release``: this machine's, the hosts' running release)."""
    return [deb for newer in newer_releases(kernel_release) for deb in _kernel(newer)]


def _kernel(pending: str) -> list:
    from sandbox import nvidia_repo  # it calls this module while building its package list

    stand_in = f"sandbox stand-in: Linux {pending}, installed, never run\n".encode()
    image = nvidia_repo.Deb(
        f"linux-image-{pending}",
        package_version(pending),
        f"Linux {pending} for 64-bit PCs",
        files={
            f"/boot/vmlinuz-{pending}": (stand_in, 0o644),
            f"/boot/config-{pending}": (b"CONFIG_MODULES=y\nCONFIG_MODULE_SIG=y\n", 0o644),
            f"/boot/System.map-{pending}": (stand_in, 0o644),
            f"/lib/modules/{pending}/modules.order": (b"", 0o644),
        },
        scripts={"postinst": _IMAGE_POSTINST.format(release=pending)},
    )
    headers = replace(nvidia_repo._linux_headers(pending),
                      scripts={"postinst": _HEADERS_POSTINST.format(release=pending)})
    return [image, headers]


def digest_input() -> bytes:
    """What the repository's stamp hashes of this module (a change rebuilds the repository)."""
    return Path(__file__).read_bytes()


def install(root: Path) -> None:
    """Put the kernel stand-ins into the host tree ``root`` (the boot unit enabled, as
    ``systemctl enable`` would)."""
    for source, dest, mode in FILES:
        target = root / dest
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text((STANDINS / source).read_text())
        target.chmod(mode)
    wants = root / "etc/systemd/system/sysinit.target.wants" / BOOT_UNIT
    wants.parent.mkdir(parents=True, exist_ok=True)
    if wants.is_symlink() or wants.exists():
        wants.unlink()
    wants.symlink_to(f"/etc/systemd/system/{BOOT_UNIT}")
