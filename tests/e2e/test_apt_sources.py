"""NVIDIA's repository added by hand before the first deploy, on a fresh sandbox host: an entry
whose signed-by differs from gpuhost's (a .list line, then a deb822 .sources stanza) is refused
by --dry and by a real run while planning, naming the file and the line, with nothing on the
host changed (apt's configuration, keyrings, lists and dpkg -l compared over ssh); with
gpuhost_cuda_repo_adopt the entry is used as NVIDIA's repository and gpuhost writes none of its
own, and apt reads its sources. The run's output is in English on the German host."""

import json

import pytest

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


@pytest.fixture(scope="module")
def fresh_host():
    (host,) = lab.up(hosts=1, scenario="single-gpu")
    yield host
    lab.sandbox("down", check=False)


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


def test_an_entry_adopted_with_host_data_is_used_as_nvidias_repository(fresh_host):
    host, url = fresh_host, repo_url()
    # The operator's entry and its keyring, as NVIDIA's manual setup would leave them: the
    # keyring readable by apt's own user (_apt verifies signatures; under the sandbox's root
    # umask 077 a keyring of mode 0600 reads as NO_PUBKEY)
    host.ssh(f"rm -f {DEB822} {MANUAL} && mkdir -p /etc/apt/keyrings && python3 -c "
             f"\"import urllib.request; open('{MANUAL_KEYRING}', 'wb').write(urllib.request."
             f"urlopen('{url}cuda-archive-keyring.gpg').read())\" && "
             f"chmod 644 {MANUAL_KEYRING} && "
             f"echo 'deb [signed-by={MANUAL_KEYRING}] {url} /' > {MANUAL} && chmod 644 {MANUAL}")
    dry = lab.deploy("--dry", "--data", "gpuhost_cuda_repo_adopt=true")
    assert dry.returncode == 0, dry.output[-6000:]
    assert f"NVIDIA's repository is used as listed in {MANUAL} line 1" in dry.output

    run = lab.deploy("--data", "gpuhost_cuda_repo_adopt=true")
    assert run.returncode == 0, run.output[-6000:]
    assert host.ssh(f"test -e {OWN} || echo absent").strip() == "absent"
    assert host.ssh(f"test -e {OWN_KEYRING} || echo absent").strip() == "absent"
    update = host.ssh("apt-get update 2>&1; echo rc=$?")
    assert "rc=0" in update and "Conflicting" not in update and "multiple times" not in update
    assert host.ssh("dpkg-query -W -f='${Version}' nvidia-kernel-open-dkms").startswith("580.")

    again = lab.deploy("--data", "gpuhost_cuda_repo_adopt=true")
    assert again.returncode == 0, again.output[-6000:]
    assert host.ssh(f"test -e {OWN} || echo absent").strip() == "absent"
