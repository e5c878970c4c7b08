"""The suite's lanes (tests/lanes.py): what makes a unit, how a unit's report is counted, and
what the suite's exit status is."""

import os
import subprocess
from pathlib import Path

import pytest

from tests import lanes
from tests.lanes import Unit


def test_every_e2e_module_is_a_unit_and_the_rest_is_one_more():
    found = lanes.units()
    modules = {str(p.relative_to(lanes.ROOT)) for p in lanes.E2E.glob("test_*.py")}
    split = {m for m in modules if lanes.unit_per_test(lanes.ROOT / m)}
    whole = [a for u in found if "::" not in u.name and u.name.startswith("tests/e2e/")
             for a in u.args]
    assert sorted(whole) == sorted(modules - split)  # each in one unit, whole or joined
    assert [u.args for u in found if u.name == "the rest of tests/"] == [
        ["tests", "--ignore=tests/e2e"]]
    assert [u.expected for u in found] == sorted((u.expected for u in found), reverse=True)


def test_the_p2p_scenarios_are_one_unit_of_one_boot():
    """test_p2p boots its four scenarios' hosts together and converges them in one deploy: one
    unit, its tests not split (four units of one boot each cost a lane 537 s in the 2550 s CI
    run of 8cfba4e)."""
    p2p = [u for u in lanes.units() if u.name.startswith("tests/e2e/test_p2p.py")]
    assert [(u.name, u.args) for u in p2p] == [("tests/e2e/test_p2p.py",
                                               ["tests/e2e/test_p2p.py"])]


def test_each_driver_test_is_a_unit_of_its_own():
    """test_driver's four tests each boot a single-gpu host of their own (754 s as one unit in
    a 3354 s run, the longest): four units, spread over the lanes."""
    driver = [u.name for u in lanes.units() if u.name.startswith("tests/e2e/test_driver.py")]
    assert len(driver) == 4 and all("::test_" in n for n in driver), driver


def test_units_start_by_their_measured_seconds_and_unmeasured_ones_by_their_text(
        monkeypatch):
    """A 461 s module whose text names one boot and two deploys starts before a 126 s one that
    names more; a unit SECONDS lacks is expected to take its text's weight in boots and
    deploys."""
    monkeypatch.setattr(lanes, "SECONDS", {"tests/e2e/test_apt_sources.py": 126,
                                           "tests/e2e/test_interrupted.py": 461})
    found = {u.name: u for u in lanes.units()}
    slow, quick = found["tests/e2e/test_interrupted.py"], found["tests/e2e/test_apt_sources.py"]
    assert slow.weight < quick.weight and slow.expected > quick.expected
    names = [u.name for u in lanes.units()]
    assert names.index(slow.name) < names.index(quick.name)
    gate = found["tests/e2e/test_gate.py"]
    assert gate.expected == gate.weight * lanes.WEIGHT_SECONDS


def test_measured_seconds_name_units_of_the_suite():
    """Nothing in SECONDS that is no unit any more (a module renamed, split or gone)."""
    names = {u.name for u in lanes.units()}
    assert set(lanes.SECONDS) <= names, set(lanes.SECONDS) - names


def test_while_the_image_is_made_a_free_lane_takes_a_unit_that_needs_none(tmp_path):
    maker, user, bare, short_user = (Unit("maker", [], expected=800, image=True),
                                     Unit("user", [], expected=500, image=True),
                                     Unit("bare", [], expected=300),
                                     Unit("short user", [], expected=100, image=True))
    todo = lanes.Todo([maker, user, bare, short_user], tmp_path)
    assert todo.take() is maker  # makes the image (or waits for it)
    assert todo.take() is bare  # not "user", which would wait on the image's lock
    assert todo.take() is user  # nothing else left
    (tmp_path / "converged-reference-lab.tar").write_bytes(b"")
    assert todo.take() is short_user and todo.take() is None
    again = lanes.Todo([maker, user, bare], tmp_path)  # the image is there: in order
    assert [again.take() for _ in range(3)] == [maker, user, bare]


def test_modules_that_start_from_the_image_are_told_by_their_text():
    found = {u.name: u for u in lanes.units()}
    assert found["tests/e2e/test_server.py"].image  # converged_host
    assert found["tests/e2e/test_gate.py"].image  # lab.up_from_image
    assert not found["tests/e2e/test_deploy.py"].image  # the converge from bare itself
    assert not found["the rest of tests/"].image


def test_a_module_asks_for_a_unit_per_test_at_its_top_level(tmp_path):
    asks, silent, off = tmp_path / "a.py", tmp_path / "b.py", tmp_path / "c.py"
    asks.write_text("import pytest\nLANES_UNIT_PER_TEST = True\n")
    silent.write_text("def f():\n    LANES_UNIT_PER_TEST = True\n")
    off.write_text("LANES_UNIT_PER_TEST = False\n")
    assert lanes.unit_per_test(asks)
    assert not lanes.unit_per_test(silent) and not lanes.unit_per_test(off)


def test_modules_that_share_a_fleet_are_one_unit_the_joined_after():
    """test_tls_faults.py's tests run on test_tls.py's fleet, test_observability.py's on
    test_planes.py's (tests/e2e/fleets.py): one pytest process each, one boot and first
    deploy of the fleet instead of two."""
    found = {u.name: u for u in lanes.units()}
    tls = found["tests/e2e/test_tls.py + tests/e2e/test_tls_faults.py"]
    assert tls.args == ["tests/e2e/test_tls.py", "tests/e2e/test_tls_faults.py"] and tls.image
    planes = found["tests/e2e/test_planes.py + tests/e2e/test_observability.py"]
    assert planes.args == ["tests/e2e/test_planes.py", "tests/e2e/test_observability.py"]
    assert planes.image
    assert not {"tests/e2e/test_tls_faults.py", "tests/e2e/test_observability.py",
                "tests/e2e/test_tls.py", "tests/e2e/test_planes.py"} & set(found)


def test_a_module_joins_one_of_its_folder_that_joins_none(tmp_path):
    (tmp_path / "test_a.py").write_text("x = 1\n")
    (tmp_path / "test_b.py").write_text('LANES_UNIT_WITH = "test_a.py"\n')
    assert lanes.joins(tmp_path / "test_b.py") == tmp_path / "test_a.py"
    assert lanes.joins(tmp_path / "test_a.py") is None
    for bad in ('"test_b.py"', '"test_none.py"', '"test_c.py"', "3"):
        (tmp_path / "test_c.py").write_text(f"LANES_UNIT_WITH = {bad}\n")
        with pytest.raises(ValueError, match="test_c.py: LANES_UNIT_WITH = .* is not allowed"):
            lanes.joins(tmp_path / "test_c.py")
    (tmp_path / "test_d.py").write_text("LANES_UNIT_PER_TEST = True\n")
    (tmp_path / "test_c.py").write_text('LANES_UNIT_WITH = "test_d.py"\n')
    with pytest.raises(ValueError, match="neither with LANES_UNIT_PER_TEST"):
        lanes.joins(tmp_path / "test_c.py")


def test_a_tests_weight_counts_its_own_text_and_its_fixtures(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "@pytest.fixture\ndef host():\n    lab.up(hosts=1)\n    yield\n\n"
        "def other():\n    lab.up(hosts=2)\n\n"
        "def test_a(host):\n    lab.deploy()\n    lab.deploy('--dry')\n\n"
        "def test_b():\n    lab.deploy()\n")
    assert lanes.test_weight(module, "m.py::test_a[x]") == 3 + 2
    assert lanes.test_weight(module, "m.py::test_b") == 1


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
    printed = capsys.readouterr().out.splitlines()
    assert "1 failed, 5 passed, 1 skipped, 0 errors" in printed[-1] and "failing: c" in printed[-1]


def test_each_lane_says_its_minutes(capsys):
    """.ci/run's output names each lane's busy minutes beside the run's (issue 43)."""
    units = [Unit("a", ["a"], rc=0, counts=(1, 0, 0, 0), seconds=120.0, lab=0),
             Unit("b", ["b"], rc=0, counts=(1, 0, 0, 0), seconds=60.0, lab=0),
             Unit("c", ["c"], rc=0, counts=(1, 0, 0, 0), seconds=30.0, lab=1)]
    assert lanes.summary(units, 240.0) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "lane of lab 0: 2 units, 3.0 min busy of the run's 4.0 min" in printed
    assert "lane of lab 1: 1 units, 0.5 min busy of the run's 4.0 min" in printed


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


def test_units_of_one_module_keep_reports_of_their_own(tmp_path, monkeypatch):
    junits = []

    def run(cmd, env, **kwargs):
        junits.append(next(a for a in cmd if a.startswith("--junitxml=")))
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(lanes.subprocess, "run", run)
    for name in ("tests/e2e/test_m.py::test_x[a]", "tests/e2e/test_m.py::test_x[b]"):
        lanes.run_unit(Unit(name, [name]), 0, [], tmp_path, lambda text: None)
    assert len(set(junits)) == 2


def test_units_defer_tree_removal_and_each_lane_ends_with_a_plain_down(tmp_path, monkeypatch):
    seen = []

    def run(cmd, env, **kwargs):
        seen.append((cmd, env))
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(lanes.subprocess, "run", run)
    monkeypatch.setattr(lanes.os, "geteuid", lambda: 0)
    monkeypatch.setenv(lanes.DEFER_REMOVAL, "1")  # as a unit's own environment would have it
    lanes.run_unit(Unit("m", ["tests/e2e/test_m.py"]), 7, [], tmp_path, lambda text: None)
    said = []
    lanes.clean_up(7, said.append)
    (unit_cmd, unit_env), (down_cmd, down_env) = seen
    assert unit_env[lanes.DEFER_REMOVAL] == "1"
    assert down_cmd[1:] == ["-m", "sandbox", "down"]
    assert lanes.DEFER_REMOVAL not in down_env and down_env["GPUHOST_SANDBOX_LAB"] == "7"
    assert said == ["[lab 7] sandbox down: exit 0 in 0 s"]


def test_the_cpu_line_says_how_busy_the_machine_was():
    """From two readings of /proc/stat's cpu line: busy, I/O wait and idle shares."""
    before = [100, 0, 50, 800, 50, 0, 0, 0]
    after = [400, 0, 150, 1200, 150, 0, 0, 0]  # 400 busy, 400 idle, 100 iowait of 900
    line = lanes.cpu_line(before, after)
    assert "44 % busy, 11 % waiting on I/O, 44 % idle" in line, line
    assert lanes.cpu_line(None, after) == "CPU over the run: not known (no /proc/stat)"


def test_a_unit_is_charged_the_cpu_its_lanes_group_spent(tmp_path, monkeypatch, capsys):
    """The unit runs inside the lane's group (the shell joins it, then execs pytest) and gets
    the group's cpuacct.usage growth over its run, in seconds; the summary prints it."""
    group = tmp_path / f"gpuhost-lanes-{os.getpid()}-lab3"
    cpu = lanes.LaneCpu(3, root=tmp_path)
    assert cpu.group == group and group.is_dir()
    (group / "cpuacct.usage").write_text("5000000000\n")
    seen = []

    def run(cmd, **kwargs):
        seen.append(cmd)
        (group / "cpuacct.usage").write_text("47500000000\n")  # 42.5 s more
        return subprocess.CompletedProcess(cmd, 0, stdout="")

    monkeypatch.setattr(lanes.subprocess, "run", run)
    unit = Unit("m", ["tests/e2e/test_m.py"], counts=(1, 0, 0, 0))
    lanes.run_unit(unit, 3, [], tmp_path, lambda text: None, cpu)
    (cmd,) = seen
    assert cmd[:2] == ["sh", "-c"] and str(group / "cgroup.procs") in cmd[2]
    assert cmd[4:7] == [lanes.sys.executable, "-m", "pytest"]
    assert unit.cpu == 42.5
    lanes.summary([unit], 60.0)
    printed = capsys.readouterr().out
    assert "     42 CPU s  lab 3" in printed and "1.0 min, 0.7 CPU min" in printed
    (group / "cpuacct.usage").unlink()  # a cgroup's files go with it; these are plain files
    cpu.close()
    assert not group.exists()


def test_without_a_cpuacct_hierarchy_a_unit_runs_as_it_is_and_has_no_cpu_figure(tmp_path):
    cpu = lanes.LaneCpu(0, root=tmp_path / "absent")
    assert cpu.group is None and cpu.seconds() is None
    assert cpu.command(["pytest"]) == ["pytest"]


@pytest.mark.skipif(not (lanes.CPUACCT / "cgroup.procs").exists() or os.geteuid() != 0,
                    reason="needs cgroup v1's cpuacct hierarchy and root")
def test_a_real_group_counts_the_cpu_of_a_child_and_its_children():
    cpu = lanes.LaneCpu(9)
    try:
        before = cpu.seconds()
        burn = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'sum(range(10**7))'])"
        subprocess.run(cpu.command([lanes.sys.executable, "-c", burn]), check=True)
        assert cpu.seconds() - before > 0.05
    finally:
        cpu.close()


def test_units_keep_their_bytecode_in_the_runs_folder_not_the_clone(tmp_path, monkeypatch):
    """PYTHONDONTWRITEBYTECODE, as this machine sets it, would have every deploy of a unit
    compile gpuhost again: the units write bytecode, under the run's folder alone."""
    seen = []
    monkeypatch.setattr(lanes.subprocess, "run", lambda cmd, env, **kw: seen.append(env) or
                        subprocess.CompletedProcess(cmd, 0, stdout=""))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    lanes.run_unit(Unit("m", ["tests/e2e/test_m.py"]), 7, [], tmp_path, lambda text: None)
    (env,) = seen
    assert "PYTHONDONTWRITEBYTECODE" not in env
    assert env["PYTHONPYCACHEPREFIX"] == str(tmp_path / lanes.BYTECODE)
