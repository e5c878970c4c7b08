"""Commands of the deploy's own callbacks (operations/runtime/remote.py): a lost connection in one
line, the run's environment."""

from __future__ import annotations

import gevent
from paramiko import SSHException
from pyinfra.api import Config
from pyinfra.api.arguments import generate_env
from pyinfra.api.exceptions import OperationError
from pyinfra.context import ctx_config

import pytest

from operations.runtime import remote


class FakeHost:
    name = "gpu1"

    def __init__(self, answers=()):
        self.said: list[str] = []
        self.connected = True
        self.answers = list(answers)
        self.connector = self

    # pyinfra's Host
    def log_styled(self, message, fg=None, log_func=None):
        self.said.append(message)

    def run_shell_command(self, command, **kwargs):
        answer = self.answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        if answer == "hang":
            gevent.sleep(5)
        return answer, None

    # its connector
    client = None

    def disconnect(self):
        pass


def test_a_lost_connection_is_one_line_and_fails_the_host(monkeypatch):
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {})

    @remote.callback("the flash-attn build", "a build goes on on the host")
    def poll(state, host):
        remote.shell(host, "systemctl show x")

    host = FakeHost([SSHException("SSH session not active")])
    assert poll(None, host) is False
    assert host.said == ["connection to gpu1 lost during the flash-attn build (SSH session not "
                         "active): run again; a build goes on on the host"]
    assert host.connected is False


def test_no_answer_and_no_answer_to_true_is_a_lost_connection(monkeypatch):
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {})
    monkeypatch.setattr(remote, "PROBE_TIMEOUT_S", 0.2)
    host = FakeHost(["hang", "hang"])
    try:
        remote.shell(host, "cat /proc/loadavg", timeout=0.2)
    except remote.ConnectionLost as exc:
        assert "no answer for 0 s" in str(exc)
    else:
        raise AssertionError("no ConnectionLost")


def test_a_slow_command_on_a_live_link_is_not_a_lost_connection(monkeypatch):
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {})
    host = FakeHost(["hang", True])
    try:
        remote.shell(host, "sleep 100", timeout=0.2)
    except remote.ConnectionLost:
        raise AssertionError("a live link counted as lost") from None
    except OperationError as exc:
        assert "did not finish within 0 s" in str(exc)


def test_a_refusal_is_its_message():
    @remote.callback("the GPU binding check")
    def check(state, host):
        raise OperationError("GPUs not bound to nvidia: 0000:01:00.0 (nouveau)")

    host = FakeHost()
    assert check(None, host) is False
    assert host.said == ["the GPU binding check: GPUs not bound to nvidia: 0000:01:00.0 "
                         "(nouveau)"]
    assert host.connected is True


def test_every_command_of_the_run_is_in_the_c_locale():
    run_config = Config(ENV={"HTTP_PROXY": "http://proxy:3128"})
    with ctx_config.use(run_config):
        remote.use_run_env()
    env = generate_env(run_config, {"EXTRA": "1"})  # what pyinfra gives each command's _env
    assert env == {"HTTP_PROXY": "http://proxy:3128", "LC_ALL": "C", "EXTRA": "1"}


def test_a_failed_callback_ends_with_what_it_did_not_executed_0_commands(tmp_path):
    """A rolled-back change ended with pyinfra's "Error: executed 0 commands" (a callback
    counts as one command, done only when it succeeds): it ends with what it did."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    deploy = tmp_path / "rolled_back.py"
    deploy.write_text(
        f"import sys\nsys.path.insert(0, {str(root)!r})\n"
        "from pyinfra.api import FunctionCommand, operation\n"
        "from operations.runtime import remote\n"
        "def undo(state, host):\n"
        "    remote.ending(host, 'the change was rolled back: it serves the last known good')\n"
        "    return False\n"
        "@operation(is_idempotent=False)\n"
        "def changed_then_rolled_back():\n"
        "    yield FunctionCommand(undo, (), {})\n"
        "changed_then_rolled_back(name='Change and roll back')\n")
    pyinfra = Path(sys.executable).with_name("pyinfra")
    run = subprocess.run([str(pyinfra), "-y", "@local", str(deploy)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120, check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 1, out
    assert "Error: the change was rolled back: it serves the last known good" in out, out
    assert "executed 0 commands" not in out


def test_a_rollback_says_what_it_did_at_the_operations_end(monkeypatch):
    from pyinfra.connectors.util import CommandOutput, OutputLine

    from operations.stages import last_known_good

    def shell(host, command, **_):
        return True, CommandOutput([OutputLine("stdout", "rolled back to the unit of 09:12")])

    monkeypatch.setattr(last_known_good.remote, "shell", shell)
    monkeypatch.setattr(remote, "_endings", {})
    host = FakeHost()
    host.print_prefix = "[gpu1] "
    assert last_known_good.roll_back(host, "the server failed", lambda: True, "restart") is False
    assert remote._endings["gpu1"].startswith(
        "this run's server change was rolled back: the server serves the last known good again "
        "(the unit of 09:12), verified")


def test_callbacks_at_execution_time_are_in_the_c_locale():
    """pyinfra loads deploy.py under a per-host copy of the run's config (without its ENV) and
    executes under the run's own: a callback's command (apt-get update) got the host's locale
    (a German apt error, seen on the sandbox) until both had RUN_ENV."""
    from pyinfra.api import Inventory, State
    from pyinfra.context import ctx_state

    inventory = Inventory((["gpu1"], {}))
    run_state = State(inventory, Config())
    gpu1 = inventory.get_host("gpu1")
    with ctx_state.use(run_state), ctx_config.use(run_state.config):
        with ctx_config.use(run_state.config.copy()):  # loading deploy.py, as pyinfra_cli does
            remote.use_run_env()
        # executing: the callbacks' commands
        assert remote.connector_arguments(gpu1)["_env"] == {"LC_ALL": "C"}
        assert generate_env(run_state.config, None) == {"LC_ALL": "C"}


def test_host_data_env_adds_to_the_c_locale():
    from pyinfra.api import Inventory, State
    from pyinfra.context import ctx_state

    inventory = Inventory(([("gpu1", {"_env": {"HTTP_PROXY": "http://proxy:3128"}})], {}))
    run_state = State(inventory, Config())
    gpu1 = inventory.get_host("gpu1")
    with ctx_state.use(run_state), ctx_config.use(run_state.config):
        assert remote.connector_arguments(gpu1)["_env"] == {
            "LC_ALL": "C", "HTTP_PROXY": "http://proxy:3128"}


def test_a_file_fetched_through_sudo_is_read_from_a_copy_of_mode_0644(monkeypatch):
    """pyinfra's get_file makes its sudo copy readable with `chmod +r`, which root's umask 077
    turns into u+r: the login's SFTP read failed with Errno 13 on the hardened sandbox hosts.
    gpuhost copies the file itself, mode 0644, reads that copy without sudo and removes it."""
    from pyinfra.connectors.util import CommandOutput, OutputLine

    ran, fetched = [], []
    monkeypatch.setattr(remote, "connector_arguments",
                        lambda host: {"_sudo": True, "_sudo_user": None, "_env": {"LC_ALL": "C"}})

    def shell(host, command, **_):
        ran.append(str(command))
        return True, CommandOutput([OutputLine("stdout", "/tmp/gpuhost-get.Ab12Cd")])

    monkeypatch.setattr(remote, "shell", shell)
    host = FakeHost()
    host.get_file = lambda src, dest, **kw: fetched.append((src, dest, kw)) or True
    remote.get(host, "/opt/gpuhost/build/flash-attn/wheels/x.whl", "/tmp/local.whl")
    assert ran[0] == ('t=$(mktemp /tmp/gpuhost-get.XXXXXX) && cp '
                      '/opt/gpuhost/build/flash-attn/wheels/x.whl "$t" && chmod 0644 "$t" '
                      '&& echo "$t"')
    assert fetched == [("/tmp/gpuhost-get.Ab12Cd", "/tmp/local.whl", {"_env": {"LC_ALL": "C"}})]
    assert ran[-1] == "rm -f /tmp/gpuhost-get.Ab12Cd"

    monkeypatch.setattr(remote, "connector_arguments", lambda host: {"_env": {"LC_ALL": "C"}})
    ran.clear()
    fetched.clear()
    remote.get(host, "/var/lib/x.json", "/tmp/x.json")
    assert ran == [] and fetched == [("/var/lib/x.json", "/tmp/x.json", {"_env": {"LC_ALL": "C"}})]


def test_a_command_ended_by_a_closed_link_is_a_lost_connection(monkeypatch):
    """The link watch (operations/runtime/link.py) may close the transport under a running command,
    which then ends not ok and without a word: that is a lost connection, not a failed command
    (seen under load: "watching the build failed:" with nothing after it)."""
    from pyinfra.connectors.util import CommandOutput

    class Transport:
        active = True

        def is_active(self):
            return self.active

    class Client:
        transport = Transport()

        def get_transport(self):
            return self.transport

    host = FakeHost()
    host.client = Client()
    host.run_shell_command = lambda command, **kw: (False, CommandOutput([]))
    monkeypatch.setattr(remote, "connector_arguments", lambda host: {})
    ok, _out = remote.shell(host, "systemctl show x")
    assert ok is False  # the link is up: a failed command
    Client.transport.active = False
    with pytest.raises(remote.ConnectionLost):
        remote.shell(host, "systemctl show x")
