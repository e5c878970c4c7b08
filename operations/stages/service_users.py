"""The system users gpuhost's daemons run as: made by the deploy, with fixed names.

| user | what runs as it |
|---|---|
| ``gpuhost-gate`` | the gates' nginx workers (sglang-gate, sglang-router-gate); their master stays root, reads the keys and the TLS key, and hands the workers the sockets |
| ``gpuhost-router`` | the router (smg, sglang-router.service); its keys reach it through systemd's credentials (LoadCredential=), never its own read of their files |
| ``gpuhost-server`` | the SGLang server (sglang.service); it reads the venv and the model (files 0644, folders 0755, as the deploy writes them) and writes only its kernel caches (owned by it) and its home (the unit's CacheDirectory=); it holds no key: the gate in front of it does |

Each is a system account (useradd(8) ``--system``: a uid below SYS_UID_MAX, no aging) with a
group of its own of the same name, no home (``/nonexistent``, as Debian's own daemons' users,
e.g. _apt and nobody) and no login shell. The loopback guard admits these users, by name, to
the ports behind the gates (operations/stages/loopback_guard.py, operations/stages/fleet.py
:func:`service_users`).
"""

from __future__ import annotations

from typing import Final

from pyinfra import host
from pyinfra.api import operation
from pyinfra.operations import server

from operations.facts.host import PasswdEntry

#: The gates' nginx workers (nginx's ``user`` directive).
GATE_USER: Final = "gpuhost-gate"
#: The router (smg).
ROUTER_USER: Final = "gpuhost-router"
#: The SGLang server.
SERVER_USER: Final = "gpuhost-server"
HOME: Final = "/nonexistent"
SHELL: Final = "/usr/sbin/nologin"


@operation()
def service_user(user: str):
    """``user`` as pyinfra's ``server.user`` makes it: a system user, home :data:`HOME` (not
    created), shell :data:`SHELL`, group ``user`` made first. Where ``getent`` shows the
    account with that home and shell, nothing runs, without reading pyinfra's ``Users`` of
    every account (as operations/stages/model_copy.py copy_user).

    + user: the account's name
    """
    entry = host.get_fact(PasswdEntry, user=user)
    if entry and (entry["home"], entry["shell"]) == (HOME, SHELL):
        host.noop(f"user {user} exists")
        return
    # its own group made first and named: useradd makes one of the user's name only where
    # login.defs says USERGROUPS_ENAB yes (a hardened host's is no: useradd(8), login.defs(5))
    yield from server.group._inner(group=user, system=True)
    yield from server.user._inner(user=user, group=user, home=HOME, shell=SHELL, system=True,
                                  ensure_home=False)
