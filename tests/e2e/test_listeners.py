"""Ports and addresses checked against the hosts while planning (issue #30 item 5), on two bare
sandbox hosts (gpu1 serving, gpu2 a CPU-only router host): gpuhost_router_port=22, sshd's,
is refused in --dry and in a real run before any change, naming the key, the value and the
listener; a gpuhost_router_host or gpuhost_fleet_address that is no address of its host is
refused too (an address of no host of the lab's switch). Checked over ssh (what is on the host), not through pyinfra."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def hosts():
    found = lab.up(hosts=2, scenario="reference-lab", host_scenarios={"gpu2": "cpu-only"})
    # the fleet's planes (docs/security.md): the fleet key on both, the client keys
    lab.fleet_keys(found, routers=["gpu2"])
    yield found
    lab.sandbox("down", check=False)


def switch(name: str) -> str:
    return next(h["switch_address"] for h in json.loads(lab.sandbox("status", "--json").stdout)
                if h["name"] == name)


KEY_FILE = lab.API_KEY_FILE
FLEET_KEY_FILE = lab.FLEET_KEY_FILE
ROUTER_KEY_FILE = lab.ROUTER_KEY_FILE


def deploy_with(tmp_path: Path, *extra: str, gpu1: dict | None = None,
                gpu2: dict | None = None) -> lab.Run:
    """A valid fleet: gpu1's server behind its gate on its switch address (the router reaches
    it there), gpu2's router on its loopback; ``gpu1``/``gpu2`` override their host data."""
    entries = []
    for h in json.loads(lab.sandbox("status", "--json").stdout):
        data = lab.inventory_data(h)
        data["gpuhost_fleet_address"] = h["switch_address"]
        data["gpuhost_fleet_key_file"] = FLEET_KEY_FILE
        if h["name"] == "gpu2":
            data["gpuhost_router_api_key_file"] = ROUTER_KEY_FILE
        if h["name"] == "gpu1":
            data.update(gpuhost_server_host=h["switch_address"], gpuhost_api_key_file=KEY_FILE)
        data.update((gpu1 if h["name"] == "gpu1" else gpu2) or {})
        entries.append((h["name"], data))
    path = tmp_path / f"inventory{time.monotonic_ns()}.py"
    path.write_text("import json\nsandbox = [tuple(e) for e in json.loads("
                    f"{json.dumps(json.dumps(entries))})]\ngpuhost_router = ['gpu2']\n")
    return lab.deploy(*extra, inventory=str(path))


def untouched(host: lab.Host) -> bool:
    return host.ssh("test -e /opt/gpuhost && echo made || echo none").strip() == "none"


def test_a_router_port_sshd_listens_on_is_refused_before_any_change(hosts, tmp_path):
    gpu1, gpu2 = hosts
    said = ("Router: refused: gpuhost_router_port = 22 is not allowed: a port no other unit "
            "listens on (ssh.service listens on it)")
    dry = deploy_with(tmp_path, "--dry", "--limit", "gpu2", gpu2={"gpuhost_router_port": 22})
    assert dry.returncode != 0, dry.output[-6000:]
    assert said in dry.output and "\nTraceback" not in dry.output, dry.output[-6000:]
    run = deploy_with(tmp_path, "--limit", "gpu2", gpu2={"gpuhost_router_port": 22})
    assert run.returncode != 0, run.output[-6000:]
    assert said in run.output and "\nTraceback" not in run.output, run.output[-6000:]
    assert untouched(gpu2)
    assert gpu2.ssh("systemctl is-active ssh.service").strip() == "active"


def test_a_router_host_that_is_another_hosts_address_is_refused(hosts, tmp_path):
    gpu1, gpu2 = hosts
    other = switch("gpu1")
    dry = deploy_with(tmp_path, "--dry", "--limit", "gpu2", gpu2={
        "gpuhost_router_host": other, "gpuhost_router_api_key_file": "/root/router-api.key"})
    assert dry.returncode != 0, dry.output[-6000:]
    assert (f"Router: refused: gpuhost_router_host = '{other}' is not allowed: it is not an "
            "address of this host (the router binds it)") in dry.output, dry.output[-6000:]
    assert switch("gpu2") in dry.output  # the host's own, offered instead
    assert untouched(gpu2)


def test_a_fleet_address_that_is_another_hosts_address_is_refused(hosts, tmp_path):
    gpu1, gpu2 = hosts
    # on the lab switch's network, and no host's
    other = switch("gpu1").rsplit(".", 1)[0] + ".9"
    dry = deploy_with(tmp_path, "--dry", "--limit", "gpu1", gpu1={
        "gpuhost_fleet_address": other, "gpuhost_server_host": "0.0.0.0"})
    assert dry.returncode != 0, dry.output[-6000:]
    assert (f"gpuhost_fleet_address = '{other}' is not allowed: it is not an address of this "
            "host (the router reaches the server there)") in dry.output, dry.output[-6000:]
    assert untouched(gpu1)


def test_the_shipped_inventory_plans_a_fleet_on_a_lab_with_a_router_host(hosts):
    """On a lab with a CPU-only host, `sandbox up` made the fleet's keys (sandbox/fleet_keys.py)
    and inventory/sandbox.py names them: bin/quickstart --fleet's deploy plans with no refusal
    (it was refused: the server on 127.0.0.1, no router key file), the server behind its gate on
    the switch, and nothing is changed by the --dry."""
    gpu1, gpu2 = hosts
    for host, files in ((gpu1, "/root/fleet.key /root/sglang-api.key"),
                        (gpu2, "/root/fleet.key /root/router-api.key")):
        assert host.ssh(f"stat -c '%a %U' {files}").split() == ["600", "root"] * 2, host.name
    dry = lab.deploy("--dry")
    assert dry.returncode == 0, dry.output[-6000:]
    assert "refused" not in dry.output, dry.output[-6000:]
    for name, bind in (("gpu1", "gpuhost_server_host"), ("gpu2", "gpuhost_router_host")):
        assert f"[{name}] host data: {bind} binds wider than the loopback" in dry.output, name
    assert "[gpu2] " in dry.output and "serves no model (gpuhost_serving = False): the router " \
        "only" in dry.output
    assert untouched(gpu1) and untouched(gpu2)
