"""Many facts read in one remote command, each answer processed by its own fact class.

pyinfra 3 runs one command per fact reading (``pyinfra/api/facts.py``, ``_get_fact``; pyinfra
3.10): for ``files.put`` that is up to three (``File``, the parent's ``Directory``,
``Sha1File``) for each file, even when nothing changed. Here the commands of many facts run in
one shell command, each in a subshell of its own, framed by marker lines that carry its exit
status; each fact's own ``process`` then reads its part, as ``_get_fact`` would have read that
command's output (its lines with the newline taken off, ``connectors/util.py``,
``read_buffer``). The facts run at once, each in the background into a file of its own under a
``mktemp -d`` folder (in /dev/shm where it can be), printed in order once all ended: facts only
read, and one after the other the host's answer took the sum of their times (3.2 s of a
converged sandbox host's no-op run, most of it Python starting: ``pip list``, ``pip
--version``, the stand-ins; docs/development.md). A fact whose command failed,
found its command missing or has a precondition is left out of the answer: the caller reads it
alone, so pyinfra's own error handling applies. So is one whose command cannot be made from the
arguments given (a path that is a number: a recorded reading of another version,
``operations/runtime/planned_facts.py``), and nobody reads it.
"""

from __future__ import annotations

import functools
import inspect
import secrets
from collections.abc import Sequence
from typing import Any

from pyinfra.api import StringCommand
from pyinfra.api.arguments import CONNECTOR_ARGUMENT_KEYS
from pyinfra.api.facts import _MISSING_COMMAND_MARKER, _handle_fact_kwargs, _make_command
from pyinfra.api.host import Host
from pyinfra.api.state import State

#: At most this many characters of fact commands in one batch: the command travels as one
#: argument (``sh -c``), and Linux allows 128 KiB for one (MAX_ARG_STRLEN, execve(2)).
MAX_COMMAND_CHARS = 64 * 1024

Wanted = tuple[Any, dict[str, Any]]  # (fact class, its arguments by name)


@functools.cache
def _command_signature(cls: Any) -> inspect.Signature | None:
    try:
        return inspect.signature(cls.command)
    except (AttributeError, TypeError, ValueError):  # FactBase itself has no command
        return None


def named_arguments(cls: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """A reading's fact arguments by name, defaults filled in, as pyinfra names them
    (``inspect.getcallargs(cls().command, ...)``, ``_handle_fact_kwargs``), from the command's
    signature built once a run: ``inspect`` builds it anew at each call, 3 % of the
    controller's CPU of a 4-host no-op (sampled with py-spy). Raises TypeError where the call
    does not fit the command, or the class has none."""
    signature = _command_signature(cls)
    if signature is None or not signature.parameters:
        raise TypeError(f"{cls!r} has no fact command")
    bound = signature.bind(None, *args, **kwargs)
    bound.apply_defaults()
    named = dict(bound.arguments)
    named.pop(next(iter(signature.parameters)))
    return named


def _command(fact: Any, fact_kwargs: dict[str, Any]) -> StringCommand | None:
    """The fact's command as ``_get_fact`` builds it (its requires_command guard included).
    The same instance processes the output: some facts keep their arguments from ``command``
    (``HashFileFactBase`` its path)."""
    command = _make_command(fact.command, dict(fact_kwargs))
    requires = _make_command(fact.requires_command, dict(fact_kwargs))
    if command is None:
        return None
    if requires:
        command = StringCommand("if", "command", "-v", requires, ">/dev/null", "2>&1;", "then",
                                "(", command, ");", "else", "echo",
                                f"'{_MISSING_COMMAND_MARKER}';", "fi")
    return command if isinstance(command, StringCommand) else StringCommand(command)


def connector_arguments(state: State, host: Host, cls: Any, args: Any,
                        kwargs: Any) -> dict[str, Any]:
    """What a reading of ``cls`` would be run with (sudo, user, timeout...), ``_get_fact``'s."""
    _, global_kwargs = _handle_fact_kwargs(state, host, cls, args, kwargs)
    return {k: v for k, v in global_kwargs.items() if k in CONNECTOR_ARGUMENT_KEYS}


Framed = tuple[int, Any, StringCommand]  # (index in wanted, fact instance, its command)


def _chunks(commands: list[Framed]) -> list[list[Framed]]:
    chunks: list[list[Framed]] = [[]]
    size = 0
    for index, fact, command in commands:
        length = len(command.get_raw_value())
        if chunks[-1] and size + length > MAX_COMMAND_CHARS:
            chunks.append([])
            size = 0
        chunks[-1].append((index, fact, command))
        size += length
    return chunks


def read(state: State, host: Host, wanted: Sequence[Wanted],
         connector_kwargs: dict[str, Any]) -> dict[int, Any]:
    """Read ``wanted`` facts of ``host`` in as few commands as fit; index in ``wanted`` -> value,
    for each fact that answered as a reading of its own would have without an error."""
    commands: list[Framed] = []
    for index, (cls, fact_kwargs) in enumerate(wanted):
        fact = cls()
        if fact.check_preconditions(state, host):
            continue
        try:
            command = _command(fact, fact_kwargs)
            if command is not None:
                command.get_raw_value()
        except Exception:  # noqa: BLE001 - arguments it cannot take (another version's record)
            continue
        if command is not None:
            commands.append((index, fact, command))
    values: dict[int, Any] = {}
    for chunk in _chunks(commands):
        values.update(_read_chunk(state, host, chunk, connector_kwargs))
    return values


def _read_chunk(state: State, host: Host, chunk: list[Framed], connector_kwargs: dict[str, Any]) -> dict[int, Any]:
    marker = f"gpuhost-fact-batch-{secrets.token_hex(8)}"
    # Each fact runs at once, in the background, into a file of its own; the files are then
    # printed in order. In memory (/dev/shm) where it can be: a full disk leaves the answers
    # whole. mktemp failing fails the batch: its facts are then read alone.
    parts: list[Any] = ['d="$(mktemp -d -p /dev/shm 2>/dev/null || mktemp -d)"', "||", "exit",
                        "1;", "trap", "'rm -rf \"$d\"'", "EXIT;"]
    for index, _, command in chunk:
        # The leading newline ends a last line the fact left open; _answers takes it back.
        parts += ["{", "echo", f"'{marker} begin {index}';", "(", command, ");",
                  f"printf '\\n{marker} end {index} %s\\n' \"$?\";", "}",
                  f'>"$d/{index}"', "&"]
    parts += ["wait;", "cat", *(f'"$d/{index}"' for index, _, _ in chunk)]
    status, output = host.run_shell_command(StringCommand(*parts),
                                            print_output=state.print_fact_output,
                                            print_input=state.print_fact_input,
                                            **connector_kwargs)
    if not status:
        return {}
    facts = {index: fact for index, fact, _ in chunk}
    values: dict[int, Any] = {}
    for index, (rc, lines) in _answers(output.stdout_lines, marker).items():
        if rc != 0 or lines == [_MISSING_COMMAND_MARKER] or index not in facts:
            continue
        fact = facts[index]
        try:
            values[index] = fact.process(lines) if lines else fact.default()
        except Exception:  # noqa: BLE001 - read alone, the error is pyinfra's to report
            continue
    return values


def _answers(lines: list[str], marker: str) -> dict[int, tuple[int, list[str]]]:
    """Each framed fact's exit status and output lines."""
    answers: dict[int, tuple[int, list[str]]] = {}
    current: list[str] | None = None
    for line in lines:
        if line.startswith(f"{marker} begin "):
            current = []
        elif line.startswith(f"{marker} end ") and current is not None:
            _, _, index, rc = line.rsplit(" ", 3)
            if current and current[-1] == "":
                current.pop()
            answers[int(index)] = (int(rc), current)
            current = None
        elif current is not None:
            current.append(line)
    return answers
