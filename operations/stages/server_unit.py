"""The SGLang server's systemd unit and environment file: their paths, where the server and its
API key gate answer, what the templates are rendered with, and what the server reads at start."""

from __future__ import annotations

from typing import Final

from operations.plans import gpu_verdict
from operations.plans.node_group import NodeRole
from operations.plans.settings import Settings
from operations.plans.sglang import server_args
from operations.plans.unit_sandbox import GPU_DEVICES, Sandbox
from operations.stages import gate, tls
from operations.stages import model as model_ops
from operations.stages.kernel_cache import KERNEL_CACHE_ROOT, cache_env, cache_key
from operations.stages.nodes import NODES_ENV_FILE
from operations.stages.nvidia import DRIVER_GATE_DROPIN
from operations.stages.p2p import ENV_FILE as P2P_ENV_FILE
from operations.stages.p2p import LIB_DIR
from operations.stages.service_users import SERVER_USER
from operations.stages.systemd_units import systemd_quote
from operations.stages.venvs import host_venv

UNIT: Final = "sglang.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT}"
GATE_UNIT: Final = "sglang-gate.service"
#: The server's home under /var/cache (the unit's CacheDirectory=).
CACHE_DIR: Final = "gpuhost-sglang"
#: The server's unit sandbox (operations/plans/unit_sandbox.py), run as SERVER_USER: the GPUs'
#: devices; its kernel caches writable (KERNEL_CACHE_ROOT); the network (NCCL, Gloo: AF_NETLINK);
#: a local model read where it is (``ProtectHome=read-only``); Triton's and CUDA's JIT; system
#: calls beyond @system-service kept (sglang raises its open files' limit; torch and NCCL set
#: CPU and memory affinity); /proc whole (torch and NVML read cpuinfo, meminfo, /proc/driver).
SANDBOX: Final = Sandbox(families=("AF_INET", "AF_INET6", "AF_UNIX", "AF_NETLINK"),
                         writable=(KERNEL_CACHE_ROOT,), home="read-only", devices=GPU_DEVICES,
                         jit=True, privileged=True, proc="all")
GATE_UNIT_PATH: Final = f"/etc/systemd/system/{GATE_UNIT}"
SERVER_ENV_FILE: Final = "/etc/gpuhost/server.env"
#: The server unit's drop-in folder (systemd.unit(5): ``<unit>.d/*.conf`` under
#: /etc/systemd/system). gpuhost owns OWN_DROPINS; host data may allow others by name.
DROPIN_DIR: Final = f"/etc/systemd/system/{UNIT}.d"
#: The runtime drop-in a bench.py sweep runs one value with (under /run: a reboot removes it);
#: one left by an interrupted sweep is removed here, and the server restarted.
SWEEP_DROPIN: Final = f"/run/systemd/system/{UNIT}.d/90-gpuhost-bench-sweep.conf"
OWN_DROPINS: Final = (DRIVER_GATE_DROPIN,)
#: systemd's pause before restarting a failed server, and how many starts it gets within
#: StartLimitIntervalSec (sized from the start timeout) before it stays failed.
RESTART_SEC: Final = 10
START_LIMIT_BURST: Final = 3
#: Folders under /run (systemd's RuntimeDirectory=) where each unit's ExecStartPre records the
#: digest of what it started with (operations/files/unit_inputs.py).
RUNTIME_DIRS: Final = {UNIT: "gpuhost-sglang", GATE_UNIT: "gpuhost-sglang-gate"}
#: The units' InvocationIDs (one line each) when the health gate last passed.
VERIFIED_FILE: Final = "/var/lib/gpuhost/sglang.verified"


def public_url(settings: Settings) -> str | None:
    """Where the API key gate answers, from the host, for the health gate and the bench, or
    None: no gate. https:// where the gate serves TLS (its certificate names the loopback
    addresses too, operations/stages/tls.py, which a wildcard bind is reached at)."""
    if not settings.server_is_public:
        return None
    return _url(settings.server_host, settings.server_port,
                "https" if tls.needs_tls(settings) else "http")


def _url(address: str, port: int, scheme: str = "http") -> str:
    address = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(address, address)
    return f"{scheme}://[{address}]:{port}" if ":" in address else f"{scheme}://{address}:{port}"


def backend_url(settings: Settings) -> str:
    """Where the server itself answers, from the host: the loopback behind the gate when the
    server is public, else its own bind address."""
    if settings.server_is_public:
        return _url("127.0.0.1", settings.server_backend_port)
    return _url(settings.server_host, settings.server_port)


def server_env(settings: Settings) -> dict[str, str]:
    """The server's environment from host data: gpuhost_server_env (the launch profile's
    unless set), and ``SGLANG_ENABLE_SPEC_V2=True`` with MTP on: without it sglang turns NEXTN
    into EAGLE and loads the model a second time as its draft, out of memory on these GPUs
    (voipmonitor/rtx6kpro models/glm5.md, "MTP / Speculative Decoding"; sglang 0.5.9's
    srt/environ.py: ``SGLANG_ENABLE_SPEC_V2 = EnvBool(False)``, which reads "True")."""
    env = dict(settings.server_env)
    if settings.speculative_algorithm is not None:
        env["SGLANG_ENABLE_SPEC_V2"] = "True"
    return env


def env_context(settings: Settings) -> dict:
    """What templates/server.env.j2 is rendered with."""
    return {"env": server_env(settings)}


def server_inputs(settings: Settings) -> list[str]:
    """What the server reads at start, as unit_inputs.py's arguments: the venv, then the
    files (a node of a server across hosts reads its nodes.env too)."""
    paths = [UNIT_PATH, DROPIN_DIR, SERVER_ENV_FILE, P2P_ENV_FILE]
    if settings.nodes:
        paths.append(NODES_ENV_FILE)
    if not settings.model_is_local:
        paths.append(f"{settings.model_path}/{model_ops.STAMP}")
    return ["--venv", host_venv(settings.lock_path), *paths]


def worker_gate(settings: Settings) -> gate.Gate:
    """The API key gate in front of a public server (operations/stages/gate.py): the client key and
    the fleet key the router sends (operations/stages/fleet.py), every path (sglang's own), the
    trusted peers host data names; the one query string the router sends (gate.ROUTER_QUERIES)."""
    return gate.Gate(
        unit=GATE_UNIT, description="API key gate in front of the SGLang server",
        part_of=UNIT, runtime_dir=RUNTIME_DIRS[GATE_UNIT], listen_host=settings.server_host,
        listen_port=settings.server_port, backend_url=backend_url(settings),
        key_files=tuple(filter(None, [settings.api_key_file, settings.fleet_key_file])),
        allowed_queries=gate.ROUTER_QUERIES,
        trusted_peers=tuple(settings.api_gate_trusted_peers), failed_file=gpu_verdict.FAILED_FILE,
        **tls.gate_files(settings, settings.server_is_public))


def gate_inputs(settings: Settings) -> list[str]:
    """What the API key gate reads at start (its key files aside: no digest of a secret)."""
    return gate.gate_inputs(worker_gate(settings))


def unit_context(settings: Settings, role: NodeRole | None = None) -> dict:
    """What templates/sglang.service.j2 is rendered with. StartLimitIntervalSec leaves room
    for START_LIMIT_BURST full starts (the start timeout and RestartSec each). ``role``: the
    host's place in a server across nodes (operations/plans/node_group.py)."""
    return {
        "role": role,
        "nodes_env_file": NODES_ENV_FILE if role is not None else None,
        "model": settings.model,
        "served_model_name": settings.served_model_name,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "server_env_file": SERVER_ENV_FILE,
        "p2p_env_file": P2P_ENV_FILE,
        "venv": host_venv(settings.lock_path),
        "cuda_home": settings.cuda_home,
        "lib_dir": LIB_DIR,
        "backend_url": backend_url(settings),
        "start_timeout": settings.server_start_timeout,
        "restart_sec": RESTART_SEC,
        "start_limit_burst": START_LIMIT_BURST,
        "start_limit_interval": START_LIMIT_BURST * (settings.server_start_timeout + RESTART_SEC),
        "gate_unit": GATE_UNIT if settings.server_is_public else None,
        "exec_args": " ".join(systemd_quote(a) for a in server_args(settings, role)),
        "runtime_dir": RUNTIME_DIRS[UNIT],
        "inputs_args": " ".join(systemd_quote(a) for a in server_inputs(settings)),
        "kernel_cache_env": cache_env(cache_key(settings)),
        "cache_dir": CACHE_DIR,
        "service_user": SERVER_USER,  # not "user": files.template's owner of the file
        "sandbox": SANDBOX.text(),
    }


def gate_context(settings: Settings) -> dict:
    """What templates/gate.service.j2 is rendered with for the server's gate."""
    return gate.unit_context(worker_gate(settings), gate_inputs(settings), systemd_quote)
