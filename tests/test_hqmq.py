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
    codes, _ = encode(x, ident, 4)
    dirs, _, _ = ref.unpack_rows(codes, 128, 1, 4)
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
    codes, out = encode(x, sec, rb)
    assert codes.dtype == torch.int16 and codes.shape == (2, H, 9, ref.units(D, S, rb))
    assert out.shape == (0, 4)
    dirs, rc, _ = ref.unpack_rows(codes, D, S, rb)
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
    codes, _ = encode(x, sec, rb)
    dirs, rc, sc_ref, _ = ref.encode_reference(x, sec, rb)
    _, rcode, scale = ref.unpack_rows(codes, 128, S, rb)
    assert scale.dtype == torch.float16 and scale.shape == (2, 2, 17)
    # scale = the largest chunk radius rounded up to the SB-bit grid; the reference follows the
    # encoder's fp32 norm and division, so scales and radius codes agree exactly
    assert torch.equal(scale.view(torch.int16), sc_ref.view(torch.int16))
    assert torch.equal(rcode, rc)
    rmax = ref.chunk_norms_fp32(x).amax(-1).double()
    assert (scale.double() >= rmax).all()
    # smallest grid value >= rmax: the grid value below it (code - 1) is below rmax
    sh = 15 - ref.scale_bits(128, S, rb)
    below = ref.scale_from_code((scale.view(torch.int16).long() >> sh) - 1, 15 - sh).double()
    assert (below < rmax).all()


@pytest.mark.parametrize("S,rb", CONFIGS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", TOKENS)
def test_decode_matches_reference(S, rb, D, dtype, T):
    x = make_x(2, 2, T, D, dtype)
    sec = secondary(2, S)
    codes, out = encode(x, sec, rb)
    y = kvq.hqmq_decode(codes, sec, out, rb, D, dtype)
    assert y.shape == x.shape and y.dtype == dtype
    if T == 0:
        return
    dirs, rc, scale = ref.unpack_rows(codes, D, S, rb)
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
    codes, rec = encode(x, sec, 6, thr)
    norms = ref.chunk_norms_fp32(x).double()
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
    y = kvq.hqmq_decode(codes, sec, rec, 6, D, dtype)
    yc = y.reshape(2, H, 20, D // 4, 4)
    assert torch.equal(yc[flag_ref], x.to(torch.float16).to(dtype).reshape(2, H, 20, D // 4, 4)[flag_ref])
    # outliers do not stretch the radius scale: scale = max over the non-outlier chunks,
    # rounded up to the SB-bit grid
    dirs, rc, scale = ref.unpack_rows(codes, D, 192, 6)
    r_in = torch.where(flag_ref, torch.zeros_like(norms), norms).amax(-1)
    assert torch.equal(scale.view(torch.int16), ref.round_scale(r_in.float(), ref.scale_bits(D, 192, 6)).view(torch.int16))
    assert (scale.double() < norms.amax(-1) * 0.9)[flag_ref.any(-1)].all()
    # outlier fields are zero (zero radius)
    assert (rc[flag_ref] == 0).all() and (dirs[flag_ref] == 0).all()
    # the whole encode equals the reference's (exact radii and scales; directions up to ties)
    d_ref, rc_ref, sc_ref, outl_ref = ref.encode_reference(x, sec, 6, thr)
    assert torch.equal(outl_ref, flag_ref)
    assert torch.equal(rc, rc_ref) and torch.equal(scale.view(torch.int16), sc_ref.view(torch.int16))
    assert (dirs == d_ref).float().mean() > 0.999
    # Med3x lowers the error on outlier-heavy data
    c_plain, r_plain = encode(x, sec, 6)
    y_plain = kvq.hqmq_decode(c_plain, sec, r_plain, 6, D, dtype)
    e_med = (y.double() - x.double()).norm()
    e_plain = (y_plain.double() - x.double()).norm()
    assert e_med < 0.8 * e_plain


# ----------------------------------------------------------------------------- storage
@pytest.mark.parametrize("preset,S,rb,D,U,per_vec", [
    ("hqmq-3.79", 96, 4, 128, 31, 3.875), ("hqmq-3.79", 96, 4, 64, 16, 4.0),
    ("hqmq-3.79-paper", 96, 4, 128, 31, 3.875), ("hqmq-3.79-paper", 96, 4, 64, 16, 4.0),
    ("hqmq-5", 192, 6, 128, 37, 4.625), ("hqmq-5", 192, 6, 64, 19, 4.75)])
def test_bits_per_element_matches_formula(preset, S, rb, D, U, per_vec):
    B, H, T = 2, 4, 33
    x = make_x(B, H, T, D, torch.float16, outliers=True)
    c = kvq.compress(x, preset, "value")
    assert c.secondary.shape == (H, S, 4)
    assert c.codes.dtype == torch.int16
    assert c.codes.shape == (B, H, T, U) and U == kvq.ops.hqmq_units(D, S, rb) == ref.units(D, S, rb)
    assert not hasattr(c, "scale") and "scale" not in c.tensors()
    # the documented formula: C plain fields of E = DB - 4 + rb bits, G = C // K 16-bit digit
    # groups, the C - G K remaining base-R digits, at least 8 scale bits, rounded up to 16-bit
    # units; the scale takes the rest of the last unit (SB = 9 at D = 128, 12 at D = 64)
    C, DB = D // 4, math.ceil(math.log2(24 * S))
    E, R = DB - 4 + rb, math.ceil(24 * S / 2 ** (DB - 4))
    assert R == 9
    K = 5
    G = C // K
    tail = (R ** (C - G * K) - 1).bit_length()
    assert U == math.ceil((C * E + 16 * G + tail + 8) / 16)
    assert ref.scale_bits(D, S, rb) == 16 * U - (C * E + 16 * G + tail) == {128: 9, 64: 12}[D]
    assert kvq.ops.hqmq_row_layout(D, S, rb)["scale_bits"] == ref.scale_bits(D, S, rb)
    M = c.num_outliers
    if preset == "hqmq-5":
        assert M > 0
    else:
        assert M == 0
    nbytes = B * H * T * 2 * U + 16 * M + 16 * H * S + (4 * H if preset == "hqmq-5" else 0)
    assert c.nbytes == nbytes
    assert c.bits_per_element == pytest.approx(8 * nbytes / (B * H * T * D))
    # per-vector part: 16 U / D bits per element (codes and radius scale)
    assert 16 * U / D == pytest.approx(per_vec)


LAYOUT_CASES = [(D, S, rb) for D in (32, 64, 128, 256) for S in (1, 64, 96, 192, 2048) for rb in range(1, 9)]


def test_reference_layout_equals_kvq_layout():
    """The reference's layout (written from the format text) equals kvq.ops.hqmq_row_layout for
    every D, S and radius bits the op accepts (S = 1..2048 on a sampled grid)."""
    for D in (32, 64, 128, 256):
        for S in list(range(1, 200)) + [255, 256, 257, 341, 342, 511, 512, 513, 683, 1000, 1365, 1366, 2047, 2048]:
            for rb in range(1, 9):
                a, b = ref.row_layout(D, S, rb), kvq.ops.hqmq_row_layout(D, S, rb)
                assert {k: a[k] for k in b} == b, (D, S, rb)
                assert kvq.ops.hqmq_units(D, S, rb) == a["units"]
                assert a["units"] == -(-a["used"] // 16) and a["used"] <= 16 * a["units"] < a["used"] + 16


def exact_codeword_input(sec, T, D, radius_bits, seed):
    """[1, H, T, D] float32 whose every chunk is r * codeword[dir] for random dirs over all 24 S
    (so every base-R digit value occurs) and random radii (a zero chunk and a zero token too),
    each codeword the unique best one by a margin far above fp32 rounding: the encoder's
    direction is known exactly.  Returns (x, dirs [1, H, T, C])."""
    g = torch.Generator().manual_seed(seed)
    H, S, _ = sec.shape
    C = D // 4
    dirs = torch.randint(0, 24 * S, (1, H, T, C), generator=g)
    r = torch.rand(1, H, T, C, generator=g, dtype=torch.float64) * torch.exp(
        3 * torch.randn(1, H, T, 1, generator=g, dtype=torch.float64))
    r[..., 0, :] = 0.0                      # an all-zero token
    r[..., 1 % T, C // 2] = 0.0             # a zero chunk
    cbs = [ref.codebook(sec[h].double()) for h in range(H)]
    for _ in range(50):
        x = torch.stack([cbs[h][dirs[0, h]] for h in range(H)])[None] * r[..., None]  # [1, H, T, C, 4]
        xf = x.float()
        bad = torch.zeros_like(dirs, dtype=torch.bool)
        for h in range(H):
            sc = xf[0, h].double() @ cbs[h].T                                   # [T, C, 24 S]
            top = sc.topk(min(2, 24 * S), dim=-1)
            margin = top.values[..., 0] - top.values[..., -1] if 24 * S > 1 else top.values[..., 0]
            ok = (top.indices[..., 0] == dirs[0, h]) & (margin > 1e-4 * r[0, h])
            bad[0, h] = ~ok & (r[0, h] > 0)
        if not bad.any():
            break
        dirs = torch.where(bad, torch.randint(0, 24 * S, dirs.shape, generator=g), dirs)
    assert not bad.any()
    dirs = torch.where(r > 0, dirs, torch.zeros_like(dirs))  # a zero chunk: all scores 0, s = 0, p = 0
    return xf.reshape(1, H, T, D), dirs


@pytest.mark.parametrize("D,S,rb", LAYOUT_CASES)
def test_packed_layout_matches_reference(D, S, rb):
    """The packed rows: U = hqmq_units units, every unused bit past the scale zero, digit groups
    and tail canonical, and the fields the reference unpacks (from the format text) equal the
    known directions, the reference's exact radius codes and SB-bit scales; re-packing the
    reference's fields reproduces the rows bit for bit."""
    H, T = 2, 6
    sec = secondary(H, S, seed=S + rb)
    x, dirs_true = exact_codeword_input(sec, T, D, rb, seed=D * 1000 + S * 10 + rb)
    codes, rec = encode(x, sec, rb)
    U = kvq.ops.hqmq_units(D, S, rb)
    assert codes.dtype == torch.int16 and codes.shape == (1, H, T, U) and rec.shape == (0, 4)
    lay = ref.row_layout(D, S, rb)
    bits = ref.row_bits(codes)
    assert not bits[..., lay["used"]:].any()  # rest zero
    dirs, rc, scale = ref.unpack_rows(codes, D, S, rb, strict=True)
    d_ref, rc_ref, sc_ref, _ = ref.encode_reference(x, sec, rb)
    assert torch.equal(dirs, dirs_true)
    assert torch.equal(d_ref, dirs_true)  # the reference's search agrees on these inputs
    assert torch.equal(rc, rc_ref)
    assert torch.equal(scale.view(torch.int16), sc_ref.view(torch.int16))
    assert (scale[0, :, 0] == 0).all()  # the all-zero token: scale code 0
    fields, scode = ref.unpack_fields(codes, D, S, rb)
    assert torch.equal(ref.pack_rows(dirs, rc, scode, D, S, rb), codes)
    # all digit values occur (S > 1: the high direction bits are really exercised)
    if S > 1:
        assert (fields >> lay["E"]).unique().numel() == lay["R"]
    # and the decode is the reference decode of these fields
    y = kvq.hqmq_decode(codes, sec, rec, rb, D, torch.float32)
    y_ref = ref.decode_reference(dirs, rc, scale, sec, rb)
    assert torch.allclose(y.double(), y_ref, rtol=1e-5, atol=1e-6 * max(float(scale.double().max()), 1e-30))


def test_unpack_reference_rejects_non_canonical_rows():
    """The strict reference unpack is not vacuous: a set padding bit (past an SB = 15 scale), a
    digit group >= R^K, a tail >= R^(C - G K) and a wrong unit count are refused."""
    D, S, rb = 32, 96, 4  # 137 of 144 bits used, one digit group, 3 tail digits
    x = make_x(1, 1, 3, D, torch.float32)
    sec = secondary(1, S)
    codes, _ = encode(x, sec, rb)
    ref.unpack_rows(codes, D, S, rb)
    lay = ref.row_layout(D, S, rb)
    assert lay["scale_bits"] == 15 and lay["used"] < 16 * lay["units"] and lay["tail_n"] == 3
    bad = codes.clone()
    bad[..., -1] |= torch.tensor(-32768, dtype=torch.int16)  # the last bit of the row
    with pytest.raises(ValueError, match="past the scale"):
        ref.unpack_rows(bad, D, S, rb)
    bad = codes.clone()
    j = lay["groups_at"] // 16
    assert lay["groups_at"] % 16 == 0
    bad[..., j] = torch.tensor(-1, dtype=torch.int16)  # 65535 >= 9^5
    with pytest.raises(ValueError, match="canonical"):
        ref.unpack_rows(bad, D, S, rb)
    bits = ref.row_bits(codes)
    tail = bits.clone()
    tail[..., lay["tail_at"]:lay["tail_at"] + lay["tail_bits"]] = 1  # 1023 >= 9^3
    u = (tail.long().reshape(*codes.shape, 16) << torch.arange(16)).sum(-1)
    with pytest.raises(ValueError, match="canonical"):
        ref.unpack_rows(torch.where(u >= 2 ** 15, u - 2 ** 16, u).to(torch.int16), D, S, rb)
    with pytest.raises(ValueError, match="units"):
        ref.unpack_rows(codes[..., :-1], D, S, rb)


def expected_scale(rmax: float, SB: int) -> float:
    """The smallest fp16 value with SB - 5 mantissa bits (the top SB of its 15 magnitude bits)
    >= rmax, by arithmetic on exponent and mantissa (independent of the reference's code grid);
    rmax above the largest finite one but <= 65504 gives the largest finite one."""
    if rmax == 0:
        return 0.0
    mb = SB - 5
    e = max(math.floor(math.log2(rmax)), -14)  # fp16 subnormals share the spacing of 2^-14
    step = 2.0 ** (e - mb)
    top = 2.0 ** 15 * (2 - 2.0 ** -mb)
    return min(math.ceil(rmax / step) * step, top) if rmax <= 65504 else math.inf


# (D, S, radius_bits) with scale widths SB = 8, 9, 12, 14, 15
SB_CASES = [(32, 1, 2), (128, 96, 4), (64, 96, 4), (32, 24, 1), (256, 96, 4), (64, 192, 6)]
RMAX = [0.0, 1.0, 1.01, 1.0625, 1.125, 1.126, 0.7, 300.3, 2.0 ** -24, 1e-6, 3e-5, 6.1e-5, 6.2e-5, 57344.0,
        57345.0, 61439.0, 61440.0]


def test_scale_widths_of_the_cases():
    assert [ref.scale_bits(*c) for c in SB_CASES] == [8, 9, 12, 14, 15, 12]
    assert [kvq.ops.hqmq_row_layout(*c)["scale_bits"] for c in SB_CASES] == [8, 9, 12, 14, 15, 12]
    # a few values by hand
    for SB, rmax, want in [(8, 1.01, 1.125), (9, 1.01, 1.0625), (12, 1.01, 1.015625), (15, 1.01, 1035 / 1024),
                           (8, 57345.0, 61440.0), (9, 57345.0, 59392.0), (8, 2.0 ** -24, 2.0 ** -17),
                           (8, 3e-5, 2.0 ** -15), (15, 2.0 ** -24, 2.0 ** -24), (9, 64000.0, 63488.0),
                           (12, 65400.0, 65280.0), (15, 65400.0, 65408.0), (8, 65504.0, 61440.0)]:
        rm = float(torch.tensor(rmax, dtype=torch.float32))
        assert expected_scale(rm, SB) == want, (SB, rmax)
        assert float(ref.round_scale(torch.tensor(rm), SB)) == want, (SB, rmax)


@pytest.mark.parametrize("D,S,rb", SB_CASES)
def test_scale_is_smallest_grid_value_at_or_above_rmax(D, S, rb):
    """Tokens whose largest chunk norm is rmax (one chunk (rmax, 0, 0, 0) or (0, 0, -rmax, 0),
    the others smaller) get the radius scale of expected_scale: the smallest fp16 with SB - 5
    mantissa bits >= rmax; their radius codes and decode follow."""
    SB = ref.scale_bits(D, S, rb)
    T = len(RMAX)
    x = torch.zeros(1, 1, T, D)
    for t, rmax in enumerate(RMAX):
        x[0, 0, t, 0 if t % 2 else 10] = rmax if t % 2 else -rmax
        x[0, 0, t, 5:8] = torch.tensor([0.3, -0.2, 0.1]) * rmax
    rm32 = ref.chunk_norms_fp32(x).amax(-1)[0, 0]
    assert rm32.tolist() == [float(torch.tensor(r, dtype=torch.float32)) for r in RMAX]
    sec = secondary(1, S)
    codes, _ = encode(x, sec, rb)
    _, rc, scale = ref.unpack_rows(codes, D, S, rb)
    want = [expected_scale(float(r), SB) for r in rm32]
    assert scale[0, 0].double().tolist() == want
    assert torch.equal(scale.view(torch.int16), ref.round_scale(rm32, SB).view(torch.int16)[None, None])
    grid = ref.scale_grid(SB)
    assert [float(grid[grid >= float(r)].min()) for r in rm32] == want
    y = kvq.hqmq_decode(codes, sec, torch.empty(0, 4, dtype=torch.int32), rb, D, torch.float32)
    assert torch.isfinite(y).all()
    maxq = 2 ** rb - 1
    for t, r in enumerate(rm32.tolist()):
        if r == 0:
            assert scale[0, 0, t] == 0 and (rc[0, 0, t] == 0).all() and (y[0, 0, t] == 0).all()
            continue
        c = 0 if t % 2 else 2
        assert int(rc[0, 0, t, c]) == min(maxq, round(r / (want[t] / maxq)))
        # the largest chunk decodes close to its norm (within half a radius step)
        assert abs(float(y[0, 0, t, 4 * c:4 * c + 4].norm()) - r) <= 0.5 * want[t] / maxq * (1 + 1e-5) + 1e-6 * r


@pytest.mark.parametrize("D,S,rb", SB_CASES[:4])
def test_scale_grid_over_magnitudes(D, S, rb):
    """Random rows over 45 octaves: the scale equals the reference's and is the smallest grid
    value >= rmax (fp32 rmax, as the encoder computes it); many codes occur."""
    SB = ref.scale_bits(D, S, rb)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(1, 2, 300, D, generator=g) * torch.exp2(
        torch.randint(-30, 15, (1, 2, 300, 1), generator=g).float())
    x = x * torch.rand(1, 2, 300, 1, generator=g)
    sec = secondary(2, S)
    codes, _ = encode(x, sec, rb)
    _, _, scale = ref.unpack_rows(codes, D, S, rb)
    rmax = ref.chunk_norms_fp32(x).amax(-1).double()
    assert (rmax > 61440).sum() == 0
    grid = ref.scale_grid(SB)
    assert torch.equal(scale.double(), grid[torch.searchsorted(grid, rmax)])
    assert (scale.view(torch.int16).long() >> (15 - SB)).unique().numel() > 100


@pytest.mark.parametrize("D,S,rb", SB_CASES)
def test_scale_above_61440(D, S, rb):
    """A coded chunk norm above 61440 (entries all within fp16): the finite check refuses it
    naming 61440; without the check the scale is the next grid value (or, above the largest
    finite one, that one) and the token decodes finite; Med3x stores such a chunk exactly."""
    SB = ref.scale_bits(D, S, rb)
    sec = secondary(1, S)
    none = torch.empty(0, 4, dtype=torch.int32)
    cases = [(torch.float32, [61441.0, 0, 0, 0]), (torch.float32, [62000.0, 0, 0, 0]),
             (torch.float32, [64000.0, 0, 0, 0]), (torch.float32, [65400.0, 0, 0, 0]),
             (torch.float32, [65504.0, 0, 0, 0]), (torch.float16, [30752.0] * 4),  # norm 61504
             (torch.bfloat16, [0, 61952.0, 0, 0])]
    for dtype, chunk in cases:
        x = torch.randn(1, 1, 3, D)
        x[0, 0, 1, 8:12] = torch.tensor(chunk)
        x = x.to(dtype)
        assert torch.equal(x[0, 0, 1, 8:12].float(), torch.tensor(chunk))
        norm = float(ref.chunk_norms_fp32(x)[0, 0, 1, 2])
        assert 61440 < norm <= 65504
        with pytest.raises(RuntimeError, match="'x'.*61440"):
            encode(x, sec, rb)
        codes, _ = encode(x, sec, rb, check_finite=False)
        dirs, rc, scale = ref.unpack_rows(codes, D, S, rb)
        want = expected_scale(norm, SB)
        assert float(scale[0, 0, 1]) == want and math.isfinite(want)
        assert want >= norm or want == float(ref.scale_grid(SB)[-1])  # clamped only past the grid
        _, rc_ref, sc_ref, _ = ref.encode_reference(x, sec, rb)
        assert torch.equal(rc, rc_ref) and torch.equal(scale.view(torch.int16), sc_ref.view(torch.int16))
        maxq = 2 ** rb - 1
        assert rc[0, 0, 1, 2] == min(maxq, round(norm / (want / maxq)))
        y = kvq.hqmq_decode(codes, sec, none, rb, D, torch.float32)
        assert torch.isfinite(y).all()
        assert abs(float(y[0, 0, 1, 8:12].norm()) - norm) <= max(0.5 * want / maxq, norm - want) * (1 + 1e-5)
        # the other tokens are untouched
        c_ok, _ = encode(x[:, :, [0, 2]], sec, rb)
        assert torch.equal(codes[:, :, [0, 2]], c_ok)
        # Med3x: the chunk is an outlier (exact record), the token's scale comes from the rest
        codes_m, rec = encode(x, sec, rb, torch.tensor([100.0]))
        assert rec.shape[0] == 1
        y = kvq.hqmq_decode(codes_m, sec, rec, rb, D, torch.float32)
        assert torch.equal(y[0, 0, 1, 8:12], x[0, 0, 1, 8:12].half().float())
        assert ref.unpack_rows(codes_m, D, S, rb)[2][0, 0, 1] < 100
    # exactly 61440 is accepted (fp32 and as four fp16 entries of 30720), its scale is 61440
    for dtype, chunk in [(torch.float32, [61440.0, 0, 0, 0]), (torch.float16, [30720.0] * 4)]:
        x = torch.zeros(1, 1, 1, D, dtype=dtype)
        x[0, 0, 0, :4] = torch.tensor(chunk, dtype=dtype)
        codes, _ = encode(x, sec, rb)
        assert ref.unpack_rows(codes, D, S, rb)[2].item() == 61440.0
    # above fp16's range the round-up overflows: the scale is Inf (documented: stays non-finite)
    x = torch.zeros(1, 1, 1, D)
    x[0, 0, 0, :2] = 50000.0  # entries fp16-finite, norm 70711 > 65504
    with pytest.raises(RuntimeError, match="61440"):
        encode(x, sec, rb)
    codes, _ = encode(x, sec, rb, check_finite=False)
    inf_code = 0x7C00 >> (15 - SB)
    assert ref.unpack_fields(codes, D, S, rb)[1].item() == inf_code
    assert ref.scale_code_reference(torch.tensor([70711.0]), SB).item() == inf_code
    assert ref.unpack_rows(codes, D, S, rb)[2].item() == math.inf


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
    codes, rec = encode(x, sec, 4)
    assert codes.shape[-1] == kvq.ops.hqmq_units(128, 8, 4)
    # radius_bits 4 -> 6 changes U (32 chunks x 2 more bits)
    assert kvq.ops.hqmq_units(128, 8, 6) != codes.shape[-1]
    with pytest.raises(RuntimeError, match="'codes'.*16-bit units"):
        kvq.hqmq_decode(codes, sec, rec, 6, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'codes'.*16-bit units"):
        kvq.hqmq_decode(codes[..., :-1], sec, rec, 4, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'codes'.*dtype"):
        kvq.hqmq_decode(codes.int(), sec, rec, 4, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'head_dim'"):
        kvq.hqmq_decode(codes, sec, rec, 4, 130, torch.float32)
    with pytest.raises(RuntimeError, match="'outliers'"):
        kvq.hqmq_decode(codes, sec, rec.reshape(-1, 2), 4, 128, torch.float32)
    with pytest.raises(RuntimeError, match="'dtype'"):
        kvq.hqmq_decode(codes, sec, rec, 4, 128, torch.int32)


def test_nan_with_check_disabled_spoils_only_its_own_token():
    sec = secondary(2, 16)
    x = make_x(1, 2, 6, 64, torch.float32)
    xn = x.clone()
    xn[0, 1, 2, 5] = float("nan")
    c1, _ = encode(x, sec, 4)
    c2, _ = encode(xn, sec, 4, check_finite=False)
    same = torch.ones(1, 2, 6, dtype=torch.bool)
    same[0, 1, 2] = False
    assert torch.equal(c1[same], c2[same])  # the packed rows hold the scales too
    assert not torch.equal(c1[~same], c2[~same])


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
    codes, rec = encode(k_all, sec, cfg.radius_bits, thr)
    K_ref = kvq.hqmq_decode(codes, sec, rec, cfg.radius_bits, D, k_all.dtype)
    assert torch.equal(K, K_ref)
    layer1 = cache.layers[1]
    assert torch.equal(layer1.key.codes.view(), codes)  # the stream's packed rows = one encode
    assert not hasattr(layer1.key, "scale")
    assert torch.equal(layer1.key.secondary, sec)
    assert not torch.equal(layer1.key.secondary, layer1.value.secondary)
    assert not torch.equal(cache.layers[0].key.secondary, sec)
    if cfg.outlier_factor:
        assert layer1.key.outliers.length == rec.shape[0] > 0
    assert V.shape == (B, H, 20, D)
    rel = (K.float() - k_all.float()).norm() / k_all.float().norm()
    assert rel < 0.2
    n = cache.nbytes
    U = kvq.ops.hqmq_units(D, cfg.secondary_size, cfg.radius_bits)
    assert n >= 2 * 2 * B * H * 20 * 2 * U
    # state dict round trip
    sd = cache.state_dict()
    assert not any(k.endswith(".scale") for k in sd)  # the scales live in the packed rows
    assert sd["layers.1.key.codes"].dtype == torch.int16 and sd["layers.1.key.codes"].shape[-1] == U
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
    codes, rec = encode(x, sec, 4, thr)
    assert rec.shape[0] > 0
    torch.library.opcheck(torch.ops.kvq.hqmq_decode.default,
                          (codes, sec, rec, 4, 128, torch.float16))


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
    assert torch.equal(cpu[0], gpu[0].cpu())  # packed rows (codes and scales) bit-identical
    assert torch.equal(cpu[1], gpu[1].cpu())  # outlier records
    if T:
        dirs, rc, scale = ref.unpack_rows(gpu[0].cpu(), D, S, rb)
        _, rc_ref, sc_ref, _ = ref.encode_reference(x, sec, rb, thr)
        assert torch.equal(rc, rc_ref) and torch.equal(scale.view(torch.int16), sc_ref.view(torch.int16))
        best, _ = ref.brute_force_best(x, sec) if S <= 192 else (None, None)
        if best is not None:
            chosen = ref.chosen_score(x, sec, dirs)
            ok = (best - chosen) <= 2e-6 * ref.chunk_norms(x) + 1e-12
            if thr is not None:  # Med3x chunks are stored exactly; their direction field is 0
                ok |= ref.chunk_norms(x) > thr.double().view(1, H, 1, 1) * (1 - 1e-6)
            assert ok.all()
    y_cpu = kvq.hqmq_decode(cpu[0], sec, cpu[1], rb, D, dtype)
    y_gpu = kvq.hqmq_decode(cpu[0].cuda(), sec.cuda(), cpu[1].cuda(), rb, D, dtype)
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
            ref.unpack_rows(gpu[0].cpu(), 128, S, 4, strict=True)  # canonical rows


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
    codes, rec = encode(x, sec, 4)
    torch.library.opcheck(torch.ops.kvq.hqmq_decode.default,
                          (codes, sec, rec, 4, 128, torch.float16))
    # a chunk norm above 61440 (entries within fp16) is refused on the GPU as on the CPU
    xb = torch.zeros_like(x)
    xb[0, 1, 2, :4] = 30752.0  # norm 61504
    with pytest.raises(RuntimeError, match="'x'.*61440"):
        encode(xb, sec, 4)
    assert torch.equal(encode(xb, sec, 4, check_finite=False)[0].cpu(),
                       encode(xb.cpu(), sec.cpu(), 4, check_finite=False)[0])


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
        codes, rec = kvq.hqmq_encode(x, sec, 4, thr)
        return kvq.hqmq_decode(codes, sec, rec, 4, 128, torch.float16)

    f = torch.compile(roundtrip, backend="aot_eager")
    assert torch.equal(f(x, sec, thr), roundtrip(x, sec, thr))


def test_magnitude_limit_is_the_chunk_norm():
    """Without Med3x the bound is kvq.hqmq.MAX_SCALE, a chunk norm <= 61440: a token whose
    chunk norm exceeds it is refused with a message saying so (the cache used to store NaN), while
    entries up to that norm are accepted; hqmq-5 stores such chunks exactly."""
    assert kvq.hqmq.MAX_SCALE == 61440.0
    assert kvq.get_config("hqmq-3.79-paper").new_stream("key").max_abs == 61440.0
    for big in (40000.0, 30752.0):  # chunk norms 80000 and 61504 (between 61440 and 65504)
        x = torch.randn(1, 2, 40, 64, dtype=torch.float16)
        x[0, 0, 3, 4:8] = big  # entries < 65504
        cache = kvq.KVCache("hqmq-3.79-paper")
        with pytest.raises(ValueError, match="4-element chunks with norm above 61440"):
            cache.update(x, x, 0)
        assert cache.get_seq_length(0) == 0
        with pytest.raises(RuntimeError, match="chunk whose norm exceeds 61440"):
            kvq.compress(x, "hqmq-3.79-paper", "key")
        c5 = kvq.KVCache("hqmq-5")
        c5.update(x, x, 0)
        K, _ = c5.dequantize(0)
        assert torch.equal(K[0, 0, 3, 4:8], x[0, 0, 3, 4:8])
    cache = kvq.KVCache("hqmq-3.79-paper")
    ok = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    ok[0, 0, 3, 5] = 60000.0  # one large entry: chunk norm below the limit
    ok[0, 1, 7, 8:12] = 30720.0  # chunk norm exactly 61440
    cache.update(ok, ok, 0)
    K, _ = cache.dequantize(0)
    assert torch.isfinite(K).all()
    assert float(K[0, 1, 7, 8:12].float().norm()) == pytest.approx(61440.0, rel=2e-3)
