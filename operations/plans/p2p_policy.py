"""The P2P decision table: from measured P2P status to NCCL settings and all-reduce flags.

Standard library only, and no imports from this package: the host-side check
(operations/files/p2p_check.py) ships this file and runs it in the host's venv.

| measured                                   | P2P | NCCL env                     | server flags |
|--------------------------------------------|-----|------------------------------|--------------|
| one GPU (no pairs)                         | n/a | NCCL_IB_DISABLE              | none         |
| every pair OK for read and write, verified | on  | NCCL_IB_DISABLE              | none         |
| any pair NS, CNS, GNS, TNS or U            | off | the reference launch's four  | --disable-custom-all-reduce |
| reported OK, a copy or all-reduce failed   | off | the four, NCCL_P2P_DISABLE=1 | --disable-custom-all-reduce, with a warning |
| forced off by gpuhost_p2p_override         | off | the four, NCCL_P2P_DISABLE=1 | --disable-custom-all-reduce, with a warning |

The "off" settings are those of the reference lab's launch (../shared/reference-lab.md), which
served GLM-5 on 8 GPUs in a Proxmox VM without peer-to-peer: NCCL_P2P_LEVEL=PHB,
NCCL_ALLOC_P2P_NET_LL_BUFFERS=1, NCCL_MIN_NCHANNELS=8 and SGLang's custom all-reduce disabled.
They keep NCCL off P2P only where the driver itself says no (NCCL checks the same status): with
P2P reported OK, NCCL_P2P_LEVEL=PHB still lets NCCL go peer-to-peer over any path up to a host
bridge, and NVLink always. Measured on two NVLinked H200s with NCCL 2.28.9
(tests/fixtures/h200-x2-device/nccl-env.txt): the four alone, "via P2P/CUMEM"; with
NCCL_P2P_DISABLE=1, "via SHM/direct/direct", the sum intact. So where P2P is reported OK but must
not be used (it corrupted data, or the operator forced it off), NCCL_P2P_DISABLE=1 is added.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: NCCL_IB_DISABLE=1: one host has no InfiniBand peer to reach; NCCL stops probing for it.
BASE_ENV = {"NCCL_IB_DISABLE": "1"}
#: The reference launch's settings for GPUs that cannot reach each other directly.
NO_P2P_ENV = {
    "NCCL_IB_DISABLE": "1",
    "NCCL_P2P_LEVEL": "PHB",
    "NCCL_ALLOC_P2P_NET_LL_BUFFERS": "1",
    "NCCL_MIN_NCHANNELS": "8",
}
#: For GPUs whose P2P the driver reports OK but which must not use it (module docstring).
P2P_DISABLED_ENV = {**NO_P2P_ENV, "NCCL_P2P_DISABLE": "1"}
NO_P2P_FLAGS = ("--disable-custom-all-reduce",)

HOST_SIDE_CAUSES = (
    "PCIe ACS redirecting peer traffic through the root complex, or an IOMMU translating it; "
    "on Proxmox, look at a q35 machine with pcie=1 root ports and the vfio-pci "
    "x-nv-gpudirect-clique property"
)


@dataclass(frozen=True)
class Decision:
    """What the server gets: ``p2p`` is "on", "off" or "n/a" (a single GPU); ``env`` the NCCL
    variables; ``server_args`` SGLang flags; ``reason`` one sentence; ``warnings`` what the
    operator should read."""

    p2p: str
    env: dict[str, str]
    server_args: tuple[str, ...]
    reason: str
    warnings: tuple[str, ...] = field(default=())

    def to_json(self) -> dict:
        return asdict(self)


def decide(
    read: list[list[str]],
    write: list[list[str]],
    verified: bool | None = None,
    override: str | None = None,
) -> Decision:
    """Decide from the P2P status matrices (``nvidia-smi topo -p2p r`` and ``w``: square,
    "X" on the diagonal, codes OK/CNS/GNS/TNS/NS/U) and the write-and-verify result
    (True passed, False failed, None not run).

    ``override`` ("on" or "off", host data ``gpuhost_p2p_override``) wins, with a warning
    where it contradicts the measurement. Raises ValueError for matrices of different shapes
    or an unknown override.
    """
    if len(read) != len(write) or any(len(r) != len(read) for r in (*read, *write)):
        raise ValueError("the P2P read and write matrices must be square and of one size")
    if override not in (None, "on", "off"):
        raise ValueError(f"P2P override {override!r}: allowed are 'on', 'off' or None")
    n = len(read)
    codes = {read[i][j] for i in range(n) for j in range(n) if i != j}
    codes |= {write[i][j] for i in range(n) for j in range(n) if i != j}

    if n < 2:
        measured = Decision("n/a", dict(BASE_ENV), (), "one GPU: no GPU pairs, nothing to decide")
    elif codes != {"OK"}:
        bad = ", ".join(sorted(codes - {"OK"}))
        measured = Decision("off", dict(NO_P2P_ENV), NO_P2P_FLAGS,
                            f"nvidia-smi reports P2P as {bad} between GPUs")
    elif verified is False:
        measured = Decision(
            "off", dict(P2P_DISABLED_ENV), NO_P2P_FLAGS,
            "nvidia-smi reports P2P OK, but peer copies or the all-reduce failed verification",
            (f"P2P is reported OK but does not work; likely causes: {HOST_SIDE_CAUSES}",),
        )
    else:
        how = "verified by peer copies and an NCCL all-reduce" if verified else "not verified"
        measured = Decision("on", dict(BASE_ENV), (), f"every GPU pair reports P2P OK ({how})")

    if override is None or override == measured.p2p or measured.p2p == "n/a":
        return measured
    if override == "on":
        return Decision(
            "on", dict(BASE_ENV), (), f"forced on by gpuhost_p2p_override ({measured.reason})",
            (*measured.warnings,
             f"gpuhost_p2p_override = 'on' contradicts the measurement: {measured.reason}"),
        )
    return Decision(
        "off", dict(P2P_DISABLED_ENV), NO_P2P_FLAGS,
        f"forced off by gpuhost_p2p_override ({measured.reason})",
        (f"gpuhost_p2p_override = 'off' contradicts the measurement: {measured.reason}",),
    )


def env_file(decision: Decision) -> str:
    """The decision as a systemd EnvironmentFile: the NCCL variables, and the server flags in
    GPUHOST_P2P_SERVER_ARGS (the unit passes it unquoted, so systemd splits it into words)."""
    lines = [f"# Written by gpuhost's P2P check: P2P {decision.p2p}: {decision.reason}"]
    lines += [f"{k}={v}" for k, v in sorted(decision.env.items())]
    lines.append(f"GPUHOST_P2P_SERVER_ARGS={' '.join(decision.server_args)}")
    return "\n".join(lines) + "\n"
