"""Kernel-level breakdown (torch.profiler) of one decode-attention call: FP16 SDPA and the
fused op for a few presets, at the shapes given.

    python bench/profile_decode.py [--batch 1 8] [--len 4096 32768] [--presets kivi-2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
import kvquant_ext as kvq

sys.path.insert(0, os.path.dirname(__file__))
from utils import kernel_table  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--len", type=int, nargs="+", default=[4096, 32768])
    ap.add_argument("--presets", nargs="+", default=["kivi-2"])
    args = ap.parse_args(argv)
    Hq, H, D = 32, 8, 128
    for B in args.batch:
        for L in args.len:
            torch.manual_seed(0)
            k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16)
            fns = {"fp16 SDPA": lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
            for name in args.presets:
                cache = kvq.KVCache(name, check_finite=False)
                cache.update(k, v, 0)
                fns[name] = (lambda c: (lambda: kvq.decode_attention(q, c, 0)))(cache)
            for label, fn in fns.items():
                print(f"\n### B={B} L={L} {label} (10 calls)")
                print(kernel_table(fn, calls=10, rows=8))


if __name__ == "__main__":
    main()
