"""Host facts pyinfra does not have, and a reboot that proves the host came back."""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass
from typing import Final
from time import monotonic, sleep

from pyinfra import logger
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import FactProcessError, OperationError
from typing_extensions import override

from operations import deploy_lock, proxy, remote


@dataclass(frozen=True)
class Resources:
    """What a build may use: ``cores`` from nproc, ``mem_available_gib`` from MemAvailable in
    /proc/meminfo (GiB, 1 GiB = 2**30 bytes), ``mem_total_gib`` from MemTotal."""

    cores: int
    mem_available_gib: float
    mem_total_gib: float


class HostResources(FactBase[Resources]):
    """Cores and memory (proc(5): /proc/meminfo is in kB, 1 kB = 1024 bytes).

    .. code:: python

        Resources(cores=16, mem_available_gib=124.6, mem_total_gib=125.8)
    """

    @override
    def command(self) -> str:
        return "nproc; grep -E '^(MemTotal|MemAvailable):' /proc/meminfo"

    @override
    def process(self, output: list[str]) -> Resources:
        try:
            cores = int(output[0])
            mem = {}
            for line in output[1:]:
                key, value, unit = line.split()
                mem[key.rstrip(":")] = int(value) / 2**20 if unit == "kB" else float("nan")
            return Resources(cores, round(mem["MemAvailable"], 2), round(mem["MemTotal"], 2))
        except (ValueError, KeyError, IndexError) as exc:
            raise FactProcessError(f"nproc and /proc/meminfo: cannot read {output!r}") from exc


class HeldPackages(FactBase[set[str]]):
    """Packages on hold (``apt-mark showhold``), as a set of names."""

    default = set

    @override
    def requires_command(self) -> str:
        return "apt-mark"

    @override
    def command(self) -> str:
        return "apt-mark showhold"

    @override
    def process(self, output: list[str]) -> set[str]:
        return {line.strip() for line in output if line.strip()}


class AptListsPresent(FactBase[bool]):
    """Whether apt has package lists at all (a fresh cloud image often has none)."""

    @override
    def command(self) -> str:
        return "ls /var/lib/apt/lists/ | grep -c '_Packages' || true"

    @override
    def process(self, output: list[str]) -> bool:
        return bool(output) and output[-1].strip().isdigit() and int(output[-1]) > 0


class FileText(FactBase[str | None]):
    """A small text file's content, or None where it does not exist."""

    @override
    def command(self, path: str) -> str:
        quoted = "'" + path.replace("'", "'\\''") + "'"
        return f"if [ -f {quoted} ]; then echo present; cat {quoted}; else echo absent; fi"

    @override
    def process(self, output: list[str]) -> str | None:
        if not output or output[0] == "absent":
            return None
        return "\n".join(output[1:])


class PasswdEntry(FactBase["dict[str, str] | None"]):
    """A user's account as ``getent passwd`` shows it (passwd(5): name, password, UID, GID,
    GECOS, home, shell), or None where there is none. One account's line, where pyinfra's
    ``Users`` runs ``id`` and ``lastlog`` for every account (0.67 s of a sandbox host's CPU at
    each no-op run, docs/development.md).

    .. code:: python

        {"uid": "998", "gid": "998", "home": "/var/lib/gpuhost-models", "shell": "/bin/sh"}
    """

    @override
    def command(self, user: str) -> str:
        return f"getent passwd {shlex.quote(user)} || true"

    @override
    def process(self, output: list[str]) -> dict[str, str] | None:
        fields = output[0].split(":") if output else []
        if len(fields) != 7:
            return None
        return {"uid": fields[2], "gid": fields[3], "home": fields[5], "shell": fields[6]}


class DpkgInterrupted(FactBase[list[str]]):
    """What an interrupted package run left (dpkg(1)): the entries of dpkg's journal in
    /var/lib/dpkg/updates, which make apt refuse with "dpkg was interrupted", and what
    ``dpkg --audit`` reports (packages half-installed, unpacked but not configured, ...), one
    line each; empty when dpkg is consistent.

    .. code:: python

        ["journal entry 0001", "The following packages are only half configured, ..."]
    """

    default = list

    @override
    def requires_command(self) -> str:
        return "dpkg"

    @override
    def command(self) -> str:
        return ("ls -A /var/lib/dpkg/updates 2>/dev/null | sed 's/^/journal entry /'; "
                "dpkg --audit 2>/dev/null | head -n 40")

    @override
    def process(self, output: list[str]) -> list[str]:
        return [line for line in output if line.strip()]


#: Waits for dpkg's frontend lock as apt does, then runs dpkg under it (DPKG_FRONTEND_LOCKED:
#: dpkg(1), ENVIRONMENT). argv: seconds to wait, then dpkg's arguments.
_DPKG_UNDER_LOCK: Final = r"""
import fcntl, os, signal, subprocess, sys
def late(*_):
    print(f"dpkg's lock (/var/lib/dpkg/lock-frontend) still held after {sys.argv[1]} s: another "
          "package run is going on; let it finish, then run the deploy again", file=sys.stderr)
    sys.exit(1)
signal.signal(signal.SIGALRM, late)
signal.alarm(int(sys.argv[1]))
lock = open("/var/lib/dpkg/lock-frontend", "w")
fcntl.lockf(lock, fcntl.LOCK_EX)
signal.alarm(0)
env = dict(os.environ, DPKG_FRONTEND_LOCKED="1", DEBIAN_FRONTEND="noninteractive")
sys.exit(subprocess.run(["dpkg", *sys.argv[2:]], env=env).returncode)
"""


@operation(is_idempotent=False)
def dpkg_finished(lock_timeout: int = 600):
    """Finish what an interrupted package run left (see :class:`DpkgInterrupted`): wait up to
    ``lock_timeout`` seconds for dpkg's frontend lock (a run that lost its SSH session may
    still be going on), then ``dpkg --configure -a`` under the lock, keeping changed
    configuration files (--force-confold). Packages left half-installed are reinstalled by
    the apt operations after it, which see them as not installed."""
    yield StringCommand("python3", "-c", shlex.quote(_DPKG_UNDER_LOCK), str(int(lock_timeout)),
                        "--force-confdef", "--force-confold", "--configure", "-a")


#: ``apt-get update`` once apt's lists lock is free: apt waits for dpkg's lock
#: (DPkg::Lock::Timeout) but fails at once on /var/lib/apt/lists/lock, which apt-daily and
#: unattended-upgrades take too (seen with apt 2.6: "Could not get lock
#: /var/lib/apt/lists/lock. It is held by process ..."). apt locks with fcntl(2) (apt-pkg's
#: GetLock), so lockf here sees its lock. argv: seconds to wait.
_UPDATE_WHEN_LISTS_FREE: Final = r"""
import fcntl, subprocess, sys, time
deadline, told = time.monotonic() + int(sys.argv[1]), False
while True:
    with open("/var/lib/apt/lists/lock", "w") as lock:
        try:
            fcntl.lockf(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            free = True
        except OSError:
            free = False
    if free:
        run = subprocess.run(["apt-get", "-q", "update"], capture_output=True, text=True)
        print(run.stdout, end="")
        if run.returncode == 0 or "/var/lib/apt/lists/lock" not in run.stderr:
            print(run.stderr, end="", file=sys.stderr)
            sys.exit(run.returncode)
    if time.monotonic() > deadline:
        print(f"apt's lists lock (/var/lib/apt/lists/lock) still held after {sys.argv[1]} s: "
              "another apt run is going on; let it finish, then run the deploy again",
              file=sys.stderr)
        sys.exit(1)
    if not told:
        print("waiting for apt's lists lock (/var/lib/apt/lists/lock)", flush=True)
        told = True
    time.sleep(2)
"""


@operation(is_idempotent=False)
def lists_updated(lock_timeout: int = 600):
    """``apt-get update``, waiting up to ``lock_timeout`` seconds for apt's lists lock, as apt
    itself waits for dpkg's (see _UPDATE_WHEN_LISTS_FREE); the wait is printed per host."""
    command = StringCommand("python3", "-c", shlex.quote(_UPDATE_WHEN_LISTS_FREE),
                            str(int(lock_timeout)))

    @remote.callback("apt-get update")
    def update(state, host):
        ok, out = remote.shell(host, command, timeout=lock_timeout + remote.DEFAULT_TIMEOUT_S)
        for line in out.stdout_lines:
            if line.startswith("waiting for apt's lists lock"):
                logger.info(f"{host.print_prefix}{line}")
        if not ok:
            chosen = proxy.of_host()
            route = (f"\napt's downloads went through {proxy.shown(chosen.http or chosen.https)} "
                     f"(from {chosen.source})" if chosen.any else "")
            raise OperationError(("\n".join(out.stderr_lines[-20:]) or "apt-get update failed")
                                 + route)

    yield FunctionCommand(update, (), {})


@operation(is_idempotent=False)
def reboot(timeout: int = 600, interval: float = 2.0):
    """Reboot the host and wait until it is back with a new boot id.

    + timeout: seconds to wait for SSH and a new boot id
    + interval: seconds between reconnect attempts

    pyinfra's own ``server.reboot`` compares uptimes, which a container host shares with its
    machine; the boot id is what changes at every boot, on a VM and in a container alike.
    Raises OperationError when the host is not back in time.
    """
    before: list[str] = []

    @remote.callback("the reboot")
    def record(state, host):
        status, out = remote.shell(host, "cat /proc/sys/kernel/random/boot_id")
        before.append(out.stdout.strip())

    @remote.callback("the reboot", "the host may still be booting")
    def wait(state, host):
        back_with_new_boot(host, before[0], timeout, interval)

    yield FunctionCommand(record, (), {})
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    yield FunctionCommand(wait, (), {})



def back_with_new_boot(host, before: str, timeout: float = 600, interval: float = 2.0) -> None:
    """Wait, from an operation's callback, until ``host`` answers SSH with a boot id other than
    ``before`` (its deploy lock released meanwhile and taken again); a reboot must already be
    under way. Raises OperationError when the host is not back within ``timeout`` seconds."""
    deploy_lock.release(host)
    remote.close(host)
    deadline = monotonic() + timeout
    sleep(interval)
    while monotonic() < deadline:
        host.connect(show_errors=False)
        if host.connected:
            try:
                status, out = remote.shell(host, "cat /proc/sys/kernel/random/boot_id",
                                           timeout=30)
            except OperationError:
                status = False
            now = out.stdout.strip() if status else ""
            if now and now != before:
                logger.info(f"{host.print_prefix}back after reboot (boot id {now[:8]})")
                deploy_lock.take_again(host)
                return
        remote.close(host)
        sleep(interval)
    raise OperationError(f"host did not come back with a new boot id within {timeout} s")


class HostAddresses(FactBase[list[str]]):
    """The IP addresses of the host's own interfaces (``ip -o addr show``: iproute2's one line
    per address, ``<n>: <dev> inet|inet6 <address>/<prefix> ...``), without their prefix.

    .. code:: python

        ["127.0.0.1", "10.213.1.2", "::1"]
    """

    @override
    def requires_command(self) -> str:
        return "ip"

    @override
    def command(self) -> str:
        return "ip -o addr show"

    @override
    def default(self) -> list[str]:
        return []

    @override
    def process(self, output: list[str]) -> list[str]:
        found = []
        for line in output:
            words = line.split()
            if len(words) > 3 and words[2] in ("inet", "inet6"):
                found.append(words[3].split("/", 1)[0])
        return found


def address_problem(key: str, address: str, own: list[str], what: str) -> str | None:
    """Why ``address`` (host data's ``key``) cannot be used on this host, or None: it is
    neither a wildcard (0.0.0.0, ::), a loopback address, nor one of the host's own
    (:class:`HostAddresses` ``own``); ``what`` says what the address is for."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return None  # settings.py refuses what is no IP address
    if ip.is_unspecified or ip.is_loopback or any(
            ipaddress.ip_address(a) == ip for a in own if _is_ip(a)):
        return None
    return (f"{key} = {address!r} is not allowed: it is not an address of this host ({what}); "
            f"allowed: one of its own addresses ({', '.join(own) or 'none found'}), a "
            "loopback address or a wildcard")


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
