"""The fleet's metrics credentials, made on the host from a root-only key file: the key never
leaves the host, and no file written here is readable by anyone but root and one group.

Two files, each written whole (a temporary file renamed over it), owned by root and the group
given (``prometheus``: Debian's and Ubuntu's node exporter and Prometheus run as that user, their
units' ``User=prometheus``), mode 0640:

- ``copy KEY DEST GROUP``: DEST holds KEY's secret, one line. The Prometheus host's copy of the
  fleet key, which Prometheus sends to the workers' API key gates (``authorization:
  credentials_file:`` of prometheus.yml) and, as the metrics password (the node exporters'
  and Prometheus' own web), its :func:`password` (``basic_auth: password_file:``).
- ``web-config KEY DEST USER GROUP``: DEST is the node exporter's (or Prometheus') web
  configuration
  (exporter-toolkit's ``--web.config.file``, node exporter 1.5.0: ``basic_auth_users``, a
  user name and the bcrypt hash of its password; exporter-toolkit's docs/web-configuration.md),
  with USER and the bcrypt hash of :func:`password`. bcrypt from the distribution's
  python3-bcrypt (pyca/bcrypt), cost 10 (exporter-toolkit's docs: the hash is checked at each
  request, and a higher cost slows every scrape).
- ``password KEY DEST GROUP``: DEST holds :func:`password`, for Prometheus' ``password_file``.

With ``--check`` first, nothing is written: one line of JSON says whether DEST is already what
it would write (``{"current": true}``), or why not (``{"current": false, "why": "..."}``), never
a secret. A bcrypt hash has a random salt, so a web configuration is current when its hash
checks against the password, not when its bytes are equal.

Why a password derived from the key, not the key itself: bcrypt reads at most 72 bytes of a
password (pyca/bcrypt refuses longer ones from 5.0; Go's x/crypto/bcrypt, which the node
exporter uses, ignored the rest before 2023), and a fleet key may be up to 4096 characters
(secret_file.py). HMAC-SHA256 of the key is 64 hex characters, and knowing it (the Prometheus
user can) gives no way through the workers' gates.

Standard library only but for bcrypt; Python 3.10 and newer. Sent as ``python3 -c``
(operations/stages/metrics_auth.py), so nothing needs shipping first.
"""

from __future__ import annotations

import grp
import hashlib
import hmac
import json
import os
import stat
import sys

#: The purpose the metrics password is derived for (HMAC-SHA256's message).
PURPOSE = b"gpuhost node exporter basic auth"
#: bcrypt's cost (exporter-toolkit's docs/web-configuration.md example: cost 10).
COST = 10
MODE = 0o640


class CredentialError(ValueError):
    """A key file that cannot be used; the message names the file, never its content."""


def read_key(path: str) -> str:
    """The key ``path`` holds, without its line ending (secret_file.py's rule: one line)."""
    try:
        with open(path, "rb") as f:
            data = f.read(8192)
    except OSError as exc:
        raise CredentialError(f"the key file {path} cannot be read: {exc.strerror}") from None
    text = data.rstrip(b"\r\n")
    if not text or b"\n" in text:
        raise CredentialError(f"the key file {path} is not one line of text")
    return text.decode("ascii", "replace")


def password(key: str) -> str:
    """The metrics password: HMAC-SHA256 of the key, 64 hex characters."""
    return hmac.new(key.encode(), PURPOSE, hashlib.sha256).hexdigest()


def web_config(user: str, hashed: str) -> str:
    """exporter-toolkit's web configuration with one user (YAML; the hash single-quoted)."""
    return ("# Managed by gpuhost (operations/stages/metrics_auth.py): the node exporter credential.\n"
            f"basic_auth_users:\n  {user}: '{hashed}'\n")


def _hash_in(text: str, user: str) -> str | None:
    prefix = f"  {user}: '"
    for line in text.splitlines():
        if line.startswith(prefix) and line.endswith("'"):
            return line[len(prefix):-1]
    return None


def _owned(dest: str, group: str) -> str | None:
    """Why ``dest`` is not a regular file of root and ``group`` with MODE, or None."""
    try:
        st = os.lstat(dest)
    except FileNotFoundError:
        return "it does not exist"
    if not stat.S_ISREG(st.st_mode):
        return "it is not a regular file"
    try:
        gid = grp.getgrnam(group).gr_gid
    except KeyError:
        return f"group {group} does not exist"
    if st.st_uid != 0 or st.st_gid != gid or stat.S_IMODE(st.st_mode) != MODE:
        return f"it is not root:{group} {MODE:o}"
    return None


def _read(dest: str) -> str:
    with open(dest, encoding="utf-8", errors="replace") as f:
        return f.read()


def check(mode: str, key: str, dest: str, group: str, user: str = "") -> str | None:
    """Why ``dest`` is not what ``mode`` would write from ``key``, or None."""
    why = _owned(dest, group)
    if why:
        return why
    text = _read(dest)
    if mode == "copy":
        return None if hmac.compare_digest(text, key + "\n") else "it holds another key"
    if mode == "password":
        return None if hmac.compare_digest(text, password(key) + "\n") else \
            "it holds another password"
    hashed = _hash_in(text, user)
    if hashed is None:
        return f"it has no user {user}"
    try:
        import bcrypt
    except ImportError:
        return "bcrypt (python3-bcrypt) is not installed"
    try:
        ok = bcrypt.checkpw(password(key).encode(), hashed.encode())
    except ValueError:
        ok = False
    return None if ok else "its hash is another password's"


def content(mode: str, key: str, user: str = "") -> str:
    if mode == "copy":
        return key + "\n"
    if mode == "password":
        return password(key) + "\n"
    import bcrypt

    hashed = bcrypt.hashpw(password(key).encode(), bcrypt.gensalt(COST)).decode()
    return web_config(user, hashed)


def write(dest: str, text: str, group: str) -> None:
    """``text`` to ``dest`` whole: a temporary file beside it, root:group MODE, renamed."""
    gid = grp.getgrnam(group).gr_gid
    tmp = f"{dest}.gpuhost-new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, 0, gid)
        os.fchmod(fd, MODE)
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, dest)


def main(argv: list[str]) -> int:
    checking = argv[:1] == ["--check"]
    args = argv[1:] if checking else argv
    if len(args) < 4 or args[0] not in ("copy", "password", "web-config") \
            or (args[0] == "web-config") != (len(args) == 5):
        sys.stderr.write("usage: metrics_credentials.py [--check] copy|password KEY DEST GROUP"
                         " | web-config KEY DEST USER GROUP\n")
        return 2
    mode, key_file, dest = args[:3]
    user, group = (args[3], args[4]) if mode == "web-config" else ("", args[3])
    try:
        key = read_key(key_file)
    except CredentialError as exc:
        if checking:
            print(json.dumps({"current": False, "why": str(exc)}))
            return 0
        sys.stderr.write(f"gpuhost: {exc}\n")
        return 1
    if checking:
        why = check(mode, key, dest, group, user)
        print(json.dumps({"current": why is None, "why": why}))
        return 0
    write(dest, content(mode, key, user), group)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
