#!/usr/bin/env bash
# Nsight Compute sections of one launch each of the compress kernels that missed their
# predictions in session 5 (fused GEAR keys, Gram iterate, KCVT cluster quantize), on
# [8, 8, 4096, 128] fp16.  Needs a machine where ncu can read counters; clocks left alone.
#   bash bench/ncu_compress.sh [kernel regex ...]
set -uo pipefail
cat > /tmp/kvq_ncu_compress.py <<'P'
import torch, kvquant_ext as kvq
torch.manual_seed(0)
x = torch.randn(8, 8, 4096, 128, device="cuda", dtype=torch.float16)
for _ in range(3):
    kvq.gear_compress(x, 2, 64, True, 0.02, 4, 3, check_finite=False)
    kvq.quantize(x, 2, -1, True, check_finite=False)
torch.cuda.synchronize()
P
for k in "${@:-GearKeysKernel PowerGramIterateKernel GroupQuantizeKcvtClusterKernel}"; do
  for name in $k; do
    echo "### $name"
    timeout 120 ncu --clock-control none -k regex:"$name" --launch-skip 1 --launch-count 1 \
      --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
      --section MemoryWorkloadAnalysis python3 /tmp/kvq_ncu_compress.py 2>&1 | grep -v "^==PROF==" |
      grep -E "Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Waves Per SM|Warp Cycles Per Issued|Issued Ipc|Stall|Mem Busy|Max Bandwidth|L1/TEX Hit|L2 Hit|Cluster|Shared Memory Configuration Size|Dynamic Shared" | head -30
  done
done
