"""Launch profiles: the server flags and environment of the best published launches, as data.

A profile is for GPUs of some compute capability, a model architecture and a range of sglang
releases; it gives values of the server's settings (``gpuhost_<setting>``, rendered to flags by
operations/plans/sglang.py's server_args) and says, for each, where the value comes from. What the
source launch named and the profile does not take is listed with the reason (``left``).

Host data key ``gpuhost_launch_profile`` names one; unset, the deploy takes the first profile of
:data:`PROFILES` that matches the host and whose command line the locked sglang's own parser
accepts (locks/sglang-<version>.args.json; operations/plans/settings.py checks it). A host data key
of the user's own always wins over a profile's value for it.

Sources read on 2026-12-06: voipmonitor/rtx6kpro's models/glm5.md at commit
b80ffe7d9dbda90e4524274cd72ab2494aa4bceb (2026-03-31; the benchmark tables of commit b13bf21,
2026-03-30, are unchanged there and at the page's head, 29f3863 of 2026-05-04), the sglang
0.5.9 and 0.5.10 parsers (locks/sglang-0.5.9.args.json, locks/sglang-0.5.10.args.json) and
sglang-0.5.9-py3-none-any.whl's sglang/srt/server_args.py and sglang/srt/environ.py; for the
CUDA 13 stack (locks/cuda13.0.txt), the sglang 0.5.17 parser (locks/sglang-0.5.17.args.json)
and sglang-0.5.17-cp312-cp312-manylinux_2_34_x86_64.whl's fp4_utils.py and
speculative/base_spec_worker.py. Each profile names the CUDA its figure was measured on.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Final

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version


@dataclass(frozen=True)
class Value:
    """One setting's value in a profile and where it comes from."""

    setting: str
    value: Any
    why: str


@dataclass(frozen=True)
class Left:
    """A flag or variable of the source launch that the profile does not take, and why."""

    what: str
    why: str


@dataclass(frozen=True)
class LaunchProfile:
    """One launch.

    + name: the value of ``gpuhost_launch_profile``
    + summary: one line
    + source: where the launch is published (a page at a commit, a file)
    + figure: what it measured, with the stack it ran on ("" where nothing was measured)
    + cuda: the CUDA release of the stack it was measured on ("13.0": torch 2.11 cu130)
    + compute_capability: a PEP 440 specifier of the GPUs' compute capability
    + architectures: model architectures (config.json's ``architectures[0]``)
    + sglang: a PEP 440 specifier of the locked sglang's version ("" for any)
    + values: the settings it gives, each with its reason
    + left: what of the source launch it does not take, each with its reason
    """

    name: str
    summary: str
    source: str
    figure: str
    cuda: str
    compute_capability: str
    architectures: tuple[str, ...]
    sglang: str
    values: tuple[Value, ...]
    left: tuple[Left, ...] = ()

    def settings(self) -> dict[str, Any]:
        """The profile's values by setting name."""
        return {v.setting: v.value for v in self.values}

    def matches(self, compute_capability: str, architecture: str, sglang: str) -> bool:
        """Whether the profile is for these GPUs, this model architecture and this sglang."""
        return (_within(self.compute_capability, compute_capability)
                and architecture in self.architectures and _within(self.sglang, sglang))


def _within(specifier: str, version: str) -> bool:
    if not specifier:
        return True
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except InvalidVersion:
        return False


_FIELD: Final = ("https://github.com/voipmonitor/rtx6kpro/blob/"
                 "b80ffe7d9dbda90e4524274cd72ab2494aa4bceb/models/glm5.md")
_FIELD_FIGURE: Final = (
    "1010.6 output tok/s decode at 64 concurrent requests, 659.7 at 32, 50.4 at 1 (MTP off, "
    "context 0; 1424.6 at 64 with MTP NEXTN): 8 x RTX PRO 6000 Blackwell, TP 8, "
    "GLM-5-NVFP4, sglang built from source with SM120 patches, torch 2.11 cu130, March 2026 "
    f"({_FIELD}, Benchmark Results)")
#: The CUDA the page's builds ran: torch 2.11 cu130 (its figure's stack, above).
_FIELD_CUDA: Final = "13.0"
_SM12X: Final = ">=12.0,<13.0"
_GLM5: Final = ("GlmMoeDsaForCausalLM",)

#: The page's launch ("SGLang Launch Commands": the Docker run with MTP + b12x, and "For
#: high-concurrency serving (4+ users), switch MoE backend: --fp4-gemm-backend cutlass
#: --moe-runner-backend cutlass"), the values every version of it shares.
_FIELD_COMMON: Final = (
    Value("kv_cache_dtype", "bf16", f"{_FIELD} (BF16 KV Cache Mandatory: fp8_e4m3 gives "
          "garbled output on SM120)"),
    Value("quantization", "modelopt_fp4", f"{_FIELD} (--quantization modelopt_fp4)"),
    Value("attention_backend", "flashinfer", f"{_FIELD} (--attention-backend flashinfer)"),
    Value("moe_runner_backend", "cutlass", f"{_FIELD} (--moe-runner-backend cutlass for 4+ "
          "users: 1010.6 tok/s at 64 concurrent requests)"),
    # The page names no NSA backend flag: its build runs GLM-5 past the DSA backends
    # (a patched server_args.py, "Error 4"). sglang 0.5.9 left to itself picks FlashMLA
    # (ServerArgs._set_default_nsa_backends), which has no SM120 kernels (sglang#26087).
    Value("nsa_decode_backend", "trtllm", "not named by the page (its patched build bypasses "
          "the DSA backends); sglang 0.5.9's own choice, FlashMLA, does not run on SM120 "
          "(sglang#26087): the reference lab's trtllm, with which decode stopped crashing "
          "with NaN"),
    Value("nsa_prefill_backend", "trtllm", "as the NSA decode backend"),
    Value("fp8_gemm_backend", "cutlass", "not named by the page; the reference lab's "
          "(--fp8-gemm-backend cutlass)"),
    Value("mem_fraction_static", 0.85, f"{_FIELD} (--mem-fraction-static 0.85; the page's "
          "range is 0.85-0.92)"),
    Value("max_running_requests", 64, f"{_FIELD} (--max-running-requests 64)"),
    Value("reasoning_parser", "glm45", f"{_FIELD} (--reasoning-parser glm45)"),
    Value("tool_call_parser", "glm47", f"{_FIELD} (--tool-call-parser glm47)"),
    Value("trust_remote_code", True, f"{_FIELD} (--trust-remote-code)"),
    Value("enable_flashinfer_allreduce_fusion", True, f"{_FIELD} "
          "(--enable-flashinfer-allreduce-fusion, in the launch of the benchmarks; the page "
          "dropped it on 2026-04-01 with the PCIe oneshot all-reduce, since reverted for 8 "
          "GPUs)"),
    Value("server_extra_args", ("--chunked-prefill-size", "16384", "--cuda-graph-max-bs", "32",
                                "--model-loader-extra-config",
                                '{"enable_multithread_load": true, "num_threads": 16}'),
          f"{_FIELD} (--chunked-prefill-size 16384, --cuda-graph-max-bs 32, "
          "--model-loader-extra-config: the flags no gpuhost key owns; sglang 0.5.9's "
          "model_loader/loader.py reads enable_multithread_load and num_threads)"),
    Value("server_env", {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1",
                         "SGLANG_ENABLE_JIT_DEEPGEMM": "0", "SGLANG_ENABLE_DEEP_GEMM": "0"},
          f"{_FIELD} (the launch's -e variables: DeepGEMM has no SM120 path; sglang 0.5.9 "
          "reads SGLANG_ENABLE_JIT_DEEPGEMM, default on, in srt/environ.py; "
          "SGLANG_ENABLE_DEEP_GEMM is read by the page's newer build only)"),
    # MTP: rendered only with gpuhost_speculative_algorithm set (operations/plans/sglang.py).
    Value("speculative_num_steps", 4, f"{_FIELD} (--speculative-num-steps 4: 1424.6 tok/s "
          "at 64 concurrent requests with MTP)"),
    Value("speculative_eagle_topk", 1, f"{_FIELD} (--speculative-eagle-topk 1; with "
          "SGLANG_ENABLE_SPEC_V2 sglang 0.5.9 allows topk 1 only)"),
)

_FIELD_LEFT: Final = (
    Left("--model-path festr2/GLM-5-NVFP4-MTP", "the model is gpuhost_model's; a profile "
         "picks no checkpoint"),
    Left("--host 0.0.0.0 --port 5000", "gpuhost_server_host and gpuhost_server_port"),
    Left("--disable-custom-all-reduce", "set by the P2P decision (operations/plans/p2p_policy.py) "
         "where direct peer access is not measured working"),
    Left("--enable-metrics", "every server gets it (operations/plans/sglang.py, ALWAYS_FLAGS)"),
    Left("--sleep-on-idle", "added to the page on 2026-03-31 after the benchmarks were run"),
    Left("--speculative-algorithm NEXTN", "MTP is gpuhost_speculative_algorithm's: it needs a "
         "checkpoint with the MTP layer"),
    Left("--json-model-override-args index_topk_pattern", "sglang 0.5.9 reads no "
         "index_topk_pattern (not in the wheel's sources)"),
    Left("NCCL_IB_DISABLE, NCCL_P2P_LEVEL=SYS, NCCL_ALLOC_P2P_NET_LL_BUFFERS, "
         "NCCL_MIN_NCHANNELS", "set by the P2P decision from what was measured on the host "
         "(operations/plans/p2p_policy.py)"),
    Left("NCCL_GRAPH_FILE=/etc/nccl_graph_opt.xml", "a file of the page's Docker image, not "
         "on a gpuhost host"),
    Left("SGLANG_ENABLE_SPEC_V2=True",
         "set by the deploy with MTP on (operations/stages/server_unit.py)"),
)

#: The field's page as published: its variants below differ only where their sglang does.
_FIELD_PROFILE: Final = LaunchProfile(
    name="field-glm5-sm120",
    summary="the field's best published GLM-5-NVFP4 launch on 8 x RTX PRO 6000 (SM120): "
            "CUTLASS MoE and FP4 GEMM, BF16 KV cache, FlashInfer attention",
    source=_FIELD,
    figure=_FIELD_FIGURE,
    cuda=_FIELD_CUDA,
    compute_capability=_SM12X,
    architectures=_GLM5,
    sglang=">=0.5.9",
    values=(*_FIELD_COMMON,
            Value("fp4_gemm_backend", "cutlass", f"{_FIELD} (--fp4-gemm-backend cutlass "
                  "for 4+ users)"),
            Value("speculative_num_draft_tokens", 6, f"{_FIELD} "
                  "(--speculative-num-draft-tokens 6)")),
    left=_FIELD_LEFT,
)

#: The profiles, best first: the first that matches a host and that the locked sglang's parser
#: accepts is the default.
PROFILES: Final[tuple[LaunchProfile, ...]] = (
    _FIELD_PROFILE,
    replace(
        _FIELD_PROFILE,
        name="field-glm5-sm120-sglang0.5.9",
        summary="field-glm5-sm120 with what sglang 0.5.9 has: its FP4 GEMM backend is "
                "FlashInfer's CUTLASS one (0.5.9 has no --fp4-gemm-backend cutlass)",
        sglang=">=0.5.9,<0.5.10",
        values=(*_FIELD_COMMON,
                Value("fp4_gemm_backend", "flashinfer_cutlass", "the page's "
                      "--fp4-gemm-backend cutlass is not among sglang 0.5.9's choices "
                      "(locks/sglang-0.5.9.args.json; 0.5.10 has it): 0.5.9's default, "
                      "FlashInfer's CUTLASS FP4 GEMM, as in the reference lab"),
                Value("speculative_num_draft_tokens", 5, "the page's 6 with 4 steps and "
                      "topk 1 is what sglang 0.5.9 turns into steps + 1 = 5 "
                      "(server_args.py: speculative_num_draft_tokens is adjusted to "
                      "speculative_num_steps + 1 when speculative_eagle_topk == 1)")),
    ),
    replace(
        _FIELD_PROFILE,
        name="field-glm5-sm120-cuda13",
        summary="field-glm5-sm120 on the CUDA 13 stack's sglang (locks/cuda13.0.txt): its FP4 "
                "GEMM backend is FlashInfer's CUTLASS one (no --fp4-gemm-backend cutlass there)",
        # 0.5.11 is the first sglang on torch 2.11 cu130; 0.5.20 dropped --nsa-*-backend
        sglang=">=0.5.11,<0.5.20",
        values=(*_FIELD_COMMON,
                Value("fp4_gemm_backend", "flashinfer_cutlass", "the page's "
                      "--fp4-gemm-backend cutlass is not among sglang 0.5.17's choices "
                      "(locks/sglang-0.5.17.args.json); sglang-0.5.17's "
                      "sglang/srt/layers/quantization/fp4_utils.py (initialize_fp4_gemm_config) "
                      "resolves auto to flashinfer_cutlass on SM120, made explicit"),
                Value("speculative_num_draft_tokens", 5, "the page's 6 with 4 steps and "
                      "topk 1: sglang 0.5.17 asserts draft tokens == steps + 1 for topk 1 "
                      "(sglang/srt/speculative/base_spec_worker.py)")),
    ),
    LaunchProfile(
        name="reference-lab",
        summary="the reference lab's hand-made launch (FP8 KV cache, FlashInfer CUTLASS MoE, "
                "trtllm NSA backends)",
        source="../shared/reference-lab.md (the operator's launch, with the measured "
               "baseline's --moe-runner-backend flashinfer_cutlass and --kv-cache-dtype auto "
               "made explicit as what sglang 0.5.9 resolves it to)",
        figure="about 225 output tok/s (516 total) at 64 concurrent requests, 11 tok/s for "
               "one stream: 8 x RTX PRO 6000 Blackwell, TP 8, sglang 0.5.9, CUDA 12.8",
        cuda="12.8",
        compute_capability=_SM12X,
        architectures=_GLM5,
        sglang="==0.5.9",
        values=(
            Value("kv_cache_dtype", "fp8_e4m3", "--kv-cache-dtype auto, which sglang 0.5.9 "
                  "resolves to fp8_e4m3 for GLM-5 on compute capability 10 and up "
                  "(_set_default_nsa_kv_cache_dtype)"),
            Value("quantization", "modelopt_fp4", "--quantization modelopt_fp4"),
            Value("attention_backend", "flashinfer", "--attention-backend flashinfer"),
            Value("fp8_gemm_backend", "cutlass", "--fp8-gemm-backend cutlass"),
            Value("fp4_gemm_backend", "flashinfer_cutlass", "sglang 0.5.9's default "
                  "(ServerArgs.fp4_gemm_runner_backend), made explicit"),
            Value("nsa_decode_backend", "trtllm", "--nsa-decode-backend trtllm (NaN in decode "
                  "until both NSA backends were trtllm)"),
            Value("nsa_prefill_backend", "trtllm", "--nsa-prefill-backend trtllm"),
            Value("moe_runner_backend", "flashinfer_cutlass", "the measured baseline's (the "
                  "last launch's flashinfer_trtllm was an experiment never recorded)"),
            Value("mem_fraction_static", 0.92, "--mem-fraction-static 0.92"),
            Value("max_running_requests", 64, "--max-running-requests 64"),
            Value("reasoning_parser", "glm45", "--reasoning-parser glm45"),
            Value("tool_call_parser", "glm47", "--tool-call-parser glm47"),
            Value("trust_remote_code", True, "--trust-remote-code"),
            Value("enable_flashinfer_allreduce_fusion", True,
                  "--enable-flashinfer-allreduce-fusion"),
            Value("server_extra_args", (), "no other flag"),
            Value("server_env", {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1"},
                  "OMP_NUM_THREADS=8 SAFETENSORS_FAST_GPU=1 (the NCCL_* ones are the P2P "
                  "decision's, CUDA_HOME the unit's)"),
            Value("speculative_num_steps", None, "no speculative decoding: sglang chooses"),
            Value("speculative_eagle_topk", None, "as speculative_num_steps"),
            Value("speculative_num_draft_tokens", None, "as speculative_num_steps"),
        ),
    ),
)

#: Every profile's name.
NAMES: Final = tuple(p.name for p in PROFILES)

#: The settings a profile gives (each profile gives all of them, so that switching profiles
#: never leaves another profile's value behind).
PROFILE_SETTINGS: Final = tuple(v.setting for v in PROFILES[0].values)
assert all({v.setting for v in p.values} == set(PROFILE_SETTINGS) for p in PROFILES), \
    "every profile gives every profile setting"


def named(name: str) -> LaunchProfile:
    """The profile called ``name``; KeyError for another name."""
    for profile in PROFILES:
        if profile.name == name:
            return profile
    raise KeyError(name)


def matching(compute_capability: str, architecture: str, sglang: str,
             profiles: Iterable[LaunchProfile] = PROFILES) -> list[LaunchProfile]:
    """The profiles for these GPUs, model architecture and sglang release, best first."""
    return [p for p in profiles if p.matches(compute_capability, architecture, sglang)]


def _flag_of(setting: str) -> str:
    from operations.plans.sglang import OWNED_FLAGS
    for flag, keys in OWNED_FLAGS.items():
        if keys[0] == setting:
            return flag
    return {"server_env": "environment", "server_extra_args": "flags"}[setting]


def shown(setting: str, value: Any) -> str:
    """A profile value as the server gets it: ``--kv-cache-dtype bf16``, ``--trust-remote-code``,
    ``environment A=1 B=2``; a value that renders nothing says so."""
    flag = _flag_of(setting)
    if isinstance(value, Mapping):
        return f"{flag} " + " ".join(f"{k}={v}" for k, v in sorted(value.items()))
    if isinstance(value, tuple):
        return f"{flag} " + " ".join(value) if value else f"no more {flag}"
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    if value is None:
        return f"no {flag}"
    return f"{flag} {value}"


def report(profile: LaunchProfile | None, given: Iterable[str],
           passed_over: Iterable[tuple[str, str]], sglang: str, named: bool,
           whole: bool, cuda: str | None = None) -> list[str]:
    """What the plan says of a host's launch profile: its name, how it was chosen (named by
    gpuhost_launch_profile, or the first the locked sglang accepts, with the profiles passed
    over and why), its source and figure; then every value it set (``whole``: one line each
    with its reason, then what of the source launch it left out; else all in one line) and
    the keys of the host's own that won over it; where the host's stack runs another CUDA
    (``cuda``, gpuhost_cuda_toolkit) than the profile was measured on, a line that says so."""
    passed = "; ".join(f"{name} passed over: {why}" for name, why in passed_over)
    if profile is None:
        return [f"no launch profile for these GPUs, model architecture and sglang {sglang}"
                + (f" ({passed})" if passed else "") + ": the settings' own defaults"]
    how = ("named by gpuhost_launch_profile" if named else
           f"the first profile the locked sglang {sglang} accepts" + (f"; {passed}" if passed
                                                                      else ""))
    mine = [v for v in profile.values if v.setting in set(given)]
    ours = [v for v in profile.values if v.setting not in set(given)]
    lines = [f"launch profile {profile.name} ({how}): {profile.summary} [source: "
             f"{profile.source}; measured: {profile.figure}]"]
    if whole:
        lines += [f"launch profile {profile.name} sets {shown(v.setting, v.value)} "
                  f"(gpuhost_{v.setting}): {v.why}" for v in ours]
        lines += [f"launch profile {profile.name} leaves out {left.what}: {left.why}"
                  for left in profile.left]
    else:
        lines.append(f"launch profile {profile.name} sets "
                     + "; ".join(shown(v.setting, v.value) for v in ours)
                     + " (--dry: the reason for each)")
    if cuda is not None and cuda != profile.cuda:
        lines.append(f"launch profile {profile.name} was measured on CUDA {profile.cuda}; this "
                     f"host's stack is CUDA {cuda} (gpuhost_cuda_toolkit): its figure is not "
                     "this stack's")
    if mine:
        lines.append(f"launch profile {profile.name}: your own "
                     + ", ".join(f"gpuhost_{v.setting}" for v in mine)
                     + " win over its " + "; ".join(shown(v.setting, v.value) for v in mine))
    return lines
