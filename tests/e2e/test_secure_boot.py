"""Secure Boot end to end on one sandbox host of the secure-boot scenario (the reference lab with
Secure Boot on, no MOK enrolled): a deploy without a signing key is refused before any change;
with a key and certificate made on the host and enrolled, the deploy goes through, DKMS's
configuration names them and the module DKMS signed with them loads; with Secure Boot turned
off, the deploy needs no key. Every check is made with ssh as root, never through pyinfra."""

import json
import shlex

import pytest

from tests.e2e import lab
from tests.e2e.test_driver import checksum, loaded_driver, serves

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MOK_DIR = "/var/lib/gpuhost/mok"
KEY, CERT = f"{MOK_DIR}/MOK.priv", f"{MOK_DIR}/MOK.der"
CONF = "/etc/dkms/framework.conf.d/gpuhost-mok-signing.conf"
KEYS = ("--data", f"gpuhost_mok_signing_key={KEY}", "--data", f"gpuhost_mok_certificate={CERT}")


@pytest.fixture(scope="module")
def secure_host():
    (host,) = lab.up(hosts=1, scenario="secure-boot")
    yield host
    lab.sandbox("down", check=False)


def set_firmware(host: lab.Host, **changes) -> None:
    """Change the scenario's host section on the host, as the firmware's setup or its console
    (MokManager) would: Secure Boot on or off, the MOK list."""
    script = ("import json, sys; p = '/etc/gpuhost-sandbox/hardware.json'; d = json.load(open(p)); "
              "d['host'].update(json.loads(sys.argv[1])); json.dump(d, open(p, 'w'), indent=2)")
    host.ssh(f"python3 -c {shlex.quote(script)} {shlex.quote(json.dumps(changes))}")


def no_nvidia(host: lab.Host) -> bool:
    # LC_ALL=C: the host's locale is German.
    packages = host.ssh("LC_ALL=C dpkg-query -W nvidia-open nvidia-kernel-open-dkms 2>&1; true")
    source = host.ssh("test -e /etc/apt/sources.list.d/cuda-debian12-x86_64.list; echo $?")
    return packages.count("no packages found") == 2 and source.strip() == "1"


def test_without_a_key_the_driver_is_refused_and_nothing_changes(secure_host):
    host = secure_host
    assert host.ssh("mokutil --sb-state") == "SecureBoot enabled\n"
    before = checksum(host)

    dry = lab.deploy("--dry")
    assert "Secure Boot enabled (mokutil --sb-state: SecureBoot enabled)" in dry.output
    assert "refused: Secure Boot is enabled" in dry.output, dry.output[-6000:]
    assert dry.returncode != 0  # a CI job gating on --dry sees the refusal

    run = lab.deploy()
    assert run.returncode != 0, run.output[-6000:]
    assert "nothing was changed" in run.output
    assert "Secure Boot is enabled (mokutil --sb-state: SecureBoot enabled)" in run.output
    for advice in ("mokutil --import", "gpuhost_mok_signing_key", "gpuhost_mok_certificate",
                   "disable Secure Boot in the firmware"):
        assert advice in run.output, advice
    assert "Traceback" not in run.output
    assert checksum(host) == before
    assert no_nvidia(host)


def test_an_enrolled_key_signs_the_module_and_it_loads(secure_host):
    host = secure_host
    host.ssh(f"mkdir -p {MOK_DIR} && cd {MOK_DIR} && openssl req -new -x509 -newkey rsa:2048 "
             "-nodes -days 36500 -subj '/CN=gpuhost e2e module signing' -keyout MOK.priv "
             "-outform DER -out MOK.der 2>/dev/null && chmod 0600 MOK.priv")
    before = checksum(host)

    # Named but not enrolled yet: refused with mokutil's words, nothing changed.
    pending = lab.deploy(*KEYS)
    assert pending.returncode != 0, pending.output[-6000:]
    assert f"(mokutil --test-key: {CERT} is not enrolled)" in pending.output
    assert f"mokutil --import {CERT}" in pending.output
    assert checksum(host) == before and no_nvidia(host)

    # Enrolled at the console.
    digest = host.ssh(f"sha256sum {CERT}").split()[0]
    set_firmware(host, enrolled_mok=[digest])
    assert host.ssh(f"mokutil --test-key {CERT}; true") == f"{CERT} is already enrolled\n"

    run = lab.deploy(*KEYS)
    assert run.returncode == 0, run.output[-6000:]
    assert "is already enrolled" in run.output
    # DKMS reads its configuration by sourcing it (read_framework_conf): so does this check.
    named = host.ssh("bash -c 'for i in /etc/dkms/framework.conf "
                     "/etc/dkms/framework.conf.d/*.conf; do [ -e \"$i\" ] && . \"$i\"; done; "
                     "echo \"$mok_signing_key $mok_certificate\"'")
    assert named.split() == [KEY, CERT]
    assert host.ssh(f"stat -c '%U %a' {CONF}").split() == ["root", "644"]
    # The module was signed with the enrolled certificate, so it loaded after the reboot.
    assert host.ssh("cat /var/lib/nvidia-sandbox/modules/$(uname -r)/signer").strip() == digest
    assert loaded_driver(host).startswith("580.")
    assert serves(host)


def test_with_secure_boot_off_no_key_is_needed(secure_host):
    host = secure_host
    set_firmware(host, secure_boot=False)
    run = lab.deploy()
    assert run.returncode == 0, run.output[-6000:]
    assert "Secure Boot off (mokutil --sb-state: SecureBoot disabled)" in run.output
    assert ": refused: " not in run.output
    # Host data names no key any more: gpuhost's DKMS configuration goes, the driver stays.
    assert host.ssh(f"test -e {CONF}; echo $?").strip() == "1"
    assert loaded_driver(host).startswith("580.")
    assert serves(host)
