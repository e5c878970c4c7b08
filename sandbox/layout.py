"""Names, addresses and paths of the sandbox lab, as sandbox/README.md fixes them.

Pure data: nothing here touches the machine, so unit tests and the inventory can use it freely.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _lab_number() -> int:
    """GPUHOST_SANDBOX_LAB (0 to 9, default 0): several labs side by side on one machine, each
    with its own state, namespaces and subnets, so that test runs do not take each other's
    hosts down."""
    text = os.environ.get("GPUHOST_SANDBOX_LAB", "0")
    if not text.isdigit() or not 0 <= int(text) <= 9:
        raise SystemExit(f"GPUHOST_SANDBOX_LAB = {text!r}: allowed are 0 to 9")
    return int(text)


LAB = _lab_number()
CACHE = Path("/var/cache/gpuhost-sandbox")
STATE_DIR = Path("/var/lib/gpuhost-sandbox" + (f"-lab{LAB}" if LAB else ""))

ROOTFS_TAR = CACHE / "rootfs-bookworm.tar"
APT_ARCHIVES = CACHE / "apt-archives"
PYPI_CACHE = CACHE / "pypi"

STATE_FILE = STATE_DIR / "state.json"
SSH_DIR = STATE_DIR / "ssh"
SSH_KEY = SSH_DIR / "id_ed25519"
KNOWN_HOSTS = SSH_DIR / "known_hosts"
HOSTS_DIR = STATE_DIR / "hosts"
TRASH = STATE_DIR / "trash"
WWW = STATE_DIR / "www"
LOCK_FILE = STATE_DIR / "lock.txt"
#: The stand-in lock of each stack by CUDA release (sandbox/pypi_index.py stacks): the
#: default, CUDA 12.8's, is LOCK_FILE, which the inventory gives every host as gpuhost_lock.
LOCK_FILES = {"12.8": LOCK_FILE, "13.0": STATE_DIR / "lock-cuda13.0.txt"}
SERVICES_DIR = STATE_DIR / "services"

HTTP_PORT = 8080
PROXY_PORT = 8888
SSH_PORT = 22

SUBNET_PREFIX = f"10.{213 + LAB}"
#: The lab "switch": a bridge in a network namespace of the lab's own, one port per host. Its
#: subnet is the 0th /24 of the lab's 10.(213+L).0.0/16, which no host link uses (hosts are 1..254),
#: so no two labs' switches, and no switch and link, share addresses.
SWITCH_NETNS = f"gpuhost{LAB or ''}-switch"
SWITCH_BRIDGE = "br0"
SWITCH_SUBNET = f"{SUBNET_PREFIX}.0.0/24"
#: The host's end of its switch port, beside eth0 (its link to this machine).
SWITCH_IFACE = "eth1"
MAX_HOSTS = 254
DEFAULT_SCENARIO = "reference-lab"

# The base URL, as NVIDIA's own .../compute/cuda/repos: the product appends <distro>/<arch>/.
CUDA_REPO_PATH = "/compute/cuda/repos"
#: Where NVIDIA keeps the Debian 12 x86_64 repository under the base URL (its layout).
CUDA_REPO_DIR = CUDA_REPO_PATH + "/debian12/x86_64/"
PIP_INDEX_PATH = "/simple/"

GUEST_APT_ARCHIVES = "/var/cache/apt/archives"


@dataclass(frozen=True)
class HostSpec:
    """One sandbox host's names and link addresses (host N is gpuN on 10.213.N.0/24; in lab L
    on 10.(213+L).N.0/24)."""

    index: int

    def __post_init__(self) -> None:
        if not 1 <= self.index <= MAX_HOSTS:
            raise ValueError(f"host index must be 1..{MAX_HOSTS}, not {self.index}")

    @property
    def name(self) -> str:
        return f"gpu{self.index}"

    @property
    def netns(self) -> str:
        return f"gpuhost{LAB or ''}-{self.name}"

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns

    @property
    def veth(self) -> str:
        """This machine's end of the link; the namespace's end is always eth0."""
        return f"gh{LAB}x{self.index}" if LAB else f"gh{self.index}"

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.{self.index}.0/24"

    @property
    def gateway(self) -> str:
        """This machine's address on the link: where the proxy and the HTTP server listen."""
        return f"{SUBNET_PREFIX}.{self.index}.1"

    @property
    def address(self) -> str:
        return f"{SUBNET_PREFIX}.{self.index}.2"

    @property
    def switch_address(self) -> str:
        """The host's address on the lab switch: where the lab's other hosts reach it."""
        return f"{SUBNET_PREFIX}.0.{self.index}"

    @property
    def switch_port(self) -> str:
        """The switch's end of the host's port (inside SWITCH_NETNS, so no name clashes)."""
        return f"port{self.index}"

    @property
    def dir(self) -> Path:
        return HOSTS_DIR / self.name

    @property
    def root(self) -> Path:
        return self.dir / "root"

    @property
    def console_log(self) -> Path:
        return self.dir / "console.log"

    @property
    def cuda_repo_url(self) -> str:
        return f"http://{self.gateway}:{HTTP_PORT}{CUDA_REPO_PATH}"

    @property
    def pip_index_url(self) -> str:
        return f"http://{self.gateway}:{HTTP_PORT}{PIP_INDEX_PATH}"

    @property
    def proxy_url(self) -> str:
        return f"http://{self.gateway}:{PROXY_PORT}"


def host_specs(count: int) -> list[HostSpec]:
    """Hosts gpu1..gpuN; raises ValueError when N is outside 1..254 (one /24 per host)."""
    if not 1 <= count <= MAX_HOSTS:
        raise ValueError(f"--hosts must be 1..{MAX_HOSTS}, not {count}")
    return [HostSpec(i) for i in range(1, count + 1)]


def host_from_name(name: str) -> HostSpec:
    """The spec of `gpuN`; raises ValueError for any other name."""
    if not name.startswith("gpu") or not name[3:].isdigit():
        raise ValueError(f"not a sandbox host name: {name!r}")
    return HostSpec(int(name[3:]))
