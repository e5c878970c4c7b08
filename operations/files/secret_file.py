"""Secret files on the GPU host (the API key file, the Hub token file): what they may hold, read
without ever showing their content.

A secret file holds one line of header-safe text: 1 to MAX_CHARS visible US-ASCII characters
(RFC 9110 section 5.5 field-vchar without obs-text, i.e. RFC 5234's VCHAR, 0x21-0x7E: no space,
tab or other control character, nothing outside ASCII), optionally followed by one newline or
CRLF. That is what ``Authorization: Bearer <secret>`` can carry through every client and
server between here and the user (RFC 6750 section 2.1's b64token is a subset), and what
Python's http.client sends as it is (it encodes header values as Latin-1 and refuses CR and LF).

Used three ways, always on the host:

- imported by gate_keys.py, health_check.py and model_fetch.py (shipped beside them):
  :func:`read_secret` raises :class:`SecretFileError`, whose message names the file and says
  what is wrong, never what it holds;
- while planning (operations/secret_file.py sends this file as ``python3 -c``), run as
  ``--check PATH``: one line of JSON, a verdict and no content:
  ``{"type": "file", "user": "root", "mode": "600", "problem": null}``.

Standard library only; Python 3.10 and newer (the host's python3 or the ML venv's).
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import stat
import sys

#: Characters at most: "Authorization: Bearer " and the secret stay well inside the 8 KiB a
#: header line may have at common servers (nginx large_client_header_buffers 4 8k, Apache
#: LimitRequestFieldSize 8190), the gates' nginx among them (operations/stages/gate.py).
MAX_CHARS = 4096
#: What a secret file may hold, for messages.
ALLOWED = (f"one line of 1 to {MAX_CHARS} visible ASCII characters (RFC 9110 VCHAR, 0x21-0x7E: "
           "no spaces, tabs or other control characters, no non-ASCII), optionally ending in "
           "one newline or CRLF")


class SecretFileError(ValueError):
    """A secret file that cannot be used; the message names the file, never its content."""


def problem(data: bytes) -> str | None:
    """Why ``data`` (a secret file's bytes) is not one line of header-safe text, or None.
    The answer is one of a few fixed phrases: it never quotes the data."""
    if len(data) > MAX_CHARS + 2:  # more bytes than the longest line allowed and a CRLF
        return f"it is longer than {MAX_CHARS} characters"
    if data.endswith(b"\r\n"):
        data = data[:-2]
    elif data.endswith(b"\n"):
        data = data[:-1]
    if not data:
        return "it is empty"
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return "it is not UTF-8 text"
    lines = text.split("\n")
    if len(lines) > 1:
        return f"it has {len(lines)} lines"
    if len(text) > MAX_CHARS:
        return f"it is longer than {MAX_CHARS} characters"
    for char, what in ((" ", "a space"), ("\t", "a tab"), ("\r", "a carriage return")):
        if char in text:
            return f"it holds {what}"
    if any(not 0x21 <= ord(c) <= 0x7E for c in text):
        if any(ord(c) > 0x7F for c in text):
            return "it holds a character outside ASCII"
        return "it holds a control character"
    return None


def _read_capped(path: str) -> bytes:
    """At most MAX_CHARS + 3 bytes of ``path`` (enough to tell "too long"), not following a
    symlink (os.O_NOFOLLOW: ELOOP), refusing what is not a regular file."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | getattr(os, "O_NONBLOCK", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        chunks, left = [], MAX_CHARS + 3
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_secret(path: str, what: str = "key file") -> str:
    """The secret ``path`` holds, without its line ending.

    + path: the file (a symlink is refused)
    + what: how messages call it ("key file", "token file")

    Raises SecretFileError naming ``what`` and ``path`` when the file cannot be read (the
    error's strerror, e.g. "No such file or directory") or does not hold one line of
    header-safe text (see ALLOWED); its message never contains the content.
    """
    try:
        data = _read_capped(path)
    except OSError as exc:
        if exc.errno == errno.ELOOP and os.path.islink(path):
            raise SecretFileError(f"the {what} {path} is a symlink: name the file itself") \
                from None
        raise SecretFileError(f"the {what} {path} cannot be read: "
                              f"{exc.strerror or type(exc).__name__}") from None
    why = problem(data)
    if why:
        raise SecretFileError(f"the {what} {path} is not one line of header-safe text: {why} "
                              f"(allowed: {ALLOWED})")
    return data.decode("ascii").rstrip("\r\n")


def verdict(path: str) -> dict:
    """What planning needs to know about ``path``, and nothing of its content:
    ``type`` ("file", "symlink", "directory", "other" or "absent"), ``target`` (a symlink's),
    ``user`` and ``mode`` (owner's name, or uid where it has none; permission bits in octal,
    "600"), ``problem`` (:func:`problem`'s answer, or why it cannot be read; None when the
    content is fine)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return {"type": "absent"}
    except OSError as exc:
        return {"type": "other", "problem": f"it cannot be examined: {exc.strerror}"}
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = ""
        return {"type": "symlink", "target": target}
    kind = "file" if stat.S_ISREG(st.st_mode) else \
        "directory" if stat.S_ISDIR(st.st_mode) else "other"
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    out = {"type": kind, "user": user, "mode": format(stat.S_IMODE(st.st_mode), "o"),
           "problem": None}
    if kind == "file":
        try:
            out["problem"] = problem(_read_capped(path))
        except OSError as exc:
            out["problem"] = f"it cannot be read: {exc.strerror or type(exc).__name__}"
    return out


def describe(exc: BaseException, secrets_loaded: bool) -> str:
    """``exc`` as one line for a message: its type and, unless a secret is loaded in this
    process, its first line. An exception's text can quote a header (http.client's "Invalid
    header value b'Bearer ...'", requests' InvalidHeader): where a secret is loaded only
    OSError's own text (errno, strerror, file name) is shown."""
    name = type(exc).__name__
    if isinstance(exc, OSError) and exc.strerror:
        return f"{name}: {exc.strerror}" + (f": {exc.filename}" if exc.filename else "")
    if secrets_loaded:
        return f"{name} (its text is withheld: it may quote a secret)"
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{name}: {text}" if text else name


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] != "--check":
        print("usage: secret_file.py --check PATH", file=sys.stderr)
        return 2
    print(json.dumps(verdict(argv[1]), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
