#!/usr/bin/env bash
# Nsight Compute per-instruction warp-state samples of one fused decode-attention launch, as
# CSV (SASS + samples per stall reason) for offline analysis:
#   bash bench/ncu_source.sh PRESET OUTDIR [B L]
# Needs a machine where ncu can read counters; clocks left alone.
set -uo pipefail
preset=${1:-kivi-2}; out=${2:-/tmp}; B=${3:-8}; L=${4:-32768}
rep="$out/ncu_${preset}"
timeout 200 ncu --clock-control none -k regex:'DecodeAttentionKernel' --launch-skip 2 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy \
  --import-source no -f -o "$rep" python3 bench/ncu_one_launch.py "$preset" "$B" "$L" 2>&1 | grep -v "^==PROF==" | tail -3
ncu --import "$rep.ncu-rep" --page details 2>&1 | grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issued Ipc|Warp Cycles Per Issued|No Eligible|Stall" | head -20
ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
gzip -f "$rep.sass.csv"; rm -f "$rep.ncu-rep"
ls -la "$out" | grep ncu_
# summary here or offline: python3 bench/ncu_source_summary.py "$rep.sass.csv.gz"
