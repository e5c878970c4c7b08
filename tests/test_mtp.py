"""MTP (speculative decoding) by host data: the keys, their flags and SPEC_V2 in the server's
environment, refused where the locked sglang lacks the flags or the checkpoint its MTP layer
(read from its weight index, as the sandbox hub's two repositories hold it)."""

import json
from dataclasses import replace

import pytest

from operations.plans import settings as settings_module
from operations.plans import settings_checks
from operations.plans.settings import SettingsError, from_host_data
from operations.plans.sglang import ArgSpec, load_parser_spec, server_args
from operations.stages.server_unit import server_env
from operations.files.model_config import WEIGHT_INDEX, missing_mtp, mtp_layer
from sandbox import hub

LOCK = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


@pytest.fixture
def lock(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(LOCK)
    return str(path)


def settings(lock, **data):
    return from_host_data("gpu1", {"gpuhost_lock": lock, **data})


def files(mtp):
    return {f.path: f.data.decode() for f in hub.repository(mtp=mtp)
            if f.path in ("config.json", WEIGHT_INDEX)}


def test_the_hub_standins_have_and_lack_the_mtp_layer_as_the_field_checkpoints_do():
    with_layer, without = files(True), files(False)
    # both configs name the NextN layer (GLM-5's config.json does); only one index maps it
    assert json.loads(without["config.json"])["num_nextn_predict_layers"] == 1
    assert mtp_layer(without["config.json"]) == 2
    assert missing_mtp(with_layer["config.json"], with_layer[WEIGHT_INDEX], "m") is None
    assert missing_mtp(without["config.json"], without[WEIGHT_INDEX], "m") == (
        f"m/{WEIGHT_INDEX} has no tensor of the MTP layer (model.layers.2.*: config.json's "
        "num_hidden_layers is 2)")


@pytest.mark.parametrize(("config", "layer"), [
    ({"num_hidden_layers": 78, "num_nextn_predict_layers": 1}, 78),  # GLM-5
    ({"num_hidden_layers": 1, "num_nextn_predict_layers": 1}, 0),
    ({"num_hidden_layers": 78}, None), ({"num_hidden_layers": 78, "num_nextn_predict_layers": 2},
                                        None)])
def test_the_mtp_layer_is_where_sglang_loads_it(config, layer):
    assert mtp_layer(json.dumps(config)) == layer


def test_no_index_or_no_nextn_layer_is_no_mtp():
    config = json.dumps({"num_hidden_layers": 78, "num_nextn_predict_layers": 1})
    assert "has no model.safetensors.index.json" in missing_mtp(config, None, "m")
    assert "names no MTP layer" in missing_mtp("{}", "{}", "m")


def test_nextn_renders_the_flags_and_spec_v2(lock):
    s = settings(lock, gpuhost_speculative_algorithm="NEXTN", gpuhost_speculative_num_steps=3,
                 gpuhost_speculative_num_draft_tokens=4)
    args = server_args(s)
    at = args.index("--speculative-algorithm")
    assert args[at:at + 8] == ["--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3",
                               "--speculative-eagle-topk", "1",
                               "--speculative-num-draft-tokens", "4"]
    assert server_env(s)["SGLANG_ENABLE_SPEC_V2"] == "True"
    off = settings(lock)
    assert not [a for a in server_args(off) if a.startswith("--speculative")]
    assert "SGLANG_ENABLE_SPEC_V2" not in server_env(off)


@pytest.mark.parametrize(("data", "message"), [
    ({"gpuhost_speculative_algorithm": "EAGLE"},
     "gpuhost_speculative_algorithm = 'EAGLE' is not allowed: one of NEXTN, or None"),
    ({"gpuhost_speculative_algorithm": "NEXTN", "gpuhost_speculative_eagle_topk": 2},
     "gpuhost_speculative_eagle_topk = 2 is not allowed: 1 (sglang 0.5.9 with "
     "SGLANG_ENABLE_SPEC_V2"),
    ({"gpuhost_speculative_algorithm": "NEXTN", "gpuhost_speculative_num_steps": None},
     "gpuhost_speculative_eagle_topk = 1 is not allowed: None with "
     "gpuhost_speculative_num_steps None"),
    ({"gpuhost_server_env": {"SGLANG_ENABLE_SPEC_V2": "False"}},
     "gpuhost_server_env = {'SGLANG_ENABLE_SPEC_V2': 'False'} is not allowed"),
    ({"gpuhost_server_extra_args": ["--speculative-algorithm", "NEXTN"]},
     "which gpuhost_speculative_algorithm owns"),
])
def test_bad_mtp_data_is_refused_naming_key_value_and_what_is_allowed(lock, data, message):
    with pytest.raises(SettingsError) as err:
        settings(lock, **data)
    assert message in str(err.value)


def test_a_locked_sglang_without_the_flags_refuses_mtp(lock, monkeypatch):
    real = load_parser_spec("0.5.9")
    bare = replace(real, arguments=tuple(a for a in real.arguments
                                         if not a.flags[0].startswith("--speculative")))
    for module in (settings_module, settings_checks):  # the profile's choice, the checks
        monkeypatch.setattr(module, "load_parser_spec", lambda version: bare)
    assert settings(lock).speculative_algorithm is None  # MTP off: nothing to refuse
    with pytest.raises(SettingsError) as err:
        settings(lock, gpuhost_speculative_algorithm="NEXTN")
    assert ("gpuhost_speculative_algorithm = 'NEXTN' is not allowed: None: the locked sglang "
            "0.5.9 has no --speculative-algorithm") in str(err.value)


def test_a_locked_sglang_without_nextn_refuses_it(lock, monkeypatch):
    real = load_parser_spec("0.5.9")
    fewer = replace(real, arguments=tuple(
        ArgSpec(a.flags, a.action, ("EAGLE",), a.nargs, a.type)
        if a.flags[0] == "--speculative-algorithm" else a for a in real.arguments))
    for module in (settings_module, settings_checks):  # the profile's choice, the checks
        monkeypatch.setattr(module, "load_parser_spec", lambda version: fewer)
    with pytest.raises(SettingsError) as err:
        settings(lock, gpuhost_speculative_algorithm="NEXTN")
    assert "offers EAGLE for --speculative-algorithm" in str(err.value)
