"""A catalogue of bad host data: each stops the run with a message naming the key, the value and
what is allowed, exits non-zero, and sends no command to the host (recorded on the host by a
forced command in authorized_keys, not assumed).

Bad secret files (the API key file, the Hub token file) can only be seen on the host: each is
refused while planning, with a message naming the key and the file and never its content, a
non-zero exit, and nothing changed on the host (the run reads facts, then stops)."""

from __future__ import annotations

import base64

import pytest

from tests.e2e import audit, lab

pytestmark = [pytest.mark.e2e]

# (case id, host data merged into the sandbox host's, words the message must contain)
CASES = [
    ("unknown-key-typo", {"gpuhost_tensor_paralel_size": 8},
     ["gpuhost_tensor_paralel_size", "did you mean gpuhost_tensor_parallel_size"]),
    ("unknown-key-unprefixed", {"served_model_name": "glm-5"},
     ["served_model_name", "did you mean gpuhost_served_model_name"]),
    ("unknown-key-far", {"gpuhost_colour": "blue"}, ["gpuhost_colour", "known keys"]),
    ("tp-string", {"gpuhost_tensor_parallel_size": "8"},
     ["gpuhost_tensor_parallel_size", "'8'", "an integer from 1 to 64"]),
    ("tp-not-divisor", {"gpuhost_tensor_parallel_size": 3},
     ["gpuhost_tensor_parallel_size", "= 3", "a divisor of gpuhost_gpu_count (8): 1, 2, 4, 8"]),
    ("tp-above-gpus", {"gpuhost_tensor_parallel_size": 16},
     ["gpuhost_tensor_parallel_size", "= 16", "a divisor"]),
    ("tp-zero", {"gpuhost_tensor_parallel_size": 0},
     ["gpuhost_tensor_parallel_size", "= 0", "an integer from 1 to 64"]),
    ("gpu-count-bool", {"gpuhost_gpu_count": True}, ["gpuhost_gpu_count", "True", "an integer"]),
    ("moe-backend", {"gpuhost_moe_runner_backend": "flashinfer_magic"},
     ["--moe-runner-backend flashinfer_magic", "sglang 0.5.9 allows only", "flashinfer_trtllm"]),
    ("nsa-backend", {"gpuhost_nsa_decode_backend": "nan_free"},
     ["--nsa-decode-backend nan_free", "allows only", "trtllm"]),
    ("attention-backend", {"gpuhost_attention_backend": "magic"},
     ["--attention-backend magic", "allows only"]),
    ("tool-parser", {"gpuhost_tool_call_parser": "glm99"}, ["--tool-call-parser glm99", "glm47"]),
    ("renamed-flag", {"gpuhost_server_extra_args": ["--dsa-decode-backend", "trtllm"]},
     ["--dsa-decode-backend", "calls it --nsa-decode-backend"]),
    ("unknown-flag", {"gpuhost_server_extra_args": ["--warp-speed"]},
     ["--warp-speed", "sglang 0.5.9 has no flag"]),
    ("flag-missing-value", {"gpuhost_server_extra_args": ["--chunked-prefill-size"]},
     ["--chunked-prefill-size needs a value"]),
    ("extra-args-string", {"gpuhost_server_extra_args": "--foo"},
     ["gpuhost_server_extra_args", "'--foo'", "a list of strings"]),
    ("mem-fraction-high", {"gpuhost_mem_fraction_static": 1.5},
     ["gpuhost_mem_fraction_static", "1.5", "strictly between 0 and 1"]),
    ("mem-fraction-zero", {"gpuhost_mem_fraction_static": 0.0},
     ["gpuhost_mem_fraction_static", "0.0", "strictly between 0 and 1"]),
    ("mem-fraction-string", {"gpuhost_mem_fraction_static": "0.9"},
     ["gpuhost_mem_fraction_static", "'0.9'", "a float"]),
    ("port-high", {"gpuhost_server_port": 70000},
     ["gpuhost_server_port", "70000", "an integer from 1 to 65535"]),
    ("port-zero", {"gpuhost_server_port": 0}, ["gpuhost_server_port", "= 0", "from 1 to 65535"]),
    ("served-name-empty", {"gpuhost_served_model_name": ""},
     ["gpuhost_served_model_name", "''", "a name of letters"]),
    ("host-not-ip", {"gpuhost_server_host": "everywhere"},
     ["gpuhost_server_host", "'everywhere'", "an IP address"]),
    ("driver-branch-old", {"gpuhost_driver_branch": "535"},
     ["gpuhost_driver_branch", "'535'", "570, 575, 580, 590"]),
    ("driver-branch-bool", {"gpuhost_driver_branch": True},
     ["gpuhost_driver_branch", "True", "one of"]),
    ("extra-arg-overrides-host", {"gpuhost_server_extra_args": ["--ho", "0.0.0.0"]},
     ["gpuhost_server_extra_args", "'--ho'", "no flag gpuhost sets itself"]),
    ("extra-arg-moe-backend-abbreviated",
     {"gpuhost_moe_runner_backend": None,
      "gpuhost_server_extra_args": ["--moe-runner-b", "flashinfer_trtllm"]},
     ["gpuhost_server_extra_args", "--moe-runner-b is --moe-runner-backend, which "
      "gpuhost_moe_runner_backend owns, set or not"]),
    ("extra-arg-moe-backend-inline",
     {"gpuhost_moe_runner_backend": None,
      "gpuhost_server_extra_args": ["--moe-runner-backend=flashinfer_trtllm"]},
     ["--moe-runner-backend=flashinfer_trtllm is --moe-runner-backend, which "
      "gpuhost_moe_runner_backend owns"]),
    ("extra-arg-fp4-gemm-backend",
     {"gpuhost_fp4_gemm_backend": None,
      "gpuhost_server_extra_args": ["--fp4-gemm-backend", "flashinfer_trtllm"]},
     ["--fp4-gemm-backend is --fp4-gemm-backend, which gpuhost_fp4_gemm_backend owns"]),
    ("moe-backend-text-none", {"gpuhost_moe_runner_backend": "None"},
     ["gpuhost_moe_runner_backend = 'None' is not allowed",
      "in --data write null: None there is the text 'None'"]),
    ("venv-path-shell", {"gpuhost_venv_path": "/opt/$(id)"},
     ["gpuhost_venv_path", "'/opt/$(id)'", "an absolute path (letters"]),
    ("env-value-newline", {"gpuhost_server_env": {"FOO": "1\nLD_PRELOAD=/x.so"}},
     ["gpuhost_server_env", "FOO", "without control characters"]),
    ("driver-version-bad", {"gpuhost_driver_version": "latest"},
     ["gpuhost_driver_version", "'latest'", "a driver version such as"]),
    ("driver-version-other-branch", {"gpuhost_driver_version": "570.172.08"},
     ["gpuhost_driver_version", "'570.172.08'", "a version of driver branch 580"]),
    ("proprietary-on-blackwell", {"gpuhost_driver_flavour": "proprietary"},
     ["gpuhost_driver_flavour", "'proprietary'", "only 'open' on compute capability 12.0"]),
    ("flavour-unknown", {"gpuhost_driver_flavour": "nouveau"},
     ["gpuhost_driver_flavour", "'nouveau'", "one of open, proprietary"]),
    ("cuda-unknown", {"gpuhost_cuda_toolkit": "11.8"},
     ["gpuhost_cuda_toolkit", "'11.8'", "one of 12.8, 13.0"]),
    ("cuda13-on-570", {"gpuhost_cuda_toolkit": "13.0", "gpuhost_driver_branch": "570"},
     ["gpuhost_driver_branch = '570' is not allowed: with gpuhost_cuda_toolkit = '13.0', a "
      "branch that supports CUDA 13.0 (driver >= 580.65.06): 580, 590"]),
    ("compute-capability", {"gpuhost_compute_capability": "sm_120"},
     ["gpuhost_compute_capability", "'sm_120'", "a compute capability"]),
    ("p2p-override", {"gpuhost_p2p_override": "auto"},
     ["gpuhost_p2p_override", "'auto'", "one of on, off, or None"]),
    ("max-jobs-zero", {"gpuhost_max_jobs": 0}, ["gpuhost_max_jobs", "= 0", "an integer >= 1"]),
    ("nvcc-threads-high", {"gpuhost_nvcc_threads": 64},
     ["gpuhost_nvcc_threads", "64", "an integer from 1 to 16"]),
    ("lock-missing", {"gpuhost_lock": "locks/none.txt"},
     ["gpuhost_lock", "'locks/none.txt'", "an existing lock file"]),
    ("venv-relative", {"gpuhost_venv_path": "venv"},
     ["gpuhost_venv_path", "'venv'", "an absolute path"]),
    ("env-lowercase", {"gpuhost_server_env": {"nccl_debug": "INFO"}},
     ["gpuhost_server_env", "nccl_debug", "UPPER_CASE names"]),
    ("repo-url-slash", {"gpuhost_cuda_repo_url": "http://mirror.example/repos/"},
     ["gpuhost_cuda_repo_url", "without a trailing slash"]),
    ("dropins-string", {"gpuhost_allowed_dropins": "50-local.conf"},
     [("gpuhost_allowed_dropins = '50-local.conf' is not allowed: a list of drop-in file names "
       "under /etc/systemd/system/sglang.service.d/")]),
    ("dropins-path", {"gpuhost_allowed_dropins": ["../x.conf"]},
     ["gpuhost_allowed_dropins = ['../x.conf'] is not allowed: a list of drop-in file names"]),
    ("dropins-not-conf", {"gpuhost_allowed_dropins": ["x.service"]},
     ["gpuhost_allowed_dropins = ['x.service'] is not allowed: a list of drop-in file names"]),
]


@pytest.fixture(scope="module")
def audited_host():
    (host,) = lab.up(hosts=1, scenario="reference-lab")
    audit.install(host)
    yield host
    lab.sandbox("down", check=False)


def _assert_refused(run: lab.Run, words: list[str], host: lab.Host) -> None:
    assert run.returncode != 0, run.output[-2000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    for word in words:
        assert word in run.output, (word, run.output[-2000:])
    assert audit.commands(host) == [], "a command reached the host"


@pytest.mark.parametrize(("case", "data", "words"), CASES, ids=[c[0] for c in CASES])
def test_bad_host_data_touches_no_host(audited_host, tmp_path, case, data, words):
    audit.clear(audited_host)
    inventory = audit.write_inventory(tmp_path / "inventory.py", data)
    _assert_refused(lab.deploy(inventory=str(inventory)), words, audited_host)


def test_two_hosts_one_address(audited_host, tmp_path):
    audit.clear(audited_host)
    (listed,) = [h for h in __import__("json").loads(lab.sandbox("status", "--json").stdout)]
    twin = ("gpu1-twin", {"ssh_hostname": listed["address"], "ssh_user": listed["ssh_user"],
                          "_sudo": True, "ssh_key": listed["ssh_key"]})
    inventory = audit.write_inventory(tmp_path / "inventory.py", {}, extra_hosts=[twin])
    _assert_refused(lab.deploy(inventory=str(inventory)),
                    ["hosts gpu1 and gpu1-twin both claim the address", listed["address"]],
                    audited_host)


def test_a_host_given_twice_with_different_data(audited_host, tmp_path):
    """The last entry would silently win: refused while pyinfra loads the inventory."""
    audit.clear(audited_host)
    (listed,) = __import__("json").loads(lab.sandbox("status", "--json").stdout)
    again = (listed["name"], {**lab.inventory_data(listed), "gpuhost_server_port": 9000})
    inventory = audit.write_inventory(tmp_path / "inventory.py", {"gpuhost_server_port": 8000},
                                      extra_hosts=[again])
    run = lab.deploy(inventory=str(inventory))
    twice = f"host {listed['name']} is given twice in {inventory} with different data"
    _assert_refused(run, [twice, "gpuhost_server_port = 9000"], audited_host)
    assert "Connecting to hosts" not in run.output


def test_a_limit_that_matches_no_host(audited_host, tmp_path):
    """A CI job's typo: exits non-zero, before connecting."""
    audit.clear(audited_host)
    inventory = audit.write_inventory(tmp_path / "inventory.py", {})
    run = lab.deploy("--limit", "gpu9", inventory=str(inventory))
    _assert_refused(run, ["--limit gpu9 matches no host"], audited_host)
    assert "Connecting to hosts" not in run.output


def test_the_audit_sees_a_real_run(audited_host, tmp_path):
    """The recording is not blind: a --dry run's facts reach the host and are recorded."""
    audit.clear(audited_host)
    inventory = audit.write_inventory(tmp_path / "inventory.py", {})
    run = lab.deploy("--dry", inventory=str(inventory))
    assert run.returncode == 0, run.output[-3000:]
    assert any("nvidia-smi" in c for c in audit.commands(audited_host))
    # The default launch profile: the known behaviours that apply are printed, each with its
    # source, and none refuses (operations/plans/stack_facts.py).
    for row, source in (("modelopt-fp4-moe-one-kernel", "modelopt_quant.py"),
                        ("deepgemm-paged-mqa-logits-sm120", "sgl-project/sglang/issues/26087"),
                        ("flashinfer-cutlass-fp4-gemm-pdl-race",
                         "flashinfer-ai/flashinfer/issues/2708")):
        (line,) = [x for x in run.output.splitlines() if f"Stack: warn: {row}:" in x]
        assert "on compute capability 12.0" in line and source in line, line
    assert "Stack: refused" not in run.output
    assert "3 known behaviour(s) apply" in run.output
    # --dry names the CUDA stack and its lock, and that the default profile's figure is of
    # another CUDA than the host's
    assert "Stack: CUDA 12.8 (gpuhost_cuda_toolkit: /usr/local/cuda-12.8), lock " in run.output
    assert ("launch profile field-glm5-sm120-sglang0.5.9 was measured on CUDA 13.0; this "
            "host's stack is CUDA 12.8 (gpuhost_cuda_toolkit)") in run.output


def test_a_moe_backend_without_kernels_for_the_gpus_is_refused_while_planning(audited_host,
                                                                              tmp_path):
    inventory = audit.write_inventory(tmp_path / "inventory.py",
                                      {"gpuhost_moe_runner_backend": "flashinfer_trtllm"})
    run = lab.deploy(inventory=str(inventory))
    assert run.returncode != 0, run.output[-2000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    assert ("Stack: refused: flashinfer-trtllm-moe-sm12x: flashinfer-python 0.6.3 on compute "
            "capability 12.0") in run.output, run.output[-4000:]
    assert ("set gpuhost_moe_runner_backend (now 'flashinfer_trtllm') to one of "
            "flashinfer_cutlass, cutlass, triton") in run.output
    # Planning read facts and stopped: nothing of gpuhost's is on the host.
    left = audited_host.ssh(f"{audit.PROBE}ls -d /etc/gpuhost /opt/gpuhost "
                            "/etc/apt/sources.list.d/cuda-* 2>/dev/null || true").split()
    assert left == [], left


# --- secret files, refused while planning --------------------------------------------------------

SECRET_PATH = "/root/gpuhost-test-secret"
LINK_TARGET = "/root/gpuhost-test-target.key"
PART1 = lab.GUARD.register("SECRETPART1-" + "d4" * 10, "API key (test)")
PART2 = lab.GUARD.register("SECRETPART2-" + "e5" * 10, "API key (test)")
# (case id, host-data key, file content or None for a symlink to a good file, message words)
SECRET_CASES = [
    ("key-two-lines", "api_key_file", f"{PART1}\n{PART2}\n".encode(),
     ["gpuhost_api_key_file", f"the key file {SECRET_PATH} is not one line of header-safe text: "
      "it has 2 lines", "visible ASCII characters"]),
    ("key-empty", "api_key_file", b"", ["gpuhost_api_key_file", "it is empty"]),
    ("key-not-utf8", "api_key_file", b"\xff\xfe" + PART1.encode() + b"\n",
     ["gpuhost_api_key_file", "it is not UTF-8 text"]),
    ("key-space", "api_key_file", f"{PART1} {PART2}\n".encode(),
     ["gpuhost_api_key_file", "it holds a space"]),
    ("key-symlink", "api_key_file", None,
     ["gpuhost_api_key_file", f"it is a symlink (to {LINK_TARGET}): name the file itself"]),
    ("token-two-lines", "hf_token_file", f"{PART1}\r\n{PART2}\r\n".encode(),
     ["gpuhost_hf_token_file", f"the token file {SECRET_PATH} is not one line of header-safe "
      "text: it has 2 lines"]),
]


@pytest.mark.parametrize(("case", "key", "content", "words"), SECRET_CASES,
                         ids=[c[0] for c in SECRET_CASES])
def test_bad_secret_file_refused_while_planning(audited_host, tmp_path, case, key, content,
                                                words):
    if content is None:
        setup = (f"umask 077; printf 'sk-good-key-0123456789abcdef\\n' > {LINK_TARGET}; "
                 f"ln -sfn {LINK_TARGET} {SECRET_PATH}")
    else:
        encoded = base64.b64encode(content).decode()
        setup = f"rm -f {SECRET_PATH}; umask 077; echo {encoded} | base64 -d > {SECRET_PATH}"
    audited_host.ssh(f"{audit.PROBE}{setup}")
    data = {f"gpuhost_{key}": SECRET_PATH}
    if key == "api_key_file":
        data["gpuhost_server_host"] = "0.0.0.0"
    inventory = audit.write_inventory(tmp_path / "inventory.py", data)
    try:
        run = lab.deploy(inventory=str(inventory))
    finally:
        audited_host.ssh(f"{audit.PROBE}rm -f {SECRET_PATH} {LINK_TARGET}")
    assert run.returncode != 0, run.output[-2000:]
    assert "Traceback" not in run.output, run.output[-4000:]
    for word in words:
        assert word in run.output, (word, run.output[-2000:])
    for part in (PART1, PART2, "SECRETPART"):
        assert part not in run.output
    # Planning read facts and stopped: nothing of gpuhost's is on the host.
    left = audited_host.ssh(f"{audit.PROBE}ls -d /etc/gpuhost /opt/gpuhost "
                            "/etc/apt/sources.list.d/cuda-* 2>/dev/null || true").split()
    assert left == [], left
