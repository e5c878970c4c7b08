"""The room a model download needs, read while planning: the bytes of the revision's files not
in ``dest`` yet (as model_fetch.py counts them) and the room free on the file system ``dest``
is on (or would be: its nearest existing folder). Run by the host's python3 (stdlib only, sent
as ``python3 -c``: it runs before the venv that holds huggingface_hub exists). Prints one JSON
line, ``{"need": 1577149, "free": 2147483648, "mount": "/opt", "folder": "/opt"}``, or
``{"error": "..."}``.

The file listing is the one model_fetch.py reads for the download: huggingface_hub 0.36.2's
``HfApi.model_info(repo, revision=..., files_metadata=True)``, which GETs
``<endpoint>/api/models/<repo>/revision/<quoted revision>?blobs=True`` with the token as
``Authorization: Bearer`` (hf_api.py, model_info) and reads each sibling's ``rfilename`` and
``size``. The free room: ``os.statvfs``'s blocks available to unprivileged users, as
model_fetch.py's shutil.disk_usage and df(1) count them.

    python3 -c "$(cat model_room.py)" ENDPOINT REPO REVISION DEST TOKEN_FILE_OR_EMPTY
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.parse
import urllib.request


def mount_of(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def main(argv: list[str]) -> int:
    endpoint, repo, revision, dest, token_file = argv[1:6]
    url = (f"{endpoint}/api/models/{repo}/revision/{urllib.parse.quote(revision, safe='')}"
           "?blobs=True")
    headers = {}
    try:
        if token_file:
            with open(token_file, encoding="utf-8") as f:
                token = f.read().strip()
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
    need = 0
    for sibling in info.get("siblings") or []:
        local = os.path.join(dest, sibling["rfilename"])
        size = sibling.get("size") or 0
        if not os.path.isfile(local) or os.path.getsize(local) != size:
            need += size
    folder = dest
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder) or "/"
    st = os.statvfs(folder)
    print(json.dumps({"need": need, "free": st.f_bavail * st.f_frsize, "mount": mount_of(folder),
                      "folder": folder}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
