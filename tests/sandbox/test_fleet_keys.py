"""A lab with a router host is a fleet: its keys made once, root-only, on the hosts that need
them, and the host data that names them (sandbox/fleet_keys.py); ``sandbox ask`` through the
gates with them."""

from __future__ import annotations

import os
import stat

from sandbox import ask, fleet_keys


def test_the_keys_are_made_once_root_only(tmp_path):
    first = fleet_keys.ensure(tmp_path)
    assert set(first) == set(fleet_keys.KEYS) and len(set(first.values())) == 3
    assert all(len(k) >= 43 for k in first.values())  # token_urlsafe(32)
    assert fleet_keys.ensure(tmp_path) == first
    folder = tmp_path / "fleet"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    for path in folder.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
    assert fleet_keys.router_key_file(tmp_path).read_text().strip() == first["router API key"]


def test_each_host_gets_the_fleet_key_and_its_own_client_key_alone(tmp_path):
    keys = fleet_keys.ensure(tmp_path / "state")
    gpu, router = tmp_path / "gpu1", tmp_path / "router"
    fleet_keys.install(gpu, True, keys)
    fleet_keys.install(router, False, keys)
    on = {root: sorted(p.name for p in (root / "root").iterdir()) for root in (gpu, router)}
    assert on == {gpu: ["fleet.key", "sglang-api.key"], router: ["fleet.key", "router-api.key"]}
    assert (gpu / "root/sglang-api.key").read_text() == keys["API key"] + "\n"
    assert (router / "root/router-api.key").read_text() == keys["router API key"] + "\n"
    for path in (gpu / "root/fleet.key", router / "root/router-api.key"):
        info = path.stat()
        assert stat.S_IMODE(info.st_mode) == 0o600 and (info.st_uid, info.st_gid) == (0, 0)


def test_host_data_binds_the_switch_behind_the_gates_and_ask_goes_through_them():
    serving = fleet_keys.host_data("10.213.0.1", True)
    router = fleet_keys.host_data("10.213.0.3", False)
    assert serving == {"gpuhost_fleet_key_file": "/root/fleet.key",
                       "gpuhost_server_host": "10.213.0.1",
                       "gpuhost_api_key_file": "/root/sglang-api.key"}
    assert router == {"gpuhost_fleet_key_file": "/root/fleet.key",
                      "gpuhost_router_host": "10.213.0.3",
                      "gpuhost_router_api_key_file": "/root/router-api.key"}
    assert ask.endpoint({"fleet_data": serving}, 8000) == ("http://10.213.0.1:8000",
                                                          "/root/sglang-api.key")
    assert ask.endpoint({"fleet_data": router}, 8000) == ("http://10.213.0.3:8100",
                                                         "/root/router-api.key")
    assert ask.endpoint({"fleet_data": {}}, 8000) == (
        "http://127.0.0.1:8000", None)
