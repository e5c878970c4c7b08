"""One commit of the model per fleet: the revision resolved once a run, every host served it.

``gpuhost_model_revision`` names a branch, a tag or a commit. A full commit sha (40 lowercase hex
digits, git's object name) is the commit itself. A branch or a tag moves when the repository is
pushed to: the ``main`` a host fetched last month need not be today's. The fleet here is every
serving host of the inventory with the same repository and revision (every worker behind the
router, every node of a group: operations/stages/fleet.py, operations/plans/node_group.py),
whichever Hub endpoint each host reaches (a mirror's, or the sandbox's, one per host link: the same
repository). Its commit is decided once per run, at the first of its hosts that plans
(:func:`fleet_commit`), from what its hosts hold and what the Hub answers (:func:`decide`):

- the commit of the fleet's complete copies of that revision (their stamps' ``sha``,
  operations/facts/model_facts.py ModelSnapshot), where they agree: a host without it (one added
  later, or rebuilt) gets that commit, not the one the branch names now;
- where no host holds a copy, the commit the Hub names for the revision now;
- where the branch moved on the Hub since, the run (``--dry`` too) says so, and the fleet stays
  at its commit: pinning the new one (``gpuhost_model_revision = '<sha>'``) is how to serve it,
  a change of host data that every host then downloads, its server restarting through the roll;
- copies of two commits under one revision (left by an older gpuhost): refused on every host of
  the fleet, naming each commit and its hosts: which model to serve is the operator's choice;
- the Hub not answering is said: the held commit stands; with none held the commit is unknown,
  never guessed (each host's download asks the Hub then, as without this module).

The Hub is asked from the planning host (the token file, the proxy and often the only route to
the Hub are the hosts'), as huggingface_hub 0.36.2's ``HfApi.model_info(repo, revision=...)``
asks: ``GET <endpoint>/api/models/<repo>/revision/<quote(revision, safe='')>`` (hf_api.py,
``model_info``), whose JSON's ``sha`` is the commit (``ModelInfo.sha``): operations/files/
model_room.py without a destination. The token stays on the host; nothing here prints it.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from pyinfra import host, logger, state
from pyinfra.api.exceptions import PyinfraError
from typing_extensions import override

from operations import REPO_ROOT
from operations.facts.model_facts import JsonObjectFact, ModelSnapshot, is_current
from operations.plans.plan import fact, fact_of, refuse
from operations.plans.settings import PREFIX, Settings

STAGE: Final = "Model revision"
#: A full commit sha as the Hub spells it (ModelInfo.sha: git's 40 lowercase hex digits).
COMMIT: Final = re.compile(r"[0-9a-f]{40}")
_ROOM_SCRIPT: Final = (REPO_ROOT / "operations" / "files" / "model_room.py").read_text()
#: The run's fleet, on pyinfra's state (:func:`configure`).
_RUN: Final = "_gpuhost_model_revision"


def pinned(revision: str) -> bool:
    """Whether ``revision`` is a commit's full sha (nothing to resolve)."""
    return COMMIT.fullmatch(revision) is not None


class HubCommit(JsonObjectFact):
    """The commit ``revision`` of ``repo`` names on the Hub now, asked from the host (module
    docstring):

    .. code:: python

        {"sha": "4f3c0a9e..."}

    ``{"error": "..."}`` where the Hub did not answer (its kind only: never the token).
    """

    #: the Hub, from the host: through the host's proxy (operations/plans/proxy.py)
    reaches_outside = True
    said_by = "model_room.py"

    @override
    def command(self, endpoint: str, repo: str, revision: str, token_file: str | None) -> str:
        return shlex.join(["python3", "-c", _ROOM_SCRIPT, endpoint, repo, revision, "",
                           token_file or ""])


@dataclass(frozen=True)
class Decision:
    """The fleet's commit (None: unknown, or refused), the line the run says once (a warning
    where ``warn``), and the refusal every host of the fleet gets (None: none)."""

    commit: str | None
    line: str | None = None
    warn: bool = False
    refused: str | None = None


def _names(names: Sequence[str]) -> str:
    return ", ".join(names)


def decide(repo: str, revision: str, held: Mapping[str, str], fresh: Sequence[str],
           hub: Mapping[str, str], asked_on: str = "",
           unread: Mapping[str, str] | None = None) -> Decision:
    """The fleet's commit of ``repo`` at ``revision`` (a branch or tag; a full sha is its own
    commit) and what the run says (module docstring).

    + held: each host whose complete copy is of that revision, by name: its commit's sha
    + fresh: the fleet's hosts without one
    + hub: the Hub's answer, ``{"sha": ...}`` or ``{"error": ...}`` (:class:`HubCommit`)
    + asked_on: the host that asked the Hub, for the message
    + unread: the fleet's hosts whose copy could not be read, by name: why (said, not counted)
    """
    if pinned(revision):
        return Decision(revision)
    upstream = hub.get("sha")
    what = f"{revision} of {repo}"
    not_read = "".join(f"; {name}'s copy was not read ({why}): not counted"
                       for name, why in (unread or {}).items())
    by_commit: dict[str, list[str]] = {}
    for name, sha in held.items():
        by_commit.setdefault(sha, []).append(name)
    if len(by_commit) > 1:
        listed = "; ".join(f"{sha} ({_names(names)})" for sha, names in sorted(by_commit.items()))
        now = f"; the Hub names {upstream} now" if upstream else ""
        return Decision(None, refused=(
            f"the fleet's hosts hold {len(by_commit)} commits of {what}: {listed}{now}: one "
            f"served name, {len(by_commit)} models. Set {PREFIX}model_revision to the commit "
            "every host is to serve (its hosts keep their copies; the others download it and "
            f"restart){not_read}"))
    gets = "gets" if len(fresh) == 1 else "get"
    too = f"; {_names(fresh)}, without it, {gets} it too" if fresh else ""
    if by_commit:
        (commit, names), = by_commit.items()
        holds = f"the commit {_names(names)} hold{'s' if len(names) == 1 else ''}"
        if upstream == commit:
            return Decision(commit, f"model revision: {what} is commit {commit[:12]}, {holds}"
                                    f"{too}{not_read}", warn=bool(unread))
        if upstream:
            return Decision(commit, warn=True, line=(
                f"model revision: {what} moved on the Hub from {commit[:12]} to "
                f"{upstream[:12]}: the fleet stays at {commit[:12]}, {holds}"
                + (f"; {_names(fresh)}, without it, {gets} {commit[:12]} too, not "
                   f"{upstream[:12]}" if fresh else "") + "; to serve "
                f"{upstream[:12]}, set {PREFIX}model_revision = '{upstream}' (every host "
                f"downloads it and restarts, behind a router one at a time){not_read}"))
        return Decision(commit, warn=True, line=(
            f"model revision: whether {what} moved on the Hub is unknown (the Hub did not "
            f"answer {asked_on}: {hub.get('error')}): the fleet stays at {commit[:12]}, "
            f"{holds}{too}{not_read}"))
    if upstream:
        return Decision(upstream, warn=bool(unread), line=(
            f"model revision: {what} is commit {upstream[:12]} on the Hub: every host of the "
            f"fleet gets that commit ({_names(fresh)}){not_read}"))
    return Decision(None, warn=True, line=(
        f"model revision: the commit of {what} is unknown: the Hub did not answer {asked_on} "
        f"({hub.get('error')}) and no host of the fleet holds a copy of it; each host's "
        f"download asks the Hub itself{not_read}"))


@dataclass
class _Run:
    settings: Mapping[str, Settings]
    decided: dict[tuple[str, str], Decision] = field(default_factory=dict)
    refused: set[str] = field(default_factory=set)


def configure(settings: Mapping[str, Settings]) -> None:
    """Keep every host's settings for :func:`fleet_commit`, once a run (deploy.py calls it at
    each host's plan: the first call's stand)."""
    if getattr(state, _RUN, None) is None:
        setattr(state, _RUN, _Run(dict(settings)))


def _key(s: Settings) -> tuple[str, str]:
    return s.model, s.model_revision


def fleet_commit(settings: Settings) -> str | None:
    """The commit this host's copy of the model must be: a pinned sha as it is; else the
    fleet's (:func:`decide`), decided at the first call of the run for the fleet and said
    there; a refusal for every host of the fleet where its copies disagree
    (operations/plans/plan.py). None for a local model folder, a host that serves none, an unknown
    commit, or where :func:`configure` was not called (the revision as named then)."""
    run = getattr(state, _RUN, None)
    if run is None or not settings.serving or settings.model_is_local:
        return None
    if pinned(settings.model_revision):
        return settings.model_revision
    key = _key(settings)
    if key not in run.decided:
        run.decided[key] = _decide_now(settings, run.settings)
        decision = run.decided[key]
        if decision.line:
            (logger.warning if decision.warn else logger.info)(
                f"{host.print_prefix}{decision.line}")
    decision = run.decided[key]
    if decision.refused and host.name not in run.refused:
        run.refused.add(host.name)
        refuse(STAGE, decision.refused)
    return decision.commit


def _decide_now(settings: Settings, every: Mapping[str, Settings]) -> Decision:
    """Read the fleet's copies (each host's stamp, another host's through its own connection)
    and the Hub's answer here, then :func:`decide`."""
    held: dict[str, str] = {}
    fresh: list[str] = []
    unread: dict[str, str] = {}
    failed = {h.name for h in state.failed_hosts}
    for name, s in every.items():
        if not s.serving or s.model_is_local or _key(s) != _key(settings):
            continue
        if name in failed:
            unread[name] = "it failed in this run"
            continue
        try:
            snapshot = fact_of(name, ModelSnapshot, path=s.model_path)
        except (PyinfraError, OSError) as exc:
            unread[name] = f"{type(exc).__name__}: {str(exc)[:200]}"
            continue
        if is_current(snapshot, s.model, s.model_revision) and snapshot.get("sha"):
            held[name] = str(snapshot["sha"])
        else:
            fresh.append(name)
    hub = fact(HubCommit, endpoint=settings.hf_endpoint, repo=settings.model,
               revision=settings.model_revision, token_file=settings.hf_token_file)
    return decide(settings.model, settings.model_revision, held, fresh, hub,
                  f"from {host.name}", unread)
