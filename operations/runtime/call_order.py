"""pyinfra's operation order, read from the call stack without reading source files.

In CLI mode pyinfra orders each operation by the line numbers of the call stack below the deploy
file (``get_operation_order_from_stack``, ``pyinfra/api/util.py``, called for every operation
and host by ``solve_operation_consistency`` in ``pyinfra/api/operation.py``; pyinfra 3.10). It
takes them from ``inspect.stack()`` and ``inspect.getframeinfo`` on every frame, which look up
each frame's source file on disk and read one line of it through linecache, twice per frame:
the largest part of a converged host's no-op beyond pyinfra's start and the host's answer
(0.65 s under cProfile for 65 operations; docs/development.md). Only each frame's
file name and line number enter the order.

:func:`operation_order` walks the frames with ``sys._getframe`` and gives the same list: the
file name ``getframeinfo`` gives (the code's ``co_filename``, unless that names a compiled file:
then inspect's own answer) and its line number (the start line of the instruction's position,
``co_positions``, else ``f_lineno``: ``inspect.getframeinfo`` in CPython 3.11). The order, and
so the plan and every operation's hash, is the one pyinfra computes.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import inspect
import itertools
import sys
from types import FrameType
from typing import Any

import pyinfra
from pyinfra.api import util as pyinfra_util

#: pyinfra.api.operation, the module (``from pyinfra.api import operation`` is the decorator).
pyinfra_operation = importlib.import_module("pyinfra.api.operation")

#: File name endings for which ``inspect.getsourcefile`` may answer another name than the code's
#: own (a compiled or an extension module): these frames are named by inspect itself.
_NOT_SOURCE = tuple(importlib.machinery.DEBUG_BYTECODE_SUFFIXES
                    + importlib.machinery.OPTIMIZED_BYTECODE_SUFFIXES
                    + importlib.machinery.EXTENSION_SUFFIXES)


def _filename(frame: FrameType) -> str:
    """The name ``inspect.getframeinfo(frame).filename`` gives."""
    name = frame.f_code.co_filename
    if name.endswith(_NOT_SOURCE):
        return inspect.getsourcefile(frame) or inspect.getfile(frame)
    return name


def _lineno(frame: FrameType) -> int:
    """The line ``inspect.getframeinfo(frame).lineno`` gives: where the running instruction's
    position starts (``inspect._get_code_position``: one position per 2-byte code unit)."""
    if frame.f_lasti >= 0:
        start = next(itertools.islice(frame.f_code.co_positions(), frame.f_lasti // 2, None),
                     (None,))[0]
        if start is not None:
            return start
    return frame.f_lineno


def operation_order(state: Any) -> list[int]:
    """pyinfra's ``get_operation_order_from_stack(state)``, for the stack of its caller."""
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()
    start = 0
    if state.current_deploy_filename:
        # pyinfra's loop ends on its own frame (in pyinfra, so skipped) when no frame is the
        # deploy file's: no line numbers then.
        start = next((i for i, f in enumerate(frames)
                      if _filename(f) == state.current_deploy_filename), len(frames))
    line_numbers = [state.current_op_file_number] if pyinfra.is_cli else []
    line_numbers.extend(_lineno(f) for f in frames[start:]
                        if not _filename(f).startswith(pyinfra_util.PYINFRA_INSTALL_DIR))
    return line_numbers


def install() -> None:
    """Have pyinfra's operations take their order from :func:`operation_order` (idempotent)."""
    pyinfra_operation.get_operation_order_from_stack = operation_order  # type: ignore[assignment]
