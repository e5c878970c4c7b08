"""The sandbox lab: its pure parts (no root needed) and one end-to-end boot (root, e2e).

The end-to-end checks go through plain ssh and the CLI, never through the lab's own helpers, so
the lab does not confirm itself.
"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from sandbox import __main__ as cli
from sandbox import fleet_keys, httpd, lab, network, procs, rootfs, services, supervisor
from sandbox.layout import LAB, HostSpec, host_from_name, host_specs

#: The documented layout (sandbox/README.md) of this process's lab: lab 0's names and subnets,
#: shifted under GPUHOST_SANDBOX_LAB=L (bin/test's second worker runs in lab 1) to
#: 10.(213+L).N, namespaces gpuhostL-gpuN, links ghLxN, state in /var/lib/gpuhost-sandbox-labL.
NET = f"10.{213 + LAB}"
NS = f"gpuhost{LAB or ''}-"
STATE = "/var/lib/gpuhost-sandbox" + (f"-lab{LAB}" if LAB else "")


def veth(n: int) -> str:
    return f"gh{LAB}x{n}" if LAB else f"gh{n}"

ROOT = Path(__file__).resolve().parents[2]


# --- addresses and names ---------------------------------------------------------------------
def test_host_n_gets_its_own_24():
    spec = HostSpec(7)
    assert (spec.name, spec.netns, spec.veth) == ("gpu7", f"{NS}gpu7", veth(7))
    assert (spec.gateway, spec.address, spec.subnet) == (
        f"{NET}.7.1",
        f"{NET}.7.2",
        f"{NET}.7.0/24",
    )
    assert spec.netns_path == Path(f"/run/netns/{NS}gpu7")
    assert spec.root == Path(f"{STATE}/hosts/gpu7/root")
    assert spec.console_log == Path(f"{STATE}/hosts/gpu7/console.log")
    assert spec.cuda_repo_url == f"http://{NET}.7.1:8080/compute/cuda/repos"
    assert spec.pip_index_url == f"http://{NET}.7.1:8080/simple/"
    assert spec.proxy_url == f"http://{NET}.7.1:8888"
def test_hosts_are_numbered_from_one():
    assert [s.name for s in host_specs(3)] == ["gpu1", "gpu2", "gpu3"]
    assert host_specs(254)[-1].address == f"{NET}.254.2"


@pytest.mark.parametrize("count", [0, 255, -1])
def test_host_count_outside_one_octet_is_refused(count):
    with pytest.raises(ValueError, match="1..254"):
        host_specs(count)


def test_names_round_trip():
    assert host_from_name("gpu12") == HostSpec(12)
    for bad in ("gpu", "gpux", "node1", "gpu0"):
        with pytest.raises(ValueError):
            host_from_name(bad)
def test_link_commands_put_gateway_outside_and_address_inside():
    cmds = [" ".join(c) for c in network.link_commands(HostSpec(3))]
    assert cmds[0] == f"netns add {NS}gpu3"
    assert f"link add {veth(3)} type veth peer name eth0 netns {NS}gpu3" in cmds
    assert f"addr add {NET}.3.1/24 dev {veth(3)}" in cmds
    assert f"-n {NS}gpu3 addr add {NET}.3.2/24 dev eth0" in cmds
    assert f"-n {NS}gpu3 link set lo up" in cmds
    assert cmds[-1] == f"-n {NS}gpu3 route add default via {NET}.3.1"


# --- nspawn, supervisor ----------------------------------------------------------------------
def test_switch_is_the_labs_own_0th_24_and_a_namespace_of_its_own():
    from sandbox import layout

    assert layout.SWITCH_NETNS == f"{NS}switch"
    assert layout.SWITCH_SUBNET == f"{NET}.0.0/24"
    assert [HostSpec(n).switch_address for n in (1, 7, 254)] == [
        f"{NET}.0.1", f"{NET}.0.7", f"{NET}.0.254"
    ]
    # no host link uses the 0th /24: a switch address is on no link's subnet
    links = {HostSpec(n).subnet for n in range(1, 255)}
    assert layout.SWITCH_SUBNET not in links


def test_switch_subnets_of_the_ten_labs_do_not_collide():
    # each lab's subnets, switch and links, lie in its own 10.(213+L).0.0/16
    code = "from sandbox import layout; print(layout.SWITCH_SUBNET, layout.SWITCH_NETNS)"
    seen = set()
    for lab_number in range(10):
        env = {**os.environ, "GPUHOST_SANDBOX_LAB": str(lab_number)}
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, text=True,
                             capture_output=True, check=True).stdout.split()
        assert out[0] == f"10.{213 + lab_number}.0.0/24"
        seen.add(tuple(out))
    assert len({s for s, _ in seen}) == len({n for _, n in seen}) == 10


def test_switch_has_a_bridge_no_address_and_forwarding_off():
    cmds = [" ".join(c) for c in network.switch_commands()]
    assert cmds[0] == f"netns add {NS}switch"
    sysctl = next(c for c in cmds if " sysctl " in c)
    assert cmds.index(sysctl) < cmds.index(f"-n {NS}switch link add br0 type bridge")
    for setting in ("net.ipv4.ip_forward=0", "net.ipv6.conf.all.forwarding=0",
                    "net.ipv6.conf.default.disable_ipv6=1"):
        assert setting in sysctl
    assert not [c for c in cmds if " addr " in c or " route " in c]


def test_port_commands_plug_eth1_into_the_bridge_from_the_hosts_namespace():
    cmds = [" ".join(c) for c in network.port_commands(HostSpec(3))]
    # made inside the host's namespace: nothing of it ever lands in this machine's
    assert cmds[0] == f"-n {NS}gpu3 link add eth1 type veth peer name port3 netns {NS}switch"
    assert f"-n {NS}switch link set port3 master br0" in cmds
    assert f"-n {NS}gpu3 addr add {NET}.0.3/24 dev eth1" in cmds
    assert not [c for c in cmds if " route " in c]  # no gateway on the switch
    assert all(c.startswith("-n ") for c in cmds)


def test_nspawn_command_line_is_the_readme_one():
    cmd = supervisor.nspawn_command(HostSpec(2))
    assert cmd[0] == "systemd-nspawn"
    for flag in (
        "--boot",
        "--register=no",
        "--keep-unit",
        "--resolv-conf=off",
        "--link-journal=no",
        "--capability=CAP_NET_ADMIN",  # its own firewall, as a VM's root (loopback guard)
    ):
        assert flag in cmd
    assert cmd[cmd.index("-D") + 1] == f"{STATE}/hosts/gpu2/root"
    assert cmd[cmd.index("-M") + 1] == "gpu2"
    assert f"--network-namespace-path=/run/netns/{NS}gpu2" in cmd
    # The shared .deb cache is seeded into each host, not bind-mounted (one apt lock per host).
    assert not any(arg.startswith("--bind") for arg in cmd)


@pytest.fixture
def restore_signals():
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    yield
    for s, handler in saved.items():
        signal.signal(s, handler)


def test_supervisor_boots_again_after_reboot_and_stops_otherwise(
    tmp_path, monkeypatch, restore_signals
):
    boots = tmp_path / "boots"
    script = f'echo x >> {boots}; [ "$(wc -l < {boots})" -lt 3 ] && exit 133; exit 0'
    monkeypatch.setattr(supervisor, "nspawn_command", lambda spec: ["sh", "-c", script])
    assert supervisor.supervise(HostSpec(1)) == 0
    assert len(boots.read_text().splitlines()) == 3


def test_supervisor_stops_on_sigterm(tmp_path, monkeypatch, restore_signals):
    # The stand-in for nspawn asks its parent, the supervisor, to stop, as `down` would.
    monkeypatch.setattr(
        supervisor, "nspawn_command", lambda spec: ["sh", "-c", "kill -TERM $PPID; exec sleep 30"]
    )
    started = time.monotonic()
    rc = supervisor.supervise(HostSpec(1))
    assert rc == -signal.SIGTERM
    assert time.monotonic() - started < 10


# --- root filesystem -------------------------------------------------------------------------


def test_image_is_minimal_cloud_vm():
    cmd = rootfs.mmdebstrap_command(Path("/tmp/x.tar"))
    assert cmd[:3] == ["mmdebstrap", "--variant=minbase", "--format=tar"]
    included = next(a for a in cmd if a.startswith("--include=")).split("=", 1)[1].split(",")
    assert {"systemd", "systemd-sysv", "dbus", "openssh-server", "python3"} <= set(included)
    for product_installs_these in ("curl", "python3-venv", "build-essential", "gcc"):
        assert product_installs_these not in included
def test_personalise_writes_what_a_host_needs(tmp_path):
    root = tmp_path / "root"
    (root / "etc/ssh").mkdir(parents=True)
    (root / "etc/ssh/ssh_host_ed25519_key").write_text("old image key")
    (root / f"home/{rootfs.OPERATOR}").mkdir(parents=True)
    (root / "etc/passwd").write_text(
        f"{rootfs.OPERATOR}:x:{os.getuid()}:{os.getgid()}::/home/{rootfs.OPERATOR}:/bin/bash\n")
    keys = rootfs.personalise(HostSpec(4), root, "ssh-ed25519 AAAA lab", '{"schema": 1}\n')
    assert (root / "etc/hostname").read_text() == "gpu4\n"
    assert "127.0.1.1\tgpu4" in (root / "etc/hosts").read_text()
    assert (root / "etc/machine-id").read_text() == ""
    assert (root / "root/.ssh/authorized_keys").read_text() == "ssh-ed25519 AAAA lab\n"
    assert (root / "root/.ssh/authorized_keys").stat().st_mode & 0o777 == 0o600
    operator_keys = root / f"home/{rootfs.OPERATOR}/.ssh/authorized_keys"
    assert operator_keys.read_text() == "ssh-ed25519 AAAA lab\n"
    assert operator_keys.stat().st_mode & 0o777 == 0o600
    assert (root / "etc/default/locale").read_text() == f"LANG={rootfs.LOCALE}\n"
    proxy = (root / "etc/apt/apt.conf.d/80sandbox-proxy").read_text()
    assert f'Acquire::http::Proxy "http://{NET}.4.1:8888";' in proxy
    assert f'Acquire::http::Proxy::{NET}.4.1 "DIRECT";' in proxy
    assert (root / "etc/gpuhost-sandbox/hardware.json").read_text() == '{"schema": 1}\n'
    assert (
        "PermitRootLogin prohibit-password"
        in (root / "etc/ssh/sshd_config.d/50-gpuhost-sandbox.conf").read_text()
    )
    assert os.readlink(root / "etc/systemd/system/systemd-networkd.service") == "/dev/null"
    assert (root / "etc/ssh/ssh_host_ed25519_key").read_text() != "old image key"
    # a hardened host's umask: login.defs, pam_umask in every session, the profile
    assert "UMASK\t\t077\n" in (root / "etc/login.defs").read_text()
    assert "USERGROUPS_ENAB no\n" in (root / "etc/login.defs").read_text()
    assert "pam_umask.so" in (root / "etc/pam.d/common-session").read_text()
    assert "umask 077" in (root / "etc/profile.d/50-gpuhost-sandbox-umask.sh").read_text()
    assert sorted(k.split()[0] for k in keys) == ["ecdsa-sha2-nistp256", "ssh-ed25519", "ssh-rsa"]


def test_apt_cache_is_seeded_per_host_and_harvested_back(tmp_path):
    pool, root = tmp_path / "pool", tmp_path / "root"
    pool.mkdir()
    (pool / "a_1_all.deb").write_text("a")
    assert rootfs.seed_apt_archives(root, pool) == 1
    archives = root / "var/cache/apt/archives"
    assert (archives / "partial").is_dir()
    assert os.path.samefile(archives / "a_1_all.deb", pool / "a_1_all.deb")
    (archives / "b_2_all.deb").write_text("b")
    assert rootfs.harvest_apt_archives(root, pool) == 1
    assert (pool / "b_2_all.deb").read_text() == "b"
    assert sorted(p.name for p in pool.iterdir()) == ["a_1_all.deb", "b_2_all.deb"]


def test_remove_tree_refuses_a_tree_with_mounts(tmp_path, monkeypatch):
    tree = tmp_path / "gpu1"
    (tree / "root").mkdir(parents=True)
    monkeypatch.setattr(rootfs, "mounts_below", lambda path: [str(tree / "root/proc")])
    with pytest.raises(rootfs.RootfsError, match="still mounted"):
        rootfs.remove_tree(tree)
    assert tree.exists()


# --- services, processes ---------------------------------------------------------------------
def test_proxy_listens_on_the_link_only_and_admits_its_subnet(tmp_path):
    conf = services.proxy_conf(HostSpec(5), tmp_path)
    assert f"Listen {NET}.5.1\n" in conf
    assert "Port 8888\n" in conf
    assert f"Allow {NET}.5.0/24\n" in conf
    assert f'PidFile "{tmp_path}/proxy-gpu5.pid"' in conf


def test_httpd_serves_files(tmp_path):
    (tmp_path / "simple").mkdir()
    (tmp_path / "simple/index.html").write_text("<a href='x/'>x</a>")
    handler = functools.partial(httpd.Handler, directory=str(tmp_path))
    server = httpd.Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/simple/"
        assert urllib.request.urlopen(url, timeout=5).read() == b"<a href='x/'>x</a>"
    finally:
        server.shutdown()
        server.server_close()


def test_a_recorded_process_is_recognised_by_pid_and_start_time():
    me = procs.identify(os.getpid())
    assert procs.alive(me)
    assert not procs.alive(procs.Proc(me.pid, me.start + 1))
    assert not procs.alive(None)
    child = subprocess.Popen(["true"])
    child.wait()
    assert not procs.alive(procs.Proc(child.pid, 0))


def test_status_without_a_lab_is_empty(tmp_path, monkeypatch):
    monkeypatch.setattr(lab, "STATE_FILE", tmp_path / "state.json")
    assert lab.status() == []


def test_up_and_down_refuse_non_root(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cli.main(["up"]) == 1
    assert cli.main(["down"]) == 1
    assert "needs root" in capsys.readouterr().err


def test_a_host_scenario_for_a_host_the_lab_lacks_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert cli.main(["up", "--hosts", "2", "--host-scenario", "gpu3=cpu-only"]) == 1
    assert "--host-scenario names gpu3, not a host of this lab (gpu1..gpu2)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["up", "--host-scenario", "cpu-only"])
    assert "must be HOST=SCENARIO, e.g. gpu4=cpu-only" in capsys.readouterr().err


def test_status_gives_each_host_its_own_scenario_and_a_gpu_less_one_serves_no_model(
        tmp_path, monkeypatch):
    state = {"version": lab.STATE_VERSION, "scenario": "reference-lab",
             "host_scenarios": {"gpu2": "cpu-only"}, "cuda_keyring_sha256": None,
             "hosts": [{"name": "gpu1", "supervisor": None}, {"name": "gpu2", "supervisor": None}]}
    monkeypatch.setattr(lab, "STATE_FILE", tmp_path / "state.json")
    lab.STATE_FILE.write_text(json.dumps(state))
    listed = {h["name"]: h for h in lab.status()}
    assert listed["gpu1"]["scenario"] == "reference-lab"
    assert listed["gpu1"]["host_data"]["gpuhost_gpu_count"] == 8
    assert listed["gpu2"]["scenario"] == "cpu-only"
    # a lab with a router host is a fleet: its keys' files and binds on the switch
    # (sandbox/fleet_keys.py)
    assert listed["gpu2"]["host_data"] == {"gpuhost_serving": False}
    assert listed["gpu2"]["fleet_data"] == fleet_keys.host_data(
        listed["gpu2"]["switch_address"], False)
    assert listed["gpu1"]["fleet_data"]["gpuhost_api_key_file"] == "/root/sglang-api.key"
    assert listed["gpu1"]["fleet_data"]["gpuhost_server_host"] == listed["gpu1"]["switch_address"]


# --- end to end ------------------------------------------------------------------------------


def _sandbox(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [sys.executable, "-m", "sandbox", *args],
        cwd=ROOT,
        text=True,
        capture_output=True,
        check=False,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"sandbox {' '.join(args)} exited {proc.returncode}:\n{proc.stderr}")
    return proc


def _ssh(host: dict, command: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ssh", "-i", host["ssh_key"], "-o", "StrictHostKeyChecking=no",
         "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR", "-o", "BatchMode=yes",
         "-o", "ConnectTimeout=3", f"root@{host['address']}", command],
        text=True, capture_output=True, timeout=timeout, check=False,
    )  # fmt: skip


def _ok(host: dict, command: str) -> str:
    proc = _ssh(host, command)
    assert proc.returncode == 0, f"{command!r} exited {proc.returncode}: {proc.stdout}{proc.stderr}"
    return proc.stdout


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="boots sandbox hosts: needs root")


@pytest.fixture(scope="module")
def lab_host():
    _sandbox("up", "--hosts", "1")
    (host,) = json.loads(_sandbox("status", "--json").stdout)
    yield host
    _sandbox("down", check=False)


@pytest.mark.e2e
@needs_root
def test_host_boots_with_systemd_as_pid_1(lab_host):
    assert lab_host["name"] == "gpu1" and lab_host["address"] == f"10.{213 + LAB}.1.2"
    assert lab_host["state"] == "running"
    assert _ok(lab_host, "cat /proc/1/comm").strip() == "systemd"
    state = _ssh(lab_host, "systemctl is-system-running --wait").stdout.strip()
    assert state in ("running", "degraded")
    assert _ok(lab_host, "cat /etc/gpuhost-sandbox/hardware.json").lstrip().startswith("{")


@pytest.mark.e2e
@needs_root
def test_debian_packages_install_through_the_proxy(lab_host):
    # The host has no resolver: deb.debian.org is reachable only through the link's proxy.
    out = _ok(
        lab_host,
        "apt-get update && DEBIAN_FRONTEND=noninteractive "
        "apt-get install -y --no-install-recommends python3-venv && python3 -m venv /tmp/venv",
    )
    assert "deb.debian.org" in out
    assert _ok(lab_host, "/tmp/venv/bin/python -c 'print(42)'").strip() == "42"


@pytest.mark.e2e
@needs_root
def test_reboot_brings_the_host_back_with_a_new_boot_id(lab_host):
    before = _ok(lab_host, "cat /proc/sys/kernel/random/boot_id").strip()
    _ssh(lab_host, "reboot", timeout=30)
    deadline = time.monotonic() + 120
    after = before
    while after == before and time.monotonic() < deadline:
        time.sleep(0.5)
        proc = _ssh(lab_host, "cat /proc/sys/kernel/random/boot_id", timeout=30)
        if proc.returncode == 0:
            after = proc.stdout.strip()
    assert after != before, "the host did not come back from reboot in 120 s"
    (host,) = json.loads(_sandbox("status", "--json").stdout)
    assert host["state"] in ("running", "booting")


@pytest.mark.e2e
@needs_root
def test_down_leaves_nothing_and_is_idempotent(lab_host):
    _sandbox("down")
    _sandbox("down")
    assert json.loads(_sandbox("status", "--json").stdout) == []
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    # this lab's names only: another lab may be up beside it
    assert HostSpec(1).netns not in netns.stdout.split()
    assert not HostSpec(1).dir.exists()
    assert procs.cgroup_pids() == set()
    assert _ssh(lab_host, "true", timeout=30).returncode != 0


def test_ask_answers_for_a_group_through_its_rank_0(tmp_path):
    """`sandbox ask` on a node group exited 1 with a cut traceback: rank 1 answers 404 to
    /v1/models, as it should. A rank >= 1 now says its rank and that rank 0 answers."""
    import json
    import subprocess
    import sys

    from sandbox import ask

    nodes_env = tmp_path / "nodes.env"
    nodes_env.write_text("# Written by gpuhost: node rank 1 of 2 (gpu1, gpu2), rendezvous "
                         "10.214.0.2:5000\nNCCL_IB_DISABLE=1\n")
    # port 9 (discard): a query would fail; the rank >= 1 asks nothing
    run = subprocess.run([sys.executable, "-c", ask.client(9, str(nodes_env))],
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode == 0, run.stderr
    result = {"host": "gpu2", **json.loads(run.stdout)}
    assert ask.said(result) == ["gpu2: node rank 1 of gpu1, gpu2: the group's model is asked "
                                "through its rank 0, gpu1"]
    nodes_env.write_text(nodes_env.read_text().replace("node rank 1", "node rank 0"))
    run = subprocess.run([sys.executable, "-c", ask.client(9, str(nodes_env))],
                         capture_output=True, text=True, timeout=30, check=False)
    assert run.returncode != 0  # rank 0 is asked (nothing listens on port 9 here)
