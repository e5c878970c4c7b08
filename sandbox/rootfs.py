"""The hosts' root filesystem: one cached Debian 12 tarball, a fresh extraction per host."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

from sandbox import kernels, pci
from sandbox.layout import APT_ARCHIVES, GUEST_APT_ARCHIVES, ROOTFS_TAR, HostSpec

SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SECURITY_MIRROR = "http://deb.debian.org/debian-security"

# What a fresh minimal cloud VM image holds on top of minbase; the product installs the rest
# (curl, python3-venv, build tools) itself, so they must not be here.
PACKAGES: tuple[str, ...] = (
    "systemd",
    "systemd-sysv",
    "dbus",
    "openssh-server",
    "python3",
    "iproute2",
    "ca-certificates",
    "netbase",
    "procps",
    "less",
    "kmod",
    "sudo",
    "locales",
)

#: The operator the deploy logs in as: a user with passwordless sudo, as on a cloud image
#: (Ubuntu's "ubuntu"), never root. The lab's root login stays for the tests' own checks.
OPERATOR: Final = "gpuops"
#: The hosts' locale (/etc/default/locale, which pam_env gives every SSH session, sudo keeping
#: LANG): German, so that apt, dpkg and coreutils answer in German unless told LC_ALL=C.
LOCALE: Final = "de_DE.UTF-8"

# Run inside the new tree once, when the cached tarball is built: the locale compiled, the
# operator created with passwordless sudo.
CUSTOMIZE_HOOKS: tuple[str, ...] = (
    f'echo "{LOCALE} UTF-8" > "$1/etc/locale.gen" && chroot "$1" locale-gen',
    f'chroot "$1" useradd --create-home --shell /bin/bash --groups sudo {OPERATOR}',
    f'echo "{OPERATOR} ALL=(ALL:ALL) NOPASSWD: ALL" > "$1/etc/sudoers.d/90-{OPERATOR}" '
    f'&& chmod 0440 "$1/etc/sudoers.d/90-{OPERATOR}"',
)

SOURCES: tuple[str, ...] = (
    f"deb {MIRROR} {SUITE} main",
    f"deb {MIRROR} {SUITE}-updates main",
    f"deb {SECURITY_MIRROR} {SUITE}-security main",
)

# Units a container cannot run, or that would fight the link configured from outside.
MASKED_UNITS: tuple[str, ...] = (
    "systemd-networkd.service",
    "systemd-networkd.socket",
    "systemd-networkd-wait-online.service",
    "systemd-timesyncd.service",
)

SSHD_CONF = "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"

# Stand-ins for tools that read the machine under the OS (sandbox/standins/virt/): under nspawn
# the real ones see this machine, not the scenario's.
VIRT_STANDIN_DIR = Path(__file__).with_name("standins") / "virt"
DATA_DIR = Path(__file__).with_name("data")
VIRT_STANDINS: tuple[tuple[str, str], ...] = (
    ("systemd-detect-virt", "usr/local/bin"),
    ("dmidecode", "usr/local/sbin"),
)

# The firmware's Secure Boot state and MOK list as mokutil reports them (sandbox/standins/
# secureboot/): a host under nspawn has no EFI variables of its own.
SECUREBOOT_STANDIN = Path(__file__).with_name("standins") / "secureboot" / "mokutil"
SECUREBOOT_STANDIN_DEST = "usr/local/bin/mokutil"

HOSTS_TEMPLATE = """127.0.0.1\tlocalhost
127.0.1.1\t{name}
::1\tlocalhost ip6-localhost ip6-loopback
ff02::1\tip6-allnodes
ff02::2\tip6-allrouters
"""

# apt reaches Debian through the link's proxy; the lab's own repository is on the same address.
APT_PROXY_TEMPLATE = """Acquire::http::Proxy "{proxy}";
Acquire::http::Proxy::{gateway} "DIRECT";
"""

RESOLV_CONF = "# gpuhost-sandbox: no resolver; apt reaches Debian through its HTTP proxy\n"

#: Root's and every login's umask on the hosts, as a hardened host sets it (CIS Debian
#: Linux 12 Benchmark, "Ensure default user umask is configured": UMASK 077 in
#: /etc/login.defs, applied to every PAM session by pam_umask(8), USERGROUPS_ENAB no so that
#: a user's own group gets no more, and ``umask 077`` in the shells' profile): what gpuhost
#: makes without an explicit mode comes out 0700/0600, and sudo keeps the login's umask
#: (sudoers(5) "umask": the union with its 0022).
UMASK: Final = "077"
UMASK_PAM_LINE = "session optional\t\t\tpam_umask.so\n"
UMASK_PROFILE = f"# gpuhost-sandbox: a hardened host's umask\numask {UMASK}\n"


class RootfsError(RuntimeError):
    """Building or preparing a root filesystem failed."""


def recipe() -> dict[str, object]:
    """What the cached tarball was built from: a different recipe means a rebuild."""
    return {
        "suite": SUITE,
        "variant": "minbase",
        "packages": list(PACKAGES),
        "sources": list(SOURCES),
        "customize": list(CUSTOMIZE_HOOKS),
    }


def _recipe_file(tar: Path) -> Path:
    return tar.with_name(tar.name + ".recipe.json")


def mmdebstrap_command(target: Path) -> list[str]:
    """The mmdebstrap command line that writes the tarball to `target`."""
    return [
        "mmdebstrap",
        "--variant=minbase",
        "--format=tar",
        f"--include={','.join(PACKAGES)}",
        *(f"--customize-hook={hook}" for hook in CUSTOMIZE_HOOKS),
        SUITE,
        str(target),
        *SOURCES,
    ]


def ensure_tarball(tar: Path = ROOTFS_TAR) -> bool:
    """Build the tarball unless a current one is cached; returns True when it was built."""
    wanted = recipe()
    marker = _recipe_file(tar)
    if tar.is_file() and marker.is_file():
        try:
            if json.loads(marker.read_text()) == wanted:
                return False
        except ValueError:
            pass
    tar.parent.mkdir(parents=True, exist_ok=True)
    partial = tar.with_name(tar.name + ".partial")
    partial.unlink(missing_ok=True)
    print(
        f"sandbox: building {tar} with mmdebstrap (once; downloads ~100 MB)",
        file=sys.stderr,
        flush=True,
    )
    proc = subprocess.run(mmdebstrap_command(partial), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RootfsError(f"mmdebstrap failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    os.replace(partial, tar)
    marker.write_text(json.dumps(wanted, indent=1) + "\n")
    return True


def extract(root: Path, tar: Path = ROOTFS_TAR) -> None:
    """A fresh copy of the tarball at `root` (which must not exist)."""
    root.mkdir(parents=True, mode=0o755)
    cmd = [
        "tar",
        "--numeric-owner",
        "--xattrs",
        "--xattrs-include=*",
        "-xpf",
        str(tar),
        "-C",
        str(root),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RootfsError(f"extracting {tar} into {root} failed:\n{proc.stderr[-2000:]}")


def _write(path: Path, text: str, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _mask(root: Path, unit: str) -> None:
    link = root / "etc/systemd/system" / unit
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to("/dev/null")


def _authorize_operator(root: Path, authorized_key: str) -> None:
    """The lab's key in the operator's authorized_keys, owned by the operator (its uid and gid
    as the tree's /etc/passwd has them)."""
    entry = next(line.split(":") for line in (root / "etc/passwd").read_text().splitlines()
                 if line.startswith(f"{OPERATOR}:"))
    uid, gid, home = int(entry[2]), int(entry[3]), root / entry[5].lstrip("/")
    ssh_dir = home / ".ssh"
    ssh_dir.mkdir(mode=0o700, exist_ok=True)
    keys = ssh_dir / "authorized_keys"
    _write(keys, authorized_key.strip() + "\n", 0o600)
    for path in (ssh_dir, keys):
        os.chown(path, uid, gid)


def ssh_keygen(path: Path, kind: str, comment: str) -> None:
    """A new passphrase-less key pair at `path` and `path`.pub."""
    subprocess.run(
        ["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        stdin=subprocess.DEVNULL,
    )


def _fresh_host_keys(root: Path, name: str) -> list[str]:
    """New host keys, as a first boot of a cloud image makes; returns the public key lines."""
    ssh_dir = root / "etc/ssh"
    for old in ssh_dir.glob("ssh_host_*"):
        old.unlink()
    keys = []
    for kind in ("rsa", "ecdsa", "ed25519"):
        key = ssh_dir / f"ssh_host_{kind}_key"
        ssh_keygen(key, kind, f"root@{name}")
        keys.append(" ".join(key.with_suffix(".pub").read_text().split()[:2]))
    return keys


def _harden_umask(root: Path) -> None:
    """Root's and the operator's umask 077 (:data:`UMASK`): login.defs, pam_umask in every
    session, the profile."""
    defs = root / "etc/login.defs"
    text = defs.read_text() if defs.exists() else ""
    for key, value in (("UMASK", f"UMASK\t\t{UMASK}"), ("USERGROUPS_ENAB", "USERGROUPS_ENAB no")):
        text, found = re.subn(rf"(?m)^{key}\s+\S+$", value, text)
        if not found:
            text += value + "\n"
    _write(defs, text)
    session = root / "etc/pam.d/common-session"
    lines = session.read_text() if session.exists() else ""
    if "pam_umask.so" not in lines:
        _write(session, lines + UMASK_PAM_LINE)
    _write(root / "etc/profile.d/50-gpuhost-sandbox-umask.sh", UMASK_PROFILE)


def personalise(spec: HostSpec, root: Path, authorized_key: str, hardware_json: str) -> list[str]:
    """Make an extracted tree into host `spec`; returns its SSH host public keys ("type base64")."""
    _write(root / "etc/hostname", f"{spec.name}\n")
    _write(root / "etc/hosts", HOSTS_TEMPLATE.format(name=spec.name))
    _write(root / "etc/machine-id", "", 0o444)
    (root / "var/lib/dbus/machine-id").unlink(missing_ok=True)
    resolv = root / "etc/resolv.conf"
    if resolv.is_symlink():
        resolv.unlink()
    _write(resolv, RESOLV_CONF)
    _write(root / "etc/ssh/sshd_config.d/50-gpuhost-sandbox.conf", SSHD_CONF)
    (root / "root/.ssh").mkdir(mode=0o700, parents=True, exist_ok=True)
    _write(root / "root/.ssh/authorized_keys", authorized_key.strip() + "\n", 0o600)
    _authorize_operator(root, authorized_key)
    _write(root / "etc/default/locale", f"LANG={LOCALE}\n")
    _write(
        root / "etc/apt/apt.conf.d/80sandbox-proxy",
        APT_PROXY_TEMPLATE.format(proxy=spec.proxy_url, gateway=spec.gateway),
    )
    _write(root / "etc/gpuhost-sandbox/hardware.json", hardware_json)
    release = (json.loads(hardware_json).get("host") or {}).get("os_release")
    if release:
        # The distribution the scenario presents (sandbox/scenarios.py OS_RELEASES); Debian's
        # /etc/os-release is a link to /usr/lib/os-release, which stays Debian's.
        os_release = root / "etc/os-release"
        if os_release.is_symlink():
            os_release.unlink()
        _write(os_release, (DATA_DIR / f"os-release-{release}").read_text())
    pci.install(root, hardware_json)
    # The scenario's machine as the guest's tools see it; /usr/local comes first on PATH.
    for tool, folder in VIRT_STANDINS:
        _write(root / folder / tool, (VIRT_STANDIN_DIR / tool).read_text(), 0o755)
    _write(root / SECUREBOOT_STANDIN_DEST, SECUREBOOT_STANDIN.read_text(), 0o755)
    kernels.install(root)  # the booted kernel, uname and dkms (sandbox/kernels.py)
    for unit in MASKED_UNITS:
        _mask(root, unit)
    _harden_umask(root)
    return _fresh_host_keys(root, spec.name)


def seed_apt_archives(root: Path, pool: Path = APT_ARCHIVES) -> int:
    """Hard-link the lab's cached .debs into the host's own /var/cache/apt/archives, as if a
    caching mirror had served them before; returns how many.

    Each host keeps its own archives directory (and so its own apt lock): one directory shared
    by bind mount lets only one host run apt at a time, and parallel deploys then fail with
    "Could not get lock /var/cache/apt/archives/lock". apt checks an existing file's hash
    against its index before using it, so a stale .deb is fetched again, never installed.
    A host whose root is an overlay (sandbox/overlay.py) is seeded in its upper folder instead.
    """
    archives = root / GUEST_APT_ARCHIVES.lstrip("/")
    (archives / "partial").mkdir(parents=True, exist_ok=True)
    return link_debs(pool, archives)


def link_debs(pool: Path, archives: Path) -> int:
    """Hard-link each .deb of `pool` into `archives` where it has none of that name."""
    pool.mkdir(parents=True, exist_ok=True)
    count = 0
    for deb in pool.glob("*.deb"):
        target = archives / deb.name
        if not target.exists():
            os.link(deb, target)
            count += 1
    return count


def harvest_apt_archives(root: Path, pool: Path = APT_ARCHIVES) -> int:
    """Keep the .debs the host downloaded in the lab's cache (a host's newer file replaces the
    cached one of the same name); returns how many were added or replaced."""
    archives = root / GUEST_APT_ARCHIVES.lstrip("/")
    if not archives.is_dir():
        return 0
    pool.mkdir(parents=True, exist_ok=True)
    count = 0
    for deb in archives.glob("*.deb"):
        if deb.is_symlink() or not deb.is_file():
            continue
        cached = pool / deb.name
        if cached.exists() and os.path.samefile(deb, cached):
            continue
        incoming = pool / f".{deb.name}.{os.getpid()}.incoming"  # labs harvest side by side
        incoming.unlink(missing_ok=True)
        os.link(deb, incoming)
        os.replace(incoming, cached)
        count += 1
    return count


def mounts_below(path: Path) -> list[str]:
    prefix = str(path.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if (p + "/").startswith(prefix)]


def remove_tree(path: Path) -> None:
    """Delete a host tree, refusing when anything is still mounted below it (a bind mount of
    the shared apt cache would otherwise be emptied too)."""
    if not path.exists():
        return
    mounted = mounts_below(path)
    if mounted:
        raise RootfsError(f"still mounted below {path}: {', '.join(mounted)}")
    shutil.rmtree(path)


def set_aside(trees: list[Path], trash: Path) -> None:
    """Move host trees into `trash` (a rename: instant), to delete later with remove_tree."""
    for tree in trees:
        mounted = mounts_below(tree)
        if mounted:
            raise RootfsError(f"still mounted below {tree}: {', '.join(mounted)}")
        trash.mkdir(parents=True, exist_ok=True)
        os.replace(tree, trash / f"{tree.name}-{time.time_ns()}")
