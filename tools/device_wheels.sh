#!/usr/bin/env bash
# Pack this project and its Python dependencies as wheels for a GPU host that cannot reach any
# package index (Python 3.12, Linux x86_64): .whl/ in the repository root (ignored by git).
#
#   tools/device_wheels.sh            # then carry .whl/ to the host and, there:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
#
# pip resolves the dependencies for the target platform here. The project itself is not packed:
# the deploy runs from the working tree, which travels with every device run.
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl && mkdir -p .whl
platforms=()
for n in 17 27 28 31 34; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform any)
.venv/bin/python -m pip download -q --disable-pip-version-check --only-binary=:all: \
    --python-version 3.12 --implementation cp "${platforms[@]}" -d .whl \
    "pyinfra==3.10.*" "jinja2>=3.1" "packaging>=23" "requests>=2.31" "pyyaml>=6" "paramiko>=3.4" \
    typing_extensions
ls .whl | sed 's/^/  /'
du -sh .whl
