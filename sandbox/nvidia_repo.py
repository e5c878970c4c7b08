"""NVIDIA's CUDA apt repository for the sandbox lab: stand-in .debs under NVIDIA's package names
and version strings, in a signed flat repository laid out as NVIDIA serves it.

    <www>/compute/cuda/repos/debian12/x86_64/
        *.deb  Packages  Packages.gz  Release  InRelease  Release.gpg  cuda-archive-keyring.gpg

The packages install the GPU stand-ins (sandbox/standins/nvidia/): nvidia-smi answering from the
host's scenario, a kernel-module package that "builds" for the running kernel (and fails as DKMS
does without its headers) and is "loaded" only at boot, nvcc answering --version as CUDA's does.

The signing key is generated once and kept in GNUPG_HOME, so the keyring (and its sha256, which
the inventory hands to the product) stays the same across builds. The .debs are reproducible
(fixed timestamps, root ownership); the repository is rebuilt only when its sources change.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sandbox import debian_control
from sandbox import ubuntu_driver
from sandbox.layout import APT_ARCHIVES, CUDA_REPO_DIR, CUDA_REPO_PATH, HTTP_PORT, STATE_DIR

GNUPG_HOME = STATE_DIR / "gnupg"
KEY_UID = "gpuhost sandbox CUDA repository (stand-in) <sandbox@gpuhost.invalid>"
STANDINS = Path(__file__).with_name("standins") / "nvidia"
STAMP = Path(".stamps") / "nvidia-repo.json"  # under www: what the repository was built from

MAINTAINER = "gpuhost sandbox lab <sandbox@gpuhost.invalid>"
EPOCH = 1735689600  # 2025-01-01T00:00:00Z: the mtime of every file in a .deb (reproducible builds)

# Driver branches in the repository: several side by side, as NVIDIA's debian12 repository has
# them (a pin that misses a package fails only where a newer branch sits beside the pinned one),
# and two releases of one, so that an upgrade (and the reboot it needs) can be tested. Debian
# revision "-1" as in NVIDIA's debian12 repository.
DRIVER_VERSIONS = ("570.172.08", "575.64.05", "580.95.05", "580.105.08", "590.44.01")
#: Releases whose kernel module installs and "builds" but never loads at boot (its boot-time
#: loader is standins/nvidia/load-module-unknown-symbol): nvidia-smi then finds no driver, for
#: the driver rollback's tests. In branch 590, which no host data asks for by default, so that
#: the newest of branch 580 stays what it was.
MODULE_FAILS_TO_LOAD = ("590.44.01",)


@dataclass(frozen=True)
class CudaRelease:
    """One CUDA toolkit release and its packages' versions (NVIDIA's debian12 repository)."""

    release: str  # "12.8"
    toolkit: str  # meta packages: cuda-toolkit-X-Y, cuda-compiler-X-Y, cuda-libraries-X-Y
    nvcc: str  # cuda-nvcc-X-Y
    cuobjdump: str  # cuda-cuobjdump-X-Y
    cudart: str  # cuda-cudart-X-Y and the config-common packages
    built_on: str  # nvcc --version's "Built on" line
    build: str  # nvcc --version's "Build" line

    @property
    def dashed(self) -> str:
        return self.release.replace(".", "-")

    @property
    def major(self) -> str:
        return self.release.split(".")[0]


CUDA_RELEASES = (
    # CUDA 12.8 update 1 (nvcc output as the real one prints it)
    CudaRelease(
        "12.8",
        "12.8.1",
        "12.8.93",
        "12.8.90",  # cuda-cuobjdump-12-8 12.8.90-1 (a listing of NVIDIA's repository)
        "12.8.90",
        "Fri_Feb_21_20:23:50_PST_2025",
        "cuda_12.8.r12.8/compiler.35583870_0",
    ),
    # CUDA 13.0 update 2 (shared/fixtures/h200-1gpu/system.txt)
    CudaRelease(
        "13.0",
        "13.0.2",
        "13.0.88",
        "13.0.85",  # cuda-cuobjdump-13-0 (shared/fixtures/h200-1gpu/dpkg-query.txt)
        "13.0.96",
        "Wed_Aug_20_01:58:59_PM_PDT_2025",
        "cuda_13.0.r13.0/compiler.36424714_0",
    ),
)

#: The repository's folders (NVIDIA's layout: <distro>/<arch>), each signed with the same key.
FOLDERS = ("debian12/x86_64", "ubuntu2404/x86_64")

KEYRING_DEB_VERSION = "1.1-1"
KEYRING_PATH = "/usr/share/keyrings/cuda-archive-keyring.gpg"
SOURCES_LIST = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"


class RepoError(RuntimeError):
    """The repository could not be built; the message says which step and why."""


@dataclass
class Deb:
    """One stand-in package: control fields, files, links and maintainer scripts."""

    name: str
    version: str
    description: str
    arch: str = "amd64"
    source: str = ""
    pre_depends: list[str] = field(default_factory=list)
    depends: list[str] = field(default_factory=list)
    breaks: list[str] = field(default_factory=list)
    provides: list[str] = field(default_factory=list)
    conflicts: list[str] = field(default_factory=list)
    replaces: list[str] = field(default_factory=list)
    files: dict[str, tuple[bytes, int]] = field(default_factory=dict)  # path -> (content, mode)
    links: dict[str, str] = field(default_factory=dict)  # path -> target
    scripts: dict[str, str] = field(default_factory=dict)  # postinst/prerm/postrm -> text
    conffiles: list[str] = field(default_factory=list)

    @property
    def filename(self) -> str:
        return f"{self.name}_{self.version}_{self.arch}.deb"

    def control(self) -> str:
        size = max(1, sum(len(c) for c, _ in self.files.values()) // 1024)
        fields = [
            ("Package", self.name),
            ("Source", self.source),
            ("Version", self.version),
            ("Architecture", self.arch),
            ("Maintainer", MAINTAINER),
            ("Installed-Size", str(size)),
            ("Pre-Depends", ", ".join(self.pre_depends)),
            ("Depends", ", ".join(self.depends)),
            ("Breaks", ", ".join(self.breaks)),
            ("Provides", ", ".join(self.provides)),
            ("Conflicts", ", ".join(self.conflicts)),
            ("Replaces", ", ".join(self.replaces)),
            ("Section", "devel"),
            ("Priority", "optional"),
            (
                "Description",
                self.description + " (sandbox stand-in)\n"
                " Installed by the gpuhost sandbox lab in place of NVIDIA's package of this name\n"
                " and version; it drives no hardware.",
            ),
        ]
        return "".join(f"{k}: {v}\n" for k, v in fields if v)


def build(
    www: Path,
    kernel_release: str,
    *,
    gnupg_home: Path = GNUPG_HOME,
    apt_archives: Path | None = APT_ARCHIVES,
) -> dict[str, str]:
    """Build (or keep, when nothing changed) the repository under `www`; return its keyring's hash.

    + www: the HTTP root; the repository goes to www/compute/cuda/repos/debian12/x86_64/
    + kernel_release: `uname -r` of the hosts' kernel: the linux-headers-<release> stand-in
    + gnupg_home: where the signing key lives (generated on first use)
    + apt_archives: the hosts' shared apt cache; a rebuild deletes the stand-in .debs there that
      differ from the new ones (apt reuses a cached .deb of the right name and size unchecked)

    Returns {"keyring_sha256": <sha256 hex of cuda-archive-keyring.gpg>}. Raises RepoError when
    a tool (dpkg-deb, apt-ftparchive, gpg) is missing or fails, ValueError for a kernel release
    that cannot name a Debian package.
    """
    _check_kernel_release(kernel_release)
    for tool in ("dpkg-deb", "apt-ftparchive", "gpg"):
        if shutil.which(tool) is None:
            raise RepoError(f"{tool} is not installed (Debian packages: dpkg, apt-utils, gnupg)")
    www = Path(www)
    repos = {folder: www / CUDA_REPO_PATH.strip("/") / folder for folder in FOLDERS}
    try:
        fingerprint = _signing_key(Path(gnupg_home))
        keyring = _run(
            ["gpg", "--homedir", str(gnupg_home), "--export", fingerprint], "export the signing key"
        ).stdout
        stamp = {"inputs": _inputs_digest(kernel_release, keyring)}
        stamp_path = www / STAMP
        if all((r / "InRelease").exists() for r in repos.values()) and (
                _read_json(stamp_path) == stamp):
            return {"keyring_sha256": hashlib.sha256(keyring).hexdigest()}
        for folder, repo in repos.items():
            repo.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=repo.parent, prefix=".build-") as tmp:
                new = Path(tmp) / repo.name
                new.mkdir()
                (new / "cuda-archive-keyring.gpg").write_bytes(keyring)
                with tempfile.TemporaryDirectory(prefix="gpuhost-debs-") as work:
                    for deb in packages(kernel_release, keyring, folder):
                        _build_deb(deb, Path(work), new)
                _index(new)
                _sign(new, Path(gnupg_home), fingerprint)
                old = Path(tmp) / "old"
                if repo.exists():
                    repo.rename(old)
                new.rename(repo)
            if apt_archives is not None:
                _drop_stale(Path(apt_archives), repo)
        stamp_path.parent.mkdir(parents=True, exist_ok=True)
        stamp_path.write_text(json.dumps(stamp) + "\n")
    finally:
        # gpg starts an agent for the home it signs with; end it rather than leave it running.
        subprocess.run(
            ["gpgconf", "--homedir", str(gnupg_home), "--kill", "gpg-agent"],
            capture_output=True,
            check=False,
        )
    return {"keyring_sha256": hashlib.sha256(keyring).hexdigest()}


def packages(kernel_release: str, keyring: bytes, folder: str = "debian12/x86_64") -> list[Deb]:
    """Every stand-in package of the repository folder (names and versions: NVIDIA's debian12
    repository, or its ubuntu2404 one: sandbox/ubuntu_driver.py)."""
    debs = [_linux_headers(kernel_release)]
    if folder.startswith("ubuntu"):
        branches = sorted({v.split(".")[0] for v in DRIVER_VERSIONS})
        for version in DRIVER_VERSIONS:
            debs.extend(_ubuntu_driver(version, branches))
        for branch in branches:
            debs.append(_pinning(branch, f"driver branch {branch}", f"{branch}.*",
                                 revision="1ubuntu1"))
    else:
        debs.append(_cuda_keyring(keyring))
        for version in DRIVER_VERSIONS:
            debs.extend(_driver(version))
        for branch in sorted({v.split(".")[0] for v in DRIVER_VERSIONS}):
            debs.append(_pinning(branch, f"driver branch {branch}", f"{branch}.*"))
    for cuda in CUDA_RELEASES:
        debs.extend(_toolkit(cuda))
    return debs


def render(template: str, **values: str) -> str:
    """A stand-in source (sandbox/standins/nvidia/<template>) with its @KEY@ tokens filled."""
    text = (STANDINS / template).read_text()
    for key, value in values.items():
        text = text.replace(f"@{key}@", value)
    left = sorted(set(re.findall(r"@[A-Z_]+@", text)))
    if left:
        raise RepoError(f"{template}: no value for {', '.join(left)}")
    return text


# --- packages ----------------------------------------------------------------------------------


def _cuda_keyring(keyring: bytes) -> Deb:
    # The host part is filled in by the postinst: each host reaches the lab at its gateway.
    url = f"http://sandbox-gateway.invalid:{HTTP_PORT}{CUDA_REPO_DIR}"
    source = f"deb [signed-by={KEYRING_PATH}] {url} /\n"
    return Deb(
        "cuda-keyring",
        KEYRING_DEB_VERSION,
        "GPG keyring for the CUDA repository",
        arch="all",
        files={KEYRING_PATH: (keyring, 0o644), SOURCES_LIST: (source.encode(), 0o644)},
        conffiles=[SOURCES_LIST],
        scripts={"postinst": render("cuda-keyring.postinst", VERSION=KEYRING_DEB_VERSION)},
    )


def _linux_headers(kernel_release: str) -> Deb:
    src = f"/usr/src/linux-headers-{kernel_release}"
    upstream = re.match(r"[0-9]+(\.[0-9]+)*", kernel_release)
    version = (upstream.group(0) if upstream else "0") + "-1"
    readme = (
        f"Sandbox stand-in for the headers of kernel {kernel_release}: enough for the\n"
        "stand-in NVIDIA kernel module package to 'build'. Holds no headers.\n"
    )
    return Deb(
        f"linux-headers-{kernel_release}",
        version,
        f"Header files for Linux {kernel_release}",
        files={
            f"{src}/README.sandbox": (readme.encode(), 0o644),
            f"{src}/Makefile": (b"# sandbox stand-in\nall:\n", 0o644),
            f"{src}/include/generated/utsrelease.h": (
                f'#define UTS_RELEASE "{kernel_release}"\n'.encode(),
                0o644,
            ),
        },
        links={f"/lib/modules/{kernel_release}/build": src},
    )


def _driver(version: str) -> list[Deb]:
    """One driver release's packages: Debian's tree of the driver's source package at this
    version (sandbox/data/nvidia-graphics-drivers.json, sandbox/debian_control.py) with its
    exact-version dependencies and virtual packages, NVIDIA's additions (the open kernel module
    package and the nvidia-open metapackage), and the stand-in files in the packages that carry
    them in the real tree (nvidia-smi, libnvidia-ml1, libcuda1, the kernel modules)."""
    v = f"{version}-1"
    exact = f"(= {v})"
    tree = debian_control.load()
    smi = render("nvidia-smi", VERSION=version).encode()
    lib_dir = "/usr/lib/x86_64-linux-gnu/nvidia-sandbox"
    loader = "load-module-unknown-symbol" if version in MODULE_FAILS_TO_LOAD else "load-module"
    payloads: dict[str, dict[str, tuple[bytes, int]]] = {
        "nvidia-smi": {"/usr/bin/nvidia-smi": (smi, 0o755)},
        "libnvidia-ml1": {f"{lib_dir}/libnvidia-ml1.version": (f"{version}\n".encode(), 0o644)},
        "libcuda1": {f"{lib_dir}/libcuda1.version": (f"{version}\n".encode(), 0o644)},
    }
    debs = []
    for name, fields in tree["packages"].items():
        if name == "nvidia-kernel-dkms":
            continue  # below, with the module stand-in
        rel = {k: debian_control.instantiate(t, v) for k, t in fields.items()}
        debs.append(Deb(
            name, v, f"{name} of NVIDIA driver {version}", source=tree["source"],
            pre_depends=_split(rel.get("Pre-Depends")),
            # the nvidia-smi stand-in is a Python program
            depends=_split(rel.get("Depends")) + (["python3"] if name == "nvidia-smi" else []),
            provides=_split(rel.get("Provides")), conflicts=_split(rel.get("Conflicts")),
            breaks=_split(rel.get("Breaks")), replaces=_split(rel.get("Replaces")),
            files=payloads.get(name, {}),
        ))
    module = {k: debian_control.instantiate(t, v)
              for k, t in tree["packages"]["nvidia-kernel-dkms"].items()}
    upstream = version
    for name, source, flavour, other, what, extra in (
        ("nvidia-kernel-dkms", tree["source"], "proprietary", "nvidia-kernel-open-dkms",
         "NVIDIA kernel module", []),
        # NVIDIA's name for the open module package (Debian's: nvidia-open-kernel-dkms, from
        # the source nvidia-open-gpu-kernel-modules), providing what Debian's provides
        ("nvidia-kernel-open-dkms", "nvidia-open-gpu-kernel-modules", "open",
         "nvidia-kernel-dkms", "NVIDIA open kernel module", [f"nvidia-open-kernel-{upstream}"]),
    ):
        values = {"PACKAGE": name, "VERSION": v, "DRIVER": version, "FLAVOUR": flavour}
        dkms_conf = (
            f'PACKAGE_NAME="nvidia"\nPACKAGE_VERSION="{version}"\n'
            f"# sandbox stand-in: {flavour} flavour, builds nothing\n"
        )
        debs.append(
            Deb(
                name,
                v,
                f"{what} (DKMS source)",
                source=source,
                depends=_split(module.get("Depends")),
                provides=_split(module.get("Provides")) + extra,
                conflicts=[other],
                replaces=[other],
                files={
                    f"/usr/src/nvidia-{version}/dkms.conf": (dkms_conf.encode(), 0o644),
                    "/usr/lib/nvidia-sandbox/load-module": (render(loader).encode(), 0o755),
                    "/lib/systemd/system/nvidia-sandbox-module.service": (
                        render("nvidia-sandbox-module.service").encode(),
                        0o644,
                    ),
                },
                scripts={
                    s: render(f"kernel-module.{s}", **values)
                    for s in ("postinst", "prerm", "postrm")
                },
            )
        )
    debs.append(Deb(
        "nvidia-open", v, "NVIDIA driver with the open kernel modules (metapackage)",
        source="nvidia-open",
        depends=[f"nvidia-driver {exact}", f"nvidia-kernel-open-dkms {exact}"],
    ))
    debs.append(_pinning(version, f"driver version {version}", f"{version}-*"))
    return debs


def _ubuntu_driver(version: str, branches: list[str]) -> list[Deb]:
    """One driver release's packages in NVIDIA's ubuntu2404 repository (sandbox/ubuntu_driver.py
    says what is real in it), with the stand-in files where Ubuntu's packages carry them:
    nvidia-smi in nvidia-utils, the libraries' versions in libnvidia-compute, the module in
    nvidia-dkms-open."""
    v = ubuntu_driver.revision(version)
    n = ubuntu_driver.names(version)
    rel = ubuntu_driver.relations(version, branches)
    source = ubuntu_driver.source(version)
    lib_dir = "/usr/lib/x86_64-linux-gnu/nvidia-sandbox"
    loader = "load-module"  # every release loads here: the rollback is tested on debian12
    module = n["nvidia-dkms{b}-open"]
    payloads: dict[str, dict[str, tuple[bytes, int]]] = {
        n["nvidia-utils{b}"]: {"/usr/bin/nvidia-smi": (render("nvidia-smi", VERSION=version)
                                                       .encode(), 0o755)},
        n["libnvidia-compute{b}"]: {
            f"{lib_dir}/{lib}.version": (f"{version}\n".encode(), 0o644)
            for lib in ("libnvidia-ml1", "libcuda1")},
        module: {
            f"/usr/src/nvidia-{version}/dkms.conf": (
                f'PACKAGE_NAME="nvidia"\nPACKAGE_VERSION="{version}"\n'.encode(), 0o644),
            "/usr/lib/nvidia-sandbox/load-module": (render(loader).encode(), 0o755),
            "/lib/systemd/system/nvidia-sandbox-module.service": (
                render("nvidia-sandbox-module.service").encode(), 0o644),
        },
    }
    values = {"PACKAGE": module, "VERSION": v, "DRIVER": version, "FLAVOUR": "open"}
    debs = [Deb(name, v, f"{name} of NVIDIA driver {version}", source=source,
                depends=r["Depends"], conflicts=r["Conflicts"], replaces=r["Replaces"],
                files=payloads.get(name, {}),
                scripts={s: render(f"kernel-module.{s}", **values)
                         for s in ("postinst", "prerm", "postrm")} if name == module else {})
            for name, r in rel.items()]
    debs.append(Deb(
        "nvidia-open", v, "NVIDIA driver with the open kernel modules (metapackage)",
        source="nvidia-open",
        depends=[f"{n[b]} (= {v})" for b in ("nvidia-dkms{b}-open", "nvidia-utils{b}",
                                             "libnvidia-compute{b}")],
    ))
    debs.append(_pinning(version, f"driver version {version}", f"{version}-*",
                         revision=v.rsplit("-", 1)[1]))
    return debs


def _pinning(name: str, what: str, pattern: str, revision: str = "1") -> Deb:
    """NVIDIA's pinning package for a branch or a version ("nvidia-driver-pinning-580",
    "APT driver pinning file for driver branch 580"; apt-cache search on NVIDIA's repository).
    The preferences file it installs is this stand-in's own: the product does not read it."""
    text = (
        f"# sandbox stand-in of NVIDIA's nvidia-driver-pinning-{name}\n"
        "Package: src:nvidia-graphics-drivers* src:nvidia-open-gpu-kernel-modules nvidia-open\n"
        f"Pin: version {pattern}\nPin-Priority: 1000\n"
    )
    return Deb(
        f"nvidia-driver-pinning-{name}", f"{name}-{revision}",
        f"APT driver pinning file for {what}",
        arch="all", source="nvidia-driver-pinning",
        files={f"/etc/apt/preferences.d/nvidia-driver-pinning-{name}": (text.encode(), 0o644)},
    )


def _split(relation: str | None) -> list[str]:
    return [r.strip() for r in (relation or "").split(",") if r.strip()]


def _toolkit(cuda: CudaRelease) -> list[Deb]:
    d, rel = cuda.dashed, cuda.release
    root = f"/usr/local/cuda-{rel}"
    tk, cudart = f"{cuda.toolkit}-1", f"{cuda.cudart}-1"
    nvcc = render(
        "nvcc", RELEASE=rel, NVCC_VERSION=cuda.nvcc, BUILT_ON=cuda.built_on, BUILD=cuda.build
    ).encode()
    cuobjdump = render(
        "cuobjdump", RELEASE=rel, CUOBJDUMP_VERSION=cuda.cuobjdump, BUILT_ON=cuda.built_on,
        BUILD=cuda.build,
    ).encode()
    version_json = (
        json.dumps(
            {
                "cuda": {"name": "CUDA SDK", "version": cuda.toolkit},
                "cuda_nvcc": {"name": "CUDA NVCC", "version": cuda.nvcc},
                "cuda_cudart": {"name": "CUDA Runtime (cudart)", "version": cuda.cudart},
            },
            indent=3,
        )
        + "\n"
    )
    config = {
        "PACKAGE": f"cuda-toolkit-{d}-config-common",
        "VERSION": cudart,
        "RELEASE": rel,
        "MAJOR": cuda.major,
        "PRIORITY": rel.replace(".", ""),
    }
    return [
        Deb(
            f"cuda-toolkit-{d}",
            tk,
            f"CUDA Toolkit {rel} meta-package",
            depends=[
                f"cuda-compiler-{d} (>= {cuda.toolkit})",
                f"cuda-libraries-{d} (>= {cuda.toolkit})",
                f"cuda-toolkit-{d}-config-common",
                f"cuda-toolkit-{cuda.major}-config-common",
                "cuda-toolkit-config-common",
            ],
        ),
        Deb(f"cuda-compiler-{d}", tk, "CUDA compiler",
            depends=[f"cuda-nvcc-{d} (>= {cuda.nvcc})",
                     f"cuda-cuobjdump-{d} (>= {cuda.cuobjdump})"]),
        Deb(
            f"cuda-cuobjdump-{d}",
            f"{cuda.cuobjdump}-1",
            "CUDA cuobjdump",
            files={f"{root}/bin/cuobjdump": (cuobjdump, 0o755)},
        ),
        Deb(
            f"cuda-libraries-{d}",
            tk,
            f"CUDA Libraries {rel} meta-package",
            depends=[f"cuda-cudart-{d} (>= {cuda.cudart})"],
        ),
        Deb(
            f"cuda-nvcc-{d}",
            f"{cuda.nvcc}-1",
            "CUDA nvcc",
            depends=[f"cuda-cudart-{d} (>= {cuda.cudart})"],
            files={f"{root}/bin/nvcc": (nvcc, 0o755)},
        ),
        Deb(
            f"cuda-cudart-{d}",
            cudart,
            "CUDA Runtime native Libraries",
            files={
                f"{root}/targets/x86_64-linux/lib/README.sandbox": (
                    b"sandbox stand-in: no libraries\n",
                    0o644,
                )
            },
        ),
        Deb(
            f"cuda-toolkit-{d}-config-common",
            cudart,
            f"Common config package for CUDA Toolkit {rel}.",
            arch="all",
            files={f"{root}/version.json": (version_json.encode(), 0o644)},
            scripts={
                "postinst": render("cuda-config.postinst", **config),
                "prerm": render("cuda-config.prerm", **config),
            },
        ),
        Deb(
            f"cuda-toolkit-{cuda.major}-config-common",
            cudart,
            f"Common config package for CUDA Toolkit {cuda.major}.",
            arch="all",
        ),
        Deb(
            "cuda-toolkit-config-common",
            cudart,
            "Common config package for CUDA Toolkit.",
            arch="all",
        ),
    ]


# --- building ----------------------------------------------------------------------------------


def _build_deb(deb: Deb, work: Path, out: Path) -> None:
    root = work / deb.name / deb.version
    (root / "DEBIAN").mkdir(parents=True)
    for path, (content, mode) in deb.files.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(content)
        target.chmod(mode)
    for path, dest in deb.links.items():
        target = root / path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.symlink_to(dest)
    (root / "DEBIAN" / "control").write_text(deb.control())
    for name, text in deb.scripts.items():
        script = root / "DEBIAN" / name
        script.write_text(text)
        script.chmod(0o755)
    if deb.conffiles:
        (root / "DEBIAN" / "conffiles").write_text("".join(f"{c}\n" for c in deb.conffiles))
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            os.utime(os.path.join(dirpath, name), (EPOCH, EPOCH), follow_symlinks=False)
        os.chmod(dirpath, 0o755)
    os.utime(root, (EPOCH, EPOCH))
    env = dict(os.environ, SOURCE_DATE_EPOCH=str(EPOCH))
    _run(
        [
            "dpkg-deb",
            "--root-owner-group",
            "-Zxz",
            "--threads-max=1",
            "--build",
            str(root),
            str(out / deb.filename),
        ],
        f"build {deb.filename}",
        env=env,
    )


def _drop_stale(apt_archives: Path, repo: Path) -> None:
    """Remove the shared apt cache's copies of this repository's packages that differ from
    them (a stand-in changed); labs that boot side by side may drop the same copy."""
    if not apt_archives.is_dir():
        return
    for deb in repo.glob("*.deb"):
        cached = apt_archives / deb.name
        try:
            if cached.read_bytes() != deb.read_bytes():
                cached.unlink()
        except FileNotFoundError:
            pass


def _index(repo: Path) -> None:
    packages = _run(["apt-ftparchive", "packages", "."], "list the packages", cwd=repo).stdout
    (repo / "Packages").write_bytes(packages)
    with (
        open(repo / "Packages.gz", "wb") as raw,
        gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0, compresslevel=9) as gz,
    ):
        gz.write(packages)
    release = _run(
        [
            "apt-ftparchive",
            "-o",
            "APT::FTPArchive::Release::Origin=NVIDIA",
            "-o",
            "APT::FTPArchive::Release::Label=NVIDIA CUDA",
            "-o",
            "APT::FTPArchive::Release::Architectures=amd64 all",
            "-o",
            "APT::FTPArchive::Release::Description=CUDA repository (gpuhost sandbox stand-in)",
            "release",
            ".",
        ],
        "write Release",
        cwd=repo,
    ).stdout
    (repo / "Release").write_bytes(release)


def _sign(repo: Path, home: Path, fingerprint: str) -> None:
    gpg = [
        "gpg",
        "--homedir",
        str(home),
        "--batch",
        "--yes",
        "--pinentry-mode",
        "loopback",
        "--passphrase",
        "",
        "--local-user",
        fingerprint,
        "--digest-algo",
        "SHA512",
    ]
    _run(
        [*gpg, "--clearsign", "-o", str(repo / "InRelease"), str(repo / "Release")],
        "sign InRelease",
    )
    _run(
        [*gpg, "--armor", "--detach-sign", "-o", str(repo / "Release.gpg"), str(repo / "Release")],
        "sign Release.gpg",
    )


def _signing_key(home: Path) -> str:
    """The fingerprint of the lab's signing key; generates it on first use."""
    home.mkdir(parents=True, exist_ok=True)
    home.chmod(0o700)
    listed = _run(
        ["gpg", "--homedir", str(home), "--batch", "--with-colons", "--list-secret-keys"],
        "list the signing key",
        check=False,
    ).stdout.decode()
    fprs = [line.split(":")[9] for line in listed.splitlines() if line.startswith("fpr:")]
    if fprs:
        return fprs[0]
    _run(
        [
            "gpg",
            "--homedir",
            str(home),
            "--batch",
            "--pinentry-mode",
            "loopback",
            "--passphrase",
            "",
            "--quick-gen-key",
            KEY_UID,
            "rsa4096",
            "sign",
            "never",
        ],
        "generate the signing key",
    )
    return _signing_key(home)


def _inputs_digest(kernel_release: str, keyring: bytes) -> str:
    h = hashlib.sha256()
    h.update(Path(__file__).read_bytes())
    h.update(Path(debian_control.__file__).read_bytes() + debian_control.DATA.read_bytes())
    h.update(Path(ubuntu_driver.__file__).read_bytes())
    for path in sorted(p for p in STANDINS.iterdir() if p.is_file()):
        h.update(path.name.encode() + b"\0" + path.read_bytes())
    h.update(kernel_release.encode() + b"\0" + keyring)
    for tool in ("dpkg-deb", "apt-ftparchive"):
        h.update(_run([tool, "--version"], f"{tool} --version").stdout.splitlines()[0])
    return h.hexdigest()


def _check_kernel_release(kernel_release: str) -> None:
    # Debian package names: lowercase letters, digits, + - . (Policy 5.6.1)
    if not re.fullmatch(r"[0-9][a-z0-9.+-]*", kernel_release or ""):
        raise ValueError(
            f"kernel release {kernel_release!r} cannot name a linux-headers package "
            "(lowercase letters, digits, '.', '+', '-', starting with a digit)"
        )


def _run(cmd: list[str], what: str, *, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    try:
        proc = subprocess.run(cmd, capture_output=True, check=False, **kwargs)
    except OSError as exc:
        raise RepoError(f"could not {what}: {exc}") from exc
    if check and proc.returncode != 0:
        err = proc.stderr.decode(errors="replace").strip()
        raise RepoError(f"could not {what}: {' '.join(cmd[:2])} exited {proc.returncode}: {err}")
    return proc


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
