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


def test_a_byte_range_is_answered_206_and_counted_as_sent(tmp_path):
    """One range of a file, as pip's lazy_wheel.py and wheel_sizes.py ask for a wheel's zip
    directory: 206 with Content-Range; a suffix range; past the end 416; If-Range: the whole
    file."""
    import urllib.error

    import pytest

    (tmp_path / "f.whl").write_bytes(bytes(range(256)) * 40)  # 10240 bytes

    class Counted(httpd.Handler):
        counter = httpd.Counter()  # its own: the class's is shared by every test here

    handler = lambda *a, **k: Counted(*a, directory=str(tmp_path), **k)  # noqa: E731
    server = httpd.Server(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"

    def get(headers):
        return urllib.request.urlopen(urllib.request.Request(f"{base}/f.whl", headers=headers))

    try:
        with get({"Range": "bytes=10-19"}) as r:
            assert r.status == 206 and r.headers["Content-Range"] == "bytes 10-19/10240"
            assert r.read() == bytes(range(10, 20))
        with get({"Range": "bytes=-6"}) as r:
            assert r.status == 206 and r.read() == bytes(range(250, 256))
        with get({"Range": "bytes=10200-"}) as r:
            assert r.headers["Content-Range"] == "bytes 10200-10239/10240"
            assert len(r.read()) == 40
        with pytest.raises(urllib.error.HTTPError) as past:
            get({"Range": "bytes=20000-"})
        assert past.value.code == 416
        with get({"Range": "bytes=0-9", "If-Range": '"x"'}) as r:
            assert r.status == 200 and len(r.read()) == 10240
        with urllib.request.urlopen(f"{base}/_sandbox/bytes-served") as r:
            assert json.loads(r.read())["127.0.0.1"]["files"]["/f.whl"] == 10 + 6 + 40 + 10240
    finally:
        server.shutdown()
        server.server_close()
