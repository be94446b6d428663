"""GEAR compressed blocks and the GEAR streaming rule (used by :class:`kvquant_ext.KVCache`).

A :class:`GEARCompressed` holds one block ``[B, H, T, D]`` compressed by
``kvq.gear_compress`` (layout in docs/ops.md).  A :class:`GEARStream` compresses the
prefill as one block (prefill rank), keeps new tokens in a full-precision buffer and, each
time the buffer holds ``buffer_length`` tokens, compresses exactly those tokens as a new
block (its own outliers and ``rank_decode`` factors) and appends it; older blocks are never
recompressed.  The stream stores its blocks concatenated (see :class:`GEARStream`) so that
``kvq.decode_attention_gear`` reads them in place.  No math lives here: everything goes
through the registered ops.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import _ops
from .compressed import Compressed, check_cache_tensor
from .config import GEARConfig, QuantSpec, _check_role, register_format
from .streams import Growable, Stream, check_head_dim

_FIELDS = ("codes", "scale", "zero", "outlier_values", "outlier_indices", "A", "B")


class GEARCompressed(Compressed):
    """One GEAR block: backbone codes/scale/zero, per-vector outliers (values + compact
    indices), fp16 factors ``A [B, H, T, r]`` / ``B [B, H, D, r]``, plus the full-precision
    tail of key tokens that do not fill a last KIVI group (counted in ``nbytes``)."""

    def __init__(self, fields: Dict[str, torch.Tensor], spec: QuantSpec, shape, dtype,
                 tail: Optional[torch.Tensor] = None):
        self.fields = dict(fields)
        self.spec, self.shape, self.dtype, self.tail = spec, torch.Size(shape), dtype, tail

    def __getattr__(self, name):
        fields = self.__dict__.get("fields")
        if fields is not None and name in fields:
            return fields[name]
        raise AttributeError(name)

    @property
    def rank(self) -> int:
        return self.fields["A"].shape[-1]

    @property
    def compressed_len(self) -> int:
        return self.fields["codes"].shape[2]

    @classmethod
    def from_tensor(cls, x: torch.Tensor, config: GEARConfig, role: str, *, rank: int,
                    check_finite: bool = True) -> "GEARCompressed":
        """Compress ``x [B, H, T, D]``.  The rank is clamped to ``min(rank, T, D)`` so short
        blocks stay valid; with the KIVI backbone, key tokens beyond the last full group of
        G stay full precision (``tail``)."""
        check_cache_tensor(x)
        spec = config.spec(_check_role(role))
        T, D = x.shape[2], x.shape[3]
        tq = T
        if spec.per_channel and spec.group_size != -1:
            tq = T - T % spec.group_size
        head, tail = (x, None) if tq == T else (x[:, :, :tq], x[:, :, tq:].contiguous())
        r = min(rank, tq, D)
        out = _ops.gear_compress(head, spec.bits, spec.group_size, spec.per_channel,
                                 config.sparsity, r, config.iters, config.seed,
                                 check_finite=check_finite)
        if tail is not None and check_finite and not torch.isfinite(tail).all():
            raise ValueError("argument 'x' contains NaN or Inf")
        fields = dict(zip(_FIELDS, out))
        if check_finite and r > 0 and not (torch.isfinite(fields["A"]).all()
                                           and torch.isfinite(fields["B"]).all()):
            raise ValueError("argument 'x': its quantization residual is too large for fp16 "
                             "low-rank factors (a singular value above 65504); use a smaller "
                             "rank-0 config or rescale the input")
        return cls(fields, spec, x.shape, x.dtype, tail)

    def decompress(self) -> torch.Tensor:
        f = self.fields
        out = _ops.gear_decompress(f["codes"], f["scale"], f["zero"], f["outlier_values"],
                                   f["outlier_indices"], f["A"], f["B"], self.spec.bits,
                                   self.spec.per_channel, self.dtype)
        if self.dtype == torch.float16:
            out = self._saturate(out)
        return out if self.tail is None else torch.cat([out, self.tail], dim=2)

    def _saturate(self, out: torch.Tensor) -> torch.Tensor:
        """Backbone + low rank may land past fp16's range next to an input entry near +-65504:
        such an entry saturates at +-65504 instead of becoming an infinity; a stored infinite
        outlier (check_finite=False) stays infinite, NaN stays NaN."""
        inf = out.isinf()
        if not bool(inf.any()):  # one host sync, on this dequantize path only
            return out
        keep = torch.zeros_like(inf)
        ov, oi = self.fields["outlier_values"], self.fields["outlier_indices"]
        if ov.numel():
            (keep.transpose(-1, -2) if self.spec.per_channel else keep).scatter_(-1, oi.long(), ov.isinf())
        return torch.where(inf & ~keep, out.sign() * 65504.0, out).to(out.dtype)

    def tensors(self):
        d = dict(self.fields)
        d["tail"] = self.tail
        return d


def _tile_sort(ov: torch.Tensor, oi: torch.Tensor, T: int, od: Optional[torch.Tensor] = None):
    """Key outliers of one block, per channel (``[B, H, D, 2k]``, index = token) -> sorted by
    token: values ``[B, H, 1, M]``, packed ``(token mod 32) << 8 | channel`` int16
    ``[B, H, 1, M]`` and per 32-token tile offsets ``[B, H, 1, P]`` int32 (first entry of
    each tile, then M; P = ceil((tiles + 1) / 4)·4 + 4); with ``od`` (the entries'
    corrections, same layout as ``ov``) also those, in the same order (a fourth output)."""
    B, H, D, n = ov.shape
    t = oi.long()
    c = torch.arange(D, device=ov.device).view(1, 1, D, 1).expand_as(t)
    order = torch.argsort((t * 256 + c).reshape(B, H, -1), dim=-1)
    ts = t.reshape(B, H, -1).gather(2, order)
    cs = c.reshape(B, H, -1).gather(2, order)
    vals = ov.reshape(B, H, -1).gather(2, order)
    packed = ((ts % 32) * 256 + cs).to(torch.int16)
    nt = (T + 31) // 32
    # rows padded with M to a multiple of 4 plus 4 (the CUDA kernel reads an aligned
    # window of 8 offsets around each tile)
    P = (nt + 1 + 3) // 4 * 4 + 4
    counts = torch.zeros(B, H, P, dtype=torch.int64, device=ov.device)
    counts.scatter_add_(2, ts // 32 + 1, torch.ones_like(ts))
    off = counts.cumsum(2).to(torch.int32)
    out = (vals.unsqueeze(2), packed.unsqueeze(2), off.unsqueeze(2))
    if od is None:
        return out
    return (*out, od.reshape(B, H, -1).gather(2, order).unsqueeze(2))


def outlier_corrections(f: Dict[str, torch.Tensor], per_channel: bool, dtype: torch.dtype) -> torch.Tensor:
    """Correction ``d = v - xhat`` of every outlier entry of one block, in the layout of
    ``f["outlier_values"]`` (``[B, H, V, 2k]``; V = channels for per-channel keys, whose
    indices are tokens, tokens for values, whose indices are channels), in ``dtype`` (the cache
    dtype).  ``xhat`` is what ``kvq.gear_decompress`` computes at that position before the
    outlier overwrite, in fp32 and before its rounding to the cache dtype: ``code * scale +
    zero`` plus ``A[t] . B[c]`` accumulated over the ranks in order.  Only the entries are
    touched (O(entries * rank)), so this runs once per compressed block, not per decode step;
    ``kvq.decode_attention_gear`` adds ``d`` to its own ``xhat`` instead of recomputing it."""
    ov, oi = f["outlier_values"], f["outlier_indices"]
    if ov.shape[-1] == 0:
        return torch.empty(ov.shape, dtype=dtype, device=ov.device)
    codes, scale, zero, A, Bf = f["codes"], f["scale"], f["zero"], f["A"], f["B"]
    B, H, V, n = ov.shape
    T, W = codes.shape[2], codes.shape[3]
    D = Bf.shape[2]
    bits = W * 32 // D
    cpw = 32 // bits
    idx = oi.long()
    pos = torch.arange(V, device=ov.device).view(1, 1, V, 1).expand(B, H, V, n)
    t, c = (idx, pos) if per_channel else (pos, idx)
    t, c = t.reshape(B, H, -1), c.reshape(B, H, -1)
    word = codes.reshape(B, H, -1).gather(2, t * W + torch.div(c, cpw, rounding_mode="floor"))
    code = torch.bitwise_and(torch.bitwise_right_shift(word, (c % cpw) * bits), (1 << bits) - 1)
    if per_channel:  # scale [B, H, T / G, D]
        G = T // scale.shape[2]
        si = torch.div(t, G, rounding_mode="floor") * D + c
    else:            # scale [B, H, T, D / G]
        ng = scale.shape[3]
        si = t * ng + torch.div(c, D // ng, rounding_mode="floor")
    x = code.float() * scale.reshape(B, H, -1).gather(2, si).float()
    x = x + zero.reshape(B, H, -1).gather(2, si).float()
    r = A.shape[-1]
    Af, Bff = A.reshape(B, H, -1), Bf.reshape(B, H, -1)
    for j in range(r):
        x = x + Af.gather(2, t * r + j).float() * Bff.gather(2, c * r + j).float()
    return (ov.reshape(B, H, -1).float() - x).to(dtype).reshape(B, H, V, n)


def _per_channel(vals: torch.Tensor, packed: torch.Tensor, off: torch.Tensor, D: int, T: int):
    """Inverse of :func:`_tile_sort` for one block (``[B, H, M]``, ``[B, H, nt + 1]``): per
    channel ``[B, H, D, 2k]`` values and token indices, each vector's entries in token order
    (what ``gear_decompress`` needs: it overwrites by position)."""
    B, H, M = vals.shape
    if M == 0:
        return vals.reshape(B, H, D, 0), packed.reshape(B, H, D, 0).to(_ops.outlier_index_dtype(T))
    j = torch.arange(M, device=vals.device).expand(B, H, M).contiguous()
    tile = torch.searchsorted(off[..., 1:].contiguous().long(), j, right=True)
    p = packed.long() & 0xFFFF
    t = tile * 32 + (p >> 8)
    c = p & 255
    order = torch.argsort(c * T + t, dim=-1)
    ov = vals.gather(2, order).reshape(B, H, D, -1)
    oi = t.gather(2, order).reshape(B, H, D, -1).to(_ops.outlier_index_dtype(T))
    return ov, oi


class GEARStream(Stream):
    """GEAR streaming of one role of one layer (see the module docstring).

    Storage is concatenated so that a fused decode-attention kernel reads one array per
    field: the backbone (``codes``/``scale``/``zero``) of every block in token order; the
    prefill block's factors ``A0 [B, H, T0, r]`` / ``B0 [B, H, D, r]`` and outliers
    ``ov0``/``oi0``; the decode blocks' factors ``A1 [B, H, T1, r_d]`` /
    ``B1 [B, H, nblk, D, r_d]`` and outliers ``ov1``/``oi1``.  Value outliers stay per token
    (``[B, H, T_seg, 2k]``); key outliers are stored per block (``[B, H, nblk, ...]``), with
    the KIVI backbone sorted by token for the kernel:
    ``ov``/``oi`` ``[B, H, nblk, M]`` (M = D·2k entries per block; ``oi`` int16
    ``(token mod 32) << 8 | channel``) and ``off`` ``[B, H, nblk, tiles + 1]`` int32, the
    first entry of each 32-token tile.  With the KIVI backbone every outlier entry also
    carries its correction ``od`` (``od0`` / ``od1``, the layout and dtype of ``ov``):
    ``v - xhat`` (:func:`outlier_corrections`), which ``kvq.decode_attention_gear`` adds
    instead of recomputing ``xhat`` at every decode step; counted in ``nbytes``.
    ``blocks`` gives per-block :class:`GEARCompressed` views (backbone and factors without
    copies; key outliers converted back per channel; no corrections).

    The prefill block covers the longest prefix of whole KIVI groups (``T - T mod G``) for
    keys *and* values, so both roles have the same block boundaries; the rest waits in the
    full-precision ``buffer`` with the decode tokens."""

    _SEG = ("A0", "B0", "ov0", "oi0", "off0", "od0")

    def __init__(self, config: GEARConfig, role: str, *, layer_idx: int = 0,
                 check_finite: bool = True):
        # (GEAR storage is the same for every layer: ``layer_idx`` is not used)
        super().__init__()
        self.config, self.role, self.check_finite = config, role, check_finite
        self.spec = config.spec(role)
        self.codes, self.scale, self.zero = Growable(), Growable(), Growable()
        self.A1, self.B1, self.ov1, self.oi1 = Growable(), Growable(), Growable(), Growable()
        self.off1, self.od1 = Growable(), Growable()
        self.A0 = self.B0 = self.ov0 = self.oi0 = self.off0 = self.od0 = None
        self.T0 = 0         # tokens of the prefill block (0: none)
        self.num_decode_blocks = 0
        self.buffer: Optional[torch.Tensor] = None
        self.prefilled = False

    # -- streaming --------------------------------------------------------------
    @property
    def _tile_sorted(self) -> bool:
        """Key outliers are stored sorted by token (for kvq.decode_attention_gear, which takes
        the KIVI backbone only); KCVT-backbone streams keep them per channel."""
        return self.spec.per_channel and self.config.backbone == "kivi"

    @property
    def _fused(self) -> bool:
        """Layout for kvq.decode_attention_gear (KIVI backbone): outlier corrections stored."""
        return self.config.backbone == "kivi"

    @property
    def prefill_align(self) -> int:
        """The prefill block covers a multiple of this many tokens (the KIVI group)."""
        return self.config.group_size if self.config.backbone == "kivi" else 1

    def _rows(self, ntok: int) -> int:
        """Scale/zero rows of a block of ``ntok`` tokens."""
        G = self.spec.group_size
        if not self.spec.per_channel:
            return ntok
        return 1 if G == -1 else ntok // G

    def validate(self, x: torch.Tensor, name: str) -> None:
        super().validate(x, name)
        check_head_dim(x, name, self.config.value_spec())

    def _compress_block(self, x: torch.Tensor, rank: int, name: str = "x"):
        """Compress one block without changing the stream: what :meth:`_store_block` stores.
        With ``check_outputs`` a block whose low-rank factors overflow fp16 is refused."""
        blk = GEARCompressed.from_tensor(x, self.config, self.role, rank=rank,
                                         check_finite=self.check_finite)
        assert blk.tail is None  # blocks are whole KIVI groups
        f = blk.fields
        if self.check_outputs and blk.rank > 0 and not bool(torch.isfinite(f["A"]).all()
                                                            & torch.isfinite(f["B"]).all()):
            raise ValueError(f"argument '{name}': its quantization residual is too large for fp16 "
                             "low-rank factors (a singular value above 65504); use a rank-0 "
                             "config or rescale the input (cache check_finite=True)")
        ov, oi, off = f["outlier_values"], f["outlier_indices"], None
        od = outlier_corrections(f, self.spec.per_channel, x.dtype) if self._fused else None
        if self.spec.per_channel:
            if self._tile_sorted:  # keys for the fused kernel: sorted by token, tile offsets
                ov, oi, off, od = _tile_sort(ov, oi, x.shape[2], od)
            else:                  # KCVT backbone (no fused kernel): per channel, one set per block
                ov, oi = ov.unsqueeze(2), oi.unsqueeze(2)
        return x.shape[2], f, ov, oi, off, od

    def _store_block(self, block) -> None:
        ntok, f, ov, oi, off, od = block
        for name in ("codes", "scale", "zero"):
            getattr(self, name).append(f[name])
        if self.T0 == 0 and self.num_decode_blocks == 0 and not self.prefilled:
            self.T0 = ntok
            self.A0, self.B0 = f["A"], f["B"]
            self.ov0, self.oi0, self.off0, self.od0 = ov, oi, off, od
            return
        self.num_decode_blocks += 1
        self.A1.append(f["A"])
        self.B1.append(f["B"].unsqueeze(2))
        self.ov1.append(ov)  # keys [B, H, 1, M]; values [B, H, nb, 2k]
        self.oi1.append(oi)
        if off is not None:
            self.off1.append(off)
        if od is not None:
            self.od1.append(od)  # the layout of ov

    def prepare(self, x, name="x"):
        """Compress the blocks an append of ``x`` completes, without changing the stream, and
        return the commit that stores them (so a cache can refuse a block of either role
        before it stores anything)."""
        self._check(x, name)
        if self.check_finite and not torch.isfinite(x).all():
            raise ValueError(f"argument '{name}' contains NaN or Inf (cache check_finite=True)")
        full = x if self.buffer is None else torch.cat([self.buffer, x], dim=2)
        start, blocks, prefill = 0, [], False
        W = self.config.recent_window
        if not self.prefilled and full.shape[2] > 0:
            # Prefill: one block at the prefill rank (whole KIVI groups, both roles) over the
            # tokens older than the recent window.
            n = max(full.shape[2] - W, 0)
            n -= n % self.prefill_align
            if n:
                blocks.append(self._compress_block(full[:, :, :n], self.config.rank, name))
            start, prefill = n, True
        else:
            # a block of n_b tokens is compressed once all of them are older than the window
            nb = self.config.buffer_length
            while full.shape[2] - start >= nb + W:
                blocks.append(self._compress_block(full[:, :, start:start + nb], self.config.rank_decode,
                                                   name))
                start += nb
        rest = full[:, :, start:].contiguous()

        def commit():
            for blk in blocks:
                self._store_block(blk)
            if prefill:
                self.prefilled = True
            self.buffer = rest
        return commit

    def append(self, x, name="x"):
        self.prepare(x, name)()

    # -- views ------------------------------------------------------------------
    @property
    def blocks(self) -> List[GEARCompressed]:
        """Per-block views (no copies) in token order."""
        if self._shape is None:
            return []
        B, H, D = self._shape
        out = []
        codes, scale, zero = self.codes.view(), self.scale.view(), self.zero.view()
        t = r = 0

        def block(ntok, A, Bf, ov, oi, off):
            nonlocal t, r
            nr = self._rows(ntok)
            if off is not None:
                ov, oi = _per_channel(ov, oi, off, D, ntok)
            f = {"codes": codes[:, :, t:t + ntok], "scale": scale[:, :, r:r + nr],
                 "zero": zero[:, :, r:r + nr], "outlier_values": ov, "outlier_indices": oi,
                 "A": A, "B": Bf}
            t, r = t + ntok, r + nr
            return GEARCompressed(f, self.spec, (B, H, ntok, D), self.dtype)

        if self.T0:
            off0 = None if self.off0 is None else self.off0[:, :, 0]
            out.append(block(self.T0, self.A0, self.B0, *self._seg0_outliers(), off0))
        nb = self.config.buffer_length
        A1, B1, ov1, oi1 = self.A1.view(), self.B1.view(), self.ov1.view(), self.oi1.view()
        off1 = self.off1.view()
        for j in range(self.num_decode_blocks):
            if self.spec.per_channel:
                ov, oi = ov1[:, :, j], oi1[:, :, j]
                off = off1[:, :, j] if self._tile_sorted else None
            else:
                ov, oi, off = ov1[:, :, j * nb:(j + 1) * nb], oi1[:, :, j * nb:(j + 1) * nb], None
            out.append(block(nb, A1[:, :, j * nb:(j + 1) * nb], B1[:, :, j], ov, oi, off))
        return out

    def _seg0_outliers(self):
        if not self.spec.per_channel:
            return self.ov0, self.oi0
        return self.ov0[:, :, 0], self.oi0[:, :, 0]

    @property
    def block_offsets(self) -> List[int]:
        offs, t = [], 0
        for b in self.blocks:
            offs.append(t)
            t += b.shape[2]
        return offs

    @property
    def compressed_len(self) -> int:
        return self.codes.length

    @property
    def buffer_len(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[2]

    @property
    def seq_len(self):
        return self.compressed_len + self.buffer_len

    # -- crop -------------------------------------------------------------------------
    # Down to the compressed blocks (a block's factors and outliers span all of its tokens);
    # exact when W = 0 (the buffer then holds exactly the tokens after the last block).
    @property
    def crop_floor(self):
        return self.compressed_len

    @property
    def crop_is_exact(self):
        return self.config.recent_window == 0

    def crop(self, n):
        c = self.compressed_len
        self.buffer = None if self.buffer is None else self.buffer[:, :, :n - c].contiguous()

    def _block_ends(self) -> List[int]:
        ends = [self.T0] if self.T0 else []
        nb = self.config.buffer_length
        return ends + [self.T0 + (j + 1) * nb for j in range(self.num_decode_blocks)]

    def range_cut(self, pos):
        for e in [0] + self._block_ends():
            if e >= pos:
                return e
        return pos

    def dequantize_range(self, a, b):
        """The blocks overlapping ``[a, b)`` are decompressed whole (a block's factors and
        outliers span all of its tokens), then sliced."""
        parts, start = [], 0
        blocks = self.blocks if a < self.compressed_len else []
        for blk in blocks:
            end = start + blk.shape[2]
            if start < b and a < end:
                parts.append(blk.decompress()[:, :, max(a, start) - start:min(b, end) - start])
            start = end
        c = self.compressed_len
        if b > c:
            parts.append(self.buffer[:, :, max(a, c) - c:b - c])
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0] if parts else self._empty()

    def dequantize(self):
        if self._shape is None:
            return None
        parts = [b.decompress() for b in self.blocks]
        if self.buffer_len:
            parts.append(self.buffer)
        return torch.cat(parts, dim=2) if parts else self._empty()

    def attention_operands(self):
        """Operands of ``kvq.decode_attention_gear`` for this role: the backbone
        ``(codes, scale, zero, residual)`` and the GEAR list
        ``[A0, B0, ov0, oi0, off0, od0, A1, B1, ov1, oi1, off1, od1]`` (empty tensors where
        absent)."""
        B, H, D = self._shape
        dev, spec = self.device, self.spec
        codes = self.codes.view()
        if codes is None:
            ng = D if spec.per_channel else D // spec.group_size
            codes = torch.empty((B, H, 0, D * spec.bits // 32), dtype=torch.int32, device=dev)
            scale = zero = torch.empty((B, H, 0, ng), dtype=torch.float16, device=dev)
        else:
            scale, zero = self.scale.view(), self.zero.view()
        residual = self.buffer if self.buffer is not None else self._no_data()
        e = torch.empty(0, device=dev)
        gear = [self.A0, self.B0, self.ov0, self.oi0, self.off0, self.od0, self.A1.view(),
                self.B1.view(), self.ov1.view(), self.oi1.view(), self.off1.view(), self.od1.view()]
        return codes, scale, zero, residual, [e if t is None else t for t in gear]

    def tensors(self):
        return {"codes": self.codes.view(), "scale": self.scale.view(), "zero": self.zero.view(),
                "A0": self.A0, "B0": self.B0, "ov0": self.ov0, "oi0": self.oi0, "off0": self.off0,
                "od0": self.od0, "A1": self.A1.view(), "B1": self.B1.view(), "ov1": self.ov1.view(),
                "oi1": self.oi1.view(), "off1": self.off1.view(), "od1": self.od1.view(),
                "buffer": self.buffer}

    # -- state ------------------------------------------------------------------
    unbatched = ("meta",)

    def _state(self):
        sd = super()._state()
        if self._shape is not None:
            if "buffer" not in sd:
                sd["buffer"] = self._empty()
            sd["meta"] = torch.tensor([int(self.prefilled), self.T0, self.num_decode_blocks],
                                      dtype=torch.int64)
        return sd

    def load_state_dict(self, state):
        self._shape = None
        self._check(state["buffer"], "state['buffer']")
        self.buffer = state["buffer"]
        prefilled, self.T0, self.num_decode_blocks = (int(v) for v in state["meta"].reshape(-1)[:3])
        self.prefilled = bool(prefilled)
        for name in ("codes", "scale", "zero", "A1", "B1", "ov1", "oi1", "off1", "od1"):
            getattr(self, name).reset(state.get(name))
        for name in self._SEG:
            setattr(self, name, state.get(name))
        if self._fused and self.compressed_len and "od0" not in state and "od1" not in state:
            self._rebuild_corrections()  # a state saved before the corrections were stored

    def _rebuild_corrections(self) -> None:
        """Recompute ``od0`` / ``od1`` from the stored blocks (same values as at compression)."""
        self.od0, self.od1 = None, Growable()
        for j, blk in enumerate(self.blocks):
            f = blk.fields
            od = outlier_corrections(f, self.spec.per_channel, self.dtype)
            if self._tile_sorted:
                od = _tile_sort(f["outlier_values"], f["outlier_indices"], blk.shape[2], od)[3]
            if j == 0 and self.T0:
                self.od0 = od
            else:
                self.od1.append(od)


def _gear_compress(x, config, role, *, layer_idx=0, check_finite=True, rank=None):
    """One whole block at the prefill rank unless ``rank`` is given."""
    return GEARCompressed.from_tensor(x, config, role, rank=config.rank if rank is None else rank,
                                      check_finite=check_finite)


register_format(GEARConfig, compress=_gear_compress, new_stream=GEARStream)
