"""Manage the HTTP(S) proxy the deploy's downloads go through.

A lab that reaches the outside through a proxy names it in host data (``gpuhost_proxy``) or in
the host's ``/etc/environment`` (read by pam_env at login, and dropped again by sudo's
env_reset). Either way every command of the run gets it as ``http_proxy``/``https_proxy`` (both
spellings: curl reads ``http_proxy`` in lower case only, requests and pip either, curl(1)
ENVIRONMENT), through host data's ``_env``, which pyinfra puts inside sudo's ``sh -c``
(pyinfra/connectors/util.py, ``make_unix_command``): curl's download of NVIDIA's key, pip, and
huggingface_hub (requests: ``trust_env``), and apt (apt-transport-http(1) of apt 2.6: "The
environment variable http_proxy is supported for system wide configuration"; apt's own
``Acquire::http::Proxy``, where an operator set one, stays in force). What
must stay local is in ``no_proxy``: the loopback and every address of the inventory's hosts
(their fleet, server and router addresses and SSH names), with the host's own ``no_proxy`` kept.
Nothing is written to the host.
"""

from __future__ import annotations

import ipaddress
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from pyinfra import host
from pyinfra.api import FactBase, QuoteString, StringCommand, operation
from pyinfra.operations import files

from operations.runtime import fact_cache

#: operations.plans.settings.Settings, by name only: settings imports this module for
#: gpuhost_proxy's rule, so this one reads the settings it is given without importing their class.
Settings = Any

#: gpuhost_proxy's rule (operations/plans/settings.py RULES): a proxy URL as curl, apt and requests
#: take it (scheme, host or [IPv6], port 1 to 65535), without a user or password, which the
#: run's commands and messages would show.
URL: Final = (r"https?://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(6553[0-5]|655[0-2]\d|65[0-4]\d\d"
              r"|6[0-4]\d{3}|[1-5]\d{4}|[1-9]\d{0,3})/?")
URL_ALLOWED: Final = ("an http:// or https:// URL of a proxy with a host and a port (1 to 65535), "
                      "such as http://proxy.lab:3128, with no user or password")
#: gpuhost_proxy's sentence in the reference (operations/plans/settings.py HELP).
HELP: Final = ("every download's HTTP(S) proxy (apt, NVIDIA's key, pip, the Hub; `no_proxy`: the "
               "loopback, the inventory's hosts); None: `/etc/environment`'s, if any")

#: The file pam_env reads for every login (pam_env.conf(5)).
ETC_ENVIRONMENT: Final = "/etc/environment"
#: The variables read from it, in the spellings curl, wget, requests and pip read.
NAMES: Final = ("http_proxy", "https_proxy", "no_proxy")
#: Never through a proxy: the host's own loopback.
LOOPBACK: Final = ("localhost", "127.0.0.1", "::1")


def parse_environment(text: str) -> dict[str, str]:
    """The proxy variables of an ``/etc/environment``, by lower-case name; a name in lower
    case wins over its upper-case spelling, as curl's and Python's urllib's lookups have it.

    pam_env's own reading (linux-pam modules/pam_env/pam_env.c, ``_parse_env_file``): leading
    blanks skipped, ``#`` lines skipped, an ``export `` prefix dropped, the value ending at a
    ``#``, the key letters, digits and ``_`` only, quotes around the value dropped.
    """
    found: dict[str, tuple[bool, str]] = {}
    for raw in text.splitlines():
        line = raw.lstrip(" \t")
        if line.startswith("#"):
            continue
        if line.startswith("export "):
            line = line[len("export "):]
        line = line.split("#", 1)[0]
        key, sep, value = line.partition("=")
        if not sep or not key or not all(c.isalnum() or c == "_" for c in key):
            continue
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        name = key.lower()
        if name in NAMES and value and (name not in found or not found[name][0]):
            found[name] = (key == name, value)
    return {name: value for name, (_, value) in found.items()}


class ProxyEnvironment(FactBase):
    """The proxy variables the host's ``/etc/environment`` sets ({} when none, or no file):

    .. code:: python

        {"http_proxy": "http://proxy.lab:3128", "https_proxy": "http://proxy.lab:3128",
         "no_proxy": "localhost,.lab"}
    """

    def command(self) -> str:
        return f"cat {ETC_ENVIRONMENT} 2>/dev/null || true"

    def process(self, output: Iterable[str]) -> dict[str, str]:
        return parse_environment("\n".join(output))

    def default(self) -> dict[str, str]:
        return {}


@dataclass(frozen=True)
class Proxy:
    """The proxies a host's downloads go through: ``http`` for http:// URLs, ``https`` for
    https:// ones (None: direct), and what goes direct (``no_proxy``, names and addresses)."""

    http: str | None
    https: str | None
    no_proxy: tuple[str, ...]
    source: str

    @property
    def any(self) -> bool:
        return bool(self.http or self.https)

    def env(self) -> dict[str, str]:
        """The variables, in both spellings; {} when there is no proxy."""
        if not self.any:
            return {}
        env: dict[str, str] = {}
        for name, value in (("http_proxy", self.http), ("https_proxy", self.https),
                            ("no_proxy", ",".join(self.no_proxy))):
            if value:
                env[name] = env[name.upper()] = value
        return env


def _names(values: Iterable[str | None]) -> list[str]:
    out: list[str] = []
    for value in values:
        if not value:
            continue
        text = str(value).strip().strip("[]").lower()
        try:
            if ipaddress.ip_address(text).is_loopback:
                continue
        except ValueError:
            pass
        if text and text not in out:
            out.append(text)
    return out


def local_names(fleet: Mapping[str, Settings], hosts: Iterable[Any] = ()) -> list[str]:
    """Every address of the inventory's hosts a run may talk to directly: their fleet, server
    and router addresses (from host data) and the names SSH reaches them at."""
    values: list[str | None] = []
    for s in fleet.values():
        values += [s.fleet_address, s.server_host, s.router_host]
    for h in hosts:
        values.append(h.data.get("ssh_hostname") or (None if h.name.startswith("@")
                                                     else h.name))
    return _names(values)


def host_proxy(settings: Settings, environment: Mapping[str, str],
               local: Iterable[str]) -> Proxy:
    """The proxy of a host: ``gpuhost_proxy`` for both schemes when set, else what the
    host's ``/etc/environment`` names; ``no_proxy`` the loopback, ``local`` and the host's own."""
    own = [n.strip() for n in environment.get("no_proxy", "").split(",") if n.strip()]
    no_proxy = tuple(dict.fromkeys([*LOOPBACK, *local, *own]))
    if settings.proxy:
        return Proxy(settings.proxy, settings.proxy, no_proxy, "gpuhost_proxy")
    return Proxy(environment.get("http_proxy"), environment.get("https_proxy"), no_proxy,
                 ETC_ENVIRONMENT)


def shown(url: str | None) -> str:
    """A proxy URL as messages name it: scheme, host and port, never a user or password."""
    if not url:
        return "no proxy (direct)"
    parts = urllib.parse.urlsplit(url)
    try:
        port = f":{parts.port}" if parts.port else ""
    except ValueError:
        port = ""
    return f"the proxy {parts.scheme}://{parts.hostname}{port}"


#: Where :func:`use_host_proxy` keeps the host's proxy, on pyinfra's Host.
_CHOSEN: Final = "_gpuhost_proxy"


def of_host() -> Proxy:
    """The current host's proxy, as :func:`use_host_proxy` chose it (none before it ran)."""
    current = host._get_module()  # None outside a run (pyinfra/context.py)
    return (current is not None and vars(current).get(_CHOSEN)) or Proxy(None, None, LOOPBACK,
                                                                          "nowhere")


def download_env() -> tuple[tuple[str, str], ...]:
    """:func:`of_host`'s variables as sorted pairs, for a command that does not inherit the
    run's environment (a ``systemd-run`` unit's ``--setenv``)."""
    return tuple(sorted(of_host().env().items()))


def use_host_proxy(settings: Settings, fleet: Mapping[str, Settings], hosts: Iterable[Any],
                   environment: Mapping[str, str] | None = None) -> Proxy:
    """Give every command of this host's run the host's proxy (host data's ``_env``, which
    pyinfra merges into each command's environment); returns it. Read while planning, before
    the stages: ``gpuhost_proxy``, else the host's ``/etc/environment`` (one fact). A fact
    class whose command reaches the outside says so (``reaches_outside = True``)."""
    if environment is None:
        environment = {} if settings.proxy else host.get_fact(ProxyEnvironment)
    proxy = host_proxy(settings, environment, local_names(fleet, hosts))
    vars(host._get_module())[_CHOSEN] = proxy
    if proxy.any:
        current = dict(getattr(host.data, "_env", None) or {})
        host.data._env = {**current, **proxy.env()}
        # the last run's recorded facts were read in one command with /etc/environment, before
        # the proxy was known: those that reach the outside are read again, through it
        fact_cache.drop(host._get_module(), lambda cls: getattr(cls, "reaches_outside", False))
    return proxy


def through(proxy: Proxy, url: str) -> str:
    """How a request to ``url`` goes, for a message: "through the proxy http://p:3128" or
    "directly, through no proxy", as curl and requests choose (the proxy of the URL's scheme
    unless ``no_proxy`` names its host: urllib.request's proxy_bypass_environment, which
    requests uses)."""
    parts = urllib.parse.urlsplit(url)
    chosen = proxy.https if parts.scheme == "https" else proxy.http
    if chosen and not urllib.request.proxy_bypass_environment(
            parts.hostname or "", {"no": ",".join(proxy.no_proxy)}):
        return "through " + shown(chosen)
    return "directly, through no proxy"


@operation()
def downloaded(src: str, dest: str, proxy: Proxy, **kwargs: Any):
    """pyinfra's files.download of ``src`` to ``dest`` (its other arguments as there), whose
    failed transfer says, after curl's or wget's own line, the URL, the proxy it went through
    and the tool's exit status."""
    failed = f"the download of {src} {through(proxy, src)} failed"
    for command in files.download._inner(src=src, dest=dest, **kwargs):
        raw = command.get_raw_value() if isinstance(command, StringCommand) else str(command)
        if raw.startswith(("curl ", "wget ", "( curl ")):
            yield StringCommand("(", command, ")", "||", "{", "rc=$?;", "echo",
                                QuoteString(failed + " (exit status"), '"$rc)"', ">&2;",
                                "exit", "1;", "}")
        else:
            yield command
