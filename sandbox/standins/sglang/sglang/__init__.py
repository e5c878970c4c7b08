"""sglang: sandbox stand-in (gpuhost sandbox lab) for SGLang 0.5.9 (CUDA 12.8's stack) and
0.5.17 (CUDA 13.0's). Not SGLang.

`python -m sglang.launch_server` accepts exactly the real server's flags of the release it
stands in for (read from that wheel's server_args.py into _standin/server_args.json, from
locks/sglang-<version>.args.json, when the wheel was built; sglang/version.py likewise) and
serves a small part of its HTTP API with canned answers; see sglang/_standin/server.py. What
the server does beyond its flags is 0.5.9's in both.
"""

from sglang.version import __version__  # noqa: F401

__standin__ = True
