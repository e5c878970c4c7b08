"""What the deploy says about the server it finds, end to end on one sandbox host: a hand edit
named by its file, a unit the health gate has not passed for named by which (a gate restarted
by hand, a bind switch), a server systemd left failed named with its journal, and an API key
file that a loopback bind ignores. The host is changed and checked through ssh and systemctl,
not through pyinfra."""

from __future__ import annotations

import secrets

import pytest

from tests.e2e import lab
from tests.e2e.test_server import KEY_FILE, write_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

UNIT = "sglang.service"
GATE = "sglang-gate.service"
GUESSES = ("an earlier run changed them", "an earlier run stopped during the health gate")


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


@pytest.fixture
def deploy(tmp_path):
    counter = iter(range(1000))

    def run(**overrides) -> lab.Run:
        inventory = write_inventory(tmp_path / f"inv{next(counter)}.py", **overrides)
        return lab.deploy(inventory=inventory)
    return run


def test_a_hand_edit_is_named_by_its_file(host, deploy):
    host.ssh("echo '# edited by hand' >> /etc/gpuhost/server.env")
    run = deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert (f"{UNIT} runs with other inputs than the files now: /etc/gpuhost/server.env "
            "changed since it started: restarting it") in run.output, run.output[-6000:]
    assert not any(guess in run.output for guess in GUESSES), run.output[-6000:]
    assert "edited by hand" not in host.ssh("cat /etc/gpuhost/server.env")


def test_a_failed_server_is_named_with_its_journal(host, deploy):
    dropin = "/run/systemd/system/sglang.service.d/zz-e2e-fail.conf"
    host.ssh(f"mkdir -p {dropin.rsplit('/', 1)[0]} && printf '%s\\n' '[Service]' 'Restart=no' "
             "\"ExecStartPre=/bin/sh -c 'echo e2e-marker-start-failed; exit 1'\" > " + dropin)
    host.ssh(f"systemctl daemon-reload; systemctl restart {UNIT}", check=False)
    host.ssh(f"rm {dropin} && systemctl daemon-reload")
    assert host.ssh(f"systemctl is-active {UNIT}", check=False).strip() == "failed"
    run = deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert f"{UNIT} had failed (systemd's Result: exit-code): starting it again" in run.output, \
        run.output[-6000:]
    assert "e2e-marker-start-failed" in run.output, run.output[-6000:]
    assert host.ssh(f"systemctl is-active {UNIT}", check=False).strip() == "active"


def test_unverified_names_the_gate_restarted_and_the_bind_switch(host, deploy):
    key = lab.GUARD.register("sk-" + secrets.token_hex(24), "API key")
    host.ssh(f"umask 077; printf '%s\\n' {key} > {KEY_FILE}")
    public = {"gpuhost_server_host": "0.0.0.0", "gpuhost_api_key_file": KEY_FILE}
    first = deploy(**public)
    assert first.returncode == 0, first.output[-6000:]

    host.ssh(f"systemctl restart {GATE}")
    run = deploy(**public)
    assert run.returncode == 0, run.output[-6000:]
    assert (f"not verified as it runs now: {GATE} started since the health gate last passed"
            in run.output), run.output[-6000:]
    assert not any(guess in run.output for guess in GUESSES), run.output[-6000:]

    back = deploy(gpuhost_api_key_file=KEY_FILE)
    assert back.returncode == 0, back.output[-6000:]
    assert (f"gpuhost_api_key_file = '{KEY_FILE}' has no effect: gpuhost_server_host = "
            "'127.0.0.1' is a loopback address") in back.output, back.output[-6000:]
    assert f"the health gate last passed for {UNIT} and {GATE}" in back.output, \
        back.output[-6000:]
    assert key not in back.output
