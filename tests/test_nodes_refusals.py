"""A group refused while planning (operations/stages/nodes.py ``node_role``): a node pyinfra could
not connect to is refused for its group in gpuhost's words, and no fact of any node is read (the
unconnected node's get_fact would end the whole run with pyinfra's own error)."""

from types import SimpleNamespace

import pytest

from operations.stages import nodes


class Host:
    def __init__(self, name):
        self.name = name


@pytest.fixture
def planning(monkeypatch):
    hosts = {n: Host(n) for n in ("gpu1", "gpu2", "gpu3")}
    said = []
    run = SimpleNamespace(active_hosts=set(),
                          is_host_in_limit=lambda h: True)
    monkeypatch.setattr(nodes, "inventory", SimpleNamespace(get_host=hosts.__getitem__))
    monkeypatch.setattr(nodes, "state", run)
    monkeypatch.setattr(nodes, "host", SimpleNamespace(name="gpu1", print_prefix="[gpu1] "))
    monkeypatch.setattr(nodes, "refuse", lambda stage, reason: said.append((stage, reason)))

    def no_fact(*args, **kwargs):
        raise AssertionError("a fact was read while the group is refused")

    monkeypatch.setattr(nodes, "fact_of", no_fact)
    monkeypatch.setattr(nodes, "fact", no_fact)
    return hosts, run, said


def test_a_node_the_controller_cannot_reach_refuses_its_group(planning):
    hosts, run, said = planning
    run.active_hosts = {hosts["gpu1"], hosts["gpu3"]}  # gpu2: pyinfra could not connect
    settings = SimpleNamespace(nodes=("gpu1", "gpu2"), node_interface=None,
                               dist_init_port=25000)
    assert nodes.node_role(settings) is None
    assert said == [("Nodes", "group gpu1, gpu2: gpu2 is not in this run (not connected, or "
                              "failed): the nodes of one server are converged together; the "
                              "group is left as it is")]


def test_every_unreached_node_is_named(planning):
    hosts, run, said = planning
    run.active_hosts = {hosts["gpu1"]}
    settings = SimpleNamespace(nodes=("gpu1", "gpu2", "gpu3"), node_interface=None,
                               dist_init_port=25000)
    assert nodes.node_role(settings) is None
    assert said[0][1].startswith("group gpu1, gpu2, gpu3: gpu2, gpu3 is not in this run")
