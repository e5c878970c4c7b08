"""State gpuhost repairs rather than trusts: p2p.env from the recorded measurement, drop-ins of
the server unit that gpuhost does not own, and the host data key that allows some."""

import json

import pytest

from operations import p2p, p2p_policy


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
