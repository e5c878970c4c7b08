"""sglang: sandbox stand-in (gpuhost sandbox lab) for SGLang 0.5.9. Not SGLang.

`python -m sglang.launch_server` accepts exactly the real 0.5.9 server's flags (read from its
server_args.py into _standin/server_args.json when the wheel was built) and serves a small part
of its HTTP API with canned answers; see sglang/_standin/server.py.
"""

from sglang.version import __version__  # noqa: F401

__standin__ = True
