"""A few calls of one op for Nsight Compute to profile (tools/ncu.sh picks one launch of them).

    python tools/ncu_workload.py decode [PRESET] [B] [L]      default kivi-2 8 32768
    python tools/ncu_workload.py compress [PRESET] [B H T D]  default gear-2 8 8 4096 128

``decode``: ``kvq.decode_attention`` over a PRESET cache of L tokens, Llama-3-8B attention
heads (Hq = 32, H = 8, D = 128, fp16).  ``compress``: ``kvq.gear_compress`` of keys and values
with the PRESET's GEAR parameters and the KIVI / KCVT ``kvq.quantize`` of the same tensor.
Every call runs three times, so ``--launch-skip 1`` or ``2`` skips the cold first launch.
"""
import sys

import torch

import kvquant_ext as kvq


def decode(preset="kivi-2", B="8", L="32768"):
    B, L = int(B), int(L)
    H, Hq, D = 8, 32, 128
    k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
    v = torch.randn_like(k)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.float16)
    c = kvq.KVCache(preset, check_finite=False)
    c.update(k, v, 0)
    for _ in range(3):
        kvq.decode_attention(q, c, 0)


def compress(preset="gear-2", *shape):
    shape = [int(s) for s in shape] or [8, 8, 4096, 128]
    c = kvq.get_config(preset)
    G = c.group_size if c.backbone == "kivi" else -1
    x = torch.randn(*shape, device="cuda", dtype=torch.float16)
    for _ in range(3):
        for per_channel in (True, False):
            kvq.gear_compress(x, c.bits, G, per_channel, c.sparsity, c.rank, c.iters, check_finite=False)
        kvq.quantize(x, c.bits, -1, True, check_finite=False)


if __name__ == "__main__":
    ops = {"decode": decode, "compress": compress}
    if len(sys.argv) < 2 or sys.argv[1] not in ops:
        raise SystemExit(__doc__)
    torch.manual_seed(0)
    ops[sys.argv[1]](*sys.argv[2:])
    torch.cuda.synchronize()
