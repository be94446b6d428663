#!/usr/bin/env bash
# Nsight Compute per-instruction warp-state samples (SASS + samples per stall reason, CSV) of
# one launch each of the GEAR compress kernels on [8, 8, 4096, 128] fp16 gear-2, for offline
# analysis with bench/ncu_source_summary.py:
#   bash bench/ncu_source_compress.sh OUTDIR [kernel regex ...]
# Needs a machine where ncu can read counters; clocks left alone.
set -uo pipefail
out=${1:-/tmp}; shift || true
cat > /tmp/kvq_ncu_src_compress.py <<'P'
import torch, kvquant_ext as kvq
torch.manual_seed(0)
x = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.float16)
for _ in range(3):
    kvq.gear_compress(x, 2, 64, True, 0.02, 4, 3, check_finite=False)
    kvq.gear_compress(x, 2, 64, False, 0.02, 4, 3, check_finite=False)
torch.cuda.synchronize()
P
for name in ${@:-GearKeysKernel PowerGramIterateKernel GearValuesKernel}; do
  rep="$out/ncu_src_$name"
  echo "### $name"
  timeout 150 ncu --clock-control none -k regex:"$name" --launch-skip 1 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy \
    --import-source no -f -o "$rep" python3 /tmp/kvq_ncu_src_compress.py 2>&1 | grep -v "^==PROF==" | tail -2
  ncu --import "$rep.ncu-rep" --page details 2>&1 | grep -E "Duration|Registers|Achieved Occupancy|Issued Ipc|Warp Cycles Per Issued" | head -8
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
  gzip -f "$rep.sass.csv"; rm -f "$rep.ncu-rep"
done
