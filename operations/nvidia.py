"""Manage NVIDIA's CUDA apt repository, the driver (open kernel modules) and the CUDA toolkit."""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from io import StringIO
from pathlib import Path
from typing import Final

from packaging.version import Version
from pyinfra import host, logger
from pyinfra.api import FactBase, FunctionCommand, StringCommand, deploy, operation
from pyinfra.api.exceptions import OperationError, OperationValueError
from pyinfra.facts.deb import DebPackages
from pyinfra.facts.server import Arch, LinuxDistribution
from pyinfra.facts.systemd import SystemdEnabled, SystemdStatus
from pyinfra.operations import apt, files, server, systemd
from pyinfra.operations.util import any_changed
from typing_extensions import override

from operations import REPO_ROOT
from operations import driver_lock, driver_rollback, proxy, remote, roll
from operations.apt_simulation import DriverSimulation
from operations.gpu import NvidiaDriver
from operations.host import AptListsPresent, DpkgInterrupted, FileText, HeldPackages
from operations.nvsmi import DriverState
from operations.package_runs import dpkg_finished, lists_updated
from operations.plan import PlanError, fact, refuse
from operations.reboot import reboot
from operations.secureboot import dkms_signing, secure_boot_signing
from operations.settings import CUDA_MIN_DRIVER, Settings

#: NVIDIA's repository folder per (os-release ID, VERSION_ID) and per machine architecture
#: (https://developer.download.nvidia.com/compute/cuda/repos/: ubuntu2404/x86_64, .../sbsa).
REPO_DISTROS: Final = {
    ("ubuntu", "24.04"): "ubuntu2404",
    ("ubuntu", "22.04"): "ubuntu2204",
    ("debian", "12"): "debian12",
}
REPO_ARCHES: Final = {"x86_64": "x86_64", "aarch64": "sbsa"}

KEYRING: Final = "/usr/share/keyrings/cuda-archive-keyring.gpg"
#: What fetching the repository's key needs on a minimal image (pyinfra's files.download runs
#: curl or wget on the host), and lspci, which says which kernel driver holds each GPU.
PREREQUISITES: Final = ("ca-certificates", "curl", "pciutils")

#: The packages of each driver flavour in NVIDIA's repository, per distribution family, and
#: the one that carries the kernel module (its version is the installed driver's). Debian's
#: follow Debian's packaging, which NVIDIA's debian12 repository ships (nvidia-kernel-open-dkms
#: 580.95.05-1; sandbox/data/nvidia-graphics-drivers.json): its nvidia-driver only recommends
#: nvidia-smi, and the install leaves recommends out, so the compute packages are named.
#: Ubuntu's follow Ubuntu's naming, which NVIDIA's ubuntu2404 and ubuntu2204 repositories share
#: (nvidia-dkms-580-open 580.95.05-0ubuntu1, packages.ubuntu.com; nvidia-smi is in
#: nvidia-utils-580); from branch 590 NVIDIA drops the branch from those names (nvidia-dkms-open,
#: libnvidia-compute: NVIDIA's driver installation guide, "Ubuntu 590 and later packages"):
#: "{-branch}" is "-580" up to branch 580 and nothing from 590 (:func:`driver_package_names`).
DRIVER_PACKAGES: Final = {
    ("debian", "open"): (("nvidia-open", "nvidia-smi", "libcuda1"), "nvidia-kernel-open-dkms"),
    ("debian", "proprietary"): (("nvidia-driver", "nvidia-smi", "libcuda1"),
                                "nvidia-kernel-dkms"),
    ("ubuntu", "open"): (("nvidia-open", "nvidia-utils{-branch}", "libnvidia-compute{-branch}"),
                         "nvidia-dkms{-branch}-open"),
    ("ubuntu", "proprietary"): (("nvidia-driver{-branch}", "nvidia-utils{-branch}",
                                 "libnvidia-compute{-branch}"), "nvidia-dkms{-branch}"),
}
#: The first branch whose Ubuntu packages carry no branch in their names (see above).
UNBRANCHED_NAMES_FROM: Final = 590
#: Any installed kernel-module package of a flavour, whatever its branch.
MODULE_PACKAGE_NAMES: Final = {
    "open": re.compile(r"nvidia-kernel-open-dkms|nvidia-dkms(-\d+)?-open"),
    "proprietary": re.compile(r"nvidia-kernel-dkms|nvidia-dkms(-\d+)?"),
}
def driver_package_names(folder: str, flavour: str, branch: str) -> tuple[list[str], str]:
    """The driver packages to install and the kernel-module package, for a repository folder
    ("ubuntu2404/x86_64"), a flavour ("open") and a branch ("580")."""
    family = "ubuntu" if folder.startswith("ubuntu") else "debian"
    packages, module = DRIVER_PACKAGES[(family, flavour)]
    suffix = "" if int(branch) >= UNBRANCHED_NAMES_FROM else f"-{branch}"
    return ([p.replace("{-branch}", suffix) for p in packages],
            module.replace("{-branch}", suffix))


#: The server unit (operations/server.py) that must never run across a driver change.
SERVER_UNIT: Final = "sglang.service"

#: The server unit's drop-in this stage writes (templates/sglang-driver-gate.conf).
DRIVER_GATE_DROPIN: Final = "10-gpuhost-driver-gate.conf"
#: What a rolling host's driver change is called in the roll (operations/roll.py in_turn).
DRIVER_CHANGE: Final = "the driver change"

#: PCI vendor id of NVIDIA, and the PCI class of display controllers (0300 VGA, 0302 3D):
#: the GPUs, as opposed to the HDMI audio functions of the same cards (pci.ids).
NVIDIA_VENDOR: Final = "10de"


def repo_folder(os_id: str, version_id: str, arch: str) -> str:
    """The repository folder for an OS and architecture, for example "ubuntu2404/x86_64".

    Raises PlanError for an OS or architecture NVIDIA's repository does not serve.
    """
    distro = REPO_DISTROS.get((os_id, version_id))
    if distro is None:
        known = ", ".join(f"{i} {v}" for i, v in REPO_DISTROS)
        raise PlanError(f"no NVIDIA CUDA repository for {os_id} {version_id}; "
                        f"supported: {known}")
    if arch not in REPO_ARCHES:
        raise PlanError(f"no NVIDIA CUDA repository for {arch}; "
                        f"supported: {', '.join(REPO_ARCHES)}")
    return f"{distro}/{REPO_ARCHES[arch]}"


def source_file(folder: str) -> str:
    """The source list of the repository: the file name NVIDIA's cuda-keyring package uses
    (/etc/apt/sources.list.d/cuda-ubuntu2404-x86_64.list), so that both never make two
    entries."""
    return f"/etc/apt/sources.list.d/cuda-{folder.replace('/', '-')}.list"


def driver_version_glob(settings: Settings) -> str:
    """The apt version pattern of the wanted driver: "580.95.05-*" for an exact version,
    "580.*" for the newest of a branch."""
    if settings.driver_version:
        return f"{settings.driver_version}-*"
    return f"{settings.driver_branch}.*"


def toolkit_package(cuda: str) -> str:
    """NVIDIA's package name of a CUDA toolkit: "12.8" gives "cuda-toolkit-12-8"."""
    return "cuda-toolkit-" + cuda.replace(".", "-")


def renamed_packages(folder: str, flavour: str, installed: tuple[str, ...],
                     debs: dict[str, list[str]], wanted: list[str]) -> list[str]:
    """The installed driver packages that a change to ``wanted`` replaces under other names:
    those of the installed branch (read from the kernel-module package's ``installed``
    versions) that ``wanted`` does not name, on Ubuntu across 590's rename ("nvidia-utils-580"
    when "nvidia-utils" comes); none where the names stay."""
    gone: list[str] = []
    for version in installed:
        branch = upstream(version).split(".")[0]
        if not branch.isdigit():
            continue
        old, old_module = driver_package_names(folder, flavour, branch)
        gone += [n for n in (*old, old_module) if n in debs and n not in wanted and n not in gone]
    return gone


def installed_module_package(flavour: str, debs: dict[str, list[str]],
                             module_package: str) -> str:
    """The kernel-module package installed now: ``module_package`` where it is, else the
    installed one of another name (on Ubuntu, a branch before 590's rename:
    "nvidia-dkms-580-open" when "nvidia-dkms-open" comes); ``module_package`` when none is.
    What a rollback checks the loaded driver against, once it has reinstalled that one."""
    if module_package in debs:
        return module_package
    return next((name for name in sorted(debs)
                 if MODULE_PACKAGE_NAMES[flavour].fullmatch(name)), module_package)


def upstream(version: str) -> str:
    """A Debian package version without epoch and revision: "580.95.05-1" gives "580.95.05"."""
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


# --- facts -------------------------------------------------------------------------------------


#: Where DKMS installs a module it built for a kernel on Debian and Ubuntu (dkms(8):
#: DEST_MODULE_LOCATION is ignored there for the distribution's /updates/dkms; DKMS says
#: "Installing to /lib/modules/<kernel>/updates/dkms/"), compressed on Ubuntu (nvidia.ko.zst).
DKMS_MODULE: Final = "/lib/modules/{kernel}/updates/dkms/nvidia.ko"


@dataclass(frozen=True)
class Headers:
    """The running kernel (``uname -r``), whether its build tree
    (/lib/modules/<kernel>/build, what DKMS compiles against) exists, and, where it does not,
    apt's candidate for ``linux-headers-<kernel>`` (None: apt knows no installable version, or
    not asked: ``apt-cache policy`` loads apt's whole cache, 0.41 s of a sandbox host's CPU at
    each no-op run, docs/development.md).

    ``next_kernel``: the kernel that boots next where it is not the running one (a newer
    ``linux-image`` installed, not booted yet), else None; the same ``next_build_tree`` and
    ``next_candidate`` for it; ``next_module``: DKMS installed an NVIDIA module for it
    (:data:`DKMS_MODULE`); ``grub_default``: GRUB_DEFAULT of /etc/default/grub, if set."""

    kernel: str
    build_tree: bool
    candidate: str | None
    next_kernel: str | None = None
    next_build_tree: bool = False
    next_candidate: str | None = None
    next_module: bool = False
    grub_default: str | None = None


class KernelHeaders(FactBase[Headers]):
    """Headers for the running kernel and for the kernel that boots next, installed or
    installable.

    .. code:: python

        Headers(kernel="6.1.0-26-amd64", build_tree=False, candidate="6.1.112-1",
                next_kernel="6.1.0-28-amd64", next_build_tree=False,
                next_candidate="6.1.119-1", next_module=False, grub_default="0")

    The kernel that boots next is the newest /boot/vmlinuz-* by ``LC_ALL=C sort -V``: GRUB
    boots its default entry (GRUB_DEFAULT=0, Debian's and Ubuntu's default: the first), and
    update-grub, run by every kernel package's hooks, makes the first entry of the newest
    kernel (grub-mkconfig's 10_linux: ``version_sort -r`` of the images, *.dpkg-* left out).
    DKMS's own postinst picks the same kernel to build for (dkms_common.postinst: the running
    and the newest installed kernel).
    """

    @override
    def command(self) -> str:
        return (
            'k=$(uname -r); echo "kernel=$k"; '
            'if [ -e "/lib/modules/$k/build" ]; then echo build=yes; else echo build=no; '
            "if command -v apt-cache >/dev/null 2>&1; then "
            'apt-cache policy "linux-headers-$k" 2>/dev/null '
            "| sed -n 's/^ *Candidate: */candidate=/p'; fi; fi; "
            "n=$(ls -1 /boot/vmlinuz-* 2>/dev/null | sed 's|^/boot/vmlinuz-||' "
            "| grep -v '[.]dpkg-' | LC_ALL=C sort -V | tail -n 1); "
            'if [ -n "$n" ] && [ "$n" != "$k" ]; then echo "next=$n"; '
            'if [ -e "/lib/modules/$n/build" ]; then echo next_build=yes; '
            "elif command -v apt-cache >/dev/null 2>&1; then "
            'apt-cache policy "linux-headers-$n" 2>/dev/null '
            "| sed -n 's/^ *Candidate: */next_candidate=/p'; fi; "
            'if ls "/lib/modules/$n/updates/dkms/"nvidia.ko* >/dev/null 2>&1; then '
            "echo next_module=yes; fi; fi; "
            "sed -n 's/^GRUB_DEFAULT=/grub_default=/p' /etc/default/grub 2>/dev/null "
            "| tail -n 1; true"
        )

    @override
    def process(self, output: list[str]) -> Headers:
        values = dict(line.split("=", 1) for line in output if "=" in line)

        def candidate(key: str) -> str | None:
            value = values.get(key, "").strip()
            return None if value in ("", "(none)") else value

        return Headers(
            kernel=values.get("kernel", "").strip(),
            build_tree=values.get("build") == "yes",
            candidate=candidate("candidate"),
            next_kernel=values.get("next", "").strip() or None,
            next_build_tree=values.get("next_build") == "yes",
            next_candidate=candidate("next_candidate"),
            next_module=values.get("next_module") == "yes",
            grub_default=values.get("grub_default", "").strip().strip("\"'") or None,
        )


class AptVersions(FactBase["tuple[str, ...] | None"]):
    """The versions of a package that apt's lists offer (``apt-cache madison``), newest first;
    None where apt-cache is missing.

    .. code:: python

        ("580.105.08-1", "580.95.05-1", "570.172.08-1")

    madison's format (apt-cache(8)): one line per version and source,
    "nvidia-kernel-open-dkms | 580.95.05-1 | https://.../debian12/x86_64  Packages".
    """

    @override
    def command(self, package: str) -> str:
        return (f"if command -v apt-cache >/dev/null 2>&1; then "
                f"apt-cache madison {shlex.quote(package)} 2>/dev/null; echo rc=0; "
                "else echo rc=127; fi")

    @override
    def process(self, output: list[str]) -> tuple[str, ...] | None:
        return parse_madison(output)


def parse_madison(output: list[str]) -> tuple[str, ...] | None:
    """Parse :class:`AptVersions`' output: each version once, in apt's order; None for rc=127."""
    if output and output[-1].strip() == "rc=127":
        return None
    versions: list[str] = []
    for line in output:
        fields_ = [f.strip() for f in line.split("|")]
        if len(fields_) >= 3 and fields_[1] and fields_[1] not in versions:
            versions.append(fields_[1])
    return tuple(versions)


@dataclass(frozen=True)
class DriverFiles:
    """Where the driver on a host came from: the path of ``nvidia-smi`` (None: not on PATH), the
    package that installed it (None: no package did, as with NVIDIA's runfile or a driver mounted
    from the hypervisor), and the loaded kernel module's version from
    /proc/driver/nvidia/version (None: no module loaded)."""

    smi_path: str | None
    smi_package: str | None
    module_version: str | None

    @property
    def present(self) -> bool:
        return self.smi_path is not None or self.module_version is not None


class NvidiaDriverFiles(FactBase[DriverFiles]):
    """nvidia-smi's path and owning package (``dpkg-query -S``), and the loaded module's version.

    .. code:: python

        DriverFiles(smi_path="/usr/local/nvidia/bin/nvidia-smi", smi_package=None,
                    module_version="580.159.04")

    The module line is NVIDIA's: "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64
    580.159.04  Release Build ..." (../shared/fixtures/h200-1gpu/system.txt).
    """

    @override
    def command(self) -> str:
        return (
            "if p=$(command -v nvidia-smi 2>/dev/null); then echo \"smi=$p\"; "
            'r=$(readlink -f "$p"); '
            'echo "package=$(dpkg-query -S "$r" 2>/dev/null | grep -v "^diversion" '
            '| head -n 1 | cut -d: -f1)"; fi; '
            "if [ -r /proc/driver/nvidia/version ]; then "
            "sed -n 's/^NVRM version:.*  \\([0-9][0-9.]*\\)  .*/module=\\1/p' "
            "/proc/driver/nvidia/version; fi; echo ."
        )

    @override
    def process(self, output: list[str]) -> DriverFiles:
        values = dict(line.split("=", 1) for line in output if "=" in line)
        return DriverFiles(
            smi_path=values.get("smi") or None,
            smi_package=(values.get("package") or "").strip() or None,
            module_version=(values.get("module") or "").strip() or None,
        )


@dataclass(frozen=True)
class AptSource:
    """One apt source entry (sources.list(5)): the file it is in, its URI, and where it says so:
    ``line`` (1-based; of the ``URIs:`` field in a deb822 .sources stanza) and ``text`` (that
    line); its suite (``/`` for a flat repository such as NVIDIA's), its ``signed-by`` and
    ``trusted`` options (None: not given)."""

    file: str
    uri: str
    line: int = 0
    text: str = ""
    suite: str = "/"
    signed_by: str | None = None
    trusted: str | None = None

    @property
    def where(self) -> str:
        """"/etc/apt/sources.list.d/cuda-manual.list line 1: deb [...] https://... /"."""
        return f"{self.file} line {self.line}: {self.text.strip()}"


class AptSources(FactBase[list[AptSource]]):
    """Every enabled ``deb`` and ``deb-src`` entry of /etc/apt/sources.list,
    sources.list.d/*.list (one-line style) and sources.list.d/*.sources (deb822 style).

    .. code:: python

        [AptSource(file="/etc/apt/sources.list.d/cuda-debian12-x86_64.list",
                   uri="https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/",
                   line=1, text="deb [signed-by=/usr/share/keyrings/cuda-archive-keyring.gpg] "
                   "https://developer.download.nvidia.com/compute/cuda/repos/debian12/x86_64/ /",
                   suite="/", signed_by="/usr/share/keyrings/cuda-archive-keyring.gpg")]

    The command prints each file's lines but comments as ``file:line:text`` (grep -Hn); blank
    lines stay, they end deb822 stanzas.
    """

    default = list

    @override
    def command(self) -> str:
        return (
            "for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list "
            "/etc/apt/sources.list.d/*.sources; do "
            "[ -f \"$f\" ] && grep -Hn -v '^[[:space:]]*#' \"$f\"; done; true"
        )

    @override
    def process(self, output: list[str]) -> list[AptSource]:
        return parse_sources(output)


_SOURCE_LINE: Final = re.compile(r"^(/[^:]*):(\d+):(.*)$")


def parse_sources(output: list[str]) -> list[AptSource]:
    """Parse :class:`AptSources`' output (sources.list(5): one-line entries ``deb [ options ]
    uri suite [component...]``; deb822 stanzas with ``Types``, ``URIs``, ``Suites``,
    ``Signed-By`` (a path, fingerprints, or an embedded key on continuation lines),
    ``Trusted`` and ``Enabled: no``)."""
    entries: list[AptSource] = []
    stanza: dict[str, tuple[int, str, str]] = {}  # field (lower case) -> (line, text, value)
    stanza_file = ""
    last = ""

    def end_stanza() -> None:
        if not stanza:
            return
        types = stanza.get("types", (0, "", ""))[2].split()
        enabled = stanza.get("enabled", (0, "", "yes"))[2].strip().lower() != "no"
        if enabled and {"deb", "deb-src"} & set(types) and "uris" in stanza:
            line, text, uris = stanza["uris"]
            signed = stanza.get("signed-by")
            trusted = stanza.get("trusted")
            for uri in uris.split():
                for suite in stanza.get("suites", (0, "", ""))[2].split() or [""]:
                    entries.append(AptSource(
                        stanza_file, uri, line, text, suite,
                        signed[2].strip() if signed else None,
                        trusted[2].strip() if trusted else None))
        stanza.clear()

    for raw in output:
        match = _SOURCE_LINE.match(raw)
        if not match:
            continue
        path, number, text = match.group(1), int(match.group(2)), match.group(3)
        if path.endswith(".sources"):
            if path != stanza_file:
                end_stanza()
                stanza_file, last = path, ""
            if not text.strip():
                end_stanza()
            elif text[0] in " \t" and last:
                line, first, value = stanza[last]
                stanza[last] = (line, first, value + "\n" + text.strip())
            elif ":" in text:
                key, _, value = text.partition(":")
                last = key.strip().lower()
                stanza[last] = (number, text, value.strip())
            continue
        end_stanza()
        stanza_file = ""
        options: dict[str, str] = {}
        body = text.split("#", 1)[0]
        bracket = re.search(r"\[([^]]*)\]", body)
        if bracket:
            for option in bracket.group(1).split():
                key, _, value = option.partition("=")
                options[key.lower()] = value
            body = body[:bracket.start()] + " " + body[bracket.end():]
        words = body.split()
        if len(words) >= 3 and words[0] in ("deb", "deb-src"):
            entries.append(AptSource(path, words[1], number, text, words[2],
                                     options.get("signed-by"), options.get("trusted")))
    end_stanza()
    return entries


def same_source(a: str, b: str) -> bool:
    """Whether apt takes two source URIs for one source: the same but for the scheme and
    trailing slashes (seen with apt 2.6.1, Debian 12: an http:// and an https:// entry of one
    repository with different signed-by stop every apt command with "Conflicting values set
    for option Signed-By regarding source ...")."""
    def key(uri: str) -> str:
        return uri.split("://", 1)[-1].rstrip("/")
    return key(a) == key(b)


def signed_by_key(value: str | None) -> str:
    """A signed-by value as apt compares it (apt-pkg/deb/debmetaindex.cc NormalizeSignedBy:
    an embedded key as it is; else the comma- or space-separated keyrings and fingerprints,
    sorted, once each); "" for none."""
    if not value:
        return ""
    if "-----BEGIN" in value:
        return value.strip()
    return ",".join(sorted(set(re.split(r"[,\s]+", value.strip())) - {""}))


def _conflict(entry: AptSource, repo_url: str, how: str) -> str:
    differ = signed_by_key(entry.signed_by) != signed_by_key(KEYRING)
    what = ((f"signed-by={_short(entry.signed_by)}" if entry.signed_by else "no signed-by")
            if differ else f"trusted={entry.trusted}")
    return (f"NVIDIA's repository {repo_url} is already listed in {entry.where}. Its {what} "
            f"conflicts with the entry gpuhost writes (signed-by={KEYRING}): apt would read no "
            f"source at all (\"Conflicting values set for option "
            f"{'Signed-By' if differ else 'Trusted'} regarding source ...\"), so every later "
            f"apt command would fail. To go on, {how}")


def _short(signed_by: str) -> str:
    return "(an embedded key)" if "-----BEGIN" in signed_by else signed_by


@dataclass(frozen=True)
class SourcesCheck:
    """What :func:`check_sources` found: ``adopted`` the entries gpuhost uses as NVIDIA's
    repository instead of writing its own (gpuhost_cuda_repo_adopt), ``listed`` whether apt
    lists the repository now (gpuhost's own entry or an adopted one), ``refusals`` and
    ``warnings`` as in :class:`DriverPlan`."""

    adopted: tuple[AptSource, ...] = ()
    listed: bool = False
    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


def check_sources(sources: list[AptSource], repo_url: str, source_path: str,
                  adopt: bool) -> SourcesCheck:
    """Compare the host's apt entries for NVIDIA's repository with the one gpuhost writes in
    ``source_path`` (``deb [signed-by=KEYRING] repo_url /``; no side effects).

    apt refuses to read its sources at all when two entries of one source (its URI without the
    scheme, and its suite) differ in ``signed-by`` or ``trusted`` (apt 2.6.1: "E: Conflicting
    values set for option Signed-By regarding source ..."; "E: The list of sources could not be
    read."), and every later apt command fails. So an entry added by hand that would conflict
    with gpuhost's is refused, naming its file and line, unless ``adopt``: gpuhost then uses
    it as NVIDIA's repository and writes none of its own (removing one it wrote before). An
    entry that would not conflict (the same signed-by) is a duplicate apt only warns about.
    """
    ours = [s for s in sources if s.file == source_path]
    theirs = [s for s in sources if s.file != source_path and s.suite == "/"
              and same_source(s.uri, repo_url)]
    wanted = signed_by_key(KEYRING)
    conflicting = [s for s in theirs if signed_by_key(s.signed_by) != wanted or s.trusted]
    how = (f"remove that line (or the file), or set gpuhost_cuda_repo_adopt = True to use it "
           f"as NVIDIA's repository instead of gpuhost's {source_path}")
    if not theirs:
        warnings = ((f"gpuhost_cuda_repo_adopt is set but no entry lists NVIDIA's repository "
                     f"{repo_url}: gpuhost writes its own, {source_path}"),) if adopt else ()
        return SourcesCheck(listed=bool(ours), warnings=warnings)
    if adopt:
        keys = {(signed_by_key(s.signed_by), (s.trusted or "").lower()) for s in theirs}
        if len(keys) > 1:
            return SourcesCheck(refusals=(
                f"NVIDIA's repository {repo_url} is listed more than once with different "
                "signed-by or trusted options, and apt cannot read such sources: "
                + "; ".join(s.where for s in theirs)
                + ". Keep one of them (gpuhost_cuda_repo_adopt then uses it)",))
        warnings = [f"NVIDIA's repository is used as listed in {s.where} "
                    "(gpuhost_cuda_repo_adopt): gpuhost writes no entry of its own"
                    for s in theirs[:1]]
        if ours:
            warnings.append(f"{source_path}, gpuhost's own entry, is removed: it would list "
                            "the repository a second time")
        if any((s.trusted or "").lower() == "yes" for s in theirs):
            warnings.append("the adopted entry says trusted=yes: apt does not check the "
                            "repository's signatures")
        return SourcesCheck(adopted=tuple(theirs), listed=True, warnings=tuple(warnings))
    refusals = tuple(_conflict(s, repo_url, how) for s in conflicting)
    duplicates = sorted({s.file for s in theirs if s not in conflicting})
    warnings = ((f"NVIDIA's repository {repo_url} is also listed in {', '.join(duplicates)}: "
                 f"a second entry of the one in {source_path}; remove it by hand (apt warns "
                 "of targets configured twice)"),) if duplicates else ()
    return SourcesCheck(listed=bool(ours), refusals=refusals, warnings=warnings)


@dataclass(frozen=True)
class PciGpu:
    """One NVIDIA display controller as ``lspci -Dnnk`` shows it: PCI address
    ("0000:01:00.0") and the kernel driver in use (None: no driver bound)."""

    address: str
    driver: str | None


class PciGpus(FactBase["tuple[PciGpu, ...] | None"]):
    """NVIDIA GPUs on the PCI bus and their kernel driver, from ``lspci -Dnnk -d 10de:``; None
    where lspci is not installed (pciutils).

    .. code:: python

        (PciGpu(address="0000:01:00.0", driver="nouveau"),)

    lspci's format (pciutils, lspci(8)): a device line "0000:01:00.0 3D controller [0302]:
    NVIDIA Corporation GH100 [H200 SXM 141GB] [10de:2335] (rev a1)", then tab-indented lines,
    among them "Kernel driver in use: nvidia". Only class 03xx (display controllers) count.
    """

    @override
    def command(self) -> str:
        return (f"if command -v lspci >/dev/null 2>&1; then lspci -Dnnk -d {NVIDIA_VENDOR}: ; "
                'echo "rc=$?"; else echo rc=127; fi')

    @override
    def process(self, output: list[str]) -> tuple[PciGpu, ...] | None:
        return parse_lspci(output)


def parse_lspci(output: list[str]) -> tuple[PciGpu, ...] | None:
    """Parse :class:`PciGpus`' output (``lspci -Dnnk`` lines, then ``rc=N``); None for rc=127."""
    if output and output[-1].strip() == "rc=127":
        return None
    gpus: list[PciGpu] = []
    current: str | None = None
    driver: str | None = None
    for line in output:
        if re.match(r"^[0-9a-fA-F]{4}:[0-9a-fA-F]{2}:", line):
            if current:
                gpus.append(PciGpu(current, driver))
            current = line.split()[0] if re.search(r"\[03[0-9a-fA-F]{2}\]:", line) else None
            driver = None
        elif current and line.strip().startswith("Kernel driver in use:"):
            driver = line.split(":", 1)[1].strip() or None
    if current:
        gpus.append(PciGpu(current, driver))
    return tuple(gpus)


# --- the plan ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class DriverPlan:
    """What the nvidia stage will do on one host, decided from facts before any change.

    ``installed``: the kernel-module package's installed versions; ``target``: the apt version
    pattern host data asks for; ``install``: the driver packages will be installed or changed;
    ``change``: an installed driver changes version (an upgrade or a downgrade);
    ``reboot_reasons``: why a reboot follows (empty: none); ``refusals``: why the stage must not
    run (empty: it may); ``warnings``: what is reported and left alone; ``keep_present``: a
    driver no package installed is used as it is; ``present``: the version nvidia-smi or
    /proc/driver/nvidia reports, if any; ``adopted``: the host's own entries of NVIDIA's
    repository used instead of gpuhost's (:func:`check_sources`); ``repo_listed``: apt lists
    the repository now; ``kernel``: the running kernel; ``next_kernel``: the kernel that boots
    next where it is not the running one and the driver's module must be built for it too
    (``next_module``: DKMS has built it); ``next_headers_unknown``: whether apt can install its
    headers is known only once NVIDIA's repository is in apt's lists.
    """

    installed: tuple[str, ...]
    target: str
    install: bool
    change: bool
    toolkit_installed: str | None
    toolkit_target: str
    reboot_reasons: tuple[str, ...] = ()
    refusals: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()
    keep_present: bool = False
    headers_unknown: bool = False
    present: str | None = None
    adopted: tuple[AptSource, ...] = ()
    repo_listed: bool = False
    kernel: str = ""
    next_kernel: str | None = None
    next_module: bool = False
    next_headers_unknown: bool = False

    def summary(self, resolved: str | None = None) -> str:
        """One line for the log and --dry: installed and target versions, what follows;
        ``resolved``: the version apt's simulation would install ("590.44.01-1"), if known."""
        driver = ", ".join(upstream(v) for v in self.installed) or "none"
        if self.keep_present:
            driver = f"{self.present or 'of unknown version'} by no package (kept)"
        tk = upstream(self.toolkit_installed) if self.toolkit_installed else "none"
        target = self.target.rstrip("-*") if self.target.endswith("-*") else (
            f"newest {self.target}")
        if resolved and not self.target.endswith("-*"):
            target += f" ({resolved} in apt's lists)"
        follows = []
        if self.reboot_reasons:
            into = f" into kernel {self.next_kernel}" if self.next_kernel else ""
            follows.append(f"a reboot{into} ({'; '.join(self.reboot_reasons)}) and a server "
                           "restart")
        line = (f"driver installed {driver}, target {target}"
                f"{' (a driver change)' if self.change else ''}; CUDA toolkit installed {tk}, "
                f"target {self.toolkit_target}")
        if self.next_kernel:
            line += (f"; kernel {self.next_kernel} boots next (installed, not running yet): its "
                     "headers and the NVIDIA module for it as well as for the running "
                     f"{self.kernel}" + (" (its module built already)" if self.next_module
                                         else ""))
        return line + ("; then " + ", ".join(follows) if follows else "; no reboot")


def plan_driver(
    settings: Settings,
    *,
    debs: dict[str, list[str]],
    state: DriverState,
    files_: DriverFiles,
    headers: Headers,
    gpus: tuple[PciGpu, ...] | None,
    sources: list[AptSource],
    repo_url: str,
    source_path: str,
    lists_present: bool,
    folder: str = "debian12/x86_64",
    available: tuple[str, ...] | None = None,
) -> DriverPlan:
    """Decide the nvidia stage from a host's facts (no side effects; units: none).

    Refuses: an entry of NVIDIA's repository added by hand that apt could not read beside
    gpuhost's (:func:`check_sources`; adopted instead with ``gpuhost_cuda_repo_adopt``); an
    installed driver other than the one host data asks for, unless
    ``gpuhost_allow_driver_change``; a driver no package installed, unless
    ``gpuhost_unpackaged_driver`` says "keep" or "replace"; a driver install when the running
    kernel has no headers and apt offers none (DKMS could not build the module: the host would
    come back from its reboot without a driver), and the same for the kernel that boots next
    (a newer one installed, not booted: :class:`KernelHeaders`) when this run reboots (a
    warning otherwise); a driver install when apt's lists of NVIDIA's
    repository (``available``: the kernel-module package's versions, apt-cache madison; None
    when the repository is not configured yet, and then the install checks it) have no version
    host data asks for: apt would ignore the pin and install the branch's newest. Reboots when
    the loaded module is not the installed one (nvidia-smi: "Driver/library version
    mismatch"), when no module is loaded although the packages are installed, after an
    install, and when nouveau holds a GPU.
    """
    packages, module_package = driver_package_names(folder, settings.driver_flavour,
                                                    settings.driver_branch)
    installed = tuple(sorted(v for name, versions in debs.items()
                             if MODULE_PACKAGE_NAMES[settings.driver_flavour].fullmatch(name)
                             for v in versions))
    target = driver_version_glob(settings)
    toolkit = toolkit_package(settings.cuda_toolkit)
    tk_versions = sorted(debs.get(toolkit) or ())
    refusals: list[str] = []
    warnings: list[str] = []
    reasons: list[str] = []

    listing = check_sources(sources, repo_url, source_path, settings.cuda_repo_adopt)
    refusals.extend(listing.refusals)
    warnings.extend(listing.warnings)
    if "nvidia-cuda-toolkit" in debs:
        warnings.append("the distribution's nvidia-cuda-toolkit is installed: its nvcc is not "
                        f"the one builds use ({settings.cuda_home}/bin/nvcc); remove it")

    unpackaged = files_.present and not installed and (
        files_.smi_package is None or state.status == "absent")
    keep = False
    if unpackaged:
        what = (f"nvidia-smi at {files_.smi_path}" if files_.smi_path
                else "no nvidia-smi") + (
            f", kernel module {files_.module_version} loaded" if files_.module_version else "")
        if settings.unpackaged_driver == "keep":
            keep = True
            warnings.append(f"a driver no package installed is present ({what}): kept as it is "
                            "(gpuhost_unpackaged_driver = 'keep')")
        elif settings.unpackaged_driver == "refuse":
            refusals.append(
                f"a driver no package installed is present ({what}: a runfile install, or "
                "mounted from the hypervisor). Installing NVIDIA's packages over it could leave "
                "the host without a working driver. Set gpuhost_unpackaged_driver = 'keep' to "
                "use it as it is, or 'replace' to install NVIDIA's packages over it "
                "(uninstall a runfile driver first: nvidia-uninstall)")
    elif files_.smi_package and not installed:
        warnings.append(
            f"nvidia-smi comes from the package {files_.smi_package}, not with NVIDIA's "
            f"repository's {module_package}: apt resolves the two drivers' packages")
    if keep:
        loaded = state.driver_version or files_.module_version
        minimum = CUDA_MIN_DRIVER[settings.cuda_toolkit]
        if loaded and Version(loaded) < Version(minimum):
            refusals.append(
                f"the present driver {loaded} is older than {minimum}, the minimum for CUDA "
                f"{settings.cuda_toolkit} (gpuhost_cuda_toolkit): upgrade it where it comes "
                "from, or set gpuhost_unpackaged_driver = 'replace'")

    change = bool(installed) and not any(fnmatch.fnmatch(v, target) for v in installed)
    if change and not settings.allow_driver_change:
        refusals.append(
            f"driver {', '.join(upstream(v) for v in installed)} is installed, host data asks "
            f"for {target} (gpuhost_driver_branch, gpuhost_driver_version). A driver change "
            "reboots the host and restarts the server: set gpuhost_allow_driver_change = True "
            "for this run to allow it")
    # The metapackage and the module decide whether the driver is installed (and a reboot
    # follows); a compute package missing beside them (nvidia-smi, which hosts converged before
    # it was named may lack) installs at the pinned version without one.
    install = not keep and (change or any(p not in debs for p in (packages[0], module_package)))

    configured = lists_present and listing.listed
    if install and configured and available is not None and not any(
            fnmatch.fnmatch(v, target) for v in available):
        offered = [upstream(v) for v in available
                   if upstream(v).startswith(f"{settings.driver_branch}.")] or [
            upstream(v) for v in available]
        refusals.append(
            f"NVIDIA's repository has no {module_package} {target} (gpuhost_driver_branch, "
            f"gpuhost_driver_version): it has {', '.join(offered) or 'no version of it'}. apt "
            "would install another driver than the one pinned: set gpuhost_driver_version to "
            "one it has, or None for the branch's newest")

    headers_unknown = False
    headers_package = f"linux-headers-{headers.kernel}"
    have_headers = headers.build_tree or headers_package in debs
    if install and not have_headers and headers.candidate is None:
        if configured:
            refusals.append(
                f"no kernel headers for the running kernel {headers.kernel}: apt has no "
                f"installable {headers_package}, so DKMS cannot build the NVIDIA module and the "
                "host would come back from its reboot without a driver. Install the headers, "
                "or boot a kernel whose headers the archive still has, then run again")
        else:
            headers_unknown = True

    if not keep:
        if install:
            reasons.append("the driver is installed or changed: its module loads at boot")
        elif state.status == "mismatch":
            reasons.append(f"the loaded module is not the installed driver (NVML "
                           f"{state.library_version}: driver/library version mismatch)")
        elif state.status == "not-loaded":
            reasons.append("the installed driver's module is not loaded")
        elif (state.status == "ok" and state.driver_version and installed
              and state.driver_version not in {upstream(v) for v in installed}):
            reasons.append(f"the loaded driver {state.driver_version} is not the installed one")
        bound = [g for g in gpus or () if g.driver == "nouveau"]
        if bound:
            reasons.append(f"nouveau holds {', '.join(g.address for g in bound)}")

    next_kernel = headers.next_kernel if not keep and (install or installed) else None
    next_headers_unknown = False
    if next_kernel and not headers.next_module:
        next_package = f"linux-headers-{next_kernel}"
        if not (headers.next_build_tree or next_package in debs
                or headers.next_candidate is not None):
            if not configured:
                next_headers_unknown = True
            elif reasons:
                refusals.append(
                    f"no kernel headers for the kernel that boots next, {next_kernel} "
                    f"(installed, not running yet): apt has no installable {next_package}, so "
                    "DKMS cannot build the NVIDIA module for it, and the reboot this run makes "
                    "would boot it without a driver. Install its headers, or remove "
                    f"linux-image-{next_kernel} (the running kernel {headers.kernel} then stays "
                    "the one that boots), then run again")
            else:
                warnings.append(
                    f"no kernel headers for the kernel that boots next, {next_kernel} "
                    f"(installed, not running yet): apt has no installable {next_package}, so "
                    "DKMS cannot build the NVIDIA module for it and the host's next reboot "
                    "would come up without a driver; install its headers and run again")
    if next_kernel and headers.grub_default not in (None, "0"):
        warnings.append(
            f"GRUB_DEFAULT={headers.grub_default} in /etc/default/grub: the kernel that boots "
            f"next may not be {next_kernel}, the newest installed; the NVIDIA module is built "
            f"for it and for the running {headers.kernel}, and the check after a reboot says "
            "which kernel booted")

    return DriverPlan(
        installed=installed,
        target=target,
        install=install,
        change=change,
        toolkit_installed=tk_versions[0] if tk_versions else None,
        toolkit_target=f"{settings.cuda_toolkit} ({toolkit})",
        reboot_reasons=tuple(reasons),
        refusals=tuple(refusals),
        warnings=tuple(warnings),
        keep_present=keep,
        headers_unknown=headers_unknown,
        present=state.driver_version or files_.module_version,
        adopted=listing.adopted,
        repo_listed=listing.listed,
        kernel=headers.kernel,
        next_kernel=next_kernel,
        next_module=bool(next_kernel) and headers.next_module,
        next_headers_unknown=next_headers_unknown,
    )


# --- operations --------------------------------------------------------------------------------


@operation()
def held(packages: list[str]):
    """Hold packages (``apt-mark hold``) so that no apt upgrade changes them under a running
    server.

    + packages: package names to hold
    """
    holds = host.get_fact(HeldPackages)
    missing = [p for p in packages if p not in holds]
    if not missing:
        host.noop(f"held: {', '.join(packages)}")
        return
    yield StringCommand("apt-mark", "hold", *missing)


@operation()
def driver_packages(packages: list[str], module_package: str, version_glob: str,
                    allow_change: bool = False, removals: list[str] | None = None):
    """Install NVIDIA's driver packages at the version apt's pin selects (templates/
    apt-nvidia-pin.j2), or change an installed driver to it.

    + packages: the flavour's packages ("nvidia-open")
    + module_package: the package carrying the kernel module ("nvidia-kernel-open-dkms")
    + version_glob: the wanted version as an apt pattern ("580.*", "580.95.05-*")
    + allow_change: allow changing an installed driver of another version (held packages are
      changed too); without it such a change raises OperationError
    + removals: installed packages the change replaces under other names (Ubuntu's
      nvidia-dkms-580-open when nvidia-dkms-open 590 comes, :func:`renamed_packages`), removed
      in the same transaction: apt's resolver does not remove a held package for a Conflicts
      of its own accord ("pkgProblemResolver::Resolve generated breaks, this may be caused by
      held packages", seen on the sandbox's Ubuntu host)

    pyinfra's apt.packages leaves held packages alone, which a driver change must not. apt
    ignores a pin that matches no version and installs the newest instead, so the install is
    refused when apt's lists (``apt-cache madison``) have no version matching ``version_glob``,
    and the host fails unless the installed ``module_package`` then matches it.
    """
    for name in (module_package, *(removals or ())):
        if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", name):
            raise OperationValueError(f"package name {name!r}")
    if not re.fullmatch(r"[0-9][0-9.]*(-\*|\.\*)", version_glob):
        raise OperationValueError(f"driver version pattern {version_glob!r}")
    debs = host.get_fact(DebPackages)
    installed = sorted(v for name, versions in debs.items()
                       if any(p.fullmatch(name) for p in MODULE_PACKAGE_NAMES.values())
                       for v in versions)
    wanted = [*packages, module_package]
    matches = any(fnmatch.fnmatch(v, version_glob) for v in installed)
    if installed and not matches and not allow_change:
        raise OperationError(
            f"{module_package} {', '.join(installed)} installed, {version_glob} wanted: "
            "a driver change needs gpuhost_allow_driver_change")
    if installed and matches and all(p in debs for p in wanted):
        host.noop(f"driver {', '.join(installed)} installed ({version_glob})")
        return
    args = ["--no-install-recommends"]
    if installed:
        args += ["--allow-downgrades", "--allow-change-held-packages"]
    # version_glob and module_package are checked above: safe unquoted, and the glob must stay
    # unquoted to match in `case`.
    yield StringCommand(
        f"ok=; have=; for v in $(apt-cache madison {module_package} | cut -d'|' -f2); do "
        f"have=\"$have $v\"; case \"$v\" in {version_glob}) ok=1;; esac; done; "
        f"if [ -z \"$ok\" ]; then echo \"NVIDIA's repository has no {module_package} "
        f"{version_glob} (it has:${{have:- none}}): set gpuhost_driver_version to one it has\" "
        ">&2; exit 1; fi"
    )
    gone = [f"{r}-" for r in removals or () if r in debs]
    yield StringCommand(
        "DEBIAN_FRONTEND=noninteractive", "apt-get", "-y",
        "-o", "Dpkg::Options::=--force-confdef", "-o", "Dpkg::Options::=--force-confold",
        "install", *args, *wanted, *gone,
    )
    yield StringCommand(
        f"p=$(dpkg-query -W -f='${{Version}}' {module_package}); case \"$p\" in "
        f"{version_glob}) ;; *) echo \"{module_package} $p installed, {version_glob} wanted\" "
        ">&2; exit 1;; esac"
    )


@operation(is_idempotent=False)
def driver_answers(module_package: str, gpu_count: int):
    """Check, after a reboot, that nvidia-smi answers, that the loaded driver is the installed
    ``module_package``'s version, and that it lists ``gpu_count`` GPUs. Fails the host
    otherwise, so that nothing after it (the server) runs on a driver that does not match.

    + module_package: the package whose version the loaded driver must have
    + gpu_count: the GPUs nvidia-smi must list
    """
    yield StringCommand(_answers_command(module_package, gpu_count))


def _answers_command(module_package: str, gpu_count: int) -> str:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.+-]*", module_package):
        raise OperationValueError(f"package name {module_package!r}")
    return (
        "v=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>&1) "
        "|| { echo \"nvidia-smi fails: $v\" >&2; exit 1; }; v=$(echo \"$v\" | head -n 1); "
        f"p=$(dpkg-query -W -f='${{Version}}' {module_package}); "
        "case \"$p\" in \"$v\"-*) ;; *) echo \"loaded driver $v, installed $p\" >&2; exit 1;; esac; "
        "n=$(nvidia-smi -L | grep -c '^GPU '); "
        f"if [ \"$n\" -ne {int(gpu_count)} ]; then "
        f"echo \"nvidia-smi lists $n GPU(s), {int(gpu_count)} expected\" >&2; exit 1; fi; "
        "echo \"driver $v loaded, $n GPU(s)\""
    )


def driver_failure(host, module_package: str, gpu_count: int) -> str | None:
    """Run, from an operation's callback, the checks of :func:`driver_answers` and
    :func:`gpus_bound`; the first failure in words ("nvidia-smi fails: NVIDIA-SMI has failed
    because it couldn't communicate with the NVIDIA driver. ..."), or None when the driver
    passes them all."""
    ok, out = remote.shell(host, _answers_command(module_package, gpu_count))
    if not ok:
        return "; ".join(line for line in out.stderr_lines if line.strip()) or "nvidia-smi fails"
    _status, out = remote.shell(host, PciGpus().command())
    return binding_failure(parse_lspci(out.stdout_lines))


def binding_failure(gpus: tuple[PciGpu, ...] | None) -> str | None:
    """Why the GPUs :class:`PciGpus` read are not all bound to nvidia, or None when they are."""
    if gpus is None:
        return "lspci is not installed (pciutils): cannot check GPU binding"
    wrong = [f"{g.address} ({g.driver or 'no driver'})" for g in gpus if g.driver != "nvidia"]
    if wrong:
        return f"GPUs not bound to nvidia: {', '.join(wrong)}"
    return None if gpus else "lspci lists no NVIDIA GPU"


@operation(is_idempotent=False)
def gpus_bound():
    """Check that every NVIDIA GPU on the PCI bus is bound to the nvidia driver (``lspci -Dnnk``,
    see :class:`PciGpus`); raises OperationError naming each GPU bound elsewhere or unbound."""

    @remote.callback("the GPU binding check")
    def check(state, host):
        _status, out = remote.shell(host, PciGpus().command())
        gpus = parse_lspci(out.stdout_lines)
        failure = binding_failure(gpus)
        if failure:
            raise OperationError(failure)
        logger.info(f"{host.print_prefix}{len(gpus or ())} GPU(s) bound to nvidia")
        return True

    yield FunctionCommand(check, (), {})


@operation(is_idempotent=False)
def headers_installable(kernel: str, role: str = "the running kernel"):
    """Fail the host unless ``linux-headers-<kernel>`` is installed or installable (apt has a
    candidate), before the driver is installed: DKMS needs them to build the module.

    + kernel: the kernel's release (``uname -r`` of the running one)
    + role: which kernel it is, for the message ("the kernel that boots next")
    """
    _check_release(kernel)
    if not re.fullmatch(r"[a-z ]+", role):
        raise OperationValueError(f"kernel role {role!r}")
    package = f"linux-headers-{kernel}"
    yield StringCommand(
        f"c=$(apt-cache policy {package} | sed -n 's/^ *Candidate: *//p'); "
        f"if [ -z \"$c\" ] || [ \"$c\" = '(none)' ]; then echo \"no kernel headers for "
        f"{role} {kernel}: apt has no installable {package}; DKMS could not build the "
        "NVIDIA module. Install the headers or boot a kernel that has them, then run again\" "
        ">&2; exit 1; fi; echo \"$c\""
    )


def _check_release(kernel: str) -> None:
    if not re.fullmatch(r"[0-9][a-z0-9.+-]*", kernel):
        raise OperationValueError(f"kernel release {kernel!r}")


@operation()
def module_built(kernel: str, built: bool = False):
    """Make sure DKMS installed the NVIDIA kernel module for ``kernel`` (a kernel installed but
    not booted yet), before a reboot boots it: where :data:`DKMS_MODULE` is missing, ``dkms
    autoinstall -k <kernel>`` builds every AUTOINSTALL module for it (dkms(8)); fails the host
    when there is still none.

    + kernel: the kernel's release
    + built: the module is there already (:class:`KernelHeaders` ``next_module``)

    DKMS usually built it already: the driver's postinst builds for the running and the newest
    installed kernel (dkms_common.postinst), and its /etc/kernel/header_postinst.d hook for a
    kernel whose headers arrive later.
    """
    _check_release(kernel)
    if built:
        host.noop(f"NVIDIA module built for kernel {kernel}")
        return
    module = DKMS_MODULE.format(kernel=kernel)
    yield StringCommand(
        f"if ! ls {module}* >/dev/null 2>&1; then "
        "if ! command -v dkms >/dev/null 2>&1; then echo \"dkms is not installed: no NVIDIA "
        f"module for {kernel}\" >&2; exit 1; fi; dkms autoinstall -k {kernel}; fi; "
        f"if ! ls {module}* >/dev/null 2>&1; then echo \"DKMS built no NVIDIA module for kernel "
        f"{kernel} (no {module}): the next boot would have no driver; see dkms status and "
        f"/var/lib/dkms/nvidia/*/build/make.log\" >&2; exit 1; fi"
    )


@operation(is_idempotent=False)
def booted_kernel_module(expected: str):
    """Check, after a reboot, that the kernel that booted has DKMS's NVIDIA module
    (:data:`DKMS_MODULE`); says which kernel booted, and warns when it is not ``expected``
    (the kernel that boots next, :class:`KernelHeaders`). Fails the host naming the kernel
    otherwise, before the driver's own check.

    + expected: the release the reboot was to boot
    """
    _check_release(expected)

    @remote.callback("the booted kernel's check")
    def check(state, host):
        _ok, out = remote.shell(host, "k=$(uname -r); echo \"$k\"; "
                                      f"ls {DKMS_MODULE.format(kernel='$k')}* 2>/dev/null")
        lines = [line.strip() for line in out.stdout_lines if line.strip()]
        booted = lines[0] if lines else "?"
        if booted != expected:
            logger.warning(f"{host.print_prefix}NVIDIA: booted kernel {booted}, not {expected} "
                           "(the newest installed): see GRUB_DEFAULT in /etc/default/grub")
        if len(lines) < 2:
            raise OperationError(
                f"the booted kernel {booted} has no NVIDIA module "
                f"({DKMS_MODULE.format(kernel=booted)} missing): install "
                f"linux-headers-{booted}, run dkms autoinstall -k {booted} and reboot, or boot "
                "a kernel that has the module")
        logger.info(f"{host.print_prefix}NVIDIA: booted kernel {booted} has the NVIDIA module "
                    f"({lines[1]})")
        return True

    yield FunctionCommand(check, (), {})


# --- the stage ---------------------------------------------------------------------------------


@deploy("NVIDIA driver and CUDA toolkit")
def nvidia(settings: Settings):
    """Converge NVIDIA's repository, the driver branch (open kernel modules by default), the
    CUDA toolkit, package holds, unattended-upgrades exclusions and the nouveau blacklist;
    reboot only when needed (see :func:`plan_driver`) and then verify the driver.

    + settings: the host's validated settings

    Logs, per host (also in --dry), the installed and target versions of the driver and the
    CUDA toolkit and whether a reboot and a server restart follow. Refuses (operations.plan)
    before any change: an OS without NVIDIA's repository, what :func:`plan_driver` refuses,
    and a DKMS build under Secure Boot without an enrolled MOK in host data
    (operations.secureboot.plan_signing); DKMS's signing configuration is written before the
    driver's packages install.
    The server unit is stopped before the driver packages change, the host is rebooted
    before the server stage runs (on a rolling host whose server runs, all of it waits for the
    host's turn in the roll instead: :func:`driver_change`, operations/roll.py), and a drop-in
    (templates/sglang-driver-gate.conf) keeps the unit from starting while nvidia-smi fails (no
    driver, or a driver/library version mismatch), so that no server runs across a driver
    change.

    Returns the stage's :class:`DriverPlan` (None where the stage is refused or finishes an
    interrupted rollback): the P2P stage reads from it whether the driver changes in this run.
    """
    meta = fact(LinuxDistribution).get("release_meta", {})
    try:
        folder = repo_folder(meta.get("ID", "").lower(), meta.get("VERSION_ID", ""),
                             fact(Arch))
    except PlanError as exc:
        refuse("NVIDIA", str(exc))
        return
    repo_url = f"{settings.cuda_repo_url}/{folder}/"
    source_path = source_file(folder)
    debs = fact(DebPackages)
    lists_present = fact(AptListsPresent)
    headers = fact(KernelHeaders)
    plan = plan_driver(
        settings,
        debs=debs,
        state=fact(NvidiaDriver),
        files_=fact(NvidiaDriverFiles),
        headers=headers,
        gpus=fact(PciGpus),
        sources=fact(AptSources),
        repo_url=repo_url,
        source_path=source_path,
        lists_present=lists_present,
        folder=folder,
        available=fact(AptVersions, package=driver_package_names(
            folder, settings.driver_flavour, settings.driver_branch)[1]),
    )
    packages, module_package = driver_package_names(folder, settings.driver_flavour,
                                                    settings.driver_branch)
    removals = renamed_packages(folder, settings.driver_flavour, plan.installed, debs,
                                [*packages, module_package])
    pending = driver_rollback.pending_change(fact(FileText, path=driver_rollback.CHANGE))
    last_good = driver_rollback.load(fact(FileText, path=driver_rollback.LAST_GOOD))
    simulation = None
    if plan.install and not plan.keep_present and lists_present and plan.repo_listed:
        simulation = fact(DriverSimulation,
                          packages=[*packages, module_package, *(f"{r}-" for r in removals)],
                          version_glob=plan.target)
    resolved = simulation.version_of(module_package) if simulation else None
    logger.info(f"{host.print_prefix}NVIDIA: {plan.summary(resolved)}")
    for warning in plan.warnings:
        logger.warning(f"{host.print_prefix}NVIDIA: {warning}")
    for level, line in driver_rollback.plan_lines(
            install=plan.install and not plan.keep_present, change=plan.change,
            module_package=module_package, simulation=simulation, last_good=last_good,
            pending=pending):
        getattr(logger, level)(f"{host.print_prefix}NVIDIA: {line}")
    signing = secure_boot_signing(settings, builds=plan.install)
    for reason in (*plan.refusals, *signing.refusals):
        refuse("NVIDIA", reason)
    if plan.refusals or signing.refusals:
        return

    toolkit = toolkit_package(settings.cuda_toolkit)
    files.put(
        name="apt waits for dpkg's lock",
        src=str(_templates() / "50gpuhost-dpkg-lock-timeout"),
        dest="/etc/apt/apt.conf.d/50gpuhost-dpkg-lock-timeout",
        mode="644",
    )
    interrupted = fact(DpkgInterrupted)
    if interrupted:
        logger.warning(f"{host.print_prefix}NVIDIA: an earlier package run was interrupted "
                       f"({interrupted[0]}{', ...' if len(interrupted) > 1 else ''}): "
                       "finishing it with dpkg --configure -a")
        dpkg_finished(name="Finish the interrupted package run (dpkg --configure -a)")
    if pending and pending.get("phase") == "rolling-back":
        driver_rollback.finished(
            name=f"Finish the interrupted driver rollback to {pending.get('from')}",
            packages=list(packages), module_package=module_package,
            gpu_count=settings.gpu_count, failure_of=driver_failure, server_unit=SERVER_UNIT)
        return
    tools = [p for p in PREREQUISITES if p not in debs]
    if tools or not lists_present:
        lists_updated(name="Update apt lists (for the download tools)")
    apt.packages(name="Download tools and lspci", packages=list(PREREQUISITES),
                 no_recommends=True)
    keyring = None
    if not plan.adopted or any(signed_by_key(s.signed_by) == signed_by_key(KEYRING)
                               for s in plan.adopted):
        keyring = proxy.downloaded(
            name="NVIDIA repository signing key",
            src=f"{repo_url}cuda-archive-keyring.gpg", proxy=proxy.of_host(),
            dest=KEYRING,
            sha256sum=settings.cuda_keyring_sha256,
            mode="644",
        )
    source = files.file(
        name=f"NVIDIA CUDA repository: as listed in {plan.adopted[0].file} (adopted)",
        path=source_path,
        present=False,
    ) if plan.adopted else files.put(
        name="NVIDIA CUDA repository",
        src=StringIO(f"deb [signed-by={KEYRING}] {repo_url} /\n"),
        dest=source_path,
        mode="644",
    )
    pin = files.template(
        name=f"Pin the driver to {plan.target}",
        src=str(_templates() / "apt-nvidia-pin.j2"),
        dest="/etc/apt/preferences.d/gpuhost-nvidia-driver",
        version_glob=plan.target,
        mode="644",
    )
    missing = [p for p in (toolkit,) if p not in debs]
    stale_lists = plan.install or bool(missing) or not lists_present
    configured_lists = lists_present and any(s.file == source_path for s in fact(AptSources))
    lists_updated(name="Update apt lists",
                  _if=lambda: stale_lists or any_changed(
                      *(op for op in (keyring, source, pin) if op is not None))())
    if plan.headers_unknown:
        headers_installable(name=f"Kernel headers installable for {headers.kernel}",
                            kernel=headers.kernel)
    if plan.next_headers_unknown and plan.next_kernel:
        headers_installable(name=f"Kernel headers installable for {plan.next_kernel} (the "
                            "kernel that boots next)", kernel=plan.next_kernel,
                            role="the kernel that boots next")
    files.put(
        name="Keep unattended-upgrades off the driver and CUDA",
        src=str(_templates() / "51gpuhost-unattended-upgrades"),
        dest="/etc/apt/apt.conf.d/51gpuhost-unattended-upgrades",
        mode="644",
    )
    blacklist = files.put(
        name="Blacklist nouveau",
        src=str(_templates() / "gpuhost-blacklist-nouveau.conf"),
        dest="/etc/modprobe.d/gpuhost-blacklist-nouveau.conf",
        mode="644",
    )
    server.shell(
        name="Rebuild the initramfs without nouveau",
        commands=["if command -v update-initramfs >/dev/null; then update-initramfs -u; fi"],
        _if=blacklist.did_change,
    )

    gate = files.put(
        name=f"{SERVER_UNIT} starts only on a matching driver",
        src=str(_templates() / "sglang-driver-gate.conf"),
        dest=f"/etc/systemd/system/{SERVER_UNIT}.d/{DRIVER_GATE_DROPIN}",
        mode="644",
    )
    systemd.daemon_reload(name="Reload systemd units (driver gate)", _if=gate.did_change)

    dkms_signing(settings, signing)
    running = bool(fact(SystemdStatus, services=SERVER_UNIT).get(SERVER_UNIT))
    if not plan.keep_present:
        kernels = [headers.kernel, *([plan.next_kernel] if plan.next_kernel else [])]
        apt.packages(name=f"Kernel headers for {' and '.join(kernels)}"
                     + (" (the running kernel and the one that boots next)"
                        if plan.next_kernel else ""),
                     packages=[f"linux-headers-{k}" for k in kernels], no_recommends=True)
        if plan.install and plan.installed:
            driver_rollback.kept(
                name="Keep the installed driver's packages for a rollback",
                packages=[*packages, *(f"{r}-" for r in removals)],
                module_package=module_package,
                version_glob=plan.target,
                kept_module_package=installed_module_package(settings.driver_flavour, debs,
                                                             module_package))
        name = host.name
        pinning = driver_lock.pinning_package(settings.driver_branch, settings.driver_version)
        offered = (bool(fact(AptVersions, package=pinning))
                   if configured_lists and not stale_lists else None)
        if plan.install and plan.installed and roll.in_turn(
                DRIVER_CHANGE, lambda when: driver_change(settings, plan, packages, module_package,
                                                     running, when, (pinning, offered),
                                                     removals),
                running=running, reboots=bool(plan.reboot_reasons),
                stops=lambda: driver_rollback.rolled_back(name)):
            logger.info(f"{host.print_prefix}NVIDIA: the driver changes in this host's turn "
                        "of the roll, out of the router")
        else:
            driver_change(settings, plan, packages, module_package, running,
                          lock=(pinning, offered), removals=removals)
    apt.packages(name=f"CUDA toolkit {settings.cuda_toolkit}", packages=[toolkit],
                 no_recommends=True)
    holds = [toolkit] if plan.keep_present else [*packages, module_package, toolkit]
    held(name="Hold the driver and CUDA packages", packages=holds)
    if not plan.reboot_reasons and not plan.keep_present and (
            pending or (plan.installed and last_good is None)):
        driver_rollback.checked(
            name="Check the loaded driver (and record it as verified)",
            packages=list(packages), module_package=module_package,
            gpu_count=settings.gpu_count, failure_of=driver_failure)
    return plan


def driver_change(settings: Settings, plan: DriverPlan, packages: list[str],
                  module_package: str, running: bool,
                  when: Callable[[], bool] | None = None,
                  lock: tuple[str, bool | None] | None = None,
                  removals: list[str] | None = None) -> None:
    """Plan the driver's change (see :func:`nvidia`): the server stopped, NVIDIA's pinning
    package (``lock``: its name and whether the lists offer it, operations.driver_lock), the
    packages, the reboot and the loaded driver's check; ``when``: its host's turn in the roll
    (each operation runs only then, and the server is enabled again after the check, restarted
    by the roll), else None (in place; the server stage enables and starts the server)."""
    only = [when] if when else []
    if plan.install and (running or fact(SystemdEnabled, services=SERVER_UNIT).get(
            SERVER_UNIT)):
        # Disabled too: started at the reboot's boot, it would be stopped again by the P2P
        # check; it starts once, on the new driver.
        systemd.service(name=f"Stop {SERVER_UNIT} before the driver changes",
                        service=SERVER_UNIT, running=False, enabled=False, _if=only)
    if lock:
        driver_lock.nvidia_pinning(
            name=f"NVIDIA's {lock[0]}, where the repository has it (apt's lock)",
            package=lock[0], offered=lock[1], _if=only)
    driver_packages(
        name=f"NVIDIA driver ({settings.driver_flavour} kernel modules, {plan.target})",
        packages=list(packages),
        module_package=module_package,
        version_glob=plan.target,
        allow_change=settings.allow_driver_change,
        removals=list(removals or ()),
        _if=only,
    )
    if plan.next_kernel:
        module_built(name=f"NVIDIA module for kernel {plan.next_kernel} (boots next)",
                     kernel=plan.next_kernel, built=plan.next_module, _if=only)
    if plan.reboot_reasons:
        rebooted = reboot(name="Reboot: " + "; ".join(plan.reboot_reasons), _if=only)
        booted_kernel_module(
            name="The booted kernel has the NVIDIA module",
            expected=plan.next_kernel or plan.kernel, _if=[*only, rebooted.did_change])
        driver_rollback.checked(
            name="Check the loaded driver (rolled back to the kept one if it fails)",
            packages=list(packages), module_package=module_package,
            gpu_count=settings.gpu_count, failure_of=driver_failure,
            _if=[*only, rebooted.did_change])
    if when:
        # apt-get's --allow-change-held-packages leaves the new packages unheld: the stage's
        # hold ran before them (seen on the sandbox: the next run held them again)
        held(name="Hold the changed driver packages", packages=[*packages, module_package],
             _if=only)
        systemd.service(name=f"Enable {SERVER_UNIT} again (the roll restarts it)",
                        service=SERVER_UNIT, running=False, enabled=True, _if=only)


def _templates() -> Path:
    return REPO_ROOT / "templates"
