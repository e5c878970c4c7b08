"""Manage the SGLang server: its model weights, systemd unit and environment, the API key gate
for a public bind, restarts only on change, and a health gate that needs a real completion."""

from __future__ import annotations

import json
import re
import shlex
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Final

from pyinfra import host, logger
from pyinfra.api import FactBase, FunctionCommand, StringCommand, deploy, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.files import File
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus
from pyinfra.operations import files, systemd
from typing_extensions import override

from operations import REPO_ROOT, gate, group_restart, last_known_good, remote, roll, tls
from operations import gpu_verdict, model_copy, model_revision, model as model_ops
from operations.node_group import NodeRole
from operations.nodes import NODES_ENV_FILE, internode_argv
from operations.nvidia import DRIVER_GATE_DROPIN
from operations.p2p import ENV_FILE as P2P_ENV_FILE
from operations.p2p import LIB_DIR
from operations.p2p import RECORD as P2P_RECORD
from operations.folders import folders_down_to, top_folders
from operations.host import FileText, HostAddresses, address_problem
from operations.venv_facts import VenvAt
from operations.kernel_cache import (KERNEL_CACHE_ROOT, KernelCacheFolders, cache_env, cache_key,
                                     kernel_cache, remove_superseded)
from operations.plan import fact, refuse
from operations.preflight import InitSystem
from operations.secret_files import check_secret_file
from operations.secret_template import secret_template
from operations.service_users import SERVER_USER, service_user
from operations.settings import PREFIX, Settings
from operations.unit_sandbox import GPU_DEVICES, Sandbox
from operations.sglang import server_args
from operations.venvs import (VENVS_DIR, VenvFolders, digest_of_venv, host_venv,
                              recorded_venvs, unit_venv, venv_link)

UNIT: Final = "sglang.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT}"
GATE_UNIT: Final = "sglang-gate.service"
#: The server's home under /var/cache (the unit's CacheDirectory=).
CACHE_DIR: Final = "gpuhost-sglang"
#: The server's unit sandbox (operations/unit_sandbox.py), run as SERVER_USER: the GPUs'
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
#: GiB that must stay free on the model's file system after a download.
DISK_HEADROOM_GIB: Final = 1.0
#: Seconds between two progress lines of the health gate.
PROGRESS_EVERY: Final = 10
#: Folders under /run (systemd's RuntimeDirectory=) where each unit's ExecStartPre records the
#: digest of what it started with (operations/files/unit_inputs.py).
RUNTIME_DIRS: Final = {UNIT: "gpuhost-sglang", GATE_UNIT: "gpuhost-sglang-gate"}
#: The units' InvocationIDs (one line each) when the health gate last passed.
VERIFIED_FILE: Final = "/var/lib/gpuhost/sglang.verified"


def systemd_quote(arg: str) -> str:
    """Quote one argument for an ExecStart line (systemd.service(5), "Command lines"):
    specifiers ``%`` and variables ``$`` are doubled, and words with spaces, quotes or
    backslashes are double-quoted with C-style escapes."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[A-Za-z0-9_./:=+,@-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def public_url(settings: Settings) -> str | None:
    """Where the API key gate answers, from the host, for the health gate and the bench, or
    None: no gate. https:// where the gate serves TLS (its certificate names the loopback
    addresses too, operations/tls.py, which a wildcard bind is reached at)."""
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


def record_command(settings: Settings, action: str = "record") -> str:
    """The command that records the last known good once the health gate passed: the venv the
    unit names, the files the server and its gate read (operations/last_known_good.py); with
    ``action="check"``, the one that says whether the record agrees with them."""
    venv = host_venv(settings.lock_path)
    return last_known_good.record_command(
        venv=venv, lock_digest=digest_of_venv(venv), model=settings.model,
        revision=settings.model_revision,
        files=[UNIT_PATH, SERVER_ENV_FILE, P2P_ENV_FILE, P2P_RECORD, GATE_UNIT_PATH],
        folders=[DROPIN_DIR], keep=settings.venvs_kept, venvs_dir=VENVS_DIR, action=action)


class LastGoodState(FactBase[str]):
    """Whether the last known good record agrees with what serves: the first line of
    ``last_known_good.py check`` ("fresh", "unverified", "stale: <why>"); "absent: ..." where
    the script is not on the host yet (a fresh host: nothing recorded, nothing stale),
    "stale: ..." where it cannot say.

    .. code:: python

        "stale: /etc/gpuhost/server.env differ from what it recorded"
    """

    @override
    def command(self, check: str) -> str:
        script = shlex.quote(last_known_good.SCRIPT)
        return (f"if [ -f {script} ]; then {check} 2>/dev/null || echo 'stale: check failed'; "
                "else echo 'absent: no last_known_good.py on the host yet'; fi")

    @override
    def process(self, output) -> str:
        return output[0].strip() if output and output[0].strip() else "stale: no answer"


@remote.callback("recording the last known good", "the server goes on serving")
def _record_if_stale(state, host, check: str, record: str) -> bool:
    ok, out = remote.shell(host, check, _success_exit_codes=[0])
    said = (out.stdout_lines or ["stale"])[0]
    if ok and not said.startswith("stale"):
        return True
    ok, out = remote.shell(host, record, _success_exit_codes=[0, last_known_good.WRITE_FAILED])
    lines = out.stdout_lines + out.stderr_lines
    failed = not ok or any(line.startswith("could not write") for line in lines)
    for line in lines:
        (logger.error if failed else logger.warning)(
            f"{host.print_prefix}last known good: {line}")
    return not failed


@operation()
def last_good_recorded(check: str, record: str, state_now: str):
    """The last known good record rewritten where it disagrees with what serves, verified (a
    record a full disk kept from being written, edited by hand, or of another venv): read
    again when it runs, as the health gate earlier in the run may have recorded it.

    + check, record: last_known_good.py's check and record commands (:func:`record_command`)
    + state_now: :class:`LastGoodState` while planning
    """
    if state_now.startswith("stale"):
        # a fresh host's first record ("absent") is no news: the gate's pass records it
        logger.info(f"{host.print_prefix}last known good: {state_now}: recording it again")
    yield FunctionCommand(_record_if_stale, (check, record), {})


@operation()
def venvs_pruned(venvs_dir: str, keep: int, kept: list[str], remove: list[str]):
    """Remove the venvs ``remove`` under ``venvs_dir`` (those of failed lock changes, those
    retention no longer keeps), never one of ``kept`` (the one serving, the last known good's,
    the one this run converges); the shipped script checks the record again when it runs.

    + venvs_dir: VENVS_DIR
    + keep: gpuhost_venvs_kept
    + kept: venvs never removed here
    + remove: what planning found to remove
    """
    if not remove:
        host.noop("no venv to prune")
        return
    logger.info(f"{host.print_prefix}ML venv: removing the venvs {', '.join(remove)} "
                f"(gpuhost_venvs_kept = {keep}; kept: {', '.join(kept)})")
    yield last_known_good.prune_command(venvs_dir, keep, kept)


def worker_gate(settings: Settings) -> gate.Gate:
    """The API key gate in front of a public server (operations/gate.py): the client key and
    the fleet key the router sends (operations/fleet.py), every path (sglang's own), the
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
    host's place in a server across nodes (operations/node_group.py)."""
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


_LISTENERS_SCRIPT: Final = r"""
import json, os, sys
ports = {int(p) for p in sys.argv[1:]}
inodes = {}
for name in ("tcp", "tcp6"):
    try:
        lines = open("/proc/net/" + name).read().splitlines()[1:]
    except OSError:
        continue
    for line in lines:
        f = line.split()
        port = int(f[1].rsplit(":", 1)[1], 16)
        if f[3] == "0A" and port in ports:
            inodes[f[9]] = port
found = {}
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        continue
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        if inode in inodes:
            try:
                cgroup = open(f"/proc/{pid}/cgroup").read().strip().rsplit("/", 1)[-1]
            except OSError:
                cgroup = ""
            found.setdefault(str(inodes[inode]), set()).add(cgroup or f"pid {pid}")
print(json.dumps({p: sorted(u) for p, u in found.items()}))
"""


class PortListeners(FactBase[dict]):
    """Who listens on TCP ports, by systemd unit (the cgroup of the listening process, from
    /proc/net/tcp{,6} and /proc/<pid>/fd):

    .. code:: python

        {"8000": ["sglang-gate.service"], "30000": ["sglang.service"]}
    """

    @override
    def requires_command(self, ports: tuple[int, ...]) -> str:
        return "python3"

    @override
    def command(self, ports: tuple[int, ...]) -> str:
        return f"python3 -c {shlex.quote(_LISTENERS_SCRIPT)} " + " ".join(str(p) for p in ports)

    @override
    def default(self) -> dict:
        return {}

    @override
    def process(self, output) -> dict:
        try:
            return json.loads("\n".join(output))
        except ValueError:
            return {}


class DropIns(FactBase[list[str]]):
    """The file names of the drop-ins in a unit's drop-in folder (``*.conf``, the only ones
    systemd reads, systemd.unit(5)), sorted; empty when the folder does not exist.

    .. code:: python

        ["10-gpuhost-driver-gate.conf", "50-local.conf"]
    """

    default = list

    @override
    def command(self, path: str) -> str:
        return (f"for f in {shlex.quote(path)}/*.conf; do "
                'if [ -e "$f" ] || [ -L "$f" ]; then echo "${f##*/}"; fi; done')

    @override
    def process(self, output) -> list[str]:
        return sorted(line.strip() for line in output if line.strip())


def foreign_dropins(present: Iterable[str], allowed: Iterable[str]) -> tuple[list[str], list[str]]:
    """The drop-ins gpuhost does not own, split into (to remove, allowed by host data)."""
    allowed = set(allowed)
    theirs = [name for name in present if name not in OWN_DROPINS]
    return ([n for n in theirs if n not in allowed], [n for n in theirs if n in allowed])


@dataclass(frozen=True)
class UnitState:
    """A server unit as the deploy reads it before changing anything: ``active`` systemd's
    ActiveState ("active", "activating", "inactive", "failed", ...), ``invocation`` its
    InvocationID (new at every start, systemd's own restarts included), ``need_reload``
    systemd's NeedDaemonReload (the unit file changed since systemd read it),
    ``started_with`` the digest its ExecStartPre wrote for the running process ("" when none)
    and ``now`` the same digest of the files as they are (operations/files/unit_inputs.py;
    "" when that script is not on the host yet), ``changed`` which of those inputs differ from
    what the running process read (unit_inputs.py --changed; empty when that was not recorded),
    ``result`` systemd's Result ("success", "exit-code", "start-limit-hit", ...), ``stopped_at``
    when it last stopped or failed (systemd's InactiveEnterTimestamp, in UTC: seconds since the
    epoch; None when it never did)."""

    active: str = "inactive"
    invocation: str = ""
    need_reload: bool = False
    started_with: str = ""
    now: str = ""
    changed: tuple[str, ...] = ()
    result: str = ""
    stopped_at: float | None = None

    @property
    def running(self) -> bool:
        return self.active in ("active", "activating", "reloading")

    @property
    def stale(self) -> bool:
        """Running with other inputs than the files now: an earlier run changed them and
        stopped (killed, disconnected) before restarting the unit."""
        return self.running and bool(self.now) and self.started_with != self.now


class ServiceState(FactBase[UnitState]):
    """:class:`UnitState` of ``unit`` (``systemctl show``, the digest under /run/``runtime_dir``
    and ``unit_inputs.py`` run on ``inputs``: unit_inputs.py's arguments). Which inputs changed
    is asked only where the digests differ (where they are equal, so are the inputs' parts:
    each python3 start took 0.08 s of a sandbox host's CPU at each no-op run)."""

    @override
    def command(self, unit: str, runtime_dir: str, inputs: list[str]) -> str:
        script = f"{LIB_DIR}/unit_inputs.py"
        argv = " ".join(shlex.quote(a) for a in inputs)
        return (f"TZ=UTC systemctl show -p ActiveState -p InvocationID -p NeedDaemonReload "
                f"-p Result -p InactiveEnterTimestamp {shlex.quote(unit)} 2>/dev/null; "
                f"w=$(cat /run/{runtime_dir}/inputs 2>/dev/null); echo \"started_with=$w\"; "
                f"if [ -f {script} ]; then n=$(python3 {script} {argv} 2>/dev/null); "
                "echo \"now=$n\"; if [ \"$n\" != \"$w\" ]; then "
                f"echo \"changed=$(python3 {script} --changed /run/{runtime_dir}/inputs {argv} "
                "2>/dev/null)\"; fi; else echo now=; fi")

    @override
    def default(self) -> UnitState:
        return UnitState()

    @override
    def process(self, output) -> UnitState:
        values = dict(line.split("=", 1) for line in output if "=" in line)
        return UnitState(
            active=values.get("ActiveState") or "inactive",
            invocation=values.get("InvocationID", ""),
            need_reload=values.get("NeedDaemonReload") == "yes",
            started_with=values.get("started_with", "").strip(),
            now=values.get("now", "").strip(),
            changed=tuple(c for c in values.get("changed", "").strip().split("|") if c),
            result=values.get("Result", ""),
            stopped_at=systemd_time(values.get("InactiveEnterTimestamp", "")),
        )


def systemd_time(text: str) -> float | None:
    """A timestamp as ``systemctl show`` writes it with TZ=UTC ("Thu 2026-12-03 09:48:01
    UTC"), as seconds since the epoch; None for an empty one (never happened) or another
    form."""
    try:
        when = datetime.strptime(text.strip(), "%a %Y-%m-%d %H:%M:%S UTC")
    except ValueError:
        return None
    return when.replace(tzinfo=timezone.utc).timestamp()


#: Lines of a failed unit's journal shown when the deploy starts it again.
JOURNAL_LINES: Final = 15


class UnitJournal(FactBase[list]):
    """The last ``lines`` lines of ``unit``'s journal (``journalctl -u UNIT -n LINES -o
    short-iso``, journalctl(1)), e.g. ``["2026-12-01T14:00:00+0000 gpu1 systemd[1]:
    sglang.service: Start request repeated too quickly."]``."""

    @override
    def command(self, unit: str, lines: int = JOURNAL_LINES) -> str:
        return (f"journalctl -u {shlex.quote(unit)} -n {int(lines)} --no-pager -o short-iso "
                "2>/dev/null || true")

    @override
    def default(self) -> list:
        return []

    @override
    def process(self, output) -> list:
        return [line for line in output if not line.startswith("-- ")]


def stale_message(unit: str, state: UnitState) -> str:
    """What the deploy says of a unit running with other inputs than the files now: which
    inputs differ, as the unit recorded them at its start, not a guess at why."""
    if state.changed:
        what = f"{', '.join(state.changed)} changed since it started"
    elif not state.started_with:
        what = "it recorded no inputs at its start (/run was emptied, or an older gpuhost " \
               "started it)"
    else:
        what = "which of them changed is not recorded (an older gpuhost started it)"
    return f"{unit} runs with other inputs than the files now: {what}: restarting it"


def unverified_message(units: tuple[str, ...], states: tuple[UnitState, ...],
                       recorded: list[str]) -> str:
    """Why the health gate runs for a server that runs and was not restarted: which unit's
    InvocationID differs from the ones VERIFIED_FILE recorded when the gate last passed, or
    that the units gated now are not the ones gated then (a bind switched to or from the
    loopback)."""
    if not recorded:
        why = f"no passed health gate is recorded ({VERIFIED_FILE})"
    elif len(recorded) != len(units):
        then = " and ".join((UNIT, GATE_UNIT)[: len(recorded)])
        why = (f"the health gate last passed for {then}; it is {' and '.join(units)} now "
               "(the bind address changed to or from the loopback)")
    else:
        since = [u for u, st, rec in zip(units, states, recorded) if st.invocation != rec]
        why = (f"{' and '.join(since)} started since the health gate last passed "
               "(its InvocationID differs from the one recorded then)")
    return f"not verified as it runs now: {why}: the health gate runs"


def failed_message(unit: str, state: UnitState, journal: list[str]) -> str:
    """What the deploy says of a unit systemd left failed, before it starts it again: that it
    failed, systemd's Result, and the journal's last lines."""
    lines = "".join(f"\n    {line}" for line in journal) or "\n    (the journal is empty)"
    return (f"{unit} had failed (systemd's Result: {state.result or 'unknown'}): starting it "
            f"again. The last lines of its journal:{lines}")


def _check_secret_file(key: str, path: str) -> bool:
    """Refuse (and return False) unless ``path`` on the host is a regular file owned by root
    that neither its group nor others can read or write, holding one line of header-safe text
    (operations/secret_files.py)."""
    what = "token file" if key == "hf_token_file" else "key file"
    return check_secret_file("SGLang server", key, path, what)


def _check_ports(settings: Settings) -> None:
    ports = {"server_port": settings.server_port}
    if settings.server_is_public:
        ports["server_backend_port"] = settings.server_backend_port
    listeners = fact(PortListeners, ports=tuple(sorted(ports.values())))
    for key, port in ports.items():
        others = [u for u in listeners.get(str(port), []) if u not in (UNIT, GATE_UNIT)]
        if others:
            refuse("SGLang server", f"{PREFIX}{key} = {port} is not allowed: a port no other "
                                    f"unit listens on ({', '.join(others)} listens on it)")
    if settings.fleet_address is not None:
        problem = address_problem(f"{PREFIX}fleet_address", settings.fleet_address,
                                  fact(HostAddresses), "the router reaches the server there")
        if problem:
            refuse("SGLang server", problem)


@operation()
def unit_enabled(unit: str):
    """Enable ``unit`` (started at boot). Apart from :func:`unit_started`, so that a change of
    that one means the unit was started."""
    # of this unit alone: every unit's (``systemctl show '*'``) took 0.24 s of a sandbox host
    if host.get_fact(SystemdEnabled, services=unit).get(unit):
        host.noop(f"{unit} is enabled")
        return
    yield f"systemctl enable {unit}"


@operation()
def unit_started(unit: str):
    """Start ``unit`` without waiting for it (``systemctl start --no-block``: the unit's
    ExecStartPost holds it "activating" until the server answers, which may take the whole
    start timeout; the health gate shows the progress meanwhile). Read when it runs: a unit an
    earlier stage stopped (the P2P check, a driver change) is started here, with the files as
    they are now."""
    if host.get_fact(SystemdStatus, services=unit).get(unit):
        host.noop(f"{unit} is running")
        return
    yield f"systemctl reset-failed {unit} 2>/dev/null || true"
    yield f"systemctl start --no-block {unit}"


@operation(is_idempotent=False)
def unit_reloaded(unit: str):
    """Reload ``unit`` (a gate's graceful reload: its ExecReload=)."""
    yield f"systemctl reload {unit}"


@operation()
def path_restarted(unit: str, changed: bool):
    """A path unit running, restarted where its file ``changed`` (to watch what it names now)."""
    if changed:
        yield f"systemctl restart {unit}"
        return
    if host.get_fact(SystemdStatus, services=unit).get(unit):
        host.noop(f"{unit} is running")
        return
    yield f"systemctl start {unit}"


def gate_files(g: gate.Gate) -> list[OperationMeta]:
    """A gate's nginx configuration, its key files' path unit and the oneshot that reloads
    it (templates/gate-nginx.conf.j2, gate-keys.path.j2, gate-keys.service.j2): the
    configuration first, then the units."""
    paths = gate.path_context(g, systemd_quote)
    return [
        files.template(name=f"nginx configuration of {g.unit}",
                       src=str(REPO_ROOT / "templates" / "gate-nginx.conf.j2"),
                       dest=g.conf_path, mode="644", create_remote_dir=True,
                       **gate.conf_context(g)),
        files.template(name=f"Unit {g.path_unit}",
                       src=str(REPO_ROOT / "templates" / "gate-keys.path.j2"),
                       dest=f"/etc/systemd/system/{g.path_unit}", mode="644", **paths),
        files.template(name=f"Unit {g.keys_unit}",
                       src=str(REPO_ROOT / "templates" / "gate-keys.service.j2"),
                       dest=f"/etc/systemd/system/{g.keys_unit}", mode="644", **paths),
    ]


@operation(is_idempotent=False)
def unit_restarted(unit: str):
    """Restart ``unit`` without waiting for it (see unit_started)."""
    yield f"systemctl reset-failed {unit} 2>/dev/null || true"
    yield f"systemctl restart --no-block {unit}"


def health_gate(host, argv: list[str]) -> bool:
    """Run the health gate in rounds of PROGRESS_EVERY seconds, printing its progress through
    pyinfra's logger (shown without -v); False when it failed, after showing why, the journal
    and that the unit was stopped."""
    waited, began = 0.0, time.monotonic()
    while True:
        command = StringCommand(*argv, "--poll-for", str(PROGRESS_EVERY),
                                "--elapsed-offset", f"{waited:.0f}")
        ok, output = remote.shell(host, command, _success_exit_codes=[0, 3],
                                  timeout=PROGRESS_EVERY + remote.POLL_TIMEOUT_S + 60)
        waited = time.monotonic() - began
        lines = output.stdout_lines + output.stderr_lines
        failed = not ok or any(line.startswith("server not ready") for line in lines)
        log = logger.error if failed else logger.info
        for line in lines:
            log(f"{host.print_prefix}{line}")
        if failed:
            return False
        if any(line.startswith("ready after") for line in lines):
            return True


def mark_verified(host, units: list[str]) -> bool:
    names = " ".join(shlex.quote(u) for u in units)
    return remote.shell(
        host, f"mkdir -p {shlex.quote(VERIFIED_FILE.rsplit('/', 1)[0])} && "
        f"systemctl show -p InvocationID --value {names} > {VERIFIED_FILE}.tmp && "
        f"chmod 644 {VERIFIED_FILE}.tmp && sync {VERIFIED_FILE}.tmp && "
        f"mv {VERIFIED_FILE}.tmp {VERIFIED_FILE}")[0]


@remote.callback("the health gate", "the server goes on starting on the host")
def _wait_serving(state, host, argv: list[str], timeout: int, units: list[str],
                  record: str | None = None,
                  change: str | Callable[[], str] = "") -> bool:
    """Run the health gate (:func:`health_gate`). When it passed, VERIFIED_FILE gets the
    InvocationIDs of ``units`` (the next deploy gates again only a unit started since) and
    ``record`` runs: the last known good (operations/last_known_good.py). When it failed and
    ``record`` is given, the server is rolled back to the last known good, restarted and
    gated again (:func:`operations.last_known_good.roll_back`); False either way, saying
    ``change``, what this run changed."""
    if health_gate(host, argv):
        if not mark_verified(host, units):
            return False
        if record is None:
            return True
        ok, out = remote.shell(host, record,
                               _success_exit_codes=[0, last_known_good.WRITE_FAILED])
        lines = out.stdout_lines + out.stderr_lines
        if any(line.startswith("could not write") for line in lines):
            # the host passed its gate and serves: it goes back in the router; the record is
            # written again at the end of the stage (last_good_recorded), which says why not
            return True
        for line in lines:
            (logger.info if ok else logger.error)(f"{host.print_prefix}last known good: {line}")
        return ok
    if record is None:
        return False
    what = change() if callable(change) else change
    why = (f"the server with {what} as this run changed it" if what else "the server") + \
        " failed the health gate (its journal above)"

    def again() -> bool:
        return health_gate(host, argv) and mark_verified(host, units)

    return last_known_good.roll_back(
        host, why, again, f"systemctl reset-failed {UNIT} 2>/dev/null; "
        f"systemctl restart --no-block {UNIT}")


def gate_argv(url: str, model: str, timeout: int, public_url: str | None = None,
              api_key_file: str | None = None) -> list[str]:
    """health_check.py's command line for :func:`serving` (its arguments, the same)."""
    argv = ["python3", f"{LIB_DIR}/health_check.py", "--url", shlex.quote(url),
            "--model", shlex.quote(model), "--unit", UNIT, "--timeout", str(timeout)]
    if public_url and api_key_file:
        argv += ["--public-url", shlex.quote(public_url),
                 "--api-key-file", shlex.quote(api_key_file), "--gate-unit", GATE_UNIT]
        if public_url.startswith("https://"):
            argv += ["--ca-file", tls.CA_PATH]
    return argv


def settings_gate_argv(settings: Settings) -> list[str]:
    """The health gate's command line for the server host data configures."""
    return gate_argv(backend_url(settings), settings.served_model_name, settings.health_timeout,
                     public_url(settings), settings.api_key_file)


@operation(is_idempotent=False)
def serving(url: str, model: str, timeout: int, public_url: str | None = None,
            api_key_file: str | None = None, units: tuple[str, ...] = (UNIT,),
            record: str | None = None, change: str | Callable[[], str] = ""):
    """Wait until the server serves ``model`` and answers a fixed greedy chat completion with
    text that is neither empty nor degenerate (operations/files/health_check.py), printing
    progress every 10 s; with a public URL, also that the API key gate refuses a request
    without the key and that /get_server_info does not contain it.

    + url: the server's own base URL as seen from the host, e.g. http://127.0.0.1:8000
    + model: the served model name
    + timeout: seconds before giving up; the unit is then stopped and its journal shown
    + public_url: the API key gate's base URL, when the server is public
    + api_key_file: root-only file holding the key (read on the host, never shown)
    + units: the units whose InvocationIDs VERIFIED_FILE records once the gate passed
    + record: the command recording the last known good once the gate passed; with it, a
      failed gate rolls the server back to the recorded one (operations/last_known_good.py)
    + change: what this run changed, for the failure's message
    """
    argv = gate_argv(url, model, timeout, public_url, api_key_file)
    yield FunctionCommand(_wait_serving, (argv, timeout, list(units), record, change), {})


@deploy("SGLang server")
def sglang_server(settings: Settings, inputs: Iterable[OperationMeta] = (),
                  role: NodeRole | None = None, peers: Mapping[str, Settings] | None = None):
    """Download the model, template the unit and its environment (and the API key gate's unit
    when the server binds more than the loopback), start the server, restart it only when
    something it reads changed, and wait until it serves good answers. The unit places the
    kernel caches in a folder keyed by flashinfer, torch, CUDA and the compute capability
    (operations/kernel_cache.py); the folders of other keys are removed once it serves.

    What it reads may have changed in this run, or in an earlier one that stopped before the
    restart: the digest the running server recorded at its start (:class:`ServiceState`) tells.
    A server started but never verified (a run stopped during the health gate, or systemd
    restarted it since) is verified again, without a restart.

    + settings: the host's validated settings
    + inputs: operations of earlier stages whose change means a restart (the venv, the P2P
      decision)
    + role: the host's place in a server across nodes (operations/nodes.py), else None
    + peers: every inventory host's settings: a peer serving the same model may hold a copy
      of the weights (operations/model_copy.py; ``gpuhost_model_copy_from_peers``)

    Refused while planning: PID 1 not systemd; a token or key file that is not a secret file
    (operations/secret_files.py: missing, a symlink, readable by others, not one line of
    header-safe text); a port another unit listens on; failed GPUs (operations/gpu_verdict.py).
    A start or restart of the API key gate alone is verified by the health gate in the same run.
    """
    init = fact(InitSystem)
    if init != "systemd":
        refuse("SGLang server", f"PID 1 is {init!r}, not systemd: the server runs as a systemd "
                                "unit")
        return
    secrets_ok = all([
        _check_secret_file("hf_token_file", settings.hf_token_file)
        if settings.hf_token_file else True,
        _check_secret_file("api_key_file", settings.api_key_file)
        if settings.api_key_file else True,
        _check_secret_file("fleet_key_file", settings.fleet_key_file)
        if settings.fleet_key_file and settings.server_is_public else True,
    ])
    _check_ports(settings)
    if not secrets_ok:
        return
    server_state = fact(ServiceState, unit=UNIT, runtime_dir=RUNTIME_DIRS[UNIT],
                        inputs=server_inputs(settings))
    gate_state = fact(ServiceState, unit=GATE_UNIT, runtime_dir=RUNTIME_DIRS[GATE_UNIT],
                      inputs=gate_inputs(settings))
    was_running, gate_was_running = server_state.running, gate_state.running
    gated = (UNIT, GATE_UNIT) if settings.server_is_public else (UNIT,)
    verified = (fact(FileText, path=VERIFIED_FILE) or "").split()
    # A rank >= 1 of a server across nodes serves no model: rank 0's gate covers the group.
    unverified = was_running and verified != [
        s.invocation for s in (server_state, gate_state)[: len(gated)]] and not (
        role is not None and role.node_rank > 0)
    # the gate's nginx configuration alone changed since its start (by hand, or by a run that
    # stopped before reloading it): a graceful reload, not a restart
    gate_conf_stale = gate_state.stale and bool(gate_state.changed) and set(
        gate_state.changed) <= {worker_gate(settings).conf_path}
    for name, unit_state in ((UNIT, server_state), (GATE_UNIT, gate_state)):
        if unit_state.stale:
            said = stale_message(name, unit_state)
            if name == GATE_UNIT and gate_conf_stale:
                said = said.replace(": restarting it", ": reloading it")
            logger.warning(f"{host.print_prefix}SGLang server: {said}")
        if unit_state.active == "failed" and (name == UNIT or settings.server_is_public):
            logger.warning(f"{host.print_prefix}SGLang server: " + failed_message(
                name, unit_state, fact(UnitJournal, unit=name)))
        if unit_state.need_reload:
            logger.warning(f"{host.print_prefix}SGLang server: systemd has not read {name}'s "
                           "unit file since it changed: reloading")
    if unverified and not server_state.stale:
        logger.warning(f"{host.print_prefix}SGLang server: " + unverified_message(
            gated, (server_state, gate_state)[: len(gated)], verified))
    files.directory(name="gpuhost config folder", path="/etc/gpuhost", mode="755")
    files.directory(name="gpuhost library folder", path=LIB_DIR, mode="755")
    shipped = {
        script: files.put(name=f"Ship {script}", src=str(REPO_ROOT / "operations/files" / script),
                          dest=f"{LIB_DIR}/{script}", mode="644", create_remote_dir=False)
        # model_fetch.py imports no_space.py too, which the ML venv stage ships
        for script in ("health_check.py", "model_fetch.py", "model_config.py", "gate_keys.py",
                       "unit_inputs.py", "secret_file.py", "last_known_good.py")
    }
    changed: list[OperationMeta] = []
    weights: list[OperationMeta] = []
    if not settings.model_is_local:
        top_folders()
        # mode only: gpuhost_model_dir may be a mount whose owner is not root's to set
        for folder in folders_down_to(settings.model_dir, settings.model_path):
            files.directory(name=f"Folder {folder}", path=folder, mode="755")
        files.directory(name="Model folder", path=settings.model_path, mode="755")
        model_copy.copy_access(settings)
        sources = (model_copy.peers(host.name, peers, {h.name: h.data.dict()
                                                       for h in host.inventory})
                   if peers and settings.model_copy_from_peers else [])
        weights.append(model_ops.weights(
            name=f"Model {settings.model}@{settings.model_revision}",
            repo=settings.model, revision=settings.model_revision, dest=settings.model_path,
            endpoint=settings.hf_endpoint, python=f"{host_venv(settings.lock_path)}/bin/python",
            token_file=settings.hf_token_file, headroom_gib=DISK_HEADROOM_GIB,
            architecture=settings.model_architecture, peers=sources,
            bwlimit_kib=settings.model_copy_bwlimit, mirror=settings.model_mirror,
            mtp=settings.speculative_algorithm is not None,
            commit=model_revision.fleet_commit(settings)))
        changed += weights
        model_copy.copy_key(settings)
    kernels, kernel_folders = cache_key(settings), fact(KernelCacheFolders)
    service_user(name=f"User {SERVER_USER}", user=SERVER_USER)  # its kernel caches' owner
    kernel_cache(kernels, SERVER_USER)
    env = secret_template(
        name="Server environment",
        src=str(REPO_ROOT / "templates" / "server.env.j2"),
        dest=SERVER_ENV_FILE,
        mode="600",
        **env_context(settings),
    )
    record = fact(File, path=last_known_good.RECORD)
    if record and record.get("mode") != 600:
        # left 0644 by an earlier gpuhost: it holds server.env's sha256, against which a guess
        # at a secret there could be checked offline (last_known_good.py writes it 0600)
        files.file(name="Last known good record: root's alone", path=last_known_good.RECORD,
                   mode="600")
    unit = files.template(
        name=f"Unit {UNIT}",
        src=str(REPO_ROOT / "templates" / "sglang.service.j2"),
        dest=UNIT_PATH,
        mode="644",
        **unit_context(settings, role),
    )
    units = [unit]
    removed: list[OperationMeta] = []
    remove, kept = foreign_dropins(fact(DropIns, path=DROPIN_DIR), settings.allowed_dropins)
    for name in kept:
        logger.info(f"{host.print_prefix}SGLang server: drop-in {DROPIN_DIR}/{name} is not "
                    f"gpuhost's: kept ({PREFIX}allowed_dropins)")
    for name in remove:
        logger.warning(f"{host.print_prefix}SGLang server: drop-in {DROPIN_DIR}/{name} is not "
                       f"gpuhost's and host data does not allow it: removing it (allow it "
                       f"with {PREFIX}allowed_dropins)")
        removed.append(files.file(name=f"Remove the foreign drop-in {name}",
                                  path=f"{DROPIN_DIR}/{name}", present=False))
    if fact(File, path=SWEEP_DROPIN):
        logger.warning(f"{host.print_prefix}SGLang server: {SWEEP_DROPIN} is left from an "
                       "interrupted bench.py sweep: removing it and restarting the server with "
                       "what host data configures")
        removed.append(files.file(name="Remove the interrupted sweep's drop-in",
                                  path=SWEEP_DROPIN, present=False))
    worker = worker_gate(settings)
    gate_conf: list[OperationMeta] = []
    if settings.server_is_public:
        gate.nginx_installed(name="nginx (the API key gate)")
        units.append(files.template(
            name=f"Unit {GATE_UNIT}",
            src=str(REPO_ROOT / "templates" / "gate.service.j2"),
            dest=GATE_UNIT_PATH,
            mode="644",
            **gate_context(settings),
        ))
        gate_conf = gate_files(worker)
        units += gate_conf[1:]
    elif fact(File, path=GATE_UNIT_PATH):
        for unit_name in (worker.path_unit, GATE_UNIT):
            systemd.service(name=f"Stop {unit_name} (the server binds the loopback only)",
                            service=unit_name, running=False, enabled=False)
        units.append(files.file(name=f"Remove {GATE_UNIT}", path=GATE_UNIT_PATH, present=False))
        for unit_name in (worker.path_unit, worker.keys_unit):
            files.file(name=f"Remove {unit_name}", path=f"/etc/systemd/system/{unit_name}",
                       present=False)
    units += removed  # after the gate's, which gate_ops below finds at units[1]
    need_reload = server_state.need_reload or gate_state.need_reload
    systemd.daemon_reload(name="Reload systemd units",
                          _if=lambda: need_reload or any(u.did_change() for u in units))
    unit_enabled(name=f"Enable {UNIT}", unit=UNIT)
    changed += [*removed, env, unit, *inputs]
    gpu_verdict.refusal(was_running, server_state.stale or any(o.will_change for o in changed))
    if role is None:
        started = unit_started(name=f"Start {UNIT}", unit=UNIT)
        # A unit started just now (an earlier stage stopped it) read the files as they are: a
        # restart would only kill that start.
        def must_restart() -> bool:
            return was_running and not started.did_change() and (
                server_state.stale or any(op.did_change() for op in changed))

        if roll.rolls(host.name):
            # out of the router, restarted, gated and back in, one position at a time
            rolled = roll.rolled_restart(UNIT, must_restart, was_running and not (
                started.will_change) and (server_state.stale or any(
                    op.will_change for op in changed)), gate=lambda **kw: serving(
                name=f"Wait until {settings.served_model_name} answers", url=backend_url(
                    settings), model=settings.served_model_name, timeout=settings.health_timeout,
                public_url=public_url(settings), api_key_file=settings.api_key_file,
                units=gated, record=record_command(settings), change=lambda: " and ".join(
                    label for label, ops in what if any(op.did_change() for op in ops)),
                **kw), restart=unit_restarted)
            restarts, ungated = rolled, []
        else:
            restarted = unit_restarted(
                name=f"Restart {UNIT} (what it reads changed)",
                unit=UNIT,
                _if=must_restart,
            )
            restarts = ungated = [restarted]
    else:
        must_start = (f"{UNIT} is not running ({server_state.active})" if not was_running
                      else "it runs with other inputs than the files now"
                      if server_state.stale else None)
        group_restart.register(role, changed, must_start,
                               None if was_running else server_state.stopped_at)
        started, restarted = group_restart.converge(
            role, internode_argv(settings, role, (P2P_ENV_FILE, NODES_ENV_FILE)))
        restarts = ungated = [restarted]
    what = [("the ML venv or the P2P decision", list(inputs)), ("the unit", units),
            ("the server environment", [env]), ("the model", weights)]
    gate_url = None
    # A start or restart of the gate alone is verified in this run too (its key, its answers).
    gate_changes: list[OperationMeta] = []
    if settings.server_is_public:
        unit_enabled(name=f"Enable {GATE_UNIT}", unit=GATE_UNIT)
        gate_changes.append(unit_started(name=f"Start {GATE_UNIT}", unit=GATE_UNIT))
        gate_ops = [units[1], shipped["gate_keys.py"], shipped["secret_file.py"]]
        # A restart of the server restarts the gate too (PartOf=).
        gate_changes.append(unit_restarted(
            name=f"Restart {GATE_UNIT} (its unit or program changed)",
            unit=GATE_UNIT,
            _if=lambda: gate_was_running and not any(r.did_change() for r in restarts)
            and ((gate_state.stale and not gate_conf_stale)
                 or any(op.did_change() for op in gate_ops)),
        ))
        # its configuration alone: a graceful reload (the clients' connections stay)
        gate_changes.append(unit_reloaded(
            name=f"Reload {GATE_UNIT} (its configuration changed)",
            unit=GATE_UNIT,
            _if=lambda: gate_was_running and not any(
                r.did_change() for r in (*restarts, *gate_changes[:2]))
            and (gate_conf_stale or gate_conf[0].did_change()),
        ))
        unit_enabled(name=f"Enable {worker.path_unit}", unit=worker.path_unit)
        path_restarted(name=f"Watch the key files ({worker.path_unit})", unit=worker.path_unit,
                       changed=gate_conf[1].will_change)
        gate_url = public_url(settings)
    gated_op: OperationMeta | None = None
    if role is None or role.node_rank == 0:
        gated_op = serving(
            name=f"Wait until {settings.served_model_name} answers",
            url=backend_url(settings),
            model=settings.served_model_name,
            timeout=settings.health_timeout,
            public_url=gate_url,
            api_key_file=settings.api_key_file,
            units=gated,
            # a node group is not rolled back by one node: its ranks restart together
            # (group_restart.py), so rank 0 alone must not go back to another venv
            record=record_command(settings) if role is None else None,
            change=lambda: " and ".join(label for label, ops in what
                                        if any(op.did_change() for op in ops)),
            _if=lambda: unverified or any(op.did_change()
                                          for op in (started, *ungated, *gate_changes)),
        )
    else:
        # at a later line than the gate: pyinfra runs it after rank 0's gate (group_restart.py)
        group_restart.follow(role, (started, restarted))

    # after the restart: the server that read them is gone
    remove_superseded(kernels, kernel_folders)
    # past the health gate (a failed one ends the host's run before this)
    venv = host_venv(settings.lock_path)
    venv_link(name=f"{settings.venv_path}: the venv that serves", path=settings.venv_path,
              target=venv, health=fact(VenvAt, venv=settings.venv_path))
    if role is None:
        check = record_command(settings, action="check")
        last_good_recorded(name="Last known good: as what serves",
                           check=check, record=record_command(settings),
                           state_now=(now := fact(LastGoodState, check=check)),
                           _if=lambda: not now.startswith(("fresh", "unverified")) or any(
                               op.did_change() for op in (started, *restarts, *gate_changes,
                                                          *filter(None, [gated_op]))))
    record_text = fact(FileText, path=last_known_good.RECORD)
    recorded = recorded_venvs(record_text)
    if recorded:
        kept = sorted({venv, *recorded, *filter(None, [unit_venv(fact(FileText,
                                                                      path=UNIT_PATH))])})
        found = fact(VenvFolders, path=VENVS_DIR)
        venvs_pruned(name="Prune the venvs no longer kept", venvs_dir=VENVS_DIR,
                     keep=settings.venvs_kept, kept=kept,
                     remove=[v for v in found if v not in kept])
