"""P2P host data: gpuhost_p2p_override, gpuhost_p2p_remeasure, gpuhost_p2p_check_timeout."""

import pytest

from operations.plans.settings import SettingsError, from_host_data

LOCK = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


@pytest.fixture
def settings(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(LOCK)

    def build(**data):
        return from_host_data("gpu1", {"gpuhost_lock": str(path), **data})

    return build


def test_defaults(settings):
    s = settings()
    assert (s.p2p_override, s.p2p_remeasure, s.p2p_check_timeout) == (None, False, 120)


@pytest.mark.parametrize("value", ["on", "off", None])
def test_allowed_overrides(settings, value):
    assert settings(gpuhost_p2p_override=value).p2p_override == value


ONE_OF = ("one of on, off, or None to leave it unset (None in a Python inventory; in --data "
          "write null: None there is the text 'None')")


@pytest.mark.parametrize(
    ("key", "value", "allowed"),
    [
        ("gpuhost_p2p_override", "yes", ONE_OF),
        ("gpuhost_p2p_override", "ON", ONE_OF),
        ("gpuhost_p2p_override", True, ONE_OF),
        ("gpuhost_p2p_remeasure", "true", "True or False"),
        ("gpuhost_p2p_check_timeout", 5, "an integer from 10 to 3600"),
    ],
)
def test_bad_values_name_host_key_value_and_what_is_allowed(settings, key, value, allowed):
    with pytest.raises(SettingsError) as exc:
        settings(**{key: value})
    assert str(exc.value) == f"host gpu1: {key} = {value!r} is not allowed: {allowed}."
