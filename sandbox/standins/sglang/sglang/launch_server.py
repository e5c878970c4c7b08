"""Launch the inference server (sandbox stand-in of sglang 0.5.9's sglang.launch_server)."""

import sys

from sglang._standin.server import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
