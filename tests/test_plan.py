"""operations/plans/plan.py: facts read once per host while planning, every time while executing; a
run whose every host is refused."""

import subprocess
import sys
from pathlib import Path

from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from operations import REPO_ROOT
from operations.facts.host import FileText
from operations.plans.plan import fact
from operations.stages.server_state import ServiceState


def counting_host(state, name):
    host = create_host(state, name=name)
    calls = []

    def get_fact(cls, **kwargs):
        calls.append((cls.__name__, kwargs))
        return f"{cls.__name__} of {name} #{len(calls)}"

    host.get_fact = get_fact
    return host, calls


def test_planning_reads_each_fact_once_per_host_and_arguments():
    state = FakeState()
    gpu1, calls1 = counting_host(state, "gpu1")
    gpu2, calls2 = counting_host(state, "gpu2")
    with ctx_state.use(state):
        with ctx_host.use(gpu1):
            first = fact(FileText, path="/a")
            assert fact(FileText, path="/a") == first == "FileText of gpu1 #1"
            assert fact(FileText, path="/b") == "FileText of gpu1 #2"
            inputs = ["--venv", "/opt/v", "/etc/u"]
            assert fact(ServiceState, unit="u", runtime_dir="r", inputs=inputs) == \
                fact(ServiceState, unit="u", runtime_dir="r", inputs=list(inputs))
        with ctx_host.use(gpu2):
            assert fact(FileText, path="/a") == "FileText of gpu2 #1"
    assert len(calls1) == 3 and len(calls2) == 1


def test_executing_reads_every_time():
    state = FakeState()
    state.current_stage = StateStage.Execute
    host, calls = counting_host(state, "gpu1")
    with ctx_state.use(state), ctx_host.use(host):
        assert fact(FileText, path="/a") != fact(FileText, path="/a")
    assert len(calls) == 2


def test_a_run_whose_every_host_is_refused_ends_with_the_refusal_not_a_pyinfra_error(tmp_path):
    """The last host refused used to end the run with "pyinfra error in .../plan.py line N: No
    hosts remaining!" (and pyinfra's exit status for it); it ends with the refusal and exit 1."""
    deploy = tmp_path / "refusing.py"
    deploy.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from operations.plans.plan import refuse, stop_if_refused\n"
        "refuse('Stage', 'a reason the test gives')\nstop_if_refused()\n")
    pyinfra = Path(sys.executable).with_name("pyinfra")
    run = subprocess.run([str(pyinfra), "-y", "@local", str(deploy)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "nothing was changed, because:" in out and "a reason the test gives" in out
    assert "No hosts remaining" not in out and "pyinfra error" not in out, out


def test_a_refused_hosts_planned_changes_are_said_not_to_happen(tmp_path):
    """--dry on a refused host said "a real run would change nothing" and then its table listed
    the host under every change it planned: the refusal now says those do not happen; and the
    table's "Conditional Change" column is said once, so it is not read as "will change"."""
    deploy = tmp_path / "refusing.py"
    deploy.write_text(
        f"import sys\nsys.path.insert(0, {str(REPO_ROOT)!r})\n"
        "from pyinfra.operations import files\n"
        "from operations.plans.plan import refuse, stop_if_refused\n"
        f"files.file(name='A file', path={str(tmp_path / 'made')!r})\n"
        f"files.directory(name='A folder', path={str(tmp_path / 'folder')!r})\n"
        "refuse('Stage', 'a reason the test gives')\nstop_if_refused()\n")
    pyinfra = Path(sys.executable).with_name("pyinfra")
    run = subprocess.run([str(pyinfra), "@local", str(deploy), "--dry"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "a real run would change nothing, because:" in out
    assert "The table below still counts @local under the 2 operation(s) it planned: they are " \
           "what a run would do once the above is put right; none of them happens while it " \
           "stands." in " ".join(out.split()), out
    assert out.count('"Conditional Change" counts those where it runs only if an earlier') == 1
    assert not (tmp_path / "made").exists()
