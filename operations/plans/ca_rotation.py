"""A fleet CA rotation with overlap: the warning for a CA change in one step.

A CA is replaced as Kubernetes' manual rotation (kubernetes.io/docs/tasks/tls/manual-rotation-
of-ca-certificates/) and etcd's trusted CA file go: first every client trusts both CAs (a trust
bundle, the old CA's certificate and the new one's in one PEM file, ``gpuhost_tls_ca_cert_file``,
the old CA's key still in ``gpuhost_tls_ca_key_file``), then the new CA signs and the hosts'
certificates are issued again, then the old CA leaves the bundle (docs/security.md, "Rotate the
fleet CA"). The hosts' clients read the bundle at :data:`operations.stages.tls.CA_PATH`: smg's
``--ca-cert-paths`` on a router host (once, at its start: the router's unit names every CA's
fingerprint, so a change of the bundle restarts it), Prometheus' ``tls_config.ca_file``
(prometheus/common ``config/http_config.go``: the CA file is read again when its content
changes), the health gate and the bench (Python's ``ssl``, each run); clients of the router's
gate elsewhere take the same file from the operator.

A change of the signing CA while some client's trust file does not hold the new CA yet (the
CA changed in one step: issue 40 finding 5, 2020 verification failures in a row for a client of
the old CA) is said while planning, in ``--dry`` as in a real run, naming the hosts
(:func:`one_step_gap`, :func:`warn_one_step`); the run goes on (a CA whose key leaked is
replaced at once on purpose).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from pyinfra import host, inventory, logger
from pyinfra.api import FactBase

from operations.plans.fleet_ca import FleetCA
from operations.plans.settings import PREFIX

#: The hosts' trust file (operations/stages/tls.py CA_PATH, repeated here: tls imports this module)
CA_PATH: Final = "/etc/gpuhost/tls/fleet-ca.crt"


class TrustedCAs(FactBase):
    """The certificates of the host's trust file (:data:`CA_PATH`, public), as PEM text, or
    None where there is none (a host before its first TLS run)."""

    @staticmethod
    def command() -> str:
        return (f"if [ -f {CA_PATH} ]; then sed -n '/-----BEGIN CERTIFICATE-----/,"
                f"/-----END CERTIFICATE-----/p' {CA_PATH}; fi")

    @staticmethod
    def process(output: list[str]) -> str | None:
        text = "\n".join(output).strip()
        return text + "\n" if text else None


def _ders(pem: str | None) -> set[bytes]:
    try:
        return {c.public_bytes(serialization.Encoding.DER)
                for c in x509.load_pem_x509_certificates((pem or "").encode())}
    except ValueError:
        return set()


def one_step_gap(signing: x509.Certificate, current_pem: str | None,
                 trusted: Mapping[str, str | None]) -> tuple[str, ...]:
    """The hosts (sorted) whose trust file (``trusted``: host name to :class:`TrustedCAs`) does
    not hold ``signing``, where the host's certificate (``current_pem``, the certificate on it
    now) was signed by another CA and so is issued again by ``signing`` in this run: its clients
    there, trusting the old CA alone until this run, lose their path to it. Empty where nothing
    is lost: no certificate yet, or one ``signing`` signed, or every client trusting ``signing``
    already (the bundle was put on the hosts by an earlier run). A host without a trust file has
    verified nothing yet and is left out."""
    if not current_pem:
        return ()
    try:
        current = x509.load_pem_x509_certificate(current_pem.encode())
    except ValueError:
        return ()
    try:
        current.verify_directly_issued_by(signing)
        return ()
    except (ValueError, TypeError, InvalidSignature):
        pass
    wanted = signing.public_bytes(serialization.Encoding.DER)
    return tuple(sorted(name for name, pem in trusted.items()
                        if pem is not None and wanted not in _ders(pem)))


def warning(name: str, ca: FleetCA, gap: Iterable[str]) -> str:
    """The line for host ``name`` whose certificate the new signing CA issues again while the
    trust files of ``gap`` lack it: what breaks, and what to do."""
    return (f"TLS: warning: the fleet CA changes in one step: {name}'s certificate is issued "
            f"again by {ca.cert.subject.rfc4514_string()}, which the trust file ({CA_PATH}) of "
            f"{', '.join(gap)} does not hold yet: a client that trusts only the old CA (smg and "
            f"Prometheus on the router host until this run, clients of the router's gate) fails "
            f"to verify {name} from this run on. To keep every client's path: put the old CA's "
            f"certificate and the new one's in {PREFIX}tls_ca_cert_file (one PEM file), keep "
            f"the old CA's key in {PREFIX}tls_ca_key_file and run; hand that file to your "
            f"clients; then name the new CA's key and run; then drop the old certificate "
            f"(docs/security.md, Rotate the fleet CA)")


def clients_of(name: str, routers: Mapping[str, Iterable[str]]) -> tuple[str, ...]:
    """The hosts whose trust files verify host ``name``'s certificate: its own (its checks;
    on a router host, the stand-in for the router's clients elsewhere, who take the file from
    the operator) and each router host's that has it as a worker (``routers``: router host to
    its workers' host names)."""
    return tuple(dict.fromkeys([name, *(r for r, ws in routers.items() if name in ws)]))


def _trust_of(name: str) -> str | None:
    """Host ``name``'s :class:`TrustedCAs` while planning, read once per run (as
    operations/stages/nodes.py reads a peer's facts); None where that host cannot be read in this
    run (left out by ``--limit``, its link down): its own run says so."""
    if name == host.name:
        return host.get_fact(TrustedCAs)
    try:
        other = inventory.get_host(name)
        cache = vars(other).setdefault("_gpuhost_trusted_cas", [])
        if not cache:
            cache.append(other.get_fact(TrustedCAs))
        return cache[0]
    except Exception:  # noqa: BLE001 - a peer unread is no reason to stop this host's plan
        return None


def warn_one_step(ca: FleetCA, current_pem: str | None,
                  routers: Mapping[str, Iterable[str]]) -> None:
    """Say :func:`warning` for this host where :func:`one_step_gap` finds clients without a
    path."""
    if current_pem is None:
        return
    gap = one_step_gap(ca.cert, current_pem,
                       {n: _trust_of(n) for n in clients_of(host.name, routers)})
    if gap:
        logger.warning(f"{host.print_prefix}{warning(host.name, ca, gap)}")
