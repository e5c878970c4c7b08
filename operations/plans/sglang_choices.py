"""What sglang 0.5.9 chooses for a backend flag left to it, on compute capability 12.x.

sglang's automatic choices are made for the GPUs it knows best: on 12.x (SM120) a backend left
``auto`` or unset gets the choice made for compute capability 10 and up, or for "Blackwell"
as a family (``is_blackwell_supported`` covers majors 10, 11 and 12), so the server unit names
every backend explicitly there, and a setting left to sglang is warned about. The settings are
all there is to read: gpuhost_server_extra_args may not name these flags (OWNED_FLAGS in
operations/plans/sglang.py), so a setting left unset is a flag left out of the unit.

Read from sglang-0.5.9-py3-none-any.whl: ``sglang/srt/server_args.py`` (the defaults and
``ServerArgs.__post_init__``'s handlers named below), ``sglang/srt/utils/common.py``
(``is_sm100_supported``: major 10 only; ``is_blackwell_supported``: majors 10, 11, 12) and
``sglang/srt/layers/quantization/{fp8_utils,fp4_utils,modelopt_quant}.py``.
"""

from __future__ import annotations

from typing import Final

from operations.plans.settings import PREFIX, Settings

#: The backend settings of sglang 0.5.9's launch_server whose automatic choice depends on the
#: GPU (``--prefill-attention-backend`` and ``--decode-attention-backend`` follow
#: ``--attention-backend`` when unset: ``_handle_attention_backend_compatibility``).
BACKEND_SETTINGS: Final = ("attention_backend", "kv_cache_dtype", "nsa_prefill_backend",
                           "nsa_decode_backend", "moe_runner_backend", "fp8_gemm_backend",
                           "fp4_gemm_backend")

#: Model architectures with DeepSeek's sparse attention (DSA, "NSA" in sglang 0.5.9), for which
#: ``_handle_model_specific_adjustments`` picks the attention backend, KV cache dtype and NSA
#: backends (``is_deepseek_nsa``).
DSA_ARCHITECTURES: Final = ("GlmMoeDsaForCausalLM",)

#: The sglang release whose choices this module describes.
READ_FROM: Final = "0.5.9"


def _left(value: str | None) -> bool:
    return value is None or value == "auto"


def _dsa_kv_cache(s: Settings) -> str:
    # _set_default_nsa_kv_cache_dtype: auto -> fp8_e4m3 on major >= 10; bf16 -> bfloat16
    return "fp8_e4m3" if _left(s.kv_cache_dtype) else s.kv_cache_dtype.replace("bf16", "bfloat16")


def choice(s: Settings, setting: str) -> str | None:
    """What sglang 0.5.9 picks on compute capability 12.x for ``setting`` (a field of
    :data:`BACKEND_SETTINGS`) when it is left ``auto`` or unset, with the function that picks
    it; None where the flag has no effect for this model (NSA backends on a model without
    DSA) or the setting is explicit."""
    value = getattr(s, setting)
    if not _left(value):
        return None
    dsa = s.model_architecture in DSA_ARCHITECTURES
    if setting == "attention_backend":
        if dsa:
            return "nsa (_handle_model_specific_adjustments, for DSA models)"
        return ("flashinfer for a model without MLA where flashinfer is installed, triton "
                "otherwise (_handle_attention_backend_compatibility)")
    if setting == "kv_cache_dtype":
        if dsa:
            return "fp8_e4m3 (_set_default_nsa_kv_cache_dtype: major >= 10)"
        return "the model's own dtype (auto is not resolved further for it)"
    if setting in ("nsa_prefill_backend", "nsa_decode_backend"):
        if not dsa:
            return None
        fp8 = _dsa_kv_cache(s) == "fp8_e4m3"
        if setting == "nsa_prefill_backend":
            picked = "flashmla_auto" if fp8 else "flashmla_sparse"
        else:
            picked = "flashmla_kv" if fp8 else "trtllm"
        return f"{picked} (_set_default_nsa_backends, KV cache {_dsa_kv_cache(s)})"
    if setting == "moe_runner_backend":
        if s.quantization == "modelopt_fp4":
            return ("auto, which runs sgl_kernel's cutlass_fp4_group_mm (modelopt_quant.py "
                    "ModelOptNvFp4FusedMoEMethod.apply; flashinfer_trtllm only on SM100)")
        return "auto: the quantization method's own MoE path (flashinfer_trtllm only on SM100)"
    if setting == "fp8_gemm_backend":
        return ("deep_gemm where its JIT is enabled, else FlashInfer's block FP8 GEMM "
                "(fp8_utils._dispatch_auto_backend: is_blackwell_supported)")
    if setting == "fp4_gemm_backend":
        if value is None:
            return "flashinfer_cutlass (ServerArgs.fp4_gemm_runner_backend's default)"
        return "FlashInfer's own mm_fp4 backend choice (fp4_utils: backend 'auto' passed on)"
    raise ValueError(f"{setting} is not one of {', '.join(BACKEND_SETTINGS)}")


def left_to_sglang(s: Settings, compute_capability: str, sglang_version: str) -> list[str]:
    """One warning per backend setting left ``auto`` or unset on compute capability 12.x,
    naming what sglang would choose (for sglang 0.5.9; another release is named as not read).
    Empty on other compute capabilities."""
    if compute_capability.split(".")[0] != "12":
        return []
    found = []
    for setting in BACKEND_SETTINGS:
        picked = choice(s, setting)
        if picked is None:
            continue
        value = getattr(s, setting)
        shown = "unset (None: the flag is left out)" if value is None else repr(value)
        chooses = (f"sglang {READ_FROM} chooses {picked}" if sglang_version == READ_FROM
                   else f"sglang {READ_FROM} would choose {picked}; the locked sglang "
                        f"{sglang_version} was not read")
        found.append(f"{PREFIX}{setting} is {shown} on compute capability "
                     f"{compute_capability}: {chooses}; set it explicitly, so that the unit "
                     "says what runs")
    return found
