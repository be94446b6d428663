"""HQMQ (Hurwitz quaternion multiplicative quantization, + Med3x outliers): secondary
codebooks, the compressed-block object and the streaming cache storage.

Storage per token-head vector (see ``docs/ops.md`` for the bit layout): one packed row of
``U`` 16-bit units (per 4-element chunk a direction index in ``[0, 24 S)`` and a ``b_r``-bit
radius code, the direction's base-9 part packed five chunks to 16 bits, and the token's
radius scale in the row's last bits), and, with Med3x, one 16-byte record per outlier chunk.  Every held
tensor is counted in ``nbytes``, including the secondary set and the outlier threshold.
"""
from __future__ import annotations

import hashlib
from typing import Dict, Optional

import torch

from . import _ops
from .compressed import Compressed, check_cache_tensor
from .config import HQMQConfig, register_format
from .streams import Growable, Stream

_ROLE_IDS = {"key": 0, "value": 1}
TILE = 32  # tokens per tile of the outlier index (kHqmqTile in decode_attention_hqmq.h)
MAX_SCALE = 61440.0  # hqmq::kMaxScale: bounds coded chunk norms (a radius scale of any width holds it)


def hqmq_seed(seed: int, layer_idx: int, role: str) -> int:
    """Seed of the secondary sets of one (layer, role): a hash of (seed, layer_idx, role)."""
    if role not in _ROLE_IDS:
        raise ValueError(f"argument 'role' must be 'key' or 'value', got {role!r}")
    if not isinstance(layer_idx, int) or layer_idx < 0:
        raise ValueError(f"argument 'layer_idx' must be a non-negative int, got {layer_idx!r}")
    h = hashlib.sha256(f"kvq-hqmq:{int(seed)}:{layer_idx}:{role}".encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def hqmq_secondary(num_heads: int, secondary_size: int, seed: int, *, layer_idx: int = 0,
                   role: str = "key", device=None) -> torch.Tensor:
    """The secondary sets ``[H, S, 4]`` (fp32 unit quaternions, normalized Gaussian draws)
    of one (layer, role), one set per KV head.  Drawn on the CPU with a seeded
    ``torch.Generator`` so they are identical on every device."""
    if secondary_size < 1:
        raise ValueError(f"argument 'secondary_size' must be >= 1, got {secondary_size}")
    return _secondary_cpu(int(num_heads), int(secondary_size), int(seed), layer_idx, role).to(device)


@torch.compiler.assume_constant_result
def _secondary_cpu(num_heads: int, secondary_size: int, seed: int, layer_idx: int, role: str) -> torch.Tensor:
    # a function of its arguments alone: under torch.compile the hash and the draw run at
    # trace time and the result is a constant of the graph (neither can be traced)
    g = torch.Generator(device="cpu")
    g.manual_seed(hqmq_seed(seed, layer_idx, role))
    q = torch.randn((num_heads, secondary_size, 4), generator=g, dtype=torch.float64)
    return (q / q.norm(dim=-1, keepdim=True)).to(torch.float32)


def chunk_norms(x: torch.Tensor) -> torch.Tensor:
    """Norms of the 4-element chunks of ``x [..., D]``: ``[..., D/4]`` fp32 (what HQMQ's radius
    scale must hold: at most :data:`MAX_SCALE`)."""
    return torch.linalg.vector_norm(x.float().unflatten(-1, (-1, 4)), dim=-1)


def med3_threshold(x: torch.Tensor, factor: float) -> torch.Tensor:
    """Med3x threshold ``[H]`` (fp32): ``factor`` x the median chunk norm of each KV head
    over all batches, tokens and chunks of ``x`` ``[B, H, T, D]`` (lower median for an even
    count; +inf for an empty ``x``)."""
    B, H, T, D = x.shape
    if B * T == 0:
        return torch.full((H,), float("inf"), dtype=torch.float32, device=x.device)
    norms = x.detach().float().reshape(B, H, T * D // 4, 4).norm(dim=-1)
    norms = torch.where(torch.isfinite(norms), norms, torch.full_like(norms, float("nan")))
    med = norms.transpose(0, 1).reshape(H, -1).nanmedian(dim=1).values  # NaN/Inf ignored
    return (med * factor).to(torch.float32).contiguous()


class HQMQCompressed(Compressed):
    """One HQMQ-compressed block: packed rows (codes and radius scales), Med3x outlier records,
    and the secondary sets ``.secondary`` ``[H, S, 4]`` (so anyone can verify codewords)."""

    def __init__(self, codes, outliers, secondary, radius_bits: int, shape, dtype,
                 threshold: Optional[torch.Tensor] = None):
        self.codes, self.outliers = codes, outliers
        self.secondary, self.threshold = secondary, threshold
        self.radius_bits = radius_bits
        self.shape, self.dtype = torch.Size(shape), dtype

    @classmethod
    def from_tensor(cls, x: torch.Tensor, config, role: str, *, layer_idx: int = 0,
                    check_finite: bool = True) -> "HQMQCompressed":
        check_cache_tensor(x)
        H = x.shape[1]
        sec = hqmq_secondary(H, config.secondary_size, config.seed, layer_idx=layer_idx,
                             role=role, device=x.device)
        thr = None
        if config.outlier_factor is not None:
            thr = med3_threshold(x, config.outlier_factor)
        codes, outliers = _ops.hqmq_encode(x, sec, config.radius_bits, thr, check_finite=check_finite)
        return cls(codes, outliers, sec, config.radius_bits, x.shape, x.dtype, thr)

    @property
    def secondary_size(self) -> int:
        return self.secondary.shape[1]

    @property
    def num_outliers(self) -> int:
        return self.outliers.shape[0]

    def decompress(self) -> torch.Tensor:
        return _ops.hqmq_decode(self.codes, self.secondary, self.outliers, self.radius_bits,
                                self.shape[-1], self.dtype)

    def tensors(self):
        return {"codes": self.codes, "outliers": self.outliers,
                "secondary": self.secondary, "threshold": self.threshold}


class HQMQStream(Stream):
    """HQMQ storage of one role of one layer: every token is encoded once it is older than the
    recent window (``config.recent_window`` newest tokens, kept in the full-precision
    ``residual``; W = 0 encodes every token on arrival).  Med3x: the threshold is fixed from
    the first non-empty append (the prefill, window included) and reused for every later
    token; the secondary sets come from ``hqmq_seed(config.seed, layer_idx, role)``.

    Outlier index (Med3x only): the stream keeps its records ordered by the key
    ``(t // 32) * B * H + n`` (32-token tile, then row ``n = b * H + h``) and ``outlier_ptr``,
    the int64 CSR offsets over that key (``ceil(T / 32) * B * H + 1`` entries), so the fused
    decode attention finds the records of the tiles it reads.  An append re-sorts only the
    records of the tiles it touches (the last, partial tile and the new ones) and rewrites
    their offsets; the index costs 64 bits per (tile, row) and is counted in ``nbytes``."""

    max_abs = MAX_SCALE

    def magnitude(self, x: torch.Tensor) -> torch.Tensor:
        """Every chunk coded by direction and radius is stored against the token's radius scale,
        so the bound is on those chunks' norms (<= 61440); with Med3x a chunk above the
        threshold is stored exactly (fp16 values, <= 65504), so its entries count scaled by
        61440 / 65504: the larger of the two is compared with ``max_abs``."""
        if x.numel() == 0:
            return super().magnitude(x)
        norms = chunk_norms(x)
        if self.config.outlier_factor is None:
            return norms.amax()
        thr = self.threshold if self.threshold is not None else med3_threshold(x, self.config.outlier_factor)
        coded = torch.where(norms > thr.view(1, -1, 1, 1), torch.zeros_like(norms), norms)
        return torch.maximum(coded.amax(), super().magnitude(x) * (MAX_SCALE / 65504.0))

    @property
    def magnitude_what(self) -> str:
        return "4-element chunks with norm"

    def range_text(self) -> str:
        if self.config.outlier_factor is None:
            return super().range_text()
        return f"coded 4-element chunks with norm above {MAX_SCALE:g} or entries above 65504"

    def __init__(self, config, role: str, *, layer_idx: int = 0, check_finite: bool = True):
        super().__init__()
        hqmq_seed(config.seed, layer_idx, role)  # validates role and layer_idx
        self.config, self.role, self.layer_idx = config, role, layer_idx
        self.check_finite = check_finite
        # capacity in whole 32-token tiles: every head's packed rows start 16-byte aligned
        # (the fused decode attention's tensor-core path copies them with 16-byte cp.async)
        self.codes = Growable(align=32)
        self.outliers = Growable()
        self.outlier_ptr = Growable()  # [1, 1, ceil(T / 32) * B * H + 1] int64 (Med3x only)
        self.secondary: Optional[torch.Tensor] = None
        self.threshold: Optional[torch.Tensor] = None
        self.residual: Optional[torch.Tensor] = None  # the recent window [B, H, <= W, D]

    @property
    def residual_len(self) -> int:
        return 0 if self.residual is None else self.residual.shape[2]

    def append(self, x, name="x"):
        self._check(x, name)
        if self.secondary is None:
            self.secondary = hqmq_secondary(x.shape[1], self.config.secondary_size,
                                            self.config.seed, layer_idx=self.layer_idx,
                                            role=self.role, device=x.device)
        if x.shape[0] * x.shape[2] == 0:
            return
        if self.check_finite and (self.config.outlier_factor is not None and self.threshold is None
                                  or self.config.recent_window) and not torch.isfinite(x).all():
            raise ValueError(f"argument '{name}' contains NaN or Inf (cache check_finite=True)")
        if self.config.outlier_factor is not None and self.threshold is None:
            self.threshold = med3_threshold(x, self.config.outlier_factor)
        W = self.config.recent_window
        if W:
            full = x if self.residual is None else torch.cat([self.residual, x], dim=2)
            n = max(full.shape[2] - W, 0)
            self.residual = full[:, :, n:].contiguous()
            if n == 0:
                return
            x = full[:, :, :n]
        codes, rec = _ops.hqmq_encode(x, self.secondary, self.config.radius_bits,
                                      self.threshold, check_finite=self.check_finite)
        L0 = self.codes.length
        rec[:, 0] += L0  # token index within the stream
        self.codes.append(codes)
        if self.config.outlier_factor is not None:
            self._index_append(rec, L0, self.codes.length)
        elif rec.shape[0]:
            self.outliers.append(rec.view(1, 1, -1, 4))

    def _index_append(self, rec: torch.Tensor, L0: int, L1: int) -> None:
        """Insert the records ``rec`` of tokens [L0, L1) (t already shifted) in key order and
        rewrite the offsets of the tiles from ``L0 // 32`` on."""
        B, H, _ = self._shape
        BH = B * H
        j0, j1 = L0 // TILE, (L1 + TILE - 1) // TILE
        ptr = self.outlier_ptr.view()
        if ptr is None:
            start = 0
            self.outlier_ptr.append(torch.zeros((1, 1, 1), dtype=torch.int64, device=rec.device))
        else:
            start = int(ptr[0, 0, j0 * BH])  # one sync (the Med3x encode already syncs)
        old = self.outliers.view()
        tail = old[0, 0, start:] if old is not None else rec[:0]
        allr = torch.cat([tail, rec]) if rec.shape[0] else tail.clone()
        key = (allr[:, 0].long() // TILE - j0) * BH + (allr[:, 1].long() >> 8)
        order = torch.argsort(key, stable=True)
        counts = torch.bincount(key, minlength=(j1 - j0) * BH)
        ends = start + torch.cumsum(counts, 0)
        self.outliers.length = start
        if allr.shape[0]:
            self.outliers.append(allr[order].view(1, 1, -1, 4))
        self.outlier_ptr.length = j0 * BH + 1
        self.outlier_ptr.append(ends.view(1, 1, -1))

    def _rebuild_index(self) -> None:
        """Sort every record by key and rebuild ``outlier_ptr`` (after load_state_dict)."""
        rec = self._records()
        self.outliers.reset(None)
        self.outlier_ptr.reset(None)
        if self.codes.length:
            self._index_append(rec, 0, self.codes.length)

    # -- crop -------------------------------------------------------------------------
    # To any length (per-token codes); exact when W = 0, else the kept tokens that the removed
    # ones pushed out of the recent window stay encoded.  The Med3x threshold stays as the
    # first append fixed it.
    crop_floor = 0

    @property
    def crop_is_exact(self):
        return self.config.recent_window == 0

    def crop(self, n):
        c = self.codes.length
        if n >= c:
            self.residual = None if self.residual is None or n == c else self.residual[:, :, :n - c].contiguous()
            return
        self.residual = None
        if self.config.outlier_factor is not None:
            self._index_truncate(n)
        else:
            rec = self._records()
            rec = rec[rec[:, 0] < n]
            self.outliers.reset(rec.view(1, 1, -1, 4) if rec.shape[0] else None)
        self.codes.truncate(n)

    def _index_truncate(self, n: int) -> None:
        """Drop the records of tokens >= n and rewrite the offsets from tile ``n // 32`` on."""
        ptr = self.outlier_ptr.view()
        if ptr is None:
            return
        B, H, _ = self._shape
        j0 = n // TILE
        start = int(ptr[0, 0, j0 * B * H])
        tail = self._records()[start:]
        keep = tail[tail[:, 0] < n]
        self.outliers.truncate(start)
        self.outlier_ptr.truncate(j0 * B * H + 1)
        self._index_append(keep, n, n)

    def attention_operands(self):
        """(codes, secondary, outliers, outlier_ptr) for
        ``kvq.ops.decode_attention_hqmq`` (records in index order; ``outlier_ptr`` empty
        without Med3x); the recent window is :meth:`residual_operand`."""
        rec = self._records()
        ptr = self.outlier_ptr.view()
        ptr = self._no_data((0,), torch.int64) if ptr is None else ptr.reshape(-1)
        codes = self.codes.view()
        if codes is None:  # every token so far is in the window
            B, H, D = self._shape
            codes = self._no_data((B, H, 0, _ops.hqmq_units(D, self.config.secondary_size,
                                                          self.config.radius_bits)), torch.int16)
        return codes, self.secondary, rec, ptr

    def residual_operand(self) -> torch.Tensor:
        """The recent window ``[B, H, Tr, D]`` for ``kvq.ops.decode_attention_hqmq``'s
        ``k_residual`` / ``v_residual`` (``Tr = 0`` when empty)."""
        return self.residual if self.residual is not None else self._no_data()

    def _records(self) -> torch.Tensor:
        v = self.outliers.view()
        if v is None:
            dev = self.device if self._shape is not None else None
            return torch.empty((0, 4), dtype=torch.int32, device=dev)
        return v.reshape(-1, 4)

    def dequantize(self):
        if self._shape is None:
            return None
        parts = []
        if self.codes.length:
            parts.append(_ops.hqmq_decode(self.codes.view(), self.secondary, self._records(), self.config.radius_bits,
                                          self._shape[2], self.dtype))
        if self.residual_len:
            parts.append(self.residual)
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0] if parts else self._empty()

    def dequantize_range(self, a, b):
        c, parts = self.codes.length, []
        if a < c:
            e = min(b, c)
            rec = self._records()
            ptr = self.outlier_ptr.view()
            if ptr is not None:  # Med3x: the records of tiles [a // 32, ceil(e / 32)) are contiguous
                BH = self._shape[0] * self._shape[1]
                rec = rec[int(ptr[0, 0, a // TILE * BH]):int(ptr[0, 0, -(-e // TILE) * BH])]
            rec = rec[(rec[:, 0] >= a) & (rec[:, 0] < e)].clone()
            rec[:, 0] -= a
            parts.append(_ops.hqmq_decode(self.codes.view()[:, :, a:e].contiguous(), self.secondary, rec,
                                          self.config.radius_bits, self._shape[2], self.dtype))
        if b > c:
            parts.append(self.residual[:, :, max(a, c) - c:b - c])
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0] if parts else self._empty()

    @property
    def seq_len(self):
        return self.codes.length + self.residual_len

    def tensors(self):
        return {"codes": self.codes.view(),
                "outliers": self.outliers.view(), "outlier_ptr": self.outlier_ptr.view(),
                "secondary": self.secondary, "threshold": self.threshold,
                "residual": self.residual}

    unbatched = ("secondary", "threshold", "outliers", "outlier_ptr")

    def _state(self) -> Dict[str, torch.Tensor]:
        sd = super()._state()
        if self._shape is not None:
            sd["proto"] = self._empty()  # [B, H, 0, D] in the cache dtype (0 bytes)
        return sd

    def _select_extra(self, state, index):
        """Outlier records name their row ``n = b * H + h``: keep those of the selected batch
        rows, renumbered (a repeated row gets a copy of its records), each row's records in
        their stored order; ``outlier_ptr`` is rebuilt by ``load_state_dict``.  The secondary
        sets and the Med3x threshold (per head) stay."""
        state.pop("outlier_ptr", None)
        rec = state.get("outliers")
        if rec is None:
            return state
        H = self._shape[1]
        rec = rec.reshape(-1, 4)
        n = rec[:, 1] >> 8
        row, head = n // H, n % H
        parts = []
        for j, b in enumerate(index.tolist()):
            sel = row == b
            r = rec[sel].clone()
            r[:, 1] = ((j * H + head[sel]) << 8) | (rec[sel, 1] & 255)
            parts.append(r)
        state["outliers"] = torch.cat(parts).view(1, 1, -1, 4)
        return state

    def load_state_dict(self, state):
        self._shape = None
        self._check(state["proto"], "state['proto']")
        self.codes.reset(state.get("codes"))
        self.outliers.reset(state.get("outliers"))
        self.secondary = state.get("secondary")
        self.threshold = state.get("threshold")
        self.residual = state.get("residual")
        if self.residual is not None:
            self._check(self.residual, "state['residual']")
            if self.residual.shape[2] > self.config.recent_window:
                raise ValueError(f"argument 'state': the recent window holds {self.residual.shape[2]} "
                                 f"tokens, more than this config's recent_window="
                                 f"{self.config.recent_window}")
        if self.config.outlier_factor is not None:
            self._rebuild_index()  # (any stored "outlier_ptr" is recomputed, not trusted)
        if self.secondary is None:
            B, H, D = self._shape
            self.secondary = hqmq_secondary(H, self.config.secondary_size, self.config.seed,
                                            layer_idx=self.layer_idx, role=self.role,
                                            device=self.device)


register_format(HQMQConfig, compress=HQMQCompressed.from_tensor, new_stream=HQMQStream)
