"""The hub stand-in counts the bytes it serves, per client and file (tests and the rebuild
bench read what came from outside the lab)."""

import json
import socket
import threading
import urllib.request


def test_the_hub_stand_in_counts_the_bytes_it_serves(tmp_path):
    from sandbox import hub

    token = hub.ensure_token(tmp_path / "token")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hub.Handler.hub = hub.Hub(token)
    server = hub.Server(("127.0.0.1", port), hub.Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{port}"
    try:
        auth = {"Authorization": f"Bearer {token}"}
        with urllib.request.urlopen(urllib.request.Request(
                f"{base}/{hub.REPO_ID}/resolve/main/config.json", headers=auth)) as r:
            config = r.read()
        shard = "model-00001-of-00002.safetensors"
        with urllib.request.urlopen(urllib.request.Request(
                f"{base}/{hub.REPO_ID}/resolve/main/{shard}", headers=auth)) as r:
            data = r.read()  # through the 302 to the "CDN"
        with urllib.request.urlopen(f"{base}/_sandbox/bytes-served") as r:
            served = json.loads(r.read())
        mine = served["127.0.0.1"]
        assert mine["files"] == {"config.json": len(config), shard: len(data)}
        assert mine["total"] == len(config) + len(data)
    finally:
        server.shutdown()
