"""State gpuhost repairs rather than trusts: p2p.env from the recorded measurement, drop-ins of
the server unit that gpuhost does not own, and the host data key that allows some."""

import json

import pytest

from operations.plans import p2p_policy
from operations.plans.settings import SettingsError, from_host_data
from operations.stages import p2p, server_state, server_unit


def test_p2p_env_is_rendered_from_the_records_decision_as_the_check_writes_it():
    decision = p2p_policy.decide([["X", "NS"], ["NS", "X"]], [["X", "NS"], ["NS", "X"]], True)
    record = json.dumps({"decision": decision.to_json()})  # as p2p_check.py writes it
    text = p2p.recorded_env(record)
    assert text == p2p_policy.env_file(decision)
    assert "NCCL_P2P_LEVEL=PHB\n" in text
    assert "GPUHOST_P2P_SERVER_ARGS=--disable-custom-all-reduce\n" in text


@pytest.mark.parametrize("record", [None, "", "not json", "[]", '{"decision": 3}',
                                    '{"decision": {"p2p": "on"}}'])
def test_no_p2p_env_from_a_record_without_a_usable_decision(record):
    assert p2p.recorded_env(record) is None


def test_drop_ins_gpuhost_does_not_own_are_removed_unless_allowed():
    present = server_state.DropIns().process(["50-local.conf", "10-gpuhost-driver-gate.conf",
                                        "99-evil.conf"])
    assert present == ["10-gpuhost-driver-gate.conf", "50-local.conf", "99-evil.conf"]
    assert server_state.foreign_dropins(present, ("50-local.conf",)) == (["99-evil.conf"],
                                                                   ["50-local.conf"])
    assert server_state.foreign_dropins(present, ()) == (["50-local.conf", "99-evil.conf"], [])
    assert server_state.foreign_dropins(["10-gpuhost-driver-gate.conf"], ()) == ([], [])


def test_the_drop_in_folder_is_listed_quoted_and_only_conf_files():
    command = server_state.DropIns().command(server_unit.DROPIN_DIR)
    assert command.startswith("for f in /etc/systemd/system/sglang.service.d/*.conf; do")


def test_allowed_dropins_is_a_list_of_conf_file_names():
    s = from_host_data("gpu1", {"gpuhost_allowed_dropins": ["50-local.conf"]})
    assert s.allowed_dropins == ("50-local.conf",)
    assert from_host_data("gpu1", {}).allowed_dropins == ()


@pytest.mark.parametrize("value", ["50-local.conf", ["../x.conf"], ["a/b.conf"], ["x.service"],
                                   [".hidden.conf"], [1], {"a.conf": 1}])
def test_bad_allowed_dropins_name_key_value_and_what_is_allowed(value):
    with pytest.raises(SettingsError) as err:
        from_host_data("gpu1", {"gpuhost_allowed_dropins": value})
    assert str(err.value).startswith(f"host gpu1: gpuhost_allowed_dropins = {value!r} is not "
                                     "allowed: a list of drop-in file names under "
                                     "/etc/systemd/system/sglang.service.d/")
