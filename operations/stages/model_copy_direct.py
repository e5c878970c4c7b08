"""Copy a model's weights from a peer straight into the host, over the network the hosts share.

Where a peer has a ``gpuhost_fleet_address`` (the address on the network the fleet's hosts
share: the lab switch in the sandbox), the fresh host pulls the peer's model folder itself,
with rsync over SSH, instead of through the controller. It uses the copy key
(operations/stages/model_copy.py), which the peer allows only as ``rrsync -ro`` of its model folder:
the private half is written on the host for this copy alone, root-only (``umask 077`` in a
0700 folder under /run, a tmpfs gone at a reboot), read from the controller's stdin over the
deploy's own SSH login (never on a command line), and removed when the copy ends, however it
ends (the script's EXIT trap). The session's stdin stays open for as long as the run that
started the copy lives: when it ends (a ``kill -9`` of the controller closes it too), rsync
is stopped (:data:`WATCH`), not left copying into a host nobody deploys. It is never a login key: the peer's ``authorized_keys`` forces
rrsync for it.

The peer's host key is pinned as the controller knows it: the lines ``ssh-keygen -F`` finds
for the peer's SSH address in the controller's known-hosts file (ssh-keygen(1), ``-F
hostname``: hashed or not), written for the fleet address. Before anything is written the host
checks that the peer's sshd answers on the fleet address within
:data:`REACH_TIMEOUT_S` (a TCP connect): a peer it cannot reach is copied from through the
controller (model_copy.py), exit :data:`UNREACHABLE` here (sysexits.h's EX_TEMPFAIL; rsync's
own exit values stop at 35, rsync(1) EXIT VALUES).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from typing import Final

#: Seconds the host waits for the peer's sshd to accept a TCP connection on the fleet address.
REACH_TIMEOUT_S: Final = 3
#: The script's exit status when the peer does not answer on the fleet address.
UNREACHABLE: Final = 75
#: The folder the copy key lives in on the host while it copies.
KEY_DIR: Final = "/run/gpuhost-model-copy"

#: Runs rsync (its argv) until it ends or stdin ends (the deploy's SSH session closed: the run
#: that started the copy is gone, a ``kill -9`` of it included), then SIGTERM to rsync, which
#: keeps its partial file (rsync(1), --partial) for the next run; exit 143 then.
WATCH: Final = """import os, select, subprocess, sys
child = subprocess.Popen(sys.argv[1:], stdin=subprocess.DEVNULL)
while True:
    try:
        sys.exit(child.wait(timeout=1))
    except subprocess.TimeoutExpired:
        pass
    if select.select([0], [], [], 0)[0] and not os.read(0, 4096):
        child.terminate()
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
        print("the run that started this copy is gone: copy stopped", file=sys.stderr)
        sys.exit(143)
"""

#: $1 peer address, $2 its SSH port, $3 the peer's folder (under its rrsync root), $4 the
#: host's folder, $5 StrictHostKeyChecking, $6 known-hosts lines, $7 the files to copy (one a
#: line: rsync's --files-from), then rsync's own flags; the key on stdin, read up to its
#: ``-----END`` line, the session's stdin then watched (:data:`WATCH`). LC_ALL=C: rsync's
#: progress numbers in the format model_copy_rsync.py reads.
SCRIPT: Final = f"""set -u
export LC_ALL=C
addr=$1 port=$2 src=$3 dest=$4 check=$5 known=$6 list=$7
shift 7
if ! python3 -c 'import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), {REACH_TIMEOUT_S}).close()' \\
        "$addr" "$port" 2>/dev/null; then
    echo "$addr port $port does not answer from $(hostname)" >&2
    exit {UNREACHABLE}
fi
dir={KEY_DIR}
umask 077
rm -rf "$dir"
trap 'rm -rf "$dir"' EXIT
trap 'exit 130' HUP INT TERM
mkdir -m 700 "$dir"
: > "$dir/key"
while IFS= read -r line; do
    printf '%s\\n' "$line" >> "$dir/key"
    case $line in "-----END "*) break ;; esac
done
printf '%s\\n' "$known" > "$dir/known_hosts"
printf '%s\\n' "$list" > "$dir/files"
umask 022
mkdir -p "$dest"
case $addr in *:*) at="[$addr]" ;; *) at=$addr ;; esac
python3 -c {shlex.quote(WATCH)} rsync "$@" --files-from="$dir/files" \\
    -e "ssh -i $dir/key -o IdentitiesOnly=yes -o BatchMode=yes -o ConnectTimeout=10 \\
-o UserKnownHostsFile=$dir/known_hosts -o StrictHostKeyChecking=$check -p $port" \\
    "gpuhost-models@$at:$src/" "$dest/"
"""


def known_hosts_for(address: str, port: int, fleet_address: str, known_hosts: str | None
                    ) -> str:
    """The controller's known-hosts lines for a peer's SSH ``address`` (and ``port``), written
    for its ``fleet_address``: ``"<fleet address> <key type> <key>"`` per line, "" when the
    controller knows none (``known_hosts``: host data's ``ssh_known_hosts_file``, else
    ~/.ssh/known_hosts, as ssh reads)."""
    path = os.path.expanduser(known_hosts or "~/.ssh/known_hosts")
    name = address if port == 22 else f"[{address}]:{port}"
    mine = fleet_address if port == 22 else f"[{fleet_address}]:{port}"
    found = subprocess.run(["ssh-keygen", "-F", name, "-f", path], capture_output=True,
                           text=True, check=False).stdout
    lines = []
    for line in found.splitlines():
        fields = line.split()
        if line.startswith("#") or len(fields) < 3:
            continue
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if marker is not None:  # @revoked or @cert-authority: not a pinned key of this host
            continue
        lines.append(" ".join([mine, *fields[1:3]]))
    return "\n".join(lines)


def command(remote_prefix: str, peer_address: str, port: int, src: str, dest: str,
            strict_host_key_checking: str, known: str, rsync_flags: list[str],
            files: list[str]) -> str:
    """The command line the deploy's SSH login runs on the host (``remote_prefix``: ``sudo -n``
    for a sudo user, else empty); ``files``: the peer's files to copy (verified there)."""
    argv = ["sh", "-c", SCRIPT, "gpuhost-model-copy", peer_address, str(port), src, dest,
            "yes" if known else strict_host_key_checking, known, "\n".join(files), *rsync_flags]
    return " ".join(filter(None, [remote_prefix, shlex.join(argv)]))
