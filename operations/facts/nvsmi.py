"""Parsers for nvidia-smi's outputs: GPUs, driver state, topology and P2P status.

Formats follow the real tool's output (driver 580.159.04, ../shared/fixtures/h200-1gpu and
tests/fixtures/). Standard library only: the host-side P2P script ships this module too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

#: Fields asked of ``nvidia-smi --query-gpu``, in this order (``nvidia-smi
#: --help-query-gpu`` names them; all exist in driver 525 and newer).
QUERY_FIELDS: Final = (
    "index",
    "name",
    "uuid",
    "pci.bus_id",
    "driver_version",
    "memory.total",
    "power.limit",
    "clocks.max.sm",
    "compute_cap",
)

_ANSI: Final = re.compile(r"\x1b\[[0-9;]*m")
_RC: Final = re.compile(r"^rc=(\d+)$")


class ParseError(ValueError):
    """An output that does not parse; says which command and which line."""


@dataclass(frozen=True)
class Gpu:
    """One GPU as nvidia-smi reports it.

    Units: ``memory_mib`` in MiB, ``power_limit_w`` in W, ``max_sm_clock_mhz`` in MHz;
    ``compute_capability`` as "major.minor" (for example "12.0" for SM120).
    """

    index: int
    name: str
    uuid: str
    pci_bus_id: str
    driver_version: str
    memory_mib: int
    power_limit_w: float | None
    max_sm_clock_mhz: int | None
    compute_capability: str


@dataclass(frozen=True)
class DriverState:
    """What nvidia-smi says of the driver.

    ``status`` is one of:

    - ``absent``: no nvidia-smi on the host;
    - ``not-loaded``: nvidia-smi present, no kernel module answers (exit 9);
    - ``mismatch``: the loaded kernel module differs from the user-space library (exit 18),
      ``library_version`` then holds NVML's version (for example "580.105");
    - ``ok``: ``gpus`` lists every GPU, ``driver_version`` is the loaded driver's;
    - ``error``: anything else, ``message`` holds nvidia-smi's words.
    """

    status: str
    driver_version: str | None = None
    library_version: str | None = None
    gpus: tuple[Gpu, ...] = ()
    message: str = ""


def _optional_number(text: str) -> float | None:
    text = text.strip()
    if text in ("[N/A]", "N/A", "[Not Supported]", ""):
        return None
    return float(text)


def parse_query_gpu(lines: list[str]) -> tuple[Gpu, ...]:
    """Parse ``nvidia-smi --query-gpu=<QUERY_FIELDS> --format=csv,noheader,nounits``.

    One line per GPU, fields separated by ", " (fixture: query-gpu.txt). Raises
    :class:`ParseError` naming the first line that does not have every field.
    """
    gpus = []
    for line in lines:
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(", ")]
        if len(parts) != len(QUERY_FIELDS):
            raise ParseError(
                f"nvidia-smi --query-gpu: expected {len(QUERY_FIELDS)} fields, got "
                f"{len(parts)} in line {line!r}"
            )
        try:
            limit = _optional_number(parts[6])
            clock = _optional_number(parts[7])
            gpus.append(
                Gpu(
                    index=int(parts[0]),
                    name=parts[1],
                    uuid=parts[2],
                    pci_bus_id=parts[3],
                    driver_version=parts[4],
                    memory_mib=int(parts[5]),
                    power_limit_w=limit,
                    max_sm_clock_mhz=None if clock is None else int(clock),
                    compute_capability=parts[8],
                )
            )
        except ValueError as exc:
            raise ParseError(f"nvidia-smi --query-gpu: bad value in line {line!r}: {exc}") from exc
    return tuple(gpus)


def parse_driver_state(lines: list[str]) -> DriverState:
    """Parse the output of :class:`NvidiaDriver`'s command: nvidia-smi's output, then ``rc=N``.

    Messages as the real tool prints them: exit 9 "NVIDIA-SMI has failed because it couldn't
    communicate with the NVIDIA driver", exit 18 "Failed to initialize NVML: Driver/library
    version mismatch" followed by "NVML library version: 580.105".
    """
    if not lines or not _RC.match(lines[-1].strip()):
        raise ParseError(f"nvidia-smi: no exit status line in {lines[-1:]!r}")
    rc = int(_RC.match(lines[-1].strip()).group(1))  # type: ignore[union-attr]
    body = [line for line in lines[:-1] if line.strip()]
    text = "\n".join(body)
    if rc == 127:
        return DriverState("absent")
    if rc == 0:
        gpus = parse_query_gpu(body)
        version = gpus[0].driver_version if gpus else None
        return DriverState("ok", driver_version=version, gpus=gpus)
    if "version mismatch" in text:
        match = re.search(r"NVML library version:\s*(\S+)", text)
        return DriverState("mismatch", library_version=match.group(1) if match else None,
                           message=text)
    if "couldn't communicate with the NVIDIA driver" in text:
        return DriverState("not-loaded", message=text)
    return DriverState("error", message=text or f"nvidia-smi exited with {rc}")


#: P2P status codes of ``nvidia-smi topo -p2p``, from the tool's own legend.
P2P_CODES: Final = {
    "X": "Self",
    "OK": "Status Ok",
    "CNS": "Chipset not supported",
    "GNS": "GPU not supported",
    "TNS": "Topology not supported",
    "NS": "Not supported",
    "U": "Unknown",
}

#: Link types of ``nvidia-smi topo -m``, from the tool's own legend (NV# is NV1, NV2, ...).
LINK_TYPES: Final = ("X", "SYS", "NODE", "PHB", "PXB", "PIX")


@dataclass(frozen=True)
class GpuMatrix:
    """A GPU-by-GPU matrix read from ``nvidia-smi topo``: ``gpus`` are the header names
    ("GPU0", ...), ``cells[i][j]`` the code between GPU i and GPU j ("X" on the diagonal)."""

    gpus: tuple[str, ...]
    cells: tuple[tuple[str, ...], ...]

    def pairs(self) -> list[tuple[str, str, str]]:
        """Every unordered pair of distinct GPUs with its code; empty for a single GPU."""
        out = []
        for i, a in enumerate(self.gpus):
            for j in range(i + 1, len(self.gpus)):
                out.append((a, self.gpus[j], self.cells[i][j]))
        return out


def _show(row: list[str]) -> str:
    """A table row as the tool printed it (tab-separated, escape sequences removed), quoted."""
    return repr("\t".join(row).strip())


def _table_lines(lines: list[str], command: str) -> list[list[str]]:
    rows = []
    for raw in lines:
        line = _ANSI.sub("", raw)
        if line.startswith("$ ") or line.startswith("# rc="):
            continue
        if not line.strip():
            if rows:
                break
            continue
        if line.startswith("Legend"):
            break
        rows.append([cell.strip() for cell in line.split("\t")])
    if not rows:
        raise ParseError(f"{command}: no matrix in the output")
    return rows


def parse_p2p_matrix(lines: list[str], command: str = "nvidia-smi topo -p2p r") -> GpuMatrix:
    """Parse ``nvidia-smi topo -p2p r|w|n|a|p``: a tab-separated matrix whose header is
    underlined with ESC[4m ... ESC[0m, then a legend (fixture: topo-p2p.txt).

    Raises :class:`ParseError` naming the command and the first line that is not a row of
    known status codes.
    """
    rows = _table_lines(lines, command)
    header = [c for c in rows[0] if c]
    if not header or not all(re.fullmatch(r"GPU\d+", c) for c in header):
        raise ParseError(f"{command}: bad header line {_show(rows[0])}")
    cells = []
    for n, row in enumerate(rows[1:]):
        values = [c for c in row if c]
        if len(values) != len(header) + 1 or values[0] != header[n]:
            raise ParseError(f"{command}: bad line {_show(row)}")
        codes = values[1:]
        if any(code not in P2P_CODES for code in codes):
            raise ParseError(f"{command}: unknown status code in line {_show(row)}")
        cells.append(tuple(codes))
    if len(cells) != len(header):
        raise ParseError(f"{command}: {len(header)} GPUs in the header, {len(cells)} rows")
    return GpuMatrix(tuple(header), tuple(cells))


@dataclass(frozen=True)
class Topology:
    """``nvidia-smi topo -m``: the link matrix between GPUs and each GPU's CPU and NUMA
    affinity (strings as printed, for example "0-15" and "0", "N/A" where unknown)."""

    links: GpuMatrix
    cpu_affinity: tuple[str, ...]
    numa_affinity: tuple[str, ...]


def parse_topology(lines: list[str]) -> Topology:
    """Parse ``nvidia-smi topo -m`` (fixture: topo-m.txt). NIC rows and columns are ignored.

    Raises :class:`ParseError` naming the first line that does not parse.
    """
    command = "nvidia-smi topo -m"
    rows = _table_lines(lines, command)
    header = rows[0][1:] if rows[0] and rows[0][0] == "" else rows[0]
    gpu_cols = [i for i, c in enumerate(header) if re.fullmatch(r"GPU\d+", c)]
    gpus = [header[i] for i in gpu_cols]
    if not gpus:
        raise ParseError(f"{command}: bad header line {_show(rows[0])}")
    try:
        cpu_col = header.index("CPU Affinity")
        numa_col = header.index("NUMA Affinity")
    except ValueError as exc:
        raise ParseError(f"{command}: no affinity columns in {_show(rows[0])}") from exc
    cells, cpus, numas = [], [], []
    for row in rows[1:]:
        if not row or not re.fullmatch(r"GPU\d+", row[0]):
            continue
        values = row[1:]
        if len(values) <= max(numa_col, gpu_cols[-1]):
            raise ParseError(f"{command}: bad line {_show(row)}")
        links = tuple(values[i] for i in gpu_cols)
        for link in links:
            if link not in LINK_TYPES and not re.fullmatch(r"NV\d+", link):
                raise ParseError(f"{command}: unknown link type {link!r} in line {_show(row)}")
        cells.append(links)
        cpus.append(values[cpu_col])
        numas.append(values[numa_col])
    if len(cells) != len(gpus):
        raise ParseError(f"{command}: {len(gpus)} GPUs in the header, {len(cells)} rows")
    return Topology(GpuMatrix(tuple(gpus), tuple(cells)), tuple(cpus), tuple(numas))
