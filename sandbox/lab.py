"""Bring the sandbox lab up and down, and say what is running (sandbox/README.md is the contract).

`up` gives fresh hosts every time: it first takes down any previous lab, then extracts a new
root filesystem per host from the cached tarball, links it to this machine through its own
network namespace, starts the services on the links, boots the hosts and waits for their sshd.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from sandbox import fleet_keys, hub, image, network, overlay, procs, rootfs, scenarios, services, trash
from sandbox.layout import (
    APT_ARCHIVES,
    CACHE,
    GUEST_APT_ARCHIVES,
    DEFAULT_SCENARIO,
    HOSTS_DIR,
    KNOWN_HOSTS,
    LOCK_FILE,
    LOCK_FILES,
    PYPI_CACHE,
    ROOTFS_TAR,
    SERVICES_DIR,
    SSH_DIR,
    SSH_KEY,
    SSH_PORT,
    STATE_DIR,
    STATE_FILE,
    TRASH,
    WWW,
    HostSpec,
    host_from_name,
    host_specs,
)
from sandbox.tools import ensure_tools

STATE_VERSION = 1
HUB_TOKEN = STATE_DIR / "hub" / "token"  # the hub stand-in's token, also on each host
BOOT_TIMEOUT_S = 180.0
POWEROFF_TIMEOUT_S = 30.0
#: Set to 1 (tests/lanes.py does, for its units), `down` only sets the host trees aside: the
#: lab's next `up` deletes them in the background (sandbox/trash.py), a plain `down` at the end.
DEFER_REMOVAL_ENV = "GPUHOST_SANDBOX_DEFER_REMOVAL"


class LabError(RuntimeError):
    """The lab could not be brought up or down; the message says what to look at."""


def _say(message: str) -> None:
    print(f"sandbox: {message}", file=sys.stderr, flush=True)


def require_root(action: str) -> None:
    """Raise LabError unless running as root (namespaces, nspawn and mounts need it)."""
    if os.geteuid() != 0:
        raise LabError(
            f"`{action}` needs root (network namespaces, systemd-nspawn): "
            f"run it as root, e.g. sudo {sys.executable} -m sandbox {action}"
        )


@contextlib.contextmanager
def _exclusive() -> Iterator[None]:
    """One `up` or `down` at a time."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / ".lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LabError(f"another `up` or `down` holds {STATE_DIR / '.lock'}") from None
        yield


@contextlib.contextmanager
def _shared_cache() -> Iterator[None]:
    """One lab at a time fills the caches all labs share (the root filesystem, PyPI's real
    wheels); another lab's `up` waits for it rather than fetching the same files alongside."""
    CACHE.mkdir(parents=True, exist_ok=True)
    with open(CACHE / ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def load_state() -> dict[str, Any] | None:
    """The state file's content, or None when no lab was brought up."""
    try:
        return json.loads(STATE_FILE.read_text())
    except FileNotFoundError:
        return None


def _save_state(state: dict[str, Any]) -> None:
    tmp = STATE_FILE.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=1) + "\n")
    os.replace(tmp, STATE_FILE)


def ensure_ssh_key() -> str:
    """The lab's root key (ed25519, made once); returns the public key line."""
    SSH_DIR.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not SSH_KEY.exists():
        rootfs.ssh_keygen(SSH_KEY, "ed25519", "gpuhost-sandbox")
    return SSH_KEY.with_suffix(".pub").read_text().strip()


def ssh_command(spec: HostSpec, *remote: str, connect_timeout: int = 5) -> list[str]:
    """ssh as root to `spec` with the lab key, checking the host keys `up` generated."""
    return [
        "ssh",
        "-i", str(SSH_KEY),
        "-o", "BatchMode=yes",
        "-o", "IdentitiesOnly=yes",
        "-o", f"UserKnownHostsFile={KNOWN_HOSTS}",
        "-o", "StrictHostKeyChecking=yes",
        "-o", f"ConnectTimeout={connect_timeout}",
        "-o", "LogLevel=ERROR",
        f"root@{spec.address}",
        *remote,
    ]  # fmt: skip


def _hardware_json(scenario: str) -> str:
    try:
        return scenarios.hardware_json(scenario)
    except ValueError as exc:
        raise LabError(str(exc)) from exc


def _optional_module(name: str) -> Any | None:
    """A colleague's builder module, or None while it is not written yet."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
        _say(f"{name.replace('.', '/')}.py does not exist yet: not building what it serves")
        return None


def build_www(kernel_release: str) -> str | None:
    """Fill the HTTP root: NVIDIA's repository and the package index; returns the repository
    keyring's sha256 (None when the repository builder is missing)."""
    WWW.mkdir(parents=True, exist_ok=True)
    PYPI_CACHE.mkdir(parents=True, exist_ok=True)
    keyring_sha256 = None
    nvidia_repo = _optional_module("sandbox.nvidia_repo")
    if nvidia_repo is not None:
        keyring_sha256 = nvidia_repo.build(WWW, kernel_release)["keyring_sha256"]
    pypi_index = _optional_module("sandbox.pypi_index")
    if pypi_index is not None:
        with _shared_cache():
            pypi_index.build(WWW, PYPI_CACHE, LOCK_FILE,
                             {k: v for k, v in LOCK_FILES.items() if v != LOCK_FILE})
    return keyring_sha256


def _prepare_host(spec: HostSpec, authorized_key: str, hardware_json: str,
                  tar: Path = ROOTFS_TAR) -> list[str]:
    """A fresh root filesystem (an overlay of `tar`'s tree: sandbox/overlay.py, seeded with
    the lab's .debs) and link for `spec`; returns its SSH host public keys."""
    overlay.mount(spec.dir, tar, APT_ARCHIVES, GUEST_APT_ARCHIVES)
    keys = rootfs.personalise(spec, spec.root, authorized_key, hardware_json)
    network.create(spec)
    return keys


def _console_tail(spec: HostSpec, lines: int = 30) -> str:
    try:
        text = spec.console_log.read_text(errors="replace")
    except FileNotFoundError:
        return "(no console log)"
    return "\n".join(text.splitlines()[-lines:])


def _wait_ssh(spec: HostSpec, supervisor: procs.Proc, deadline: float) -> float:
    """Wait until `ssh root@host true` succeeds; returns when, raises LabError at the deadline."""
    error = ""
    while True:
        if not procs.alive(supervisor):
            raise LabError(
                f"{spec.name} stopped while booting; {spec.console_log} ends with:\n"
                + _console_tail(spec)
            )
        if _sshd_answers(spec):
            proc = subprocess.run(
                ssh_command(spec, "true", connect_timeout=2),
                capture_output=True,
                text=True,
                stdin=subprocess.DEVNULL,
                check=False,
            )
            if proc.returncode == 0:
                return time.monotonic()
            error = proc.stderr.strip()
        if time.monotonic() > deadline:
            raise LabError(
                f"{spec.name}: no ssh on {spec.address}:{SSH_PORT} in time"
                + (f" (ssh said: {error})" if error else "")
                + f"; {spec.console_log} ends with:\n{_console_tail(spec)}"
                + "\n(the lab is left as it is for a look; `python -m sandbox down` removes it)"
            )
        time.sleep(0.2)


def _sshd_answers(spec: HostSpec, timeout: float = 0.5) -> bool:
    """True when something on the host's port 22 sends an SSH banner."""
    try:
        with socket.create_connection((spec.address, SSH_PORT), timeout=timeout) as s:
            s.settimeout(timeout)
            return s.recv(4).startswith(b"SSH-")
    except OSError:
        return False


def up(
    hosts: int = 1, scenario: str = DEFAULT_SCENARIO, boot_timeout: float = BOOT_TIMEOUT_S,
    from_image: Path | None = None, host_scenarios: Mapping[str, str] | None = None,
) -> list[dict[str, Any]]:
    """Fresh hosts gpu1..gpuN, booted and answering ssh; returns `status()`. With `from_image`
    (sandbox/image.py), each host's tree comes from that image instead of the bare root
    filesystem. `host_scenarios` gives some hosts a scenario of their own (by host name: a
    CPU-only router VM, ``{"gpu4": "cpu-only"}``, beside GPU hosts of `scenario`); with an
    image, a host of another scenario than the image's starts from the bare root filesystem
    (a router VM from the distribution's image beside GPU hosts from one made of a GPU host).

    Raises LabError (root needed, unknown scenario, an image of another scenario, a host
    scenario for a host this lab does not have, a host that does not boot: the message carries
    the console log's tail), ValueError for a host count outside 1..254.
    """
    require_root("up")
    specs = host_specs(hosts)
    own = dict(host_scenarios or {})
    unknown = sorted(set(own) - {s.name for s in specs})
    if unknown:
        raise LabError(f"--host-scenario names {', '.join(unknown)}, not a host of this lab "
                       f"(gpu1..gpu{hosts})")
    hardware = {s.name: _hardware_json(own.get(s.name, scenario)) for s in specs}
    trees = {s.name: ROOTFS_TAR for s in specs}
    if from_image is not None:
        trees.update({s.name: from_image for s in specs
                      if own.get(s.name, scenario) == scenario})
        made = _describe_image(from_image)
        if made["scenario"] != scenario:
            raise LabError(f"image {from_image} was made under scenario {made['scenario']!r}, "
                           f"not {scenario!r}")
    started = time.monotonic()
    with _exclusive():
        ensure_tools()
        _down(defer_removal=True)
        authorized_key = ensure_ssh_key()
        with _shared_cache():
            built = rootfs.ensure_tarball()
        if built:
            _say(f"root filesystem built in {time.monotonic() - started:.0f}s")
        state: dict[str, Any] = {
            "version": STATE_VERSION,
            "scenario": scenario,
            "host_scenarios": own,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "cuda_keyring_sha256": None,
            "httpd": None,
            "hub": None,
            "hosts": [
                {
                    "name": s.name,
                    "address": s.address,
                    "gateway": s.gateway,
                    "supervisor": None,
                    "proxy": None,
                }
                for s in specs
            ],
        }
        _save_state(state)
        network.create_switch()
        _prepare(specs, state, authorized_key, hardware, trees)
        _start_services(specs, state)
        _boot(specs, state, boot_timeout)
        _say(f"lab up in {time.monotonic() - started:.1f}s")
        # the trees set aside: deleted in the background (sandbox/trash.py)
        trash.delete_in_background(trash.entries())
    return status()


def _prepare(
    specs: list[HostSpec], state: dict[str, Any], authorized_key: str, hardware: dict[str, str],
    trees: dict[str, Path] | None = None,
) -> None:
    """Host trees (each from `trees`' tar for it, default the bare root filesystem) and links
    in parallel, the HTTP root alongside; writes known_hosts."""
    began = time.monotonic()
    workers = max(2, min(len(specs), 2 * (os.cpu_count() or 1)))
    for tar in {(trees or {}).get(s.name, ROOTFS_TAR) for s in specs}:
        overlay.lower(tar)  # each lower tree once, before the hosts' threads mount it
    with ThreadPoolExecutor(max_workers=workers + 1) as pool:
        www = pool.submit(build_www, os.uname().release)
        prepared = [pool.submit(_prepare_host, s, authorized_key, hardware[s.name],
                                (trees or {}).get(s.name, ROOTFS_TAR))
                    for s in specs]
        host_keys = [f.result() for f in prepared]
        state["cuda_keyring_sha256"] = www.result()
    _save_state(state)
    token = hub.ensure_token(HUB_TOKEN)
    for spec in specs:
        hub.install_token(spec.root, token)
    serving = {s.name: bool(json.loads(hardware[s.name])["gpus"]) for s in specs}
    if not all(serving.values()):  # a fleet behind a router host (sandbox/fleet_keys.py)
        keys = fleet_keys.ensure(STATE_DIR)
        for spec in specs:
            fleet_keys.install(spec.root, serving[spec.name], keys)
    KNOWN_HOSTS.write_text(
        "".join(f"{s.address} {key}\n" for s, keys in zip(specs, host_keys) for key in keys)
    )
    _say(f"{len(specs)} host tree(s) and link(s) ready in {time.monotonic() - began:.1f}s")


def _start_services(specs: list[HostSpec], state: dict[str, Any]) -> None:
    state["httpd"] = services.start_httpd(specs).to_json()
    _save_state(state)
    state["hub"] = hub.start(specs, HUB_TOKEN).to_json()
    _save_state(state)
    for entry, spec in zip(state["hosts"], specs):
        entry["proxy"] = services.start_proxy(spec).to_json()
        _save_state(state)


def _boot(specs: list[HostSpec], state: dict[str, Any], timeout: float) -> None:
    """Start every host's supervisor, then wait for all their sshd at once."""
    began = time.monotonic()
    supervisors = []
    for entry, spec in zip(state["hosts"], specs):
        supervisors.append(services.start_supervisor(spec))
        entry["supervisor"] = supervisors[-1].to_json()
        _save_state(state)
    with ThreadPoolExecutor(max_workers=len(specs)) as pool:
        waits = [pool.submit(_wait_ssh, s, p, began + timeout) for s, p in zip(specs, supervisors)]
        for spec, wait in zip(specs, waits):
            _say(f"{spec.name} ({spec.address}) answers ssh {wait.result() - began:.1f}s into boot")


def _describe_image(tar: Path) -> dict[str, Any]:
    try:
        return image.describe(tar)
    except image.ImageError as exc:
        raise LabError(str(exc)) from exc


def save_image(name: str, tar: Path) -> None:
    """Power host `name` off (orderly, as `down` does), write its tree to image `tar`
    (sandbox/image.py) and boot it again, as a VM is stopped for an image of its disk; returns
    once its sshd answers. The rest of the lab stays as it is."""
    require_root("image")
    with _exclusive():
        state = load_state()
        entry = next((h for h in (state or {}).get("hosts", []) if h["name"] == name), None)
        if state is None or entry is None:
            raise LabError(f"no host {name!r} in this lab (python -m sandbox status)")
        procs.stop([procs.Proc.from_json(entry.get("supervisor"))], POWEROFF_TIMEOUT_S)
        began = time.monotonic()
        try:
            image.save(host_from_name(name).root, tar, scenario_of(state, name), name)
        except image.ImageError as exc:
            raise LabError(str(exc)) from exc
        _say(f"{name} powered off, image {tar} written in {time.monotonic() - began:.1f}s")
        spec = host_from_name(name)
        supervisor = services.start_supervisor(spec)
        entry["supervisor"] = supervisor.to_json()
        _save_state(state)
        booted = time.monotonic()
        _wait_ssh(spec, supervisor, booted + BOOT_TIMEOUT_S)
        _say(f"{name} answers ssh {time.monotonic() - booted:.1f}s into boot")


def _host_state(entry: dict[str, Any]) -> str:
    if not procs.alive(procs.Proc.from_json(entry.get("supervisor"))):
        return "stopped"
    return "running" if _sshd_answers(host_from_name(entry["name"])) else "booting"


def status() -> list[dict[str, Any]]:
    """The hosts of the lab, as inventory/sandbox.py reads them (sandbox/README.md, Inventory):
    name, address, gateway, switch_address (where the lab's other hosts reach it, over the lab
    switch), state (running / booting / stopped), ssh_user (the operator, a sudo
    user: the deploy never logs in as root), ssh_key, cuda_repo_url, cuda_keyring_sha256,
    pip_index_url, lock (the stand-in lock's path: CUDA 12.8's stack, the default), locks (each
    stack's stand-in lock by CUDA release, {"12.8": ..., "13.0": ...}: a host switched to
    gpuhost_cuda_toolkit = "13.0" takes that one as its gpuhost_lock, as a real lab names its
    own lock), fleet_data (in a lab with a router host, the fleet's keys and binds:
    sandbox/fleet_keys.py; else {}). [] when no lab is up."""
    state = load_state()
    if state is None:
        return []
    out = []
    datas = {e["name"]: _scenario_host_data(scenario_of(state, e["name"]))
             for e in state["hosts"]}
    fleet = not all(d.get("gpuhost_serving", True) for d in datas.values())
    for entry in state["hosts"]:
        spec = host_from_name(entry["name"])
        scenario = scenario_of(state, spec.name)
        host_data = datas[spec.name]
        serving = host_data.get("gpuhost_serving", True)
        if serving:
            host_data.update(_hub_host_data(spec))
        out.append(
            {
                "name": spec.name,
                "address": spec.address,
                "gateway": spec.gateway,
                "switch_address": spec.switch_address,
                "state": _host_state(entry),
                "ssh_user": rootfs.OPERATOR,
                "ssh_key": str(SSH_KEY),
                "cuda_repo_url": spec.cuda_repo_url,
                "cuda_keyring_sha256": state.get("cuda_keyring_sha256"),
                "pip_index_url": spec.pip_index_url,
                "lock": str(LOCK_FILE),
                "locks": {cuda: str(path) for cuda, path in LOCK_FILES.items()},
                "known_hosts": str(KNOWN_HOSTS),
                "scenario": scenario,
                "host_data": host_data,
                "fleet_data": fleet_keys.host_data(spec.switch_address, serving) if fleet else {},
            }
        )
    return out


def _hub_host_data(spec: HostSpec) -> dict[str, Any]:
    """The model from the hub stand-in on the host's link, and the token `up` put on the host."""
    return {
        "gpuhost_model": hub.REPO_ID,
        "gpuhost_hf_endpoint": f"http://{spec.gateway}:{hub.PORT}",
        "gpuhost_hf_token_file": hub.TOKEN_ON_HOST,
    }


def scenario_of(state: Mapping[str, Any], name: str) -> str:
    """Host `name`'s scenario: its own (``up --host-scenario``), else the lab's."""
    return (state.get("host_scenarios") or {}).get(name) or state.get("scenario",
                                                                      DEFAULT_SCENARIO)


def _scenario_host_data(scenario: str) -> dict[str, Any]:
    """What an inventory says of the scenario's hardware: its GPU count and compute capability,
    and a tensor parallel size that uses every GPU; on a host without GPUs, that it serves no
    model (a router host: docs/fleet.md)."""
    gpus = json.loads(scenarios.hardware_json(scenario))["gpus"]
    if not gpus:
        return {"gpuhost_serving": False}
    return {
        "gpuhost_gpu_count": len(gpus),
        "gpuhost_compute_capability": gpus[0]["compute_cap"],
        "gpuhost_tensor_parallel_size": len(gpus),
    }


def link(name: str, up: bool, switch_only: bool = False) -> None:
    """Drop or bring back host ``name``'s side of its link, or of its switch port alone
    (network.set_link); LabError for a host this lab does not have."""
    require_root("link")
    state = load_state()
    if state is None or name not in [h["name"] for h in state["hosts"]]:
        raise LabError(f"no host {name!r} in this lab (python -m sandbox status)")
    network.set_link(host_from_name(name), up, switch_only)


def down() -> None:
    """Stop every host (orderly poweroff, then SIGKILL), the services, remove the namespaces,
    links and host trees. Idempotent: with no lab up it does nothing."""
    require_root("down")
    with _exclusive():
        _down(defer_removal=os.environ.get(DEFER_REMOVAL_ENV) == "1")


def _down(defer_removal: bool = False) -> None:
    """Take the lab down; with `defer_removal` the host trees are only moved into TRASH, for
    `up` to delete once its new hosts answer (this machine's ext4 has no journal: inodes freed
    in the last minute make creating new ones slow, so extracting right after a delete crawls);
    without, it waits for a deleter still at work (sandbox/trash.py) and removes TRASH too."""
    state = load_state() or {}
    entries = state.get("hosts", [])
    supervisors = [procs.Proc.from_json(e.get("supervisor")) for e in entries]
    procs.stop(supervisors, POWEROFF_TIMEOUT_S)
    service_procs = [procs.Proc.from_json(state.get("httpd")),
                     procs.Proc.from_json(state.get("hub"))]
    service_procs += [procs.Proc.from_json(e.get("proxy")) for e in entries]
    procs.stop(service_procs, 5)
    stubborn = procs.empty_cgroup()
    for ns in network.lab_namespaces():
        for pid in network.namespace_pids(ns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            stubborn.add(pid)
    deadline = time.monotonic() + 5
    while stubborn and time.monotonic() < deadline:
        stubborn = {pid for pid in stubborn if Path(f"/proc/{pid}").exists()}
        time.sleep(0.1)
    if stubborn:
        raise LabError(f"processes of the lab would not die: {sorted(stubborn)}")
    network.remove_all()
    trees = sorted(p for p in HOSTS_DIR.glob("gpu*") if p.is_dir()) if HOSTS_DIR.is_dir() else []
    for tree in trees:
        # what the host downloaded lies in its upper folder (a tree of an older lab: in root)
        rootfs.harvest_apt_archives(overlay.upper(tree) if overlay.upper(tree).is_dir()
                                    else tree / "root")
        overlay.unmount_below(tree)
    if defer_removal:
        rootfs.set_aside(trees, TRASH)
    else:
        with trash.held():
            _remove_trees([*trees, TRASH])
    shutil.rmtree(SERVICES_DIR, ignore_errors=True)
    KNOWN_HOSTS.unlink(missing_ok=True)
    STATE_FILE.unlink(missing_ok=True)
    if entries or trees:
        _say(f"lab down ({', '.join(p.name for p in trees) or 'no host trees'})")


def _remove_trees(trees: list[Path]) -> None:
    trees = [t for t in trees if t.exists()]
    if trees:
        with ThreadPoolExecutor(max_workers=len(trees)) as pool:
            list(pool.map(rootfs.remove_tree, trees))
