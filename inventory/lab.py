"""The reference lab: one Proxmox VM with 8 x RTX PRO 6000 Blackwell (compute capability
12.0), serving GLM-5-NVFP4 at tensor parallel size 8.

Where the host is comes from the environment, or from inventory/lab_local.py (not tracked):

    GPUHOST_LAB_ADDRESS=203.0.113.10 GPUHOST_LAB_USER=ubuntu \
    GPUHOST_LAB_SSH_KEY=~/.ssh/id_ed25519 pyinfra inventory/lab.py deploy.py

inventory/lab_local.py, if present, defines ``ADDRESS``, ``USER`` and ``SSH_KEY``.
"""

import os
from pathlib import Path

_local: dict = {}
_local_file = Path(__file__).with_name("lab_local.py")
if _local_file.exists():
    exec(compile(_local_file.read_text(), str(_local_file), "exec"), _local)


def _setting(env: str, local: str) -> str:
    value = os.environ.get(env) or _local.get(local)
    if not value:
        raise SystemExit(
            f"inventory/lab.py: set {env} in the environment or {local} in "
            "inventory/lab_local.py (see the README, 'A real lab')"
        )
    return str(value)


_address = _setting("GPUHOST_LAB_ADDRESS", "ADDRESS")

gpu_servers = [
    (
        "lab-gpu1",
        {
            "ssh_hostname": _address,
            "ssh_user": _setting("GPUHOST_LAB_USER", "USER"),
            "ssh_key": os.path.expanduser(_setting("GPUHOST_LAB_SSH_KEY", "SSH_KEY")),
            "_sudo": _setting("GPUHOST_LAB_USER", "USER") != "root",
            "gpuhost_gpu_count": 8,
            "gpuhost_compute_capability": "12.0",
        },
    ),
]
