"""operations/runtime/shipped_files.py ``retired``: the library files gpuhost no longer ships are
removed from a host an older gpuhost left them on, and a second run changes nothing. pyinfra's
own CLI on @local, run twice, as the end-to-end tests run it on a host."""

import subprocess
import sys
from pathlib import Path

from operations import REPO_ROOT
from operations.runtime import shipped_files


def _deploy(tmp_path: Path, lib: Path) -> str:
    deploy = tmp_path / "retire.py"
    deploy.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from operations.runtime import shipped_files\n"
        "shipped_files.install()\n"
        f"shipped_files.retired({str(lib)!r})\n")
    pyinfra = Path(sys.executable).with_name("pyinfra")
    run = subprocess.run([str(pyinfra), "-y", "@local", str(deploy)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    return out


def test_a_retired_script_is_removed_and_a_second_run_changes_nothing(tmp_path):
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "api_gate.py").write_text("# gpuhost's own API key gate, before nginx\n")
    (lib / "gate_keys.py").write_text("# shipped now\n")
    first = _deploy(tmp_path, lib)
    assert f"Remove {lib}/api_gate.py (no longer shipped)" in first
    assert "[@local] Success" in first, first
    assert not (lib / "api_gate.py").exists() and (lib / "gate_keys.py").exists()
    second = _deploy(tmp_path, lib)
    # gone: no operation at all, as on a fresh host that never had it
    assert "no longer shipped" not in second and "[@local] Success" not in second, second


def test_a_retired_name_is_shipped_by_no_stage():
    """A script both shipped and retired would be sent and removed at every run."""
    shipped = {p.name for p in (REPO_ROOT / "operations" / "files").iterdir()}
    assert shipped_files.RETIRED and not shipped & set(shipped_files.RETIRED)
    for module in (REPO_ROOT / "operations").glob("*/*.py"):
        text = module.read_text()
        for name in shipped_files.RETIRED:
            assert f'"{name}"' not in text or module.name == "shipped_files.py", module
