"""Timing helpers for the Python benchmarks: CUDA events, median of many samples, cold L2
(a 2x-L2 buffer is overwritten before every sample), and the device-to-device copy
bandwidth measured in the same run as the ceiling."""
from __future__ import annotations

import statistics
from typing import Callable, Dict

import torch

_FLUSH = None


def _flush_l2():
    global _FLUSH
    if _FLUSH is None:
        l2 = torch.cuda.get_device_properties(0).L2_cache_size
        _FLUSH = torch.empty(2 * l2, dtype=torch.uint8, device="cuda")
    _FLUSH.fill_(1)


def bench_gpu_time(fn: Callable[[], object], *, samples: int = 50, warmup: int = 3,
                   cold_l2: bool = True, graph: bool = False) -> Dict[str, float]:
    """Median/mean GPU time of ``fn()`` in microseconds (CUDA events).

    ``graph=True`` captures ``fn`` into a CUDA graph once and times its replays, so host-side
    launch overhead (Python, argument checks) is excluded: what is left is GPU time."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            with torch.cuda.graph(g, stream=s):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        fn = g.replay
    times = []
    for _ in range(samples):
        if cold_l2:
            _flush_l2()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    med = statistics.median(times)
    mean = statistics.fmean(times)
    return {"us": med, "mean_us": mean, "noise": statistics.pstdev(times) / mean}


def bench_time(fn: Callable[[], object], *, iters: int = 50, warmup: int = 3,
               device: str = "cuda") -> float:
    """Median time of ``fn()`` in microseconds: CUDA events with a cold L2 on ``cuda``,
    ``time.perf_counter`` otherwise."""
    if device == "cuda":
        return bench_gpu_time(fn, samples=iters, warmup=warmup)["us"]
    import time
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(3)
    b = torch.empty_like(a)
    t = bench_gpu_time(lambda: b.copy_(a), samples=30)
    return 2 * nbytes / (t["us"] * 1e-6)


def table(rows, headers) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    for r in rows:
        out.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(out)

