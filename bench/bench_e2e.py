"""End-to-end generate benchmark: a matrix of batch sizes x prompt lengths, every cache in the
same run, each decode step next to its bytes floor.

Caches (rows): transformers' FP16 ``DynamicCache`` (eager SDPA; also with SDPA's cuDNN backend
excluded, which on Hopper re-plans for every new key length) and ``StaticCache`` (decode
compiled by generate: CUDA graphs), transformers' own ``QuantizedCache`` with the quanto backend
(int4 / int2 keys and values, residual window of 128 tokens; needs ``optimum-quanto``) for
``--peers``, ``kvq.hf.QuantizedCache`` (eager) for ``--presets`` and
``kvq.hf.StaticQuantizedCache`` (compiled by generate) for ``--static``; ``--fp16 static-nograph``
adds StaticCache compiled in inductor's default mode, without CUDA graphs.

The model is a **Llama-3-8B-shaped** ``LlamaForCausalLM`` with random weights (hidden 4096,
32 query / 8 KV heads, head dim 128, MLP 14336, vocab 128256) and ``--layers`` (default all
32) decoder layers: weights do not change the kernels that run.

Per row: prefill s; ms/step and tokens/s of the decode steps (timed inside ``generate`` by a
logits processor that synchronises the device at every step; prefill excluded), and the median
and slowest single step (a step that compresses pages shows as the slowest); the floor =
(weights a step reads + the cache's stored bytes) / the device-to-device copy rate measured in
the same run; peak memory during the prefill, steady memory at the last decode step (weights
included) and its slack over weights + the cache's allocated bytes; and the largest batch of
``--context`` tokens that fits ``--mem-gib`` of GPU memory during decode: (memory - weights) /
(the cache's bytes per sequence at that context + the decode working set per row, both as
measured), i.e. prefilled one sequence at a time as a server would.

    python bench/bench_e2e.py                                   # B 1,8,32 x 4k,16k; every preset
    python bench/bench_e2e.py --batch 8,32 --prompt 16384 --presets kivi-2 --static kivi-2,hqmq-3.79
    python bench/bench_e2e.py --tiny --device cpu               # smoke test without a GPU
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
from typing import Dict, List, Optional

import torch

import kvquant_ext as kvq
import kvquant_ext.hf as kh
from kvquant_ext.cli import PEER_PREFIX, UsageError, peer_cache, peer_names, select_presets, stored_tensors
from kvquant_ext.attention import sdpa_without_cudnn

GIB = 1024 ** 3
PEER_ROW = "QuantizedCache ({}, SDPA without cuDNN)"  # a peer's row name
NOGRAPH = "compiled without CUDA graphs)"  # the end of the StaticCache row compiled in inductor's default mode


class StepClock:
    """LogitsProcessor recording a (synchronised) timestamp at every generation step, the peak
    memory of the prefill (at the first step) and the memory held at the last step."""

    def __init__(self, device: torch.device):
        self.device = device
        self.times: List[float] = []
        self.prefill_peak = self.steady = 0

    def __call__(self, input_ids, scores):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            if not self.times:
                self.prefill_peak = torch.cuda.max_memory_allocated(self.device)
                torch.cuda.reset_peak_memory_stats(self.device)
            self.steady = torch.cuda.memory_allocated(self.device)
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
    for layer in cache.layers:  # transformers' layers; its quantized ones also hold the codes
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                n += sum(x.numel() * x.element_size() for x in stored_tensors(t))
    return n


def allocated_bytes(obj) -> int:
    """Bytes of every distinct tensor storage reachable from a cache object (capacity, not
    just the used length: growable buffers over-allocate)."""
    seen, total, stack, visited = set(), 0, [obj], set()
    while stack:
        o = stack.pop()
        if isinstance(o, torch.Tensor) and type(o) is not torch.Tensor and hasattr(o, "__tensor_flatten__"):
            stack.extend(stored_tensors(o))
            continue
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
    """The cache of one row: transformers' DynamicCache, StaticCache (FP16) or QuantizedCache
    (rows named PEER_ROW of a peer of kvq eval --peers), kvq's QuantizedCache or (rows
    named "static ...") StaticQuantizedCache.  Static caches are compileable, so generate
    compiles their decode step on CUDA (CUDA graphs)."""
    from transformers import DynamicCache, StaticCache
    B, L = ids.shape
    if preset is None:
        model.set_attn_implementation("sdpa")
        if PEER_PREFIX in name:
            return peer_cache(name[name.index(PEER_PREFIX):].split(",")[0], model.config)
        if name.startswith("StaticCache"):
            return StaticCache(config=model.config, max_cache_len=L + args.new)
        return DynamicCache()
    kh.enable(model)
    if name.startswith("static "):
        page = int(name.rsplit(" P=", 1)[1]) if " P=" in name else None
        return kh.StaticQuantizedCache(preset, model.config, max_batch_size=B, max_cache_len=L + args.new,
                                       page_size=page)
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
    extra = {}
    chunk = args.fp16_prefill_chunk if preset is None else \
        args.static_prefill_chunk if name.startswith("static chunked ") else 0
    if chunk and ids.numel() > chunk:
        extra["prefill_chunk_size"] = max(1, chunk // ids.shape[0])
    if name.endswith(NOGRAPH):
        from transformers import CompileConfig
        extra["compile_config"] = CompileConfig(mode="default")
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=args.new, min_new_tokens=args.new, do_sample=False,
                             pad_token_id=0, logits_processor=LogitsProcessorList([clock]),
                             **{kh.cache_kwarg(model): cache}, **extra)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    B, P = ids.shape
    steps = len(clock.times)
    assert out.shape[1] == P + args.new and steps == args.new, (out.shape, steps)
    decode_s = clock.times[-1] - clock.times[0]
    steps_ms = sorted(1e3 * (b - a) for a, b in zip(clock.times, clock.times[1:])) or [float("nan")]
    nbytes = cache_bytes(cache)
    alloc = allocated_bytes(cache)
    tokens = B * (P + args.new - 1)  # the last generated token is never written to the cache
    res = {"prefill_s": clock.times[0] - t0, "total_s": t1 - t0,
           "decode_tok_s": B * (steps - 1) / decode_s if decode_s > 0 else float("nan"),
           "ms_per_step": 1e3 * decode_s / (steps - 1) if steps > 1 else float("nan"),
           "step_ms_p50": steps_ms[len(steps_ms) // 2], "step_ms_max": steps_ms[-1],
           "prefill_chunk": extra.get("prefill_chunk_size", 0),
           "prefill_peak_bytes": clock.prefill_peak, "steady_bytes": clock.steady,
           "kv_bytes": nbytes, "kv_alloc_bytes": alloc,
           "kv_bytes_per_token_layer": nbytes / tokens / args.layers,
           "bits_per_element": 8.0 * nbytes / (tokens * args.layers * 2 * model.config.num_key_value_heads
                                               * model.config.head_dim),
           "decode_peak_bytes": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0}
    del cache, out
    return res


def copy_bandwidth(device) -> float:
    """Device-to-device copy rate (bytes read + written per second) of a 1 GiB buffer."""
    if device.type != "cuda":
        return float("nan")
    src = torch.empty(GIB // 2, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        dst.copy_(src)
    b.record()
    torch.cuda.synchronize(device)
    rate = 20 * 2 * src.numel() / (a.elapsed_time(b) * 1e-3)
    del src, dst
    torch.cuda.empty_cache()
    return rate


def step_weight_bytes(model) -> int:
    """Weights one decode step reads: every parameter but the input embedding table (a step
    reads B of its rows; the LM head is read whole)."""
    emb = model.get_input_embeddings().weight
    return sum(p.numel() * p.element_size() for p in model.parameters() if p is not emb)


def sdpa_backends(cudnn: bool = True):
    """A context for SDPA's backends on CUDA: all of them, or all but cuDNN (which on Hopper
    builds a new plan for every new key length, i.e. at every decode step of a growing cache)."""
    return contextlib.nullcontext() if cudnn else sdpa_without_cudnn(torch.device("cuda"))


def forget_compiled(model) -> None:
    """Drop generate's compiled decode step and its CUDA graphs (their memory pool), so that
    the next row starts from the same memory."""
    if hasattr(model, "_compiled_call"):
        del model._compiled_call
    torch._dynamo.reset()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_row(model, ids, warm, args, cell, wargs, name: str, preset: Optional[str], device, rows) -> None:
    """Warm up and measure one row into ``rows[name]``."""
    if name.startswith(("static ", "StaticCache")):
        # one cache for the warm-up and the run, so the compiled decode step (whose
        # guards hold the cache's tensors and shapes) is compiled in the warm-up
        cache = make_cache(model, ids, cell, name, preset)
        for _ in range(max(1, args.warmup)):
            run_one(model, ids, wargs, name, preset, device, cache)
            cache.reset()
        rows[name] = run_one(model, ids, cell, name, preset, device, cache)
        del cache
    else:
        for _ in range(args.warmup):
            run_one(model, warm, wargs, name, preset, device)
        rows[name] = run_one(model, ids, cell, name, preset, device)


def bench_cell(model, args, device, B: int, L: int, names: List[str], log, rows: Dict[str, Dict[str, float]],
               saved) -> None:
    """Every cache of ``names`` at batch B, prompt L into ``rows``: {name: result or {"error": ...}};
    ``saved()`` after each row."""
    ids = torch.randint(0, model.config.vocab_size, (B, L), device=device)
    warm = ids[:, :min(L, 512)]
    for name in names:
        preset = None if name.endswith(")") else name.split(" P=")[0].split(" ")[-1]
        cell = argparse.Namespace(**{**vars(args), "batch": B, "prompt": L})
        wargs = argparse.Namespace(**{**vars(cell), "new": 4})
        try:
            with sdpa_backends(cudnn=not name.endswith("without cuDNN)")):
                run_row(model, ids, warm, args, cell, wargs, name, preset, device, rows)
            r = rows[name]
            log(f"B={B} L={L} {name}: prefill {r['prefill_s']:.2f}s, {r['ms_per_step']:.2f} ms/step, "
                f"prefill peak {r['prefill_peak_bytes'] / GIB:.2f} GiB, steady {r['steady_bytes'] / GIB:.2f} GiB, "
                f"KV {r['kv_bytes'] / GIB:.3f} GiB")
        except Exception as e:  # OOM or a failing op: report and go on
            rows[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
            log(f"B={B} L={L} {name}: FAILED {rows[name]['error']}")
        finally:
            forget_compiled(model)
            saved()


def table(results, args, weights: int, step_w: int, copy_bw: float) -> List[str]:
    """The markdown table of every cell."""
    lines = ["| B | prompt | cache | bits/elem | KV GiB stored / alloc | prefill s | prefill peak GiB | "
             "steady GiB (slack) | ms/step | step p50 / max ms | floor ms | × floor | tok/s | vs best FP16 | "
             f"max batch @ {args.context // 1024}k, {args.mem_gib:g} GiB |",
             "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    budget = args.mem_gib * GIB - weights
    for key, rows in results.items():
        B, L = (int(x) for x in key.split("x"))
        fp16 = [r["ms_per_step"] for n, r in rows.items() if "FP16" in n
                if "error" not in r]
        best = min(fp16) if fp16 else None
        for name, r in rows.items():
            if "error" in r:
                lines.append(f"| {B} | {L} | {name} | failed: {r['error']} ||||||||||||")
                continue
            floor = 1e3 * (step_w + r["kv_bytes"]) / copy_bw
            slack = r["steady_bytes"] - weights - r["kv_alloc_bytes"]
            per_seq = r["kv_bytes_per_token_layer"] * args.layers * args.context
            work = max(0.0, slack) / B
            maxb = int(budget // (per_seq + work)) if per_seq + work > 0 else 0
            vs = f"{best / r['ms_per_step']:.2f}×" if best else ""
            chunk = f" (prefill chunks of {r['prefill_chunk']})" if r.get("prefill_chunk") else ""
            lines.append(
                f"| {B} | {L} | {name}{chunk} | {r['bits_per_element']:.2f} | {r['kv_bytes'] / GIB:.3f} / "
                f"{r['kv_alloc_bytes'] / GIB:.3f} | {r['prefill_s']:.2f} | {r['prefill_peak_bytes'] / GIB:.1f} | "
                f"{r['steady_bytes'] / GIB:.2f} ({100 * slack / max(1, r['kv_alloc_bytes'] + weights):+.1f} %) | "
                f"{r['ms_per_step']:.2f} | {r['step_ms_p50']:.2f} / {r['step_ms_max']:.2f} | {floor:.2f} | {r['ms_per_step'] / floor:.2f} | "
                f"{r['decode_tok_s']:.0f} | {vs} | {maxb} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32, help="decoder layers (default 32, the whole model)")
    p.add_argument("--batch", default="1,8,32", help="comma list of batch sizes")
    p.add_argument("--prompt", default="4096,16384", help="comma list of prompt lengths")
    p.add_argument("--new", type=int, default=128, help="generated tokens")
    p.add_argument("--presets", default="all", help="kvq.hf.QuantizedCache rows (eager): comma list, 'all' "
                   "(kvq.PRESETS) or 'none'")
    p.add_argument("--static", default="", help="kvq.hf.StaticQuantizedCache rows (decode compiled by generate "
                   "on CUDA): comma list of presets")
    p.add_argument("--fp16", default="dynamic,dynamic-nocudnn,static",
                   help="FP16 rows, a comma list: 'dynamic' (DynamicCache, SDPA as torch dispatches it), "
                   "'dynamic-nocudnn' (DynamicCache, SDPA with its cuDNN backend excluded: on Hopper it "
                   "builds a new plan for every new key length), 'static' (StaticCache, compiled with CUDA "
                   "graphs), 'static-nograph' (StaticCache, compiled in inductor's default mode: no CUDA "
                   "graphs); or 'none'")
    p.add_argument("--peers", default="", help="transformers' own QuantizedCache rows (quanto backend, eager, "
                   "SDPA without cuDNN; needs optimum-quanto): comma list of int4, int2")
    p.add_argument("--fp16-prefill-chunk", type=int, default=131072,
                   help="FP16 rows prefill in chunks of this many tokens over the batch (generate's "
                   "prefill_chunk_size), so that a full-precision prefill's activations fit next to its "
                   "cache; 0: one pass")
    p.add_argument("--static-prefill-chunk", type=int, default=0,
                   help="also run every --static preset as a row 'static chunked PRESET' that prefills in "
                   "chunks of this many tokens over the batch (the chunks after the first attend to the "
                   "compressed pages already written); 0: no such rows")
    p.add_argument("--static-page-size", default="",
                   help="comma list of page sizes: each --static row runs once per page size (rows "
                   "'static PRESET P=32', ...); default: one row at the cache's default page size")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--mem-gib", type=float, default=80.0, help="GPU memory of the max-batch column (default 80)")
    p.add_argument("--context", type=int, default=32768, help="context of the max-batch column (default 32768)")
    p.add_argument("--warmup", type=int, default=1, help="short warm-up generates per row")
    p.add_argument("--out", default=None, help="also write the markdown to this file")
    p.add_argument("--json", default=None, help="write the results here (after every row)")
    p.add_argument("--tiny", action="store_true", help="tiny model/shapes (CPU smoke test)")
    args = p.parse_args(argv)
    try:
        batches = [int(x) for x in args.batch.split(",")]
        prompts = [int(x) for x in args.prompt.split(",")]
    except ValueError:
        p.error("--batch and --prompt take comma lists of ints")
    if args.tiny:
        args.layers = min(args.layers, 2)
        batches, prompts = [min(b, 2) for b in batches][:1], [min(x, 300) for x in prompts][:1]
        args.new = min(args.new, 8)
    args.prompt = max(prompts)  # build_model sizes the positions by it
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_e2e: no CUDA device (use --tiny --device cpu for a smoke test)")
        return 1
    dtype = getattr(torch, args.dtype)

    presets = [] if args.presets == "none" else list(select_presets(args.presets))
    if args.presets not in ("all", "none") and "fp16" not in args.presets.split(","):
        presets.remove("fp16")  # the FP16 rows are transformers' own caches (--fp16)
    fp16 = [] if args.fp16 == "none" else args.fp16.split(",")
    if set(fp16) - {"dynamic", "dynamic-nocudnn", "static", "static-nograph"}:
        p.error(f"--fp16 {args.fp16!r}: expected a comma list of dynamic, dynamic-nocudnn, static, "
                "static-nograph, or none")
    try:
        page_suffixes = [f" P={int(x)}" for x in args.static_page_size.split(",") if x] or [""]
    except ValueError:
        p.error("--static-page-size takes a comma list of ints")
    try:
        peers = peer_names(args.peers)
    except UsageError as e:
        p.error(str(e))
    names = (["DynamicCache (FP16)"] if "dynamic" in fp16 else []) + \
        (["DynamicCache (FP16, SDPA without cuDNN)"] if "dynamic-nocudnn" in fp16 else []) + \
        (["StaticCache (FP16, compiled)"] if "static" in fp16 else []) + \
        (["StaticCache (FP16, " + NOGRAPH] if "static-nograph" in fp16 else []) + \
        [PEER_ROW.format(n) for n in peers] + presets + \
        [f"static {n}{sz}" for n in args.static.split(",") if n for sz in page_suffixes] + \
        ([f"static chunked {n}" for n in args.static.split(",") if n] if args.static_prefill_chunk > 0 else [])
    import transformers
    torch.manual_seed(0)
    copy_bw = copy_bandwidth(device)
    model = build_model(args, device, dtype)
    weights = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
    step_w = step_weight_bytes(model)

    def log(msg):
        print(f"[bench_e2e] {msg}", file=sys.stderr, flush=True)

    log(f"copy {copy_bw / 1e12:.2f} TB/s, weights {weights / GIB:.2f} GiB ({step_w / GIB:.2f} GiB read per step)")
    results: Dict[str, Dict[str, Dict[str, float]]] = {}

    def saved():
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), "copy_bytes_per_s": copy_bw, "weights_bytes": weights,
                           "step_weight_bytes": step_w, "cells": results}, f, indent=2)

    for L in prompts:
        for B in batches:
            bench_cell(model, args, device, B, L, names, log, results.setdefault(f"{B}x{L}", {}), saved)
    cfg = model.config
    lines = [
        f"## End-to-end generate: {'tiny smoke-test' if args.tiny else 'Llama-3-8B-shaped'} model, random "
        f"weights, {args.layers} layers",
        "",
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; torch {torch.__version__}, "
        f"transformers {transformers.__version__}; {args.dtype}; {args.new} new tokens (greedy); hidden "
        f"{cfg.hidden_size}, {cfg.num_attention_heads} query / {cfg.num_key_value_heads} KV heads, head dim "
        f"{cfg.head_dim}; weights {weights / GIB:.2f} GiB ({step_w / GIB:.2f} GiB read per step); copy "
        f"{copy_bw / 1e12:.2f} TB/s.  Floor = (weights read + KV stored) / copy rate.  Steady = memory at the "
        f"last decode step; slack = steady − weights − the cache's allocated bytes, relative to their sum.",
        "",
        *table(results, args, weights, step_w, copy_bw),
    ]
    md = "\n".join(lines)
    print(md)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(md + "\n")
    ok = all("error" not in r for rows in results.values() for r in rows.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
