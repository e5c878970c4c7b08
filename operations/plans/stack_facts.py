"""What the locked stack is known to do on the host's GPUs: a table of public facts, each
with what it applies to, what happens, its source, and whether the plan refuses or warns.

Every row was read in its source before it was written here: the wheels
(``pip download --no-deps sglang==0.5.9 flashinfer-python==0.6.3 flashinfer-python==0.6.7``,
then the named files) and the public GitHub threads named in ``source``. A row that refuses is
a certain failure (no kernels for these GPUs); one that warns is a risk, with its workaround.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from operations.plans.settings import PREFIX, Settings


@dataclass(frozen=True)
class Condition:
    """A setting (a :class:`Settings` field, host data key ``gpuhost_<setting>``) and the values
    with which a row applies (None: the flag left out, sglang's own default). The key is the
    only source of its flag: gpuhost_server_extra_args naming it in any spelling is refused
    while the settings are read (operations/plans/sglang.py's OWNED_FLAGS)."""

    setting: str
    values: tuple[Any, ...]

    def holds(self, settings: Settings) -> bool:
        return getattr(settings, self.setting) in self.values


@dataclass(frozen=True)
class EnvCondition:
    """A variable of the server's environment (gpuhost_server_env, the launch profile's unless
    set) and the values with which a row applies (None: the variable unset)."""

    name: str
    values: tuple[str | None, ...]

    def holds(self, settings: Settings) -> bool:
        return settings.server_env.get(self.name) in self.values


@dataclass(frozen=True)
class StackFact:
    """One known behaviour of the stack.

    + name: a short id, for tests and messages
    + verdict: "refuse" (certain failure: the host stops while planning) or "warn" (a risk)
    + happens: what happens, one sentence
    + source: where it is read (an issue's URL, a file in a wheel)
    + package, versions: the locked distribution and a PEP 440 specifier of its version
      ("" for any version)
    + compute_capability: a PEP 440 specifier of the GPUs' compute capability ("" for any)
    + architectures: model architectures (config.json's ``architectures[0]``); () for any
    + where: conditions on settings that must all hold
    + any_of: conditions of which one must hold (when there are any)
    + min_concurrency: ``gpuhost_max_running_requests`` at least this (None: any)
    + tensor_parallel_only: only without expert parallelism or a MoE all-to-all backend
    + expert_parallel_only: only with expert parallelism or a MoE all-to-all backend
    + workaround: what to do about a risk
    + change, alternatives: for a refusal, the setting to change and the values allowed instead
    + cuda: the CUDA release of the stack the source saw it on, where only a page's builds
      tell ("13.0": the field page's torch 2.11 cu130); "" where the versions above say it
    """

    name: str
    verdict: Literal["refuse", "warn"]
    happens: str
    source: str
    package: str = "sglang"
    versions: str = ""
    compute_capability: str = ""
    architectures: tuple[str, ...] = ()
    where: tuple[Condition | EnvCondition, ...] = ()
    any_of: tuple[Condition | EnvCondition, ...] = ()
    min_concurrency: int | None = None
    tensor_parallel_only: bool = False
    expert_parallel_only: bool = False
    workaround: str = ""
    change: str | None = None
    alternatives: tuple[str, ...] = ()
    cuda: str = ""


@dataclass(frozen=True)
class Target:
    """What the rows are matched against: the lock's versions by canonical name, one compute
    capability of the host's GPUs ("12.0"), the host's settings, and whether the server runs
    with expert parallelism or a MoE all-to-all backend (from gpuhost_server_extra_args)."""

    versions: Mapping[str, str]
    compute_capability: str
    settings: Settings
    expert_parallel: bool = False


_SM12X: Final = ">=12.0,<13.0"
_GLM5: Final = ("GlmMoeDsaForCausalLM",)
_SGLANG_059: Final = "sglang-0.5.9-py3-none-any.whl"
#: voipmonitor/rtx6kpro's GLM-5 page (operations/plans/launch_profiles.py reads its launch).
_FIELD: Final = ("https://github.com/voipmonitor/rtx6kpro/blob/"
                 "b80ffe7d9dbda90e4524274cd72ab2494aa4bceb/models/glm5.md")
#: The CUDA of the page's builds (torch 2.11 cu130; operations/plans/launch_profiles.py).
_FIELD_CUDA: Final = "13.0"

#: The table. Sources read on 2026-12-01 (the rows after flashinfer-cutlass-fp4-gemm-pdl-race on
#: 2026-12-06).
FACTS: Final[tuple[StackFact, ...]] = (
    StackFact(
        name="flashinfer-trtllm-moe-sm12x",
        verdict="refuse",
        happens="FlashInfer's TRT-LLM MoE kernels have no SM12x build: the MoE runner backend "
                "flashinfer_trtllm fails on these GPUs (\"TRTLLM moe don't supported SM12x, "
                "please use cutlass moe\")",
        source="https://github.com/flashinfer-ai/flashinfer/issues/2045; "
               "flashinfer_python-0.6.3 flashinfer/data/csrc/trtllm_fused_moe_kernel_launcher.cu "
               "(TVM_FFI_ICHECK_EQ(major, 10): \"MoE kernel requires 10.x architecture\")",
        package="flashinfer-python",
        compute_capability=_SM12X,
        where=(Condition("moe_runner_backend", ("flashinfer_trtllm",)),),
        change="moe_runner_backend",
        alternatives=("flashinfer_cutlass", "cutlass", "triton"),
    ),
    StackFact(
        name="flashinfer-trtllm-fp4-gemm-sm12x",
        verdict="refuse",
        happens="FlashInfer's TRT-LLM FP4 GEMM is for compute capability 10.0 and 10.3 only: "
                "sglang passes the FP4 GEMM backend flashinfer_trtllm to flashinfer's mm_fp4 as "
                "'trtllm', and mm_fp4 raises BackendSupportedError (\"mm_fp4 does not support "
                "backend 'trtllm' with capability 120\") at the first FP4 linear layer",
        source="flashinfer_python-0.6.3 flashinfer/gemm/gemm_base.py "
               "(_trtllm_gemm_fp4_requirement is @supported_compute_capability([100, 103]); "
               "mm_fp4's @backend_requirement) and flashinfer/utils.py (backend_requirement's "
               f"wrapper checks it unless skip_check); {_SGLANG_059} "
               "sglang/srt/layers/quantization/fp4_utils.py (get_flashinfer_backend: "
               "flashinfer_trtllm -> trtllm) and modelopt_quant.py (fp4_gemm, called by "
               "ModelOptFp4LinearMethod.apply without skip_check)",
        package="flashinfer-python",
        versions="==0.6.3",
        compute_capability=_SM12X,
        where=(Condition("quantization", ("modelopt_fp4",)),
               Condition("fp4_gemm_backend", ("flashinfer_trtllm",))),
        change="fp4_gemm_backend",
        # mm_fp4's cutlass and cudnn requirements list 120 and 121 (gemm_base.py)
        alternatives=("flashinfer_cutlass", "flashinfer_cudnn"),
    ),
    StackFact(
        name="modelopt-fp4-moe-one-kernel",
        verdict="warn",
        happens="for modelopt_fp4 with tensor parallelism only, the MoE runner backends auto, "
                "triton, cutlass, deep_gemm and flashinfer_cutedsl all run one kernel, "
                "sgl_kernel's cutlass_fp4_group_mm (cutlass_moe_fp4); only flashinfer_cutlass "
                "is a path of its own",
        source=f"{_SGLANG_059} sglang/srt/layers/quantization/modelopt_quant.py "
               "(ModelOptNvFp4FusedMoEMethod.apply; flashinfer_cutedsl only in "
               "apply_without_routing_weights, reached from ep_moe) and "
               "sglang/srt/layers/moe/cutlass_moe.py",
        versions="==0.5.9",
        # auto is flashinfer_trtllm on SM100 for this model family (server_args.py,
        # _handle_model_specific_adjustments, is_sm100_supported)
        compute_capability="!=10.*",
        where=(Condition("quantization", ("modelopt_fp4",)),
               Condition("moe_runner_backend",
                         ("auto", None, "triton", "cutlass", "deep_gemm", "flashinfer_cutedsl"))),
        tensor_parallel_only=True,
        workaround="compare flashinfer_cutlass with one of the five, not all of them "
                   "(the bench's MoE runner backend sweep)",
    ),
    StackFact(
        name="dsa-auto-kv-cache-fp8",
        verdict="warn",
        happens="with gpuhost_kv_cache_dtype auto, sglang picks an FP8 KV cache (fp8_e4m3) "
                "for this DSA model on compute capability 10 and up",
        source=f"{_SGLANG_059} sglang/srt/server_args.py "
               "(ServerArgs._set_default_nsa_kv_cache_dtype: fp8_e4m3 if major >= 10)",
        versions="==0.5.9",
        compute_capability=">=10.0",
        architectures=_GLM5,
        where=(Condition("kv_cache_dtype", ("auto",)),),
        workaround=f"set {PREFIX}kv_cache_dtype explicitly: fp8_e4m3 (what auto gives here, "
                   "as in the reference lab) or bfloat16",
    ),
    StackFact(
        name="dsa-auto-nsa-flashmla",
        verdict="warn",
        happens="an NSA backend left unset is chosen by sglang: FlashMLA (prefill "
                "flashmla_auto, decode flashmla_kv) with an FP8 KV cache, prefill "
                "flashmla_sparse otherwise: one choice for compute capability 10 and up, "
                "SM100's and SM120's alike",
        source=f"{_SGLANG_059} sglang/srt/server_args.py (ServerArgs._set_default_nsa_backends); "
               "https://github.com/sgl-project/sglang/issues/26087",
        versions="==0.5.9",
        compute_capability=">=10.0",
        architectures=_GLM5,
        any_of=(Condition("nsa_prefill_backend", (None,)),
                Condition("nsa_decode_backend", (None,))),
        workaround=f"set {PREFIX}nsa_prefill_backend and {PREFIX}nsa_decode_backend to trtllm "
                   "(the reference lab: decode crashed with NaN on SM120 until both were)",
    ),
    StackFact(
        name="deepgemm-paged-mqa-logits-sm120",
        verdict="warn",
        happens="the NSA indexer calls DeepGEMM's paged MQA logits "
                "(get_paged_mqa_logits_metadata, fp8_paged_mqa_logits) on CUDA whatever the NSA "
                "backend; a DeepGEMM without SM120 kernels asserts \"Unsupported architecture\" "
                "there at startup",
        source="https://github.com/sgl-project/sglang/issues/26087 (GLM-5.1-NVFP4 on 8 x RTX "
               f"PRO 6000, every NSA backend); {_SGLANG_059} "
               "sglang/srt/layers/attention/nsa/nsa_indexer.py",
        versions=">=0.5.9",
        compute_capability=_SM12X,
        architectures=_GLM5,
        workaround="if the server stops with that assertion, this stack cannot serve the model "
                   "on these GPUs (the reference lab served it on sglang 0.5.9 with trtllm NSA "
                   "backends); DeepGEMM's SM120 MQA logits came with "
                   "https://github.com/deepseek-ai/DeepGEMM/pull/324",
    ),
    StackFact(
        name="flashinfer-cutlass-fp4-gemm-pdl-race",
        verdict="warn",
        happens="FlashInfer's CUTLASS FP4 GEMM for SM120 is JIT-built without "
                "-DCUTLASS_ENABLE_GDC_FOR_SM100, so its PDL barriers compile to nothing: output "
                "tiles corrupt (NaN or garbage) with 64+ concurrent requests, reported at "
                "tensor parallel size 8",
        source="https://github.com/flashinfer-ai/flashinfer/issues/2708; fixed by "
               "https://github.com/flashinfer-ai/flashinfer/pull/2780 (#2716 reverted by #2737 "
               "for 0.6.6): flashinfer/jit/gemm/core.py gen_gemm_sm120_module_cutlass_fp4 lacks "
               "the flag in 0.6.3, has it in 0.6.7",
        package="flashinfer-python",
        versions="<0.6.7",
        compute_capability=_SM12X,
        where=(Condition("quantization", ("modelopt_fp4",)),
               # None: sglang 0.5.9's default (ServerArgs.fp4_gemm_runner_backend)
               Condition("fp4_gemm_backend", ("flashinfer_cutlass", None))),
        min_concurrency=64,
        workaround=f"keep {PREFIX}max_running_requests below 64, or use a lock with "
                   "flashinfer-python >= 0.6.7 (sglang 0.5.10 pins 0.6.7.post2); the health "
                   "gate's single request does not show it, a benchmark at 64 concurrent "
                   "requests can",
    ),
    # A warning, not a refusal: the page reports it for its builds (sglang from source after
    # 0.5.9, a FlashInfer path without KV scales), while the reference lab served GLM-5 with
    # sglang 0.5.9's fp8_e4m3 and measured it; the health gate asks for a real completion.
    StackFact(
        name="fp8-kv-cache-garbled-sm120",
        verdict="warn",
        happens="an FP8 KV cache gives garbled output on SM120, or one token and a stop: the "
                "FlashInfer backend reads the cached KV prefix back without its FP8 scales",
        source=f"{_FIELD} (BF16 KV Cache Mandatory; All Errors and Fixes, Error 6)",
        versions=">=0.5.9",
        compute_capability=_SM12X,
        architectures=_GLM5,
        # auto is fp8_e4m3 for this model on compute capability 10 and up (dsa-auto-kv-cache-fp8)
        where=(Condition("kv_cache_dtype", ("fp8_e4m3", "fp8_e5m2", "auto")),),
        workaround=f"set {PREFIX}kv_cache_dtype to bf16 (the launch profiles' field-glm5-sm120 "
                   "value; about 200K tokens of context at mem fraction 0.92 by the page)",
        cuda=_FIELD_CUDA,
    ),
    # A warning: the reference lab served on sglang 0.5.9 without these variables.
    StackFact(
        name="deepgemm-jit-on-sm120",
        verdict="warn",
        happens="DeepGEMM has no SM120 path (it needs WGMMA or TCGEN05), yet sglang turns its "
                "JIT on by default and takes its Blackwell paths on every major 10 to 12 "
                "(is_blackwell_supported); the page's builds failed with \"AttributeError: "
                "'ImportError' object has no attribute 'get_num_sms'\"",
        source=f"{_FIELD} (SM120 Architecture Limitations; Error 1); {_SGLANG_059} "
               "sglang/srt/environ.py (SGLANG_ENABLE_JIT_DEEPGEMM = EnvBool(True)) and "
               "sglang/srt/layers/deep_gemm_wrapper/configurer.py (DEEPGEMM_BLACKWELL)",
        versions=">=0.5.9",
        compute_capability=_SM12X,
        where=(EnvCondition("SGLANG_ENABLE_JIT_DEEPGEMM", (None, "1", "true", "True")),),
        workaround=f"keep SGLANG_ENABLE_JIT_DEEPGEMM=0 and SGLANG_ENABLE_DEEP_GEMM=0 in "
                   f"{PREFIX}server_env (the launch profile's field-glm5-sm120 environment)",
        cuda=_FIELD_CUDA,
    ),
    # Corrected, and said so: the deploy sets the variable (operations/stages/server_unit.py,
    # server_env).
    StackFact(
        name="nextn-needs-spec-v2",
        verdict="warn",
        happens="without SGLANG_ENABLE_SPEC_V2=True sglang turns NEXTN into EAGLE and loads the "
                "model a second time as its draft: out of memory on 96 GB cards (57 GB of "
                "weights per GPU at TP 8); with it, speculative_eagle_topk must be 1",
        source=f"{_FIELD} (MTP / Speculative Decoding); {_SGLANG_059} "
               "sglang/srt/server_args.py (NEXTN becomes EAGLE; \"Spec v2 currently only "
               "supports topk = 1\") and sglang/srt/environ.py (SGLANG_ENABLE_SPEC_V2 = "
               "EnvBool(False))",
        versions=">=0.5.9",
        where=(Condition("speculative_algorithm", ("NEXTN",)),),
        workaround="none needed: the deploy puts SGLANG_ENABLE_SPEC_V2=True in the server's "
                   "environment whenever gpuhost_speculative_algorithm is set",
        cuda=_FIELD_CUDA,
    ),
    StackFact(
        name="flashinfer-cutedsl-moe-ep-sm12x",
        verdict="refuse",
        happens="with expert parallelism the MoE runner backend flashinfer_cutedsl runs "
                "FlashInfer's CuTe DSL masked grouped GEMM, which is for SM100 only "
                "(\"['sm_100', 'sm_103'] are the only supported SM versions for cute-dsl "
                "backend\")",
        source="flashinfer_python-0.6.3 flashinfer/cute_dsl/blockscaled_gemm.py "
               "(Sm100BlockScaledPersistentDenseGemmKernel: supported_sm_versions, tcgen05); "
               f"{_SGLANG_059} sglang/srt/layers/moe/ep_moe/layer.py "
               "(forward_flashinfer_cutedsl)",
        package="flashinfer-python",
        versions="==0.6.3",
        compute_capability=_SM12X,
        where=(Condition("moe_runner_backend", ("flashinfer_cutedsl",)),),
        expert_parallel_only=True,
        change="moe_runner_backend",
        alternatives=("cutlass", "flashinfer_cutlass", "triton"),
    ),
)


def _within(specifier: str, version: str) -> bool:
    if not specifier:
        return True
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


def applies(row: StackFact, target: Target) -> bool:
    """Whether ``row`` applies to ``target``: the package is locked at a version within
    ``versions``, the compute capability within ``compute_capability``, the model architecture
    among ``architectures``, every ``where`` condition holds and one of ``any_of`` does, the
    concurrency reaches ``min_concurrency``, and there is no expert parallelism where
    ``tensor_parallel_only``."""
    s = target.settings
    version = target.versions.get(canonicalize_name(row.package))
    return (
        version is not None
        and _within(row.versions, version)
        and _within(row.compute_capability, target.compute_capability)
        and (not row.architectures or s.model_architecture in row.architectures)
        and all(c.holds(s) for c in row.where)
        and (not row.any_of or any(c.holds(s) for c in row.any_of))
        and (row.min_concurrency is None or s.max_running_requests >= row.min_concurrency)
        and not (row.tensor_parallel_only and target.expert_parallel)
        and not (row.expert_parallel_only and not target.expert_parallel)
    )


def applicable(target: Target, table: Iterable[StackFact] = FACTS) -> list[StackFact]:
    """The rows of ``table`` that apply to ``target``, in table order."""
    return [row for row in table if applies(row, target)]


#: The most characters a known-behaviour warning takes on a real run's screen (--dry shows it
#: whole: :func:`describe`).
BRIEF_CHARS: Final = 160


def brief(row: StackFact, target: Target) -> str:
    """A warning row in one short line for every real run: its name, the versions and GPUs it
    is about, and the start of what happens (at most BRIEF_CHARS); :func:`describe`'s whole
    row, what to do and the source, is --dry's."""
    package = canonicalize_name(row.package)
    head = (f"{row.name}: {package} {target.versions[package]} on compute capability "
            f"{target.compute_capability}: ")
    tail = " ... (--dry: what to do, the source)"
    room = BRIEF_CHARS - len(head) - len(tail)
    happens = row.happens if len(row.happens) <= room else \
        row.happens[:room].rsplit(" ", 1)[0].rstrip(",;:")
    return head + happens + (tail if happens != row.happens else " (--dry: what to do, the "
                                                                   "source)")


def describe(row: StackFact, target: Target) -> str:
    """One line for the host's log: the versions and GPUs it is about, what happens, what to
    do (a refusal: the setting to change and its alternatives) and the source."""
    package = canonicalize_name(row.package)
    about = (f"{package} {target.versions[package]} on compute capability "
             f"{target.compute_capability}")
    if row.verdict == "refuse" and row.change is not None:
        todo = (f"set {PREFIX}{row.change} (now {getattr(target.settings, row.change)!r}) to "
                f"one of {', '.join(row.alternatives)}")
    else:
        todo = f"workaround: {row.workaround}"
    seen = (f"; seen on CUDA {row.cuda} builds, this host's stack is CUDA "
            f"{target.settings.cuda_toolkit}" if row.cuda and row.cuda !=
            target.settings.cuda_toolkit else "")
    return f"{row.name}: {about}: {row.happens}; {todo} [source: {row.source}{seen}]"
