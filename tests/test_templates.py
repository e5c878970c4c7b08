"""The unit and environment templates, rendered as pyinfra renders them."""

import shlex
from pathlib import Path

import pytest
from pyinfra.api.util import get_template

from operations.plans.settings import from_host_data
from operations.stages.server_unit import env_context, gate_context, unit_context
from operations.stages.systemd_units import systemd_quote
from operations.stages.venvs import stack_venv

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = """python3 -m sglang.launch_server --model lukealonso/GLM-5-NVFP4 --served-model-name glm-5
  --reasoning-parser glm45 --tool-call-parser glm47 --trust-remote-code --tp 8
  --mem-fraction-static 0.92 --max-running-requests 64 --kv-cache-dtype auto
  --quantization modelopt_fp4 --attention-backend flashinfer --fp8-gemm-backend cutlass
  --nsa-decode-backend trtllm --nsa-prefill-backend trtllm
  --moe-runner-backend flashinfer_trtllm --disable-custom-all-reduce
  --enable-flashinfer-allreduce-fusion --host 0.0.0.0 --port 8000"""


@pytest.fixture
def settings(tmp_path):
    lock = tmp_path / "lock.txt"
    lock.write_text("sglang==0.5.9 --hash=sha256:" + "0" * 64 + "\n")
    return lambda **data: from_host_data("gpu1", {"gpuhost_lock": str(lock), **data})


def render(name, context):
    return get_template(str(ROOT / "templates" / name)).render(**context)


def unit_lines(text):
    return [line for line in text.splitlines() if line and not line.startswith("#")]


def test_unit_is_the_default_profiles_launch(settings):
    text = render("sglang.service.j2", unit_context(settings()))
    (exec_start,) = [line for line in unit_lines(text) if line.startswith("ExecStart=")]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    args = words[1:-1]
    # voipmonitor/rtx6kpro models/glm5.md's launch, with sglang 0.5.9's FP4 GEMM backend
    for flag, value in (("--kv-cache-dtype", "bf16"), ("--moe-runner-backend", "cutlass"),
                        ("--attention-backend", "flashinfer"), ("--mem-fraction-static", "0.85"),
                        ("--fp4-gemm-backend", "flashinfer_cutlass"),
                        ("--chunked-prefill-size", "16384"), ("--cuda-graph-max-bs", "32")):
        assert args[args.index(flag) + 1] == value, flag
    assert not [a for a in args if a.startswith("--speculative")]
    env = render("server.env.j2", env_context(settings()))
    assert "SGLANG_ENABLE_JIT_DEEPGEMM=0" in env.splitlines()
    assert "SGLANG_ENABLE_SPEC_V2" not in env


def test_mtp_renders_the_speculative_flags_and_spec_v2(settings):
    s = settings(gpuhost_speculative_algorithm="NEXTN")
    words = shlex.split(next(line for line in unit_lines(render("sglang.service.j2",
                                                                 unit_context(s)))
                             if line.startswith("ExecStart=")).removeprefix("ExecStart="))
    at = words.index("--speculative-algorithm")
    assert words[at:at + 8] == ["--speculative-algorithm", "NEXTN", "--speculative-num-steps",
                                "4", "--speculative-eagle-topk", "1",
                                "--speculative-num-draft-tokens", "5"]
    assert "SGLANG_ENABLE_SPEC_V2=True" in render("server.env.j2", env_context(s)).splitlines()


def test_unit_is_the_reference_launch(settings):
    text = render("sglang.service.j2", unit_context(settings(
        gpuhost_launch_profile="reference-lab")))
    (exec_start,) = [line for line in unit_lines(text) if line.startswith("ExecStart=")]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    # the lock's own venv, not the link at gpuhost_venv_path (operations/stages/venvs.py)
    assert words[0] == f"{stack_venv(settings().lock_path)}/bin/python"
    assert words[-1] == "$GPUHOST_P2P_SERVER_ARGS"
    reference = shlex.split(REFERENCE)[1:]

    reference.remove("--disable-custom-all-reduce")  # from the P2P decision, not host data
    # The full name: --tp works only through argparse's prefix matching of --tp-size.
    reference[reference.index("--tp")] = "--tensor-parallel-size"
    # The weights are downloaded while provisioning; the server reads the local copy.
    reference[reference.index("--model") + 1] = "/opt/gpuhost/models/lukealonso/GLM-5-NVFP4"
    # Bound to the loopback by default (0.0.0.0 needs an API key and goes through the gate).
    reference[reference.index("--host") + 1] = "127.0.0.1"
    # The measured baseline's MoE runner backend, not the last launch's experiment.
    reference[reference.index("--moe-runner-backend") + 1] = "flashinfer_cutlass"
    # Explicit on SM120: what auto resolved to there, and sglang 0.5.9's FP4 GEMM default.
    reference[reference.index("--kv-cache-dtype") + 1] = "fp8_e4m3"
    at = reference.index("--fp8-gemm-backend") + 2
    reference[at:at] = ["--fp4-gemm-backend", "flashinfer_cutlass"]
    # Prometheus metrics on the server's own (loopback or gated) port: issue #32.
    at = reference.index("--host")
    reference[at:at] = ["--enable-metrics"]
    assert words[1:-1] == reference


#: sglang 0.5.9's launch_server flags whose automatic choice depends on the GPU
#: (operations/plans/sglang_choices.py, from the wheel's server_args.py).
BACKEND_FLAGS = ("--attention-backend", "--kv-cache-dtype", "--nsa-prefill-backend",
                 "--nsa-decode-backend", "--moe-runner-backend", "--fp8-gemm-backend",
                 "--fp4-gemm-backend")


def test_unit_names_every_backend_on_sm120(settings):
    s = settings(gpuhost_compute_capability="12.0")
    text = render("sglang.service.j2", unit_context(s))
    (exec_start,) = [line for line in unit_lines(text) if line.startswith("ExecStart=")]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    for flag in BACKEND_FLAGS:
        assert flag in words, flag
        value = words[words.index(flag) + 1]
        assert not value.startswith("--") and value != "auto", (flag, value)


def test_unit_reads_both_environment_files(settings):
    lines = unit_lines(render("sglang.service.j2", unit_context(settings())))
    assert "EnvironmentFile=/etc/gpuhost/server.env" in lines
    assert "EnvironmentFile=/etc/gpuhost/p2p.env" in lines
    assert "Restart=on-failure" in lines
    assert "WantedBy=multi-user.target" in lines


def test_unit_quotes_odd_arguments(settings):
    s = settings(gpuhost_server_extra_args=["--chat-template", "my template %d $HOME"])
    text = render("sglang.service.j2", unit_context(s))
    assert '"my template %%d $$HOME"' in text


def test_systemd_quote():
    assert systemd_quote("glm-5") == "glm-5"
    assert systemd_quote('a "b"') == '"a \\"b\\""'
    assert systemd_quote("") == '""'


def test_environment_file(settings):
    text = render("server.env.j2", env_context(settings()))
    lines = unit_lines(text)
    assert "HF_HUB_OFFLINE=1" in lines
    assert "OMP_NUM_THREADS=8" in lines
    assert "SAFETENSORS_FAST_GPU=1" in lines


def test_unit_restarts_on_failure_within_a_start_limit(settings):
    lines = unit_lines(render("sglang.service.j2", unit_context(
        settings(gpuhost_server_start_timeout=1200))))
    assert "Restart=on-failure" in lines
    assert "RestartSec=10" in lines
    assert "StartLimitBurst=3" in lines
    # room for three full starts, so the limit stops a loop and not a slow first start
    assert "StartLimitIntervalSec=3630" in lines
    assert "TimeoutStartSec=1200" in lines
    assert "LimitMEMLOCK=infinity" in lines
    assert "LimitNOFILE=1048576" in lines


def test_unit_sets_paths_explicitly(settings):
    lines = unit_lines(render("sglang.service.j2", unit_context(settings())))
    assert "Environment=CUDA_HOME=/usr/local/cuda-12.8" in lines
    assert "Environment=LD_LIBRARY_PATH=/usr/local/cuda-12.8/lib64" in lines
    venv = stack_venv(settings().lock_path)
    assert venv.startswith("/opt/gpuhost/venvs/")
    assert any(line.startswith(f"Environment=PATH={venv}/bin:/usr/local/cuda-12.8/bin:")
               for line in lines)
    (post,) = [line for line in lines if line.startswith("ExecStartPost=")]
    assert "--health-only" in post and "http://127.0.0.1:8000" in post


def test_no_secret_reaches_the_unit(settings, tmp_path):
    s = settings(gpuhost_server_host="0.0.0.0", gpuhost_api_key_file="/root/sglang.key",
                 gpuhost_hf_token_file="/root/hf_token")
    unit = render("sglang.service.j2", unit_context(s))
    gate = render("gate.service.j2", gate_context(s))
    env = render("server.env.j2", env_context(s))
    for text in (unit, gate, env):
        assert "--api-key" not in text.replace("--api-key-file", "")
    (exec_start,) = [line for line in unit_lines(unit) if line.startswith("ExecStart=")]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    # public: the server binds the loopback behind the gate, which holds the key file's path
    assert words[words.index("--host") + 1] == "127.0.0.1"
    assert words[words.index("--port") + 1] == "30000"
    assert "Wants=network-online.target sglang-gate.service" in unit_lines(unit)
    (gate_exec,) = [line for line in unit_lines(gate) if line.startswith("ExecStart=")]
    assert gate_exec == ('ExecStart=/usr/sbin/nginx -e stderr -c '
                         '/etc/gpuhost/nginx/sglang-gate.conf -g "daemon off;"')
    assert "Description=API key gate in front of the SGLang server (0.0.0.0:8000 -> " \
           "http://127.0.0.1:30000)" in unit_lines(gate)
    # the key file's path for gate_keys.py, which writes the key into nginx's root-only include
    assert ("gate_keys.py --out /etc/gpuhost/nginx/sglang-gate.keys --key-file /root/sglang.key"
            in gate)
    assert "PartOf=sglang.service" in unit_lines(gate)


def test_gate_unit_is_bounded_and_reloads_gracefully(settings):
    """The gate faces the network: its unit caps memory and tasks; a reload writes the keys
    again, tests the configuration, then signals nginx's master (SIGHUP: a graceful reload)."""
    s = settings(gpuhost_server_host="0.0.0.0", gpuhost_api_key_file="/root/sglang.key")
    lines = unit_lines(render("gate.service.j2", gate_context(s)))
    assert "MemoryMax=256M" in lines and "TasksMax=272" in lines
    reload = [line.removeprefix("ExecReload=") for line in lines
              if line.startswith("ExecReload=")]
    assert [shlex.split(r)[1].rsplit("/", 1)[-1] for r in reload[:2]] == [
        "unit_inputs.py", "gate_keys.py"]
    assert reload[2:] == ["/usr/sbin/nginx -q -t -e stderr -c /etc/gpuhost/nginx/sglang-gate.conf",
                          "/bin/kill -HUP $MAINPID"]
