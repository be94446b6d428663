"""HQMQ (kvq.hqmq_encode / kvq.hqmq_decode, HQMQConfig, HQMQStream) against the
plain-PyTorch reference in tests/reference/hqmq_reference.py."""
import math

import pytest
import torch

import kvquant_ext as kvq
from conftest import DTYPES, HEAD_DIMS, MMA_HEAD_DIMS
from kvquant_ext import hqmq_secondary, hqmq_seed, med3_threshold
from reference import hqmq_reference as ref

CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

TOKENS = [0, 1, 17]
CONFIGS = [(96, 4), (192, 6)]  # (S, radius_bits) of the two presets


def make_x(B=2, H=3, T=17, D=128, dtype=torch.float16, device="cpu", outliers=False):
    x = torch.randn(B, H, T, D) * torch.linspace(0.5, 2.0, D)
    if outliers:
        # a few chunks 20x larger (Qwen-style outlier channels), not on every token
        x[:, :, ::3, 8:12] *= 20.0
        x[:, 1, 5:7, 40:44] *= 30.0
    return x.to(dtype=dtype, device=device)


def secondary(H, S, seed=0, device="cpu"):
    return hqmq_secondary(H, S, seed, device=device)


def encode(x, sec, rb, thr=None, **kw):
    return kvq.hqmq_encode(x, sec, rb, thr, **kw)


# ----------------------------------------------------------------------------- codebook
def test_secondary_is_deterministic_unit_and_distinct():
    a = hqmq_secondary(4, 96, 7, layer_idx=3, role="key")
    b = hqmq_secondary(4, 96, 7, layer_idx=3, role="key")
    assert a.shape == (4, 96, 4) and a.dtype == torch.float32
    assert torch.equal(a, b)
    assert torch.allclose(a.norm(dim=-1), torch.ones(4, 96), atol=1e-6)
    assert not torch.equal(a[0], a[1])  # per head
    assert not torch.equal(a, hqmq_secondary(4, 96, 7, layer_idx=4, role="key"))  # per layer
    assert not torch.equal(a, hqmq_secondary(4, 96, 7, layer_idx=3, role="value"))  # per role
    assert not torch.equal(a, hqmq_secondary(4, 96, 8, layer_idx=3, role="key"))  # per seed
    assert hqmq_seed(7, 3, "key") == hqmq_seed(7, 3, "key")


def test_hurwitz_units_are_the_binary_tetrahedral_group():
    P = ref.hurwitz_units()
    assert torch.allclose(P.norm(dim=-1), torch.ones(24, dtype=P.dtype))
    prods = ref.hamilton(P[:, None], P[None, :]).reshape(-1, 4)
    # closed under multiplication: every product is one of the 24 units
    d = (prods[:, None, :] - P[None, :, :]).abs().sum(-1).min(dim=1).values
    assert d.max() < 1e-12
    g = P @ P.T - torch.eye(24, dtype=P.dtype)
    assert g.max() <= 0.5 + 1e-12  # pairwise >= 60 degrees apart


def test_reference_closed_form_equals_brute_force():
    v = torch.randn(20000, 4, dtype=torch.float64)
    score, idx = ref.closed_form_nearest_unit(v)
    bf = v @ ref.hurwitz_units().T
    assert torch.allclose(score, bf.max(dim=-1).values, atol=1e-12)
    assert torch.allclose(bf.gather(1, idx[:, None])[:, 0], score, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_closed_form_nearest_unit_equals_brute_force(dtype):
    # S = 1 with the identity secondary quaternion: the codebook is the 24 units themselves,
    # so the kernel's direction index is its closed-form nearest Hurwitz unit.
    x = make_x(2, 2, 33, 128, dtype)
    ident = torch.tensor([1.0, 0, 0, 0]).repeat(2, 1, 1)
    codes, scale, _ = encode(x, ident, 4)
    dirs, _ = ref.unpack(codes, 128, 1, 4)
    assert dirs.max() < 24
    xc = x.double().reshape(2, 2, 33, 32, 4)
    P = ref.hurwitz_units()
    chosen = (xc * P[dirs]).sum(-1)
    best = (xc @ P.T).max(dim=-1).values
    assert (chosen >= best - 1e-9 * best.abs().clamp_min(1)).all()
    # and the index itself matches the reference closed form wherever there is no tie
    s, i = ref.closed_form_nearest_unit(xc)
    top2 = (xc @ P.T).topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 1e-6
    assert torch.equal(dirs[clear], i[clear])


@pytest.mark.parametrize("S,rb", CONFIGS + [(7, 3)])
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
def test_chosen_codeword_is_best_of_all(S, rb, D):
    H = 2
    x = make_x(2, H, 9, D, torch.float32)
    sec = secondary(H, S, seed=S)
    codes, scale, out = encode(x, sec, rb)
    assert codes.shape == (2, H, 9, ref.words(D, S, rb))
    assert out.shape == (0, 4)
    dirs, rc = ref.unpack(codes, D, S, rb)
    assert dirs.max() < 24 * S and rc.max() < 2 ** rb
    chosen = ref.chosen_score(x, sec, dirs)
    best, _ = ref.brute_force_best(x, sec)
    norms = ref.chunk_norms(x)
    # chosen inner product equals the max over all 24 S codewords (fp32 search, eps rel.)
    assert ((best - chosen) <= 2e-6 * norms + 1e-12).all(), (best - chosen).max()
    # and the search is not trivially always-the-same codeword
    assert dirs.unique().numel() > 24


@pytest.mark.parametrize("S,rb", CONFIGS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_radius_codes_and_scale_match_reference(S, rb, dtype):
    x = make_x(2, 2, 17, 128, dtype)
    sec = secondary(2, S)
    codes, scale, _ = encode(x, sec, rb)
    dirs, rc, sc_ref, _ = ref.encode_reference(x, sec, rb)
    _, rcode = ref.unpack(codes, 128, S, rb)
    assert scale.dtype == torch.float16 and scale.shape == (2, 2, 17)
    # scale = largest chunk radius, rounded up to fp16 (allow 1 ulp for the norm's rounding)
    assert torch.allclose(scale.float(), sc_ref.float(), rtol=1e-3, atol=0)
    assert (scale.float() >= ref.chunk_norms(x).amax(-1).float() * (1 - 1e-6)).all()
    assert (rcode - rc).abs().max() <= 1
    assert (rcode == rc).float().mean() > 0.99


@pytest.mark.parametrize("S,rb", CONFIGS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TOKENS)
def test_decode_matches_reference(S, rb, D, dtype, T):
    x = make_x(2, 2, T, D, dtype)
    sec = secondary(2, S)
    codes, scale, out = encode(x, sec, rb)
    y = kvq.hqmq_decode(codes, scale, sec, out, rb, D, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    if T == 0:
        return
    dirs, rc = ref.unpack(codes, D, S, rb)
    y_ref = ref.decode_reference(dirs, rc, scale, sec, rb)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    assert torch.allclose(y.double(), y_ref, rtol=tol, atol=tol * scale.double().max())
    rel = (y.double() - x.double()).norm() / x.double().norm()
    assert rel < (0.16 if rb == 4 else 0.11), rel


def test_error_falls_as_S_and_radius_bits_grow():
    x = make_x(2, 2, 64, 128, torch.float32)

    def err(S, rb):
        c = kvq.compress(x, kvq.HQMQConfig(secondary_size=S, radius_bits=rb), "key")
        return ((c.decompress() - x).norm() / x.norm()).item()

    e_s = [err(S, 8) for S in (4, 24, 96, 384)]
    assert all(a > b for a, b in zip(e_s, e_s[1:])), e_s
    e_b = [err(192, b) for b in (1, 2, 4, 6, 8)]
    assert all(a > b for a, b in zip(e_b, e_b[1:])), e_b


# ----------------------------------------------------------------------------- Med3x
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 128])
def test_med3_outliers_stored_exactly(dtype, D):
    H = 3
    x = make_x(2, H, 20, D, dtype, outliers=True)
    sec = secondary(H, 192)
    thr = med3_threshold(x, 3.0)
    codes, scale, rec = encode(x, sec, 6, thr)
    norms = ref.chunk_norms(x)
    flag_ref = norms > thr.double()[None, :, None, None]
    assert flag_ref.any() and not flag_ref.all()
    assert rec.dtype == torch.int32 and rec.shape[1] == 4
    assert rec.shape[0] == int(flag_ref.sum())
    t, nc = rec[:, 0].long(), rec[:, 1].long()
    n, c = nc >> 8, nc & 0xFF
    flag = torch.zeros_like(flag_ref).reshape(-1, 20, D // 4)
    flag[n, t, c] = True
    assert torch.equal(flag.reshape(flag_ref.shape), flag_ref)
    # sorted by (n, t, c)
    key = (n * 20 + t) * 64 + c
    assert torch.equal(key, key.sort().values)
    # values: exact fp16
    vals = rec[:, 2:].contiguous().view(torch.int16).view(torch.float16).reshape(-1, 4)
    xe = x.reshape(-1, 20, D // 4, 4)[n, t, c].to(torch.float16)
    assert torch.equal(vals, xe)
    # decode: outlier chunks come back exactly (fp16-rounded), the rest as usual
    y = kvq.hqmq_decode(codes, scale, sec, rec, 6, D, dtype)
    yc = y.reshape(2, H, 20, D // 4, 4)
    assert torch.equal(yc[flag_ref], x.to(torch.float16).to(dtype).reshape(2, H, 20, D // 4, 4)[flag_ref])
    # outliers do not stretch the radius scale: scale = max over the non-outlier chunks
    r_in = torch.where(flag_ref, torch.zeros_like(norms), norms).amax(-1)
    assert torch.allclose(scale.double(), r_in, rtol=1e-3)
    assert (scale.double() < norms.amax(-1) * 0.9)[flag_ref.any(-1)].all()
    # outlier fields are zero (zero radius)
    dirs, rc = ref.unpack(codes, D, 192, 6)
    assert (rc[flag_ref] == 0).all() and (dirs[flag_ref] == 0).all()
    # Med3x lowers the error on outlier-heavy data
    c_plain, s_plain, r_plain = encode(x, sec, 6)
    y_plain = kvq.hqmq_decode(c_plain, s_plain, sec, r_plain, 6, D, dtype)
    e_med = (y.double() - x.double()).norm()
    e_plain = (y_plain.double() - x.double()).norm()
    assert e_med < 0.8 * e_plain


# ----------------------------------------------------------------------------- storage
@pytest.mark.parametrize("preset,S,rb,W", [("hqmq-3.79-paper", 96, 4, 16), ("hqmq-5", 192, 6, 19)])
def test_bits_per_element_matches_formula(preset, S, rb, W):
    B, H, T, D = 2, 4, 33, 128
    x = make_x(B, H, T, D, torch.float16, outliers=True)
    c = kvq.compress(x, preset, "value")
    assert c.secondary.shape == (H, S, 4)
    assert c.codes.shape[-1] == W == kvq.ops.hqmq_words(D, S, rb)
    F = math.ceil(math.log2(24 * S)) + rb
    assert W == math.ceil(D // 4 * F / 32)
    M = c.num_outliers
    if preset == "hqmq-5":
        assert M > 0
    else:
        assert M == 0
    nbytes = B * H * T * (4 * W + 2) + 16 * M + 16 * H * S + (4 * H if preset == "hqmq-5" else 0)
    assert c.nbytes == nbytes
    assert c.bits_per_element == pytest.approx(8 * nbytes / (B * H * T * D))
    # per-vector part: (32 W + 16) / D bits per element
    per_vec = (32 * W + 16) / D
    assert per_vec == pytest.approx({"hqmq-3.79-paper": 4.125, "hqmq-5": 4.875}[preset])


# ----------------------------------------------------------------------------- errors
def test_bad_inputs_raise_naming_the_argument():
    sec = secondary(2, 8)
    x = make_x(1, 2, 4, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'x'.*divisible by 4"):
        encode(torch.randn(1, 2, 4, 130), sec, 4)
    with pytest.raises(RuntimeError, match="'x'.*32, 64, 128 or 256"):
        encode(torch.randn(1, 2, 4, 96), sec, 4)
    with pytest.raises(RuntimeError, match="'secondary'.*S in 1"):
        encode(x, torch.empty(2, 0, 4), 4)
    with pytest.raises(RuntimeError, match="'secondary'.*\\[H, S, 4\\]"):
        encode(x, secondary(3, 8), 4)
    with pytest.raises(RuntimeError, match="'secondary'.*Float"):
        encode(x, sec.double(), 4)
    for rb in (0, 9):
        with pytest.raises(RuntimeError, match="'radius_bits'.*1..8"):
            encode(x, sec, rb)
    with pytest.raises(RuntimeError, match="'x'.*float16, bfloat16 or float32"):
        encode(x.to(torch.int32), sec, 4)
    with pytest.raises(RuntimeError, match="'x'.*float16, bfloat16 or float32"):
        encode(x.double(), sec, 4)
    with pytest.raises(RuntimeError, match="'outlier_threshold'"):
        encode(x, sec, 4, torch.ones(3))
    xn = x.clone()
    xn[0, 1, 2, 5] = float("nan")
    with pytest.raises(RuntimeError, match="'x' contains NaN or Inf"):
        encode(xn, sec, 4)
    xi = x.clone()
    xi[0, 0, 0, 0] = float("inf")
    with pytest.raises(RuntimeError, match="'x' contains NaN or Inf"):
        encode(xi, sec, 4)
    with pytest.raises(RuntimeError, match="65504"):
        encode(x * 1e5, sec, 4)
    codes, scale, rec = encode(x, sec, 4)
    with pytest.raises(RuntimeError, match="'codes'.*words"):
        kvq.hqmq_decode(codes, scale, sec, rec, 5, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'head_dim'"):
        kvq.hqmq_decode(codes, scale, sec, rec, 4, 130, torch.float32)
    with pytest.raises(RuntimeError, match="'scale'"):
        kvq.hqmq_decode(codes, scale[..., :2], sec, rec, 4, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'outliers'"):
        kvq.hqmq_decode(codes, scale, sec, rec.reshape(-1, 2), 4, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'dtype'"):
        kvq.hqmq_decode(codes, scale, sec, rec, 4, 128, torch.int32)


def test_nan_with_check_disabled_spoils_only_its_own_token():
    sec = secondary(2, 16)
    x = make_x(1, 2, 6, 64, torch.float32)
    xn = x.clone()
    xn[0, 1, 2, 5] = float("nan")
    c1, s1, _ = encode(x, sec, 4)
    c2, s2, _ = encode(xn, sec, 4, check_finite=False)
    same = torch.ones(1, 2, 6, dtype=torch.bool)
    same[0, 1, 2] = False
    assert torch.equal(c1[same], c2[same]) and torch.equal(s1[same], s2[same])


def test_config_validation_and_serialisation():
    for kw, arg in [(dict(secondary_size=0), "secondary_size"), (dict(secondary_size=4096), "secondary_size"),
                    (dict(radius_bits=0), "radius_bits"), (dict(radius_bits=9), "radius_bits"),
                    (dict(outlier_factor=-1.0), "outlier_factor"),
                    (dict(outlier_factor=float("nan")), "outlier_factor"), (dict(seed=-1), "seed"),
                    (dict(secondary_size=1.5), "secondary_size")]:
        with pytest.raises(ValueError, match=f"'{arg}'"):
            kvq.HQMQConfig(**kw)
    a, b = kvq.get_config("hqmq-3.79-paper"), kvq.get_config("hqmq-5")
    assert (a.secondary_size, a.radius_bits, a.outlier_factor) == (96, 4, None)
    assert (b.secondary_size, b.radius_bits, b.outlier_factor) == (192, 6, 3.0)
    for cfg in (a, b):
        assert kvq.CompressionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="'role'"):
        a.compress(make_x(), "query")


def test_non_contiguous_input():
    x = make_x(2, 3, 10, 128, torch.float16).transpose(1, 2).contiguous().transpose(1, 2)
    assert not x.is_contiguous()
    sec = secondary(3, 32)
    a = encode(x, sec, 4)
    b = encode(x.contiguous(), sec, 4)
    assert all(torch.equal(u, v) for u, v in zip(a, b))


# ----------------------------------------------------------------------------- streaming
@pytest.mark.parametrize("preset", ["hqmq-3.79-paper", "hqmq-5"])
def test_kvcache_prefill_and_decode(preset):
    cfg = kvq.get_config(preset)
    B, H, D = 2, 2, 128
    cache = kvq.KVCache(cfg)
    pre_k, pre_v = make_x(B, H, 13, D, outliers=True), make_x(B, H, 13, D)
    steps = [make_x(B, H, 1, D, outliers=True) for _ in range(4)] + [make_x(B, H, 3, D)]
    for layer in (0, 1):
        cache.update(pre_k, pre_v, layer)
        for s in steps:
            cache.update(s, s * 0.5, layer)
    assert cache.get_seq_length(0) == 13 + 7
    K, V = cache.dequantize(1)
    k_all = torch.cat([pre_k] + steps, dim=2)
    # equals one encode of all tokens with layer 1's codebook and the prefill threshold
    sec = hqmq_secondary(H, cfg.secondary_size, cfg.seed, layer_idx=1, role="key")
    thr = med3_threshold(pre_k, cfg.outlier_factor) if cfg.outlier_factor else None
    codes, scale, rec = encode(k_all, sec, cfg.radius_bits, thr)
    K_ref = kvq.hqmq_decode(codes, scale, sec, rec, cfg.radius_bits, D, k_all.dtype)
    assert torch.equal(K, K_ref)
    layer1 = cache.layers[1]
    assert torch.equal(layer1.key.secondary, sec)
    assert not torch.equal(layer1.key.secondary, layer1.value.secondary)
    assert not torch.equal(cache.layers[0].key.secondary, sec)
    if cfg.outlier_factor:
        assert layer1.key.outliers.length == rec.shape[0] > 0
    assert V.shape == (B, H, 20, D)
    rel = (K.float() - k_all.float()).norm() / k_all.float().norm()
    assert rel < 0.2
    n = cache.nbytes
    W = kvq.ops.hqmq_words(D, cfg.secondary_size, cfg.radius_bits)
    assert n >= 2 * 2 * B * H * 20 * (4 * W + 2)
    # state dict round trip
    sd = cache.state_dict()
    c2 = kvq.KVCache(cfg)
    c2.load_state_dict(sd)
    K2, V2 = c2.dequantize(1)
    assert torch.equal(K2, K) and c2.nbytes == n
    c2.update(steps[0], steps[0], 1)
    cache.update(steps[0], steps[0], 1)
    assert torch.equal(c2.dequantize(1)[0], cache.dequantize(1)[0])


def test_stream_empty_and_single_token():
    s = kvq.get_config("hqmq-5").new_stream("key", layer_idx=2)
    assert s.dequantize() is None and s.seq_len == 0
    s.append(make_x(1, 2, 0, 64))
    assert s.dequantize().shape == (1, 2, 0, 64)
    assert s.nbytes == 2 * 192 * 4 * 4  # only the fp32 codebook [H, S, 4] is stored yet
    s.append(make_x(1, 2, 1, 64))
    assert s.dequantize().shape == (1, 2, 1, 64) and s.seq_len == 1


# ----------------------------------------------------------------------------- opcheck
def test_opcheck_encode_decode():
    x = make_x(1, 2, 8, 128, torch.float16, outliers=True)
    sec = secondary(2, 24)
    thr = med3_threshold(x, 3.0)
    torch.library.opcheck(torch.ops.kvq.hqmq_encode.default, (x, sec, 4, None, True))
    codes, scale, rec = encode(x, sec, 4, thr)
    assert rec.shape[0] > 0
    torch.library.opcheck(torch.ops.kvq.hqmq_decode.default,
                          (codes, scale, sec, rec, 4, 128, torch.float16))


def test_opcheck_encode_with_outliers():
    x = make_x(1, 2, 8, 128, torch.float16, outliers=True)
    sec = secondary(2, 24)
    thr = med3_threshold(x, 3.0)
    # data-dependent record count: the fake uses ctx.new_dynamic_size()
    torch.library.opcheck(torch.ops.kvq.hqmq_encode.default, (x, sec, 4, thr, True))


# ----------------------------------------------------------------------------- CUDA
@requires_cuda
@pytest.mark.parametrize("S,rb", CONFIGS + [(1, 1), (2048, 8)])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TOKENS + [200])
def test_cuda_matches_cpu(S, rb, D, dtype, T):
    H = 3
    x = make_x(2, H, T, D, dtype, outliers=True)
    sec = secondary(H, S)
    thr = med3_threshold(x, 3.0) if rb == 6 else None
    cpu = encode(x, sec, rb, thr)
    gpu = encode(x.cuda(), sec.cuda(), rb, None if thr is None else thr.cuda())
    assert torch.equal(cpu[1], gpu[1].cpu())  # scales bit-identical
    assert torch.equal(cpu[2], gpu[2].cpu())  # outlier records
    same = (cpu[0] == gpu[0].cpu()).all(-1).float().mean().item() if T else 1.0
    assert same == 1.0 or (same > 0.999 and T > 0)
    if T:
        dirs, _ = ref.unpack(gpu[0].cpu(), D, S, rb)
        best, _ = ref.brute_force_best(x, sec) if S <= 192 else (None, None)
        if best is not None:
            chosen = ref.chosen_score(x, sec, dirs)
            ok = (best - chosen) <= 2e-6 * ref.chunk_norms(x) + 1e-12
            if thr is not None:  # Med3x chunks are stored exactly; their direction field is 0
                ok |= ref.chunk_norms(x) > thr.double().view(1, H, 1, 1) * (1 - 1e-6)
            assert ok.all()
    y_cpu = kvq.hqmq_decode(cpu[0], cpu[1], sec, cpu[2], rb, D, dtype)
    y_gpu = kvq.hqmq_decode(cpu[0].cuda(), cpu[1].cuda(), sec.cuda(), cpu[2].cuda(), rb, D, dtype)
    assert torch.equal(y_cpu, y_gpu.cpu())


# The CUDA encode searches with tensor cores for S <= 512 (approximate scores, then the
# candidate buckets re-searched with the CPU op's fp32 arithmetic) and with the fp32 S-way
# loop above; both must return exactly the CPU op's codes (first maximum of its fp32 scores).
TC_SECONDARY = [1, 7, 33, 96, 192, 256, 512, 513]  # 513: the fp32 loop


def near_tie_x(sec, T, D, seed=0):
    """[1, H, T, D] float32 chunks built to stress the codeword choice: random directions
    moved onto the bisector of their best codeword and their best codeword of another
    secondary (ties in exact arithmetic, decided by fp32 rounding), some nudged by 1e-7,
    random scales, plus all-zero, tiny and huge chunks."""
    g = torch.Generator().manual_seed(seed)
    H, S, _ = sec.shape
    n = T * D // 4
    x0 = torch.randn(H, n, 4, generator=g, dtype=torch.float64)
    x = x0.clone()
    for h in range(H):
        if S == 1:
            break
        cb = ref.codebook(sec[h].double())  # [24 S, 4], row s * 24 + p
        for b in range(0, n, 512):
            xb = x0[h, b:b + 512]
            sc = xb @ cb.T
            i1 = sc.argmax(-1)
            other = (torch.arange(24 * S)[None, :] // 24) == (i1[:, None] // 24)
            i2 = sc.masked_fill(other, -math.inf).argmax(-1)
            d = cb[i1] - cb[i2]
            x[h, b:b + 512] = xb - ((xb * d).sum(-1, keepdim=True) / (d * d).sum(-1, keepdim=True)) * d
    nudge = torch.rand(H, n, 1, generator=g) < 0.3
    x = torch.where(nudge, x * (1 + 1e-7 * torch.randn(H, n, 4, generator=g, dtype=torch.float64)), x)
    x = x * torch.exp(2 * torch.randn(H, n, 1, generator=g, dtype=torch.float64))
    x = x.float().reshape(1, H, T, D)
    x[0, 0, 0] = 0.0                   # all-zero token
    x[0, 1 % H, 1, 4:8] = 0.0          # one zero chunk
    x[0, 0, 2, :8] *= 1e-36            # below 2^-100: full search
    x[0, 0, 2, 8:16] *= 1e-20          # tiny but on the tensor-core path
    x[0, 0, 3, :8] *= 1e31             # above 2^100: full search
    return x


@requires_cuda
@pytest.mark.parametrize("S", TC_SECONDARY)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("med3", [False, True])
def test_cuda_codes_equal_cpu_exactly(S, D, dtype, med3):
    H = 2
    x = make_x(2, H, 67, D, dtype, outliers=True)
    x[0, 0, 3] = 0  # all-zero token
    x[1, 1, 4, :4] = 0  # one zero chunk
    sec = secondary(H, S, seed=S)
    thr = med3_threshold(x, 3.0) if med3 else None
    cpu = encode(x, sec, 5, thr)
    gpu = encode(x.cuda(), sec.cuda(), 5, None if thr is None else thr.cuda())
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


@requires_cuda
@pytest.mark.parametrize("S", [1, 33, 96, 192, 512, 513])
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sec_scale", [1.0, 3.0, 1e-3])
def test_cuda_codes_equal_cpu_on_near_ties(S, D, dtype, sec_scale):
    H = 3
    sec = secondary(H, S, seed=7)
    if S > 2:
        sec[:, 1] = sec[:, S - 1]  # duplicated secondary: exact ties between s = 1 and S - 1
    sec = sec * sec_scale  # not unit: the candidate margin scales with max |s|
    x = near_tie_x(sec / sec_scale, 40, D, seed=S + D).to(dtype)
    cpu = encode(x, sec, 6, check_finite=False)
    gpu = encode(x.cuda(), sec.cuda(), 6, check_finite=False)
    for a, b in zip(cpu, gpu):
        assert torch.equal(a, b.cpu())


@requires_cuda
def test_cuda_codes_equal_cpu_large():
    # many chunks per call (all tiles full), both presets' S, fp16 and bf16
    for dtype in (torch.float16, torch.bfloat16):
        x = make_x(1, 4, 2048, 128, dtype, outliers=True)
        for S in (96, 192):
            sec = secondary(4, S, seed=3)
            cpu = encode(x, sec, 4)
            gpu = encode(x.cuda(), sec.cuda(), 4)
            assert torch.equal(cpu[0], gpu[0].cpu()) and torch.equal(cpu[1], gpu[1].cpu())


def test_near_tie_inputs_are_near_ties():
    # the stress input really has near-ties: a sizeable share of chunks whose best two
    # secondaries' scores differ by < 1e-6 relative (checked on the CPU reference search)
    sec = secondary(2, 96, seed=7)
    x = near_tie_x(sec, 8, 64, seed=1)
    xc = x.double().reshape(-1, 4)
    h = torch.arange(2).repeat_interleave(8 * 16)
    v = ref.hamilton(xc[:, None, :], sec.double()[h][:, :, :] * torch.tensor([1.0, -1, -1, -1], dtype=torch.float64))
    a = v.abs()
    sc = torch.maximum(a.amax(-1), a.sum(-1) / 2)
    top = sc.topk(2, dim=-1).values
    n = xc.norm(dim=-1)
    ok = n > 0
    rel = ((top[:, 0] - top[:, 1]) / n)[ok]
    assert (rel < 1e-6).float().mean() > 0.5


@requires_cuda
def test_cuda_errors_and_opcheck():
    sec = secondary(2, 24, device="cuda")
    x = make_x(1, 2, 8, 128, torch.float16, device="cuda")
    xn = x.clone()
    xn[0, 0, 3, 7] = float("nan")
    with pytest.raises(RuntimeError, match="'x' contains NaN or Inf"):
        encode(xn, sec, 4)
    with pytest.raises(RuntimeError, match="'secondary' is on"):
        encode(x, sec.cpu(), 4)
    torch.library.opcheck(torch.ops.kvq.hqmq_encode.default, (x, sec, 4, None, True))
    codes, scale, rec = encode(x, sec, 4)
    torch.library.opcheck(torch.ops.kvq.hqmq_decode.default,
                          (codes, scale, sec, rec, 4, 128, torch.float16))


@requires_cuda
def test_cuda_kvcache_matches_cpu():
    cfg = kvq.get_config("hqmq-5")
    xs = [make_x(1, 2, 9, 128, outliers=True)] + [make_x(1, 2, 1, 128) for _ in range(3)]
    a, b = kvq.KVCache(cfg), kvq.KVCache(cfg)
    for t in xs:
        a.update(t, t, 0)
        b.update(t.cuda(), t.cuda(), 0)
    assert torch.equal(a.dequantize(0)[0], b.dequantize(0)[0].cpu())


def test_torch_compile_smoke():
    x = make_x(1, 2, 8, 128, torch.float16, outliers=True)
    sec = secondary(2, 24)
    thr = med3_threshold(x, 3.0)

    def roundtrip(x, sec, thr):
        codes, scale, rec = kvq.hqmq_encode(x, sec, 4, thr)
        return kvq.hqmq_decode(codes, scale, sec, rec, 4, 128, torch.float16)

    f = torch.compile(roundtrip, backend="aot_eager")
    assert torch.equal(f(x, sec, thr), roundtrip(x, sec, thr))


def test_magnitude_limit_is_the_chunk_norm():
    """Without Med3x the bound is the fp16 radius scale, i.e. a chunk norm <= 65504: a token whose
    chunk norm exceeds it is refused with a message saying so (the cache used to store NaN), while
    entries up to that norm are accepted; hqmq-5 stores such chunks exactly."""
    x = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    x[0, 0, 3, 4:8] = 40000.0  # entries < 65504, chunk norm 80000
    cache = kvq.KVCache("hqmq-3.79-paper")
    with pytest.raises(ValueError, match="4-element chunks with norm above 65504"):
        cache.update(x, x, 0)
    assert cache.get_seq_length(0) == 0
    with pytest.raises(RuntimeError, match="chunk whose norm exceeds 65504"):
        kvq.compress(x, "hqmq-3.79-paper", "key")
    ok = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    ok[0, 0, 3, 5] = 60000.0  # one large entry: chunk norm below the limit
    cache.update(ok, ok, 0)
    assert torch.isfinite(cache.dequantize(0)[0]).all()
    c5 = kvq.KVCache("hqmq-5")
    c5.update(x, x, 0)
    K, _ = c5.dequantize(0)
    assert torch.equal(K[0, 0, 3, 4:8], x[0, 0, 3, 4:8])
