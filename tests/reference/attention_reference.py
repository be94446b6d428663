"""Plain-PyTorch reference of single-query (decode) softmax attention."""
from __future__ import annotations

import torch


def reference_decode_attention(q, K, V, scale, attn_mask=None):
    """fp32 softmax attention of q ``[B, Hq, D]`` over K, V ``[B, H, T, D]`` (GQA: query
    head j reads KV head j // (Hq / H)); ``attn_mask`` ``[B, T]`` bool, True = attend; a
    fully masked row gives zeros."""
    B, Hq, D = q.shape
    H = K.shape[1]
    Kf = K.float().repeat_interleave(Hq // H, dim=1)
    Vf = V.float().repeat_interleave(Hq // H, dim=1)
    s = torch.einsum("bhd,bhtd->bht", q.float(), Kf) * scale
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("bht,bhtd->bhd", p, Vf)
