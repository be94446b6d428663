"""kvq.decode_attention against fp32 softmax attention over cache.dequantize()."""
import pytest
import torch

import kvquant_ext as kvq
from conftest import CUDA, DTYPES, MMA_HEAD_DIMS, requires_cuda
from reference.attention_reference import reference_decode_attention
from test_group_quant import make_kv

GQ_PRESETS = ["kivi-2", "kivi-4", "kcvt-4", "int4-per-token", "int2-per-token", "flexgen-4", "fp16",
              "gear-2", "hqmq-3.79", "hqmq-5"]  # gear-2 / hqmq: their own fused ops
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def build_cache(preset, B, H, T, D, dtype, device, steps=0):
    cache = kvq.KVCache(preset)
    cache.update(make_kv(B, H, T, D, dtype, device), make_kv(B, H, T, D, dtype, device), 0)
    for _ in range(steps):
        cache.update(make_kv(B, H, 1, D, dtype, device), make_kv(B, H, 1, D, dtype, device), 0)
    return cache


def check(cache, q, mask=None, tol=4e-3):
    out = kvq.decode_attention(q, cache, 0, attn_mask=mask)
    K, V = cache.dequantize(0)
    ref = reference_decode_attention(q.reshape(q.shape[0], q.shape[1], -1).to(K.dtype), K, V,
                                     q.shape[-1] ** -0.5, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    o = out.reshape(ref.shape).float()
    err = (o - ref).norm() / ref.norm()
    assert err < tol, f"relative error {err:.2e}"
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", GQ_PRESETS)
@pytest.mark.parametrize("T,steps", [(1, 0), (20, 0), (200, 3), (300, 40)])
def test_presets_and_lengths(device, preset, T, steps):
    """Residual only; one group + residual; store + residual of different K/V lengths."""
    cache = build_cache(preset, 2, 2, T, 64, torch.float16, device, steps)
    q = torch.randn(2, 8, 64, dtype=torch.float16, device=device)
    check(cache, q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("ratio", [1, 4, 7, 20])
@pytest.mark.parametrize("dtype", DTYPES)
def test_head_dims_gqa_dtypes(device, D, ratio, dtype):
    H = 2
    cache = build_cache("kivi-2", 1, H, 333 if device == "cuda" else 150, D, dtype, device, steps=5)
    q = torch.randn(1, H * ratio, 1, D, dtype=dtype, device=device)  # [B, Hq, 1, D] form
    # bf16: cache.dequantize() rounds every K/V entry to bf16 (2^-9), the op keeps fp32/fp16
    check(cache, q, tol=1.5e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "int4-per-token"])
def test_left_padding_mask(device, preset):
    B, H, T, D = 3, 2, 290, 64
    cache = build_cache(preset, B, H, T, D, torch.float16, device, steps=2)
    Tt = T + 2
    mask = torch.ones(B, Tt, dtype=torch.bool, device=device)
    mask[1, :37] = False   # left padding of sequence 1
    mask[2, :200] = False  # long padding crossing quantized groups
    q = torch.randn(B, 4, D, dtype=torch.float16, device=device)
    check(cache, q, mask)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    cache = build_cache("kivi-2", 1, 2, 40, 64, torch.float16, device)
    q = torch.randn(1, 6, 64, dtype=torch.float16, device=device)
    with pytest.raises(ValueError, match="not a multiple"):
        kvq.decode_attention(torch.randn(1, 3, 64, dtype=torch.float16, device=device), cache, 0)
    with pytest.raises(ValueError, match="'q'"):
        kvq.decode_attention(torch.randn(1, 4, 2, 64, dtype=torch.float16, device=device), cache, 0)
    with pytest.raises(TypeError, match="'q'"):
        kvq.decode_attention(q.to(torch.int32), cache, 0)
    with pytest.raises(IndexError, match="layer_idx"):
        kvq.decode_attention(q, cache, 3)
    with pytest.raises(ValueError, match="attn_mask"):
        kvq.decode_attention(q, cache, 0, attn_mask=torch.ones(1, 5, dtype=torch.bool))
    empty = kvq.KVCache("kivi-2", num_layers=1)
    with pytest.raises((ValueError, IndexError, TypeError)):
        kvq.decode_attention(q, empty, 0)
    if CUDA:
        with pytest.raises(ValueError, match="on"):
            kvq.decode_attention(q.cpu() if device == "cuda" else q.cuda(), cache, 0)
    # the raw op names its arguments
    kst, vst = cache.layers[0].key, cache.layers[0].value
    kc, ks, kz, kr = kst.attention_operands()
    vc, vs, vz, vr = vst.attention_operands()
    with pytest.raises(RuntimeError, match="'k_residual' must have the dtype of 'q'"):
        kvq.ops.decode_attention_gq(q.float(), kc, ks, kz, kr, vc, vs, vz, vr, None, 2, True, 2, False, 0.1)
    with pytest.raises(RuntimeError, match="'k_bits'"):
        kvq.ops.decode_attention_gq(q, kc, ks, kz, kr, vc, vs, vz, vr, None, 3, True, 2, False, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    cache = build_cache("kivi-4", 1, 2, 150, 64, torch.float16, device, steps=1)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=device)
    args = (q, *kst.attention_operands(), *vst.attention_operands(), None, 4, True, 4, False, 0.125)
    torch.library.opcheck(torch.ops.kvq.decode_attention_gq.default, args)


@requires_cuda
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "kcvt-4", "int4-per-token", "flexgen-4"])
@pytest.mark.parametrize("T", [4096, 5000])
def test_cuda_long_matches_cpu(preset, T):
    """Long caches (mma path, many splits) equal the CPU op on the same stored data."""
    cache = build_cache(preset, 2, 4, T, 128, torch.float16, "cuda", steps=3)
    q = torch.randn(2, 16, 128, dtype=torch.float16, device="cuda")
    out = check(cache, q)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    cpu_ops = [t.cpu() for t in (*kst.attention_operands(), *vst.attention_operands())]
    ref = kvq.ops.decode_attention_gq(q.cpu(), *cpu_ops, None, kst.spec.bits, kst.spec.per_channel,
                                      vst.spec.bits, vst.spec.per_channel, 128 ** -0.5)
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < 3e-3


@requires_cuda
@pytest.mark.parametrize("cfg,D", [
    (kvq.GroupQuantConfig(bits=2, key_group_size=32, value_group_size=16), 128),   # 8 value groups
    (kvq.GroupQuantConfig(bits=2, key_group_size=64, value_group_size=64), 128),   # 2 tiles per key group
    (kvq.GroupQuantConfig(bits=4, key_group_size=256, value_group_size=128, residual_length=256), 128),
    (kvq.GroupQuantConfig(bits=8, key_group_size=128, value_group_size=32), 64),
    (kvq.GroupQuantConfig(bits=2, key_group_size=64, key_per_channel=False, value_group_size=16), 128),
    (kvq.GroupQuantConfig(bits=4, key_group_size=32, value_group_size=8), 64),     # values G < 16
    (kvq.GroupQuantConfig(bits=2, key_group_size=32, value_group_size=32), 256),
])
def test_cuda_group_sizes_match_cpu(cfg, D):
    """Every key/value group layout the tensor-core kernels instantiate (value groups per token
    1..8, key groups spanning 1, 2 or 8 tiles, per-token keys) equals the CPU op on the same
    stored data and the fp32 reference."""
    cache = build_cache(cfg, 2, 4, 3000, D, torch.float16, "cuda", steps=2)
    q = torch.randn(2, 16, D, dtype=torch.float16, device="cuda")
    out = check(cache, q)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    cpu_ops = [t.cpu() for t in (*kst.attention_operands(), *vst.attention_operands())]
    ref = kvq.ops.decode_attention_gq(q.cpu(), *cpu_ops, None, kst.spec.bits, kst.spec.per_channel,
                                      vst.spec.bits, vst.spec.per_channel, D ** -0.5)
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < 3e-3


@requires_cuda
@pytest.mark.parametrize("preset,D,dtype", [("kivi-2", 128, torch.float16), ("kivi-4", 128, torch.bfloat16),
                                            ("int4-per-token", 128, torch.float16), ("kivi-2", 64, torch.float16),
                                            (kvq.KIVIConfig(bits=8), 256, torch.float16)])
def test_cuda_many_tiles_per_warp(preset, D, dtype):
    """B x H large enough that each warp streams many tiles through its cp.async ring (wrap-
    around of every stage), plus a mask that cuts through mma tiles."""
    B, H, T = 4, 8, 12000
    cache = build_cache(preset, B, H, T, D, dtype, "cuda", steps=5)
    q = torch.randn(B, 4 * H, D, dtype=dtype, device="cuda")
    # bf16: the fp32 reference reads cache.dequantize(), which rounds every entry to bf16 (2^-9);
    # the kernel's own error is checked against the CPU op on the same stored data below
    tol = 6e-3 if dtype == torch.bfloat16 else 4e-3
    mask = torch.ones(B, T + 5, dtype=torch.bool, device="cuda")
    mask[1, :3001] = False
    mask[2, 5000:5100] = False
    kst, vst = cache.layers[0].key, cache.layers[0].value
    cpu_ops = [t.cpu() for t in (*kst.attention_operands(), *vst.attention_operands())]
    for m in (None, mask):
        out = check(cache, q, m, tol=tol)
        ref = kvq.ops.decode_attention_gq(q.cpu(), *cpu_ops, None if m is None else m.cpu(), kst.spec.bits,
                                          kst.spec.per_channel, vst.spec.bits, vst.spec.per_channel, D ** -0.5)
        err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
        assert err < 3e-3, f"relative error vs the CPU op {err:.2e}"


@requires_cuda
@pytest.mark.parametrize("preset,B,T,D,dtype", [("kivi-2", 32, 4096, 128, torch.float16),
                                                ("kivi-4", 16, 700, 128, torch.bfloat16),
                                                ("kcvt-4", 24, 333, 64, torch.float16),
                                                ("kivi-2", 8, 1000, 256, torch.float32),
                                                ("int4-per-token", 20, 150, 128, torch.float16)])
def test_cuda_tail_heavy_matches_cpu(preset, B, T, D, dtype):
    """B x H rows that fill the GPU, so each row's one or few CTAs run the whole full-precision
    window on the generic path, several tokens per step with a partial last step; masked
    window tokens whose stored K / V are NaN get weight 0 and must not reach the output."""
    H = 8
    cache = build_cache(preset, B, H, T, D, dtype, "cuda", steps=3)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    ops = [t.clone() for t in (*kst.attention_operands(), *vst.attention_operands())]
    Tt = T + 3
    q = torch.randn(B, 4 * H, D, dtype=dtype, device="cuda")
    mask = torch.ones(B, Tt, dtype=torch.bool, device="cuda")
    hidden = [Tt - 1, Tt - 6, Tt - 7, Tt - 40]  # window tokens of row 1: masked, then poisoned
    mask[1, hidden] = False
    mask[2, : Tt - 2] = False  # row 2 sees only its last two tokens
    for res, tq in ((ops[3], ops[0].shape[2]), (ops[7], ops[4].shape[2])):
        for t in hidden:
            if t >= tq:
                res[1, :, t - tq] = float("nan")
    args = (kst.spec.bits, kst.spec.per_channel, vst.spec.bits, vst.spec.per_channel, D ** -0.5)
    for m in (None, mask):
        if m is None:  # unmasked: the original window (no NaN)
            run = [t.clone() for t in (*kst.attention_operands(), *vst.attention_operands())]
        else:
            run = ops
        out = kvq.ops.decode_attention_gq(q, *run, m, *args)
        ref = kvq.ops.decode_attention_gq(q.cpu(), *[t.cpu() for t in run], None if m is None else m.cpu(), *args)
        assert torch.isfinite(out).all()
        err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
        assert err < 3e-3, f"relative error vs the CPU op {err:.2e}"


@requires_cuda
def test_cuda_graph_capture():
    cache = build_cache("kivi-2", 1, 8, 4096, 128, torch.float16, "cuda")
    q = torch.randn(1, 32, 128, dtype=torch.float16, device="cuda")
    out = kvq.decode_attention(q, cache, 0)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out2 = kvq.decode_attention(q, cache, 0)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, out2)


# ---- the split combine (split kernel + combine kernel) over many split plans ----
def _cpu_op(cache, q, mask, scale):
    kst, vst = cache.layers[0].key, cache.layers[0].value
    cpu_ops = [t.cpu() for t in (*kst.attention_operands(), *vst.attention_operands())]
    return kvq.ops.decode_attention_gq(q.cpu(), *cpu_ops, None if mask is None else mask.cpu(), kst.spec.bits,
                                       kst.spec.per_channel, vst.spec.bits, vst.spec.per_channel, scale)


# (preset, B, H, Hq, T, D, masked): B = 1 short (residual only: generic kernel) and long
# (mma + tail-only CTAs; many splits), the Llama-3-8B bench shape, batch > 1 with a mask and a
# fully masked row, g = 16 (generic kernel, 16 heads per CTA), 4-bit and per-token keys,
# GEAR and HQMQ (their own kernels, same combine).
SPLIT_CASES = [
    ("kivi-2", 1, 8, 32, 40, 128, False),
    ("kivi-2", 1, 8, 32, 4096, 128, False),
    ("kivi-2", 1, 2, 8, 20000, 128, False),
    ("kivi-4", 3, 4, 16, 5000, 128, True),
    ("int4-per-token", 2, 4, 16, 3000, 128, False),
    ("kivi-2", 2, 2, 32, 700, 64, True),
    ("kivi-2", 1, 2, 4, 3000, 256, False),
    ("gear-2", 2, 2, 8, 1500, 128, False),
    ("hqmq-3.79", 1, 2, 8, 3000, 128, False),
]


@requires_cuda
@pytest.mark.parametrize("preset,B,H,Hq,T,D,masked", SPLIT_CASES)
def test_cuda_split_combine_matches_cpu(preset, B, H, Hq, T, D, masked):
    """Every split plan (one split, many, tail-only CTAs) merges to the CPU op's result, and
    repeated calls give the same bits (the merge runs in split order)."""
    cache = build_cache(preset, B, H, T, D, torch.float16, "cuda", steps=3)
    q = torch.randn(B, Hq, D, dtype=torch.float16, device="cuda")
    mask = None
    if masked:
        mask = torch.ones(B, T + 3, dtype=torch.bool, device="cuda")
        mask[1, :T // 3] = False
        mask[B - 1] = False  # a fully masked row: zeros
    two = kvq.decode_attention(q, cache, 0, attn_mask=mask)
    outs = [kvq.decode_attention(q, cache, 0, attn_mask=mask) for _ in range(2)]
    torch.cuda.synchronize()
    for o in outs:
        assert torch.equal(o, two)
    if masked:
        assert torch.equal(two[B - 1], torch.zeros_like(two[B - 1]))
    if preset.startswith(("gear", "hqmq")):
        check(cache, q, mask, tol=1e-2)
    else:
        ref = _cpu_op(cache, q, mask, D ** -0.5)
        err = (two.cpu().float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)
        assert err < 3e-3, f"relative error vs the CPU op {err:.2e}"


@requires_cuda
def test_cuda_graph_replay_two_calls():
    """Two calls (long B = 1 and short) captured in one CUDA graph, replayed twice in a row and
    again after new q values were copied in: each replay equals eager calls."""
    long_c = build_cache("kivi-2", 1, 8, 4096, 128, torch.float16, "cuda", steps=1)
    short_c = build_cache("kivi-4", 2, 4, 300, 128, torch.float16, "cuda", steps=1)
    q1 = torch.randn(1, 32, 128, dtype=torch.float16, device="cuda")
    q2 = torch.randn(2, 16, 128, dtype=torch.float16, device="cuda")

    def run():
        return kvq.decode_attention(q1, long_c, 0), kvq.decode_attention(q2, short_c, 0)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()  # warm-up outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            o1, o2 = run()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    for step in range(3):
        if step == 2:
            q1.copy_(torch.randn_like(q1))
            q2.copy_(torch.randn_like(q2))
        e1, e2 = run()
        g.replay()
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(o1, e1) and torch.equal(o2, e2), f"replay {step}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", ["kivi-2", "fp16", "gear-2"])
def test_fully_masked_row_gives_zeros(device, preset):
    cache = build_cache(preset, 2, 2, 150, 64, torch.float16, device)
    mask = torch.ones(2, 150, dtype=torch.bool, device=device)
    mask[1] = False
    q = torch.randn(2, 4, 64, dtype=torch.float16, device=device)
    out = kvq.decode_attention(q, cache, 0, attn_mask=mask)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all() and out[0].abs().sum() > 0


# ----------------------------------------------------------------------------- prefix attention
def _prefix_cache(preset, dtype=torch.float32, device="cpu", seed=None):
    """2 layers, B = 2, H = 2, D = 64: a prefill of 70, single tokens to 100, steps of 5 to 230
    (compressed part, full-precision part and, for GEAR, decode blocks all non-empty)."""
    cache = kvq.KVCache(preset)
    g = None if seed is None else torch.Generator().manual_seed(seed)
    x = [(torch.randn(2, 2, 230, 64, generator=g) * (1 + torch.rand(2, 2, 1, 64, generator=g))).to(dtype).to(device)
         for _ in range(2)]
    a = 0
    for b in [70] + list(range(71, 100)) + list(range(105, 231, 5)):
        cache.update(x[0][:, :, a:b], x[1][:, :, a:b], 0)
        a = b
    return cache


def _attention_reference(q, K, V, allowed, scale):
    g = q.shape[1] // K.shape[1]
    K, V = K.double().repeat_interleave(g, 1), V.double().repeat_interleave(g, 1)
    s = (q.double() @ K.transpose(-1, -2)) * scale
    p = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1).nan_to_num(0.0)
    return p @ V


@pytest.mark.parametrize("preset", sorted(kvq.PRESETS))
def test_dequantize_range_is_the_slice_of_dequantize(preset):
    cache = _prefix_cache(preset, torch.float16)
    for st in (cache.layers[0].key, cache.layers[0].value):
        full, T = st.dequantize(), st.seq_len
        for a, b in [(0, T), (0, 1), (5, 77), (31, 33), (64, 128), (100, 229), (128, 200), (200, T), (7, 7)]:
            assert torch.equal(st.dequantize_range(a, b), full[:, :, a:b]), (a, b)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("preset", sorted(kvq.PRESETS))
def test_prefix_attention_equals_attention_over_the_dequantized_cache(preset, masked, monkeypatch):
    cache = _prefix_cache(preset)
    P, t = cache.get_seq_length(0), 9
    q = torch.randn(2, 8, t, 64)  # GQA: Hq = 4 H
    kn, vn = torch.randn(2, 2, t, 64), torch.randn(2, 2, t, 64)
    K, V = (torch.cat([d, n], dim=2) for d, n in zip(cache.dequantize(0), (kn, vn)))
    allowed = torch.cat([torch.ones(t, P, dtype=torch.bool), torch.ones(t, t, dtype=torch.bool).tril()], 1)
    allowed = allowed.expand(2, t, P + t).clone()
    mask = None
    if masked:  # left padding of row 0, a query of row 1 that attends to nothing
        allowed[0, :, :5] = False
        allowed[1, 3] = False
        mask = allowed.clone()
    ref = _attention_reference(q, K, V, allowed, 0.125)

    def no_full_dequantize(*a, **k):
        raise AssertionError("prefix_attention dequantized the whole layer")
    for st in (cache.layers[0].key, cache.layers[0].value):
        monkeypatch.setattr(st, "dequantize", no_full_dequantize)
    out = kvq.prefix_attention(q, cache, 0, kn, vn, attn_mask=mask, chunk_size=50)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.allclose(out.double(), ref, atol=2e-5, rtol=1e-5)
    if masked:
        assert torch.equal(out[1, :, 3], torch.zeros_like(out[1, :, 3]))
    # the fresh tokens already appended (their arrival may have compressed past tokens):
    # past_length names the past
    cache.update(kn, vn, 0)
    K2, V2 = (torch.cat([st.dequantize_range(0, P), n], dim=2)
              for st, n in zip((cache.layers[0].key, cache.layers[0].value), (kn, vn)))
    out2 = kvq.prefix_attention(q, cache, 0, kn, vn, attn_mask=mask, past_length=P, chunk_size=50)
    assert torch.allclose(out2.double(), _attention_reference(q, K2, V2, allowed, 0.125), atol=2e-5, rtol=1e-5)


@requires_cuda
@pytest.mark.parametrize("preset", ["fp16", "kivi-2", "int4-per-token", "gear-2", "hqmq-3.79", "hqmq-5"])
def test_cuda_prefix_attention_equals_cpu(preset):
    """The same streamed fp16 cache on CUDA and on the CPU: prefix_attention agrees (fp32
    softmax on both; the stored tensors are equal, so only the matmul order differs)."""
    out = []
    for dev in ("cpu", "cuda"):
        cache = _prefix_cache(preset, torch.float16, dev, seed=3)
        g = torch.Generator().manual_seed(4)
        q = torch.randn(2, 8, 9, 64, generator=g).half().to(dev)
        kn, vn = (torch.randn(2, 2, 9, 64, generator=g).half().to(dev) for _ in range(2))
        out.append(kvq.prefix_attention(q, cache, 0, kn, vn, chunk_size=50).float().cpu())
    torch.testing.assert_close(out[1], out[0], rtol=2e-3, atol=2e-3)


def test_prefix_attention_errors():
    cache = _prefix_cache("kivi-2")
    q, k = torch.randn(2, 8, 3, 64), torch.randn(2, 2, 3, 64)
    with pytest.raises(ValueError, match="'past_length'"):
        kvq.prefix_attention(q, cache, 0, k, k, past_length=10_000)
    with pytest.raises(ValueError, match="'attn_mask'"):
        kvq.prefix_attention(q, cache, 0, k, k, attn_mask=torch.ones(2, 3, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="'q'"):
        kvq.prefix_attention(torch.randn(2, 7, 3, 64), cache, 0, k, k)
    with pytest.raises(ValueError, match="'key'"):
        kvq.prefix_attention(q, cache, 0, k[:, :, :2], k)
    with pytest.raises(ValueError, match="'chunk_size'"):
        kvq.prefix_attention(q, cache, 0, k, k, chunk_size=0)
    with pytest.raises(ValueError, match="empty"):
        kvq.prefix_attention(q, kvq.KVCache("kivi-2", num_layers=1), 0, k, k)
