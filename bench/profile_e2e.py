"""Where a decode step of ``model.generate`` spends its time: torch.profiler over the decode
steps (prefill and the first step excluded) of the model of ``bench_e2e.py``, for
transformers' ``DynamicCache`` with SDPA (as ``generate`` calls it, with its all-ones
attention mask, without a mask, and with SDPA's cuDNN backend excluded), ``StaticCache`` with SDPA,
``kvq`` presets (eager ``kvq.hf.QuantizedCache``) and ``--static`` presets
(``kvq.hf.StaticQuantizedCache``, whose decode step generate compiles into CUDA graphs; one
short warm-up generate compiles it before the profiled one).

For each cache: wall ms per step (synchronised), then the top CUDA kernels by GPU time and
the top CPU operators by self CPU time, each per step.

    python bench/profile_e2e.py [--layers 4 --batch 8 --prompt 16384 --steps 8]
        [--presets kivi-2,hqmq-3.79] [--static kivi-2] [--rows 12]
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
import kvquant_ext as kvq  # noqa: E402
import kvquant_ext.hf as kh  # noqa: E402
from bench_e2e import build_model, forget_compiled, sdpa_backends  # noqa: E402


class ProfStep:
    """LogitsProcessor: one profiler step (and a synchronised timestamp) per generated token."""

    def __init__(self, prof, device):
        self.prof, self.device, self.times = prof, device, []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        self.prof.step()
        return scores


def profile_one(model, ids, args, kind: str, device):
    from transformers import DynamicCache, LogitsProcessorList, StaticCache
    mask = torch.ones_like(ids)
    if kind.startswith("DynamicCache") or kind == "StaticCache":
        model.set_attn_implementation("sdpa")
        if kind == "StaticCache":
            cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + args.steps + 4)
        else:
            cache = DynamicCache()
        if kind.endswith("no mask"):
            mask = None
    elif kind.startswith("static "):
        kh.enable(model)
        cache = kh.StaticQuantizedCache(kind.split(" ", 1)[1], model.config, max_batch_size=ids.shape[0],
                                        max_cache_len=ids.shape[1] + args.steps + 4)
        with torch.no_grad():  # compiles the decode step (its guards hold this cache's tensors)
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, min_new_tokens=4,
                           do_sample=False, pad_token_id=0, **{kh.cache_kwarg(model): cache})
        cache.reset()
    else:
        kh.enable(model)
        cache = kh.QuantizedCache(kvq.get_config(kind), model.config)
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    # step 0 ends the prefill, step 1 the first decode step (warm-up); then `steps` are recorded
    sched = torch.profiler.schedule(wait=1, warmup=1, active=args.steps, repeat=1)
    with torch.profiler.profile(activities=acts, schedule=sched) as prof:
        clock = ProfStep(prof, device)
        kw = {kh.cache_kwarg(model): cache}
        if mask is not None:
            kw["attention_mask"] = mask
        with torch.no_grad(), sdpa_backends(cudnn=not kind.endswith("without cuDNN")):
            model.generate(input_ids=ids, max_new_tokens=args.steps + 3, min_new_tokens=args.steps + 3,
                           do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]), **kw)
    t = clock.times
    step_ms = (t[2 + args.steps] - t[2]) / args.steps * 1e3
    print(f"\n### {kind}: {step_ms:.2f} ms / decode step (B={ids.shape[0]}, prompt {ids.shape[1]}, "
          f"{args.layers} layers)", flush=True)
    ka = prof.key_averages()
    n = args.steps
    if device.type == "cuda":
        kern = sorted((e for e in ka if e.device_type == torch.autograd.DeviceType.CUDA),
                      key=lambda e: e.self_device_time_total, reverse=True)[:args.rows]
        tot = sum(e.self_device_time_total for e in ka if e.device_type == torch.autograd.DeviceType.CUDA)
        print(f"GPU time {tot / n / 1e3:.2f} ms / step; top kernels (us / step, calls / step):")
        for e in kern:
            print(f"  {e.self_device_time_total / n:9.1f}  {e.count / n:6.1f}  {e.key[:110]}")
    cpu = sorted((e for e in ka if e.device_type == torch.autograd.DeviceType.CPU),
                 key=lambda e: e.self_cpu_time_total, reverse=True)[:args.rows]
    print("top CPU operators by self time (us / step, calls / step):")
    for e in cpu:
        print(f"  {e.self_cpu_time_total / n:9.1f}  {e.count / n:6.1f}  {e.key[:110]}")
    del cache
    if kind.startswith("static "):
        forget_compiled(model)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--steps", type=int, default=8, help="decode steps recorded")
    p.add_argument("--presets", default="kivi-2", help="comma list of kvq presets ('' for none)")
    p.add_argument("--static", default="", help="comma list of presets run as kvq.hf.StaticQuantizedCache, "
                   "compiled by generate")
    p.add_argument("--baselines", default="DynamicCache,DynamicCache no mask,DynamicCache without cuDNN,StaticCache")
    p.add_argument("--rows", type=int, default=12)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny model (CPU smoke test)")
    args = p.parse_args(argv)
    args.new = args.steps + 3
    if args.tiny:
        args.layers, args.batch, args.prompt = min(args.layers, 2), min(args.batch, 2), min(args.prompt, 200)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("profile_e2e: no CUDA device (use --tiny --device cpu for a smoke test)")
        return 1
    torch.manual_seed(0)
    model = build_model(args, device, torch.float16 if device.type == "cuda" else torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=device)
    kinds = [k for k in args.baselines.split(",") if k] + [k for k in args.presets.split(",") if k] + \
        [f"static {k}" for k in args.static.split(",") if k]
    for kind in kinds:
        profile_one(model, ids, args, kind, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
