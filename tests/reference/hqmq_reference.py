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
    """DB = ceil(log2(24 S))."""
    return (24 * S - 1).bit_length()


# ----------------------------------------------------------------------------- packed row
# Implemented from the format text at the top of include/kvq/hqmq/hqmq.h ("Packed row"), not
# from kvq's own layout helpers: one little-endian bitstream of U 16-bit units per (row, token);
# C = D / 4 chunks; chunk field = dir << rb | rcode = digit * 2^E + plain (E = DB - 4 + rb,
# digit in [0, R), R = ceil(24 S / 2^(DB - 4))); from bit 0: the C plain fields of E bits, G =
# C // K 16-bit groups of K base-R digits (K = 5 if R == 9 else 4; group j = sum_i digit(K j + i)
# R^i), the last C - G K digits as one base-R number in tail_bits = bit_length(R^(C-GK) - 1)
# bits, then the radius scale code in SB = min(15, 16 U - scale_at) bits (>= 8; U = ceil((
# scale_at + 8) / 16)): the top SB of an fp16's 15 magnitude bits, fp16 bits = code << (15 - SB);
# any bits past it (SB = 15 only) zero.

def row_layout(D: int, S: int, radius_bits: int) -> dict:
    """The packed row layout of head dim D (see above): a dict with C, L, E, R, K, G, tail_n
    (digits in the tail), tail_bits, groups_at, tail_at, scale_at, used (bits) and units."""
    C = D // 4
    L = dir_bits(S) - 4
    E = L + radius_bits
    R = math.ceil(24 * S / 2 ** L)
    assert 9 <= R <= 16, R
    # K: the most base-R digits one 16-bit unit holds
    K = max(k for k in range(1, 6) if R ** k <= 2 ** 16)
    assert K == (5 if R == 9 else 4)
    G = C // K
    tail_n = C - G * K
    tail_bits = (R ** tail_n - 1).bit_length()
    groups_at = C * E
    tail_at = groups_at + 16 * G
    scale_at = tail_at + tail_bits
    U = -(-(scale_at + 8) // 16)
    scale_bits = min(15, 16 * U - scale_at)
    assert 8 <= scale_bits <= 15
    return dict(C=C, L=L, E=E, R=R, K=K, G=G, tail_n=tail_n, tail_bits=tail_bits, groups_at=groups_at,
                tail_at=tail_at, scale_at=scale_at, scale_bits=scale_bits, used=scale_at + scale_bits, units=U)


def scale_bits(D: int, S: int, radius_bits: int) -> int:
    """SB, the width of the row's radius scale code."""
    return row_layout(D, S, radius_bits)["scale_bits"]


def units(D: int, S: int, radius_bits: int) -> int:
    """16-bit units per packed row."""
    return row_layout(D, S, radius_bits)["units"]


def row_bits(codes: torch.Tensor) -> torch.Tensor:
    """Packed rows ``[..., U]`` (int16) -> their bits ``[..., 16 U]`` (uint8, bit 0 first)."""
    u = codes.long() & 0xFFFF
    b = (u[..., None] >> torch.arange(16, device=codes.device)) & 1
    return b.reshape(*codes.shape[:-1], 16 * codes.shape[-1]).to(torch.uint8)


def _take(bits: torch.Tensor, at: torch.Tensor, width: int) -> torch.Tensor:
    """Unsigned little-endian fields of ``width`` bits at bit offsets ``at`` [n] -> [..., n] int64."""
    if width == 0:
        return torch.zeros(*bits.shape[:-1], at.numel(), dtype=torch.long, device=bits.device)
    idx = at[:, None] + torch.arange(width, device=bits.device)  # [n, width]
    b = bits[..., idx.reshape(-1)].long().reshape(*bits.shape[:-1], at.numel(), width)
    return (b << torch.arange(width, device=bits.device)).sum(-1)


def unpack_fields(codes: torch.Tensor, D: int, S: int, radius_bits: int, strict: bool = True):
    """Packed rows ``[..., U]`` -> (fields ``[..., C]`` = dir << rb | rcode, scale code ``[...]``),
    int64.  ``strict``: raise ValueError unless the row is canonical (U units, every digit group
    and the tail below R^K / R^tail_n, all bits past the scale zero)."""
    lay = row_layout(D, S, radius_bits)
    if codes.dtype != torch.int16 or codes.shape[-1] != lay["units"]:
        raise ValueError(f"expected int16 rows of {lay['units']} units, got {codes.dtype} {tuple(codes.shape)}")
    C, E, R, K, G = lay["C"], lay["E"], lay["R"], lay["K"], lay["G"]
    dev = codes.device
    bits = row_bits(codes)
    plain = _take(bits, torch.arange(C, device=dev) * E, E)                       # [..., C]
    groups = _take(bits, lay["groups_at"] + 16 * torch.arange(G, device=dev), 16)  # [..., G]
    tail = _take(bits, torch.tensor([lay["tail_at"]], device=dev), lay["tail_bits"])  # [..., 1]
    scode = _take(bits, torch.tensor([lay["scale_at"]], device=dev), lay["scale_bits"])[..., 0]
    if strict:
        if (groups >= R ** K).any() or (tail >= R ** lay["tail_n"]).any():
            raise ValueError("a digit group or the tail is not a canonical base-R number")
        if bits[..., lay["used"]:].any():
            raise ValueError("bits past the scale code are not zero")
    digits = []
    for j in range(G):
        digits += [(groups[..., j] // R ** i) % R for i in range(K)]
    digits += [(tail[..., 0] // R ** i) % R for i in range(lay["tail_n"])]
    digit = torch.stack(digits, dim=-1) if digits else plain[..., :0]
    return digit * 2 ** E + plain, scode


def unpack_rows(codes: torch.Tensor, D: int, S: int, radius_bits: int, strict: bool = True):
    """Packed rows ``[..., U]`` -> (dir ``[..., C]``, rcode ``[..., C]`` int64, scale ``[...]``
    float16: the decoded radius scale, fp16 bits = scale code << (15 - SB))."""
    f, scode = unpack_fields(codes, D, S, radius_bits, strict)
    return f >> radius_bits, f & ((1 << radius_bits) - 1), scale_from_code(scode, scale_bits(D, S, radius_bits))


def pack_rows(dirs: torch.Tensor, rcode: torch.Tensor, scode: torch.Tensor, D: int, S: int,
              radius_bits: int) -> torch.Tensor:
    """Inverse of :func:`unpack_fields`: (dir, rcode ``[..., C]``, scale code ``[...]``) ->
    int16 packed rows ``[..., U]``."""
    lay = row_layout(D, S, radius_bits)
    C, E, R, K, G = lay["C"], lay["E"], lay["R"], lay["K"], lay["G"]
    dev = dirs.device
    f = (dirs.long() << radius_bits) | rcode.long()
    assert (dirs >= 0).all() and (dirs < 24 * S).all() and (rcode >= 0).all() and (rcode < 2 ** radius_bits).all()
    bits = torch.zeros(*f.shape[:-1], 16 * lay["units"], dtype=torch.long, device=dev)

    def put(at, width, v):  # v [...]
        bits[..., at:at + width] = (v[..., None] >> torch.arange(width, device=dev)) & 1

    digit, plain = f >> E, f & ((1 << E) - 1)
    for c in range(C):
        put(c * E, E, plain[..., c])
    for j in range(G):
        put(lay["groups_at"] + 16 * j, 16, sum(digit[..., K * j + i] * R ** i for i in range(K)))
    if lay["tail_n"]:
        put(lay["tail_at"], lay["tail_bits"], sum(digit[..., G * K + i] * R ** i for i in range(lay["tail_n"])))
    assert (scode >= 0).all() and (scode < 2 ** lay["scale_bits"]).all()
    put(lay["scale_at"], lay["scale_bits"], scode.long())
    u = (bits.reshape(*f.shape[:-1], lay["units"], 16) << torch.arange(16, device=dev)).sum(-1)
    return torch.where(u >= 2 ** 15, u - 2 ** 16, u).to(torch.int16)


# ----------------------------------------------------------------------------- radius scale
MAX_SCALE = 61440.0  # the largest coded chunk norm the finite check accepts (on every SB grid)


def scale_from_code(scode: torch.Tensor, SB: int) -> torch.Tensor:
    """SB-bit scale codes -> the fp16 scale (the fp16 whose bits are code << (15 - SB))."""
    b = scode.long() << (15 - SB)
    assert (b >= 0).all() and (b < 2 ** 15).all()
    return b.to(torch.int16).view(torch.float16)


def max_finite_code(SB: int) -> int:
    """The largest SB-bit code whose scale is finite (top SB bits of 0x7bff = 65504)."""
    return 0x7BFF >> (15 - SB)


def scale_grid(SB: int) -> torch.Tensor:
    """The finite non-negative SB-bit scales (codes 0 .. max_finite_code), ascending, float64."""
    return scale_from_code(torch.arange(max_finite_code(SB) + 1), SB).double()


def scale_code_reference(rmax: torch.Tensor, SB: int) -> torch.Tensor:
    """The documented SB-bit scale code of rows whose largest coded chunk radius is ``rmax``: the
    code of the smallest SB-bit scale >= rmax; an rmax above the largest finite one but <= 65504
    (its fp16 round-up is still finite) clamps to the largest finite code; rmax > 65504 (the
    round-up to fp16 overflows) and +Inf give the Inf code (0x7c00 >> (15 - SB)), NaN the code of
    the fp16 NaN 0x7e00 rounded up."""
    grid = scale_grid(SB)
    sh = 15 - SB
    r = rmax.double()
    code = torch.searchsorted(grid, r.clamp(0, float(grid[-1])).contiguous(), right=False)  # grid[code] >= r
    code = torch.where(r > 65504.0, torch.full_like(code, 0x7C00 >> sh), code)
    code = torch.where(r.isnan(), torch.full_like(code, (0x7E00 + (1 << sh) - 1) >> sh), code)
    return code


def round_scale(rmax: torch.Tensor, SB: int) -> torch.Tensor:
    """rmax -> the decoded fp16 radius scale (:func:`scale_code_reference`)."""
    return scale_from_code(scale_code_reference(rmax, SB), SB)


def chunk_norms(x: torch.Tensor) -> torch.Tensor:
    *lead, D = x.shape
    return x.double().reshape(*lead, D // 4, 4).norm(dim=-1)


def chunk_norms_fp32(x: torch.Tensor) -> torch.Tensor:
    """The encoder's chunk norms: sqrt(((x0^2 + x1^2) + x2^2) + x3^2), every step rounded to
    fp32 (include/kvq/hqmq/hqmq.h, chunk_norm)."""
    *lead, D = x.shape
    c = x.float().reshape(*lead, D // 4, 4)
    sq = c * c
    return torch.sqrt(((sq[..., 0] + sq[..., 1]) + sq[..., 2]) + sq[..., 3])


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
    """Reference encode: (dir, rcode, scale, outlier_mask) with brute-force directions.

    The radius path follows the documented fp32 arithmetic, so rcode and scale are exact:
    chunk norms r in fp32 (:func:`chunk_norms_fp32`), outliers r > threshold (fp32), rmax = the
    largest non-outlier r of the token, scale = :func:`round_scale` (the smallest SB-bit scale
    >= rmax, SB = :func:`scale_bits`), step = fp32(scale) / (2^rb - 1) and rcode = round-half-even(
    clamp(r / step, 0, 2^rb - 1)) in fp32 (0 where step == 0).  Only the directions come from a
    float64 search (equal to the encoder's fp32 search unless two codewords nearly tie)."""
    r = chunk_norms_fp32(x)
    outl = torch.zeros_like(r, dtype=torch.bool)
    if threshold is not None:
        outl = r > threshold.float()[None, :, None, None]
    coded = torch.where(outl | r.isnan(), torch.zeros_like(r), r)
    rmax = coded.amax(dim=-1) if r.shape[-1] and r.numel() else coded.sum(-1)
    scale = round_scale(rmax, scale_bits(x.shape[-1], secondary.shape[1], radius_bits))
    maxq = float((1 << radius_bits) - 1)
    step = scale.float() / torch.tensor(maxq, dtype=torch.float32)
    q = (r / step[..., None]).nan_to_num(0.0, posinf=math.inf).clamp(0.0, maxq)
    rc = torch.where(step[..., None] > 0, q.round(), torch.zeros_like(q)).long()
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
