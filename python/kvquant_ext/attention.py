"""Decode attention over a compressed :class:`~kvquant_ext.KVCache` layer.

Group-quantized layers (KIVI, KCVT, per-token INT, FlexGen) run the fused
``torch.ops.kvq.decode_attention_gq`` op, GEAR layers with the KIVI backbone
``torch.ops.kvq.decode_attention_gear`` and HQMQ layers ``torch.ops.kvq.decode_attention_hqmq``;
all read the packed codes directly (tensor-core kernels on CUDA, a C++ loop on CPU).  FP16
layers use ``scaled_dot_product_attention``; KCVT-backbone GEAR layers dequantize.
"""
from __future__ import annotations

import contextlib
import math
import warnings
from typing import Optional

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from . import _ops
from ._build_config import DTYPES_TEXT, MMA_HEAD_DIMS
from .gear import GEARStream
from .hqmq import HQMQStream
from .streams import FullPrecisionStream, _QuantStream

_warned = set()
_MAX_GROUP = 16  # query heads per KV head in one kernel call
_MAX_GROUP_TC = 8  # query heads per KV head of the tensor-core paths (the N = 8 mma columns)


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
    if q.dtype not in _ops.FLOAT_DTYPES:
        raise TypeError(f"argument 'q' must be {DTYPES_TEXT}, got {q.dtype}")
    if q.dtype != kst.dtype:  # attend in the cache's dtype; the output comes back in q's
        return decode_attention(q.to(kst.dtype), cache, layer_idx, scale, attn_mask=attn_mask).to(q.dtype)
    T = kst.seq_len
    if attn_mask is not None:
        if attn_mask.shape != (B, T):
            raise ValueError(f"argument 'attn_mask' must be [B, T] = [{B}, {T}], got {tuple(attn_mask.shape)}")
        attn_mask = attn_mask.to(device=q.device, dtype=torch.bool)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    qc = q if squeeze else q4.reshape(B, Hq, D)

    g = Hq // H
    path = _path(kst, vst, qc)
    if path == "gq":
        operands = (*kst.attention_operands(), *vst.attention_operands())

        def run(qh):
            return _ops.decode_attention_gq(qh, *operands, attn_mask, kst.spec.bits,
                                            kst.spec.per_channel, vst.spec.bits,
                                            vst.spec.per_channel, float(scale))

        # on CUDA the tensor-core kernels take <= 8 query heads per KV head; more in one call
        # run the CUDA-core kernel, ~25x slower (H200, g = 16, B = 8, L = 32k, kivi-2:
        # 6206 us), so such calls go in passes of 8 heads, each reading the layer once
        mg = _MAX_GROUP_TC if qc.is_cuda and D in MMA_HEAD_DIMS and kst.spec.bits == vst.spec.bits else _MAX_GROUP
        out = _split_heads(run, qc, H, g, mg)
    elif path == "gear":
        kc, ks, kz, kr, kg = kst.attention_operands()
        vc, vs, vz, vr, vg = vst.attention_operands()

        def run(qh):
            return _ops.decode_attention_gear(qh, kc, ks, kz, kr, vc, vs, vz, vr, attn_mask,
                                              kst.spec.bits, kg, vg, kst.T0,
                                              kst.config.buffer_length, float(scale))

        out = _split_heads(run, qc, H, g, _MAX_GROUP_TC)
    elif path == "hqmq":
        kops, vops = kst.attention_operands(), vst.attention_operands()
        kres, vres = kst.residual_operand(), vst.residual_operand()

        def run(qh):
            return _ops.decode_attention_hqmq(qh, *kops, *vops, attn_mask, kst.config.radius_bits,
                                              vst.config.radius_bits, float(scale), kres, vres)

        # on CUDA the tensor-core path takes <= 8 query heads per KV head
        out = _split_heads(run, qc, H, g, _MAX_GROUP_TC if qc.is_cuda else _MAX_GROUP)
    elif path == "fp16":
        out = _sdpa(qc, kst.dequantize(), vst.dequantize(), scale, attn_mask, Hq != H)
    else:
        # NOTE: GEAR layers the fused op does not cover (KCVT backbone; on CUDA also blocks
        # that are not whole 32-token tiles) attend over the layer dequantized by their own
        # ops (correct, but reads a full-precision copy).
        name = type(cache.config).__name__
        if name not in _warned:
            _warned.add(name)
            warnings.warn(f"kvq.decode_attention: no fused kernel for {name} yet; dequantizing "
                          "the layer each call", RuntimeWarning, stacklevel=2)
        K, V = cache.dequantize(layer_idx)
        out = _sdpa(qc, K, V, scale, attn_mask, Hq != H)
    return out if squeeze else out.unsqueeze(2)


def _path(kst, vst, q) -> str:
    """Which implementation attends over a layer: "gq" / "gear" / "hqmq" (fused ops), "fp16" (SDPA)
    or "dequantize" (the layer dequantized, then SDPA)."""
    if isinstance(kst, _QuantStream) and isinstance(vst, _QuantStream):
        return "gq"
    if isinstance(kst, GEARStream) and _gear_fused_ok(kst, vst, q):
        return "gear"
    if isinstance(kst, HQMQStream) and isinstance(vst, HQMQStream):
        return "hqmq"
    if isinstance(kst, FullPrecisionStream) and isinstance(vst, FullPrecisionStream):
        return "fp16"
    return "dequantize"


def uses_fused_kernel(cache, layer_idx: int, q: torch.Tensor) -> bool:
    """True when :func:`decode_attention` reads layer ``layer_idx`` of ``cache`` through a
    fused op (``decode_attention_gq`` / ``_gear`` / ``_hqmq``) for queries like ``q``; False
    when it runs SDPA (FP16 layers) or dequantizes the layer first (GEAR with the KCVT
    backbone; on CUDA also GEAR layers outside the tensor-core kernel's shape and 16-byte
    alignment rules).  Only ``q.device`` and ``q.shape`` are read."""
    layer = cache._layer(layer_idx)
    return _path(layer.key, layer.value, q) in ("gq", "gear", "hqmq")


def _split_heads(run, qc, H, g, max_group):
    """run(q) over groups of at most ``max_group`` query heads per KV head."""
    if g <= max_group:
        return run(qc)
    B, _, D = qc.shape
    qg = qc.reshape(B, H, g, D)
    parts = [run(qg[:, :, j:j + max_group].reshape(B, -1, D)).reshape(B, H, -1, D)
             for j in range(0, g, max_group)]
    return torch.cat(parts, dim=2).reshape(B, H * g, D)


def _gear_fused_ok(kst, vst, q) -> bool:
    """Does ``kvq.decode_attention_gear`` cover this GEAR layer?  (KIVI backbone, both roles
    with the same block boundaries; on CUDA the tensor-core path's shape rules.)"""
    cfg = kst.config
    if cfg.backbone != "kivi" or not isinstance(vst, GEARStream):
        return False
    if (kst.T0, kst.num_decode_blocks, kst.compressed_len) != (vst.T0, vst.num_decode_blocks,
                                                              vst.compressed_len):
        return False
    if q.device.type != "cuda":
        return True
    D = q.shape[-1]
    if not (D in MMA_HEAD_DIMS and cfg.group_size % 32 == 0 and kst.T0 % 32 == 0
            and cfg.buffer_length % 32 == 0):
        return False
    # the kernel copies codes, scales, factor rows, tile offsets and value outliers with
    # 16-byte cp.async: every (batch, head[, block]) row must start 16-byte aligned
    for st in (kst, vst):
        for name, t in st.tensors().items():
            if name == "buffer" or t is None or not t.numel():
                continue
            blocked = name == "B1" or (st.spec.per_channel and name[:2] in ("ov", "oi", "of", "od"))
            if not _aligned16(t, 3 if blocked else 2):
                return False
    return True


def _aligned16(t: torch.Tensor, ndims: int) -> bool:
    """16-byte aligned start and strides of the leading ``ndims`` dims."""
    e = t.element_size()
    return t.data_ptr() % 16 == 0 and all((t.stride(d) * e) % 16 == 0 for d in range(ndims))


def sdpa_without_cudnn(device: torch.device):
    """A context in which SDPA on ``device`` avoids its cuDNN backend.  On CUDA, cuDNN builds an
    execution plan for every new shape (≈ 12 ms of host time on an H200), and a growing cache
    gives every decode step a new key length; flash / memory-efficient attention plan nothing."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _sdpa(q, K, V, scale, attn_mask, gqa):
    """SDPA of q ``[B, Hq, D]`` over K, V ``[B, H, T, D]`` (cuDNN excluded: the key length
    changes every step); a fully masked row gives zeros (as the fused op), not NaN."""
    mask = None if attn_mask is None else attn_mask[:, None, None, :]
    with sdpa_without_cudnn(q.device):
        out = torch.nn.functional.scaled_dot_product_attention(
            q.unsqueeze(2), K, V, attn_mask=mask, scale=scale, enable_gqa=gqa).squeeze(2)
    if attn_mask is not None:
        out = torch.where(attn_mask.any(dim=1)[:, None, None], out, torch.zeros_like(out))
    return out



def prefix_attention(q: torch.Tensor, cache, layer_idx: int, key: torch.Tensor, value: torch.Tensor,
                     scale: Optional[float] = None, *, past_length: Optional[int] = None,
                     attn_mask: Optional[torch.Tensor] = None, chunk_size: int = 4096) -> torch.Tensor:
    """Causal attention of ``t`` new query tokens over the first ``past_length`` tokens of
    ``cache`` layer ``layer_idx`` (the past, as the cache holds it) followed by the ``t`` fresh
    tokens ``key`` / ``value`` in full precision: query ``i`` attends to every past token and
    to fresh tokens ``0 .. i``.

    The past is read in chunks of at most ``chunk_size`` tokens, cut where no compressed unit
    is split (a GEAR block is decoded whole, so a chunk can be as long as one), each dequantized
    from the stored codes alone (``Stream.dequantize_range``); scores, the running max and the
    softmax denominator stay in fp32 and the chunks merge online, so no full-precision copy of
    the past is ever made.  FP16 layers attend through SDPA.

    Parameters
    ----------
    q : ``[B, Hq, t, D]``, Hq a multiple of the cache's KV heads H.
    key, value : ``[B, H, t, D]``, the fresh tokens (they may already be appended to the cache:
        then pass ``past_length = seq_len - t``).
    past_length : past tokens to attend to (default: every token the layer holds).
    attn_mask : optional bool ``[B, t, past_length + t]`` or ``[B, 1, t, past_length + t]``
        (True = attend; a float mask: 0 attends), combined with the causal rule; a query row
        with nothing to attend to gives zeros.

    Returns ``[B, Hq, t, D]`` in q's dtype.
    """
    for name, x in (("q", q), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise ValueError(f"argument '{name}' must be 4-D [B, heads, t, D], got {tuple(x.shape)}")
    layer = cache._layer(layer_idx)
    kst, vst = layer.key, layer.value
    if kst._shape is None:
        raise ValueError(f"layer {layer_idx} of the cache is empty")
    Bc, H, Dc = kst._shape
    B, Hq, t, D = q.shape
    if (B, D) != (Bc, Dc) or Hq % H:
        raise ValueError(f"argument 'q' {tuple(q.shape)} does not fit the cache's [B, H, D] = [{Bc}, {H}, {Dc}] "
                         "(Hq a multiple of H)")
    if key.shape != (B, H, t, D) or value.shape != key.shape:
        raise ValueError(f"arguments 'key' {tuple(key.shape)} and 'value' {tuple(value.shape)} must be "
                         f"[B, H, t, D] = [{B}, {H}, {t}, {D}]")
    T = kst.seq_len
    P = T if past_length is None else past_length
    if isinstance(P, bool) or not isinstance(P, int) or not 0 <= P <= T:
        raise ValueError(f"argument 'past_length' must be an int in [0, {T}], got {past_length!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"argument 'chunk_size' must be an int >= 1, got {chunk_size!r}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    mask = None
    if attn_mask is not None:
        m = attn_mask[:, 0] if attn_mask.dim() == 4 else attn_mask
        if m.shape != (B, t, P + t):
            raise ValueError(f"argument 'attn_mask' must be [B, t, past_length + t] = [{B}, {t}, {P + t}] "
                             f"(or with a head dim of 1), got {tuple(attn_mask.shape)}")
        mask = m if m.dtype == torch.bool else m > torch.finfo(m.dtype).min / 2
        mask = mask.to(q.device)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    g = Hq // H

    if isinstance(kst, FullPrecisionStream) and isinstance(vst, FullPrecisionStream):
        K = torch.cat([kst.dequantize_range(0, P), key.to(kst.dtype)], dim=2)
        V = torch.cat([vst.dequantize_range(0, P), value.to(kst.dtype)], dim=2)
        full = torch.cat([torch.ones(t, P, dtype=torch.bool, device=q.device), causal], dim=1)
        full = full.expand(B, t, P + t) if mask is None else full & mask
        with sdpa_without_cudnn(q.device):
            out = torch.nn.functional.scaled_dot_product_attention(
                q.to(kst.dtype), K, V, attn_mask=full[:, None], scale=scale, enable_gqa=g > 1)
        return torch.where(full.any(-1)[:, None, :, None], out, torch.zeros_like(out)).to(q.dtype)

    acc = OnlineSoftmax(q, H, scale)
    a = 0
    while a < P:
        b = min(a + chunk_size, P)
        while b < P:  # the first common cut of both roles at or after it
            c = max(kst.range_cut(b), vst.range_cut(b))
            if c == b:
                break
            b = min(c, P)
        allowed = torch.ones(1, t, b - a, dtype=torch.bool, device=q.device) if mask is None else mask[:, :, a:b]
        acc.add(kst.dequantize_range(a, b), vst.dequantize_range(a, b), allowed)
        a = b
    acc.add(key, value, causal[None] if mask is None else causal[None] & mask[:, :, P:])
    return acc.result(q.dtype)


class OnlineSoftmax:
    """softmax(q·Kᵀ·scale)·V over keys that arrive in chunks, in fp32: a running max, softmax
    denominator and weighted sum of values per query, merged chunk by chunk, so that no chunk
    outlives its merge.  ``q [B, Hq, t, D]``, its query heads grouped by KV head (``Hq = H·g``);
    a query that was allowed no key gives zeros."""

    def __init__(self, q: torch.Tensor, num_kv_heads: int, scale: float):
        B, Hq, t, D = q.shape
        H = num_kv_heads
        self.dims = (B, H, Hq // H, t)
        self.q = q.float().reshape(B, H, Hq // H * t, D) * scale
        self.m = torch.full((B, H, Hq // H * t), float("-inf"), device=q.device)
        self.l = torch.zeros((B, H, Hq // H * t), device=q.device)
        self.acc = torch.zeros((B, H, Hq // H * t, D), device=q.device)

    def add(self, K: torch.Tensor, V: torch.Tensor, allowed: torch.Tensor) -> None:
        """Keys and values ``[B, H, n, D]``; ``allowed``: bool broadcastable to ``[B, t, n]``
        (True: the query sees the key).  Values of keys no query is allowed must be finite."""
        B, H, g, t = self.dims
        s = self.q @ K.float().transpose(-1, -2)  # [B, H, g*t, n]
        s = s.view(B, H, g, t, -1).masked_fill(~allowed[:, None, None], float("-inf")).view(B, H, g * t, -1)
        m_new = torch.maximum(self.m, s.amax(-1))
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        p = torch.exp(s - safe[..., None])
        corr = torch.exp(self.m - safe)
        self.l = self.l * corr + p.sum(-1)
        self.acc = self.acc * corr[..., None] + p @ V.float()
        self.m = m_new

    def result(self, dtype: torch.dtype) -> torch.Tensor:
        """``[B, Hq, t, D]`` in ``dtype``."""
        B, H, g, t = self.dims
        out = torch.where(self.l[..., None] > 0, self.acc / self.l.clamp_min(1e-30)[..., None],
                          torch.zeros_like(self.acc))
        return out.reshape(B, H * g, t, -1).to(dtype)
