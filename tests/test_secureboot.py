"""Secure Boot: the MOK keys of host data (operations.plans.settings), the NVIDIA stage's decision
(operations.stages.secureboot.plan_signing), one case per branch, and DKMS's signing configuration
as DKMS reads it (a shell file sourced by bash: read_framework_conf in dkms)."""

import subprocess
from pathlib import Path

import jinja2
import pytest

from operations.plans.settings import SettingsError, from_host_data
from operations.stages.secureboot import Enrolment, SecureBootState, parse_sb_state, plan_signing

LOCK = Path(__file__).parents[1] / "locks" / "cuda12.8.txt"
TEMPLATE = Path(__file__).parents[1] / "templates" / "dkms-mok-signing.conf.j2"
KEY, CERT = "/var/lib/gpuhost/mok/MOK.priv", "/var/lib/gpuhost/mok/MOK.der"

ON = SecureBootState(True, "mokutil", "mokutil --sb-state: SecureBoot enabled")
OFF = SecureBootState(False, "mokutil", "mokutil --sb-state: SecureBoot disabled")
UNKNOWN = SecureBootState(None, "mokutil", "mokutil --sb-state: Cannot determine secure boot "
                                           "state.")
LEGACY = SecureBootState(False, "none", "no EFI: legacy boot, no Secure Boot")
ROOT_0600 = {"user": "root", "group": "root", "mode": 600, "size": 1704}
ENROLLED = Enrolment("enrolled", f"{CERT} is already enrolled")


def settings(**data):
    return from_host_data("gpu1", {"gpuhost_lock": str(LOCK), **data})


def with_keys(**data):
    return settings(gpuhost_mok_signing_key=KEY, gpuhost_mok_certificate=CERT, **data)


# --- host data -------------------------------------------------------------------------------


def test_keys_default_to_none_and_take_absolute_paths():
    assert settings().mok_signing_key is None and settings().mok_certificate is None
    s = with_keys()
    assert (s.mok_signing_key, s.mok_certificate) == (KEY, CERT)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("gpuhost_mok_signing_key", "MOK.priv", "an absolute path on the host of a MOK's private key"),
    ("gpuhost_mok_signing_key", "/var/lib/dkms/../mok.key", "no '.' or '..' part"),
    ("gpuhost_mok_signing_key", "/root/mok key", "letters, digits"),
    ("gpuhost_mok_signing_key", "pkcs11:token=x", "an absolute path"),
    ("gpuhost_mok_certificate", 7, "an absolute path on the host of the MOK's DER certificate"),
    ("gpuhost_mok_certificate", '/root/"$(reboot)"', "letters, digits"),
])
def test_bad_paths_name_key_value_and_what_is_allowed(key, value, words):
    with pytest.raises(SettingsError) as err:
        settings(**{key: value})
    text = str(err.value)
    assert f"{key} = {value!r} is not allowed" in text and words in text


@pytest.mark.parametrize(("given", "missing"), [
    ({"gpuhost_mok_signing_key": KEY}, "gpuhost_mok_certificate"),
    ({"gpuhost_mok_certificate": CERT}, "gpuhost_mok_signing_key"),
])
def test_key_and_certificate_go_together(given, missing):
    with pytest.raises(SettingsError) as err:
        settings(**given)
    assert f"{missing} = None is not allowed: a path as well" in str(err.value)


def test_key_and_certificate_are_two_files():
    with pytest.raises(SettingsError) as err:
        settings(gpuhost_mok_signing_key=KEY, gpuhost_mok_certificate=KEY)
    assert "gpuhost_mok_certificate" in str(err.value) and "two files" in str(err.value)


# --- the decision ----------------------------------------------------------------------------


def test_secure_boot_on_and_a_build_without_keys_is_refused_with_what_to_do():
    plan = plan_signing(settings(), state=ON, builds=True)
    (reason,) = plan.refusals
    assert reason.startswith("Secure Boot is enabled (mokutil --sb-state: SecureBoot enabled)")
    assert "mokutil --import" in reason and "disable Secure Boot in the firmware" in reason
    assert "gpuhost_mok_signing_key" in reason and "gpuhost_mok_certificate" in reason
    assert not plan.sign


def test_an_unknown_state_and_a_build_without_keys_is_refused():
    (reason,) = plan_signing(settings(), state=UNKNOWN, builds=True).refusals
    assert reason.startswith("whether Secure Boot is enabled cannot be told")


@pytest.mark.parametrize("state", [OFF, LEGACY])
def test_secure_boot_off_changes_nothing(state):
    plan = plan_signing(settings(), state=state, builds=True)
    assert plan.refusals == () and plan.notes == () and not plan.sign


def test_secure_boot_on_without_a_build_is_noted_not_refused():
    plan = plan_signing(settings(), state=ON, builds=False)
    assert plan.refusals == () and "not built in this run" in plan.notes[0]


def test_enrolled_key_signs():
    plan = plan_signing(with_keys(), state=ON, builds=True, key=ROOT_0600,
                        cert={"user": "root", "mode": 644}, enrolment=ENROLLED)
    assert plan.refusals == () and plan.sign
    assert "is already enrolled" in plan.notes[0]


def test_the_kernels_own_key_is_trusted():
    plan = plan_signing(with_keys(), state=ON, builds=True, key={"user": "root", "mode": 400},
                        cert={"user": "root", "mode": 644},
                        enrolment=Enrolment("built-in", "in the built-in trusted keyring"))
    assert plan.refusals == () and plan.sign


@pytest.mark.parametrize(("status", "advice"), [
    ("not-enrolled", "mokutil --import /var/lib/gpuhost/mok/MOK.der"),
    ("pending", "confirm it with the password given to mokutil --import at the console"),
    ("in-db", "not in the MOK list"),
    ("blocked", "make a new key"),
    ("not-a-certificate", "-outform DER"),
    ("unreadable", "check the path"),
    ("no-mokutil", "apt-get install mokutil"),
    ("unknown", "by hand"),
])
def test_a_certificate_not_enrolled_is_refused_with_mokutils_words(status, advice):
    said = f"{CERT} says {status}"
    plan = plan_signing(with_keys(), state=ON, builds=True, key=ROOT_0600,
                        cert={"user": "root", "mode": 644}, enrolment=Enrolment(status, said))
    (reason,) = plan.refusals
    assert "gpuhost_mok_certificate = '/var/lib/gpuhost/mok/MOK.der' is not enrolled" in reason
    assert f"(mokutil --test-key: {said})" in reason and advice in reason
    assert not plan.sign


def test_enrolment_is_checked_without_a_build_too():
    # The configuration is written on every run, for DKMS's builds at kernel upgrades.
    plan = plan_signing(with_keys(), state=ON, builds=False, key=ROOT_0600,
                        cert={"user": "root", "mode": 644},
                        enrolment=Enrolment("not-enrolled", f"{CERT} is not enrolled"))
    assert plan.refusals and not plan.sign


@pytest.mark.parametrize(("key", "why"), [
    (None, "it does not exist; DKMS would generate a new key there"),
    (False, "it is not a regular file"),
    ({"user": "root", "mode": 644}, "owned by root with mode 644): chown root:root"),
    ({"user": "gpuops", "mode": 600}, "owned by gpuops with mode 600"),
    ({"user": "root", "mode": 640}, "with mode 640"),
])
def test_the_key_must_be_a_root_only_file(key, why):
    plan = plan_signing(with_keys(), state=ON, builds=True, key=key,
                        cert={"user": "root", "mode": 644}, enrolment=ENROLLED)
    (reason,) = plan.refusals
    assert reason.startswith(f"gpuhost_mok_signing_key = {KEY!r} is not allowed: a file on the "
                             "host owned by root with mode 0600 or 0400")
    assert why in reason


@pytest.mark.parametrize("cert", [None, False])
def test_the_certificate_must_exist(cert):
    plan = plan_signing(with_keys(), state=ON, builds=True, key=ROOT_0600, cert=cert)
    (reason,) = plan.refusals
    assert reason.startswith(f"gpuhost_mok_certificate = {CERT!r} is not allowed")


def test_keys_with_secure_boot_off_sign_without_an_enrolment_check():
    plan = plan_signing(with_keys(), state=OFF, builds=True, key=ROOT_0600,
                        cert={"user": "root", "mode": 644}, enrolment=None)
    assert plan.refusals == () and plan.sign
    assert "its enrolment is not checked" in plan.notes[0]


def test_keys_with_secure_boot_off_must_still_exist():
    plan = plan_signing(with_keys(), state=LEGACY, builds=True, key=None,
                        cert={"user": "root", "mode": 644})
    assert len(plan.refusals) == 1 and not plan.sign


def test_unreadable_fact_output_is_unknown_not_off():
    state = parse_sb_state(["bash: line 1: od: command not found"])
    assert state.enabled is None and "unreadable answer" in state.said


# --- DKMS's configuration --------------------------------------------------------------------


def test_dkms_reads_the_key_and_certificate_from_the_rendered_file(tmp_path):
    text = jinja2.Template(TEMPLATE.read_text()).render(mok_signing_key=KEY,
                                                         mok_certificate=CERT)
    conf = tmp_path / "gpuhost-mok-signing.conf"
    conf.write_text(text)
    # As dkms's safe_source: the file sourced by bash, the two variables echoed.
    out = subprocess.run(["bash", "-c", f'. "{conf}" >/dev/null; '
                          'echo "$mok_signing_key"; echo "$mok_certificate"'],
                         capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [KEY, CERT]
