"""Host facts pyinfra does not have: resources, held packages, files, accounts, dpkg's state,
addresses."""

from __future__ import annotations

import ipaddress
import shlex
from dataclasses import dataclass

from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError
from typing_extensions import override


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
