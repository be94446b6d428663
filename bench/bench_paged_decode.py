"""Paged decode attention (kvq.PagedKVCache / kvq.ops.paged_decode_attention) vs FP16 SDPA on a
contiguous cache of the same shape, and vs the contiguous fused op (kvq.decode_attention over a
kvq.KVCache), Llama-3-8B attention shape (32 query heads, 8 KV heads, D = 128), all in one run.

For each shape: the raw ops (plan + attention) captured in a CUDA graph and replayed ("graph"),
the eager PagedKVCache.decode_attention call ("eager": GPU time between events around the
Python call) and its host wall time per call ("host"), bytes the op reads (the layer's nbytes),
GB/s and % of the device-to-device copy bandwidth measured in the same run.  Then a mixed batch
of 16 sequences (1k .. 64k tokens) next to an equal-length batch of the same total tokens, and
paged_append of one decode token for 32 sequences (alone in a graph, and per call of 32 calls --
a 32-layer step's worth -- in one graph; and of a step that fills pages, and of one
whose 32 page pairs all point at the scratch page, as a captured step's rows with nothing to
compress do).

    python bench/bench_paged_decode.py [--batch 1 8 32] [--len 4096 32768 131072] [--presets kivi-2 ...]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
import kvquant_ext as kvq  # noqa: E402
from utils import bench_gpu_time, copy_bandwidth, table  # noqa: E402
from kvquant_ext.paged import default_page_size  # noqa: E402

DEFAULT_PRESETS = ["fp16", "kivi-2", "kivi-4", "int4-per-token", "kcvt-4", "flexgen-4", "hqmq-3.79-paper"]
H, HQ, D = 8, 32, 128


def build(preset, lens, max_tokens=None, page_size=None):
    """A one-layer PagedKVCache (pages of `page_size` tokens, default the pool's) holding random
    sequences of the given lengths."""
    page_size = page_size or default_page_size(kvq.get_config(preset))
    cache = kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=H, head_dim=D, device="cuda",
                             max_tokens=max_tokens or sum(lens) + page_size * len(lens), max_seqs=max(len(lens), 4),
                             page_size=page_size)
    ids = []
    for L in lens:
        sid = cache.add_sequence()
        ids.append(sid)
        for a in range(0, L, 16384):
            n = min(16384, L - a)
            cache.append(0, [sid], torch.randn(1, H, n, D, device="cuda", dtype=torch.float16),
                         torch.randn(1, H, n, D, device="cuda", dtype=torch.float16))
    return cache, ids


def raw_call(cache, ids, q):
    bt, lens, comp = cache.batch_tables(0, ids)
    mi = cache.default_max_items(len(ids))

    def fn():
        work = kvq.ops.paged_decode_plan(lens, comp, mi)
        return cache.attention_op(0, q, bt, lens, comp, work, D ** -0.5)[0]
    return fn


def host_us(fn, iters=200):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / iters * 1e6


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--len", type=int, nargs="+", default=[4096, 32768, 131072])
    ap.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    ap.add_argument("--max-kv-gb", type=float, default=20.0, help="skip shapes whose FP16 KV exceeds this")
    ap.add_argument("--no-contiguous", action="store_true", help="skip the contiguous kvq.decode_attention rows")
    ap.add_argument("--mixed", action="store_true", help="only the mixed-length and append rows")
    ap.add_argument("--page-size", type=int, nargs="+", default=None,
                    help="page sizes of the paged rows (one row per preset and page size; default: one row "
                    "at the pool's default page size, kvq.paged.default_page_size)")
    args = ap.parse_args(argv)
    copy_bw = copy_bandwidth()
    print(f"# paged decode attention, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{datetime.date.today()}, Hq={HQ} H={H} D={D} fp16; copy {copy_bw / 1e9:.0f} GB/s", flush=True)
    hdr = ["B", "L", "cache", "graph us", "eager us", "host us", "vs FP16 (graph)", "MB read", "GB/s", "% copy"]
    rows = []
    shapes = [] if args.mixed else [(B, L) for B in args.batch for L in args.len]
    for B, L in shapes:
        fp16_bytes = 2 * B * H * L * D * 2
        if fp16_bytes / 1e9 > args.max_kv_gb:
            continue
        torch.manual_seed(0)
        k = torch.randn(B, H, L, D, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        q4 = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.float16)
        sdpa = lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)  # noqa: E731
        base = bench_gpu_time(sdpa, graph=True)["us"]
        eager = bench_gpu_time(sdpa)["us"]
        rows.append([B, L, "fp16 SDPA (contiguous)", f"{base:.1f}", f"{eager:.1f}", f"{host_us(sdpa):.1f}", "1.00",
                     f"{fp16_bytes / 1e6:.0f}", f"{fp16_bytes / base / 1e3:.0f}",
                     f"{100 * fp16_bytes / (base * 1e-6) / copy_bw:.0f}%"])
        print(rows[-1], flush=True)
        q = q4[:, :, 0].contiguous()
        for preset in args.presets:
            if not args.no_contiguous and preset != "fp16":
                kc = kvq.KVCache(preset)
                kc.update(k, v, 0)
                fn = lambda: kvq.decode_attention(q, kc, 0)  # noqa: E731
                g = bench_gpu_time(fn, graph=True)["us"]
                rows.append([B, L, f"{preset} contiguous", f"{g:.1f}", f"{bench_gpu_time(fn)['us']:.1f}",
                             f"{host_us(fn):.1f}", f"{base / g:.2f}", "", "", ""])
                print(rows[-1], flush=True)
                del kc
            for P in args.page_size or [None]:
                cache, ids = build(preset, [L] * B, page_size=P)
                nb = cache.nbytes
                g = bench_gpu_time(raw_call(cache, ids, q), graph=True)["us"]
                fn = lambda: cache.decode_attention(q, 0, ids)  # noqa: E731
                name = f"{preset} paged" + (f" P={P}" if args.page_size else "")
                rows.append([B, L, name, f"{g:.1f}", f"{bench_gpu_time(fn)['us']:.1f}", f"{host_us(fn):.1f}",
                             f"{base / g:.2f}", f"{nb / 1e6:.0f}", f"{nb / g / 1e3:.0f}",
                             f"{100 * nb / (g * 1e-6) / copy_bw:.0f}%"])
                print(rows[-1], flush=True)
                del cache
        del k, v
        torch.cuda.empty_cache()
    print(table(rows, hdr), flush=True)

    # ---- mixed lengths vs equal lengths of the same total tokens ----
    mixed = [int(1024 * (64 ** (i / 15))) for i in range(16)]  # 1k .. 64k, geometric
    total = sum(mixed)
    mrows = []
    for preset in args.presets:
        out = []
        for lens in (mixed, [total // 16] * 16):
            cache, ids = build(preset, lens)
            q = torch.randn(16, HQ, D, device="cuda", dtype=torch.float16)
            out.append(bench_gpu_time(raw_call(cache, ids, q), graph=True)["us"])
            del cache
        mrows.append([preset, total, f"{out[0]:.1f}", f"{out[1]:.1f}", f"{out[0] / out[1]:.2f}"])
        print(mrows[-1], flush=True)
    print(table(mrows, ["cache", "total tokens", "mixed 1k..64k us", "equal us", "mixed / equal"]), flush=True)

    # ---- paged_append: one decode token for 32 sequences; a step whose tokens fill pages ----
    arows = []
    for preset in args.presets:
        cache, ids = build(preset, [1000] * 32, max_tokens=32 * 4096)
        layer = cache.layers[0]
        kt = torch.randn(32, H, D, device="cuda", dtype=torch.float16)
        slots = torch.tensor([layer.seqs[s].fp_pages[-1] * 128 + 1000 % 128 for s in ids], device="cuda")
        spec = cache.kspec
        bits, kpc, vpc = (spec.bits, spec.per_channel, cache.vspec.per_channel) if spec else (2, True, False)
        pools = layer.comp_tensors() if cache.hqmq is None else ()
        one = lambda: kvq.ops.paged_append(layer.k_fp, layer.v_fp, kt, kt, slots, *pools,  # noqa: E731
                                           bits=bits, k_per_channel=kpc, v_per_channel=vpc)
        t1 = bench_gpu_time(one, cold_l2=False)["us"]
        g1 = bench_gpu_time(one, cold_l2=False, graph=True)["us"]
        # a decode step's worth: one call per layer of a 32-layer model in one graph, per call
        g32 = bench_gpu_time(lambda: [one() for _ in range(32)], cold_l2=False, graph=True)["us"] / 32
        tf = tg = ts = float("nan")
        if cache.compressed:
            src = torch.tensor([layer.seqs[s].fp_pages[-1] for s in ids], device="cuda")
            dst = torch.tensor(layer.free_comp[:32], device="cuda")
            if cache.hqmq is not None:
                def fill():
                    one()
                    cache._encode_pages(layer, src, dst)
            else:
                fill = lambda: kvq.ops.paged_append(layer.k_fp, layer.v_fp, kt, kt, slots,  # noqa: E731
                                                    *pools, compress_src=src, compress_dst=dst, bits=bits,
                                                    k_per_channel=kpc, v_per_channel=vpc)
            tf = bench_gpu_time(fill, cold_l2=False)["us"]
            tg = bench_gpu_time(fill, cold_l2=False, graph=True)["us"]
            if cache.hqmq is None:  # a captured step's pairs for rows with nothing to compress
                zero = torch.zeros_like(src)
                ts = bench_gpu_time(lambda: kvq.ops.paged_append(
                    layer.k_fp, layer.v_fp, kt, kt, slots, *pools, compress_src=zero, compress_dst=zero, bits=bits,
                    k_per_channel=kpc, v_per_channel=vpc), cold_l2=False, graph=True)["us"]
        arows.append([preset, f"{g1:.1f}", f"{g32:.1f}", f"{t1:.1f}", f"{tf:.1f}", f"{tg:.1f}", f"{ts:.1f}"])
        print(arows[-1], flush=True)
        del cache
    print(table(arows, ["cache", "append 32 x 1 token graph us", "per call of 32 in one graph us", "eager us",
                        "append + compress 32 pages eager us",
                        "graph us", "append + 32 scratch pairs graph us"]),
          flush=True)


if __name__ == "__main__":
    main()
