#!/usr/bin/env bash
# Run on the lent GPU machine (docs/development.md): every fact of ours on real
# outputs, the P2P check, and a dry run of the whole deploy with pyinfra's @local connector.
# Expects .whl/ from tools/device_wheels.sh beside it; writes what it read under $OUT (or
# ./device-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device-out}
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --disable-pip-version-check \
    --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

echo "== facts (raw outputs in $out/probe)"
python3 tools/device_probe.py "$out/probe"

echo "== P2P check, in this machine's python (torch $(python3 -c 'import torch; print(torch.__version__)' 2>&1))"
lib=$(mktemp -d)
cp operations/facts/nvsmi.py operations/plans/p2p_policy.py operations/files/p2p_check.py "$lib/"
python3 "$lib/p2p_check.py" --env-file "$out/p2p.env" --record "$out/p2p.json"
echo "p2p_check exit status: $?"

echo "== pyinfra inventory/h200.py deploy.py --dry"
python3 -m pyinfra inventory/h200.py deploy.py --dry 2>&1 | tee "$out/dry-run.txt"
echo "dry run exit status: ${PIPESTATUS[0]}"
