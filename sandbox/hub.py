"""The sandbox lab's stand-in of the Hugging Face Hub: two small gated model repositories, served
on each host link's address (port 8090) with the endpoints huggingface_hub 0.36's
snapshot_download and model_info use (read from huggingface_hub's source: hf_api.py
model_info, file_download.py get_hf_file_metadata and http_get, utils/_http.py
hf_raise_for_status):

    GET  /api/models/<repo>[/revision/<rev>][?blobs=True]   ModelInfo JSON: id, sha, siblings
                                                            (with blobs: size, blobId, lfs)
    HEAD /<repo>/resolve/<rev>/<file>                       small files: 200, ETag (git blob
                                                            sha1), X-Repo-Commit, Content-Length;
                                                            LFS files: 302 to the "CDN" with
                                                            X-Linked-Etag (sha256), X-Linked-Size
    GET  /<repo>/resolve/<rev>/<file>                       the same, with the content
    GET  /cdn-lfs/<sha256>?expires=..&sig=..                LFS content (signed URL, Range)

The two repositories are GLM-5-shaped as the field's two NVFP4 checkpoints are (voipmonitor/
rtx6kpro models/glm5.md: lukealonso/GLM-5-NVFP4 has no MTP weights, festr2/GLM-5-NVFP4-MTP
restores layer 78): both config.json files name ``num_nextn_predict_layers: 1`` (GLM-5's
config.json does, with ``num_hidden_layers: 78``), and only the MTP one's weight index maps the
MTP layer's tensors, ``model.layers.<num_hidden_layers>.*`` (the name sglang 0.5.9 loads them
by: deepseek_weight_loader.py, nextn_layer_prefix), in a shard of its own.

The stand-in counts the bytes of every response body it sends, per client address and per
repository file (metadata requests count as "api"), for tests and the rebuild bench:

    GET  /_sandbox/bytes-served    {"<client address>": {"total": n, "files": {"<path>": n}}}

(no token needed; not an endpoint of the real Hub). Each repository's ``main`` can be moved, as a
push to the real repository moves it, by another endpoint of the stand-in alone:

    POST /_sandbox/move-main?repo=<id>    a new commit on main (README.md gains a line);
                                          {"from": "<old sha>", "to": "<new sha>"}

Every earlier commit stays resolvable by its sha, as on the Hub: a revision is ``main`` (its
latest commit) or a commit's full sha; ``/api/models/<repo>/revision/<rev>`` answers that
commit's ``sha`` and files (huggingface_hub 0.36.2, hf_api.py ``model_info``: the revision,
``quote(revision, safe='')``, in the path; ModelInfo's ``sha``), ``/resolve/<rev>/`` its files
with ``X-Repo-Commit`` the commit's sha (file_download.py ``_get_metadata_or_catch_error``). The repository is gated: without a token 401 with X-Error-Code: GatedRepo; with a wrong one 401
"Invalid credentials in Authorization header"; unknown repositories 401 RepoNotFound, unknown
revisions 404 RevisionNotFound, unknown files 404 EntryNotFound, as the Hub answers.

    python -m sandbox.hub --port 8090 --token-file FILE ADDRESS...
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import secrets
import signal
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

PORT = 8090
REPO_ID = "gpuhost-sandbox/tiny-glm-5"
#: The same model with its MTP layer (as festr2/GLM-5-NVFP4-MTP is lukealonso/GLM-5-NVFP4's).
MTP_REPO_ID = "gpuhost-sandbox/tiny-glm-5-mtp"
TOKEN_ON_HOST = "/root/hf_token"  # where `up` puts the token on each host (mode 0600)
LFS_SUFFIXES = (".safetensors",)
SHARD_BYTES = 768 * 1024


@dataclass(frozen=True)
class RepoFile:
    path: str
    data: bytes

    @property
    def lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def blob_id(self) -> str:
        """git's blob id (sha1 of "blob <size>\\0" + content), what the Hub calls blobId."""
        return hashlib.sha1(b"blob %d\0" % len(self.data) + self.data).hexdigest()

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.data).hexdigest()

    @property
    def pointer(self) -> bytes:
        """The LFS pointer file git keeps in place of the content."""
        return (f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\n"
                f"size {len(self.data)}\n").encode()


def _safetensors(name: str, nbytes: int) -> bytes:
    """A valid safetensors file: an 8-byte header length, the JSON header, one BF16 tensor of
    deterministic bytes."""
    count = nbytes // 2
    header = json.dumps({"__metadata__": {"format": "pt"},
                         name: {"dtype": "BF16", "shape": [count], "data_offsets": [0, count * 2]}},
                        separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    seed = hashlib.sha256(name.encode()).digest()
    body = (seed * (count * 2 // len(seed) + 1))[: count * 2]
    return len(header).to_bytes(8, "little") + header + body


def repository(mtp: bool = False) -> list[RepoFile]:
    """The stand-in model: a GLM-shaped config, a tokenizer, two safetensors shards; with
    ``mtp``, a third shard holding the MTP layer (``model.layers.2.*``, the layer after the
    config's two)."""
    count = 3 if mtp else 2
    shards = {f"model-0000{i}-of-0000{count}.safetensors": f"model.layers.{i - 1}.mlp.weight"
              for i in range(1, count + 1)}
    files = {
        "README.md": b"---\nlicense: mit\nextra_gated_prompt: sandbox stand-in\n---\n"
                     b"# tiny-glm-5\n\nA gpuhost sandbox stand-in repository (no real weights).\n",
        "config.json": json.dumps({"architectures": ["GlmMoeDsaForCausalLM"],
                                   "model_type": "glm_moe_dsa", "num_hidden_layers": 2,
                                   "num_nextn_predict_layers": 1,
                                   "hidden_size": 64, "vocab_size": 256,
                                   "torch_dtype": "bfloat16"}, indent=2).encode(),
        "generation_config.json": b'{"do_sample": false, "eos_token_id": 0}\n',
        "tokenizer_config.json": b'{"model_max_length": 131072, "tokenizer_class": '
                                 b'"PreTrainedTokenizerFast"}\n',
        "tokenizer.json": json.dumps({"version": "1.0", "model": {
            "type": "BPE", "vocab": {chr(i): i for i in range(32, 127)}, "merges": []}}).encode(),
    }
    for shard, tensor in shards.items():
        files[shard] = _safetensors(tensor, SHARD_BYTES)
    files["model.safetensors.index.json"] = json.dumps({
        "metadata": {"total_size": sum(len(files[s]) for s in shards)},
        "weight_map": {t: s for s, t in shards.items()}}, indent=2).encode()
    return [RepoFile(p, d) for p, d in sorted(files.items())]


def commit_sha(files: list[RepoFile]) -> str:
    h = hashlib.sha1()
    for f in files:
        h.update(f.path.encode() + b"\0" + f.blob_id.encode())
    return h.hexdigest()


@dataclass
class Repo:
    """A repository: its commits, oldest first; ``main`` is the last."""

    id: str
    commits: list[list[RepoFile]]

    @property
    def files(self) -> list[RepoFile]:
        return self.commits[-1]

    @property
    def sha(self) -> str:
        return commit_sha(self.files)

    def at(self, revision: str) -> list[RepoFile] | None:
        """The files of ``revision`` (``main`` or a commit's full sha), None if it names none."""
        if revision == "main":
            return self.files
        return next((c for c in self.commits if commit_sha(c) == revision), None)

    def move_main(self) -> tuple[str, str]:
        """A new commit on main: README.md gains a line; (the old sha, the new)."""
        old = self.sha
        readme = next(f for f in self.files if f.path == "README.md")
        line = f"\nCommit {len(self.commits) + 1} of main.\n".encode()
        self.commits.append([RepoFile(f.path, f.data + line) if f is readme else f
                             for f in self.files])
        return old, self.sha


class Hub:
    def __init__(self, token: str):
        self.token = token
        self.repos = {r.id: r for r in (Repo(REPO_ID, [repository()]),
                                        Repo(MTP_REPO_ID, [repository(mtp=True)]))}
        # one content, one CDN object (as the Hub's LFS store): a shard both repositories hold
        # is counted under the first one's path
        self.by_sha256: dict[str, RepoFile] = {}
        for r in self.repos.values():
            for f in r.files:
                if f.lfs:
                    self.by_sha256.setdefault(f.sha256, f)
        self.secret = secrets.token_bytes(32)
        self.served: dict[str, dict] = {}
        self.lock = threading.Lock()

    def count(self, client: str, path: str, nbytes: int) -> None:
        with self.lock:
            entry = self.served.setdefault(client, {"total": 0, "files": {}})
            entry["total"] += nbytes
            entry["files"][path] = entry["files"].get(path, 0) + nbytes

    def bytes_served(self) -> dict:
        with self.lock:
            return json.loads(json.dumps(self.served))

    def resolve(self, repo: str, revision: str) -> str | None:
        files = self.repos[repo].at(revision)
        return None if files is None else commit_sha(files)

    def sign(self, sha256: str, expires: int) -> str:
        return hmac.new(self.secret, f"{sha256}:{expires}".encode(), "sha256").hexdigest()

    def model_info(self, repo_id: str, blobs: bool, revision: str = "main") -> dict:
        repo = self.repos[repo_id]
        files = repo.at(revision) or []
        siblings = []
        for f in files:
            entry: dict = {"rfilename": f.path}
            if blobs:
                entry["blobId"] = f.blob_id if not f.lfs else \
                    hashlib.sha1(b"blob %d\0" % len(f.pointer) + f.pointer).hexdigest()
                entry["size"] = len(f.data)
                if f.lfs:
                    entry["lfs"] = {"sha256": f.sha256, "size": len(f.data),
                                    "pointerSize": len(f.pointer)}
            siblings.append(entry)
        stamp = "2026-01-01T00:00:00.000Z"
        return {"_id": hashlib.md5(repo_id.encode()).hexdigest()[:24], "id": repo_id,
                "modelId": repo_id, "author": repo_id.split("/")[0], "sha": commit_sha(files),
                "lastModified": stamp, "createdAt": stamp, "private": False,
                "disabled": False, "gated": "manual", "downloads": 0, "likes": 0,
                "library_name": "transformers", "tags": ["safetensors", "glm_moe_dsa"],
                "pipeline_tag": "text-generation", "siblings": siblings,
                "usedStorage": sum(len(f.data) for f in files)}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: Hub
    #: What the response being sent is of: a repository file's path, or "api".
    served_file = "api"

    def log_message(self, fmt: str, *args: object) -> None:
        sys.stderr.write(f"{self.address_string()} {fmt % args}\n")

    def _send(self, code: int, body: bytes = b"", headers: dict | None = None,
              content_type: str = "application/json") -> None:
        self.send_response(code)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
            self.hub.count(self.client_address[0], self.served_file, len(body))

    def _error(self, code: int, error_code: str | None, message: str) -> None:
        headers = {"X-Error-Message": message}
        if error_code:
            headers["X-Error-Code"] = error_code
        self._send(code, json.dumps({"error": message}).encode(), headers)

    def _authorized(self, repo: str) -> bool:
        auth = self.headers.get("Authorization") or ""
        scheme, _, token = auth.partition(" ")
        if not auth:
            self._error(401, "GatedRepo", f"Access to model {repo} is restricted. You must "
                        "have access to it and be authenticated to access it. Please log in.")
            return False
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(),
                                                                 self.hub.token.encode()):
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        return True

    def do_HEAD(self) -> None:
        self.do_GET()

    def do_POST(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        repo = urllib.parse.parse_qs(url.query).get("repo", [""])[0]
        self.served_file = "api"
        if url.path != "/_sandbox/move-main" or repo not in self.hub.repos:
            return self._error(404, None, "Sorry, we can't find the page you are looking for.")
        with self.hub.lock:
            old, new = self.hub.repos[repo].move_main()
        self._send(200, json.dumps({"from": old, "to": new}).encode())

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        query = urllib.parse.parse_qs(url.query)
        self.served_file = "api"
        if path == "/_sandbox/bytes-served":
            return self._send(200, json.dumps(self.hub.bytes_served()).encode())
        if path.startswith("/cdn-lfs/"):
            return self._cdn(path[len("/cdn-lfs/"):], query)
        if path.startswith("/api/models/"):
            rest = path[len("/api/models/"):]
            repo, _, revision = rest.partition("/revision/")
            return self._api(repo, revision or "main",
                             query.get("blobs", [""])[0].lower() == "true")
        parts = path.lstrip("/").split("/")
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]))
        self._error(404, None, "Sorry, we can't find the page you are looking for.")

    def _repo_ok(self, repo: str) -> bool:
        if repo not in self.hub.repos:
            self._error(401, "RepoNotFound", "Repository not found")
            return False
        return self._authorized(repo)

    def _api(self, repo: str, revision: str, blobs: bool) -> None:
        if not self._repo_ok(repo):
            return
        if self.hub.resolve(repo, revision) is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        self._send(200, json.dumps(self.hub.model_info(repo, blobs, revision)).encode())

    def _resolve(self, repo: str, revision: str, filename: str) -> None:
        if not self._repo_ok(repo):
            return
        sha = self.hub.resolve(repo, revision)
        if sha is None:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {revision}")
        f = {f.path: f for f in self.hub.repos[repo].at(revision) or []}.get(filename)
        if f is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on \"{revision}\"")
        self.served_file = f.path
        headers = {"X-Repo-Commit": sha, "Accept-Ranges": "bytes"}
        if f.lfs:
            expires = int(time.time()) + 3600
            host = self.headers.get("Host") or f"{self.server.server_address[0]}:{PORT}"
            location = (f"http://{host}/cdn-lfs/{f.sha256}?expires={expires}"
                        f"&sig={self.hub.sign(f.sha256, expires)}")
            headers.update({"Location": location, "X-Linked-Etag": f'"{f.sha256}"',
                            "X-Linked-Size": str(len(f.data)), "ETag": f'"{f.blob_id}"'})
            return self._send(302, b"", headers, content_type="text/plain; charset=utf-8")
        headers["ETag"] = f'"{f.blob_id}"'
        self._send(200, f.data, headers, content_type="application/octet-stream")

    def _cdn(self, sha256: str, query: dict) -> None:
        f = self.hub.by_sha256.get(sha256)
        try:
            expires = int(query.get("expires", ["0"])[0])
        except ValueError:
            expires = 0
        sig = query.get("sig", [""])[0]
        if f is None or expires < time.time() or not hmac.compare_digest(
                sig, self.hub.sign(sha256, expires)):
            return self._send(403, b"<Error><Code>AccessDenied</Code></Error>",
                              content_type="application/xml")
        self.served_file = f.path
        data, code, headers = f.data, 200, {"ETag": f'"{f.sha256}"', "Accept-Ranges": "bytes"}
        rng = self.headers.get("Range") or ""
        if rng.startswith("bytes="):
            start_s, _, end_s = rng[len("bytes="):].partition("-")
            start = int(start_s or 0)
            end = int(end_s) if end_s else len(f.data) - 1
            data, code = f.data[start:end + 1], 206
            headers["Content-Range"] = f"bytes {start}-{start + len(data) - 1}/{len(f.data)}"
        self._send(code, data, headers, content_type="binary/octet-stream")


class Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 64


def serve(token: str, port: int, addresses: list[str]) -> None:
    Handler.hub = Hub(token)
    servers = [Server((a, port), Handler) for a in addresses]
    for server in servers:
        threading.Thread(target=server.serve_forever, daemon=True).start()
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print("hub stand-in (" + ", ".join(f"{r.id} at {r.sha}" for r in Handler.hub.repos.values())
          + ") on "
          f"{', '.join(f'{a}:{port}' for a in addresses)}", flush=True)
    stop.wait()
    for server in servers:
        server.shutdown()


def ensure_token(path: Path) -> str:
    """The lab's hub token (made once per lab, mode 0600), shaped like the Hub's ("hf_...")."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write("hf_" + secrets.token_urlsafe(26).replace("-", "x").replace("_", "y") + "\n")
    return path.read_text().strip()


def install_token(root: Path, token: str) -> None:
    """Put the token on a host's root filesystem at TOKEN_ON_HOST, root-only, as an admin
    would before provisioning."""
    dest = root / TOKEN_ON_HOST.lstrip("/")
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token + "\n")
    os.chmod(dest, 0o600)
    os.chown(dest, 0, 0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sandbox.hub")
    parser.add_argument("--port", type=int, default=PORT)
    parser.add_argument("--token-file", type=Path, required=True)
    parser.add_argument("addresses", nargs="+")
    args = parser.parse_args(argv)
    sys.stderr.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    serve(args.token_file.read_text().strip(), args.port, args.addresses)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def start(specs: list, token_file: Path):  # -> procs.Proc
    """One detached `sandbox.hub` process serving every host's gateway:PORT (lab.py's `up`)."""
    from sandbox import procs, services
    from sandbox.layout import SERVICES_DIR

    SERVICES_DIR.mkdir(parents=True, exist_ok=True)
    log = SERVICES_DIR / "hub.log"
    argv = [sys.executable, "-m", "sandbox.hub", "--port", str(PORT),
            "--token-file", str(token_file), *(spec.gateway for spec in specs)]
    proc = procs.spawn_detached(argv, log, "hub", env=services.python_env())
    for spec in specs:
        services.wait_listening(spec.gateway, PORT, proc, log)
    return proc
