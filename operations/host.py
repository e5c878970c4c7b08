"""Host facts pyinfra does not have, and a reboot that proves the host came back."""

from __future__ import annotations

from dataclasses import dataclass
from time import monotonic, sleep

from pyinfra import logger
from pyinfra.api import FactBase, FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import FactProcessError, OperationError
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

    def record(state, host):
        status, out = host.run_shell_command("cat /proc/sys/kernel/random/boot_id")
        before.append(out.stdout.strip())

    def wait(state, host):
        host.disconnect()
        deadline = monotonic() + timeout
        sleep(interval)
        while monotonic() < deadline:
            host.connect(show_errors=False)
            if host.connected:
                status, out = host.run_shell_command("cat /proc/sys/kernel/random/boot_id")
                now = out.stdout.strip() if status else ""
                if now and now != before[0]:
                    logger.info(f"{host.print_prefix}back after reboot (boot id {now[:8]})")
                    return
                host.disconnect()
            sleep(interval)
        raise OperationError(f"host did not come back with a new boot id within {timeout} s")

    yield FunctionCommand(record, (), {})
    yield StringCommand("( sleep 1 && systemctl reboot ) </dev/null >/dev/null 2>&1 &")
    yield FunctionCommand(wait, (), {})

