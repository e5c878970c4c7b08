"""Host data that must not get through: values that would reach a shell, a unit file or an
environment file as something else, flags that would override what gpuhost renders, and the
spellings of keys and addresses that would otherwise slip by (found by trying to break it)."""

import pytest

from operations.plans.settings import SettingsError, for_inventory, from_host_data

LOCK = "locks/cuda12.8.txt"


def settings(**data):
    return from_host_data("gpu1", {"gpuhost_lock": LOCK, **data})


@pytest.mark.parametrize(("extra", "shown", "means"), [
    (["--host", "0.0.0.0"], "--host", "--host"),
    (["--ho", "0.0.0.0"], "--ho", "--host"),
    (["--host=0.0.0.0"], "--host=0.0.0.0", "--host"),
    (["--port", "9000"], "--port", "--port"),
    (["--tp-size", "3"], "--tp-size", "--tensor-parallel-size"),
    (["--model-path", "/etc"], "--model-path", "--model-path"),
    (["--served-model-name", "other"], "--served-model-name", "--served-model-name"),
    (["--disable-custom-all-reduce"], "--disable-custom-all-reduce",
     "--disable-custom-all-reduce"),
])
def test_extra_args_cannot_override_what_gpuhost_renders(extra, shown, means):
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_server_extra_args=extra)
    assert f"no flag gpuhost sets itself ({shown} is {means}," in str(err.value)


@pytest.mark.parametrize("extra", [["--api-key=s3cr3t-value"], ["--api-ke", "s3cr3t-value"],
                                   ["--admin-api-key=s3cr3t-value"], ["--api-key", "s3cr3t-value"]])
def test_no_api_key_flag_in_any_spelling_and_the_key_is_not_repeated(extra):
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_server_extra_args=extra)
    assert "is not allowed: no API key flag" in str(err.value)
    assert "s3cr3t-value" not in str(err.value)


def test_other_extra_args_still_pass():
    s = settings(gpuhost_server_extra_args=["--chunked-prefill-size", "4096"])
    assert s.server_extra_args == ("--chunked-prefill-size", "4096")


@pytest.mark.parametrize(("key", "value"), [
    ("server_extra_args", ["--chat-template=a\nExecStartPre=/bin/touch /tmp/x"]),
    ("server_env", {"FOO": "1\nLD_PRELOAD=/tmp/evil.so"}),
    ("server_env", {"FOO": "x\x00y"}),
    ("cuda_repo_url", "https://example.com/repos\n"),
    ("served_model_name", "glm\t5"),
])
def test_control_characters_are_refused(key, value):
    with pytest.raises(SettingsError, match=f"gpuhost_{key} = .* is not allowed: a value "
                                            "without control characters"):
        settings(**{f"gpuhost_{key}": value})


@pytest.mark.parametrize(("key", "value", "allowed"), [
    ("venv_path", "/opt/$(touch${IFS}/tmp/pwned)", "an absolute path (letters"),
    ("venv_path", "/opt/`id`", "an absolute path (letters"),
    ("venv_path", "/opt/%h/venv", "an absolute path (letters"),
    ("venv_path", "/usr", "outside the system's folders"),
    ("venv_path", "/opt/../etc", "no '.' or '..' part"),
    ("venv_path", "/opt/venv/", "no trailing slash"),
    ("venv_path", "/opt/gpuhost/lib", "gpuhost's"),
    ("model_dir", "/opt/a b", "an absolute path (letters"),
    ("model", "../../../etc", "a Hugging Face repository id"),
    ("model", "org/name/", "a Hugging Face repository id"),
    ("model", "org/a%zb", "a Hugging Face repository id"),
    ("model_revision", "main/../../x", "a branch, tag or commit sha"),
    ("api_key_file", "/root/key;id", "an absolute path on the host"),
    ("server_env", {"A": "x\\", "B": "y"}, "without backslashes"),
    ("cuda_repo_url", "https://example.com/repos ", "without a trailing slash"),
    ("cuda_repo_url", "http:///a", "an http(s) URL"),
    ("server_host", "fe80::1%eth0", "an IP address"),
    ("server_host", 2130706433, "an IP address"),
    ("server_host", True, "an IP address"),
    ("server_host", b"\x7f\x00\x00\x01", "an IP address"),
])
def test_values_that_would_reach_a_shell_or_a_unit_as_something_else(key, value, allowed):
    with pytest.raises(SettingsError) as err:
        settings(**{f"gpuhost_{key}": value})
    assert f"gpuhost_{key} = " in str(err.value) and allowed in str(err.value)


def test_usual_values_still_pass():
    s = settings(gpuhost_venv_path="/srv/ml/venv-2", gpuhost_model="Qwen/Qwen3-8B",
                 gpuhost_model_dir="/data/models", gpuhost_model_revision="refs/pr/1",
                 gpuhost_hf_token_file="/root/.config/hf_token",
                 gpuhost_pip_index_url="https://mirror.example/simple?token=abc&arch=x86_64")
    assert s.model_path == "/data/models/Qwen/Qwen3-8B"
    assert settings(gpuhost_model="gpt2").model == "gpt2"


def test_the_index_url_and_the_venv_are_quoted_for_the_shell():
    from pyinfra.context import ctx_host, ctx_state
    from pyinfra_testing.util import FakeState, create_host

    from operations.stages.venv_install import locked_packages

    state = FakeState()
    host = create_host(state, name="gpu1", facts={"venv_facts.VenvPackages": {"venv=/opt/v": {}}})
    with ctx_state.use(state), ctx_host.use(host):
        (command,) = list(locked_packages._inner(
            venv="/opt/v", requirements="/opt/gpuhost/lock/stack.txt", wanted={"a": "1"},
            index_url="https://m.example/simple?x=1&y=2"))
    assert "--index-url 'https://m.example/simple?x=1&y=2'" in str(command)


@pytest.mark.parametrize(("key", "value", "as_text"), [
    ("driver_branch", 580, "580"), ("cuda_toolkit", 12.8, "12.8"),
    ("compute_capability", 12.0, "12.0"),
])
def test_numbers_typed_with_pyinfra_data_are_taken_as_typed(key, value, as_text):
    assert getattr(settings(**{f"gpuhost_{key}": value}), key) == as_text


@pytest.mark.parametrize("key", ["GPUHOST_gpu_count", "gpuhots_gpu_count", "gpu_host_gpu_count",
                                 "gpuhost-gpu_count", "gpuhostgpu_count", "Gpuhost_Gpu_Count"])
def test_a_misspelt_prefix_is_named(key):
    with pytest.raises(SettingsError, match=f"unknown key {key}: did you mean gpuhost_gpu_count?"):
        settings(**{key: 4})


def test_keys_must_be_strings():
    with pytest.raises(SettingsError, match="host data key 1 is not allowed: keys are strings"):
        from_host_data("gpu1", {"gpuhost_lock": LOCK, 1: 2})


def test_a_lock_that_is_not_text(tmp_path):
    lock = tmp_path / "bin.txt"
    lock.write_bytes(b"\xff\xfe")
    with pytest.raises(SettingsError, match="not UTF-8"):
        from_host_data("gpu1", {"gpuhost_lock": str(lock)})


@pytest.mark.parametrize(("a", "b"), [
    (("gpu1", {"ssh_hostname": "GPU1.lab"}), ("gpu2", {"ssh_hostname": "gpu1.lab"})),
    (("gpu1", {"ssh_hostname": "gpu1.lab"}), ("gpu2", {"ssh_hostname": "gpu1.lab."})),
    (("gpu1", {"ssh_hostname": " 10.0.0.1"}), ("gpu2", {"ssh_hostname": "10.0.0.1"})),
    (("gpu1", {"ssh_hostname": "2001:db8::1"}), ("gpu2", {"ssh_hostname": "2001:DB8:0::1"})),
    (("gpu1", {"ssh_hostname": "192.0.2.10"}), ("@ssh/192.0.2.10", {})),
])
def test_one_machine_in_two_spellings(a, b):
    with pytest.raises(SettingsError, match="both claim the address"):
        for_inventory([(a[0], {"gpuhost_lock": LOCK, **a[1]}),
                       (b[0], {"gpuhost_lock": LOCK, **b[1]})])


def test_one_address_two_ports_are_two_machines():
    hosts = for_inventory([
        ("gpu1", {"gpuhost_lock": LOCK, "ssh_hostname": "nat.lab", "ssh_port": 2201}),
        ("gpu2", {"gpuhost_lock": LOCK, "ssh_hostname": "nat.lab", "ssh_port": 2202}),
    ])
    assert set(hosts) == {"gpu1", "gpu2"}


def test_a_toolkit_of_another_cuda_major_than_the_locked_torch():
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_cuda_toolkit="13.0")
    assert ("gpuhost_cuda_toolkit = '13.0' is not allowed: a CUDA 12.x toolkit: the locked torch "
            "2.9.1 is built for CUDA 12.8") in str(err.value)


@pytest.mark.parametrize("name", ["HF_HUB_OFFLINE", "PATH", "CUDA_HOME", "NCCL_P2P_LEVEL",
                                  "GPUHOST_P2P_SERVER_ARGS"])
def test_server_env_cannot_name_what_gpuhost_sets(name):
    with pytest.raises(SettingsError, match="naming none of what gpuhost sets itself"):
        settings(gpuhost_server_env={name: "0"})
    assert settings(gpuhost_server_env={"NCCL_DEBUG": "INFO"}).server_env == {"NCCL_DEBUG": "INFO"}


@pytest.mark.parametrize(("data", "extra", "shown", "means", "key"), [
    # The tester's bypass: the key null, the flag abbreviated in extra args.
    ({"gpuhost_moe_runner_backend": None}, ["--moe-runner-b", "flashinfer_trtllm"],
     "--moe-runner-b", "--moe-runner-backend", "gpuhost_moe_runner_backend"),
    ({"gpuhost_moe_runner_backend": None}, ["--moe-runner-backend=flashinfer_trtllm"],
     "--moe-runner-backend=flashinfer_trtllm", "--moe-runner-backend",
     "gpuhost_moe_runner_backend"),
    ({"gpuhost_fp4_gemm_backend": None}, ["--fp4-gemm-b", "flashinfer_trtllm"],
     "--fp4-gemm-b", "--fp4-gemm-backend", "gpuhost_fp4_gemm_backend"),
    ({"gpuhost_quantization": None}, ["--quantization=fp8"], "--quantization=fp8",
     "--quantization", "gpuhost_quantization"),
    ({"gpuhost_reasoning_parser": None}, ["--reasoning-parser", "glm45"], "--reasoning-parser",
     "--reasoning-parser", "gpuhost_reasoning_parser"),
    ({"gpuhost_trust_remote_code": False}, ["--trust-remote"], "--trust-remote",
     "--trust-remote-code", "gpuhost_trust_remote_code"),
    ({"gpuhost_enable_flashinfer_allreduce_fusion": False},
     ["--enable-flashinfer-allreduce-fusion"], "--enable-flashinfer-allreduce-fusion",
     "--enable-flashinfer-allreduce-fusion", "gpuhost_enable_flashinfer_allreduce_fusion"),
])
def test_extra_args_cannot_name_a_flag_a_key_owns_even_when_the_key_is_unset(
        data, extra, shown, means, key):
    with pytest.raises(SettingsError) as err:
        settings(**data, gpuhost_server_extra_args=extra)
    message = str(err.value)
    assert f"no flag gpuhost sets itself ({shown} is {means}, which {key} owns, set or not" \
        in message
    assert f"set {key} instead" in message
    assert message.startswith("host gpu1: gpuhost_server_extra_args = ")


def test_every_flag_gpuhost_renders_is_owned_by_a_key():
    from operations.plans.settings import Settings
    from operations.plans.sglang import (
        ALWAYS_FLAGS,
        OWNED_FLAGS,
        flags_named,
        load_parser_spec,
        server_args,
    )

    spec = load_parser_spec("0.5.9")
    every = Settings(quantization="modelopt_fp4", attention_backend="flashinfer",
                     fp8_gemm_backend="cutlass", fp4_gemm_backend="flashinfer_cutlass",
                     nsa_decode_backend="trtllm", nsa_prefill_backend="trtllm",
                     moe_runner_backend="flashinfer_cutlass", reasoning_parser="glm45",
                     tool_call_parser="glm47", trust_remote_code=True,
                     enable_flashinfer_allreduce_fusion=True, speculative_algorithm="NEXTN",
                     server_extra_args=())
    owned = {arg.flags for _, arg in flags_named([*OWNED_FLAGS, *ALWAYS_FLAGS], spec)}
    rendered = {arg.flags for _, arg in flags_named(server_args(every), spec)}
    assert rendered <= owned
    assert all(k in Settings.__dataclass_fields__ for keys in OWNED_FLAGS.values() for k in keys)


@pytest.mark.parametrize("extra", [["--enable-metrics"], ["--log-level", "info", "--enable-metrics"]])
def test_extra_args_may_not_name_the_metrics_flag_every_server_gets(extra):
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_server_extra_args=extra)
    assert "no flag gpuhost sets itself (--enable-metrics is --enable-metrics, which every server " \
        "gets): leave it out" in str(err.value)


@pytest.mark.parametrize("text", ["None", "null"])
def test_the_text_none_for_an_optional_key_says_how_to_leave_it_unset(text):
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_moe_runner_backend=text)
    message = str(err.value)
    assert message.startswith(f"host gpu1: gpuhost_moe_runner_backend = {text!r} is not "
                              "allowed: a MoE runner backend name, or None to leave it unset")
    assert "in --data write null: None there is the text 'None'" in message
    assert "allows only" not in message
