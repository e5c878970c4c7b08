"""What the lock's distributions will take on the host: for each ``name==version:hashes``
argument, the file of the package index (``--index``) the lock's sha256 names, its size (what
pip downloads into the wheels' folder) and the bytes its members unpack to (what pip installs
into the venv). Run by the host's python3 (stdlib only, sent as ``python3 -c``: it runs before
any venv exists), so the index is read the way the host's pip reads it. Prints one JSON line:

    {"torch": {"file": "torch-2.9.1-....whl", "download": 899704118, "installed": 1833200128},
     ...}

Where a name has no file of its version on the index, ``{"error": "..."}`` stands instead.

Sources:
- the project page: PEP 503 (``<index>/<normalized name>/``, links whose fragment is
  ``#sha256=<hex>``), asked for PEP 691's JSON form first (``Accept:
  application/vnd.pypi.simple.v1+json``; its ``files`` carry ``hashes`` and, PEP 700, ``size``);
- a file's size: the JSON ``size``, else the ``Content-Length`` of the file's answer;
- a wheel's unpacked size: the sum of its members' uncompressed sizes in its zip central
  directory (read with HTTP range requests as pip's own lazy_wheel.py does, or from the whole
  file where the server ignores ``Range``), plus each ``.py`` member's size again for the
  ``.pyc`` pip compiles beside it (an estimate: CPython's marshalled code is about its
  source's size); an sdist (flash-attn's) counts at its download size and is not read: a
  tar.gz has no directory to read by range, and reading it whole would fetch it from the index
  on every fresh host's planning, also where the run takes a built wheel from the wheel cache
  and never downloads it (e2e test_rebuild: 0 index bytes for a rebuilt VM); its unpacked
  sources and the extension its build makes fall within the room kept free above the figures.
Of a name's several files under the lock's hashes (one per platform), the largest counts.

An index URL with credentials (``https://user:token@host/simple``, as pip takes them) is read
as pip reads it: the user information is taken out of the URL and sent as HTTP Basic
authentication to that URL's host and port alone (pip 26.3, network/auth.py
``MultiDomainBasicAuth``: ``split_auth_netloc_from_url``, a missing user or password sent as
empty), never on a redirect elsewhere (urllib's ``add_unredirected_header``); so no request,
error or line printed carries them (urllib itself would take ``user:token@host`` for a host
and quote it in its error).
"""

from __future__ import annotations

import base64
import html.parser
import io
import json
import re
import sys
import tarfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from concurrent.futures import ThreadPoolExecutor

ACCEPT = ("application/vnd.pypi.simple.v1+json, application/vnd.pypi.simple.v1+html;q=0.2, "
          "text/html;q=0.01")
TIMEOUT = 60
#: ``Authorization`` header by the netloc (host[:port]) it is sent to; see the docstring.
AUTH: dict[str, str] = {}


def without_auth(url: str) -> str:
    """``url`` with its user information taken out, kept in :data:`AUTH` for its netloc."""
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    userinfo, netloc = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    pair = f"{urllib.parse.unquote(user)}:{urllib.parse.unquote(password)}"
    AUTH[netloc] = "Basic " + base64.b64encode(pair.encode()).decode()
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def fetch(request: "urllib.request.Request | str"):
    """urlopen, with the index's credentials where the request goes to its netloc."""
    if isinstance(request, str):
        request = urllib.request.Request(request)
    auth = AUTH.get(urllib.parse.urlsplit(request.full_url).netloc)
    if auth:
        request.add_unredirected_header("Authorization", auth)
    return urllib.request.urlopen(request, timeout=TIMEOUT)


class Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.links.append(href)


def files_of(index: str, name: str) -> list[dict]:
    """The project page's files: [{"filename", "url", "sha256", "size" or None}]."""
    page = urllib.parse.urljoin(index.rstrip("/") + "/", re.sub(r"[-_.]+", "-", name).lower()
                                + "/")
    with fetch(urllib.request.Request(page, headers={"Accept": ACCEPT})) as answer:
        kind = answer.headers.get_content_type()
        body = answer.read().decode("utf-8", "replace")
        base = answer.geturl()
    if kind == "application/vnd.pypi.simple.v1+json":
        return [{"filename": f["filename"], "url": urllib.parse.urljoin(base, f["url"]),
                 "sha256": f.get("hashes", {}).get("sha256", ""), "size": f.get("size")}
                for f in json.loads(body).get("files", [])]
    parser = Links()
    parser.feed(body)
    found = []
    for href in parser.links:
        url, _, fragment = urllib.parse.urljoin(base, html.unescape(href)).partition("#")
        found.append({"filename": urllib.parse.unquote(url.rsplit("/", 1)[-1]), "url": url,
                      "sha256": fragment.removeprefix("sha256=") if fragment.startswith(
                          "sha256=") else "", "size": None})
    return found


class Remote(io.RawIOBase):
    """A file of the index read by HTTP range requests (RFC 9110 section 14), for zipfile."""

    def __init__(self, url: str, size: int) -> None:
        self.url, self.size, self.pos = url, size, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: 0, 1: self.pos, 2: self.size}[whence] + offset
        return self.pos

    def tell(self) -> int:
        return self.pos

    def readinto(self, buffer) -> int:
        end = min(self.size, self.pos + len(buffer))
        if end <= self.pos:
            return 0
        request = urllib.request.Request(self.url, headers={
            "Range": f"bytes={self.pos}-{end - 1}"})
        with fetch(request) as answer:
            if answer.status != 206:
                raise NoRanges()
            data = answer.read()
        buffer[:len(data)] = data
        self.pos += len(data)
        return len(data)


class NoRanges(Exception):
    """The server answered a range request with the whole file."""


def head_size(url: str) -> int:
    with fetch(urllib.request.Request(url, method="HEAD")) as answer:
        return int(answer.headers["Content-Length"])


def unpacked(members: list[tuple[str, int]]) -> int:
    return sum(size for _, size in members) + sum(size for name, size in members
                                                  if name.endswith(".py"))


def installed_size(url: str, filename: str, size: int) -> int:
    if filename.endswith(".whl"):
        try:
            with zipfile.ZipFile(io.BufferedReader(Remote(url, size), 256 * 1024)) as wheel:
                return unpacked([(i.filename, i.file_size) for i in wheel.infolist()])
        except NoRanges:
            pass
    else:
        return size  # an sdist: not read (the module's docstring says why)
    with fetch(url) as answer:
        data = io.BytesIO(answer.read())
    with zipfile.ZipFile(data) as wheel:
        return unpacked([(i.filename, i.file_size) for i in wheel.infolist()])


def local_installed_size(path) -> int:
    """What a wheel or sdist on this machine unpacks to, counted as :func:`installed_size`
    counts one of the index (the controller's cache: operations/stages/locked_wheels.py)."""
    if str(path).endswith(".whl"):
        with zipfile.ZipFile(path) as wheel:
            return unpacked([(i.filename, i.file_size) for i in wheel.infolist()])
    with tarfile.open(path) as sdist:
        return unpacked([(m.name, m.size) for m in sdist.getmembers() if m.isfile()])


#: The first answer that says the index cannot be reached (a connection refused or timed out,
#: not an HTTP status): the names not asked yet are not asked (a lock of 174 names behind a
#: firewall that drops the packets waited TIMEOUT for each, 8 at a time: 22 minutes).
DOWN: list[str] = []


def measure(index: str, pin: str) -> tuple[str, dict]:
    spec, _, prefixes = pin.partition(":")
    name, _, version = spec.partition("==")
    wanted = [p for p in prefixes.split(",") if p]
    if DOWN:
        return name, {"error": DOWN[0]}
    try:
        files = [f for f in files_of(index, name)
                 if any(f["sha256"].startswith(p) for p in wanted)]
        if not files:
            return name, {"error": f"the index has no file of {name} {version} with the "
                                   "lock's sha256"}
        for f in files:
            if f["size"] is None:
                f["size"] = head_size(f["url"])
        chosen = max(files, key=lambda f: f["size"])
        return name, {"file": chosen["filename"], "download": chosen["size"],
                      "installed": installed_size(chosen["url"], chosen["filename"],
                                                  chosen["size"])}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, tarfile.TarError) as exc:
        if isinstance(exc, (urllib.error.URLError, TimeoutError, ConnectionError)) \
                and not isinstance(exc, urllib.error.HTTPError):
            DOWN.append(f"the index did not answer: {getattr(exc, 'reason', exc)}")
            return name, {"error": DOWN[0]}
        return name, {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str]) -> int:
    index, pins = without_auth(argv[1]), argv[2:]
    with ThreadPoolExecutor(max_workers=8) as pool:
        print(json.dumps(dict(pool.map(lambda p: measure(index, p), pins)), sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
