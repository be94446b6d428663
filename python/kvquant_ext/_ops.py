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
