"""The fleet CA and the hosts' certificates (operations/stages/tls.py), and where TLS reaches: the
gates' nginx configuration, smg's unit, the fleet's worker URLs, Prometheus' targets. The CA is
made with the openssl command docs/security.md gives; certificates are checked with openssl's
own ``verify``."""

from __future__ import annotations

import datetime
import ipaddress
import os
import subprocess
from pathlib import Path

import pytest

from operations.plans.settings import for_inventory
from operations.stages import tls

MAKE_CA = ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
           "-noenc", "-days", "3650", "-subj", "/CN=gpuhost fleet CA",
           "-addext", "basicConstraints=critical,CA:TRUE",
           "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
NOW = datetime.datetime.now(datetime.timezone.utc)


def make_ca(folder: Path, name: str = "ca", days: int = 3650,
            extra: tuple[str, ...] = ()) -> tuple[str, str]:
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    argv = [*MAKE_CA, "-keyout", str(key), "-out", str(cert), *extra]
    argv[argv.index("-days") + 1] = str(days)
    subprocess.run(argv, check=True, capture_output=True)
    return str(cert), str(key)


@pytest.fixture(scope="module")
def ca_files(tmp_path_factory):
    return make_ca(tmp_path_factory.mktemp("ca"))


def fleet_host(**data):
    base = {"gpuhost_fleet_address": "10.0.0.11", "gpuhost_server_host": "0.0.0.0",
            "gpuhost_api_key_file": "/root/k", "gpuhost_tls_ca_cert_file": "/ca.crt",
            "gpuhost_tls_ca_key_file": "/ca.key"}
    return for_inventory([("gpu1", {**base, **data})])["gpu1"]


def test_the_docs_ca_loads_and_its_certificates_verify_with_openssl(ca_files, tmp_path):
    ca = tls.load_ca(*ca_files)
    names = tls.subject_names("gpu1", fleet_host(gpuhost_tls_names=["gpu1.lab.example"]))
    assert names == ("10.0.0.11", "127.0.0.1", "::1", "gpu1", "gpu1.lab.example", "localhost")
    pem = tls.issue(ca, "gpu1", names)
    assert pem.startswith("-----BEGIN PRIVATE KEY-----") and pem.count("BEGIN CERTIFICATE") == 1
    (tmp_path / "host.pem").write_text(pem)
    verified = subprocess.run(["openssl", "verify", "-CAfile", ca_files[0], "-purpose",
                               "sslserver", str(tmp_path / "host.pem")],
                              capture_output=True, text=True)
    assert verified.returncode == 0, verified.stderr
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "host.pem"), "-noout",
                           "-text"], capture_output=True, text=True, check=True).stdout
    assert "IP Address:10.0.0.11" in text and "DNS:gpu1.lab.example" in text
    assert "CA:FALSE" in text and "TLS Web Server Authentication" in text
    # the key is the certificate's (nginx reads both from the one file)
    key_pub = subprocess.run(["openssl", "pkey", "-in", str(tmp_path / "host.pem"), "-pubout"],
                             capture_output=True, text=True, check=True).stdout
    cert_pub = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "host.pem"), "-noout",
                               "-pubkey"], capture_output=True, text=True, check=True).stdout
    assert key_pub == cert_pub


def test_a_certificate_is_issued_again_only_for_a_reason(ca_files, tmp_path):
    ca = tls.load_ca(*ca_files)
    names = tls.subject_names("gpu1", fleet_host())
    pem = tls.issue(ca, "gpu1", names)
    cert = pem[pem.index("-----BEGIN CERTIFICATE-----"):]
    assert tls.reason_to_issue(cert, ca, names) is None
    assert tls.reason_to_issue(None, ca, names) == "the host has no certificate yet"
    assert tls.reason_to_issue("junk", ca, names) == "the host's certificate does not parse"
    other = tls.load_ca(*make_ca(tmp_path, "other"))
    assert tls.reason_to_issue(tls.issue(other, "gpu1", names).partition(
        "-----END PRIVATE KEY-----\n")[2], ca, names) == \
        "the host's certificate was not issued by this fleet CA"
    moved = tls.subject_names("gpu1", fleet_host(gpuhost_fleet_address="10.0.0.12"))
    assert tls.reason_to_issue(cert, ca, moved).startswith(
        "the host's certificate names 10.0.0.11, 127.0.0.1")
    # 30 days before it expires (certbot's renew_before_expiry), not 31
    expires = NOW + datetime.timedelta(days=tls.VALID_DAYS)
    assert tls.reason_to_issue(cert, ca, names, expires - datetime.timedelta(days=31)) is None
    assert "within 30 days" in tls.reason_to_issue(cert, ca, names,
                                                   expires - datetime.timedelta(days=29))


def test_a_certificate_outlives_neither_its_ca_nor_starts_after_the_host_clock(tmp_path):
    ca = tls.load_ca(*make_ca(tmp_path, "short", days=100))
    # now, not NOW: the module's import can be minutes before this test in a full suite run
    now = datetime.datetime.now(datetime.timezone.utc)
    pem = tls.issue(ca, "gpu1", ("127.0.0.1",), now=now)
    from cryptography import x509
    cert = x509.load_pem_x509_certificate(pem.partition("-----END PRIVATE KEY-----\n")[2].encode())
    assert cert.not_valid_after_utc <= ca.cert.not_valid_after_utc
    assert cert.not_valid_before_utc <= now - datetime.timedelta(minutes=4)


@pytest.mark.parametrize("case, expected", [
    ("missing", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a readable file on the "
                "controller (No such file or directory)"),
    ("not pem", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a PEM certificate"),
    ("not a ca", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a CA's certificate"),
    ("expiring", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a CA valid for more than "
                 "30 days; this one expires on"),
    ("readable key", "gpuhost_tls_ca_key_file = '{key}' is not allowed: a file only its owner "
                     "may read or write (its mode is 0644; chmod 600 it)"),
    ("encrypted key", "gpuhost_tls_ca_key_file = '{key}' is not allowed: an unencrypted PEM "
                      "private key"),
    ("another's key", "gpuhost_tls_ca_key_file = '{key}' is not allowed: the private key of "
                      "gpuhost_tls_ca_cert_file's certificate"),
])
def test_a_ca_that_cannot_issue_is_refused_naming_the_key_and_value(tmp_path, case, expected):
    cert, key = make_ca(tmp_path, days=20 if case == "expiring" else 3650)
    if case == "missing":
        cert = str(tmp_path / "nowhere.crt")
    elif case == "not pem":
        Path(cert).write_text("hello\n")
    elif case == "not a ca":
        cert, key = str(tmp_path / "leaf.crt"), str(tmp_path / "leaf.key")
        subprocess.run([*MAKE_CA[:MAKE_CA.index("-addext")], "-addext",
                        "basicConstraints=critical,CA:FALSE", "-keyout", key, "-out", cert],
                       check=True, capture_output=True)
    elif case == "readable key":
        os.chmod(key, 0o644)
    elif case == "encrypted key":
        subprocess.run(["openssl", "pkey", "-in", key, "-out", key + ".enc", "-aes256",
                        "-passout", "pass:x"], check=True)
        os.replace(key + ".enc", key)
        os.chmod(key, 0o600)
    elif case == "another's key":
        _, key = make_ca(tmp_path, "other")
    with pytest.raises(tls.TlsError) as caught:
        tls.load_ca(cert, key)
    assert str(caught.value).startswith(expected.format(cert=cert, key=key)), str(caught.value)


def test_a_bad_ca_ends_the_run_before_any_host_naming_each_host(tmp_path):
    cert, key = make_ca(tmp_path)
    os.chmod(key, 0o640)
    settings = {name: fleet_host(gpuhost_tls_ca_cert_file=cert, gpuhost_tls_ca_key_file=key)
                for name in ("gpu1", "gpu2")}
    with pytest.raises(SystemExit) as ended:
        tls.for_run(settings)
    text = str(ended.value)
    assert "gpuhost: the fleet CA refused, no host was touched:" in text
    assert f"hosts gpu1, gpu2: gpuhost_tls_ca_key_file = '{key}' is not allowed" in text
    assert "Traceback" not in text


def test_the_fact_reads_the_certificate_never_the_key():
    command = tls.HostCertificate.command()
    assert "BEGIN CERTIFICATE" in command and "sed -n" in command
    assert tls.HostCertificate.process([]) is None
    assert tls.HostCertificate.process(["-----BEGIN CERTIFICATE-----", "x",
                                        "-----END CERTIFICATE-----"]).endswith("-----\n")


def test_only_hosts_with_a_public_endpoint_need_a_certificate():
    assert tls.needs_tls(fleet_host())
    assert not tls.needs_tls(fleet_host(gpuhost_server_host="127.0.0.1"))
    assert tls.needs_tls(fleet_host(gpuhost_server_host="127.0.0.1",
                                    gpuhost_router_host="10.0.0.11",
                                    gpuhost_router_api_key_file="/root/r"))
    assert not tls.needs_tls(fleet_host(gpuhost_tls_ca_cert_file=None,
                                        gpuhost_tls_ca_key_file=None))


def test_tls_reaches_the_gate_the_router_and_the_workers_urls():
    from operations.stages import fleet, gate, observability, router, server_health, server_unit
    s = fleet_host(gpuhost_router_host="10.0.0.11", gpuhost_router_api_key_file="/root/r",
                   gpuhost_fleet_key_file="/root/f")
    conf = gate.conf_context(server_unit.worker_gate(s))
    assert conf["tls_cert"] == conf["tls_key"] == tls.HOST_PEM
    from jinja2 import Environment, FileSystemLoader
    rendered = Environment(loader=FileSystemLoader("templates")).get_template(
        "gate-nginx.conf.j2").render(**conf)
    assert "listen 0.0.0.0:8000 ssl;" in rendered
    assert f"ssl_certificate {tls.HOST_PEM};" in rendered
    assert "ssl_protocols TLSv1.2 TLSv1.3;" in rendered and "error_page 497 @plain_http;" in rendered
    assert router.router_gate(s).tls_cert == tls.HOST_PEM
    assert router.unit_context(s)["ca_args"] == f" --ca-cert-paths {tls.CA_PATH}"
    assert server_unit.public_url(s) == "https://127.0.0.1:8000"
    assert "--ca-file" in server_health.settings_gate_argv(s)
    # the path unit reloads the gate when the certificate changes
    assert f"{tls.HOST_PEM}" in gate.path_context(server_unit.worker_gate(s), str)["key_files"]
    url, problem = fleet.worker_url("gpu2", s, "gpu9")
    assert (url, problem) == ("https://10.0.0.11:8000", None)
    plain = fleet_host(gpuhost_tls_ca_cert_file=None, gpuhost_tls_ca_key_file=None)
    assert fleet.worker_url("gpu2", plain, "gpu9")[0] == "http://10.0.0.11:8000"
    assert "ssl" not in gate.Gate.__dataclass_fields__ and \
        " ssl;" not in Environment(loader=FileSystemLoader("templates")).get_template(
            "gate-nginx.conf.j2").render(**gate.conf_context(server_unit.worker_gate(plain)))
    assert observability.prometheus_context("gpu1", s)["ca_file"] == tls.CA_PATH


def test_a_router_and_its_workers_name_one_ca():
    from operations.stages import fleet
    router = fleet_host(gpuhost_serving=False, gpuhost_router_host="10.0.0.10",
                        gpuhost_fleet_address="10.0.0.10", gpuhost_router_api_key_file="/r",
                        gpuhost_fleet_key_file="/f")
    worker = fleet_host(gpuhost_tls_ca_cert_file="/other.crt", gpuhost_fleet_key_file="/f")
    with pytest.raises(fleet.FleetError) as caught:
        fleet.plan([("r", ["gpuhost_router"]), ("gpu1", [])], {"r": router, "gpu1": worker})
    assert caught.value.problems == [
        "host gpu1: gpuhost_tls_ca_cert_file = '/other.crt' is not allowed: '/ca.crt', as on "
        "router host r, whose router verifies this host's certificate with it (one fleet CA "
        "for a router and its workers)"]


@pytest.mark.parametrize("data, words", [
    ({"gpuhost_tls_ca_cert_file": "/ca.crt", "gpuhost_server_host": "0.0.0.0",
      "gpuhost_api_key_file": "/k"}, "gpuhost_tls_ca_key_file = None is not allowed: a path, or "
                                     "gpuhost_tls_cert_file and gpuhost_tls_key_file"),
    ({"gpuhost_tls_cert_file": "/c.pem"}, "gpuhost_tls_key_file = None is not allowed"),
    ({"gpuhost_tls_cert_file": "/c.pem", "gpuhost_tls_key_file": "/k.pem"},
     "gpuhost_tls_ca_cert_file = None is not allowed: a path, since gpuhost_tls_cert_file"),
    ({"gpuhost_tls_ca_key_file": "/ca.key"}, "gpuhost_tls_ca_cert_file = None is not allowed"),
    ({"gpuhost_tls_ca_cert_file": "/c", "gpuhost_tls_ca_key_file": "/c"},
     "gpuhost_tls_ca_key_file = '/c' is not allowed: a file other than"),
    ({"gpuhost_tls_names": ["*.lab"], "gpuhost_tls_ca_cert_file": "/c",
      "gpuhost_tls_ca_key_file": "/k"}, "gpuhost_tls_names = ['*.lab'] is not allowed: a list"),
    ({"gpuhost_tls_names": ["gpu1.lab"]}, "gpuhost_tls_names = ['gpu1.lab'] is not allowed: "
                                          "[] without gpuhost_tls_ca_cert_file"),
    ({"gpuhost_tls_ca_cert_file": "ca.crt", "gpuhost_tls_ca_key_file": "/k"},
     "gpuhost_tls_ca_cert_file = 'ca.crt' is not allowed: an absolute path on the controller"),
])
def test_tls_host_data_is_refused_naming_key_and_value(data, words):
    from operations.plans.settings import SettingsError
    with pytest.raises(SettingsError) as caught:
        for_inventory([("gpu1", data)])
    assert any(words in p for p in caught.value.problems), caught.value.problems


def test_a_hosts_own_certificate_is_checked_while_planning(ca_files, tmp_path):
    ca = tls.load_ca(*ca_files)
    s = fleet_host(gpuhost_tls_ca_key_file=None, gpuhost_tls_cert_file="/etc/ssl/gpu1.pem",
                   gpuhost_tls_key_file="/etc/ssl/private/gpu1.key")
    assert tls.gate_files(s, True) == {"tls_cert": "/etc/ssl/gpu1.pem",
                                       "tls_key": "/etc/ssl/private/gpu1.key"}
    assert tls.gate_files(s, False) == {"tls_cert": None, "tls_key": None}
    pem = tls.issue(ca, "gpu1", ("10.0.0.11",))
    cert = pem.partition("-----END PRIVATE KEY-----\n")[2]
    root_only = {"user": "root", "mode": "600"}
    assert tls.given_problem(s, cert, root_only) is None
    assert tls.given_problem(s, cert, None).endswith("a root-only file on the host (there is none)")
    assert "(mode 0600, owner root; it is 644, owner root)" in tls.given_problem(
        s, cert, {"user": "root", "mode": "644"})
    assert "a PEM certificate on the host" in tls.given_problem(s, None, root_only)
    elsewhere = tls.issue(ca, "gpu1", ("10.9.9.9",)).partition("-----END PRIVATE KEY-----\n")[2]
    assert tls.given_problem(s, elsewhere, root_only) == (
        "gpuhost_tls_cert_file = '/etc/ssl/gpu1.pem' is not allowed: a certificate naming the "
        "fleet address 10.0.0.11, at which the router and Prometheus verify it (it names "
        "10.9.9.9)")
    later = NOW + datetime.timedelta(days=400)
    assert "it expired on" in tls.given_problem(s, cert, root_only, later)
    # the CA's certificate alone is enough to verify with; issuing needs its key
    verifier = tls.load_ca(ca_files[0], None)
    assert verifier.key is None
    with pytest.raises(tls.TlsError):
        tls.issue(verifier, "gpu1", ("10.0.0.11",))


def test_an_ipv6_address_written_long_is_the_certificates_short_one(ca_files):
    ca = tls.load_ca(*ca_files)
    s = fleet_host(gpuhost_fleet_address="fd00:0:0::11", gpuhost_server_host="::",
                   gpuhost_tls_names=["FD00:0::12"])
    names = tls.subject_names("gpu1", s)
    assert "fd00::11" in names and "fd00::12" in names
    cert = tls.issue(ca, "gpu1", names).partition("-----END PRIVATE KEY-----\n")[2]
    assert tls.reason_to_issue(cert, ca, names) is None  # no new certificate every run


def _ca_made_in_python(folder: Path, name: str, key, days_from: float = -1.0,
                       ski: bytes | None = None) -> tuple[str, str]:
    """A self-signed CA (basicConstraints CA:TRUE, keyUsage keyCertSign) that openssl's req
    cannot make here: a notBefore in the future (OpenSSL 3.0 has no -not_before), a
    subjectKeyIdentifier of another method than SHA-1 of the key (``ski``: Go 1.25's truncated
    SHA-256), with its authorityKeyIdentifier the same, as a CA's own should be."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.x509.oid import NameOID
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    builder = (x509.CertificateBuilder().subject_name(subject).issuer_name(subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(NOW + datetime.timedelta(days=days_from))
               .not_valid_after(NOW + datetime.timedelta(days=3650))
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False,
                                            False), critical=True))
    if ski is not None:
        builder = builder.add_extension(x509.SubjectKeyIdentifier(ski), critical=False) \
            .add_extension(x509.AuthorityKeyIdentifier(ski, None, None), critical=False)
    cert, key_file = folder / f"{name}.crt", folder / f"{name}.key"
    cert.write_bytes(builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    os.chmod(key_file, 0o600)
    return str(cert), str(key_file)


def _openssl_ca(folder: Path, name: str, newkey: list[str], usage: str = "keyCertSign,cRLSign"):
    cert, key = folder / f"{name}.crt", folder / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", *newkey, "-noenc", "-days", "3650",
                    "-subj", f"/CN={name}", "-addext", "basicConstraints=critical,CA:TRUE",
                    "-addext", f"keyUsage=critical,{usage}", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True)
    os.chmod(key, 0o600)
    return str(cert), str(key)


@pytest.mark.parametrize("case, expected", [
    ("rsa 1024", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: an RSA key of at least "
                 "2048 bits; this one has 1024"),
    ("secp256k1", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: an ECDSA key on P-256 or "
                  "P-384; this one is on secp256k1"),
    ("rsa-pss", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: an RSA (PKCS#1), ECDSA "
                "P-256 or P-384, or Ed25519 CA; this one's key is RSA-PSS"),
    ("no keyCertSign", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a CA whose keyUsage "
                       "includes keyCertSign; this one's does not"),
    ("not yet valid", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a CA already valid; "
                      "this one starts on "),
    ("one certificate twice", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: each CA's "
                              "certificate once (certificate 2 of 2, CN=gpuhost fleet CA): this "
                              "one is there twice"),
    ("not self-signed", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a root CA's "
                        "certificate, self-signed (the hosts trust this file alone); this one is "
                        "issued by CN=root"),
    ("a directory", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a regular file on the "
                    "controller (this is a directory)"),
    ("a device", "gpuhost_tls_ca_key_file = '{key}' is not allowed: a regular file on the "
                 "controller (this is a character device)"),
    ("huge", "gpuhost_tls_ca_cert_file = '{cert}' is not allowed: a PEM file of at most 1048576 "
             "bytes (this one has 2097152)"),
])
def test_a_ca_whose_certificates_clients_would_refuse_is_refused(tmp_path, case, expected):
    """Each of these CAs loaded and issued before, and curl and Python's ssl then refused the
    hosts' certificates (or, /dev/zero as the file, the run read until it ran out of memory)."""
    if case == "rsa 1024":
        cert, key = _openssl_ca(tmp_path, "ca", ["-newkey", "rsa:1024"])
    elif case == "secp256k1":
        cert, key = _openssl_ca(tmp_path, "ca", ["-newkey", "ec", "-pkeyopt",
                                                 "ec_paramgen_curve:secp256k1"])
    elif case == "rsa-pss":
        key = str(tmp_path / "ca.key")
        subprocess.run(["openssl", "genpkey", "-algorithm", "RSA-PSS", "-out", key], check=True,
                       capture_output=True)
        os.chmod(key, 0o600)
        cert, _ = _openssl_ca(tmp_path, "ca", ["-key", key])
    elif case == "no keyCertSign":
        cert, key = _openssl_ca(tmp_path, "ca", ["-newkey", "ec", "-pkeyopt",
                                                 "ec_paramgen_curve:P-256"], "digitalSignature")
    elif case == "not yet valid":
        from cryptography.hazmat.primitives.asymmetric import ec
        cert, key = _ca_made_in_python(tmp_path, "ca", ec.generate_private_key(ec.SECP256R1()),
                                       days_from=2)
    elif case == "one certificate twice":
        cert, key = make_ca(tmp_path)
        Path(cert).write_text(Path(cert).read_text() * 2)
    elif case == "not self-signed":  # an intermediate CA, signed by a root
        root_cert, root_key = _openssl_ca(tmp_path, "root", ["-newkey", "ec", "-pkeyopt",
                                                             "ec_paramgen_curve:P-256"])
        cert, key = str(tmp_path / "mid.crt"), str(tmp_path / "mid.key")
        subprocess.run([*MAKE_CA[:MAKE_CA.index("-subj")], "-subj", "/CN=mid", "-CA", root_cert,
                        "-CAkey", root_key, *MAKE_CA[MAKE_CA.index("-subj") + 2:], "-keyout", key,
                        "-out", cert], check=True, capture_output=True)
        os.chmod(key, 0o600)
    elif case == "a directory":
        _, key = make_ca(tmp_path)
        cert = str(tmp_path)
    elif case == "a device":
        cert, _ = make_ca(tmp_path)
        key = "/dev/zero"
    elif case == "huge":
        cert, key = make_ca(tmp_path)
        with open(cert, "ab") as f:
            f.truncate(2 << 20)
    with pytest.raises(tls.TlsError) as caught:
        tls.load_ca(cert, key)
    assert str(caught.value).startswith(expected.format(cert=cert, key=key)), str(caught.value)


@pytest.mark.parametrize("kind", ["rsa:2048", "ed25519", "P-384", "go-ski"])
def test_every_ca_that_loads_issues_certificates_openssl_verifies(tmp_path, kind):
    """RSA, Ed25519 and P-384 CAs issue certificates OpenSSL verifies; so does a CA whose
    subjectKeyIdentifier is not SHA-1 of its key (Go 1.25's method): the host's certificate
    names the CA's own identifier (before: "unable to get local issuer certificate")."""
    import hashlib
    from cryptography.hazmat.primitives.asymmetric import ec
    if kind == "go-ski":
        key = ec.generate_private_key(ec.SECP256R1())
        from cryptography.hazmat.primitives import serialization
        spki = key.public_key().public_bytes(serialization.Encoding.DER,
                                             serialization.PublicFormat.SubjectPublicKeyInfo)
        cert, key_file = _ca_made_in_python(tmp_path, "ca", key,
                                            ski=hashlib.sha256(spki).digest()[:20])
    elif kind == "P-384":
        cert, key_file = _openssl_ca(tmp_path, "ca", ["-newkey", "ec", "-pkeyopt",
                                                      "ec_paramgen_curve:P-384"])
    else:
        cert, key_file = _openssl_ca(tmp_path, "ca", ["-newkey", kind])
    pem = tls.issue(tls.load_ca(cert, key_file), "gpu1", ("127.0.0.1",))
    (tmp_path / "host.pem").write_text(pem)
    verified = subprocess.run(["openssl", "verify", "-CAfile", cert, "-purpose", "sslserver",
                               str(tmp_path / "host.pem")], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    if kind == "P-384":  # the Mozilla Root Store Policy's pair
        text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "host.pem"), "-noout",
                               "-text"], capture_output=True, text=True, check=True).stdout
        assert "ecdsa-with-SHA384" in text


def test_a_name_spelt_otherwise_is_not_issued_again_at_every_run(ca_files):
    """An IPv6 address in capitals or with zeros spelt out, and a DNS name in capitals, were
    kept as host data spelt them, and the certificate gives them back compressed (RFC 5952):
    every converge found the names changed and issued the certificate again; the same address
    twice (``::1`` and ``0:0:0:0:0:0:0:1``) went in twice."""
    ca = tls.load_ca(*ca_files)
    s = fleet_host(gpuhost_fleet_address="FD00:0::11", gpuhost_server_host="FD00:0:0::11",
                   gpuhost_tls_names=["0:0:0:0:0:0:0:1", "GPU1.Lab.Example", "::FFFF:10.0.0.9"])
    names = tls.subject_names("GPU1", s)
    mapped = str(ipaddress.ip_address("::ffff:10.0.0.9"))  # '::ffff:a00:9' before Python 3.13
    assert names == tuple(sorted(("127.0.0.1", "::1", mapped, "fd00::11", "gpu1",
                                  "gpu1.lab.example", "localhost")))
    pem = tls.issue(ca, "GPU1", names)
    cert = pem.partition("-----END PRIVATE KEY-----\n")[2]
    assert tls.reason_to_issue(cert, ca, names) is None
    # a certificate given in host data, naming the fleet address: it is the same address
    given = fleet_host(gpuhost_fleet_address="FD00:0::11", gpuhost_server_host="::",
                       gpuhost_tls_ca_key_file=None, gpuhost_tls_cert_file="/etc/ssl/gpu1.pem",
                       gpuhost_tls_key_file="/etc/ssl/private/gpu1.key")
    assert tls.given_problem(given, cert, {"user": "root", "mode": "600"}) is None


def test_a_new_fleet_ca_changes_the_routers_unit(ca_files, tmp_path):
    """smg reads --ca-cert-paths once, at its start: after the CA changed (the workers' new
    certificates the new CA's), it refused every worker with "UnknownIssuer" and the converge
    waited for healthy workers in vain. The unit names the CA's fingerprint: a new CA changes
    the unit, and the router restarts (operations/stages/router.py restarts on a changed unit)."""
    from jinja2 import Environment, FileSystemLoader

    from operations.stages import router
    s = fleet_host(gpuhost_router_host="10.0.0.11", gpuhost_router_api_key_file="/root/r",
                   gpuhost_fleet_key_file="/root/f")
    template = Environment(loader=FileSystemLoader("templates")).get_template(
        "sglang-router.service.j2")
    ca, other = tls.load_ca(*ca_files), tls.load_ca(*make_ca(tmp_path, "other"))
    first = template.render(**router.unit_context(s, ca))
    assert first != template.render(**router.unit_context(s, other))
    assert first == template.render(**router.unit_context(s, tls.load_ca(*ca_files)))
    assert tls.fingerprint(ca.cert_pem) in first and "PRIVATE" not in first
    plain = fleet_host(gpuhost_tls_ca_cert_file=None, gpuhost_tls_ca_key_file=None,
                       gpuhost_router_host="10.0.0.11", gpuhost_router_api_key_file="/root/r",
                       gpuhost_fleet_key_file="/root/f")
    assert "No fleet CA" in template.render(**router.unit_context(plain))


def test_a_given_key_is_looked_at_through_its_symlink(tmp_path):
    """certbot's /etc/letsencrypt/live/<name>/privkey.pem is a symlink to a root-only file:
    pyinfra's File fact says False for a symlink, and the key was refused as "there is none".
    The fact follows it, as nginx does, and says what a non-file is."""
    target = tmp_path / "archive" / "privkey1.pem"
    target.parent.mkdir()
    target.write_text("key\n")
    os.chmod(target, 0o600)
    live = tmp_path / "live"
    live.mkdir()
    (live / "privkey.pem").symlink_to("../archive/privkey1.pem")
    (live / "dangling.pem").symlink_to("../archive/none.pem")

    def fact(path):
        out = subprocess.run(["sh", "-c", tls.GivenKey.command(str(path))],
                             capture_output=True, text=True, check=True).stdout
        return tls.GivenKey.process(out.splitlines())

    me = subprocess.run(["id", "-un"], capture_output=True, text=True).stdout.strip()
    assert fact(live / "privkey.pem") == {"user": me, "mode": "600", "type": "regular file"}
    assert fact(live / "dangling.pem") is None and fact(tmp_path / "none.pem") is None
    assert fact(live)["type"] == "directory"
    s = fleet_host(gpuhost_tls_ca_key_file=None, gpuhost_tls_cert_file="/etc/ssl/gpu1.pem",
                   gpuhost_tls_key_file="/etc/ssl/private")
    assert tls.given_problem(s, None, {"user": "root", "mode": "700", "type": "directory"}) == (
        "gpuhost_tls_key_file = '/etc/ssl/private' is not allowed: a root-only file on the host "
        "(it is a directory)")


def test_a_given_key_of_another_certificate_is_refused_while_planning(ca_files, tmp_path):
    """A certificate given in host data with another certificate's key: nginx's reload failed
    ("key values mismatch") and the run said only "Job for sglang-gate.service failed", the
    configuration left naming the pair for the gate's next start. The pair is loaded on the
    host as nginx loads it, while planning; an encrypted key too (the gate has no
    passphrase)."""
    ca = tls.load_ca(*ca_files)
    pem, other = (tls.issue(ca, "gpu1", ("10.0.0.11",)) for _ in range(2))
    key, _, cert = pem.partition("-----END PRIVATE KEY-----\n")
    (tmp_path / "gpu1.crt").write_text(cert)
    (tmp_path / "gpu1.key").write_text(key + "-----END PRIVATE KEY-----\n")
    (tmp_path / "other.key").write_text(other.partition("-----END PRIVATE KEY-----\n")[0]
                                        + "-----END PRIVATE KEY-----\n")
    subprocess.run(["openssl", "pkey", "-in", str(tmp_path / "gpu1.key"), "-aes256", "-passout",
                    "pass:x", "-out", str(tmp_path / "locked.key")], check=True)

    def fact(key_name):
        out = subprocess.run(["sh", "-c", tls.GivenPair.command(str(tmp_path / "gpu1.crt"),
                                                                str(tmp_path / key_name))],
                             capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout
        return tls.GivenPair.process(out.splitlines())

    assert fact("gpu1.key") is None
    assert fact("other.key") == "key values mismatch"
    assert fact("locked.key") == "the key is encrypted (it asks for a passphrase, which the " \
                                 "gate has not)"
    assert fact("none.key") == "No such file or directory"
    assert "BEGIN" not in (fact("other.key") or "")


def test_a_given_certificate_of_another_pki_is_refused_while_planning(ca_files, tmp_path):
    """A certificate given in host data that the fleet CA does not sign, directly or through
    the chain after it in the file, was served, and the router refused the worker
    ("UnknownIssuer"): the run said, after gpuhost_router_wait_timeout, only "unhealthy"."""
    ca = tls.load_ca(*ca_files)
    s = fleet_host(gpuhost_tls_ca_key_file=None, gpuhost_tls_cert_file="/etc/ssl/gpu1.pem",
                   gpuhost_tls_key_file="/etc/ssl/private/gpu1.key")

    def cert_of(pem):
        return pem.partition("-----END PRIVATE KEY-----\n")[2]

    assert tls.chain_problem(s, cert_of(tls.issue(ca, "gpu1", ("10.0.0.11",))), ca) is None
    other = tls.load_ca(*make_ca(tmp_path, "other"))
    # two CAs made with the docs' command have one name
    assert tls.chain_problem(s, cert_of(tls.issue(other, "gpu1", ("10.0.0.11",))), ca) == (
        "gpuhost_tls_cert_file = '/etc/ssl/gpu1.pem' is not allowed: a certificate the fleet CA "
        "(CN=gpuhost fleet CA, gpuhost_tls_ca_cert_file) signs, or the chain to it after the "
        "certificate in the file; the router verifies it with that CA alone (it names "
        "CN=gpuhost fleet CA as its issuer, but another key signed it)")
    # an intermediate the fleet CA signs, after the host's certificate in the file
    mid_cert, mid_key = str(tmp_path / "mid.crt"), str(tmp_path / "mid.key")
    subprocess.run([*MAKE_CA[:MAKE_CA.index("-subj")], "-subj", "/CN=mid", "-CA", ca_files[0],
                    "-CAkey", ca_files[1], *MAKE_CA[MAKE_CA.index("-subj") + 2:], "-keyout",
                    mid_key, "-out", mid_cert], check=True, capture_output=True)
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    mid = tls.FleetCA(cert=x509.load_pem_x509_certificate(Path(mid_cert).read_bytes()),
                      key=serialization.load_pem_private_key(Path(mid_key).read_bytes(), None))
    leaf = cert_of(tls.issue(mid, "gpu1", ("10.0.0.11",)))
    (tmp_path / "chain.pem").write_text(leaf + Path(mid_cert).read_text())
    read = subprocess.run(["sh", "-c", tls.GivenChain.command(str(tmp_path / "chain.pem"))],
                          capture_output=True, text=True, check=True).stdout
    assert tls.chain_problem(s, tls.GivenChain.process(read.splitlines()), ca) is None
    assert "(this one is issued by CN=mid)" in tls.chain_problem(s, leaf, ca)
