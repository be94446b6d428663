"""Plain-PyTorch reference of HQMQ (brute-force codeword search) and of its packed layout.

Index conventions (same as include/kvq/hqmq/hqmq.h):
  Hurwitz unit p in [0, 8): axis p // 2 with sign (-1 if p odd); p in [8, 24): half unit
  with component i negative iff bit i of p - 8 is set.  Direction dir = s * 24 + p,
  codeword = P[p] . secondary[h, s] (Hamilton product, p on the left).
"""
from __future__ import annotations

import math

import torch


def hurwitz_units(dtype=torch.float64) -> torch.Tensor:
    """The 24 unit Hurwitz quaternions ``[24, 4]`` in kernel index order."""
    P = torch.zeros(24, 4, dtype=dtype)
    for p in range(8):
        P[p, p // 2] = -1.0 if p & 1 else 1.0
    for m in range(16):
        for i in range(4):
            P[8 + m, i] = -0.5 if (m >> i) & 1 else 0.5
    return P


def hamilton(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamilton product of broadcastable ``[..., 4]`` quaternions (w, x, y, z)."""
    a0, a1, a2, a3 = a.unbind(-1)
    b0, b1, b2, b3 = b.unbind(-1)
    return torch.stack([
        a0 * b0 - a1 * b1 - a2 * b2 - a3 * b3,
        a0 * b1 + a1 * b0 + a2 * b3 - a3 * b2,
        a0 * b2 - a1 * b3 + a2 * b0 + a3 * b1,
        a0 * b3 + a1 * b2 - a2 * b1 + a3 * b0,
    ], dim=-1)


def codebook(secondary_h: torch.Tensor) -> torch.Tensor:
    """All 24 S codewords ``[24 S, 4]`` of one head, row dir = s * 24 + p."""
    P = hurwitz_units(secondary_h.dtype).to(secondary_h.device)
    return hamilton(P[None, :, :], secondary_h[:, None, :]).reshape(-1, 4)


def closed_form_nearest_unit(v: torch.Tensor):
    """Closed-form best Hurwitz unit for ``v [..., 4]``: (score, index)."""
    a = v.abs()
    m, i = a.max(dim=-1)
    h = a.sum(dim=-1) / 2
    neg = (v < 0).long()
    half_idx = 8 + (neg * torch.tensor([1, 2, 4, 8], device=v.device)).sum(-1)
    vi = v.gather(-1, i[..., None])[..., 0]
    axis_idx = 2 * i + (vi < 0).long()
    return torch.maximum(m, h), torch.where(m >= h, axis_idx, half_idx)


def dir_bits(S: int) -> int:
    return (24 * S - 1).bit_length()


def words(D: int, S: int, radius_bits: int) -> int:
    return (D // 4 * (dir_bits(S) + radius_bits) + 31) // 32


def unpack(codes: torch.Tensor, D: int, S: int, radius_bits: int):
    """Fields of packed rows ``[..., W]`` -> (dir, rcode) ``[..., D/4]`` (int64)."""
    F = dir_bits(S) + radius_bits
    C = D // 4
    w = codes.long() & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)
    bit = torch.arange(C, device=codes.device) * F
    lo = w[..., bit // 32] >> (bit % 32)
    hi = w[..., bit // 32 + 1] << (32 - bit % 32)
    f = (lo | hi) & ((1 << F) - 1)
    return f >> radius_bits, f & ((1 << radius_bits) - 1)


def chunk_norms(x: torch.Tensor) -> torch.Tensor:
    *lead, D = x.shape
    return x.double().reshape(*lead, D // 4, 4).norm(dim=-1)


def brute_force_best(x: torch.Tensor, secondary: torch.Tensor):
    """Best inner product and argmax over all 24 S codewords for every chunk of
    ``x [B, H, T, D]`` (float64); returns (best [B,H,T,C], argmax [B,H,T,C], all-scores fn)."""
    B, H, T, D = x.shape
    xc = x.double().reshape(B, H, T * D // 4, 4)
    best = torch.empty(B, H, T * D // 4, dtype=torch.float64)
    arg = torch.empty(B, H, T * D // 4, dtype=torch.long)
    for h in range(H):
        cb = codebook(secondary[h].double())
        s = xc[:, h] @ cb.T
        best[:, h], arg[:, h] = s.max(dim=-1)
    return best.reshape(B, H, T, D // 4), arg.reshape(B, H, T, D // 4)


def chosen_score(x: torch.Tensor, secondary: torch.Tensor, dirs: torch.Tensor) -> torch.Tensor:
    """<x_chunk, codeword[dir]> for the chosen directions (float64)."""
    B, H, T, D = x.shape
    xc = x.double().reshape(B, H, T, D // 4, 4)
    out = torch.empty(B, H, T, D // 4, dtype=torch.float64)
    for h in range(H):
        cb = codebook(secondary[h].double())
        out[:, h] = (xc[:, h] * cb[dirs[:, h]]).sum(-1)
    return out


def encode_reference(x: torch.Tensor, secondary: torch.Tensor, radius_bits: int,
                     threshold=None):
    """Reference encode: (dir, rcode, scale, outlier_mask) with brute-force directions."""
    r = chunk_norms(x)
    outl = torch.zeros_like(r, dtype=torch.bool)
    if threshold is not None:
        outl = r > threshold.double()[None, :, None, None]
    rmax = torch.where(outl, torch.zeros_like(r), r).amax(dim=-1) if r.shape[-1] else r.sum(-1)
    scale = rmax.float().to(torch.float16)
    scale = torch.where(scale.float() < rmax.float(), torch.nextafter(scale, torch.tensor(
        math.inf, dtype=torch.float16)), scale) if scale.numel() else scale
    maxq = (1 << radius_bits) - 1
    step = scale.double() / maxq
    rc = torch.where(step[..., None] > 0, (r / step[..., None].clamp_min(1e-300)).round(),
                     torch.zeros_like(r)).clamp(0, maxq).long()
    _, dirs = brute_force_best(x, secondary)
    rc = torch.where(outl, torch.zeros_like(rc), rc)
    dirs = torch.where(outl, torch.zeros_like(dirs), dirs)
    return dirs, rc, scale, outl


def decode_reference(dirs, rcode, scale, secondary, radius_bits, x_exact=None, outl=None):
    """Reference decode ``[B, H, T, D]`` (float64) from unpacked fields; outlier chunks
    are taken from ``x_exact`` (rounded to fp16) where ``outl`` is set."""
    B, H, T, C = dirs.shape
    maxq = (1 << radius_bits) - 1
    rq = rcode.double() * (scale.double()[..., None] / maxq)
    out = torch.empty(B, H, T, C, 4, dtype=torch.float64)
    for h in range(H):
        cb = codebook(secondary[h].double())
        out[:, h] = rq[:, h, ..., None] * cb[dirs[:, h]]
    if outl is not None and x_exact is not None:
        xe = x_exact.to(torch.float16).double().reshape(B, H, T, C, 4)
        out = torch.where(outl[..., None], xe, out)
    return out.reshape(B, H, T, C * 4)
