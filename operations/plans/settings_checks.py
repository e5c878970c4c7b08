"""Checks of a host's stack settings against each other: GPUs, driver, CUDA, lock, flags, venv."""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

from packaging.version import Version

from operations.plans.lock import LockError, read_lock
from operations.plans.p2p_policy import NO_P2P_FLAGS as P2P_SERVER_FLAGS
from operations.plans.settings_bench import SWEEP_KEYS
from operations.plans.settings_host import (
    CUDA_MIN_DRIVER,
    CUDA_TOOLKITS,
    DRIVER_BRANCHES,
    OPEN_MODULE_ONLY_FROM,
    TORCH_DEFAULT_CUDA,
)
from operations.plans.settings_mlenv import GPUHOST_DIRS
from operations.plans.settings_rules import PREFIX, SettingsError, _fail
from operations.plans.settings_schema import RULES, Settings
from operations.plans.sglang import (
    ALWAYS_FLAGS,
    OWNED_FLAGS,
    FlagError,
    check_server_args,
    flags_named,
    load_parser_spec,
    server_args,
)


def _check_tensor_parallel(host: str, s: Settings) -> None:
    """On one host, the tensor parallel size a divisor of the GPU count (times the pipeline
    parallel size, where set). Across nodes, every GPU of every node: sglang 0.5.9 places
    tp x pp / nnodes ranks on each node (sglang/srt/entrypoints/engine.py,
    _launch_scheduler_processes: tp_size_per_node), so a node runs exactly gpuhost_gpu_count
    ranks only when tp x pp = GPUs per node x nodes."""
    pp = s.pipeline_parallel_size or 1
    if s.nodes:
        if host not in s.nodes:
            raise _fail(host, "nodes", list(s.nodes),
                        f"a list of the group's hosts that names this host ({host}): it "
                        "gets the group's data, so it serves one rank of it")
        total = s.gpu_count * len(s.nodes)
        across = (f"the group's {total} GPUs ({PREFIX}gpu_count {s.gpu_count} x "
                  f"{len(s.nodes)} nodes)")
        if total % pp:
            raise _fail(host, "pipeline_parallel_size", pp, f"a divisor of {across}")
        if s.tensor_parallel_size * pp != total:
            raise _fail(host, "tensor_parallel_size", s.tensor_parallel_size,
                        f"{total // pp}: {across}"
                        + (f" divided by {PREFIX}pipeline_parallel_size {pp}" if pp > 1 else "")
                        + "; sglang runs tensor x pipeline parallel size / nodes ranks on "
                        "each node, one per GPU")
        return
    if s.gpu_count % pp:
        raise _fail(host, "pipeline_parallel_size", pp,
                    f"a divisor of {PREFIX}gpu_count ({s.gpu_count}) on one host")
    per_stage = s.gpu_count // pp
    if s.tensor_parallel_size > per_stage or per_stage % s.tensor_parallel_size:
        divisors = [n for n in range(1, per_stage + 1) if per_stage % n == 0]
        raise _fail(
            host,
            "tensor_parallel_size",
            s.tensor_parallel_size,
            f"a divisor of {PREFIX}gpu_count ({s.gpu_count})"
            + (f" / {PREFIX}pipeline_parallel_size ({pp})" if pp > 1 else "") + ": "
            + ", ".join(str(n) for n in divisors),
        )


def _check_flavour(host: str, s: Settings) -> None:
    major, minor = (int(p) for p in s.compute_capability.split("."))
    if s.driver_flavour != "open" and (major, minor) >= OPEN_MODULE_ONLY_FROM:
        raise _fail(
            host,
            "driver_flavour",
            s.driver_flavour,
            f"only 'open' on compute capability {s.compute_capability}: NVIDIA supports "
            "Blackwell and newer GPUs with the open kernel modules only",
        )


def _check_driver(host: str, s: Settings) -> None:
    """The driver branch (and version) at least the minimum of gpuhost_cuda_toolkit's CUDA
    (CUDA_MIN_DRIVER: NVIDIA's release notes, Table 3; CUDA 13.0 needs R580, >= 580.65.06)."""
    text = CUDA_MIN_DRIVER[s.cuda_toolkit]
    floor = Version(text).major
    if int(s.driver_branch) < floor:
        fits = "".join(f"; or {PREFIX}cuda_toolkit = {c!r}" for c in CUDA_TOOLKITS
                       if int(s.driver_branch) >= Version(CUDA_MIN_DRIVER[c]).major)
        raise _fail(host, "driver_branch", s.driver_branch,
                    f"with {PREFIX}cuda_toolkit = {s.cuda_toolkit!r}, a branch that supports "
                    f"CUDA {s.cuda_toolkit} (driver >= {text}): "
                    + ", ".join(b for b in DRIVER_BRANCHES if int(b) >= floor) + fits)
    if s.driver_version is not None and not s.driver_version.startswith(f"{s.driver_branch}."):
        raise _fail(host, "driver_version", s.driver_version,
                    f"a version of driver branch {s.driver_branch} ({PREFIX}driver_branch)")
    if s.driver_version is not None and Version(s.driver_version) < Version(text):
        raise _fail(host, "driver_version", s.driver_version, f"a driver >= {text}, the "
                    f"minimum for CUDA {s.cuda_toolkit} ({PREFIX}cuda_toolkit)")


def _check_lock(host: str, s: Settings) -> None:
    if not s.lock_path.is_file():
        raise _fail(host, "lock", s.lock, f"an existing lock file (not found: {s.lock_path})")
    _check_server_flags(host, s)


def _check_speculative(host: str, s: Settings) -> None:
    """MTP: the locked sglang has the speculative flags and NEXTN among its algorithms (where
    its parser lists them: 0.5.17's takes any text); the step counts set together or all left
    to sglang (0.5.9's server_args.py asserts topk and draft tokens None where the steps are).
    The checkpoint's MTP layer is read from its weight index (operations/plans/stack_check.py)."""
    if s.speculative_algorithm is None:
        return
    try:
        sglang = read_lock(s.lock_path).get("sglang")
        spec = load_parser_spec(sglang.version) if sglang else None
    except (LockError, FlagError):
        return  # said by _check_lock
    if spec is None:
        return
    by_flag = spec.by_flag()
    for flag in ("--speculative-algorithm", "--speculative-num-steps",
                 "--speculative-eagle-topk", "--speculative-num-draft-tokens"):
        if flag not in by_flag:
            raise _fail(host, "speculative_algorithm", s.speculative_algorithm,
                        f"None: the locked sglang {spec.version} has no {flag} "
                        f"(locks/sglang-{spec.version}.args.json)")
    choices = by_flag["--speculative-algorithm"].choices
    if choices is not None and s.speculative_algorithm not in choices:
        raise _fail(host, "speculative_algorithm", s.speculative_algorithm,
                    f"None: the locked sglang {spec.version} offers "
                    f"{', '.join(choices) or 'no algorithm'} for --speculative-algorithm")
    if s.speculative_num_steps is None:
        for key in ("speculative_eagle_topk", "speculative_num_draft_tokens"):
            if getattr(s, key) is not None:
                raise _fail(host, key, getattr(s, key),
                            f"None with {PREFIX}speculative_num_steps None: sglang "
                            f"{spec.version} chooses the three step counts together or takes "
                            "all three as given (server_args.py asserts it)")


def _check_mok(host: str, s: Settings) -> None:
    """The MOK's key and certificate go together (DKMS signs with both), as two files."""
    pair = {"mok_signing_key": s.mok_signing_key, "mok_certificate": s.mok_certificate}
    for key, other in (("mok_signing_key", "mok_certificate"),
                       ("mok_certificate", "mok_signing_key")):
        if pair[key] is None and pair[other] is not None:
            raise _fail(host, key, None, f"a path as well, since {PREFIX}{other} is set: DKMS "
                        "signs with a private key and its certificate, named together")
    if s.mok_signing_key is not None and s.mok_signing_key == s.mok_certificate:
        raise _fail(host, "mok_certificate", s.mok_certificate,
                    f"a file other than {PREFIX}mok_signing_key's: the private key and its "
                    "DER certificate are two files")


def _known_flags(flags: list[str], spec: Any) -> list[tuple[str, Any]]:
    """:func:`flags_named` of those of ``flags`` the locked sglang has (an older one may lack
    some of the flags gpuhost owns: the speculative ones; a key that would render one is
    refused on its own, _check_speculative)."""
    found = []
    for flag in flags:
        try:
            found += flags_named([flag], spec)
        except FlagError:
            continue
    return found


def _check_server_flags(host: str, s: Settings) -> None:
    try:
        lock = read_lock(s.lock_path)
    except LockError as exc:
        raise _fail(host, "lock", s.lock, f"a lock that parses ({exc})") from None
    _check_torch_cuda(host, s, lock)
    sglang = lock.get("sglang")
    if sglang is None:
        raise _fail(host, "lock", s.lock, "a lock that pins sglang")
    try:
        spec = load_parser_spec(sglang.version)
        check_server_args(server_args(s), spec)
        extra = flags_named(list(s.server_extra_args), spec)
        owned = {arg.flags: flag for flag, arg in _known_flags(list(OWNED_FLAGS), spec)}
        rendered = {arg.flags for _, arg in
                    flags_named([*server_args(replace(s, server_extra_args=())),
                                 *P2P_SERVER_FLAGS], spec)}
    except FlagError as exc:
        raise SettingsError(
            f"host {host}: the server's flags (gpuhost_* server keys, "
            f"gpuhost_server_extra_args) do not fit the locked sglang: {exc}"
        ) from None
    for token, arg in extra:
        if any("api-key" in flag for flag in arg.flags):
            raise _fail(
                host, "server_extra_args", _without_values(s.server_extra_args),
                f"no API key flag ({token.partition('=')[0]} is {arg.flags[0]}; sglang logs "
                "its arguments and "
                f"/server_info returns them): name a root-only key file in {PREFIX}api_key_file",
            )
        if arg.flags in owned:
            keys = " and ".join(PREFIX + k for k in OWNED_FLAGS[owned[arg.flags]])
            raise _fail(
                host, "server_extra_args", list(s.server_extra_args),
                f"no flag gpuhost sets itself ({token} is {arg.flags[0]}, which {keys} "
                "owns, set or not: the known behaviour and the backends left to sglang are "
                "read from the key, so a second spelling would run unchecked): set "
                f"{keys} instead (null leaves an optional flag out)",
            )
        if any(flag in arg.flags for flag in ALWAYS_FLAGS):
            raise _fail(
                host, "server_extra_args", list(s.server_extra_args),
                f"no flag gpuhost sets itself ({token} is {arg.flags[0]}, which every server "
                "gets): leave it out",
            )
        if arg.flags in rendered:
            raise _fail(
                host, "server_extra_args", list(s.server_extra_args),
                f"no flag gpuhost sets itself ({token} is {arg.flags[0]}, set from the "
                f"{PREFIX}* server keys, the bind address and the P2P decision, which it would "
                "silently override): set the matching key instead",
            )


def _check_sweep(host: str, s: Settings) -> None:
    """The sweep's key one of SWEEP_KEYS; its values non-empty, distinct, each allowed on its own
    and by the locked sglang's parser (what launch_server would refuse at start)."""
    if not s.bench_sweep:
        return
    ((key, values),) = s.bench_sweep.items()
    if s.nodes:
        raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                    f"None on a node of a server across hosts ({PREFIX}nodes = "
                    f"{list(s.nodes)}): a sweep restarts one host's server alone, and a rank "
                    "restarted alone leaves the others waiting in NCCL's rendezvous")
    if key not in SWEEP_KEYS:
        raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                    f"a sweep over one of {', '.join(SWEEP_KEYS)} (not {key!r})")
    if not values or len(set(map(repr, values))) != len(values):
        raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                    f"a non-empty list of distinct values for {key}")
    for value in values:
        if (value is None and key != "speculative_algorithm") or not RULES[key].check(value):
            raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                        f"values of {key} each {RULES[key].allowed} ({value!r} is not)")
    try:
        sglang = read_lock(s.lock_path).get("sglang")
        spec = load_parser_spec(sglang.version) if sglang else None
    except (LockError, FlagError):
        return  # said by _check_lock
    for value in values if spec else ():
        try:
            if key == "speculative_algorithm":
                _check_speculative(host, replace(s, speculative_algorithm=value))
            check_server_args(server_args(replace(s, **{key: value})), spec)
        except SettingsError as exc:  # NEXTN's: the host data's step counts
            raise _fail(host, "bench_sweep", dict(s.bench_sweep), "values whose NEXTN the host "
                        f"data allows ({str(exc).split(': ', 1)[1].rstrip('.')})") from None
        except FlagError as exc:
            raise _fail(host, "bench_sweep", dict(s.bench_sweep),
                        f"values the locked sglang {sglang.version} accepts: {exc}") from None


def _check_bench(host: str, s: Settings) -> None:
    """Every level within what the server runs at once, and enough prompts to reach the highest
    (the model's context length is checked on the host, by bench.py, from its config)."""
    over = [n for n in s.bench_levels if n > s.max_running_requests]
    if over:
        raise _fail(host, "bench_levels", list(s.bench_levels),
                    f"levels from 1 to {PREFIX}max_running_requests ({s.max_running_requests}):"
                    f" the server runs no more requests at once ({over[0]} is more)")
    if s.bench_sweep and s.bench_target == "router":
        raise _fail(host, "bench_target", s.bench_target,
                    f"'host' with {PREFIX}bench_sweep: a sweep restarts one host's server, "
                    "which the router then takes out; sweep a host's own server")
    if s.bench_prompts < max(s.bench_levels):
        raise _fail(host, "bench_prompts", s.bench_prompts,
                    f"at least the highest of {PREFIX}bench_levels ({max(s.bench_levels)}): "
                    "fewer prompts never reach that many concurrent requests")


def _without_values(args: Iterable[str]) -> list[str]:
    """Extra server args for a message about an API key in them: every value replaced by
    "<hidden>" (a key must not reach the screen or a log)."""
    return [a.partition("=")[0] + "=<hidden>" if a.startswith("--") and "=" in a
            else a if a.startswith("--") else "<hidden>" for a in args]


def torch_cuda(lock: Any) -> str | None:
    """The CUDA release ("12.8") the lock's torch was built for: from torch's local version
    ("2.9.1+cu128"), else the lock's nvidia-cuda-runtime-cu1N pin (torch's CUDA runtime
    wheel), else PyPI's default build of that torch release (TORCH_DEFAULT_CUDA). None when
    the lock has no torch or none of these tells."""
    torch = lock.get("torch")
    if torch is None:
        return None
    local = re.search(r"\+cu(\d+)(\d)$", torch.version)
    if local:
        return f"{local.group(1)}.{local.group(2)}"
    for pin in lock.pins:
        if re.fullmatch(r"nvidia-cuda-runtime(-cu1\d)?", pin.name):
            return ".".join(pin.version.split(".")[:2])
    return TORCH_DEFAULT_CUDA.get(".".join(torch.version.split(".")[:2]))


def _check_torch_cuda(host: str, s: Settings, lock: Any) -> None:
    if lock.get("torch") is None:
        return
    cuda = torch_cuda(lock)
    if cuda is None or cuda not in CUDA_MIN_DRIVER:
        raise _fail(host, "lock", s.lock,
                    f"a lock whose torch says its CUDA release (a +cuXYZ version or an "
                    f"nvidia-cuda-runtime pin) among {', '.join(CUDA_MIN_DRIVER)}; "
                    f"torch {lock.get('torch').version} gives {cuda or 'none'}")
    if Version(cuda).major != Version(s.cuda_toolkit).major:
        raise _fail(host, "cuda_toolkit", s.cuda_toolkit,
                    f"a CUDA {Version(cuda).major}.x toolkit: the locked torch "
                    f"{lock.get('torch').version} is built for CUDA {cuda}, and what builds "
                    f"against it (flash-attn, FlashInfer's JIT) needs an nvcc of that major "
                    f"({PREFIX}lock = {s.lock!r})")
    if cuda == s.cuda_toolkit:
        return  # the same minimum as the toolkit's: _check_driver says it
    text = CUDA_MIN_DRIVER[cuda]
    minimum = Version(text)
    if s.driver_version is not None and Version(s.driver_version) < minimum:
        raise _fail(host, "driver_version", s.driver_version,
                    f"a driver >= {text}, the minimum for CUDA {cuda}, which the locked "
                    f"torch {lock.get('torch').version} needs ({PREFIX}lock = {s.lock!r})")
    if Version(s.driver_branch) < Version(str(minimum.major)):
        raise _fail(host, "driver_branch", s.driver_branch,
                    f"a branch >= {minimum.major}: the locked torch "
                    f"{lock.get('torch').version} needs CUDA {cuda}, driver >= {text} "
                    f"({PREFIX}lock = {s.lock!r})")


def _overlaps(a: str, b: str) -> bool:
    """Whether one path is the other or lies inside it."""
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _check_venv_path(host: str, s: Settings) -> None:
    """The venv apart from every folder gpuhost manages and from the files other keys name:
    a venv is cleared when it does not run, and pip writes into it."""
    theirs = dict(GPUHOST_DIRS)
    theirs[s.model_dir] = f"the model weights' folder, {PREFIX}model_dir"
    if s.model_is_local:
        theirs[s.model] = f"the served model's folder, {PREFIX}model"
    for key in ("api_key_file", "hf_token_file", "mok_signing_key", "mok_certificate",
                "fleet_key_file"):
        value = getattr(s, key)
        if value is not None:
            theirs[value] = f"the file {PREFIX}{key} names"
    for path, what in theirs.items():
        if not _overlaps(s.venv_path, path):
            continue
        how = ("is" if s.venv_path == path else "contains" if path.startswith(s.venv_path + "/")
               else "lies inside")
        raise _fail(host, "venv_path", s.venv_path,
                    f"a folder of the venv's own, apart from what gpuhost manages: it {how} "
                    f"{path}, {what} (a venv that does not run is cleared, and pip writes into "
                    f"it); the default is {Settings.venv_path}")
