"""Room for the venv, and a venv a full disk left half-written, on sandbox hosts: a fresh host
whose venvs' and models' folders are on a small file system is refused while planning (--dry
and a real run alike) with one line per folder naming it, the mount point, the room needed and
the room free,
before the driver or anything else is touched; then, on one converged host, a serving venv
whose python or pip does not run is kept as it is and its replacement built beside it by the
next run, and a file system (a tmpfs mounted over the venvs' folder) that fills while the
lock's venv is created or installed into ends the run with one line naming ENOSPC, the file
system and what is free there. Checked over ssh (dpkg, the folders, the venv's python, pip
check, the server's MainPID), never through pyinfra."""

from __future__ import annotations

import re
import shlex

import pytest

from operations.stages.venvs import REPLACEMENT_SUFFIX, VENVS_DIR
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

#: the link to the serving venv; the lock's venv itself is under VENVS_DIR
#: (operations/stages/venvs.py)
VENV = "/opt/gpuhost/venv"
#: the fresh host's small file system: everything gpuhost puts under /opt (issue 42: /opt on a
#: file system of its own)
SMALL = "/opt/gpuhost"
SMALL_MIB = 64
#: the tmpfs goes over the venvs' folder: the lock's venv is made in it (the serving one hidden
#: meanwhile; the server keeps its files open)
FULL = VENVS_DIR


@pytest.fixture
def fresh_host():
    """A fresh sandbox host, taken down after its test (the converged host comes after)."""
    (fresh,) = lab.up(hosts=1, scenario="reference-lab")
    yield fresh
    lab.sandbox("down", check=False)


def test_a_fresh_host_without_room_for_the_venv_is_refused_before_any_change(fresh_host):
    fresh_host.ssh(f"mkdir -p {SMALL} && mount -t tmpfs -o size={SMALL_MIB}m tmpfs {SMALL}")
    # what the NVIDIA stage would change first: packages, apt's sources and keys, the module
    state = ("dpkg-query -W; ls -A /etc/apt/sources.list.d /etc/apt/preferences.d "
             "/usr/share/keyrings /etc/modprobe.d")
    before = fresh_host.ssh(state)
    line = f"ML venv: refused: no room for the new venv {VENVS_DIR}/"
    where = (f"{VENVS_DIR}, /opt/gpuhost/wheels/locked on the file system mounted on {SMALL} "
             "(df): ")
    for args in (("--dry",), ()):  # --dry first: on a host it would not refuse, no real run
        run = lab.deploy(*args)
        assert run.returncode != 0, run.output[-6000:]
        assert "Traceback" not in run.output, run.output[-6000:]
        said = [x for x in run.output.splitlines() if line in x]
        assert len(said) == 1, run.output[-6000:]
        assert where in said[0] and " GiB needed (" in said[0], said[0]
        assert f"{SMALL_MIB}.0 MiB free" in said[0], said[0]
        # the models' folder is on it too: the download's room from the Hub's file listing
        model = [x for x in run.output.splitlines() if "Preflight: refused: no room for the "
                 "model " in x]
        assert len(model) == 1, run.output[-6000:]
        assert (" in /opt/gpuhost/models/" in model[0] and f"{SMALL} on the file system "
                f"mounted on {SMALL} (df): " in model[0]), model[0]
        assert f"GiB kept free), {SMALL_MIB}.0 MiB free" in model[0], model[0]
    # room for the venv alone and for the model alone, not for both: the venv's line counts
    # the model's download on the file system they share (each check passed alone, before)
    parts = re.search(r"needed \((.*), 1 GiB kept free\)", said[0]).group(1).split(", ")
    venv = sum(_kib(p) for p in parts if p.startswith(("/opt/gpuhost/venvs ",
                                                         "/opt/gpuhost/wheels/locked ")))
    model_kib = _kib(re.search(r"\(([\d.]+ [MG]iB) of the revision's files not there yet",
                               model[0]).group(1))
    assert model_kib >= 512, said[0]  # a window the lines' rounding (0.1 MiB) cannot close
    size = 2**20 + max(venv, model_kib) + min(venv, model_kib) // 2
    fresh_host.ssh(f"umount {SMALL} && mount -t tmpfs -o size={size}k tmpfs {SMALL}")
    run = lab.deploy("--dry")
    assert run.returncode != 0 and "Traceback" not in run.output, run.output[-6000:]
    assert "Preflight: refused" not in run.output, run.output[-6000:]
    said = [x for x in run.output.splitlines() if line in x]
    assert len(said) == 1 and "the model's download into /opt/gpuhost/models/" in said[0], \
        run.output[-6000:]
    assert fresh_host.ssh(state) == before
    assert fresh_host.ssh(f"ls -A {SMALL}").split() == []


def _kib(part: str) -> int:
    """KiB of a room line's "<what> 32.0 MiB" (operations/stages/venvs.py size_text)."""
    number, unit = part.split()[-2:]
    return int(float(number) * {"MiB": 1024, "GiB": 2**20}[unit])


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


def changed(run: lab.Run) -> list[str]:
    assert run.results is not None, run.output[-3000:]
    return [op["name"] for op in run.results["results"]["operations"]
            if op["success"] or op["error"]]


def served_venv(host: lab.Host) -> str:
    return host.process_args(host.main_pid())[0].removesuffix("/bin/python")


def other_slot(venv: str) -> str:
    """The lock's other venv folder (<digest> or <digest>-b): where a replacement of ``venv``
    is built (operations/stages/venvs.py)."""
    return (venv.removesuffix(REPLACEMENT_SUFFIX) if venv.endswith(REPLACEMENT_SUFFIX)
            else venv + REPLACEMENT_SUFFIX)


def assert_recreated(host: lab.Host, why: str) -> None:
    """The serving venv that does not run is kept as it is: its replacement is built in the
    lock's other folder (<digest> or <digest>-b, operations/stages/venvs.py) and served."""
    pid, served = host.main_pid(), served_venv(host)
    other = other_slot(served)
    run = lab.deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert "Traceback" not in run.output, run.output[-6000:]
    # the warning's second line starts with the run's indentation (mlenv.py)
    assert (f"venv at {served} does not run ({why})\n  and it serves or is the last known good: "
            f"kept as it is; a replacement is built beside it, at {other}") in run.output, \
        run.output[-6000:]
    assert served_venv(host) == other
    assert host.ssh(f"{VENV}/bin/python -c 'print(6 * 7)'").strip() == "42"
    assert "No broken requirements" in host.ssh(f"{VENV}/bin/python -m pip check")
    assert "sglang" in host.ssh(f"{VENV}/bin/python -m pip list --disable-pip-version-check")
    assert host.main_pid() != pid  # restarted on the recreated venv
    again = lab.deploy("--json")
    assert again.returncode == 0 and changed(again) == [], again.output[-6000:]


def test_a_venv_whose_python_does_not_run_is_recreated(host):
    """A truncated bin/python: it "runs" as an empty shell script, exit 0 and no output."""
    host.ssh(f"rm {VENV}/bin/python && : > {VENV}/bin/python && chmod 755 {VENV}/bin/python")
    assert_recreated(host, "bin/python printed nothing (exit 0)")


def test_a_venv_whose_pip_does_not_run_is_recreated(host):
    host.ssh(f"rm -rf {VENV}/lib/python3*/site-packages/pip")
    assert_recreated(host, f"pip exited 1: {served_venv(host)}/bin/python: No module named pip")


#: the tmpfs's size: room for the lock's venv as the plan counts it (the stand-in lock's files
#: unpack to about 32 MiB; 1 GiB kept free: operations/stages/venvs.py), so that the plan passes
TMPFS_MIB = 1200


@pytest.fixture
def full_disk(host):
    """A tmpfs over the venvs' folder with room enough for the plan, filled once a process
    whose command line matches ``pattern`` (a regex, bracketed so that the watcher's own
    command line does not match it) runs, leaving ``left_kib`` free: the disk fills while the
    deploy writes, after the plan counted the room. Removed after."""
    def fill_when(pattern: str, left_kib: int) -> None:
        host.ssh(f"mount -t tmpfs -o size={TMPFS_MIB}m tmpfs {FULL}")
        watch = (f"for i in $(seq 12000); do if grep -lsaE '{pattern}' /proc/[0-9]*/cmdline "
                 f">/dev/null; then fallocate -l $(( $(df -Pk {FULL} | awk 'NR==2 {{print $4}}')"
                 f" - {left_kib} ))k {FULL}/.filler; exit; fi; sleep 0.02; done")
        host.ssh(f"nohup sh -c {shlex.quote(watch)} >/dev/null 2>&1 &")

    yield fill_when
    host.ssh(f"umount {FULL} 2>/dev/null", check=False)


def test_a_full_disk_while_the_venv_is_created_is_named_and_the_half_venv_recreated(
        host, full_disk):
    pid, served = host.main_pid(), served_venv(host)
    venv = other_slot(served)
    full_disk("[e]nsurepip", 512)  # python -m venv fits, its pip does not
    line = (f"installing pip into the venv {venv}: no space left on the device (ENOSPC) "
            f"writing {venv}: {venv} is on tmpfs mounted on {FULL}, ")
    run = lab.deploy()
    assert run.returncode != 0, run.output[-6000:]
    assert "Traceback" not in run.output and "ensurepip" not in run.output, run.output[-6000:]
    # the tmpfs hides the serving venv: said missing, and never made again at its path; its
    # replacement goes to the lock's other folder, where the full disk is named
    assert f"venv at {served} is missing" in run.output, run.output[-6000:]
    assert line in run.output and f"free of {TMPFS_MIB / 1024:.1f} GiB (df)" in run.output, \
        run.output[-6000:]
    # the next run finds the replacement half-made (no pip); it serves nothing, so it is
    # cleared and made again, and the disk is still full
    again = lab.deploy()
    assert again.returncode != 0, again.output[-6000:]
    assert ("no space left on the device (ENOSPC)" in again.output
            or f"no room for the new venv {venv}" in again.output), again.output[-6000:]
    assert "Traceback" not in again.output, again.output[-6000:]
    assert host.main_pid() == pid  # the host's own venv and server were left alone


def test_a_full_disk_during_the_locked_install_is_named(host, full_disk):
    # room for the venv and its pip, not for the lock's distributions
    full_disk("[p]ip install into", 2048)
    venv = other_slot(served_venv(host))  # the serving one is hidden by the tmpfs
    run = lab.deploy()
    assert run.returncode != 0, run.output[-6000:]
    assert "Traceback" not in run.output, run.output[-6000:]
    assert (f"pip install into {venv}: no space left on the device (ENOSPC) writing "
            f"{venv}") in run.output, run.output[-6000:]
    assert f"mounted on {FULL}, " in run.output and " free of " in run.output


def test_a_folder_of_user_files_or_a_file_at_the_venv_path_is_refused_and_left_alone(host):
    """Not a venv: a real run stops before any change, the files still there; a file at the
    path is named in --dry."""
    host.ssh("mkdir -p /srv/t/notvenv/sub && echo keep > /srv/t/notvenv/important.txt && "
             ": > /srv/t/notvenv/sub/x && : > /srv/t/afile")
    pid = host.main_pid()
    run = lab.deploy("--data", "gpuhost_venv_path=/srv/t/notvenv")
    assert run.returncode != 0 and "Traceback" not in run.output, run.output[-6000:]
    assert ("ML venv: refused: gpuhost_venv_path = '/srv/t/notvenv' is not allowed: it is a "
            "folder holding what a venv does not (important.txt, sub), and gpuhost replaces it "
            "with a link to the serving venv") in run.output, run.output[-6000:]
    assert host.ssh("ls -A /srv/t/notvenv").split() == ["important.txt", "sub"]
    assert host.ssh("cat /srv/t/notvenv/important.txt").strip() == "keep"
    dry = lab.deploy("--dry", "--data", "gpuhost_venv_path=/srv/t/afile")
    assert "Traceback" not in dry.output, dry.output[-6000:]
    assert ("gpuhost_venv_path = '/srv/t/afile' is not allowed: it is a file, and gpuhost "
            "puts a link to the serving venv there") in dry.output, dry.output[-6000:]
    assert host.ssh("stat -c %F /srv/t/afile").strip() == "regular empty file"
    assert host.main_pid() == pid
    host.ssh("rm -rf /srv/t")
