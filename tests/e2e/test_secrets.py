"""Secrets and the deploy lock against a local attacker (issue 29, findings 5 and 6), on one
converged host: ``--dry --diff`` shows a secret file's keys, never its values; no file another
user can read holds a hash of server.env; a deploy lock path that is a symbolic link is refused,
and its target is not made. Checked over plain ssh, as root or as ``nobody``."""

from __future__ import annotations

import hashlib
import os
import secrets
import subprocess

import pytest

from tests.e2e import lab
from tests.e2e.test_server import write_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ENV_FILE = "/etc/gpuhost/server.env"


@pytest.fixture(scope="module")
def host(converged_host):
    return converged_host


def test_a_deploy_lock_path_that_is_a_symlink_is_refused_and_not_followed(host):
    """/run/gpuhost/deploy.lock -> /etc/x: the run is refused, saying why; /etc/x is not made."""
    host.ssh("rm -f /etc/x /run/gpuhost/deploy.lock && mkdir -p /run/gpuhost "
             "&& ln -s /etc/x /run/gpuhost/deploy.lock")
    try:
        run = lab.deploy("--dry")
        assert run.returncode != 0, run.output[-6000:]
        assert ("the host cannot hold the deploy lock: /run/gpuhost/deploy.lock is a symbolic "
                "link (to /etc/x), not a plain file") in run.output, run.output[-6000:]
        assert host.ssh("test -e /etc/x && echo made || echo absent").strip() == "absent"
    finally:
        host.ssh("rm -f /run/gpuhost/deploy.lock /etc/x")
    again = lab.deploy("--dry")
    assert again.returncode == 0, again.output[-6000:]


def test_no_file_another_user_reads_holds_a_hash_of_server_env(host):
    """A local user (``nobody``) finds server.env's SHA-256 (nor SHA-1, nor MD5) in no file it
    can read: a guessed secret could be checked offline against one."""
    # as an earlier gpuhost left it: the next run makes it root's alone, changing nothing else
    host.ssh("chmod 644 /var/lib/gpuhost/last-known-good.json")
    run = lab.deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert "Last known good record: root's alone" in run.output, run.output[-6000:]
    data = host.ssh(f"cat {ENV_FILE}").encode()
    digests = [hashlib.sha256(data).hexdigest(), hashlib.sha1(data).hexdigest(),
               hashlib.md5(data).hexdigest()]
    # the converge recorded the last known good, with server.env's sha256 in it
    assert digests[0] in host.ssh("cat /var/lib/gpuhost/last-known-good.json")
    found = host.ssh("runuser -u nobody -- grep -rlsF " + " ".join(f"-e {d}" for d in digests)
                     + " /etc /opt /var /run /tmp /home /srv /root || true").split()
    assert found == []
    assert host.ssh("stat -c '%a %U' /var/lib/gpuhost/last-known-good.json").strip() == \
        "600 root"


def test_dry_diff_shows_the_keys_of_server_env_never_its_values(host, tmp_path):
    old = lab.GUARD.register("wandb-" + secrets.token_hex(20), "W&B API key")
    new = lab.GUARD.register("wandb-" + secrets.token_hex(20), "W&B API key")
    host.ssh(f"umask 077; printf 'WANDB_API_KEY=%s\\n' {old} >> {ENV_FILE}")
    # as an operator reads a plan: without -y, so that pyinfra's change detection runs the
    # operations (and prints their --diff) before it stops (--dry)
    inventory = write_inventory(tmp_path / "inventory.py",
                                gpuhost_server_env={"WANDB_API_KEY": new})
    done = subprocess.run([str(lab.PYINFRA), "--dry", "--diff", inventory, "deploy.py"],
                          cwd=lab.ROOT, text=True, capture_output=True, check=False,
                          env={**os.environ, "PYTHONUNBUFFERED": "1"})
    run = lab.Run(done.returncode, done.stdout + done.stderr, None)
    lab.GUARD.observe("pyinfra --dry --diff", run.output)
    assert run.returncode == 0, run.output[-6000:]
    assert old not in run.output and new not in run.output
    assert f"Will modify {ENV_FILE} (values hidden: it holds secrets)" in run.output, \
        run.output[-6000:]
    assert "WANDB_API_KEY=<hidden, new value>" in run.output
    # the dry run changed nothing
    assert old in host.ssh(f"cat {ENV_FILE}")
    host.ssh(f"sed -i '/^WANDB_API_KEY=/d' {ENV_FILE}")
