"""Last known good: what a host served with when its health gate last passed, and the rollback
to it when a change fails the gate.

The record is /var/lib/gpuhost/last-known-good.json (beside p2p.json and sglang.verified; mode
0600: it holds server.env's SHA-256, against which a guessed secret could be checked), one
JSON object with a ``format`` number and one entry per concern; the shipped script
operations/files/last_known_good.py writes only the ``"server"`` entry and keeps the others as
they are, so another concern adds its own entry beside it (a ``"driver"`` entry: the driver
packages to reinstall)::

    {
      "format": 1,
      "server": {
        "recorded_at": "2026-12-01T20:51:07Z",
        "venv": "/opt/gpuhost/venvs/5f0c6b0e3c1d2a94",
        "lock_digest": "5f0c6b0e3c1d2a94",
        "model": "lukealonso/GLM-5-NVFP4",
        "model_revision": "main",
        "files": {
          "/etc/systemd/system/sglang.service": {"sha256": "<hex>", "mode": "0644"},
          "/etc/gpuhost/server.env": {"sha256": "<hex>", "mode": "0600"},
          "/etc/gpuhost/p2p.env": {"sha256": "<hex>", "mode": "0644"},
          "/var/lib/gpuhost/p2p.json": {"sha256": "<hex>", "mode": "0644"}
        },
        "absent": ["/etc/systemd/system/sglang-gate.service"],
        "folders": ["/etc/systemd/system/sglang.service.d"],
        "venvs": ["/opt/gpuhost/venvs/5f0c6b0e3c1d2a94"]
      }
    }

``files`` are the files the server reads at start (the unit, its drop-ins, the environment
files, the P2P record the P2P decision comes from), each kept as a copy named by its SHA-256 in
/var/lib/gpuhost/last-known-good/ (mode 0600 in a 0700 folder: server.env may hold a secret);
``absent`` those that did not exist; ``folders`` those whose ``*.conf`` files count (one added
since is removed by a rollback); ``venvs`` the venvs verified, newest first, as many as
gpuhost_venvs_kept (the others are removed from /opt/gpuhost/venvs then). The venv is the one the unit names: restoring the unit restores
the venv, which the retention rule keeps (operations/stages/venvs.py).
/var/lib/gpuhost/rollback.json exists while a rollback runs: a run that finds it finishes that
rollback first.
"""

from __future__ import annotations

import shlex
from typing import Final

from pyinfra import logger

from operations.runtime import remote
from operations.stages.p2p import LIB_DIR

RECORD: Final = "/var/lib/gpuhost/last-known-good.json"
MARKER: Final = "/var/lib/gpuhost/rollback.json"
SCRIPT: Final = f"{LIB_DIR}/last_known_good.py"


#: The shipped script's exit status for a write that failed (ENOSPC): one line said.
WRITE_FAILED: Final = 7


def record_command(venv: str, lock_digest: str, model: str, revision: str,
                   files: list[str], folders: list[str], keep: int = 1,
                   venvs_dir: str | None = None, action: str = "record") -> str:
    """The command that records the server's last known good (run once the gate passed) and,
    with ``venvs_dir``, removes the venvs there beyond the ``keep`` verified last; with
    ``action="check"``, the one that says whether the record is "fresh", "stale: <why>" or
    "unverified" (operations/files/last_known_good.py)."""
    argv = ["python3", SCRIPT, action, "--venv", venv, "--lock-digest", lock_digest,
            "--model", model, "--revision", revision, "--keep", str(keep)]
    if venvs_dir:
        argv += ["--venvs-dir", venvs_dir]
    for folder in folders:
        argv += ["--folder", folder]
    return " ".join(shlex.quote(a) for a in [*argv, *files])


def roll_back(host, why: str, gate, restart: str) -> bool:
    """After a failed health gate: put the last known good's files back, restart the server
    (``restart``, a shell command) and run ``gate()`` (the health gate, True when it passed)
    on it. Always False: the host's run fails; what failed and what the rollback did is said."""
    prefix = f"{host.print_prefix}SGLang server: "
    ok, out = remote.shell(host, f"python3 {SCRIPT} restore --why {shlex.quote(why)}",
                           _success_exit_codes=[0, 4, 5])
    lines = out.stdout_lines + out.stderr_lines
    if not ok or not lines or not lines[-1].startswith("rolled back"):
        said = "; ".join(lines) or "the restore failed"
        logger.error(f"{prefix}{why}; no rollback: {said}")
        return False
    for line in lines:
        logger.warning(f"{prefix}rollback: {line}")
    remote.shell(host, restart)
    restored = lines[-1].removeprefix("rolled back to ")
    if not gate():
        logger.error(f"{prefix}{why}; rolled back to the last known good "
                     f"({restored}), but the restored server failed the health gate too: the "
                     "host does not serve")
        remote.ending(host, "this run's server change was rolled back to the last known good "
                            f"({restored}), which failed its health gate too: the host does "
                            "not serve")
        return False
    remote.shell(host, f"python3 {SCRIPT} finish")
    logger.error(f"{prefix}{why}; rolled back to the last known good "
                 f"({restored}): it serves again, verified by the health gate")
    remote.ending(host, "this run's server change was rolled back: the server serves the last "
                        f"known good again ({restored}), verified; the run fails for this host "
                        "so that the change is looked at (above)")
    return False


def prune_command(venvs_dir: str, keep: int, venvs: list[str]) -> str:
    """The command that removes the venvs under ``venvs_dir`` that the record does not keep
    and ``venvs`` (the one serving, the one this run converges) do not name: a failed lock
    change's venv goes with the rest, not only once a restart passed its gate."""
    argv = ["python3", SCRIPT, "prune", "--keep", str(keep), "--venvs-dir", venvs_dir]
    for venv in venvs:
        argv += ["--venv", venv]
    return " ".join(shlex.quote(a) for a in argv)
