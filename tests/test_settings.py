"""Host data validation: every bad value names the host, the key, the value and what is
allowed."""

import pytest

from operations.plans.settings import Settings, SettingsError, for_inventory, from_host_data

LOCK = "sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n"


@pytest.fixture
def lock(tmp_path):
    path = tmp_path / "lock.txt"
    path.write_text(LOCK)
    return str(path)


def settings(lock, **data):
    return from_host_data("gpu1", {"gpuhost_lock": lock, **data})


def test_defaults_are_the_field_profile_for_sglang_059(lock):
    # The default is the best launch profile the locked sglang 0.5.9 accepts
    # (operations/plans/launch_profiles.py): the field's GLM-5 launch on SM120 with 0.5.9's own FP4
    # GEMM backend (0.5.9 has no --fp4-gemm-backend cutlass).
    s = settings(lock)
    assert s.launch_profile == "field-glm5-sm120-sglang0.5.9"
    assert s.tensor_parallel_size == 8 and s.gpu_count == 8
    assert s.mem_fraction_static == 0.85
    assert s.moe_runner_backend == "cutlass"
    # An FP8 KV cache gives garbled output on SM120 (voipmonitor/rtx6kpro models/glm5.md).
    assert s.kv_cache_dtype == "bf16"
    assert s.fp4_gemm_backend == "flashinfer_cutlass"
    assert s.model_architecture == "GlmMoeDsaForCausalLM"
    assert s.nsa_decode_backend == s.nsa_prefill_backend == "trtllm"
    assert s.server_env["SGLANG_ENABLE_JIT_DEEPGEMM"] == "0"
    assert s.speculative_algorithm is None
    assert s.cuda_home == "/usr/local/cuda-12.8"
    assert s.cuda_arch == "120"
    assert s.server_host == "127.0.0.1"


def test_the_reference_lab_profile_is_its_hand_made_launch(lock):
    s = settings(lock, gpuhost_launch_profile="reference-lab")
    assert s.mem_fraction_static == 0.92
    # The measured baseline's MoE runner backend, not the last launch's experiment
    # (../shared/reference-lab.md): flashinfer_trtllm has no SM12x kernels.
    assert s.moe_runner_backend == "flashinfer_cutlass"
    # What the reference launch's auto resolved to for GLM-5 on SM120 (sglang 0.5.9's
    # _set_default_nsa_kv_cache_dtype), and sglang 0.5.9's FP4 GEMM default, both explicit.
    assert s.kv_cache_dtype == "fp8_e4m3"
    assert s.fp4_gemm_backend == "flashinfer_cutlass"
    assert s.server_extra_args == ()
    assert dict(s.server_env) == {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1"}


def test_pyinfra_keys_are_left_alone(lock):
    s = settings(lock, ssh_hostname="10.0.0.1", _sudo=True, ssh_user="root")
    assert isinstance(s, Settings)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpuhost_tensor_paralel_size": 8},
         "unknown key gpuhost_tensor_paralel_size: did you mean gpuhost_tensor_parallel_size?"),
        ({"tensor_parallel_size": 8}, "unknown key tensor_parallel_size: did you mean "
                                      "gpuhost_tensor_parallel_size?"),
        ({"gpuhost_tensor_parallel_size": "8"},
         "gpuhost_tensor_parallel_size = '8' is not allowed: an integer from 1 to 64"),
        ({"gpuhost_tensor_parallel_size": 3},
         "gpuhost_tensor_parallel_size = 3 is not allowed: a divisor of gpuhost_gpu_count (8): "
         "1, 2, 4, 8"),
        ({"gpuhost_tensor_parallel_size": 16},
         "gpuhost_tensor_parallel_size = 16 is not allowed: a divisor"),
        ({"gpuhost_trust_remote_code": "yes"},
         "gpuhost_trust_remote_code = 'yes' is not allowed: True or False"),
        ({"gpuhost_mem_fraction_static": 1.2},
         "gpuhost_mem_fraction_static = 1.2 is not allowed: a float strictly between 0 and 1"),
        ({"gpuhost_mem_fraction_static": 0},
         "gpuhost_mem_fraction_static = 0 is not allowed"),
        ({"gpuhost_server_port": 70000},
         "gpuhost_server_port = 70000 is not allowed: an integer from 1 to 65535"),
        ({"gpuhost_served_model_name": ""},
         "gpuhost_served_model_name = '' is not allowed: a name of letters"),
        ({"gpuhost_driver_branch": "535"},
         "gpuhost_driver_branch = '535' is not allowed: with gpuhost_cuda_toolkit = '12.8', a "
         "branch that supports CUDA 12.8 "
         "(driver >= 570.26): 570, 575, 580, 590"),
        ({"gpuhost_driver_branch": "999"},
         "gpuhost_driver_branch = '999' is not allowed: one of 535, 550, 560, 565, 570, 575, "
         "580, 590"),
        ({"gpuhost_driver_flavour": "proprietary"},
         "gpuhost_driver_flavour = 'proprietary' is not allowed: only 'open' on compute "
         "capability 12.0"),
        ({"gpuhost_driver_flavour": "closed"},
         "gpuhost_driver_flavour = 'closed' is not allowed: one of open, proprietary"),
        ({"gpuhost_driver_version": "580.x"},
         "gpuhost_driver_version = '580.x' is not allowed: a driver version"),
        ({"gpuhost_driver_version": "570.172.08"},
         "gpuhost_driver_version = '570.172.08' is not allowed: a version of driver branch 580"),
        ({"gpuhost_cuda_toolkit": "12.4"},
         "gpuhost_cuda_toolkit = '12.4' is not allowed: one of 12.8, 13.0"),
        ({"gpuhost_cuda_toolkit": "13.0", "gpuhost_driver_branch": "570"},
         "gpuhost_driver_branch = '570' is not allowed: with gpuhost_cuda_toolkit = '13.0', a "
         "branch that supports CUDA 13.0 (driver >= 580.65.06): 580, 590; or "
         "gpuhost_cuda_toolkit = '12.8'."),
        ({"gpuhost_compute_capability": "sm120"},
         "gpuhost_compute_capability = 'sm120' is not allowed: a compute capability"),
        ({"gpuhost_server_host": "everywhere"},
         "gpuhost_server_host = 'everywhere' is not allowed: an IP address"),
        ({"gpuhost_server_local_users": ["root"]},
         "gpuhost_server_local_users = ['root'] is not allowed: a list of local user names"),
        ({"gpuhost_server_local_users": ["alice", "alice"]},
         "gpuhost_server_local_users = ['alice', 'alice'] is not allowed: a list of local user "
         "names, each once"),
        ({"gpuhost_server_local_users": ["Alice; rm -rf /"]}, "gpuhost_server_local_users"),
        ({"gpuhost_server_local_users": "alice"},
         "gpuhost_server_local_users = 'alice' is not allowed: a list of local user names"),
        ({"gpuhost_server_local_users": ["alice"], "gpuhost_server_host": "10.0.0.5",
          "gpuhost_api_key_file": "/etc/gpuhost/api.key"},
         "gpuhost_server_local_users = ['alice'] is not allowed: no users with "
         "gpuhost_server_host = '10.0.0.5'"),
        ({"gpuhost_server_env": {"nccl_debug": "INFO"}},
         "gpuhost_server_env = {'nccl_debug': 'INFO'} is not allowed"),
        ({"gpuhost_p2p_override": "maybe"},
         "gpuhost_p2p_override = 'maybe' is not allowed: one of on, off, or None"),
        ({"gpuhost_max_jobs": 0}, "gpuhost_max_jobs = 0 is not allowed: an integer >= 1"),
        ({"gpuhost_proxy": "proxy.lab:3128"}, "gpuhost_proxy = 'proxy.lab:3128' is not allowed: "
         "an http:// or https:// URL of a proxy with a host and a port"),
        ({"gpuhost_proxy": "socks5://proxy.lab:1080"},
         "gpuhost_proxy = 'socks5://proxy.lab:1080' is not allowed: an http:// or https://"),
        ({"gpuhost_proxy": "http://proxy.lab"}, "gpuhost_proxy = 'http://proxy.lab' is not "
         "allowed: an http:// or https:// URL of a proxy with a host and a port"),
        ({"gpuhost_proxy": "http://u:pw@proxy.lab:3128"}, "with no user or password"),
        ({"gpuhost_lock": "locks/nope.txt"},
         "gpuhost_lock = 'locks/nope.txt' is not allowed: an existing lock file"),
    ],
)
def test_bad_host_data(lock, data, message):
    with pytest.raises(SettingsError) as err:
        settings(lock, **data)
    assert str(err.value).startswith("host gpu1: ")
    assert message in str(err.value)


def test_local_users_of_a_loopback_server(lock):
    s = settings(lock, gpuhost_server_local_users=["alice", "_svc-bench"])
    assert s.server_local_users == ("alice", "_svc-bench")


def test_driver_version_of_the_branch(lock):
    s = settings(lock, gpuhost_driver_version="580.95.05")
    assert s.driver_version == "580.95.05"


def test_proprietary_allowed_before_blackwell(lock):
    s = settings(lock, gpuhost_compute_capability="9.0", gpuhost_driver_flavour="proprietary")
    assert s.driver_flavour == "proprietary"


def test_inventory_stops_on_first_bad_host(lock):
    good = {"gpuhost_lock": lock}
    with pytest.raises(SettingsError, match="host b: "):
        for_inventory([("a", good), ("b", {**good, "gpuhost_gpu_count": 0})])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpuhost_moe_runner_backend": "flashinfer_magic"},
         "--moe-runner-backend flashinfer_magic: sglang 0.5.9 allows only auto, deep_gemm"),
        ({"gpuhost_server_extra_args": ["--dsa-decode-backend", "trtllm"]},
         "sglang 0.5.9 has no flag --dsa-decode-backend; sglang 0.5.9 calls it "
         "--nsa-decode-backend"),
        ({"gpuhost_server_extra_args": ["--cuda-graph-max-bs"]},
         "--cuda-graph-max-bs needs a value (sglang 0.5.9)"),
        ({"gpuhost_server_extra_args": ["--enable-torch-compile=yes"]},
         "--enable-torch-compile takes no value"),
        ({"gpuhost_tool_call_parser": "glm99"}, "--tool-call-parser glm99: sglang 0.5.9 allows"),
    ],
)
def test_server_flags_checked_against_the_locked_sglang(lock, data, message):
    with pytest.raises(SettingsError, match="do not fit the locked sglang") as err:
        settings(lock, **data)
    assert message in str(err.value)


def test_flags_for_a_newer_sglang_name_the_replacement(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.23 --hash=sha256:" + "0" * 64 + "\n")
    with pytest.raises(SettingsError, match="sglang 0.5.23 has no flag --nsa-decode-backend; "
                                            "its replacement is --dsa-decode-backend"):
        from_host_data("gpu1", {"gpuhost_lock": str(lock)})


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("sglang>=0.5 --hash=sha256:00\n", "is not pinned with =="),
        ("sglang==0.5.9\n", "sglang has no --hash"),
        ("this is not a requirement\n", "is not a requirement"),
        ("", "no requirements in it"),
        ("torch==2.9.1 --hash=sha256:00\n", "a lock that pins sglang"),
    ],
)
def test_bad_lock(tmp_path, text, message):
    lock = tmp_path / "lock.txt"
    lock.write_text(text)
    with pytest.raises(SettingsError, match="gpuhost_lock") as err:
        from_host_data("gpu1", {"gpuhost_lock": str(lock)})
    assert message in str(err.value)


def test_two_hosts_one_address(lock):
    a = {"gpuhost_lock": lock, "ssh_hostname": "10.0.0.5"}
    with pytest.raises(SettingsError, match="hosts a and b both claim the address 10.0.0.5"):
        for_inventory([("a", a), ("b", dict(a))])


def test_reference_has_a_section_for_every_key():
    """docs/reference.md, generated from the settings (tests/test_docs.py checks it whole)."""
    from pathlib import Path

    from operations.plans.settings import RULES

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference.md").read_text()
    missing = [key for key in RULES if f"### `gpuhost_{key}`" not in page]
    assert missing == []


def test_every_host_is_validated_once_a_run(monkeypatch):
    """pyinfra executes deploy.py once per host: the inventory's settings are validated at the
    first host's, reused by the others, and validated again for another inventory."""
    import types

    import pyinfra

    from operations.plans import settings as module

    validated = []

    def for_inventory(pairs, sources):
        names = [name for name, _ in pairs]
        validated.append(names)
        return {name: object() for name in names}

    class Host:
        def __init__(self, name):
            self.name, self.data = name, types.SimpleNamespace(dict=dict)

    inventory = [Host("gpu1"), Host("gpu2")]
    state = types.SimpleNamespace(cwd=".")
    monkeypatch.setattr(module, "for_inventory", for_inventory)
    monkeypatch.setattr(module, "data_sources", lambda *args: {})
    monkeypatch.setattr(module, "notes", lambda settings: [])
    monkeypatch.setattr(pyinfra, "state", state)
    for current in inventory:
        monkeypatch.setattr(pyinfra, "host", current)
        assert set(module.for_run(inventory)) == {"gpu1", "gpu2"}
    assert validated == [["gpu1", "gpu2"]]
    module.for_run([Host("gpu3")])
    assert validated == [["gpu1", "gpu2"], ["gpu3"]]
