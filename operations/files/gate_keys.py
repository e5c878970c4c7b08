"""The API gate's keys as an nginx include file: read from their root-only key files
(secret_file.py's rules) and written, root-only, where the gate's nginx configuration includes
it (operations/stages/gate.py, templates/gate-nginx.conf.j2).

    python3 gate_keys.py --out FILE --key-file KEY [--key-file KEY...] [--backend-key-file KEY]

Writes three maps (nginx's ngx_http_map_module), atomically (a temporary file renamed over
FILE, mode 0600, so nginx reads it whole and nobody but root reads it at all):

- ``$gpuhost_key_ok``: 1 where ``$http_authorization`` is ``Bearer <a key>`` (the scheme in
  any case, RFC 9110 section 11.1; the key byte for byte: every character other than a letter
  or a digit as a PCRE ``\\xHH`` escape, so that no key character is read as syntax);
- ``$gpuhost_keys_read``: 1, or 0 when a key file cannot be used (missing, a symlink, not one
  line of header-safe text): the gate then answers 503 to every request that needs the key,
  as the home-made gate did, and the reason goes to the journal (this script's stderr, under
  the gate's unit: it runs as ExecStartPre and ExecReload), never the content;
- ``$gpuhost_backend_authorization``: ``Bearer <the backend key>`` (the router's gate hands
  smg the fleet key), empty without ``--backend-key-file`` (nginx then sends no
  Authorization: a client's key never reaches the server).

A reason is printed once per change of state (FILE.state remembers the last one), and the
recovery too ("the key file ... is readable again"). Exit 0 whatever the keys say (the gate
starts and refuses); 1 only when FILE cannot be written.

Standard library only, beside secret_file.py; Python 3.10 and newer (the host's python3).
"""

from __future__ import annotations

import argparse
import os
import sys

from secret_file import SecretFileError, read_secret


def pcre_literal(text: str) -> str:
    """``text`` as a PCRE pattern matching exactly it: letters and digits as they are, every
    other character as ``\\xHH`` (PCRE2's pattern syntax, "Non-printing characters"). Inside an
    nginx quoted string ``\\x`` is kept as it is (only ``\\"``, ``\\'``, ``\\\\``, ``\\t``,
    ``\\r``, ``\\n`` are unescaped: ngx_conf_file.c, ngx_conf_read_token)."""
    return "".join(c if c.isascii() and c.isalnum() else f"\\x{ord(c):02x}" for c in text)


def bearer_pattern(key: str) -> str:
    """The map entry's source: a case-sensitive regular expression for ``Bearer <key>``."""
    scheme = "".join(f"[{c.upper()}{c.lower()}]" for c in "bearer")
    return f"~^{scheme}[ ]+{pcre_literal(key)}[ ]*$"


def render(keys: list[str], ok: bool, backend: str | None) -> str:
    lines = ["# Written by gpuhost's gate_keys.py from the key files; root's alone.",
             "map $http_authorization $gpuhost_key_ok {", "    default 0;"]
    lines += [f'    "{bearer_pattern(k)}" 1;' for k in keys]
    lines += ["}", "map $request_method $gpuhost_keys_read {", f"    default {int(ok)};", "}",
              "map $request_method $gpuhost_backend_authorization {"]
    # a header-safe key (VCHAR) holds no quote nginx would end the string at: escape them
    value = f"Bearer {backend}".replace("\\", "\\\\").replace('"', '\\"') if backend else ""
    lines += [f'    default "{value}";', "}", ""]
    return "\n".join(lines)


def write(path: str, text: str) -> None:
    tmp = f"{path}.new"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, text.encode("ascii"))
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--key-file", action="append", required=True)
    parser.add_argument("--backend-key-file")
    args = parser.parse_args()
    keys, problems = [], []
    for path in args.key_file:
        try:
            keys.append(read_secret(path, "key file"))
        except SecretFileError as exc:
            problems.append(str(exc))
    backend = None
    if args.backend_key_file:
        try:
            backend = read_secret(args.backend_key_file, "backend key file")
        except SecretFileError as exc:
            problems.append(str(exc))
    ok = not problems
    state_file = f"{args.out}.state"
    try:
        with open(state_file) as fh:
            before = fh.read()
    except OSError:
        before = ""
    now = "\n".join(problems)
    if now != before:
        for why in problems:
            print(f"refusing every request that needs the key (503): {why}", file=sys.stderr)
        if not problems and before:
            for line in before.splitlines():
                name = line.split(" cannot be read")[0].split(" is ")[0]
                print(f"{name} is readable again", file=sys.stderr)
    try:
        write(args.out, render(keys if ok else [], ok, backend if ok else None))
        write(state_file, now)
    except OSError as exc:
        print(f"cannot write {args.out}: {exc.strerror}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
