"""Manage the SGLang server: its systemd unit, its environment, restarts only on change, and a
health gate."""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable
from typing import Final

from pyinfra import host
from pyinfra.api import StringCommand, deploy, operation
from pyinfra.api.operation import OperationMeta
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import files, systemd

from operations.p2p import ENV_FILE as P2P_ENV_FILE
from operations.p2p import LIB_DIR
from operations.plan import refuse
from operations.preflight import InitSystem
from operations import REPO_ROOT
from operations.settings import Settings
from operations.sglang import server_args

UNIT: Final = "sglang.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT}"
SERVER_ENV_FILE: Final = "/etc/gpuhost/server.env"


def systemd_quote(arg: str) -> str:
    """Quote one argument for an ExecStart line (systemd.service(5), "Command lines"):
    specifiers ``%`` and variables ``$`` are doubled, and words with spaces, quotes or
    backslashes are double-quoted with C-style escapes."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and re.fullmatch(r"[A-Za-z0-9_./:=+,@-]+", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def env_context(settings: Settings) -> dict:
    """What templates/server.env.j2 is rendered with."""
    return {"cuda_home": settings.cuda_home, "venv": settings.venv_path,
            "env": dict(settings.server_env)}


def unit_context(settings: Settings) -> dict:
    """What templates/sglang.service.j2 is rendered with."""
    return {
        "model": settings.model,
        "served_model_name": settings.served_model_name,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "server_env_file": SERVER_ENV_FILE,
        "p2p_env_file": P2P_ENV_FILE,
        "venv": settings.venv_path,
        "exec_args": " ".join(systemd_quote(a) for a in server_args(settings)),
    }


@operation(is_idempotent=False)
def ready(url: str, model: str, timeout: int):
    """Wait until the server answers /health and /v1/models lists ``model``.

    + url: the server's base URL as seen from the host, e.g. http://127.0.0.1:8000
    + model: the served model name
    + timeout: seconds before giving up; the unit is then stopped and its journal shown
    """
    yield StringCommand(
        "python3", f"{LIB_DIR}/health_check.py", "--url", shlex.quote(url),
        "--model", shlex.quote(model), "--unit", UNIT, "--timeout", str(timeout),
    )


@deploy("SGLang server")
def sglang_server(settings: Settings, inputs: Iterable[OperationMeta] = ()):
    """Template the unit and its environment, start the server, restart it only when something
    it reads changed, and wait until it serves the model.

    + settings: the host's validated settings
    + inputs: operations of earlier stages whose change means a restart (the venv, the P2P
      decision)
    """
    init = host.get_fact(InitSystem)
    if init != "systemd":
        refuse("SGLang server", f"PID 1 is {init!r}, not systemd: the server runs as a systemd "
                                "unit")
        return
    was_running = bool(host.get_fact(SystemdStatus).get(UNIT))
    files.directory(name="gpuhost config folder", path="/etc/gpuhost", mode="755")
    env = files.template(
        name="Server environment",
        src=str(REPO_ROOT / "templates" / "server.env.j2"),
        dest=SERVER_ENV_FILE,
        mode="600",
        **env_context(settings),
    )
    unit = files.template(
        name=f"Unit {UNIT}",
        src=str(REPO_ROOT / "templates" / "sglang.service.j2"),
        dest=UNIT_PATH,
        mode="644",
        **unit_context(settings),
    )
    files.put(name="Ship health_check.py", src=str(REPO_ROOT / "operations/files/health_check.py"),
              dest=f"{LIB_DIR}/health_check.py", mode="644")
    systemd.daemon_reload(name="Reload systemd units", _if=unit.did_change)
    started = systemd.service(name=f"Start {UNIT}", service=UNIT, running=True, enabled=True)
    changed = [env, unit, *inputs]
    restarted = systemd.service(
        name=f"Restart {UNIT} (what it reads changed)",
        service=UNIT,
        restarted=True,
        _if=lambda: was_running and any(op.did_change() for op in changed),
    )
    address = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(settings.server_host, settings.server_host)
    host_addr = f"[{address}]" if ":" in address else address
    ready(
        name=f"Wait until {settings.served_model_name} is served",
        url=f"http://{host_addr}:{settings.server_port}",
        model=settings.served_model_name,
        timeout=settings.health_timeout,
        _if=lambda: started.did_change() or restarted.did_change(),
    )
