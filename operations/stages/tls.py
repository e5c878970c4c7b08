"""TLS on the fleet's public endpoints: each host's certificate, issued by the fleet CA.

The fleet CA is the operator's (operations/plans/fleet_ca.py reads and checks it on the controller;
docs/security.md shows the openssl command that makes one). The CA key never leaves the
controller. For each
host with a public endpoint (a server or a router bound wider than the loopback), the deploy
makes a key and a certificate the CA signs, and puts them on the host in one root-only file
(:data:`HOST_PEM`, the key and then the certificate: nginx reads both from one file,
``ssl_certificate`` and ``ssl_certificate_key``, and one atomic upload never leaves a key
beside another key's certificate); the CA's certificate goes beside it (:data:`CA_PATH`), for
the clients on the hosts (the health gate, smg's ``--ca-cert-paths``, Prometheus).

A certificate is issued again when it is missing, does not parse, was not signed by this CA,
names other addresses than the host's endpoints now need, or expires within
:data:`RENEW_DAYS` (certbot's default ``renew_before_expiry``: certbot.eff.org/docs/using.html,
"Configuration file"); a converge does it, and the gates reload (a path unit watches the file,
operations/stages/gate.py). The certificate's names (:func:`subject_names`): the loopback addresses
(the hosts' own checks), the host's fleet address, the addresses its endpoints bind, the
inventory name where it is an address or a DNS name, and ``gpuhost_tls_names``.

The certificate's profile follows RFC 5280 and the CA/Browser Forum's baseline for a server
certificate: subjectAltName with the names (clients match those, never the CN), basicConstraints
CA:FALSE, keyUsage digitalSignature, extendedKeyUsage serverAuth, the key identifiers; an ECDSA
P-256 key (what Let's Encrypt issues for by default since 2024 for ECDSA accounts, and
every TLS 1.2/1.3 client here speaks: nginx 1.22/1.24 with OpenSSL 3, smg's rustls, Python's
ssl, Go's crypto/tls in Prometheus).
"""

from __future__ import annotations

import datetime
import hashlib
import ipaddress
import re
import shlex
from collections.abc import Iterable, Mapping
from io import StringIO
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from pyinfra import host
from pyinfra.api import FactBase, operation
from pyinfra.operations import files

from operations.plans import ca_rotation

# for_run and load_ca: the stage's callers and tests reach the CA through this module too
from operations.plans.fleet_ca import RENEW_DAYS, FleetCA, TlsError, for_run, load_ca  # noqa: F401
from operations.plans.plan import refuse
from operations.plans.settings import PREFIX, Settings
from operations.stages.secret_template import put_hidden
from operations.stages.whole_file import whole

TLS_DIR: Final = "/etc/gpuhost/tls"
#: The fleet CA's certificate on every host (public): what the hosts' clients verify with.
#: A trust bundle during a CA rotation: every CA's certificate (operations/plans/ca_rotation.py).
CA_PATH: Final = ca_rotation.CA_PATH
#: The host's private key and certificate, in this order, root-only.
HOST_PEM: Final = f"{TLS_DIR}/host.pem"
#: Days a certificate is valid (at most the CA's own remaining validity).
VALID_DAYS: Final = 365
#: A certificate's start, this far before its issue: a host's clock a little behind the
#: controller's still accepts it.
BACKDATE: Final = datetime.timedelta(minutes=5)
_DNS_NAME: Final = re.compile(r"(?=.{1,253}$)([A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)"
                              r"(\.[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*")


def subject_names(name: str, s: Settings) -> tuple[str, ...]:
    """The names host ``name``'s certificate holds (sorted): the loopback addresses and
    ``localhost``, its fleet address, the addresses its public endpoints bind (not a wildcard),
    its inventory name where that is an address or a DNS name, and ``gpuhost_tls_names``."""
    names = {"127.0.0.1", "::1", "localhost", *s.tls_names}
    if s.fleet_address:
        names.add(s.fleet_address)
    for bound, public in ((s.server_host, s.server_is_public),
                          (s.router_host, s.router_is_public)):
        if public and not ipaddress.ip_address(bound).is_unspecified:
            names.add(bound)
    if _is_address(name) or _DNS_NAME.fullmatch(name):
        names.add(name)
    return tuple(sorted({canonical(n) for n in names}))


def canonical(name: str) -> str:
    """A name as a certificate's subjectAltName gives it back: an IP address in Python's
    compressed form (RFC 5952: ``FD00:0::5`` is ``fd00::5``; the certificate holds its 4 or 16
    bytes), a DNS name in lower case (compared without case, RFC 6125 6.4.1). Else one
    spelling of a name is issued again at every run, as never the certificate's."""
    return str(ipaddress.ip_address(name)) if _is_address(name) else name.lower()


def _is_address(value: str) -> bool:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return False
    return True


def _general_name(value: str) -> x509.GeneralName:
    if _is_address(value):
        return x509.IPAddress(ipaddress.ip_address(value))
    return x509.DNSName(value)


def _names_of(cert: x509.Certificate) -> tuple[str, ...]:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ()
    found = [str(a) for a in san.get_values_for_type(x509.IPAddress)]
    found += [n.lower() for n in san.get_values_for_type(x509.DNSName)]
    return tuple(sorted(found))


def needs_tls(s: Settings) -> bool:
    """Whether the host has a public endpoint and the fleet a CA: then it has a certificate,
    and its public gates serve TLS."""
    return s.tls_ca_cert_file is not None and (s.server_is_public and s.serving
                                                or s.router_is_public)


def gate_files(s: Settings, public: bool) -> dict[str, str | None]:
    """A gate's ``tls_cert`` and ``tls_key`` (operations/stages/gate.py Gate): None for a gate on
    the loopback or without a fleet CA; the files host data names
    (``gpuhost_tls_cert_file``, ``gpuhost_tls_key_file``); else :data:`HOST_PEM`, both."""
    if not (public and needs_tls(s)):
        return {"tls_cert": None, "tls_key": None}
    if s.tls_cert_file is not None:
        return {"tls_cert": s.tls_cert_file, "tls_key": s.tls_key_file}
    return {"tls_cert": HOST_PEM, "tls_key": HOST_PEM}


def reason_to_issue(current: str | None, ca: FleetCA, names: tuple[str, ...],
                    now: datetime.datetime | None = None) -> str | None:
    """Why the host's certificate (``current``: the PEM on the host, None where there is none)
    must be issued again, or None where it serves on."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if not current:
        return "the host has no certificate yet"
    try:
        cert = x509.load_pem_x509_certificate(current.encode())
    except ValueError:
        return "the host's certificate does not parse"
    try:
        cert.verify_directly_issued_by(ca.cert)
    except (ValueError, TypeError, InvalidSignature):
        return "the host's certificate was not issued by this fleet CA"
    if _names_of(cert) != names:
        return (f"the host's certificate names {', '.join(_names_of(cert)) or 'nothing'}; "
                f"its endpoints need {', '.join(names)}")
    if cert.not_valid_after_utc - datetime.timedelta(days=RENEW_DAYS) <= now:
        return (f"the host's certificate expires on {cert.not_valid_after_utc:%Y-%m-%d}, "
                f"within {RENEW_DAYS} days")
    return None


def issue(ca: FleetCA, name: str, names: tuple[str, ...],
          now: datetime.datetime | None = None) -> str:
    """A new private key and a certificate for it that ``ca`` signs, for host ``name`` with
    ``names``: the PEM of both, key first (:data:`HOST_PEM`)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if ca.key is None:
        raise TlsError("the fleet CA has no key here: gpuhost_tls_ca_key_file")
    key = ec.generate_private_key(ec.SECP256R1())
    not_after = min(now + datetime.timedelta(days=VALID_DAYS), ca.cert.not_valid_after_utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name[:64])]))
        .issuer_name(ca.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName([_general_name(n) for n in names]),
                       critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                     key_encipherment=False, data_encipherment=False,
                                     key_agreement=False, key_cert_sign=False, crl_sign=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .add_extension(_authority_key_id(ca.cert), critical=False)
        .sign(ca.key, _signature_hash(ca.key))
    )
    key_pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption()).decode()
    return key_pem + cert.public_bytes(serialization.Encoding.PEM).decode()


def _authority_key_id(ca_cert: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    """The authorityKeyIdentifier of a certificate the CA signs: the CA's own
    subjectKeyIdentifier where it has one (RFC 5280 4.2.1.1; OpenSSL looks the issuer up by it,
    and a CA made by another tool may have computed it otherwise than SHA-1 of the key, as Go
    1.25's truncated SHA-256 does: "unable to get local issuer certificate"), else one from its
    public key."""
    try:
        ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    except x509.ExtensionNotFound:
        public = ca_cert.public_key()
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(public)  # type: ignore[arg-type]
    return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)


def _signature_hash(key: object) -> hashes.HashAlgorithm | None:
    """The hash the CA signs with: none for Ed25519, SHA-384 for a P-384 key (the Mozilla Root
    Store Policy's pairs, section 5.1.2: P-256 with SHA-256, P-384 with SHA-384), else SHA-256."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return None
    if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve, ec.SECP384R1):
        return hashes.SHA384()
    return hashes.SHA256()


class _PemFact(FactBase):
    """A fact whose output is PEM text: the text, or None where there is none."""

    @staticmethod
    def process(output: list[str]) -> str | None:
        text = "\n".join(output).strip()
        return text + "\n" if text else None


class HostCertificate(_PemFact):
    """The certificate in :data:`HOST_PEM` (its PEM block alone, never the key), or None where
    the file holds no certificate or no key beside it."""

    @staticmethod
    def command() -> str:
        return (f"if [ -f {HOST_PEM} ] && grep -q -- '-----BEGIN PRIVATE KEY-----' {HOST_PEM}; "
                f"then sed -n '/-----BEGIN CERTIFICATE-----/,/-----END CERTIFICATE-----/p' "
                f"{HOST_PEM}; fi")


def fingerprint(pem: str) -> str:
    """A certificate's SHA-256 fingerprint, as openssl x509 -fingerprint -sha256 prints it."""
    der = x509.load_pem_x509_certificate(pem.encode()).public_bytes(serialization.Encoding.DER)
    digest = hashlib.sha256(der).hexdigest().upper()
    return ":".join(digest[i:i + 2] for i in range(0, len(digest), 2))


class GivenKey(FactBase):
    """The file ``gpuhost_tls_key_file`` names as nginx opens it, a symlink followed (certbot's
    ``/etc/letsencrypt/live/<name>/privkey.pem`` is one, into ``../../archive``): its owner, its
    mode (octal) and its type (stat's %F: "regular file", "directory", ...), or None where
    there is no such file (a dangling symlink included)."""

    @staticmethod
    def command(path: str) -> str:
        return f"stat -L -c 'user=%U mode=%a type=%F' -- {shlex.quote(path)} 2>/dev/null || true"

    @staticmethod
    def process(output: list[str]) -> dict | None:
        found = re.fullmatch(r"user=(\S+) mode=([0-7]+) type=(.+)", "\n".join(output).strip())
        return {"user": found[1], "mode": found[2], "type": found[3]} if found else None


#: Loads a certificate and its key as nginx does (OpenSSL's SSL_CTX_use_certificate_chain_file
#: and SSL_CTX_use_PrivateKey_file, through Python's ssl): prints "ok", or OpenSSL's reason
#: ("key values mismatch": nginx's reload failed on it, the old gate serving on), or that the
#: key asks for a passphrase (no ssl_password_file here). Nothing of the key is printed.
_PAIR_CHECK: Final = (
    "import ssl, sys\n"
    "def asked():\n"
    "    raise KeyError\n"
    "try:\n"
    "    ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(sys.argv[1], sys.argv[2], asked)\n"
    "except KeyError:\n"
    "    print('the key is encrypted (it asks for a passphrase, which the gate has not)')\n"
    "except ssl.SSLError as exc:\n"
    "    print((exc.reason or exc.strerror).lower().replace('_', ' '))\n"
    "except OSError as exc:\n"
    "    print(exc.strerror)\n"
    "else:\n"
    "    print('ok')\n")


class GivenPair(FactBase):
    """Whether nginx can serve the certificate and key host data names (:data:`_PAIR_CHECK`
    on the host, as root): None where it can, else OpenSSL's reason."""

    @staticmethod
    def command(cert: str, key: str) -> str:
        return (f"python3 -c {shlex.quote(_PAIR_CHECK)} {shlex.quote(cert)} "
                f"{shlex.quote(key)} 2>&1 | tail -n 1")

    @staticmethod
    def process(output: list[str]) -> str | None:
        said = "\n".join(output).strip()
        return None if said == "ok" else said or "python3 said nothing"


class GivenChain(_PemFact):
    """Every certificate of a PEM file on the host (``gpuhost_tls_cert_file``: the host's and
    the chain after it), or None."""

    @staticmethod
    def command(path: str) -> str:
        quoted = shlex.quote(path)
        return (f"if [ -f {quoted} ]; then sed -n '/-----BEGIN CERTIFICATE-----/,"
                f"/-----END CERTIFICATE-----/p' {quoted}; fi")


def chain_problem(s: Settings, chain_pem: str | None, ca: FleetCA) -> str | None:
    """Why the router and Prometheus, which trust the fleet CA's file alone (each CA of a trust
    bundle), would not verify the certificate host data names (``chain_pem``:
    :class:`GivenChain`, the host's certificate first), or None: it must be signed by a CA of
    the file, or by a certificate after it in the file that one signs (and so on). Before, a
    certificate of another PKI was served, and the run said after
    ``gpuhost_router_wait_timeout`` only that the worker was unhealthy (smg: "UnknownIssuer")."""
    try:
        chain = x509.load_pem_x509_certificates((chain_pem or "").encode())
    except ValueError:
        return None  # given_problem says what does not parse
    for anchor in ca.bundle:
        if _chains_to(chain, anchor):
            return None
    issuer = chain[0].issuer.rfc4514_string()
    said = (f"it names {issuer} as its issuer, but another key signed it"
            if any(chain[0].issuer == c.subject for c in ca.bundle)
            else f"this one is issued by {issuer}")
    return (f"{PREFIX}tls_cert_file = {s.tls_cert_file!r} is not allowed: a certificate the "
            f"fleet CA ({ca.cert.subject.rfc4514_string()}, {PREFIX}tls_ca_cert_file) signs, "
            f"or the chain to it after the certificate in the file; the router verifies it with "
            f"that CA alone ({said})")


def _chains_to(chain: list[x509.Certificate], anchor: x509.Certificate) -> bool:
    """Whether ``chain[0]`` is signed by ``anchor``, or by a certificate after it in ``chain``
    that ``anchor`` signs (and so on)."""
    current, seen = chain[0], 0
    while seen <= len(chain):
        seen += 1
        if current.issuer == anchor.subject:
            try:
                current.verify_directly_issued_by(anchor)
                return True
            except (ValueError, TypeError, InvalidSignature):
                return False
        issuer = next((c for c in chain[1:] if c.subject == current.issuer), None)
        if issuer is None:
            return False
        try:
            current.verify_directly_issued_by(issuer)
        except (ValueError, TypeError, InvalidSignature):
            return False
        current = issuer
    return False


def given_problem(s: Settings, cert_pem: str | None, key: dict | None,
                  now: datetime.datetime | None = None) -> str | None:
    """Why the certificate and key host data names on the host cannot serve (``cert_pem``:
    :class:`GivenChain`, of which the first certificate is the host's; ``key``:
    :class:`GivenKey`), or None. The chain up to the
    CA: :func:`chain_problem`; the key beside the certificate: :class:`GivenPair`."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    if not key:
        return (f"{PREFIX}tls_key_file = {s.tls_key_file!r} is not allowed: a root-only file "
                "on the host (there is none)")
    if key.get("type", "regular file") != "regular file":
        return (f"{PREFIX}tls_key_file = {s.tls_key_file!r} is not allowed: a root-only file "
                f"on the host (it is a {key['type']})")
    if key.get("user") != "root" or int(str(key.get("mode", 0)), 8) & 0o077:
        return (f"{PREFIX}tls_key_file = {s.tls_key_file!r} is not allowed: a root-only file "
                f"(mode 0600, owner root; it is {key.get('mode')}, owner {key.get('user')})")
    if cert_pem is None:
        return (f"{PREFIX}tls_cert_file = {s.tls_cert_file!r} is not allowed: a PEM "
                "certificate on the host (there is none, or no -----BEGIN CERTIFICATE-----)")
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode())
    except ValueError:
        return (f"{PREFIX}tls_cert_file = {s.tls_cert_file!r} is not allowed: a PEM "
                "certificate (its first one does not parse)")
    if cert.not_valid_after_utc <= now:
        return (f"{PREFIX}tls_cert_file = {s.tls_cert_file!r} is not allowed: a certificate "
                f"in its validity (it expired on {cert.not_valid_after_utc:%Y-%m-%d})")
    if s.fleet_address and canonical(s.fleet_address) not in _names_of(cert):
        return (f"{PREFIX}tls_cert_file = {s.tls_cert_file!r} is not allowed: a certificate "
                f"naming the fleet address {s.fleet_address}, at which the router and "
                f"Prometheus verify it (it names {', '.join(_names_of(cert)) or 'nothing'})")
    return None


def certificates(settings: Settings, ca: FleetCA,
                 routers: Mapping[str, Iterable[str]] | None = None) -> None:
    """The TLS stage: the fleet CA's certificate on the host (every CA's of a trust bundle),
    and the host's own where it has a public endpoint: the one host data names, checked while
    planning (refused otherwise), or one the fleet CA issues (:func:`host_certificate`), with a
    warning where a new signing CA would leave a client without a path (``routers``: each
    router host's workers' host names, whose trust files verify them;
    operations/plans/ca_rotation.py)."""
    if settings.tls_cert_file is not None and needs_tls(settings):
        chain = host.get_fact(GivenChain, path=settings.tls_cert_file)
        problem = given_problem(settings, chain,
                                host.get_fact(GivenKey, path=settings.tls_key_file))
        if not problem:
            problem = chain_problem(settings, chain, ca)
        if not problem:
            reason = host.get_fact(GivenPair, cert=settings.tls_cert_file,
                                   key=settings.tls_key_file)
            if reason:
                problem = (f"{PREFIX}tls_key_file = {settings.tls_key_file!r} is not allowed: "
                           f"the private key of {PREFIX}tls_cert_file's certificate, which "
                           f"nginx loads ({reason})")
        if problem:
            refuse("TLS", problem)
            return
    if needs_tls(settings) and settings.tls_cert_file is None:  # said while planning
        ca_rotation.warn_one_step(ca, host.get_fact(HostCertificate), routers or {})
    host_certificate(name="TLS: the fleet CA's certificate and this host's", settings=settings,
                     ca=ca)


@operation()
def host_certificate(settings: Settings, ca: FleetCA):
    """The fleet CA's certificate (a trust bundle's every CA's) and the host's key and
    certificate in /etc/gpuhost/tls, issued again where :func:`reason_to_issue` says so (its
    reason is the change's line)."""
    yield from files.directory._inner(path=TLS_DIR, user="root", group="root", mode="755")
    yield from whole(files.put._inner(src=StringIO(ca.bundle_pem), dest=CA_PATH, user="root",
                                      group="root", mode="644"), CA_PATH, "644")
    if not needs_tls(settings):
        host.noop("no public endpoint here: no certificate of its own")
        return
    if settings.tls_cert_file is not None:
        host.noop(f"the gates serve {settings.tls_cert_file}, which host data names")
        return
    names = subject_names(host.name, settings)
    current = host.get_fact(HostCertificate)
    reason = reason_to_issue(current, ca, names)
    if reason is None:
        cert = x509.load_pem_x509_certificate(current.encode())  # type: ignore[union-attr]
        host.noop(f"the TLS certificate for {', '.join(names)} is valid until "
                  f"{cert.not_valid_after_utc:%Y-%m-%d}")
        return
    host.log(f"TLS certificate: {reason}: issued again by the fleet CA")
    yield from put_hidden(StringIO(issue(ca, host.name, names)), HOST_PEM)
