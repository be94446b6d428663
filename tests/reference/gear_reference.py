"""Plain-PyTorch reference of GEAR (docs/methods.md): per-vector fixed-k outliers with the
library's tie rule, outliers filled within their own quantization group (clamped into the
group's inlier range; a group without an inlier becomes +0) before the backbone
quantization (quant_reference), the residual with zeros at outliers, and a QR-based subspace
iteration from the same start vectors.

Independent of the extension: only torch and quant_reference are used.
"""
from __future__ import annotations

import math

import torch

from .quant_reference import dequantize_ref, quantize_ref

_M64 = (1 << 64) - 1


def outlier_count(sparsity: float, length: int) -> int:
    if not sparsity > 0.0 or length <= 0:
        return 0
    return min(max(0, math.ceil(sparsity * 0.5 * length - 1e-9)), length // 2)


def _vectors(x: torch.Tensor, per_channel: bool) -> torch.Tensor:
    """[..., T, D] -> [..., V, L] (a view)."""
    return x.transpose(-1, -2) if per_channel else x


def outlier_select_ref(x: torch.Tensor, k: int, per_channel: bool):
    """Returns (values [..., V, 2k] x.dtype, indices int64, lo, hi [..., V] float32).

    Order: by value, ties broken so that a smaller index counts as larger; slots [0, k) the
    k largest, [k, 2k) the k smallest, each half sorted by index."""
    vec = _vectors(x, per_channel)
    vf = vec.float()
    L = vec.shape[-1]
    top_sorted, top_order = torch.sort(vf, dim=-1, descending=True, stable=True)
    bot_sorted, bot_order = torch.sort(vf.flip(-1), dim=-1, stable=True)
    bot_order = (L - 1) - bot_order
    top_idx = top_order[..., :k].sort(dim=-1).values
    bot_idx = bot_order[..., :k].sort(dim=-1).values
    idx = torch.cat([top_idx, bot_idx], dim=-1)
    values = torch.gather(vec, -1, idx)
    if L >= 2 * k + 1:
        hi, lo = top_sorted[..., k], bot_sorted[..., k]
    else:
        hi = lo = torch.zeros(vec.shape[:-1])
    return values, idx, lo, hi


def init_basis(seed: int, d: int, r: int) -> torch.Tensor:
    """The library's start vectors (splitmix64 of seed, row, column) -> [d, r] float64."""
    out = torch.empty(d, r, dtype=torch.float64)
    for j in range(d):
        for c in range(r):
            z = (seed * 0x9E3779B97F4A7C15 + j * 0xBF58476D1CE4E5B9 + c * 0x94D049BB133111EB
                 + 0x2545F4914F6CDD1D) & _M64
            z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
            z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
            z ^= z >> 31
            out[j, c] = (z >> 40) * (1.0 / 8388608.0) - 1.0
    return out


def power_width(rank: int) -> int:
    """Internal (oversampled) subspace width of the library (power_svd.h power_width)."""
    return 2 if rank <= 1 else (4 if rank <= 2 else (6 if rank <= 4 else 8))


def power_iter_ref(x: torch.Tensor, rank: int, iters: int, seed: int):
    """Subspace iteration of width power_width(rank) with Householder QR in float64, then
    the best rank-r approximation inside that subspace: A [..., T, r] orthonormal,
    B = x^T A [..., d, r]."""
    X = x.double()
    w = power_width(rank)
    Bt = torch.linalg.qr(init_basis(seed, X.shape[-1], w)).Q.expand(*X.shape[:-2], -1, -1)
    Q = B = None
    for i in range(iters):
        Q = torch.linalg.qr(X @ Bt).Q
        B = X.mT @ Q
        if i < iters - 1:
            Bt = torch.linalg.qr(B).Q
    U = torch.linalg.svd(B.mT, full_matrices=False).U[..., :rank]
    A = Q @ U
    return A, X.mT @ A


def group_fill_ref(x: torch.Tensor, mask: torch.Tensor, group_size: int,
                   per_channel: bool) -> torch.Tensor:
    """xc of GEAR: inliers (mask False) unchanged, outliers clamped into their quantization
    group's inlier range [lo, hi] (min / max over the group's inliers, NaN ignored), every
    entry of a group without a non-NaN inlier +0."""
    vec = _vectors(x.float(), per_channel)                 # [..., V, L]
    m = _vectors(mask, per_channel)
    L = vec.shape[-1]
    G = L if group_size == -1 else group_size
    g = vec.reshape(*vec.shape[:-1], L // G, G)
    gm = m.reshape(g.shape)
    inl = ~gm & ~torch.isnan(g)
    lo = torch.where(inl, g, torch.inf).amin(-1, keepdim=True)
    hi = torch.where(inl, g, -torch.inf).amax(-1, keepdim=True)
    empty = ~inl.any(-1, keepdim=True)
    clamped = torch.where(torch.isnan(g), lo, torch.minimum(torch.maximum(g, lo), hi))  # fmaxf(NaN, lo) = lo
    filled = torch.where(gm, clamped, g)
    filled = torch.where(empty, torch.zeros_like(g), filled)
    out = filled.reshape(vec.shape)
    return (out.transpose(-1, -2) if per_channel else out).to(x.dtype)


def gear_ref(x: torch.Tensor, bits: int, group_size: int, per_channel: bool, sparsity: float,
             rank: int, iters: int = 3, seed: int = 0):
    """Reference GEAR reconstruction of x [..., T, D] (returns (recon, parts dict))."""
    T, D = x.shape[-2:]
    L = T if per_channel else D
    k = outlier_count(sparsity, L)
    xc = x
    mask = torch.zeros(x.shape, dtype=torch.bool)
    values = idx = None
    if k > 0:
        values, idx, _, _ = outlier_select_ref(x, k, per_channel)
        mvec = _vectors(mask, per_channel)
        mvec.scatter_(-1, idx, True)
        xc = group_fill_ref(x, mask, group_size, per_channel)
    codes, scale, zero = quantize_ref(xc, bits, group_size, per_channel)
    deq = dequantize_ref(codes, scale, zero, per_channel)
    resid = (xc.float() - deq).half().float().masked_fill(mask, 0.0)
    recon = deq.clone()
    A = B = None
    if rank > 0 and T > 0:
        A, B = power_iter_ref(resid, rank, iters, seed)
        A, B = A.half(), B.half()
        recon = recon + A.float() @ B.float().mT
    recon = recon.to(x.dtype)
    if k > 0:
        rv = _vectors(recon, per_channel)
        rv.scatter_(-1, idx, values)
    return recon, {"k": k, "values": values, "indices": idx, "A": A, "B": B, "deq": deq,
                   "resid": resid, "mask": mask}


def kivi_ref(x: torch.Tensor, bits: int, group_size: int, per_channel: bool) -> torch.Tensor:
    codes, scale, zero = quantize_ref(x, bits, group_size, per_channel)
    return dequantize_ref(codes, scale, zero, per_channel).to(x.dtype)
