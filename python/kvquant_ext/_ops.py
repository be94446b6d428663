"""Thin Python wrappers of the ``torch.ops.kvq`` custom ops, and their fake (meta)
implementations so that ``torch.compile`` can trace through them.

No math lives here: every function documents shapes and calls the registered op.
"""
from __future__ import annotations

import torch

from . import _C  # noqa: F401  (loads the library that registers torch.ops.kvq.*)

__all__ = ["quantize", "dequantize"]


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
__all__ += ["hqmq_encode", "hqmq_decode", "hqmq_words"]


def hqmq_words(head_dim: int, secondary_size: int, radius_bits: int) -> int:
    """Packed 32-bit words per token-head vector: ``ceil(D/4 * F / 32)`` with
    ``F = ceil(log2(24 S)) + radius_bits`` bits per 4-element chunk."""
    dir_bits = (24 * secondary_size - 1).bit_length()
    return (head_dim // 4 * (dir_bits + radius_bits) + 31) // 32


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
    check_finite : raise on NaN/Inf (and |x| > 65504); False skips the check.

    Returns
    -------
    codes : int32 ``[..., H, T, W]``, W = :func:`hqmq_words` (bit fields ``dir << b_r | rcode``)
    scale : float16 ``[..., H, T]`` (largest non-outlier chunk radius, rounded up)
    outliers : int32 ``[M, 4]`` records ``{t, n << 8 | chunk, fp16x2, fp16x2}``
    """
    return torch.ops.kvq.hqmq_encode.default(x, secondary, radius_bits, outlier_threshold,
                                             check_finite)


def hqmq_decode(codes: torch.Tensor, scale: torch.Tensor, secondary: torch.Tensor,
                outliers: torch.Tensor, radius_bits: int, head_dim: int,
                dtype: torch.dtype) -> torch.Tensor:
    """Inverse of :func:`hqmq_encode`: returns ``[..., H, T, head_dim]`` in ``dtype``."""
    return torch.ops.kvq.hqmq_decode.default(codes, scale, secondary, outliers, radius_bits,
                                             head_dim, dtype)


@torch.library.register_fake("kvq::hqmq_encode")
def _hqmq_encode_fake(x, secondary, radius_bits, outlier_threshold=None, check_finite=True):
    *lead, T, D = x.shape
    W = hqmq_words(D, secondary.shape[1], radius_bits)
    codes = x.new_empty((*lead, T, W), dtype=torch.int32)
    scale = x.new_empty((*lead, T), dtype=torch.float16)
    if outlier_threshold is None:
        m = 0
    else:
        m = torch.library.get_ctx().new_dynamic_size()
    return codes, scale, x.new_empty((m, 4), dtype=torch.int32)


@torch.library.register_fake("kvq::hqmq_decode")
def _hqmq_decode_fake(codes, scale, secondary, outliers, radius_bits, head_dim, dtype):
    *lead, T, _ = codes.shape
    return codes.new_empty((*lead, T, head_dim), dtype=dtype)
