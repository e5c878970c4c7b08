"""Driver upgrades that cannot leave a host without a driver: the installed driver's packages
kept before a change, and reinstalled when the new driver fails its checks after the reboot.

Files on the host (root's, under /var/lib/gpuhost/):

``driver-last-good.json``: the driver the host was last verified with (nvidia-smi answered with
the installed module's version and the GPUs host data names, every GPU bound to nvidia)::

    {"version": "580.95.05", "module_package": "nvidia-kernel-open-dkms",
     "packages": {"nvidia-open": "580.95.05-1", "nvidia-kernel-open-dkms": "580.95.05-1", ...},
     "gpus": 1, "verified_at": "2026-12-01T20:41:07Z",
     "failed": [{"version": "590.44.01", "failure": "nvidia-smi fails: ...",
                 "at": "2026-12-01T20:48:10Z"}]}

``driver-change.json``: a driver change under way, written before the new packages install
and removed once a driver is verified; ``phase`` is "upgrading" (the new driver is not verified
yet) or "rolling-back" (it failed: ``failure`` says how, the kept packages are going back)::

    {"phase": "upgrading", "from": "580.95.05", "to": "590.44.01", "started_at": "...",
     "restore": [{"package": "nvidia-open", "version": "580.95.05-1",
                  "file": "/var/lib/gpuhost/driver-kept/nvidia-open_580.95.05-1_amd64.deb",
                  "sha256": "..."}, ...],
     "remove": ["a-package-the-new-driver-added"],
     "module_package": "nvidia-kernel-open-dkms", "failure": null}

``module_package`` is the kept driver's kernel-module package: a rollback checks the loaded
driver against it once reinstalled (on Ubuntu, 580's "nvidia-dkms-580-open" is not 590's
"nvidia-dkms-open"; a record without it, from an older gpuhost, means the new driver's name).

``driver-kept/``: the .deb files of ``restore``, each checked against the SHA256 apt's lists give
for that version (``apt-cache show``) when kept and against the recorded hash before reinstall.

What a change replaces is apt's own word: operations.stages.apt_simulation.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any, Final

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, operation
from pyinfra.api.exceptions import OperationError
from operations.runtime import remote
from operations.stages.apt_simulation import (
    INSTALL_OPTIONS,
    Simulation,
    parse_simulation,
    simulation_command,
)
from operations.stages.reboot import back_with_new_boot

STATE_DIR: Final = "/var/lib/gpuhost"
LAST_GOOD: Final = f"{STATE_DIR}/driver-last-good.json"
CHANGE: Final = f"{STATE_DIR}/driver-change.json"
KEPT_DIR: Final = f"{STATE_DIR}/driver-kept"

#: Per host, what the rollback of this run did: the run fails for that host at its end.
_rolled_back: dict[str, str] = {}


# --- the records -------------------------------------------------------------------------------


def load(text: str | None) -> dict | None:
    """A record's JSON (driver-last-good.json, driver-change.json), or None: absent or not
    readable as a JSON object."""
    try:
        value = json.loads(text) if text else None
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def upstream(version: str) -> str:
    """"580.95.05-1" gives "580.95.05" (no epoch, no revision)."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


#: Where a list of packages is wrapped: a driver change lists 20 to 40 of them (nvidia-open,
#: its libraries, the DKMS module), a line of about 2000 characters unwrapped (issue #42).
LIST_WIDTH = 100


def listed(items: list[str], width: int = LIST_WIDTH) -> str:
    """``": a, b"`` where the list fits one line; else its count, then the items, each whole,
    packed into indented lines of at most ``width`` characters."""
    one = ", ".join(items)
    if len(one) <= width:
        return f": {one}"
    rows, row = [], ""
    for item in items:
        piece = item if not row else f"{row}, {item}"
        if row and len(piece) > width:
            rows.append(row + ",")
            piece = item
        row = piece
    rows.append(row)
    return f" {len(items)} packages:\n" + "\n".join(f"    {r}" for r in rows)


def plan_lines(*, install: bool, change: bool, module_package: str,
               simulation: Simulation | None, last_good: dict | None,
               pending: dict | None) -> list[tuple[str, str]]:
    """What --dry (and a real run) says about a driver change and its rollback, as
    (level, line) pairs, level "info" or "warning". No side effects."""
    lines: list[tuple[str, str]] = []
    verified = (f"last verified {last_good.get('verified_at', '?')} with "
                f"{last_good.get('version', '?')}" if last_good else
                "no driver verified by gpuhost yet")
    if pending:
        restore = ", ".join(f"{r.get('package')} {r.get('version')}"
                            for r in pending.get("restore", []))
        if pending.get("phase") == "rolling-back":
            lines.append(("warning", (
                f"an interrupted driver rollback is finished first: {pending.get('to')} failed "
                f"({pending.get('failure')}); {restore} reinstalled from {KEPT_DIR}, a reboot, "
                "the driver verified; the run then fails for this host")))
        else:
            lines.append(("warning", (
                f"the change from {pending.get('from')} to {pending.get('to')} is not verified "
                f"yet: checked now; if it fails, {restore} reinstalled from {KEPT_DIR}, a "
                "reboot, verified, and the run fails for this host")))
        return lines
    if install and simulation is not None:
        if simulation.error:
            lines.append(("warning", f"apt's simulation of the driver install fails: "
                          f"{simulation.error}"))
        elif simulation.changes:
            # one line each: the caller prefixes each with the host's name
            lines.extend(("info", row) for row in ("apt would install" + listed(
                [c.describe() for c in simulation.changes])).split("\n"))
    elif install:
        lines.append(("info", "apt would install: known once NVIDIA's repository is in the "
                      "host's apt lists (this run adds it)"))
    if change and simulation is not None and not simulation.error:
        old = [c for c in simulation.changes if c.installed]
        new = simulation.version_of(module_package)
        failed = [f for f in (last_good or {}).get("failed", [])
                  if new and f.get("version") == upstream(new)]
        if failed:
            lines.append(("warning", (
                f"{upstream(new)} failed its checks on this host before ({failed[-1].get('at')}: "
                f"{failed[-1].get('failure')}) and was rolled back: it is tried again")))
        if old:
            lines.append(("info", (
                f"driver rollback available: if {upstream(new) if new else 'the new driver'} "
                "fails its checks after the reboot, "
                + ", ".join(f"{c.package} {c.installed}" for c in old)
                + f" are reinstalled (kept in {KEPT_DIR} first), the host rebooted and "
                f"verified, and the run fails for this host ({verified})")))
    elif change:
        lines.append(("info", "driver rollback available: the installed driver's packages are "
                      f"kept in {KEPT_DIR} before the change ({verified})"))
    elif install:
        lines.append(("info", "no driver rollback: no driver is installed to go back to"))
    elif last_good:
        lines.append(("info", f"driver rollback: none needed ({verified})"))
    return lines


# --- on the host ---------------------------------------------------------------------------------


def _sh(host_, command: str, **kwargs: Any):
    """:func:`operations.runtime.remote.shell` in the C locale, whatever the host's (the output is
    read or shown: a German host's sha256sum says "FEHLSCHLAG")."""
    return remote.shell(host_, f"export LC_ALL=C; {command}", **kwargs)


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _read(host_, path: str) -> dict | None:
    _ok, out = _sh(host_, f"cat {path} 2>/dev/null || true")
    return load(out.stdout)


def _write(host_, path: str, record: dict) -> None:
    text = json.dumps(record, indent=1, sort_keys=True)
    ok, out = _sh(host_, f"mkdir -p {STATE_DIR} && printf '%s\\n' {shlex.quote(text)} "
                           f"> {path}.tmp && mv {path}.tmp {path}")
    if not ok:
        raise OperationError(f"could not write {path}: {' '.join(out.stderr_lines[-3:])}")


def _installed(host_, names: list[str]) -> dict[str, str]:
    quoted = " ".join(shlex.quote(n) for n in sorted(set(names)))
    _ok, out = _sh(host_, "dpkg-query -W -f='${db:Status-Abbrev} ${Package} "
                            f"${{Version}}\\n' {quoted} 2>/dev/null || true")
    # db:Status-Abbrev: the wanted state ("i" install, "h" hold, ...), then the current one
    # ("i": installed), dpkg-query(1)
    return {w[1]: w[2] for w in (line.split() for line in out.stdout_lines)
            if len(w) == 3 and w[0][1:2] == "i"}


def _record_verified(host_, module_package: str, names: list[str], gpu_count: int,
                     failed: dict | None = None) -> dict:
    previous = _read(host_, LAST_GOOD) or {}
    packages = _installed(host_, [*names, module_package])
    record = {
        "version": upstream(packages.get(module_package, "?")),
        "module_package": module_package,
        "packages": packages,
        "gpus": gpu_count,
        "verified_at": _now(),
        "failed": [*previous.get("failed", []), *([failed] if failed else [])][-10:],
    }
    _write(host_, LAST_GOOD, record)
    _sh(host_, f"rm -f {CHANGE}")
    return record


def _keep_script(restore: list[tuple[str, str]]) -> str:
    """Shell that puts the .deb of each (package, version) in KEPT_DIR: apt's cache when a file
    there has the SHA256 apt's lists give for that version, else ``apt-get download``; prints
    "kept <package> <version> <file> <sha256>" per package, fails naming what it could not keep."""
    pairs = " ".join(shlex.quote(f"{n}={v}") for n, v in restore)
    new = f"{KEPT_DIR}.new"
    return (
        f"set -e; rm -rf {new}; mkdir -p {new}; cd {new}; "
        f"for nv in {pairs}; do n=${{nv%%=*}}; v=${{nv#*=}}; "
        "want=$(apt-cache show --no-all-versions \"$nv\" 2>/dev/null "
        "| sed -n 's/^SHA256: //p' | head -n 1); "
        "if [ -z \"$want\" ]; then echo \"apt's lists have no $n $v any more: it cannot be kept "
        "for a rollback\" >&2; exit 1; fi; "
        "for c in /var/cache/apt/archives/\"$n\"_*.deb; do "
        "if [ -f \"$c\" ] && [ \"$(sha256sum < \"$c\" | cut -d' ' -f1)\" = \"$want\" ]; then "
        "cp \"$c\" .; break; fi; done; "
        "if ! ls \"$n\"_*.deb >/dev/null 2>&1; then "
        "apt-get download -q \"$nv\" >/dev/null 2>download.err "
        "|| { echo \"apt-get download $nv failed: $(tail -n 2 download.err)\" >&2; exit 1; }; fi; "
        "f=$(ls \"$n\"_*.deb | head -n 1); got=$(sha256sum < \"$f\" | cut -d' ' -f1); "
        "if [ \"$got\" != \"$want\" ]; then echo \"$f: sha256 $got, apt's lists say $want\" >&2; "
        f"exit 1; fi; echo \"kept $n $v {KEPT_DIR}/$f $got\"; done; "
        f"rm -f download.err; rm -rf {KEPT_DIR}; mv {new} {KEPT_DIR}"
    )


@operation(is_idempotent=False)
def kept(packages: list[str], module_package: str, version_glob: str,
         kept_module_package: str | None = None):
    """Keep the installed packages a driver change replaces, as .deb files whose hashes are
    checked (see the module docstring), and record the change in driver-change.json before it
    starts; raises OperationError (nothing changed yet) when a package cannot be kept.

    + packages: the driver packages the change installs ("nvidia-open")
    + module_package: the kernel-module package ("nvidia-kernel-open-dkms")
    + version_glob: the wanted version pattern (the pin already written: "590.*")
    + kept_module_package: the kernel-module package installed now, where its name is not
      ``module_package`` (Ubuntu across 590's rename: "nvidia-dkms-580-open"); recorded, so
      that a rollback checks the loaded driver against the package it reinstalled

    A change already recorded and not verified keeps what it kept: that is the driver last
    verified, not the one being replaced now.
    """

    kept_module = kept_module_package or module_package

    @remote.callback("keeping the installed driver's packages")
    def keep(state, host):
        if _read(host, CHANGE):
            logger.warning(f"{host.print_prefix}NVIDIA: a driver change is still unverified: "
                           f"{KEPT_DIR} keeps the driver before it")
            return True
        _ok, out = _sh(host, simulation_command([*packages, module_package],
                                                         version_glob))
        simulation = parse_simulation(out.stdout_lines)
        if simulation.error:
            raise OperationError(f"apt's simulation of the driver install fails: "
                                 f"{simulation.error}")
        restore = [(c.package, c.installed) for c in simulation.changes if c.installed]
        if not restore:
            return True
        ok, out = _sh(host, _keep_script(restore))  # type: ignore[arg-type]
        if not ok:
            raise OperationError("cannot keep the installed driver for a rollback, nothing "
                                 f"changed: {' '.join(out.stderr_lines[-3:])}")
        entries = [dict(zip(("package", "version", "file", "sha256"), line.split()[1:]))
                   for line in out.stdout_lines if line.startswith("kept ")]
        old = dict(restore).get(kept_module)
        new = simulation.version_of(module_package)
        _write(host, CHANGE, {
            "phase": "upgrading", "from": upstream(old) if old else None,
            "to": upstream(new) if new else None, "started_at": _now(), "restore": entries,
            "module_package": kept_module,
            "remove": [c.package for c in simulation.changes if c.installed is None],
            "failure": None,
        })
        logger.info(f"{host.print_prefix}NVIDIA: kept for a rollback: "
                    + ", ".join(f"{e['package']} {e['version']}" for e in entries))
        return True

    yield FunctionCommand(keep, (), {})


def _roll_back(host_, change: dict, failure: str, module_package: str, gpu_count: int,
               failure_of: Callable[..., str | None], interrupted: bool = False) -> None:
    """Reinstall the kept packages, reboot, verify; records the outcome (see the module
    docstring). Raises OperationError when the kept files are gone or changed, or the restored
    driver fails its checks too."""
    change = {**change, "phase": "rolling-back", "failure": failure}
    _write(host_, CHANGE, change)
    # what the kept driver's module package is called (its name may not be the new one's)
    module_package = str(change.get("module_package") or module_package)
    restore = change.get("restore") or []
    files = [r["file"] for r in restore]
    check = " && ".join(f"echo {shlex.quote(r['sha256'] + '  ' + r['file'])} | sha256sum -c "
                        "--quiet -" for r in restore)
    ok, out = _sh(host_, check or "false")
    if not ok:
        raise OperationError(f"driver {change.get('to')} failed its checks ({failure}); the "
                             f"packages kept in {KEPT_DIR} for the rollback to "
                             f"{change.get('from')} are missing or changed: "
                             + " ".join(out.stdout_lines[-3:] + out.stderr_lines[-3:]))
    removals = [f"{name}-" for name in change.get("remove") or []]
    ok, out = _sh(host_, " ".join([
        "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y", "-q",
        "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
        "install", *INSTALL_OPTIONS, *(shlex.quote(f) for f in files),
        *(shlex.quote(r) for r in removals)]), timeout=1800)
    if not ok:
        raise OperationError(f"driver {change.get('to')} failed its checks ({failure}); "
                             f"reinstalling {change.get('from')} failed: "
                             + " ".join(out.stderr_lines[-5:]))
    _ok, out = _sh(host_, "cat /proc/sys/kernel/random/boot_id")
    logger.warning(f"{host_.print_prefix}NVIDIA: {change.get('from')} reinstalled: rebooting")
    _sh(host_, "( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    back_with_new_boot(host_, out.stdout.strip())
    again = failure_of(host_, module_package, gpu_count)
    if again:
        raise OperationError(f"driver {change.get('to')} failed its checks ({failure}); after "
                             f"the rollback to {change.get('from')} the driver fails too "
                             f"({again}): the host has no working driver")
    record = _record_verified(host_, module_package,
                              [r["package"] for r in restore], gpu_count,
                              {"version": change.get("to"), "failure": failure, "at": _now()})
    message = (f"driver {change.get('to')} failed its checks after the reboot ({failure}); "
               f"rolled back to {record['version']}: reinstalled, rebooted and verified "
               f"({gpu_count} GPU(s))")
    if interrupted:
        message += "; an earlier run had left the rollback unfinished"
    _rolled_back[host_.name] = message
    logger.error(f"{host_.print_prefix}NVIDIA: {message}")


def rolled_back(name: str) -> str | None:
    """What this run's rollback of host ``name``'s driver said (it failed its upgrade and
    went back), or None."""
    return _rolled_back.get(name)


def fail_if_rolled_back() -> None:
    """At the end of the deploy: fail the current host when this run rolled its driver back
    (:func:`reported`); nothing runs on the others."""
    name = host.name
    reported(name="Driver: fail the host if this run rolled its upgrade back",
             _if=lambda: name in _rolled_back)


@operation(is_idempotent=False)
def checked(packages: list[str], module_package: str, gpu_count: int,
            failure_of: Callable[..., str | None]):
    """Check the loaded driver; record it in driver-last-good.json when it passes; when it
    fails and a change is recorded (driver-change.json), roll back to the kept packages
    (reinstall, reboot, verify). Without a recorded change a failure fails the host.

    + packages: the driver packages (recorded with their versions)
    + module_package: the package whose version the loaded driver must have
    + gpu_count: the GPUs nvidia-smi must list
    + failure_of: ``(host, module_package, gpu_count) -> str | None``, the checks
      (operations.stages.driver_checks.driver_failure)

    After a rollback the run goes on (the server starts on the restored driver) and fails
    for this host at its end (:func:`reported`).
    """

    @remote.callback("the driver check")
    def check(state, host):
        failure = failure_of(host, module_package, gpu_count)
        change = _read(host, CHANGE)
        if not failure:
            names = [r.get("package", "") for r in (change or {}).get("restore", [])]
            record = _record_verified(host, module_package, [*packages, *names], gpu_count)
            logger.info(f"{host.print_prefix}NVIDIA: driver {record['version']} verified "
                        f"({gpu_count} GPU(s)), recorded in {LAST_GOOD}")
            return True
        if not change or not change.get("restore"):
            raise OperationError(failure)
        logger.error(f"{host.print_prefix}NVIDIA: driver {change.get('to')} failed its checks "
                     f"after the reboot ({failure}): rolling back to {change.get('from')}")
        _roll_back(host, change, failure, module_package, gpu_count, failure_of)
        return True

    yield FunctionCommand(check, (), {})


@operation(is_idempotent=False)
def finished(packages: list[str], module_package: str, gpu_count: int,
             failure_of: Callable[..., str | None], server_unit: str):
    """Finish a rollback an earlier run left unfinished (driver-change.json in phase
    "rolling-back"): stop ``server_unit``, reinstall the kept packages, reboot, verify (see
    :func:`checked`; ``packages``, ``module_package``, ``gpu_count``, ``failure_of`` as there)."""

    @remote.callback("the driver rollback", "run again to finish it")
    def finish(state, host):
        change = _read(host, CHANGE)
        if not change:
            return True
        _sh(host, f"systemctl stop {shlex.quote(server_unit)} 2>/dev/null || true")
        _roll_back(host, change, str(change.get("failure")), module_package, gpu_count,
                   failure_of, interrupted=True)
        return True

    yield FunctionCommand(finish, (), {})


@operation(is_idempotent=False)
def reported():
    """Fail the host, at the end of the run, when this run rolled its driver back, saying what
    failed and to which version it went back."""

    @remote.callback("the driver upgrade")
    def report(state, host):
        message = _rolled_back.pop(host.name, None)
        if message:
            raise OperationError(message)
        return True

    yield FunctionCommand(report, (), {})


def pending_change(text: str | None) -> dict[str, Any] | None:
    """driver-change.json's record when it names kept packages to go back to, else None."""
    change = load(text)
    return change if change and change.get("restore") else None
