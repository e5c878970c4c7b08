"""A secret file's --diff (operations/stages/secret_template.py): keys, never values; the file
written as files.template writes it."""

from __future__ import annotations

import logging
from io import StringIO

import pytest
from pyinfra.api import FileUploadCommand
from pyinfra.context import ctx_host, ctx_state
from pyinfra_testing.util import FakeState, create_host

from operations.stages import secret_template as mod

OLD = ["# Managed by gpuhost from host data; edit the inventory, not this file.", "",
       "HF_HUB_OFFLINE=1", "OMP_NUM_THREADS=8", "WANDB_API_KEY=old-secret-value-1234"]
TEMPLATE = ("# Managed by gpuhost from host data; edit the inventory, not this file.\n\n"
            "HF_HUB_OFFLINE=1\n{% for key, value in env | dictsort %}{{ key }}={{ value }}\n"
            "{% endfor %}")


def test_a_changed_value_is_said_as_its_key_only():
    new = ["# Managed by gpuhost from host data; edit the inventory, not this file.\n", "\n",
           "HF_HUB_OFFLINE=1\n", "OMP_NUM_THREADS=8\n", "SECOND_KEY=another-secret-5678\n",
           "WANDB_API_KEY=new-secret-value-5678\n"]
    lines = "\n".join(mod.masked_diff([line + "\n" for line in OLD], new))
    for value in ("old-secret-value-1234", "new-secret-value-5678", "another-secret-5678"):
        assert value not in lines
    assert "- WANDB_API_KEY=<hidden>" in lines
    assert "+ WANDB_API_KEY=<hidden, new value>" in lines
    assert "+ SECOND_KEY=<hidden, new value>" in lines
    assert "OMP_NUM_THREADS=<hidden>" in lines and "- OMP_NUM_THREADS" not in lines
    # a comment could hold anything: hidden whole, as unchanged
    assert "Managed by gpuhost" not in lines


def test_a_new_file_lists_its_keys():
    lines = mod.masked_diff(None, ["A_TOKEN=abcdefabcdefabcdef\n", "\n", "export B=c\n"])
    assert [line.split(" ", 1)[1] for line in lines[1:]] == [
        "A_TOKEN=<hidden, new value>", "", "B=<hidden, new value>"]


def _host(state, facts):
    host = create_host(state, facts=facts)
    host.log = lambda message, log_func: log_func(message)  # pyinfra's Host.log, unprefixed
    return host


def _run(facts: dict, diff: bool, env: dict, tmp_path):
    template = tmp_path / "server.env.j2"
    template.write_text(TEMPLATE)
    state = FakeState()
    state.config.DIFF = diff
    host = _host(state, facts)
    with ctx_state.use(state), ctx_host.use(host):
        commands = list(mod._secret_template._inner(src=str(template),
                                                    dest="/etc/gpuhost/server.env", env=env))
    return state, commands


FACTS = {
    "files.File": {"path=/etc/gpuhost/server.env": {"mode": 600, "user": "root",
                                                     "group": "root"}},
    "files.Sha1File": {"path=/etc/gpuhost/server.env": "0" * 40},
    "files.FileContents": {"path=/etc/gpuhost/server.env": OLD},
    "files.Directory": {"path=/etc/gpuhost/server.env": None, "path=/etc/gpuhost": {
        "mode": 755}},
}


@pytest.mark.parametrize("diff", [True, False])
def test_the_file_is_written_as_files_template_writes_it(tmp_path, caplog, diff):
    caplog.set_level(logging.INFO)
    env = {"OMP_NUM_THREADS": "8", "WANDB_API_KEY": "new-secret-value-5678"}
    state, commands = _run(FACTS, diff, env, tmp_path)
    upload = next(c for c in commands if isinstance(c, FileUploadCommand))
    upload.src.seek(0)
    assert upload.src.read().endswith("WANDB_API_KEY=new-secret-value-5678\n")
    assert state.config.DIFF is diff  # pyinfra's own diff was off only inside
    said = caplog.text
    assert "old-secret-value-1234" not in said and "new-secret-value-5678" not in said
    if diff:
        assert "- WANDB_API_KEY=<hidden>" in said
        assert "+ WANDB_API_KEY=<hidden, new value>" in said
    else:
        assert "WANDB_API_KEY" not in said


def test_pyinfras_own_diff_would_show_the_values(tmp_path, caplog):
    """The check above can fail: files.template's own --diff prints both values."""
    caplog.set_level(logging.INFO)
    template = tmp_path / "server.env.j2"
    template.write_text(TEMPLATE)
    state = FakeState()
    state.config.DIFF = True
    host = _host(state, FACTS)
    from pyinfra.operations import files
    with ctx_state.use(state), ctx_host.use(host):
        list(files.template._inner(src=str(template), dest="/etc/gpuhost/server.env",
                                   env={"WANDB_API_KEY": "new-secret-value-5678"}))
    assert "old-secret-value-1234" in caplog.text and "new-secret-value-5678" in caplog.text


def test_nothing_to_change_says_nothing(tmp_path, caplog):
    import hashlib
    caplog.set_level(logging.INFO)
    env = {"OMP_NUM_THREADS": "8", "WANDB_API_KEY": "old-secret-value-1234"}
    rendered = "\n".join(OLD) + "\n"
    facts = {**FACTS, "files.Sha1File": {"path=/etc/gpuhost/server.env": hashlib.sha1(
        rendered.encode()).hexdigest()}}
    _, commands = _run(facts, True, env, tmp_path)
    assert commands == []
    assert "WANDB_API_KEY" not in caplog.text


def test_a_key_file_is_said_while_another_hosts_holds_the_diff_off(tmp_path, caplog):
    """Hosts run in parallel: while one host's secret file holds pyinfra's diff off (a fact read
    inside it switches greenlets), another host's key file was written without its --diff line
    (host.pem on the second host of a fleet, lab 6)."""
    caplog.set_level(logging.INFO)
    state = FakeState()
    state.config.DIFF = True
    facts = {"files.File": {"path=/etc/gpuhost/tls/host.pem": None},
             "files.Directory": {"path=/etc/gpuhost/tls/host.pem": None,
                                 "path=/etc/gpuhost/tls": {"mode": 755}}}
    host = _host(state, facts)
    from io import StringIO
    with ctx_state.use(state), ctx_host.use(host):
        with mod._diff_off():  # another host, inside its own secret file
            commands = list(mod.put_hidden(StringIO("-----BEGIN PRIVATE KEY-----\nk\n"),
                                           "/etc/gpuhost/tls/host.pem"))
    assert any(isinstance(c, FileUploadCommand) for c in commands)
    assert "Will write /etc/gpuhost/tls/host.pem (contents hidden" in caplog.text
    assert "BEGIN PRIVATE KEY" not in caplog.text and state.config.DIFF is True
