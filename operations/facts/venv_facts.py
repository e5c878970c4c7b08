"""Facts about a venv on the host: whether it runs, what it holds, its Python, its torch's CUDA."""

from __future__ import annotations

import json
import re
import shlex
from typing import Final

from packaging.version import Version
from pyinfra.api import FactBase
from pyinfra.api.exceptions import FactProcessError
from typing_extensions import override

from operations.facts.venv_path import MAX_ENTRIES, VenvHealth

#: What the venv's python must print: a truncated or empty file "runs" as an empty shell
#: script, with exit status 0 and no output (a shell runs a file execve(2) refuses with ENOEXEC
#: as a script of its own: POSIX, XCU 2.9.1.1 "Command Search and Execution").
_PYTHON_OK: Final = "gpuhost-venv-python-ok"
#: Run by the venv's python: "pip intact" where every file pip's RECORD lists with a hash is
#: there with that sha256 (the wheel format, PEP 376/PEP 627: ``path,sha256=<urlsafe base64,
#: no padding>,size``; bytecode under ``__pycache__`` aside, python rewrites it). A disk that
#: filled while pip was written leaves a file short or missing; where all are whole, ``pip
#: --version`` would run (starting it took 0.55 s of a sandbox host's CPU at each no-op run,
#: docs/development.md), and where any is not, ``pip --version`` is run to say why.
_PIP_INTACT: Final = (
    "import base64, hashlib, importlib.metadata as m\n"
    "try:\n"
    "    files = m.distribution('pip').files\n"
    "except m.PackageNotFoundError:\n"
    "    files = None\n"
    "whole = bool(files)\n"
    "for f in files or ():\n"
    "    if f.hash is None or '__pycache__' in f.parts:\n"
    "        continue\n"
    "    try:\n"
    "        data = f.locate().read_bytes()\n"
    "    except OSError:\n"
    "        whole = False\n"
    "        break\n"
    "    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()\n"
    "    if f.hash.mode != 'sha256' or digest != f.hash.value:\n"
    "        whole = False\n"
    "        break\n"
    "print('pip intact' if whole else 'pip not whole')\n"
)


class VenvRuns(FactBase[VenvHealth]):
    """What is at the venv's path (a folder and its entries, a file, a symlink, nothing and
    what is above it) and whether the venv's python and its pip run (a full disk while the venv
    was created or installed into can leave either half-written); see
    :class:`operations.facts.venv_path.VenvHealth`:

    .. code:: python

        {"found": "folder", "target": "", "target_found": "", "above": "",
         "above_found": "", "entries": ["bin", "include", "lib", "lib64", "pyvenv.cfg"],
         "entry_count": 5, "is_venv": True, "state": "broken",
         "why": "bin/python printed nothing (exit 0)"}
    """

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=True)

    @staticmethod
    def _shell(venv: str, runs: bool) -> str:
        q = shlex.quote(venv)
        last = "printf '%s\\n' \"$out\" | tail -n 1 | cut -c1-300"
        kind = ("k() { if [ -d \"$1\" ]; then echo folder; elif [ -f \"$1\" ]; then echo file; "
                "elif [ -e \"$1\" ]; then echo other; elif [ -L \"$1\" ]; then echo link; "
                "else echo missing; fi; }; ")
        return (
            f"v={q}; p=\"$v/bin/python\"; {kind}"
            "if [ -L \"$v\" ]; then echo found link; echo \"target $(readlink \"$v\")\"; "
            "echo \"target-found $(k \"$v\")\"; else echo \"found $(k \"$v\")\"; fi; "
            "if [ ! -e \"$v\" ] && [ ! -L \"$v\" ]; then a=$v; while :; do a=${a%/*}; "
            "[ -n \"$a\" ] || a=/; if [ -e \"$a\" ] || [ -L \"$a\" ]; then break; fi; done; "
            "echo \"above $a\"; echo \"above-found $(k \"$a\")\"; fi; "
            "if [ ! -d \"$v\" ]; then echo state absent; exit 0; fi; "
            "echo \"entries $(LC_ALL=C ls -1Aq \"$v\" | wc -l)\"; "
            f"LC_ALL=C ls -1Aq \"$v\" | head -n {MAX_ENTRIES} | sed 's/^/entry /'; "
            "if [ -f \"$v/pyvenv.cfg\" ]; then echo venv yes; else echo venv no; fi; "
            + ("" if runs else "echo state unchecked; exit 0; ") +
            "if [ ! -e \"$p\" ] && [ ! -L \"$p\" ]; then "
            "if [ -f \"$v/pyvenv.cfg\" ]; then echo state broken; echo 'why it has no bin/python'; "
            "else echo state absent; fi; exit 0; fi; "
            f"out=$(\"$p\" -c 'print(\"{_PYTHON_OK}\")' 2>&1 </dev/null); rc=$?; "
            f"if [ \"$out\" != {_PYTHON_OK} ]; then echo state broken; "
            "if [ -z \"$out\" ]; then echo \"why bin/python printed nothing (exit $rc)\"; "
            f"else echo \"why bin/python exited $rc: $({last})\"; fi; exit 0; fi; "
            f"out=$(\"$p\" -I -c {shlex.quote(_PIP_INTACT)} 2>&1 </dev/null); "
            "if [ \"$out\" = 'pip intact' ]; then echo state ok; exit 0; fi; "
            "out=$(\"$p\" -m pip --version --disable-pip-version-check 2>&1 </dev/null); rc=$?; "
            "if [ $rc -eq 0 ] && printf '%s\\n' \"$out\" | grep -q '^pip '; then echo state ok; "
            f"else echo state broken; echo \"why pip exited $rc: $({last})\"; fi"
        )

    @override
    def process(self, output: list[str]) -> VenvHealth:
        keys = {"found": "found", "target": "target", "target-found": "target_found",
                "above": "above", "above-found": "above_found", "state": "state", "why": "why"}
        text = dict.fromkeys(keys.values(), "")
        entries: list[str] = []
        count, is_venv = 0, False
        for line in output:
            key, _, value = line.rstrip("\n").partition(" ")
            if key == "entry":
                entries.append(value)
            elif key == "entries" and value.strip().isdigit():
                count = int(value)
            elif key == "venv":
                is_venv = value.strip() == "yes"
            elif key in keys:
                text[keys[key]] = value if key == "target" else value.strip()
        if (text["found"] not in ("missing", "folder", "file", "link", "other")
                or text["state"] not in ("absent", "ok", "broken", "unchecked")):
            raise FactProcessError(f"venv check: cannot read {output[:3]!r}")
        return VenvHealth(found=text["found"], target=text["target"],
                          target_found=text["target_found"], above=text["above"],
                          above_found=text["above_found"], entries=entries, entry_count=count,
                          is_venv=is_venv, state=text["state"], why=text["why"])


#: Run by the venv's python (``-I``: its own site-packages alone, neither PYTHONPATH nor a user
#: site): what ``pip list --format=json`` prints, without starting pip. pip 26.3's importlib
#: backend (``pip/_internal/metadata/importlib/_envs.py``, ``_DistributionFinder``) walks
#: sys.path in order, skips a location that is a wheel file and a distribution without a name
#: (BadMetadata), keeps the first of each canonical name; ``pip list`` then leaves out
#: ``stdlib_pkgs`` (``metadata/base.py``: python, wsgiref, argparse). Legacy ``.egg-link``
#: editables (setuptools' ``develop``) are not followed: gpuhost installs none.
_LIST_DISTRIBUTIONS: Final = (
    "import importlib.metadata as m, json, os, re, sys\n"
    "seen, out = set(), []\n"
    "for location in sys.path:\n"
    "    if location.endswith('.whl') and os.path.isfile(location):\n"
    "        continue\n"
    "    for d in m.distributions(path=[location]):\n"
    "        name = d.metadata['Name']\n"
    "        key = re.sub(r'[-_.]+', '-', name).lower() if isinstance(name, str) else ''\n"
    "        if not key or key in seen:\n"
    "            continue\n"
    "        seen.add(key)\n"
    "        if key not in ('python', 'wsgiref', 'argparse'):\n"
    "            out.append({'name': name, 'version': d.metadata['Version'] or ''})\n"
    "print(json.dumps(out))\n"
)


class VenvPackages(FactBase[dict[str, str]]):
    """Distributions installed in a venv, by canonical name, as ``pip list --format=json``
    gives them (read by the venv's own python from the distributions' metadata: starting pip
    took 0.67 s of a sandbox host's CPU at each no-op run, docs/development.md).

    .. code:: python

        {"torch": "2.9.1+cu128", "sglang": "0.5.9"}

    pyinfra's PipPackages drops versions with a local part such as ``+cu128``; this does not.
    A version is normalised as pip prints it (``str(Version(...))``, the raw string where it
    does not parse: pip's ``format_for_json``). Empty where the venv does not exist yet. Read
    only where VenvRuns says its pip runs.
    """

    default = dict

    @override
    def requires_command(self, venv: str) -> str:
        return f"{venv}/bin/python"

    @override
    def command(self, venv: str) -> str:
        return (f"{shlex.quote(venv)}/bin/python -I -c {shlex.quote(_LIST_DISTRIBUTIONS)} "
                "2>/dev/null")

    @override
    def process(self, output: list[str]) -> dict[str, str]:
        from packaging.utils import canonicalize_name
        from packaging.version import InvalidVersion

        def printed(version: str) -> str:
            try:
                return str(Version(version))
            except InvalidVersion:
                return version

        try:
            listed = json.loads("\n".join(output))
            return {canonicalize_name(d["name"]): printed(d["version"]) for d in listed}
        except (ValueError, KeyError, TypeError) as exc:
            raise FactProcessError(f"venv distributions: cannot read {output[:3]!r}") from exc


class VenvAt(VenvRuns):
    """What is at a venv's path, as :class:`VenvRuns` reads it, its python and pip not started
    (state "unchecked" where a folder is there): for the link at gpuhost_venv_path, which points
    at a venv whose own reading starts them (pip alone took 0.55 s of a sandbox host's CPU at
    each no-op run, docs/development.md)."""

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=False)



class VenvPython(FactBase[str | None]):
    """The venv's Python as major.minor ("3.12"): the venv's own where it exists, else the
    ``python3`` that would create it; None where neither exists.

    .. code:: python

        "3.12"
    """

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=True)

    @staticmethod
    def _shell(venv: str, runs: bool) -> str:
        q = shlex.quote(venv)
        version = "import sys; print('%d.%d' % sys.version_info[:2])"
        # a venv's python that does not run (see VenvRuns) is recreated from python3
        return (f"if [ -x {q}/bin/python ] && v=$({q}/bin/python -c \"{version}\" 2>/dev/null) "
                "&& [ -n \"$v\" ]; then echo \"$v\"; "
                f"elif command -v python3 >/dev/null; then python3 -c \"{version}\"; fi")

    @override
    def process(self, output: list[str]) -> str | None:
        return output[-1].strip() if output and output[-1].strip() else None


class VenvTorchCuda(FactBase[str | None]):
    """``torch.version.cuda`` in the venv ("12.8"); None where the venv, torch or a CUDA build
    of torch is missing.

    .. code:: python

        "12.8"
    """

    @override
    def command(self, venv: str) -> str:
        return self._shell(venv, runs=True)

    @staticmethod
    def _shell(venv: str, runs: bool) -> str:
        q = shlex.quote(venv)
        return (f"if [ -x {q}/bin/python ]; then {q}/bin/python -c "
                "\"import torch; print(torch.version.cuda)\" 2>/dev/null || true; fi")

    @override
    def process(self, output: list[str]) -> str | None:
        value = output[-1].strip() if output else ""
        return value if re.fullmatch(r"\d+\.\d+", value) else None
