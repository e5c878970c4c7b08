"""The sandbox's Secure Boot: the scenario's host.secure_boot and host.enrolled_mok, and the
mokutil stand-in answering from them in mokutil 0.6.0's words and exit statuses, as the
product's facts read them (operations.stages.secureboot)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from operations.stages.secureboot import parse_sb_state, parse_test_key
from sandbox import rootfs, scenarios

MOKUTIL = rootfs.SECUREBOOT_STANDIN
needs_openssl = pytest.mark.skipif(not shutil.which("openssl"), reason="needs openssl")


def test_secure_boot_defaults_off_and_the_secure_boot_scenario_has_it_on():
    assert scenarios.load("reference-lab")["host"]["secure_boot"] is False
    assert scenarios.load("reference-lab")["host"]["enrolled_mok"] == []
    secure = scenarios.load("secure-boot")
    assert secure["host"]["secure_boot"] is True and secure["host"]["enrolled_mok"] == []
    reference = scenarios.load("reference-lab")
    assert secure["gpus"] == reference["gpus"] and secure["p2p"] == reference["p2p"]


@pytest.mark.parametrize(("host", "words"), [
    ({"secure_boot": "yes"}, "host.secure_boot must be true or false, not 'yes'"),
    ({"secure_boot": 1}, "host.secure_boot must be true or false, not 1"),
    ({"enrolled_mok": "abc"}, "host.enrolled_mok must be a list of sha256 hex digests"),
    ({"enrolled_mok": ["ABC"]}, "host.enrolled_mok must be a list of sha256 hex digests"),
])
def test_a_bad_secure_boot_setting_is_named(tmp_path, monkeypatch, host, words):
    raw = json.loads((scenarios.SCENARIO_DIR / "single-gpu.json").read_text())
    raw["host"] = {**raw.get("host", {}), **host}
    (tmp_path / "broken.json").write_text(json.dumps(raw))
    monkeypatch.setattr(scenarios, "SCENARIO_DIR", tmp_path)
    with pytest.raises(scenarios.ScenarioError) as err:
        scenarios.load("broken")
    assert str(err.value).startswith("scenario 'broken': ") and words in str(err.value)


@pytest.fixture
def mokutil(tmp_path):
    """Run the stand-in against a hardware document with the given host settings."""

    def run(*args, secure_boot=False, enrolled=()):
        hardware = json.loads(scenarios.hardware_json("single-gpu"))
        hardware["host"].update(secure_boot=secure_boot, enrolled_mok=list(enrolled))
        (tmp_path / "hardware.json").write_text(json.dumps(hardware))
        env = dict(os.environ, GPUHOST_SANDBOX_HARDWARE=str(tmp_path / "hardware.json"))
        return subprocess.run([sys.executable, str(MOKUTIL), *args], capture_output=True,
                              text=True, env=env, check=False)

    return run


@pytest.fixture
def certificate(tmp_path) -> tuple[Path, str]:
    """A fresh DER certificate (as the README's openssl line makes one) and its sha256."""
    if not shutil.which("openssl"):
        pytest.skip("needs openssl")
    key, cert = tmp_path / "MOK.priv", tmp_path / "MOK.der"
    subprocess.run(["openssl", "req", "-new", "-x509", "-newkey", "rsa:2048", "-nodes",
                    "-days", "1", "-subj", "/CN=gpuhost test", "-keyout", str(key),
                    "-outform", "DER", "-out", str(cert)], check=True, capture_output=True)
    return cert, hashlib.sha256(cert.read_bytes()).hexdigest()


def facts_output(result: subprocess.CompletedProcess) -> list[str]:
    """What the product's fact command makes of a run (2>&1, then rc=N)."""
    return [*(result.stderr + result.stdout).splitlines(), f"rc={result.returncode}"]


@pytest.mark.parametrize(("on", "words"), [(True, "SecureBoot enabled"),
                                           (False, "SecureBoot disabled")])
def test_sb_state(mokutil, on, words):
    result = mokutil("--sb-state", secure_boot=on)
    assert (result.stdout, result.returncode) == (words + "\n", 0)
    assert parse_sb_state(["source=mokutil", *facts_output(result)]).enabled is on


def test_test_key_enrolled_and_not_in_mokutil_0_6s_exit_statuses(mokutil, certificate):
    cert, digest = certificate
    no = mokutil("--test-key", str(cert), secure_boot=True)
    assert (no.stdout, no.returncode) == (f"{cert} is not enrolled\n", 0)
    assert parse_test_key(facts_output(no)).status == "not-enrolled"
    yes = mokutil("--test-key", str(cert), secure_boot=True, enrolled=[digest])
    assert (yes.stdout, yes.returncode) == (f"{cert} is already enrolled\n", 1)
    assert parse_test_key(facts_output(yes)).trusted


@needs_openssl
def test_test_key_refuses_what_is_not_a_der_certificate(mokutil, tmp_path):
    pem = tmp_path / "MOK.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    result = mokutil("-t", str(pem))
    assert (result.stderr, result.returncode) == ("Not a valid x509 certificate\n", 255)
    assert parse_test_key(facts_output(result)).status == "not-a-certificate"
    missing = mokutil("--test-key", str(tmp_path / "absent.der"))
    assert (missing.stderr, missing.returncode) == (f"Failed to open {tmp_path}/absent.der\n",
                                                    255)


def test_other_options_say_they_are_not_provided(mokutil):
    result = mokutil("--import", "/root/MOK.der")
    assert result.returncode == 2 and "stand-in" in result.stderr


def test_personalise_puts_it_ahead_of_any_real_one():
    assert rootfs.SECUREBOOT_STANDIN_DEST == "usr/local/bin/mokutil"
    assert "sandbox stand-in" in MOKUTIL.read_text().splitlines()[1]
