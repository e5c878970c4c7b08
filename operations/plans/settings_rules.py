"""What a setting's value may be: the rules, their texts, and the error a refused value raises."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from pyinfra.api.exceptions import PyinfraError

PREFIX: Final = "gpuhost_"


class SettingsError(PyinfraError):
    """Host data that cannot be used: the message names host, key, value and what is allowed
    (one line per problem, every problem found). ``key`` is the setting a single problem is
    about (None when not one key's); ``problems`` every problem's line."""

    def __init__(self, message: str, key: str | None = None,
                 problems: Iterable[str] | None = None) -> None:
        super().__init__(message)
        self.key = key
        self.problems: list[str] = list(problems) if problems is not None else [message]


@dataclass(frozen=True)
class _Rule:
    """What a setting allows: a test of a value, and the text that names the values passing it
    (every refusal of the key quotes it; docs/reference.md's "allowed" line)."""

    check: Callable[[Any], bool]
    allowed: str


def setting(default: Any, rule: _Rule, sentence: str) -> Any:
    """A Settings field declared once: its default, its rule (what is allowed: the checks and
    their messages, the reference's "allowed" line) and its sentence (what it does, for
    docs/reference.md), kept in the field's metadata as ``rule`` and ``help``. A dict default
    is copied for each Settings: a dataclass field takes no mutable default."""
    metadata = {"rule": rule, "help": sentence}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _fail(host: str, key: str, value: Any, allowed: str) -> SettingsError:
    return SettingsError(f"host {host}: {PREFIX}{key} = {value!r} is not allowed: {allowed}.",
                         key=f"{PREFIX}{key}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_between(low: int, high: int) -> _Rule:
    return _Rule(lambda v: _is_int(v) and low <= v <= high, f"an integer from {low} to {high}")


#: How an optional key is left unset, in both places host data comes from: pyinfra's
#: ``--data key=value`` reads the value as JSON where it parses (``null`` is None, ``None``
#: stays the string 'None'), a Python inventory or group_data file writes None.
_UNSET: Final = (", or None to leave it unset (None in a Python inventory; in --data write "
                 "null: None there is the text 'None')")


#: Texts that mean "unset" to the person typing them but arrive as text.
_UNSET_TEXTS: Final = ("None", "null", "Null", "NULL", "~")


def _one_of(choices: Iterable[str], optional: bool = False) -> _Rule:
    options = tuple(choices)
    text = ", ".join(options) + (_UNSET if optional else "")
    return _Rule(lambda v: (optional and v is None) or v in options, f"one of {text}")


def _text(pattern: str, allowed: str, optional: bool = False) -> _Rule:
    regex = re.compile(pattern)
    return _Rule(
        lambda v: (optional and v is None) or (
            isinstance(v, str) and bool(regex.fullmatch(v))
            and not (optional and v in _UNSET_TEXTS)),
        allowed + (_UNSET if optional else ""),
    )


def _is_host(value: Any) -> bool:
    if not isinstance(value, str) or "%" in value:  # no IPv6 zone: it would reach unit files
        return False
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


#: An absolute path whose every part is letters, digits and ``. _ + @ : -``, none of them
#: "." or "..": it goes into shell commands, systemd units and pip's arguments unquoted by
#: whoever reads them on the host.
_PATH = r"(/(?!\.\.?(?:/|$))[A-Za-z0-9._+@:-]+)+"
_PATH_DETAIL = "(letters, digits and . _ + @ : -; no '.' or '..' part, no trailing slash)"
_PATH_ALLOWED = f"an absolute path {_PATH_DETAIL}"

#: An http(s) URL: a host, then anything but whitespace (quoted wherever a shell sees it).
_URL = r"https?://[^\s/]\S*"

_BOOL = _Rule(lambda v: isinstance(v, bool), "True or False")


def _control_characters(value: Any) -> bool:
    """Whether a value holds a control character (a newline, a tab, NUL, ...) anywhere: in a
    string, or in the strings of a list or dict. Host data reaches unit files, environment
    files and shell commands line by line."""
    if isinstance(value, str):
        return any(ord(c) < 32 or ord(c) == 127 for c in value)
    if isinstance(value, Mapping):
        return any(_control_characters(k) or _control_characters(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return any(_control_characters(v) for v in value)
    return False
