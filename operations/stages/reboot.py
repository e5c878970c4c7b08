"""A reboot that proves the host came back: a new boot id, the deploy lock taken again."""

from __future__ import annotations

from time import monotonic, sleep

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError

from operations.runtime import remote
from operations.stages import deploy_lock


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
