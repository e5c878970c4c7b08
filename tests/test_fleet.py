"""The fleet's planning (operations/stages/fleet.py), the router's unit and gate
(operations/stages/router.py, templates/sglang-router*.service.j2), and the API key gate's trusted
peers."""

from __future__ import annotations

import configparser
import dataclasses
import ipaddress
import json
from pathlib import Path

import jinja2
import pytest

from operations.plans.lock import read_lock
from operations.plans.settings import SettingsError, from_host_data
from operations.stages import fleet, router
from operations.stages import gate as gate_ops

ROOT = Path(__file__).resolve().parents[1]


def settings(name: str, **data):
    """A host's settings; every host holds the fleet key and a client key file unless told
    (a fleet needs both: operations/stages/fleet.py)."""
    data = {"fleet_key_file": "/root/fleet.key", "router_api_key_file": "/root/router.key",
            **data}
    return from_host_data(name, {f"gpuhost_{k}": v for k, v in data.items()})


def gated(address: str, **extra):
    return settings("h", server_host=address, fleet_address=address,
                    api_key_file="/root/key", **extra)


def render(template: str, context: dict) -> str:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "templates"))
    return env.get_template(template).render(**context)


def test_router_on_a_serving_host_routes_to_every_host_at_its_fleet_address():
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2"), "gpu3": gated("10.0.0.3")}
    hosts = [("gpu1", ["sandbox", "gpuhost_router"]), ("gpu2", ["sandbox"]),
             ("gpu3", ["sandbox"])]
    planned = fleet.plan(hosts, s)
    assert planned.routers == ("gpu1",)
    # its own server behind the gate on the loopback, the others at their fleet address
    assert [w.url for w in planned.workers_of("gpu1")] == [
        "http://127.0.0.1:30000", "http://10.0.0.2:8000", "http://10.0.0.3:8000"]
    # no address is trusted: the router sends the fleet key (issue 29, finding 2)
    assert all(p.api_gate_trusted_peers == () for p in s.values())
    # behind the gates, the loopback ports admit root only
    assert [fleet.guarded_ports(planned, n, s[n]) for n in s] == [
        (30000, 30100), (30000,), (30000,)]


def test_a_node_group_is_one_worker_its_rank_0():
    """Ranks >= 1 of a gpuhost_nodes group serve no model (sglang's dummy /health only)."""
    group = ("gpu2", "gpu3")
    def node(address):
        return dataclasses.replace(gated(address), nodes=group)

    s = {"gpu1": gated("10.0.0.1"), "gpu2": node("10.0.0.2"),
         "gpu3": node("10.0.0.3")}
    hosts = [("gpu1", ["gpuhost_router"]), ("gpu2", ["pair"]), ("gpu3", ["pair"])]
    assert [w.name for w in fleet.plan(hosts, s).workers_of("gpu1")] == ["gpu1", "gpu2"]


def test_no_router_group_is_no_fleet():
    s = {"gpu1": gated("10.0.0.1")}
    planned = fleet.plan([("gpu1", ["sandbox"])], s)
    assert planned.routers == ()
    assert fleet.guarded_ports(planned, "gpu1", s["gpu1"]) == (30000,)
    loop = settings("gpu1")
    # a server on the loopback keeps no key: its port is root's too (a local user is a stranger)
    assert fleet.guarded_ports(fleet.plan([("gpu1", [])], {"gpu1": loop}), "gpu1", loop) == (8000,)
    assert fleet.admitted_users(loop) == {}
    named = dataclasses.replace(loop, server_local_users=("alice",))
    assert fleet.admitted_users(named) == {8000: ("alice",)}


def test_the_loopback_guard_admits_each_service_user_to_the_ports_it_reaches():
    """The gates' workers to the ports behind them, the router's smg to its own host's server,
    the server to its own port (sglang's warmup asks itself: fleet.service_users); a CPU-only
    router host runs no server, whose user it then does not admit."""
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2")}
    planned = fleet.plan([("gpu1", ["gpuhost_router"]), ("gpu2", [])], s)
    assert fleet.service_users(planned, "gpu1", s["gpu1"]) == {
        30000: ("gpuhost-gate", "gpuhost-router", "gpuhost-server"),
        30100: ("gpuhost-gate",)}
    assert fleet.service_users(planned, "gpu2", s["gpu2"]) == {
        30000: ("gpuhost-gate", "gpuhost-server")}
    loop = settings("gpu1")  # a server on the loopback: its own port, no gate
    assert fleet.service_users(fleet.plan([("gpu1", [])], {"gpu1": loop}), "gpu1", loop) == {
        8000: ("gpuhost-server",)}
    alone = {"router": cpu_router("10.0.0.9"), "gpu2": s["gpu2"]}
    planned = fleet.plan([("router", ["gpuhost_router"]), ("gpu2", [])], alone)
    assert fleet.service_users(planned, "router", alone["router"]) == {
        30100: ("gpuhost-gate",)}


def cpu_router(address: str, **extra):
    """A router host that serves no model: the router behind its gate, no GPU keys of its own."""
    return settings("router", serving=False, fleet_address=address, router_host=address,
                    router_api_key_file="/root/router.key", **extra)


def test_a_cpu_only_router_host_is_no_worker_and_routes_to_every_serving_host():
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2"), "gpu3": gated("10.0.0.3"),
         "router": cpu_router("10.0.0.9")}
    hosts = [("gpu1", ["lab"]), ("gpu2", ["lab"]), ("gpu3", ["lab"]),
             ("router", ["lab", "gpuhost_router"])]
    planned = fleet.plan(hosts, s)
    assert planned.routers == ("router",)
    assert [(w.name, w.url) for w in planned.workers_of("router")] == [
        ("gpu1", "http://10.0.0.1:8000"), ("gpu2", "http://10.0.0.2:8000"),
        ("gpu3", "http://10.0.0.3:8000")]
    assert fleet.guarded_ports(planned, "router", s["router"]) == (30100,)


@pytest.mark.parametrize("where, key, words", [
    ("router", "router_api_key_file", "the client key"),
    ("router", "fleet_key_file", "admit the router by the fleet key"),
    ("gpu2", "fleet_key_file", "reaches this host's gate with the fleet key"),
])
def test_a_fleet_without_its_keys_is_refused(where, key, words):
    """No plane is open: the router needs its client key, and the router and every worker it
    reaches through a gate the fleet key (the router is admitted by a credential, never by its
    address alone)."""
    s = {"gpu1": gated("10.0.0.1"), "gpu2": gated("10.0.0.2"), "router": cpu_router("10.0.0.9")}
    s[where] = dataclasses.replace(s[where], **{key: None})
    with pytest.raises(fleet.FleetError) as caught:
        fleet.plan([("gpu1", []), ("gpu2", []), ("router", ["gpuhost_router"])], s)
    (problem,) = caught.value.problems
    assert problem.startswith(f"host {where}: gpuhost_{key} = None is not allowed") \
        and words in problem, problem


def test_a_host_that_serves_no_model_outside_the_router_group_is_refused():
    s = {"gpu1": gated("10.0.0.1"), "cpu": cpu_router("10.0.0.9")}
    with pytest.raises(fleet.FleetError) as caught:
        fleet.plan([("gpu1", ["lab"]), ("cpu", ["lab"])], s)
    assert caught.value.problems == [
        "host cpu: gpuhost_serving = False is not allowed outside the gpuhost_router group: "
        "True, or put cpu in gpuhost_router (a host that serves no model runs the fleet's "
        "router)"]


def test_a_router_with_no_serving_host_is_refused():
    s = {"cpu": cpu_router("10.0.0.9")}
    with pytest.raises(fleet.FleetError, match="host cpu: the router has no worker"):
        fleet.plan([("cpu", ["gpuhost_router"])], s)


def test_a_host_that_serves_no_model_skips_the_gpu_and_server_checks():
    """GPU, driver, server and ML venv keys have no effect there (group data may set them for
    every host): values a serving host is refused for are let through."""
    s = cpu_router("10.0.0.9", gpu_count=8, tensor_parallel_size=3, driver_flavour="proprietary",
                   server_host="10.0.0.9", router_port=8000)
    assert not s.serving and s.tensor_parallel_size == 3
    with pytest.raises(SettingsError, match="tensor_parallel_size = 3"):
        settings("gpu1", tensor_parallel_size=3)
    # the router's own rules still hold
    with pytest.raises(SettingsError, match="gpuhost_router_host = '10.0.0.9' is not allowed"):
        settings("cpu", serving=False, router_host="10.0.0.9", router_api_key_file=None)


@pytest.mark.parametrize(("data", "message"), [
    ({"serving": "no"}, "host cpu: gpuhost_serving = 'no' is not allowed: True or False."),
    ({"serving": False, "nodes": ["cpu", "gpu2"]},
     "host cpu: gpuhost_serving = False is not allowed: True on a host of a node group "
     "(gpuhost_nodes = ['cpu', 'gpu2']): each node serves its ranks of the group's model."),
])
def test_bad_serving_data_is_refused_naming_key_and_value(data, message):
    with pytest.raises(SettingsError) as caught:
        settings("cpu", **data)
    assert message in caught.value.problems


def test_the_router_host_may_reach_its_own_loopback_server():
    s = {"gpu1": settings("gpu1")}
    planned = fleet.plan([("gpu1", ["gpuhost_router"])], s)
    assert [w.url for w in planned.workers_of("gpu1")] == ["http://127.0.0.1:8000"]


def test_a_worker_the_router_cannot_reach_is_refused_naming_the_key():
    s = {"gpu1": gated("10.0.0.1"), "gpu2": settings("gpu2"),
         "gpu3": settings("gpu3", server_host="0.0.0.0", api_key_file="/root/k",
                          fleet_address="10.0.0.3"),
         "gpu4": settings("gpu4", server_host="10.0.0.9", api_key_file="/root/k",
                          fleet_address="10.0.0.4")}
    hosts = [("gpu1", ["gpuhost_router"]), ("gpu2", []), ("gpu3", []), ("gpu4", [])]
    with pytest.raises(fleet.FleetError) as err:
        fleet.plan(hosts, s)
    assert err.value.problems == [
        "host gpu2: gpuhost_fleet_address = None is not allowed: the address where the router "
        "on gpu1 reaches this host's server (the gpuhost_router group routes to every serving "
        "host)",
        "host gpu4: gpuhost_server_host = '10.0.0.9' is not allowed: the router on gpu1 "
        "reaches the server at gpuhost_fleet_address '10.0.0.4': bind that address or 0.0.0.0 "
        "(with gpuhost_api_key_file)",
    ]


def test_a_router_without_a_fleet_address_is_planned_its_address_being_no_credential():
    """Main before issue 29 refused it: the workers' gates trusted the router's address. Now
    the router is admitted by the fleet key it sends."""
    s = {"gpu1": settings("gpu1"), "gpu2": gated("10.0.0.2")}
    planned = fleet.plan([("gpu1", ["gpuhost_router"]), ("gpu2", [])], s)
    assert [w.url for w in planned.workers_of("gpu1")] == ["http://127.0.0.1:8000",
                                                           "http://10.0.0.2:8000"]
    assert fleet.guarded_ports(planned, "gpu1", s["gpu1"]) == (8000, 30100)


@pytest.mark.parametrize("data, key", [
    ({"router_host": "0.0.0.0", "router_api_key_file": None}, "gpuhost_router_host"),
    ({"router_policy": "fastest"}, "gpuhost_router_policy"),
    ({"router_port": 8000}, "gpuhost_router_port"),
    ({"router_backend_port": 30000}, "gpuhost_router_backend_port"),
    ({"router_host": "10.0.0.1", "router_api_key_file": "/root/k", "router_backend_port": 8100},
     "gpuhost_router_backend_port"),
    ({"router_health_check_interval_secs": 0}, "gpuhost_router_health_check_interval_secs"),
])
def test_bad_router_data_is_refused_naming_key_and_value(data, key):
    with pytest.raises(SettingsError) as err:
        settings("h", **data)
    value = {f"gpuhost_{k}": v for k, v in data.items()}[key]
    assert f"{key} = {value!r} is not allowed" in str(err.value)


def test_default_policy_is_cache_aware_and_policies_are_smgs():
    assert settings("h").router_policy == "cache_aware"
    help_choices = {"random", "round_robin", "passthrough", "cache_aware", "power_of_two",
                    "least_load", "manual", "consistent_hashing", "prefix_hash"}
    from operations.plans.settings import ROUTER_POLICIES

    assert set(ROUTER_POLICIES) == help_choices  # smg 1.13.0 launch --help's --policy


def test_router_lock_pins_smg_with_hashes():
    lock = read_lock(ROOT / "locks" / "router.txt")
    assert lock.get("smg").version == "1.13.0"
    assert all(p.hashes for p in lock.pins)


def unit(text: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.read_string(text)
    return parser


def test_loopback_router_has_its_gate_too_and_its_unit_names_no_worker_and_no_key():
    """Keys off the command line (router_launch.py reads them), no worker on it (they join
    through the control plane: a change of the fleet restarts nothing). A router on the
    loopback has its gate too: smg forwards each request with the Authorization it came with,
    which must be the fleet key the workers admit, never a client's."""
    s = settings("h")
    text = render("sglang-router.service.j2", router.unit_context(s))
    service = unit(text)["Service"]
    start = service["ExecStart"].split()
    assert start[:2] == ["/opt/gpuhost/router-venv/bin/python",
                         "/opt/gpuhost/lib/router_launch.py"]
    args = " ".join(start)
    # the key files reach smg's user as the unit's credentials (%d), as root reads them
    assert ("--api-key-file %d/api-key --control-key-file %d/control-key -- --host 127.0.0.1 "
            "--port 30100 --policy cache_aware") in args
    assert [line for line in text.splitlines() if line.startswith("LoadCredential=")] == [
        "LoadCredential=api-key:/root/fleet.key",
        "LoadCredential=control-key:/etc/gpuhost/router-control.key"]
    assert service["User"] == "gpuhost-router"
    assert "--worker-urls" not in args and "--api-key " not in args
    assert "--prometheus-host 127.0.0.1" in args  # smg's default is every interface
    assert "--health-check-interval-secs 10" in args
    assert service["ExecStartPost"].split()[1:] == [
        "/opt/gpuhost/lib/router_workers.py", "--router", "http://127.0.0.1:30100",
        "--control-key-file", "/etc/gpuhost/router-control.key", "--worker-key-file",
        "/root/fleet.key", "--start", "--members", "/etc/gpuhost/router-workers.json",
        "--timeout", "60"]
    assert "Wants=sglang-router-gate.service" in text
    gate = unit(render("gate.service.j2", router.gate_context(s)))
    assert "(127.0.0.1:8100 -> http://127.0.0.1:30100)" in gate["Unit"]["Description"]
    conf = render("gate-nginx.conf.j2", gate_ops.conf_context(router.router_gate(s)))
    assert "listen 127.0.0.1:8100;" in conf


def test_public_router_binds_the_loopback_behind_its_gate_and_the_key_stays_in_its_file():
    s = settings("h", router_host="10.0.0.1", router_api_key_file="/root/router.key",
                 fleet_key_file=None)
    text = render("sglang-router.service.j2", router.unit_context(s))
    assert "--host 127.0.0.1 --port 30100" in text and "/root/router.key" not in text
    # no fleet key (no gated worker elsewhere): a backend key of its own, made on the host
    assert "LoadCredential=api-key:/etc/gpuhost/router-backend.key" in text
    assert "Wants=sglang-router-gate.service" in text
    gate = render("gate.service.j2", router.gate_context(s))
    assert ("gate_keys.py --out /etc/gpuhost/nginx/sglang-router-gate.keys --key-file "
            "/root/router.key --backend-key-file /etc/gpuhost/router-backend.key" in gate)
    assert "/root/router.key" not in unit(gate)["Service"]["ExecStart"]
    conf = render("gate-nginx.conf.j2", gate_ops.conf_context(router.router_gate(s)))
    assert "listen 10.0.0.1:8100;" in conf and "proxy_pass http://127.0.0.1:30100;" in conf
    # the allow-list: every other path is 404 (its map's default), /workers first
    assert "default deny;" in conf
    assert '"~^/v1/chat/completions(\\?|$)" key;' in conf
    assert "worker" not in conf.split("map $request_uri")[1].split("}")[0]
    assert router.own_url(s) == "http://127.0.0.1:30100"


def test_a_workers_gate_admits_the_fleet_key_beside_its_own():
    from operations.stages.server_unit import gate_context, worker_gate

    start = render("gate.service.j2", gate_context(gated("10.0.0.2")))
    assert ("gate_keys.py --out /etc/gpuhost/nginx/sglang-gate.keys --key-file /root/key "
            "--key-file /root/fleet.key" in start)
    path = unit(render("gate-keys.path.j2", gate_ops.path_context(
        worker_gate(gated("10.0.0.2")), str)))
    assert path["Path"]["PathChanged"] == "/root/fleet.key"  # the last of two (configparser)
    assert path["Path"]["Unit"] == "sglang-gate-keys.service"


def test_server_gate_unit_trusts_the_router_peers():
    from operations.stages.server_unit import gate_context

    from operations.stages.server_unit import worker_gate

    s = dataclasses.replace(gated("10.0.0.2"), api_gate_trusted_peers=("10.0.0.1",))
    conf = render("gate-nginx.conf.j2", gate_ops.conf_context(worker_gate(s)))
    geo = conf.split("geo $gpuhost_trusted {")[1].split("}")[0].split()
    assert geo == ["default", "0;", "10.0.0.1", "1;"]
    plain = render("gate-nginx.conf.j2", gate_ops.conf_context(worker_gate(gated("10.0.0.2"))))
    assert plain.split("geo $gpuhost_trusted {")[1].split("}")[0].split() == ["default", "0;"]



def test_router_check_describes_what_is_missing():
    from operations.files import router_workers

    seen = {"listed": {"a": True, "b": False}, "missing": ["c"], "unhealthy": ["b"], "error": ""}
    assert router_workers.describe(seen, ["a", "b", "c"]) == (
        "1 of 3 configured worker(s) listed and healthy (a); not listed: c; unhealthy: b")
    assert router_workers.describe({"listed": {}, "missing": [], "unhealthy": [],
                                    "error": "URLError: refused"}).startswith("no worker list")


def test_the_router_check_does_not_wait_for_workers_whose_host_failed(monkeypatch):
    """A host that failed in this run (a failed roll) stays out of the router: its worker is
    not waited for, the others are."""
    from types import SimpleNamespace

    from operations.runtime import remote

    ran = []

    def shell(host, command, **kwargs):
        ran.append(str(command))
        return True, SimpleNamespace(stdout_lines=["all 1 worker(s) healthy"], stderr_lines=[])

    monkeypatch.setattr(remote, "shell", shell)
    state = SimpleNamespace(failed_hosts=[SimpleNamespace(name="gpu2")])
    host = SimpleNamespace(name="gpu1", print_prefix="[gpu1] ")
    workers = (("gpu1", "http://127.0.0.1:30000"), ("gpu2", "http://10.0.0.2:8000"))
    assert router._workers_listed(state, host, "http://127.0.0.1:30100", workers, 60,
                                  "/root/fleet.key")
    assert len(ran) == 1 and ran[0].endswith(
        "--control-key-file /etc/gpuhost/router-control.key --worker-key-file /root/fleet.key "
        "--timeout 60 --register --remove-others --save /etc/gpuhost/router-workers.json "
        "--roll-state /etc/gpuhost/roll-state.json --name gpu1=http://127.0.0.1:30000 "
        "--name gpu2=http://10.0.0.2:8000 --keep http://10.0.0.2:8000 "
        "http://127.0.0.1:30000"), ran
    ran.clear()
    state.failed_hosts = [SimpleNamespace(name="gpu1"), SimpleNamespace(name="gpu2")]
    assert router._workers_listed(state, host, "http://127.0.0.1:30100", workers, 60, None)
    assert ran == []


CONTROL_KEY = "control-key-for-the-test-0123456789"
FLEET_KEY = "fleet-key-for-the-test-0123456789"


@pytest.fixture
def keys(tmp_path):
    made = {}
    for name, value in (("control", CONTROL_KEY), ("fleet", FLEET_KEY)):
        made[name] = tmp_path / f"{name}.key"
        made[name].write_text(value + "\n")
        made[name].chmod(0o600)
    return made


def test_the_router_check_registers_a_worker_the_router_lost(monkeypatch, capsys, keys):
    """smg registers its --worker-urls at its start only: a worker it lost (down past its
    startup timeout, taken out) is registered again, then waited for until healthy."""
    import threading
    from http.server import ThreadingHTTPServer

    from operations.files import router_workers
    from tests.test_roll import FakeRouter

    FakeRouter.workers = {"http://127.0.0.1:30000": {"id": "w1", "url": "http://127.0.0.1:30000",
                                                     "is_healthy": True, "status": "ready"}}
    FakeRouter.auth, FakeRouter.added = set(), []
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeRouter)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        argv = ["x", "--router", url, "--timeout", "5", "--interval", "0.01",
                "--control-key-file", str(keys["control"]), "--worker-key-file",
                str(keys["fleet"]), "http://127.0.0.1:30000", "http://10.0.0.2:8000"]
        monkeypatch.setattr("sys.argv", argv)
        assert router_workers.main() == 1  # without --register: waited for in vain
        assert "not listed: http://10.0.0.2:8000" in capsys.readouterr().err
        monkeypatch.setattr("sys.argv", [*argv[:9], "--register", *argv[9:]])
        assert router_workers.main() == 0
        out = capsys.readouterr().out
        assert "registering http://10.0.0.2:8000 again (202)" in out, out
        assert FakeRouter.workers["http://10.0.0.2:8000"]["is_healthy"]
        # added with the fleet key, the key the router then sends it
        assert FakeRouter.added[-1] == {"url": "http://10.0.0.2:8000", "api_key": FLEET_KEY}
        assert FakeRouter.auth == {f"Bearer {CONTROL_KEY}"}
        # a worker gpuhost did not configure is removed, and said; a failed host's entry kept
        FakeRouter.workers["http://10.0.0.66:8999"] = {
            "id": "evil", "url": "http://10.0.0.66:8999", "is_healthy": True, "status": "ready"}
        FakeRouter.workers["http://10.0.0.3:8000"] = {
            "id": "w3", "url": "http://10.0.0.3:8000", "is_healthy": True, "status": "ready"}
        saved = keys["control"].parent / "workers.json"
        monkeypatch.setattr("sys.argv", [*argv[:9], "--remove-others", "--keep",
                                         "http://10.0.0.3:22", "--save", str(saved), *argv[9:]])
        assert router_workers.main() == 0
        out = capsys.readouterr().out
        assert "removed http://10.0.0.66:8999, which gpuhost did not configure" in out, out
        # the verified list, the refused host's last good entry kept (issue 30 finding 4)
        assert json.loads(saved.read_text()) == [
            "http://10.0.0.2:8000", "http://10.0.0.3:8000", "http://127.0.0.1:30000"]
        assert FakeRouter.workers["http://10.0.0.66:8999"]["status"] == "draining"
        assert FakeRouter.workers["http://10.0.0.3:8000"]["status"] == "ready"
    finally:
        server.shutdown()


@pytest.mark.parametrize(("look", "checked"), [
    ({"listed": {"http://127.0.0.1:30000": True}, "missing": ["http://10.0.0.2:8000"],
      "unhealthy": [], "error": ""}, True),
    ({"listed": {"http://127.0.0.1:30000": True, "http://10.0.0.2:8000": False},
      "missing": [], "unhealthy": ["http://10.0.0.2:8000"], "error": ""}, True),
    ({"listed": {"http://127.0.0.1:30000": True, "http://10.0.0.2:8000": True}, "missing": [],
      "unhealthy": [], "error": ""}, False),
])
def test_the_router_is_looked_at_again_after_the_runs_restarts(monkeypatch, look, checked):
    """Planning found the router well; a worker that rebooted (or a router host that did) in
    this run is seen when the operation runs: checked then, and only then (a no-op run reports
    no change)."""
    import json
    from types import SimpleNamespace

    from operations.runtime import remote

    workers = (("gpu1", "http://127.0.0.1:30000"), ("gpu2", "http://10.0.0.2:8000"))
    well = {"listed": dict.fromkeys([u for _, u in workers], True), "missing": [],
            "unhealthy": [], "error": ""}
    noops = []
    monkeypatch.setattr(router, "host", SimpleNamespace(get_fact=lambda *a, **k: well,
                                                        noop=noops.append))
    monkeypatch.setattr(router, "state", SimpleNamespace(is_executing=False, failed_hosts=[]))
    monkeypatch.setattr(remote, "shell", lambda host, command, **kw: (
        True, SimpleNamespace(stdout_lines=[json.dumps(look)], stderr_lines=[])))
    planned = list(router.workers_registered._inner(
        router="http://127.0.0.1:30100", workers=workers, timeout=60, restarted=False))
    assert planned == [] and noops == ["the router lists 2 worker(s), each healthy and configured"]
    router.state.is_executing = True
    ran = list(router.workers_registered._inner(
        router="http://127.0.0.1:30100", workers=workers, timeout=60, restarted=False))
    assert len(ran) == (1 if checked else 0), ran
    if checked:
        assert ran[0].function is router._workers_listed


@pytest.mark.parametrize("address", ["127.0.0.1", "::1", "::ffff:127.0.0.1", "0.0.0.0", "::",
                                     "224.0.0.1", "ff02::1", "fe80::1"])
def test_a_fleet_address_no_other_host_reaches_it_at_is_refused(address):
    """A router on another host would route to itself (loopback, 0.0.0.0), and every worker's
    gate would admit its own host's processes without the key (the router's address, trusted)."""
    with pytest.raises(SettingsError) as err:
        settings("gpu2", fleet_address=address)
    assert str(err.value).startswith(f"host gpu2: gpuhost_fleet_address = {address!r} is not "
                                     "allowed: this host's IP address on the network")
    assert "not loopback, 0.0.0.0, ::, multicast or IPv6 link-local" in str(err.value)


@pytest.mark.parametrize("address", ["10.0.0.2", "169.254.0.2", "fd00::2", "::ffff:10.0.0.2"])
def test_a_fleet_address_of_the_fleet_network_is_taken(address):
    assert settings("gpu2", fleet_address=address).fleet_address == address


@pytest.mark.parametrize("first, second", [("10.0.0.1", "10.0.0.1"), ("fd00::1", "fd00:0::1"),
                                           ("10.0.0.1", "::ffff:10.0.0.1")])
def test_one_fleet_address_for_two_hosts_is_refused(first, second):
    s = {"gpu1": gated(first), "gpu2": gated(second), "gpu3": gated("10.0.0.3")}
    hosts = [("gpu1", ["gpuhost_router"]), ("gpu2", []), ("gpu3", [])]
    with pytest.raises(fleet.FleetError) as err:
        fleet.plan(hosts, s)
    assert err.value.problems == [f"host gpu2: gpuhost_fleet_address = {second!r} is not "
                                  "allowed: host gpu1 has it too; each host's own address"]


@pytest.mark.parametrize("peers", [["127.0.0.1"], ["10.0.0.1", "::1"], ["0.0.0.0"]])
def test_a_trusted_peer_that_is_this_host_or_nobody_is_refused(peers):
    with pytest.raises(SettingsError) as err:
        settings("gpu2", api_gate_trusted_peers=peers)
    assert str(err.value).startswith(f"host gpu2: gpuhost_api_gate_trusted_peers = {peers!r} is "
                                     "not allowed: a list of other hosts' IP addresses")


def test_a_server_bound_to_ipv4_only_is_refused_for_an_ipv6_fleet_address():
    v6 = settings("gpu2", fleet_address="fd00::2", server_host="0.0.0.0", api_key_file="/root/k")
    hosts = [("gpu1", ["gpuhost_router"]), ("gpu2", [])]
    with pytest.raises(fleet.FleetError) as err:
        fleet.plan(hosts, {"gpu1": gated("fd00::1"), "gpu2": v6})
    assert err.value.problems == [
        "host gpu2: gpuhost_server_host = '0.0.0.0' is not allowed: the router on gpu1 reaches "
        "the server at gpuhost_fleet_address 'fd00::2': bind that address or :: (with "
        "gpuhost_api_key_file)"]
    both = dataclasses.replace(v6, server_host="::")
    assert [w.url for w in fleet.plan(hosts, {"gpu1": gated("fd00::1"), "gpu2": both})
            .workers_of("gpu1")][1] == "http://[fd00::2]:8000"


@pytest.mark.parametrize("data, key", [
    ({"router_port": 29000}, "router_port"),
    ({"router_host": "10.0.0.1", "router_api_key_file": "/root/r.key",
      "router_backend_port": 29000}, "router_backend_port"),
])
def test_the_router_on_its_own_metrics_port_is_refused(data, key):
    with pytest.raises(SettingsError) as err:
        settings("gpu1", **data)
    assert str(err.value).startswith(
        f"host gpu1: gpuhost_{key} = 29000 is not allowed: a port other than 29000: the "
        "router's own metrics listen on 127.0.0.1:29000")


def test_a_public_router_may_listen_on_29000_of_its_own_address():
    s = settings("gpu1", router_host="10.0.0.1", router_api_key_file="/root/r.key",
                 router_port=29000)
    assert router.unit_context(s)["bind_port"] == s.router_backend_port != 29000


def test_a_router_hosts_server_on_the_routers_metrics_port_is_refused():
    s = {"gpu1": gated("10.0.0.1", server_backend_port=29000), "gpu2": gated("10.0.0.2")}
    hosts = [("gpu1", ["gpuhost_router"]), ("gpu2", [])]
    with pytest.raises(fleet.FleetError) as err:
        fleet.plan(hosts, s)
    assert err.value.problems == [
        "host gpu1: gpuhost_server_backend_port = 29000 is not allowed: a port other than "
        "29000, where the router on this host has its metrics (127.0.0.1)"]
    assert fleet.plan([("gpu1", []), ("gpu2", ["gpuhost_router"])], s).routers == ("gpu2",)


@pytest.mark.parametrize(("data", "words"), [
    ({"fleet_address": "10.0.0.2", "api_gate_trusted_peers": ["10.0.0.2"]},
     "10.0.0.2 is this host's own gpuhost_fleet_address"),
    ({"server_host": "10.0.0.7", "api_key_file": "/root/k",
      "api_gate_trusted_peers": ["::ffff:10.0.0.7"]},
     "::ffff:10.0.0.7 is this host's own gpuhost_server_host"),
    ({"api_gate_trusted_peers": ["10.0.0.1", "10.0.0.3", "10.0.0.1"]},
     "each address once (10.0.0.1 is listed twice)"),
    ({"api_gate_trusted_peers": ["10.0.0.1", "::ffff:10.0.0.1"]},
     "each address once (::ffff:10.0.0.1 is listed twice)"),
])
def test_a_hosts_own_address_or_a_repeated_one_is_no_trusted_peer(data, words):
    """Issue 29 finding 2: every local user of a host would pass its own gate from its own
    address; a repeated peer is a typo hiding another."""
    with pytest.raises(SettingsError) as err:
        settings("gpu2", **data)
    message = str(err.value)
    assert message.startswith("host gpu2: gpuhost_api_gate_trusted_peers = ") and words in message


def test_a_fleet_key_that_starts_with_a_dash_reaches_smg_as_its_api_key(monkeypatch):
    """smg parses with argparse (smg 1.13.0 router_args.py: ``--api-key``, type=str); a key
    from secrets.token_urlsafe may start with ``-``, which a separate argument would make a
    flag: the router then exited with 'argument --api-key: expected one argument'."""
    import argparse
    import importlib

    # on the host, router_launch.py's folder holds secret_file.py beside it
    monkeypatch.syspath_prepend(str(Path(router.__file__).parent.parent / "files"))
    router_launch = importlib.import_module("router_launch")
    parser = argparse.ArgumentParser()
    parser.add_argument("--api-key", type=str, default=None)
    parser.add_argument("--control-plane-api-keys", type=str, nargs="*", default=[])
    parser.add_argument("--host")
    key = "-QWfDk5t1u0Pz3nV4sW_yXq8rA2bC6dE9gH7jK1mN0o"
    ns = parser.parse_args(router_launch.router_args(key, "c0ntrol", ["--host", "127.0.0.1"]))
    assert ns.api_key == key and ns.host == "127.0.0.1"
    assert ns.control_plane_api_keys == [
        f"{router_launch.CONTROL_ID}:{router_launch.CONTROL_NAME}:admin:c0ntrol"]
