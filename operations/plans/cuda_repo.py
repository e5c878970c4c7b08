"""NVIDIA's CUDA apt repository: its folder per OS, gpuhost's entry of it beside the host's own."""

from __future__ import annotations

import re
from dataclasses import dataclass
from io import StringIO
from typing import Final

from pyinfra.api import FactBase
from pyinfra.operations import files
from typing_extensions import override

from operations import REPO_ROOT
from operations.plans import proxy
from operations.plans.plan import PlanError
from operations.plans.settings import Settings

#: NVIDIA's repository folder per (os-release ID, VERSION_ID) and per machine architecture
#: (https://developer.download.nvidia.com/compute/cuda/repos/: ubuntu2404/x86_64, .../sbsa).
REPO_DISTROS: Final = {
    ("ubuntu", "24.04"): "ubuntu2404",
    ("ubuntu", "22.04"): "ubuntu2204",
    ("debian", "12"): "debian12",
}
REPO_ARCHES: Final = {"x86_64": "x86_64", "aarch64": "sbsa"}

KEYRING: Final = "/usr/share/keyrings/cuda-archive-keyring.gpg"


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



def repository_entry(settings: Settings, repo_url: str, source_path: str,
                     adopted: tuple[AptSource, ...], target: str) -> tuple:
    """The repository's signing key (None where an adopted entry names another keyring), its
    source entry (gpuhost's own, or none beside ``adopted``) and the driver's apt pin to
    ``target``: the operations whose change makes apt's lists stale."""
    keyring = None
    if not adopted or any(signed_by_key(s.signed_by) == signed_by_key(KEYRING)
                          for s in adopted):
        keyring = proxy.downloaded(
            name="NVIDIA repository signing key",
            src=f"{repo_url}cuda-archive-keyring.gpg", proxy=proxy.of_host(),
            dest=KEYRING,
            sha256sum=settings.cuda_keyring_sha256,
            mode="644",
        )
    source = files.file(
        name=f"NVIDIA CUDA repository: as listed in {adopted[0].file} (adopted)",
        path=source_path,
        present=False,
    ) if adopted else files.put(
        name="NVIDIA CUDA repository",
        src=StringIO(f"deb [signed-by={KEYRING}] {repo_url} /\n"),
        dest=source_path,
        mode="644",
    )
    pin = files.template(
        name=f"Pin the driver to {target}",
        src=str(REPO_ROOT / "templates" / "apt-nvidia-pin.j2"),
        dest="/etc/apt/preferences.d/gpuhost-nvidia-driver",
        version_glob=target,
        mode="644",
    )
    return keyring, source, pin
