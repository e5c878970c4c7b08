"""NVIDIA's repository added by hand before the first deploy, on a fresh sandbox host: an entry
whose signed-by differs from gpuhost's (a .list line, then a deb822 .sources stanza) is refused
by --dry and by a real run while planning, naming the file and the line, with nothing on the
host changed (apt's configuration, keyrings, lists and dpkg -l compared over ssh); with
gpuhost_cuda_repo_adopt the entry is used as NVIDIA's repository and gpuhost writes none of its
own, and apt reads its sources. The run's output is in English on the German host.

The lab's outside is behind an HTTP proxy there (tinyproxy from Debian, on the host's link): a
dead one named only in the host's /etc/environment fails the first download, naming the URL and
the proxy; with gpuhost_proxy the whole converge (Debian's packages, NVIDIA's repository, the
package index, the Hub) goes through the live one: its log has each, and the stand-ins' own logs
no request straight from the host. The controller's wheel cache is kept, as on a lab: the index
is asked only what it lacks."""

import json
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sandbox import layout, services
from tests.e2e import lab

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MANUAL = "/etc/apt/sources.list.d/cuda-manual.list"
DEB822 = "/etc/apt/sources.list.d/cuda-manual.sources"
MANUAL_KEYRING = "/etc/apt/keyrings/cuda-manual.gpg"
OWN = "/etc/apt/sources.list.d/cuda-debian12-x86_64.list"
OWN_KEYRING = "/usr/share/keyrings/cuda-archive-keyring.gpg"

#: What must not change in a refused run: apt's configuration and keyrings (names, modes, link
#: targets, contents), its lists, and the installed packages.
APT_STATE = (
    "find /etc/apt /usr/share/keyrings -xdev \\( -type f -o -type l \\) -printf '%p %m %l\\n' "
    "| sort; find /etc/apt /usr/share/keyrings -xdev -type f -print0 | sort -z "
    "| xargs -0 sha256sum; ls -la /var/lib/apt/lists; dpkg -l"
)


def repo_url() -> str:
    (listed,) = json.loads(lab.sandbox("status", "--json").stdout)
    return f"{listed['cuda_repo_url']}/debian12/x86_64/"


#: The lab's proxy to the outside, beside the sandbox's own (which lets Debian's mirror alone).
PROXY_PORT = 3128
SANDBOX_APT_PROXY = "/etc/apt/apt.conf.d/80sandbox-proxy"


@pytest.fixture(scope="module")
def fresh_host():
    (host,) = lab.up(hosts=1, scenario="single-gpu")
    yield host
    lab.sandbox("down", check=False)


@pytest.fixture(scope="module")
def outside_proxy(fresh_host):
    """tinyproxy on the host's link (sandbox.services' configuration on another port), to
    Debian's mirror and the stand-ins' address; its log, one line per request."""
    spec = layout.host_from_name(fresh_host.name)
    work = layout.SERVICES_DIR / "outside-proxy"  # where tinyproxy's user reads, as the lab's
    work.mkdir(parents=True, exist_ok=True)
    (work / "filter").write_text(f"^deb\\.debian\\.org$\n^{spec.gateway.replace('.', '[.]')}$\n")
    conf = work / "tinyproxy.conf"
    conf.write_text(services.PROXY_CONF_TEMPLATE.format(
        gateway=spec.gateway, port=PROXY_PORT, subnet=spec.subnet, filter=work / "filter",
        pidfile=work / "tinyproxy.pid"))
    log = work / "tinyproxy.log"
    with log.open("w") as out:
        proc = subprocess.Popen(["tinyproxy", "-d", "-c", str(conf)], stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                socket.create_connection((spec.gateway, PROXY_PORT), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
        yield f"http://{spec.gateway}:{PROXY_PORT}", log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def refused_alike(run: lab.Run, where: str) -> None:
    assert run.returncode != 0, run.output[-6000:]
    assert f"is already listed in {where}" in run.output, run.output[-6000:]
    assert "gpuhost_cuda_repo_adopt = True" in run.output
    assert "remove that line" in run.output


def test_an_entry_added_by_hand_is_refused_before_any_change(fresh_host):
    host, url = fresh_host, repo_url()
    line = f"deb [signed-by={MANUAL_KEYRING}] {url} /"
    host.ssh(f"echo '{line}' > {MANUAL}")
    before = host.ssh(APT_STATE)

    dry = lab.deploy("--dry")
    refused_alike(dry, f"{MANUAL} line 1: {line}")
    assert host.ssh(APT_STATE) == before

    run = lab.deploy()
    refused_alike(run, f"{MANUAL} line 1: {line}")
    assert "nothing was changed" in run.output
    assert host.ssh(APT_STATE) == before
    assert host.ssh(f"test -e {OWN} || echo absent").strip() == "absent"

    # The same entry in deb822 style, a comment and another stanza before it.
    host.ssh(f"rm {MANUAL} && printf '%s\\n' '# added by hand' 'Types: deb' "
             "'URIs: http://deb.debian.org/debian' 'Suites: bookworm' 'Components: contrib' "
             "'Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg' '' 'Types: deb' "
             f"'URIs: {url}' 'Suites: /' 'Signed-By: {MANUAL_KEYRING}' > {DEB822}")
    before = host.ssh(APT_STATE)
    dry = lab.deploy("--dry")
    refused_alike(dry, f"{DEB822} line 9: URIs: {url}")
    run = lab.deploy()
    refused_alike(run, f"{DEB822} line 9: URIs: {url}")
    assert host.ssh(APT_STATE) == before
    # Every message of the run in English on the German host (LC_ALL=C throughout).
    for german in ("Fehler", "Paketlisten", "konnte nicht", "Konflikt"):
        assert german not in dry.output + run.output


def test_a_dead_proxy_of_etc_environment_is_named_with_the_download(fresh_host):
    host, url = fresh_host, repo_url()
    host.ssh(f"rm -f {DEB822} {MANUAL}")
    dead = f"http://{layout.host_from_name(host.name).gateway}:9"
    host.ssh(f"cp /etc/environment /etc/environment.e2e && printf '%s\\n' "
             f"'http_proxy=\"{dead}\"' 'export HTTPS_PROXY={dead}' >> /etc/environment")
    try:
        run = lab.deploy()
    finally:
        # the host as fresh again for the next test: its apt lists (read by the run's update
        # for the download tools) gone, so the adopted entry's are not taken as missing
        host.ssh("mv /etc/environment.e2e /etc/environment && find /var/lib/apt/lists "
                 "-maxdepth 1 -type f ! -name lock -delete")
    assert run.returncode != 0, run.output[-6000:]
    assert (f"the download of {url}cuda-archive-keyring.gpg through the proxy {dead} failed "
            "(exit status 7)") in run.output, run.output[-6000:]


def new_lines(path: Path, offset: int) -> list[str]:
    with path.open(errors="replace") as f:
        f.seek(offset)
        return f.read().splitlines()


def test_an_entry_adopted_with_host_data_is_used_as_nvidias_repository(fresh_host, outside_proxy):
    host, url = fresh_host, repo_url()
    # The operator's entry and its keyring, as NVIDIA's manual setup would leave them: the
    # keyring readable by apt's own user (_apt verifies signatures; under the sandbox's root
    # umask 077 a keyring of mode 0600 reads as NO_PUBKEY)
    host.ssh(f"rm -f {DEB822} {MANUAL} && mkdir -p /etc/apt/keyrings && python3 -c "
             f"\"import urllib.request; open('{MANUAL_KEYRING}', 'wb').write(urllib.request."
             f"urlopen('{url}cuda-archive-keyring.gpg').read())\" && "
             f"chmod 644 {MANUAL_KEYRING} && "
             f"echo 'deb [signed-by={MANUAL_KEYRING}] {url} /' > {MANUAL} && chmod 644 {MANUAL}")
    # the outside through the lab's proxy alone: apt without the sandbox's own proxy; the
    # controller's wheel cache kept (flash-attn's built wheel from it, not a build), so the
    # index is asked only what the cache lacks: the room check's sizes of the rest (flash-attn's
    # sdist at least, never cached: its built wheel is) and the download of any missing wheel
    proxy, log = outside_proxy
    gateway = layout.host_from_name(host.name).gateway
    host.ssh(f"rm -f {SANDBOX_APT_PROXY}")
    data = ["--data", "gpuhost_cuda_repo_adopt=true", "--data", f"gpuhost_proxy={proxy}"]
    dry = lab.deploy("--dry", *data)
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"NVIDIA's repository is used as listed in {MANUAL} line 1" in dry.output

    httpd, hub = layout.SERVICES_DIR / "httpd.log", layout.SERVICES_DIR / "hub.log"
    offsets = {p: p.stat().st_size for p in (httpd, hub)}
    run = lab.deploy(*data)
    assert run.returncode == 0, run.output[-6000:]
    requests = [line for line in log.read_text(errors="replace").splitlines()
                if "Request (file descriptor" in line]
    for seen in ("GET http://deb.debian.org/", f"GET http://{gateway}:8080/compute/cuda/repos/",
                 f"GET http://{gateway}:8080/simple/", f"GET http://{gateway}:8090/api/models/"):
        assert any(seen in line for line in requests), (seen, requests[-20:])
    # nothing straight from the host: each stand-in names its client first (hub) or second
    direct = [line for line in new_lines(httpd, offsets[httpd])
              if line.split()[1:2] == [host.address]]
    direct += [line for line in new_lines(hub, offsets[hub]) if line.split()[:1] == [host.address]]
    assert direct == [], direct[:10]
    assert host.ssh(f"test -e {OWN} || echo absent").strip() == "absent"
    assert host.ssh(f"test -e {OWN_KEYRING} || echo absent").strip() == "absent"
    update = host.ssh(f"http_proxy={proxy} apt-get update 2>&1; echo rc=$?")
    assert "rc=0" in update and "Conflicting" not in update and "multiple times" not in update
    assert host.ssh("dpkg-query -W -f='${Version}' nvidia-kernel-open-dkms").startswith("580.")

    again = lab.deploy(*data)
    assert again.returncode == 0, again.output[-6000:]
    assert host.ssh(f"test -e {OWN} || echo absent").strip() == "absent"
