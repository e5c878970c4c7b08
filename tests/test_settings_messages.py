"""Host-data errors list every problem, say where each value came from (--data, the inventory,
group_data/<group>.py), and reach the user without pyinfra's "error in <file> line <n>"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from pyinfra.api import Inventory

from operations import REPO_ROOT
from operations.plans.settings import (
    SettingsError,
    data_sources,
    for_inventory,
    from_host_data,
    notes,
)

PYINFRA = Path(sys.executable).parent / "pyinfra"


def test_every_problem_of_a_host_is_listed():
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", {"gpuhost_server_port": 0, "gpuhost_mem_fraction_static": 1.5,
                                "gpuhost_colr": "blue"})
    problems = err.value.problems
    assert len(problems) == 3, problems
    assert any("gpuhost_server_port = 0" in p for p in problems)
    assert any("gpuhost_mem_fraction_static = 1.5" in p for p in problems)
    assert any("unknown key gpuhost_colr" in p for p in problems)
    assert str(err.value) == "\n".join(problems)


def test_settings_against_each_other_are_all_checked():
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", {"gpuhost_tensor_parallel_size": 3,
                                "gpuhost_driver_flavour": "proprietary"})
    assert [p.split(" = ")[0] for p in err.value.problems] == [
        "host gpu1: gpuhost_tensor_parallel_size", "host gpu1: gpuhost_driver_flavour"]


def test_every_host_is_listed():
    with pytest.raises(SettingsError) as err:
        for_inventory([("gpu1", {"gpuhost_server_port": 0}), ("gpu2", {}),
                       ("gpu3", {"gpuhost_gpu_count": 0})])
    assert [p.split(":")[0] for p in err.value.problems] == ["host gpu1", "host gpu3"]


def test_a_problem_says_where_its_value_came_from():
    sources = {"gpuhost_server_port": "--data", "gpuhost_gpu_count": "group_data/all.py"}
    with pytest.raises(SettingsError) as err:
        for_inventory([("gpu1", {"gpuhost_server_port": 0})], {"gpu1": sources})
    (port,) = err.value.problems
    assert port.endswith("an integer from 1 to 65535. It is set in --data.")
    with pytest.raises(SettingsError) as err:
        for_inventory([("gpu1", {"gpuhost_gpu_count": 4})], {"gpu1": sources})
    (tp,) = err.value.problems
    # The value at fault may be a default that another key's value contradicts.
    assert "gpuhost_tensor_parallel_size = 8" in tp and tp.endswith("It is the default.")


def test_data_sources_follow_pyinfras_precedence(tmp_path):
    (tmp_path / "lab.py").write_text("gpuhost_server_port = 8001\n")
    (tmp_path / "all.py").write_text("gpuhost_gpu_count = 8\n")
    inventory = Inventory(
        ([("gpu1", {"gpuhost_model": "a/b", "gpuhost_served_model_name": "x"})],
         {"gpuhost_gpu_count": 8, "gpuhost_lock": "locks/cuda12.8.txt"}),
        override_data={"gpuhost_served_model_name": "y"},
        lab=(["gpu1"], {"gpuhost_server_port": 8001, "gpuhost_health_timeout": 60,
                        "gpuhost_model": "c/d"}),
    )
    (host,) = list(inventory)
    sources = data_sources(host, "inventory/lab.py", tmp_path)
    assert sources["gpuhost_served_model_name"] == "--data"
    assert sources["gpuhost_model"] == "the inventory inventory/lab.py (host gpu1's entry)"
    assert sources["gpuhost_server_port"] == "group_data/lab.py"
    assert sources["gpuhost_health_timeout"] == "the inventory inventory/lab.py (group lab's data)"
    assert sources["gpuhost_gpu_count"] == "group_data/all.py"
    assert sources["gpuhost_lock"] == "the inventory inventory/lab.py (group all's data)"


def test_cli_lists_every_problem_with_its_source_and_no_internal_line(tmp_path):
    """pyinfra on an ``@local`` inventory: deploy.py stops at its first line (the settings),
    before any operation, so nothing runs on this machine."""
    path = tmp_path / "inventory.py"
    path.write_text('lab = [("@local", {"gpuhost_server_port": 0})]\n')
    run = subprocess.run([str(PYINFRA), str(path), "deploy.py", "--dry",
                          "--data", "gpuhost_served_model_name="],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    output = run.stdout + run.stderr
    assert run.returncode != 0, output
    assert "gpuhost_server_port = 0 is not allowed" in output
    assert f"It is set in the inventory {path} (host @local's entry)." in output
    assert "gpuhost_served_model_name = '' is not allowed" in output
    assert "It is set in --data." in output
    assert "pyinfra error in" not in output and "settings.py line" not in output
    assert "Traceback" not in output


def test_an_api_key_file_on_a_loopback_bind_is_noted():
    s = from_host_data("gpu1", {"gpuhost_api_key_file": "/etc/gpuhost/api.key"})
    (note,) = notes(s)
    assert note.startswith("gpuhost_api_key_file = '/etc/gpuhost/api.key' has no effect: "
                           "gpuhost_server_host = '127.0.0.1' is a loopback address")
    public = from_host_data("gpu1", {"gpuhost_api_key_file": "/etc/gpuhost/api.key",
                                     "gpuhost_server_host": "0.0.0.0"})
    assert notes(from_host_data("gpu1", {})) == []
    (plain,) = notes(public)
    assert plain.startswith("gpuhost_server_host binds wider than the loopback without "
                            "gpuhost_tls_ca_cert_file: keys and prompts cross the network in "
                            "plain HTTP")
    secured = from_host_data("gpu1", {"gpuhost_api_key_file": "/etc/gpuhost/api.key",
                                      "gpuhost_server_host": "0.0.0.0",
                                      "gpuhost_tls_ca_cert_file": "/ca.crt",
                                      "gpuhost_tls_ca_key_file": "/ca.key"})
    assert notes(secured) == []
