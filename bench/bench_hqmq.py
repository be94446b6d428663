"""Benchmark HQMQ encode/decode (kvq.hqmq_encode / kvq.hqmq_decode) on CUDA (--device cpu: the
C++ twin, timed with perf_counter; for a quick smoke run on small shapes).

Next to each op, in the same run: a brute-force 24*S codeword search written with torch
ops (the public reference's approach: every codeword, one big matmul + argmax, chunked to
bound memory) and a device-to-device copy of the input (bandwidth reference).

Timing: CUDA events, median of --iters runs, L2 flushed (bench/utils.py) before each run.
GB/s counts the bytes each op must move: encode reads x and writes the packed rows (int16
[..., T, U], the radius scales inside them; + Med3x records); decode reads the packed rows and
writes x; copy reads and writes x.

    python bench/bench_hqmq.py                      # [8, 8, 4096, 128] fp16, S = 96 and 192
    python bench/bench_hqmq.py --shape 1 8 32768 128 --secondary 192 --med3
    python bench/bench_hqmq.py --device cpu --shape 1 2 64 128 --iters 2 --warmup 0
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

import os
import sys

import kvquant_ext as kvq
from kvquant_ext import hqmq_secondary, med3_threshold

sys.path.insert(0, os.path.dirname(__file__))
from utils import bench_time  # noqa: E402

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
DEFAULT_RADIUS_BITS = {96: 4, 192: 6}


@dataclass
class Row:
    op: str
    S: int
    us: float
    nbytes: int

    @property
    def gbs(self) -> float:
        return self.nbytes / (self.us * 1e-6) / 1e9


def hurwitz_units(device) -> torch.Tensor:
    P = torch.zeros(24, 4, device=device)
    for p in range(8):
        P[p, p // 2] = -1.0 if p & 1 else 1.0
    for m in range(16):
        for i in range(4):
            P[8 + m, i] = -0.5 if (m >> i) & 1 else 0.5
    return P


def hamilton(a, b):
    a0, a1, a2, a3 = a.unbind(-1)
    b0, b1, b2, b3 = b.unbind(-1)
    return torch.stack([a0 * b0 - a1 * b1 - a2 * b2 - a3 * b3, a0 * b1 + a1 * b0 + a2 * b3 - a3 * b2,
                        a0 * b2 - a1 * b3 + a2 * b0 + a3 * b1, a0 * b3 + a1 * b2 - a2 * b1 + a3 * b0],
                       dim=-1)


def brute_force_encode(x, codebooks, radius_bits, chunk_rows):
    """Torch-ops HQMQ: per head, scores = chunks @ codebook.T (all 24 S codewords), argmax;
    radius codes against the per-token max radius."""
    B, H, T, D = x.shape
    xc = x.float().reshape(B, H, T, D // 4, 4)
    r = xc.norm(dim=-1)
    scale = r.amax(dim=-1, keepdim=True)
    maxq = (1 << radius_bits) - 1
    rcode = torch.round(r / scale.clamp_min(1e-30) * maxq).to(torch.int32)
    dirs = torch.empty(B, H, T * D // 4, dtype=torch.int32, device=x.device)
    for h in range(H):
        rows = xc[:, h].reshape(-1, 4)
        out = dirs[:, h].reshape(-1)
        for i in range(0, rows.shape[0], chunk_rows):
            out[i:i + chunk_rows] = (rows[i:i + chunk_rows] @ codebooks[h].T).argmax(dim=-1)
    return dirs, rcode, scale.half()


def packed_dirs(codes: torch.Tensor, D: int, S: int, radius_bits: int) -> torch.Tensor:
    """Direction indices [..., T, D/4] of packed rows [..., T, U] (kvq.ops.hqmq_row_layout:
    plain fields of E bits from bit 0, base-R digits K per 16-bit group, then the tail)."""
    lay = kvq.ops.hqmq_row_layout(D, S, radius_bits)
    C, E, R, K, G = lay["C"], lay["E"], lay["R"], lay["K"], lay["G"]
    u = codes.long() & 0xFFFF
    bits = ((u[..., None] >> torch.arange(16, device=codes.device)) & 1).flatten(-2)

    def take(at, width):
        if width == 0:
            return torch.zeros(bits.shape[:-1], dtype=torch.long, device=codes.device)
        w = torch.arange(width, device=codes.device)
        return (bits[..., at:at + width] << w).sum(-1)

    plain = torch.stack([take(c * E, E) for c in range(C)], -1)
    digits = []
    for j in range(G + 1):
        n = K if j < G else C - G * K
        g = take(lay["groups_at"] + 16 * j, 16) if j < G else take(lay["tail_at"], lay["tail_bits"])
        digits += [(g // R ** i) % R for i in range(n)]
    field = torch.stack(digits, -1) * 2 ** E + plain
    return field >> radius_bits


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 8, 4096, 128], metavar=("B", "H", "T", "D"))
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp16")
    ap.add_argument("--secondary", type=int, nargs="+", default=[96, 192], help="S values")
    ap.add_argument("--radius-bits", type=int, default=None, help="default: 4 for S=96, 6 otherwise")
    ap.add_argument("--med3", action="store_true", help="encode with a Med3x threshold (x3 median)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--brute-iters", type=int, default=3)
    ap.add_argument("--chunk-rows", type=int, default=1 << 17, help="brute-force rows per matmul")
    ap.add_argument("--no-brute", action="store_true")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="cpu: the C++ twin (perf_counter timing, no L2 flush), for smoke runs")
    args = ap.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_hqmq.py needs a CUDA GPU (or --device cpu)")
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device(args.device)
    timer = lambda fn, iters, warmup: bench_time(fn, iters=iters, warmup=warmup, device=args.device)  # noqa: E731
    B, H, T, D = args.shape
    dtype = DTYPES[args.dtype]
    x = torch.randn(B, H, T, D, device=dev).to(dtype)
    esz = x.element_size()
    n = x.numel()

    dst = torch.empty_like(x)
    rows = [Row("copy (D2D)", 0, timer(lambda: dst.copy_(x), args.iters, args.warmup), 2 * n * esz)]
    for S in args.secondary:
        rb = args.radius_bits or DEFAULT_RADIUS_BITS.get(S, 6)
        sec = hqmq_secondary(H, S, 0, device=dev)
        thr = med3_threshold(x, 3.0) if args.med3 else None
        codes, rec = kvq.hqmq_encode(x, sec, rb, thr)
        assert codes.dtype == torch.int16 and codes.shape[-1] == kvq.ops.hqmq_units(D, S, rb)
        stored = codes.numel() * 2 + rec.numel() * 4
        t_enc = timer(lambda: kvq.hqmq_encode(x, sec, rb, thr), args.iters, args.warmup)
        rows.append(Row(f"hqmq_encode b_r={rb}", S, t_enc, n * esz + stored))
        t_dec = timer(lambda: kvq.hqmq_decode(codes, sec, rec, rb, D, dtype), args.iters, args.warmup)
        rows.append(Row(f"hqmq_decode b_r={rb}", S, t_dec, n * esz + stored))
        if not args.no_brute:
            P = hurwitz_units(dev)
            cbs = hamilton(P[None, None, :, :], sec[:, :, None, :]).reshape(H, 24 * S, 4)
            t_bf = timer(lambda: brute_force_encode(x, cbs, rb, args.chunk_rows), args.brute_iters, 1)
            rows.append(Row("brute force (torch matmul+argmax)", S, t_bf, n * esz))
            # sanity: the kernel's codewords score as well as the brute-force argmax
            dirs_bf, _, _ = brute_force_encode(x[:1, :, :256], cbs, rb, args.chunk_rows)
            dk = packed_dirs(codes[:1, :, :256], D, S, rb).reshape(1, H, -1)
            xc = x[:1, :, :256].float().reshape(1, H, -1, 4)
            sk = (xc * cbs[torch.arange(H, device=dev)[None, :, None], dk]).sum(-1)
            sb = (xc * cbs[torch.arange(H, device=dev)[None, :, None], dirs_bf.long()]).sum(-1)
            ok = sk >= sb - 1e-4 * xc.norm(dim=-1)
            if thr is not None:  # Med3x chunks are stored exactly (direction field 0)
                ok |= xc.norm(dim=-1) > thr.view(1, H, 1) * (1 - 1e-6)
            assert ok.all(), "kernel codeword worse than brute force"

    copy_gbs = rows[0].gbs
    where = torch.cuda.get_device_name() if args.device == "cuda" else "CPU"
    print(f"\nHQMQ on {where} — x = {list(args.shape)} {args.dtype}"
          f"{', Med3x' if args.med3 else ''}; median of {args.iters} (brute force {args.brute_iters})"
          f"{', cold L2' if args.device == 'cuda' else ''}\n")
    print("| op | S | µs | GB/s | % of copy | vs brute force |")
    print("|---|---:|---:|---:|---:|---:|")
    bf = {r.S: r.us for r in rows if r.op.startswith("brute")}
    for r in rows:
        speed = f"{bf[r.S] / r.us:.1f}x" if r.S in bf and not r.op.startswith("brute") else ""
        print(f"| {r.op} | {r.S or ''} | {r.us:.1f} | {r.gbs:.0f} | {100 * r.gbs / copy_gbs:.1f}% | {speed} |")


if __name__ == "__main__":
    main()
