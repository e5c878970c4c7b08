"""The GPUs' architecture against what is built for them: their compute capability as nvidia-smi
reports it once the driver answers, and the machine code (ELF cubins) a built wheel carries, as
the CUDA toolkit's ``cuobjdump --list-elf`` lists it."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from typing import Final

from pyinfra.api.exceptions import OperationError

#: nvidia-smi's query for the compute capability alone: one line per GPU, "major.minor"
#: (tests/fixtures/h200-device/nvidia-smi-compute-cap.txt: "9.0" on an H200).
COMPUTE_CAP_QUERY: Final = "nvidia-smi --query-gpu=compute_cap --format=csv,noheader"

#: A line of ``cuobjdump --list-elf``: "ELF file    4: libtorch_nvshmem.4.sm_90.cubin"
#: (tests/fixtures/h200-device/cuobjdump-list-elf.txt, CUDA 13.0's cuobjdump 13.0.85). nvcc's
#: arch- and family-specific targets carry a letter (sm_90a, sm_100f: the CUDA Compiler Driver
#: NVCC guide, "GPU Feature List").
_ELF_LINE: Final = re.compile(r"^ELF file\s+\d+:\s+(\S+)\.(sm_\d+[a-z]?)\.cubin$")
#: What cuobjdump says, with exit status 255, of a file without device code (same fixture).
NO_DEVICE_CODE: Final = "does not contain device code"
#: Separators of the wheel check's output (see :func:`wheel_check_command`).
_FILE_MARK: Final = "--- file "
_RC_MARK: Final = "--- rc="


class ArchitectureError(OperationError):
    """GPUs or a wheel that do not match the compute capability the host is built for."""


def parse_compute_caps(text: str) -> list[str]:
    """The compute capabilities in :data:`COMPUTE_CAP_QUERY`'s output, one per GPU, in order
    ("9.0"). Raises ArchitectureError naming a line that is not "major.minor" (nvidia-smi's
    own errors, such as "No devices were found")."""
    caps = []
    for line in text.splitlines():
        value = line.strip()
        if not value:
            continue
        if not re.fullmatch(r"\d+\.\d+", value):
            raise ArchitectureError(f"nvidia-smi answers {value!r} instead of a compute capability")
        caps.append(value)
    return caps


def check_compute_capability(caps: list[str], wanted: str) -> None:
    """Refuse GPUs whose compute capability is not host data's ``gpuhost_compute_capability``
    (``wanted``, "12.0"): what flash-attn is built for comes from host data. Raises
    ArchitectureError naming both values and the key to change; also for no GPU listed."""
    if not caps:
        raise ArchitectureError("nvidia-smi lists no GPU: cannot check "
                                f"gpuhost_compute_capability = {wanted!r}")
    found = sorted(set(caps))
    if found != [wanted]:
        raise ArchitectureError(
            f"the GPUs have compute capability {', '.join(found)} (nvidia-smi), host data says "
            f"gpuhost_compute_capability = {wanted!r}: set gpuhost_compute_capability = "
            f"{found[-1]!r} in the inventory (nothing was built for {wanted})")


def parse_list_elf(text: str) -> tuple[str, ...]:
    """The architectures of the ELF cubins ``cuobjdump --list-elf`` lists, in order and without
    repeats: ("sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"). Lines of another form are
    ignored (cuobjdump prints nothing else on success)."""
    found: list[str] = []
    for line in text.splitlines():
        match = _ELF_LINE.match(line.strip())
        if match and match.group(2) not in found:
            found.append(match.group(2))
    return tuple(found)


def runs_on(sm: str, arch: str) -> bool:
    """Whether machine code for ``sm`` ("sm_120", "sm_90a") is for the architecture number
    ``arch`` ("120", FLASH_ATTN_CUDA_ARCHS's form)."""
    return re.fullmatch(rf"sm_{re.escape(arch)}[a-z]?", sm) is not None


def wheel_check_command(python: str, wheel: str, cuobjdump: str) -> str:
    """A shell command that unpacks a wheel's shared objects into a temporary folder (removed
    after) with ``python``'s zipfile and runs ``cuobjdump --list-elf`` on each, printing for
    each "--- file <name in the wheel>", cuobjdump's output (stdout and stderr) and
    "--- rc=<exit status>". Fails (exit 1) where ``cuobjdump`` is not there."""
    unpack = ("import re, sys, zipfile; z = zipfile.ZipFile(sys.argv[1]); "
              "[z.extract(n, sys.argv[2]) for n in z.namelist() "
              "if re.search(r'\\.so(\\.|$)', n.rsplit('/', 1)[-1])]")
    q = shlex.quote
    return (f"test -x {q(cuobjdump)} || {{ echo 'no {cuobjdump}' >&2; exit 1; }}; "
            f'd=$(mktemp -d) && trap \'rm -rf "$d"\' EXIT && '
            f'{q(python)} -c {q(unpack)} {q(wheel)} "$d" && '
            f'(cd "$d" && find . -type f | sort) | while read -r f; do '
            f'echo "{_FILE_MARK}${{f#./}}"; {q(cuobjdump)} --list-elf "$d/$f" 2>&1; '
            f'echo "{_RC_MARK}$?"; done')


@dataclass(frozen=True)
class WheelCode:
    """The machine code in a wheel: each shared object's cubin architectures (empty for one
    without device code)."""

    objects: dict[str, tuple[str, ...]]

    def architectures(self) -> tuple[str, ...]:
        return tuple(sorted({sm for sms in self.objects.values() for sm in sms},
                            key=lambda sm: int(re.sub(r"\D", "", sm))))


def parse_wheel_check(text: str) -> WheelCode:
    """Read :func:`wheel_check_command`'s output. Raises ArchitectureError for a cuobjdump that
    failed otherwise than for a file without device code."""
    objects: dict[str, tuple[str, ...]] = {}
    name, lines = None, []
    for line in text.splitlines():
        if line.startswith(_FILE_MARK):
            name, lines = line[len(_FILE_MARK):], []
        elif line.startswith(_RC_MARK) and name is not None:
            rc, out = line[len(_RC_MARK):].strip(), "\n".join(lines)
            if rc == "0":
                objects[name] = parse_list_elf(out)
            elif NO_DEVICE_CODE in out:
                objects[name] = ()
            else:
                raise ArchitectureError(f"cuobjdump --list-elf {name} failed (exit status "
                                        f"{rc}): {out.strip()}")
            name = None
        elif name is not None:
            lines.append(line)
    return WheelCode(objects)


def check_wheel_code(wheel: str, code: WheelCode, arch: str) -> None:
    """Refuse a wheel none of whose shared objects has machine code for ``arch`` ("120").
    Raises ArchitectureError naming the wheel, the architectures it has and the one needed."""
    if any(runs_on(sm, arch) for sm in code.architectures()):
        return
    has = ", ".join(code.architectures()) or "no machine code"
    objects = ", ".join(code.objects) or "no shared object"
    raise ArchitectureError(f"{wheel} has {has} ({objects}), the GPUs need sm_{arch}")
