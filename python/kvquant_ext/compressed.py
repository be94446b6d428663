"""Compressed-tensor objects returned by :func:`kvquant_ext.compress`.

Each holds one whole block ``[B, H, T, D]`` and counts every byte it stores.
"""
from __future__ import annotations

from typing import Dict, Optional

import torch

from . import _ops
from ._build_config import DTYPES_TEXT
from .config import QuantSpec


def check_cache_tensor(x, name: str = "x") -> None:
    """Validate a ``[B, H, T, D]`` floating tensor (clear errors naming the argument)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _ops.FLOAT_DTYPES:
        raise TypeError(f"argument '{name}' must be {DTYPES_TEXT}, got {x.dtype}")
    if x.dim() != 4:
        raise ValueError(f"argument '{name}' must have shape [B, H, T, D], got {tuple(x.shape)}")


class Compressed:
    """Base class: ``decompress()``, ``nbytes``, ``bits_per_element``."""

    shape: torch.Size
    dtype: torch.dtype

    def decompress(self) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def tensors(self) -> Dict[str, Optional[torch.Tensor]]:
        """Every stored tensor (``nbytes`` is the sum of their sizes)."""
        raise NotImplementedError  # pragma: no cover

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values() if t is not None)

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def bits_per_element(self) -> float:
        return 8.0 * self.nbytes / self.numel if self.numel else 0.0

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, bits_per_element={self.bits_per_element:.3f})")


class FullPrecision(Compressed):
    """No compression (FP16 baseline): the tensor itself."""

    def __init__(self, x: torch.Tensor):
        check_cache_tensor(x)
        self.data = x
        self.shape, self.dtype = x.shape, x.dtype

    def decompress(self):
        return self.data

    def tensors(self):
        return {"data": self.data}


class GroupQuantized(Compressed):
    """Group-quantized block: packed codes + fp16 scale/zero, plus the full-precision
    tail of key tokens that do not fill a last per-channel group."""

    def __init__(self, codes, scale, zero, spec: QuantSpec, shape, dtype, tail=None):
        self.codes, self.scale, self.zero, self.tail = codes, scale, zero, tail
        self.spec, self.shape, self.dtype = spec, torch.Size(shape), dtype

    @classmethod
    def from_tensor(cls, x: torch.Tensor, spec: QuantSpec, *, check_finite: bool = True):
        check_cache_tensor(x)
        T = x.shape[2]
        tq = T
        if spec.per_channel and spec.group_size != -1:
            tq = T - T % spec.group_size
        head, tail = (x, None) if tq == T else (x[:, :, :tq], x[:, :, tq:].contiguous())
        codes, scale, zero = _ops.quantize(head, spec.bits, spec.group_size, spec.per_channel,
                                           check_finite=check_finite)
        if tail is not None and check_finite and not torch.isfinite(tail).all():
            raise ValueError("argument 'x' contains NaN or Inf")
        return cls(codes, scale, zero, spec, x.shape, x.dtype, tail)

    def decompress(self):
        out = _ops.dequantize(self.codes, self.scale, self.zero, self.spec.bits,
                              self.spec.per_channel, self.dtype)
        return out if self.tail is None else torch.cat([out, self.tail], dim=2)

    def tensors(self):
        return {"codes": self.codes, "scale": self.scale, "zero": self.zero, "tail": self.tail}
