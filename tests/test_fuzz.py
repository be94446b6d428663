"""Property-based fuzzing (hypothesis) of the public API against the bad-input and accuracy
contract of docs/design.md and the layouts of docs/ops.md.

Inputs are drawn over B in 1..3, H in 1..4, T in 0..200 (0, 1 and odd counts included), every
head dim of the build, every dtype, every preset and every bit width / grouping of the raw op;
contiguous and strided storage (transposed, every other token, a channel slice of wider rows,
channel-major rows; the storage outside the view is NaN, so a read outside it shows); largest
magnitudes from 1e-4 to 6e4; constant groups, +0 / -0 and sprinkled NaN / +-Inf (with
``check_finite`` True and False).  Every example either raises a ValueError / RuntimeError /
TypeError / NotImplementedError whose message names an argument the caller passed (IndexError
for an out-of-range layer index), changing nothing, or returns a result within the method's
bound.  The bounds are the methods' own per-entry / per-matrix / per-chunk guarantees computed
from the stored scales, which are themselves checked against the reference, so a wrong scale,
code, grouping or decode shows:

* ``kvq.quantize`` / ``kvq.dequantize``: scale and zero bit-identical to
  tests/reference/quant_reference.py (a -0 minimum stored as +0), codes within one of it
  (rounding ties), every entry within ``scale/2`` of its input (+ the fp32 rounding of the code
  choice and of ``code*scale + zero``), the dtype output one rounding of the fp32 one, constant
  groups of an fp16 number exact with scale 0, strided input identical to contiguous.
* ``kvq.compress(x, preset, role)``: fp16 exact; group quantization within ``scale/2`` per
  entry; GEAR outliers exact and, per ``[T, D]`` matrix, ``||x - x^||_F <= ||scale/2||_F`` (the
  low-rank part is a projection of the backbone residual, so it never adds error); HQMQ per
  4-element chunk ``||x - x^|| <= sqrt(2 - sqrt 2) ||x|| + step/2`` (the 24 Hurwitz units of any
  secondary lie within 45 degrees of every direction; ``step = scale / (2^b_r - 1)``), radius
  scales, secondary sets, Med3x threshold and exact outlier chunks as documented; key tokens
  past the last whole group exact.  ``nbytes`` is the sum of the stored tensors and equals the
  layout's count.  A block the format cannot store (GEAR factors beyond fp16, HQMQ coded chunk
  norms beyond 61440, kvq.hqmq.MAX_SCALE) may be refused, naming 'x'.
* Non-finite entries: ``check_finite=True`` raises naming the argument; with ``False`` every
  entry outside the bad entries' own groups (HQMQ: chunk for NaN, token vector for Inf) is what
  the clean input gives (group quantization: bit for bit; HQMQ without Med3x: other tokens bit
  for bit) and within the family's bound (GEAR, HQMQ).
* ``kvq.KVCache`` appended in random chunk sizes (a recent window drawn now and then where the
  configs have one): ``dequantize`` equals whole-block op calls on the blocks the method's
  streaming rule forms (KIVI residual / flush, GEAR prefill + buffer blocks, HQMQ per token
  with the prefill's Med3x threshold), bit for bit; ``nbytes`` is the sum of the stored tensors
  and equals the layout's count, and never decreases without a full-precision window; the
  compressed part never shrinks; growable buffers hold at most twice what they use;
  ``state_dict`` / ``load_state_dict`` round-trips bit-exactly and the loaded cache continues
  identically; NaN/Inf updates are refused without a change (or, with check_finite=False,
  stored as the reference stores them).
* ``kvq.decode_attention`` equals fp32 softmax attention over the cache's own
  ``dequantize(layer)`` up to float rounding (a bound from the dtype's unit roundoff), for GQA
  groups 1..17, masks, 3-d and 4-d queries and a query dtype other than the cache's.
* ``kvq.PagedKVCache`` (fp16, the group-quantization presets, HQMQ without Med3x): a sequence's
  K/V are its whole pages quantized page by page (HQMQ: encoded token by token) plus an exact tail, ``nbytes`` counts pages and tail, decode
  attention and its log-sum-exp equal fp32 attention over ``dequantize``, freeing a sequence
  leaves the others intact; GEAR and HQMQ with Med3x outliers raise NotImplementedError naming
  the config.

What the fuzzing found is pinned by the deterministic regression tests at the end of the file;
the strategies leave out the inputs those cover: GEAR magnitudes near the fp16 limit
(``top_magnitude``), the NaN check of ``compress(x, "fp16")``, and head dims a config's groups
do not divide in a cache.

``KVQ_FUZZ_EXAMPLES`` raises every test's number of examples (e.g. 500 for a long run).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import kvquant_ext as kvq
from conftest import BITS, DTYPES, HEAD_DIMS
from kvquant_ext.gear import GEARCompressed, GEARStream
from kvquant_ext.hqmq import HQMQStream
from kvquant_ext.streams import FullPrecisionStream, Growable, _QuantStream
from reference import hqmq_reference as hq_ref
from reference.quant_reference import expand_scale, kivi_stream_ref, quantize_ref, unpack_ref

# ----------------------------------------------------------------------------- settings
EXAMPLES = int(os.environ.get("KVQ_FUZZ_EXAMPLES", "0"))
settings.register_profile(
    "kvq-fuzz", derandomize=True, deadline=None, database=None, print_blob=True,
    # the autouse seed fixture of conftest.py is function-scoped; the tests draw from their
    # own torch.Generator, so it does not matter that it runs once per test, not per example
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                           HealthCheck.function_scoped_fixture])


def fuzz(n: int):
    """The file's profile with ``n`` examples (or KVQ_FUZZ_EXAMPLES, if larger)."""
    return settings(settings.get_profile("kvq-fuzz"), max_examples=max(n, EXAMPLES))


pytestmark = pytest.mark.filterwarnings("ignore:kvq.decode_attention. no fused kernel")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread while fuzzing (restored afterwards): the examples are small, and on a
    2-core machine shared with other jobs a thread pool's wake-ups and spinning cost more than
    the ops themselves (~15x here).  Results do not depend on the thread count."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


PRESETS = list(kvq.PRESETS)
GROUP_PRESETS = [p for p, c in kvq.PRESETS.items() if isinstance(c, kvq.GroupQuantBase)]
PAGED_PRESETS = ["fp16"] + GROUP_PRESETS
ROLES = ("key", "value")
ALLOWED = (ValueError, RuntimeError, TypeError, NotImplementedError)
# unit roundoff of each dtype (half an ulp, relative)
UNIT = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8, torch.float32: 2.0 ** -24}
# half the smallest subnormal: the absolute rounding error below the normal range
TINY = {torch.float16: 2.0 ** -25, torch.bfloat16: 2.0 ** -134, torch.float32: 2.0 ** -150}
# the 24 Hurwitz units are within 45 degrees of any direction: ||u - c|| <= sqrt(2 - sqrt(2))
HURWITZ_DIST = math.sqrt(2.0 - math.sqrt(2.0))


# ----------------------------------------------------------------------------- helpers
@contextlib.contextmanager
def raises_naming(*names, types=ALLOWED):
    """The block raises one of ``types`` whose message quotes one of the argument ``names``."""
    with pytest.raises(types) as info:
        yield info
    msg = str(info.value)
    assert any(f"'{n}'" in msg for n in names), f"error does not name any of {names}: {msg!r}"


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (NaN == NaN; -0 != +0)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.dtype.is_floating_point:
        view = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


def same_values(a: torch.Tensor, b: torch.Tensor, where=None) -> bool:
    """Equal values (NaN == NaN, -0 == +0), optionally only where ``where`` is True."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    eq = (a == b) | (torch.isnan(a) & torch.isnan(b))
    return bool(eq.all()) if where is None else bool(eq[where].all())


def nbytes_of(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def dyadic(mag: float, a: float, b: float) -> float:
    """A constant of about ``mag`` with a 3-bit mantissa: exact in fp16, bf16 and fp32."""
    e = min(max(math.floor(math.log2(mag)) - 3, -14), 12)
    return (1 + int(a * 7)) * 2.0 ** e * (-1 if b < 0.5 else 1)


@dataclass(frozen=True)
class Values:
    """How a tensor's entries are made (drawn by hypothesis, generated by torch)."""

    seed: int
    log_mag: float  # max |x| = 10 ** log_mag
    offsets: bool   # per-channel offsets (keys-like)
    specials: tuple  # (kind, a, b): constant tokens / channels / whole tensor, +-0, extremes
    layout: str


SPECIALS = ("const_token", "const_channel", "const_all", "neg_zero", "zero_token", "extreme")
LAYOUTS = ("contiguous", "transposed", "token_strided", "channel_sliced", "channel_major")
unit = st.floats(0, 1, exclude_max=True)


def values_st(max_log_mag: float = math.log10(6e4), layouts=LAYOUTS):
    return st.builds(Values, seed=st.integers(0, 2 ** 31 - 1),
                     log_mag=st.one_of(st.sampled_from([-4.0, 0.0, max_log_mag]),
                                       st.floats(-4.0, max_log_mag)),
                     offsets=st.booleans(),
                     specials=st.lists(st.tuples(st.sampled_from(SPECIALS), unit, unit),
                                       max_size=3).map(tuple),
                     layout=st.sampled_from(layouts))


def make_tensor(shape, dtype, v: Values, salt: int = 0) -> torch.Tensor:
    """Heavy-tailed cache-like data (random channel scales, optional channel offsets), scaled so
    that max |x| = 10**v.log_mag (<= 6e4), with v.specials applied; contiguous, in ``dtype``."""
    B, H, T, D = shape
    g = torch.Generator().manual_seed(v.seed + 7919 * salt)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x = x * torch.exp(torch.randn((B, H, 1, D), generator=g, dtype=torch.float64))
    if v.offsets:
        x = x + 2 * torch.randn((B, H, 1, D), generator=g, dtype=torch.float64)
    mag = 10.0 ** v.log_mag
    if x.numel():
        x = x * (mag / max(float(x.abs().max()), 1e-30))
    for kind, a, b in v.specials:
        if T == 0:
            break
        t, c = int(a * T), int(b * D)
        const = dyadic(mag, a, b)
        if kind == "const_token":      # constant per-token groups
            x[:, :, t, :] = const
        elif kind == "const_channel":  # constant per-channel groups
            x[:, :, :, c] = const
        elif kind == "const_all":
            x[:] = const
        elif kind == "neg_zero":
            x[:, :, t, c] = -0.0
        elif kind == "zero_token":     # a whole token of signed zeros
            x[:, :, t, :] = -0.0 if b < 0.5 else 0.0
        elif kind == "extreme":
            x[:, :, t, c] = mag if b < 0.5 else -mag
    return x.clamp(-6e4, 6e4).to(dtype)


def with_layout(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in a tensor with the given strides; storage outside the view is NaN."""
    B, H, T, D = x.shape
    full = lambda *s: torch.full(s, float("nan"), dtype=x.dtype)
    if layout == "contiguous":
        return x.clone()
    if layout == "transposed":        # [B, T, H, D] storage (the HF layout)
        y = full(B, T, H, D).transpose(1, 2)
    elif layout == "token_strided":   # every other token of a longer buffer
        y = full(B, H, 2 * T + 1, D)[:, :, 1::2]
    elif layout == "channel_sliced":  # rows of a wider buffer, unaligned start
        y = full(B, H, T, D + 8)[..., 3:3 + D]
    elif layout == "channel_major":   # inner stride T
        y = full(B, H, D, T).transpose(2, 3)
    else:  # pragma: no cover
        raise AssertionError(layout)
    y.copy_(x)
    return y


# non-finite entries and finite ones beyond the fp16 range of scales (Inf once in fp16)
BAD = {"nan": float("nan"), "inf": float("inf"), "-inf": float("-inf"), "big": 1e5, "-big": -1e5}
bad_st = st.lists(st.tuples(st.sampled_from(sorted(BAD)), unit, unit, unit, unit), min_size=1,
                  max_size=4)


def sprinkle(x: torch.Tensor, bad):
    """``x`` with the ``bad`` entries set (positions as fractions of B, H, T, D) and their mask."""
    y, mask = x.clone(), torch.zeros(x.shape, dtype=torch.bool)
    if x.numel() == 0:
        return y, mask
    for kind, *f in bad:
        idx = tuple(int(fi * n) for fi, n in zip(f, x.shape))
        y[idx] = BAD[kind]
        mask[idx] = True
    return y, mask


def group_reduce(x: torch.Tensor, G: int, per_channel: bool, op: str = "amax") -> torch.Tensor:
    """Per entry, ``op`` ("amax" or "any") over the entry's quantization group (G tokens of a
    channel / G channels of a token; -1 the whole axis) of ``x [..., T, D]``."""
    *lead, T, D = x.shape
    if x.numel() == 0:
        return x.clone()
    if per_channel:
        g = T if G == -1 else G
        m = getattr(x.reshape(*lead, T // g, g, D), op)(-2, keepdim=True)
        return m.expand(*lead, T // g, g, D).reshape(x.shape)
    g = D if G == -1 else G
    m = getattr(x.reshape(*lead, T, D // g, g), op)(-1, keepdim=True)
    return m.expand(*lead, T, D // g, g).reshape(x.shape)


def group_mask(mask: torch.Tensor, G: int, per_channel: bool) -> torch.Tensor:
    """Entries of the quantization groups that contain a True entry of ``mask [..., T, D]``."""
    return group_reduce(mask, G, per_channel, "any")


def chunk_mask(mask: torch.Tensor) -> torch.Tensor:
    """Entries of the 4-element chunks (HQMQ) that contain a True entry."""
    *lead, T, D = mask.shape
    return mask.reshape(*lead, T, D // 4, 4).any(-1, keepdim=True).expand(
        *lead, T, D // 4, 4).reshape(mask.shape)


def quant_bound(x: torch.Tensor, s_el: torch.Tensor, z_el: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-entry error bound of min/max group quantization: half a step, plus the fp32 rounding
    of the code choice ((x - z) * (1/s) may round across .5) and of ``code*s + z``."""
    maxq = (1 << bits) - 1
    return s_el / 2 + s_el * maxq * 2.0 ** -21 + 2.0 ** -22 * (x.float().abs() + z_el.abs())


def unsupported_arg(cfg, role: str, D: int):
    """The config field a ``[.., D]`` tensor of ``role`` violates (per-token groups that do not
    divide the head dim), or None."""
    if isinstance(cfg, (kvq.GroupQuantBase, kvq.GEARConfig)):
        spec = cfg.spec(role)
        if not spec.per_channel and spec.group_size != -1 and D % spec.group_size:
            return "group_size"
    return None


def valid_head_dims(cfg):
    return [D for D in HEAD_DIMS if all(unsupported_arg(cfg, r, D) is None for r in ROLES)]


TOP = math.log10(6e4)


def top_magnitude(cfg, dtype, *, streaming: bool) -> float:
    """log10 of the largest magnitude drawn for ``cfg``: 6e4, except for GEAR, whose fp16
    factors and output run out of range near the fp16 limit: a cache then refuses the block
    and decompress saturates (regression tests below: test_gear_cache_refuses_or_stores_finite_
    factors, test_gear_decompress_stays_finite_in_fp16), which the streaming and attention
    properties here do not model.  Streamed GEAR stays at 1e4 (keeps ||residual column|| *
    sqrt(T) within fp16) and compressed fp16 GEAR at 3e4 (keeps x^ = deq + A B^T within fp16)."""
    if isinstance(cfg, kvq.GEARConfig):
        if streaming:
            return 4.0
        if dtype == torch.float16:
            return math.log10(3e4)
    return TOP


def hqmq_unstorable(x: torch.Tensor, cfg, thr=None) -> bool:
    """Does ``x`` hold a 4-element chunk whose norm exceeds 61440 (kvq.hqmq.MAX_SCALE, the bound
    on coded chunk norms) and that is not a Med3x outlier (norm above the threshold ``thr``,
    default x's own), i.e. one HQMQ cannot store?  Norms as the encoder computes them (fp32)."""
    if x.numel() == 0:
        return False
    norms = hq_ref.chunk_norms_fp32(x)
    big = norms > kvq.hqmq.MAX_SCALE
    if cfg.outlier_factor is not None:
        thr = kvq.med3_threshold(x, cfg.outlier_factor) if thr is None else thr
        big &= ~(norms > thr.float()[None, :, None, None])
    return bool(big.any())


def hqmq_scale(c) -> torch.Tensor:
    """The per-token radius scales (fp16) a kvq.compress result holds in its packed rows, read
    with the reference unpack (which also checks that the rows are canonical)."""
    D, S = c.shape[-1], c.secondary.shape[1]
    return hq_ref.unpack_rows(c.codes, D, S, c.radius_bits)[2]


def compress_or_refuse(x, cfg, role, **kw):
    """kvq.compress, or None where the format refuses an input it cannot store, naming 'x'
    (within the contract): GEAR where the residual's fp16 factors would overflow, HQMQ where a
    4-element chunk that is not a Med3x outlier has a norm beyond the fp16 radius scale."""
    try:
        return kvq.compress(x, cfg, role, **kw)
    except (ValueError, RuntimeError) as e:
        msg = str(e)
        if isinstance(cfg, kvq.GEARConfig) and "'x'" in msg and "too large" in msg:
            return None
        if isinstance(cfg, kvq.HQMQConfig) and "'x'" in msg and "61440" in msg and hqmq_unstorable(x, cfg):
            return None
        raise


# ----------------------------------------------------------------------------- byte counts
def group_rows(spec, ntok: int, D: int, G=None) -> int:
    """Scale (and zero) entries of one ``[ntok, D]`` matrix quantized with ``spec``."""
    G = spec.group_size if G is None else G
    if spec.per_channel:
        if ntok == 0:
            return 0
        return (1 if G == -1 else ntok // G) * D
    return ntok * (D // (D if G == -1 else G))


def gear_block_bytes(cfg, role: str, ntok: int, D: int, itemsize: int, rank: int, *,
                     stream: bool) -> int:
    """Bytes of one GEAR block of ``ntok`` tokens per ``[b, h]`` (docs/ops.md): codes, fp16
    scale/zero, outliers (values + indices; in a KIVI-backbone stream keys sorted by token with
    int16 packed indices and tile offsets, and every entry's correction ``od``), fp16 factors."""
    spec = cfg.spec(role)
    r = min(rank, ntok, D)
    n = ntok * D * spec.bits // 8 + 2 * 2 * group_rows(spec, ntok, D)
    kivi = cfg.backbone == "kivi"
    if spec.per_channel:
        k = kvq.outlier_count(cfg.sparsity, ntok)
        m = D * 2 * k
        if stream and kivi:
            nt = -(-ntok // 32)
            P = (nt + 1 + 3) // 4 * 4 + 4
            n += m * itemsize + m * 2 + P * 4 + m * itemsize  # ov, oi (int16), off, od
        else:
            n += m * (itemsize + torch.empty((), dtype=kvq.outlier_index_dtype(ntok)).element_size())
    else:
        k = kvq.outlier_count(cfg.sparsity, D)
        m = ntok * 2 * k
        n += m * (itemsize + 1)  # uint8 channel indices (D <= 256)
        if stream and kivi:
            n += m * itemsize  # od
    return n + 2 * r * (ntok + D)


def expected_compressed_nbytes(c, cfg, role: str, shape, dtype) -> int:
    """Bytes of a ``kvq.compress`` result from its layout (docs/ops.md, docs/design.md)."""
    B, H, T, D = shape
    item = torch.empty((), dtype=dtype).element_size()
    if isinstance(cfg, kvq.FP16Config):
        return B * H * T * D * item
    if isinstance(cfg, kvq.HQMQConfig):
        U = hq_ref.units(D, cfg.secondary_size, cfg.radius_bits)  # packed rows, scale included
        med3 = cfg.outlier_factor is not None
        return (B * H * T * 2 * U + 16 * c.num_outliers + 16 * H * cfg.secondary_size
                + 4 * H * med3)
    spec = cfg.spec(role)
    tq = T - T % spec.group_size if spec.per_channel and spec.group_size != -1 else T
    tail = (T - tq) * D * item
    if isinstance(cfg, kvq.GEARConfig):
        return B * H * (gear_block_bytes(cfg, role, tq, D, item, cfg.rank, stream=False) + tail)
    return B * H * (tq * D * spec.bits // 8 + 2 * 2 * group_rows(spec, tq, D) + tail)


def stream_spec(cfg, role):
    """The QuantSpec a group-quantized stream stores (whole-axis key groups = the flushed block)."""
    spec = cfg.spec(role)
    if spec.per_channel and spec.group_size == -1:
        return kvq.QuantSpec(spec.bits, cfg.residual_length, True)
    return spec


def expected_stream_nbytes(stream, cfg, role: str) -> int:
    """Bytes one role of a cache layer stores, from its lengths and the format's layout:
    codes, scales, zeros, residual / buffer, outliers (+ corrections, tile offsets), factors,
    HQMQ records, secondary sets, Med3x threshold and outlier index."""
    if stream._shape is None:
        return 0
    B, H, D = stream._shape
    item = torch.empty((), dtype=stream.dtype).element_size()
    if isinstance(stream, FullPrecisionStream):
        return B * H * stream.seq_len * D * item
    if isinstance(stream, _QuantStream):
        spec = stream_spec(cfg, role)
        nq = stream.quantized_len
        return B * H * (nq * D * spec.bits // 8 + 2 * 2 * group_rows(spec, nq, D)
                        + stream.residual_len * D * item)
    if isinstance(stream, GEARStream):
        n = 0
        if stream.T0:
            n += gear_block_bytes(cfg, role, stream.T0, D, item, cfg.rank, stream=True)
        n += stream.num_decode_blocks * gear_block_bytes(cfg, role, cfg.buffer_length, D, item,
                                                         cfg.rank_decode, stream=True)
        return B * H * (n + stream.buffer_len * D * item)
    if isinstance(stream, HQMQStream):
        T = stream.seq_len
        U = hq_ref.units(D, cfg.secondary_size, cfg.radius_bits)
        nres = getattr(stream, "residual_len", 0)  # recent window, full precision
        T -= nres
        n = B * H * (T * 2 * U + nres * D * item) + 16 * stream._records().shape[0]
        n += 16 * H * cfg.secondary_size  # the secondary sets (made on the first append)
        if cfg.outlier_factor is not None and stream.threshold is not None:
            n += 4 * H  # threshold
            if T:
                n += 8 * (-(-T // 32) * B * H + 1)  # outlier index
        return n
    raise AssertionError(type(stream))  # pragma: no cover


def compressed_bytes(stream) -> int:
    """Bytes of the compressed part (everything but the full-precision residual / buffer)."""
    skip = {"residual", "buffer"}
    return nbytes_of(t for k, t in stream.tensors().items() if k not in skip)


def growables(obj):
    return [(k, g) for k, g in vars(obj).items() if isinstance(g, Growable)]


def check_growables(stream) -> None:
    """No growable buffer holds more than twice the rows it uses (+ its first allocation)."""
    for name, g in growables(stream):
        if g.buf is None:
            continue
        cap = g.buf.shape[2]
        assert g.length <= cap <= max(2 * g.length, 16) + g.align, \
            f"{type(stream).__name__}.{name}: capacity {cap} for {g.length} rows"


# ----------------------------------------------------------------------------- bounds
def hqmq_chunk_check(x: torch.Tensor, out: torch.Tensor, scale: torch.Tensor, radius_bits: int,
                     where: torch.Tensor) -> None:
    """Per 4-element chunk: ||x - out|| <= HURWITZ_DIST ||x|| + step/2 (+ fp rounding), on the
    chunks selected by ``where [.., T, D/4]``."""
    *lead, T, D = x.shape
    xc = x.double().reshape(*lead, T, D // 4, 4)
    oc = out.double().reshape(*lead, T, D // 4, 4)
    r = xc.norm(dim=-1)
    step = scale.double()[..., None] / ((1 << radius_bits) - 1)
    u = UNIT[out.dtype]
    bound = HURWITZ_DIST * r * (1 + 1e-3) + step / 2 * (1 + 1e-3) + 2 * u * oc.norm(dim=-1) + 1e-7
    err = (xc - oc).norm(dim=-1)
    bad = (err > bound) & where
    assert not bad.any(), (f"HQMQ chunk error {err[bad].max():.4g} above bound "
                           f"{bound[bad].min():.4g} ({int(bad.sum())} chunks)")


def element_scales(scale, zero, shape, spec):
    """Per-entry scale and zero of a quantized ``[.., T, D]`` block."""
    s = expand_scale(scale, shape, spec.per_channel)
    z = expand_scale(zero, shape, spec.per_channel)
    return s, z


def check_group_block(x, out, scale, zero, spec, where=None) -> None:
    """Every entry of a quantized block within its group's bound (+ output rounding)."""
    if x.shape[-2] == 0:
        return
    s, z = element_scales(scale, zero, x.shape, spec)
    tol = quant_bound(x, s, z, spec.bits) + UNIT[out.dtype] * out.float().abs() + TINY[out.dtype]
    err = (out.float() - x.float()).abs()
    bad = ~(err <= tol)
    if where is not None:
        bad &= where
    assert not bad.any(), f"quantization error {err[bad].max():.4g} above bound {tol[bad].min():.4g}"


def check_gear_block(x, out, c: GEARCompressed, where=None) -> None:
    """GEAR block: outlier entries exact; per [b, h] matrix ||x - x^||_F over ``where`` <= the
    backbone bound ||scale/2||_F (the low-rank part is the projection of the residual onto an
    orthonormal basis, so it cannot add error) + rounding."""
    spec = c.spec
    tq = c.compressed_len
    xh, oh = x[:, :, :tq], out[:, :, :tq]
    # outliers: the stored values are x's entries and come back bit-exact
    ov, oi = c.fields["outlier_values"], c.fields["outlier_indices"].long()
    if ov.shape[-1]:
        got = (oh.transpose(-1, -2) if spec.per_channel else oh).gather(-1, oi)
        src = (xh.transpose(-1, -2) if spec.per_channel else xh).gather(-1, oi)
        ok = same_values(got, ov) and same_values(src, ov)
        assert ok, "GEAR outliers are not restored exactly"
    if tq == 0:
        return
    s, z = element_scales(c.fields["scale"], c.fields["zero"], xh.shape, spec)
    tol = quant_bound(xh, s, z, spec.bits)
    w = torch.ones(xh.shape, dtype=torch.bool) if where is None else where[:, :, :tq]
    w = w & torch.isfinite(tol)
    err = torch.where(w, (oh.double() - xh.double()), torch.zeros((), dtype=torch.float64))
    u = UNIT[out.dtype]
    lhs = err.pow(2).sum((-1, -2)).sqrt()
    rhs = (torch.where(w, tol.double(), torch.zeros((), dtype=torch.float64)).pow(2).sum((-1, -2)).sqrt()
           * 1.01 + 2 * u * torch.where(w, xh.double(), torch.zeros((), dtype=torch.float64)).pow(2).sum((-1, -2)).sqrt()
           + 2 * TINY[out.dtype] * w.sum((-1, -2)).double().sqrt() + 1e-30)
    assert bool((lhs <= rhs).all()), f"GEAR error ||.||_F {lhs.max():.4g} above bound {rhs.min():.4g}: {lhs} vs {rhs}"


def check_compressed(cfg, role, c, x, out, where=None) -> None:
    """``out = c.decompress()`` of ``x`` within the bound of its family (``where``: entries to
    check; default all)."""
    if isinstance(cfg, kvq.FP16Config):
        assert same_values(out, x, where)
        return
    if isinstance(cfg, kvq.HQMQConfig):
        w = torch.ones(x.shape, dtype=torch.bool) if where is None else where
        cw = w.reshape(*x.shape[:-1], x.shape[-1] // 4, 4).all(-1)
        hqmq_chunk_check(x, out, hqmq_scale(c), cfg.radius_bits, cw)
        return
    spec = cfg.spec(role)
    T = x.shape[2]
    tq = T - T % spec.group_size if spec.per_channel and spec.group_size != -1 else T
    tail_where = None if where is None else where[:, :, tq:]
    assert same_values(out[:, :, tq:], x[:, :, tq:], tail_where), "full-precision tail is not exact"
    if isinstance(cfg, kvq.GEARConfig):
        check_gear_block(x, out, c, where)
    else:
        check_group_block(x[:, :, :tq], out[:, :, :tq], c.scale, c.zero, spec,
                          None if where is None else where[:, :, :tq])


def check_stored_parameters(cfg, role, c, x) -> None:
    """The stored side parameters are the method's (so that the bounds above, which read them,
    are the method's bounds and not just any): group quantization scale/zero bit-identical to the
    reference; GEAR scales at most the raw group's min/max step; HQMQ secondary sets from the
    seed, radius scale = the largest non-outlier chunk norm rounded up to the row's SB-bit scale
    grid (bit for bit, with the encoder's fp32 norms), Med3x threshold and the outlier chunks
    (which, count and exact fp16 values)."""
    B, H, T, D = x.shape
    if isinstance(cfg, kvq.FP16Config) or T == 0:
        return
    if isinstance(cfg, kvq.HQMQConfig):
        sec = kvq.hqmq_secondary(H, cfg.secondary_size, cfg.seed, layer_idx=0, role=role)
        assert bits_equal(c.secondary, sec), "secondary sets are not hqmq_secondary(seed, layer, role)"
        norms = hq_ref.chunk_norms_fp32(x)  # the encoder's norms, bit for bit
        inl = torch.ones_like(norms, dtype=torch.bool)
        if cfg.outlier_factor is not None:
            thr = kvq.med3_threshold(x, cfg.outlier_factor)
            assert bits_equal(c.threshold, thr), "Med3x threshold is not factor x the median chunk norm"
            outl = norms > thr.float()[None, :, None, None]
            assert int(outl.sum()) == c.num_outliers, "outlier count"
            rec = c.outliers.long()
            flag = torch.zeros(B * H, T, D // 4, dtype=torch.bool)
            flag[rec[:, 1] >> 8, rec[:, 0], rec[:, 1] & 0xFF] = True
            assert torch.equal(flag.reshape(outl.shape), outl), "the outlier chunks are not those above the threshold"
            out = c.decompress()
            exact = x.half().to(x.dtype)
            sm = outl[..., None].expand(B, H, T, D // 4, 4).reshape(x.shape)
            assert same_values(out, exact, sm), "an outlier chunk is not stored exactly (fp16)"
            inl = ~outl
        rmax = torch.where(inl, norms, torch.zeros(())).amax(-1)
        want = hq_ref.round_scale(rmax, hq_ref.scale_bits(D, cfg.secondary_size, cfg.radius_bits))
        sc = hqmq_scale(c)
        assert bits_equal(sc, want), "HQMQ radius scale is not the token's largest chunk norm rounded up"
        assert bool((sc.double() >= rmax.double()).all())
        return
    spec = cfg.spec(role)
    tq = T - T % spec.group_size if spec.per_channel and spec.group_size != -1 else T
    head = x[:, :, :tq]
    if tq == 0:
        return
    _, rs, rz = quantize_ref(head, spec.bits, spec.group_size, spec.per_channel)
    scale, zero = (c.fields["scale"], c.fields["zero"]) if isinstance(cfg, kvq.GEARConfig) else (c.scale, c.zero)
    if isinstance(cfg, kvq.GEARConfig):
        # the backbone quantizes x with its outliers clamped into the group's inlier range,
        # which lies inside the raw range: never a larger step than the raw group's
        assert bool((scale.float() <= rs.float() * (1 + 2.0 ** -10)).all()), "GEAR scale above the raw group's"
        return
    assert bits_equal(scale, rs), "stored scale differs from the reference"
    assert bool((zero == rz).all()), "stored zero differs from the reference"


# ----------------------------------------------------------------------------- strategies
T_ANY = st.one_of(st.sampled_from([0, 1, 2, 3, 31, 32, 33, 63, 64, 65, 127, 128, 129, 199]),
                  st.integers(0, 200))


@st.composite
def quant_case(draw):
    """(dtype, bits, per_channel, group_size, shape) of a valid raw quantize call."""
    dtype = draw(st.sampled_from(DTYPES))
    bits = draw(st.sampled_from(BITS))
    D = draw(st.sampled_from(HEAD_DIMS))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    per_channel = draw(st.booleans())
    if per_channel:
        G = draw(st.sampled_from([-1, 1, 3, 8, 20, 32, 64, 128]))
        T = draw(T_ANY) if G == -1 else G * draw(st.integers(0, max(1, 200 // G)))
    else:
        G = draw(st.sampled_from([-1] + [g for g in (8, 16, 32, 64, 128, 256) if D % g == 0]))
        T = draw(T_ANY)
    return dtype, bits, per_channel, G, (B, H, T, D)


def budget_T(B, H, D, cap=200, elements=1 << 16):
    """Largest token count that keeps a tensor within ``elements`` (HQMQ's search is costly)."""
    return max(1, min(cap, elements // (B * H * D)))


# ----------------------------------------------------------------------------- raw op
@fuzz(300)
@given(case=quant_case(), vals=values_st(), bad=st.one_of(st.just([]), bad_st),
       check_finite=st.booleans(), lead=st.sampled_from(["4d", "3d", "5d"]))
def test_quantize_dequantize(case, vals, bad, check_finite, lead):
    """Raw op: shapes, reference scale/zero, codes, per-entry bound, one rounding to the dtype,
    exact constant groups, strided == contiguous; NaN/Inf raise or stay in their groups."""
    dtype, bits, per_channel, G, shape = case
    B, H, T, D = shape
    x = make_tensor(shape, dtype, vals)
    y, badmask = sprinkle(x, bad)
    xin = with_layout(y, vals.layout)
    reshape = {"4d": lambda t: t, "3d": lambda t: t.reshape(B * H, *t.shape[2:]),
               "5d": lambda t: t.unsqueeze(1)}[lead]
    xin, x, badmask = reshape(xin), reshape(x), reshape(badmask)
    note(f"x strides {xin.stride()}")
    if bad and check_finite and x.numel():
        with raises_naming("x") as info:
            kvq.quantize(xin, bits, G, per_channel)
        assert "NaN or Inf" in str(info.value) or "65504" in str(info.value)
        return
    codes, scale, zero = kvq.quantize(xin, bits, G, per_channel, check_finite=check_finite)
    *ld, _, _ = x.shape
    Gr = (T if G == -1 else G) if per_channel else (D if G == -1 else G)
    sshape = (*ld, T // Gr if Gr else 0, D) if per_channel else (*ld, T, D // Gr)
    assert codes.shape == (*ld, T, D * bits // 32) and codes.dtype == torch.int32
    assert scale.shape == zero.shape == sshape and scale.dtype == zero.dtype == torch.float16
    c2, s2, z2 = kvq.quantize(xin.contiguous(), bits, G, per_channel, check_finite=check_finite)
    assert bits_equal(codes, c2) and bits_equal(scale, s2) and bits_equal(zero, z2), \
        "strided input quantizes differently from its contiguous copy"
    out = kvq.dequantize(codes, scale, zero, bits, per_channel, dtype)
    assert out.shape == x.shape and out.dtype == dtype
    if T == 0:
        return
    spoiled = group_mask(badmask, G, per_channel)
    ok = ~spoiled
    # reference on the clean data: scale/zero bit for bit (a -0 minimum is stored as +0),
    # codes within 1 (rounding ties)
    rc, rs, rz = quantize_ref(x, bits, G, per_channel)
    s_el, z_el = expand_scale(scale, x.shape, per_channel), expand_scale(zero, x.shape, per_channel)
    rs_el, rz_el = expand_scale(rs, x.shape, per_channel), expand_scale(rz, x.shape, per_channel)
    assert bits_equal(s_el[ok], rs_el[ok]), "scale differs from the reference"
    assert (z_el[ok] == rz_el[ok]).all(), "zero differs from the reference"
    assert not torch.signbit(z_el[ok & (z_el == 0)]).any(), "a zero point is stored as -0"
    mine = unpack_ref(codes, bits)
    assert ((mine - rc).abs()[ok] <= 1).all(), "codes differ from the reference by more than 1"
    # error bound in fp32, then one rounding to the dtype
    out32 = kvq.dequantize(codes, scale, zero, bits, per_channel, torch.float32)
    err = (out32 - x.float()).abs()
    tol = quant_bound(x, s_el, z_el, bits)
    bad_entries = ~(err <= tol) & ok
    assert not bad_entries.any(), f"error {err[bad_entries].max():.4g} > bound {tol[bad_entries].min():.4g}"
    assert same_values(out, out32.to(dtype), ok), "dtype output is not one rounding of the fp32 one"
    # constant groups of an fp16 number: exact, scale 0
    xg = x.float()
    gmin = -group_reduce(-xg, G, per_channel)
    gmax = group_reduce(xg, G, per_channel)
    const = (gmin == gmax) & (xg.half().float() == xg) & ok
    assert (out.float()[const] == xg[const]).all(), "a constant group does not decode exactly"
    assert (s_el[const] == 0).all(), "a constant group has a non-zero scale"


@fuzz(60)
@given(data=st.data())
def test_quantize_rejects_bad_arguments(data):
    """Every invalid raw-op call raises RuntimeError naming the offending argument."""
    D = data.draw(st.sampled_from(HEAD_DIMS))
    x = torch.randn(1, 2, 64, D)
    kind = data.draw(st.sampled_from(["bits", "group_size0", "group_size_neg", "pc_divide",
                                      "pt_divide", "pt_pow2", "head_dim", "rank", "dtype",
                                      "big", "nonfinite"]))
    args = [x, 2, 32, True]
    name = "x"
    if kind == "bits":
        args[1] = data.draw(st.sampled_from([0, 1, 3, 5, 6, 7, 16, 32, -2]))
        name = "bits"
    elif kind in ("group_size0", "group_size_neg"):
        args[2] = 0 if kind == "group_size0" else data.draw(st.integers(-100, -2))
        args[3] = data.draw(st.booleans())
        name = "group_size"
    elif kind == "pc_divide":
        args[0] = x[:, :, :data.draw(st.sampled_from([1, 31, 33, 50, 63]))]
        name = "group_size"
    elif kind == "pt_divide":
        args[2:] = [data.draw(st.sampled_from([g for g in (64, 128, 256, 512) if g > D]
                                              + [24, 48, 96])), False]
        name = "group_size"
    elif kind == "pt_pow2":
        args[2:] = [data.draw(st.sampled_from([1, 2, 4, 3, 12, 20])), False]
        name = "group_size"
    elif kind == "head_dim":
        args[0] = torch.randn(1, 1, 32, data.draw(st.sampled_from([4, 8, 16, 48, 96, 100, 512])))
    elif kind == "rank":
        args[0] = x[0, 0, 0]
    elif kind == "dtype":
        args[0] = x.to(data.draw(st.sampled_from([torch.int32, torch.float64, torch.int8, torch.bool])))
    elif kind == "big":
        args[0] = x * 1e6
        args[3] = data.draw(st.booleans())
    elif kind == "nonfinite":
        y = x.clone()
        y[0, 1, data.draw(st.integers(0, 63)), data.draw(st.integers(0, D - 1))] = data.draw(
            st.sampled_from(list(BAD.values())))
        args[0] = y
    with raises_naming(name):
        kvq.quantize(*args)


# ----------------------------------------------------------------------------- compress
@st.composite
def block_case(draw, preset, min_T=0):
    cfg = kvq.get_config(preset)
    dtype = draw(st.sampled_from(DTYPES))
    D = draw(st.sampled_from(HEAD_DIMS))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    cap = budget_T(B, H, D) if isinstance(cfg, kvq.HQMQConfig) else 200
    T = draw(st.one_of(st.sampled_from([t for t in (0, 1, 3, 63, 64, 65, 129) if min_T <= t <= cap]
                                       or [cap]), st.integers(min_T, cap)))
    return cfg, dtype, (B, H, T, D)


@pytest.mark.parametrize("preset", PRESETS)
@fuzz(30)
@given(data=st.data())
def test_compress_roundtrip(preset, data):
    """kvq.compress(...).decompress() within the family's bound; nbytes = stored tensors =
    layout count; deterministic; strided == contiguous; a head dim the config's groups do not
    divide raises naming 'group_size'."""
    cfg, dtype, shape = data.draw(block_case(preset))
    role = data.draw(st.sampled_from(ROLES))
    vals = data.draw(values_st(top_magnitude(cfg, dtype, streaming=False)))
    x = make_tensor(shape, dtype, vals)
    xin = with_layout(x, vals.layout)
    arg = unsupported_arg(cfg, role, shape[3])
    if arg is not None:
        with raises_naming(arg):
            kvq.compress(xin, preset, role)
        return
    c = compress_or_refuse(xin, cfg, role)
    if c is None:
        return
    out = c.decompress()
    assert out.shape == x.shape and out.dtype == dtype
    assert torch.isfinite(out).all(), "finite input decompresses to NaN/Inf"
    assert c.nbytes == nbytes_of(c.tensors().values())
    assert c.nbytes == expected_compressed_nbytes(c, cfg, role, shape, dtype)
    assert c.bits_per_element == (8 * c.nbytes / x.numel() if x.numel() else 0.0)
    again = kvq.compress(x, cfg, role).decompress()
    assert bits_equal(out, again), "compress is not deterministic / strided input differs"
    check_stored_parameters(cfg, role, c, x)
    check_compressed(cfg, role, c, x, out)


@pytest.mark.parametrize("preset", PRESETS)
@fuzz(30)
@given(data=st.data())
def test_compress_nonfinite(preset, data):
    """NaN/Inf, and entries beyond 65504 where they would be quantized: check_finite=True raises
    naming 'x' (a finite entry in a full-precision tail is stored as it is); with False every
    entry outside the bad entries' own groups (HQMQ: chunk for NaN, token vector for Inf) is what
    the clean input gives, bit for bit where the format is group-local, else within the
    family's bound."""
    cfg, dtype, shape = data.draw(block_case(preset, min_T=1))
    role = data.draw(st.sampled_from(ROLES))
    if unsupported_arg(cfg, role, shape[3]) is not None:
        return  # covered by test_compress_roundtrip
    vals = data.draw(values_st(top_magnitude(cfg, dtype, streaming=False)))
    bad = data.draw(bad_st)
    x = make_tensor(shape, dtype, vals)
    y, badmask = sprinkle(x, bad)
    yin = with_layout(y, vals.layout)
    clean_c = compress_or_refuse(x, cfg, role)
    if clean_c is None:
        return
    B, H, T, D = shape
    tq = T  # tokens that are quantized (the rest: a full-precision key tail)
    if isinstance(cfg, (kvq.GroupQuantBase, kvq.GEARConfig)):
        spec = cfg.spec(role)
        tq = T - T % spec.group_size if spec.per_channel and spec.group_size != -1 else T
    must_raise = bool((~torch.isfinite(y)).any()) or bool((badmask & torch.isfinite(y))[:, :, :tq].any())
    if isinstance(cfg, kvq.FP16Config):
        pass  # test_fp16_compress_refuses_nonfinite
    elif must_raise:
        with raises_naming("x"):
            kvq.compress(yin, preset, role)
    else:  # finite entries beyond 65504 only in the full-precision tail
        assert same_values(kvq.compress(yin, preset, role).decompress()[:, :, tq:], y[:, :, tq:])
    c = kvq.compress(yin, preset, role, check_finite=False)
    out = c.decompress()
    assert out.shape == x.shape and out.dtype == dtype
    # the spoiled region
    if isinstance(cfg, kvq.FP16Config):
        spoiled = badmask
    elif isinstance(cfg, kvq.HQMQConfig):
        # a NaN spoils its chunk; an Inf or an entry beyond 65504 its token vector
        inf = badmask & ~torch.isnan(y)
        spoiled = chunk_mask(badmask) | inf.any(-1, keepdim=True).expand_as(inf)
    else:
        spoiled = badmask.clone()
        spoiled[:, :, :tq] = group_mask(badmask[:, :, :tq], spec.group_size, spec.per_channel)
    ok = ~spoiled
    note(f"{int(badmask.sum())} bad entries spoil {int(spoiled.sum())} of {spoiled.numel()}")
    clean = clean_c.decompress()
    if isinstance(cfg, (kvq.FP16Config, kvq.GroupQuantBase)):
        # group-local formats: everything outside the spoiled groups is bit-identical
        assert same_values(out, clean, ok), "a non-finite entry changed data outside its group"
    elif isinstance(cfg, kvq.HQMQConfig) and cfg.outlier_factor is None:
        # tokens are encoded independently: other tokens bit-identical (the token's other chunks
        # share its radius scale, so they are only within the bound, checked below)
        other_tokens = ~badmask.any(-1, keepdim=True).expand_as(badmask)
        assert same_values(out, clean, other_tokens), "a non-finite entry changed other tokens"
    check_compressed(cfg, role, c, y, out, where=ok)  # y == x where ok


# ----------------------------------------------------------------------------- streaming
def with_window(cfg, data):
    """``cfg`` with a drawn recent window (mostly 0) where configs have that field."""
    if "recent_window" not in {f.name for f in dataclasses.fields(cfg)}:
        return cfg
    return dataclasses.replace(cfg, recent_window=data.draw(st.sampled_from([0, 0, 0, 16, 130])))


def window_of(cfg) -> int:
    """The config's recent window (W newest tokens kept in full precision before the method's
    own rule sees them; 0 where the config has none)."""
    return getattr(cfg, "recent_window", 0)


def group_stream_blocks(chunks, R: int, W: int, per_channel: bool):
    """KIVI's rule with a recent window (tests/reference kivi_stream_ref for W = 0): keys flush R
    tokens at a time once they are older than the W newest, values quantize every token older
    than the R + W newest.  Returns (quantized blocks, full-precision rest)."""
    if W == 0:
        return kivi_stream_ref(chunks, R, per_channel)
    blocks, residual = [], None
    for x in chunks:
        full = x if residual is None else torch.cat([residual, x], dim=2)
        n = (max(full.shape[2] - W, 0) // R) * R if per_channel else max(full.shape[2] - R - W, 0)
        if n:
            blocks.append(full[:, :, :n])
        residual = full[:, :, n:]
    return blocks, residual


def stream_reference(cfg, role: str, chunks, *, layer_idx: int = 0, check_finite: bool = True):
    """What one role of a cache layer holds after appending ``chunks``, from whole-block op calls
    on the blocks the method's streaming rule forms (docs/methods.md, docs/ops.md; a recent
    window W delays every rule by the W newest tokens)."""
    full = torch.cat(chunks, dim=2)
    B, H, T, D = full.shape
    dtype = full.dtype
    W = window_of(cfg)
    if isinstance(cfg, kvq.FP16Config):
        return full
    if isinstance(cfg, kvq.GroupQuantBase):
        spec = stream_spec(cfg, role)
        blocks, residual = group_stream_blocks(chunks, cfg.residual_length, W, spec.per_channel)
        parts = [kvq.dequantize(*kvq.quantize(b, spec.bits, spec.group_size, spec.per_channel,
                                              check_finite=check_finite),
                                spec.bits, spec.per_channel, dtype) for b in blocks]
        return torch.cat(parts + [residual], dim=2)
    if isinstance(cfg, kvq.GEARConfig):
        # prefill: the first non-empty append, its whole KIVI groups at the prefill rank; then
        # blocks of buffer_length tokens at rank_decode; the rest waits in full precision
        align = cfg.group_size if cfg.backbone == "kivi" else 1
        parts, buf, prefilled = [], None, False
        for x in chunks:
            f = x if buf is None else torch.cat([buf, x], dim=2)
            start = 0
            if not prefilled and f.shape[2] > 0:
                n = max(f.shape[2] - W, 0)
                n -= n % align
                if n:
                    parts.append(GEARCompressed.from_tensor(f[:, :, :n], cfg, role, rank=cfg.rank,
                                                            check_finite=check_finite).decompress())
                start, prefilled = n, True
            else:
                while f.shape[2] - start >= cfg.buffer_length + W:
                    blk = f[:, :, start:start + cfg.buffer_length]
                    parts.append(GEARCompressed.from_tensor(blk, cfg, role, rank=cfg.rank_decode,
                                                            check_finite=check_finite).decompress())
                    start += cfg.buffer_length
            buf = f[:, :, start:]
        return torch.cat(parts + [buf], dim=2)
    if isinstance(cfg, kvq.HQMQConfig):
        # every token on its own, against the threshold of the first non-empty append
        sec = kvq.hqmq_secondary(H, cfg.secondary_size, cfg.seed, layer_idx=layer_idx, role=role)
        thr = None
        if cfg.outlier_factor is not None:
            first = next((c for c in chunks if c.shape[0] * c.shape[2]), None)
            if first is not None:
                thr = kvq.med3_threshold(first, cfg.outlier_factor)
        n = T - min(W, T)  # the W newest tokens wait in full precision
        codes, rec = kvq.hqmq_encode(full[:, :, :n], sec, cfg.radius_bits, thr,
                                     check_finite=check_finite)
        out = kvq.hqmq_decode(codes, sec, rec, cfg.radius_bits, D, dtype)
        return torch.cat([out, full[:, :, n:]], dim=2)
    raise AssertionError(type(cfg))  # pragma: no cover


def window_ok(stream, cfg) -> bool:
    """The full-precision part stays within the method's window (+ the recent window)."""
    W = window_of(cfg)
    if isinstance(stream, _QuantStream):
        R = cfg.residual_length
        return stream.residual_len < R + W if stream.spec.per_channel else stream.residual_len <= R + W
    if isinstance(stream, GEARStream):
        return stream.buffer_len < max(cfg.buffer_length, stream.prefill_align) + W
    if isinstance(stream, HQMQStream):
        return getattr(stream, "residual_len", 0) <= W
    return True


def check_layer_invariants(cache, cfg, total: int, prev: dict) -> None:
    """Lengths, byte accounting, windows, growable capacity, monotone compressed part."""
    layer = cache.layers[0]
    for role in ROLES:
        st_ = getattr(layer, role)
        assert st_.seq_len == total
        assert st_.nbytes == nbytes_of(st_.tensors().values())
        assert st_.nbytes == expected_stream_nbytes(st_, cfg, role), (
            f"{role} nbytes {st_.nbytes} != layout count {expected_stream_nbytes(st_, cfg, role)}")
        assert window_ok(st_, cfg), f"{role} full-precision window grew past the method's"
        check_growables(st_)
        cb = compressed_bytes(st_)
        assert cb >= prev.get(role, 0), f"{role}: compressed part shrank"
        prev[role] = cb
    nb = cache.nbytes
    assert nb == layer.key.nbytes + layer.value.nbytes
    if not cfg_has_window(cfg):
        assert nb >= prev.get("total", 0), "nbytes decreased for a method without a window"
    prev["total"] = nb


def cfg_has_window(cfg) -> bool:
    return (isinstance(cfg, kvq.GEARConfig) or window_of(cfg) > 0
            or getattr(cfg, "residual_length", 0) > 0)


def snapshot(cache):
    return {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in cache.state_dict().items()}


def same_state(a: dict, b: dict) -> bool:
    if a.keys() != b.keys():
        return False
    return all(bits_equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


@st.composite
def stream_case(draw, preset):
    cfg = kvq.get_config(preset)
    dtype = draw(st.sampled_from(DTYPES))
    D = draw(st.sampled_from(valid_head_dims(cfg)))
    B, H = draw(st.integers(1, 3)), draw(st.integers(1, 4))
    cap = budget_T(B, H, D, cap=320, elements=1 << 17 if isinstance(cfg, kvq.HQMQConfig) else 1 << 19)
    sizes = draw(st.lists(st.one_of(st.sampled_from([0, 1, 1, 1, 2, 63, 64, 65, 127, 128, 129]),
                                    st.integers(0, 80)), min_size=1, max_size=10))
    out, total = [], 0
    for s in sizes:
        s = min(s, cap - total)
        out.append(s)
        total += s
    return cfg, dtype, (B, H, D), out


@pytest.mark.parametrize("preset", PRESETS)
@fuzz(15)
@given(data=st.data())
def test_kvcache_streaming(preset, data):
    """KVCache in random chunk sizes (strided chunks included): dequantize = the streaming rule's
    whole-block reference bit for bit; byte accounting, windows and buffers after every append;
    NaN/Inf chunks refused (check_finite=True, nothing changed) or stored as the reference with
    check_finite=False; state_dict round trip bit-exact and the loaded cache continues alike."""
    cfg, dtype, (B, H, D), sizes = data.draw(stream_case(preset))
    cfg = with_window(cfg, data)
    check_finite = data.draw(st.booleans())
    vals = data.draw(values_st(top_magnitude(cfg, dtype, streaming=True)))
    cache = kvq.KVCache(cfg, check_finite=check_finite)
    ks, vs, prev = [], [], {}
    for i, n in enumerate(sizes):
        k = make_tensor((B, H, n, D), dtype, vals, salt=2 * i)
        v = make_tensor((B, H, n, D), dtype, vals, salt=2 * i + 1)
        if n and data.draw(st.integers(0, 4)) == 0:  # now and then a chunk with NaN/Inf
            role = data.draw(st.sampled_from(ROLES))
            bad = data.draw(bad_st)
            if role == "key":
                k, _ = sprinkle(k, bad)
            else:
                v, _ = sprinkle(v, bad)
            t = k if role == "key" else v
            # an fp16 cache stores finite entries beyond 65504 as they are
            if check_finite and (not isinstance(cfg, kvq.FP16Config) or not torch.isfinite(t).all()):
                before = snapshot(cache) if cache.layers else None
                with raises_naming(role, types=ValueError):
                    cache.update(with_layout(k, vals.layout), with_layout(v, vals.layout), 0)
                if before is not None:
                    assert same_state(before, snapshot(cache)), "a refused update changed the cache"
                continue
        if isinstance(cfg, kvq.HQMQConfig) and cfg.outlier_factor is not None and check_finite and n:
            # a chunk beyond 61440 below the Med3x threshold: the cache refuses it
            # (pinned by test_hqmq_med3x_cache_refuses_what_its_radius_scale_cannot_hold)
            def thr_of(role, t):
                st_ = getattr(cache.layers[0], role) if cache.layers else None
                if st_ is not None and st_.threshold is not None:
                    return st_.threshold
                return kvq.med3_threshold(t, cfg.outlier_factor)

            if any(hqmq_unstorable(t, cfg, thr_of(r, t)) for r, t in (("key", k), ("value", v))):
                continue
        if isinstance(cfg, kvq.HQMQConfig) and cfg.outlier_factor is None and check_finite:
            # chunk norms above 61440 (kvq.hqmq.MAX_SCALE) are refused naming the argument
            big = [name for name, t in (("key", k), ("value", v)) if n and float(
                hq_ref.chunk_norms_fp32(t).amax()) > kvq.hqmq.MAX_SCALE]
            if big:
                with raises_naming(big[0], types=ValueError):
                    cache.update(k, v, 0)
                continue
        cache.update(with_layout(k, vals.layout), with_layout(v, vals.layout), 0)
        ks.append(k)
        vs.append(v)
        check_layer_invariants(cache, cfg, sum(t.shape[2] for t in ks), prev)
    if not ks:
        return
    K, V = cache.dequantize(0)
    for role, got, chunks in (("key", K, ks), ("value", V, vs)):
        # (a cache checks NaN/Inf itself, once per update; its streams never do)
        want = stream_reference(cfg, role, chunks, check_finite=False)
        assert same_values(got, want), f"{role}s differ from the streaming rule's reference"
        if check_finite:
            assert torch.isfinite(got).all(), f"finite {role}s accepted, but they dequantize to NaN/Inf"
    # state_dict round trip, then both caches continue alike
    sd = cache.state_dict()
    other = kvq.KVCache(cfg, check_finite=check_finite)
    other.load_state_dict(sd)
    assert other.nbytes == cache.nbytes
    K2, V2 = other.dequantize(0)
    assert bits_equal(K2, K) and bits_equal(V2, V)
    n = data.draw(st.sampled_from([1, 64, 100]))
    small = dataclasses.replace(vals, log_mag=min(vals.log_mag, 4.0))  # chunk norms < 61440
    k = make_tensor((B, H, n, D), dtype, small, salt=999)
    v = make_tensor((B, H, n, D), dtype, small, salt=998)
    for c in (cache, other):
        c.update(k, v, 0)
    for a, b in zip(cache.dequantize(0), other.dequantize(0)):
        assert bits_equal(a, b), "a loaded cache continues differently"
    assert other.nbytes == cache.nbytes
    assert same_state(cache.state_dict(), other.state_dict())


# ----------------------------------------------------------------------------- attention
def attention_ref(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, scale: float, mask=None):
    """fp32 softmax attention of q [B, Hq, D] over K, V [B, H, T, D] (GQA); fully masked rows 0."""
    B, Hq, D = q.shape
    H = K.shape[1]
    qf = q.float().reshape(B, H, Hq // H, D)
    s = torch.einsum("bhgd,bhtd->bhgt", qf, K.float()) * scale
    if mask is not None:
        s = s.masked_fill(~mask[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhgt,bhtd->bhgd", p, V.float()).reshape(B, Hq, D)


def attention_bound(q, K, V, scale, dtype, T, *, scores=False):
    """How far two correct evaluations of softmax(q K^T) V can differ when one reads K, V rounded
    to ``dtype`` (the cache's dequantize) and the other in fp32 from the codes (fused kernels):
    per-entry perturbation 4u|K|max (u the dtype's unit roundoff; GEAR's corrections add one
    more rounding), score perturbation ds = scale * sum|q| * dK, output 2.5 ds max|V| + dV, plus
    the output rounding and fp32 accumulation.  [B, Hq, 1] (``scores``: ds, which also bounds
    the log-sum-exp, a 1-Lipschitz function of the scores)."""
    u = UNIT[dtype]
    B, Hq, D = q.shape
    H = K.shape[1]
    kmax = K.float().abs().amax((-1, -2)) if T else torch.zeros(B, H)  # [B, H]
    vmax = V.float().abs().amax((-1, -2)) if T else torch.zeros(B, H)
    kmax = kmax.repeat_interleave(Hq // H, dim=1)[..., None]
    vmax = vmax.repeat_interleave(Hq // H, dim=1)[..., None]
    qs = q.float().abs().sum(-1, keepdim=True)
    tiny = TINY[dtype]
    dk = 4 * u * kmax + 4 * tiny + 2.0 ** -22 * kmax
    ds = scale * qs * (dk + D * 2.0 ** -23 * kmax)
    if scores:
        return ds
    dout = torch.minimum(2.5 * ds, torch.full_like(ds, 2.0)) * vmax
    return dout + 4 * u * vmax + 4 * tiny + (T + D) * 2.0 ** -22 * vmax + 1e-30


@pytest.mark.parametrize("preset", PRESETS)
@fuzz(15)
@given(data=st.data())
def test_decode_attention_equals_attention_over_dequantized(preset, data):
    """decode_attention = fp32 softmax attention over cache.dequantize(layer) up to float
    rounding: GQA group sizes 1..17, masks (fully masked rows give 0), q in another dtype."""
    cfg = with_window(kvq.get_config(preset), data)
    dtype = data.draw(st.sampled_from(DTYPES))
    D = data.draw(st.sampled_from(valid_head_dims(cfg)))
    B, H = data.draw(st.integers(1, 3)), data.draw(st.integers(1, 4))
    cap = budget_T(B, H, D, cap=300, elements=1 << 17 if isinstance(cfg, kvq.HQMQConfig) else 1 << 19)
    prefill = data.draw(st.integers(0, cap))
    steps = data.draw(st.integers(0 if prefill else 1, min(40, cap)))
    vals = data.draw(values_st(top_magnitude(cfg, dtype, streaming=True)))
    cache = kvq.KVCache(cfg)
    layer_idx = data.draw(st.integers(0, 1))
    T = 0
    for i, n in enumerate([prefill] + [1] * steps):
        if n == 0:
            continue
        k = make_tensor((B, H, n, D), dtype, vals, salt=2 * i)
        v = make_tensor((B, H, n, D), dtype, vals, salt=2 * i + 1)
        try:
            cache.update(k, v, layer_idx)
        except ValueError as e:  # HQMQ: coded chunk norms above 61440
            assert isinstance(cfg, kvq.HQMQConfig) and "61440" in str(e) and (
                "'key'" in str(e) or "'value'" in str(e))
            return
        T += n
    g = data.draw(st.sampled_from([1, 2, 3, 4, 8, 16, 17]))
    qdtype = data.draw(st.sampled_from([dtype] * 3 + list(DTYPES)))
    gq = torch.Generator().manual_seed(vals.seed + 1)
    q = (torch.randn(B, H * g, D, generator=gq) * 10 ** data.draw(st.floats(-2, 1))).to(qdtype)
    mask = None
    if data.draw(st.booleans()):
        mask = torch.rand(B, T, generator=gq) < data.draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]))
    scale = data.draw(st.one_of(st.none(), st.floats(0.01, 1.0)))
    four_d = data.draw(st.booleans())
    out = kvq.decode_attention(q.unsqueeze(2) if four_d else q, cache, layer_idx, scale, attn_mask=mask)
    assert out.shape == (q.unsqueeze(2) if four_d else q).shape and out.dtype == qdtype
    out = out.reshape(q.shape)
    K, V = cache.dequantize(layer_idx)
    sc = 1.0 / math.sqrt(D) if scale is None else scale
    qc = q.to(dtype)  # attention runs in the cache's dtype
    ref = attention_ref(qc, K, V, sc, mask)
    tol = attention_bound(qc, K, V, sc, dtype, T) + UNIT[qdtype] * ref.abs() + TINY[qdtype]
    err = (out.float() - ref).abs()
    assert bool((err <= tol).all()), (f"decode_attention differs from attention over dequantize by "
                                      f"{err.max():.4g} (bound {tol.min():.4g})")
    if mask is not None:
        empty = ~mask.any(1)
        assert (out[empty] == 0).all(), "a fully masked row is not 0"


@fuzz(60)
@given(data=st.data())
def test_cache_and_attention_reject_bad_arguments(data):
    """Bad update / decode_attention / compress arguments raise naming the argument, and a
    refused update leaves the cache as it was."""
    preset = data.draw(st.sampled_from(PRESETS))
    cfg = kvq.get_config(preset)
    D = data.draw(st.sampled_from([d for d in valid_head_dims(cfg) if d >= 64]))
    H = data.draw(st.integers(2, 3))  # so that 2H + 1 query heads are not a multiple
    cache = kvq.KVCache(preset)
    k = torch.randn(1, H, 70, D, dtype=torch.float16)
    cache.update(k, k, 0)
    before = snapshot(cache)
    kind = data.draw(st.sampled_from(["key_dtype", "value_rank", "shape_mismatch", "heads", "dim",
                                      "cache_dtype", "layer_neg", "not_tensor", "q_rank", "q_dim",
                                      "q_heads", "q_dtype", "mask", "layer_range", "role", "config"]))
    one = torch.randn(1, H, 1, D, dtype=torch.float16)
    q = torch.randn(1, H, D, dtype=torch.float16)
    types, names = ALLOWED, ()
    if kind == "key_dtype":
        call, names = lambda: cache.update(one.to(torch.int32), one, 0), ("key",)
    elif kind == "value_rank":
        call, names = lambda: cache.update(one, one[0], 0), ("value",)
    elif kind == "shape_mismatch":
        call, names = lambda: cache.update(one, torch.randn(1, H, 2, D).half(), 0), ("key", "value")
    elif kind == "heads":
        call, names = lambda: cache.update(*(torch.randn(1, H + 1, 1, D).half(),) * 2, 0), ("key",)
    elif kind == "dim":
        call, names = lambda: cache.update(*(torch.randn(1, H, 1, D // 2).half(),) * 2, 0), ("key",)
    elif kind == "cache_dtype":
        call, names = lambda: cache.update(one.float(), one.float(), 0), ("key",)
    elif kind == "layer_neg":
        call, names = lambda: cache.update(one, one, data.draw(st.sampled_from([-1, 1.5, "0"]))), ("layer_idx",)
    elif kind == "not_tensor":
        call, names = lambda: cache.update(one.tolist(), one, 0), ("key",)
    elif kind == "q_rank":
        call, names = lambda: kvq.decode_attention(q[0], cache, 0), ("q",)
    elif kind == "q_dim":
        call, names = lambda: kvq.decode_attention(torch.randn(1, H, D + 4).half(), cache, 0), ("q",)
    elif kind == "q_heads":
        call, names = lambda: kvq.decode_attention(torch.randn(1, 2 * H + 1, D).half(), cache, 0), ("q",)
    elif kind == "q_dtype":
        call, names = lambda: kvq.decode_attention(q.to(torch.int16), cache, 0), ("q",)
    elif kind == "mask":
        call, names = lambda: kvq.decode_attention(q, cache, 0, attn_mask=torch.ones(1, 69, dtype=torch.bool)), ("attn_mask",)
    elif kind == "layer_range":
        types = (IndexError,)  # an out-of-range layer index is an IndexError naming it
        call, names = lambda: kvq.decode_attention(q, cache, 3), ("layer_idx",)
    elif kind == "role":
        call, names = lambda: kvq.compress(k, preset, data.draw(st.sampled_from(["query", "keys", ""]))), ("role",)
    else:
        call, names = lambda: kvq.compress(k, data.draw(st.sampled_from([3, None, kvq.QuantSpec(2, 32, True)])), "key"), ("config",)
    with raises_naming(*names, types=types):
        call()
    assert same_state(before, snapshot(cache)), f"a refused call ({kind}) changed the cache"


# ----------------------------------------------------------------------------- paged
def paged_expected(cache, k, v):
    """A sequence's K/V as the paged cache must hold them: its whole pages older than the recent
    window quantized page by page (kvq ops on [1, H, P, D] blocks, the page spec), the rest exact."""
    P, W = cache.page_size, cache.recent_window
    T = k.shape[2]
    if not cache.compressed:
        return k, v
    ncomp = max(0, T - W) // P
    if cache.hqmq is not None:  # per-token encoding with the contiguous cache's sets of layer 0
        cfg, H, D = cache.hqmq, k.shape[1], k.shape[3]
        out = []
        for x, role in ((k, "key"), (v, "value")):
            sec = kvq.hqmq_secondary(H, cfg.secondary_size, cfg.seed, layer_idx=0, role=role)
            codes, _ = kvq.hqmq_encode(x[:, :, :ncomp * P], sec, cfg.radius_bits, check_finite=False)
            deq = kvq.hqmq_decode(codes, sec, torch.empty((0, 4), dtype=torch.int32), cfg.radius_bits, D, x.dtype)
            out.append(torch.cat([deq, x[:, :, ncomp * P:]], dim=2))
        return out[0], out[1]
    out = []
    for x, spec in ((k, cache.kspec), (v, cache.vspec)):
        parts = [kvq.dequantize(*kvq.quantize(x[:, :, j * P:(j + 1) * P], spec.bits, spec.group_size,
                                              spec.per_channel), spec.bits, spec.per_channel, x.dtype)
                 for j in range(ncomp)]
        out.append(torch.cat(parts + [x[:, :, ncomp * P:]], dim=2))
    return out[0], out[1]


def paged_nbytes(cache, lens) -> int:
    """Compressed pages (codes + fp16 scales/zeros of both roles) + full-precision tokens."""
    H, D, P = cache.num_kv_heads, cache.head_dim, cache.page_size
    item = torch.empty((), dtype=cache.dtype).element_size()
    if not cache.compressed:
        return sum(lens) * 2 * H * D * item
    if cache.hqmq is not None:  # one packed row (codes + radius scale) per token vector; the two sets
        cfg = cache.hqmq
        page = 2 * H * P * 2 * hq_ref.units(D, cfg.secondary_size, cfg.radius_bits)
    else:
        page = sum(H * P * D * s.bits // 8 + 2 * 2 * H * group_rows(s, P, D) for s in (cache.kspec, cache.vspec))
    n, pages = 0, 0
    for L in lens:
        c = max(0, L - cache.recent_window) // P
        pages += c
        n += c * page + (L - c * P) * 2 * H * D * item
    if cache.hqmq is not None and pages:
        n += 2 * H * cache.hqmq.secondary_size * 4 * 4
    return n


# HQMQ pages without Med3x records (bit-exact against the contiguous encoding in test_paged.py)
PAGED_HQMQ = [p for p in PRESETS if isinstance(kvq.get_config(p), kvq.HQMQConfig)
              and kvq.get_config(p).outlier_factor is None]


@pytest.mark.parametrize("preset", PAGED_PRESETS + PAGED_HQMQ)
@fuzz(10)
@given(data=st.data())
def test_paged_cache(preset, data):
    """PagedKVCache: stored K/V = page-wise quantization (HQMQ: the per-token encoding) + exact
    tail; nbytes; decode attention (and lse) = fp32 attention over dequantize; freeing one
    sequence leaves the others intact and its pages are reused."""
    cfg = kvq.get_config(preset)
    dtype = data.draw(st.sampled_from(DTYPES))
    D = data.draw(st.sampled_from(valid_head_dims(cfg)))
    H = data.draw(st.integers(1, 4))
    P = data.draw(st.sampled_from([32, 64, 128]))
    W = data.draw(st.sampled_from([0, P]))
    nseq = data.draw(st.integers(1, 3))
    lens = [data.draw(st.one_of(st.sampled_from([0, 1, P - 1, P, P + 1]), st.integers(0, 300)))
            for _ in range(nseq)]
    # HQMQ's pages take chunk norms <= 61440 (kvq.hqmq.MAX_SCALE), i.e. up to 2 x max |x|
    vals = data.draw(values_st(math.log10(3e4)) if preset in PAGED_HQMQ else values_st())
    cache = kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=H, head_dim=D,
                             max_tokens=sum(lens) + 2 * P * (nseq + 1), dtype=dtype, page_size=P,
                             max_seqs=nseq + 1, recent_window=W)
    ids = [cache.add_sequence() for _ in lens]
    kv = {}
    for i, (sid, L) in enumerate(zip(ids, lens)):
        kv[sid] = (make_tensor((1, H, L, D), dtype, vals, salt=2 * i),
                   make_tensor((1, H, L, D), dtype, vals, salt=2 * i + 1))
        t = 0
        while t < L:  # a prompt, then chunks and single tokens
            n = min(L - t, data.draw(st.sampled_from([1, 1, 7, P, 2 * P + 3, 300])))
            k, v = kv[sid]
            cache.append(0, [sid], with_layout(k[:, :, t:t + n], vals.layout), v[:, :, t:t + n])
            t += n
    if data.draw(st.booleans()):  # one joint step for every sequence
        step = [make_tensor((1, H, 1, D), dtype, vals, salt=100 + 2 * i + r) for i in range(nseq) for r in (0, 1)]
        cache.append(0, ids, torch.cat(step[0::2]), torch.cat(step[1::2]))
        for i, sid in enumerate(ids):
            k, v = kv[sid]
            kv[sid] = (torch.cat([k, step[2 * i]], dim=2), torch.cat([v, step[2 * i + 1]], dim=2))

    def check():
        live = list(kv)
        assert cache.nbytes == paged_nbytes(cache, [kv[s][0].shape[2] for s in live])
        for sid in live:
            K, V = cache.dequantize(0, sid)
            eK, eV = paged_expected(cache, *kv[sid])
            assert cache.seq_len(sid) == eK.shape[2]
            assert same_values(K, eK) and same_values(V, eV), "paged K/V differ from page-wise quantization"
        g = data.draw(st.sampled_from([1, 2, 8, 9, 12, 16]))
        q = torch.randn(len(live), H * g, D, generator=torch.Generator().manual_seed(len(live))).to(dtype)
        out, lse = cache.decode_attention(q, 0, live, return_lse=True)
        assert out.shape == q.shape and out.dtype == dtype and lse.shape == q.shape[:2]
        for i, sid in enumerate(live):
            K, V = cache.dequantize(0, sid)
            T = K.shape[2]
            if T == 0:  # an empty sequence: output 0, lse -inf
                assert (out[i] == 0).all() and torch.isneginf(lse[i]).all()
                continue
            ref = attention_ref(q[i:i + 1], K, V, D ** -0.5)
            tol = attention_bound(q[i:i + 1], K, V, D ** -0.5, dtype, T) + UNIT[dtype] * ref.abs() + TINY[dtype]
            assert bool(((out[i:i + 1].float() - ref).abs() <= tol).all()), "paged attention out of bound"
            s = torch.einsum("hgd,htd->hgt", q[i].float().view(H, g, D), K[0].float()) * D ** -0.5
            ref_lse = torch.logsumexp(s, -1).reshape(-1)
            ds = attention_bound(q[i:i + 1], K, V, D ** -0.5, dtype, T, scores=True)[0, :, 0]
            assert bool(((lse[i] - ref_lse).abs() <= ds + 1e-6 * ref_lse.abs() + 1e-6).all()), "lse out of bound"

    check()
    if nseq > 1:  # free one, refill a new one: the others stay as they were
        gone = ids[data.draw(st.integers(0, nseq - 1))]
        cache.free(gone)
        del kv[gone]
        sid = cache.add_sequence()
        L = data.draw(st.integers(1, 200))
        kv[sid] = (make_tensor((1, H, L, D), dtype, vals, salt=500),
                   make_tensor((1, H, L, D), dtype, vals, salt=501))
        cache.append(0, [sid], *kv[sid])
        check()


@pytest.mark.parametrize("preset", [p for p in PRESETS if p not in PAGED_PRESETS + PAGED_HQMQ])
def test_paged_cache_refuses_unsupported_configs(preset):
    """GEAR and HQMQ-with-Med3x paged caches raise NotImplementedError naming the config class."""
    with pytest.raises(NotImplementedError) as info:
        kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=1, head_dim=64, max_tokens=256)
    assert type(kvq.get_config(preset)).__name__ in str(info.value)


@fuzz(40)
@given(data=st.data())
def test_paged_cache_rejects_bad_arguments(data):
    """Bad constructor / append / attention arguments raise naming the argument; a refused append
    changes nothing."""
    preset = data.draw(st.sampled_from(PAGED_PRESETS))
    kind = data.draw(st.sampled_from(["page_size", "recent_window", "head_dim", "num_layers", "dtype",
                                      "k_shape", "v_shape", "k_dtype", "nonfinite", "q_shape",
                                      "q_heads", "q_dtype"]))
    base = dict(num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=512, page_size=64, max_seqs=2)
    ctor = {"page_size": data.draw(st.sampled_from([0, 16, 48, 100, True])),
            "recent_window": data.draw(st.sampled_from([-64, 32, 100])),
            "head_dim": data.draw(st.sampled_from([0, 48, 96, 512])),
            "num_layers": data.draw(st.sampled_from([0, -1, 1.0])),
            "dtype": data.draw(st.sampled_from([torch.float64, torch.int32]))}
    if kind in ctor:
        with raises_naming(kind):
            kvq.PagedKVCache(preset, **{**base, kind: ctor[kind]})
        return
    cache = kvq.PagedKVCache(preset, **base)
    sid = cache.add_sequence()
    k = torch.randn(1, 2, 70, 64).half()
    cache.append(0, [sid], k, k)
    K0, V0 = cache.dequantize(0, sid)
    one = torch.randn(1, 2, 1, 64).half()
    q = torch.randn(1, 2, 64).half()
    if kind == "k_shape":
        call, names = lambda: cache.append(0, [sid], torch.randn(1, 3, 1, 64).half(), one), ("k",)
    elif kind == "v_shape":
        call, names = lambda: cache.append(0, [sid], one, torch.randn(1, 2, 2, 64).half()), ("v",)
    elif kind == "k_dtype":
        call, names = lambda: cache.append(0, [sid], one.float(), one), ("k",)
    elif kind == "nonfinite":
        bad = one.clone()
        bad[0, 1, 0, 5] = data.draw(st.sampled_from(list(BAD.values())))
        call, names = lambda: cache.append(0, [sid], one, bad), ("k", "v")
    elif kind == "q_shape":
        call, names = lambda: cache.decode_attention(q[0], 0, [sid]), ("q",)
    elif kind == "q_heads":
        call, names = lambda: cache.decode_attention(torch.randn(1, 3, 64).half(), 0, [sid]), ("q",)
    else:
        call, names = lambda: cache.decode_attention(q.float(), 0, [sid]), ("q",)
    with raises_naming(*names):
        call()
    assert cache.seq_len(sid) == 70
    K1, V1 = cache.dequantize(0, sid)
    assert bits_equal(K0, K1) and bits_equal(V0, V1)


# ----------------------------------------------------------------------------- regressions
# Deterministic reproducers of what the fuzzing found; the fuzz tests above leave out the inputs
# they cover: head dims a config's groups do not divide (valid_head_dims), GEAR magnitudes near
# the fp16 limit (top_magnitude), the NaN check of compress(x, "fp16"), HQMQ-Med3x chunks beyond
# 61440 below the threshold in a cache, and magnitudes beyond 65504 in the paged cache.
@pytest.mark.parametrize("preset,D", [("kivi-2-g64", 32), ("gear-2", 32), ("gearl-2", 32),
                                      ("outlier-2", 32), ("kivi-2", 48), ("gear-2", 48),
                                      ("flexgen-4", 32), ("int4-per-token", 48), ("gear-4", 48)])
def test_update_refuses_a_head_dim_the_format_cannot_store(preset, D):
    """A head dim the config cannot store (per-token groups that do not divide it, or a head dim
    the ops do not take) is refused by the first update, naming the argument, before the cache
    takes any token; a refused update never leaves keys and values of different lengths."""
    cfg = (kvq.KIVIConfig(bits=2, group_size=64, residual_length=128) if preset == "kivi-2-g64"
           else kvq.get_config(preset))
    cache = kvq.KVCache(cfg)
    x = torch.randn(1, 1, 1, D)
    with raises_naming("key", "value", "group_size", "x"):
        for _ in range(200):
            cache.update(x, x, 0)
    layer = cache.layers[0]
    assert layer.key.seq_len == layer.value.seq_len, (
        f"keys hold {layer.key.seq_len} tokens, values {layer.value.seq_len}")
    assert layer.key.seq_len == 0, f"the cache took {layer.key.seq_len} tokens before refusing"


def _near_limit(seed: int, shape=(1, 1, 128, 64)) -> torch.Tensor:
    """i.i.d. Gaussian fp16 data scaled to max |x| = 6e4 (inside the accepted range)."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return (x / x.abs().max() * 6e4).half()


def _refused_or_finite(preset: str, x: torch.Tensor):
    """Update a fresh cache with x as keys and values: None when it refuses (naming 'key' and
    holding nothing), else the dequantized keys."""
    cache = kvq.KVCache(preset)
    try:
        cache.update(x, x, 0)
    except ValueError as e:
        assert "'key'" in str(e) and cache.get_seq_length(0) == 0
        return None
    return cache.dequantize(0)[0]


@pytest.mark.parametrize("preset", ["gear-2", "gearl-2"])
def test_gear_cache_refuses_or_stores_finite_factors(preset):
    """Finite tokens the cache accepts (check_finite=True) dequantize to finite values: where
    kvq.compress refuses the block (its residual's fp16 factors would overflow), the cache must
    refuse the update too, naming the argument, not store Inf factors."""
    x = _near_limit(1, (1, 1, 64, 64))
    try:  # near the limit: whether the block's factors fit fp16 depends on the rounding
        kvq.compress(x, preset, "key")
    except ValueError as e:
        assert "'x'" in str(e)
    K = _refused_or_finite(preset, x)
    assert K is None or torch.isfinite(K).all(), f"{int((~torch.isfinite(K)).sum())} accepted keys dequantize to Inf/NaN"


@pytest.mark.parametrize("seed,role", [(0, "key"), (2, "value")])
def test_gear_decompress_stays_finite_in_fp16(seed, role):
    """An fp16 block inside the accepted range (max |x| = 6e4) that kvq.compress accepts
    decompresses to finite values (deq + A B^T may exceed 65504 near the limit: it must
    saturate or be refused, not become Inf)."""
    x = _near_limit(seed)
    c = compress_or_refuse(x, kvq.get_config("gearl-2"), role)
    if c is None:
        return
    out = c.decompress()
    bad = ~torch.isfinite(out)
    assert not bad.any(), (f"{int(bad.sum())} entries decompress to Inf, e.g. x = "
                           f"{float(x[bad][0])} -> {float(out[bad][0])}")


@pytest.mark.parametrize("role", ROLES)
def test_fp16_compress_refuses_nonfinite(role):
    """kvq.compress(x, "fp16", role) raises on NaN/Inf by default like every other preset (and
    like KVCache("fp16")); check_finite=False keeps them."""
    x = torch.randn(1, 2, 8, 64)
    x[0, 1, 3, 5] = float("nan")
    assert torch.isnan(kvq.compress(x, "fp16", role, check_finite=False).decompress()[0, 1, 3, 5])
    with raises_naming("key"):
        kvq.KVCache("fp16").update(x, x, 0)
    with raises_naming("x"):
        kvq.compress(x, "fp16", role)


@pytest.mark.parametrize("g", [8, 9, 12, 15, 16])
def test_paged_attention_query_groups(g):
    """PagedKVCache.decode_attention takes any number of query heads per KV head (a multiple of
    the KV heads), also one that is not a multiple of the 8 the tensor-core passes take."""
    H, D = 2, 64
    cache = kvq.PagedKVCache("kivi-2", num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=512,
                             page_size=64, max_seqs=2)
    sid = cache.add_sequence()
    gen = torch.Generator().manual_seed(g)
    k, v = (torch.randn(1, H, 100, D, generator=gen).half() for _ in range(2))
    cache.append(0, [sid], k, v)
    q = torch.randn(1, H * g, D, generator=gen).half()
    out = cache.decode_attention(q, 0, [sid])
    K, V = cache.dequantize(0, sid)
    ref = attention_ref(q, K, V, D ** -0.5)
    tol = attention_bound(q, K, V, D ** -0.5, torch.float16, 100) + UNIT[torch.float16] * ref.abs() + TINY[torch.float16]
    assert out.shape == q.shape and bool(((out.float() - ref).abs() <= tol).all())


@pytest.mark.parametrize("preset", ["kivi-2", "int4-per-token"])
@pytest.mark.parametrize("value", [-1e5, -7e4])
def test_paged_cache_refuses_what_fp16_scales_cannot_hold(preset, value):
    """PagedKVCache(check_finite=True) refuses tokens whose group its fp16 zero points / scales
    cannot represent (as KVCache does, naming the argument), instead of storing NaN groups."""
    k = torch.randn(1, 1, 130, 64, generator=torch.Generator().manual_seed(0))
    k[0, 0, 3, 5] = value
    with raises_naming("key"):
        kvq.KVCache(preset).update(k, k, 0)
    cache = kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=1, head_dim=64, max_tokens=512,
                             dtype=torch.float32, page_size=64, max_seqs=2)
    sid = cache.add_sequence()
    try:
        cache.append(0, [sid], k, k)
    except ValueError as e:
        assert "'k'" in str(e) and cache.seq_len(sid) == 0
        return
    K, V = cache.dequantize(0, sid)
    assert torch.isfinite(K).all() and torch.isfinite(V).all(), (
        f"accepted tokens dequantize to {int((~torch.isfinite(K)).sum())} NaN/Inf keys")


@pytest.mark.parametrize("big", [60000.0, 55000.0])  # chunk 0 norm 66.4k (> 65504) or 61.9k (> 61440)
def test_hqmq_med3x_cache_refuses_what_its_radius_scale_cannot_hold(big):
    """A token whose entries are all within fp16 but one of whose chunks has a norm beyond 61440
    without being a Med3x outlier (3x the median chunk norm) cannot be stored by hqmq-5:
    kvq.compress refuses it naming 'x', and the cache must refuse it too (naming the argument),
    not store an Inf radius scale that decodes the whole token to NaN."""
    x = torch.full((1, 1, 1, 32), -16384.0)
    x[0, 0, 0, 0] = big  # the other chunks' norms are 32768, so the threshold is 98304
    x = x.half()
    assert 61440 < float(hq_ref.chunk_norms_fp32(x)[0, 0, 0, 0]) < 98304
    assert hqmq_unstorable(x, kvq.get_config("hqmq-5"))
    with raises_naming("x"):
        kvq.compress(x, "hqmq-5", "key")
    K = _refused_or_finite("hqmq-5", x)
    assert K is None or torch.isfinite(K).all(), f"the accepted token dequantizes to {K[0, 0, 0, :4].tolist()}..."
