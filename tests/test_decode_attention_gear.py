"""kvq.decode_attention over GEAR layers: the fused op (low rank + outliers applied inside the
kernel) against fp32 softmax attention over cache.dequantize()."""
import warnings

import pytest
import torch

import kvquant_ext as kvq
from conftest import CUDA, DTYPES, MMA_HEAD_DIMS, requires_cuda
from test_decode_attention import check
from test_group_quant import make_kv

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
FUSED = ["gear-2", "gearl-2", "outlier-2"]
NB = kvq.get_config("gear-2").buffer_length  # decode-block tokens of the 2-bit presets (all equal)


def spiky_kv(B, H, T, D, dtype, device, seed):
    """Cache-like data with structured residuals and large entries, so that outliers, low
    rank and backbone all matter."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(B, H, T, D, generator=g)
    x += torch.randn(B, H, T, 2, generator=g) @ torch.randn(B, H, 2, D, generator=g)  # low rank
    x[..., 3] *= 6.0  # an outlier channel (keys)
    spikes = torch.rand(B, H, T, D, generator=g) < 0.01
    x = torch.where(spikes, x * 12.0, x)
    return x.to(dtype=dtype, device=device)


def gear_cache(preset, B, H, T, D, dtype, device, steps=0, seed=0):
    cache = kvq.KVCache(preset)
    cache.update(spiky_kv(B, H, T, D, dtype, device, seed), spiky_kv(B, H, T, D, dtype, device, seed + 1), 0)
    for s in range(steps):
        cache.update(spiky_kv(B, H, 1, D, dtype, device, seed + 2 + 2 * s),
                     spiky_kv(B, H, 1, D, dtype, device, seed + 3 + 2 * s), 0)
    return cache


def fused(cache, q, mask=None):
    """Run kvq.decode_attention and assert it took the fused GEAR op (no fallback warning)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        return check(cache, q, mask)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", FUSED)
@pytest.mark.parametrize("T,steps", [(1, 0), (70, 0), (150, 90), (256, 130)])
def test_presets_lengths_streaming(device, preset, T, steps):
    """Buffer only; prefill block + buffer; prefill + decode blocks + buffer."""
    cache = gear_cache(preset, 2, 2, T, 64, torch.float16, device, steps)
    fused(cache, torch.randn(2, 8, 64, dtype=torch.float16, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("ratio", [1, 4, 7, 12])
def test_head_dims_gqa(device, D, ratio):
    H = 2
    cache = gear_cache("gear-2", 1, H, 320 if device == "cuda" else 192, D, torch.float16, device, steps=NB + 2)
    fused(cache, torch.randn(1, H * ratio, D, dtype=torch.float16, device=device))


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_and_mask(device):
    B, H, T, D = 3, 2, 256, 128
    cache = gear_cache("gear-2", B, H, T, D, torch.bfloat16, device, steps=NB + 6)
    Tt = T + NB + 6
    mask = torch.ones(B, Tt, dtype=torch.bool, device=device)
    mask[1, :37] = False
    mask[2, :200] = False
    q = torch.randn(B, 8, D, dtype=torch.bfloat16, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        check(cache, q, mask, tol=1.5e-2)
    mask[0] = False  # a fully masked row gives zeros
    out = kvq.decode_attention(q, cache, 0, attn_mask=mask)
    assert torch.all(out[0] == 0) and torch.isfinite(out).all()


@pytest.mark.parametrize("device", DEVICES)
def test_outliers_and_low_rank_matter(device):
    """The op must use the outliers and the factors: dropping either changes the output by
    far more than the tolerance (so the equality tests above can fail)."""
    B, H, T, D = 1, 2, 256, 64
    cache = gear_cache("gear-2", B, H, T, D, torch.float16, device, steps=NB)
    q = torch.randn(B, 4, D, dtype=torch.float16, device=device) * 2
    out = fused(cache, q).float()
    kst, vst = cache.layers[0].key, cache.layers[0].value
    kc, ks, kz, kr, kg = kst.attention_operands()
    vc, vs, vz, vr, vg = vst.attention_operands()
    scale = D ** -0.5

    def run(kg_, vg_):
        return kvq.ops.decode_attention_gear(q, kc, ks, kz, kr, vc, vs, vz, vr, None, 2, kg_, vg_,
                                          kst.T0, NB, scale).float()

    torch.testing.assert_close(run(kg, vg), out, rtol=0, atol=0)
    e = torch.empty(0, device=device)
    for drop in ([0, 1, 6, 7], [2, 3, 4, 5, 8, 9, 10, 11]):  # low rank, outliers
        kg2 = [e if j in drop else t for j, t in enumerate(kg)]
        vg2 = [e if j in drop else t for j, t in enumerate(vg)]
        diff = (run(kg2, vg2) - out).norm() / out.norm()
        assert diff > 1e-2, (drop, diff)


def _entries(stream, blk_idx, blk):
    """Flat (t, c, v, d) of block ``blk_idx`` of a stream in its stored layout (keys: sorted by
    token, tile offsets; values: per token), t within the block."""
    kt = stream.T0 and blk_idx == 0
    j = blk_idx - (1 if stream.T0 else 0)
    T = blk.shape[2]
    if stream.spec.per_channel:  # keys: [B, H, 1, M]
        if kt:
            ov, oi, off, od = stream.ov0[:, :, 0], stream.oi0[:, :, 0], stream.off0[:, :, 0], stream.od0[:, :, 0]
        else:
            ov, oi, off, od = (x.view()[:, :, j] for x in (stream.ov1, stream.oi1, stream.off1, stream.od1))
        M = ov.shape[-1]
        e = torch.arange(M, device=ov.device).expand(*ov.shape[:2], M).contiguous()
        tile = torch.searchsorted(off[..., 1:].contiguous().long(), e, right=True)
        pk = oi.long() & 0xFFFF
        return tile * 32 + (pk >> 8), pk & 255, ov, od
    nb = stream.config.buffer_length
    if kt:
        ov, oi, od = stream.ov0, stream.oi0, stream.od0
    else:
        ov, oi, od = (x.view()[:, :, j * nb:(j + 1) * nb] for x in (stream.ov1, stream.oi1, stream.od1))
    B, H, _, n = ov.shape
    t = torch.arange(T, device=ov.device).view(1, 1, T, 1).expand(B, H, T, n)
    return t.reshape(B, H, -1), oi.long().reshape(B, H, -1), ov.reshape(B, H, -1), od.reshape(B, H, -1)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", FUSED)
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_corrections(device, preset, dtype):
    """Every outlier entry of every block (prefill and each streamed decode block, with its own
    factors) carries d = v - xhat in the cache dtype, xhat recomputed here independently by
    kvq.gear_decompress without outliers in fp32 (the value before the outlier overwrite)."""
    B, H, D = 2, 2, 64
    cache = gear_cache(preset, B, H, 150, D, dtype, device, steps=2 * NB + 12)
    eps = torch.finfo(dtype).eps
    for role in ("key", "value"):
        st = getattr(cache.layers[0], role)
        blocks = st.blocks
        assert st.T0 and len(blocks) >= 3  # prefill + at least 2 decode blocks
        for bi, blk in enumerate(blocks):
            f = blk.fields
            ov, oi = f["outlier_values"], f["outlier_indices"]
            xhat = kvq.ops.gear_decompress(f["codes"], f["scale"], f["zero"], ov[..., :0].float(),
                                        oi[..., :0].contiguous(), f["A"], f["B"], st.spec.bits,
                                        st.spec.per_channel, torch.float32)
            t, c, v, d = _entries(st, bi, blk)
            assert d.dtype == dtype and d.shape == v.shape
            if preset == "gearl-2":
                assert d.numel() == 0
                continue
            assert d.numel() > 0
            xe = xhat.reshape(B, H, -1).gather(2, t * D + c)
            exp = v.float() - xe
            # rounding of d to the cache dtype (plus fp32 order effects far below it)
            torch.testing.assert_close(d.float(), exp, rtol=eps, atol=1e-6)
            # xhat + d gives the exact value back up to d's rounding
            assert ((xe + d.float()) - v.float()).abs().max() <= eps * exp.abs().max() + 1e-6
            # and the exact values are those decompress() restores
            full = blk.decompress().reshape(B, H, -1).gather(2, t * D + c)
            assert torch.equal(full, v)


def test_corrections_rebuilt_from_old_state():
    """A state dict saved before the corrections were stored gets them recomputed on load."""
    cache = gear_cache("gear-2", 1, 2, 150, 64, torch.float16, "cpu", steps=2 * NB + 12)
    sd = cache.state_dict()
    old = {k: v for k, v in sd.items() if not (k.endswith("od0") or k.endswith("od1"))}
    assert len(old) < len(sd)
    other = kvq.KVCache("gear-2")
    other.load_state_dict(old)
    for role in ("key", "value"):
        a, b = getattr(cache.layers[0], role), getattr(other.layers[0], role)
        assert torch.equal(a.od0, b.od0) and torch.equal(a.od1.view(), b.od1.view())
    assert other.nbytes == cache.nbytes
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    torch.testing.assert_close(kvq.decode_attention(q, other, 0), kvq.decode_attention(q, cache, 0), rtol=0, atol=0)


def test_kcvt_backbone_falls_back(monkeypatch):
    import kvquant_ext.attention as ka
    monkeypatch.setattr(ka, "_warned", set())  # the warning is once per process and config type
    cache = gear_cache("gear-4", 1, 2, 100, 64, torch.float16, "cpu", steps=25)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    with pytest.warns(RuntimeWarning, match="no fused kernel"):
        check(cache, q)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input(device):
    cache = gear_cache("gear-2", 1, 2, 128, 64, torch.float16, device, steps=NB)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    kc, ks, kz, kr, kg = kst.attention_operands()
    vc, vs, vz, vr, vg = vst.attention_operands()
    q = torch.randn(1, 4, 64, dtype=torch.float16, device=device)

    def call(kg_=kg, vg_=vg, t0=kst.T0, nb=NB):
        return kvq.ops.decode_attention_gear(q, kc, ks, kz, kr, vc, vs, vz, vr, None, 2, kg_, vg_, t0, nb, 0.1)

    with pytest.raises(RuntimeError, match="k_gear"):
        call(kg_=kg[:11])
    with pytest.raises(RuntimeError, match="12 tensors"):
        call(kg_=kg[:5] + kg[6:11])  # the 10-tensor list of before the corrections
    e = torch.empty(0, device=device)
    for j, name in ((5, "k_gear od0"), (11, "k_gear od1")):  # outliers without their corrections
        bad = list(kg)
        bad[j] = e
        with pytest.raises(RuntimeError, match=name):
            call(kg_=bad)
    bad = list(vg)
    bad[11] = bad[11].float()
    with pytest.raises(RuntimeError, match="v_gear od1"):
        call(vg_=bad)
    with pytest.raises(RuntimeError, match="prefill_tokens"):
        call(t0=100)
    with pytest.raises(RuntimeError, match="block_tokens"):
        call(nb=0)
    bad = list(vg)
    bad[0] = bad[0].float()
    with pytest.raises(RuntimeError, match="v_gear A0"):
        call(vg_=bad)
    bad = list(kg)
    bad[3] = bad[3].to(torch.int64)
    with pytest.raises(RuntimeError, match="k_gear oi0"):
        call(kg_=bad)
    if device == "cpu":
        saved = kg[10].clone()
        kg[10].fill_(5)  # tile offsets that do not start at 0 (same strides)
        with pytest.raises(RuntimeError, match="k_gear off1"):
            call()
        kg[10].copy_(saved)
        saved = vg[9].clone()
        vg[9].fill_(200)  # value outlier channels beyond D
        with pytest.raises(RuntimeError, match="outside"):
            call()
        vg[9].copy_(saved)
        saved = kg[3].clone()
        kg[3].bitwise_or_(40 << 8)  # key outlier tokens beyond their 32-token tile
        with pytest.raises(RuntimeError, match="tokens outside"):
            call()
        kg[3].copy_(saved)
    # more value outliers per token than the kernel's 8-bit count (and than D)
    bad = list(vg)
    T1 = vg[8].shape[2]
    bad[8] = torch.zeros(1, 2, T1, 256, dtype=vg[8].dtype, device=device)
    bad[9] = torch.zeros(1, 2, T1, 256, dtype=vg[9].dtype, device=device)
    bad[11] = torch.zeros(1, 2, T1, 256, dtype=vg[11].dtype, device=device)
    with pytest.raises(RuntimeError, match="2k <= min"):
        call(vg_=bad)


@requires_cuda
@pytest.mark.parametrize("preset", FUSED)
@pytest.mark.parametrize("D,dtype", [(128, torch.float16), (64, torch.bfloat16), (256, torch.float16)])
def test_cuda_long_matches_cpu(preset, D, dtype):
    """Many tiles per warp through the prefill block (cursor walk over long outlier lists),
    several decode blocks, and the split combine."""
    B, H, T = 2, 2, 4096
    cache = gear_cache(preset, B, H, T, D, dtype, "cuda", steps=3 * NB + 8, seed=7)
    q = torch.randn(B, 8, D, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    out = fused(cache, q) if dtype == torch.float16 else kvq.decode_attention(q, cache, 0)
    cpu = kvq.KVCache(preset)
    cpu.load_state_dict(_to_cpu(cache.state_dict()))
    ref = kvq.decode_attention(q.cpu(), cpu, 0)
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < (1.5e-2 if dtype == torch.bfloat16 else 4e-3), err


@requires_cuda
@pytest.mark.parametrize("preset", ["gear-2", "outlier-2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_reads_stored_corrections(preset, dtype):
    """The CUDA kernel applies the stored corrections od (and never reads the exact values ov):
    garbage in ov changes nothing; scaled corrections give what the CPU op gives with the same
    operands, and differ from the unscaled result."""
    B, H, T, D = 2, 2, 1024, 128
    cache = gear_cache(preset, B, H, T, D, dtype, "cuda", steps=NB + 36, seed=3)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    kc, ks, kz, kr, kg = kst.attention_operands()
    vc, vs, vz, vr, vg = vst.attention_operands()
    q = torch.randn(B, 8, D, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    scale = D ** -0.5

    def run(kg_, vg_, dev="cuda"):
        mv = lambda L: [t.to(dev) for t in L]  # noqa: E731
        args = mv([q, kc, ks, kz, kr, vc, vs, vz, vr])
        return kvq.ops.decode_attention_gear(*args[:9], None, 2, mv(kg_), mv(vg_), kst.T0,
                                          kst.config.buffer_length, scale).float().cpu()

    out = run(kg, vg)
    saved = [t.clone() for t in (kg[2], kg[8], vg[2], vg[8])]
    for t in (kg[2], kg[8], vg[2], vg[8]):
        t.fill_(1000.0)  # in place: same strides as the indices
    torch.testing.assert_close(run(kg, vg), out, rtol=0, atol=0)
    for t, sv in zip((kg[2], kg[8], vg[2], vg[8]), saved):
        t.copy_(sv)
    kg2, vg2 = list(kg), list(vg)
    for L in (kg2, vg2):
        for j in (5, 11):
            L[j] = L[j] * 3  # contiguous copies: own strides
    got, ref = run(kg2, vg2), run(kg2, vg2, "cpu")
    err = (got - ref).norm() / ref.norm()
    assert err < (1.5e-2 if dtype == torch.bfloat16 else 4e-3), err
    assert (got - out).norm() / out.norm() > 1e-2


@requires_cuda
@pytest.mark.parametrize("cfg,D,dtype,tol", [
    # 2k = 8 value entries per token (staged, 4 per lane pair member); ~205 key entries per
    # 32-token tile: rounds beyond the 4 preloaded ones
    (kvq.GEARConfig(bits=2, group_size=64, sparsity=0.05, rank=4, rank_decode=2, buffer_length=64), 128,
     torch.float16, 4e-3),
    # 2k = 14 value entries per token: read from global memory (not staged); ~410 key entries per
    # tile; decode blocks of 3 tiles (a warp meets them at varying positions)
    (kvq.GEARConfig(bits=2, group_size=32, sparsity=0.1, rank=3, rank_decode=1, buffer_length=96), 128,
     torch.bfloat16, 1.5e-2),
    # 2k = 6 (3 per lane), fp32 cache (corrections converted per entry), key groups of one tile
    (kvq.GEARConfig(bits=2, group_size=32, sparsity=0.02, rank=2, rank_decode=2, buffer_length=32), 256,
     torch.float32, 4e-3),
    # 2k = 2 (1 per lane), 4-bit backbone, no low rank
    (kvq.GEARConfig(bits=4, group_size=64, sparsity=0.02, rank=0, rank_decode=0, buffer_length=64), 64,
     torch.float16, 4e-3),
])
def test_cuda_outlier_layouts_match_cpu(cfg, D, dtype, tol):
    """The kernel's outlier paths (value entries per token 2..14, staged or from global memory;
    key tiles with more entries than the preloaded rounds; fp32 corrections; prefill and decode
    blocks) equal the CPU op on the same stored data."""
    B, H, T = 2, 2, 2048
    cache = gear_cache(cfg, B, H, T, D, dtype, "cuda", steps=3 * cfg.buffer_length + 5, seed=11)
    q = torch.randn(B, 8, D, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = check(cache, q, tol=tol)
    cpu = kvq.KVCache(cfg)
    cpu.load_state_dict(_to_cpu(cache.state_dict()))
    ref = kvq.decode_attention(q.cpu(), cpu, 0)
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < tol, err


@requires_cuda
@pytest.mark.parametrize("preset", ["gear-2", "outlier-2"])
def test_cuda_wide_value_indices(preset):
    """int16 value indices (accepted by the op) take the kernel's unstaged value-outlier path
    and give exactly the result of the uint8 indices (staged path)."""
    B, H, T, D = 2, 2, 1024, 128
    cache = gear_cache(preset, B, H, T, D, torch.float16, "cuda", steps=NB + 36, seed=5)
    kst, vst = cache.layers[0].key, cache.layers[0].value
    kc, ks, kz, kr, kg = kst.attention_operands()
    vc, vs, vz, vr, vg = vst.attention_operands()
    q = torch.randn(B, 8, D, dtype=torch.float16, device="cuda")

    def run(vg_):
        return kvq.ops.decode_attention_gear(q, kc, ks, kz, kr, vc, vs, vz, vr, None, 2, kg, vg_, kst.T0,
                                          kst.config.buffer_length, D ** -0.5)

    out = run(vg)
    wide = list(vg)
    for j in (3, 9):  # oi0, oi1: int16 copies with the strides of ov
        if wide[j].numel():
            assert wide[j].dtype == torch.uint8
            w = torch.empty_strided(wide[j].shape, wide[j].stride(), dtype=torch.int16, device="cuda")
            wide[j] = w.copy_(wide[j])
    torch.testing.assert_close(run(wide), out, rtol=0, atol=0)


def stream_cache(cfg, B, H, P, nblk, extra, D, dtype, device, seed=0):
    """The cache a long generation leaves: a P-token prefill (one update), nblk decode blocks
    of buffer_length tokens appended by one update (each block compressed on its own, as
    token-by-token appends would), then ``extra`` single-token steps (full-precision buffer)."""
    cache = kvq.KVCache(cfg)
    nb = cache.config.buffer_length
    T = P + nblk * nb
    k = spiky_kv(B, H, T, D, dtype, device, seed)
    v = spiky_kv(B, H, T, D, dtype, device, seed + 1)
    cache.update(k[:, :, :P], v[:, :, :P], 0)
    cache.update(k[:, :, P:], v[:, :, P:], 0)
    for s in range(extra):
        cache.update(spiky_kv(B, H, 1, D, dtype, device, seed + 2 + 2 * s),
                     spiky_kv(B, H, 1, D, dtype, device, seed + 3 + 2 * s), 0)
    return cache


# decode-heavy caches: (config, D, dtype, prefill P, decode blocks, single-token steps, tol)
_DECODE_HEAVY = [
    # r 4 / 2 with 60 decode blocks of 2 tiles (the paper's n_b = 64): every tile of a warp
    # starts a new block (q . B_k and the B_v flush per tile); odd buffer length.  The shipped
    # 2-bit presets: blocks of 4 tiles
    ("gear-2-paper", 128, torch.float16, 1024, 60, 37, 4e-3),
    ("gear-2", 128, torch.float16, 1024, 30, 37, 4e-3),
    ("gearl-2", 128, torch.float16, 1024, 60, 37, 4e-3),
    ("outlier-2", 128, torch.float16, 1024, 60, 37, 4e-3),
    ("gear-2", 64, torch.bfloat16, 512, 40, 5, 1.5e-2),
    ("gear-2", 256, torch.float16, 512, 40, 63, 4e-3),
    # no prefill block (the first update is shorter than a group): decode blocks only, T0 = 0
    ("gear-2", 128, torch.float16, 20, 50, 1, 4e-3),
    # odd decode rank, blocks of 3 tiles starting at an odd tile (prefill of 13 tiles)
    (kvq.GEARConfig(bits=2, group_size=32, sparsity=0.02, rank=4, rank_decode=3, buffer_length=96), 128,
     torch.float16, 416, 30, 17, 4e-3),
    # rank 8 in both block kinds (all 8 rows of the q . B_k tile), blocks of one tile, fp32 cache
    (kvq.GEARConfig(bits=2, group_size=32, sparsity=0.02, rank=8, rank_decode=8, buffer_length=32), 128,
     torch.float32, 256, 70, 3, 4e-3),
    # rank 1 decode blocks, 4-bit backbone
    (kvq.GEARConfig(bits=4, group_size=64, sparsity=0.02, rank=4, rank_decode=1, buffer_length=64), 128,
     torch.float16, 1024, 40, 9, 4e-3),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cfg,P,T0,buf", [
    ("gear-2", 128, 128, 7),
    (kvq.GEARConfig(bits=2, group_size=32, sparsity=0.02, rank=4, rank_decode=3, buffer_length=96), 96, 96, 7),
    ("gear-2", 20, 0, 27),  # a first update shorter than a group: no prefill block
])
def test_decode_heavy_stream(device, cfg, P, T0, buf):
    """A prefill block followed by many decode blocks (each with its own outliers and factors)
    and an odd buffer: the fused op against attention over cache.dequantize(); batch rows
    independent."""
    B, H, D = 3, 2, 64
    cache = stream_cache(cfg, B, H, P, 12, 7, D, torch.float16, device, seed=21)
    kst = cache.layers[0].key
    assert (kst.T0, kst.num_decode_blocks, kst.buffer.shape[2]) == (T0, 12, buf)
    q = torch.randn(B, 8, D, dtype=torch.float16, device=device)
    out = fused(cache, q)
    check_row_independent(cache, q, out, 4e-3)


def check_row_independent(cache, q, out, tol):
    """Batch row 1 of ``cache`` alone (a B = 1 cache from its state) gives row 1 of ``out``."""
    one = kvq.KVCache(cache.config)
    one.load_state_dict(_to_dev(_slice_batch(cache.state_dict(), 1), q.device))
    got = kvq.decode_attention(q[1:2], one, 0)
    torch.testing.assert_close(got.float(), out[1:2].float(), rtol=tol, atol=tol)


@requires_cuda
@pytest.mark.parametrize("cfg,D,dtype,P,nblk,extra,tol", _DECODE_HEAVY)
def test_cuda_decode_heavy_matches_cpu(cfg, D, dtype, P, nblk, extra, tol):
    """Caches built by streaming (prefill + many decode blocks + buffer), B = 3: the kernel's
    per-block work (q . B_k through the dense tile, the B_v flush, prefetched B rows; blocks
    that start at every tile of a warp) equals the CPU op on the same stored data, and
    attention over the dequantized cache."""
    B, H = 3, 2
    cache = stream_cache(cfg, B, H, P, nblk, extra, D, dtype, "cuda", seed=13)
    kst = cache.layers[0].key
    assert kst.num_decode_blocks >= nblk - 1
    q = torch.randn(B, 8, D, generator=torch.Generator().manual_seed(3)).to("cuda", dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        out = check(cache, q, tol=tol)
    cpu = kvq.KVCache(cache.config)
    cpu.load_state_dict(_to_cpu(cache.state_dict()))
    ref = kvq.decode_attention(q.cpu(), cpu, 0)
    err = (out.cpu().float() - ref.float()).norm() / ref.float().norm()
    assert err < tol, err
    check_row_independent(cache, q, out, tol)


def _slice_batch(x, b):
    if isinstance(x, dict):
        return {k: _slice_batch(v, b) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_slice_batch(v, b) for v in x)
    return x[b:b + 1].clone() if isinstance(x, torch.Tensor) and x.dim() >= 3 else x  # [B, H, ...] tensors


def _to_dev(x, dev):
    if isinstance(x, dict):
        return {k: _to_dev(v, dev) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_dev(v, dev) for v in x)
    return x.to(dev) if isinstance(x, torch.Tensor) else x


def _to_cpu(x):
    if isinstance(x, dict):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x.cpu() if isinstance(x, torch.Tensor) else x


@requires_cuda
def test_cuda_graph_capture():
    cache = gear_cache("gear-2", 2, 2, 1024, 128, torch.float16, "cuda", steps=NB)
    q = torch.randn(2, 8, 128, dtype=torch.float16, device="cuda")
    eager = kvq.decode_attention(q, cache, 0)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kvq.decode_attention(q, cache, 0)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kvq.decode_attention(q, cache, 0)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)


def test_cuda_eligibility_checks_alignment():
    """On CUDA the fused GEAR path needs 16-byte aligned rows; a misaligned layer must take the
    dequantize path (checked here on CPU tensors through kvq.uses_fused_kernel)."""
    cache = gear_cache("gear-2", 1, 2, 128, 64, torch.float16, "cpu", steps=NB)
    kst, vst = cache.layers[0].key, cache.layers[0].value

    class FakeCuda:  # what kvq.uses_fused_kernel reads of q: its device and shape
        device = torch.device("cuda")
        shape = (1, 4, 64)

    assert kvq.uses_fused_kernel(cache, 0, FakeCuda())
    # an A0 whose head stride is not a multiple of 16 bytes
    A0 = kst.A0
    bad = torch.empty(A0.shape[0], A0.shape[1], A0.shape[2] + 1, A0.shape[3], dtype=A0.dtype)[:, :, 1:]
    bad.copy_(A0)
    kst.A0 = bad
    assert not kvq.uses_fused_kernel(cache, 0, FakeCuda())
    kst.A0 = A0
