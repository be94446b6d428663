"""Benchmark GEAR compression (kvq.gear_compress) against KIVI quantization (kvq.quantize)
and against the same algorithm written with plain torch ops (torch.topk + matmuls +
torch.linalg.qr), in the same run.  Prints a markdown table.

    python3 bench/bench_gear.py                       # [8, 8, 4096, 128] fp16 + decode block
    python3 bench/bench_gear.py --tokens 32768 --batch 1

Timing: CUDA events around each call, median over --iters runs, L2 flushed before every
run by writing a buffer larger than the L2 (cold cache).  "eager" is the plain call (with the
default check_finite=True, i.e. one device->host sync); "graph" is the call with
check_finite=False captured once in a CUDA graph and replayed (GPU time only: no Python,
dispatcher or launch overhead).  Without a GPU it falls back to wall-clock CPU timing (for a
smoke test only; no graph column).
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass

import torch

import os
import sys

import kvquant_ext as kvq

sys.path.insert(0, os.path.dirname(__file__))
from utils import bench_gpu_time, bench_time  # noqa: E402


@dataclass
class Case:
    name: str
    B: int
    H: int
    T: int
    D: int
    bits: int
    group: int  # -1: KCVT (whole axis)
    sparsity: float
    rank: int
    iters: int = 3


# ----------------------------------------------------------------------------- torch-ops GEAR
def _quant_torch(x, bits, group, per_channel):
    """Asymmetric min/max group quantization with torch ops (codes unpacked, fp16 stats)."""
    *lead, T, D = x.shape
    xf = x.float()
    if per_channel:
        G = T if group == -1 else group
        g = xf.reshape(*lead, T // G, G, D)
        dim = -2
    else:
        G = D if group == -1 else group
        g = xf.reshape(*lead, T, D // G, G)
        dim = -1
    mn, mx = g.amin(dim, keepdim=True), g.amax(dim, keepdim=True)
    maxq = (1 << bits) - 1
    scale = ((mx - mn) / maxq).clamp_min(1e-8).half().float()
    zero = mn.half().float()
    q = ((g - zero) / scale).round_().clamp_(0, maxq)
    return (q * scale + zero).reshape(x.shape)


def gear_torch(x, bits, group, per_channel, sparsity, rank, iters=3, seed=0):
    """GEAR with plain torch ops: topk outliers, clamp, quantize, residual, power iteration
    with torch.linalg.qr.  Returns the reconstruction's pieces (not packed)."""
    vec = x.transpose(-1, -2) if per_channel else x
    L = vec.shape[-1]
    k = kvq.outlier_count(sparsity, L)
    xc = x
    if k > 0:
        top = vec.topk(k + 1, dim=-1)
        bot = vec.topk(k + 1, dim=-1, largest=False)
        hi, lo = top.values[..., -1:], bot.values[..., -1:]
        vc = torch.minimum(torch.maximum(vec, lo), hi)
        xc = vc.transpose(-1, -2) if per_channel else vc
        idx = torch.cat([top.indices[..., :k], bot.indices[..., :k]], -1)
        vals = torch.gather(vec, -1, idx)
    deq = _quant_torch(xc, bits, group, per_channel)
    R = (xc.float() - deq)
    if k > 0:
        Rv = R.transpose(-1, -2) if per_channel else R
        Rv.scatter_(-1, idx, 0.0)
    A = B = None
    if rank > 0:
        g = torch.Generator(device=x.device).manual_seed(seed)
        Bt = torch.randn(R.shape[-1], rank, device=x.device, generator=g)
        Bt = torch.linalg.qr(Bt).Q.expand(*R.shape[:-2], -1, -1)
        for i in range(iters):
            Q = torch.linalg.qr(R @ Bt).Q
            B = R.mT @ Q
            if i < iters - 1:
                Bt = torch.linalg.qr(B).Q
        A, B = Q.half(), B.half()
    return deq, (vals, idx) if k > 0 else None, A, B


# ----------------------------------------------------------------------------- main
def _graph_time(fn, args) -> float:
    """GPU time of fn replayed from a CUDA graph (nan, with a note, if capture fails)."""
    try:
        return bench_gpu_time(fn, samples=args.iters, warmup=args.warmup, graph=True)["us"]
    except Exception as e:  # noqa: BLE001 - report and keep benchmarking
        print(f"# graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        torch.cuda.synchronize()
        return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--decode-tokens", type=int, default=64, help="n_b of the decode-block case")
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--no-torch", action="store_true", help="skip the torch-ops baseline")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args()

    dev, dtype = args.device, getattr(torch, args.dtype)
    B, H, T, D = args.batch, args.heads, args.tokens, args.head_dim
    cases = [
        Case("gear-2 prefill", B, H, T, D, 2, 64, 0.02, 4),
        Case("gear-4 prefill (KCVT)", B, H, T, D, 4, -1, 0.02, 4),
        Case("gearl-2 prefill", B, H, T, D, 2, 64, 0.0, 4),
        Case("gear-2 decode block", B, H, args.decode_tokens, D, 2, 64, 0.02, 2),
        Case("gear-4 decode block (n_b=20)", B, H, 20, D, 4, -1, 0.02, 2),
    ]
    rows, results = [], []
    for c in cases:
        g = torch.Generator(device="cpu").manual_seed(0)
        x = (torch.randn(c.B, c.H, c.T, c.D, generator=g) * (1 + torch.rand(1, 1, 1, c.D, generator=g))).to(dtype).to(dev)
        for role, pc in (("key", True), ("value", False)):
            G = c.group
            if pc and G != -1 and c.T % G:
                G = c.T  # decode-block keys are their own group when n_b < G
            t_kivi = bench_time(lambda: kvq.quantize(x, c.bits, G, pc), iters=args.iters,
                           warmup=args.warmup, device=dev)
            t_gear = bench_time(lambda: kvq.gear_compress(x, c.bits, G, pc, c.sparsity, c.rank, c.iters),
                           iters=args.iters, warmup=args.warmup, device=dev)
            gk = gg = float("nan")
            if dev == "cuda":
                gk = _graph_time(lambda: kvq.quantize(x, c.bits, G, pc, check_finite=False), args)
                gg = _graph_time(lambda: kvq.gear_compress(x, c.bits, G, pc, c.sparsity, c.rank, c.iters,
                                                           check_finite=False), args)
            t_torch = float("nan")
            if not args.no_torch:
                t_torch = bench_time(lambda: gear_torch(x, c.bits, G, pc, c.sparsity, c.rank, c.iters),
                                iters=max(3, args.iters // 5), warmup=2, device=dev)
            rec = kvq.gear_decompress(*kvq.gear_compress(x, c.bits, G, pc, c.sparsity, c.rank, c.iters),
                                      c.bits, pc, dtype)
            kivi = kvq.dequantize(*kvq.quantize(x, c.bits, G, pc), c.bits, pc, dtype)
            err = ((rec.float() - x.float()).norm() / x.float().norm()).item()
            err_kivi = ((kivi.float() - x.float()).norm() / x.float().norm()).item()
            r = dict(case=c.name, role=role, shape=[c.B, c.H, c.T, c.D], kivi_us=t_kivi,
                     gear_us=t_gear, kivi_graph_us=gk, gear_graph_us=gg,
                     gear_over_kivi_graph=gg / gk, torch_us=t_torch, gear_over_kivi=t_gear / t_kivi,
                     torch_over_gear=t_torch / t_gear, rel_err=err, rel_err_kivi=err_kivi)
            results.append(r)
            rows.append(f"| {c.name} | {role} | {c.B}x{c.H}x{c.T}x{c.D} | {t_kivi:.1f} | {t_gear:.1f} | "
                        f"{gk:.1f} | {gg:.1f} | {gg / gk:.2f}x | "
                        f"{t_torch:.1f} | {t_gear / t_kivi:.2f}x | {t_torch / t_gear:.1f}x | "
                        f"{err:.4f} / {err_kivi:.4f} |")
    name = torch.cuda.get_device_name(0) if dev == "cuda" else "CPU"
    print(f"\nGEAR compression on {name}, {args.dtype}, median of {args.iters} runs, cold L2\n")
    print("| case | role | B x H x T x D | KIVI quantize (us) | gear_compress (us) "
          "| KIVI graph (us) | GEAR graph (us) | GEAR / KIVI graph "
          "| torch ops (us) | GEAR / KIVI | torch / GEAR | rel. error GEAR / KIVI |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "dtype": args.dtype, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
