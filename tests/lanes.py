"""The whole suite in lanes (bin/test): each end-to-end module is a unit of work, the rest of
the suite one more; GPUHOST_TEST_WORKERS lanes (default 3) take the next unit as they finish,
and lane i runs it in a pytest process of its own with GPUHOST_SANDBOX_LAB = base + i (base:
GPUHOST_SANDBOX_LAB, default 0), so two modules never share, or take down, each other's sandbox
hosts. A unit's whole output is printed when it ends, then one line for the suite.

    .venv/bin/python -m tests.lanes [pytest arguments]

The end-to-end modules wait on their hosts most of the time (boots, deploys, the server's
start), so lanes on a 2-core machine take much less than one: two lanes left 20 to 40 % of
the CPU idle (vmstat, 17 units), so the default is three. Arguments go to every unit's
pytest; arguments naming test paths run just those, in one plain pytest process.

A module whose tests each boot hosts of their own (a function-scoped host fixture, e.g.
test_driver's four) says so with a top-level ``LANES_UNIT_PER_TEST = True``: each of its tests
(by node id, from ``pytest --collect-only -q``) is then a unit of its own, so they spread over
the lanes instead of holding one lane for the sum of their boots (test_p2p, one host per
scenario one after the other, took 1000 to 1100 s of a 2434 s run in one lane; it now boots its
four scenarios' hosts together, one boot and one converge).

Modules that share a fleet (a session-scoped fixture of tests/e2e/fleets.py) form one unit, one
pytest process, so the fleet boots and converges once for them: the module that joins another
names it at its top level (``LANES_UNIT_WITH = "test_tls.py"``) and its tests run after that
module's. Run alone, either module boots the fleet itself.

The lanes take the units longest first, by the seconds each took in a measured run (SECONDS;
a unit not listed there, e.g. a new module, by its text: WEIGHT_SECONDS per boot and deploy it
names): with the text alone, a 461 s module weighed as little as a 39 s one and could start
last. The run's summary lists each unit's seconds, from which SECONDS is brought up to date.

The run keeps a folder for images of converged hosts (GPUHOST_E2E_IMAGES, removed at the end;
tests/e2e/lab.py ``up_converged``, ``up_from_image``): modules that start from a converged host
boot it from the image the first of them made, instead of each converging a bare host (4 to 5
minutes each on 2 cores with three lanes). While the first of them makes it, a free lane takes
the longest unit that needs no image (its text names none of those), rather than one that
would wait on the image's lock.

Why not pytest-xdist: pyinfra_cli, which pyinfra-testing and the inventory check import, calls
gevent's ``monkey.patch_all()`` on import (pyinfra_cli/__init__.py); in an xdist worker that
happens after execnet's I/O thread started, and the worker stops at once with gevent's LoopExit
"This operation would block forever".
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
E2E = ROOT / "tests" / "e2e"
#: pytest's exit status when a unit collects nothing (e.g. ``-m "not e2e"`` on an e2e module)
NO_TESTS = 5
#: the top-level name by which a module asks for one unit per test
PER_TEST = "LANES_UNIT_PER_TEST"
#: the folder of the run's reports where every Python process of the units keeps its bytecode
#: (PYTHONPYCACHEPREFIX, Python's "sys.pycache_prefix"; none in the clone): each deploy, inventory
#: and ``python -m sandbox`` of a unit compiled gpuhost's modules again where the machine sets
#: PYTHONDONTWRITEBYTECODE (this one does): importing operations/ took 0.67 to 0.70 s of CPU
#: that way, 0.43 to 0.50 s from the folder (measured here, 2026-12-07), in every one of the
#: suite's hundreds of such processes
BYTECODE = "bytecode"
#: the top-level name by which a module joins another module's unit (its file name)
WITH = "LANES_UNIT_WITH"
#: the rest of tests/ (the unit tests) weighs as much as a module of one boot and two deploys
#: (197 s in the 2434 s CI run, beside test_deploy's 156 s and test_rebuild's 250 s)
REST_WEIGHT = 5
#: seconds per boot or deploy named in a unit's text (weight), for a unit SECONDS lacks: the
#: median over the units of the 3354 s CI run of 2026-12-03
WEIGHT_SECONDS = 37
#: seconds each unit took: the clean-clone CI run of 8cfba4e (2026-12-07: 37 units in 2550 s,
#: this 2-core machine, three lanes, nothing else running; hosts on overlays of one tree)
SECONDS = {
    "the rest of tests/": 418,
    "tests/e2e/test_apt_sources.py": 166,
    "tests/e2e/test_bad_input.py": 156,
    "tests/e2e/test_bench.py": 259,
    "tests/e2e/test_deploy.py": 132,
    "tests/e2e/test_drift.py": 111,
    "tests/e2e/test_driver.py::"
    "test_driver_change_dry_refused_then_allowed_and_mismatch_rebooted": 199,
    "tests/e2e/test_driver.py::"
    "test_driver_outside_apt_is_refused_left_alone_or_replaced_on_request": 134,
    "tests/e2e/test_driver.py::test_no_headers_for_the_running_kernel_stops_before_the_driver": 24,
    "tests/e2e/test_driver.py::test_nouveau_bound_gpu_is_rebound_to_nvidia": 125,
    "tests/e2e/test_driver_rollback.py": 310,
    "tests/e2e/test_dry_purity.py": 134,
    "tests/e2e/test_fleet.py": 143,
    "tests/e2e/test_full_disk.py": 129,
    "tests/e2e/test_gate.py": 104,
    "tests/e2e/test_interrupted.py": 346,
    "tests/e2e/test_listeners.py": 24,
    "tests/e2e/test_membership.py": 295,
    "tests/e2e/test_messages.py": 76,
    "tests/e2e/test_mlenv.py": 221,
    "tests/e2e/test_multinode.py": 159,
    "tests/e2e/test_nothing_lost.py": 175,
    "tests/e2e/test_operators.py": 223,
    "tests/e2e/test_p2p.py": 250,
    "tests/e2e/test_pending_kernel.py": 150,
    "tests/e2e/test_planes.py + tests/e2e/test_observability.py": 600,
    "tests/e2e/test_rebuild.py": 312,
    "tests/e2e/test_rollback.py": 137,
    "tests/e2e/test_router.py": 569,
    "tests/e2e/test_secrets.py": 42,
    "tests/e2e/test_secure_boot.py": 149,
    "tests/e2e/test_server.py": 577,
    "tests/e2e/test_tls.py + tests/e2e/test_tls_faults.py": 328,
    "tests/e2e/test_ubuntu.py": 155,
}
#: a unit's `sandbox down` sets its host trees aside, the next `up` on the lab deletes them in
#: the background (sandbox/trash.py: 13 to 82 s per teardown off the lane); the lane's last
#: step is a plain `down` of its lab, which waits for that and removes the rest
DEFER_REMOVAL = "GPUHOST_SANDBOX_DEFER_REMOVAL"


@dataclass
class Unit:
    name: str
    args: list[str]
    rc: int | None = None
    seconds: float = 0.0
    #: CPU seconds its processes spent, its sandbox hosts' included (LaneCpu); None: not known
    cpu: float | None = None
    lab: int = 0
    weight: int = 0
    #: seconds it is expected to take: SECONDS, else weight x WEIGHT_SECONDS
    expected: float = 0.0
    #: whether it starts from the run's image of a converged host (IMAGE_USERS)
    image: bool = False
    counts: tuple[int, int, int, int] = (0, 0, 0, 0)  # tests, failures, errors, skipped


def weight(path: Path) -> int:
    """How long a module is likely to take, for starting the longest first: its boots and
    deploys, as the text says (a proxy; a lane takes the next unit whenever it finishes)."""
    return text_weight(path.read_text())


def text_weight(text: str) -> int:
    return 3 * text.count("lab.up(") + text.count("deploy(")


def test_weight(path: Path, node_id: str) -> int:
    """One test's weight: its function's text and that of the module's fixtures it takes (the
    function-scoped host fixture boots for each test)."""
    source = path.read_text()
    functions = {n.name: n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
    test = functions[node_id.split("::")[-1].split("[")[0]]
    parts = [test] + [functions[a.arg] for a in test.args.args if a.arg in functions]
    return sum(text_weight(ast.get_source_segment(source, f) or "") for f in parts)


#: what a module's text names when it starts from the run's image of a converged host (the
#: last two: tests/e2e/fleets.py's fleets, booted with lab.up_from_image)
IMAGE_USERS = ("up_converged(", "converged_host", "up_from_image(", "tls_fleet",
               "cpu_router_fleet")


def uses_image(text: str) -> bool:
    return any(name in text for name in IMAGE_USERS)


def top_level(path: Path, name: str):
    """The constant the module assigns to ``name`` at its top level (None if it does not)."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            if any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                return node.value.value
    return None


def unit_per_test(path: Path) -> bool:
    """True when the module sets ``LANES_UNIT_PER_TEST = True`` at its top level."""
    return top_level(path, PER_TEST) is True


def joins(path: Path) -> Path | None:
    """The module whose unit this one joins (``LANES_UNIT_WITH = "test_x.py"``: a module of
    its folder that joins none and is one unit), or None. Anything else is an error."""
    named = top_level(path, WITH)
    if named is None:
        return None
    other = path.parent / str(named)
    if not isinstance(named, str) or not other.is_file() or other == path or joins(other) \
            or unit_per_test(other) or unit_per_test(path):
        raise ValueError(f"{path.name}: {WITH} = {named!r} is not allowed: the file name of "
                         "another module of its folder, which joins none, and neither with "
                         f"{PER_TEST}")
    return other


@functools.cache
def node_ids(path: Path) -> tuple[str, ...]:
    """The module's tests, as pytest collects them (parametrized ones one per parameter)."""
    rel = str(path.relative_to(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           "--collect-only", "-q", rel], cwd=ROOT, text=True,
                          capture_output=True, check=False)
    found = [line.strip() for line in proc.stdout.splitlines()
             if line.startswith(f"{rel}::")]
    if proc.returncode != 0 or not found:
        raise RuntimeError(f"collecting {rel} for its tests' units failed "
                           f"(exit {proc.returncode}):\n{proc.stdout}{proc.stderr}")
    return tuple(found)


def module_units(path: Path, joined: list[Path] | None = None) -> list[Unit]:
    """The module as one unit (with the modules that join it, after it, named by all of them:
    "a.py + b.py") or, where it asks, each test as one."""
    rel = str(path.relative_to(ROOT))
    image = uses_image(path.read_text())
    if joined:
        paths = [path, *joined]
        rels = [str(p.relative_to(ROOT)) for p in paths]
        return [Unit(" + ".join(rels), rels, weight=sum(weight(p) for p in paths),
                     image=any(uses_image(p.read_text()) for p in paths))]
    if not unit_per_test(path):
        return [Unit(rel, [rel], weight=weight(path), image=image)]
    tests = node_ids(path)
    return [Unit(t, [t], weight=test_weight(path, t), image=image) for t in tests]


class Todo:
    """The units not yet started, longest first; `take` gives a lane the next one. Until the
    run's image exists (a converged-*.tar in `images`), once a unit that needs it has started
    (it makes the image, or waits for it), a lane takes the next unit that needs none, and one
    that needs it only when nothing else is left."""

    def __init__(self, found: list[Unit], images: Path):
        self.left, self.images = list(found), images
        self.image_started = False
        self.lock = threading.Lock()

    def take(self) -> Unit | None:
        with self.lock:
            if not self.left:
                return None
            waiting = self.image_started and not any(self.images.glob("converged-*.tar"))
            unit = next((u for u in self.left if not (waiting and u.image)), self.left[0])
            self.left.remove(unit)
            self.image_started = self.image_started or unit.image
            return unit


def units() -> list[Unit]:
    """Every unit of the suite, the longest expected first (ties by name)."""
    modules = sorted(E2E.glob("test_*.py"))
    joined: dict[Path, list[Path]] = {}
    for path in modules:
        if (other := joins(path)) is not None:
            joined.setdefault(other, []).append(path)
    found = [u for p in modules if joins(p) is None for u in module_units(p, joined.get(p))]
    found.append(Unit("the rest of tests/", ["tests", f"--ignore={E2E.relative_to(ROOT)}"],
                      weight=REST_WEIGHT))
    for unit in found:
        unit.expected = SECONDS.get(unit.name, unit.weight * WEIGHT_SECONDS)
    return sorted(found, key=lambda u: (-u.expected, u.name))


def names_paths(args: list[str]) -> bool:
    return any(not a.startswith("-") and (ROOT / a.split("::")[0]).exists() for a in args)


def counts(junit: Path) -> tuple[int, int, int, int]:
    """tests, failures, errors, skipped, from pytest's --junitxml report (absent: nothing ran)."""
    try:
        suites = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return (0, 0, 0, 0)
    total = [0, 0, 0, 0]
    for suite in suites.iter("testsuite"):
        for i, key in enumerate(("tests", "failures", "errors", "skipped")):
            total[i] += int(suite.get(key, 0))
    return tuple(total)


#: cgroup v1's CPU accounting hierarchy, as this machine's kernel mounts it (cgroups(7))
CPUACCT = Path("/sys/fs/cgroup/cpuacct")


class LaneCpu:
    """The CPU a lane's units spend: each unit's pytest starts inside a cpuacct group of the
    lane's own, and whatever it starts stays there (a child inherits its parent's cgroup,
    cgroups(7)): pyinfra and ssh, the sandbox's detached supervisors, and through them the
    hosts' systemd-nspawn and every process on the hosts (--keep-unit: nspawn makes no group
    of its own, sandbox/supervisor.py). A unit's figure is the group's ``cpuacct.usage``
    (nanoseconds) at its end less at its start, so a unit also carries what the lane's last
    unit left running (its hosts until this unit's ``up`` takes them down, the tree deleter).
    The figure says which units the CPU-bound suite spends its time on, as the wall seconds
    of a unit sharing two cores with the other lanes cannot. No figure where there is no such
    hierarchy (cgroup v2 alone) or no right to make a group in it."""

    def __init__(self, lab: int, root: Path = CPUACCT):
        self.group: Path | None = root / f"gpuhost-lanes-{os.getpid()}-lab{lab}"
        try:
            self.group.mkdir(exist_ok=True)
        except OSError:
            self.group = None

    def command(self, argv: list[str]) -> list[str]:
        """`argv` run inside the group (a shell that joins it, then execs `argv`: no
        preexec_fn, which is not safe beside the lanes' threads)."""
        if self.group is None:
            return argv
        procs = shlex.quote(str(self.group / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def seconds(self) -> float | None:
        if self.group is None:
            return None
        try:
            return int((self.group / "cpuacct.usage").read_text()) / 1e9
        except (OSError, ValueError):
            return None

    def close(self) -> None:
        if self.group is not None:
            try:
                self.group.rmdir()
            except OSError:  # a process still in it: the group stays, empty groups are cheap
                pass


def run_unit(unit: Unit, lab: int, extra: list[str], reports: Path, say,
             cpu: LaneCpu | None = None) -> None:
    junit = reports / f"{re.sub(r'[^A-Za-z0-9_.-]+', '_', unit.name)}.xml"
    images = reports / "images"
    images.mkdir(exist_ok=True)
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"},
           "GPUHOST_SANDBOX_LAB": str(lab), "PYTHONUNBUFFERED": "1",
           "GPUHOST_E2E_IMAGES": str(images), DEFER_REMOVAL: "1",
           "PYTHONPYCACHEPREFIX": str(reports / BYTECODE)}
    argv = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}",
            *unit.args, *extra]
    started, cpu_before = time.monotonic(), cpu.seconds() if cpu else None
    say(f"[lab {lab}] {unit.name}: started")
    proc = subprocess.run(cpu.command(argv) if cpu else argv, cwd=ROOT, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=False)
    unit.rc, unit.lab = proc.returncode, lab
    unit.seconds = time.monotonic() - started
    cpu_after = cpu.seconds() if cpu else None
    if cpu_before is not None and cpu_after is not None:
        unit.cpu = cpu_after - cpu_before
    unit.counts = counts(junit)
    spent = "" if unit.cpu is None else f" ({unit.cpu:.0f} CPU s)"
    say(f"\n{'=' * 30} {unit.name} (lab {lab}): exit {unit.rc} in {unit.seconds:.0f} s{spent} "
        f"{'=' * 30}\n{proc.stdout.rstrip()}\n")


def clean_up(lab: int, say) -> None:
    """A plain `sandbox down` of the lane's lab: the trees its units set aside are removed
    (after a deleter still at work); without root there is no lab to take down."""
    if os.geteuid() != 0:
        return
    env = {k: v for k, v in os.environ.items() if k != DEFER_REMOVAL}
    env["GPUHOST_SANDBOX_LAB"] = str(lab)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "sandbox", "down"], cwd=ROOT, env=env,
                          text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          check=False)
    say(f"[lab {lab}] sandbox down: exit {proc.returncode} in {time.monotonic() - started:.0f} s"
        + (f"\n{proc.stdout.rstrip()}" if proc.returncode else ""))


def main(args: list[str]) -> int:
    if names_paths(args):
        return subprocess.run([sys.executable, "-m", "pytest", *args], cwd=ROOT).returncode
    lanes = int(os.environ.get("GPUHOST_TEST_WORKERS", "3") or "3")
    base = os.environ.get("GPUHOST_SANDBOX_LAB", "0")
    if not base.isdigit() or lanes < 1 or int(base) + lanes - 1 > 9:
        print(f"GPUHOST_SANDBOX_LAB = {base!r} with GPUHOST_TEST_WORKERS = {lanes}: the lanes' "
              "labs must lie within 0 to 9 (at least one lane)", file=sys.stderr)
        return 2
    every = units()
    printing = threading.Lock()

    def say(text: str) -> None:
        with printing:
            print(text, flush=True)

    started, cpu_before = time.monotonic(), cpu_times()
    with tempfile.TemporaryDirectory(prefix="gpuhost-lanes-") as reports:
        todo = Todo(every, Path(reports) / "images")

        def lane(lab: int) -> None:
            cpu = LaneCpu(lab)
            while True:
                unit = todo.take()
                if unit is None:
                    clean_up(lab, say)
                    cpu.close()
                    return
                run_unit(unit, lab, args, Path(reports), say, cpu)

        threads = [threading.Thread(target=lane, args=(int(base) + i,)) for i in range(lanes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    print(cpu_line(cpu_before, cpu_times()))
    return summary(every, time.monotonic() - started)


def cpu_times() -> list[int] | None:
    """The machine's CPU time so far, in USER_HZ, from /proc/stat's ``cpu`` line (proc(5):
    user nice system idle iowait irq softirq steal ...); None where there is none."""
    try:
        with open("/proc/stat") as stat:
            return [int(x) for x in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None


def cpu_line(before: list[int] | None, after: list[int] | None) -> str:
    """How busy the machine's CPUs were over the run: what says whether more lanes could help
    (idle left) or only less work (none left)."""
    if before is None or after is None:
        return "CPU over the run: not known (no /proc/stat)"
    spent = [b - a for a, b in zip(before, after)]
    total = sum(spent) or 1
    idle, iowait = spent[3], spent[4]
    return (f"CPU over the run: {100 * (total - idle - iowait) / total:.0f} % busy, "
            f"{100 * iowait / total:.0f} % waiting on I/O, {100 * idle / total:.0f} % idle "
            f"(/proc/stat, {os.cpu_count()} CPUs)")


def summary(every: list[Unit], wall: float) -> int:
    print(f"{'=' * 30} {len(every)} units in {wall:.0f} s on "
          f"{len({u.lab for u in every})} lane(s) {'=' * 30}")
    for unit in every:
        tests, failures, errors, skipped = unit.counts
        spent = "      -" if unit.cpu is None else f"{unit.cpu:7.0f}"
        print(f"{unit.seconds:7.0f} s {spent} CPU s  lab {unit.lab}  exit {unit.rc}  "
              f"{unit.name}  "
              f"({tests - failures - errors - skipped} passed, {failures} failed, "
              f"{errors} errors, {skipped} skipped)")
    for lab in sorted({u.lab for u in every}):
        mine = [u for u in every if u.lab == lab]
        cpu = [u.cpu for u in mine if u.cpu is not None]
        spent = f", {sum(cpu) / 60:.1f} CPU min" if cpu else ""
        print(f"lane of lab {lab}: {len(mine)} units, {sum(u.seconds for u in mine) / 60:.1f} "
              f"min busy of the run's {wall / 60:.1f} min{spent}")
    tests, failures, errors, skipped = (sum(u.counts[i] for u in every) for i in range(4))
    bad = [u.name for u in every if u.rc not in (0, NO_TESTS)]
    print(f"{'=' * 30} {failures} failed, {tests - failures - errors - skipped} passed, "
          f"{skipped} skipped, {errors} errors in {wall:.0f} s "
          f"({'all units passed' if not bad else 'failing: ' + ', '.join(bad)}) {'=' * 30}")
    if bad:
        return 1
    return NO_TESTS if all(u.rc == NO_TESTS for u in every) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
