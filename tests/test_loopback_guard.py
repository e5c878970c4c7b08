"""The loopback guard (operations/stages/loopback_guard.py): its nft table and unit."""

from __future__ import annotations

from operations.stages import loopback_guard


def test_the_table_refuses_the_ports_to_every_socket_but_roots_and_replaces_itself():
    text = loopback_guard.rules((30000, 30100))
    lines = [line.strip() for line in text.splitlines() if not line.startswith("#")]
    # created if missing, deleted, defined anew: one load replaces it whole (nft -f is atomic)
    assert lines[:3] == ["table inet gpuhost_loopback_guard",
                         "delete table inet gpuhost_loopback_guard",
                         "table inet gpuhost_loopback_guard {"]
    assert "type filter hook output priority filter; policy accept;" in lines
    assert ('oifname "lo" tcp dport { 30000, 30100 } meta skuid != 0 reject with tcp reset'
            in lines)


def test_the_unit_loads_before_the_servers_and_is_reloaded_not_restarted():
    unit = loopback_guard.unit()
    assert "Before=network-pre.target sglang.service sglang-router.service" in unit
    assert "RequiredBy=sglang.service sglang-router.service" in unit
    assert "ExecReload=/usr/sbin/nft -f /etc/gpuhost/loopback-guard.nft" in unit
    assert "PartOf=nftables.service" in unit  # its flush of the ruleset loads the table again


def test_named_users_pass_to_their_port_only_and_roots_always():
    text = loopback_guard.rules((8000, 30100), {8000: (1001, 1000)})
    lines = [line.strip() for line in text.splitlines()]
    assert 'oifname "lo" tcp dport { 30100 } meta skuid != 0 reject with tcp reset' in lines
    assert ('oifname "lo" tcp dport 8000 meta skuid != { 0, 1000, 1001 } reject with tcp reset'
            in lines)
    assert sum("8000" in line for line in lines) == 1


def test_the_user_ids_fact_reads_getent_lines_and_skips_the_rest():
    fact = loopback_guard.UserIds()
    assert fact.command(("alice", "bob")) == "getent passwd alice bob || true"
    assert fact.process(["alice:x:1001:1001:Alice,,,:/home/alice:/bin/bash", "",
                         "broken line"]) == {"alice": 1001}


def test_the_routers_metrics_admit_root_and_prometheus_alone():
    lines = [line.strip() for line in loopback_guard.metrics_rules((29000,), ("prometheus",))
             .splitlines()]
    assert lines[1:4] == ["table inet gpuhost_metrics_guard",
                          "delete table inet gpuhost_metrics_guard",
                          "table inet gpuhost_metrics_guard {"]
    assert ('oifname "lo" tcp dport 29000 meta skuid != { 0, prometheus } reject with tcp reset'
            in lines)
    assert ('oifname "lo" tcp dport 29000 meta skuid != 0 reject with tcp reset'
            in loopback_guard.metrics_rules((29000,), ()))
    assert ('oifname "lo" tcp dport { 29000, 9093 } meta skuid != { 0, prometheus } reject with '
            'tcp reset' in loopback_guard.metrics_rules((29000, 9093), ("prometheus",)))
    unit = loopback_guard.metrics_unit()
    assert "ExecStart=/usr/sbin/nft -f /etc/gpuhost/metrics-guard.nft" in unit
    # loaded after the package made the user: nothing requires it (the router starts before)
    assert "RequiredBy" not in unit and "PartOf=nftables.service" in unit
