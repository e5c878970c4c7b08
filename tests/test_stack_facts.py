"""The stack's known behaviour (operations/plans/stack_facts.py): each row applies at its boundaries
and not beyond them; what sglang 0.5.9 chooses for a backend left to it
(operations/plans/sglang_choices.py); expert parallelism read from the extra server flags."""

from dataclasses import replace
from pathlib import Path

import pytest

from operations.plans import launch_profiles
from operations.plans.settings import Settings
from operations.plans.sglang import load_parser_spec
from operations.plans.sglang_choices import BACKEND_SETTINGS, choice, left_to_sglang
from operations.plans.stack_check import expert_parallel, model_architecture
from operations.plans.stack_facts import FACTS, Target, applicable, applies, describe

ROOT = Path(__file__).resolve().parent.parent
LOCKED = {"sglang": "0.5.9", "flashinfer-python": "0.6.3", "torch": "2.9.1"}
ROW = {row.name: row for row in FACTS}


def target(versions=None, cc="12.0", ep=False, **settings):
    return Target({**LOCKED, **(versions or {})}, cc, replace(Settings(), **settings), ep)


def names(t):
    return [row.name for row in applicable(t)]


def test_the_default_profile():
    # GLM-5 on SM120 with the default launch profile (CUTLASS MoE): the risks, no refusal.
    assert names(target()) == ["modelopt-fp4-moe-one-kernel",
                               "deepgemm-paged-mqa-logits-sm120",
                               "flashinfer-cutlass-fp4-gemm-pdl-race"]


def test_the_reference_lab_profile():
    # The reference lab's hand-made launch: the two risks and its FP8 KV cache, no refusal.
    lab = launch_profiles.named("reference-lab").settings()
    assert names(target(**lab)) == ["deepgemm-paged-mqa-logits-sm120",
                                    "flashinfer-cutlass-fp4-gemm-pdl-race",
                                    "fp8-kv-cache-garbled-sm120",
                                    "deepgemm-jit-on-sm120"]


def test_rows_name_a_source_and_what_to_do():
    for row in FACTS:
        assert row.source and row.happens, row.name
        if row.verdict == "refuse":
            assert row.change and row.alternatives, row.name
            assert hasattr(Settings(), row.change), row.name
            assert getattr(Settings(), row.change) in row.alternatives, row.name  # defaults pass
        else:
            assert row.workaround, row.name


@pytest.mark.parametrize(("cc", "applies_"), [("12.0", True), ("12.1", True), ("10.0", False),
                                              ("11.0", False), ("13.0", False), ("9.0", False)])
def test_trtllm_moe_is_refused_on_sm12x_only(cc, applies_):
    t = target(cc=cc, moe_runner_backend="flashinfer_trtllm")
    assert applies(ROW["flashinfer-trtllm-moe-sm12x"], t) is applies_


def test_trtllm_moe_refusal_names_the_setting_and_alternatives():
    t = target(moe_runner_backend="flashinfer_trtllm")
    assert not applies(ROW["flashinfer-trtllm-moe-sm12x"], target())
    line = describe(ROW["flashinfer-trtllm-moe-sm12x"], t)
    assert "set gpuhost_moe_runner_backend (now 'flashinfer_trtllm') to one of " \
           "flashinfer_cutlass, cutlass, triton" in line
    assert "flashinfer-ai/flashinfer/issues/2045" in line
    assert "flashinfer-python 0.6.3 on compute capability 12.0" in line


def test_trtllm_moe_row_needs_flashinfer_in_the_lock():
    t = Target({"sglang": "0.5.9"}, "12.0",
               replace(Settings(), moe_runner_backend="flashinfer_trtllm"))
    assert not applies(ROW["flashinfer-trtllm-moe-sm12x"], t)


@pytest.mark.parametrize(("cc", "backend", "quantization", "applies_"), [
    ("12.0", "flashinfer_trtllm", "modelopt_fp4", True),
    ("12.1", "flashinfer_trtllm", "modelopt_fp4", True),
    ("10.0", "flashinfer_trtllm", "modelopt_fp4", False),
    ("10.3", "flashinfer_trtllm", "modelopt_fp4", False),
    ("12.0", "flashinfer_cutlass", "modelopt_fp4", False),
    ("12.0", "flashinfer_cudnn", "modelopt_fp4", False),
    ("12.0", "flashinfer_trtllm", None, False),
])
def test_trtllm_fp4_gemm_is_refused_on_sm12x_for_modelopt_fp4(cc, backend, quantization,
                                                               applies_):
    t = target(cc=cc, fp4_gemm_backend=backend, quantization=quantization)
    assert applies(ROW["flashinfer-trtllm-fp4-gemm-sm12x"], t) is applies_


def test_trtllm_fp4_gemm_refusal_names_the_setting_and_alternatives():
    row = ROW["flashinfer-trtllm-fp4-gemm-sm12x"]
    assert row.verdict == "refuse"
    line = describe(row, target(fp4_gemm_backend="flashinfer_trtllm"))
    assert "set gpuhost_fp4_gemm_backend (now 'flashinfer_trtllm') to one of " \
           "flashinfer_cutlass, flashinfer_cudnn" in line
    assert "@supported_compute_capability([100, 103])" in line
    assert not applies(row, target(versions={"flashinfer-python": "0.6.7"},
                                   fp4_gemm_backend="flashinfer_trtllm"))


@pytest.mark.parametrize("backend", ["auto", None, "triton", "cutlass", "deep_gemm",
                                     "flashinfer_cutedsl"])
def test_modelopt_fp4_backends_that_share_one_kernel(backend):
    row = ROW["modelopt-fp4-moe-one-kernel"]
    assert applies(row, target(moe_runner_backend=backend))
    assert not applies(row, target(moe_runner_backend=backend, ep=True))
    assert not applies(row, target(moe_runner_backend=backend, quantization="fp8"))
    assert not applies(row, target({"sglang": "0.5.10"}, moe_runner_backend=backend))


def test_flashinfer_cutlass_is_a_moe_path_of_its_own():
    assert not applies(ROW["modelopt-fp4-moe-one-kernel"],
                       target(moe_runner_backend="flashinfer_cutlass"))


def test_auto_moe_is_flashinfer_trtllm_on_sm100():
    assert not applies(ROW["modelopt-fp4-moe-one-kernel"], target(cc="10.0",
                                                                   moe_runner_backend="auto"))
    assert applies(ROW["modelopt-fp4-moe-one-kernel"], target(cc="9.0", moe_runner_backend="auto"))


@pytest.mark.parametrize(("cc", "applies_"), [("9.0", False), ("10.0", True), ("12.0", True)])
def test_dsa_auto_kv_cache_from_compute_capability_10(cc, applies_):
    row = ROW["dsa-auto-kv-cache-fp8"]
    assert applies(row, target(cc=cc, kv_cache_dtype="auto")) is applies_
    assert not applies(row, target(cc=cc, kv_cache_dtype="bfloat16"))
    assert not applies(row, target(cc=cc, kv_cache_dtype="auto",
                                   model_architecture="Qwen3MoeForCausalLM"))


@pytest.mark.parametrize(("prefill", "decode", "applies_"),
                         [(None, "trtllm", True), ("trtllm", None, True), (None, None, True),
                          ("trtllm", "trtllm", False)])
def test_dsa_nsa_backends_left_unset(prefill, decode, applies_):
    row = ROW["dsa-auto-nsa-flashmla"]
    t = target(nsa_prefill_backend=prefill, nsa_decode_backend=decode)
    assert applies(row, t) is applies_
    assert not applies(row, replace(t, compute_capability="9.0"))
    assert not applies(row, replace(t, versions={**LOCKED, "sglang": "0.5.10"}))


def test_deepgemm_mqa_logits_on_sm12x_for_dsa_models():
    row = ROW["deepgemm-paged-mqa-logits-sm120"]
    assert applies(row, target())
    assert applies(row, target({"sglang": "0.5.12"}))
    assert not applies(row, target({"sglang": "0.5.8"}))
    assert not applies(row, target(cc="10.0"))
    assert not applies(row, target(model_architecture="Qwen3MoeForCausalLM"))


@pytest.mark.parametrize(("flashinfer", "concurrency", "applies_"),
                         [("0.6.3", 64, True), ("0.6.6", 256, True), ("0.6.3", 63, False),
                          ("0.6.7", 64, False), ("0.6.7.post2", 64, False)])
def test_fp4_gemm_race_from_64_concurrent_requests(flashinfer, concurrency, applies_):
    row = ROW["flashinfer-cutlass-fp4-gemm-pdl-race"]
    t = target({"flashinfer-python": flashinfer}, max_running_requests=concurrency)
    assert applies(row, t) is applies_


def test_fp4_gemm_race_needs_that_gemm_on_sm12x():
    row = ROW["flashinfer-cutlass-fp4-gemm-pdl-race"]
    assert applies(row, target(fp4_gemm_backend=None))  # sglang 0.5.9's default
    assert not applies(row, target(fp4_gemm_backend="flashinfer_cudnn"))
    assert not applies(row, target(quantization=None))
    assert not applies(row, target(cc="10.0"))


# --- what sglang 0.5.9 chooses for a backend left to it -----------------------------------


def test_reference_defaults_leave_nothing_to_sglang_on_sm120():
    assert left_to_sglang(Settings(), "12.0", "0.5.9") == []


def test_every_backend_left_to_sglang_is_warned_about_on_sm120():
    s = replace(Settings(), attention_backend=None, kv_cache_dtype="auto",
                nsa_prefill_backend=None, nsa_decode_backend=None, moe_runner_backend="auto",
                fp8_gemm_backend="auto", fp4_gemm_backend=None)
    warnings = left_to_sglang(s, "12.0", "0.5.9")
    assert len(warnings) == len(BACKEND_SETTINGS)
    joined = "\n".join(warnings)
    assert "gpuhost_attention_backend is unset (None: the flag is left out) on compute " \
           "capability 12.0: sglang 0.5.9 chooses nsa" in joined
    assert "gpuhost_kv_cache_dtype is 'auto' on compute capability 12.0: sglang 0.5.9 " \
           "chooses fp8_e4m3 (_set_default_nsa_kv_cache_dtype" in joined
    assert "chooses flashmla_auto (_set_default_nsa_backends, KV cache fp8_e4m3)" in joined
    assert "chooses flashmla_kv (_set_default_nsa_backends" in joined
    assert "cutlass_fp4_group_mm" in joined
    assert "chooses flashinfer_cutlass (ServerArgs.fp4_gemm_runner_backend" in joined
    assert left_to_sglang(s, "10.0", "0.5.9") == []
    assert left_to_sglang(s, "9.0", "0.5.9") == []


def test_nsa_choice_follows_an_explicit_bf16_kv_cache():
    s = replace(Settings(), kv_cache_dtype="bf16", nsa_prefill_backend=None,
                nsa_decode_backend=None)
    assert choice(s, "nsa_prefill_backend").startswith("flashmla_sparse")
    assert choice(s, "nsa_decode_backend").startswith("trtllm")


def test_nsa_backends_do_not_matter_without_dsa():
    s = replace(Settings(), model_architecture="Qwen3MoeForCausalLM", nsa_prefill_backend=None)
    assert choice(s, "nsa_prefill_backend") is None


def test_another_sglang_is_named_as_not_read():
    s = replace(Settings(), attention_backend=None)
    (warning,) = left_to_sglang(s, "12.0", "0.5.10")
    assert "sglang 0.5.9 would choose nsa" in warning
    assert "the locked sglang 0.5.10 was not read" in warning


# --- expert parallelism in the extra flags ------------------------------------------------


@pytest.mark.parametrize(("args", "expected"), [
    ([], False),
    (["--ep-size", "1"], False),
    (["--ep-size", "8"], True),
    (["--expert-parallel-size=2"], True),
    (["--moe-a2a-backend", "none"], False),
    (["--moe-a2a-backend", "deepep"], True),
    (["--chunked-prefill-size", "8"], False),
])
def test_expert_parallel(args, expected):
    assert expert_parallel(args, load_parser_spec("0.5.9")) is expected


# --- the model's architecture from its config.json -----------------------------------------


def test_model_architecture_from_config_json():
    # The shape of GLM-5's config.json (and the sandbox hub's stand-in of it).
    assert model_architecture('{"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "x"}') \
        == "GlmMoeDsaForCausalLM"
    assert model_architecture(None) is None  # not downloaded yet
    assert model_architecture('{"model_type": "x"}') is None
    assert model_architecture("not json") is None
    assert model_architecture("[1, 2]") is None
    assert model_architecture('{"architectures": "GlmMoeDsaForCausalLM"}') \
        == "GlmMoeDsaForCausalLM"  # a string, taken whole (not its first letter)
    assert model_architecture('{"architectures": []}') is None


def test_a_real_run_warns_in_one_short_line():
    """Every run, a no-op too, printed each warning row whole (about 900 characters, twice on
    the reference lab's defaults): a real run now gets one short line each, --dry the row."""
    from operations.plans.stack_facts import BRIEF_CHARS, brief

    t = target()
    for row in applicable(t):
        whole, short = describe(row, t), brief(row, t)
        assert len(whole) > 400 and len(short) <= BRIEF_CHARS, short
        assert short.startswith(f"{row.name}: ") and short.endswith(
            "(--dry: what to do, the source)")
        assert "flashinfer-python 0.6.3" in short or "sglang 0.5.9" in short


@pytest.mark.parametrize(("kv", "cc", "applies_"), [
    ("fp8_e4m3", "12.0", True), ("auto", "12.0", True), ("fp8_e5m2", "12.1", True),
    ("bf16", "12.0", False), ("fp8_e4m3", "10.0", False), ("fp8_e4m3", "9.0", False)])
def test_fp8_kv_cache_warns_on_sm12x_only(kv, cc, applies_):
    row = ROW["fp8-kv-cache-garbled-sm120"]
    assert row.verdict == "warn" and "rtx6kpro" in row.source
    assert applies(row, target(cc=cc, kv_cache_dtype=kv)) is applies_
    assert not applies(row, target(kv_cache_dtype=kv, model_architecture="LlamaForCausalLM"))


@pytest.mark.parametrize(("env", "applies_"), [
    ({}, True), ({"SGLANG_ENABLE_JIT_DEEPGEMM": "1"}, True),
    ({"SGLANG_ENABLE_JIT_DEEPGEMM": "0"}, False),
    ({"SGLANG_ENABLE_JIT_DEEPGEMM": "false"}, False)])
def test_deepgemm_jit_left_on_warns_on_sm12x(env, applies_):
    row = ROW["deepgemm-jit-on-sm120"]
    assert applies(row, target(server_env=env)) is applies_
    assert not applies(row, target(cc="9.0", server_env=env))
    assert not applies(row, target())  # the profile's environment turns it off


def test_nextn_says_the_deploy_sets_spec_v2():
    row = ROW["nextn-needs-spec-v2"]
    assert not applies(row, target())
    line = describe(row, target(speculative_algorithm="NEXTN"))
    assert "the deploy puts SGLANG_ENABLE_SPEC_V2=True" in line and "loads the model" in line


def test_cutedsl_moe_is_refused_with_expert_parallelism_on_sm12x():
    row = ROW["flashinfer-cutedsl-moe-ep-sm12x"]
    assert applies(row, target(moe_runner_backend="flashinfer_cutedsl", ep=True))
    assert not applies(row, target(moe_runner_backend="flashinfer_cutedsl"))
    assert not applies(row, target(cc="10.0", moe_runner_backend="flashinfer_cutedsl", ep=True))
    line = describe(row, target(moe_runner_backend="flashinfer_cutedsl", ep=True))
    assert "set gpuhost_moe_runner_backend (now 'flashinfer_cutedsl') to one of cutlass" in line


def test_rows_from_the_field_page_say_the_cuda_they_were_seen_on():
    field = [row.name for row in FACTS if row.cuda]
    assert field == ["fp8-kv-cache-garbled-sm120", "deepgemm-jit-on-sm120",
                     "nextn-needs-spec-v2"]
    row = ROW["fp8-kv-cache-garbled-sm120"]
    on_128 = describe(row, target(kv_cache_dtype="fp8_e4m3"))
    assert on_128.endswith("; seen on CUDA 13.0 builds, this host's stack is CUDA 12.8]")
    assert "seen on" not in describe(row, target(kv_cache_dtype="fp8_e4m3",
                                                 cuda_toolkit="13.0"))
    assert "seen on" not in describe(ROW["flashinfer-trtllm-moe-sm12x"], target())


def test_the_stack_line_names_the_cuda_and_the_lock():
    from operations.plans.lock import read_lock
    from operations.plans.settings import from_host_data
    from operations.plans.stack_check import stack_line
    s = from_host_data("gpu1", {"gpuhost_cuda_toolkit": "13.0"})
    versions = read_lock(s.lock_path).versions()
    assert stack_line(s, versions, {"gpuhost_cuda_toolkit": "13.0"}) == (
        "CUDA 13.0 (gpuhost_cuda_toolkit: /usr/local/cuda-13.0), lock locks/cuda13.0.txt (the "
        "lock of CUDA 13.0's stack): sglang 0.5.17, torch 2.11.0, flashinfer-python 0.6.15.post1")
    s = from_host_data("gpu1", {"gpuhost_lock": "locks/cuda12.8.txt"})
    assert stack_line(s, read_lock(s.lock_path).versions(), {"gpuhost_lock": s.lock}) == (
        "CUDA 12.8 (gpuhost_cuda_toolkit: /usr/local/cuda-12.8), lock locks/cuda12.8.txt "
        "(gpuhost_lock): sglang 0.5.9, torch 2.9.1, flashinfer-python 0.6.3, flash-attn "
        "2.8.3.post2")
