"""Secure Boot: the firmware's state, and DKMS signing the NVIDIA kernel module with a MOK."""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from pyinfra import host, logger
from pyinfra.api import FactBase
from pyinfra.facts.files import File
from pyinfra.operations import files
from typing_extensions import override

from operations import REPO_ROOT
from operations.plans.plan import fact
from operations.plans.settings import PREFIX, Settings

#: EFI_GLOBAL_VARIABLE, the vendor GUID of SecureBoot and SetupMode (UEFI specification,
#: "Globally Defined Variables"; the kernel's EFI_GLOBAL_VARIABLE_GUID, include/linux/efi.h).
EFI_GLOBAL_VARIABLE: Final = "8be4df61-93ca-11d2-aa0d-00e098032b8c"
EFIVARS: Final = "/sys/firmware/efi/efivars"

#: Where DKMS 3.x reads its signing configuration: read_framework_conf() in dkms sources
#: /etc/dkms/framework.conf, then /etc/dkms/framework.conf.d/*.conf, and takes sign_file,
#: mok_signing_key and mok_certificate from them (dkms.in, v3.0.6 to v3.4.3; Debian 12's
#: dkms 3.0.10-8+deb12u1 /usr/sbin/dkms, lines 48 and 662, read from the package).
DKMS_SIGNING_CONF: Final = "/etc/dkms/framework.conf.d/gpuhost-mok-signing.conf"

#: What mokutil --test-key prints, by what it means (mokutil 0.6.0, src/mokutil.c test_key()
#: and print_skip_message(); unchanged up to 0.7.2 and in lcp/mokutil's master). Each line
#: starts with the path as given. The exit status is not used: 0.6.0 to 0.7.2 (Debian 12's
#: mokutil is 0.6.0-2) exit 0 for "is not enrolled" and 1 for "is already enrolled", and
#: mokutil's master since 2025 (commits 4d2b704, 9ae73db) the other way round.
TEST_KEY_ANSWERS: Final = (
    (" is not enrolled", "not-enrolled"),
    (" is already enrolled", "enrolled"),
    (" is already in db", "in-db"),
    (" is already in the enrollment request", "pending"),
    (" is blocked in dbx", "blocked"),
    (" is blocked in MokListXRT", "blocked"),
    (" is already in the built-in trusted keyring", "built-in"),
)
#: mokutil's errors, printed on stderr before any answer (same source).
TEST_KEY_ERRORS: Final = (
    ("Not a valid x509 certificate", "not-a-certificate"),
    ("Failed to open ", "unreadable"),
    ("Failed to read ", "unreadable"),
    ("EFI variables are not supported on this system", "no-efi"),
)
#: The answers that make modules signed with the key load: the MOK list (MokListRT) is what
#: shim hands the kernel; the kernel's own key needs nothing more.
TRUSTED: Final = ("enrolled", "built-in")


# --- facts -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SecureBootState:
    """The Secure Boot state of a host: ``enabled`` (None: it cannot be told), where it was read
    (``source``: "mokutil", "efivarfs" or "none") and what was read, for messages (``said``)."""

    enabled: bool | None
    source: str
    said: str

    def summary(self) -> str:
        """One phrase for the log: "Secure Boot enabled (mokutil --sb-state: SecureBoot
        enabled)"."""
        word = {True: "enabled", False: "off", None: "unknown"}[self.enabled]
        return f"Secure Boot {word} ({self.said})"


class SecureBoot(FactBase[SecureBootState]):
    """Whether Secure Boot is enabled: ``mokutil --sb-state`` where mokutil is installed, else
    the EFI variables SecureBoot and SetupMode in efivarfs, else no EFI (legacy boot).

    .. code:: python

        SecureBootState(enabled=True, source="mokutil",
                        said="mokutil --sb-state: SecureBoot enabled")

    mokutil's words (mokutil 0.6.0 to 0.7.2, src/mokutil.c sb_state()): "SecureBoot enabled"
    (with SecureBoot = 1 and SetupMode = 0), then "SecureBoot validation is disabled in shim"
    when shim's MokSBStateRT exists; "SecureBoot disabled", then "Platform is in Setup Mode"
    when SetupMode = 1; "Cannot determine secure boot state."; and, before any of them, "EFI
    variables are not supported on this system" (no EFI: exit 1) or "This system doesn't support
    Secure Boot" (no SecureBoot variable). Shim's validation disabled counts as off: the kernel
    then boots as without Secure Boot (efi_get_secureboot(), drivers/firmware/efi/libstub/
    secureboot.c) and loads unsigned modules.

    efivarfs (Documentation/filesystems/efivarfs.rst): each file holds 4 bytes of the variable's
    attributes (little-endian), then its data; SecureBoot and SetupMode are one byte each
    (UEFI specification, "Globally Defined Variables"). Enabled when SecureBoot is 1 and
    SetupMode 0, as mokutil and the kernel's efi_get_secureboot_mode() decide.
    """

    @override
    def command(self) -> str:
        reads = "; ".join(
            f'f={EFIVARS}/{name}-{EFI_GLOBAL_VARIABLE}; if [ -r "$f" ]; then '
            f'echo "{name}=$(od -An -v -tu1 "$f" | tr -s " \\n" "  ")"; '
            f'else echo "{name}=absent"; fi'
            for name in ("SecureBoot", "SetupMode")
        )
        return (
            "if command -v mokutil >/dev/null 2>&1; then echo source=mokutil; "
            'LC_ALL=C mokutil --sb-state 2>&1; echo "rc=$?"; '
            f"elif [ -d /sys/firmware/efi ]; then echo source=efivarfs; {reads}; "
            "else echo source=none; fi"
        )

    @override
    def process(self, output: list[str]) -> SecureBootState:
        return parse_sb_state(output)


def parse_sb_state(output: list[str]) -> SecureBootState:
    """Parse :class:`SecureBoot`'s output (a ``source=`` line, then mokutil's lines and
    ``rc=N``, or ``SecureBoot=``/``SetupMode=`` lines of byte values, or nothing)."""
    lines = [line.strip() for line in output if line.strip()]
    source = lines[0].partition("=")[2] if lines and lines[0].startswith("source=") else ""
    body = lines[1:]
    if source == "mokutil":
        said = [line for line in body if not line.startswith("rc=")]
        shown = "mokutil --sb-state: " + ("; ".join(said) or "no answer")
        if "EFI variables are not supported on this system" in said:
            return SecureBootState(False, source, "no EFI: legacy boot, no Secure Boot")
        if "This system doesn't support Secure Boot" in said:
            return SecureBootState(False, source, f"{shown}: EFI without Secure Boot")
        if "SecureBoot enabled" in said:
            if "SecureBoot validation is disabled in shim" in said:
                return SecureBootState(False, source, f"{shown}: the kernel runs as without "
                                                      "Secure Boot")
            return SecureBootState(True, source, shown)
        if "SecureBoot disabled" in said:
            return SecureBootState(False, source, shown)
        return SecureBootState(None, source, shown)
    if source == "efivarfs":
        values = dict(line.split("=", 1) for line in body if "=" in line)
        secure_boot = _efi_value(values.get("SecureBoot", "absent"))
        setup_mode = _efi_value(values.get("SetupMode", "absent"))
        shown = (f"efivarfs: SecureBoot {_shown(secure_boot)}, "
                 f"SetupMode {_shown(setup_mode)}")
        if values.get("SecureBoot", "absent") == "absent":
            return SecureBootState(False, source, f"{shown}: EFI without Secure Boot")
        if secure_boot == 0 or setup_mode == 1:
            return SecureBootState(False, source, shown)
        if secure_boot == 1 and setup_mode == 0:
            return SecureBootState(True, source, shown)
        return SecureBootState(None, source, shown)
    if source == "none":
        return SecureBootState(False, source, "no EFI: legacy boot, no Secure Boot")
    return SecureBootState(None, "none", f"unreadable answer: {' / '.join(lines) or 'nothing'}")


def _efi_value(text: str) -> int | None:
    """A variable's value from efivarfs bytes ("6 0 0 0 1"): the data after the 4 attribute
    bytes, little-endian, of 1, 2 or 4 bytes as mokutil accepts; None otherwise."""
    try:
        data = [int(b) for b in text.split()]
    except ValueError:
        return None
    value = data[4:]
    if len(data) < 5 or len(value) not in (1, 2, 4) or any(not 0 <= b <= 255 for b in data):
        return None
    return int.from_bytes(bytes(value), "little")


def _shown(value: int | None) -> str:
    return "unreadable" if value is None else str(value)


@dataclass(frozen=True)
class Enrolment:
    """What ``mokutil --test-key CERT`` says of a certificate: ``status`` is one of
    "enrolled", "not-enrolled", "pending" (in the enrolment request, confirmed at the next
    boot's console), "in-db" (in the firmware's db, not the MOK list), "blocked", "built-in"
    (the kernel's own key), "not-a-certificate" (not DER X.509), "unreadable", "no-efi",
    "no-mokutil" or "unknown"; ``said``: mokutil's words."""

    status: str
    said: str

    @property
    def trusted(self) -> bool:
        return self.status in TRUSTED


class MokEnrolment(FactBase[Enrolment]):
    """Whether a DER certificate is enrolled as a MOK (``mokutil --test-key``), read by its
    words (see :data:`TEST_KEY_ANSWERS`), never by mokutil's exit status.

    .. code:: python

        Enrolment(status="enrolled", said="/root/mok/MOK.der is already enrolled")
    """

    @override
    def command(self, path: str) -> str:
        quoted = shlex.quote(path)
        return ("if command -v mokutil >/dev/null 2>&1; then "
                f'LC_ALL=C mokutil --test-key {quoted} 2>&1; echo "rc=$?"; '
                "else echo mokutil=absent; fi")

    @override
    def process(self, output: list[str]) -> Enrolment:
        return parse_test_key(output)


def parse_test_key(output: list[str]) -> Enrolment:
    """Parse :class:`MokEnrolment`'s output (mokutil's lines, then ``rc=N``)."""
    lines = [line.strip() for line in output if line.strip() and not line.startswith("rc=")]
    if lines == ["mokutil=absent"]:
        return Enrolment("no-mokutil", "mokutil is not installed")
    said = "; ".join(lines) or "no answer"
    for line in lines:
        for start, status in TEST_KEY_ERRORS:
            if line.startswith(start):
                return Enrolment(status, said)
    for line in lines:
        for end, status in TEST_KEY_ANSWERS:
            if line.endswith(end):
                return Enrolment(status, said)
    return Enrolment("unknown", said)


# --- the decision ------------------------------------------------------------------------------


@dataclass(frozen=True)
class SigningPlan:
    """What Secure Boot asks of the NVIDIA stage on one host: ``refusals`` (empty: it may go
    on), ``notes`` to log, and ``sign``: DKMS's signing configuration names host data's key."""

    refusals: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    sign: bool = False


def _enrol_advice(cert: str) -> str:
    return (f"enrol it: mokutil --import {cert} (it asks for a one-time password), reboot, "
            "and confirm the enrolment with that password at the console (MokManager), then "
            "run again")


def plan_signing(
    settings: Settings,
    *,
    state: SecureBootState,
    builds: bool,
    key: Any = None,
    cert: Any = None,
    enrolment: Enrolment | None = None,
) -> SigningPlan:
    """Decide, from facts, whether the NVIDIA stage may build the driver under Secure Boot
    (no side effects).

    + state: the host's :class:`SecureBootState`
    + builds: the stage installs or changes the driver, so that DKMS builds its module
    + key, cert: pyinfra ``File`` facts of gpuhost_mok_signing_key and gpuhost_mok_certificate
      (a dict, None: absent, False: not a regular file); read only when host data names them
    + enrolment: :class:`Enrolment` of the certificate; read only when Secure Boot is not off

    Refuses a DKMS build under Secure Boot (or where its state cannot be told) unless host data
    names a signing key and certificate; refuses named files that are missing, a key that is
    not root-only (mode 0600 or 0400), a certificate that is not enrolled in the MOK list.
    DKMS itself generates a new key where the named one is missing (dkms.in,
    prepare_signing()): that key would not be enrolled, so a missing file is never let through.
    """
    named = settings.mok_signing_key is not None and settings.mok_certificate is not None
    refusals: list[str] = []
    notes: list[str] = []
    if not named:
        if builds and state.enabled is not False:
            what = ("Secure Boot is enabled" if state.enabled else
                    "whether Secure Boot is enabled cannot be told")
            refusals.append(
                f"{what} ({state.said}) and the NVIDIA driver's kernel module would be built by "
                "DKMS: under Secure Boot the kernel loads only modules signed with a key it "
                "trusts, so the host would come back from its reboot without a driver. Either "
                "enrol a MOK key (mokutil --import CERT.der, then confirm it at the console at "
                f"the next boot) and name it in host data: {PREFIX}mok_signing_key (the private "
                f"key, root-only) and {PREFIX}mok_certificate (its DER certificate; DKMS's own "
                "/var/lib/dkms/mok.key and /var/lib/dkms/mok.pub do, once enrolled); or disable "
                "Secure Boot in the firmware")
        elif state.enabled and not builds:
            notes.append(f"{state.summary()}; the driver is not built in this run")
        return SigningPlan(tuple(refusals), tuple(notes))

    key_path, cert_path = settings.mok_signing_key, settings.mok_certificate
    allowed = "a file on the host owned by root with mode 0600 or 0400"
    if key is None or key is False:
        why = "it does not exist" if key is None else "it is not a regular file"
        refusals.append(f"{PREFIX}mok_signing_key = {key_path!r} is not allowed: {allowed} "
                        f"({why}; DKMS would generate a new key there, which no MOK list "
                        "holds)")
    elif key.get("user") != "root" or int(key.get("mode") or 0) % 100 != 0:
        refusals.append(f"{PREFIX}mok_signing_key = {key_path!r} is not allowed: {allowed} (it "
                        f"is owned by {key.get('user')} with mode {key.get('mode')}): "
                        f"chown root:root {key_path} && chmod 0600 {key_path}")
    if cert is None or cert is False:
        why = "it does not exist" if cert is None else "it is not a regular file"
        refusals.append(f"{PREFIX}mok_certificate = {cert_path!r} is not allowed: the DER "
                        f"certificate of {PREFIX}mok_signing_key, a file on the host ({why})")
    elif state.enabled is False:
        notes.append(f"{state.summary()}: DKMS signs the module with {cert_path} all the same; "
                     "its enrolment is not checked")
    elif enrolment is not None and not enrolment.trusted:
        refusals.append(_enrolment_refusal(state, cert_path, enrolment))
    elif enrolment is not None:
        notes.append(f"{state.summary()}: DKMS signs the module with {key_path} "
                     f"({enrolment.said})")
    return SigningPlan(tuple(refusals), tuple(notes), sign=not refusals)


def _enrolment_refusal(state: SecureBootState, cert: str, enrolment: Enrolment) -> str:
    head = (f"{state.summary()} and {PREFIX}mok_certificate = {cert!r} is not enrolled as a "
            f"MOK (mokutil --test-key: {enrolment.said}): modules signed with it would not "
            "load")
    advice = {
        "not-enrolled": _enrol_advice(cert),
        "pending": ("its enrolment is requested but not confirmed: reboot the host and confirm "
                    "it with the password given to mokutil --import at the console "
                    "(MokManager), then run again"),
        "in-db": ("it is in the firmware's db, not in the MOK list the kernel trusts for "
                  "modules: " + _enrol_advice(cert)),
        "blocked": "it is blocked (dbx or MokListX): make a new key and certificate and enrol "
                   "those",
        "not-a-certificate": ("mokutil reads DER X.509 certificates only: convert it "
                              f"(openssl x509 -in CERT.pem -outform DER -out {cert}) or name "
                              "the DER one"),
        "unreadable": "mokutil could not read it: check the path and its permissions",
        "no-efi": "mokutil sees no EFI variables on this host",
        "no-mokutil": ("mokutil is not installed, and gpuhost checks the enrolment with "
                       "mokutil --test-key: install it (apt-get install mokutil), then run "
                       "again"),
    }.get(enrolment.status, "check the enrolment with mokutil --test-key by hand")
    return f"{head}; {advice}"


# --- the stage's part --------------------------------------------------------------------------


def secure_boot_signing(settings: Settings, *, builds: bool) -> SigningPlan:
    """Read the facts :func:`plan_signing` needs (the certificate's enrolment only where host
    data names a key and Secure Boot is not off) and decide."""
    state = fact(SecureBoot)
    if settings.mok_signing_key is None or settings.mok_certificate is None:
        return plan_signing(settings, state=state, builds=builds)
    key = fact(File, path=settings.mok_signing_key)
    cert = fact(File, path=settings.mok_certificate)
    enrolment = None
    if state.enabled is not False and cert:
        enrolment = fact(MokEnrolment, path=settings.mok_certificate)
    return plan_signing(settings, state=state, builds=builds, key=key, cert=cert,
                        enrolment=enrolment)


def dkms_signing(settings: Settings, plan: SigningPlan) -> None:
    """DKMS's signing configuration (:data:`DKMS_SIGNING_CONF`, templates/
    dkms-mok-signing.conf.j2): present, naming gpuhost_mok_signing_key and
    gpuhost_mok_certificate, where host data names them; absent otherwise. Written before the
    driver's packages install, whose postinst has DKMS build (and sign) the module; kept for the
    builds DKMS makes at later kernel upgrades."""
    for note in plan.notes:
        logger.info(f"{host.print_prefix}NVIDIA: {note}")
    if plan.sign:
        files.template(
            name="DKMS signs kernel modules with the MOK of host data",
            src=str(_templates() / "dkms-mok-signing.conf.j2"),
            dest=DKMS_SIGNING_CONF,
            mode="644",
            mok_signing_key=settings.mok_signing_key,
            mok_certificate=settings.mok_certificate,
        )
    else:
        files.file(name="No DKMS signing configuration (host data names no MOK)",
                   path=DKMS_SIGNING_CONF, present=False)


def _templates() -> Path:
    return REPO_ROOT / "templates"
