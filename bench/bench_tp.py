"""Tensor-parallel generate: per-rank KV bytes, peak memory and decode ms/step of transformers'
FP16 ``DynamicCache`` and ``kvq.hf.QuantizedCache`` presets, and the greedy tokens, on a
Llama-3-8B-shaped model with random weights (all 32 layers by default) sharded with
``tp_plan="auto"``.  Launch one process per GPU with torchrun; run it with 1 and with 2
processes to put the 1-GPU numbers next to the 2-GPU ones (the tokens must be the same):

    torchrun --nproc_per_node 1 bench/bench_tp.py --out tp1.json
    torchrun --nproc_per_node 2 bench/bench_tp.py --out tp2.json --compare tp1.json
    torchrun --nproc_per_node 2 bench/bench_tp.py --tiny --device cpu   # gloo smoke test

The random checkpoint is written once (rank 0, ``--ckpt``) and every rank loads its shard.
NCCL on the 2-GPU machine: keep NVLink multicast off (``NCCL_NVLS_ENABLE=0``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_e2e import StepClock, build_model, cache_bytes  # noqa: E402

import kvquant_ext.hf as kh  # noqa: E402


def load_sharded(path, dtype):
    from transformers import AutoModelForCausalLM
    try:  # transformers >= 5.2x; 5.17 takes tp_plan= directly
        from transformers.distributed import DistributedConfig
        tp = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:
        tp = {"tp_plan": "auto"}
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="kvq", **tp).eval()


def run(model, ids, new, preset, device):
    from transformers import DynamicCache, LogitsProcessorList
    cache = DynamicCache() if preset == "dynamic" else kh.QuantizedCache(preset, model.config)
    clock = StepClock(device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             min_new_tokens=new, do_sample=False, pad_token_id=0,
                             logits_processor=LogitsProcessorList([clock]), **{kh.cache_kwarg(model): cache})
    steps = len(clock.times)
    return {"tokens": out[:, ids.shape[1]:].tolist(),
            "ms_per_step": 1e3 * (clock.times[-1] - clock.times[0]) / max(steps - 1, 1),
            "kv_mib": cache_bytes(cache) / 2 ** 20,
            "peak_gib": (torch.cuda.max_memory_allocated(device) / 2 ** 30) if device.type == "cuda" else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--prompt", type=int, default=16384)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--presets", default="dynamic,fp16,kivi-2,gear-2",
                   help="'dynamic' = transformers' DynamicCache, then kvq presets")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16", "float32"])
    p.add_argument("--device", default="cuda")
    p.add_argument("--ckpt", default="/tmp/kvq-bench-tp-ckpt", help="where the random checkpoint is written")
    p.add_argument("--out", default=None, help="rank 0 writes the results as JSON")
    p.add_argument("--compare", default=None, help="JSON of another run: its tokens must equal these")
    p.add_argument("--tiny", action="store_true", help="tiny model and shapes (CPU smoke test)")
    args = p.parse_args(argv)
    if args.tiny:
        args.layers, args.batch, args.prompt, args.new = 2, 2, 200, 8
    cpu = args.device == "cpu"
    dist.init_process_group("gloo" if cpu else "nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu") if cpu else torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    if not cpu:
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype if not cpu else "float32")
    ckpt = f"{args.ckpt}-{'tiny' if args.tiny else args.layers}"
    if rank == 0 and not os.path.exists(os.path.join(ckpt, "config.json")):
        torch.manual_seed(0)
        model = build_model(args, "cpu", dtype)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # random logits are nearly flat: sharpen for stable greedy
        model.save_pretrained(ckpt)
        del model
    dist.barrier()
    model = load_sharded(ckpt, dtype)
    V = model.config.vocab_size
    ids = torch.randint(1, V, (args.batch, args.prompt), generator=torch.Generator().manual_seed(1)).to(device)
    res = {}
    for preset in args.presets.split(","):
        t0 = time.perf_counter()
        res[preset] = run(model, ids, args.new, preset, device)
        res[preset]["seconds"] = time.perf_counter() - t0
    gathered = [None] * world
    dist.all_gather_object(gathered, res)
    if rank == 0:
        print(f"world {world}: B={args.batch}, prompt {args.prompt}, {args.new} new tokens, {args.layers} layers")
        print("| cache | ms/step | KV MiB per rank | peak GiB per rank | tokens equal on every rank |")
        print("|---|---|---|---|---|")
        for preset, r in res.items():
            same = all(g[preset]["tokens"] == r["tokens"] for g in gathered)
            print(f"| {preset} | {r['ms_per_step']:.2f} | {r['kv_mib']:.2f} | {r['peak_gib']:.2f} | {same} |")
        if args.compare:
            other = json.load(open(args.compare))
            for preset, r in res.items():
                if preset in other["results"]:
                    print(f"{preset}: tokens {'equal' if other['results'][preset]['tokens'] == r['tokens'] else 'DIFFER'}"
                          f" to {args.compare} (world {other['world']})")
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"world": world, "args": vars(args), "results": res}, f)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
