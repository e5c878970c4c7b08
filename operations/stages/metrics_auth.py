"""The credentials of the fleet's metrics: made on each host from its own root-only key file by
operations/files/metrics_credentials.py, so that no key passes through the controller, a
command line, a diff or a log."""

from __future__ import annotations

import json
import shlex
from typing import Final, TypedDict

from pyinfra import host
from pyinfra.api import FactBase, StringCommand, operation
from typing_extensions import override

from operations import REPO_ROOT

#: The script, sent as ``python3 -c`` for the check and the write alike.
_SCRIPT: Final = (REPO_ROOT / "operations" / "files" / "metrics_credentials.py").read_text()


class Current(TypedDict, total=False):
    current: bool
    why: str | None


def _command(check: bool, mode: str, key_file: str, dest: str, group: str, user: str) -> str:
    args = [key_file, dest, *([user] if mode == "web-config" else []), group]
    return " ".join(shlex.quote(a) for a in
                    ["python3", "-c", _SCRIPT, *(["--check"] if check else []), mode, *args])


class MetricsCredential(FactBase[Current]):
    """Whether a credentials file on the host is what metrics_credentials.py would write
    (``mode``: copy, password, web-config) from the key file; never its content:

    .. code:: python

        {"current": True, "why": None}
        {"current": False, "why": "it does not exist"}
    """

    @override
    def requires_command(self, **kwargs) -> str:
        return "python3"

    @override
    def command(self, mode: str, key_file: str, dest: str, group: str,  # type: ignore[override]
                user: str = "") -> str:
        return _command(True, mode, key_file, dest, group, user)

    @override
    def default(self) -> Current:
        return {"current": False, "why": "python3 does not answer"}

    @override
    def process(self, output) -> Current:
        try:
            data = json.loads("\n".join(output))
        except ValueError:
            return self.default()
        return data if isinstance(data, dict) else self.default()


@operation()
def credential(mode: str, key_file: str, dest: str, group: str, user: str = ""):
    """A root:``group`` 0640 file at ``dest`` made from the root-only ``key_file`` on the host:
    its copy (``mode="copy"``), the metrics password (``"password"``), or a web configuration
    for ``user`` (``"web-config"``: the node exporter's, Prometheus'); written only where it is
    not already that (operations/files/metrics_credentials.py).

    + mode: copy, password or web-config
    + key_file: the root-only key file on the host
    + dest: the file written
    + group: the group that may read it (the service's user's group)
    + user: web-config's user name

    **Example:**

    .. code:: python

        credential(name="Prometheus' copy of the fleet key", mode="copy",
                   key_file="/root/fleet.key", dest="/etc/prometheus/gpuhost-fleet.key",
                   group="prometheus")
    """
    seen = host.get_fact(MetricsCredential, mode=mode, key_file=key_file, dest=dest,
                         group=group, user=user)
    if seen.get("current"):
        host.noop(f"{dest} is current")
        return
    yield StringCommand(_command(False, mode, key_file, dest, group, user))
