"""operations/runtime/fact_batch.py and the announced facts of operations/runtime/fact_cache.py and
operations/runtime/shipped_files.py: announced facts are read in one command, each as pyinfra reads
it alone. pyinfra's own State, Host and @local connector; each command is counted."""

from __future__ import annotations

import inspect
import os

import pytest
from pyinfra.api import Config, Inventory, State
from pyinfra.api import host as host_module
from pyinfra.api.host import Host
from pyinfra.api.operation import add_op
from pyinfra.api.state import StateStage
from pyinfra.context import ctx_host, ctx_state
from pyinfra.facts.files import Directory, File, Sha1File
from pyinfra.facts import files as pyinfra_files
from pyinfra.facts.server import Command
from pyinfra.facts.systemd import SystemdStatus
from pyinfra.operations import files

from operations.runtime import fact_batch, fact_cache, shipped_files


@pytest.fixture
def local(monkeypatch):
    """pyinfra's @local host, its commands counted in ``host.commands``, the cache installed
    for the test only."""
    monkeypatch.setattr(host_module, "get_fact", host_module.get_fact)
    monkeypatch.setattr(Host, "put_file", Host.put_file)
    monkeypatch.delattr(host_module, "_gpuhost_fact_cache", raising=False)
    for name in shipped_files.READS:
        monkeypatch.setattr(files, name, getattr(files, name))
    run = Host.run_shell_command
    commands: list[str] = []

    def counted(self, command, *args, **kwargs):
        commands.append(str(command))
        return run(self, command, *args, **kwargs)

    monkeypatch.setattr(Host, "run_shell_command", counted)
    inventory = Inventory((["@local"], {}))
    state = State(inventory, Config())
    state.current_stage = StateStage.Prepare
    target = inventory.get_host("@local")
    with ctx_state.use(state), ctx_host.use(target):
        target.connect()
        fact_cache.install()
        target.commands = commands
        yield target


@pytest.fixture
def tree(tmp_path):
    (tmp_path / "a.txt").write_text("one\n")
    (tmp_path / "b.txt").write_text("two, no newline")
    os.chmod(tmp_path / "b.txt", 0o600)
    (tmp_path / "sub").mkdir()
    return tmp_path


def test_announced_facts_are_read_in_one_command_as_each_alone(local, tree):
    state = local.state
    wanted = [(File, {"path": str(tree / "a.txt")}), (Sha1File, {"path": str(tree / "a.txt")}),
              (File, {"path": str(tree / "b.txt")}), (Sha1File, {"path": str(tree / "b.txt")}),
              (Directory, {"path": str(tree / "sub")}), (File, {"path": str(tree / "no")}),
              (Sha1File, {"path": str(tree / "no")}), (Directory, {"path": str(tree / "a.txt")})]
    values = fact_batch.read(state, local, wanted, {})
    assert len(local.commands) == 1
    fact_cache.forget(local)
    alone = [local.get_fact(cls, **kwargs) for cls, kwargs in wanted]

    def timeless(value):  # reading a file or folder may move its access time (relatime)
        return {k: v for k, v in value.items() if k != "atime"} if isinstance(value, dict) \
            else value

    assert [timeless(values[i]) for i in range(len(wanted))] == [timeless(v) for v in alone]
    assert alone[3] is not None and alone[2]["mode"] == 600 and alone[5] is None


def test_a_fact_whose_command_fails_is_left_to_its_own_reading(local, tmp_path):
    values = fact_batch.read(local.state, local, [
        (Command, {"command": "printf 'no newline'"}), (Command, {"command": "echo x; false"}),
        (Command, {"command": "true"}), (Command, {"command": "printf 'a\\n\\n'"})], {})
    assert values == {0: "no newline", 2: None, 3: "a\n"}


def test_the_facts_of_a_batch_run_at_once(local, tmp_path):
    flag = tmp_path / "flag"
    # The first waits (at most 10 s) for a file the second makes: read one after the other,
    # the first would find none and be left to its own reading.
    wait = (f"i=0; while [ ! -e {flag} ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i+1)); done; "
            f"[ -e {flag} ] && echo seen")
    values = fact_batch.read(local.state, local, [
        (Command, {"command": wait}), (Command, {"command": f"touch {flag} && echo made"})], {})
    assert values == {0: "seen", 1: "made"}
    assert len(local.commands) == 1


def test_the_first_announced_fact_read_reads_them_all_once_until_a_command_runs(local, tree):
    paths = [str(tree / "a.txt"), str(tree / "b.txt"), str(tree / "sub")]
    for path in paths:
        fact_cache.expect(local, File, path=path)
        fact_cache.expect(local, Sha1File, path=path)
    assert local.get_fact(File, path=paths[0])["size"] == 4
    assert local.get_fact(Sha1File, path=paths[1])
    assert local.get_fact(File, path=paths[2]) is False
    assert len(local.commands) == 1
    local.run_shell_command(f"echo more >> {paths[0]}")
    assert local.get_fact(File, path=paths[0])["size"] == 9  # read again, with the others
    assert local.get_fact(Sha1File, path=paths[1])
    assert len(local.commands) == 3


def test_files_put_announces_what_it_reads(local, tree):
    shipped_files.install()
    dest = str(tree / "sub" / "shipped.txt")
    add_op(local.state, files.put, name="Ship", src=str(tree / "a.txt"), dest=dest, mode="644",
           host=local)
    add_op(local.state, files.directory, name="Folder", path=str(tree / "other"), host=local)
    announced = {(cls, kwargs["path"]) for cls, kwargs
                 in vars(local)[fact_cache._EXPECTED].values()}
    assert announced == {(File, dest), (Directory, dest), (Sha1File, dest),
                         (Directory, str(tree / "sub")), (Directory, str(tree / "other"))}


@pytest.mark.parametrize(("cls", "args", "kwargs"), [
    (pyinfra_files.File, (), {"path": "/etc/hosts"}),
    (pyinfra_files.File, ("/etc/hosts",), {}),
    (SystemdStatus, (), {"services": "sglang.service"}),
    (SystemdStatus, (), {}),
    (pyinfra_files.Sha256File, (), {"path": "/x"}),
])
def test_named_arguments_are_pyinfra_s_getcallargs(cls, args, kwargs):
    """The signature kept once a run names a reading's arguments as pyinfra's own
    ``getcallargs(cls().command, ...)`` does, defaults filled in; a call that does not fit the
    command is a TypeError, as there."""
    expected = inspect.getcallargs(cls().command, *args, **kwargs)
    expected.pop("self")
    assert fact_batch.named_arguments(cls, args, kwargs) == expected
    with pytest.raises(TypeError):
        inspect.getcallargs(cls().command, *args, nonsense=1, **kwargs)
    with pytest.raises(TypeError):
        fact_batch.named_arguments(cls, args, {**kwargs, "nonsense": 1})
