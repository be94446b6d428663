"""A few fused decode-attention calls on one cache, for Nsight Compute to profile (the scripts
bench/ncu_decode.sh and bench/ncu_source.sh pick one launch of them).

    python bench/ncu_one_launch.py [PRESET] [B] [L]      (default kivi-2 8 32768)

Llama-3-8B attention heads: Hq = 32, H = 8, D = 128, fp16.
"""
import sys

import torch

import kvquant_ext as kvq

preset = sys.argv[1] if len(sys.argv) > 1 else "kivi-2"
B = int(sys.argv[2]) if len(sys.argv) > 2 else 8
L = int(sys.argv[3]) if len(sys.argv) > 3 else 32768
H, Hq, D = 8, 32, 128
k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
v = torch.randn_like(k)
q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
c = kvq.KVCache(preset, check_finite=False)
c.update(k, v, 0)
for _ in range(3):
    kvq.decode_attention(q, c, 0)
torch.cuda.synchronize()
