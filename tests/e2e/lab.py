"""Helpers for end-to-end tests: the sandbox lab through its CLI, the deploy through pyinfra's
CLI, and checks through plain ssh (never through pyinfra, so the code under test does not
confirm itself)."""

from __future__ import annotations

import fcntl
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from sandbox import lab as sandbox_lab
from tests.secret_guard import GUARD

ROOT = Path(__file__).resolve().parents[2]
PYINFRA = ROOT / ".venv" / "bin" / "pyinfra"
#: A folder for this suite run's images of converged hosts (tests/lanes.py makes one per run,
#: so an image never outlives the code that converged it); unset: every module converges its own.
IMAGES_ENV = "GPUHOST_E2E_IMAGES"


def sandbox(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "sandbox", *args], cwd=ROOT, text=True,
                            capture_output=True, check=False)
    GUARD.observe(f"python -m sandbox {' '.join(args)}", result.stdout + result.stderr)
    if check:
        result.check_returncode()
    return result


def register_hub_token() -> None:
    """The hub stand-in's token, which `up` puts on every host, and a fleet lab's keys
    (sandbox/fleet_keys.py): secrets to the guard."""
    if sandbox_lab.HUB_TOKEN.is_file():
        GUARD.register(sandbox_lab.HUB_TOKEN.read_text(), "Hugging Face token")
    for path in sorted((sandbox_lab.STATE_DIR / "fleet").glob("*.key")):
        GUARD.register(path.read_text(), f"the lab's {path.name}")


@dataclass
class Host:
    name: str
    address: str
    ssh_key: str

    def ssh(self, command: str, check: bool = True) -> str:
        result = subprocess.run(
            ["ssh", "-i", self.ssh_key, "-o", "StrictHostKeyChecking=no",
             "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
             "-o", "BatchMode=yes",
             # the checks read English (sshd accepts LC_*); the deploy gets the host's German
             "-o", "SetEnv=LC_ALL=C", f"root@{self.address}", command],
            text=True, capture_output=True, timeout=120, check=False,
        )
        if check and result.returncode != 0:
            raise AssertionError(f"ssh {self.name} {command!r} exited {result.returncode}: "
                                 f"{result.stdout}{result.stderr}")
        return result.stdout

    def set_scenario_host(self, **fields) -> None:
        """Change the host's scenario (its ``host`` fields, e.g. how many seconds the stand-in
        DKMS and flash-attn builds take) in its copy of hardware.json."""
        self.ssh("python3 - <<'EOF'\nimport json\np = '/etc/gpuhost-sandbox/hardware.json'\n"
                 f"d = json.load(open(p))\nd['host'].update({json.dumps(fields)})\n"
                 "json.dump(d, open(p, 'w'))\nEOF")

    def http_get(self, url: str) -> str:
        """GET a URL from inside the host (the server binds the host's 127.0.0.1)."""
        script = f"import urllib.request; print(urllib.request.urlopen({url!r}).read().decode())"
        return self.ssh(f"python3 -c {json.dumps(script)}")

    def main_pid(self, unit: str = "sglang.service") -> int:
        return int(self.ssh(f"systemctl show -p MainPID --value {unit}").strip())

    def process_env(self, pid: int) -> dict[str, str]:
        raw = self.ssh(f"tr '\\0' '\\n' < /proc/{pid}/environ")
        return dict(line.split("=", 1) for line in raw.splitlines() if "=" in line)

    def process_args(self, pid: int) -> list[str]:
        return self.ssh(f"tr '\\0' '\\n' < /proc/{pid}/cmdline").splitlines()


def driver_by_hand(host: "Host", version: str) -> None:
    """Install driver ``version`` ("580.95.05") by hand, without a reboot, as an operator would:
    every installed package of the driver's tree (sandbox/data/nvidia-graphics-drivers.json,
    whose exact-version dependencies want them all at one version) at that version."""
    host.ssh(
        "set -e; p=$(dpkg-query -W -f='${Package} ${Status}\\n' | awk '$NF == \"installed\" "
        "{print $1}' | grep -E '^(nvidia-|libnvidia-|libcuda1|libgl1-nvidia-|libegl-nvidia|"
        "libglx-nvidia|firmware-nvidia-|xserver-xorg-video-nvidia)' "
        "| grep -v '^nvidia-driver-pinning-' | sed 's/$/=" + version + "-1/'); "
        "DEBIAN_FRONTEND=noninteractive apt-get -y -q install --allow-downgrades "
        "--allow-change-held-packages $p >/dev/null")


def inventory_data(listed: dict) -> dict:
    """A host's data as inventory/sandbox.py gives it, from its ``sandbox status --json`` entry:
    the operator's login with sudo, the stand-ins' URLs and lock, the scenario's data."""
    return {
        "ssh_hostname": listed["address"], "ssh_user": listed["ssh_user"],
        "_sudo": listed["ssh_user"] != "root", "ssh_key": listed["ssh_key"],
        "ssh_known_hosts_file": listed["known_hosts"], "ssh_strict_host_key_checking": "yes",
        "gpuhost_cuda_repo_url": listed["cuda_repo_url"],
        "gpuhost_cuda_keyring_sha256": listed["cuda_keyring_sha256"],
        "gpuhost_pip_index_url": listed["pip_index_url"], "gpuhost_lock": listed["lock"],
        **listed.get("host_data", {}),
    }


def up(hosts: int = 1, scenario: str = "reference-lab",
       from_image: str | Path | None = None,
       host_scenarios: dict[str, str] | None = None) -> list[Host]:
    image = ["--from-image", str(from_image)] if from_image else []
    own = [a for name, s in (host_scenarios or {}).items()
           for a in ("--host-scenario", f"{name}={s}")]
    result = sandbox("up", "--hosts", str(hosts), "--scenario", scenario, *own, *image,
                     check=False)
    register_hub_token()
    if result.returncode != 0:
        raise AssertionError(f"sandbox up failed:\n{result.stdout}\n{result.stderr}")
    return status()


def up_converged(scenario: str = "reference-lab") -> Host:
    """One host of `scenario` converged by a first deploy of the default inventory (which must
    succeed). Where the suite run keeps images ($GPUHOST_E2E_IMAGES), the first module to ask
    converges a bare host and keeps its image (sandbox/image.py, which boots the host again);
    every other module gets a new host from the image; each runs the first deploy on its host
    (one from the image is new to this lab: its address, SSH keys, NVIDIA repository key and
    controller are this lab's), so one bare converge serves the run. Modules that test the
    converge itself use ``up``."""
    tar, made = _converged_image(scenario)
    if tar is None:
        (host,) = up(hosts=1, scenario=scenario)
    elif made:  # the host that made the image, booted again
        (host,) = status()
    else:
        (host,) = up(hosts=1, scenario=scenario, from_image=tar)
    _first_deploy()
    return host


def up_from_image(hosts: int, scenario: str = "reference-lab",
                  host_scenarios: dict[str, str] | None = None,
                  first_deploy: bool = True) -> list[Host]:
    """Fresh hosts gpu1..gpuN as ``up`` gives them, except that where the suite run keeps
    images ($GPUHOST_E2E_IMAGES) the hosts of `scenario` boot from its converged image (made
    as ``up_converged`` makes it, if no module made it yet) and, unless told otherwise, get the
    first deploy ``up_converged`` gives (an inventory of them alone), while the
    ``host_scenarios`` ones (a CPU-only router VM) boot from the bare tree. For modules whose
    subject is a fleet, not a converge from bare: their own first deploy then changes the
    converged hosts into the fleet. Run alone, a module boots bare hosts.

    The image is another lab's host: its NVIDIA repository source names that lab's address
    until the deploy's NVIDIA stage writes this lab's, and an apt install that comes earlier in
    the run (the loopback guard's nftables, where the server binds off the loopback) fails on
    the stale source; ``first_deploy=False`` for a module whose own first deploy has none."""
    tar, _ = _converged_image(scenario)
    started = time.monotonic()
    booted = up(hosts=hosts, scenario=scenario, from_image=tar, host_scenarios=host_scenarios)
    print(f"up_from_image: {hosts} host(s) up in {time.monotonic() - started:.0f} s")
    if tar is not None and first_deploy:
        own = host_scenarios or {}
        listed = [h for h in json.loads(sandbox("status", "--json").stdout)
                  if own.get(h["name"], scenario) == scenario]
        entries = json.dumps(json.dumps([(h["name"], inventory_data(h)) for h in listed]))
        with tempfile.TemporaryDirectory(prefix="gpuhost-e2e-") as folder:
            inventory = Path(folder) / "converged.py"
            inventory.write_text(f"import json\nconverged = [tuple(e) for e in "
                                 f"json.loads({entries})]\n")
            started = time.monotonic()
            first = deploy(inventory=str(inventory))
        assert first.returncode == 0, first.output[-6000:]
        print(f"up_from_image: their first deploy {time.monotonic() - started:.0f} s")
    return booted


def _converged_image(scenario: str) -> tuple[Path | None, bool]:
    """The suite run's image of a converged host of `scenario` and whether this call made it
    (in this lab, whose gpu1 it leaves converged and booted); (None, False) where the run
    keeps no images."""
    folder = os.environ.get(IMAGES_ENV)
    if not folder:
        return None, False
    tar = Path(folder) / f"converged-{scenario}.tar"
    with open(Path(folder) / f".{scenario}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another lane's module may be making it
        made = not tar.is_file()
        if made:  # the host is booted again once its image is written
            up(hosts=1, scenario=scenario)
            _first_deploy()
            sandbox("image", "gpu1", str(tar))
    return tar, made


#: Where the fleet's keys go on the hosts (docs/security.md, the fleet's three planes).
FLEET_KEY_FILE = "/root/fleet.key"
API_KEY_FILE = "/root/sglang-api.key"
ROUTER_KEY_FILE = "/root/router-api.key"


def fleet_keys(hosts: Iterable[Host], routers: Iterable[str],
               serving: Iterable[str] | None = None) -> dict[str, str]:
    """The fleet's three keys, made here and known to the secret guard, in root-only files on
    the hosts: the fleet key on every host (:data:`FLEET_KEY_FILE`), the servers' client key on
    each serving host (:data:`API_KEY_FILE`; ``serving``: their names, default every host
    that is no router), the router's client key on each router host
    (:data:`ROUTER_KEY_FILE`). Returns them by kind: "API key", "router API key", "fleet
    key"."""
    keys = {what: GUARD.register("sk-" + secrets.token_hex(24), what)
            for what in ("API key", "router API key", "fleet key")}
    routers = set(routers)
    for h in hosts:
        files = [(FLEET_KEY_FILE, keys["fleet key"])]
        if h.name in routers:
            files.append((ROUTER_KEY_FILE, keys["router API key"]))
        if (h.name not in routers) if serving is None else (h.name in set(serving)):
            files.append((API_KEY_FILE, keys["API key"]))
        h.ssh("umask 077; " + "; ".join(f"printf '%s\\n' {key} > {path}"
                                        for path, key in files))
    return keys


def fleet_data(listed: dict, router: bool) -> dict:
    """A host's data in a fleet on the lab switch (``listed``: its ``sandbox status --json``
    entry): :func:`inventory_data`, its switch address as its fleet address and the fleet key;
    a serving host's server bound there behind its gate with the client key; a router host's
    router bound there with the router's client key (the keys as :func:`fleet_keys` wrote
    them)."""
    data = {**inventory_data(listed), "gpuhost_fleet_address": listed["switch_address"],
            "gpuhost_fleet_key_file": FLEET_KEY_FILE}
    if data.get("gpuhost_serving", True):
        data.update(gpuhost_server_host=listed["switch_address"],
                    gpuhost_api_key_file=API_KEY_FILE)
    if router:
        data.update(gpuhost_router_host=listed["switch_address"],
                    gpuhost_router_api_key_file=ROUTER_KEY_FILE)
    return data


def _first_deploy() -> None:
    first = deploy()
    assert first.returncode == 0, first.output[-6000:]


def status() -> list[Host]:
    listed = json.loads(sandbox("status", "--json").stdout)
    return [Host(h["name"], h["address"], h["ssh_key"]) for h in listed]


@dataclass
class Run:
    returncode: int
    output: str
    results: dict | None


def deploy(*extra: str, inventory: str = "inventory/sandbox.py",
           deploy_file: str = "deploy.py", yes: bool = True) -> Run:
    """Run the deploy (or bench.py) as a user would; with --json, also return pyinfra's run
    results. ``yes=False``: without ``-y`` and with no terminal (stdin /dev/null), as a
    command documented without it runs from a script."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    argv = [str(PYINFRA), *(["-y"] if yes else []), *extra, inventory, deploy_file]
    result = subprocess.run(
        argv, cwd=ROOT, text=True, capture_output=True, env=env, check=False,
        stdin=subprocess.DEVNULL,
    )
    GUARD.observe(" ".join(["pyinfra", *argv[1:]]), result.stdout + result.stderr)
    payload = None
    if "--json" in extra:
        try:
            payload = json.loads(result.stdout)
        except ValueError:
            payload = None
    return Run(result.returncode, result.stdout + result.stderr, payload)
