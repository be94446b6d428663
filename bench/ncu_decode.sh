#!/usr/bin/env bash
# Nsight Compute sections for one fused decode-attention launch (kivi-2, B = 8, L = 32k,
# Llama-3-8B heads).  Needs a machine where ncu can read counters; clocks left alone.
cat > /tmp/ncu_one.py <<'PY'
import torch, kvquant_ext as kvq
B, H, Hq, L, D = 8, 8, 32, 32768, 128
k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16); v = torch.randn_like(k)
q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
c = kvq.KVCache("kivi-2", check_finite=False); c.update(k, v, 0)
for _ in range(3):
    kvq.decode_attention(q, c, 0)
torch.cuda.synchronize()
PY
timeout 240 ncu --clock-control none -k regex:DecodeAttentionKernel --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
  --section SchedulerStats --section MemoryWorkloadAnalysis python3 /tmp/ncu_one.py 2>&1 | grep -v "^==PROF==" | tail -120
