"""Kernel-level breakdown (torch.profiler) of gear_compress (keys and values) and of the KIVI
quantize it is compared with, at [B, H, T, D] fp16.

    python bench/profile_gear.py [--shape 8 8 4096 128] [--presets gear-2 gearl-2]
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import kvquant_ext as kvq

sys.path.insert(0, os.path.dirname(__file__))
from utils import kernel_table  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 8, 4096, 128])
    ap.add_argument("--presets", nargs="+", default=["gear-2", "gearl-2"])
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--compact", action="store_true", help="one line per kernel (GPU µs per call)")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    x = torch.randn(*args.shape, device="cuda", dtype=torch.float16)
    fns = {}
    for name in args.presets:
        c = kvq.get_config(name)
        for role, pc in (("keys", True), ("values", False)):
            G = c.group_size if c.backbone == "kivi" else -1
            fns[f"{name} {role}"] = (lambda c=c, G=G, pc=pc: kvq.gear_compress(
                x, c.bits, G, pc, c.sparsity, c.rank, c.iters, check_finite=False))
    fns["kivi quantize keys G=64"] = lambda: kvq.quantize(x, 2, 64, True, check_finite=False)
    fns["kivi quantize values G=64"] = lambda: kvq.quantize(x, 2, 64, False, check_finite=False)
    for label, fn in fns.items():
        print(f"\n### {label} {tuple(args.shape)} ({args.calls} calls; per-call us = total / {args.calls})")
        print(kernel_table(fn, calls=args.calls, rows=12, compact=args.compact))


if __name__ == "__main__":
    main()
