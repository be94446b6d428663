"""Thin Python wrappers of the ``torch.ops.kvq`` custom ops, and their fake (meta)
implementations so that ``torch.compile`` can trace through them.

No math lives here: every function documents shapes and calls the registered op.
"""
from __future__ import annotations

import math

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.kvq.*)
from ._build_config import DTYPES

__all__ = ["quantize", "dequantize"]

FLOAT_DTYPES = tuple(getattr(torch, name) for name in DTYPES)  # the floating inputs of every op


def quantize(x: torch.Tensor, bits: int, group_size: int, per_channel: bool,
             *, check_finite: bool = True):
    """Asymmetric min/max group quantization with bit packing.

    Parameters
    ----------
    x : Tensor ``[..., T, D]`` float16/bfloat16/float32, D in {32, 64, 128, 256}.
    bits : 2, 4 or 8.
    group_size : G, or -1 for the whole axis (KCVT).
    per_channel : True groups G consecutive tokens of one channel (keys, requires
        T % G == 0); False groups G consecutive channels of one token (values, D % G == 0,
        G a power of two >= 8).
    check_finite : raise on NaN/Inf (and |x| > 65504); False skips the check.

    Returns
    -------
    codes : int32 ``[..., T, D*bits/32]`` (LSB-first, 32/bits codes per word along D)
    scale, zero : float16 ``[..., T/G, D]`` (per-channel) or ``[..., T, D/G]`` (per-token)
    """
    return torch.ops.kvq.quantize.default(x, bits, group_size, per_channel, check_finite)


def dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int,
               per_channel: bool, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`quantize`: returns ``[..., T, D]`` in ``dtype``."""
    return torch.ops.kvq.dequantize.default(codes, scale, zero, bits, per_channel, dtype)


# ----------------------------------------------------------------------------- fakes
def _resolve_group(n: int, g: int) -> int:
    return n if g == -1 else g


@torch.library.register_fake("kvq::quantize")
def _quantize_fake(x, bits, group_size, per_channel, check_finite=True):
    *lead, T, D = x.shape
    codes = x.new_empty((*lead, T, D * bits // 32), dtype=torch.int32)
    if per_channel:
        G = _resolve_group(T, group_size)
        ng = T // G if G else 0
        sshape = (*lead, ng, D)
    else:
        G = _resolve_group(D, group_size)
        sshape = (*lead, T, D // G)
    return codes, x.new_empty(sshape, dtype=torch.float16), x.new_empty(sshape, dtype=torch.float16)


@torch.library.register_fake("kvq::dequantize")
def _dequantize_fake(codes, scale, zero, bits, per_channel, dtype):
    *lead, T, W = codes.shape
    return codes.new_empty((*lead, T, W * 32 // bits), dtype=dtype)


# ----------------------------------------------------------------------------- HQMQ
__all__ += ["hqmq_encode", "hqmq_decode", "hqmq_row_layout", "hqmq_units"]


def hqmq_row_layout(head_dim: int, secondary_size: int, radius_bits: int) -> dict:
    """Bit layout of one packed HQMQ row (``include/kvq/hqmq/hqmq.h``, docs/ops.md): chunk c's
    field ``dir << b_r | rcode`` is stored as ``plain`` (its low ``E`` bits, at bit ``c * E``)
    and the base-``R`` digit ``field >> E``; digits are packed ``K`` per 16-bit group from bit
    ``groups_at``, the last ``C % K`` as one number of ``tail_bits`` bits at ``tail_at``, then the
    radius scale at ``scale_at`` in the rest of the last unit (``scale_bits``, 8 to 15: the top
    bits of the fp16 value's magnitude); ``units`` 16-bit units in all."""
    dir_bits = (24 * secondary_size - 1).bit_length()
    C, L = head_dim // 4, dir_bits - 4
    R = -(-24 * secondary_size // (1 << L))
    K = 5 if R == 9 else 4
    G = C // K
    tail_bits = (R ** (C - G * K) - 1).bit_length()
    E = L + radius_bits
    groups_at = C * E
    tail_at = groups_at + 16 * G
    scale_at = tail_at + tail_bits
    units = (scale_at + 8 + 15) // 16
    return dict(C=C, E=E, R=R, K=K, G=G, tail_bits=tail_bits, groups_at=groups_at, tail_at=tail_at,
                scale_at=scale_at, scale_bits=min(15, 16 * units - scale_at), units=units)


def hqmq_units(head_dim: int, secondary_size: int, radius_bits: int) -> int:
    """16-bit units per packed HQMQ row (one token of one head, its radius scale included)."""
    return hqmq_row_layout(head_dim, secondary_size, radius_bits)["units"]


def hqmq_encode(x: torch.Tensor, secondary: torch.Tensor, radius_bits: int,
                outlier_threshold=None, *, check_finite: bool = True):
    """Hurwitz quaternion multiplicative quantization (HQMQ, + optional Med3x outliers).

    Parameters
    ----------
    x : Tensor ``[..., H, T, D]`` float16/bfloat16/float32, D in {32, 64, 128, 256}.
    secondary : float32 ``[H, S, 4]`` unit quaternions (one set per KV head), 1 <= S <= 2048.
    radius_bits : b_r in 1..8.
    outlier_threshold : optional float32 ``[H]``: chunks with norm > threshold[h] are stored
        exactly (fp16 records) and excluded from their token's radius scale.
    check_finite : raise on NaN/Inf, on |x| > 65504 and on a non-outlier chunk norm above
        61440 (the largest radius scale); False skips the check.

    Returns
    -------
    codes : int16 ``[..., H, T, U]``, U = :func:`hqmq_units`: one packed row per token (the
        chunks' direction and radius codes and the token's radius scale, the largest
        non-outlier chunk radius rounded up to 8-15 bits; :func:`hqmq_row_layout`)
    outliers : int32 ``[M, 4]`` records ``{t, n << 8 | chunk, fp16x2, fp16x2}``
    """
    return torch.ops.kvq.hqmq_encode.default(x, secondary, radius_bits, outlier_threshold,
                                             check_finite)


def hqmq_decode(codes: torch.Tensor, secondary: torch.Tensor, outliers: torch.Tensor,
                radius_bits: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`hqmq_encode`: returns ``[..., H, T, head_dim]`` in ``dtype``."""
    return torch.ops.kvq.hqmq_decode.default(codes, secondary, outliers, radius_bits, head_dim, dtype)


@torch.library.register_fake("kvq::hqmq_encode")
def _hqmq_encode_fake(x, secondary, radius_bits, outlier_threshold=None, check_finite=True):
    *lead, T, D = x.shape
    codes = x.new_empty((*lead, T, hqmq_units(D, secondary.shape[1], radius_bits)), dtype=torch.int16)
    if outlier_threshold is None:
        m = 0
    else:
        m = torch.library.get_ctx().new_dynamic_size()
    return codes, x.new_empty((m, 4), dtype=torch.int32)


@torch.library.register_fake("kvq::hqmq_decode")
def _hqmq_decode_fake(codes, secondary, outliers, radius_bits, head_dim, dtype):
    *lead, T, _ = codes.shape
    return codes.new_empty((*lead, T, head_dim), dtype=dtype)


# ----------------------------------------------------------------------------- GEAR
__all__ += ["outlier_count", "outlier_index_dtype", "outlier_select", "lowrank_power_iter",
            "gear_compress", "gear_decompress"]


def outlier_count(sparsity: float, length: int) -> int:
    """Outliers per side of a vector of ``length`` entries: ``ceil(sparsity/2 * length)``,
    at most ``length // 2`` (the same double expression as the C++ op)."""
    if not sparsity > 0.0 or length <= 0:
        return 0
    k = max(0, math.ceil(float(sparsity) * 0.5 * float(length) - 1e-9))
    return min(k, length // 2)


def outlier_index_dtype(length: int) -> torch.dtype:
    """Stored index dtype for vectors of ``length`` entries: uint8 / int16 / int32."""
    return torch.uint8 if length <= 256 else (torch.int16 if length <= 32768 else torch.int32)


def outlier_select(x: torch.Tensor, k: int, per_channel: bool):
    """Per-vector top-k and bottom-k entries.

    Parameters
    ----------
    x : ``[..., T, D]`` float16/bfloat16/float32.
    k : entries per side (``2k <= L``; see :func:`outlier_count`).
    per_channel : True: vectors are channels (length T, keys); False: tokens (length D).

    Returns
    -------
    values : ``[..., V, 2k]`` x.dtype (V = D or T): slots ``[0, k)`` the k largest entries,
        ``[k, 2k)`` the k smallest, each half in increasing index order; exact copies.
    indices : ``[..., V, 2k]`` uint8 (L <= 256), int16 (L <= 32768) or int32: positions
        along the vector.  Ties: a smaller index counts as larger.
    """
    return torch.ops.kvq.outlier_select.default(x, k, per_channel)


def lowrank_power_iter(x: torch.Tensor, rank: int, iters: int = 3, seed: int = 0):
    """Rank-``rank`` (<= 8) approximation ``x ~= A @ B.mT`` of every ``[T, d]`` matrix by
    power (subspace) iteration with Gram-Schmidt orthonormalization.

    Returns ``A [..., T, r]`` (orthonormal columns) and ``B [..., d, r] = x^T A``, in x.dtype.
    """
    return torch.ops.kvq.lowrank_power_iter.default(x, rank, iters, seed)


def gear_compress(x: torch.Tensor, bits: int, group_size: int, per_channel: bool,
                  sparsity: float, rank: int, iters: int = 3, seed: int = 0,
                  *, check_finite: bool = True):
    """GEAR compression of ``x [..., T, D]`` in one call (layout: docs/ops.md).

    Returns ``(codes, scale, zero, outlier_values, outlier_indices, A, B)``: the backbone in
    :func:`quantize`'s format (of x with its outliers clamped), ``k = outlier_count(sparsity,
    L)`` outliers per side and vector as in :func:`outlier_select`, and fp16 factors
    ``A [..., T, r]``, ``B [..., D, r]`` of the residual (r = 0 allowed).
    """
    return torch.ops.kvq.gear_compress.default(x, bits, group_size, per_channel, float(sparsity),
                                               rank, iters, seed, check_finite)


def gear_decompress(codes, scale, zero, outlier_values, outlier_indices, A, B, bits: int,
                    per_channel: bool, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`gear_compress`: ``dequantize + A B^T``, outliers restored exactly."""
    return torch.ops.kvq.gear_decompress.default(codes, scale, zero, outlier_values,
                                                 outlier_indices, A, B, bits, per_channel, dtype)


@torch.library.register_fake("kvq::outlier_select")
def _outlier_select_fake(x, k, per_channel):
    *lead, T, D = x.shape
    V, L = (D, T) if per_channel else (T, D)
    return (x.new_empty((*lead, V, 2 * k)),
            x.new_empty((*lead, V, 2 * k), dtype=outlier_index_dtype(L)))


@torch.library.register_fake("kvq::lowrank_power_iter")
def _lowrank_power_iter_fake(x, rank, iters, seed):
    *lead, T, d = x.shape
    return x.new_empty((*lead, T, rank)), x.new_empty((*lead, d, rank))


@torch.library.register_fake("kvq::gear_compress")
def _gear_compress_fake(x, bits, group_size, per_channel, sparsity, rank, iters, seed,
                        check_finite=True):
    *lead, T, D = x.shape
    codes, scale, zero = _quantize_fake(x, bits, group_size, per_channel)
    V, L = (D, T) if per_channel else (T, D)
    k = outlier_count(sparsity, L)
    return (codes, scale, zero, x.new_empty((*lead, V, 2 * k)),
            x.new_empty((*lead, V, 2 * k), dtype=outlier_index_dtype(L)),
            x.new_empty((*lead, T, rank), dtype=torch.float16),
            x.new_empty((*lead, D, rank), dtype=torch.float16))


@torch.library.register_fake("kvq::gear_decompress")
def _gear_decompress_fake(codes, scale, zero, outlier_values, outlier_indices, A, B, bits,
                          per_channel, dtype):
    *lead, T, W = codes.shape
    return codes.new_empty((*lead, T, W * 32 // bits), dtype=dtype)


# ----------------------------------------------------------------------------- decode attention
__all__ += ["decode_attention_gq", "decode_attention_gear"]


def decode_attention_gq(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero,
                        v_residual, mask, k_bits: int, k_per_channel: bool, v_bits: int,
                        v_per_channel: bool, scale: float) -> torch.Tensor:
    """Decode attention over a group-quantized cache layer (fused kernels on CUDA).

    ``q`` ``[B, Hq, D]``; per role: ``codes`` int32 ``[B, H, Tq, D*bits/32]``, ``scale``/``zero``
    fp16 in :func:`quantize`'s layout (may be views with batch/head strides), ``residual``
    ``[B, H, Tr, D]`` in q's dtype (token t reads the store when t < Tq, else the residual);
    ``mask`` ``[B, T]`` (nonzero = attend) or None.  Returns ``[B, Hq, D]`` in q's dtype.
    """
    return torch.ops.kvq.decode_attention_gq.default(
        q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero, v_residual, mask,
        k_bits, k_per_channel, v_bits, v_per_channel, scale)


@torch.library.register_fake("kvq::decode_attention_gq")
def _decode_attention_gq_fake(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero,
                              v_residual, mask, k_bits, k_per_channel, v_bits, v_per_channel, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def decode_attention_gear(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero,
                          v_residual, mask, bits: int, k_gear, v_gear, prefill_tokens: int,
                          block_tokens: int, scale: float) -> torch.Tensor:
    """Decode attention over a GEAR layer (KIVI backbone): the backbone operands of
    :func:`decode_attention_gq` (keys per channel, values per token, one bit width) plus per
    role ``[A0, B0, ov0, oi0, off0, od0, A1, B1, ov1, oi1, off1, od1]``: low-rank factors,
    outliers (exact values ``ov``, indices ``oi``, key tile offsets ``off``) and the outliers'
    precomputed corrections ``od = v - xhat`` (cache dtype, the shape of ``ov``) of the
    prefill block (``prefill_tokens`` tokens) and of the concatenated decode blocks
    (``block_tokens`` each); see ``GEARStream.attention_operands``.  Low rank and corrections
    are applied inside the kernel (``ov`` is checked but not read)."""
    return torch.ops.kvq.decode_attention_gear.default(
        q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero, v_residual, mask,
        bits, k_gear, v_gear, prefill_tokens, block_tokens, scale)


@torch.library.register_fake("kvq::decode_attention_gear")
def _decode_attention_gear_fake(q, k_codes, k_scale, k_zero, k_residual, v_codes, v_scale, v_zero,
                                v_residual, mask, bits, k_gear, v_gear, prefill_tokens,
                                block_tokens, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


__all__ += ["decode_attention_hqmq"]


def decode_attention_hqmq(q, k_codes, k_secondary, k_outliers, k_outlier_ptr, v_codes,
                          v_secondary, v_outliers, v_outlier_ptr, mask,
                          k_radius_bits: int, v_radius_bits: int, scale: float, k_residual=None,
                          v_residual=None) -> torch.Tensor:
    """Decode attention over an HQMQ cache layer (fused kernel on CUDA, C++ twin on CPU).

    ``q`` ``[B, Hq, D]``; per role: ``codes`` int16 ``[B, H, T, U]`` (:func:`hqmq_encode`'s
    packed rows; may be a view with batch/head strides),
    ``secondary`` fp32 ``[H, S, 4]``, ``outliers`` int32 ``[M, 4]`` Med3x records ordered by
    ``(t // 32, b * H + h)`` and ``outlier_ptr`` int64 ``[ceil(T/32) * B * H + 1]``, the CSR
    offsets over that key (empty when ``M == 0``; see ``HQMQStream.attention_operands``);
    ``k_residual`` / ``v_residual`` ``[B, H, Tr, D]`` in q's dtype (or None): the recent window,
    tokens ``T .. T + Tr - 1`` in full precision after the ``T`` encoded ones;
    ``mask`` ``[B, T + Tr]`` (nonzero = attend) or None.  Returns ``[B, Hq, D]`` in q's dtype.
    """
    return torch.ops.kvq.decode_attention_hqmq.default(
        q, k_codes, k_secondary, k_outliers, k_outlier_ptr, v_codes,
        v_secondary, v_outliers, v_outlier_ptr, mask, k_radius_bits, v_radius_bits, scale,
        k_residual, v_residual)


@torch.library.register_fake("kvq::decode_attention_hqmq")
def _decode_attention_hqmq_fake(q, k_codes, k_secondary, k_outliers, k_outlier_ptr,
                                v_codes, v_secondary, v_outliers, v_outlier_ptr, mask,
                                k_radius_bits, v_radius_bits, scale, k_residual=None, v_residual=None):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


# ----------------------------------------------------------------------------- paged KV
def paged_append(k_fp, v_fp, k, v, slot_mapping, k_codes=None, k_scale=None, k_zero=None, v_codes=None,
                 v_scale=None, v_zero=None, compress_src=None, compress_dst=None, bits=2,
                 k_per_channel=True, v_per_channel=False) -> None:
    """Write tokens into full-precision pages and compress full pages (in place).

    ``k, v [N, H, D]``: token i goes to page ``slot_mapping[i] // P``, row ``slot_mapping[i] % P``
    of ``k_fp, v_fp [pages, H, P, D]``.  Then the full-precision pages ``compress_src`` (int64
    ``[M]``) are quantized into the compressed pages ``compress_dst`` of the pools ``k_codes``
    (int32 ``[pages, H, P, D*bits/32]``), ``k_scale`` / ``k_zero`` (fp16, kvq.quantize's layout
    of one ``[1, H, P, D]`` block) and the value pools likewise; a pair into page 0 (scratch) is
    skipped.  No host synchronisation."""
    torch.ops.kvq.paged_append.default(k_fp, v_fp, k, v, slot_mapping, k_codes, k_scale, k_zero, v_codes,
                                       v_scale, v_zero, compress_src, compress_dst, bits, k_per_channel,
                                       v_per_channel)


def paged_decode_plan(seq_lens: torch.Tensor, comp_lens: torch.Tensor, max_items: int) -> torch.Tensor:
    """Work list of a batch (int32, on the lengths' device): which (sequence, token range) each
    CTA of :func:`paged_decode_attention` takes.  ``seq_lens`` / ``comp_lens`` int32 ``[num_seqs]``
    (tokens, and of them compressed: a multiple of the page size).  ``max_items`` >=
    ``2 num_seqs + 2`` bounds the items (and the launch grid); compute once per batch and reuse
    it for every layer.  Reads the lengths on the device: a CUDA graph that captured it stays
    valid when they change."""
    return torch.ops.kvq.paged_decode_plan.default(seq_lens, comp_lens, max_items)


def paged_decode_attention(q, k_fp, v_fp, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                           seq_lens, comp_lens, work, bits: int, k_per_channel: bool, v_per_channel: bool,
                           scale: float):
    """Decode attention of ``q [num_seqs, Hq, D]`` over paged caches of different lengths.

    Returns ``(out [num_seqs, Hq, D], lse float32 [num_seqs, Hq])``; ``lse`` is the natural log
    of the softmax denominator of the scaled scores (-inf for an empty sequence), so partial
    results over disjoint token sets merge exactly.  Layout: docs/serving.md."""
    return torch.ops.kvq.paged_decode_attention.default(q, k_fp, v_fp, k_codes, k_scale, k_zero, v_codes,
                                                        v_scale, v_zero, block_table, seq_lens, comp_lens,
                                                        work, bits, k_per_channel, v_per_channel, scale)


def paged_decode_attention_hqmq(q, k_fp, v_fp, k_codes, k_secondary, v_codes, v_secondary,
                                block_table, seq_lens, comp_lens, work, radius_bits: int, scale: float):
    """:func:`paged_decode_attention` over HQMQ pages: ``k_codes`` int16 ``[pages, H, P, U]``
    (:func:`hqmq_encode` of one ``[1, H, P, D]`` block per page, without Med3x records),
    ``k_secondary`` float32 ``[H, S, 4]``; values likewise.  Returns ``(out, lse)``.  Layout:
    docs/serving.md."""
    return torch.ops.kvq.paged_decode_attention_hqmq.default(q, k_fp, v_fp, k_codes, k_secondary, v_codes,
                                                             v_secondary, block_table, seq_lens,
                                                             comp_lens, work, radius_bits, scale)


def paged_work_size(num_seqs: int, max_items: int) -> int:
    """Length of the int32 work list of :func:`paged_decode_plan`."""
    return 4 + 3 * max_items + 2 * num_seqs


@torch.library.register_fake("kvq::paged_append")
def _paged_append_fake(k_fp, v_fp, k, v, slot_mapping, k_codes=None, k_scale=None, k_zero=None, v_codes=None,
                       v_scale=None, v_zero=None, compress_src=None, compress_dst=None, bits=2,
                       k_per_channel=True, v_per_channel=False):
    return None


@torch.library.register_fake("kvq::paged_decode_plan")
def _paged_decode_plan_fake(seq_lens, comp_lens, max_items):
    return seq_lens.new_empty((paged_work_size(seq_lens.shape[0], max_items),), dtype=torch.int32)


@torch.library.register_fake("kvq::paged_decode_attention")
def _paged_decode_attention_fake(q, k_fp, v_fp, k_codes, k_scale, k_zero, v_codes, v_scale, v_zero, block_table,
                                 seq_lens, comp_lens, work, bits, k_per_channel, v_per_channel, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)


@torch.library.register_fake("kvq::paged_decode_attention_hqmq")
def _paged_decode_attention_hqmq_fake(q, k_fp, v_fp, k_codes, k_secondary, v_codes, v_secondary,
                                      block_table, seq_lens, comp_lens, work, radius_bits, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:2], dtype=torch.float32)
