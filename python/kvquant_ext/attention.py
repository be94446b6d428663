"""Decode attention over a compressed :class:`~kvquant_ext.KVCache` layer.

NOTE(founding): this first version dequantizes the layer and runs plain softmax attention;
it is the semantic reference and is being replaced by the fused ``torch.ops.kvq``
decode-attention ops (issue "fused decode attention"), with the same signature.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


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
    K, V = cache.dequantize(layer_idx)
    squeeze = q.dim() == 3
    if squeeze:
        q = q.unsqueeze(2)
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"argument 'q' must be [B, Hq, D] or [B, Hq, 1, D], got {tuple(q.shape)}")
    B, Hq, _, D = q.shape
    H = K.shape[1]
    if Hq % H:
        raise ValueError(f"argument 'q' has {Hq} heads, not a multiple of the cache's {H} KV heads")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    Kf = K.float().repeat_interleave(Hq // H, dim=1)
    Vf = V.float().repeat_interleave(Hq // H, dim=1)
    s = torch.matmul(q.float(), Kf.transpose(-1, -2)) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask.bool()[:, None, None, :], float("-inf"))
    out = torch.matmul(torch.softmax(s, dim=-1), Vf).to(q.dtype)
    return out.squeeze(2) if squeeze else out
