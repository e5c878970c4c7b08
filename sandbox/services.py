"""What this machine serves on the hosts' links: the HTTP server and one tinyproxy per host."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

from sandbox import procs
from sandbox.layout import HTTP_PORT, PROXY_PORT, SERVICES_DIR, WWW, HostSpec

# Only Debian's mirror is reachable from here; anything else through the proxy would hang.
PROXY_FILTER = "^deb\\.debian\\.org$\n"

PROXY_CONF_TEMPLATE = """User nobody
Group nogroup
Listen {gateway}
Port {port}
Timeout 600
MaxClients 100
Allow {subnet}
DisableViaHeader Yes
FilterType ere
FilterDefaultDeny Yes
Filter "{filter}"
ConnectPort 443
PidFile "{pidfile}"
LogLevel Connect
"""


class ServiceError(RuntimeError):
    """A service did not come up."""


def python_env() -> dict[str, str]:
    """Environment for detached `python -m sandbox.*` children: they find this very package
    whatever the caller's working directory."""
    parent = str(Path(__file__).resolve().parent.parent)
    path = os.environ.get("PYTHONPATH")
    return dict(os.environ, PYTHONPATH=f"{parent}:{path}" if path else parent)


def proxy_conf(spec: HostSpec, directory: Path = SERVICES_DIR) -> str:
    """tinyproxy's configuration for host `spec`: its link's gateway, its subnet only."""
    return PROXY_CONF_TEMPLATE.format(
        gateway=spec.gateway,
        port=PROXY_PORT,
        subnet=spec.subnet,
        filter=directory / "proxy-filter",
        pidfile=directory / f"proxy-{spec.name}.pid",
    )


def wait_listening(
    address: str, port: int, proc: procs.Proc, log: Path, timeout: float = 10
) -> None:
    """Return once `address:port` accepts; raises ServiceError with the log's tail otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            if not procs.alive(proc):
                break
            time.sleep(0.05)
    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
    raise ServiceError(f"nothing answers on {address}:{port}; {log}:\n{tail}")


def start_proxy(spec: HostSpec) -> procs.Proc:
    """tinyproxy in the foreground (its PID is ours to record; it logs to our log file, one line
    per request) on `spec`'s gateway:8888."""
    SERVICES_DIR.mkdir(parents=True, exist_ok=True)
    (SERVICES_DIR / "proxy-filter").write_text(PROXY_FILTER)
    conf = SERVICES_DIR / f"proxy-{spec.name}.conf"
    conf.write_text(proxy_conf(spec))
    log = SERVICES_DIR / f"proxy-{spec.name}.log"
    proc = procs.spawn_detached(["tinyproxy", "-d", "-c", str(conf)], log, f"proxy-{spec.name}")
    wait_listening(spec.gateway, PROXY_PORT, proc, log)
    return proc


def start_httpd(specs: list[HostSpec], www: Path = WWW) -> procs.Proc:
    """One `sandbox.httpd` process serving `www` on every host's gateway:8080."""
    www.mkdir(parents=True, exist_ok=True)
    log = SERVICES_DIR / "httpd.log"
    argv = [sys.executable, "-m", "sandbox.httpd", "--root", str(www), "--port", str(HTTP_PORT)]
    argv += [spec.gateway for spec in specs]
    proc = procs.spawn_detached(argv, log, "httpd", env=python_env())
    for spec in specs:
        wait_listening(spec.gateway, HTTP_PORT, proc, log)
    return proc


def start_supervisor(spec: HostSpec) -> procs.Proc:
    """The detached `sandbox.supervisor` of `spec`, its console and messages in console.log."""
    argv = [sys.executable, "-m", "sandbox.supervisor", spec.name]
    return procs.spawn_detached(argv, spec.console_log, spec.name, env=python_env())
