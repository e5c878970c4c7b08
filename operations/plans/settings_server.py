"""The server's settings: the launch profile, sglang's flags, nodes, MTP, the bind, the weights."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from operations.plans import launch_profiles
from operations.plans import proxy as download_proxy
from operations.plans.settings_rules import (
    _BOOL,
    _PATH,
    _PATH_ALLOWED,
    _PATH_DETAIL,
    _UNSET,
    _URL,
    _int_between,
    _is_host,
    _is_int,
    _one_of,
    _Rule,
    _text,
    setting,
)

#: The speculative decoding gpuhost turns on: NEXTN, the model's own MTP layer (sglang 0.5.9's
#: --speculative-algorithm choices: EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM; the others need a
#: draft model or tables gpuhost does not provide).
SPECULATIVE_ALGORITHMS: Final = ("NEXTN",)

#: The rendezvous port on rank 0 (``--dist-init-addr <rank 0>:<port>``): the port of the
#: example in sglang 0.5.9's own help for --dist-init-addr (sglang/srt/server_args.py:
#: "e.g., `192.168.0.2:25000`").
DIST_INIT_PORT: Final = 25000


#: What the server's environment gets from gpuhost itself: the unit (CUDA_HOME, PATH,
#: LD_LIBRARY_PATH, the kernel caches of operations/stages/kernel_cache.py), server.env
#: (HF_HUB_OFFLINE: the weights are local) and the P2P decision (operations/plans/p2p_policy.py). An
#: EnvironmentFile wins over the unit's Environment= lines, and the P2P file is read last:
#: gpuhost_server_env naming one of these would override gpuhost, or be silently overridden.
RESERVED_ENV: Final = ("CUDA_HOME", "PATH", "LD_LIBRARY_PATH", "HF_HUB_OFFLINE",
                       "FLASHINFER_WORKSPACE_BASE", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR",
                       "TORCH_EXTENSIONS_DIR",
                       "NCCL_IB_DISABLE", "NCCL_P2P_LEVEL", "NCCL_ALLOC_P2P_NET_LL_BUFFERS",
                       "NCCL_MIN_NCHANNELS", "NCCL_P2P_DISABLE", "GPUHOST_P2P_SERVER_ARGS",
                       "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "SGLANG_ENABLE_SPEC_V2")


def _is_env(value: Any) -> bool:
    # No backslash in a value: at a line's end, systemd's EnvironmentFile joins the next line.
    return isinstance(value, Mapping) and all(
        isinstance(k, str) and re.fullmatch(r"[A-Z_][A-Z0-9_]*", k) and k not in RESERVED_ENV
        and isinstance(v, str) and "\\" not in v for k, v in value.items()
    )


#: A drop-in's file name: systemd reads only ``*.conf`` in a unit's ``.d`` folder
#: (systemd.unit(5), "drop-in").
DROPIN_NAME: Final = r"[A-Za-z0-9][A-Za-z0-9._+@-]*\.conf"

_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
#: A user name as Debian 12's adduser 3.134 accepts one (/etc/adduser.conf: NAME_REGEX
#: ``^[a-z][-a-z0-9_]*\$?$``, SYS_NAME_REGEX ``^[a-z_][-a-z0-9_]*\$?$``; a trailing '$' is for
#: Samba's machine accounts, left out), at most 32 characters (useradd(8) of passwd 4.13:
#: "Usernames may only be up to 32 characters long")
_USER_NAME = r"[a-z_][a-z0-9_-]{0,31}"


@dataclass(frozen=True)
class ServerSettings:
    """The server's part of Settings (operations/plans/settings_schema.py)."""
    # The server. The launch profile's settings (operations/plans/launch_profiles.py,
    # PROFILE_SETTINGS) default to the default profile's values for the default lock
    # (field-glm5-sm120-sglang0.5.9; tests/test_launch_profiles.py checks they agree).
    launch_profile: str | None = setting(
        None, _one_of(launch_profiles.NAMES, optional=True),
        "the launch profile whose flags and environment the server keys default to "
        "(operations/plans/launch_profiles.py; docs/profiles.md): None takes the first profile for "
        "the GPUs, the model architecture and the locked sglang whose flags that sglang's "
        "parser accepts; any `gpuhost_` key you set wins over the profile's value. `--dry` "
        "names the profile, its source and every value it set")
    model: str = setting(
        "lukealonso/GLM-5-NVFP4",
        _text(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?|" + _PATH,
              f"a Hugging Face repository id (owner/name) or {_PATH_ALLOWED}"),
        "`--model`")
    served_model_name: str = setting(
        "glm-5",
        _text(_NAME, "a name of letters, digits, '_', '.', '-' that starts "
              "with a letter or digit"),
        "`--served-model-name`; the health gate waits for it in `/v1/models`")
    tensor_parallel_size: int = setting(
        8, _int_between(1, 64),
        "`--tp`; must divide `gpuhost_gpu_count` (divided by `gpuhost_pipeline_parallel_size` "
        "where set); on a node of a group, `gpuhost_gpu_count` x nodes / pipeline parallel size")
    pipeline_parallel_size: int | None = setting(
        None,
        _Rule(lambda v: v is None or (_is_int(v) and 1 <= v <= 64),
              "an integer from 1 to 64" + _UNSET),
        "`--pipeline-parallel-size` (1 to 64), left out when None")
    # One server across hosts (operations/plans/node_group.py): the group's hosts in rank order
    nodes: tuple[str, ...] = setting(
        (),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and (not v or (
                2 <= len(v) <= 64 and all(isinstance(n, str) and n for n in v)
                and len(set(v)) == len(v))),
            "a list of 2 to 64 distinct inventory host names, rank 0 first (the hosts of one "
            "server across nodes), or [] for a server of the host's own"),
        "on a group: its hosts, rank 0 first, which then serve as one server (a model across "
        "hosts)")
    node_interface: str | None = setting(
        None,
        # Linux's IFNAMSIZ is 16 with the NUL (include/uapi/linux/if.h); dev_valid_name refuses
        # '/', ':' and whitespace (net/core/dev.c).
        _text(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}",
              "a network interface name such as eth0 or ens1f0 (up to 15 "
              "letters, digits, '_', '.', '-')", optional=True),
        "the interface the nodes reach each other on (the same name on every node); None finds "
        "the one IPv4 network every node has an address in")
    dist_init_port: int = setting(
        DIST_INIT_PORT, _int_between(1024, 65535),
        "the rendezvous port on rank 0 (`--dist-init-addr <rank 0>:<port>`; sglang's own help "
        "gives 25000 as its example)")
    mem_fraction_static: float = setting(
        0.85,
        _Rule(
            lambda v: isinstance(v, float) and 0.0 < v < 1.0, "a float strictly between 0 and 1"
        ),
        "`--mem-fraction-static`, strictly between 0 and 1")
    max_running_requests: int = setting(64, _int_between(1, 65536), "`--max-running-requests`")
    model_architecture: str = setting(
        "GlmMoeDsaForCausalLM",
        _text(r"[A-Za-z][A-Za-z0-9_]*", "a model architecture as the "
              "model's config.json names it (its architectures[0]), such as "
              "GlmMoeDsaForCausalLM"),
        "the model's architecture, as its `config.json` names it (`architectures[0]`); the known "
        "behaviour rows and sglang's automatic choices depend on it; once the weights are on the "
        "host, a `config.json` naming another is refused while planning")
    kv_cache_dtype: str = setting(
        "bf16", _text(_NAME, "a kv cache dtype such as auto, fp8_e4m3"),
        "`--kv-cache-dtype`; the profile's (bf16: an FP8 KV cache gives garbled output on "
        "SM120, voipmonitor/rtx6kpro models/glm5.md)")
    quantization: str | None = setting(
        "modelopt_fp4", _text(_NAME, "a quantization method name", optional=True),
        "`--quantization` (None leaves it out)")
    attention_backend: str | None = setting(
        "flashinfer", _text(_NAME, "an attention backend name", optional=True),
        "`--attention-backend`")
    fp8_gemm_backend: str | None = setting(
        "cutlass", _text(_NAME, "an FP8 GEMM backend name", optional=True),
        "`--fp8-gemm-backend`")
    fp4_gemm_backend: str | None = setting(
        "flashinfer_cutlass", _text(_NAME, "an FP4 GEMM backend name", optional=True),
        "`--fp4-gemm-backend` (sglang 0.5.9's default, made explicit)")
    nsa_decode_backend: str | None = setting(
        "trtllm", _text(_NAME, "an NSA decode backend name", optional=True),
        "`--nsa-decode-backend` (trtllm avoids the NaN decode crash on SM120)")
    nsa_prefill_backend: str | None = setting(
        "trtllm", _text(_NAME, "an NSA prefill backend name", optional=True),
        "`--nsa-prefill-backend`")
    moe_runner_backend: str | None = setting(
        "cutlass", _text(_NAME, "a MoE runner backend name", optional=True),
        "`--moe-runner-backend`, the MoE runner backend: the profile's (cutlass, the field's "
        "best at 64 concurrent requests; the reference lab's measured baseline was "
        "flashinfer_cutlass)")
    # MTP (speculative decoding): off unless the algorithm is set
    speculative_algorithm: str | None = setting(
        None, _one_of(SPECULATIVE_ALGORITHMS, optional=True),
        "`--speculative-algorithm`: `NEXTN` turns MTP (speculative decoding with the model's own "
        "MTP layer) on, with `SGLANG_ENABLE_SPEC_V2=True` in the server's environment; refused "
        "while planning where the locked sglang lacks the flag or the checkpoint's weight index "
        "lacks the MTP layer; None: off")
    speculative_num_steps: int | None = setting(
        4,
        _Rule(lambda v: v is None or (_is_int(v) and 1 <= v <= 16),
              "an integer from 1 to 16" + _UNSET),
        "`--speculative-num-steps` with MTP on (the profile's); None leaves the three step "
        "counts to sglang, which then needs all three unset")
    speculative_eagle_topk: int | None = setting(
        1,
        _Rule(lambda v: v is None or v == 1,
              "1 (sglang 0.5.9 with SGLANG_ENABLE_SPEC_V2, which the "
              "deploy sets for MTP, allows topk 1 only: server_args.py, "
              '"Spec v2 currently only supports topk = 1")' + _UNSET),
        "`--speculative-eagle-topk` with MTP on: 1 or None")
    speculative_num_draft_tokens: int | None = setting(
        5,
        _Rule(lambda v: v is None or (_is_int(v) and 2 <= v <= 64),
              "an integer from 2 to 64" + _UNSET),
        "`--speculative-num-draft-tokens` with MTP on; sglang 0.5.9 makes it steps + 1 where "
        "topk is 1")
    reasoning_parser: str | None = setting(
        "glm45", _text(_NAME, "a reasoning parser name", optional=True),
        "`--reasoning-parser`")
    tool_call_parser: str | None = setting(
        "glm47", _text(_NAME, "a tool call parser name", optional=True),
        "`--tool-call-parser`")
    trust_remote_code: bool = setting(True, _BOOL, "`--trust-remote-code`")
    enable_flashinfer_allreduce_fusion: bool = setting(
        True, _BOOL,
        "`--enable-flashinfer-allreduce-fusion`")
    server_host: str = setting(
        "127.0.0.1", _Rule(_is_host, "an IP address such as 127.0.0.1"),
        "`--host`: the address the server binds")
    server_port: int = setting(8000, _int_between(1, 65535), "`--port`")
    #: Local users whose processes may connect to a loopback server (root's always may;
    #: operations/stages/loopback_guard.py)
    server_local_users: tuple[str, ...] = setting(
        (),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and len(set(v)) == len(v)
            and all(isinstance(u, str) and re.fullmatch(_USER_NAME, u) and u != "root" for u in v),
            "a list of local user names, each once (lower-case letters, digits, '_' and '-', "
            "starting with a letter or '_', at most 32 characters; not root, who always may)"),
        "local users (besides root) whose processes may connect to a server bound to the "
        "loopback, e.g. the account you run clients or an SSH tunnel from; everyone else's are "
        "refused by the host's firewall (docs/security.md); only with a loopback "
        "`gpuhost_server_host` (a wider bind is reached through its gate, with the API key)")
    server_extra_args: tuple[str, ...] = setting(
        ("--chunked-prefill-size", "16384", "--cuda-graph-max-bs", "32",
         "--model-loader-extra-config", '{"enable_multithread_load": true, "num_threads": 16}'),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v),
            "a list of strings",
        ),
        "more sglang flags, appended as given; the profile's (`--chunked-prefill-size`, "
        "`--cuda-graph-max-bs`, `--model-loader-extra-config`) unless you set this key")
    server_env: Mapping[str, str] = setting(
        {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1",
         "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
         "SGLANG_ENABLE_DEEP_GEMM": "0"},
        _Rule(_is_env, "a dict of UPPER_CASE names to string values without "
              "backslashes, naming none of what gpuhost sets itself ("
              + ", ".join(RESERVED_ENV) + ")"),
        "the server's environment; the profile's (with `SGLANG_ENABLE_JIT_DEEPGEMM=0`: "
        "DeepGEMM has no SM120 path) unless you set this key")
    health_timeout: int = setting(
        1800, _int_between(10, 86400),
        "seconds the deploy waits for the server to serve the model")
    server_start_timeout: int = setting(
        3600, _int_between(60, 7 * 86400),
        "seconds systemd gives one start of the server (weight loading included) before it counts "
        "as failed (`TimeoutStartSec`); three failed starts within three such windows leave the "
        "unit failed")
    server_backend_port: int = setting(
        30000, _int_between(1, 65535),
        "the server's port on 127.0.0.1 behind the API key gate, when `gpuhost_server_host` is "
        "wider than the loopback")
    api_key_file: str | None = setting(
        None,
        _text(_PATH, f"an absolute path on the host, root-only {_PATH_DETAIL}",
              optional=True),
        "secret file (docs/security.md) on the host holding the API key; needed to bind wider than "
        "127.0.0.1; read by the gate only, never by sglang")
    allowed_dropins: tuple[str, ...] = setting(
        (),
        _Rule(
            lambda v: isinstance(v, (list, tuple)) and all(
                isinstance(n, str) and re.fullmatch(DROPIN_NAME, n) for n in v),
            "a list of drop-in file names under /etc/systemd/system/sglang.service.d/ such as "
            '"50-local.conf" (letters, digits and . _ + @ -, ending in .conf)',
        ),
        "file names of drop-ins under `/etc/systemd/system/sglang.service.d/` that are not "
        "gpuhost's and stay (e.g. `[\"50-local.conf\"]`); any other `*.conf` there that gpuhost "
        "does not write is reported and removed")
    # Model weights
    model_dir: str = setting(
        "/opt/gpuhost/models", _text(_PATH, _PATH_ALLOWED),
        "where the weights are downloaded: `<dir>/<repository id>` (when `gpuhost_model` is an "
        "absolute path, that folder is served as it is)")
    model_revision: str = setting(
        "main",
        _text(r"(?!.*(?:^|/)\.\.?(?:/|$))[A-Za-z0-9][A-Za-z0-9_.\-/]*(?<!/)",
              "a branch, tag or commit sha of the model's repository"),
        "branch, tag or commit sha of `gpuhost_model`; a change downloads again and restarts the "
        "server. A branch or tag is one commit per fleet, the one its hosts hold (a host added "
        "later gets it); a move on the Hub is said: pin its sha to serve it (docs/fleet.md)")
    hf_endpoint: str = setting(
        "https://huggingface.co",
        _text(_URL + r"(?<!/)", "an http(s) URL without a trailing slash"),
        "the Hub's URL (huggingface_hub's `HF_ENDPOINT`: a mirror's, or the sandbox's)")
    proxy: str | None = setting(  # every download's (operations/plans/proxy.py)
        None, _text(download_proxy.URL, download_proxy.URL_ALLOWED, optional=True),
        download_proxy.HELP)
    hf_token_file: str | None = setting(
        None,
        _text(_PATH, f"an absolute path on the host, root-only {_PATH_DETAIL}",
              optional=True),
        "secret file (docs/security.md) on the host holding the Hub token for gated "
        "repositories; its path is all the deploy handles")
    model_copy_from_peers: bool = setting(
        True, _BOOL,
        "copy the weights from another inventory host serving the same repository and revision, "
        "whose copy is complete, before the Hub (docs/rebuild.md); every file is verified "
        "against the Hub's metadata, a wrong one downloaded from the Hub")
    model_copy_bwlimit: int | None = setting(
        None,
        _Rule(lambda v: v is None or (_is_int(v) and v >= 1),
              "an integer >= 1 (KiB/s, rsync's --bwlimit), or None"),
        "KiB/s the copy from a peer may use (rsync's `--bwlimit`), None for no limit")
    model_mirror: str | None = setting(
        None,
        _text(_PATH, "an absolute path on the host of a folder holding <repository "
              f"id>/ copies of models (an NFS mount, say) {_PATH_DETAIL}",
              optional=True),
        "a folder on the host (a lab's NFS mount, say) holding `<repository id>/` copies as "
        "gpuhost's model folders hold them (with their `.gpuhost-model.json` stamp); a copy there "
        "of the same commit is rsynced in first, instead of a peer's, then verified against the "
        "Hub's metadata file by file; where it holds no copy of the revision (missing, empty, "
        "another commit), the peers are tried as without it")

    @property
    def model_is_local(self) -> bool:
        """Whether gpuhost_model is a folder on the host (no download) rather than a repository."""
        return self.model.startswith("/")

    @property
    def model_path(self) -> str:
        """Where the server reads the weights: gpuhost_model itself when it is an absolute path,
        else ``<gpuhost_model_dir>/<repository id>``, where provisioning downloads them."""
        return self.model if self.model_is_local else f"{self.model_dir}/{self.model}"

    @property
    def server_is_public(self) -> bool:
        """Whether the server binds more than the loopback address (then the API key gate
        listens there and the server itself on 127.0.0.1:gpuhost_server_backend_port)."""
        return not ipaddress.ip_address(self.server_host).is_loopback
