"""Typed, validated host settings read once from pyinfra host data.

Every public key has the prefix ``gpuhost_``, a default below, a rule (RULES) and a sentence
(HELP), from which docs/reference.md is made (tools/docs_gen.py).
A wrong value raises :class:`SettingsError` naming the host, the key, the value and what is
allowed, before any operation is planned for any host.
"""

from __future__ import annotations

import ast
import difflib
import ipaddress
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Final

from packaging.version import InvalidVersion, Version
from pyinfra.api.exceptions import PyinfraError

from operations import REPO_ROOT, launch_profiles, proxy
from operations.lock import LockError, read_lock
from operations.node_group import check_groups
from operations.p2p_policy import NO_P2P_FLAGS as P2P_SERVER_FLAGS
from operations.run_exit import end_run
from operations.sglang import (ALWAYS_FLAGS, OWNED_FLAGS, FlagError, check_server_args,
                               flags_named, load_parser_spec, server_args)

PREFIX: Final = "gpuhost_"

#: The speculative decoding gpuhost turns on: NEXTN, the model's own MTP layer (sglang 0.5.9's
#: --speculative-algorithm choices: EAGLE, EAGLE3, NEXTN, STANDALONE, NGRAM; the others need a
#: draft model or tables gpuhost does not provide).
SPECULATIVE_ALGORITHMS: Final = ("NEXTN",)

#: CUDA toolkits this toolkit installs, each with the minimum Linux driver it needs (the
#: "CUDA Toolkit and Corresponding Driver Versions" table of NVIDIA's CUDA release notes,
#: https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/, Table 3, ">= driver" column,
#: Linux x86_64, each release's GA row; every value checked against that table on 2026-11-30).
CUDA_MIN_DRIVER: Final[Mapping[str, str]] = {
    "12.4": "550.54.14",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}

#: CUDA toolkits this toolkit installs (NVIDIA's cuda-toolkit-X-Y in /usr/local/cuda-X.Y), each
#: with its stack's lock, which a host without gpuhost_lock gets (locks/README.md).
CUDA_TOOLKITS: Final = {"12.8": "locks/cuda12.8.txt", "13.0": "locks/cuda13.0.txt"}

#: The CUDA release of PyPI's default Linux x86_64 torch wheels (no local version, no
#: nvidia-cuda-runtime pin in the lock), by torch release (pytorch.org "Previous versions",
#: RELEASE.md's compatibility matrix: the stable CUDA of each release).
TORCH_DEFAULT_CUDA: Final[Mapping[str, str]] = {
    "2.6": "12.4",
    "2.7": "12.6",
    "2.8": "12.8",
    "2.9": "12.8",
}

#: What to do with a driver that no package installed (a runfile, or one mounted from the
#: hypervisor): refuse the run, keep it as it is, or replace it with NVIDIA's packages.
UNPACKAGED_DRIVER: Final = ("refuse", "keep", "replace")

#: Driver branches known to this toolkit (NVIDIA's production and new-feature branches that ship
#: open kernel modules in the CUDA repository for Ubuntu 24.04 and Debian 12).
DRIVER_BRANCHES: Final = ("535", "550", "560", "565", "570", "575", "580", "590")

#: Compute capability from which NVIDIA supports only the open kernel modules (Blackwell, per
#: NVIDIA's driver installation guide, "Recommendation: use the open GPU kernel modules").
OPEN_MODULE_ONLY_FROM: Final = (10, 0)

DRIVER_FLAVOURS: Final = ("open", "proprietary")

#: The rendezvous port on rank 0 (``--dist-init-addr <rank 0>:<port>``): the port of the
#: example in sglang 0.5.9's own help for --dist-init-addr (sglang/srt/server_args.py:
#: "e.g., `192.168.0.2:25000`").
DIST_INIT_PORT: Final = 25000
#: The router's load balancing policies: smg 1.13.0's ``smg launch --policy`` choices (its
#: ``--help``, read off the wheel locks/router.txt pins); cache_aware is the issue's default.
ROUTER_POLICIES: Final = ("cache_aware", "round_robin", "random", "power_of_two", "least_load",
                          "consistent_hashing", "prefix_hash", "passthrough", "manual")
#: The router's Prometheus metrics port, on 127.0.0.1 (smg 1.13.0's default, ``--prometheus-port``;
#: operations/router.py binds it there): no port of the router's may be it.
ROUTER_METRICS_PORT: Final = 29000
P2P_OVERRIDES: Final = ("on", "off")


class SettingsError(PyinfraError):
    """Host data that cannot be used: the message names host, key, value and what is allowed
    (one line per problem, every problem found). ``key`` is the setting a single problem is
    about (None when not one key's); ``problems`` every problem's line."""

    def __init__(self, message: str, key: str | None = None,
                 problems: Iterable[str] | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.problems: list[str] = list(problems) if problems is not None else [message]


@dataclass(frozen=True)
class Settings:
    """One host's settings. Field ``x`` is host data key ``gpuhost_x``."""

    # The host
    gpu_count: int = 8
    compute_capability: str = "12.0"
    # NVIDIA driver and CUDA
    driver_branch: str = "580"
    driver_version: str | None = None
    driver_flavour: str = "open"
    allow_driver_change: bool = False
    unpackaged_driver: str = "refuse"
    cuda_toolkit: str = "12.8"
    cuda_repo_url: str = "https://developer.download.nvidia.com/compute/cuda/repos"
    cuda_keyring_sha256: str | None = None
    cuda_repo_adopt: bool = False
    # The run
    deploy_lock_wait: int = 0
    # Secure Boot: the MOK DKMS signs the driver's kernel module with
    mok_signing_key: str | None = None
    mok_certificate: str | None = None
    # The ML venv
    venv_path: str = "/opt/gpuhost/venv"
    lock: str = "locks/cuda12.8.txt"
    pip_index_url: str = "https://pypi.org/simple"
    max_jobs: int | None = None
    nvcc_threads: int | None = None
    wheel_cache: str = "~/.cache/gpuhost/wheels"
    # Upgrades and rollback (operations/venvs.py, operations/last_known_good.py)
    venvs_kept: int = 1
    rollback: bool = False
    # P2P
    p2p_override: str | None = None
    p2p_remeasure: bool = False
    p2p_check_timeout: int = 120
    # The server. The launch profile's settings (operations/launch_profiles.py,
    # PROFILE_SETTINGS) default to the default profile's values for the default lock
    # (field-glm5-sm120-sglang0.5.9; tests/test_launch_profiles.py checks they agree).
    launch_profile: str | None = None
    model: str = "lukealonso/GLM-5-NVFP4"
    served_model_name: str = "glm-5"
    tensor_parallel_size: int = 8
    pipeline_parallel_size: int | None = None
    # One server across hosts (operations/node_group.py): the group's hosts in rank order
    nodes: tuple[str, ...] = ()
    node_interface: str | None = None
    dist_init_port: int = DIST_INIT_PORT
    mem_fraction_static: float = 0.85
    max_running_requests: int = 64
    model_architecture: str = "GlmMoeDsaForCausalLM"
    kv_cache_dtype: str = "bf16"
    quantization: str | None = "modelopt_fp4"
    attention_backend: str | None = "flashinfer"
    fp8_gemm_backend: str | None = "cutlass"
    fp4_gemm_backend: str | None = "flashinfer_cutlass"
    nsa_decode_backend: str | None = "trtllm"
    nsa_prefill_backend: str | None = "trtllm"
    moe_runner_backend: str | None = "cutlass"
    # MTP (speculative decoding): off unless the algorithm is set
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = 4
    speculative_eagle_topk: int | None = 1
    speculative_num_draft_tokens: int | None = 5
    reasoning_parser: str | None = "glm45"
    tool_call_parser: str | None = "glm47"
    trust_remote_code: bool = True
    enable_flashinfer_allreduce_fusion: bool = True
    server_host: str = "127.0.0.1"
    server_port: int = 8000
    #: Local users whose processes may connect to a loopback server (root's always may;
    #: operations/loopback_guard.py)
    server_local_users: tuple[str, ...] = ()
    server_extra_args: tuple[str, ...] = (
        "--chunked-prefill-size", "16384", "--cuda-graph-max-bs", "32",
        "--model-loader-extra-config", '{"enable_multithread_load": true, "num_threads": 16}')
    server_env: Mapping[str, str] = field(
        default_factory=lambda: {"OMP_NUM_THREADS": "8", "SAFETENSORS_FAST_GPU": "1",
                                 "SGLANG_ENABLE_JIT_DEEPGEMM": "0",
                                 "SGLANG_ENABLE_DEEP_GEMM": "0"}
    )
    health_timeout: int = 1800
    server_start_timeout: int = 3600
    server_backend_port: int = 30000
    api_key_file: str | None = None
    allowed_dropins: tuple[str, ...] = ()
    # Model weights
    model_dir: str = "/opt/gpuhost/models"
    model_revision: str = "main"
    hf_endpoint: str = "https://huggingface.co"
    proxy: str | None = None  # every download's (operations/proxy.py)
    hf_token_file: str | None = None
    model_copy_from_peers: bool = True
    model_copy_bwlimit: int | None = None
    model_mirror: str | None = None
    # The bench (bench.py): sglang.bench_serving's load at each concurrency level
    bench_levels: tuple[int, ...] = (1, 16, 64)
    bench_input_len: int = 1024
    bench_output_len: int = 256
    bench_prompts: int = 128
    bench_sweep: Mapping[str, tuple] | None = None
    #: "host": each host's own server; "router": the fleet endpoint (operations/bench_fleet.py)
    bench_target: str = "host"
    # The fleet (operations/router.py): the SGLang model gateway on the gpuhost_router group
    #: False: the host serves no model (a CPU-only router VM of the gpuhost_router group)
    serving: bool = True
    fleet_address: str | None = None
    #: The key the router sends its workers and their gates admit it by (operations/fleet.py)
    fleet_key_file: str | None = None
    api_gate_trusted_peers: tuple[str, ...] = ()
    #: The fleet CA on the controller: the public endpoints serve TLS with certificates it
    #: signs (operations/tls.py)
    tls_ca_cert_file: str | None = None
    tls_ca_key_file: str | None = None
    tls_names: tuple[str, ...] = ()
    #: The host's own certificate and key (on the host), in place of one the fleet CA's key issues
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    router_host: str = "127.0.0.1"
    router_port: int = 8100
    router_backend_port: int = 30100
    router_api_key_file: str | None = None
    router_policy: str = "cache_aware"
    router_health_check_interval_secs: int = 10
    router_health_check_timeout_secs: int = 5
    router_health_failure_threshold: int = 3
    router_health_success_threshold: int = 2
    router_lock: str = "locks/router.txt"
    router_venv_path: str = "/opt/gpuhost/router-venv"
    router_wait_timeout: int = 300
    roll_size: int = 1
    roll_drain_timeout: int = 120
    roll_max_unavailable: int = 1
    # Observability (operations/observability.py): metrics, Prometheus, alert rules
    #: True/False: this router host runs the fleet's Prometheus or not; None: the first one does
    prometheus: bool | None = None
    prometheus_port: int = 9090
    prometheus_retention_days: int = 15
    prometheus_retention_gib: int = 10
    node_exporter_port: int = 9100
    gpu_metrics_interval: int = 15
    alert_ttft_p99: float = 10.0
    alert_itl_p99: float = 0.5
    alert_kv_cache_usage: float = 0.95
    #: Where Alertmanager posts the alerts (its webhook receiver); None: no Alertmanager
    alert_webhook_url: str | None = None
    alertmanager_port: int = 9093

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

    @property
    def router_is_public(self) -> bool:
        """Whether the router binds more than the loopback address (then an API key gate
        listens there and the router itself on 127.0.0.1:gpuhost_router_backend_port)."""
        return not ipaddress.ip_address(self.router_host).is_loopback

    @property
    def router_lock_path(self) -> Path:
        path = Path(self.router_lock)
        return path if path.is_absolute() else REPO_ROOT / path

    @property
    def cuda_home(self) -> str:
        """The toolkit's prefix, as NVIDIA's cuda-toolkit-X-Y packages install it."""
        return f"/usr/local/cuda-{self.cuda_toolkit}"

    @property
    def cuda_arch(self) -> str:
        """The architecture number nvcc and FLASH_ATTN_CUDA_ARCHS take ("12.0" gives "120")."""
        major, minor = self.compute_capability.split(".")
        return f"{major}{minor}"

    @property
    def lock_path(self) -> Path:
        path = Path(self.lock)
        return path if path.is_absolute() else REPO_ROOT / path


@dataclass(frozen=True)
class _Rule:
    check: Callable[[Any], bool]
    allowed: str


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_between(low: int, high: int) -> _Rule:
    return _Rule(lambda v: _is_int(v) and low <= v <= high, f"an integer from {low} to {high}")


#: How an optional key is left unset, in both places host data comes from: pyinfra's
#: ``--data key=value`` reads the value as JSON where it parses (``null`` is None, ``None``
#: stays the string 'None'), a Python inventory or group_data file writes None.
_UNSET: Final = (", or None to leave it unset (None in a Python inventory; in --data write "
                 "null: None there is the text 'None')")

#: Texts that mean "unset" to the person typing them but arrive as text.
_UNSET_TEXTS: Final = ("None", "null", "Null", "NULL", "~")


def _one_of(choices: Iterable[str], optional: bool = False) -> _Rule:
    options = tuple(choices)
    text = ", ".join(options) + (_UNSET if optional else "")
    return _Rule(lambda v: (optional and v is None) or v in options, f"one of {text}")


def _text(pattern: str, allowed: str, optional: bool = False) -> _Rule:
    regex = re.compile(pattern)
    return _Rule(
        lambda v: (optional and v is None) or (
            isinstance(v, str) and bool(regex.fullmatch(v))
            and not (optional and v in _UNSET_TEXTS)),
        allowed + (_UNSET if optional else ""),
    )


def _is_driver_version(value: Any) -> bool:
    if not isinstance(value, str) or not re.fullmatch(r"\d{3}\.\d{2,3}(\.\d{2})?", value):
        return False
    try:
        Version(value)
    except InvalidVersion:
        return False
    return True


def _is_host(value: Any) -> bool:
    if not isinstance(value, str) or "%" in value:  # no IPv6 zone: it would reach unit files
        return False
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _is_tls_name(value: Any) -> bool:
    """A name a certificate may hold: an IP address (no zone) or a DNS name (RFC 1035 labels
    of letters, digits and inner hyphens, at most 253 characters; a '*.' wildcard is not one)."""
    return _is_host(value) or (isinstance(value, str) and bool(re.fullmatch(
        r"(?=.{1,253}$)[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
        r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*", value)))


def _is_peer_address(value: Any) -> bool:
    """An address another host can reach this one at: an IP address (no zone) that is not
    loopback, unspecified (0.0.0.0, ::), multicast or IPv6 link-local (which needs a zone),
    an IPv4-mapped IPv6 address judged as its IPv4 one (Python's ipaddress, ``ipv4_mapped``)."""
    if not _is_host(value):
        return False
    address = ipaddress.ip_address(value)
    address = getattr(address, "ipv4_mapped", None) or address
    return not (address.is_loopback or address.is_unspecified or address.is_multicast
                or (address.version == 6 and address.is_link_local))


#: An absolute path whose every part is letters, digits and ``. _ + @ : -``, none of them
#: "." or "..": it goes into shell commands, systemd units and pip's arguments unquoted by
#: whoever reads them on the host.
_PATH = r"(/(?!\.\.?(?:/|$))[A-Za-z0-9._+@:-]+)+"
_PATH_DETAIL = "(letters, digits and . _ + @ : -; no '.' or '..' part, no trailing slash)"
_PATH_ALLOWED = f"an absolute path {_PATH_DETAIL}"
#: Where a venv must not go: the system's own folders (pip would write into them).
_SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/run",
                "/sbin", "/sys", "/usr", "/var/lib/dpkg", "/var/lib/apt", "/var/run", "/var/lock")
#: Folders that hold others' files and are never a venv themselves (the Filesystem Hierarchy
#: Standard 3.0, chapter 5, "/var": its subfolders; every top-level folder is refused by depth,
#: and /home/<user>, a user's home folder, by :func:`_is_venv_path`).
_SHARED_DIRS = ("/var/account", "/var/backups", "/var/cache", "/var/crash", "/var/games",
                "/var/lib", "/var/local", "/var/log", "/var/mail", "/var/opt", "/var/spool",
                "/var/tmp", "/var/www", "/var/yp")


def _is_venv_path(value: Any) -> bool:
    # No ":": python3 -m venv refuses a folder with the PATH separator in it (CPython's
    # Lib/venv/__init__.py, ensure_directories: "Refusing to create a venv in ...").
    return (isinstance(value, str) and bool(re.fullmatch(_PATH, value)) and ":" not in value
            and value.count("/") >= 2 and value not in _SHARED_DIRS
            and not re.fullmatch(r"/home/[^/]+", value)
            and not any(value == d or value.startswith(d + "/") for d in _SYSTEM_DIRS))


#: The folders gpuhost manages on the host (operations/: mlenv.LOCK_DIR, p2p.LIB_DIR,
#: flash_attn.BUILD_DIR and WHEEL_DIR, kernel_cache.KERNEL_CACHE_ROOT, p2p.RECORD and
#: server.VERIFIED_FILE, p2p.ENV_FILE and server.SERVER_ENV_FILE, files/deploy_lock.RUN_DIR;
#: tests/test_venv_path.py checks that every such path in operations/ lies in one of them).
#: The venv lives beside them, never in, on or around one: ``python3 -m venv --clear``
#: empties its folder.
GPUHOST_DIRS: Final[Mapping[str, str]] = {
    "/opt/gpuhost/lib": "gpuhost's shipped scripts",
    "/opt/gpuhost/lock": "the ML stack's lock files",
    "/opt/gpuhost/build": "flash-attn's build folder",
    "/opt/gpuhost/wheels": "flash-attn's built wheels, a fresh venv's locked wheels",
    "/opt/gpuhost/venvs": "the ML venvs, one per lock digest",
    "/var/cache/gpuhost": "the server's kernel caches",
    "/var/lib/gpuhost": "gpuhost's records (the P2P measurement, the verified server)",
    "/var/lib/gpuhost-models": "the model copy user's home (its one key: rrsync -ro)",
    "/etc/gpuhost": "the server's and the P2P decision's environment files",
    "/run/gpuhost": "the deploy lock",
    "/run/gpuhost-model-copy": "the copy key while the host copies from a peer",
    "/opt/gpuhost/router-venv": "the router's venv (gpuhost_router_venv_path's default)",
}


def _overlaps(a: str, b: str) -> bool:
    """Whether one path is the other or lies inside it."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


#: An http(s) URL: a host, then anything but whitespace (quoted wherever a shell sees it).
_URL = r"https?://[^\s/]\S*"


#: What the server's environment gets from gpuhost itself: the unit (CUDA_HOME, PATH,
#: LD_LIBRARY_PATH, the kernel caches of operations/kernel_cache.py), server.env (HF_HUB_OFFLINE: the weights are local) and the P2P decision
#: (operations/p2p_policy.py). An EnvironmentFile wins over the unit's Environment= lines, and
#: the P2P file is read last: gpuhost_server_env naming one of these would override gpuhost, or
#: be silently overridden.
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


def _control_characters(value: Any) -> bool:
    """Whether a value holds a control character (a newline, a tab, NUL, ...) anywhere: in a
    string, or in the strings of a list or dict. Host data reaches unit files, environment
    files and shell commands line by line."""
    if isinstance(value, str):
        return any(ord(c) < 32 or ord(c) == 127 for c in value)
    if isinstance(value, Mapping):
        return any(_control_characters(k) or _control_characters(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_control_characters(v) for v in value)
    return False


#: Keys whose values are version-like strings: pyinfra's --data turns "570" into 570, "13.0"
#: into 13.0 and "580.95" into 580.95, so numbers are taken as the string they were typed as.
_NUMBER_AS_TEXT: Final = ("driver_branch", "cuda_toolkit", "compute_capability", "driver_version")


#: A drop-in's file name: systemd reads only ``*.conf`` in a unit's ``.d`` folder
#: (systemd.unit(5), "drop-in").
DROPIN_NAME: Final = r"[A-Za-z0-9][A-Za-z0-9._+@-]*\.conf"


_BOOL = _Rule(lambda v: isinstance(v, bool), "True or False")
_NAME = r"[A-Za-z0-9][A-Za-z0-9_.\-]*"
#: A user name as Debian 12's adduser 3.134 accepts one (/etc/adduser.conf: NAME_REGEX
#: ``^[a-z][-a-z0-9_]*\$?$``, SYS_NAME_REGEX ``^[a-z_][-a-z0-9_]*\$?$``; a trailing '$' is for
#: Samba's machine accounts, left out), at most 32 characters (useradd(8) of passwd 4.13:
#: "Usernames may only be up to 32 characters long")
_USER_NAME = r"[a-z_][a-z0-9_-]{0,31}"

RULES: Final[Mapping[str, _Rule]] = {
    "gpu_count": _int_between(1, 64),
    "compute_capability": _text(r"\d{1,2}\.\d", 'a compute capability such as "9.0" or "12.0"'),
    "driver_branch": _one_of(DRIVER_BRANCHES),
    "driver_version": _Rule(
        lambda v: v is None or _is_driver_version(v),
        'a driver version such as "580.95.05", or None for the newest of the branch',
    ),
    "driver_flavour": _one_of(DRIVER_FLAVOURS),
    "allow_driver_change": _BOOL,
    "unpackaged_driver": _one_of(UNPACKAGED_DRIVER),
    "cuda_toolkit": _one_of(CUDA_TOOLKITS),
    "cuda_repo_url": _text(_URL + r"(?<!/)", "an http(s) URL without a trailing slash"),
    "cuda_keyring_sha256": _text(r"[0-9a-f]{64}", "a sha256 hex digest", optional=True),
    "cuda_repo_adopt": _BOOL,
    "mok_signing_key": _text(_PATH, "an absolute path on the host of a MOK's private key, "
                             f"root-only (mode 0600 or 0400) {_PATH_DETAIL}", optional=True),
    "mok_certificate": _text(_PATH, "an absolute path on the host of the MOK's DER "
                             f"certificate, enrolled {_PATH_DETAIL}", optional=True),
    "venv_path": _Rule(_is_venv_path, "an absolute path (letters, digits and . _ + @ -; no "
                       "':', which python3 -m venv refuses; no '.' or '..' part, no trailing "
                       "slash), a folder of the venv's "
                       "own: at least two levels deep, not a home folder (/home/<user>) nor "
                       f"one of {', '.join(_SHARED_DIRS)}, and outside the system's folders "
                       f"({', '.join(_SYSTEM_DIRS)})"),
    "lock": _text(r"[^\s]+\.txt", "a path to a lock file (.txt) in locks/ or absolute"),
    "pip_index_url": _text(_URL, "an http(s) URL of a PEP 503 simple index"),
    "max_jobs": _Rule(lambda v: v is None or (_is_int(v) and v >= 1), "an integer >= 1, or None"),
    "nvcc_threads": _Rule(
        lambda v: v is None or (_is_int(v) and 1 <= v <= 16), "an integer from 1 to 16, or None"
    ),
    "venvs_kept": _int_between(1, 16),
    "rollback": _BOOL,
    "wheel_cache": _text(r"(~|/)[^\s'\"]*", "a path on the controller, absolute or under ~"),
    "p2p_override": _one_of(P2P_OVERRIDES, optional=True),
    "p2p_remeasure": _BOOL,
    "p2p_check_timeout": _int_between(10, 3600),
    "deploy_lock_wait": _int_between(0, 86400),
    "model": _text(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?|" + _PATH,
                   f"a Hugging Face repository id (owner/name) or {_PATH_ALLOWED}"),
    "served_model_name": _text(_NAME, "a name of letters, digits, '_', '.', '-' that starts "
                               "with a letter or digit"),
    "tensor_parallel_size": _int_between(1, 64),
    "pipeline_parallel_size": _Rule(lambda v: v is None or (_is_int(v) and 1 <= v <= 64),
                                    "an integer from 1 to 64" + _UNSET),
    "nodes": _Rule(
        lambda v: isinstance(v, (list, tuple)) and (not v or (
            2 <= len(v) <= 64 and all(isinstance(n, str) and n for n in v)
            and len(set(v)) == len(v))),
        "a list of 2 to 64 distinct inventory host names, rank 0 first (the hosts of one "
        "server across nodes), or [] for a server of the host's own"),
    # Linux's IFNAMSIZ is 16 with the NUL (include/uapi/linux/if.h); dev_valid_name refuses
    # '/', ':' and whitespace (net/core/dev.c).
    "node_interface": _text(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,14}",
                            "a network interface name such as eth0 or ens1f0 (up to 15 "
                            "letters, digits, '_', '.', '-')", optional=True),
    "dist_init_port": _int_between(1024, 65535),
    "mem_fraction_static": _Rule(
        lambda v: isinstance(v, float) and 0.0 < v < 1.0, "a float strictly between 0 and 1"
    ),
    "max_running_requests": _int_between(1, 65536),
    "model_architecture": _text(r"[A-Za-z][A-Za-z0-9_]*", "a model architecture as the "
                                "model's config.json names it (its architectures[0]), such as "
                                "GlmMoeDsaForCausalLM"),
    "kv_cache_dtype": _text(_NAME, "a kv cache dtype such as auto, fp8_e4m3"),
    "quantization": _text(_NAME, "a quantization method name", optional=True),
    "attention_backend": _text(_NAME, "an attention backend name", optional=True),
    "fp8_gemm_backend": _text(_NAME, "an FP8 GEMM backend name", optional=True),
    "fp4_gemm_backend": _text(_NAME, "an FP4 GEMM backend name", optional=True),
    "nsa_decode_backend": _text(_NAME, "an NSA decode backend name", optional=True),
    "nsa_prefill_backend": _text(_NAME, "an NSA prefill backend name", optional=True),
    "moe_runner_backend": _text(_NAME, "a MoE runner backend name", optional=True),
    "launch_profile": _one_of(launch_profiles.NAMES, optional=True),
    "speculative_algorithm": _one_of(SPECULATIVE_ALGORITHMS, optional=True),
    "speculative_num_steps": _Rule(lambda v: v is None or (_is_int(v) and 1 <= v <= 16),
                                   "an integer from 1 to 16" + _UNSET),
    "speculative_eagle_topk": _Rule(lambda v: v is None or v == 1,
                                    "1 (sglang 0.5.9 with SGLANG_ENABLE_SPEC_V2, which the "
                                    "deploy sets for MTP, allows topk 1 only: server_args.py, "
                                    '"Spec v2 currently only supports topk = 1")' + _UNSET),
    "speculative_num_draft_tokens": _Rule(lambda v: v is None or (_is_int(v) and 2 <= v <= 64),
                                          "an integer from 2 to 64" + _UNSET),
    "reasoning_parser": _text(_NAME, "a reasoning parser name", optional=True),
    "tool_call_parser": _text(_NAME, "a tool call parser name", optional=True),
    "trust_remote_code": _BOOL,
    "enable_flashinfer_allreduce_fusion": _BOOL,
    "server_host": _Rule(_is_host, "an IP address such as 127.0.0.1"),
    "server_port": _int_between(1, 65535),
    "server_local_users": _Rule(
        lambda v: isinstance(v, (list, tuple)) and len(set(v)) == len(v)
        and all(isinstance(u, str) and re.fullmatch(_USER_NAME, u) and u != "root" for u in v),
        "a list of local user names, each once (lower-case letters, digits, '_' and '-', "
        "starting with a letter or '_', at most 32 characters; not root, who always may)"),
    "server_extra_args": _Rule(
        lambda v: isinstance(v, (list, tuple)) and all(isinstance(a, str) for a in v),
        "a list of strings",
    ),
    "server_env": _Rule(_is_env, "a dict of UPPER_CASE names to string values without "
                        "backslashes, naming none of what gpuhost sets itself ("
                        + ", ".join(RESERVED_ENV) + ")"),
    "health_timeout": _int_between(10, 86400),
    "server_start_timeout": _int_between(60, 7 * 86400),
    "server_backend_port": _int_between(1, 65535),
    "allowed_dropins": _Rule(
        lambda v: isinstance(v, (list, tuple)) and all(
            isinstance(n, str) and re.fullmatch(DROPIN_NAME, n) for n in v),
        "a list of drop-in file names under /etc/systemd/system/sglang.service.d/ such as "
        '"50-local.conf" (letters, digits and . _ + @ -, ending in .conf)',
    ),
    "api_key_file": _text(_PATH, f"an absolute path on the host, root-only {_PATH_DETAIL}",
                          optional=True),
    "model_dir": _text(_PATH, _PATH_ALLOWED),
    "model_revision": _text(r"(?!.*(?:^|/)\.\.?(?:/|$))[A-Za-z0-9][A-Za-z0-9_.\-/]*(?<!/)",
                            "a branch, tag or commit sha of the model's repository"),
    "hf_endpoint": _text(_URL + r"(?<!/)", "an http(s) URL without a trailing slash"),
    "proxy": _text(proxy.URL, proxy.URL_ALLOWED, optional=True),
    "hf_token_file": _text(_PATH, f"an absolute path on the host, root-only {_PATH_DETAIL}",
                           optional=True),
    "model_copy_from_peers": _BOOL,
    "model_copy_bwlimit": _Rule(lambda v: v is None or (_is_int(v) and v >= 1),
                                "an integer >= 1 (KiB/s, rsync's --bwlimit), or None"),
    "model_mirror": _text(_PATH, "an absolute path on the host of a folder holding <repository "
                          f"id>/ copies of models (an NFS mount, say) {_PATH_DETAIL}",
                          optional=True),
    "bench_levels": _Rule(
        lambda v: isinstance(v, (list, tuple)) and bool(v) and all(_is_int(n) and n >= 1
                                                                   for n in v)
        and len(set(v)) == len(v),
        "a non-empty list of distinct concurrency levels, integers >= 1, such as [1, 16, 64]",
    ),
    "serving": _BOOL,
    "fleet_address": _Rule(lambda v: v is None or _is_peer_address(v),
                           "this host's IP address on the network the fleet shares, such as "
                           "10.0.0.5 (where the router and peers on other hosts reach it: not "
                           "loopback, 0.0.0.0, ::, multicast or IPv6 link-local), or None"),
    "fleet_key_file": _text(_PATH, f"an absolute path on the host, root-only {_PATH_DETAIL}",
                            optional=True),
    "api_gate_trusted_peers": _Rule(
        lambda v: isinstance(v, (list, tuple)) and all(_is_peer_address(a) for a in v),
        "a list of other hosts' IP addresses (the router hosts' gpuhost_fleet_address; not "
        "loopback, 0.0.0.0, ::, multicast or IPv6 link-local: a loopback peer lets every "
        "process of this host past the key)"),
    "tls_ca_cert_file": _text(_PATH, "an absolute path on the controller of the fleet CA's "
                              f"PEM certificate {_PATH_DETAIL}", optional=True),
    "tls_ca_key_file": _text(_PATH, "an absolute path on the controller of the fleet CA's PEM "
                             f"private key, mode 0600 {_PATH_DETAIL}", optional=True),
    "tls_cert_file": _text(_PATH, "an absolute path on the host of this host's PEM certificate "
                           f"(its chain after it) {_PATH_DETAIL}", optional=True),
    "tls_key_file": _text(_PATH, "an absolute path on the host of that certificate's PEM "
                          f"private key, root-only {_PATH_DETAIL}", optional=True),
    "tls_names": _Rule(
        lambda v: isinstance(v, (list, tuple)) and all(_is_tls_name(n) for n in v),
        "a list of DNS names (such as gpu1.lab.example) or IP addresses (no zone) clients reach "
        "this host's endpoints by"),
    "router_host": _Rule(_is_host, "an IP address such as 127.0.0.1"),
    "router_port": _int_between(1, 65535),
    "router_backend_port": _int_between(1, 65535),
    "router_api_key_file": _text(_PATH, f"an absolute path on the host, root-only "
                                 f"{_PATH_DETAIL}", optional=True),
    "router_policy": _Rule(lambda v: v in ROUTER_POLICIES,
                           "one of " + ", ".join(ROUTER_POLICIES)),
    "router_health_check_interval_secs": _int_between(1, 3600),
    "router_health_check_timeout_secs": _int_between(1, 600),
    "router_health_failure_threshold": _int_between(1, 100),
    "router_health_success_threshold": _int_between(1, 100),
    "router_lock": _text(r"[A-Za-z0-9_./\-]+\.txt", "a lock file (.txt) under locks/ or an "
                         "absolute path"),
    "router_venv_path": _text(_PATH, _PATH_ALLOWED),
    "router_wait_timeout": _int_between(10, 86400),
    "roll_size": _int_between(1, 1024),
    "roll_drain_timeout": _int_between(1, 86400),
    "roll_max_unavailable": _int_between(1, 1024),
    "prometheus": _Rule(lambda v: v is None or isinstance(v, bool),
                        "True (this router host runs the fleet's Prometheus), False, or None "
                        "(the first host of the gpuhost_router group does)"),
    "prometheus_port": _int_between(1024, 65535),
    # Prometheus' own flags: --storage.tsdb.retention.time (its default 15d) and
    # --storage.tsdb.retention.size; both bound the disk it takes, whichever is reached first.
    "prometheus_retention_days": _int_between(1, 3650),
    "prometheus_retention_gib": _int_between(1, 10240),
    "node_exporter_port": _int_between(1024, 65535),
    "gpu_metrics_interval": _int_between(5, 3600),
    "alert_ttft_p99": _Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                            and 0 < v <= 3600, "a number of seconds above 0, at most 3600"),
    "alert_itl_p99": _Rule(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                           and 0 < v <= 60, "a number of seconds above 0, at most 60"),
    "alert_kv_cache_usage": _Rule(lambda v: isinstance(v, float) and 0.0 < v <= 1.0,
                                  "a float above 0, at most 1 (the share of the KV cache's "
                                  "tokens in use, sglang:token_usage)"),
    "alert_webhook_url": _text(_URL, "an http(s) URL that takes Alertmanager's webhook POSTs "
                               "(its webhook_config url)", optional=True),
    "alertmanager_port": _int_between(1024, 65535),
    "bench_input_len": _int_between(1, 1 << 20),
    "bench_output_len": _int_between(1, 1 << 20),
    "bench_prompts": _int_between(1, 1 << 20),
    "bench_target": _one_of(("host", "router")),
    "bench_sweep": _Rule(
        lambda v: v is None or (isinstance(v, Mapping) and len(v) == 1 and all(
            isinstance(k, str) and isinstance(vals, (list, tuple)) for k, vals in v.items())),
        'None, or one server setting and the values to try, such as {"moe_runner_backend": '
        '["flashinfer_cutlass", "cutlass"]}',
    ),
}

_FIELDS: Final = {f.name for f in fields(Settings)}
assert _FIELDS == set(RULES), "every setting needs exactly one rule"


#: What each key does, for the host-data reference (docs/reference.md: tools/docs_gen.py makes
#: it from the fields, RULES and this; tests/test_docs.py fails when a key has no entry here).
HELP: Final[Mapping[str, str]] = {
    "fleet_key_file": (
        "secret file holding the fleet key, the same key on the router hosts and every worker "
        "they reach through a gate (required there): the router sends it to its workers, their "
        "gates admit it (security.md)"),
    "gpu_count": "GPUs the host must have; checked against nvidia-smi when the driver answers",
    "compute_capability": (
        "the GPUs' compute capability (\"12.0\" is Blackwell SM120); gives the build architecture "
        "(120); checked against nvidia-smi while planning where the driver answers, else before "
        "flash-attn builds"),
    "driver_branch": (
        "NVIDIA driver branch: 535, 550, 560, 565, 570, 575, 580 or 590, and at least the minimum "
        "of the CUDA toolkit and of the locked torch's CUDA (`CUDA_MIN_DRIVER` in "
        "`operations/settings.py`: 570 for CUDA 12.8)"),
    "driver_version": (
        "an exact driver version of the branch, e.g. `\"580.95.05\"`; None takes the branch's "
        "newest"),
    "driver_flavour": (
        "`\"open\"` kernel modules, or `\"proprietary\"` (refused on compute capability 10.0 and "
        "newer)"),
    "allow_driver_change": (
        "allow this run to upgrade or downgrade an installed driver (reboots the host, restarts "
        "the server)"),
    "unpackaged_driver": (
        "a driver present that no package installed (runfile, or mounted from the hypervisor): "
        "`\"refuse\"` the run, `\"keep\"` it as it is (checked against the CUDA minimum), or "
        "`\"replace\"` it with NVIDIA's packages"),
    "cuda_toolkit": (
        "the CUDA stack: the toolkit to install (`cuda-toolkit-12-8` in `/usr/local/cuda-12.8`; "
        "`\"13.0\"`: `cuda-toolkit-13-0`, driver branch 580 or newer) and, unless "
        "`gpuhost_lock` is set, its lock (`locks/cuda12.8.txt`, `locks/cuda13.0.txt`); "
        "docs/driver.md"),
    "cuda_repo_url": "base URL of NVIDIA's CUDA repository (a mirror's, or the sandbox's)",
    "cuda_keyring_sha256": (
        "sha256 the repository's `cuda-archive-keyring.gpg` must have; None checks nothing beyond "
        "HTTPS"),
    "cuda_repo_adopt": (
        "use an entry of NVIDIA's repository already in the host's apt sources (added by hand, "
        "another `signed-by`) as gpuhost's own and write none; without it such an entry is "
        "refused while planning (docs/driver.md)"),
    "deploy_lock_wait": (
        "seconds a run waits for another run's deploy lock on the host before it fails (0 to "
        "86400; 0 fails at once, saying who holds it)"),
    "mok_signing_key": (
        "root-only file (mode 0600/0400) on the host: the private key of an enrolled MOK, with "
        "which DKMS signs the NVIDIA kernel module; needed to build the driver under Secure Boot "
        "(see Secure Boot); set together with `gpuhost_mok_certificate`"),
    "mok_certificate": (
        "file on the host: that key's DER certificate, enrolled as a MOK (`mokutil --test-key` "
        "says \"is already enrolled\")"),
    "venv_path": (
        "the link to the ML venv the server was last verified with; the venvs themselves live in "
        "`/opt/gpuhost/venvs/<lock digest>`, one per lock, and the unit names the lock's venv "
        "itself (docs/upgrades.md). Neither on, inside nor around a folder gpuhost manages or a "
        "file another key names. On the host (refused while planning otherwise) it must be "
        "missing, a symlink (replaced), an empty folder, or a venv of an earlier gpuhost holding "
        "nothing but what a venv has, which is removed once the lock's venv passed the health "
        "gate; a file or a folder holding anything else is named and left alone"),
    "lock": ("the ML stack lock (relative to the repository, or absolute); unset, the lock of "
             "`gpuhost_cuda_toolkit`'s stack"),
    "pip_index_url": "the package index the lock installs from",
    "max_jobs": "lower flash-attn's MAX_JOBS below the computed bound (never above it)",
    "nvcc_threads": "lower flash-attn's NVCC_THREADS (default 4, or fewer on small hosts)",
    "venvs_kept": (
        "how many venvs stay in `/opt/gpuhost/venvs` once the health gate passed: the one serving "
        "(the last known good) and the ones verified before it, newest first, 1 to 16; the others "
        "are removed then. A new lock's venv is built beside them, so during an upgrade there is "
        "one more, and the disk must hold it (checked before the build)"),
    "rollback": (
        "`true`: roll the host back to its last known good "
        "(`/var/lib/gpuhost/last-known-good.json`: the unit, its drop-ins, the environment files, "
        "the P2P record, so the venv the unit names), restart the server and verify it; nothing "
        "else of the deploy runs (only the scripts the rollback runs are shipped). Meant for "
        "`--data gpuhost_rollback=true`"),
    "wheel_cache": (
        "folder on the controller where a flash-attn wheel built on one host is kept for the "
        "others (same flash-attn, torch, CUDA, Python, architecture), and the locked wheels a "
        "host downloaded, by sha256, for the next fresh venv (rebuilding a host)"),
    "p2p_override": "`\"on\"` or `\"off\"` to override the measured P2P decision",
    "p2p_remeasure": (
        "measure P2P again on this run even when the recorded measurement holds (stops and "
        "restarts the server)"),
    "p2p_check_timeout": (
        "seconds the P2P check's peer copies, and its NCCL all-reduce (on a node of a group, also "
        "the all-reduce across the nodes), may take before they count as failed (10 to 3600)"),
    "model": "`--model`",
    "served_model_name": "`--served-model-name`; the health gate waits for it in `/v1/models`",
    "tensor_parallel_size": (
        "`--tp`; must divide `gpuhost_gpu_count` (divided by `gpuhost_pipeline_parallel_size` "
        "where set); on a node of a group, `gpuhost_gpu_count` x nodes / pipeline parallel size"),
    "pipeline_parallel_size": "`--pipeline-parallel-size` (1 to 64), left out when None",
    "nodes": (
        "on a group: its hosts, rank 0 first, which then serve as one server (a model across "
        "hosts)"),
    "node_interface": (
        "the interface the nodes reach each other on (the same name on every node); None finds "
        "the one IPv4 network every node has an address in"),
    "dist_init_port": (
        "the rendezvous port on rank 0 (`--dist-init-addr <rank 0>:<port>`; sglang's own help "
        "gives 25000 as its example)"),
    "mem_fraction_static": "`--mem-fraction-static`, strictly between 0 and 1",
    "max_running_requests": "`--max-running-requests`",
    "model_architecture": (
        "the model's architecture, as its `config.json` names it (`architectures[0]`); the known "
        "behaviour rows and sglang's automatic choices depend on it; once the weights are on the "
        "host, a `config.json` naming another is refused while planning"),
    "launch_profile": (
        "the launch profile whose flags and environment the server keys default to "
        "(operations/launch_profiles.py; docs/profiles.md): None takes the first profile for "
        "the GPUs, the model architecture and the locked sglang whose flags that sglang's "
        "parser accepts; any `gpuhost_` key you set wins over the profile's value. `--dry` "
        "names the profile, its source and every value it set"),
    "kv_cache_dtype": (
        "`--kv-cache-dtype`; the profile's (bf16: an FP8 KV cache gives garbled output on "
        "SM120, voipmonitor/rtx6kpro models/glm5.md)"),
    "quantization": "`--quantization` (None leaves it out)",
    "attention_backend": "`--attention-backend`",
    "fp8_gemm_backend": "`--fp8-gemm-backend`",
    "fp4_gemm_backend": "`--fp4-gemm-backend` (sglang 0.5.9's default, made explicit)",
    "nsa_decode_backend": "`--nsa-decode-backend` (trtllm avoids the NaN decode crash on SM120)",
    "nsa_prefill_backend": "`--nsa-prefill-backend`",
    "moe_runner_backend": (
        "`--moe-runner-backend`, the MoE runner backend: the profile's (cutlass, the field's "
        "best at 64 concurrent requests; the reference lab's measured baseline was "
        "flashinfer_cutlass)"),
    "speculative_algorithm": (
        "`--speculative-algorithm`: `NEXTN` turns MTP (speculative decoding with the model's own "
        "MTP layer) on, with `SGLANG_ENABLE_SPEC_V2=True` in the server's environment; refused "
        "while planning where the locked sglang lacks the flag or the checkpoint's weight index "
        "lacks the MTP layer; None: off"),
    "speculative_num_steps": (
        "`--speculative-num-steps` with MTP on (the profile's); None leaves the three step "
        "counts to sglang, which then needs all three unset"),
    "speculative_eagle_topk": "`--speculative-eagle-topk` with MTP on: 1 or None",
    "speculative_num_draft_tokens": (
        "`--speculative-num-draft-tokens` with MTP on; sglang 0.5.9 makes it steps + 1 where "
        "topk is 1"),
    "reasoning_parser": "`--reasoning-parser`",
    "tool_call_parser": "`--tool-call-parser`",
    "trust_remote_code": "`--trust-remote-code`",
    "enable_flashinfer_allreduce_fusion": "`--enable-flashinfer-allreduce-fusion`",
    "server_host": "`--host`: the address the server binds",
    "server_port": "`--port`",
    "server_local_users": (
        "local users (besides root) whose processes may connect to a server bound to the "
        "loopback, e.g. the account you run clients or an SSH tunnel from; everyone else's are "
        "refused by the host's firewall (docs/security.md); only with a loopback "
        "`gpuhost_server_host` (a wider bind is reached through its gate, with the API key)"),
    "server_extra_args": (
        "more sglang flags, appended as given; the profile's (`--chunked-prefill-size`, "
        "`--cuda-graph-max-bs`, `--model-loader-extra-config`) unless you set this key"),
    "server_env": (
        "the server's environment; the profile's (with `SGLANG_ENABLE_JIT_DEEPGEMM=0`: "
        "DeepGEMM has no SM120 path) unless you set this key"),
    "health_timeout": "seconds the deploy waits for the server to serve the model",
    "server_start_timeout": (
        "seconds systemd gives one start of the server (weight loading included) before it counts "
        "as failed (`TimeoutStartSec`); three failed starts within three such windows leave the "
        "unit failed"),
    "server_backend_port": (
        "the server's port on 127.0.0.1 behind the API key gate, when `gpuhost_server_host` is "
        "wider than the loopback"),
    "allowed_dropins": (
        "file names of drop-ins under `/etc/systemd/system/sglang.service.d/` that are not "
        "gpuhost's and stay (e.g. `[\"50-local.conf\"]`); any other `*.conf` there that gpuhost "
        "does not write is reported and removed"),
    "api_key_file": (
        "secret file (docs/security.md) on the host holding the API key; needed to bind wider than "
        "127.0.0.1; read by the gate only, never by sglang"),
    "model_dir": (
        "where the weights are downloaded: `<dir>/<repository id>` (when `gpuhost_model` is an "
        "absolute path, that folder is served as it is)"),
    "model_revision": (
        "branch, tag or commit sha of `gpuhost_model`; a change downloads again and restarts the "
        "server. A branch or tag is one commit per fleet, the one its hosts hold (a host added "
        "later gets it); a move on the Hub is said: pin its sha to serve it (docs/fleet.md)"),
    "hf_endpoint": "the Hub's URL (huggingface_hub's `HF_ENDPOINT`: a mirror's, or the sandbox's)",
    "proxy": proxy.HELP,
    "hf_token_file": (
        "secret file (docs/security.md) on the host holding the Hub token for gated "
        "repositories; its path is all the deploy handles"),
    "model_copy_from_peers": (
        "copy the weights from another inventory host serving the same repository and revision, "
        "whose copy is complete, before the Hub (docs/rebuild.md); every file is verified "
        "against the Hub's metadata, a wrong one downloaded from the Hub"),
    "model_copy_bwlimit": (
        "KiB/s the copy from a peer may use (rsync's `--bwlimit`), None for no limit"),
    "model_mirror": (
        "a folder on the host (a lab's NFS mount, say) holding `<repository id>/` copies as "
        "gpuhost's model folders hold them (with their `.gpuhost-model.json` stamp); a copy there "
        "of the same commit is rsynced in first, instead of a peer's, then verified against the "
        "Hub's metadata file by file; where it holds no copy of the revision (missing, empty, "
        "another commit), the peers are tried as without it"),
    "bench_levels": (
        "bench.py: the concurrency levels (`--max-concurrency`), distinct, each from 1 to "
        "`gpuhost_max_running_requests`"),
    "bench_input_len": (
        "bench.py: input tokens per request (`--random-input-len`, fixed); with the output length "
        "at most the model's context length (checked on the host while planning)"),
    "bench_output_len": "bench.py: output tokens per request (`--random-output-len`, fixed)",
    "bench_prompts": "bench.py: prompts per level (`--num-prompts`), at least the highest level",
    "bench_target": (
        "bench.py: `\"host\"` loads each host's own server; `\"router\"` loads the fleet through "
        "the router's endpoint, from a router host (docs/bench.md); not with a sweep"),
    "bench_sweep": (
        "bench.py: one server setting and the values to try, e.g. `{\"moe_runner_backend\": "
        "[\"cutlass\"]}`, MTP off and on `{\"speculative_algorithm\": [null, \"NEXTN\"]}`"),
    "serving": (
        "`False`: the host serves no model, a CPU-only router VM of the `gpuhost_router` group "
        "(refused elsewhere and in a node group): only the deploy lock, a preflight of its own "
        "and the router run there, and the GPU, driver, ML venv, model and server keys have no "
        "effect (docs/fleet.md)"),
    "fleet_address": (
        "the host's address on the network it shares with the router: the router reaches its "
        "server at `http://<this>:<gpuhost_server_port>` (docs/fleet.md); one per host, never "
        "loopback, `0.0.0.0`, `::`, multicast or IPv6 link-local (a router elsewhere would "
        "reach itself, and workers' gates would trust their own host)"),
    "api_gate_trusted_peers": (
        "client addresses the server's API key gate admits without the key; a fleet's deploy adds "
        "the router hosts' `gpuhost_fleet_address` (the router sends its workers no key); other "
        "hosts' only: never loopback (every process of the host would pass), `0.0.0.0`, `::`, "
        "multicast or IPv6 link-local"),
    "tls_ca_cert_file": (
        "the fleet CA's certificate (PEM; in a CA rotation the old and new CAs' in one file, "
        "`gpuhost_tls_ca_key_file`'s signing), a file on the controller: every public endpoint "
        "then serves TLS with a certificate the deploy issues from the CA, renews 30 days before "
        "it expires, and refuses plain HTTP; the router verifies its workers with it (all its "
        "CAs: docs/security.md, Rotate the fleet CA); the same on a router and its workers"),
    "tls_ca_key_file": (
        "the fleet CA's private key (PEM, unencrypted, mode 0600), a file on the controller; it "
        "never leaves the controller"),
    "tls_cert_file": (
        "this host's own certificate (PEM, its chain after it), a file on the host, in place of "
        "one the deploy issues: your PKI's, signed by the CA `gpuhost_tls_ca_cert_file` names "
        "(then `gpuhost_tls_ca_key_file` may be left unset); set together with "
        "`gpuhost_tls_key_file`; you renew it, and the gate reloads when the file changes"),
    "tls_key_file": "its private key (PEM), a root-only file on the host (mode 0600, owner root)",
    "tls_names": (
        "more names for this host's certificate, DNS names or IP addresses its clients reach it "
        "by; it always holds the loopback, `localhost`, the fleet address, the bound addresses "
        "and the inventory name"),
    "router_host": (
        "router hosts: the router's bind; wider than the loopback needs "
        "`gpuhost_router_api_key_file` (then `sglang-router-gate.service` listens there)"),
    "router_port": "the router's port (the gate's, for a wider bind)",
    "router_backend_port": "the router's own port on 127.0.0.1 behind its gate",
    "router_api_key_file": (
        "secret file on the router host holding the router's API key; read by its gate only, "
        "never on the router's command line"),
    "router_policy": (
        "the router's load balancing policy: `cache_aware`, `round_robin`, `random`, "
        "`power_of_two`, `least_load`, `consistent_hashing`, `prefix_hash`, `passthrough`, "
        "`manual` (smg 1.13.0's)"),
    "router_health_check_interval_secs": (
        "seconds between the router's health checks of each worker (`GET /health`)"),
    "router_health_check_timeout_secs": "seconds a health check may take",
    "router_health_failure_threshold": (
        "failed checks in a row before the router takes a worker out"),
    "router_health_success_threshold": "passed checks in a row before it takes the worker back",
    "router_lock": "the router venv's lock (smg 1.13.0 and its dependencies, hashed)",
    "router_venv_path": "the router's own venv",
    "router_wait_timeout": "seconds the deploy waits for the router to list every worker healthy",
    "roll_size": (
        "servers of the fleet restarted at once in a rolling upgrade (read from the first router "
        "host's data)"),
    "roll_drain_timeout": (
        "seconds a host out of the router is waited for until its in-flight requests are done; "
        "past that it restarts anyway"),
    "roll_max_unavailable": (
        "workers of the fleet a roll may have out of the router at once, those an interrupted "
        "run left out included (read from the first router host's data; at least "
        "gpuhost_roll_size)"),
    "prometheus": (
        "on a router host: True runs the fleet's Prometheus there, False not; None: the first "
        "host of the gpuhost_router group runs it (docs/observability.md)"),
    "prometheus_port": "Prometheus' port on its host's loopback (its UI: an SSH tunnel)",
    "prometheus_retention_days": "days of metrics Prometheus keeps",
    "prometheus_retention_gib": (
        "GiB of disk Prometheus' data may take; the oldest data goes first"),
    "node_exporter_port": (
        "the node exporter's port on a GPU host (its fleet address, or the loopback where "
        "Prometheus runs on the same host)"),
    "gpu_metrics_interval": (
        "seconds between two readings of nvidia-smi for the GPU metrics (DCGM exporter's names)"),
    "alert_ttft_p99": "seconds: a p99 time to first token above this fires SGLangTTFTHigh",
    "alert_itl_p99": "seconds: a p99 inter-token latency above this fires SGLangITLHigh",
    "alert_kv_cache_usage": (
        "share of the KV cache in use above which SGLangKVCacheNearFull fires"),
    "alert_webhook_url": (
        "on the Prometheus host: Debian's Alertmanager posts every alert, firing and resolved, "
        "to this URL (a webhook receiver); None: no Alertmanager, the alerts stay in "
        "Prometheus' UI and API"),
    "alertmanager_port": "Alertmanager's port on the Prometheus host's loopback",
}


def _fail(host: str, key: str, value: Any, allowed: str) -> SettingsError:
    return SettingsError(f"host {host}: {PREFIX}{key} = {value!r} is not allowed: {allowed}.",
                         key=f"{PREFIX}{key}")


def _sourced(exc: SettingsError, sources: Mapping[str, str] | None) -> str:
    """A problem's line, with where its key's value came from when ``sources`` tells."""
    message = str(exc)
    if sources is None or exc.key is None:
        return message
    where = sources.get(exc.key)
    return message + (f" It is set in {where}." if where else " It is the default.")


def _typed(data: Mapping[str, Any]) -> dict[str, Any]:
    """Host data's ``gpuhost_`` values by setting name, as the Settings fields take them
    (version-like numbers as the text typed, lists as tuples)."""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX):]
        if name in _NUMBER_AS_TEXT and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            value = str(value)
        values[name] = tuple(value) if name in ("server_extra_args", "allowed_dropins",
                                                "bench_levels", "nodes",
                                                "api_gate_trusted_peers",
                                                "server_local_users", "tls_names") \
            else value
    if (cuda := values.get("cuda_toolkit", Settings.cuda_toolkit)) in CUDA_TOOLKITS:
        values.setdefault("lock", CUDA_TOOLKITS[cuda])
    return values


def profile_choice(host: str, data: Mapping[str, Any]) -> ProfileChoice:
    """:func:`launch_choice` of a host's raw host data (already validated by
    :func:`for_run`), for the plan's log (operations/stack_check.py)."""
    return launch_choice(host, _typed(data))


def from_host_data(host: str, data: Mapping[str, Any],
                   sources: Mapping[str, str] | None = None) -> Settings:
    """Build one host's :class:`Settings` from its merged host data.

    + host: the host's name, for messages
    + data: pyinfra host data (inventory, group_data and defaults merged)
    + sources: where each key's value came from (:func:`data_sources`), added to messages

    Raises :class:`SettingsError` for an unknown ``gpuhost_`` key (with the closest known key),
    a value of the wrong type or outside what is allowed, or settings that contradict each
    other (a tensor parallel size that does not divide the GPU count, the proprietary driver
    flavour on Blackwell): every such problem, one line each. Settings are checked against
    each other only once every value is allowed on its own.
    """
    problems: list[str] = []
    for key, value in data.items():
        try:
            _check_key(host, key, value)
        except SettingsError as exc:
            problems.append(_sourced(exc, sources))
    if problems:
        raise SettingsError("\n".join(problems), problems=problems)
    values = _typed(data)
    if values.get("serving", Settings.serving):
        try:
            choice = launch_choice(host, values)
        except SettingsError as exc:
            problems.append(_sourced(exc, sources))
        else:
            values = choice.applied(values)
    if "bench_levels" not in values:
        values["bench_levels"] = default_bench_levels(values.get(
            "max_running_requests", Settings.max_running_requests))
    settings = Settings(**values)
    for check in _TOGETHER:
        if not settings.serving and check in _SERVING_ONLY:
            continue
        try:
            check(host, settings)
        except SettingsError as exc:
            problems.append(_sourced(exc, sources))
    if problems:
        raise SettingsError("\n".join(problems), problems=problems)
    return settings


@dataclass(frozen=True)
class ProfileChoice:
    """The launch profile a host's data gets (operations/launch_profiles.py).

    + profile: the profile, None where none is for the host's GPUs, model and sglang
    + given: the profile's settings the host data sets itself (they win)
    + passed_over: profiles for the host that the locked sglang's parser refused, with why
    + sglang: the locked sglang's version ("" where the lock cannot be read)
    + named: whether gpuhost_launch_profile named it (else the default choice)
    """

    profile: launch_profiles.LaunchProfile | None
    given: frozenset[str]
    passed_over: tuple[tuple[str, str], ...]
    sglang: str
    named: bool = False

    def applied(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` with the profile's value of each setting they do not set, and the
        profile's name as gpuhost_launch_profile."""
        out = dict(values)
        if self.profile is None:
            return out
        for setting, value in self.profile.settings().items():
            if setting not in self.given:
                out[setting] = dict(value) if isinstance(value, Mapping) else value
        out["launch_profile"] = self.profile.name
        return out


def launch_choice(host: str, values: Mapping[str, Any]) -> ProfileChoice:
    """The launch profile for one host's settings (``values``: host data without the prefix,
    each value allowed on its own): the one gpuhost_launch_profile names, else the first of
    launch_profiles.PROFILES for the host's compute capability (gpuhost_compute_capability),
    model architecture and locked sglang whose command line, with the host's own values
    winning, the locked sglang's parser accepts (locks/sglang-<version>.args.json).

    Raises :class:`SettingsError` for a named profile that is for other GPUs, another model
    architecture or another sglang, or whose flags the locked sglang refuses. Where the lock
    cannot be read, no profile (the lock's own check says why)."""
    given = frozenset(k for k in values if k in launch_profiles.PROFILE_SETTINGS)
    base = Settings(**values)
    try:
        sglang = read_lock(base.lock_path).get("sglang")
        spec = load_parser_spec(sglang.version) if sglang is not None else None
    except (LockError, FlagError):
        spec = None
    if spec is None:
        return ProfileChoice(None, given, (), "")
    version = spec.version
    here = (base.compute_capability, base.model_architecture, version)
    fits = launch_profiles.matching(*here)

    def refusal(profile: launch_profiles.LaunchProfile) -> str | None:
        ours = {k: v for k, v in profile.settings().items() if k not in given}
        try:
            check_server_args(server_args(replace(base, **ours)), spec)
        except FlagError as exc:
            return str(exc)
        return None

    if base.launch_profile is not None:
        profile = launch_profiles.named(base.launch_profile)
        if profile not in fits:
            raise _fail(host, "launch_profile", base.launch_profile,
                        f"a profile for compute capability {here[0]}, {PREFIX}model_architecture "
                        f"{here[1]} and the locked sglang {version} ({profile.name} is for "
                        f"compute capability {profile.compute_capability}, "
                        f"{', '.join(profile.architectures)}, sglang {profile.sglang or 'any'}); "
                        f"for this host: {', '.join(p.name for p in fits) or 'none'}, or None")
        why = refusal(profile)
        if why is not None:
            raise _fail(host, "launch_profile", base.launch_profile,
                        f"a profile whose flags the locked sglang {version} accepts ({why}); "
                        "for this host: " + (", ".join(p.name for p in fits
                                                       if refusal(p) is None) or "none")
                        + ", or None")
        return ProfileChoice(profile, given, (), version, named=True)
    passed: list[tuple[str, str]] = []
    for profile in fits:
        why = refusal(profile)
        if why is None:
            return ProfileChoice(profile, given, tuple(passed), version)
        passed.append((profile.name, why))
    return ProfileChoice(None, given, tuple(passed), version)


def _check_key(host: str, key: Any, value: Any) -> None:
    """Raise :class:`SettingsError` unless ``key = value`` is allowed on its own."""
    known = sorted(f"{PREFIX}{name}" for name in _FIELDS)
    squashed = {re.sub(r"[^a-z0-9]", "", k): k for k in known}
    if not isinstance(key, str):
        raise SettingsError(f"host {host}: host data key {key!r} is not allowed: keys are "
                            "strings")
    if not key.startswith(PREFIX):
        if f"{PREFIX}{key}" in known:
            raise SettingsError(
                f"host {host}: unknown key {key}: did you mean {PREFIX}{key}?", key=key
            )
        # A misspelt prefix (GPUHOST_, gpuhost-, gpuhots_) would leave the default on.
        close = squashed.get(re.sub(r"[^a-z0-9]", "", key.lower())) or next(iter(
            difflib.get_close_matches(key.lower(), known, n=1, cutoff=0.9)), None)
        if close:
            raise SettingsError(f"host {host}: unknown key {key}: did you mean {close}?",
                                key=key)
        return
    name = key[len(PREFIX):]
    if name not in _FIELDS:
        # Compared without the prefix, which every key shares; issue 39 names the CUDA key so
        close = {"cuda_version": ["cuda_toolkit"]}.get(name) or difflib.get_close_matches(
            name, sorted(_FIELDS), n=1, cutoff=0.7)
        hint = (f" did you mean {PREFIX}{close[0]}?" if close
                else f" known keys: {', '.join(known)}")
        raise SettingsError(f"host {host}: unknown key {key}:{hint}", key=key)
    if name in _NUMBER_AS_TEXT and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if _control_characters(value):
        raise _fail(host, name, value, "a value without control characters (newlines, "
                                        "tabs, NUL): it is written into unit files, "
                                        "environment files and commands")
    rule = RULES[name]
    if not rule.check(value):
        raise _fail(host, name, value, rule.allowed)


def _check_tensor_parallel(host: str, s: Settings) -> None:
    """On one host, the tensor parallel size a divisor of the GPU count (times the pipeline
    parallel size, where set). Across nodes, every GPU of every node: sglang 0.5.9 places
    tp x pp / nnodes ranks on each node (sglang/srt/entrypoints/engine.py,
    _launch_scheduler_processes: tp_size_per_node), so a node runs exactly gpuhost_gpu_count
    ranks only when tp x pp = GPUs per node x nodes."""
    pp = s.pipeline_parallel_size or 1
    if s.nodes:
        if host not in s.nodes:
            raise _fail(host, "nodes", list(s.nodes),
                        f"a list of the group's hosts that names this host ({host}): it "
                        "gets the group's data, so it serves one rank of it")
        total = s.gpu_count * len(s.nodes)
        across = (f"the group's {total} GPUs ({PREFIX}gpu_count {s.gpu_count} x "
                  f"{len(s.nodes)} nodes)")
        if total % pp:
            raise _fail(host, "pipeline_parallel_size", pp, f"a divisor of {across}")
        if s.tensor_parallel_size * pp != total:
            raise _fail(host, "tensor_parallel_size", s.tensor_parallel_size,
                        f"{total // pp}: {across}"
                        + (f" divided by {PREFIX}pipeline_parallel_size {pp}" if pp > 1 else "")
                        + "; sglang runs tensor x pipeline parallel size / nodes ranks on "
                        "each node, one per GPU")
        return
    if s.gpu_count % pp:
        raise _fail(host, "pipeline_parallel_size", pp,
                    f"a divisor of {PREFIX}gpu_count ({s.gpu_count}) on one host")
    per_stage = s.gpu_count // pp
    if s.tensor_parallel_size > per_stage or per_stage % s.tensor_parallel_size:
        divisors = [n for n in range(1, per_stage + 1) if per_stage % n == 0]
        raise _fail(
            host,
            "tensor_parallel_size",
            s.tensor_parallel_size,
            f"a divisor of {PREFIX}gpu_count ({s.gpu_count})"
            + (f" / {PREFIX}pipeline_parallel_size ({pp})" if pp > 1 else "") + ": "
            + ", ".join(str(n) for n in divisors),
        )


def _check_flavour(host: str, s: Settings) -> None:
    major, minor = (int(p) for p in s.compute_capability.split("."))
    if s.driver_flavour != "open" and (major, minor) >= OPEN_MODULE_ONLY_FROM:
        raise _fail(
            host,
            "driver_flavour",
            s.driver_flavour,
            f"only 'open' on compute capability {s.compute_capability}: NVIDIA supports "
            "Blackwell and newer GPUs with the open kernel modules only",
        )


def _check_driver(host: str, s: Settings) -> None:
    """The driver branch (and version) at least the minimum of gpuhost_cuda_toolkit's CUDA
    (CUDA_MIN_DRIVER: NVIDIA's release notes, Table 3; CUDA 13.0 needs R580, >= 580.65.06)."""
    text = CUDA_MIN_DRIVER[s.cuda_toolkit]
    floor = Version(text).major
    if int(s.driver_branch) < floor:
        fits = "".join(f"; or {PREFIX}cuda_toolkit = {c!r}" for c in CUDA_TOOLKITS
                       if int(s.driver_branch) >= Version(CUDA_MIN_DRIVER[c]).major)
        raise _fail(host, "driver_branch", s.driver_branch,
                    f"with {PREFIX}cuda_toolkit = {s.cuda_toolkit!r}, a branch that supports "
                    f"CUDA {s.cuda_toolkit} (driver >= {text}): "
                    + ", ".join(b for b in DRIVER_BRANCHES if int(b) >= floor) + fits)
    if s.driver_version is not None and not s.driver_version.startswith(f"{s.driver_branch}."):
        raise _fail(host, "driver_version", s.driver_version,
                    f"a version of driver branch {s.driver_branch} ({PREFIX}driver_branch)")
    if s.driver_version is not None and Version(s.driver_version) < Version(text):
        raise _fail(host, "driver_version", s.driver_version, f"a driver >= {text}, the "
                    f"minimum for CUDA {s.cuda_toolkit} ({PREFIX}cuda_toolkit)")


def _check_lock(host: str, s: Settings) -> None:
    if not s.lock_path.is_file():
        raise _fail(host, "lock", s.lock, f"an existing lock file (not found: {s.lock_path})")
    _check_server_flags(host, s)


def _check_speculative(host: str, s: Settings) -> None:
    """MTP: the locked sglang has the speculative flags and NEXTN among its algorithms (where
    its parser lists them: 0.5.17's takes any text); the step counts set together or all left
    to sglang (0.5.9's server_args.py asserts topk and draft tokens None where the steps are).
    The checkpoint's MTP layer is read from its weight index (operations/stack_check.py)."""
    if s.speculative_algorithm is None:
        return
    try:
        sglang = read_lock(s.lock_path).get("sglang")
        spec = load_parser_spec(sglang.version) if sglang else None
    except (LockError, FlagError):
        return  # said by _check_lock
    if spec is None:
        return
    by_flag = spec.by_flag()
    for flag in ("--speculative-algorithm", "--speculative-num-steps",
                 "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        if flag not in by_flag:
            raise _fail(host, "speculative_algorithm", s.speculative_algorithm,
                        f"None: the locked sglang {spec.version} has no {flag} "
                        f"(locks/sglang-{spec.version}.args.json)")
    choices = by_flag["--speculative-algorithm"].choices
    if choices is not None and s.speculative_algorithm not in choices:
        raise _fail(host, "speculative_algorithm", s.speculative_algorithm,
                    f"None: the locked sglang {spec.version} offers "
                    f"{', '.join(choices) or 'no algorithm'} for --speculative-algorithm")
    if s.speculative_num_steps is None:
        for key in ("speculative_eagle_topk", "speculative_num_draft_tokens"):
            if getattr(s, key) is not None:
                raise _fail(host, key, getattr(s, key),
                            f"None with {PREFIX}speculative_num_steps None: sglang "
                            f"{spec.version} chooses the three step counts together or takes "
                            "all three as given (server_args.py asserts it)")


def _check_mok(host: str, s: Settings) -> None:
    """The MOK's key and certificate go together (DKMS signs with both), as two files."""
    pair = {"mok_signing_key": s.mok_signing_key, "mok_certificate": s.mok_certificate}
    for key, other in (("mok_signing_key", "mok_certificate"),
                       ("mok_certificate", "mok_signing_key")):
        if pair[key] is None and pair[other] is not None:
            raise _fail(host, key, None, f"a path as well, since {PREFIX}{other} is set: DKMS "
                        "signs with a private key and its certificate, named together")
    if s.mok_signing_key is not None and s.mok_signing_key == s.mok_certificate:
        raise _fail(host, "mok_certificate", s.mok_certificate,
                    f"a file other than {PREFIX}mok_signing_key's: the private key and its "
                    "DER certificate are two files")


def _check_tls(host: str, s: Settings) -> None:
    """The fleet CA's certificate and key go together; names need the CA."""
    if s.tls_ca_key_file is not None and s.tls_ca_cert_file is None:
        raise _fail(host, "tls_ca_cert_file", None, f"a path as well, since {PREFIX}"
                    "tls_ca_key_file is set: the deploy issues certificates with the fleet CA's "
                    "key and certificate")
    own = {"tls_cert_file": s.tls_cert_file, "tls_key_file": s.tls_key_file}
    for key, other in (("tls_cert_file", "tls_key_file"), ("tls_key_file", "tls_cert_file")):
        if own[key] is None and own[other] is not None:
            raise _fail(host, key, None, f"a path as well, since {PREFIX}{other} is set: a "
                        "certificate and its private key, named together")
    if s.tls_cert_file is not None and s.tls_ca_cert_file is None:
        raise _fail(host, "tls_ca_cert_file", None, f"a path, since {PREFIX}tls_cert_file is "
                    "set: the CA's certificate that signed it, which the router and the "
                    "deploy's checks verify it with")
    if s.tls_cert_file is not None and s.tls_cert_file == s.tls_key_file:
        raise _fail(host, "tls_key_file", s.tls_key_file,
                    f"a file other than {PREFIX}tls_cert_file's")
    public = (s.serving and s.server_is_public) or s.router_is_public
    if s.tls_ca_cert_file is not None and s.tls_ca_key_file is None and public \
            and s.tls_cert_file is None:
        raise _fail(host, "tls_ca_key_file", None, f"a path, or {PREFIX}tls_cert_file and "
                    f"{PREFIX}tls_key_file: this host's endpoints bind wider than the "
                    "loopback and need a certificate, issued with the fleet CA's key or your own")
    if s.tls_ca_cert_file is not None and s.tls_ca_cert_file == s.tls_ca_key_file:
        raise _fail(host, "tls_ca_key_file", s.tls_ca_key_file,
                    f"a file other than {PREFIX}tls_ca_cert_file's")
    if s.tls_names and s.tls_ca_cert_file is None:
        raise _fail(host, "tls_names", list(s.tls_names), f"[] without {PREFIX}tls_ca_cert_file "
                    "(names of a certificate the deploy issues from the fleet CA)")


def _check_server_exposure(host: str, s: Settings) -> None:
    if s.server_is_public and s.server_local_users:
        raise _fail(
            host, "server_local_users", list(s.server_local_users),
            f"no users with {PREFIX}server_host = {s.server_host!r}: a server bound wider than the "
            "loopback is reached through its gate with the API key, never past it")
    if s.server_is_public and s.api_key_file is None:
        raise _fail(
            host, "server_host", s.server_host,
            f"a loopback address (127.0.0.1, ::1), or set {PREFIX}api_key_file to a root-only "
            "file holding the API key: a wider bind without a key is open to the network",
        )
    if s.server_is_public and s.server_backend_port == s.server_port:
        raise _fail(
            host, "server_backend_port", s.server_backend_port,
            f"a port other than {PREFIX}server_port ({s.server_port}): the API key gate listens "
            "there and the server behind it on 127.0.0.1",
        )


def _check_trusted_peers(host: str, s: Settings) -> None:
    """Each trusted peer once, and none of this host's own addresses (its fleet address, its
    server's and router's binds): every process of the host, every local user included, would
    pass the gate without the key from there. An IPv4-mapped IPv6 address is its IPv4 one."""
    def same(address: str) -> str:
        ip = ipaddress.ip_address(address)
        return (getattr(ip, "ipv4_mapped", None) or ip).compressed

    seen: set[str] = set()
    own = {same(a): key for key, a in (("fleet_address", s.fleet_address),
                                        ("server_host", s.server_host),
                                        ("router_host", s.router_host)) if a}
    for peer in s.api_gate_trusted_peers:
        if same(peer) in seen:
            raise _fail(host, "api_gate_trusted_peers", list(s.api_gate_trusted_peers),
                        f"each address once ({peer} is listed twice)")
        seen.add(same(peer))
        if same(peer) in own:
            raise _fail(host, "api_gate_trusted_peers", list(s.api_gate_trusted_peers),
                        f"other hosts' addresses only ({peer} is this host's own "
                        f"{PREFIX}{own[same(peer)]}: every local user would pass without the "
                        "key)")


def _check_dist_init_port(host: str, s: Settings) -> None:
    """The rendezvous port on rank 0 is torch.distributed's TCP store there (sglang 0.5.9,
    ``--dist-init-addr``): it cannot be a port the server or its gate listens on."""
    if not s.nodes:
        return
    taken = {s.server_port: "server_port"}
    if s.server_is_public:
        taken[s.server_backend_port] = "server_backend_port"
    if s.dist_init_port in taken:
        raise _fail(host, "dist_init_port", s.dist_init_port,
                    f"a port other than {PREFIX}{taken[s.dist_init_port]} "
                    f"({s.dist_init_port}): rank 0 listens there for the nodes' rendezvous")


def _check_router_exposure(host: str, s: Settings) -> None:
    """The router's bind as the server's: a wider bind needs a key (the API key gate in front,
    operations/router.py, on the loopback too), and the gate's port is not the router's own."""
    if s.router_is_public and s.router_api_key_file is None:
        raise _fail(
            host, "router_host", s.router_host,
            f"a loopback address (127.0.0.1, ::1), or set {PREFIX}router_api_key_file to a "
            "root-only file holding the API key: a wider bind without a key is open to the "
            "network",
        )
    if s.router_backend_port == s.router_port:
        raise _fail(
            host, "router_backend_port", s.router_backend_port,
            f"a port other than {PREFIX}router_port ({s.router_port}): the API key gate listens "
            "there and the router behind it on 127.0.0.1",
        )
    for loopback in ("router_backend_port", *(() if s.router_is_public else ("router_port",))):
        if getattr(s, loopback) == ROUTER_METRICS_PORT:
            raise _fail(host, loopback, ROUTER_METRICS_PORT,
                        f"a port other than {ROUTER_METRICS_PORT}: the router's own metrics "
                        f"listen on 127.0.0.1:{ROUTER_METRICS_PORT}, where the router would "
                        "listen too")
    taken = {s.server_port: "server_port", s.server_backend_port: "server_backend_port"} \
        if s.serving else {}
    for key in ("router_port", "router_backend_port"):
        port = getattr(s, key)
        if port in taken:
            raise _fail(host, key, port, f"a port other than {PREFIX}{taken[port]}'s ({port}): "
                        "the router may run on a serving host")


def _known_flags(flags: list[str], spec: Any) -> list[tuple[str, Any]]:
    """:func:`flags_named` of those of ``flags`` the locked sglang has (an older one may lack
    some of the flags gpuhost owns: the speculative ones; a key that would render one is
    refused on its own, _check_speculative)."""
    found = []
    for flag in flags:
        try:
            found += flags_named([flag], spec)
        except FlagError:
            continue
    return found


def _check_server_flags(host: str, s: Settings) -> None:
    try:
        lock = read_lock(s.lock_path)
    except LockError as exc:
        raise _fail(host, "lock", s.lock, f"a lock that parses ({exc})") from None
    _check_torch_cuda(host, s, lock)
    sglang = lock.get("sglang")
    if sglang is None:
        raise _fail(host, "lock", s.lock, "a lock that pins sglang")
    try:
        spec = load_parser_spec(sglang.version)
        check_server_args(server_args(s), spec)
        extra = flags_named(list(s.server_extra_args), spec)
        owned = {arg.flags: flag for flag, arg in _known_flags(list(OWNED_FLAGS), spec)}
        rendered = {arg.flags for _, arg in
                    flags_named([*server_args(replace(s, server_extra_args=())),
                                 *P2P_SERVER_FLAGS], spec)}
    except FlagError as exc:
        raise SettingsError(
            f"host {host}: the server's flags (gpuhost_* server keys, "
            f"gpuhost_server_extra_args) do not fit the locked sglang: {exc}"
        ) from None
    for token, arg in extra:
        if any("api-key" in flag for flag in arg.flags):
            raise _fail(
                host, "server_extra_args", _without_values(s.server_extra_args),
                f"no API key flag ({token.partition('=')[0]} is {arg.flags[0]}; sglang logs "
                "its arguments and "
                f"/server_info returns them): name a root-only key file in {PREFIX}api_key_file",
            )
        if arg.flags in owned:
            keys = " and ".join(PREFIX + k for k in OWNED_FLAGS[owned[arg.flags]])
            raise _fail(
                host, "server_extra_args", list(s.server_extra_args),
                f"no flag gpuhost sets itself ({token} is {arg.flags[0]}, which {keys} "
                "owns, set or not: the known behaviour and the backends left to sglang are "
                "read from the key, so a second spelling would run unchecked): set "
                f"{keys} instead (null leaves an optional flag out)",
            )
        if any(flag in arg.flags for flag in ALWAYS_FLAGS):
            raise _fail(
                host, "server_extra_args", list(s.server_extra_args),
                f"no flag gpuhost sets itself ({token} is {arg.flags[0]}, which every server "
                "gets): leave it out",
            )
        if arg.flags in rendered:
            raise _fail(
                host, "server_extra_args", list(s.server_extra_args),
                f"no flag gpuhost sets itself ({token} is {arg.flags[0]}, set from the "
                f"{PREFIX}* server keys, the bind address and the P2P decision, which it would "
                "silently override): set the matching key instead",
            )


#: Server settings a sweep may vary (each renders one launch_server flag).
SWEEP_KEYS: Final = ("moe_runner_backend", "attention_backend", "fp8_gemm_backend",
                     "nsa_decode_backend", "nsa_prefill_backend", "kv_cache_dtype",
                     "mem_fraction_static", "speculative_algorithm")  # its None: MTP off


def _check_sweep(host: str, s: Settings) -> None:
    """The sweep's key one of SWEEP_KEYS; its values non-empty, distinct, each allowed on its own
    and by the locked sglang's parser (what launch_server would refuse at start)."""
    if not s.bench_sweep:
        return
    ((key, values),) = s.bench_sweep.items()
    if s.nodes:
        raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                    f"None on a node of a server across hosts ({PREFIX}nodes = "
                    f"{list(s.nodes)}): a sweep restarts one host's server alone, and a rank "
                    "restarted alone leaves the others waiting in NCCL's rendezvous")
    if key not in SWEEP_KEYS:
        raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                    f"a sweep over one of {', '.join(SWEEP_KEYS)} (not {key!r})")
    if not values or len(set(map(repr, values))) != len(values):
        raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                    f"a non-empty list of distinct values for {key}")
    for value in values:
        if (value is None and key != "speculative_algorithm") or not RULES[key].check(value):
            raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                        f"values of {key} each {RULES[key].allowed} ({value!r} is not)")
    try:
        sglang = read_lock(s.lock_path).get("sglang")
        spec = load_parser_spec(sglang.version) if sglang else None
    except (LockError, FlagError):
        return  # said by _check_lock
    for value in values if spec else ():
        try:
            if key == "speculative_algorithm":
                _check_speculative(host, replace(s, speculative_algorithm=value))
            check_server_args(server_args(replace(s, **{key: value})), spec)
        except SettingsError as exc:  # NEXTN's: the host data's step counts
            raise _fail(host, "bench_sweep", dict(s.bench_sweep), "values whose NEXTN the host "
                        f"data allows ({str(exc).split(': ', 1)[1].rstrip('.')})") from None
        except FlagError as exc:
            raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                        f"values the locked sglang {sglang.version} accepts: {exc}") from None


def default_bench_levels(max_running_requests: int) -> tuple[int, ...]:
    """The bench's default concurrency levels (1, 16, 64: the reference lab's notes) within
    what the server runs at once; a server of fewer requests also gets its own maximum. Host
    data that lowers gpuhost_max_running_requests must not make the deploy refuse a bench key
    it never set."""
    levels = tuple(n for n in Settings.bench_levels if n <= max_running_requests)
    if max_running_requests not in levels and max_running_requests < max(Settings.bench_levels):
        levels += (max_running_requests,)
    return levels


def _check_bench(host: str, s: Settings) -> None:
    """Every level within what the server runs at once, and enough prompts to reach the highest
    (the model's context length is checked on the host, by bench.py, from its config)."""
    over = [n for n in s.bench_levels if n > s.max_running_requests]
    if over:
        raise _fail(host, "bench_levels", list(s.bench_levels),
                    f"levels from 1 to {PREFIX}max_running_requests ({s.max_running_requests}):"
                    f" the server runs no more requests at once ({over[0]} is more)")
    if s.bench_sweep and s.bench_target == "router":
        raise _fail(host, "bench_target", s.bench_target,
                    f"'host' with {PREFIX}bench_sweep: a sweep restarts one host's server, "
                    "which the router then takes out; sweep a host's own server")
    if s.bench_prompts < max(s.bench_levels):
        raise _fail(host, "bench_prompts", s.bench_prompts,
                    f"at least the highest of {PREFIX}bench_levels ({max(s.bench_levels)}): "
                    "fewer prompts never reach that many concurrent requests")


def _without_values(args: Iterable[str]) -> list[str]:
    """Extra server args for a message about an API key in them: every value replaced by
    "<hidden>" (a key must not reach the screen or a log)."""
    return [a.partition("=")[0] + "=<hidden>" if a.startswith("--") and "=" in a
            else a if a.startswith("--") else "<hidden>" for a in args]


def torch_cuda(lock: Any) -> str | None:
    """The CUDA release ("12.8") the lock's torch was built for: from torch's local version
    ("2.9.1+cu128"), else the lock's nvidia-cuda-runtime-cu1N pin (torch's CUDA runtime
    wheel), else PyPI's default build of that torch release (TORCH_DEFAULT_CUDA). None when
    the lock has no torch or none of these tells."""
    torch = lock.get("torch")
    if torch is None:
        return None
    local = re.search(r"\+cu(\d+)(\d)$", torch.version)
    if local:
        return f"{local.group(1)}.{local.group(2)}"
    for pin in lock.pins:
        if re.fullmatch(r"nvidia-cuda-runtime(-cu1\d)?", pin.name):
            return ".".join(pin.version.split(".")[:2])
    return TORCH_DEFAULT_CUDA.get(".".join(torch.version.split(".")[:2]))


def _check_torch_cuda(host: str, s: Settings, lock: Any) -> None:
    if lock.get("torch") is None:
        return
    cuda = torch_cuda(lock)
    if cuda is None or cuda not in CUDA_MIN_DRIVER:
        raise _fail(host, "lock", s.lock,
                    f"a lock whose torch says its CUDA release (a +cuXYZ version or an "
                    f"nvidia-cuda-runtime pin) among {', '.join(CUDA_MIN_DRIVER)}; "
                    f"torch {lock.get('torch').version} gives {cuda or 'none'}")
    if Version(cuda).major != Version(s.cuda_toolkit).major:
        raise _fail(host, "cuda_toolkit", s.cuda_toolkit,
                    f"a CUDA {Version(cuda).major}.x toolkit: the locked torch "
                    f"{lock.get('torch').version} is built for CUDA {cuda}, and what builds "
                    f"against it (flash-attn, FlashInfer's JIT) needs an nvcc of that major "
                    f"({PREFIX}lock = {s.lock!r})")
    if cuda == s.cuda_toolkit:
        return  # the same minimum as the toolkit's: _check_driver says it
    text = CUDA_MIN_DRIVER[cuda]
    minimum = Version(text)
    if s.driver_version is not None and Version(s.driver_version) < minimum:
        raise _fail(host, "driver_version", s.driver_version,
                    f"a driver >= {text}, the minimum for CUDA {cuda}, which the locked "
                    f"torch {lock.get('torch').version} needs ({PREFIX}lock = {s.lock!r})")
    if Version(s.driver_branch) < Version(str(minimum.major)):
        raise _fail(host, "driver_branch", s.driver_branch,
                    f"a branch >= {minimum.major}: the locked torch "
                    f"{lock.get('torch').version} needs CUDA {cuda}, driver >= {text} "
                    f"({PREFIX}lock = {s.lock!r})")


def _check_venv_path(host: str, s: Settings) -> None:
    """The venv apart from every folder gpuhost manages and from the files other keys name:
    a venv is cleared when it does not run, and pip writes into it."""
    theirs = dict(GPUHOST_DIRS)
    theirs[s.model_dir] = f"the model weights' folder, {PREFIX}model_dir"
    if s.model_is_local:
        theirs[s.model] = f"the served model's folder, {PREFIX}model"
    for key in ("api_key_file", "hf_token_file", "mok_signing_key", "mok_certificate",
                "fleet_key_file"):
        value = getattr(s, key)
        if value is not None:
            theirs[value] = f"the file {PREFIX}{key} names"
    for path, what in theirs.items():
        if not _overlaps(s.venv_path, path):
            continue
        how = ("is" if s.venv_path == path else "contains" if path.startswith(s.venv_path + "/")
               else "lies inside")
        raise _fail(host, "venv_path", s.venv_path,
                    f"a folder of the venv's own, apart from what gpuhost manages: it {how} "
                    f"{path}, {what} (a venv that does not run is cleared, and pip writes into "
                    f"it); the default is {Settings.venv_path}")


def _check_serving(host: str, s: Settings) -> None:
    """A host that serves no model is no node of a server across nodes (operations/fleet.py
    refuses one outside the gpuhost_router group: it knows the groups)."""
    if s.serving:
        return
    if s.nodes:
        raise _fail(host, "serving", s.serving,
                    f"True on a host of a node group ({PREFIX}nodes = {list(s.nodes)}): each "
                    "node serves its ranks of the group's model")


def _check_observability_ports(host: str, s: Settings) -> None:
    """Prometheus and Alertmanager (on the loopback of their host) and the node exporter (on the
    fleet address or the loopback) listen beside the server, its gate, the router and the
    router's metrics: no two of them on one port."""
    taken = {ROUTER_METRICS_PORT: "the router's metrics (127.0.0.1)"}
    for key in ("server_port", "server_backend_port", "router_port", "router_backend_port"):
        taken.setdefault(getattr(s, key), PREFIX + key)
    names = {"prometheus_port": "Prometheus", "node_exporter_port": "the node exporter",
             "alertmanager_port": "Alertmanager"}
    for key in ("prometheus_port", "node_exporter_port", "alertmanager_port"):
        port = getattr(s, key)
        if port in taken:
            raise _fail(host, key, port, f"a port other than {taken[port]}'s ({port}): "
                        f"{names[key]} listens there")
        taken[port] = PREFIX + key


#: The checks of settings against each other: each runs, so that every problem is reported.
_TOGETHER: Final = (_check_bench, _check_tensor_parallel, _check_flavour, _check_driver,
                    _check_mok, _check_server_exposure, _check_router_exposure,
                    _check_trusted_peers, _check_dist_init_port, _check_venv_path, _check_lock,
                    _check_speculative,
                    _check_sweep, _check_serving, _check_observability_ports,
                    _check_tls)
#: The checks of the host's GPUs, driver, ML venv and server: a host that serves no model
#: (``gpuhost_serving = False``) skips them, and those keys have no effect there (group data
#: such as group_data/all.py may set them for every host of the inventory).
_SERVING_ONLY: Final = (_check_tensor_parallel, _check_flavour, _check_driver, _check_mok,
                        _check_server_exposure, _check_dist_init_port, _check_venv_path,
                        _check_lock, _check_speculative, _check_sweep)


def for_inventory(hosts: Iterable[tuple[str, Mapping[str, Any]]],
                  sources: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Settings]:
    """Validate every host's settings at once, so one bad host stops the run before any host
    is touched. Takes ``(name, data)`` pairs, and optionally each host's :func:`data_sources`
    by name; returns settings by host name.

    Raises :class:`SettingsError` with every problem of every host, one line each (and where
    the value came from, when ``sources`` tells); also when two hosts claim one address
    (``ssh_hostname``, or the host's name where it has none): one machine would be converged
    twice, concurrently.
    """
    pairs = [(name, data if data is not None else {}) for name, data in hosts]
    problems: list[str] = []
    claimed: dict[tuple[str, int], str] = {}
    for name, data in pairs:
        address = _address(name, data)
        if address is None:
            continue
        if address in claimed:
            shown = address[0] if address[1] == 22 else f"{address[0]} port {address[1]}"
            problems.append(
                f"hosts {claimed[address]} and {name} both claim the address {shown} "
                "(ssh_hostname, ssh_port): each host of an inventory must be a different machine"
            )
            continue
        claimed[address] = name
    settings: dict[str, Settings] = {}
    for name, data in pairs:
        try:
            settings[name] = from_host_data(name, data, (sources or {}).get(name))
        except SettingsError as exc:
            problems += exc.problems
    problems += check_groups(settings, refused=[name for name, _ in pairs if name not in settings])
    if problems:
        raise SettingsError("\n".join(problems), problems=problems)
    return settings


def notes(s: Settings) -> list[str]:
    """Host data that is allowed but has no effect, one sentence each, for a warning: an API
    key file on a loopback bind (only a wider bind puts the API key gate, which reads the
    key, in front of the server; sglang itself never gets the key)."""
    found = []
    if s.api_key_file is not None and not s.server_is_public:
        found.append(
            f"{PREFIX}api_key_file = {s.api_key_file!r} has no effect: {PREFIX}server_host = "
            f"{s.server_host!r} is a loopback address, where the server answers without the "
            "API key gate; bind a wider address to require the key, or remove "
            f"{PREFIX}api_key_file")
    public = [key for key, bound in (("server_host", s.serving and s.server_is_public),
                                     ("router_host", s.router_is_public)) if bound]
    if public and s.tls_ca_cert_file is None:
        found.append(
            f"{' and '.join(PREFIX + k for k in public)} bind{'s' if len(public) == 1 else ''} "
            f"wider than the loopback without {PREFIX}tls_ca_cert_file: keys and prompts cross "
            "the network in plain HTTP; name a fleet CA for TLS (docs/security.md, TLS)")
    return found


#: Where a run keeps its validated settings (on pyinfra's state): pyinfra executes deploy.py
#: once per host, and each execution validated every host again (N hosts, N² validations: 5 %
#: of the controller's CPU of a 4-host no-op, sampled with py-spy).
_VALIDATED: Final = "_gpuhost_validated_settings"


def for_run(inventory: Any) -> dict[str, Settings]:
    """:func:`for_inventory` of pyinfra's inventory, each problem with where its value came
    from (:func:`data_sources`); on a problem, exit with every problem listed. Validated once
    a run, at the first host's deploy file; the other hosts' reuse it (the inventory is fixed
    once pyinfra has loaded it).

    SystemExit, because pyinfra shows an error raised in a deploy file as "pyinfra error in
    <file> line <n>", naming the innermost frame outside pyinfra (pyinfra_cli/exceptions.py,
    ``WrappedError``): a line of this module, not of the user's data. SystemExit is no
    Exception, so neither the deploy file's loader nor the CLI wraps it: pyinfra prints its
    message alone and exits 1, before any operation reaches any host. The current host's
    :func:`notes` are logged as warnings.
    """
    from pyinfra import host, logger, state

    from operations.inventory_check import command_line

    validated = getattr(state, _VALIDATED, None)
    if validated is not None and validated[0] is inventory:
        settings = dict(validated[1])
    else:
        inventory_file, _ = command_line(sys.argv[1:])
        folder = Path(getattr(state, "cwd", None) or ".") / "group_data"
        hosts = list(inventory)
        try:
            settings = for_inventory(
                ((h.name, h.data.dict()) for h in hosts),
                {h.name: data_sources(h, inventory_file, folder) for h in hosts})
        except SettingsError as exc:
            end_run("gpuhost: host data refused, no host was touched:\n  - "
                    + "\n  - ".join(exc.problems))
        setattr(state, _VALIDATED, (inventory, dict(settings)))
    if host.name in settings:
        for note in notes(settings[host.name]):
            logger.warning(f"{host.print_prefix}host data: {note}")
    return settings


def data_sources(host: Any, inventory_file: str | None = None,
                 group_data_dir: Path | None = None) -> dict[str, str]:
    """Where each of a pyinfra host's data keys gets its value, for messages: ``--data`` (the
    CLI's override data), the inventory (the host's own entry, or a group's data there), a
    ``group_data/<group>.py`` file, or ``group_data/all.py`` / the inventory's ``all`` data.

    pyinfra's HostData looks a key up in that order: override data, host data, group data
    (a later group winning), then the inventory's global data (pyinfra/api/host.py,
    ``Host.__init__``; pyinfra/api/inventory.py, ``get_groups_data``); the CLI puts a group's
    data from the inventory and from group_data/<group>.py into one dict, group_data/all.py
    into the global data (pyinfra_cli/inventory.py, ``make_inventory_from_files``). Which of the
    two a group's key came from is told by the file's own top-level assignments.

    + host: a pyinfra Host
    + inventory_file: the inventory's path, for messages
    + group_data_dir: the group_data folder pyinfra read (default: ./group_data)
    """
    inventory = host.inventory
    folder = group_data_dir if group_data_dir is not None else Path("group_data")
    in_inventory = f"the inventory {inventory_file}" if inventory_file else "the inventory"

    def group_source(group: str, key: str) -> str:
        path = folder / f"{group}.py"
        if key in _assigned_names(path):
            return f"group_data/{group}.py"
        return f"{in_inventory} (group {group}'s data)"

    layers: list[tuple[Callable[[str], str], Mapping[str, Any]]] = [
        (lambda key: "--data", inventory.get_override_data()),
        (lambda key: f"{in_inventory} (host {host.name}'s entry)",
         inventory.get_host_data(host.name)),
    ]
    for group in reversed(list(dict.fromkeys(host.groups))):
        layers.append((lambda key, g=group: group_source(g, key), inventory.get_group_data(group)))
    layers.append((lambda key: group_source("all", key), inventory.get_data()))
    found: dict[str, str] = {}
    for label, data in layers:
        for key in data:
            if key not in found:
                found[key] = label(key)
    return found


def _assigned_names(path: Path) -> set[str]:
    """The names a Python file assigns at its top level (nothing when it does not exist or does
    not parse)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _address(name: str, data: Mapping[str, Any]) -> tuple[str, int] | None:
    """The SSH address a host is reached at, in one spelling: (host, port). Case, a trailing
    dot and IPv6 notation do not make two addresses; pyinfra's ``@ssh/HOST`` names count,
    other connectors (``@local``, ``@docker/...``) have none."""
    if name.startswith("@"):
        if not name.startswith("@ssh/"):
            return None
        name = name[len("@ssh/"):]
    raw = str(data.get("ssh_hostname") or name).strip().rstrip(".").lower()
    try:
        raw = str(ipaddress.ip_address(raw.strip("[]")))
    except ValueError:
        pass
    port = data.get("ssh_port", 22)
    return raw, port if isinstance(port, int) else 22
