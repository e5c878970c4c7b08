"""Build flash-attn once per fleet: a detached, memory-capped build on one host, its wheel kept in
a cache on the controller, the cached wheel installed everywhere else, and a stamp on each host of
what was built against what."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from io import StringIO
from pathlib import Path
from typing import Any, Final

from pyinfra import host, logger
from pyinfra.api import FunctionCommand, StringCommand, operation
from pyinfra.api.exceptions import OperationError

from operations.runtime import remote
from operations.runtime.polled_lock import lock_exclusive
from operations.plans.cuda_compat import driver_problem
from operations.plans.gpu_arch import (
    COMPUTE_CAP_QUERY,
    ArchitectureError,
    check_compute_capability,
    check_wheel_code,
    parse_compute_caps,
    parse_wheel_check,
    wheel_check_command,
)
from operations.stages.disk import no_space_named
from operations.stages.pip_index import pip_index_args

#: The transient systemd unit the build runs in (``systemd-run``), detached from SSH.
BUILD_UNIT: Final = "gpuhost-flash-attn-build.service"
#: Where the build runs on the host: ``build.log``, ``wheels/``, ``key.json`` (the BuildKey it
#: builds) and ``complete`` (written when pip wheel exited 0).
BUILD_DIR: Final = "/opt/gpuhost/build/flash-attn"
#: Where a wheel to install is put on the host.
WHEEL_DIR: Final = "/opt/gpuhost/wheels"
#: The stamp, inside the venv (a new venv has none, so it builds or installs again).
STAMP_NAME: Final = "gpuhost-flash-attn.json"
#: Seconds between polls of the build: the first, and the most as the build goes on.
POLL_FIRST_S: Final = 2.0
POLL_MAX_S: Final = 30.0
#: Between two polls the host itself watches the build unit, this often (seconds), so that the
#: build's end is seen within a second, not at the next poll.
WATCH_EVERY_S: Final = 0.5
#: Seconds a build may take before the deploy gives up on it (the unit is stopped).
BUILD_TIMEOUT_S: Final = 6 * 3600
#: Lines of the build log shown when the build fails: its last lines, and the last lines that
#: look like a compiler's error or a kill (ninja's, nvcc's, gcc's wording).
LOG_TAIL_LINES: Final = 25
ERROR_LINES: Final = 10
ERROR_PATTERN: Final = r"error|killed|signal 9|build stopped"


@dataclass(frozen=True)
class BuildKey:
    """What a flash-attn wheel was built from and for: the controller cache's key and the stamp.

    ``flash_attn`` its version; ``torch`` torch.__version__ in the venv ("2.9.1+cu128");
    ``cuda`` nvcc's release ("12.8"); ``python`` the venv's major.minor ("3.12"); ``archs``
    FLASH_ATTN_CUDA_ARCHS ("120").
    """

    flash_attn: str
    torch: str
    cuda: str
    python: str
    archs: str

    def slug(self) -> str:
        """A folder name for the key: ``flash_attn-2.8.3.post2-torch2.9.1+cu128-cu12.8-py3.12-sm120``."""
        raw = (f"flash_attn-{self.flash_attn}-torch{self.torch}-cu{self.cuda}-py{self.python}"
               f"-sm{self.archs}")
        return re.sub(r"[^A-Za-z0-9.+_-]", "_", raw)

    def describe(self) -> str:
        return (f"flash-attn {self.flash_attn} for torch {self.torch}, CUDA {self.cuda}, "
                f"Python {self.python}, architectures {self.archs}")

    @classmethod
    def from_stamp(cls, stamp: Mapping[str, Any]) -> BuildKey | None:
        try:
            return cls(**{f.name: str(stamp[f.name]) for f in fields(cls)})
        except (KeyError, TypeError):
            return None


def read_stamp(text: str | None) -> dict[str, Any] | None:
    """The stamp's JSON object, or None for no stamp or one that does not parse."""
    if not text:
        return None
    try:
        stamp = json.loads(text)
    except ValueError:
        return None
    return stamp if isinstance(stamp, dict) else None


def stale_reasons(stamp: Mapping[str, Any] | None, installed: str | None, *, flash_attn: str,
                  torch_locked: str, torch_installed: str | None, cuda: str,
                  python: str | None, archs: str) -> list[str]:
    """Why the host's flash-attn must be built or installed again; [] when its stamp matches.

    + stamp: the host's stamp (see :func:`read_stamp`), None where there is none
    + installed: the flash-attn version ``pip list`` shows in the venv, None where absent
    + flash_attn, torch_locked: the lock's versions of flash-attn and torch
    + torch_installed: torch's version in the venv now (with its local part), None where absent
    + cuda: the CUDA toolkit the build uses ("12.8"); python: the venv's major.minor, None
      where unknown; archs: FLASH_ATTN_CUDA_ARCHS
    """
    key = BuildKey.from_stamp(stamp) if stamp else None
    if key is None:
        return ["no stamp of a flash-attn build in the venv"]
    reasons = []
    if installed != flash_attn:
        reasons.append(f"flash-attn {installed or 'missing'} in the venv, the lock has "
                       f"{flash_attn}")
    if key.flash_attn != flash_attn:
        reasons.append(f"built flash-attn {key.flash_attn}, the lock has {flash_attn}")
    if key.torch.split("+")[0] != torch_locked:
        reasons.append(f"torch changed: built against {key.torch}, the lock has {torch_locked}")
    elif torch_installed is not None and (
            # PyPI's torch is "2.9.1" to pip and "2.9.1+cu128" to itself: a local part is
            # compared only where pip shows one
            torch_installed.split("+")[0] != key.torch.split("+")[0]
            or ("+" in torch_installed and torch_installed != key.torch)):
        reasons.append(f"torch changed: built against {key.torch}, the venv has "
                       f"{torch_installed}")
    if key.cuda != cuda:
        reasons.append(f"CUDA changed: built with nvcc {key.cuda}, the toolkit is {cuda}")
    if python is not None and key.python != python:
        reasons.append(f"Python changed: built for {key.python}, the venv has {python}")
    if key.archs != archs:
        reasons.append(f"architectures changed: built for {key.archs}, wanted {archs}")
    return reasons


# --- the controller's cache -------------------------------------------------------------------


class WheelCache:
    """Built wheels on the controller: ``<root>/<key slug>/<wheel>`` beside ``key.json`` (the
    key, the wheel's name and sha256, the host that built it). Entries are written to a
    temporary folder and renamed into place, so a reader never sees half a wheel."""

    def __init__(self, root: str | Path):
        self.root = Path(os.path.expanduser(str(root)))

    def lookup(self, key: BuildKey) -> tuple[Path, str] | None:
        """The cached wheel and its sha256, or None. A wheel whose sha256 differs from its
        entry's is ignored (and rebuilt)."""
        folder = self.root / key.slug()
        try:
            meta = json.loads((folder / "key.json").read_text())
            wheel = folder / meta["wheel"]
            digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return (wheel, digest) if digest == meta.get("sha256") else None

    def discard(self, key: BuildKey) -> None:
        """Remove the key's entry (a wheel refused on the host), so that the next run builds."""
        folder = self.root / key.slug()
        if folder.exists():
            gone = self.root / f".{key.slug()}.discarded.{os.getpid()}"
            os.replace(folder, gone)
            _remove_tree(gone)

    def store(self, key: BuildKey, wheel: Path, built_on: str) -> tuple[Path, str]:
        """Move a fetched wheel into the cache; returns its cached path and sha256."""
        digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
        final = self.root / key.slug()
        tmp = self.root / f".{key.slug()}.{os.getpid()}.{built_on}"
        tmp.mkdir(parents=True, exist_ok=True)
        os.replace(wheel, tmp / wheel.name)
        meta = {**asdict(key), "wheel": wheel.name, "sha256": digest, "built_on": built_on,
                "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        (tmp / "key.json").write_text(json.dumps(meta, indent=2) + "\n")
        if final.exists():
            old = self.root / f".{key.slug()}.old.{os.getpid()}"
            os.replace(final, old)
            _remove_tree(old)
        os.replace(tmp, final)
        return final / wheel.name, digest

    @contextmanager
    def claimed(self, key: BuildKey, holder: str, poll_s: float = 2.0,
                log_prefix: str = "") -> Iterator[None]:
        """Hold the key while one host builds or installs it, so that hosts converging
        together (greenlets of one pyinfra run, or several runs on this controller) wait for
        the first host's wheel instead of compiling it again. An flock(2) on
        ``<root>/<slug>.lock``, polled so that other hosts' greenlets keep running."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{key.slug()}.lock"
        with open(path, "a+") as fh:
            def waiting() -> None:
                fh.seek(0)
                other = fh.read().strip() or "another deploy"
                logger.info(f"{log_prefix}flash-attn: waiting for {other}, "
                            f"which holds {key.describe()}")

            lock_exclusive(fh, waiting, poll_s)
            fh.seek(0)
            fh.truncate()
            fh.write(f"host {holder}\n")
            fh.flush()
            try:
                yield
            finally:
                fh.truncate(0)
                fcntl.flock(fh, fcntl.LOCK_UN)


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


# --- on the host --------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildPlan:
    """Everything the execution of a flash-attn build or install needs."""

    venv: str
    requirements: str
    index_url: str
    flash_attn: str
    archs: str
    compute_capability: str
    cuda_home: str
    max_jobs: int
    nvcc_threads: int
    memory_max_bytes: int
    cache_root: str
    #: The host's proxy variables (operations/plans/proxy.py), which a systemd-run unit does not
    #: inherit: pip fetches the sdist from the index inside the unit
    download_env: tuple[tuple[str, str], ...] = ()


class _Remote:
    """Commands on one host, with the run's sudo and environment (operations/runtime/remote.py)."""

    def __init__(self, host_):
        self.host = host_

    def run(self, command: str | StringCommand, what: str,
            timeout: float = remote.DEFAULT_TIMEOUT_S) -> str:
        ok, out = remote.shell(self.host, command, timeout=timeout)
        if not ok:
            raise OperationError(f"{what} failed: {out.stdout}\n{out.stderr}".strip())
        return out.stdout

    def put(self, src, dest: str) -> None:
        remote.put(self.host, src, dest)

    def get(self, src: str, dest: str) -> None:
        remote.get(self.host, src, dest)


def parse_nvcc_release(text: str) -> str | None:
    """"12.8" from ``nvcc --version``'s "Cuda compilation tools, release 12.8, V12.8.93"."""
    match = re.search(r"release (\d+\.\d+)", text)
    return match.group(1) if match else None


def check_nvcc(nvcc: str | None, torch_cuda: str | None, torch_version: str, cuda_home: str) -> None:
    """Refuse a build whose nvcc cannot build for the venv's torch, before it starts (torch's own
    check fails the same way, but only minutes into the build). Raises OperationError naming
    both versions where the major versions differ or either is unknown."""
    if nvcc is None:
        raise OperationError(f"no nvcc release from {cuda_home}/bin/nvcc --version: is the CUDA "
                             f"toolkit installed in {cuda_home}?")
    if torch_cuda in (None, "None"):
        raise OperationError(f"torch {torch_version} in the venv is not a CUDA build "
                             "(torch.version.cuda is None): flash-attn cannot build against it")
    if nvcc.split(".")[0] != torch_cuda.split(".")[0]:
        raise OperationError(
            f"nvcc {nvcc} ({cuda_home}) does not match torch.version.cuda {torch_cuda} "
            f"(torch {torch_version}): flash-attn must be built with the CUDA torch was built "
            "with; set gpuhost_cuda_toolkit or use a lock with a matching torch")
    if nvcc != ".".join(torch_cuda.split(".")[:2]):
        logger.warning(f"{host.print_prefix}flash-attn: nvcc {nvcc} and torch.version.cuda "
                       f"{torch_cuda} differ in the minor version (torch accepts this)")


def _probe(on_host: _Remote, plan: BuildPlan) -> BuildKey:
    """Read the venv's Python, torch and torch.version.cuda, the loaded driver and the GPUs'
    compute capability, and nvcc's release; refuse (OperationError) GPUs whose compute
    capability is not host data's (on a fresh host the driver answers only now, after the
    driver stage: planning could not compare them), an nvcc that cannot build for this torch,
    or a driver too old for the venv's CUDA (planning could not yet read torch.version.cuda)."""
    script = ("import sys, torch; print('%d.%d' % sys.version_info[:2]); "
              "print(torch.__version__); print(torch.version.cuda)")
    out = on_host.run(
        f"{shlex.quote(plan.venv)}/bin/python -c {shlex.quote(script)} && echo --driver && "
        "{ nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -n 1 "
        f"|| true; }} && echo --compute-cap && {{ {COMPUTE_CAP_QUERY} 2>&1 || true; }} && "
        f"echo --nvcc && {shlex.quote(plan.cuda_home)}/bin/nvcc --version",
        "reading torch, the driver, the GPUs and nvcc on the host")
    head, _, rest = out.partition("--driver\n")
    driver_text, _, rest = rest.partition("--compute-cap\n")
    caps_text, _, nvcc_text = rest.partition("--nvcc\n")
    check_compute_capability(parse_compute_caps(caps_text), plan.compute_capability)
    python, torch_version, torch_cuda = (line.strip() for line in head.splitlines()[:3])
    nvcc = parse_nvcc_release(nvcc_text)
    check_nvcc(nvcc, torch_cuda, torch_version, plan.cuda_home)
    driver = driver_text.strip()
    if re.fullmatch(r"\d+\.\d+(\.\d+)?", driver):
        problem = driver_problem(torch_cuda, f"torch.version.cuda of torch {torch_version}",
                                 driver)
        if problem:
            raise OperationError(f"{problem}; flash-attn and the server were left as they are")
    return BuildKey(plan.flash_attn, torch_version, nvcc or "", python, plan.archs)


def build_command(plan: BuildPlan) -> str:
    """The ``systemd-run`` command that starts the build detached from the SSH session, in a
    transient unit whose MemoryMax makes the kernel kill the build, not sshd, when it runs out
    of memory. The unit stays loaded after it ends (RemainAfterExit) so its result is read."""
    cuda = plan.cuda_home
    env = {
        "MAX_JOBS": str(plan.max_jobs),
        "NVCC_THREADS": str(plan.nvcc_threads),
        "FLASH_ATTN_CUDA_ARCHS": plan.archs,
        # Build here: without it flash-attn's setup.py fetches a prebuilt wheel instead.
        "FLASH_ATTENTION_FORCE_BUILD": "TRUE",
        "CUDA_HOME": cuda,
        "PATH": f"{cuda}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        **dict(plan.download_env),
    }
    pip = [f"{plan.venv}/bin/python", "-m", "pip", "wheel", "--no-deps", "--require-hashes",
           "--no-build-isolation", "--no-cache-dir", "--disable-pip-version-check",
           *pip_index_args(plan.index_url), "-r", plan.requirements,
           "--wheel-dir", f"{BUILD_DIR}/wheels"]
    command = [
        "systemd-run", f"--unit={BUILD_UNIT}",
        f"--description=flash-attn {plan.flash_attn} build (gpuhost)",
        f"--property=MemoryMax={plan.memory_max_bytes}", "--property=MemorySwapMax=0",
        "--property=RemainAfterExit=yes",
        f"--property=StandardOutput=truncate:{BUILD_DIR}/build.log",
        "--property=StandardError=inherit",
        f"--working-directory={BUILD_DIR}",
        *(f"--setenv={k}={v}" for k, v in env.items()),
        # the marker says the build finished, also to a run that finds the unit gone
        "/bin/sh", "-c", f'"$@" && : > {BUILD_DIR}/complete', "sh",
        *pip,
    ]
    return " ".join(shlex.quote(c) for c in command)


def _build_state(on_host: _Remote) -> tuple[dict[str, str], str, BuildKey | None, bool]:
    """The build unit's state, the log's last line, the key the build in BUILD_DIR is for
    (None where there is none) and whether it finished (its ``complete`` marker)."""
    # each part after a line of its own: the log's last line may have no newline (pip's
    # progress), and a marker printed after it would join it
    out = on_host.run(
        f"systemctl show -p LoadState -p ActiveState -p SubState -p Result -p ExecMainStatus "
        f"{BUILD_UNIT}; printf '\\n---\\n'; tail -n 1 {BUILD_DIR}/build.log 2>/dev/null; "
        f"printf '\\n---\\n'; cat {BUILD_DIR}/key.json 2>/dev/null; printf '\\n---\\n'; "
        f"test -e {BUILD_DIR}/complete && echo complete || true",
        "reading the build's state", timeout=remote.POLL_TIMEOUT_S)
    parts: list[list[str]] = [[]]
    for line in out.splitlines():
        if line == "---":
            parts.append([])
        elif line.strip():
            parts[-1].append(line)
    head, tail, key_lines, done = (parts + [[], [], []])[:4]
    state = dict(line.split("=", 1) for line in head if "=" in line)
    stamp = read_stamp("\n".join(key_lines))
    return (state, tail[-1].strip() if tail else "",
            BuildKey.from_stamp(stamp) if stamp else None, done == ["complete"])


def watch_command(seconds: float) -> str:
    """Wait on the host, up to ``seconds``, while the build unit runs (its SubState
    ``running``; RemainAfterExit leaves it ``exited`` when the build ends): returns within
    WATCH_EVERY_S of the build's end, exit status 0 either way."""
    script = (f'while [ "$(systemctl show -p SubState --value {BUILD_UNIT})" = running ]; '
              f"do sleep {WATCH_EVERY_S}; done")
    return f"timeout {max(1, round(seconds))} sh -c {shlex.quote(script)} || true"


def _start(on_host: _Remote, plan: BuildPlan, key: BuildKey) -> None:
    key_json = shlex.quote(json.dumps(asdict(key), sort_keys=True))
    on_host.run(f"systemctl stop {BUILD_UNIT} 2>/dev/null; "
               f"systemctl reset-failed {BUILD_UNIT} 2>/dev/null; "
               f"rm -rf {BUILD_DIR} && mkdir -p {BUILD_DIR}/wheels && "
               f"echo {key_json} > {BUILD_DIR}/key.json && {build_command(plan)}",
               "starting the build with systemd-run")
    logger.info(f"{host.print_prefix}flash-attn: build started in {BUILD_UNIT} "
                f"(MAX_JOBS={plan.max_jobs}, NVCC_THREADS={plan.nvcc_threads}, "
                f"MemoryMax={plan.memory_max_bytes / 2**30:.1f} GiB, log "
                f"{BUILD_DIR}/build.log)")


def _build(on_host: _Remote, plan: BuildPlan, key: BuildKey) -> str:
    """Start the build, or adopt the one an earlier run started for the same key (still
    running: follow it; finished: take its wheel), poll it until it ends, return the built
    wheel's path on the host. Raises OperationError with the log's tail when it fails."""
    state, _, built_for, done = _build_state(on_host)
    running = state.get("SubState") == "running"
    if built_for == key and done:
        logger.info(f"{host.print_prefix}flash-attn: the build an earlier run started "
                    f"finished meanwhile ({BUILD_DIR}): taking its wheel")
    elif built_for == key and running:
        logger.info(f"{host.print_prefix}flash-attn: a build is already running "
                    f"({BUILD_UNIT}): following it")
    else:
        if running:
            logger.info(f"{host.print_prefix}flash-attn: stopping the running build, which is "
                        f"for {built_for.describe() if built_for else 'an unknown key'}")
        _start(on_host, plan, key)
    start = time.monotonic()
    interval = POLL_FIRST_S
    while not done:
        on_host.run(watch_command(interval), "watching the build",
                    timeout=interval + remote.POLL_TIMEOUT_S)
        elapsed = time.monotonic() - start
        state, last, _, done = _build_state(on_host)
        sub = state.get("SubState", "?")
        logger.info(f"{host.print_prefix}flash-attn build: {elapsed:.0f} s, {sub}: "
                    f"{last[:160] or '(no output yet)'}")
        if sub != "running" and state.get("ActiveState") != "activating":
            break
        if elapsed > BUILD_TIMEOUT_S:
            on_host.run(f"systemctl stop {BUILD_UNIT}", "stopping the build")
            raise OperationError(f"flash-attn build still running after {elapsed:.0f} s: "
                                 f"stopped; see {BUILD_DIR}/build.log")
        interval = min(POLL_MAX_S, interval * 1.5)
    if not done:
        log = f"{BUILD_DIR}/build.log"
        # the compiler's own words (a kill, an error) come long before pip's traceback ends
        errors = on_host.run(f"grep -i -E {shlex.quote(ERROR_PATTERN)} {log} 2>/dev/null | "
                            f"tail -n {ERROR_LINES} || true", "reading the build log")
        tail = on_host.run(f"tail -n {LOG_TAIL_LINES} {log} 2>/dev/null || true",
                          "reading the build log")
        result = state.get("Result", "?")
        why = (" (out of memory: lower gpuhost_max_jobs or gpuhost_nvcc_threads)"
               if result == "oom-kill" else "")
        raise OperationError(
            f"flash-attn build failed: {BUILD_UNIT} ended with result {result}, exit status "
            f"{state.get('ExecMainStatus', '?')}{why}; error lines of {log}:\n"
            + "\n".join(f"    {line}" for line in errors.splitlines())
            + f"\nlast lines of {log}:\n"
            + "\n".join(f"    {line}" for line in tail.splitlines()))
    wheels = on_host.run(f"ls {BUILD_DIR}/wheels/*.whl", "finding the built wheel").split()
    if len(wheels) != 1:
        raise OperationError(f"the build left {len(wheels)} wheels in {BUILD_DIR}/wheels")
    on_host.run(f"systemctl stop {BUILD_UNIT} 2>/dev/null; "
               f"systemctl reset-failed {BUILD_UNIT} 2>/dev/null; true",
               "unloading the finished build unit")
    return wheels[0]


def check_machine_code(on_host: _Remote, plan: BuildPlan, wheel: str) -> None:
    """Refuse (ArchitectureError) a wheel on the host that has no machine code for the GPUs'
    architecture, as the toolkit's ``cuobjdump --list-elf`` lists its shared objects."""
    out = on_host.run(wheel_check_command(f"{plan.venv}/bin/python", wheel,
                                          f"{plan.cuda_home}/bin/cuobjdump"),
                      f"listing the machine code in {Path(wheel).name} (cuobjdump --list-elf)")
    check_wheel_code(Path(wheel).name, parse_wheel_check(out), plan.archs)


def _install(on_host: _Remote, plan: BuildPlan, local: Path, digest: str, *,
             check: bool) -> str:
    """Send the wheel, check its sha256 and (``check``: a cached one) its machine code, and
    install it; a refused wheel is removed from the host."""
    dest = f"{WHEEL_DIR}/{local.name}"
    on_host.run(f"mkdir -p {WHEEL_DIR}", "making the wheel folder")
    on_host.put(str(local), dest)
    on_host.run(f"echo {digest}' '{shlex.quote(dest)} | sha256sum --check --quiet",
               f"checking the sha256 of {dest}")
    try:
        if check:
            check_machine_code(on_host, plan, dest)
    except OperationError:
        on_host.run(f"rm -f {shlex.quote(dest)}", "removing the refused wheel")
        raise
    on_host.run(no_space_named(f"installing {local.name} into {plan.venv}", plan.venv, [
        f"{plan.venv}/bin/python", "-m", "pip", "install", "--no-deps", "--no-index",
        "--force-reinstall", "--disable-pip-version-check", dest]), f"installing {local.name}")
    return dest


def _build_and_cache(host, on_host: _Remote, plan: BuildPlan, key, cache: WheelCache):
    """Build the wheel on this host, check its machine code there, fetch it into the
    controller's cache; returns its cached path and sha256."""
    built = _build(on_host, plan, key)
    try:
        check_machine_code(on_host, plan, built)
    except ArchitectureError as exc:
        # not adopted by the next run either: it builds again
        on_host.run(f"rm -rf {BUILD_DIR}/wheels {BUILD_DIR}/complete",
                    "removing the refused wheel")
        raise ArchitectureError(f"{exc}: it is neither cached nor installed") from None
    fetch_dir = cache.root / f".fetch.{host.name}.{os.getpid()}"
    fetch_dir.mkdir(parents=True, exist_ok=True)
    fetched = fetch_dir / Path(built).name
    on_host.get(built, str(fetched))
    found = cache.store(key, fetched, host.name)
    fetch_dir.rmdir()
    logger.info(f"{host.print_prefix}flash-attn: built {found[0].name}, cached at {found[0]}")
    return found


@remote.callback("the flash-attn build",
                 f"a build goes on on the host ({BUILD_UNIT}) and the next run takes its wheel")
def converge(state, host, plan: BuildPlan) -> None:
    """Execution time: probe the venv's torch and nvcc, then install the controller's cached
    wheel for that key or, where there is none, build it on this host (one host per key at a
    time), fetch it into the cache and install it; write the stamp last. The host fails with
    one line on an OperationError or a lost connection (operations/runtime/remote.py)."""
    _converge(host, plan)


def _converge(host, plan: BuildPlan) -> None:
    on_host = _Remote(host)
    key = _probe(on_host, plan)
    cache = WheelCache(plan.cache_root)
    with cache.claimed(key, host.name, log_prefix=host.print_prefix):
        found = cache.lookup(key)
        if found is not None:
            source = f"controller cache {found[0]}"
            logger.info(f"{host.print_prefix}flash-attn: installing the cached wheel "
                        f"{found[0].name} ({key.describe()})")
            try:
                _install(on_host, plan, *found, check=True)
            except ArchitectureError as exc:
                # a wheel cached by an older gpuhost, or built for other GPUs: built again
                cache.discard(key)
                logger.warning(f"{host.print_prefix}flash-attn: {exc}: not installed, and "
                               f"removed from the controller's cache ({found[0].parent}); "
                               "building it on this host instead")
                found = None
        if found is None:
            found = _build_and_cache(host, on_host, plan, key, cache)
            source = f"built on {host.name}"
            # a wheel built just now was checked on the host that built it
            _install(on_host, plan, *found, check=False)
        wheel, digest = found
    stamp = {**asdict(key), "source": source, "wheel": wheel.name, "sha256": digest,
             "max_jobs": plan.max_jobs, "nvcc_threads": plan.nvcc_threads}
    # whole or not at all, mode 0644 whatever the umask: a temporary file, synced, renamed
    # (named as gpuhost's stamps are, venv_path.GPUHOST_ENTRY, should it be left behind)
    path, tmp = (shlex.quote(f"{plan.venv}/{name}")
                 for name in (STAMP_NAME, STAMP_NAME.replace(".json", "-new.json")))
    on_host.put(StringIO(json.dumps(stamp, indent=2, sort_keys=True) + "\n"),
                f"{plan.venv}/{STAMP_NAME.replace('.json', '-new.json')}")
    on_host.run(f"chmod 644 {tmp} && sync {tmp} && mv -f {tmp} {path}", "writing the build stamp")


@operation()
def built_wheel(plan: BuildPlan, reasons: list[str]):
    """flash-attn in the venv, built once per fleet (see :func:`converge`).

    + plan: what to build, with which parallelism and memory limit, and where the controller's
      cache is
    + reasons: why the stamp does not match (from :func:`stale_reasons`); [] means nothing to do

    Raises OperationError (failing the host) for GPUs whose compute capability is not host
    data's, nvcc not matching torch.version.cuda, a failed build (with the log's last lines), a
    wheel whose sha256 does not match, or a built one without machine code for the GPUs (neither
    cached nor installed). A cached wheel without it is removed from the cache and built anew.
    """
    if not reasons:
        host.noop(f"flash-attn {plan.flash_attn} built for the venv's torch (stamp matches)")
        return
    logger.info(f"{host.print_prefix}flash-attn {plan.flash_attn}: " + "; ".join(reasons))
    yield FunctionCommand(converge, (plan,), {})
