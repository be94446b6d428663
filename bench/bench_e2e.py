"""End-to-end generate benchmark: peak GPU memory and decode tokens/s of
``model.generate`` with transformers' FP16 ``DynamicCache`` vs ``kvq.hf.QuantizedCache``
for every preset, plus the largest batch that fits a fixed KV budget; with ``--static``, also
the compileable caches (transformers' ``StaticCache``, ``kvq.hf.StaticQuantizedCache``), whose
decode step generate compiles on CUDA.

The model is a **Llama-3-8B-shaped** ``LlamaForCausalLM`` with **random weights and only
``--layers`` (default 4) of its 32 decoder layers** (hidden 4096, 32 query / 8 KV heads,
head dim 128, MLP 14336, vocab 128256): weights do not change the kernels that run, and a
few layers keep the run short.  Memory and KV bytes are measured on those layers; the
"max batch" column scales the measured KV bytes/token to the full 32 layers.

Decode tokens/s = batch x (new tokens - 1) / (time from the first to the last generated
token), timed inside ``generate`` by a logits processor that synchronises the device at
every step (prefill excluded).  Peak memory is ``torch.cuda.max_memory_allocated`` during
``generate`` (weights included; the weights alone are listed in the header).

    python bench/bench_e2e.py                                  # batch 8, prompt 16k, 256 new
    python bench/bench_e2e.py --presets fp16,kivi-2,gear-2 --out docs/bench_e2e.md
    python bench/bench_e2e.py --presets kivi-2 --static kivi-2,hqmq-3.79 --prompt 4096 --new 128
    python bench/bench_e2e.py --tiny --device cpu              # smoke test without a GPU
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

import kvquant_ext as kvq
import kvquant_ext.hf as kh

GIB = 1024 ** 3


class StepClock:
    """LogitsProcessor recording a (synchronised) timestamp at every generation step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: List[float] = []

    def __call__(self, input_ids, scores):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.times.append(time.perf_counter())
        return scores


def build_model(args, device, dtype):
    from transformers import LlamaConfig, LlamaForCausalLM
    if args.tiny:
        cfg = LlamaConfig(vocab_size=1000, hidden_size=256, intermediate_size=512,
                          num_hidden_layers=args.layers, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=64, max_position_embeddings=8192)
    else:
        cfg = LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                          num_hidden_layers=args.layers, num_attention_heads=32,
                          num_key_value_heads=8, head_dim=128, rope_theta=500000.0,
                          max_position_embeddings=max(131072, args.prompt + args.new),
                          rms_norm_eps=1e-5, tie_word_embeddings=False)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    return model.eval()


def cache_bytes(cache) -> int:
    if isinstance(cache, (kh.QuantizedCache, kh.StaticQuantizedCache)):
        return cache.nbytes
    n = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                n += t.numel() * t.element_size()
    return n


def allocated_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from a cache object (capacity, not
    just the used length: growable buffers over-allocate)."""
    seen, total, stack, visited = set(), 0, [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor):
            st = o.untyped_storage()
            key = (st.data_ptr(), o.device)
            if key not in seen and st.nbytes():
                seen.add(key)
                total += st.nbytes()
            continue
        if id(o) in visited or isinstance(o, (str, bytes, int, float, bool, type(None), torch.nn.Module)):
            continue
        visited.add(id(o))
        if isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (list, tuple, set)):
            stack.extend(o)
        elif hasattr(o, "__dict__") and type(o).__module__.split(".")[0] in ("kvquant_ext", "transformers"):
            stack.extend(v for k, v in vars(o).items() if k != "parent")
    return total


def make_cache(model, ids, args, name: str, preset: Optional[str]):
    """The cache of one row: transformers' DynamicCache or StaticCache (FP16), kvq's
    QuantizedCache or (rows named "static ...") StaticQuantizedCache.  Static caches are
    compileable, so generate compiles their decode step on CUDA (CUDA graphs)."""
    from transformers import DynamicCache, StaticCache
    B, L = ids.shape
    if preset is None:
        model.set_attn_implementation("sdpa")
        if name.startswith("StaticCache"):
            return StaticCache(config=model.config, max_cache_len=L + args.new)
        return DynamicCache()
    kh.enable(model)
    if name.startswith("static "):
        return kh.StaticQuantizedCache(preset, model.config, max_batch_size=B, max_cache_len=L + args.new)
    return kh.QuantizedCache(kvq.get_config(preset), model.config)


def run_one(model, ids, args, name: str, preset: Optional[str], device, cache=None) -> Dict[str, float]:
    from transformers import LogitsProcessorList
    if cache is None:
        cache = make_cache(model, ids, args, name, preset)
    clock = StepClock(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                             pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                             **{kh.cache_kwarg(model): cache})
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    B, P = ids.shape
    steps = len(clock.times)
    assert out.shape[1] == P + args.new and steps == args.new, (out.shape, steps)
    decode_s = clock.times[-1] - clock.times[0]
    nbytes = cache_bytes(cache)
    alloc = allocated_bytes(cache)
    tokens = B * (P + args.new - 1)  # the last generated token is never written to the cache
    res = {"prefill_s": clock.times[0] - t0, "total_s": t1 - t0,
           "decode_tok_s": B * (steps - 1) / decode_s if decode_s > 0 else float("nan"),
           "kv_bytes": nbytes, "kv_alloc_bytes": alloc,
           "kv_bytes_per_token_layer": nbytes / tokens / args.layers,
           "bits_per_element": 8.0 * nbytes / (tokens * args.layers * 2 * model.config.num_key_value_heads
                                               * model.config.head_dim),
           "peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}
    del cache, out
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="decoder layers of the 32 (default 4)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--new", type=int, default=256, help="generated tokens")
    p.add_argument("--presets", default="all", help="comma list or 'all' (kvq.PRESETS at run time)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--kv-budget-gib", type=float, default=64.0,
                   help="KV budget for the max-batch column, full 32-layer model (default 64)")
    p.add_argument("--full-layers", type=int, default=32)
    p.add_argument("--warmup", type=int, default=1, help="short warm-up generates per preset")
    p.add_argument("--out", default=None, help="also write the markdown to this file")
    p.add_argument("--json", default=None)
    p.add_argument("--tiny", action="store_true", help="tiny model/shapes (CPU smoke test)")
    p.add_argument("--static", default="", help="comma list of presets also run on kvq.hf.StaticQuantizedCache "
                   "(decode compiled by generate on CUDA), next to transformers' StaticCache")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.batch = min(args.layers, 2), min(args.batch, 2)
        args.prompt, args.new = min(args.prompt, 300), min(args.new, 8)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device (use --tiny --device cpu for a smoke test)")
        return 1
    dtype = getattr(torch, args.dtype)

    from kvquant_ext.cli import select_presets
    presets = select_presets(args.presets)
    import transformers
    torch.manual_seed(0)
    model = build_model(args, device, dtype)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), device=device)
    warm = ids[:, :min(args.prompt, 512)]

    rows: Dict[str, Dict[str, float]] = {}
    errors: Dict[str, str] = {}
    names = ["DynamicCache (FP16)"] + list(presets)
    if args.static:
        names += ["StaticCache (FP16, compiled)"] + [f"static {n}" for n in args.static.split(",")]
    for name in names:
        preset = None if name.endswith(")") else name.split(" ")[-1]
        try:
            wargs = argparse.Namespace(**{**vars(args), "new": 4})
            if name.startswith(("static ", "StaticCache")):
                # one cache for the warm-up and the run, so the compiled decode step (whose
                # guards hold the cache's tensors and shapes) is compiled in the warm-up
                cache = make_cache(model, ids, args, name, preset)
                for _ in range(max(1, args.warmup)):
                    run_one(model, ids, wargs, name, preset, device, cache)
                    cache.reset()
                rows[name] = run_one(model, ids, args, name, preset, device, cache)
                del cache
            else:
                for _ in range(args.warmup):
                    run_one(model, warm, wargs, name, preset, device)
                rows[name] = run_one(model, ids, args, name, preset, device)
            r = rows[name]
            print(f"[bench_e2e] {name}: prefill {r['prefill_s']:.2f}s, decode "
                  f"{r['decode_tok_s']:.1f} tok/s, peak {r['peak_bytes'] / GIB:.2f} GiB, "
                  f"KV {r['kv_bytes'] / GIB:.3f} GiB", file=sys.stderr, flush=True)
        except Exception as e:  # OOM or a failing op: report and go on
            errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
            print(f"[bench_e2e] {name}: FAILED {errors[name]}", file=sys.stderr, flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    base = rows.get("DynamicCache (FP16)")
    budget = args.kv_budget_gib * GIB
    seq = args.prompt + args.new
    cfg = model.config
    lines = [
        f"## End-to-end generate: {'tiny smoke-test' if args.tiny else 'Llama-3-8B-shaped'} model, random weights, {args.layers} of 32 layers",
        "",
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; torch "
        f"{torch.__version__}, transformers {transformers.__version__}; {args.dtype}; batch "
        f"{args.batch}, prompt {args.prompt}, {args.new} new tokens (greedy); hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, "
        f"head dim {cfg.head_dim}; weights {weights / GIB:.2f} GiB.  KV stored = every byte the cache "
        f"counts (nbytes); allocated = the capacity of its buffers. Decode tok/s excludes prefill. "
        f"Max batch: sequences of {seq} tokens whose KV fits {args.kv_budget_gib:g} GiB for the "
        f"full {args.full_layers}-layer model, from the measured KV bytes/token.",
        "",
        "| cache | bits/elem | KV bytes/token/layer | KV GiB (stored) | KV GiB (allocated) | peak GiB | "
        "prefill s | decode tok/s | vs FP16 | max batch @ budget |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        per_seq = r["kv_bytes_per_token_layer"] * args.full_layers * seq
        speed = f"{r['decode_tok_s'] / base['decode_tok_s']:.2f}×" if base else ""
        lines.append(f"| {name} | {r['bits_per_element']:.2f} | {r['kv_bytes_per_token_layer']:.0f} | "
                     f"{r['kv_bytes'] / GIB:.3f} | {r['kv_alloc_bytes'] / GIB:.3f} | "
                     f"{r['peak_bytes'] / GIB:.2f} | {r['prefill_s']:.2f} | "
                     f"{r['decode_tok_s']:.1f} | {speed} | {int(budget // per_seq)} |")
    for name, err in errors.items():
        lines.append(f"| {name} | failed: {err} | | | | | | | | |")
    md = "\n".join(lines)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md + "\n")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows, "errors": errors}, f, indent=2)
    return 0 if base is not None else 1


if __name__ == "__main__":
    sys.exit(main())
