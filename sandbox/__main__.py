"""python -m sandbox up [--hosts N] [--scenario NAME] [--host-scenario HOST=NAME ...]
[--from-image PATH] | status [--json] | ask
| link NAME up|down [--switch] | image NAME PATH | down"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sandbox import fleet_keys
from sandbox.ask import ask, said
from sandbox.lab import BOOT_TIMEOUT_S, LabError, down, link, save_image, status, up
from sandbox.layout import DEFAULT_SCENARIO, MAX_HOSTS, SSH_KEY, STATE_DIR
from sandbox.network import NetworkError
from sandbox.rootfs import RootfsError
from sandbox.services import ServiceError
from sandbox.tools import ToolError


def _print_status(hosts: list[dict[str, object]]) -> None:
    if not hosts:
        print("no sandbox lab is up (python -m sandbox up)")
        return
    for h in hosts:
        print(f"{h['name']:<8} {h['address']:<14} {h['state']}")
    # the deploys log in as the lab's sudo user (inventory/sandbox.py's ssh_user), not root
    user = hosts[0].get("ssh_user", "root")
    print(f"ssh key: {SSH_KEY}   (ssh -i {SSH_KEY} {user}@ADDRESS, as the deploys log in)")
    if any("gpuhost_router_api_key_file" in h.get("fleet_data", {}) for h in hosts):
        print(f"a fleet: the router's client key is {fleet_keys.router_key_file(STATE_DIR)} "
              "(python -m sandbox ask asks through the router with it)")


def _host_count(text: str) -> int:
    n = int(text)
    if not 1 <= n <= MAX_HOSTS:
        raise argparse.ArgumentTypeError(f"must be 1..{MAX_HOSTS}")
    return n


def _host_scenario(text: str) -> tuple[str, str]:
    name, sep, scenario = text.partition("=")
    if not sep or not name or not scenario:
        raise argparse.ArgumentTypeError(f"{text!r}: must be HOST=SCENARIO, e.g. gpu4=cpu-only")
    return name, scenario


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sandbox", description="The sandbox lab: sandbox/README.md."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="fresh hosts gpu1..gpuN, booted (takes down any previous lab)")
    p_up.add_argument("--hosts", type=_host_count, default=1, metavar="N")
    p_up.add_argument("--scenario", default=DEFAULT_SCENARIO, metavar="NAME")
    p_up.add_argument("--host-scenario", type=_host_scenario, action="append", default=[],
                      metavar="HOST=NAME",
                      help="a scenario of its own for one host, e.g. gpu4=cpu-only (repeatable)")
    p_up.add_argument("--boot-timeout", type=float, default=BOOT_TIMEOUT_S, metavar="SECONDS")
    p_up.add_argument("--from-image", type=Path, metavar="PATH",
                      help="the hosts' trees from this image (python -m sandbox image)")
    p_status = sub.add_parser("status", help="name, address, state, SSH key path")
    p_status.add_argument("--json", action="store_true", help="the list inventory/sandbox.py reads")
    sub.add_parser("down", help="stop hosts, services, namespaces; remove the host trees")
    p_ask = sub.add_parser("ask", help="print each host's /v1/models and one chat answer")
    p_ask.add_argument("--port", type=int, default=8000)
    p_link = sub.add_parser("link", help="drop a host's side of its link, or bring it back")
    p_link.add_argument("name", help="a host of this lab, e.g. gpu1")
    p_link.add_argument("state", choices=("up", "down"))
    p_link.add_argument("--switch", action="store_true",
                        help="the switch port (eth1) only: off its peers, still on this machine")
    p_image = sub.add_parser("image", help="power a host off and write its tree to an image")
    p_image.add_argument("name", help="a host of this lab, e.g. gpu1")
    p_image.add_argument("path", type=Path, help="the image file to write (a tar)")
    args = parser.parse_args(argv)
    try:
        if args.command == "up":
            _print_status(up(args.hosts, args.scenario, args.boot_timeout, args.from_image,
                             dict(args.host_scenario)))
        elif args.command == "image":
            save_image(args.name, args.path)
        elif args.command == "down":
            down()
        elif args.command == "link":
            link(args.name, args.state == "up", args.switch)
        elif args.command == "ask":
            for result in ask(args.port):
                for line in said(result):
                    print(line)
        elif args.json:
            print(json.dumps(status(), indent=2))
        else:
            _print_status(status())
    except (LabError, ToolError, RootfsError, NetworkError, ServiceError) as exc:
        print(f"sandbox: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
