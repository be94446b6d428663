"""Per-kernel GPU time (torch.profiler) of one op, to see which launch of a call the time goes to.

    python tools/kernel_profile.py decode [--batch 1 8] [--len 4096 32768] [--presets kivi-2]
    python tools/kernel_profile.py gear [--shape 8 8 4096 128] [--presets gear-2 gearl-2] [--compact]

``decode``: FP16 SDPA and ``kvq.decode_attention`` for each preset, Llama-3-8B attention shape
(Hq = 32, H = 8, D = 128, fp16).  ``gear``: ``kvq.gear_compress`` (keys and values) for each
preset and the KIVI ``kvq.quantize`` it is compared with, at [B, H, T, D] fp16.  Needs a CUDA
device and an installed kvquant_ext.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict

import torch
import torch.nn.functional as F

import kvquant_ext as kvq


def kernel_table(fn: Callable[[], object], calls: int = 10, rows: int = 10, compact: bool = False) -> str:
    """torch.profiler table of the CUDA kernels that ``calls`` calls of ``fn`` launch (after
    two warm-up calls), sorted by total GPU time; ``compact``: one line per kernel with its
    GPU time per call (µs) and the sum."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    if compact:
        ev = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
        ev.sort(key=lambda e: -e.self_device_time_total)
        lines = [f"  {e.self_device_time_total / calls:8.1f} us  {e.key[:90]}" for e in ev[:rows]]
        lines.append(f"  {sum(e.self_device_time_total for e in ev) / calls:8.1f} us  total per call")
        return "\n".join(lines)
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)


def decode_calls(args) -> Dict[str, Callable[[], object]]:
    Hq, H, D = 32, 8, 128
    fns: Dict[str, Callable[[], object]] = {}
    for B in args.batch:
        for L in args.len:
            torch.manual_seed(0)
            k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
            v = torch.randn_like(k)
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16)
            fns[f"B={B} L={L} fp16 SDPA"] = (
                lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
            for name in args.presets:
                cache = kvq.KVCache(name, check_finite=False)
                cache.update(k, v, 0)
                fns[f"B={B} L={L} {name}"] = lambda q=q, c=cache: kvq.decode_attention(q, c, 0)
    return fns


def gear_calls(args) -> Dict[str, Callable[[], object]]:
    torch.manual_seed(0)
    x = torch.randn(*args.shape, device="cuda", dtype=torch.float16)
    fns: Dict[str, Callable[[], object]] = {}
    for name in args.presets:
        c = kvq.get_config(name)
        G = c.group_size if c.backbone == "kivi" else -1
        for role, pc in (("keys", True), ("values", False)):
            fns[f"{name} {role}"] = (lambda c=c, G=G, pc=pc: kvq.gear_compress(
                x, c.bits, G, pc, c.sparsity, c.rank, c.iters, check_finite=False))
    fns["kivi quantize keys G=64"] = lambda: kvq.quantize(x, 2, 64, True, check_finite=False)
    fns["kivi quantize values G=64"] = lambda: kvq.quantize(x, 2, 64, False, check_finite=False)
    return fns


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="op", required=True)
    d = sub.add_parser("decode", help="decode attention vs FP16 SDPA")
    d.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    d.add_argument("--len", type=int, nargs="+", default=[4096, 32768])
    d.add_argument("--presets", nargs="+", default=["kivi-2"])
    g = sub.add_parser("gear", help="gear_compress vs KIVI quantize")
    g.add_argument("--shape", type=int, nargs=4, default=[8, 8, 4096, 128], metavar=("B", "H", "T", "D"))
    g.add_argument("--presets", nargs="+", default=["gear-2", "gearl-2"])
    for p in (d, g):
        p.add_argument("--calls", type=int, default=10)
        p.add_argument("--rows", type=int, default=12, help="kernels listed per call")
        p.add_argument("--compact", action="store_true", help="one line per kernel (GPU µs per call)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("kernel_profile.py needs a CUDA device")
    fns = decode_calls(args) if args.op == "decode" else gear_calls(args)
    for label, fn in fns.items():
        print(f"\n### {label} ({args.calls} calls; per-call us = total / {args.calls})")
        print(kernel_table(fn, calls=args.calls, rows=args.rows, compact=args.compact))


if __name__ == "__main__":
    main()
