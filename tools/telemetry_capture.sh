#!/usr/bin/env bash
# Capture nvidia-smi's telemetry outputs on a real GPU machine while a torch workload runs known
# phases (tools/telemetry_phases.py: idle, large bf16 GEMMs, many tiny GEMMs, idle), for the
# fixtures under tests/fixtures/h200-device/telemetry/ (README there). Writes under $OUT (or
# ./telemetry-out): each output, the command line that made it (cmdlines.txt), the phases' times.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/telemetry-out}
mkdir -p "$out"
log() { printf '%s\n' "$*" | tee -a "$out/cmdlines.txt"; }
run() { log "\$ $1 > $2"; bash -c "$1" >"$out/$2" 2>&1; echo "# rc=$?" >>"$out/$2"; }

run "nvidia-smi --help-query-gpu" help-query-gpu.txt
run "nvidia-smi dmon -h" dmon-help.txt
run "nvidia-smi --version" version.txt
run "nvidia-smi -q -d PERFORMANCE,POWER,CLOCK,TEMPERATURE,UTILIZATION" q-perf-idle.txt

# Every clocks_event_reasons.* and pcie.* name --help-query-gpu lists, beside the base fields.
base="timestamp,index,power.draw,enforced.power.limit,clocks.sm,clocks.max.sm,clocks.mem,utilization.gpu,utilization.memory,temperature.gpu,clocks_event_reasons.active"
reasons=$(grep -o '"clocks_event_reasons\.[a-z_.]*"' "$out/help-query-gpu.txt" | tr -d '"' \
    | grep -vx 'clocks_event_reasons.active\|clocks_event_reasons.supported' | sort -u | paste -sd, -)
fields="$base${reasons:+,$reasons}"
if ! nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits >/dev/null 2>&1; then
    log "# the full field list is refused; sampling the base fields only"
    fields=$base
fi
pcie=$(grep -o '"pcie\.[a-z_.]*"' "$out/help-query-gpu.txt" | tr -d '"' | sort -u | paste -sd, -)
run "nvidia-smi --query-gpu=index,pci.bus_id,${pcie:-pcie.link.gen.max,pcie.link.width.max},power.limit,power.max_limit,clocks.max.sm,clocks.max.mem --format=csv" static.txt
run "nvidia-smi --query-gpu=$fields --format=csv" query-header.txt
# One field per call, so a field this driver refuses shows as its own error.
for f in ${fields//,/ }; do
    echo "$f: $(nvidia-smi --query-gpu="$f" --format=csv,noheader,nounits 2>&1 | head -1)"
done >"$out/fields-one-by-one.txt"

log "\$ nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits -lms 500 > query.csv"
nvidia-smi --query-gpu="$fields" --format=csv,noheader,nounits -lms 500 >"$out/query.csv" 2>&1 &
q=$!
log "\$ nvidia-smi dmon -s puct -d 1 > dmon.txt"
nvidia-smi dmon -s puct -d 1 >"$out/dmon.txt" 2>&1 &
d1=$!
log "\$ nvidia-smi dmon -s puct -d 1 -o T > dmon-T.txt"
nvidia-smi dmon -s puct -d 1 -o T >"$out/dmon-T.txt" 2>&1 &
d2=$!
d3=
if grep -q -- '--format' "$out/dmon-help.txt"; then
    log "\$ nvidia-smi dmon -s puct -d 1 -o DT --format csv > dmon-DT.csv"
    nvidia-smi dmon -s puct -d 1 -o DT --format csv >"$out/dmon-DT.csv" 2>&1 &
    d3=$!
fi
sleep 1
log "\$ python3 tools/telemetry_phases.py > phases.json"
python3 tools/telemetry_phases.py >"$out/phases.json" 2>"$out/phases.stderr"
echo "phases exit status: $?" | tee -a "$out/cmdlines.txt"
run "nvidia-smi -q -d PERFORMANCE,POWER,CLOCK,TEMPERATURE,UTILIZATION" q-perf-after.txt
sleep 1
kill $q $d1 $d2 $d3 2>/dev/null
wait 2>/dev/null
wc -l "$out"/*.csv "$out"/dmon*.txt
