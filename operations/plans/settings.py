"""Typed, validated host settings read once from pyinfra host data.

Every public key has the prefix ``gpuhost_`` and one declaration: a field of one concern's
settings (operations/plans/settings_host.py, settings_mlenv.py, settings_server.py,
settings_bench.py, settings_fleet.py, settings_observability.py), ``setting(default, rule,
sentence)`` (operations/plans/settings_rules.py), from which the Settings dataclass's field, the
rule whose text every refusal of the value quotes, and the sentence of docs/reference.md
(tools/docs_gen.py) all come. One declaration, because three lists of the same keys (the
fields, RULES, HELP) drift apart: a key added to one and not the others was caught only by an
assert or a test. The declaration stays a plain dataclass field, so ``Settings`` is still what
every operation reads, typed; the field's metadata holds the rest, and RULES and HELP are views
of it (operations/plans/settings_schema.py). The concerns' dataclasses are composed into one
Settings by inheritance, in the order of the reference's sections.

A wrong value raises :class:`SettingsError` naming the host, the key, the value and what is
allowed, before any operation is planned for any host; the checks of settings against each
other are operations/plans/settings_checks.py's and operations/plans/settings_exposure.py's. This
module is the entry point the others import: it reads host data into Settings, for one host, an
inventory or a run.
"""

from __future__ import annotations

import ast
import difflib
import ipaddress
import re
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Final

from operations.runtime.run_exit import end_run
from operations.plans import launch_profiles
from operations.plans.lock import LockError, read_lock
from operations.plans.node_group import check_groups
from operations.plans.settings_bench import SWEEP_KEYS, default_bench_levels
from operations.plans.settings_checks import (
    _check_bench,
    _check_driver,
    _check_flavour,
    _check_lock,
    _check_mok,
    _check_speculative,
    _check_sweep,
    _check_tensor_parallel,
    _check_venv_path,
    torch_cuda,
)
from operations.plans.settings_exposure import (
    _check_dist_init_port,
    _check_observability_ports,
    _check_router_exposure,
    _check_server_exposure,
    _check_serving,
    _check_tls,
    _check_trusted_peers,
)
from operations.plans.settings_fleet import ROUTER_METRICS_PORT, ROUTER_POLICIES
from operations.plans.settings_host import (
    CUDA_MIN_DRIVER,
    CUDA_TOOLKITS,
    DRIVER_BRANCHES,
    DRIVER_FLAVOURS,
    OPEN_MODULE_ONLY_FROM,
    TORCH_DEFAULT_CUDA,
    UNPACKAGED_DRIVER,
)
from operations.plans.settings_mlenv import GPUHOST_DIRS, P2P_OVERRIDES
from operations.plans.settings_rules import PREFIX, SettingsError, _control_characters, _fail
from operations.plans.settings_schema import HELP, RULES, Settings
from operations.plans.settings_server import (
    DIST_INIT_PORT,
    DROPIN_NAME,
    RESERVED_ENV,
    SPECULATIVE_ALGORITHMS,
)
from operations.plans.sglang import FlagError, check_server_args, load_parser_spec, server_args

#: The names other modules and tests import from here, defined in the modules above.
__all__ = ["CUDA_MIN_DRIVER", "CUDA_TOOLKITS", "DIST_INIT_PORT", "DRIVER_BRANCHES",
           "DRIVER_FLAVOURS", "DROPIN_NAME", "GPUHOST_DIRS", "HELP", "OPEN_MODULE_ONLY_FROM",
           "P2P_OVERRIDES", "PREFIX", "RESERVED_ENV", "ROUTER_METRICS_PORT", "ROUTER_POLICIES",
           "RULES", "SPECULATIVE_ALGORITHMS", "SWEEP_KEYS", "TORCH_DEFAULT_CUDA",
           "UNPACKAGED_DRIVER", "ProfileChoice", "Settings", "SettingsError", "data_sources",
           "default_bench_levels", "for_inventory", "for_run", "from_host_data",
           "launch_choice", "notes", "profile_choice", "torch_cuda"]

#: Keys whose values are version-like strings: pyinfra's --data turns "570" into 570, "13.0"
#: into 13.0 and "580.95" into 580.95, so numbers are taken as the string they were typed as.
_NUMBER_AS_TEXT: Final = ("driver_branch", "cuda_toolkit", "compute_capability", "driver_version")

_FIELDS: Final = frozenset(RULES)


def _sourced(exc: SettingsError, sources: Mapping[str, str] | None) -> str:
    """A problem's line, with where its key's value came from when ``sources`` tells."""
    message = str(exc)
    if sources is None or exc.key is None:
        return message
    where = sources.get(exc.key)
    return message + (f" It is set in {where}." if where else " It is the default.")


def _typed(data: Mapping[str, Any]) -> dict[str, Any]:
    """Host data's ``gpuhost_`` values by setting name, as the Settings fields take them
    (version-like numbers as the text typed, lists as tuples)."""
    values: dict[str, Any] = {}
    for key, value in data.items():
        if not isinstance(key, str) or not key.startswith(PREFIX):
            continue
        name = key[len(PREFIX):]
        if name in _NUMBER_AS_TEXT and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            value = str(value)
        values[name] = tuple(value) if name in ("server_extra_args", "allowed_dropins",
                                                "bench_levels", "nodes",
                                                "api_gate_trusted_peers",
                                                "server_local_users", "tls_names") \
            else value
    if (cuda := values.get("cuda_toolkit", Settings.cuda_toolkit)) in CUDA_TOOLKITS:
        values.setdefault("lock", CUDA_TOOLKITS[cuda])
    return values


def profile_choice(host: str, data: Mapping[str, Any]) -> ProfileChoice:
    """:func:`launch_choice` of a host's raw host data (already validated by
    :func:`for_run`), for the plan's log (operations/plans/stack_check.py)."""
    return launch_choice(host, _typed(data))


def from_host_data(host: str, data: Mapping[str, Any],
                   sources: Mapping[str, str] | None = None) -> Settings:
    """Build one host's :class:`Settings` from its merged host data.

    + host: the host's name, for messages
    + data: pyinfra host data (inventory, group_data and defaults merged)
    + sources: where each key's value came from (:func:`data_sources`), added to messages

    Raises :class:`SettingsError` for an unknown ``gpuhost_`` key (with the closest known key),
    a value of the wrong type or outside what is allowed, or settings that contradict each
    other (a tensor parallel size that does not divide the GPU count, the proprietary driver
    flavour on Blackwell): every such problem, one line each. Settings are checked against
    each other only once every value is allowed on its own.
    """
    problems: list[str] = []
    for key, value in data.items():
        try:
            _check_key(host, key, value)
        except SettingsError as exc:
            problems.append(_sourced(exc, sources))
    if problems:
        raise SettingsError("\n".join(problems), problems=problems)
    values = _typed(data)
    if values.get("serving", Settings.serving):
        try:
            choice = launch_choice(host, values)
        except SettingsError as exc:
            problems.append(_sourced(exc, sources))
        else:
            values = choice.applied(values)
    if "bench_levels" not in values:
        values["bench_levels"] = default_bench_levels(values.get(
            "max_running_requests", Settings.max_running_requests))
    settings = Settings(**values)
    for check in _TOGETHER:
        if not settings.serving and check in _SERVING_ONLY:
            continue
        try:
            check(host, settings)
        except SettingsError as exc:
            problems.append(_sourced(exc, sources))
    if problems:
        raise SettingsError("\n".join(problems), problems=problems)
    return settings


@dataclass(frozen=True)
class ProfileChoice:
    """The launch profile a host's data gets (operations/plans/launch_profiles.py).

    + profile: the profile, None where none is for the host's GPUs, model and sglang
    + given: the profile's settings the host data sets itself (they win)
    + passed_over: profiles for the host that the locked sglang's parser refused, with why
    + sglang: the locked sglang's version ("" where the lock cannot be read)
    + named: whether gpuhost_launch_profile named it (else the default choice)
    """

    profile: launch_profiles.LaunchProfile | None
    given: frozenset[str]
    passed_over: tuple[tuple[str, str], ...]
    sglang: str
    named: bool = False

    def applied(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` with the profile's value of each setting they do not set, and the
        profile's name as gpuhost_launch_profile."""
        out = dict(values)
        if self.profile is None:
            return out
        for setting, value in self.profile.settings().items():
            if setting not in self.given:
                out[setting] = dict(value) if isinstance(value, Mapping) else value
        out["launch_profile"] = self.profile.name
        return out


def launch_choice(host: str, values: Mapping[str, Any]) -> ProfileChoice:
    """The launch profile for one host's settings (``values``: host data without the prefix,
    each value allowed on its own): the one gpuhost_launch_profile names, else the first of
    launch_profiles.PROFILES for the host's compute capability (gpuhost_compute_capability),
    model architecture and locked sglang whose command line, with the host's own values
    winning, the locked sglang's parser accepts (locks/sglang-<version>.args.json).

    Raises :class:`SettingsError` for a named profile that is for other GPUs, another model
    architecture or another sglang, or whose flags the locked sglang refuses. Where the lock
    cannot be read, no profile (the lock's own check says why)."""
    given = frozenset(k for k in values if k in launch_profiles.PROFILE_SETTINGS)
    base = Settings(**values)
    try:
        sglang = read_lock(base.lock_path).get("sglang")
        spec = load_parser_spec(sglang.version) if sglang is not None else None
    except (LockError, FlagError):
        spec = None
    if spec is None:
        return ProfileChoice(None, given, (), "")
    version = spec.version
    here = (base.compute_capability, base.model_architecture, version)
    fits = launch_profiles.matching(*here)

    def refusal(profile: launch_profiles.LaunchProfile) -> str | None:
        ours = {k: v for k, v in profile.settings().items() if k not in given}
        try:
            check_server_args(server_args(replace(base, **ours)), spec)
        except FlagError as exc:
            return str(exc)
        return None

    if base.launch_profile is not None:
        profile = launch_profiles.named(base.launch_profile)
        if profile not in fits:
            raise _fail(host, "launch_profile", base.launch_profile,
                        f"a profile for compute capability {here[0]}, {PREFIX}model_architecture "
                        f"{here[1]} and the locked sglang {version} ({profile.name} is for "
                        f"compute capability {profile.compute_capability}, "
                        f"{', '.join(profile.architectures)}, sglang {profile.sglang or 'any'}); "
                        f"for this host: {', '.join(p.name for p in fits) or 'none'}, or None")
        why = refusal(profile)
        if why is not None:
            raise _fail(host, "launch_profile", base.launch_profile,
                        f"a profile whose flags the locked sglang {version} accepts ({why}); "
                        "for this host: " + (", ".join(p.name for p in fits
                                                       if refusal(p) is None) or "none")
                        + ", or None")
        return ProfileChoice(profile, given, (), version, named=True)
    passed: list[tuple[str, str]] = []
    for profile in fits:
        why = refusal(profile)
        if why is None:
            return ProfileChoice(profile, given, tuple(passed), version)
        passed.append((profile.name, why))
    return ProfileChoice(None, given, tuple(passed), version)


def _check_key(host: str, key: Any, value: Any) -> None:
    """Raise :class:`SettingsError` unless ``key = value`` is allowed on its own."""
    known = sorted(f"{PREFIX}{name}" for name in _FIELDS)
    squashed = {re.sub(r"[^a-z0-9]", "", k): k for k in known}
    if not isinstance(key, str):
        raise SettingsError(f"host {host}: host data key {key!r} is not allowed: keys are "
                            "strings")
    if not key.startswith(PREFIX):
        if f"{PREFIX}{key}" in known:
            raise SettingsError(
                f"host {host}: unknown key {key}: did you mean {PREFIX}{key}?", key=key
            )
        # A misspelt prefix (GPUHOST_, gpuhost-, gpuhots_) would leave the default on.
        close = squashed.get(re.sub(r"[^a-z0-9]", "", key.lower())) or next(iter(
            difflib.get_close_matches(key.lower(), known, n=1, cutoff=0.9)), None)
        if close:
            raise SettingsError(f"host {host}: unknown key {key}: did you mean {close}?",
                                key=key)
        return
    name = key[len(PREFIX):]
    if name not in _FIELDS:
        # Compared without the prefix, which every key shares; issue 39 names the CUDA key so
        close = {"cuda_version": ["cuda_toolkit"]}.get(name) or difflib.get_close_matches(
            name, sorted(_FIELDS), n=1, cutoff=0.7)
        hint = (f" did you mean {PREFIX}{close[0]}?" if close
                else f" known keys: {', '.join(known)}")
        raise SettingsError(f"host {host}: unknown key {key}:{hint}", key=key)
    if name in _NUMBER_AS_TEXT and isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if _control_characters(value):
        raise _fail(host, name, value, "a value without control characters (newlines, "
                                        "tabs, NUL): it is written into unit files, "
                                        "environment files and commands")
    rule = RULES[name]
    if not rule.check(value):
        raise _fail(host, name, value, rule.allowed)


#: The checks of settings against each other: each runs, so that every problem is reported.
_TOGETHER: Final = (_check_bench, _check_tensor_parallel, _check_flavour, _check_driver,
                    _check_mok, _check_server_exposure, _check_router_exposure,
                    _check_trusted_peers, _check_dist_init_port, _check_venv_path, _check_lock,
                    _check_speculative,
                    _check_sweep, _check_serving, _check_observability_ports,
                    _check_tls)


#: The checks of the host's GPUs, driver, ML venv and server: a host that serves no model
#: (``gpuhost_serving = False``) skips them, and those keys have no effect there (group data
#: such as group_data/all.py may set them for every host of the inventory).
_SERVING_ONLY: Final = (_check_tensor_parallel, _check_flavour, _check_driver, _check_mok,
                        _check_server_exposure, _check_dist_init_port, _check_venv_path,
                        _check_lock, _check_speculative, _check_sweep)


def for_inventory(hosts: Iterable[tuple[str, Mapping[str, Any]]],
                  sources: Mapping[str, Mapping[str, str]] | None = None) -> dict[str, Settings]:
    """Validate every host's settings at once, so one bad host stops the run before any host
    is touched. Takes ``(name, data)`` pairs, and optionally each host's :func:`data_sources`
    by name; returns settings by host name.

    Raises :class:`SettingsError` with every problem of every host, one line each (and where
    the value came from, when ``sources`` tells); also when two hosts claim one address
    (``ssh_hostname``, or the host's name where it has none): one machine would be converged
    twice, concurrently.
    """
    pairs = [(name, data if data is not None else {}) for name, data in hosts]
    problems: list[str] = []
    claimed: dict[tuple[str, int], str] = {}
    for name, data in pairs:
        address = _address(name, data)
        if address is None:
            continue
        if address in claimed:
            shown = address[0] if address[1] == 22 else f"{address[0]} port {address[1]}"
            problems.append(
                f"hosts {claimed[address]} and {name} both claim the address {shown} "
                "(ssh_hostname, ssh_port): each host of an inventory must be a different machine"
            )
            continue
        claimed[address] = name
    settings: dict[str, Settings] = {}
    for name, data in pairs:
        try:
            settings[name] = from_host_data(name, data, (sources or {}).get(name))
        except SettingsError as exc:
            problems += exc.problems
    problems += check_groups(settings, refused=[name for name, _ in pairs if name not in settings])
    if problems:
        raise SettingsError("\n".join(problems), problems=problems)
    return settings


def notes(s: Settings) -> list[str]:
    """Host data that is allowed but has no effect, one sentence each, for a warning: an API
    key file on a loopback bind (only a wider bind puts the API key gate, which reads the
    key, in front of the server; sglang itself never gets the key)."""
    found = []
    if s.api_key_file is not None and not s.server_is_public:
        found.append(
            f"{PREFIX}api_key_file = {s.api_key_file!r} has no effect: {PREFIX}server_host = "
            f"{s.server_host!r} is a loopback address, where the server answers without the "
            "API key gate; bind a wider address to require the key, or remove "
            f"{PREFIX}api_key_file")
    public = [key for key, bound in (("server_host", s.serving and s.server_is_public),
                                     ("router_host", s.router_is_public)) if bound]
    if public and s.tls_ca_cert_file is None:
        found.append(
            f"{' and '.join(PREFIX + k for k in public)} bind{'s' if len(public) == 1 else ''} "
            f"wider than the loopback without {PREFIX}tls_ca_cert_file: keys and prompts cross "
            "the network in plain HTTP; name a fleet CA for TLS (docs/security.md, TLS)")
    return found


#: Where a run keeps its validated settings (on pyinfra's state): pyinfra executes deploy.py
#: once per host, and each execution validated every host again (N hosts, N² validations: 5 %
#: of the controller's CPU of a 4-host no-op, sampled with py-spy).
_VALIDATED: Final = "_gpuhost_validated_settings"


def for_run(inventory: Any) -> dict[str, Settings]:
    """:func:`for_inventory` of pyinfra's inventory, each problem with where its value came
    from (:func:`data_sources`); on a problem, exit with every problem listed. Validated once
    a run, at the first host's deploy file; the other hosts' reuse it (the inventory is fixed
    once pyinfra has loaded it).

    SystemExit, because pyinfra shows an error raised in a deploy file as "pyinfra error in
    <file> line <n>", naming the innermost frame outside pyinfra (pyinfra_cli/exceptions.py,
    ``WrappedError``): a line of this module, not of the user's data. SystemExit is no
    Exception, so neither the deploy file's loader nor the CLI wraps it: pyinfra prints its
    message alone and exits 1, before any operation reaches any host. The current host's
    :func:`notes` are logged as warnings.
    """
    from pyinfra import host, logger, state

    from operations.runtime.inventory_check import command_line

    validated = getattr(state, _VALIDATED, None)
    if validated is not None and validated[0] is inventory:
        settings = dict(validated[1])
    else:
        inventory_file, _ = command_line(sys.argv[1:])
        folder = Path(getattr(state, "cwd", None) or ".") / "group_data"
        hosts = list(inventory)
        try:
            settings = for_inventory(
                ((h.name, h.data.dict()) for h in hosts),
                {h.name: data_sources(h, inventory_file, folder) for h in hosts})
        except SettingsError as exc:
            end_run("gpuhost: host data refused, no host was touched:\n  - "
                    + "\n  - ".join(exc.problems))
        setattr(state, _VALIDATED, (inventory, dict(settings)))
    if host.name in settings:
        for note in notes(settings[host.name]):
            logger.warning(f"{host.print_prefix}host data: {note}")
    return settings


def data_sources(host: Any, inventory_file: str | None = None,
                 group_data_dir: Path | None = None) -> dict[str, str]:
    """Where each of a pyinfra host's data keys gets its value, for messages: ``--data`` (the
    CLI's override data), the inventory (the host's own entry, or a group's data there), a
    ``group_data/<group>.py`` file, or ``group_data/all.py`` / the inventory's ``all`` data.

    pyinfra's HostData looks a key up in that order: override data, host data, group data
    (a later group winning), then the inventory's global data (pyinfra/api/host.py,
    ``Host.__init__``; pyinfra/api/inventory.py, ``get_groups_data``); the CLI puts a group's
    data from the inventory and from group_data/<group>.py into one dict, group_data/all.py
    into the global data (pyinfra_cli/inventory.py, ``make_inventory_from_files``). Which of the
    two a group's key came from is told by the file's own top-level assignments.

    + host: a pyinfra Host
    + inventory_file: the inventory's path, for messages
    + group_data_dir: the group_data folder pyinfra read (default: ./group_data)
    """
    inventory = host.inventory
    folder = group_data_dir if group_data_dir is not None else Path("group_data")
    in_inventory = f"the inventory {inventory_file}" if inventory_file else "the inventory"

    def group_source(group: str, key: str) -> str:
        path = folder / f"{group}.py"
        if key in _assigned_names(path):
            return f"group_data/{group}.py"
        return f"{in_inventory} (group {group}'s data)"

    layers: list[tuple[Callable[[str], str], Mapping[str, Any]]] = [
        (lambda key: "--data", inventory.get_override_data()),
        (lambda key: f"{in_inventory} (host {host.name}'s entry)",
         inventory.get_host_data(host.name)),
    ]
    for group in reversed(list(dict.fromkeys(host.groups))):
        layers.append((lambda key, g=group: group_source(g, key), inventory.get_group_data(group)))
    layers.append((lambda key: group_source("all", key), inventory.get_data()))
    found: dict[str, str] = {}
    for label, data in layers:
        for key in data:
            if key not in found:
                found[key] = label(key)
    return found


def _assigned_names(path: Path) -> set[str]:
    """The names a Python file assigns at its top level (nothing when it does not exist or does
    not parse)."""
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError):
        return set()
    names: set[str] = set()
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
        names.update(t.id for t in targets if isinstance(t, ast.Name))
    return names


def _address(name: str, data: Mapping[str, Any]) -> tuple[str, int] | None:
    """The SSH address a host is reached at, in one spelling: (host, port). Case, a trailing
    dot and IPv6 notation do not make two addresses; pyinfra's ``@ssh/HOST`` names count,
    other connectors (``@local``, ``@docker/...``) have none."""
    if name.startswith("@"):
        if not name.startswith("@ssh/"):
            return None
        name = name[len("@ssh/"):]
    raw = str(data.get("ssh_hostname") or name).strip().rstrip(".").lower()
    try:
        raw = str(ipaddress.ip_address(raw.strip("[]")))
    except ValueError:
        pass
    port = data.get("ssh_port", 22)
    return raw, port if isinstance(port, int) else 22
