"""The fleet CA, read on the controller: its certificate, which every host's clients verify
with, and its private key, which signs the hosts' certificates (operations/stages/tls.py) and never
leaves the controller. Both are files named in host data (``gpuhost_tls_ca_cert_file``,
``gpuhost_tls_ca_key_file``); the key may be left out where every host with a public endpoint
brings its own certificate. Read once a run, before any host is touched: a CA the hosts'
clients would refuse ends the run with one line per problem (:func:`for_run`).
"""

from __future__ import annotations

import datetime
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from cryptography.x509.oid import SignatureAlgorithmOID

from operations.runtime.run_exit import end_run
from operations.plans.settings import PREFIX, Settings

#: Days before expiry at which a converge issues a host's certificate again (certbot's default
#: ``renew_before_expiry``: certbot.eff.org/docs/using.html, "Configuration file"); a CA must
#: outlive it.
RENEW_DAYS: Final = 30
_LOADED: Final = "_gpuhost_fleet_cas"
_PRIVATE_KEYS: Final = (ec.EllipticCurvePrivateKey, rsa.RSAPrivateKey, ed25519.Ed25519PrivateKey)


class TlsError(ValueError):
    """The fleet CA's files give no CA to issue with: the line names the key, the value and
    what is allowed."""


@dataclass(frozen=True)
class FleetCA:
    """The fleet CA, loaded on the controller."""

    #: the CA that signs the hosts' certificates (whose key ``key`` is)
    cert: x509.Certificate
    #: None where host data names no key: the hosts bring their own certificates
    key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey | ed25519.Ed25519PrivateKey | None
    #: every CA's certificate the hosts' clients trust, in the file's order (``cert`` among
    #: them): more than one during a rotation; empty: ``cert`` alone
    trusted: tuple[x509.Certificate, ...] = ()

    @property
    def cert_pem(self) -> str:
        return self.cert.public_bytes(serialization.Encoding.PEM).decode()

    @property
    def bundle(self) -> tuple[x509.Certificate, ...]:
        """The certificates the clients trust (:data:`operations.stages.tls.CA_PATH`)."""
        return self.trusted or (self.cert,)

    @property
    def bundle_pem(self) -> str:
        return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in self.bundle)


def _refuse(key: str, value: str, why: str) -> TlsError:
    return TlsError(f"{PREFIX}{key} = {value!r} is not allowed: {why}")


def load_ca(cert_file: str, key_file: str | None,
            now: datetime.datetime | None = None) -> FleetCA:
    """The fleet CA from its files on the controller (``key_file`` None: its certificates alone,
    to verify with); :class:`TlsError` where they give none (unreadable, not PEM, not a CA,
    expired or expiring within :data:`RENEW_DAYS`, a key that other users may read, an
    encrypted key, a key of none of the certificates).

    The certificate file may be a trust bundle, several CAs' certificates in one PEM file, as
    OpenSSL's ``-CAfile`` (SSL_CTX_load_verify_locations), Python's ``cafile``, Go's
    ``AppendCertsFromPEM`` (Prometheus' ``ca_file``) and smg's ``--ca-cert-paths`` read one: a
    CA rotation's overlap (docs/security.md, "Rotate the fleet CA"). The hosts' clients trust
    every certificate of it; the one whose key ``key_file`` holds signs (without a key, the
    first). The signing CA must outlive :data:`RENEW_DAYS`; the others must be valid now (an
    old CA near its end is what a rotation replaces)."""
    now = now or datetime.datetime.now(datetime.timezone.utc)
    data = _read("tls_ca_cert_file", cert_file)[1]
    try:
        certs = x509.load_pem_x509_certificates(data)
    except ValueError:
        raise _refuse("tls_ca_cert_file", cert_file, "a PEM certificate (-----BEGIN "
                      "CERTIFICATE-----), the fleet CA's, or the CAs' of a rotation") from None
    certs = _checked_bundle(cert_file, certs, now)
    if key_file is None:
        return _valid_signer(cert_file, certs[0], certs, None, now)
    mode, data = _read("tls_ca_key_file", key_file)
    if stat.S_IMODE(mode) & 0o077:
        raise _refuse("tls_ca_key_file", key_file, f"a file only its owner may read or write "
                      f"(its mode is {stat.S_IMODE(mode):04o}; chmod 600 it)")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except TypeError:
        raise _refuse("tls_ca_key_file", key_file, "an unencrypted PEM private key (the deploy "
                      "asks for no passphrase)") from None
    except (ValueError, x509.UnsupportedGeneratorAlgorithm):
        raise _refuse("tls_ca_key_file", key_file, "a PEM private key (-----BEGIN PRIVATE "
                      "KEY-----), the fleet CA's") from None
    if not isinstance(key, _PRIVATE_KEYS):
        raise _refuse("tls_ca_key_file", key_file, "an EC, RSA or Ed25519 private key")
    public = _spki(key.public_key())
    signer = next((c for c in certs if _spki(c.public_key()) == public), None)
    if signer is None:
        whose = (f"{PREFIX}tls_ca_cert_file's certificate ({cert_file})" if len(certs) == 1
                 else f"one of the {len(certs)} certificates of {PREFIX}tls_ca_cert_file "
                 f"({cert_file}: {', '.join(_cn(c) for c in certs)})")
        raise _refuse("tls_ca_key_file", key_file, f"the private key of {whose}; it is "
                      "another's")
    return _valid_signer(cert_file, signer, certs, key, now)


def _spki(public: object) -> bytes:
    return public.public_bytes(serialization.Encoding.DER,  # type: ignore[attr-defined]
                               serialization.PublicFormat.SubjectPublicKeyInfo)


def _cn(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string() or "an empty subject"


def _checked_bundle(cert_file: str, certs: list[x509.Certificate],
                    now: datetime.datetime) -> tuple[x509.Certificate, ...]:
    """Each certificate of the file a root CA the hosts' clients would take
    (:func:`_unusable_ca`), valid now, and each once; a refusal names which."""
    seen: set[bytes] = set()
    for number, cert in enumerate(certs, 1):
        which = "" if len(certs) == 1 else f" (certificate {number} of {len(certs)}, {_cn(cert)})"
        der = cert.public_bytes(serialization.Encoding.DER)
        if der in seen:
            raise _refuse("tls_ca_cert_file", cert_file, f"each CA's certificate once{which}: "
                          "this one is there twice")
        seen.add(der)
        try:
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
        except x509.ExtensionNotFound:
            constraints = None
        if constraints is None or not constraints.ca:
            raise _refuse("tls_ca_cert_file", cert_file, "a CA's certificate (basicConstraints "
                          f"CA:TRUE){which}; this one is not a CA's")
        if len(certs) == 1:
            _valid_signer(cert_file, cert, (cert,), None, now)
        elif cert.not_valid_after_utc <= now:
            raise _refuse("tls_ca_cert_file", cert_file, f"CAs valid now{which}: this one "
                          f"expired on {cert.not_valid_after_utc:%Y-%m-%d}; drop it from the file")
        problem = _unusable_ca(cert, now)
        if problem:
            raise _refuse("tls_ca_cert_file", cert_file, problem + which)
    return tuple(certs)


def _valid_signer(cert_file: str, signer: x509.Certificate,
                  certs: tuple[x509.Certificate, ...], key, now: datetime.datetime) -> FleetCA:
    if signer.not_valid_after_utc - datetime.timedelta(days=RENEW_DAYS) <= now:
        which = "" if len(certs) == 1 else f" (the signing one, {_cn(signer)})"
        raise _refuse("tls_ca_cert_file", cert_file, f"a CA valid for more than {RENEW_DAYS} "
                      f"days{which}; this one expires on {signer.not_valid_after_utc:%Y-%m-%d}")
    return FleetCA(cert=signer, key=key, trusted=certs)


#: The most a fleet CA's file may hold: a PEM certificate or private key is a few KiB (RSA
#: 4096: about 3.3 KiB), and the deploy reads the file whole.
MAX_PEM_BYTES: Final = 1 << 20


def _read(key: str, path: str) -> tuple[int, bytes]:
    """The mode and the bytes of a file on the controller (a symlink followed), or
    :class:`TlsError`: not a regular file (a directory, a device, a FIFO would hang the run),
    larger than :data:`MAX_PEM_BYTES`, unreadable."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise _refuse(key, path, "a regular file on the controller (this is "
                          f"{_KINDS.get(stat.S_IFMT(info.st_mode), 'not one')})")
        if info.st_size > MAX_PEM_BYTES:
            raise _refuse(key, path, f"a PEM file of at most {MAX_PEM_BYTES} bytes (this one "
                          f"has {info.st_size})")
        with open(path, "rb") as f:
            return info.st_mode, f.read(MAX_PEM_BYTES + 1)
    except OSError as exc:
        raise _refuse(key, path, f"a readable file on the controller ({exc.strerror})") from None


_KINDS: Final = {stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
                 stat.S_IFBLK: "a block device", stat.S_IFIFO: "a FIFO",
                 stat.S_IFSOCK: "a socket"}


def _unusable_ca(cert: x509.Certificate, now: datetime.datetime) -> str | None:
    """Why the certificates a CA's certificate signs would not verify at the hosts' clients
    (OpenSSL 3 at Debian's security level 2 in nginx, curl and Python; rustls in smg; Go in
    Prometheus), or None. Each was seen to fail there (OpenSSL 3.0 ``verify``, curl): a CA
    not yet valid ("certificate is not yet valid"), a keyUsage without keyCertSign ("invalid
    CA certificate", RFC 5280 4.2.1.3), a CA that is not self-signed (the hosts trust the file
    alone, and OpenSSL wants a chain ending at a root: "unable to get local issuer
    certificate"), an RSA key under 2048 bits ("CA certificate key too weak", SECLEVEL 2), an
    RSASSA-PSS key (this module signs PKCS#1 v1.5). The key types are the Mozilla Root Store
    Policy's (section 5.1: RSA of at least 2048 bits, ECDSA on P-256 or P-384, which rustls
    and Go verify; Ed25519 as well, which OpenSSL, rustls and Go verify)."""
    if cert.not_valid_before_utc > now:
        return (f"a CA already valid; this one starts on "
                f"{cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (by the controller's clock)")
    try:
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    except x509.ExtensionNotFound:
        usage = None
    if usage is not None and not usage.key_cert_sign:
        return "a CA whose keyUsage includes keyCertSign; this one's does not"
    try:
        self_signed = cert.issuer == cert.subject
        cert.verify_directly_issued_by(cert)
    except (ValueError, TypeError, InvalidSignature):
        self_signed = False
    if not self_signed:
        return (f"a root CA's certificate, self-signed (the hosts trust this file alone); "
                f"this one is issued by {cert.issuer.rfc4514_string()}")
    if cert.signature_algorithm_oid == SignatureAlgorithmOID.RSASSA_PSS:
        return "an RSA (PKCS#1), ECDSA P-256 or P-384, or Ed25519 CA; this one's key is RSA-PSS"
    public = cert.public_key()
    if isinstance(public, rsa.RSAPublicKey) and public.key_size < 2048:
        return f"an RSA key of at least 2048 bits; this one has {public.key_size}"
    if isinstance(public, ec.EllipticCurvePublicKey) and \
            not isinstance(public.curve, (ec.SECP256R1, ec.SECP384R1)):
        return f"an ECDSA key on P-256 or P-384; this one is on {public.curve.name}"
    return None


def for_run(settings: Mapping[str, Settings]) -> dict[str, FleetCA]:
    """Each host's fleet CA (by host name; none where host data names none), loaded from the
    controller once a run; on a problem, the run ends listing each before any host is touched
    (as settings.for_run does)."""
    from pyinfra import state

    loaded = getattr(state, _LOADED, None)
    if loaded is not None and loaded[0] == dict(settings):
        return loaded[1]
    cas: dict[tuple[str, str | None], FleetCA] = {}
    problems: dict[tuple[str, str | None], tuple[list[str], str]] = {}
    for name, s in settings.items():
        if s.tls_ca_cert_file is None:
            continue
        pair = (s.tls_ca_cert_file, s.tls_ca_key_file)
        if pair in cas:
            continue
        if pair in problems:
            problems[pair][0].append(name)
            continue
        try:
            cas[pair] = load_ca(*pair)
        except TlsError as exc:
            problems[pair] = ([name], str(exc))
    if problems:
        end_run("gpuhost: the fleet CA refused, no host was touched:\n  - " + "\n  - ".join(
            f"host{'s' if len(names) > 1 else ''} {', '.join(names)}: {why}"
            for names, why in problems.values()))
    by_host = {name: cas[(s.tls_ca_cert_file, s.tls_ca_key_file)]
               for name, s in settings.items() if s.tls_ca_cert_file is not None}
    setattr(state, _LOADED, (dict(settings), by_host))
    return by_host
