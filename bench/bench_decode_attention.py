"""Decode attention over compressed caches vs FP16 SDPA, Llama-3-8B attention shape.

For each (B, L): FP16 ``scaled_dot_product_attention`` (flash backend, enable_gqa),
"dequantize then SDPA", and ``kvq.decode_attention`` (fused) for each preset, all in one
run.  Reports GPU time (the call captured in a CUDA graph and replayed: no host overhead), the
eager time (events around the Python call, cold L2 each sample), speedup vs FP16 (graph
times), bytes the fused op must read, achieved GB/s and % of the
device-to-device copy bandwidth measured in the same run.

    python bench/bench_decode_attention.py [--batch 1 8 32] [--len 4096 32768 131072]

``--stream-prefill P`` builds every cache as a long generation leaves it: one ``update`` with
the first P tokens (the prefill block), then one with the other L - P (GEAR: compressed in
``buffer_length``-token decode blocks, each with its own outliers and rank-``rank_decode``
factors, exactly as token-by-token appends would form them; the tokens past the last whole
block stay in the full-precision buffer).  Rows are labelled ``[stream P+rest]``; the
dequantize+SDPA rows are left out (the Python per-block dequantize is not what is measured).
Default: off (one update of all L tokens, the rows of docs/performance.md).

    python bench/bench_decode_attention.py --batch 8 --len 32768 --stream-prefill 4096 \
        --presets kivi-2 gear-2 gearl-2 outlier-2
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import kvquant_ext as kvq  # noqa: E402
from kvquant_ext import uses_fused_kernel  # noqa: E402
from utils import bench_gpu_time, copy_bandwidth, table  # noqa: E402

DEFAULT_PRESETS = ["kivi-2", "kivi-4", "kcvt-4", "int4-per-token", "flexgen-4", "gear-2", "gearl-2", "outlier-2",
                   "hqmq-3.79", "hqmq-5"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--len", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--h", type=int, default=8)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--max-kv-gb", type=float, default=40.0, help="skip shapes whose FP16 KV exceeds this")
    ap.add_argument("--stream-prefill", type=int, default=None, metavar="P",
                    help="build each cache from a P-token prefill, then the rest appended (decode blocks)")
    ap.add_argument("--out", default=None, help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    Hq, H, D = args.hq, args.h, args.d
    copy_bw = copy_bandwidth()
    head = (f"# decode attention, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
            f"{datetime.date.today()}, Hq={Hq} H={H} D={D} fp16; copy {copy_bw / 1e9:.0f} GB/s")
    print(head, flush=True)
    rows = []
    presets = [p for p in args.presets if p in kvq.PRESETS]
    for B in args.batch:
        for L in args.len:
            fp16_bytes = 2 * B * H * L * D * 2
            if fp16_bytes / 1e9 > args.max_kv_gb:
                continue
            P = args.stream_prefill
            stream = P is not None and 0 < P < L
            tag = f" [stream {P}+{L - P}]" if stream else ""
            torch.manual_seed(0)
            k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
            v = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
            q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.float16)
            sdpa = lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True)  # noqa: E731
            eager = bench_gpu_time(sdpa)["us"]
            base = bench_gpu_time(sdpa, graph=True)["us"]
            bw = fp16_bytes / (base * 1e-6)
            rows.append([B, L, "fp16 SDPA", f"{base:.1f}", f"{eager:.1f}", "1.00", f"{fp16_bytes / 1e6:.0f}",
                         f"{bw / 1e9:.0f}", f"{100 * bw / copy_bw:.0f}%"])
            print(rows[-1], flush=True)
            for name in presets:
                cache = kvq.KVCache(name, check_finite=False)
                try:
                    if stream:
                        cache.update(k[:, :, :P], v[:, :, :P], 0)
                        cache.update(k[:, :, P:], v[:, :, P:], 0)
                        kst = cache.layers[0].key
                        if hasattr(kst, "num_decode_blocks"):
                            print(f"{name}: prefill block {kst.T0} tokens, {kst.num_decode_blocks} decode blocks"
                                  f" of {kst.config.buffer_length}, buffer "
                                  f"{0 if kst.buffer is None else kst.buffer.shape[2]}", flush=True)
                    else:
                        cache.update(k, v, 0)
                except Exception as e:  # pragma: no cover - report and go on
                    print(f"skip {name}: {e}")
                    continue
                fused = uses_fused_kernel(cache, 0, q)
                if not fused and fp16_bytes > 4e9:
                    del cache
                    continue  # no fused kernel: its dequantize path would need ~4x FP16 memory
                nbytes = cache.nbytes
                label = "fused" if fused else "decode_attention (dequantizes: no fused kernel)"
                run = lambda: kvq.decode_attention(q, cache, 0)  # noqa: E731
                eager = bench_gpu_time(run, samples=50 if fused else 10)["us"]
                t = bench_gpu_time(run, samples=50 if fused else 10, graph=fused)
                bw = nbytes / (t["us"] * 1e-6)
                rows.append([B, L, f"{name} {label}{tag}", f"{t['us']:.1f}", f"{eager:.1f}", f"{base / t['us']:.2f}",
                             f"{nbytes / 1e6:.0f}", f"{bw / 1e9:.0f}", f"{100 * bw / copy_bw:.0f}%"])
                print(rows[-1], flush=True)
                if not stream and name in ("kivi-2", "gear-2", "hqmq-3.79", "hqmq-5"):
                    def deq_sdpa():
                        K, V = cache.dequantize(0)
                        return F.scaled_dot_product_attention(q, K, V, enable_gqa=True)
                    t = bench_gpu_time(deq_sdpa, samples=20)
                    rows.append([B, L, f"{name} dequantize+SDPA", f"{t['us']:.1f}", f"{t['us']:.1f}",
                                 f"{base / t['us']:.2f}",
                                 "", "", ""])
                    print(rows[-1], flush=True)
                del cache
            del k, v
            torch.cuda.empty_cache()
    text = head + "\n\n" + table(rows, ["B", "L", "method", "us (graph)", "us (eager)", "speedup vs FP16", "MB read",
                                       "GB/s", "% of copy"])
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
