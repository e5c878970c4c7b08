"""The room a model download needs, read while planning: the bytes of the revision's files not
in ``dest`` yet (as model_fetch.py counts them) and the room free on the file system ``dest``
is on (or would be: its nearest existing folder). Run by the host's python3 (stdlib only, sent
as ``python3 -c``: it runs before the venv that holds huggingface_hub exists). Prints one JSON
line, ``{"need": 1577149, "free": 2147483648, "mount": "/opt", "folder": "/opt", "unsized":
0, "weights": 1572864, "weights_unsized": 0}`` (``unsized``: the files the listing gives no
size of, counted nothing; ``weights``: the bytes of every ``*.safetensors`` file it lists,
there or not, for the GPU memory check, operations/plans/memory_fit.py; ``weights_unsized``: those
without a size), or ``{"error": "..."}``.

The file listing is the one model_fetch.py reads for the download: huggingface_hub 0.36.2's
``HfApi.model_info(repo, revision=..., files_metadata=True)``, which GETs
``<endpoint>/api/models/<repo>/revision/<quoted revision>?blobs=True`` with the token as
``Authorization: Bearer`` (hf_api.py, model_info) and reads each sibling's ``rfilename`` and
``size``. The free room: ``os.statvfs``'s blocks available to unprivileged users, as
model_fetch.py's shutil.disk_usage and df(1) count them.

    python3 -c "$(cat model_room.py)" ENDPOINT REPO REVISION DEST TOKEN_FILE_OR_EMPTY

With DEST empty, only the commit REVISION names there now, the answer's ``sha`` (huggingface_hub's
``ModelInfo.sha``), ``{"sha": "<40 hex digits>"}`` (operations/plans/model_revision.py HubCommit).
"""

from __future__ import annotations

import errno
import json
import os
import stat
import sys
import urllib.error
import urllib.parse
import urllib.request


def mount_of(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


#: Bytes of the token file read at most: secret_file.py's MAX_CHARS, a CRLF and one more (what
#: tells a longer file, which then holds no single token).
TOKEN_BYTES = 4096 + 3


def read_token(path: str) -> str | None:
    """The token file's text, stripped, read as secret_file.py's ``_read_capped`` reads a
    secret: a symlink not followed (O_NOFOLLOW), nothing waited on (O_NONBLOCK: a FIFO), at most
    TOKEN_BYTES (a device such as /dev/zero, or a huge file, would be read whole); None where
    it is not a regular file (the planning's secret-file check refuses it, naming the key)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = b""
        while len(data) < TOKEN_BYTES and (chunk := os.read(fd, TOKEN_BYTES - len(data))):
            data += chunk
    finally:
        os.close(fd)
    return data.decode("utf-8").strip() if len(data) < TOKEN_BYTES else ""  # longer: none


def main(argv: list[str]) -> int:
    endpoint, repo, revision, dest, token_file = argv[1:6]
    url = (f"{endpoint}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}"
           "?blobs=True")
    headers = {}
    try:
        if token_file:
            token = read_token(token_file)
            if token is None:
                print(json.dumps({"error": "the token file is not a regular file"}))
                return 0
            if not token or any(c.isspace() for c in token):
                # not one token (the planning's secret-file check refuses it, naming the key):
                # never sent, never printed (http.client's ValueError would quote it whole)
                print(json.dumps({"error": "the token file holds no single token"}))
                return 0
            headers["Authorization"] = f"Bearer {token}"
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers),
                                    timeout=60) as answer:
            info = json.load(answer)
    except Exception as exc:  # the token never in the text: only the error's kind
        if isinstance(exc, urllib.error.URLError):
            reason = exc.reason
        else:
            reason = exc.strerror if isinstance(exc, OSError) else ""
        code = f"HTTP {exc.code}" if isinstance(exc, urllib.error.HTTPError) else ""
        print(json.dumps({"error": f"{type(exc).__name__} {code} {reason or ''}".strip()}))
        return 0
    if not dest:
        sha = info.get("sha") if isinstance(info, dict) else None
        valid = isinstance(sha, str) and len(sha) == 40 and not sha.strip("0123456789abcdef")
        print(json.dumps({"sha": sha} if valid else {"error": "the Hub's answer has no commit sha"}))
        return 0
    siblings = (info.get("siblings") if isinstance(info, dict) else None) or []
    if not isinstance(siblings, list) or not all(
            isinstance(e, dict) and isinstance(e.get("rfilename"), str) for e in siblings):
        print(json.dumps({"error": "the Hub's file listing has a sibling without rfilename"}))
        return 0
    need, unsized, weights, weights_unsized = 0, 0, 0, 0
    for sibling in siblings:
        local = os.path.join(dest, sibling["rfilename"])
        size = sibling.get("size")
        sized = isinstance(size, int) and not isinstance(size, bool) and size >= 0
        if sibling["rfilename"].endswith(".safetensors"):
            weights += size if sized else 0
            weights_unsized += 0 if sized else 1
        if not sized:
            unsized += 1  # counted nothing, and said (operations/stages/model.py)
        elif not os.path.isfile(local) or os.path.getsize(local) != size:
            need += size
    folder = dest
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder) or "/"
    st = os.statvfs(folder)
    print(json.dumps({"need": need, "free": st.f_bavail * st.f_frsize, "mount": mount_of(folder),
                      "folder": folder, "unsized": unsized, "weights": weights,
                      "weights_unsized": weights_unsized}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
