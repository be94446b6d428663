"""Quantize + pack throughput of kvq.quantize on a real-shaped KV cache, against a
device-to-device copy measured in the same run.

    python bench/bench_group_quant.py [--shape 8 8 4096 128]

"% of copy of x" compares with a device-to-device copy of the input tensor itself (same bytes
read), "% of 1 GiB copy" with the device's best copy rate.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import kvquant_ext as kvq  # noqa: E402
from utils import bench_gpu_time, copy_bandwidth, table  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", type=int, nargs=4, default=[8, 8, 4096, 128], metavar=("B", "H", "T", "D"))
    ap.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    B, H, T, D = args.shape
    x = torch.randn(B, H, T, D, device="cuda", dtype=dtype)
    copy_bw = copy_bandwidth()  # 1 GiB: the device's best copy rate
    copy_x = copy_bandwidth(x.numel() * x.element_size())  # a copy of x itself (same bytes read)
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, copy {copy_bw / 1e9:.0f} GB/s (1 GiB), "
          f"{copy_x / 1e9:.0f} GB/s (copy of x, {x.numel() * x.element_size() >> 20} MiB)")
    rows = []
    cases = [("key per-channel", True, 32, 2), ("key per-channel", True, 64, 2), ("key per-channel", True, 128, 2),
             ("key per-channel", True, 32, 4), ("key per-channel", True, 128, 4), ("key per-channel", True, 32, 8),
             ("KCVT key (whole channel)", True, -1, 2),
             ("value per-token", False, 32, 2), ("value per-token", False, 32, 4), ("value per-token", False, -1, 4),
             ("value per-token", False, 64, 2), ("value per-token", False, 128, 2), ("value per-token", False, 128, 4),
             ("value per-token", False, -1, 2),
             ("KCVT key (whole channel)", True, -1, 4)]
    for name, pc, G, bits in cases:
        c, s, z = kvq.quantize(x, bits, G, pc, check_finite=False)
        nbytes = x.numel() * x.element_size() + c.numel() * 4 + 2 * s.numel() * 2
        for label, fn in ((f"quantize {name} G={G} {bits}b", lambda: kvq.quantize(x, bits, G, pc, check_finite=False)),
                          (f"dequantize {name} G={G} {bits}b", lambda: kvq.dequantize(c, s, z, bits, pc, dtype))):
            t = bench_gpu_time(fn)
            bw = nbytes / (t["us"] * 1e-6)
            rows.append([label, f"{t['us']:.1f}", f"{100 * t['noise']:.1f}%", f"{bw / 1e9:.0f}",
                         f"{100 * bw / copy_x:.0f}%", f"{100 * bw / copy_bw:.0f}%"])
    t = bench_gpu_time(lambda: kvq.quantize(x, 2, 32, True, check_finite=True))
    rows.append(["quantize key per-channel G=32 2b, check_finite=True (syncs)", f"{t['us']:.1f}",
                 f"{100 * t['noise']:.1f}%", "", "", ""])
    print(table(rows, ["op", "us", "noise", "GB/s", "% of copy of x", "% of 1 GiB copy"]))


if __name__ == "__main__":
    main()
