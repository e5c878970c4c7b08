"""Ports and addresses checked against the host while planning (issue #30 item 5): a port of
the router, its gate or its metrics that another unit listens on (sshd's 22), and a
gpuhost_router_host or gpuhost_fleet_address that is no address of the host, are refused
before any change, naming the key, the value and the listener."""

from __future__ import annotations

import pytest

from operations.facts.host import HostAddresses, address_problem
from operations.plans.settings import from_host_data
from operations.stages import router, server_refusals, server_state

IP_O = [
    "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft forever",
    "1: lo    inet6 ::1/128 scope host noprefixroute \\       valid_lft forever",
    "2: eth0    inet 10.217.1.2/24 brd 10.217.1.255 scope global eth0\\       valid_lft forever",
    "3: eth1    inet 10.217.0.1/24 brd 10.217.0.255 scope global eth1\\       valid_lft forever",
    "3: eth1    inet6 fe80::1c2d:3eff:fe4f:5a6b/64 scope link \\       valid_lft forever",
]
OWN = ["127.0.0.1", "::1", "10.217.1.2", "10.217.0.1", "fe80::1c2d:3eff:fe4f:5a6b"]


def settings(**data):
    return from_host_data("gpu1", {f"gpuhost_{k}": v for k, v in data.items()})


def test_the_hosts_addresses_as_ip_o_gives_them():
    assert HostAddresses().process(IP_O) == OWN


@pytest.mark.parametrize("address", ["0.0.0.0", "::", "127.0.0.1", "127.0.0.53", "10.217.0.1"])
def test_a_wildcard_loopback_or_own_address_is_allowed(address):
    assert address_problem("gpuhost_router_host", address, OWN, "x") is None


def test_an_address_of_another_host_is_refused_naming_key_value_and_the_hosts_own():
    said = address_problem("gpuhost_router_host", "10.217.0.9", OWN, "the router binds it")
    assert said.startswith("gpuhost_router_host = '10.217.0.9' is not allowed: it is not an "
                           "address of this host (the router binds it)")
    assert "10.217.0.1" in said


def _planned(monkeypatch, module, listeners, addresses=OWN):
    refused = []

    def fact(cls, **kwargs):
        if cls is server_state.PortListeners:
            return listeners
        if cls is HostAddresses:
            return addresses
        raise AssertionError(cls)

    monkeypatch.setattr(module, "fact", fact)
    monkeypatch.setattr(module, "refuse", lambda stage, why: refused.append((stage, why)))
    return refused


def test_a_router_port_that_sshd_listens_on_is_refused(monkeypatch):
    refused = _planned(monkeypatch, router, {"22": ["ssh.service"]})
    assert router._check_listen(settings(router_port=22)) is False
    assert refused == [("Router", "gpuhost_router_port = 22 is not allowed: a port no other "
                                  "unit listens on (ssh.service listens on it)")]


def test_the_routers_own_units_and_metrics_port_count_as_its_own(monkeypatch):
    refused = _planned(monkeypatch, router, {"8100": [router.UNIT],
                                             "29000": [router.UNIT]})
    assert router._check_listen(settings()) is True and refused == []
    refused = _planned(monkeypatch, router, {"29000": ["node-exporter.service"]})
    assert router._check_listen(settings()) is False
    assert "the router's metrics port = 29000 is not allowed" in refused[0][1]


def test_a_router_host_that_is_not_the_hosts_own_address_is_refused(monkeypatch):
    refused = _planned(monkeypatch, router, {})
    assert router._check_listen(settings(router_host="10.217.0.9",
                                         router_api_key_file="/root/k")) is False
    assert refused[0][1].startswith("gpuhost_router_host = '10.217.0.9' is not allowed")


def test_a_fleet_address_that_is_not_the_hosts_own_is_refused(monkeypatch):
    refused = _planned(monkeypatch, server_refusals, {})
    server_refusals._check_ports(settings(fleet_address="10.217.0.9", server_host="0.0.0.0",
                                 api_key_file="/root/k"))
    assert [stage for stage, _ in refused] == ["SGLang server"]
    assert refused[0][1].startswith("gpuhost_fleet_address = '10.217.0.9' is not allowed: it "
                                    "is not an address of this host (the router reaches")
    refused = _planned(monkeypatch, server_refusals, {})
    server_refusals._check_ports(settings(fleet_address="10.217.0.1", server_host="0.0.0.0",
                                 api_key_file="/root/k"))
    assert refused == []
