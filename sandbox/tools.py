"""The Debian packages the lab needs on this machine, installed with apt-get when missing."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# command -> the Debian package that provides it
REQUIRED: dict[str, str] = {
    "mmdebstrap": "mmdebstrap",
    "systemd-nspawn": "systemd-container",
    # The executable without Debian's system-wide service, which would take 0.0.0.0:8888.
    "tinyproxy": "tinyproxy-bin",
    "apt-ftparchive": "apt-utils",
    "gpg": "gnupg",
    "ssh": "openssh-client",
    "ssh-keygen": "openssh-client",
    "ip": "iproute2",
    "tar": "tar",
    # The controller relays model copies from peer to host (operations/stages/model_copy.py).
    "rsync": "rsync",
}


class ToolError(RuntimeError):
    """A required tool could not be installed."""


def missing_packages() -> list[str]:
    """Debian packages whose commands are not on PATH (sbin included: root's tools live there)."""
    path = os.environ.get("PATH", "") + ":/usr/sbin:/sbin"
    return sorted({pkg for cmd, pkg in REQUIRED.items() if shutil.which(cmd, path=path) is None})


def ensure_tools() -> None:
    """Install what is missing; tries the current package lists first, then `apt-get update`."""
    packages = missing_packages()
    if not packages:
        return
    print(f"sandbox: installing {' '.join(packages)}", file=sys.stderr, flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = ["apt-get", "install", "-y", "--no-install-recommends", *packages]
    # apt's chatter goes to stderr: stdout is for `status --json` and the like.
    if subprocess.run(install, env=env, stdout=sys.stderr, check=False).returncode != 0:
        subprocess.run(["apt-get", "update"], env=env, stdout=sys.stderr, check=False)
        if subprocess.run(install, env=env, stdout=sys.stderr, check=False).returncode != 0:
            raise ToolError(f"apt-get could not install: {' '.join(packages)}")
    still = missing_packages()
    if still:
        raise ToolError(f"installed, yet commands are still missing from: {' '.join(still)}")
