"""kvq.hf.StaticQuantizedCache: per-row static pages of the paged pools, decode steps that
torch.compile captures whole.

A tiny random Llama (2 layers, hidden 64, 4 query heads, 2 KV heads, head dim 32) runs on CPU;
references are DynamicCache (fp16 preset) and kvq.PagedKVCache fed the same tokens (compressed
presets: the same storage rule, so the same pages).
"""
import inspect

import pytest
import torch

transformers = pytest.importorskip("transformers")
import kvquant_ext as kvq  # noqa: E402
import kvquant_ext.hf as kh  # noqa: E402
from transformers import AttentionInterface, DynamicCache  # noqa: E402
from transformers.cache_utils import Cache  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: E402

VOCAB = 128
REF_ATTN = "kvq_paged_reference"


def tiny_model(family="llama", **over):
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=1024)
    common.update(over)
    if family == "llama":
        from transformers import LlamaConfig as C, LlamaForCausalLM as M
    else:
        from transformers import MistralConfig as C, MistralForCausalLM as M
    model = M(C(**common)).eval()
    with torch.no_grad():  # sharpen the random model's logits so that greedy choices are stable
        model.lm_head.weight.mul_(8.0)
    return kh.enable(model)


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def cuda_model():
    return tiny_model().to("cuda", torch.float16)


def static(model, preset, rows=3, max_len=128, **kw):
    return kh.StaticQuantizedCache(preset, model.config, max_batch_size=rows, max_cache_len=max_len, **kw)


def gen(model, ids, cache, n, attention_mask=None):
    if attention_mask is None:
        attention_mask = torch.ones_like(ids)
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=n, min_new_tokens=n,
                              do_sample=False, pad_token_id=0, **{kh.cache_kwarg(model): cache})


def fwd(model, cache, ids, **kw):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=True, **{kh.cache_kwarg(model): cache}, **kw).logits


def step_kwargs(model, padded_position: int) -> dict:
    """The decode step's ``cache_position`` where the installed model's forward still takes one
    (the step's index on the padded timeline), so that it is not derived from the cache."""
    if "cache_position" not in inspect.signature(model.forward).parameters:
        return {}
    return {"cache_position": torch.tensor([padded_position], device=model.device)}


def left_padded(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    T = max(lengths)
    ids = torch.zeros(len(lengths), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(prompts):
        ids[b, T - len(p):], mask[b, T - len(p):] = p, 1
    return prompts, ids, mask


# ----------------------------------------------------------------------------- fp16: exact
def test_fp16_batch_of_one_is_token_identical_to_dynamic_cache(model):
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(0))
    ref = gen(model, ids, DynamicCache(), 24)
    cache = static(model, "fp16", rows=1, max_len=80, page_size=32, device="cpu", dtype=torch.float32)
    assert torch.equal(gen(model, ids, cache, 24), ref)
    assert cache.layers[0].row_lengths() == [40 + 23]  # the last generated token is not run


def test_fp16_left_padded_batch_rows_equal_their_own_runs(model):
    """Each row of a left-padded batch of 3 prompts generates what it generates alone; the cache
    holds only the real tokens (padding costs no memory)."""
    lengths, n = [37, 12, 25], 22
    prompts, ids, mask = left_padded(lengths)
    cache = static(model, "fp16", max_len=96, page_size=32)
    out = gen(model, ids, cache, n, attention_mask=mask)[:, -n:]
    for b, p in enumerate(prompts):
        alone = gen(model, p[None], DynamicCache(), n)[:, -n:]
        assert torch.equal(out[b:b + 1], alone), f"row {b}"
    assert cache.layers[1].row_lengths() == [m + n - 1 for m in lengths]
    fp_tok = 2 * 2 * 32 * 4  # K and V, 2 heads, head dim 32, float32
    assert cache.nbytes == 2 * sum(m + n - 1 for m in lengths) * fp_tok


# ----------------------------------------------------------------------------- compressed: the paged reference
class PagedReference(Cache):
    """The model's keys/values appended to a kvq.PagedKVCache (each row's real tokens as one
    sequence); the reference attention function below attends on the fresh tokens at prefill
    and through PagedKVCache.decode_attention on decode steps."""

    def __init__(self, pool, pads):
        super().__init__(layers=[])
        self.pool, self.pads = pool, pads
        self.ids = [pool.add_sequence() for _ in pads]

    def update(self, k, v, layer_idx, *args, **kwargs):
        if k.shape[2] > 1:
            for b, s in enumerate(self.ids):
                self.pool.append(layer_idx, [s], k[b:b + 1, :, self.pads[b]:].contiguous(),
                                 v[b:b + 1, :, self.pads[b]:].contiguous())
        else:
            self.pool.append(layer_idx, self.ids, k.contiguous(), v.contiguous())
        k._paged_ref = (self, layer_idx)
        return k, v


def paged_reference_attention(module, query, key, value, attention_mask, scaling=None, **kw):
    ref, layer_idx = key._paged_ref
    if query.shape[2] == 1:
        out = ref.pool.decode_attention(query[:, :, 0].contiguous(), layer_idx, ref.ids, scaling)
        return out[:, None], None
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kw)


AttentionInterface.register(REF_ATTN, paged_reference_attention)
AttentionMaskInterface.register(REF_ATTN, sdpa_mask)


PAGED_REFERENCE_CASES = [
    ("kivi-2", [175, 150], 22, None),         # window 128: pages compress at 160 and 192
    ("int4-per-token", [40, 57], 12, None),   # no window: a page compresses when it fills (64)
    ("hqmq-3.79", [70, 90], 12, None),        # window 32: pages compress at 96
    ("kivi-2", [58, 33], 10, 0),              # no window: pages compress when full (64)
]


@pytest.mark.parametrize("preset,lengths,steps,window", PAGED_REFERENCE_CASES)
def test_compressed_decode_equals_the_paged_reference(model, preset, lengths, steps, window):
    check_against_the_paged_reference(model, preset, lengths, steps, window, tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,lengths,steps,window", PAGED_REFERENCE_CASES)
def test_cuda_compressed_decode_equals_the_paged_reference(cuda_model, preset, lengths, steps, window):
    """On CUDA in fp16 (both sides run the CUDA ops, with different batch tables and split
    plans, so sums differ in rounding): close logits, the same pages bit for bit."""
    check_against_the_paged_reference(cuda_model, preset, lengths, steps, window, tol=2e-2)


def check_against_the_paged_reference(model, preset, lengths, steps, window, tol):
    """Decode steps of the static cache give the logits of kvq.PagedKVCache fed the same tokens
    (within ``tol``), with equal bytes and lengths; its layer-0 compressed pages equal the pool's
    bit for bit.  On CPU (float32) the greedy tokens agree; on CUDA each step feeds the
    reference's token to both."""
    P, dev, dtype = 32, model.device, model.dtype
    prompts, ids, mask = left_padded(lengths, seed=2)
    ids, mask = ids.to(dev), mask.to(dev)
    B, T = ids.shape
    pads = [T - n for n in lengths]
    cache = static(model, preset, rows=B, max_len=T + steps + 1, page_size=P, recent_window=window, device=dev,
                   dtype=dtype)
    pool = kvq.PagedKVCache(preset, num_layers=2, num_kv_heads=2, head_dim=32, max_tokens=4096,
                            dtype=dtype, device=dev, page_size=P, max_seqs=B, recent_window=window)
    ref = PagedReference(pool, pads)
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    got = fwd(model, cache, ids, attention_mask=mask, position_ids=pos)[:, -1]
    model.set_attn_implementation(REF_ATTN)
    try:
        want = fwd(model, ref, ids, attention_mask=mask, position_ids=pos)[:, -1]
    finally:
        kh.enable(model)
    comp_at = pool._comp_pages_at
    comp_before = [comp_at(n) for n in lengths]
    for i in range(steps):
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        tok = want.argmax(-1, keepdim=True)
        if dev.type == "cpu":
            assert torch.equal(tok, got.argmax(-1, keepdim=True)), f"step {i}"
        step_pos = torch.tensor(lengths, device=dev)[:, None] + i
        got = fwd(model, cache, tok, position_ids=step_pos)[:, -1]
        model.set_attn_implementation(REF_ATTN)
        try:
            want = fwd(model, ref, tok, position_ids=step_pos)[:, -1]
        finally:
            kh.enable(model)
        assert cache.nbytes == pool.nbytes
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert cache.layers[0].row_lengths() == [pool.seq_len(s) for s in ref.ids]
    assert any(comp_at(n + steps) > c for n, c in zip(lengths, comp_before)), "no page compressed in decode"
    # layer 0's keys and values come from the embeddings alone, equal in both runs: its compressed
    # pages hold the pool's codes bit for bit (HQMQ pages are encoded token by token as written)
    lay, pl = cache.layers[0], pool.layers[0]
    for b, s in enumerate(ref.ids):
        pages, J = pl.seqs[s].comp_pages, lay.layout.comp
        assert pages
        for role in ("k", "v"):
            for x, y in zip(lay.pages.comp[role], pl.comp[role]):
                assert torch.equal(x[1 + b * J:1 + b * J + len(pages)], y[torch.tensor(pages)])


def test_generate_with_a_compressed_cache(model):
    """generate drives the cache as transformers' StaticCache (seq length and mask sizes)."""
    lengths, n = [60, 41, 52], 12
    _, ids, mask = left_padded(lengths, seed=3)
    cache = static(model, "kivi-4", max_len=80, page_size=32, recent_window=32)
    out = gen(model, ids, cache, n, attention_mask=mask)
    assert out.shape == (3, 60 + n)
    assert int(cache.get_seq_length()) == 60 + n - 1
    assert cache.get_mask_sizes(1, 0) == (80, 0) and cache.get_max_cache_shape() == 80
    assert cache.is_compileable
    cache.reset()
    assert int(cache.get_seq_length()) == 0 and cache.nbytes == 0
    assert torch.equal(gen(model, ids, cache, n, attention_mask=mask), out)  # reused after reset


# ----------------------------------------------------------------------------- beam search / row selection
def test_fp16_beam_search_equals_dynamic_cache(model):
    """generate with num_beams reorders the rows every step (reorder_cache): fp16 beams are the
    DynamicCache beams token for token."""
    from transformers import DynamicCache
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(7))
    kw = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        ref = model.generate(input_ids=ids, **kw, **{kh.cache_kwarg(model): DynamicCache()})
        out = model.generate(input_ids=ids, **kw, **{kh.cache_kwarg(model): static(model, "fp16", rows=6, max_len=64)})
    assert torch.equal(out, ref)


@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79"])
def test_row_selection_equals_a_cache_of_the_selected_rows(model, preset):
    """reorder_cache / batch_select_indices / batch_repeat_interleave after a left-padded prefill:
    the cache then holds what a cache prefilled with the selected rows holds -- the same lengths
    and bytes, and the same logits over 40 more decode steps, which compress pages."""
    lengths = [70, 45, 58]
    _, ids, mask = left_padded(lengths, seed=5)
    new = lambda: static(model, preset, rows=6, max_len=128, page_size=32, recent_window=0)  # noqa: E731
    for select, rows in ((lambda c: c.reorder_cache(torch.tensor([2, 0, 0])), [2, 0, 0]),
                         (lambda c: c.batch_select_indices(torch.tensor([1])), [1]),
                         (lambda c: c.batch_repeat_interleave(2), [0, 0, 1, 1, 2, 2])):
        cache, ref = new(), new()
        fwd(model, cache, ids, attention_mask=mask)
        select(cache)
        r = torch.tensor(rows)
        got_tok = fwd(model, ref, ids[r], attention_mask=mask[r])[:, -1].argmax(-1, keepdim=True)
        assert cache.layers[0].row_lengths() == [lengths[i] for i in rows]
        assert cache.nbytes == ref.nbytes
        for i in range(40):
            pos = torch.tensor([lengths[j] for j in rows])[:, None] + i
            got = fwd(model, cache, got_tok, position_ids=pos)[:, -1]
            want = fwd(model, ref, got_tok, position_ids=pos)[:, -1]
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
            got_tok = want.argmax(-1, keepdim=True)
        assert cache.nbytes == ref.nbytes


# ----------------------------------------------------------------------------- crop (assisted decoding)
def decode_tokens(model, cache, tok, start, n):
    """n greedy decode steps from ``tok`` ([B, 1]) at positions start..: the last-position logits."""
    out = []
    for i in range(n):
        logits = fwd(model, cache, tok, position_ids=torch.full_like(tok, start + i))[:, -1]
        out.append(logits)
        tok = logits.argmax(-1, keepdim=True)
    return out


@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79", "fp16"])
@pytest.mark.parametrize("remove", [1, 19, 32])
def test_crop_equals_a_cache_of_the_kept_tokens(model, preset, remove):
    """Prefill 50 tokens, decode 40 (P = 32, no window: pages are compressed along the way), crop
    ``remove`` of them (up to P, which crop always allows), decode 30 more: the lengths, bytes and
    logits are those of a cache that saw only the kept tokens."""
    ids = torch.randint(1, VOCAB, (2, 50), generator=torch.Generator().manual_seed(3))
    drafts = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(4))
    new = lambda: static(model, preset, rows=2, max_len=160, page_size=32, recent_window=0)  # noqa: E731
    cache, ref = new(), new()
    for c, n in ((cache, 40), (ref, 40 - remove)):
        fwd(model, c, ids)
        for i in range(n):
            fwd(model, c, drafts[:, i:i + 1], position_ids=torch.full((2, 1), 50 + i))
    cache.crop(-remove)
    assert cache.get_seq_length() == ref.get_seq_length() == 90 - remove
    assert cache.layers[1].row_lengths() == ref.layers[1].row_lengths() == [90 - remove] * 2
    assert cache.nbytes == ref.nbytes
    tok = drafts[:, 40 - remove:41 - remove]
    for got, want in zip(decode_tokens(model, cache, tok, 90 - remove, 30), decode_tokens(model, ref, tok, 90 - remove, 30)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert cache.nbytes == ref.nbytes


def test_crop_past_the_ring_is_refused_and_changes_nothing(model):
    """A crop whose pages' full-precision copies were overwritten names the most it can remove;
    every layer is unchanged.  Removing every token of a row (or more) empties it."""
    ids = torch.randint(1, VOCAB, (1, 200), generator=torch.Generator().manual_seed(5))
    cache = static(model, "kivi-2", rows=1, max_len=256, page_size=32, recent_window=0)
    fwd(model, cache, ids)
    # ring R = 2 pages: 200 tokens hold pages 0..6, the ring pages 5 and 6 -> tokens from 160 on
    with pytest.raises(ValueError, match=r"remove at most 40 tokens"):
        cache.crop(-41)
    assert [layer.row_lengths() for layer in cache.layers] == [[200], [200]] and cache.get_seq_length() == 200
    cache.crop(-40)
    assert cache.layers[0].row_lengths() == [160]
    cache.crop(-500)
    assert cache.get_seq_length() == 0 and cache.layers[0].row_lengths() == [0] and cache.nbytes == 0


def _assistant():
    a = tiny_model()
    with torch.no_grad():  # a slightly different model: some drafts are rejected
        for p in a.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return a


@pytest.mark.parametrize("preset", ["fp16", "kivi-2"])
def test_assisted_decoding_equals_greedy_with_the_same_cache(model, preset):
    """Assisted decoding verifies the drafts and crops the rejected ones: its tokens are greedy
    decoding's with the same kind of cache (fp16: DynamicCache's), and crops did happen."""
    ids = torch.randint(1, VOCAB, (1, 40), generator=torch.Generator().manual_seed(6))
    new = lambda: static(model, preset, rows=1, max_len=128, page_size=32, recent_window=0)  # noqa: E731
    ref = gen(model, ids, DynamicCache() if preset == "fp16" else new(), n=40)
    cache, crops = new(), []
    real = kh.StaticQuantizedCache.crop
    cache.crop = lambda n: (crops.append(n), real(cache, n))[1]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=40,
                             min_new_tokens=40, do_sample=False, pad_token_id=0, assistant_model=_assistant(),
                             **{kh.cache_kwarg(model): cache})
    assert torch.equal(out, ref)
    assert any(n < 0 for n in crops)


# ----------------------------------------------------------------------------- several new tokens (eager)
def test_several_token_step_fp16_equals_dynamic_cache(model):
    """A follow-up chunk after the prefill (row 1's chunk left-padded) and a decode step after it:
    the logits of the real tokens are DynamicCache's; padding is not stored."""
    lengths = [20, 13]
    _, ids, mask = left_padded(lengths, seed=8)
    chunk = torch.randint(1, VOCAB, (2, 5), generator=torch.Generator().manual_seed(9))
    chunk_mask = torch.ones_like(chunk)
    chunk[1, :2], chunk_mask[1, :2] = 0, 0
    chunk_pos = torch.stack([lengths[0] + torch.arange(5), (lengths[1] + torch.arange(5) - 2).clamp(min=0)])
    tok = torch.tensor([[3], [7]])
    tok_pos = torch.tensor([[lengths[0] + 5], [lengths[1] + 3]])
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    logits = []
    for cache in (DynamicCache(), static(model, "fp16", rows=2, max_len=40, page_size=32)):
        full = torch.cat([mask, chunk_mask], 1)
        fwd(model, cache, ids, attention_mask=mask, position_ids=pos)
        a = fwd(model, cache, chunk, attention_mask=full, position_ids=chunk_pos)
        b = fwd(model, cache, tok, attention_mask=torch.cat([full, torch.ones(2, 1, dtype=full.dtype)], 1),
                position_ids=tok_pos)
        logits.append((a, b))
    (ra, rb), (ga, gb) = logits
    real = chunk_mask.bool()
    torch.testing.assert_close(ga[real], ra[real], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gb, rb, rtol=1e-4, atol=1e-4)
    assert cache.layers[0].row_lengths() == [20 + 5 + 1, 13 + 3 + 1]


SEVERAL_TOKEN_CASES = [("kivi-2", 32), ("int4-per-token", 0), ("hqmq-3.79", 32), ("hqmq-3.79-paper", 0),
                       ("fp16", 0)]


@pytest.mark.parametrize("preset,window", SEVERAL_TOKEN_CASES)
@pytest.mark.parametrize("T", [8, 70])
def test_several_token_step_equals_decoding_them_one_by_one(model, preset, window, T):
    check_several_token_step(model, preset, window, T, tol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset,window", SEVERAL_TOKEN_CASES)
@pytest.mark.parametrize("T", [8, 70])
def test_cuda_several_token_step_equals_decoding_them_one_by_one(cuda_model, preset, window, T):
    """On CUDA in fp16: the decode steps run the paged CUDA ops, the chunk the page decoders and
    the fp32 online softmax over fp16 inputs, so the two agree within fp16 rounding."""
    check_several_token_step(cuda_model, preset, window, T, tol=3e-2)


def check_several_token_step(model, preset, window, T, tol):
    """A chunk of T new tokens on a batch (row 1's chunk left-padded by 3) gives each row the
    logits of decoding its real tokens one by one (within ``tol``), and stores the same pages:
    pages that leave the window inside the chunk (T = 70 > 2 pages of 32: the ring wraps, and
    with no window the chunk's own pages compress) are seen compressed by the later queries
    exactly as the decode steps see them; padding is not stored."""
    dev, dtype = model.device, model.dtype
    lengths, pad = [60, 45], [0, 3]
    prompts, ids, mask = left_padded(lengths, seed=10)
    chunk = torch.randint(1, VOCAB, (2, T), generator=torch.Generator().manual_seed(11))
    chunk_mask = torch.ones_like(chunk)
    chunk_mask[1, :pad[1]] = 0
    chunk_pos = torch.stack([(n + torch.arange(T) - d).clamp(min=0) for n, d in zip(lengths, pad)])
    prompts, ids, mask, chunk, chunk_mask, chunk_pos = (
        [p.to(dev) for p in prompts], ids.to(dev), mask.to(dev), chunk.to(dev), chunk_mask.to(dev), chunk_pos.to(dev))
    full = torch.cat([mask, chunk_mask], 1)
    new = lambda rows: static(model, preset, rows=rows, max_len=136, page_size=32, recent_window=window,  # noqa: E731
                              device=dev, dtype=dtype)
    cache = new(2)
    fwd(model, cache, ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0))
    got = fwd(model, cache, chunk, attention_mask=full, position_ids=chunk_pos)
    assert cache.layers[1].row_lengths() == [n + T - d for n, d in zip(lengths, pad)]
    for b, (prompt, d) in enumerate(zip(prompts, pad)):
        ref = new(1)
        fwd(model, ref, prompt[None])
        want = torch.cat([fwd(model, ref, chunk[b:b + 1, i:i + 1], position_ids=chunk_pos[b:b + 1, i:i + 1])
                          for i in range(d, T)], 1)
        torch.testing.assert_close(got[b:b + 1, d:].float(), want.float(), rtol=tol, atol=tol)
        # row b's compressed pages of layer 0 hold the same tokens, compressed alike (its keys and
        # values come from the embeddings alone: equal in both runs up to the projection's
        # rounding, which may move an fp16 scale by an ulp or, rarely, a code by one step)
        a, r = cache.layers[0], ref.layers[0]
        c = max(0, lengths[b] + T - d - window) // 32
        if a.pages.comp is not None and c:
            J = a.layout.comp
            for x, y in zip(*([t for role in ("k", "v") for t in lay.pages.comp[role]] for lay in (a, r))):
                x, y = x[1 + b * J:1 + b * J + c], y[1:1 + c]
                if x.is_floating_point():
                    torch.testing.assert_close(x.float(), y.float(), rtol=2e-3, atol=1e-4)
                else:
                    assert (x != y).float().mean() <= 0.01
    tok = torch.tensor([[5], [9]], device=dev)
    step_mask = torch.cat([full, torch.ones(2, 1, dtype=full.dtype, device=dev)], 1)
    after = fwd(model, cache, tok, attention_mask=step_mask, position_ids=chunk_pos[:, -1:] + 1)
    assert torch.isfinite(after).all()


@pytest.mark.parametrize("preset", ["fp16", "kivi-2"])
def test_generate_with_chunked_prefill(model, preset):
    """generate's chunked prefill (prefill_chunk_size): the chunks after the first are several-token
    steps on the stored pages.  fp16: DynamicCache's tokens; kivi-2: the tokens of the same chunks
    and greedy steps run by hand."""
    ids = torch.randint(1, VOCAB, (1, 50), generator=torch.Generator().manual_seed(3))
    new = lambda: static(model, preset, rows=1, max_len=80, page_size=32, recent_window=32)  # noqa: E731
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=20,
                             min_new_tokens=20, do_sample=False, pad_token_id=0, prefill_chunk_size=16,
                             **{kh.cache_kwarg(model): new()})
    if preset == "fp16":
        assert torch.equal(out, gen(model, ids, DynamicCache(), n=20))
        # a left-padded batch: the chunks carry padding columns, which are not stored
        _, ids, mask = left_padded([50, 37], seed=4)
        cache = static(model, "fp16", rows=2, max_len=80, page_size=32)
        with torch.no_grad():
            out, ref = (model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=20, min_new_tokens=20,
                                       do_sample=False, pad_token_id=0, prefill_chunk_size=16,
                                       **{kh.cache_kwarg(model): c}) for c in (cache, DynamicCache()))
        assert torch.equal(out, ref)
        assert cache.layers[0].row_lengths() == [50 + 19, 37 + 19]
        return
    cache, seq = new(), ids
    for a in range(0, 50, 16):
        logits = fwd(model, cache, ids[:, a:a + 16], position_ids=torch.arange(a, min(50, a + 16))[None])
    for i in range(20):
        tok = logits[:, -1:].argmax(-1)
        seq = torch.cat([seq, tok], 1)
        if i < 19:  # generate never feeds its last token
            logits = fwd(model, cache, tok, position_ids=torch.tensor([[50 + i]]))
    assert torch.equal(out, seq)
    assert cache.layers[0].row_lengths() == [69]


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79"])
def test_decode_step_compiles_fullgraph_without_recompiles(model, preset):
    """The model's decode step with the cache traces into one graph (aot_eager: the ops' fake
    implementations and mutation annotations), runs 6 steps without a recompile, compresses a
    page inside them, and equals the eager steps."""
    P, lengths = 32, [60, 45]
    _, ids, mask = left_padded(lengths, seed=4)
    caches = [static(model, preset, rows=2, max_len=80, page_size=P, recent_window=32) for _ in range(2)]
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    for c in caches:
        fwd(model, c, ids, attention_mask=mask, position_ids=pos)
    toks = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(5))
    ck = kh.cache_kwarg(model)

    T = ids.shape[1]

    def step(tok, p, cache, **extra):
        return model(input_ids=tok, position_ids=p, use_cache=True, **{ck: cache}, **extra).logits

    def run(f, cache):
        return [f(toks[:, i:i + 1], torch.tensor(lengths)[:, None] + i, cache, **step_kwargs(model, T + i))
                for i in range(6)]

    with torch.no_grad():
        eager = run(step, caches[0])
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
        with torch._dynamo.config.patch(error_on_recompile=True):
            got = run(compiled, caches[1])
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert caches[1].layers[0].row_lengths() == [66, 51]
    comp = lambda n: max(0, n - 32) // P  # noqa: E731
    assert comp(60) < comp(66)  # a page of row 0 was compressed by a compiled step
    assert caches[1].nbytes == caches[0].nbytes
    torch._dynamo.reset()


def test_generate_compiles_its_decode_steps_into_one_graph(model):
    """generate's own compiled decode (its 4D mask of max_cache_len columns, positions from the
    attention mask), forced on CPU with an aot_eager CompileConfig: one graph, no graph break,
    the tokens of an uncompiled generate."""
    from transformers import CompileConfig, GenerationConfig
    cc = CompileConfig(backend="aot_eager", fullgraph=True, mode=None)
    if not hasattr(cc, "_compile_all_devices"):
        pytest.skip("this transformers compiles generate on accelerators only")
    cc._compile_all_devices = True
    _, ids, mask = left_padded([50, 37], seed=7)
    kw = dict(max_new_tokens=20, min_new_tokens=20, do_sample=False, pad_token_id=0)

    def run(**extra):
        cache = static(model, "kivi-2", rows=2, max_len=72, page_size=32, recent_window=32)
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(**kw, **extra),
                                  **{kh.cache_kwarg(model): cache})

    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    out = run(compile_config=cc)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch.equal(out, run(disable_compile=True))
    torch._dynamo.reset()


# ----------------------------------------------------------------------------- bad input
def test_bad_input_raises_clear_errors(model):
    with pytest.raises(NotImplementedError, match="argument 'config'"):
        static(model, "gear-2")
    with pytest.raises(NotImplementedError, match="argument 'config'"):
        static(model, "hqmq-5")  # Med3x outliers
    with pytest.raises(TypeError, match="argument 'config'"):
        static(model, 3)
    with pytest.raises(ValueError, match="max_batch_size"):
        static(model, "kivi-2", rows=0)
    with pytest.raises(ValueError, match="max_cache_len"):
        static(model, "kivi-2", max_len=-1)
    with pytest.raises(ValueError, match="page_size"):
        static(model, "kivi-2", page_size=48, device="cpu", dtype=torch.float32)
    sliding = tiny_model("mistral", sliding_window=16)
    with pytest.raises(NotImplementedError, match="model_config"):
        static(sliding, "kivi-2")

    ids = torch.randint(1, VOCAB, (4, 10))
    with pytest.raises(ValueError, match="max_batch_size=3"):
        fwd(model, static(model, "kivi-2"), ids)
    with pytest.raises(ValueError, match="max_cache_len=8"):
        fwd(model, static(model, "kivi-2", max_len=8), ids[:1])
    cache = static(model, "kivi-2", rows=1, max_len=11, page_size=32)
    fwd(model, cache, ids[:1])
    with pytest.raises(ValueError, match="max_cache_len=11"):
        fwd(model, cache, ids[:1, :2])
    fwd(model, cache, ids[:1, :1])  # token 11 of 11
    with pytest.raises(ValueError, match="max_cache_len=11"):
        fwd(model, cache, ids[:1, :1])
    two = static(model, "kivi-2", rows=2)
    fwd(model, two, ids[:2])
    with pytest.raises(ValueError, match="holds 2 sequences"):
        fwd(model, two, ids[:1, :1])

    model.set_attn_implementation("sdpa")
    try:
        cache = static(model, "kivi-2")
        fwd(model, cache, ids[:1])
        with pytest.raises(RuntimeError, match='"kvq" attention'):
            fwd(model, cache, ids[:1, :1])
    finally:
        kh.enable(model)
    cache = static(model, "kivi-2", rows=2)
    fwd(model, cache, ids[:2])
    with pytest.raises(IndexError, match="beam_idx"):
        cache.reorder_cache(torch.tensor([0, 2]))
    with pytest.raises(ValueError, match="repeats"):
        cache.batch_repeat_interleave(2)  # 4 rows > max_batch_size 2
    with pytest.raises(ValueError, match="positive value"):
        cache.crop(1)
    with pytest.raises(TypeError, match="tokens_to_remove"):
        cache.crop(-1.5)
    bad = static(model, "kivi-2", rows=1, device="cpu", dtype=torch.float32)
    k, v = bad.update(torch.full((1, 2, 3, 32), float("nan")), torch.zeros(1, 2, 3, 32), 0)
    with pytest.raises(ValueError, match="NaN"):  # checked when the prompt is stored
        bad.layers[0].attention(model.model.layers[0].self_attn, torch.zeros(1, 4, 3, 32), k, v, None, scaling=1.0)


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79"])
def test_cuda_reduce_overhead_decode_and_generate(preset):
    """fp16 on CUDA: decode steps compiled with CUDA graphs (mode="reduce-overhead",
    fullgraph) equal the eager steps, pages compressing inside them; generate with the cache
    (transformers compiles its decode steps) agrees with an uncompiled generate."""
    model = tiny_model().to("cuda", torch.float16)
    ck = kh.cache_kwarg(model)
    P, lengths, steps = 32, [60, 45], 12
    _, ids, mask = left_padded(lengths, seed=6)
    ids, mask = ids.cuda(), mask.cuda()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    caches = [static(model, preset, rows=2, max_len=96, page_size=P, recent_window=32, device="cuda",
                     dtype=torch.float16) for _ in range(2)]
    for c in caches:
        fwd(model, c, ids, attention_mask=mask, position_ids=pos)
    toks = torch.randint(1, VOCAB, (2, steps), device="cuda")
    T = ids.shape[1]

    def step(tok, p, cache, **extra):
        return model(input_ids=tok, position_ids=p, use_cache=True, **{ck: cache}, **extra).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for i in range(steps):
            p = torch.tensor(lengths, device="cuda")[:, None] + i
            want = step(toks[:, i:i + 1], p, caches[0], **step_kwargs(model, T + i)).float()
            got = compiled(toks[:, i:i + 1], p.clone(), caches[1], **step_kwargs(model, T + i)).float().clone()
            torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    torch.cuda.synchronize()
    assert caches[1].layers[0].row_lengths() == [n + steps for n in lengths]
    assert caches[1].nbytes == caches[0].nbytes
    assert max(0, 60 - 32) // P < max(0, 60 + steps - 32) // P  # a page compressed in the graphs

    n = 16
    from transformers import GenerationConfig
    kw = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    with torch.no_grad():  # on CUDA, generate compiles the decode steps of a compileable cache
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=GenerationConfig(**kw),
                             **{ck: static(model, preset, rows=2, max_len=96, page_size=P, recent_window=32)})
        plain = model.generate(input_ids=ids, attention_mask=mask,
                               generation_config=GenerationConfig(**kw, disable_compile=True),
                               **{ck: static(model, preset, rows=2, max_len=96, page_size=P, recent_window=32)})
    assert out.shape == plain.shape == (2, T + n)
    agree = (out[:, -n:] == plain[:, -n:]).float().mean().item()
    assert agree >= 0.9, agree
    torch._dynamo.reset()
