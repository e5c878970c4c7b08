"""A fleet CA rotation with overlap (issue 40 finding 5; operations/plans/ca_rotation.py): a trust
bundle in ``gpuhost_tls_ca_cert_file`` (operations/plans/fleet_ca.py), what the hosts get of it, and
the warning's decision for a CA changed in one step. CAs are made with the openssl command
docs/security.md gives (tests/test_tls.py make_ca); certificates are checked with openssl's own
``verify`` and Python's ``ssl``."""

from __future__ import annotations

import datetime
import os
import ssl
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from operations.plans import ca_rotation
from operations.stages import tls
from tests.test_tls import MAKE_CA, fleet_host

NOW = datetime.datetime.now(datetime.timezone.utc)
NAMES = ("10.0.0.11", "127.0.0.1")


def make_ca(folder: Path, cn: str) -> tuple[str, str]:
    """docs/security.md's openssl command, with the CN ``cn``."""
    cert, key = folder / f"{cn}.crt", folder / f"{cn}.key"
    argv = [*MAKE_CA, "-keyout", str(key), "-out", str(cert)]
    argv[argv.index("-subj") + 1] = f"/CN={cn}"
    subprocess.run(argv, check=True, capture_output=True)
    return str(cert), str(key)


def bundle(folder: Path, *certs: str, name: str = "bundle.crt") -> str:
    path = folder / name
    path.write_text("".join(Path(c).read_text() for c in certs))
    return str(path)


def ca_ending(folder: Path, cn: str, days_left: float) -> tuple[str, str]:
    """A self-signed CA (as the docs' openssl command makes) that ends ``days_left`` days from
    now (negative: expired)."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])
    cert = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(NOW - datetime.timedelta(days=3000))
            .not_valid_after(NOW + datetime.timedelta(days=days_left))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                         False), critical=True)
            .sign(key, hashes.SHA256()))
    cert_file, key_file = folder / f"{cn}.crt", folder / f"{cn}.key"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_file, 0o600)
    return str(cert_file), str(key_file)


@pytest.fixture(scope="module")
def cas(tmp_path_factory):
    folder = tmp_path_factory.mktemp("rotation")
    return folder, make_ca(folder, "old"), make_ca(folder, "new")


def _cert(pem: str) -> str:
    return pem.partition("-----END PRIVATE KEY-----\n")[2]


def test_a_bundle_loads_its_signer_is_the_keys_and_the_hosts_trust_both(cas):
    folder, old, new = cas
    both = bundle(folder, old[0], new[0])
    step1, step2 = tls.load_ca(both, old[1]), tls.load_ca(both, new[1])
    assert step1.cert == tls.load_ca(*old).cert and step2.cert == tls.load_ca(*new).cert
    assert step1.bundle == step2.bundle and len(step1.bundle) == 2
    # what the hosts' trust file gets (tls.CA_PATH): both certificates, in the file's order
    assert step1.bundle_pem == Path(both).read_text()
    # without a key (the hosts bring their own certificates): the first verifies and signs none
    assert tls.load_ca(both, None).cert == step1.cert
    # a single CA is as before: its own certificate alone
    assert tls.load_ca(*old).bundle_pem == Path(old[0]).read_text()


def test_clients_of_the_bundle_verify_certificates_of_either_ca(cas, tmp_path):
    """OpenSSL's -CAfile (nginx, curl) and Python's cafile (the health gate, the bench, the
    tests' clients) read every certificate of the bundle: a host's certificate of the old CA
    and one of the new both verify with it, each with its own CA alone."""
    folder, old, new = cas
    both = bundle(folder, old[0], new[0])
    for ca_files in (old, new):
        pem = _cert(tls.issue(tls.load_ca(*ca_files), "gpu1", NAMES))
        host = tmp_path / "host.crt"
        host.write_text(pem)
        for trusted in (both, ca_files[0]):
            done = subprocess.run(["openssl", "verify", "-CAfile", trusted, "-purpose",
                                   "sslserver", str(host)], capture_output=True, text=True)
            assert done.returncode == 0, (ca_files, trusted, done.stderr)
        other = new if ca_files == old else old
        done = subprocess.run(["openssl", "verify", "-CAfile", other[0], str(host)],
                              capture_output=True, text=True)
        assert done.returncode != 0
    context = ssl.create_default_context(cafile=both)
    assert len(context.get_ca_certs()) == 2


@pytest.mark.parametrize("case, expected", [
    ("a key of neither", "gpuhost_tls_ca_key_file = '{key}' is not allowed: the private key of "
                         "one of the 2 certificates of gpuhost_tls_ca_cert_file ({cert}: "
                         "CN=old, CN=new); it is another's"),
    ("an expired old CA", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: CAs valid now "
                          "(certificate 1 of 2, CN=gone): this one expired on "),
    ("a signer expiring", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a CA valid for "
                          "more than 30 days (the signing one, CN=ending); this one expires on "),
    ("a host certificate", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a CA's "
                           "certificate (basicConstraints CA:TRUE) (certificate 2 of 2, "
                           "CN=gpu1); this one is not a CA's"),
    ("the same CA twice", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: each CA's "
                          "certificate once (certificate 2 of 2, CN=old): this one is there "
                          "twice"),
])
def test_a_bundle_clients_could_not_use_is_refused_naming_the_certificate(cas, tmp_path, case,
                                                                          expected):
    folder, old, new = cas
    key = new[1]
    if case == "a key of neither":
        cert, key = bundle(tmp_path, old[0], new[0]), make_ca(tmp_path, "third")[1]
    elif case == "an expired old CA":
        cert = bundle(tmp_path, ca_ending(tmp_path, "gone", -1)[0], new[0])
    elif case == "a signer expiring":
        ending = ca_ending(tmp_path, "ending", 10)
        cert, key = bundle(tmp_path, old[0], ending[0]), ending[1]
    elif case == "a host certificate":
        host = tmp_path / "gpu1.crt"
        host.write_text(_cert(tls.issue(tls.load_ca(*old), "gpu1", NAMES)))
        cert = bundle(tmp_path, new[0], str(host))
    else:
        cert = bundle(tmp_path, old[0], old[0])
        key = old[1]
    with pytest.raises(tls.TlsError) as caught:
        tls.load_ca(cert, key)
    assert str(caught.value).startswith(expected.format(cert=cert, key=key)), str(caught.value)


def test_an_old_ca_near_its_end_is_taken_beside_a_new_signer(cas, tmp_path):
    """The old CA expiring within 30 days is why one rotates: it stays trusted beside the new
    one, which signs (alone it is refused, as before)."""
    _, _, new = cas
    ending = ca_ending(tmp_path, "ending", 10)
    ca = tls.load_ca(bundle(tmp_path, ending[0], new[0]), new[1])
    assert ca.cert == tls.load_ca(*new).cert and len(ca.bundle) == 2
    with pytest.raises(tls.TlsError, match="a CA valid for more than 30 days; this one expires"):
        tls.load_ca(*ending)


def test_the_one_step_gap_is_the_clients_without_the_new_signer(cas):
    folder, old, new = cas
    old_ca, new_ca = tls.load_ca(*old), tls.load_ca(*new)
    both = Path(bundle(folder, old[0], new[0])).read_text()
    from_old = _cert(tls.issue(old_ca, "gpu2", NAMES))
    from_new = _cert(tls.issue(new_ca, "gpu2", NAMES))
    only_old, only_new = old_ca.cert_pem, new_ca.cert_pem
    gap = ca_rotation.one_step_gap
    # one step: the hosts trust the old CA alone, the new one signs: both clients named
    assert gap(new_ca.cert, from_old, {"gpu1": only_old, "gpu2": only_old}) == ("gpu1", "gpu2")
    # the router's trust file lagging (its last run failed) while gpu2's holds the bundle
    assert gap(new_ca.cert, from_old, {"gpu1": only_old, "gpu2": both}) == ("gpu1",)
    # step 2 of a rotation: every client trusts the bundle already
    assert gap(new_ca.cert, from_old, {"gpu1": both, "gpu2": both}) == ()
    # step 1 (the bundle, the old CA still signing) and step 3 (the old CA dropped): no
    # certificate issued by another CA than the one it has
    assert gap(old_ca.cert, from_old, {"gpu1": only_old}) == ()
    assert gap(new_ca.cert, from_new, {"gpu1": both, "gpu2": only_new}) == ()
    # a fresh host (no certificate, no trust file) loses nothing; nor one without a trust file
    assert gap(new_ca.cert, None, {"gpu1": only_old}) == ()
    assert gap(new_ca.cert, from_old, {"gpu1": None, "gpu2": only_old}) == ("gpu2",)
    assert gap(new_ca.cert, "garbage\n", {"gpu1": only_old}) == ()


def test_the_clients_of_a_host_are_itself_and_the_routers_it_serves_behind():
    routers = {"gpu1": ["gpu1", "gpu2", "gpu3"], "router2": ["gpu3"]}
    assert ca_rotation.clients_of("gpu2", routers) == ("gpu2", "gpu1")
    assert ca_rotation.clients_of("gpu3", routers) == ("gpu3", "gpu1", "router2")
    assert ca_rotation.clients_of("gpu1", routers) == ("gpu1",)
    assert ca_rotation.clients_of("alone", {}) == ("alone",)


def test_the_warning_names_the_hosts_the_ca_and_what_to_do(cas):
    _, _, new = cas
    line = ca_rotation.warning("gpu2", tls.load_ca(*new), ("gpu1", "gpu2"))
    assert line.startswith("TLS: warning: the fleet CA changes in one step: gpu2's certificate "
                           "is issued again by CN=new, which the trust file "
                           "(/etc/gpuhost/tls/fleet-ca.crt) of gpu1, gpu2 does not hold yet"), line
    for said in ("gpuhost_tls_ca_cert_file", "gpuhost_tls_ca_key_file", "Rotate the fleet CA"):
        assert said in line, said
    assert "PRIVATE KEY" not in line


def test_a_hosts_own_certificate_of_either_ca_of_the_bundle_is_taken(cas):
    folder, old, new = cas
    ca = tls.load_ca(bundle(folder, old[0], new[0]), None)
    s = fleet_host(gpuhost_tls_cert_file="/etc/ssl/gpu1.crt",
                   gpuhost_tls_key_file="/etc/ssl/gpu1.key")
    for ca_files in (old, new):
        pem = _cert(tls.issue(tls.load_ca(*ca_files), "gpu1", NAMES))
        assert tls.chain_problem(s, pem, ca) is None, ca_files
    third = make_ca(folder, "third")
    pem = _cert(tls.issue(tls.load_ca(*third), "gpu1", NAMES))
    assert "this one is issued by CN=third" in tls.chain_problem(s, pem, ca)


def test_the_routers_unit_names_every_trusted_ca_so_a_bundle_change_restarts_smg(cas):
    from operations.stages import router
    folder, old, new = cas
    s = fleet_host()
    single = router.unit_context(s, tls.load_ca(*old))["ca_note"]
    assert single == (f"smg verifies its workers with the fleet CA (SHA-256 "
                      f"{tls.fingerprint(tls.load_ca(*old).cert_pem)}), read at its start: a new "
                      "CA restarts it")
    both = router.unit_context(s, tls.load_ca(bundle(folder, old[0], new[0]), old[1]))["ca_note"]
    assert both.startswith("smg verifies its workers with the fleet CAs (SHA-256 ")
    for ca_files in (old, new):
        assert tls.fingerprint(tls.load_ca(*ca_files).cert_pem) in both
    # step 2 changes the signer alone: the unit stays as it was, smg is not restarted
    assert router.unit_context(s, tls.load_ca(bundle(folder, old[0], new[0]), new[1]))[
        "ca_note"] == both
