"""One host's supervisor: boots it with systemd-nspawn and boots it again after a reboot.

Run detached by `up` as `python -m sandbox.supervisor gpuN`. nspawn exits with 133 when the
host ran `reboot`; a VM would come back, so the supervisor boots it again. Any other exit stops
the supervisor. SIGTERM powers the host off (nspawn turns it into an orderly shutdown) and stops.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from types import FrameType

from sandbox.layout import HostSpec, host_from_name

REBOOT_EXIT = 133


def nspawn_command(spec: HostSpec) -> list[str]:
    """The systemd-nspawn command line that boots `spec` (sandbox/README.md, "Hosts and links").

    --register=no/--keep-unit: this machine runs no systemd (no machined, no scopes).
    --console=read-only: the console goes to our stdout (console.log) without a terminal.
    --resolv-conf/--timezone=off: the image's own files stay, as on a VM.
    --link-journal=no: the host's journal stays inside it.
    --capability=CAP_NET_ADMIN: a VM's root may set its own firewall (nft); the capability
    reaches no further than the host's own network namespace, which nspawn joins.
    No bind of the shared .deb cache: see rootfs.seed_apt_archives.
    """
    return [
        "systemd-nspawn",
        "--quiet",
        "--boot",
        "--register=no",
        "--keep-unit",
        "-D",
        str(spec.root),
        "-M",
        spec.name,
        f"--network-namespace-path={spec.netns_path}",
        "--resolv-conf=off",
        "--timezone=off",
        "--link-journal=no",
        "--console=read-only",
        "--capability=CAP_NET_ADMIN",
    ]


def _log(message: str) -> None:
    print(f"=== gpuhost-sandbox {time.strftime('%Y-%m-%d %H:%M:%S')}: {message}", flush=True)


def supervise(spec: HostSpec) -> int:
    """Boot `spec` until it exits other than by reboot, or until SIGTERM; returns nspawn's last
    exit code."""
    stopping = False
    child: subprocess.Popen[bytes] | None = None

    def on_stop(signum: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        if child is not None and child.poll() is None:
            child.send_signal(signal.SIGTERM)

    signal.signal(signal.SIGTERM, on_stop)
    signal.signal(signal.SIGINT, on_stop)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    # The host's systemd inherits TERM through nspawn; a log file wants no colours.
    env = dict(os.environ, TERM="dumb", SYSTEMD_COLORS="0")
    boot = 0
    rc = 0
    while not stopping:
        boot += 1
        _log(f"{spec.name} boot {boot}")
        child = subprocess.Popen(nspawn_command(spec), stdin=subprocess.DEVNULL, env=env)
        if stopping:
            child.send_signal(signal.SIGTERM)
        rc = child.wait()
        _log(f"{spec.name} nspawn exited with {rc}")
        if rc != REBOOT_EXIT:
            break
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.supervisor")
    parser.add_argument("name", help="the host, gpuN")
    args = parser.parse_args(argv)
    supervise(host_from_name(args.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
