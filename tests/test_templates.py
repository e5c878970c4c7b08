"""The unit and environment templates, rendered as pyinfra renders them."""

import shlex
from pathlib import Path

import pytest
from pyinfra.api.util import get_template

from operations.server import env_context, systemd_quote, unit_context
from operations.settings import from_host_data

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


def test_unit_is_the_reference_launch(settings):
    text = render("sglang.service.j2", unit_context(settings(gpuhost_server_host="0.0.0.0")))
    (exec_start,) = [line for line in unit_lines(text) if line.startswith("ExecStart=")]
    words = shlex.split(exec_start.removeprefix("ExecStart="))
    assert words[0] == "/opt/gpuhost/venv/bin/python"
    assert words[-1] == "$GPUHOST_P2P_SERVER_ARGS"
    reference = shlex.split(REFERENCE)[1:]
    reference.remove("--disable-custom-all-reduce")  # from the P2P decision, not host data
    # The full name: --tp works only through argparse's prefix matching of --tp-size.
    reference[reference.index("--tp")] = "--tensor-parallel-size"
    assert words[1:-1] == reference


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
    assert "CUDA_HOME=/usr/local/cuda-12.8" in lines
    assert "OMP_NUM_THREADS=8" in lines
    assert "SAFETENSORS_FAST_GPU=1" in lines
    assert any(line.startswith("PATH=/opt/gpuhost/venv/bin:/usr/local/cuda-12.8/bin:")
               for line in lines)
