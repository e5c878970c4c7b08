"""Server host data refused before any host is touched: each message names the key, the value
and what is allowed."""

import pytest

from operations.plans.settings import SettingsError, from_host_data
from sandbox.pypi_index import REAL_WHEELS

LOCK = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


@pytest.fixture
def settings(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text(LOCK)
    return lambda **data: from_host_data("gpu1", {"gpuhost_lock": str(lock), **data})


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpuhost_server_port": 0},
         "gpuhost_server_port = 0 is not allowed: an integer from 1 to 65535"),
        ({"gpuhost_server_port": 65536},
         "gpuhost_server_port = 65536 is not allowed: an integer from 1 to 65535"),
        ({"gpuhost_served_model_name": ""},
         "gpuhost_served_model_name = '' is not allowed: a name of letters"),
        ({"gpuhost_mem_fraction_static": 1.0},
         "gpuhost_mem_fraction_static = 1.0 is not allowed: a float strictly between 0 and 1"),
        ({"gpuhost_mem_fraction_static": 0.0},
         "gpuhost_mem_fraction_static = 0.0 is not allowed: a float strictly between 0 and 1"),
        ({"gpuhost_server_host": "0.0.0.0"},
         ("gpuhost_server_host = '0.0.0.0' is not allowed: a loopback address (127.0.0.1, ::1), "
          "or set gpuhost_api_key_file")),
        ({"gpuhost_server_host": "10.0.0.5"},
         "gpuhost_server_host = '10.0.0.5' is not allowed: a loopback address"),
        ({"gpuhost_server_host": "0.0.0.0", "gpuhost_api_key_file": "/root/key",
          "gpuhost_server_backend_port": 8000},
         ("gpuhost_server_backend_port = 8000 is not allowed: a port other than "
          "gpuhost_server_port (8000)")),
        ({"gpuhost_server_extra_args": ["--api-key", "sekrit"]},
         "gpuhost_server_extra_args = ['--api-key', '<hidden>'] is not allowed: no API key flag"),
        ({"gpuhost_hf_token_file": "hf_token"},
         "gpuhost_hf_token_file = 'hf_token' is not allowed: an absolute path on the host"),
        ({"gpuhost_api_key_file": "key"},
         "gpuhost_api_key_file = 'key' is not allowed: an absolute path on the host"),
        ({"gpuhost_server_start_timeout": 5},
         "gpuhost_server_start_timeout = 5 is not allowed: an integer from 60 to 604800"),
        ({"gpuhost_hf_endpoint": "huggingface.co"},
         "gpuhost_hf_endpoint = 'huggingface.co' is not allowed: an http(s) URL"),
    ],
)
def test_bad_server_data(settings, data, message):
    with pytest.raises(SettingsError) as exc:
        settings(**data)
    assert message in str(exc.value)
    assert str(exc.value).startswith("host gpu1: ")


def test_loopback_needs_no_key(settings):
    assert not settings(gpuhost_server_host="::1").server_is_public
    public = settings(gpuhost_server_host="0.0.0.0", gpuhost_api_key_file="/root/key")
    assert public.server_is_public


def test_model_path(settings):
    assert settings().model_path == "/opt/gpuhost/models/lukealonso/GLM-5-NVFP4"
    s = settings(gpuhost_model="/srv/glm5", gpuhost_model_dir="/data/models")
    assert s.model_is_local and s.model_path == "/srv/glm5"
    assert settings(gpuhost_model_dir="/data").model_path == "/data/lukealonso/GLM-5-NVFP4"


def test_sandbox_hub_wheels_are_the_real_locks(tmp_path):
    """The sandbox index serves huggingface_hub and its dependencies as PyPI's files: each
    pinned at the real lock's version, with a sha256 the real lock lists."""
    from operations import REPO_ROOT

    lock = (REPO_ROOT / "locks" / "cuda12.8.txt").read_text()
    names = {w.name for w in REAL_WHEELS}
    assert {"huggingface-hub", "requests", "filelock", "fsspec", "pyyaml", "tqdm"} <= names
    from sandbox.pypi_index import ROUTER_PROJECTS

    for wheel in (w for w in REAL_WHEELS if w.name not in ROUTER_PROJECTS):  # locks/router.txt's
        assert f"{wheel.name}=={wheel.version} " in lock, wheel.name
        assert f"--hash=sha256:{wheel.sha256}" in lock, wheel.filename
