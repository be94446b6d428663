"""kvq.decode_attention over HQMQ cache layers (torch.ops.kvq.decode_attention_hqmq) against
fp32 softmax attention over cache.dequantize(); the Med3x outlier index of HQMQStream."""
import warnings

import pytest
import torch

import kvquant_ext as kvq
from conftest import CUDA, MMA_HEAD_DIMS, requires_cuda
from reference import hqmq_reference as hq_ref
from reference.attention_reference import reference_decode_attention

PRESETS = ["hqmq-3.79-paper", "hqmq-5"]
DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def make_data(B, H, T, D, dtype, device, spikes=True):
    """Gaussian data with a few large chunks (so Med3x flags outliers at hqmq-5)."""
    x = torch.randn(B, H, T, D)
    if spikes and T > 0:
        x[:, :, ::5, 8:12] *= 12.0   # chunk 2 of every 5th token
        x[:, :, 3::11, -4:] *= 20.0  # last chunk of some tokens
    return x.to(dtype).to(device)


def build(preset, B, H, T, D, dtype, device, steps=0, spike_steps=True):
    cache = kvq.KVCache(preset)
    cache.update(make_data(B, H, T, D, dtype, device), make_data(B, H, T, D, dtype, device), 0)
    for s in range(steps):
        k = make_data(B, H, 1, D, dtype, device, spikes=False)
        v = make_data(B, H, 1, D, dtype, device, spikes=False)
        if spike_steps and s % 2 == 0:
            k[..., :4] *= 25.0
            v[..., 4:8] *= 25.0
        cache.update(k, v, 0)
    return cache


def fused(q, cache, mask=None):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the dequantize fallback warns: it must not be taken
        return kvq.decode_attention(q, cache, 0, attn_mask=mask)


def check(cache, q, mask=None, tol=4e-3):
    out = fused(q, cache, mask)
    K, V = cache.dequantize(0)
    q3 = q.reshape(q.shape[0], q.shape[1], -1)
    ref = reference_decode_attention(q3.to(K.dtype), K, V, q.shape[-1] ** -0.5, mask)
    assert out.shape == q.shape and out.dtype == q.dtype
    o = out.reshape(ref.shape).float()
    assert torch.isfinite(o).all()
    err = ((o - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"
    return out, ref


def num_records(cache):
    layer = cache.layers[0]
    return layer.key.outliers.length, layer.value.outliers.length


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("T", [1, 17, 33, 300])
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
def test_presets_lengths_head_dims(device, preset, T, D):
    cache = build(preset, 2, 2, T, D, torch.float16, device)
    q = torch.randn(2, 8, D, dtype=torch.float16, device=device)
    check(cache, q)
    nk, nv = num_records(cache)
    if preset == "hqmq-5" and T >= 17:
        assert nk > 0 and nv > 0  # Med3x fired: the records are part of what is checked
    if preset == "hqmq-3.79-paper":
        assert nk == nv == 0


def reference_role(ops, D, rb):
    """One role's K or V [B, H, T, D] (float64) from its attention operands, decoded by the
    plain-PyTorch reference from the documented packed layout, Med3x records applied."""
    codes, sec, rec, _ = [t.cpu() for t in ops]
    B, H, T, _ = codes.shape
    S = sec.shape[1]
    dirs, rc, scale = hq_ref.unpack_rows(codes, D, S, rb)
    x = hq_ref.decode_reference(dirs, rc, scale, sec, rb).reshape(B * H, T, D // 4, 4)
    for r in rec.tolist():
        v = torch.tensor([r[2], r[3]], dtype=torch.int32).view(torch.float16).double()
        n, c = (r[1] & 0xFFFFFFFF) >> 8, r[1] & 0xFF
        assert (x[n, r[0], c] == 0).all()  # outlier chunks are coded with radius 0
        x[n, r[0], c] = v
    return x.reshape(B, H, T, D)


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
def test_attention_reads_the_documented_layout(preset, D):
    """The CPU op over the packed rows equals fp32 attention over K / V decoded by the reference
    from the documented layout (independent of kvq's decode)."""
    cache = build(preset, 2, 2, 77, D, torch.float16, "cpu", steps=3)
    rb = kvq.get_config(preset).radius_bits
    kops, vops = cache.layers[0].key.attention_operands(), cache.layers[0].value.attention_operands()
    K, V = reference_role(kops, D, rb), reference_role(vops, D, rb)
    torch.testing.assert_close(K.float(), cache.dequantize(0)[0].float(), rtol=1e-3, atol=1e-3)
    q = torch.randn(2, 6, D, dtype=torch.float16)
    out = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, rb, rb, D ** -0.5)
    ref = reference_decode_attention(q.double(), K, V, D ** -0.5, None)
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < 2e-3, f"relative error {err:.2e}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("ratio", [1, 4, 7, 20])
def test_gqa(device, preset, ratio):
    H = 2
    cache = build(preset, 1, H, 70 if device == "cpu" else 333, 128, torch.float16, device, steps=3)
    q = torch.randn(1, H * ratio, 1, 128, dtype=torch.float16, device=device)  # [B, Hq, 1, D]
    check(cache, q)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_then_appends(device, preset):
    """Records of a 32-token tile arrive over several calls: the index must merge them."""
    cache = build(preset, 2, 3, 45, 64, torch.float16, device, steps=40)
    q = torch.randn(2, 6, 64, dtype=torch.float16, device=device)
    for _ in range(3):  # attend, append, attend again
        check(cache, q)
        cache.update(make_data(2, 3, 1, 64, torch.float16, device),
                     make_data(2, 3, 1, 64, torch.float16, device), 0)
    check(cache, q)
    if preset == "hqmq-5":
        nk, nv = num_records(cache)
        assert nk > 0 and nv > 0


@pytest.mark.parametrize("device", DEVICES)
def test_outliers_are_used(device):
    """Dropping the records changes the result well beyond the tolerance (so the exactness
    check of the records is not vacuous), and keeping them matches the reference."""
    cache = build("hqmq-5", 1, 2, 100, 64, torch.float16, device, steps=10)
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=device)
    # make q see the outlier chunks strongly
    q[..., 8:12] *= 4.0
    out, ref = check(cache, q)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    kops, vops = kst.attention_operands(), vst.attention_operands()
    assert len(kops) == 4 and kops[0].dtype == torch.int16  # (codes, secondary, outliers, outlier_ptr)
    assert kops[2].shape[0] > 0 and vops[2].shape[0] > 0
    no_rec = lambda ops: (*ops[:2], ops[2][:0], ops[3][:0])  # noqa: E731
    wrong = kvq.ops.decode_attention_hqmq(q, *no_rec(kops), *vops, None, 6, 6, 64 ** -0.5)
    err = ((wrong.float() - ref).norm() / ref.norm()).item()
    assert err > 2e-2, f"records made no difference ({err:.2e})"
    # the index is a CSR over (tile, row): monotone, covering every record
    for ops in (kops, vops):
        ptr = ops[3].cpu()
        assert ptr.shape[0] == (kst.seq_len + 31) // 32 * 2 + 1
        assert ptr[0] == 0 and ptr[-1] == ops[2].shape[0] and (ptr[1:] >= ptr[:-1]).all()
        rec = ops[2].cpu()
        key = (rec[:, 0].long() // 32) * 2 + (rec[:, 1].long() >> 8)
        pos = torch.arange(rec.shape[0])
        assert ((ptr[key] <= pos) & (pos < ptr[key + 1])).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_masks(device, preset):
    B, H, T, D = 3, 2, 290, 64
    cache = build(preset, B, H, T, D, torch.float16, device, steps=2)
    Tt = T + 2
    mask = torch.ones(B, Tt, dtype=torch.bool, device=device)
    mask[1, :37] = False    # left padding
    mask[2, :] = False      # a fully masked row -> zeros
    q = torch.randn(B, 4, D, dtype=torch.float16, device=device)
    out = fused(q, cache, mask)
    assert (out[2] == 0).all()
    mask[2, :200] = False
    mask[2, 200:] = True
    check(cache, q, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dtypes(device, preset, dtype):
    cache = build(preset, 1, 2, 150, 128, dtype, device, steps=3)
    q = torch.randn(1, 8, 128, dtype=dtype, device=device)
    # bf16: cache.dequantize() rounds every K/V entry to bf16 (2^-9), the op keeps fp32/fp16
    check(cache, q, tol=1.5e-2 if dtype == torch.bfloat16 else 4e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_roundtrip(device):
    cache = build("hqmq-5", 1, 2, 70, 64, torch.float16, device, steps=5)
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=device)
    a = fused(q, cache)
    other = kvq.KVCache("hqmq-5")
    other.load_state_dict(cache.state_dict())
    torch.testing.assert_close(fused(q, other), a, rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    cache = build("hqmq-5", 1, 2, 40, 64, torch.float16, device)
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=device)
    kops = cache.layers[0].key.attention_operands()
    vops = cache.layers[0].value.attention_operands()
    op = kvq.ops.decode_attention_hqmq
    s = 0.125
    with pytest.raises(RuntimeError, match="'q'.*head dim"):
        op(q[..., :48].contiguous(), *kops, *vops, None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'q'.*not a multiple"):
        op(q[:, :3], *kops, *vops, None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'k_radius_bits'"):
        op(q, *kops, *vops, None, 9, 6, s)
    with pytest.raises(RuntimeError, match="'v_codes'.*16-bit units per token"):
        op(q, *kops, *vops, None, 6, 4, s)  # wrong radius bits: U does not match
    with pytest.raises(RuntimeError, match="'k_codes'.*16-bit units per token"):
        op(q, kops[0][..., :-1].contiguous(), *kops[1:], *vops, None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'k_codes'"):
        op(q, kops[0].float(), *kops[1:], *vops, None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'k_codes'.*dtype"):
        op(q, kops[0].int(), *kops[1:], *vops, None, 6, 6, s)  # the old int32 word layout
    with pytest.raises(RuntimeError, match="'v_secondary'"):
        op(q, *kops, vops[0], vops[1][:1], *vops[2:], None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'k_outlier_ptr'"):
        op(q, *kops[:3], kops[3][:-1], *vops, None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'v_outliers'"):
        op(q, *kops, *vops[:2], vops[2][:, :3].contiguous(), vops[3], None, 6, 6, s)
    with pytest.raises(RuntimeError, match="'mask'"):
        op(q, *kops, *vops, torch.ones(1, 5, dtype=torch.bool, device=device), 6, 6, s)
    with pytest.raises(RuntimeError, match="'q'"):
        op(q.to(torch.int32), *kops, *vops, None, 6, 6, s)
    # corrupt index entries are clamped, never read out of bounds
    bad = kops[3].clone()
    bad[1:] = 10 ** 9
    out = op(q, *kops[:3], bad, *vops, None, 6, 6, s)
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS)
def test_opcheck(device, preset):
    cache = build(preset, 1, 2, 70, 64, torch.float16, device, steps=1)
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=device)
    rb = kvq.get_config(preset).radius_bits
    args = (q, *cache.layers[0].key.attention_operands(), *cache.layers[0].value.attention_operands(),
            None, rb, rb, 0.125)
    torch.library.opcheck(torch.ops.kvq.decode_attention_hqmq.default, args)


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("T", [4096, 5000])
def test_cuda_long_matches_cpu(preset, D, T):
    """Long caches (mma path, many splits, tail on the generic path) against the reference
    and against the CPU op on the same stored data."""
    cache = build(preset, 2, 4, T, D, torch.float16, "cuda", steps=3)
    q = torch.randn(2, 16, D, dtype=torch.float16, device="cuda")
    out, _ = check(cache, q)
    kops = [t.cpu() for t in cache.layers[0].key.attention_operands()]
    vops = [t.cpu() for t in cache.layers[0].value.attention_operands()]
    rb = kvq.get_config(preset).radius_bits
    ref = kvq.ops.decode_attention_hqmq(q.cpu(), *kops, *vops, None, rb, rb, D ** -0.5)
    err = ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item()
    assert err < 4e-3, f"CUDA vs CPU relative error {err:.2e}"


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_long_masked_bf16(preset):
    B, H, T, D = 2, 2, 2048, 128
    cache = build(preset, B, H, T, D, torch.bfloat16, "cuda", steps=5)
    mask = torch.ones(B, T + 5, dtype=torch.bool, device="cuda")
    mask[1, :700] = False
    q = torch.randn(B, 8, D, dtype=torch.bfloat16, device="cuda")
    check(cache, q, mask, tol=1.5e-2)


def _cpu_op(q, kops, vops, rb, mask=None):
    kops = [t.cpu() for t in kops]
    vops = [t.cpu() for t in vops]
    m = None if mask is None else mask.cpu()
    return kvq.ops.decode_attention_hqmq(q.cpu(), *kops, *vops, m, rb, rb, q.shape[-1] ** -0.5)


@requires_cuda
@pytest.mark.parametrize("preset", PRESETS)
def test_cuda_generic_paths_match_cpu(preset):
    """The CUDA-core path: > 8 query heads per KV head in one raw call, and rows whose head
    stride is not 16-byte aligned (the tensor-core path's cp.async needs it)."""
    B, H, T, D = 2, 2, 300, 128
    cache = build(preset, B, H, T, D, torch.float16, "cuda", steps=2)
    rb = kvq.get_config(preset).radius_bits
    kops = list(cache.layers[0].key.attention_operands())
    vops = list(cache.layers[0].value.attention_operands())
    q = torch.randn(B, 12 * H, D, dtype=torch.float16, device="cuda")
    out = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, rb, rb, D ** -0.5)
    ref = _cpu_op(q, kops, vops, rb)
    assert ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item() < 4e-3
    # misaligned head stride: codes in a [B, H, T + 1, U] buffer
    for ops in (kops, vops):
        c = ops[0]
        buf = torch.zeros(B, H, c.shape[2] + 1, c.shape[3], dtype=c.dtype, device="cuda")
        buf[:, :, :c.shape[2]] = c
        ops[0] = buf[:, :, :c.shape[2]]
    q = torch.randn(B, 4 * H, D, dtype=torch.float16, device="cuda")
    out = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, rb, rb, D ** -0.5)
    ref = _cpu_op(q, kops, vops, rb)
    assert ((out.cpu().float() - ref.float()).norm() / ref.float().norm()).item() < 4e-3


# ---- the v2 layout of the F = 16 (hqmq-3.79) tensor-core path at D = 64 / 128 (hqmq_warp_mma16) ----

F16_MED3 = kvq.HQMQConfig(secondary_size=96, radius_bits=4, outlier_factor=3.0)  # F = 16 with records


@requires_cuda
@pytest.mark.parametrize("preset", ["hqmq-3.79-paper", "f16-med3"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("g", [1, 3, 8])
def test_cuda_hqmq_v2_matches_cpu(preset, D, g):
    """The v2 path against the CPU op on the same stored data, with key and value records
    (f16-med3) and a mask that removes whole tiles and parts of tiles."""
    cfg = F16_MED3 if preset == "f16-med3" else preset
    B, H, T = 2, 2, 2053
    cache = kvq.KVCache(cfg)
    cache.update(make_data(B, H, T, D, torch.float16, "cuda"), make_data(B, H, T, D, torch.float16, "cuda"), 0)
    kops = list(cache.layers[0].key.attention_operands())
    vops = list(cache.layers[0].value.attention_operands())
    if preset == "f16-med3":
        assert kops[2].shape[0] > 0 and vops[2].shape[0] > 0
    q = torch.randn(B, H * g, D, dtype=torch.float16, device="cuda")
    q[..., 8:12] *= 4.0  # weight the chunk that carries most records
    mask = torch.ones(B, T, dtype=torch.bool, device="cuda")
    mask[1, :700] = False
    mask[0, 100:117] = False
    for m in (None, mask):
        out2 = kvq.ops.decode_attention_hqmq(q, *kops, *vops, m, 4, 4, D ** -0.5)
        ref = _cpu_op(q, kops, vops, 4, m).float()
        rel = lambda a, r: ((a.cpu().float() - r).norm() / r.norm()).item()  # noqa: E731
        assert torch.isfinite(out2).all()
        assert rel(out2, ref) < 4e-3, f"v2 vs CPU {rel(out2, ref):.2e}"


@requires_cuda
@pytest.mark.parametrize("D", [64, 128])
def test_cuda_hqmq_v2_dtypes_and_small_scales(D):
    """bf16 / fp32 queries; values of very different magnitudes per token (tiny radius scales:
    the v2 value path multiplies rcode / 16 by the fp16 scale) and large ones (no overflow)."""
    B, H, T = 1, 2, 1024
    k = make_data(B, H, T, D, torch.float32, "cuda", spikes=False)
    v = make_data(B, H, T, D, torch.float32, "cuda", spikes=False)
    v[:, :, ::3] *= 1e-3
    v[:, :, 1::7] *= 3e3
    k[:, :, ::5] *= 1e-3
    for dtype in (torch.bfloat16, torch.float32, torch.float16):
        cache = kvq.KVCache("hqmq-3.79-paper")
        cache.update(k.to(dtype), v.to(dtype), 0)
        kops = list(cache.layers[0].key.attention_operands())
        vops = list(cache.layers[0].value.attention_operands())
        q = torch.randn(B, 4 * H, D, dtype=dtype, device="cuda")
        out = kvq.ops.decode_attention_hqmq(q, *kops, *vops, None, 4, 4, D ** -0.5)
        ref = _cpu_op(q, kops, vops, 4).float()
        err = ((out.cpu().float() - ref).norm() / ref.norm()).item()
        assert torch.isfinite(out).all() and err < 4e-3, f"{dtype}: {err:.2e}"


@requires_cuda
def test_cuda_hqmq_v2_graph_replay():
    """The v2 kernel under CUDA-graph capture (same bits on replay as eagerly)."""
    cache = build("hqmq-3.79-paper", 2, 2, 1500, 128, torch.float16, "cuda", steps=3)
    q = torch.randn(2, 16, 128, dtype=torch.float16, device="cuda")
    eager = fused(q, cache)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fused(q, cache)  # warm-up outside the capture
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            out = fused(q, cache)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
