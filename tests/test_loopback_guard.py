"""The loopback guard (operations/loopback_guard.py): its nft table and unit."""

from __future__ import annotations

from operations import loopback_guard


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
