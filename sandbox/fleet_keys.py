"""A lab that is a fleet: its keys, made by ``up`` as docs/security.md's "Set it up" has an
operator make them, and the host data that names them.

A lab with a host that serves no model (scenario ``cpu-only``: inventory/sandbox.py puts it in
the ``gpuhost_router`` group) is a fleet behind the router on that host, as docs/fleet.md's
"the router on a CPU-only VM of its own": every host gets the fleet key, each serving host its
servers' client key, each router host the router's client key, each a root-only file
(docs/security.md: the deploy refuses a router host without its client key file and a gated
worker without the fleet key file). The servers bind their switch address behind their gates,
the router its own (the lab's switch is the fleet network: sandbox/README.md). A lab without
such a host is as before: each host its own server on its loopback.

The keys are made once per lab, kept root-only in the lab's state folder (``fleet/``), which is
where a newcomer's client finds the router's (``sandbox status`` names the file); ``down``
leaves them, as it leaves the hub's token.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import Any, Final

#: kind: (the file on the host, which hosts get it: "all", "serving" or "router")
KEYS: Final = {
    "fleet key": ("/root/fleet.key", "all"),
    "API key": ("/root/sglang-api.key", "serving"),
    "router API key": ("/root/router-api.key", "router"),
}


def _controller_file(state_dir: Path, kind: str) -> Path:
    return state_dir / "fleet" / Path(KEYS[kind][0]).name


def router_key_file(state_dir: Path) -> Path:
    """Where the controller keeps the router's client key: what a client sends."""
    return _controller_file(state_dir, "router API key")


def ensure(state_dir: Path) -> dict[str, str]:
    """The lab's keys by kind, each made once (32 bytes of ``secrets.token_urlsafe``, as
    docs/security.md's commands make them), mode 0600 in a folder of mode 0700."""
    keys = {}
    for kind in KEYS:
        path = _controller_file(state_dir, kind)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(secrets.token_urlsafe(32) + "\n")
        keys[kind] = path.read_text().strip()
    return keys


def install(root: Path, serving: bool, keys: dict[str, str]) -> None:
    """Put a host's keys on its root filesystem, root-only, as an admin would before
    provisioning: the fleet key, and the serving host's or the router host's client key."""
    for kind, (on_host, who) in KEYS.items():
        if who == "all" or (who == "serving") == serving:
            dest = root / on_host.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(keys[kind] + "\n")
            os.chmod(dest, 0o600)
            os.chown(dest, 0, 0)


def host_data(switch_address: str, serving: bool) -> dict[str, Any]:
    """A fleet lab's host data for one host: its keys' files and its binds on the switch."""
    data: dict[str, Any] = {"gpuhost_fleet_key_file": KEYS["fleet key"][0]}
    if serving:
        data.update(gpuhost_server_host=switch_address, gpuhost_api_key_file=KEYS["API key"][0])
    else:
        data.update(gpuhost_router_host=switch_address,
                    gpuhost_router_api_key_file=KEYS["router API key"][0])
    return data
