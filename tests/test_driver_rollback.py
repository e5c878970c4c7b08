"""The driver rollback's planning: apt's simulation read from real apt-get -s output
(tests/fixtures/apt-get-s, apt 2.6 on Debian 12, LC_ALL=C), what --dry says, the records."""

from __future__ import annotations

from pathlib import Path

import pytest

from operations.stages import apt_simulation as sim_
from operations.stages import driver_rollback as dr
from operations.stages.apt_simulation import PackageChange, Simulation

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "apt-get-s"


def lines(name: str, rc: int = 0) -> list[str]:
    return [*(FIXTURES / name).read_text().splitlines(), f"rc={rc}"]


def test_upgrades_read_with_their_installed_version():
    sim = sim_.parse_simulation(lines("upgrade-excerpt.txt"))
    assert sim.error is None
    assert sim.changes == (
        PackageChange("libssl-dev", "3.0.19-1~deb12u2", "3.0.20-1~deb12u2"),
        PackageChange("libssl3", "3.0.19-1~deb12u2", "3.0.20-1~deb12u2"),
        PackageChange("base-files", "12.4+deb12u11", "12.4+deb12u15"),
    )


def test_new_and_removed_packages():
    assert sim_.parse_simulation(lines("install-hello.txt")).changes == (
        PackageChange("hello", None, "2.10-3"),)
    assert sim_.parse_simulation(lines("remove-jq.txt")).changes == (
        PackageChange("yq", "3.1.0-3", None), PackageChange("jq", "1.6-2.1+deb12u1", None))


def test_apt_errors_are_kept():
    sim = sim_.parse_simulation(["Reading package lists...",
                               "E: Unable to locate package nvidia-open", "rc=100"])
    assert sim.error == "Unable to locate package nvidia-open"
    assert sim_.parse_simulation(["rc=1"]).error == "apt-get -s exited 1"


def test_simulation_uses_the_runs_pin_and_changes_nothing():
    command = sim_.simulation_command(["nvidia-open", "nvidia-kernel-open-dkms"], "590.*")
    assert "apt-get -s -o Dir::Etc::PreferencesParts=" in command
    assert "LC_ALL=C" in command and "Pin: version 590.*" in command
    assert "--allow-downgrades --allow-change-held-packages nvidia-open " in command
    assert 'rm -rf "$t"' in command
    with pytest.raises(Exception, match="package name"):
        sim_.simulation_command(["nvidia open"], "590.*")


UPGRADE = Simulation((PackageChange("nvidia-open", "580.95.05-1", "590.44.01-1"),
                      PackageChange("nvidia-kernel-open-dkms", "580.95.05-1", "590.44.01-1")))
RECORD = {"version": "580.95.05", "verified_at": "2026-12-01T20:00:00Z"}


def plan(**kwargs):
    args = dict(install=True, change=True, module_package="nvidia-kernel-open-dkms",
                simulation=UPGRADE, last_good=RECORD, pending=None)
    return dr.plan_lines(**{**args, **kwargs})


def test_dry_names_exact_versions_and_what_a_rollback_restores():
    (_, exact), (_, rollback) = plan()
    assert exact == ("apt would install: nvidia-open 590.44.01-1 (now 580.95.05-1), "
                     "nvidia-kernel-open-dkms 590.44.01-1 (now 580.95.05-1)")
    assert rollback.startswith("driver rollback available: if 590.44.01 fails its checks")
    assert "nvidia-open 580.95.05-1, nvidia-kernel-open-dkms 580.95.05-1 are reinstalled" \
        in rollback
    assert "last verified 2026-12-01T20:00:00Z with 580.95.05" in rollback


def test_dry_without_lists_or_without_a_driver_to_go_back_to():
    assert plan(simulation=None, change=False)[0][1].startswith(
        "apt would install: known once NVIDIA's repository is in the host's apt lists")
    fresh = Simulation((PackageChange("nvidia-open", None, "580.105.08-1"),))
    assert plan(simulation=fresh, change=False, last_good=None)[-1] == (
        "info", "no driver rollback: no driver is installed to go back to")
    failing = plan(simulation=Simulation((), "Unable to locate package nvidia-open"))
    assert failing[0] == ("warning", "apt's simulation of the driver install fails: "
                          "Unable to locate package nvidia-open")
    assert plan(install=False, change=False) == [
        ("info", "driver rollback: none needed (last verified 2026-12-01T20:00:00Z with "
                 "580.95.05)")]


def test_a_pending_change_or_rollback_is_said_first():
    restore = [{"package": "nvidia-open", "version": "580.95.05-1"}]
    rolling = {"phase": "rolling-back", "from": "580.95.05", "to": "590.44.01",
               "failure": "nvidia-smi fails", "restore": restore}
    ((level, line),) = plan(pending=rolling)
    assert level == "warning"
    assert line.startswith("an interrupted driver rollback is finished first: 590.44.01 failed "
                           "(nvidia-smi fails); nvidia-open 580.95.05-1 reinstalled")
    ((_, line),) = plan(pending={**rolling, "phase": "upgrading"})
    assert line.startswith("the change from 580.95.05 to 590.44.01 is not verified yet")


def test_records_read_safely():
    assert dr.load(None) is None and dr.load("{broken") is None and dr.load("[1]") is None
    assert dr.pending_change('{"phase": "upgrading", "restore": []}') is None
    assert dr.pending_change('{"phase": "upgrading", "restore": [{}]}')["phase"] == "upgrading"


def test_keep_script_checks_hashes_against_apts_lists():
    script = dr._keep_script([("nvidia-open", "580.95.05-1")])
    assert "apt-cache show --no-all-versions" in script and "SHA256" in script
    assert "nvidia-open=580.95.05-1" in script and "apt-get download" in script
    assert f"mv {dr.KEPT_DIR}.new {dr.KEPT_DIR}" in script


def test_a_version_that_failed_here_before_is_said():
    record = {**RECORD, "failed": [{"version": "590.44.01", "failure": "nvidia-smi fails",
                                    "at": "2026-12-01T20:30:00Z"}]}
    warning = [line for level, line in plan(last_good=record) if level == "warning"]
    assert warning == ["590.44.01 failed its checks on this host before (2026-12-01T20:30:00Z: "
                       "nvidia-smi fails) and was rolled back: it is tried again"]


def test_the_sandbox_driver_change_as_apt_simulates_it():
    sim = sim_.parse_simulation(lines("sandbox-driver-580-to-590.txt"))
    assert sim.error is None and len(sim.changes) == 6
    assert sim.version_of("nvidia-kernel-open-dkms") == "590.44.01-1"
    assert {c.installed for c in sim.changes} == {"580.95.05-1"}


def test_the_summary_names_the_version_apt_would_install_for_a_branch():
    from operations.plans.driver_plan import DriverPlan

    plan_ = DriverPlan(installed=("580.95.05-1",), target="590.*", install=True, change=True,
                       toolkit_installed="12.8.1-1", toolkit_target="12.8 (cuda-toolkit-12-8)")
    assert "target newest 590.* (590.44.01-1 in apt's lists) (a driver change)" in \
        plan_.summary("590.44.01-1")
    assert "target newest 590.* (a driver change)" in plan_.summary()
    exact = DriverPlan(installed=(), target="580.95.05-*", install=True, change=False,
                       toolkit_installed=None, toolkit_target="12.8 (cuda-toolkit-12-8)")
    assert "target 580.95.05;" in exact.summary("580.95.05-1")


def test_the_simulation_leaves_nvidias_pinning_files_out(tmp_path):
    """The simulation answers under gpuhost's pin for the new target: the installed pinning
    packages' files (dpkg-query -L) are left out of its copy of preferences.d, others stay."""
    import subprocess

    from operations.stages.driver_lock import drop_pinning_files

    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "dpkg-query").write_text(
        "#!/bin/sh\n"  # dpkg-query as it answers for two installed pinning packages
        'if [ "$1" = "-W" ]; then printf "nvidia-driver-pinning-580\\n'
        'nvidia-driver-pinning-580.95.05\\n"; exit 0; fi\n'
        'if [ "$1" = "-L" ]; then echo /.; echo /etc/apt/preferences.d; '
        'echo "/etc/apt/preferences.d/$2"; echo "/usr/share/doc/$2"; fi\n')
    (bin_ / "dpkg-query").chmod(0o755)
    parts = tmp_path / "parts"
    parts.mkdir()
    for name in ("nvidia-driver-pinning-580", "nvidia-driver-pinning-580.95.05",
                 "gpuhost-nvidia-driver", "local-pins"):
        (parts / name).write_text("Package: x\n")
    subprocess.run(["sh", "-c", drop_pinning_files(f"'{parts}'")], check=True,
                   env={"PATH": f"{bin_}:/usr/bin:/bin"})
    assert sorted(p.name for p in parts.iterdir()) == ["gpuhost-nvidia-driver", "local-pins"]


def test_the_rollback_checks_the_kept_module_package_named_in_its_record(monkeypatch):
    """Across Ubuntu's 590 rename: the record names the kept driver's kernel-module package
    (nvidia-dkms-580-open); the reinstalled driver is checked and recorded against that one,
    not against the new driver's name, which the rollback has just removed."""
    from types import SimpleNamespace

    commands: list[str] = []
    checked: list[str] = []

    def sh(host_, command, **kwargs):
        commands.append(command)
        return True, SimpleNamespace(stdout="boot-1", stdout_lines=[], stderr_lines=[])

    def verified(host_, module_package, names, gpu_count, failed):
        checked.append(f"recorded {module_package}")
        return {"version": "580.95.05"}

    monkeypatch.setattr(dr, "_sh", sh)
    monkeypatch.setattr(dr, "_write", lambda *a: None)
    monkeypatch.setattr(dr, "back_with_new_boot", lambda *a: None)
    monkeypatch.setattr(dr, "_record_verified", verified)
    change = {"from": "580.95.05", "to": "590.44.01", "module_package": "nvidia-dkms-580-open",
              "restore": [{"package": "nvidia-dkms-580-open", "version": "580.95.05-0ubuntu1",
                           "file": "/var/lib/gpuhost/driver-kept/a.deb", "sha256": "0" * 64}],
              "remove": ["nvidia-dkms-open"]}
    host_ = SimpleNamespace(name="gpu1", print_prefix="[gpu1] ")
    dr._roll_back(host_, change, "nvidia-smi fails", "nvidia-dkms-open", 1,
                  lambda h, module, n: checked.append(f"checked {module}"))
    assert checked == ["checked nvidia-dkms-580-open", "recorded nvidia-dkms-580-open"]
    assert any("nvidia-dkms-open-" in c for c in commands)  # the new driver's name removed
    old_record = {k: v for k, v in change.items() if k != "module_package"}
    checked.clear()
    dr._roll_back(host_, old_record, "nvidia-smi fails", "nvidia-kernel-open-dkms", 1,
                  lambda h, module, n: checked.append(f"checked {module}"))
    assert checked == ["checked nvidia-kernel-open-dkms", "recorded nvidia-kernel-open-dkms"]


def test_a_long_package_list_is_counted_and_wrapped_each_package_whole():
    changes = tuple(PackageChange(f"libnvidia-part{i}", "580.95.05-1", "590.44.01-1")
                    for i in range(30))
    said = [text for _, text in plan(simulation=Simulation(changes))]
    head, *rows = said[:said.index(next(t for t in said if t.startswith("driver rollback")))]
    assert head == "apt would install 30 packages:"
    assert all(r.startswith("    ") and len(r) <= 4 + dr.LIST_WIDTH for r in rows), rows
    items = [i.strip() for r in rows for i in r.split(",") if i.strip()]
    assert items == [c.describe() for c in changes]
