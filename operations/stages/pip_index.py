"""pip's package index options, shared by the venv's install and the flash-attn build."""

from __future__ import annotations

from urllib.parse import urlsplit


def pip_index_args(index_url: str) -> list[str]:
    """pip's index options. An http index is trusted for transport only: every file is
    checked against the lock's hashes (--require-hashes) whatever the transport."""
    args = ["--index-url", index_url]
    if urlsplit(index_url).scheme == "http":
        args += ["--trusted-host", urlsplit(index_url).hostname or ""]
    return args
