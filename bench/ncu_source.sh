#!/usr/bin/env bash
# Nsight Compute per-instruction warp-state samples of one fused decode-attention launch, as
# CSV (SASS + samples per stall reason) for offline analysis:
#   bash bench/ncu_source.sh PRESET OUTDIR [B L]
# Needs a machine where ncu can read counters; clocks left alone.
set -uo pipefail
preset=${1:-kivi-2}; out=${2:-/tmp}; B=${3:-8}; L=${4:-32768}
cat > /tmp/ncu_src_one.py <<PY
import torch, kvquant_ext as kvq
B, H, Hq, L, D = $B, 8, 32, $L, 128
k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
c = kvq.KVCache("$preset", check_finite=False); c.update(k, v, 0)
for _ in range(3):
    kvq.decode_attention(q, c, 0)
torch.cuda.synchronize()
PY
rep="$out/ncu_${preset}"
timeout 200 ncu --clock-control none -k regex:'DecodeAttentionKernel' --launch-skip 2 --launch-count 1 \
  --section SourceCounters --section WarpStateStats --section SpeedOfLight --section Occupancy \
  --import-source no -f -o "$rep" python3 /tmp/ncu_src_one.py 2>&1 | grep -v "^==PROF==" | tail -3
ncu --import "$rep.ncu-rep" --page details 2>&1 | grep -E "Duration|Throughput|Registers|Achieved Occupancy|Issued Ipc|Warp Cycles Per Issued|No Eligible|Stall" | head -20
ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2>&1
gzip -f "$rep.sass.csv"; rm -f "$rep.ncu-rep"
ls -la "$out" | grep ncu_
# summary here or offline: python3 bench/ncu_source_summary.py "$rep.sass.csv.gz"
