"""The sandbox lab on this machine: hosts booted by ``python -m sandbox up``.

Only inventory data differs from a real lab: the NVIDIA repository and package index are the
sandbox's stand-ins on each host's link, and the lock is the stand-ins' own.
"""

import json
import subprocess
import sys
from pathlib import Path

_root = Path(__file__).resolve().parent.parent
_status = subprocess.run(
    [sys.executable, "-m", "sandbox", "status", "--json"],
    cwd=_root, capture_output=True, text=True, check=False,
)
if _status.returncode != 0:
    raise SystemExit(f"inventory/sandbox.py: python -m sandbox status failed: {_status.stderr}")
_hosts = json.loads(_status.stdout)
if not _hosts:
    raise SystemExit("inventory/sandbox.py: no sandbox hosts: run python -m sandbox up")

#: The bench's sizes on the sandbox (a real lab keeps operations/plans/settings.py's 1, 16, 64
#: levels of 128 prompts, 1024 in / 256 out): the stand-in server paces its answers at the reference
#: lab's rates (11 output tok/s for one stream), so those take the better part of an hour here;
#: these take about a minute (tests/test_bench.py checks the estimate). --data overrides them.
SANDBOX_BENCH = {
    "gpuhost_bench_levels": [1, 4, 16],
    "gpuhost_bench_prompts": 16,
    "gpuhost_bench_input_len": 128,
    "gpuhost_bench_output_len": 32,
}

sandbox = [
    (
        h["name"],
        {
            "ssh_hostname": h["address"],
            # A sudo user, as on a real lab: every command runs through pyinfra's sudo.
            "ssh_user": h["ssh_user"],
            "_sudo": h["ssh_user"] != "root",
            "ssh_key": h["ssh_key"],
            "ssh_known_hosts_file": h["known_hosts"],
            "ssh_strict_host_key_checking": "yes",
            "gpuhost_cuda_repo_url": h["cuda_repo_url"],
            "gpuhost_cuda_keyring_sha256": h["cuda_keyring_sha256"],
            "gpuhost_pip_index_url": h["pip_index_url"],
            "gpuhost_lock": h["lock"],
            # where the fleet's router reaches the host: its lab switch address
            "gpuhost_fleet_address": h["switch_address"],
            **SANDBOX_BENCH,
            **h.get("host_data", {}),
            # a lab with a router host: the fleet's keys and binds (sandbox/fleet_keys.py)
            **h.get("fleet_data", {}),
        },
    )
    for h in _hosts
]

# a host without GPUs (sandbox up --host-scenario gpuN=cpu-only) serves no model: a router host
_routers = [h["name"] for h in _hosts if h.get("host_data", {}).get("gpuhost_serving") is False]
if _routers:
    gpuhost_router = _routers
