"""kvq.quantize / kvq.dequantize against the plain-PyTorch reference, on CPU and CUDA."""
import pytest
import torch

import kvquant_ext as kvq
from conftest import BITS, CUDA, DTYPES, HEAD_DIMS, MMA_HEAD_DIMS, requires_cuda
from reference.quant_reference import (dequantize_ref, expand_scale, pack_ref, quantize_ref,
                                       unpack_ref)

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])


def make_kv(B, H, T, D, dtype, device="cpu", outlier_channels=True):
    """Random cache-like data: heavy-tailed, with a few outlier channels (like real keys)."""
    x = torch.randn(B, H, T, D) * (1 + torch.rand(B, H, 1, D))
    if outlier_channels and D >= 8:
        x[..., ::17] *= 8.0
    x = x + torch.randn(B, H, 1, D)  # per-channel offsets
    return x.to(dtype).to(device)


def check_against_ref(x, bits, G, per_channel, codes, scale, zero):
    rc, rs, rz = quantize_ref(x.cpu(), bits, G, per_channel)
    # scale/zero bit-identical to the reference (same fp16 directed rounding)
    assert torch.equal(scale.cpu().view(torch.int16), rs.view(torch.int16))
    assert torch.equal(zero.cpu().view(torch.int16), rz.view(torch.int16))
    mine = unpack_ref(codes.cpu(), bits)
    diff = (mine - rc).abs()
    assert diff.max() <= 1, "codes differ from the reference by more than 1"
    assert (diff > 0).float().mean() < 1e-3, "too many rounding-tie differences"
    # error bound: every entry within half a quantization step of its group
    deq = dequantize_ref(mine, scale.cpu(), zero.cpu(), per_channel)
    s = expand_scale(scale.cpu(), mine.shape, per_channel)
    err = (deq - x.cpu().float()).abs()
    tol = s / 2 * (1 + 1e-5) + 1e-6 * x.cpu().float().abs()
    assert (err <= tol).all(), f"max excess {(err - tol).max()}"
    return mine


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("per_channel,G", [(True, 32), (True, -1), (False, 32), (False, -1), (False, 64)])
def test_quantize_matches_reference(device, dtype, bits, D, per_channel, G):
    T = 64 if per_channel else 17
    x = make_kv(2, 3, T, D, dtype, device)
    codes, scale, zero = kvq.quantize(x, bits, G, per_channel)
    assert codes.shape == (2, 3, T, D * bits // 32) and codes.dtype == torch.int32
    ng = (T // (T if G == -1 else G)) if per_channel else None
    assert scale.shape == ((2, 3, ng, D) if per_channel else (2, 3, T, D // (D if G == -1 else G)))
    assert scale.dtype == zero.dtype == torch.float16
    mine = check_against_ref(x, bits, G, per_channel, codes, scale, zero)
    # packed layout is exactly LSB-first along D
    assert torch.equal(codes.cpu(), pack_ref(mine, bits))
    out = kvq.dequantize(codes, scale, zero, bits, per_channel, dtype)
    assert out.dtype == dtype and out.shape == x.shape and out.device == x.device
    expect = dequantize_ref(mine, scale.cpu(), zero.cpu(), per_channel).to(dtype)
    torch.testing.assert_close(out.cpu(), expect, rtol=0, atol=0) if device == "cpu" else \
        torch.testing.assert_close(out.cpu().float(), expect.float(), rtol=2e-3, atol=1e-5)


@pytest.mark.parametrize("T", [1, 17, 1025])
@pytest.mark.parametrize("dtype", DTYPES)
def test_odd_token_counts(T, dtype):
    x = make_kv(1, 2, T, 128, dtype)
    for bits in BITS:
        # per-token: any T
        c, s, z = kvq.quantize(x, bits, 32, False)
        check_against_ref(x, bits, 32, False, c, s, z)
        # per-channel whole axis (KCVT): any T
        c, s, z = kvq.quantize(x, bits, -1, True)
        assert s.shape == (1, 2, 1, 128)
        check_against_ref(x, bits, -1, True, c, s, z)


def test_empty_and_single_token():
    x = torch.randn(2, 2, 0, 64)
    c, s, z = kvq.quantize(x, 2, 32, True)
    assert c.shape == (2, 2, 0, 4) and s.shape == (2, 2, 0, 64)
    assert kvq.dequantize(c, s, z, 2, True, torch.float32).shape == (2, 2, 0, 64)
    c, s, z = kvq.quantize(x, 4, 32, False)
    assert kvq.dequantize(c, s, z, 4, False, torch.float32).shape == (2, 2, 0, 64)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("per_channel", [True, False])
def test_non_contiguous_input(device, per_channel):
    base = torch.randn(2, 64, 4, 128, dtype=torch.float16, device=device)  # [B, T, H, D]
    x = base.transpose(1, 2)  # [B, H, T, D], non-contiguous
    assert not x.is_contiguous()
    c1, s1, z1 = kvq.quantize(x, 4, 32, per_channel)
    c2, s2, z2 = kvq.quantize(x.contiguous(), 4, 32, per_channel)
    assert torch.equal(c1, c2) and torch.equal(s1, s2) and torch.equal(z1, z2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_constant_groups_dequantize_exactly(device, dtype, bits):
    # constants representable in fp16 (the storage type of zero points)
    vals = torch.tensor([0.0, -3.5, 1.25, 1000.0, -0.0078125])
    xc = vals[torch.randint(0, len(vals), (1, 2, 1, 128))].expand(1, 2, 64, 128)  # per channel
    xt = vals[torch.randint(0, len(vals), (1, 2, 64, 4))].repeat_interleave(32, dim=-1)  # per token group
    for per_channel, G, x in [(True, 32, xc), (False, 32, xt)]:
        x = x.to(dtype).to(device)
        c, s, z = kvq.quantize(x, bits, G, per_channel)
        out = kvq.dequantize(c, s, z, bits, per_channel, dtype)
        assert torch.equal(out, x)
        assert (s == 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_saturation_extremes(device):
    # groups spanning the whole fp16 range quantize without overflow
    x = torch.randn(1, 1, 32, 64, device=device) * 100
    x[0, 0, 0, :] = 65504.0
    x[0, 0, 1, :] = -65504.0
    for bits in BITS:
        c, s, z = kvq.quantize(x, bits, 32, True)
        check_against_ref(x, bits, 32, True, c, s, z)
        assert torch.isfinite(kvq.dequantize(c, s, z, bits, True, torch.float32)).all()


# ----------------------------------------------------------------------------- bad input
def test_declared_sets_are_what_the_checks_accept():
    """kvq.HEAD_DIMS / kvq.BITS / kvq.DTYPES (the build's declared sets) are exactly what the C++
    argument checks of kvq.quantize and the Python QuantSpec accept."""
    assert set(kvq.MMA_HEAD_DIMS) <= set(kvq.HEAD_DIMS)
    for D in range(4, 516, 4):
        x = torch.randn(1, 1, 2, D)
        if D in kvq.HEAD_DIMS:
            kvq.quantize(x, 2, -1, False)
        else:
            with pytest.raises(RuntimeError, match="'x'.*head.*dimension"):
                kvq.quantize(x, 2, -1, False)
    x = torch.randn(1, 1, 2, 64)
    for bits in range(0, 17):
        if bits in kvq.BITS:
            kvq.quantize(x, bits, -1, False)
            kvq.QuantSpec(bits, -1, False)
        else:
            with pytest.raises(RuntimeError, match="'bits'"):
                kvq.quantize(x, bits, -1, False)
            with pytest.raises(ValueError, match="'bits'"):
                kvq.QuantSpec(bits, -1, False)
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32):
        if dtype in kvq.DTYPES:
            kvq.quantize(x.to(dtype), 2, -1, False)
        else:
            with pytest.raises(RuntimeError, match="'x'.*must be"):
                kvq.quantize(x.to(dtype), 2, -1, False)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_input_errors(device):
    x = torch.randn(1, 2, 64, 128, device=device)
    with pytest.raises(RuntimeError, match="'x'.*float16, bfloat16 or float32"):
        kvq.quantize(x.to(torch.int32), 2, 32, True)
    with pytest.raises(RuntimeError, match="'x'.*at least 2 dimensions"):
        kvq.quantize(x[0, 0, 0], 2, 32, True)
    with pytest.raises(RuntimeError, match="'bits'.*2, 4 or 8"):
        kvq.quantize(x, 3, 32, True)
    with pytest.raises(RuntimeError, match="'group_size'.*multiple"):
        kvq.quantize(x, 2, 48, False)
    with pytest.raises(RuntimeError, match="'group_size'.*token count"):
        kvq.quantize(x[:, :, :50], 2, 32, True)
    with pytest.raises(RuntimeError, match="'group_size'.*positive"):
        kvq.quantize(x, 2, 0, True)
    with pytest.raises(RuntimeError, match="'x'.*head\\) dimension"):
        kvq.quantize(torch.randn(1, 1, 32, 96, device=device), 2, 32, True)
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[0, 1, 5, 7] = bad
        with pytest.raises(RuntimeError, match="'x' contains NaN or Inf"):
            kvq.quantize(y, 2, 32, True)
    with pytest.raises(RuntimeError, match="65504"):
        kvq.quantize(x * 1e6, 4, 32, False)
    c, s, z = kvq.quantize(x, 2, 32, True)
    with pytest.raises(RuntimeError, match="'dtype'"):
        kvq.dequantize(c, s, z, 2, True, torch.int8)
    with pytest.raises(RuntimeError, match="'scale'.*dtype"):
        kvq.dequantize(c, s.float(), z, 2, True, torch.float16)
    with pytest.raises(RuntimeError, match="'zero'.*shape"):
        kvq.dequantize(c, s, z[:, :1], 2, True, torch.float16)


def test_nan_with_check_disabled_spoils_only_its_group():
    x = make_kv(1, 1, 64, 128, torch.float32)
    y = x.clone()
    y[0, 0, 3, 10] = float("inf")
    for per_channel in (True, False):
        c, s, z = kvq.quantize(y, 4, 32, per_channel, check_finite=False)
        c0, s0, z0 = kvq.quantize(x, 4, 32, per_channel)
        out = kvq.dequantize(c, s, z, 4, per_channel, torch.float32)
        ref = kvq.dequantize(c0, s0, z0, 4, per_channel, torch.float32)
        same = out == ref
        if per_channel:  # group = tokens 0..31 of channel 10
            same[0, 0, 0:32, 10] = True
        else:  # group = channels 0..31 of token 3
            same[0, 0, 3, 0:32] = True
        assert same.all()


@requires_cuda
def test_cpu_cuda_mismatch_errors():
    c, s, z = kvq.quantize(torch.randn(1, 1, 32, 64), 2, 32, True)
    with pytest.raises(RuntimeError, match="'scale' is on"):
        kvq.dequantize(c.cuda(), s, z, 2, True, torch.float16)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("per_channel,G", [(True, 32), (True, 128), (True, -1), (False, 32), (False, -1)])
def test_cuda_equals_cpu(dtype, bits, per_channel, G):
    x = make_kv(3, 4, 1024, 128, dtype)
    c1, s1, z1 = kvq.quantize(x, bits, G, per_channel)
    c2, s2, z2 = kvq.quantize(x.cuda(), bits, G, per_channel)
    assert torch.equal(s1, s2.cpu()) and torch.equal(z1, z2.cpu())
    d = (unpack_ref(c1, bits) - unpack_ref(c2.cpu(), bits)).abs()
    assert d.max() <= 1 and (d > 0).float().mean() < 1e-4
    o1 = kvq.dequantize(c2.cpu(), s2.cpu(), z2.cpu(), bits, per_channel, dtype)
    o2 = kvq.dequantize(c2, s2, z2, bits, per_channel, dtype)
    torch.testing.assert_close(o2.cpu().float(), o1.float(), rtol=2e-3, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("T", [1, 17, 1025])
@pytest.mark.parametrize("D", [32, 64, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("bits", BITS)
def test_cuda_per_token_odd_shapes_equal_cpu(T, D, dtype, bits):
    """Per-token kernels (chunk-per-lane for G % 32 == 0, warp-per-row otherwise) on row counts
    that leave a partial last warp, every head dim, G = 32, 64 and the whole row."""
    x = make_kv(3, 1, T, D, dtype)
    for G in sorted({32, 64, D} & set(range(1, D + 1))):
        if D % G:
            continue
        c1, s1, z1 = kvq.quantize(x, bits, G, False)
        c2, s2, z2 = kvq.quantize(x.cuda(), bits, G, False)
        assert torch.equal(s1, s2.cpu()) and torch.equal(z1, z2.cpu()), G
        d = (unpack_ref(c1, bits) - unpack_ref(c2.cpu(), bits)).abs()
        assert d.max() <= 1 and (d > 0).float().mean() < 1e-3, G


# ----------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    x = make_kv(2, 2, 64, 128, torch.float16, device)
    for per_channel in (True, False):
        torch.library.opcheck(torch.ops.kvq.quantize.default, (x, 4, 32, per_channel, True))
        c, s, z = kvq.quantize(x, 4, 32, per_channel)
        torch.library.opcheck(torch.ops.kvq.dequantize.default, (c, s, z, 4, per_channel, torch.float16))


def test_torch_compile_smoke():
    def f(x):
        c, s, z = kvq.quantize(x, 2, 32, True)
        return kvq.dequantize(c, s, z, 2, True, x.dtype) - x

    x = make_kv(1, 2, 64, 64, torch.float32)
    out = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    torch.testing.assert_close(out, f(x))


# ----------------------------------------------------------------------------- per-channel kernels
# The CUDA per-channel quantize picks one of three kernels from (dtype, D, G): the tile kernel
# (a thread owns 16 bytes of channels and 8 tokens; G % 8 == 0 and G / 8 * D / (16 / itemsize)
# a whole number of warps <= 512 threads), the split-T kernels (G >= 256 otherwise: KCVT), or the
# block-per-group kernel (everything else).  Codes, scales and zeros must equal the CPU op's.
def _quantize_both(x, bits, G, check_finite=True):
    c1, s1, z1 = kvq.quantize(x, bits, G, True, check_finite=check_finite)
    c2, s2, z2 = kvq.quantize(x.cuda(), bits, G, True, check_finite=check_finite)
    assert torch.equal(s1.view(torch.int16), s2.cpu().view(torch.int16)), "scale bits differ"
    assert torch.equal(z1.view(torch.int16), z2.cpu().view(torch.int16)) or torch.equal(z1, z2.cpu()), \
        "zero differs"
    assert torch.equal(c1, c2.cpu()), "codes differ"
    return c2, s2, z2


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("G", [8, 16, 24, 32, 64, 128, 256, 512])
def test_cuda_per_channel_equals_cpu(dtype, bits, D, G):
    x = make_kv(3, 1, 3 * G, D, dtype)
    c2, s2, z2 = _quantize_both(x, bits, G)
    o1 = kvq.dequantize(c2.cpu(), s2.cpu(), z2.cpu(), bits, True, dtype)
    o2 = kvq.dequantize(c2, s2, z2, bits, True, dtype)
    torch.testing.assert_close(o2.cpu().float(), o1.float(), rtol=2e-3, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("T", [1, 17, 255, 256, 1025, 4096, 5137])
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_kcvt_equals_cpu(T, D, dtype, bits):
    """Whole-channel groups (G = T): split-T min/max partials + re-read for T >= 256."""
    x = make_kv(2, 2, T, D, dtype)
    x[0, 1, T // 2, 3] = 40.0  # one extreme inside a middle chunk
    c2, s2, z2 = _quantize_both(x, bits, -1)
    assert s2.shape == (2, 2, 1, D)
    o1 = kvq.dequantize(c2.cpu(), s2.cpu(), z2.cpu(), bits, True, dtype)
    o2 = kvq.dequantize(c2, s2, z2, bits, True, dtype)
    torch.testing.assert_close(o2.cpu().float(), o1.float(), rtol=2e-3, atol=1e-5)


@requires_cuda
@pytest.mark.parametrize("G,T", [(32, 64), (128, 256), (-1, 1025), (-1, 17)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_per_channel_status(G, T, dtype):
    x = make_kv(2, 3, T, 128, dtype, "cuda")
    for bad in (float("nan"), float("inf")):
        y = x.clone()
        y[1, 2, T - 1, 127] = bad
        with pytest.raises(RuntimeError, match="'x' contains NaN or Inf"):
            kvq.quantize(y, 4, G, True)
    if dtype == torch.float32:
        with pytest.raises(RuntimeError, match="65504"):
            kvq.quantize(x * 1e6, 4, G, True)
    # check off: a non-finite entry spoils only its own group (same as the CPU op)
    y = x.clone()
    y[0, 1, T // 2, 10] = float("inf")
    _quantize_both(y.cpu(), 4, G, check_finite=False)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_per_channel_constant_groups(dtype, bits):
    vals = torch.tensor([0.0, -3.5, 1.25, 1000.0, -0.0078125])
    for G, T in [(32, 64), (-1, 512)]:
        x = vals[torch.randint(0, len(vals), (1, 2, 1, 128))].expand(1, 2, T, 128).to(dtype)
        c, s, z = _quantize_both(x, bits, G)
        assert (s == 0).all()
        assert torch.equal(kvq.dequantize(c, s, z, bits, True, dtype).cpu(), x)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
def test_cuda_per_channel_dequantize_unaligned_scale(dtype, bits, D):
    """scale / zero views not 16-byte aligned take the warp-per-row dequantize kernel."""
    x = make_kv(2, 2, 96, D, dtype)
    c, s, z = kvq.quantize(x, bits, 32, True)
    ref = kvq.dequantize(c, s, z, bits, True, dtype)

    def shifted(t):
        buf = torch.empty(t.numel() + 1, dtype=t.dtype, device="cuda")
        v = buf[1:].view(t.shape)
        v.copy_(t)
        return v

    ss, zs = shifted(s), shifted(z)
    assert ss.data_ptr() % 16 != 0
    out = kvq.dequantize(c.cuda(), ss, zs, bits, True, dtype)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-3, atol=1e-5)
    out = kvq.dequantize(c.cuda(), s.cuda(), z.cuda(), bits, True, dtype)
    torch.testing.assert_close(out.cpu().float(), ref.float(), rtol=2e-3, atol=1e-5)


# ----------------------------------------------------------------------------- per-token kernels (v7)
# Per-token quantize with G % 32 == 0 runs the tile kernel (a warp stages 32 chunks of 32 channels
# through shared memory with cp.async; fast path without clamps when its tile is finite and within
# fp16 range, the CPU op's arithmetic otherwise); G = 8 / 16 run the warp-per-row kernel.  Per-token
# dequantize runs the thread-per-16-bytes kernel.  Codes, scales, zeros and dequantized values must
# equal the CPU op's exactly (code * scale is exact in fp32, so fmaf == the CPU's mul + add).
def _per_token_both(x, bits, G, check_finite=True):
    c1, s1, z1 = kvq.quantize(x, bits, G, False, check_finite=check_finite)
    c2, s2, z2 = kvq.quantize(x.cuda(), bits, G, False, check_finite=check_finite)
    assert torch.equal(s1, s2.cpu()), "scale differs"
    assert torch.equal(z1, z2.cpu()), "zero differs"
    assert torch.equal(c1, c2.cpu()), "codes differ"
    dtype = x.dtype
    o1 = kvq.dequantize(c1, s1, z1, bits, False, dtype)
    o2 = kvq.dequantize(c2, s2, z2, bits, False, dtype)
    o2 = o2.cpu()
    nan = o1.isnan()
    assert torch.equal(nan, o2.isnan()) and torch.equal(o1[~nan], o2[~nan]), "dequantize differs"
    return c2, s2, z2


@requires_cuda
@pytest.mark.parametrize("T", [1, 17, 255, 1025])
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_per_token_exact(T, D, dtype, bits):
    x = make_kv(3, 2, T, D, dtype)
    for G in (8, 16, 32, 64, 128, D):
        if G <= D and D % G == 0:
            _per_token_both(x, bits, G)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_cuda_per_token_many_tiles_per_warp(dtype, bits):
    """More 32-chunk tiles than resident warps (each warp loops, double-buffered), partial last tile."""
    x = make_kv(2, 8, 4099, 128, dtype)
    for G in (32, 128):
        _per_token_both(x, bits, G)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [32, 64, 128])
def test_cuda_per_token_nonfinite_check_off(dtype, G):
    """NaN / Inf / out-of-range tiles take the exact fallback; other tiles the fast path."""
    x = make_kv(2, 3, 300, 128, dtype)
    x[0, 0, 5, 7] = float("nan")
    x[0, 1, 17, 64] = float("inf")
    x[1, 2, 299, 127] = -float("inf")
    x[1, 0, 100, 0:128:16] = float("nan")
    if dtype != torch.float16:
        x[1, 1, 50, 3] = 1e6  # finite, beyond fp16 range
        x[1, 1, 51, 40] = -1e6
    for bits in BITS:
        _per_token_both(x, bits, G, check_finite=False)


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [16, 32, 128])
def test_cuda_per_token_status(dtype, G):
    x = make_kv(2, 3, 77, 128, dtype, "cuda")
    for bad in (float("nan"), float("inf"), -float("inf")):
        y = x.clone()
        y[1, 2, 76, 127] = bad
        with pytest.raises(RuntimeError, match="'x' contains NaN or Inf"):
            kvq.quantize(y, 4, G, False)
    if dtype != torch.float16:
        y = x.clone()
        y[0, 0, 3, 5] = 1e6
        with pytest.raises(RuntimeError, match="65504"):
            kvq.quantize(y, 4, G, False)
    kvq.quantize(x, 4, G, False)  # clean input: no error


@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", BITS)
def test_cuda_per_token_constant_and_extreme_groups(dtype, bits):
    # constants representable in fp16 and bf16 (the extremes stay below 65504 after bf16 rounding)
    vals = torch.tensor([0.0, -3.5, 1.25, 1000.0, -0.0078125, 60000.0, -60000.0])
    x = vals[torch.randint(0, len(vals), (2, 2, 40, 8))].repeat_interleave(32, dim=-1).to(dtype)
    x[1, 1, 7, :] = torch.linspace(-60000, 60000, 256).to(dtype)  # near-full-range groups
    for G in (32, 64, 256):
        c, s, z = _per_token_both(x, bits, G)
    c, s, z = kvq.quantize(x.cuda(), bits, 32, False)
    out = kvq.dequantize(c, s, z, bits, False, dtype)
    const = (s == 0).repeat_interleave(32, dim=-1)
    assert torch.equal(out[const].cpu(), x[const.cpu()])


@requires_cuda
def test_cuda_per_token_non_contiguous_exact():
    base = make_kv(2, 4, 96, 128, torch.bfloat16).transpose(1, 2).contiguous().transpose(1, 2)
    assert not base.is_contiguous()
    for bits in BITS:
        _per_token_both(base, bits, 32)


# ----------------------------------------------------------------------------- KCVT cluster kernel
# Per-channel groups of >= 256 tokens that the tile kernel does not take run one thread-block
# cluster per group (8 CTAs, each holding G / 8 tokens in shared memory, min/max reduced through
# distributed shared memory) while a chunk fits in 200 KB, else the split-T kernels.  Both must
# equal the CPU op exactly.
@requires_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [2, 4])
def test_cuda_kcvt_many_items_per_block(dtype, bits):
    """Many groups (more clusters than fit at once); extremes in the last CTA's short chunk
    (4100 = 7 x 513 + 509 tokens); fp32 takes the split path (chunk above 200 KB)."""
    x = make_kv(4, 6, 4100, 128, dtype)
    x[1, 2, 4099, 5] = 30.0  # extreme in the partial last chunk
    x[3, 5, 0, 127] = -30.0
    _quantize_both(x, bits, -1)


@requires_cuda
@pytest.mark.parametrize("D", [32, 64, 256])
def test_cuda_kcvt_head_dims(D):
    x = make_kv(3, 2, 3001, D, torch.float16)
    for bits in BITS:
        _quantize_both(x, bits, -1)


@requires_cuda
@pytest.mark.parametrize("T", [8192, 6401])
def test_cuda_kcvt_long_groups_take_the_split_path(T):
    """fp16, D = 128: T = 8192 (1024 tokens per CTA, 256 KB) and 6401 (801 tokens, 200.3 KB) do
    not fit the cluster kernel's chunk; both must still equal the CPU op."""
    x = make_kv(1, 3, T, 128, torch.float16)
    x[0, 1, T - 1, 7] = 25.0
    x[0, 2, 0, 64] = -25.0
    for bits in (2, 4):
        _quantize_both(x, bits, -1)


@requires_cuda
@pytest.mark.parametrize("T", [264, 520, 6400])
def test_cuda_kcvt_cluster_chunk_edges(T):
    """Short chunks (264 = 8 x 33 tokens, 520 = 8 x 65: not multiples of the 16 token slices)
    and the largest chunk that fits (6400: 800 tokens, 200 KB)."""
    x = make_kv(2, 2, T, 128, torch.float16)
    x[1, 0, T // 2, 3] = 40.0
    for bits in BITS:
        _quantize_both(x, bits, -1)


@requires_cuda
def test_cuda_kcvt_graph_capture_matches_eager():
    """The KCVT kernels are launched the same way inside stream capture."""
    x = make_kv(2, 4, 2048, 128, torch.float16, "cuda")
    ref = kvq.quantize(x, 2, -1, True, check_finite=False)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kvq.quantize(x, 2, -1, True, check_finite=False)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kvq.quantize(x, 2, -1, True, check_finite=False)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, ref):
        assert torch.equal(a, b)
