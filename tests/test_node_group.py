"""One server across hosts: gpuhost_nodes on a group, its checks, flags and NCCL settings."""

import json
import shlex
from pathlib import Path

import pytest
from pyinfra.api.util import get_template
from pyinfra.facts.hardware import NetworkDevices

from operations.plans.node_group import (
    GroupError,
    NodeRole,
    env_file,
    networks,
    node_env,
    role_of,
    shared_network,
)
from operations.plans.settings import SettingsError, for_inventory, from_host_data
from operations.plans.sglang import check_server_args, load_parser_spec, server_args
from operations.stages.nodes import RdmaDevices
from operations.stages.server_unit import server_inputs, unit_context

ROOT = Path(__file__).resolve().parent.parent
LOCK = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"
PAIR = ["gpu1", "gpu2"]


@pytest.fixture
def lock(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(LOCK)
    return str(path)


def group(lock, nodes=PAIR, **data):
    return {"gpuhost_lock": lock, "gpuhost_nodes": list(nodes), "gpuhost_gpu_count": 8,
            "gpuhost_tensor_parallel_size": 8 * len(nodes), **data}


def refused(hosts):
    with pytest.raises(SettingsError) as exc:
        for_inventory(hosts)
    return exc.value.problems


# Host data


def test_a_group_of_two_nodes_is_one_server_of_16_gpus(lock):
    found = for_inventory([(n, group(lock)) for n in PAIR])
    assert found["gpu2"].nodes == ("gpu1", "gpu2")
    assert found["gpu1"].tensor_parallel_size == 16


def test_tensor_parallel_size_must_be_gpus_per_node_times_nodes(lock):
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", group(lock, gpuhost_tensor_parallel_size=8))
    assert "gpuhost_tensor_parallel_size = 8 is not allowed: 16: the group's 16 GPUs " \
           "(gpuhost_gpu_count 8 x 2 nodes)" in str(exc.value)


def test_pipeline_parallel_size_counts_towards_the_gpus(lock):
    s = from_host_data("gpu1", group(lock, gpuhost_tensor_parallel_size=8,
                                     gpuhost_pipeline_parallel_size=2))
    assert s.pipeline_parallel_size == 2
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", group(lock, gpuhost_tensor_parallel_size=16,
                                     gpuhost_pipeline_parallel_size=2))
    assert "8: the group's 16 GPUs (gpuhost_gpu_count 8 x 2 nodes) divided by " \
           "gpuhost_pipeline_parallel_size 2" in str(exc.value)
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", group(lock, gpuhost_pipeline_parallel_size=3))
    assert "gpuhost_pipeline_parallel_size = 3 is not allowed: a divisor of the group's 16" \
        in str(exc.value)


def test_a_host_outside_its_own_node_list_is_refused(lock):
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu3", group(lock))
    assert "host gpu3: gpuhost_nodes = ['gpu1', 'gpu2'] is not allowed: a list of the " \
           "group's hosts that names this host (gpu3)" in str(exc.value)


@pytest.mark.parametrize("value", [["gpu1"], ["gpu1", "gpu1"], "gpu1,gpu2", ["gpu1", 2], [""]])
def test_bad_node_lists_are_refused(lock, value):
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", {"gpuhost_lock": lock, "gpuhost_nodes": value})
    assert f"gpuhost_nodes = {value!r} is not allowed: a list of 2 to 64 distinct" \
        in str(exc.value)


def test_bad_interface_names_are_refused(lock):
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", group(lock, gpuhost_node_interface="eth0/1"))
    assert "gpuhost_node_interface = 'eth0/1' is not allowed: a network interface name" \
        in str(exc.value)


def test_a_node_the_inventory_lacks_is_refused(lock):
    problems = refused([("gpu1", group(lock))])
    assert problems == ["host gpu1: gpuhost_nodes = ['gpu1', 'gpu2'] names gpu2, which the "
                        "inventory has no host of: each node must be a host of the inventory"]


def test_nodes_with_other_lists_are_refused(lock):
    problems = refused([("gpu1", group(lock)),
                        ("gpu2", group(lock, nodes=["gpu2", "gpu1"]))])
    assert problems[0].startswith("group gpu1, gpu2: host gpu2 has gpuhost_nodes = "
                                  "['gpu2', 'gpu1']")


def test_a_node_with_a_different_lock_is_refused_naming_both(lock, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(LOCK.replace("0" * 64, "1" * 64))
    problems = refused([("gpu1", group(lock)), ("gpu2", group(str(other)))])
    (problem,) = problems
    assert problem.startswith("group gpu1, gpu2: gpuhost_lock differs between its nodes (gpu1: ")
    assert "gpu2: '" + str(other) + " (sha256 " in problem
    assert problem.endswith("every node must run the same lock, model, driver and flags")


def test_the_same_lock_in_two_places_is_the_same_lock(lock, tmp_path):
    copy = tmp_path / "copy" / "lock.txt"
    copy.parent.mkdir()
    copy.write_text(LOCK)
    problems = refused([("gpu1", group(lock)), ("gpu2", group(str(copy)))])
    # only the path differs: named, with the same digest on both
    digest = problems[0].split("sha256 ")[1][:12]
    assert problems[0].count(digest) == 2


def test_different_revisions_drivers_and_flags_are_each_refused(lock):
    problems = refused([
        ("gpu1", group(lock)),
        ("gpu2", group(lock, gpuhost_model_revision="abc123", gpuhost_driver_branch="570",
                       gpuhost_mem_fraction_static=0.9)),
    ])
    said = "\n".join(problems)
    assert "gpuhost_model_revision differs between its nodes (gpu1: 'main'; gpu2: 'abc123')" \
        in said
    assert "gpuhost_driver_branch differs between its nodes (gpu1: '580'; gpu2: '570')" in said
    assert "server flags differs between its nodes" in said and "0.85" in said


def test_the_node_flags_are_owned(lock):
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", group(lock, gpuhost_server_extra_args=["--nccl-init-addr",
                                                                       "10.0.0.1:5000"]))
    assert "gpuhost_nodes" in str(exc.value)


# The network the nodes share, from pyinfra's NetworkDevices fact


def devices(**interfaces):
    return {name: {"state": "UP", "ipv4": {"address": a.split("/")[0],
                                           "mask_bits": int(a.split("/")[1])}}
            for name, a in interfaces.items()}


def test_the_shared_network_is_found_from_facts():
    found = shared_network(("gpu1", "gpu2"), {
        "gpu1": {**devices(eno1="192.0.2.10/24", ens1f0="10.10.0.1/16"),
                 "lo": {"state": "UNKNOWN", "ipv4": {"address": "127.0.0.1", "mask_bits": 8}}},
        "gpu2": devices(enp2s0="10.10.3.7/16", docker0="172.17.0.1/16"),
    })
    assert found == {"gpu1": ("ens1f0", "10.10.0.1"), "gpu2": ("enp2s0", "10.10.3.7")}


def test_no_shared_network_is_refused_naming_each_nodes_addresses():
    with pytest.raises(GroupError) as exc:
        shared_network(("gpu1", "gpu2"), {"gpu1": devices(eth0="10.0.1.2/24"),
                                          "gpu2": devices(eth0="10.0.2.2/24")})
    assert str(exc.value).startswith("group gpu1, gpu2: no IPv4 network that every node has "
                                     "an address in (gpu1: eth0 10.0.1.2/24; gpu2: eth0 "
                                     "10.0.2.2/24)")


def test_two_shared_networks_need_the_interface_named():
    facts = {"gpu1": devices(eth0="10.0.0.1/24", ib0="10.1.0.1/24"),
             "gpu2": devices(eth0="10.0.0.2/24", ib0="10.1.0.2/24")}
    with pytest.raises(GroupError) as exc:
        shared_network(("gpu1", "gpu2"), facts)
    assert "name the interface with gpuhost_node_interface" in str(exc.value)
    assert shared_network(("gpu1", "gpu2"), facts, "ib0") == {
        "gpu1": ("ib0", "10.1.0.1"), "gpu2": ("ib0", "10.1.0.2")}
    with pytest.raises(GroupError) as exc:
        shared_network(("gpu1", "gpu2"), {**facts, "gpu2": devices(eth0="10.0.0.2/24")}, "ib0")
    assert "gpuhost_node_interface = 'ib0': gpu2 has no IPv4 address up on it" in str(exc.value)


def test_networks_read_from_real_ip_output():
    """tests/fixtures/ip-addr/controller.json: ``ip -j addr show`` on the development machine
    (iproute2), through pyinfra's own parser."""
    text = (ROOT / "tests/fixtures/ip-addr/controller.json").read_text()
    parsed = NetworkDevices().process(text.splitlines())
    found = networks(parsed)
    assert "lo" not in found and "ifb0" not in found
    assert str(found["eth0"][0]) == "192.0.2.2/24"
    raw = {d["ifname"]: d for d in json.loads(text)}
    assert set(found) == {n for n, d in raw.items() if "UP" in d["flags"] and any(
        a["family"] == "inet" and not a["local"].startswith("127.") for a in d["addr_info"])}


def test_rdma_devices_are_the_entries_of_sys_class_infiniband():
    assert RdmaDevices().process(["mlx5_1", "mlx5_0", ""]) == ["mlx5_0", "mlx5_1"]
    assert RdmaDevices().process([]) == []


# The rendered launch and environment


ROLE = role_of("gpu2", ("gpu1", "gpu2"), 25000,
               {"gpu1": ("ens1f0", "10.10.0.1"), "gpu2": ("enp2s0", "10.10.3.7")}, ())


def test_a_node_launches_with_its_rank_and_rank_0s_address(lock):
    s = from_host_data("gpu2", group(lock))
    args = server_args(s, ROLE)
    assert args[args.index("--nnodes"):args.index("--nnodes") + 6] == [
        "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.10.0.1:25000"]
    check_server_args(args, load_parser_spec("0.5.9"))
    assert "--nnodes" not in server_args(s)


def test_nccl_uses_the_shared_interface_and_ib_only_where_rdma_exists():
    assert node_env(ROLE) == {"NCCL_SOCKET_IFNAME": "enp2s0", "GLOO_SOCKET_IFNAME": "enp2s0",
                              "NCCL_IB_DISABLE": "1"}
    with_ib = NodeRole(ROLE.nodes, 1, ROLE.dist_init_addr, "ib0", ("mlx5_0",))
    assert node_env(with_ib)["NCCL_IB_DISABLE"] == "0"
    assert env_file(ROLE).splitlines()[1:] == [
        "GLOO_SOCKET_IFNAME=enp2s0", "NCCL_IB_DISABLE=1", "NCCL_SOCKET_IFNAME=enp2s0"]


def test_the_unit_reads_nodes_env_after_p2p_env_only_on_a_node(lock):
    template = get_template(str(ROOT / "templates" / "sglang.service.j2"))
    node = from_host_data("gpu2", group(lock))
    text = template.render(**unit_context(node, ROLE))
    files = [line for line in text.splitlines() if line.startswith("EnvironmentFile=")]
    assert files[-2:] == ["EnvironmentFile=/etc/gpuhost/p2p.env",
                          "EnvironmentFile=/etc/gpuhost/nodes.env"]
    (exec_start,) = [line for line in text.splitlines() if line.startswith("ExecStart=")]
    assert "--node-rank 1 --dist-init-addr 10.10.0.1:25000" in exec_start
    assert "/etc/gpuhost/nodes.env" in shlex.split(text.split("unit_inputs.py")[1])[0:20]
    assert "/etc/gpuhost/nodes.env" in server_inputs(node)
    alone = from_host_data("gpu1", {"gpuhost_lock": lock})
    assert "nodes.env" not in template.render(**unit_context(alone))


def test_a_sweep_on_a_node_is_refused(lock):
    with pytest.raises(SettingsError) as exc:
        from_host_data("gpu1", group(lock, gpuhost_bench_sweep={
            "moe_runner_backend": ["cutlass"]}))
    assert "gpuhost_bench_sweep = {'moe_runner_backend': ['cutlass']} is not allowed: None on " \
           "a node of a server across hosts" in str(exc.value)


# Before any restart: every node reaches rank 0's rendezvous port and each other


def test_reach_is_read_from_the_hosts_answers():
    from operations.stages.nodes import NodeReach, reach_targets, unreached
    network = {"gpu1": ("eth1", "10.0.0.1"), "gpu2": ("eth1", "10.0.0.2")}
    assert reach_targets("gpu1", ("gpu1", "gpu2"), network, 25000) == (
        "10.0.0.1:25000", "10.0.0.2:25000")
    assert reach_targets("gpu2", ("gpu1", "gpu2"), network, 25000) == ("10.0.0.1:25000",)
    fact = NodeReach()
    assert "python3 -c" in fact.command(targets=("10.0.0.1:25000",))
    answers = {"gpu1": fact.process(["10.0.0.1:25000 refused", "10.0.0.2:25000 open"]),
               "gpu2": fact.process(["10.0.0.1:25000 timeout"])}
    assert unreached(("gpu1", "gpu2"), answers) == [
        "gpu2 does not reach 10.0.0.1:25000 (timeout)"]
    assert unreached(("gpu1", "gpu2"), {"gpu1": answers["gpu1"], "gpu2": {}}) == [
        "gpu2 could not check what it reaches"]


def test_the_reach_script_tells_refused_from_unreachable(tmp_path):
    import socket
    import subprocess
    import sys

    from operations.stages.nodes import NodeReach
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    listening.listen()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    open_port, closed_port = listening.getsockname()[1], closed.getsockname()[1]
    closed.close()
    command = NodeReach().command(targets=(f"127.0.0.1:{open_port}", f"127.0.0.1:{closed_port}"))
    out = subprocess.run(command.replace("python3", sys.executable, 1), shell=True,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    listening.close()
    assert NodeReach().process(out) == {f"127.0.0.1:{open_port}": "open",
                                        f"127.0.0.1:{closed_port}": "refused"}


# Group-wide restarts


class Op:
    def __init__(self, changed, complete=True):
        self.changed, self.complete = changed, complete

    def is_complete(self):
        return self.complete

    def did_change(self):
        return self.changed


def test_a_change_on_any_node_restarts_the_group(monkeypatch):
    from operations.stages import group_restart
    nodes = ("gpu1", "gpu2")
    monkeypatch.setattr(group_restart, "GROUPS", {nodes: {
        "gpu1": group_restart.NodePlan([Op(False)], None),
        "gpu2": group_restart.NodePlan([Op(False), Op(True)], None)}})
    assert group_restart.restart_reason(nodes) == "gpu2: what its server reads changed"
    group_restart.GROUPS[nodes]["gpu2"].changes = [Op(False), Op(True, complete=False)]
    assert group_restart.restart_reason(nodes) is None
    group_restart.GROUPS[nodes]["gpu2"].must_start = "sglang.service is not running (failed)"
    assert group_restart.restart_reason(nodes) == \
        "gpu2: sglang.service is not running (failed)"


def test_a_node_does_not_restart_itself(lock):
    template = get_template(str(ROOT / "templates" / "sglang.service.j2"))
    node = template.render(**unit_context(from_host_data("gpu2", group(lock)), ROLE))
    assert "Restart=no" in node.splitlines() and "Restart=on-failure" not in node
    alone = template.render(**unit_context(from_host_data("gpu1", {"gpuhost_lock": lock})))
    assert "Restart=on-failure" in alone.splitlines()


def test_the_rendezvous_port_is_not_the_servers(lock):
    with pytest.raises(SettingsError, match=r"gpuhost_dist_init_port = 8000 is not allowed: a port "
                                            r"other than gpuhost_server_port \(8000\)"):
        from_host_data("gpu1", group(lock, gpuhost_dist_init_port=8000))


def test_a_node_whose_own_data_is_refused_is_not_called_missing(lock):
    """gpu2's own bad value is its problem; the group is not said to lack gpu2."""
    problems = refused([("gpu1", group(lock)),
                        ("gpu2", group(lock, gpuhost_mem_fraction_static=2.0))])
    assert len(problems) == 1 and problems[0].startswith(
        "host gpu2: gpuhost_mem_fraction_static = 2.0 is not allowed"), problems


def test_a_node_asked_to_roll_back_alone_is_refused_before_any_host_is_touched(lock):
    problems = refused([("gpu1", group(lock)), ("gpu2", group(lock, gpuhost_rollback=True))])
    assert problems == [
        "group gpu1, gpu2: gpuhost_rollback = True on gpu2: allowed on a node of a server "
        "across hosts: False only (a node has no last known good of its own: its ranks restart "
        "together, never one alone); roll the group back by deploying every node with the lock "
        "and host data it last served with"]


def test_each_rank_writes_nodes_env_in_a_row_of_its_own(monkeypatch):
    """--dry listed "/etc/gpuhost/nodes.env (node rank 1)" for both hosts of a group: pyinfra
    names an operation after the first host that planned it. Each rank's put is planned at a
    loop position of its own (a distinct operation), named with that rank."""
    from pyinfra.api import Config, Inventory, State
    from pyinfra.api.operation import solve_operation_consistency
    from pyinfra.context import ctx_host, ctx_state

    from operations.plans.node_group import NodeRole
    from operations.stages import nodes

    inventory = Inventory((["gpu1", "gpu2"], {}))
    state = State(inventory, Config())
    planned = {}

    def put(name, **_):
        target = nodes.host._get_module()
        _, op_hash = solve_operation_consistency({name}, state, target)
        planned.setdefault(op_hash, set()).add((name, target.name))
        return name

    monkeypatch.setattr(nodes.files, "put", put)
    settings = from_host_data("gpu1", {})
    for rank, name in enumerate(("gpu1", "gpu2")):
        role = NodeRole(("gpu1", "gpu2"), rank, "10.0.0.1:5000", "eth1")
        with ctx_state.use(state), ctx_host.use(inventory.get_host(name)):
            assert nodes.nodes_env(role, settings) == [f"/etc/gpuhost/nodes.env (node rank {rank})"]
    put_rows = [names for names in planned.values() if any("nodes.env" in n for n, _ in names)]
    assert sorted(put_rows, key=sorted) == [{("/etc/gpuhost/nodes.env (node rank 0)", "gpu1")},
                                            {("/etc/gpuhost/nodes.env (node rank 1)", "gpu2")}]
