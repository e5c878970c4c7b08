"""Record every command an SSH client sends to a sandbox host, through a forced command in
root's and the operator's authorized_keys (sshd(8), AUTHORIZED_KEYS FILE FORMAT, "command="), so a test can prove
that a run sent nothing. The test's own probes start with ": probe;" and are not recorded."""

from __future__ import annotations

import base64
import json
from pathlib import Path

from tests.e2e import lab

LOG = "/var/log/gpuhost-test-ssh-commands.log"
PROBE = ": probe; "

_WRAPPER = f"""#!/bin/sh
case "$SSH_ORIGINAL_COMMAND" in
  ": probe; "*) ;;
  "") echo "sftp" >> {LOG} ;;
  *) printf '%s\\n' "$SSH_ORIGINAL_COMMAND" >> {LOG} ;;
esac
if [ -z "$SSH_ORIGINAL_COMMAND" ]; then exec /usr/lib/openssh/sftp-server; fi
exec /bin/sh -c "$SSH_ORIGINAL_COMMAND"
"""


def install(host: lab.Host) -> None:
    """Put the recording wrapper in front of every command sent with the lab key."""
    encoded = base64.b64encode(_WRAPPER.encode()).decode()
    host.ssh(
        f"echo {encoded} | base64 -d > /usr/local/sbin/gpuhost-test-audit && "
        "chmod 755 /usr/local/sbin/gpuhost-test-audit && "
        "sed -i 's|^ssh-|command=\"/usr/local/sbin/gpuhost-test-audit\" ssh-|' "
        "/root/.ssh/authorized_keys /home/*/.ssh/authorized_keys && "
        f": > {LOG} && chmod 666 {LOG}"
    )
    host.ssh("echo audit-self-test")
    if commands(host) != ["echo audit-self-test"]:
        raise AssertionError(f"the command recording does not work: {commands(host)!r}")
    clear(host)


def commands(host: lab.Host) -> list[str]:
    """Commands recorded since install() or the last clear()."""
    return host.ssh(f"{PROBE}cat {LOG}").splitlines()


def clear(host: lab.Host) -> None:
    host.ssh(f"{PROBE}: > {LOG}")


def write_inventory(path: Path, overrides: dict, hosts: list[dict] | None = None,
                    extra_hosts: list[tuple[str, dict]] = ()) -> Path:
    """An inventory of the sandbox's hosts (as inventory/sandbox.py makes it) with
    ``overrides`` merged into every host's data, plus ``extra_hosts`` as given."""
    listed = hosts if hosts is not None else json.loads(lab.sandbox("status", "--json").stdout)
    entries = []
    for h in listed:
        entries.append((h["name"], {**lab.inventory_data(h), **overrides}))
    entries += list(extra_hosts)
    path.write_text(f"sandbox = {entries!r}\n")
    return path
