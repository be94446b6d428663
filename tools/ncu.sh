#!/usr/bin/env bash
# Nsight Compute on one launch of a kvquant-ext kernel (clocks left alone).
#
#   bash tools/ncu.sh [-o OUTDIR] KERNEL_REGEX WORKLOAD [ARGS...]
#
# WORKLOAD [ARGS] are those of tools/ncu_workload.py (decode PRESET B L | compress PRESET
# B H T D).  Without -o: the headline metrics of the SpeedOfLight, Occupancy, LaunchStats,
# WarpStateStats, SchedulerStats and MemoryWorkloadAnalysis sections.  With -o: also the
# per-instruction warp-state samples (SASS + samples per stall reason) as
# OUTDIR/ncu_<regex>.sass.csv.gz, to read with tools/ncu_source_summary.py.
#   bash tools/ncu.sh DecodeAttentionKernel decode kivi-2 8 32768
#   bash tools/ncu.sh -o /tmp/ncu GearKeysKernel compress gear-2
# Needs a machine where ncu may read the performance counters.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=""
if [ "${1:-}" = "-o" ]; then out=$2; shift 2; mkdir -p "$out"; fi
if [ $# -lt 2 ]; then sed -n '2,13p' "$0"; exit 2; fi
kernel=$1; shift
metrics="Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM"
metrics+="|Warp Cycles Per Issued|Issued Ipc|No Eligible|Stall|Mem Busy|Max Bandwidth|L1/TEX Hit|L2 Hit"
metrics+="|Shared Memory Configuration Size|Dynamic Shared"
sections=(--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats
          --section SchedulerStats --section MemoryWorkloadAnalysis)
run=(ncu --clock-control none -k "regex:$kernel" --launch-skip 1 --launch-count 1)
if [ -z "$out" ]; then
  "${run[@]}" "${sections[@]}" python3 "$here/ncu_workload.py" "$@" 2>&1 | grep -v "^==PROF==" | grep -E "$metrics"
  exit "${PIPESTATUS[0]}"
fi
rep="$out/ncu_$(echo "$kernel" | tr -c 'A-Za-z0-9_\n' '_')"
"${run[@]}" "${sections[@]}" --section SourceCounters --import-source no -f -o "$rep" \
  python3 "$here/ncu_workload.py" "$@" 2>&1 | grep -v "^==PROF==" | tail -3
ncu --import "$rep.ncu-rep" --page details 2>&1 | grep -E "$metrics" | head -30
ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
gzip -f "$rep.sass.csv"
echo "wrote $rep.ncu-rep and $rep.sass.csv.gz (python3 $here/ncu_source_summary.py $rep.sass.csv.gz)"
