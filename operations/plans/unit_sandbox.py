"""systemd's sandboxing for the units gpuhost installs: one description per unit, rendered into
its [Service] section.

Every directive is systemd.exec(5)'s (systemd 252, Debian 12; 255, Ubuntu 24.04); the weights
``systemd-analyze security`` gives them are in systemd's src/analyze/analyze-security.c. What
every unit gets (:data:`BASE`): no new privileges, the whole file system read-only but for the
paths named writable (``ProtectSystem=strict``; a unit's RuntimeDirectory= is writable too), no
home folders, a /tmp of its own, the kernel's tunables, modules, logs and clock out of reach,
``SystemCallFilter=@system-service`` for the native architecture, and a umask of 077. What a
unit needs beyond it is said per unit (:class:`Sandbox`): the capabilities it keeps, the
address families it opens, the devices it reads (the GPUs through ``DeviceAllow=`` and
``DevicePolicy=closed``, never ``PrivateDevices=``, which would hide /dev/nvidia*), whether it
reaches the network at all.

The targets of issue 41, measured by ``systemd-analyze security <unit>`` on the sandbox hosts:
the server and the router at most 4.9, every other unit at most 2.5
(tests/e2e/test_tls.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

#: What every unit gets.
BASE: Final = (
    "NoNewPrivileges=yes",
    "ProtectSystem=strict",
    "PrivateTmp=yes",
    "PrivateMounts=yes",
    "ProtectKernelTunables=yes",
    "ProtectKernelModules=yes",
    "ProtectKernelLogs=yes",
    "ProtectControlGroups=yes",
    "ProtectClock=yes",
    "ProtectHostname=yes",
    "RestrictNamespaces=yes",
    "RestrictRealtime=yes",
    "RestrictSUIDSGID=yes",
    "LockPersonality=yes",
    "SystemCallArchitectures=native",
    "SystemCallFilter=@system-service",
    "UMask=0077",
)

#: The GPUs' character devices, by their drivers' names in /proc/devices: every name that
#: starts with ``nvidia`` (systemd.resource-control(5), DeviceAllow= "char-<name>"; systemd
#: matches each /proc/devices line against it with fnmatch, src/core/bpf-devices.c
#: bpf_devices_allow_list_major). The open kernel modules name major 195 ``nvidia`` and
#: ``nvidiactl`` (open-gpu-kernel-modules, kernel-open/nvidia/nv.c nvidia_init_module), the
#: older proprietary ones ``nvidia-frontend``; beside them ``nvidia-uvm`` (/dev/nvidia-uvm*,
#: CUDA's unified memory), ``nvidia-caps`` (MIG), ``nvidia-modeset``. systemd reads
#: /proc/devices when the unit starts: a driver module loaded later is not in the list until
#: the next start (see templates/sglang.service.j2 for nvidia-uvm).
GPU_DEVICES: Final = ("char-nvidia* rw",)


@dataclass(frozen=True)
class Sandbox:
    """What one unit needs beyond :data:`BASE`.

    + capabilities: the bounding set (empty: none at all, root's included)
    + families: the socket address families it may open (RestrictAddressFamilies=)
    + writable: paths it writes besides its RuntimeDirectory= (ReadWritePaths=)
    + home: ``read-only`` where it reads files the operator names, which may be anywhere,
      /root and /home included (the key files, a certificate, a local model); else ``yes``:
      no home folder at all (ProtectHome=)
    + devices: None for no device at all (PrivateDevices=yes), else DeviceAllow= entries
    + network: False puts it in a network namespace of its own with no address (PrivateNetwork=)
    + ip: False refuses it every IP address (IPAddressDeny=any), in the host's namespace
    + jit: it maps memory writable and executable (Python's JIT compilers, CUDA)
    + privileged: it changes users or limits (nginx's master: setuid, setrlimit)
    + proc: ``all`` where it reads /proc's system files (meminfo, cpuinfo, /proc/driver)
    + kernel_log: it reads the kernel's ring buffer (dmesg: the NVIDIA driver's Xid lines):
      ProtectKernelLogs= left out, which would take CAP_SYSLOG, block syslog(2) and hide
      /dev/kmsg (systemd.exec(5)); the unit keeps CAP_SYSLOG (reading /dev/kmsg needs it
      where kernel.dmesg_restrict is 1, Ubuntu's default) and /dev/kmsg among its devices
    """

    capabilities: tuple[str, ...] = ()
    families: tuple[str, ...] = ("AF_UNIX",)
    writable: tuple[str, ...] = ()
    home: str = "yes"
    devices: tuple[str, ...] | None = None
    network: bool = True
    ip: bool = True
    jit: bool = False
    privileged: bool = False
    proc: str = "pid"
    kernel_log: bool = False

    def lines(self) -> list[str]:
        """The directives, one a line, BASE's first."""
        out = [line for line in BASE
               if not (self.kernel_log and line == "ProtectKernelLogs=yes")]
        out.append(f"ProtectHome={self.home}")
        out.append("CapabilityBoundingSet=" + " ".join(self.capabilities))
        out.append("RestrictAddressFamilies=" + " ".join(self.families))
        if self.writable:
            out.append("ReadWritePaths=" + " ".join(self.writable))
        if self.devices is None:
            out.append("PrivateDevices=yes")
        else:
            out.append("DevicePolicy=closed")
            out.extend(f"DeviceAllow={d}" for d in self.devices)
        if not self.network:
            out.append("PrivateNetwork=yes")
        if not (self.network and self.ip):
            out.append("IPAddressDeny=any")
        if not self.jit:
            out.append("MemoryDenyWriteExecute=yes")
        if not self.privileged:
            out.append("SystemCallFilter=~@privileged @resources")
        out.append("ProtectProc=invisible")
        out.append(f"ProcSubset={self.proc}")
        return out

    def text(self) -> str:
        """:meth:`lines` as a unit file's lines, each ending in a newline."""
        return "".join(f"{line}\n" for line in self.lines())


#: A oneshot that asks systemd to reload a gate (systemctl over systemd's private socket):
#: no capability, no network, no device.
SYSTEMCTL: Final = Sandbox(network=False)
#: nft loading a table: netlink, CAP_NET_ADMIN in the host's namespace; user names in a
#: rule are resolved through NSS (a local socket where nscd or systemd-userdbd answers).
NFT: Final = Sandbox(capabilities=("CAP_NET_ADMIN",), families=("AF_NETLINK", "AF_UNIX"),
                     ip=False)
