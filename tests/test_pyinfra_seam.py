"""operations/runtime/pyinfra_seam.py: the installed pyinfra has every symbol gpuhost patches, each
with the parameters the patch passes or reads; a pyinfra outside the pin, or a symbol gone or
changed, is one line naming it (issue 43)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import types

import pytest

from operations import REPO_ROOT
from operations.runtime import pyinfra_seam


def test_the_pin_is_pyprojects():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    assert f"pyinfra{pyinfra_seam.PIN}" in project["dependencies"]


def test_the_installed_pyinfra_fits_every_patch_in_a_fresh_interpreter():
    """Read before any patch (the operations package's import does it first)."""
    run = subprocess.run([sys.executable, "-c",
                          "from operations.runtime import pyinfra_seam; print(pyinfra_seam.SEEN)"],
                         cwd=REPO_ROOT, capture_output=True, text=True, check=False, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]"


@pytest.mark.parametrize("patched", pyinfra_seam.PATCHED, ids=lambda p: p.symbol)
def test_each_patched_symbol_is_pyinfras(patched):
    assert pyinfra_seam.symbol_problem(patched) is None


def test_every_patching_module_is_in_the_table():
    """A module that assigns to an attribute of a pyinfra module or class (``Host.put_file =``,
    ``setattr(files, ...)``) names its symbol in PATCHED."""
    patchers = {by.strip().removeprefix("operations/").split(" ")[0]
                for p in pyinfra_seam.PATCHED for by in p.by.split(",")}
    for module in sorted((REPO_ROOT / "operations").glob("*/*.py")):
        tree = ast.parse(module.read_text())
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else []
            patches = [t for t in targets if isinstance(t, ast.Attribute)
                       and isinstance(t.value, ast.Name)
                       and t.value.id in {"Host", "host_module", "pyinfra_operation", "files"}]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr" \
                    and isinstance(node.args[0], ast.Name) and node.args[0].id in {"Host", "files"}:
                patches.append(node)
            if patches:
                assert module.relative_to(REPO_ROOT / "operations").as_posix() in patchers, (module.name, ast.unparse(patches[0]))


def test_a_pyinfra_outside_the_pin_is_named():
    said = pyinfra_seam.version_problem("3.11.0")
    assert said.startswith("pyinfra 3.11.0 is installed") and ">=3.10,<3.11" in said
    assert pyinfra_seam.version_problem("3.10.2") is None
    assert pyinfra_seam.version_problem(None) == "pyinfra is not installed"
    assert "not-a-version" in pyinfra_seam.version_problem("not-a-version")


def test_a_symbol_gone_or_changed_is_named(monkeypatch):
    fake = types.ModuleType("fake_pyinfra_host")

    def get_fact(state, host, cls, arguments=None):  # "args" and "kwargs" renamed
        return None

    fake.get_fact = get_fact
    monkeypatch.setitem(sys.modules, "fake_pyinfra_host", fake)
    changed = pyinfra_seam.Patched("fake_pyinfra_host", "get_fact", "operations/runtime/fact_cache.py",
                                   ("state", "host", "cls", "args", "kwargs"))
    assert pyinfra_seam.symbol_problem(changed) == (
        "fake_pyinfra_host.get_fact has no parameter args, kwargs in the installed pyinfra "
        "(patched by operations/runtime/fact_cache.py, which passes or reads it)")
    gone = pyinfra_seam.Patched("fake_pyinfra_host", "Host.put_file", "operations/runtime/link.py")
    assert pyinfra_seam.symbol_problem(gone) == (
        "fake_pyinfra_host.Host.put_file is gone from the installed pyinfra "
        "(patched by operations/runtime/link.py)")


def test_a_run_with_a_pyinfra_that_does_not_fit_ends_in_one_line(tmp_path):
    """The operations package's import ends the run with the lines, no traceback: here a
    pyinfra whose version is made to read 3.11.0."""
    script = ("import importlib.metadata as m\n"
              "real = m.version\n"
              "m.version = lambda name: '3.11.0' if name == 'pyinfra' else real(name)\n"
              "import operations\n")
    run = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                         text=True, check=False, timeout=120)
    assert run.returncode == 1
    assert run.stderr.strip().splitlines() == [
        "gpuhost: " + pyinfra_seam.version_problem("3.11.0")]
