"""The suite's lanes (tests/lanes.py): what makes a unit, how a unit's report is counted, and
what the suite's exit status is."""

import subprocess
from pathlib import Path

from tests import lanes
from tests.lanes import Unit


def test_every_e2e_module_is_a_unit_and_the_rest_is_one_more():
    found = lanes.units()
    modules = {str(p.relative_to(lanes.ROOT)) for p in lanes.E2E.glob("test_*.py")}
    assert {u.name for u in found[:-1]} == modules
    assert found[-1].args == ["tests", "--ignore=tests/e2e"]


def test_arguments_naming_test_paths_are_told_from_options():
    assert lanes.names_paths(["tests/e2e/test_gate.py::test_x", "-q"])
    assert not lanes.names_paths(["-ra", "-m", "not e2e", "--durations=20"])


def test_a_junit_report_is_counted(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text('<testsuites><testsuite name="pytest" errors="1" failures="2" '
                      'skipped="3" tests="10"/></testsuites>')
    assert lanes.counts(report) == (10, 2, 1, 3)
    assert lanes.counts(tmp_path / "none.xml") == (0, 0, 0, 0)


def test_the_suite_fails_when_any_unit_fails_and_deselected_units_do_not(capsys):
    ok = Unit("a", ["a"], rc=0, counts=(4, 0, 0, 1))
    deselected = Unit("b", ["b"], rc=lanes.NO_TESTS)
    failed = Unit("c", ["c"], rc=1, counts=(3, 1, 0, 0))
    assert lanes.summary([ok, deselected], 1.0) == 0
    assert lanes.summary([deselected], 1.0) == lanes.NO_TESTS
    assert lanes.summary([ok, deselected, failed], 1.0) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert "1 failed, 5 passed, 1 skipped, 0 errors" in last and "failing: c" in last


def test_the_longest_modules_start_first(tmp_path):
    light, heavy = tmp_path / "light.py", tmp_path / "heavy.py"
    light.write_text("lab.deploy()\n")
    heavy.write_text("lab.up(hosts=2)\nlab.deploy()\nlab.deploy()\n")
    assert lanes.weight(heavy) > lanes.weight(light)
    assert isinstance(lanes.weight(Path(lanes.__file__)), int)


def test_every_unit_of_a_run_gets_the_runs_image_folder(tmp_path, monkeypatch):
    seen = []

    def run(cmd, env, **kwargs):
        seen.append(env)
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(lanes.subprocess, "run", run)
    for lab in (0, 1):
        lanes.run_unit(Unit("m", ["tests/e2e/test_m.py"]), lab, [], tmp_path, lambda text: None)
    assert [e["GPUHOST_SANDBOX_LAB"] for e in seen] == ["0", "1"]
    assert {e["GPUHOST_E2E_IMAGES"] for e in seen} == {str(tmp_path / "images")}
    assert (tmp_path / "images").is_dir()
