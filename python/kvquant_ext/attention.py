"""Decode attention over a compressed :class:`~kvquant_ext.KVCache` layer.

Group-quantized layers (KIVI, KCVT, per-token INT, FlexGen) run the fused
``torch.ops.kvq.decode_attention_gq`` op and HQMQ layers ``torch.ops.kvq.decode_attention_hqmq``;
both read the packed codes directly (tensor-core kernels on CUDA, a C++ loop on CPU).  FP16
layers use ``scaled_dot_product_attention``; GEAR layers still dequantize.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional

import torch

from . import _ops
from .hqmq import HQMQStream
from .streams import FullPrecisionStream, _QuantStream

_warned = set()
_MAX_GROUP = 16  # query heads per KV head in one kernel call


def decode_attention(q: torch.Tensor, cache, layer_idx: int, scale: Optional[float] = None, *,
                     attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """softmax(q·Kᵀ·scale + mask)·V over every token of ``cache`` layer ``layer_idx``.

    Parameters
    ----------
    q : ``[B, Hq, D]`` or ``[B, Hq, 1, D]`` (float16/bfloat16/float32), Hq a multiple of the
        cache's KV heads H (GQA/MQA/MHA).
    cache : a :class:`~kvquant_ext.KVCache`.
    scale : softmax scale, default ``1/sqrt(D)``.
    attn_mask : optional ``[B, T]`` bool (True = attend; e.g. False on left padding).

    Returns the attention output with the shape and dtype of ``q``.
    """
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"argument 'q' must be a torch.Tensor, got {type(q).__name__}")
    layer = cache._layer(layer_idx)
    kst, vst = layer.key, layer.value
    if kst.seq_len == 0:
        raise ValueError(f"layer {layer_idx} of the cache is empty")
    squeeze = q.dim() == 3
    q4 = q.unsqueeze(2) if squeeze else q
    if q4.dim() != 4 or q4.shape[2] != 1:
        raise ValueError(f"argument 'q' must be [B, Hq, D] or [B, Hq, 1, D], got {tuple(q.shape)}")
    B, Hq, _, D = q4.shape
    Bc, H, Dc = kst._shape
    if (B, D) != (Bc, Dc):
        raise ValueError(f"argument 'q' has [B, D] = [{B}, {D}] but the cache holds [{Bc}, {Dc}]")
    if Hq % H:
        raise ValueError(f"argument 'q' has {Hq} heads, not a multiple of the cache's {H} KV heads")
    if q.device != kst.device:
        raise ValueError(f"argument 'q' is on {q.device} but the cache is on {kst.device}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"argument 'q' must be float16, bfloat16 or float32, got {q.dtype}")
    T = kst.seq_len
    if attn_mask is not None:
        if attn_mask.shape != (B, T):
            raise ValueError(f"argument 'attn_mask' must be [B, T] = [{B}, {T}], got {tuple(attn_mask.shape)}")
        attn_mask = attn_mask.to(device=q.device, dtype=torch.bool)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    qc = q4.reshape(B, Hq, D).to(kst.dtype)

    run = None
    max_group = _MAX_GROUP
    if isinstance(kst, _QuantStream) and isinstance(vst, _QuantStream):
        operands = (*kst.attention_operands(), *vst.attention_operands())

        def run(qh):
            return _ops.decode_attention_gq(qh, *operands, attn_mask, kst.spec.bits,
                                            kst.spec.per_channel, vst.spec.bits,
                                            vst.spec.per_channel, float(scale))
    elif isinstance(kst, HQMQStream) and isinstance(vst, HQMQStream):
        operands = (*kst.attention_operands(), *vst.attention_operands())

        def run(qh):
            return _ops.decode_attention_hqmq(qh, *operands, attn_mask, kst.config.radius_bits,
                                              vst.config.radius_bits, float(scale))

        if qc.is_cuda:  # the HQMQ tensor-core path takes <= 8 query heads per KV head
            max_group = 8

    if run is not None:
        g = Hq // H
        if g <= max_group:
            out = run(qc)
        else:  # the kernels take up to 16 query heads per KV head: split the group
            qg = qc.reshape(B, H, g, D)
            parts = [run(qg[:, :, j:j + max_group].reshape(B, -1, D)).reshape(B, H, -1, D)
                     for j in range(0, g, max_group)]
            out = torch.cat(parts, dim=2).reshape(B, Hq, D)
    elif isinstance(kst, FullPrecisionStream) and isinstance(vst, FullPrecisionStream):
        out = _sdpa(qc, kst.dequantize(), vst.dequantize(), scale, attn_mask, Hq != H)
    else:
        # NOTE: GEAR layers have no fused kernel yet; they attend over the layer
        # dequantized by their own ops (correct, but reads a full-precision copy).
        name = type(cache.config).__name__
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"kvq.decode_attention: no fused kernel for {name} yet; dequantizing "
                          "the layer each call", RuntimeWarning, stacklevel=2)
        K, V = cache.dequantize(layer_idx)
        out = _sdpa(qc, K, V, scale, attn_mask, Hq != H)
    out = out.to(q.dtype)
    return out if squeeze else out.unsqueeze(2)


def _sdpa(q, K, V, scale, attn_mask, gqa):
    """SDPA of q ``[B, Hq, D]`` over K, V ``[B, H, T, D]``; a fully masked row gives zeros
    (as the fused op), not NaN."""
    mask = None if attn_mask is None else attn_mask[:, None, None, :]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.unsqueeze(2), K, V, attn_mask=mask, scale=scale, enable_gqa=gqa).squeeze(2)
    if attn_mask is not None:
        out = torch.where(attn_mask.any(dim=1)[:, None, None], out, torch.zeros_like(out))
    return out


def reference_decode_attention(q, K, V, scale, attn_mask=None):
    """fp32 softmax attention of q ``[B, Hq, D]`` over K, V ``[B, H, T, D]`` (GQA)."""
    B, Hq, D = q.shape
    H = K.shape[1]
    Kf = K.float().repeat_interleave(Hq // H, dim=1)
    Vf = V.float().repeat_interleave(Hq // H, dim=1)
    s = torch.einsum("bhd,bhtd->bht", q.float(), Kf) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bht,bhtd->bhd", p, Vf)
