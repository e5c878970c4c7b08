"""Start the router (smg 1.13.0) with its keys read from root-only files, never from its
command line.

    <router venv>/bin/python router_launch.py --api-key-file F --control-key-file G -- ARGS

smg takes its keys only as flags (``--api-key``, ``--control-plane-api-keys``; its ``launch
--help``, no environment variable): on a command line they would be in ``/proc/<pid>/cmdline``
for every local user, in the unit file and in ``systemctl show``. Here they join smg's own
argument list in this process (``smg.launch_router.parse_router_args`` and
``launch_router``, what ``smg launch`` calls), so the process's command line names the files
only, and smg then sets its title to ``smg::router``. smg logs neither key (seen: its
start-up log names its host, port and mode).

- ``--api-key``: what smg requires of every request on its generation paths (``Authorization:
  Bearer``; ``/health`` and ``/v1/models`` stay open, seen) and what it sends the workers of
  ``--worker-urls``; gpuhost names no ``--worker-urls``: every worker is added through the
  control plane with a key of its own (router_workers.py).
- ``--control-plane-api-keys id:name:role:key``: the only credential ``/workers`` (list, add,
  remove) accepts once set (seen: the ``--api-key`` gets 401 there, the control key 401 on the
  generation paths); role ``admin``.

Runs with the router venv's python (smg importable), standard library besides.
"""

from __future__ import annotations

import argparse
import sys

from secret_file import SecretFileError, read_secret

#: The control-plane key's id and name in smg's ``id:name:role:key``.
CONTROL_ID = "gpuhost-deploy"
CONTROL_NAME = "gpuhost deploy"


def router_args(api_key: str, control_key: str, args: list[str]) -> list[str]:
    """smg's argument list: ``args`` with the keys added. The key joins its flag with ``=``:
    smg's parser is argparse's (smg 1.13.0 router_args.py, ``--api-key`` of ``type=str``),
    which reads a separate value that starts with ``-`` as a flag and stops ("argument
    --api-key: expected one argument"), and ``secrets.token_urlsafe``, docs/security.md's way
    of making a key, starts one key in 64 with ``-`` (seen: a sandbox fleet key ``-QW...``)."""
    return [*args, f"--api-key={api_key}",
            "--control-plane-api-keys", f"{CONTROL_ID}:{CONTROL_NAME}:admin:{control_key}"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api-key-file", required=True)
    parser.add_argument("--control-key-file", required=True)
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then smg launch's flags")
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    try:
        api_key = read_secret(ns.api_key_file, "API key file")
        control_key = read_secret(ns.control_key_file, "control-plane key file")
    except SecretFileError as exc:
        print(f"router_launch: {exc}", file=sys.stderr)
        return 1
    from smg.launch_router import launch_router, parse_router_args

    launch_router(parse_router_args(router_args(api_key, control_key, args)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
