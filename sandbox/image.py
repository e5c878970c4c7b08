"""A host's root filesystem kept as an image: a later `up --image` boots new hosts from it
instead of the bare root filesystem, as a cloud user starts VMs from an image of a host they
set up once.

The end-to-end suite uses it for modules that start from a converged host (tests/e2e/lab.py
`up_converged`): one first deploy per suite run instead of one per module. An image is made
from a powered-off host (an orderly poweroff, so its files are at rest, as an image of a VM is
taken), with a side file naming the scenario it was made under (new hosts from it must have
the same stand-in hardware). The .deb files in its apt cache stay out: `up` seeds every host's
cache from the lab's shared one (rootfs.seed_apt_archives). `up` personalises each host from an
image as from the bare tarball: host name, SSH host keys, machine-id (empty: systemd makes a new
one at boot), the link's apt proxy, the hub token.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from sandbox.layout import GUEST_APT_ARCHIVES


class ImageError(RuntimeError):
    """An image could not be written or read; the message names the file."""


def _side_file(tar: Path) -> Path:
    return tar.with_name(tar.name + ".json")


def save(root: Path, tar: Path, scenario: str, host: str) -> None:
    """Write the (powered-off) host tree at `root` to `tar`, atomically, with its side file."""
    tar.parent.mkdir(parents=True, exist_ok=True)
    partial = tar.with_name(tar.name + ".partial")
    partial.unlink(missing_ok=True)
    archives = "." + GUEST_APT_ARCHIVES
    cmd = ["tar", "--numeric-owner", "--xattrs", "--xattrs-include=*", "-cpf", str(partial),
           "-C", str(root), f"--exclude={archives}/*.deb", "--exclude=./run/*", "."]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        partial.unlink(missing_ok=True)
        raise ImageError(f"writing {tar} from {root} failed:\n{proc.stderr[-2000:]}")
    _side_file(tar).write_text(json.dumps({"scenario": scenario, "host": host}) + "\n")
    os.replace(partial, tar)


def describe(tar: Path) -> dict[str, Any]:
    """The side file of image `tar`: {"scenario", "host"}; ImageError when there is no image."""
    if tar.is_file():
        try:
            return json.loads(_side_file(tar).read_text())
        except (OSError, ValueError):
            pass
    raise ImageError(f"no image at {tar} (python -m sandbox image HOST PATH makes one)")
