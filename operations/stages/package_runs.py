"""Package runs beside the host's own: dpkg finished after an interrupted run, and ``apt-get
update`` once apt's lists lock is free (apt-daily and unattended-upgrades take it too)."""

from __future__ import annotations

import shlex
from typing import Final

from pyinfra import logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError

from operations.runtime import remote
from operations.plans import proxy


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
