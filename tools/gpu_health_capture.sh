#!/usr/bin/env bash
# Capture nvidia-smi's health outputs on a real GPU machine (framebuffer, ECC, remapped rows,
# PCIe link and replays, the GPU count) and the kernel log's NVRM lines, for the fixtures under
# tests/fixtures/h200-device/health/ (README there). Writes under $OUT (or ./health-out): each
# output ending with "# rc=N", and the command line that made it (cmdlines.txt).
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/health-out}
mkdir -p "$out"
log() { printf '%s\n' "$*" | tee -a "$out/cmdlines.txt" >/dev/null; }
run() { log "\$ $1 > $2"; timeout 60 bash -c "$1" >"$out/$2" 2>&1; echo "# rc=$?" >>"$out/$2"; }

run "nvidia-smi --version" version.txt
run "nvidia-smi --help-query-gpu" help-query-gpu.txt
run "nvidia-smi --help-query-remapped-rows" help-query-remapped-rows.txt
run "nvidia-smi --help-query-retired-pages" help-query-retired-pages.txt
run "nvidia-smi -L" nvidia-smi-L.txt
run "nvidia-smi -q" q.txt
run "nvidia-smi -q -d ECC,ROW_REMAPPER,PAGE_RETIREMENT,MEMORY" q-ecc-remap-memory.txt
fields="index,count,memory.total,memory.reserved,memory.used,memory.free,ecc.mode.current,ecc.mode.pending,ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total,ecc.errors.corrected.aggregate.total,ecc.errors.uncorrected.aggregate.total,remapped_rows.correctable,remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure,retired_pages.sbe,retired_pages.dbe,retired_pages.pending,pcie.link.gen.current,pcie.link.gen.gpucurrent,pcie.link.gen.max,pcie.link.gen.gpumax,pcie.link.gen.hostmax,pcie.link.width.current,pcie.link.width.max"
for f in ${fields//,/ }; do
    echo "$f: $(nvidia-smi --query-gpu="$f" --format=csv,noheader,nounits 2>&1 | head -2 | paste -sd'|')"
done >"$out/fields-one-by-one.txt"
run "nvidia-smi --query-gpu=$fields --format=csv" query-header.txt
run "nvidia-smi --query-gpu=$fields --format=csv,noheader,nounits" query.csv
run "nvidia-smi --query-remapped-rows=gpu_bus_id,gpu_uuid,remapped_rows.correctable,remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure --format=csv" query-remapped-rows.txt
run "nvidia-smi --query-gpu=index,bogus.field --format=csv" query-bad-field.txt
run "nvidia-smi -i 7 --query-gpu=index --format=csv" query-no-such-gpu.txt
run "ls -l /proc/driver/nvidia/gpus/ && cat /proc/driver/nvidia/gpus/*/information" proc-gpus.txt
run "cat /proc/driver/nvidia/version" proc-version.txt
run "dmesg | grep -iE 'nvrm|nvidia|xid' | tail -80" dmesg-nvrm.txt
run "journalctl -k --no-pager -o short-iso | grep -iE 'nvrm|nvidia|xid' | tail -80" journal-k-nvrm.txt
run "timeout 3 cat /dev/kmsg | grep -iE 'nvrm|nvidia|xid' | tail -40" kmsg-nvrm.txt
run "lspci -d 10de: -vv 2>/dev/null | grep -E 'LnkCap|LnkSta|^[0-9a-f]' ; ls /sys/bus/pci/devices/*/current_link_width >/dev/null 2>&1 && for d in /sys/bus/pci/devices/*; do [ \"\$(cat \$d/vendor)\" = 0x10de ] && echo \$d \$(cat \$d/current_link_speed \$d/current_link_width \$d/max_link_speed \$d/max_link_width 2>&1); done" pci-link.txt
uname -a >"$out/uname.txt"; date -u >>"$out/uname.txt"
