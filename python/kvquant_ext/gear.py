"""GEAR compressed blocks and the GEAR streaming rule (used by :class:`kvquant_ext.KVCache`).

A :class:`GEARCompressed` holds one block ``[B, H, T, D]`` compressed by
``kvq.gear_compress`` (layout in docs/ops.md).  A :class:`GEARStream` compresses the
prefill as one block (prefill rank), keeps new tokens in a full-precision buffer and, each
time the buffer holds ``buffer_length`` tokens, compresses exactly those tokens as a new
block (its own outliers and ``rank_decode`` factors) and appends it; older blocks are never
recompressed.  No math lives here: everything goes through the registered ops.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch

from . import _ops
from .compressed import Compressed, check_cache_tensor
from .config import GEARConfig, QuantSpec, _check_role
from .streams import Stream

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
        return out if self.tail is None else torch.cat([out, self.tail], dim=2)

    def tensors(self):
        d = dict(self.fields)
        d["tail"] = self.tail
        return d


class GEARStream(Stream):
    """GEAR streaming of one role of one layer (see the module docstring).

    ``blocks`` lists the compressed blocks in token order and ``block_offsets`` their first
    token, so a decode-attention kernel can walk them; ``buffer`` holds the full-precision
    tokens not yet compressed."""

    def __init__(self, config: GEARConfig, role: str, *, check_finite: bool = True):
        super().__init__()
        self.config, self.role, self.check_finite = config, role, check_finite
        self.spec = config.spec(role)
        self.blocks: List[GEARCompressed] = []
        self.buffer: Optional[torch.Tensor] = None
        self.prefilled = False

    # -- streaming --------------------------------------------------------------
    def _compress_block(self, x: torch.Tensor, rank: int) -> None:
        self.blocks.append(GEARCompressed.from_tensor(x, self.config, self.role, rank=rank,
                                                      check_finite=self.check_finite))

    def append(self, x, name="x"):
        self._check(x, name)
        if self.check_finite and not torch.isfinite(x).all():
            raise ValueError(f"argument '{name}' contains NaN or Inf (cache check_finite=True)")
        full = x if self.buffer is None else torch.cat([self.buffer, x], dim=2)
        start = 0
        if not self.prefilled and full.shape[2] > 0:
            # Prefill: one block at the prefill rank (whole KIVI key groups only).
            n = full.shape[2]
            if self.spec.per_channel and self.spec.group_size != -1:
                n -= n % self.spec.group_size
            if n:
                self._compress_block(full[:, :, :n], self.config.rank)
            start = n
            self.prefilled = True
        else:
            nb = self.config.buffer_length
            while full.shape[2] - start >= nb:
                self._compress_block(full[:, :, start:start + nb], self.config.rank_decode)
                start += nb
        self.buffer = full[:, :, start:].contiguous()

    # -- views ------------------------------------------------------------------
    @property
    def block_offsets(self) -> List[int]:
        offs, t = [], 0
        for b in self.blocks:
            offs.append(t)
            t += b.shape[2]
        return offs

    @property
    def compressed_len(self) -> int:
        return sum(b.shape[2] for b in self.blocks)

    @property
    def buffer_len(self) -> int:
        return 0 if self.buffer is None else self.buffer.shape[2]

    @property
    def seq_len(self):
        return self.compressed_len + self.buffer_len

    def dequantize(self):
        if self._shape is None:
            return None
        parts = [b.decompress() for b in self.blocks]
        if self.buffer_len:
            parts.append(self.buffer)
        return torch.cat(parts, dim=2) if parts else self._empty()

    def tensors(self):
        d: Dict[str, Optional[torch.Tensor]] = {}
        for i, b in enumerate(self.blocks):
            for k, v in b.tensors().items():
                d[f"blocks.{i}.{k}"] = v
        d["buffer"] = self.buffer
        return d

    # -- state ------------------------------------------------------------------
    def state_dict(self):
        sd = super().state_dict()
        if self._shape is not None:
            if "buffer" not in sd:
                sd["buffer"] = self._empty()
            sd["prefilled"] = torch.tensor([int(self.prefilled)], dtype=torch.int8)
        return sd

    def load_state_dict(self, state):
        self._shape = None
        self._check(state["buffer"], "state['buffer']")
        self.buffer = state["buffer"]
        self.prefilled = bool(int(state["prefilled"].reshape(-1)[0]))
        B, H, D = self._shape
        self.blocks = []
        i = 0
        while f"blocks.{i}.codes" in state:
            f = {k: state[f"blocks.{i}.{k}"] for k in _FIELDS}
            tail = state.get(f"blocks.{i}.tail")
            T = f["codes"].shape[2] + (0 if tail is None else tail.shape[2])
            self.blocks.append(GEARCompressed(f, self.spec, (B, H, T, D), self.dtype, tail))
            i += 1
