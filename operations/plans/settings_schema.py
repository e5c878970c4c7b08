"""One Settings of every concern's declarations, and the RULES and HELP views of them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Final

from operations.plans.settings_bench import BenchSettings
from operations.plans.settings_fleet import FleetSettings
from operations.plans.settings_host import HostSettings
from operations.plans.settings_mlenv import MLStackSettings
from operations.plans.settings_observability import ObservabilitySettings
from operations.plans.settings_rules import _Rule
from operations.plans.settings_server import ServerSettings


# The bases in reverse: a dataclass takes its bases' fields from the last base to the first,
# so the fields (and docs/reference.md's sections) run host, ML stack, server, bench, fleet,
# observability.
@dataclass(frozen=True)
class Settings(ObservabilitySettings, FleetSettings, BenchSettings, ServerSettings,
               MLStackSettings, HostSettings):
    """One host's settings. Field ``x`` is host data key ``gpuhost_x``."""


#: What each key allows, by setting name: each field's declared rule.
RULES: Final[Mapping[str, _Rule]] = MappingProxyType(
    {f.name: f.metadata["rule"] for f in fields(Settings)})

#: What each key does, for the host-data reference (docs/reference.md: tools/docs_gen.py makes
#: it from the fields, their rules and these): each field's declared sentence.
HELP: Final[Mapping[str, str]] = MappingProxyType(
    {f.name: f.metadata["help"] for f in fields(Settings)})
