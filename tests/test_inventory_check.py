"""The inventory check (operations/runtime/inventory_check.py): a host given twice with different
data and a --limit that matches no host stop pyinfra while it loads the inventory, before it
connects to any host. Through pyinfra's command line, against a sandbox host that records every
command it gets, both are in tests/e2e/test_bad_input.py (counted by bench/reliability.py)."""

from __future__ import annotations

from operations.runtime.inventory_check import command_line, duplicate_hosts, unmatched_limits


def test_command_line_is_parsed_as_pyinfra_parses_it():
    argv = ["inv.py", "deploy.py", "--dry", "--limit", "gpu9", "--limit=gpu*", "-y"]
    assert command_line(argv) == ("inv.py", ("gpu9", "gpu*"))
    assert command_line(["inv.py", "deploy.py"]) == ("inv.py", ())


def test_a_host_twice_with_one_key_set_two_ways_is_named_with_both_entries():
    groups = {"lab": [("gpu1", {"gpuhost_server_port": 8000}), ("gpu2", {}),
                      ("gpu1", {"gpuhost_server_port": 9000})]}
    (problem,) = duplicate_hosts(groups, "inventory/x.py")
    assert problem.startswith("host gpu1 is given twice in inventory/x.py with different data")
    assert "group lab entry 1 sets gpuhost_server_port = 8000" in problem
    assert "group lab entry 3 sets gpuhost_server_port = 9000" in problem


def test_a_host_in_two_groups_with_clashing_data_is_refused():
    groups = {"gpus": ([("gpu1", {"ssh_hostname": "10.0.0.1"})], {}),
              "servers": [("gpu1", {"ssh_hostname": "10.0.0.2"})]}
    (problem,) = duplicate_hosts(groups, "inv.py")
    assert "group gpus entry 1" in problem and "group servers entry 1" in problem


def test_a_host_named_again_without_clashing_data_is_pyinfra_grouping():
    groups = {"gpus": [("gpu1", {"gpuhost_gpu_count": 8})], "servers": ["gpu1"],
              "bench": [("gpu1", {"gpuhost_gpu_count": 8, "other": 1})]}
    assert duplicate_hosts(groups, "inv.py") == []


def test_secret_values_are_not_shown():
    groups = {"lab": [("gpu1", {"ssh_password": "hunter2"}), ("gpu1", {"ssh_password": "x"})]}
    (problem,) = duplicate_hosts(groups, "inv.py")
    assert "hunter2" not in problem and "ssh_password = <hidden>" in problem


def test_limits_match_groups_and_host_patterns_as_pyinfra_does():
    names, groups = ["gpu1", "gpu2"], {"lab": ["gpu1", "gpu2"], "empty": []}
    assert unmatched_limits(["gpu1", "gpu*", "lab"], names, groups) == []
    assert unmatched_limits(["gpu9", "empty", "lab"], names, groups) == ["gpu9", "empty"]
