"""The lab's HTTP server counts the bytes of the files it sends, per client and path (the
rebuild bench reads the index's and the repository's share of what came from outside the lab)."""

import json
import threading
import urllib.request

from sandbox import httpd


def test_the_lab_http_server_counts_the_bytes_it_serves(tmp_path):
    (tmp_path / "simple" / "torch").mkdir(parents=True)
    wheel = tmp_path / "simple" / "torch" / "torch-2.9.1-cp311-none-any.whl"
    wheel.write_bytes(b"W" * 70000)
    (tmp_path / "simple" / "torch" / "index.html").write_text("<a href=x>x</a>\n")
    handler = lambda *a, **k: httpd.Handler(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = httpd.Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for path in ("/simple/torch/", "/simple/torch/torch-2.9.1-cp311-none-any.whl",
                     "/simple/torch/torch-2.9.1-cp311-none-any.whl"):
            with urllib.request.urlopen(base + path) as r:
                r.read()
        with urllib.request.urlopen(f"{base}/_sandbox/bytes-served") as r:
            served = json.loads(r.read())
        assert served["127.0.0.1"]["files"] == {
            "/simple/torch/": 16, "/simple/torch/torch-2.9.1-cp311-none-any.whl": 140000}
        assert served["127.0.0.1"]["total"] == 140016
    finally:
        server.shutdown()
        server.server_close()
