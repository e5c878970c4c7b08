"""The API key gate (the distribution's nginx, operations/stages/gate.py) end to end on one sandbox
host serving on 0.0.0.0: its unit's limits as systemd holds them, its refusals as a client on this
machine sees them, its journal as journalctl shows it, a key file's change reloading it, and a
restart or a reload of the gate alone verified by the run that made it.

Deploys through pyinfra's CLI; checks through ssh (systemctl, journalctl) and raw sockets to the
host's address, not pyinfra.
"""

from __future__ import annotations

import secrets
import socket
import time
from dataclasses import dataclass, field

import pytest

from tests.e2e import lab
from tests.e2e.test_server import changed, write_inventory

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

GATE = "sglang-gate.service"
UNIT = "sglang.service"
KEY_FILE = "/root/sglang-api.key"
LIB_DIR = "/opt/gpuhost/lib"


@dataclass
class Public:
    """A host converged with the gate in front (the key kept out of pytest's reports)."""

    host: lab.Host
    inventory: str
    key: str = field(repr=False)

    def __iter__(self):
        return iter((self.host, self.key, self.inventory))


@pytest.fixture(scope="module")
def public(tmp_path_factory):
    (host,) = lab.up_from_image(hosts=1)  # this module's deploy serves it on 0.0.0.0
    key = lab.GUARD.register("sk-" + secrets.token_hex(24), "API key")
    host.ssh(f"umask 077; printf '%s\\n' {key} > {KEY_FILE}")
    inventory = write_inventory(tmp_path_factory.mktemp("gate") / "inventory.py",
                                gpuhost_server_host="0.0.0.0", gpuhost_api_key_file=KEY_FILE)
    first = lab.deploy(inventory=inventory)
    assert first.returncode == 0, first.output[-6000:]
    yield Public(host, inventory, key)
    lab.sandbox("down", check=False)


def ask(host: lab.Host, raw: bytes, timeout: float = 10) -> bytes:
    """Send ``raw`` to the gate from this machine; the answer's head (up to its blank line)."""
    with socket.create_connection((host.address, 8000), timeout=timeout) as sock:
        sock.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    return data.partition(b"\r\n\r\n")[0]


def journal(host: lab.Host, since: float) -> str:
    return host.ssh(f"journalctl -u {GATE} --since @{since:.0f} --no-pager -o cat", check=False)


def test_the_gate_unit_is_bounded(public):
    host, _, _ = public
    show = host.ssh(f"systemctl show -p MemoryMax -p TasksMax -p ActiveState {GATE}")
    assert "MemoryMax=268435456" in show and "TasksMax=272" in show, show
    assert "ActiveState=active" in show


def test_the_gate_is_the_distributions_nginx_and_debians_unit_stays_off(public):
    """nginx from Debian's archive runs the gate; Debian's own nginx.service (its default site
    on port 80 of every address) is masked and nothing listens on port 80."""
    host, _, _ = public
    main = host.main_pid(GATE)
    assert host.ssh(f"readlink /proc/{main}/exe").strip() == "/usr/sbin/nginx"
    assert "ii  nginx " in host.ssh("dpkg -l nginx")
    assert host.ssh("systemctl is-enabled nginx.service", check=False).strip() == "masked"
    assert ":80 " not in host.ssh("ss -Hltn")


def test_refusals_as_a_client_sees_them(public):
    host, key, _ = public
    since = time.time() - 1
    began = time.monotonic()
    head = ask(host, b"POST /v1/chat/completions HTTP/1.1\r\nHost: gpu\r\n"
                     b"Content-Length: 300000000\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 401"), head
    assert time.monotonic() - began < 5  # answered before any of the body was sent
    # a key in the query string: 400 before anything else (keys in the Authorization header)
    assert ask(host, f"GET /v1/models?api_key={key} HTTP/1.1\r\nHost: gpu\r\n\r\n".encode()
               ).startswith(b"HTTP/1.1 400")
    auth = f"Authorization: Bearer {key}\r\n"
    assert ask(host, f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
                     "Content-Length: 10000000000000\r\n\r\n".encode()).startswith(b"HTTP/1.1 413")
    assert ask(host, f"POST /v1/completions HTTP/1.1\r\nHost: gpu\r\n{auth}"
                     "Content-Length: abc\r\n\r\n".encode()).startswith(b"HTTP/1.1 400")
    began = time.monotonic()
    with socket.create_connection((host.address, 8000), timeout=40) as idle:
        assert idle.recv(1) == b""  # an idle connection is closed by the gate
    assert time.monotonic() - began < 30
    assert ask(host, f"GET /v1/models HTTP/1.1\r\nHost: gpu\r\n{auth}\r\n".encode()
               ).startswith(b"HTTP/1.1 200")
    time.sleep(1)
    log = journal(host, since)
    assert '"POST /v1/chat/completions" 401' in log and '"GET /v1/models" 400' in log
    assert '"GET /v1/models" 200' in log
    assert key not in log and "api_key=" not in log and "Traceback" not in log


def answers(host: lab.Host, raw: bytes, status: bytes, within: float = 15) -> bytes:
    """The gate's answer to ``raw`` once it starts with ``status``, or the last one after
    ``within`` seconds: nginx reads the keys at a reload, which the key files' path unit starts
    when one changes (a moment after the change)."""
    end = time.monotonic() + within
    while True:
        head = ask(host, raw)
        if head.startswith(status) or time.monotonic() > end:
            return head
        time.sleep(0.5)


def test_vanished_key_file_gets_503(public):
    host, key, _ = public
    since = time.time() - 1
    auth = f"Authorization: Bearer {key}\r\n"
    request = f"GET /v1/models HTTP/1.1\r\nHost: gpu\r\n{auth}\r\n".encode()
    host.ssh(f"mv {KEY_FILE} {KEY_FILE}.away")
    try:
        assert answers(host, request, b"HTTP/1.1 503").startswith(b"HTTP/1.1 503")
    finally:
        host.ssh(f"mv {KEY_FILE}.away {KEY_FILE}")
    assert answers(host, request, b"HTTP/1.1 200").startswith(b"HTTP/1.1 200")
    time.sleep(1)
    log = journal(host, since)
    assert f"the key file {KEY_FILE} cannot be read: No such file or directory" in log
    assert "is readable again" in log and "Traceback" not in log and key not in log


def test_a_restart_of_the_gate_alone_is_verified(public):
    """The gate's program edited on the host: the run ships it again, restarts the gate alone
    and runs the health gate (which checks the gate) before it reports success."""
    host, _, inventory = public
    server_pid = host.main_pid()
    gate_pid = host.main_pid(GATE)
    host.ssh(f"echo '# edited by hand' >> {LIB_DIR}/gate_keys.py")
    run = lab.deploy("--json", inventory=inventory)
    assert run.returncode == 0, run.output[-6000:]
    names = changed(run)
    assert f"SGLang server | Restart {GATE} (its unit or program changed)" in names, names
    assert "SGLang server | Wait until glm-5 answers" in names, names
    assert f"SGLang server | Restart {UNIT} (what it reads changed)" not in names
    assert "ready after" in run.output
    assert host.main_pid() == server_pid and host.main_pid(GATE) != gate_pid
    again = lab.deploy("--json", inventory=inventory)
    assert again.returncode == 0 and changed(again) == [], changed(again)


def test_a_configuration_change_reloads_the_gate_gracefully_and_is_verified(public):
    """The gate's nginx configuration edited on the host: the run writes it back and reloads
    the gate (the same master process, new workers), and runs the health gate."""
    host, key, inventory = public
    server_pid = host.main_pid()
    gate_pid = host.main_pid(GATE)
    host.ssh("sed -i 's/client_max_body_size 32m/client_max_body_size 1k/' "
             "/etc/gpuhost/nginx/sglang-gate.conf")
    run = lab.deploy("--json", inventory=inventory)
    assert run.returncode == 0, run.output[-6000:]
    names = changed(run)
    assert f"SGLang server | Reload {GATE} (its configuration changed)" in names, names
    assert f"SGLang server | Restart {GATE} (its unit or program changed)" not in names
    assert "SGLang server | Wait until glm-5 answers" in names, names
    assert host.main_pid() == server_pid and host.main_pid(GATE) == gate_pid
    auth = f"Authorization: Bearer {key}\r\n"
    assert ask(host, f"GET /v1/models HTTP/1.1\r\nHost: gpu\r\n{auth}\r\n".encode()
               ).startswith(b"HTTP/1.1 200")
    again = lab.deploy("--json", inventory=inventory)
    assert again.returncode == 0 and changed(again) == [], changed(again)
