"""The SGLang server's command line, rendered from host settings."""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Final, Protocol

from operations import REPO_ROOT

LOCKS: Final = REPO_ROOT / "locks"


#: Each flag :func:`server_args` renders and the host data keys (without ``gpuhost_``) that
#: own it, set or not: gpuhost_server_extra_args may name none of these, in any spelling
#: argparse takes (``--moe-runner-b``, ``--moe-runner-backend=x``), even where the key is
#: None and the flag left out. One source per flag keeps what the unit runs and what planning
#: reads (the known behaviour, the choices left to sglang) the same thing; matching the table
#: against the command line instead would have to mirror argparse's last-one-wins for every
#: flag and action, and a miss there would be silent.
OWNED_FLAGS: Final = {
    "--model": ("model", "model_dir"),
    "--served-model-name": ("served_model_name",),
    "--reasoning-parser": ("reasoning_parser",),
    "--tool-call-parser": ("tool_call_parser",),
    "--trust-remote-code": ("trust_remote_code",),
    "--tensor-parallel-size": ("tensor_parallel_size",),
    "--pipeline-parallel-size": ("pipeline_parallel_size",),
    "--nnodes": ("nodes",),
    "--node-rank": ("nodes",),
    "--dist-init-addr": ("nodes", "node_interface", "dist_init_port"),
    "--mem-fraction-static": ("mem_fraction_static",),
    "--max-running-requests": ("max_running_requests",),
    "--kv-cache-dtype": ("kv_cache_dtype",),
    "--quantization": ("quantization",),
    "--attention-backend": ("attention_backend",),
    "--fp8-gemm-backend": ("fp8_gemm_backend",),
    "--fp4-gemm-backend": ("fp4_gemm_backend",),
    "--nsa-decode-backend": ("nsa_decode_backend",),
    "--nsa-prefill-backend": ("nsa_prefill_backend",),
    "--moe-runner-backend": ("moe_runner_backend",),
    "--speculative-algorithm": ("speculative_algorithm",),
    "--speculative-num-steps": ("speculative_num_steps", "speculative_algorithm"),
    "--speculative-eagle-topk": ("speculative_eagle_topk", "speculative_algorithm"),
    "--speculative-num-draft-tokens": ("speculative_num_draft_tokens", "speculative_algorithm"),
    "--enable-flashinfer-allreduce-fusion": ("enable_flashinfer_allreduce_fusion",),
    "--host": ("server_host",),
    "--port": ("server_port", "server_backend_port"),
}


#: Flags every server gets, owned by no key: ``--enable-metrics`` (Prometheus' /metrics, which
#: operations/stages/observability.py scrapes). gpuhost_server_extra_args may not name them either.
ALWAYS_FLAGS: Final = ("--enable-metrics",)


class ServerKeys(Protocol):
    """What :func:`server_args` reads of the host settings (operations.plans.settings.Settings has
    each): a protocol of its own, so that this module needs nothing of settings, which imports
    it to check the rendered command line against the locked sglang's parser."""

    @property
    def model_path(self) -> str: ...
    @property
    def served_model_name(self) -> str: ...
    @property
    def reasoning_parser(self) -> str | None: ...
    @property
    def tool_call_parser(self) -> str | None: ...
    @property
    def trust_remote_code(self) -> bool: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def mem_fraction_static(self) -> float: ...
    @property
    def max_running_requests(self) -> int: ...
    @property
    def kv_cache_dtype(self) -> str: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def attention_backend(self) -> str | None: ...
    @property
    def fp8_gemm_backend(self) -> str | None: ...
    @property
    def fp4_gemm_backend(self) -> str | None: ...
    @property
    def nsa_decode_backend(self) -> str | None: ...
    @property
    def nsa_prefill_backend(self) -> str | None: ...
    @property
    def moe_runner_backend(self) -> str | None: ...
    @property
    def speculative_algorithm(self) -> str | None: ...
    @property
    def speculative_num_steps(self) -> int | None: ...
    @property
    def speculative_eagle_topk(self) -> int | None: ...
    @property
    def speculative_num_draft_tokens(self) -> int | None: ...
    @property
    def enable_flashinfer_allreduce_fusion(self) -> bool: ...
    @property
    def server_is_public(self) -> bool: ...
    @property
    def server_host(self) -> str: ...
    @property
    def server_port(self) -> int: ...
    @property
    def server_backend_port(self) -> int: ...
    @property
    def server_extra_args(self) -> tuple[str, ...]: ...


class NodeFlags(Protocol):
    """A node's place in a server across hosts (operations.plans.node_group.NodeRole has it): its
    --nnodes/--node-rank/--dist-init-addr flags. A protocol, so that this module imports nothing
    of node_group, which renders the flags through it to compare nodes."""

    def server_args(self) -> list[str]: ...


def server_args(settings: ServerKeys, role: NodeFlags | None = None) -> list[str]:
    """``python -m sglang.launch_server`` arguments, in the reference launch's order
    (../shared/reference-lab.md), with ``--tensor-parallel-size`` spelled out (the reference's
    ``--tp`` works only as an argparse abbreviation of ``--tp-size``). Flags whose setting is
    None are left out (the speculative step counts also without ``--speculative-algorithm``);
    P2P-dependent flags (--disable-custom-all-reduce) come from the P2P
    decision, not from here.

    The model is the local folder (``settings.model_path``) the weights were downloaded to.
    When the server is public (``settings.server_is_public``) it binds 127.0.0.1 on
    ``gpuhost_server_backend_port`` behind the API key gate; sglang never gets the key (it logs
    its arguments and /server_info returns them). ``--enable-metrics`` is always on (sglang
    0.5.9's store_true flag, locks/sglang-0.5.9.args.json): /metrics answers on the same bind,
    so it is as closed to clients as the API.

    ``role`` (operations/plans/node_group.py), for a node of a server across hosts, adds --nnodes,
    --node-rank and --dist-init-addr after the tensor (and pipeline) parallel size."""
    s = settings
    args = ["--model", s.model_path, "--served-model-name", s.served_model_name]
    optional = [
        ("--reasoning-parser", s.reasoning_parser),
        ("--tool-call-parser", s.tool_call_parser),
    ]
    args += [a for flag, value in optional if value is not None for a in (flag, value)]
    if s.trust_remote_code:
        args.append("--trust-remote-code")
    args += [
        "--tensor-parallel-size", str(s.tensor_parallel_size),
    ]
    if s.pipeline_parallel_size is not None:
        args += ["--pipeline-parallel-size", str(s.pipeline_parallel_size)]
    if role is not None:
        args += role.server_args()
    args += [
        "--mem-fraction-static", repr(s.mem_fraction_static),
        "--max-running-requests", str(s.max_running_requests),
        "--kv-cache-dtype", s.kv_cache_dtype,
    ]
    optional = [
        ("--quantization", s.quantization),
        ("--attention-backend", s.attention_backend),
        ("--fp8-gemm-backend", s.fp8_gemm_backend),
        ("--fp4-gemm-backend", s.fp4_gemm_backend),
        ("--nsa-decode-backend", s.nsa_decode_backend),
        ("--nsa-prefill-backend", s.nsa_prefill_backend),
        ("--moe-runner-backend", s.moe_runner_backend),
    ]
    args += [a for flag, value in optional if value is not None for a in (flag, value)]
    if s.speculative_algorithm is not None:  # MTP: the step counts only with it
        args += ["--speculative-algorithm", s.speculative_algorithm]
        steps = [("--speculative-num-steps", s.speculative_num_steps),
                 ("--speculative-eagle-topk", s.speculative_eagle_topk),
                 ("--speculative-num-draft-tokens", s.speculative_num_draft_tokens)]
        args += [a for flag, value in steps if value is not None for a in (flag, str(value))]
    if s.enable_flashinfer_allreduce_fusion:
        args.append("--enable-flashinfer-allreduce-fusion")
    # Prometheus' /metrics on the server's own port (operations/stages/observability.py scrapes it):
    # on the loopback, or behind the API key gate where the server is public.
    args += ALWAYS_FLAGS
    host, port = ("127.0.0.1", s.server_backend_port) if s.server_is_public \
        else (s.server_host, s.server_port)
    args += ["--host", host, "--port", str(port), *s.server_extra_args]
    return args


class FlagError(ValueError):
    """A server flag the locked sglang does not accept: names the flag, the value, the sglang
    version and, where one exists, the replacement."""


@dataclass(frozen=True)
class ArgSpec:
    """One argument of sglang's parser, as tools/sglang_args.py reads it from the wheel."""

    flags: tuple[str, ...]
    action: str
    choices: tuple[str, ...] | None
    nargs: str | int | None
    type: str | None


@dataclass(frozen=True)
class ParserSpec:
    """sglang's launch_server arguments for one version (locks/sglang-<version>.args.json),
    with the renames later versions made (locks/sglang-flag-renames.json)."""

    version: str
    arguments: tuple[ArgSpec, ...]
    renames: dict[str, str]

    def by_flag(self) -> dict[str, ArgSpec]:
        return {flag: arg for arg in self.arguments for flag in arg.flags}


#: Actions that take no value (argparse's store_true, store_false, store_const, count).
_NO_VALUE = {"store_true", "store_false", "store_const", "count", "help", "version"}


def load_parser_spec(version: str, locks: Path = LOCKS) -> ParserSpec:
    """Read the argument data of an sglang version. Raises FlagError where the repository has
    no data for it (run tools/sglang_args.py <version>)."""
    path = locks / f"sglang-{version}.args.json"
    if not path.is_file():
        known = sorted(p.name[len("sglang-"):-len(".args.json")]
                       for p in locks.glob("sglang-*.args.json"))
        raise FlagError(f"no argument data for sglang {version} ({path.name}); known: "
                        f"{', '.join(known)}; make it with tools/sglang_args.py {version}")
    data = json.loads(path.read_text())
    arguments = tuple(
        ArgSpec(tuple(a["flags"]), a.get("action") or "store",
                tuple(a["choices"]) if a.get("choices") is not None else None,
                a.get("nargs"), a.get("type"))
        for a in data["arguments"]
    )
    renames_path = locks / "sglang-flag-renames.json"
    renames = json.loads(renames_path.read_text()).get("renames", {}) if renames_path.is_file() \
        else {}
    return ParserSpec(data["version"], arguments, renames)


def _resolve(flag: str, spec: ParserSpec, by_flag: dict[str, ArgSpec]) -> ArgSpec:
    if flag in by_flag:
        return by_flag[flag]
    # argparse's allow_abbrev: a unique prefix of a long option is that option.
    matches = {id(a): a for f, a in by_flag.items() if f.startswith(flag)}
    if len(matches) == 1:
        return next(iter(matches.values()))
    if matches:
        names = sorted(f for f, a in by_flag.items() if f.startswith(flag))
        raise FlagError(f"{flag} is ambiguous for sglang {spec.version}: it could be "
                        f"{', '.join(names[:6])}")
    hint = ""
    if flag in spec.renames:
        hint = f"; its replacement is {spec.renames[flag]}"
    else:
        for old, new in spec.renames.items():
            if new.split("=")[0] == flag:
                hint = f"; sglang {spec.version} calls it {old}"
    close = difflib.get_close_matches(flag, list(by_flag), n=1)
    if not hint and close:
        hint = f"; did you mean {close[0]}?"
    raise FlagError(f"sglang {spec.version} has no flag {flag}{hint}")


def flags_named(args: list[str], spec: ParserSpec) -> list[tuple[str, ArgSpec]]:
    """Each flag of a launch_server command line with the argument sglang's argparse takes it
    for: ``--ho``, ``--host`` and ``--host=0.0.0.0`` all name ``--host``. Values are skipped.
    Raises FlagError for an unknown or ambiguous flag, as :func:`check_server_args`."""
    by_flag = spec.by_flag()
    return [(token, _resolve(token.partition("=")[0], spec, by_flag))
            for token in args if token.startswith("--")]


def _check_value(flag: str, value: str, arg: ArgSpec, version: str) -> None:
    if arg.choices is not None and value not in arg.choices:
        raise FlagError(f"{flag} {value}: sglang {version} allows only "
                        f"{', '.join(arg.choices)}")
    kinds = {"int": (int, "an integer"), "float": (float, "a number")}
    if arg.type in kinds:
        convert, what = kinds[arg.type]
        try:
            convert(value)
        except ValueError:
            raise FlagError(f"{flag} {value}: sglang {version} wants {what}") from None


def check_server_args(args: list[str], spec: ParserSpec) -> None:
    """Check a launch_server command line as sglang's own argparse parser would, without
    sglang: every flag known (or a unique prefix of one), a value where one is needed, values
    within a flag's choices and of its type. Raises FlagError for the first problem."""
    by_flag = spec.by_flag()
    i = 0
    while i < len(args):
        token = args[i]
        if not token.startswith("--"):
            raise FlagError(f"{token!r} is not a flag (sglang {spec.version} takes no "
                            "positional arguments)")
        flag, eq, inline = token.partition("=")
        arg = _resolve(flag, spec, by_flag)
        i += 1
        if arg.action in _NO_VALUE:
            if eq:
                raise FlagError(f"{flag} takes no value in sglang {spec.version}")
            continue
        if eq:
            values = [inline]
        elif arg.nargs in ("+", "*", "?"):
            values = []
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
            if arg.nargs == "+" and not values:
                raise FlagError(f"{flag} needs at least one value (sglang {spec.version})")
        else:
            if i >= len(args) or args[i].startswith("--"):
                raise FlagError(f"{flag} needs a value (sglang {spec.version})")
            values = [args[i]]
            i += 1
        for value in values:
            _check_value(flag, value, arg, spec.version)
