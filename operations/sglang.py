"""The SGLang server's command line, rendered from host settings."""

from __future__ import annotations

from operations.settings import Settings


def server_args(settings: Settings) -> list[str]:
    """``python -m sglang.launch_server`` arguments, in the reference launch's order
    (../shared/reference-lab.md), with ``--tensor-parallel-size`` spelled out (the reference's
    ``--tp`` works only as an argparse abbreviation of ``--tp-size``). Flags whose setting is
    None are left out; P2P-dependent flags (--disable-custom-all-reduce) come from the P2P
    decision, not from here."""
    s = settings
    args = ["--model", s.model, "--served-model-name", s.served_model_name]
    optional = [
        ("--reasoning-parser", s.reasoning_parser),
        ("--tool-call-parser", s.tool_call_parser),
    ]
    args += [a for flag, value in optional if value is not None for a in (flag, value)]
    if s.trust_remote_code:
        args.append("--trust-remote-code")
    args += [
        "--tensor-parallel-size", str(s.tensor_parallel_size),
        "--mem-fraction-static", repr(s.mem_fraction_static),
        "--max-running-requests", str(s.max_running_requests),
        "--kv-cache-dtype", s.kv_cache_dtype,
    ]
    optional = [
        ("--quantization", s.quantization),
        ("--attention-backend", s.attention_backend),
        ("--fp8-gemm-backend", s.fp8_gemm_backend),
        ("--nsa-decode-backend", s.nsa_decode_backend),
        ("--nsa-prefill-backend", s.nsa_prefill_backend),
        ("--moe-runner-backend", s.moe_runner_backend),
    ]
    args += [a for flag, value in optional if value is not None for a in (flag, value)]
    if s.enable_flashinfer_allreduce_fusion:
        args.append("--enable-flashinfer-allreduce-fusion")
    args += ["--host", s.server_host, "--port", str(s.server_port), *s.server_extra_args]
    return args
