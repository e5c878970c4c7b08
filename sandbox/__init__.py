"""The sandbox lab: real Debian 12 hosts on this machine (systemd-nspawn in network namespaces)
that `deploy.py` provisions as it would GPU hosts, with stand-ins served for what needs a GPU.

sandbox/README.md is the contract (paths, names, addresses, ports); `python -m sandbox --help`.
"""

from sandbox.lab import LabError, down, load_state, ssh_command, status, up
from sandbox.layout import HostSpec, host_specs

__all__ = [
    "HostSpec",
    "LabError",
    "down",
    "host_specs",
    "load_state",
    "ssh_command",
    "status",
    "up",
]
