"""Plain-PyTorch reference of asymmetric min/max group quantization (docs/methods.md)
and of KIVI's streaming rule.  Mirrors the library's storage choices: zero point
rounded down to fp16, scale rounded up to fp16, codes round-half-even."""
from __future__ import annotations

import torch


def fp16_round_down(v: torch.Tensor) -> torch.Tensor:
    h = v.half()
    return torch.where(h.float() > v, torch.nextafter(h, torch.full_like(h, float("-inf"))), h)


def fp16_round_up(v: torch.Tensor) -> torch.Tensor:
    h = v.half()
    return torch.where(h.float() < v, torch.nextafter(h, torch.full_like(h, float("inf"))), h)


def _groups(x: torch.Tensor, group_size: int, per_channel: bool):
    """View x [..., T, D] as [..., ngroups, G, D] (per-channel) or [..., T, D/G, G]."""
    T, D = x.shape[-2:]
    if per_channel:
        G = T if group_size == -1 else group_size
        return x.reshape(*x.shape[:-2], T // G, G, D), -2
    G = D if group_size == -1 else group_size
    return x.reshape(*x.shape[:-1], D // G, G), -1


def quantize_ref(x: torch.Tensor, bits: int, group_size: int, per_channel: bool):
    """Returns (codes [..., T, D] int64 unpacked, scale fp16, zero fp16) with the library's
    scale/zero shapes."""
    xf = x.float()
    g, dim = _groups(xf, group_size, per_channel)
    mn, mx = g.amin(dim=dim, keepdim=True), g.amax(dim=dim, keepdim=True)
    maxq = (1 << bits) - 1
    z = fp16_round_down(mn)
    inv_maxq = torch.tensor(1.0 / maxq, dtype=torch.float32)  # fp32 constant, as the kernels
    s = fp16_round_up(torch.clamp((mx - z.float()) * inv_maxq.to(mx.device), min=0.0))
    inv = torch.where(s.float() > 0, 1.0 / s.float(), torch.zeros_like(s.float()))
    q = torch.clamp((g - z.float()) * inv, 0, maxq).round().to(torch.int64)
    codes = q.reshape(x.shape)
    return codes, s.squeeze(dim), z.squeeze(dim)


def dequantize_ref(codes, scale, zero, per_channel: bool) -> torch.Tensor:
    """fp32 dequantization of unpacked codes."""
    T, D = codes.shape[-2:]
    if per_channel:
        ng = scale.shape[-2]
        G = T // ng
        s = scale.float().repeat_interleave(G, dim=-2)
        z = zero.float().repeat_interleave(G, dim=-2)
    else:
        ng = scale.shape[-1]
        G = D // ng
        s = scale.float().repeat_interleave(G, dim=-1)
        z = zero.float().repeat_interleave(G, dim=-1)
    return codes.float() * s + z


def expand_scale(scale, codes_shape, per_channel: bool) -> torch.Tensor:
    T, D = codes_shape[-2:]
    if per_channel:
        return scale.float().repeat_interleave(T // scale.shape[-2], dim=-2)
    return scale.float().repeat_interleave(D // scale.shape[-1], dim=-1)


def pack_ref(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack [..., D] codes LSB-first into int32 words along D."""
    cpw = 32 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, cpw)
    shifts = torch.arange(cpw, dtype=torch.int64) * bits
    w = (c << shifts).sum(-1)
    w = torch.where(w >= 2**31, w - 2**32, w)
    return w.to(torch.int32)


def unpack_ref(words: torch.Tensor, bits: int) -> torch.Tensor:
    cpw = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(cpw, dtype=torch.int64, device=words.device) * bits
    c = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return c.reshape(*words.shape[:-1], -1)


def kivi_stream_ref(tokens: list, R: int, per_channel: bool):
    """Apply KIVI's streaming rule to a sequence of appends (each [B, H, t, D]).

    Returns (list of quantized blocks in order, residual tensor).  Per-channel (keys):
    buffer until R tokens, then quantize the R (prefill: the first T - T mod R).
    Per-token (values): FIFO of the last R tokens; tokens pushed out are quantized.
    """
    blocks, residual = [], None
    for x in tokens:
        full = x if residual is None else torch.cat([residual, x], dim=2)
        n = (full.shape[2] // R) * R if per_channel else max(full.shape[2] - R, 0)
        if n:
            blocks.append(full[:, :, :n])
        residual = full[:, :, n:]
    return blocks, residual
