"""Tensor parallelism (gloo on CPU, 2 processes): each rank's cache holds only that rank's KV
heads, attends on them, and never talks to the other rank.

* transformers' ``tp_plan="auto"`` with ``kvq.hf.QuantizedCache`` and
  ``kvq.hf.StaticQuantizedCache``: generated tokens equal the single-process run (fp16 preset:
  transformers' DynamicCache; kivi-4: the single-process kivi-4 cache of the same class) and each
  rank stores half the bytes.
* ``kvq.PagedKVCache`` sharded by KV heads as an engine shards it (each rank its H / 2 heads and
  their query heads, the same block tables): each rank's outputs equal the single-process
  cache's outputs for those heads bit for bit, and its ``nbytes`` is half.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

transformers = pytest.importorskip("transformers")
import kvquant_ext as kvq  # noqa: E402
import kvquant_ext.hf as kh  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="needs torch.distributed with gloo")

WORKER = textwrap.dedent(r"""
    import json, os, sys, torch
    import kvquant_ext.hf as kh
    from transformers import AutoModelForCausalLM
    try:  # transformers >= 5.2x; 5.17 takes tp_plan= directly
        from transformers.distributed import DistributedConfig
        tp = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except ImportError:
        tp = {"tp_plan": "auto"}

    path, out = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvq", dtype=torch.float32,
                                                 **tp).eval()
    ids = torch.load(os.path.join(path, "ids.pt"))
    res = {}
    for name in ("fp16", "kivi-4"):
        cache = kh.QuantizedCache(name, model.config)
        with torch.no_grad():
            g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                               min_new_tokens=12, do_sample=False, pad_token_id=0,
                               **{kh.cache_kwarg(model): cache})
        res[name] = {"tokens": g[:, ids.shape[1]:].tolist(), "nbytes": cache.nbytes,
                     "kv_heads": [l.key._shape[1] for l in cache.kv.layers]}
    cache = kh.StaticQuantizedCache("kivi-4", model.config, max_batch_size=2, max_cache_len=200, page_size=32)
    with torch.no_grad():
        g = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                           min_new_tokens=12, do_sample=False, pad_token_id=0, **{kh.cache_kwarg(model): cache})
    res["static kivi-4"] = {"tokens": g[:, ids.shape[1]:].tolist(), "nbytes": cache.nbytes,
                            "kv_heads": cache.pool.num_kv_heads}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
""")


def _gen(model, ids, cache):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                              min_new_tokens=12, do_sample=False, pad_token_id=0,
                              **{kh.cache_kwarg(model): cache})[:, ids.shape[1]:].tolist()


def test_tensor_parallel_generate_equals_single_process(tmp_path):
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                      max_position_embeddings=1024)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # sharpen the random model's logits: stable greedy choices
    model.save_pretrained(tmp_path)
    ids = torch.randint(1, 128, (2, 150), generator=torch.Generator().manual_seed(1))  # past KIVI's R = 128
    torch.save(ids, tmp_path / "ids.pt")
    kh.enable(model)
    ref = {"fp16": _gen(model, ids, DynamicCache())}
    single = kh.QuantizedCache("kivi-4", model.config)
    ref["kivi-4"] = _gen(model, ids, single)
    fp_single = kh.QuantizedCache("fp16", model.config)
    assert _gen(model, ids, fp_single) == ref["fp16"]
    static_single = kh.StaticQuantizedCache("kivi-4", model.config, max_batch_size=2, max_cache_len=200, page_size=32)
    ref["static kivi-4"] = _gen(model, ids, static_single)

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = tmp_path / "out"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")  # gloo on CPU, also on a GPU machine
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(29500 + os.getpid() % 1000), str(script), str(tmp_path), str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ranks = [json.loads((tmp_path / f"out.{r}").read_text()) for r in (0, 1)]
    for r in ranks:
        assert r["fp16"]["tokens"] == ref["fp16"]
        assert r["kivi-4"]["tokens"] == ref["kivi-4"]
        assert r["kivi-4"]["kv_heads"] == [2, 2]  # 4 KV heads split over 2 ranks
        assert r["kivi-4"]["nbytes"] * 2 == single.nbytes
        assert r["fp16"]["nbytes"] * 2 == fp_single.nbytes
        # StaticQuantizedCache: the pools take the rank's 2 local KV heads from its first update
        assert r["static kivi-4"]["tokens"] == ref["static kivi-4"]
        assert r["static kivi-4"]["kv_heads"] == 2
        assert r["static kivi-4"]["nbytes"] * 2 == static_single.nbytes


PAGED_WORKER = textwrap.dedent(r"""
    import json, os, sys, torch
    import torch.distributed as dist
    import kvquant_ext as kvq

    path, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.load(os.path.join(path, "paged.pt"))
    H, Hq = data["H"], data["Hq"]
    h0, h1 = rank * H // world, (rank + 1) * H // world  # this rank's KV heads ...
    g = Hq // H  # ... and their query heads
    res = {}
    for name in ("fp16", "kivi-2"):
        cache = kvq.PagedKVCache(name, num_layers=1, num_kv_heads=h1 - h0, head_dim=64, max_tokens=2048)
        ids = [cache.add_sequence() for _ in data["lens"]]
        for sid, (k, v) in zip(ids, data["kv"]):
            cache.append(0, [sid], k[:, h0:h1], v[:, h0:h1])
        o = cache.decode_attention(data["q"][:, h0 * g:h1 * g].contiguous(), 0, ids)
        res[name] = {"out": o.float().tolist(), "nbytes": cache.nbytes}
    with open(f"{out}.{rank}", "w") as f:
        json.dump(res, f)
    dist.destroy_process_group()
""")


def test_paged_cache_sharded_by_heads_equals_single_process(tmp_path):
    H, Hq, D, lens = 4, 16, 64, [300, 57, 129]
    gen = torch.Generator().manual_seed(3)
    kv = [(torch.randn(1, H, L, D, generator=gen).half(), torch.randn(1, H, L, D, generator=gen).half())
          for L in lens]
    q = torch.randn(len(lens), Hq, D, generator=gen).half()
    torch.save({"H": H, "Hq": Hq, "lens": lens, "kv": kv, "q": q}, tmp_path / "paged.pt")
    ref = {}
    for name in ("fp16", "kivi-2"):
        cache = kvq.PagedKVCache(name, num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=2048)
        ids = [cache.add_sequence() for _ in lens]
        for sid, (k, v) in zip(ids, kv):
            cache.append(0, [sid], k, v)
        ref[name] = (cache.decode_attention(q, 0, ids).float(), cache.nbytes)
    script = tmp_path / "paged_worker.py"
    script.write_text(PAGED_WORKER)
    out = tmp_path / "paged_out"
    env = dict(os.environ, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                           "--master_port", str(30500 + os.getpid() % 1000), str(script), str(tmp_path), str(out)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for r in (0, 1):
        res = json.loads((tmp_path / f"paged_out.{r}").read_text())
        for name, (want, nbytes) in ref.items():
            got = torch.tensor(res[name]["out"])
            assert torch.equal(got, want[:, r * Hq // 2:(r + 1) * Hq // 2]), (name, r)
            assert res[name]["nbytes"] * 2 == nbytes, (name, r)
