"""``recent_window`` (every config): a streaming cache keeps the newest W tokens of a layer in
full precision; a token that ages out of the window enters the method's own streaming rule.

Checked per family on CPU (and CUDA against the CPU twin where a GPU is present): the newest
W tokens come back bit-exact after every append; per-token formats store every older token
exactly as the same config without a window does (their encoding needs no other token), and
KIVI keys flush the same R-token blocks; ``nbytes`` counts the window at its dtype's size;
``decode_attention`` equals softmax attention over ``dequantize``; the state round trip is
exact and a window longer than the config's is refused when loaded.
"""
import dataclasses

import pytest
import torch

import kvquant_ext as kvq
from conftest import CUDA, MMA_HEAD_DIMS, requires_cuda

FAMILIES = ["kivi-2", "kcvt-4", "int4-per-token", "flexgen-4", "gear-2", "gearl-2", "outlier-2",
            "hqmq-3.79", "hqmq-5", "fp16"]
# formats whose stored tokens do not depend on the tokens around them (KIVI values, per-token
# INT, FlexGen, HQMQ with the Med3x threshold of the first append), and KIVI keys (blocks of R
# from token 0, so the same blocks whatever the window)
SAME_AS_WITHOUT_WINDOW = ["kivi-2", "int4-per-token", "flexgen-4", "hqmq-3.79", "hqmq-5"]


def windowed(name, W):
    return dataclasses.replace(kvq.get_config(name), recent_window=W)


def kv(T, D=64, B=2, H=2, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(B, H, T, D, generator=g) * torch.exp(0.5 * torch.randn(1, H, 1, D, generator=g))
    v = torch.randn(B, H, T, D, generator=g)
    return k.to(dtype), v.to(dtype)


def stream(cache, k, v, chunks):
    """Append k/v in the given chunk sizes (prefill first), yielding the length after each."""
    s = 0
    for n in chunks:
        cache.update(k[:, :, s:s + n].contiguous(), v[:, :, s:s + n].contiguous(), 0)
        s += n
        yield s


CHUNKS = [200, 1, 1, 3, 1, 17, 1, 1, 40, 1, 1]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("W", [1, 37, 64])
def test_newest_tokens_stay_exact(name, W):
    k, v = kv(sum(CHUNKS))
    c = kvq.KVCache(windowed(name, W))
    for n in stream(c, k, v, CHUNKS):
        K, V = c.dequantize(0)
        assert K.shape[2] == V.shape[2] == n == c.get_seq_length(0)
        w = min(W, n)
        assert torch.equal(K[:, :, n - w:n], k[:, :, n - w:n]), (name, n)
        assert torch.equal(V[:, :, n - w:n], v[:, :, n - w:n]), (name, n)
    if name != "fp16":  # the control: old tokens really are compressed
        assert not torch.equal(K[:, :, :16], k[:, :, :16])


@pytest.mark.parametrize("name", SAME_AS_WITHOUT_WINDOW)
def test_older_tokens_are_stored_as_without_a_window(name):
    k, v = kv(sum(CHUNKS), seed=1)
    W = 37
    c, c0 = kvq.KVCache(windowed(name, W)), kvq.KVCache(kvq.get_config(name))
    for n, _ in zip(stream(c, k, v, CHUNKS), stream(c0, k, v, CHUNKS)):
        K, V = c.dequantize(0)
        K0, V0 = c0.dequantize(0)
        ks = c.layers[0].key
        # tokens the windowed key stream has compressed (KIVI keys: whole R-blocks of both)
        nk = getattr(ks, "quantized_len", None)
        nk = ks.codes.length if nk is None else nk
        assert torch.equal(K[:, :, :nk], K0[:, :, :nk]), (name, n)
        nv = n - W
        if nv > 0 and name != "kivi-2":  # KIVI values: the FIFO keeps R more in full precision
            assert torch.equal(V[:, :, :nv], V0[:, :, :nv]), (name, n)


@pytest.mark.parametrize("name", FAMILIES)
def test_nbytes_counts_the_window(name):
    k, v = kv(200, seed=2)
    W = 48
    c = kvq.KVCache(windowed(name, W))
    list(stream(c, k, v, [150] + [1] * 50))
    stored = 0
    for st in (c.layers[0].key, c.layers[0].value):
        stored += sum(t.numel() * t.element_size() for t in st.tensors().values() if t is not None)
    assert c.nbytes == stored
    if name != "fp16":
        smaller = kvq.KVCache(windowed(name, 0))
        list(stream(smaller, k, v, [150] + [1] * 50))
        # the window costs up to W fp16 tokens per role, plus (block formats) up to one
        # block of <= 128 tokens that waits for whole-block alignment
        assert smaller.nbytes < c.nbytes <= smaller.nbytes + 2 * 2 * 2 * (W + 128) * 64 * 2


def _attention(q, K, V, scale):
    B, Hq, D = q.shape
    H = K.shape[1]
    qf = q.float().reshape(B, H, Hq // H, D)
    s = torch.einsum("bhgd,bhtd->bhgt", qf, K.float()) * scale
    return torch.einsum("bhgt,bhtd->bhgd", s.softmax(-1), V.float()).reshape(B, Hq, D)


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("W", [5, 64, 300])
def test_decode_attention_reads_window_and_compressed_tokens(name, W):
    k, v = kv(200, seed=3)
    c = kvq.KVCache(windowed(name, W))
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(4)).half()
    for n in stream(c, k, v, [120, 1, 1, 30, 1, 47]):
        K, V = c.dequantize(0)
        ref = _attention(q, K, V, 0.125)
        out = kvq.decode_attention(q, c, 0, scale=0.125)
        torch.testing.assert_close(out.float(), ref, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["kivi-2", "gear-2", "hqmq-5", "hqmq-3.79"])
def test_state_round_trip_with_window(name):
    k, v = kv(160, seed=5)
    cfg = windowed(name, 40)
    c = kvq.KVCache(cfg)
    list(stream(c, k, v, [100] + [1] * 60))
    d = kvq.KVCache(cfg)
    d.load_state_dict(c.state_dict())
    for a, b in zip(c.dequantize(0), d.dequantize(0)):
        assert torch.equal(a, b)
    q = torch.randn(2, 8, 64).half()
    assert torch.equal(kvq.decode_attention(q, c, 0), kvq.decode_attention(q, d, 0))


def test_hqmq_refuses_a_window_longer_than_the_config_when_loaded():
    k, v = kv(100, seed=6)
    c = kvq.KVCache(windowed("hqmq-5", 40))
    c.update(k, v, 0)
    state = c.state_dict()
    with pytest.raises(ValueError, match="recent_window"):
        kvq.KVCache(windowed("hqmq-5", 10)).load_state_dict({**state, "config": windowed("hqmq-5", 10).to_dict()})


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_recent_window_is_validated(bad):
    for cls in (kvq.KIVIConfig, kvq.HQMQConfig, kvq.GEARConfig, kvq.FP16Config):
        with pytest.raises(ValueError, match="recent_window"):
            cls(recent_window=bad)


def test_recent_window_round_trips_and_is_keyword_only():
    cfg = kvq.KIVIConfig(2, 32, 128, recent_window=64)  # positional fields keep their order
    assert (cfg.bits, cfg.group_size, cfg.residual_length, cfg.recent_window) == (2, 32, 128, 64)
    assert kvq.CompressionConfig.from_dict(cfg.to_dict()) == cfg
    old = cfg.to_dict()
    del old["recent_window"]  # a state saved before the field existed
    assert kvq.CompressionConfig.from_dict(old).recent_window == 0


def test_hqmq_op_checks_the_residual():
    k, v = kv(80, seed=7)
    c = kvq.KVCache(windowed("hqmq-3.79", 16))
    c.update(k, v, 0)
    ks, vs = c.layers[0].key, c.layers[0].value
    kops, vops = ks.attention_operands(), vs.attention_operands()
    kr, vr = ks.residual_operand(), vs.residual_operand()
    q = torch.randn(2, 4, 64).half()
    args = (q, *kops, *vops, None, 4, 4, 0.125)
    ok = kvq.ops.decode_attention_hqmq(*args, kr, vr)
    torch.testing.assert_close(ok, kvq.decode_attention(q, c, 0, scale=0.125))
    with pytest.raises(RuntimeError, match="v_residual"):
        kvq.ops.decode_attention_hqmq(*args, kr, vr.float())
    with pytest.raises(RuntimeError, match="k_residual"):
        kvq.ops.decode_attention_hqmq(*args, kr[:, :, :, :32], vr)
    with pytest.raises(RuntimeError, match="residual holds"):
        kvq.ops.decode_attention_hqmq(*args, kr, vr[:, :, :8])
    with pytest.raises(RuntimeError, match="mask"):  # the mask covers the window too
        kvq.ops.decode_attention_hqmq(q, *kops, *vops, torch.ones(2, 64, dtype=torch.bool), 4, 4, 0.125, kr, vr)


def test_paged_cache_takes_the_configs_window():
    cfg = windowed("kivi-2", 100)
    p = kvq.PagedKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=1024,
                         page_size=64, max_seqs=2)
    assert p.recent_window == 128  # rounded up to whole pages
    assert kvq.PagedKVCache(cfg, num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=1024,
                            page_size=64, max_seqs=2, recent_window=0).recent_window == 0


# ----------------------------------------------------------------------------- CUDA
@requires_cuda
@pytest.mark.parametrize("name", ["hqmq-3.79", "hqmq-5"])
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("T, W", [(40, 40), (95, 17), (200, 64), (1000, 128)])
@pytest.mark.parametrize("g", [1, 4, 8, 16])
def test_hqmq_window_cuda_equals_cpu_twin(name, D, T, W, g):
    """The fused kernel reads encoded tokens (tensor-core tiles + generic tail) and the window
    (generic tail): same result as the CPU twin, every token in the window included."""
    k, v = kv(T, D=D, seed=T + D)
    cfg = windowed(name, W)
    c = kvq.KVCache(cfg)
    c.update(k.cuda(), v.cuda(), 0)
    c.update(*(t.cuda() for t in kv(1, D=D, seed=1)), 0)
    q = torch.randn(2, 2 * g, D, generator=torch.Generator().manual_seed(g)).half()
    cpu = kvq.KVCache(cfg)
    cpu.load_state_dict({kk: (t.cpu() if isinstance(t, torch.Tensor) else t) for kk, t in c.state_dict().items()})
    out = kvq.decode_attention(q.cuda(), c, 0)
    ref = kvq.decode_attention(q, cpu, 0)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=2e-3, rtol=2e-3)
    K, V = cpu.dequantize(0)
    torch.testing.assert_close(ref.float(), _attention(q, K, V, D ** -0.5), atol=2e-3, rtol=2e-3)


@requires_cuda
@pytest.mark.parametrize("name", ["kivi-2", "gear-2", "int4-per-token"])
def test_window_cuda_equals_cpu(name):
    k, v = kv(300, D=128, seed=9)
    cfg = windowed(name, 96)
    g, gc = kvq.KVCache(cfg), kvq.KVCache(cfg)
    for s, n in ((0, 256), (256, 1), (257, 1), (258, 32)):
        g.update(k[:, :, s:s + n].cuda(), v[:, :, s:s + n].cuda(), 0)
        gc.update(k[:, :, s:s + n].contiguous(), v[:, :, s:s + n].contiguous(), 0)
    q = torch.randn(2, 8, 128).half()
    torch.testing.assert_close(kvq.decode_attention(q.cuda(), g, 0).cpu().float(),
                               kvq.decode_attention(q, gc, 0).float(), atol=2e-3, rtol=2e-3)
