"""What refuses the SGLang server while planning: PID 1 that is not systemd, a token or key
file that is not a secret file, a port another unit listens on, a fleet address not the host's."""

from __future__ import annotations

from operations.facts.host import HostAddresses, address_problem
from operations.plans.plan import fact, refuse
from operations.plans.settings import PREFIX, Settings
from operations.stages.preflight import InitSystem
from operations.stages.secret_files import check_secret_file
from operations.stages.server_state import PortListeners
from operations.stages.server_unit import GATE_UNIT, UNIT


def _check_secret_file(key: str, path: str) -> bool:
    """Refuse (and return False) unless ``path`` on the host is a regular file owned by root
    that neither its group nor others can read or write, holding one line of header-safe text
    (operations/stages/secret_files.py)."""
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


def refuses(settings: Settings) -> bool:
    """Whether the stage stops here: PID 1 is not systemd, or a token or key file is not a
    secret file (each refused while planning, as is a port another unit listens on)."""
    init = fact(InitSystem)
    if init != "systemd":
        refuse("SGLang server", f"PID 1 is {init!r}, not systemd: the server runs as a systemd "
                                "unit")
        return True
    secrets_ok = all([
        _check_secret_file("hf_token_file", settings.hf_token_file)
        if settings.hf_token_file else True,
        _check_secret_file("api_key_file", settings.api_key_file)
        if settings.api_key_file else True,
        _check_secret_file("fleet_key_file", settings.fleet_key_file)
        if settings.fleet_key_file and settings.server_is_public else True,
    ])
    _check_ports(settings)
    return not secrets_ok
