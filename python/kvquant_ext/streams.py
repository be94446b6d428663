"""Streaming storage of one role (keys or values) of one layer, used by
:class:`kvquant_ext.KVCache`, and the registered formats of :class:`~kvquant_ext.FP16Config`
and the group-quantized configs.  A config's ``new_stream(role)`` returns one of these; new
methods add their own ``Stream`` subclass and register it with
:func:`kvquant_ext.register_format`.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import torch

from . import _ops
from ._build_config import HEAD_DIMS, HEAD_DIMS_TEXT
from .compressed import FullPrecision, GroupQuantized, check_cache_tensor
from .config import FP16Config, GroupQuantBase, QuantSpec, register_format


class Growable:
    """A tensor that grows along dim 2 with amortised (doubling) reallocation.  ``align``:
    the capacity along dim 2 is a multiple of it (e.g. so that fused kernels can read rows of
    every head with 16-byte loads)."""

    def __init__(self, align: int = 1):
        self.buf: Optional[torch.Tensor] = None
        self.length = 0
        self.align = align
        # rows [0, length) of a buffer never change once written, except through
        # ``truncate``, which makes the next append write into a copy (views handed out
        # before a crop keep their values)
        self._shared = False
        # view() of the used rows, reused while buf and length are unchanged (a decode step
        # reads every stream's views once; most of them change only when a block is flushed)
        self._view: Optional[torch.Tensor] = None
        self._view_len = -1

    def _cap(self, n: int) -> int:
        return -(-n // self.align) * self.align

    def append(self, t: torch.Tensor) -> None:
        n = t.shape[2]
        if self.buf is None:
            self.buf = torch.empty((*t.shape[:2], self._cap(max(n, 16)), *t.shape[3:]),
                                   dtype=t.dtype, device=t.device)
        elif self.length + n > self.buf.shape[2] or self._shared:
            grow = self.length + n > self.buf.shape[2]
            cap = self._cap(max(self.length + n, 2 * self.buf.shape[2] if grow else self.buf.shape[2]))
            nb = torch.empty((*self.buf.shape[:2], cap, *self.buf.shape[3:]), dtype=self.buf.dtype,
                             device=self.buf.device)
            nb[:, :, :self.length] = self.buf[:, :, :self.length]
            self.buf = nb
            self._shared = False
            self._view = None
        self.buf[:, :, self.length:self.length + n] = t
        self.length += n

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` rows along dim 2."""
        if n < self.length:
            self.length = n
            self._shared = self.buf is not None

    def view(self) -> Optional[torch.Tensor]:
        if self.buf is None:
            return None
        v = self._view
        if v is None or self._view_len != self.length or v._base is not self.buf:
            v = self._view = self.buf[:, :, :self.length]
            self._view_len = self.length
        return v

    def reset(self, t: Optional[torch.Tensor]) -> None:
        self.buf, self.length, self._shared, self._view = None, 0, False, None
        if t is not None:
            self.append(t)


def check_head_dim(x: torch.Tensor, name: str, spec: Optional[QuantSpec] = None) -> None:
    """Refuse a head dim the compressed formats cannot store (before anything is appended):
    one of the supported head dims, divisible by a per-token ``spec``'s channel group."""
    D = x.shape[-1]
    if D not in HEAD_DIMS:
        raise ValueError(f"argument '{name}' has head dim {D}; this cache's format supports "
                         f"{HEAD_DIMS_TEXT}")
    if spec is not None and not spec.per_channel and spec.group_size != -1 and D % spec.group_size:
        raise ValueError(f"argument '{name}' has head dim {D}, not a multiple of the format's "
                         f"group of {spec.group_size} channels per token")


def max_abs_of(t: torch.Tensor) -> torch.Tensor:
    """max |t| as an fp32 scalar tensor (NaN if ``t`` has a NaN; 0 if it is empty)."""
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    return torch.linalg.vector_norm(t, float("inf")).float()


class Stream:
    """One role of one layer: ``append``, ``dequantize``, ``seq_len``, ``nbytes``, state.

    ``max_abs``: the largest magnitude an appended entry may have (fp16 scales, zero points
    and radii bound every compressed format); :class:`~kvquant_ext.KVCache` checks it, with
    NaN/Inf, once per update."""

    max_abs: float = 65504.0
    #: what ``magnitude`` measures, for the error message
    magnitude_what: str = "entries with magnitude"

    def range_text(self) -> str:
        """What an append that fails the ``max_abs`` check has, for the error message."""
        return f"{self.magnitude_what} above {self.max_abs:g}"
    #: refuse a block whose compressed form cannot represent what was appended (GEAR's fp16
    #: low-rank factors); a cache sets it from its ``check_finite``
    check_outputs: bool = True

    def magnitude(self, x: torch.Tensor) -> torch.Tensor:
        """The quantity ``max_abs`` bounds, over ``x`` (fp32 scalar; NaN if ``x`` has one): max |x|."""
        return max_abs_of(x)

    def __init__(self):
        self.dtype: Optional[torch.dtype] = None
        self._shape = None  # (B, H, D)

    def validate(self, x: torch.Tensor, name: str) -> None:
        """Raise if ``x`` cannot be appended (shape, dtype, device); changes nothing, so a
        cache can check keys and values before appending either."""
        check_cache_tensor(x, name)
        if self._shape is not None:
            self._check(x, name)

    def _check(self, x: torch.Tensor, name: str) -> None:
        check_cache_tensor(x, name)
        B, H, _, D = x.shape
        if self._shape is None:
            self._shape, self.dtype, self.device = (B, H, D), x.dtype, x.device
            return
        if (B, H, D) != self._shape:
            raise ValueError(f"argument '{name}' has shape {tuple(x.shape)}, but this cache holds "
                             f"[B, H, T, D] = [{self._shape[0]}, {self._shape[1]}, T, {self._shape[2]}]")
        if x.dtype != self.dtype:
            raise TypeError(f"argument '{name}' has dtype {x.dtype}, but this cache holds {self.dtype}")
        if x.device != self.device:
            raise ValueError(f"argument '{name}' is on {x.device}, but this cache is on {self.device}")

    def append(self, x: torch.Tensor, name: str = "x") -> None:
        raise NotImplementedError  # pragma: no cover

    def prepare(self, x: torch.Tensor, name: str = "x"):
        """The commit of an append of ``x``: a stream whose append can still fail after
        :meth:`validate` (e.g. on what it compresses) does that work here, without changing
        state, so that a cache can prepare keys and values before committing either."""
        return lambda: self.append(x, name)

    def dequantize(self) -> torch.Tensor:
        raise NotImplementedError  # pragma: no cover

    @property
    def seq_len(self) -> int:
        raise NotImplementedError  # pragma: no cover

    def tensors(self) -> Dict[str, Optional[torch.Tensor]]:
        """Every stored tensor, trimmed to the used length."""
        raise NotImplementedError  # pragma: no cover

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values() if t is not None)

    #: state entries without a batch dimension (``batch_select`` keeps them as they are); every
    #: other entry of :meth:`_state` is ``[B, ...]``
    unbatched: Tuple[str, ...] = ()

    def _state(self) -> Dict[str, torch.Tensor]:
        """What :meth:`state_dict` saves, without copies."""
        return {k: v for k, v in self.tensors().items() if v is not None}

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._state().items()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> None:
        raise NotImplementedError  # pragma: no cover

    def batch_select(self, index: torch.Tensor) -> None:
        """Keep the batch rows ``index`` (int64 ``[B']`` on the stream's device, each in
        ``[0, B)``, repeats allowed; :class:`~kvquant_ext.KVCache` validates it): the stream
        becomes the one rows ``index`` of its appended tokens would have built."""
        if self._shape is None:  # nothing appended yet
            return
        state = {k: v if k in self.unbatched else v.index_select(0, index)
                 for k, v in self._state().items()}
        self.load_state_dict(self._select_extra(state, index))

    def _select_extra(self, state: Dict[str, torch.Tensor], index: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Rebuild the state entries that encode batch positions in their values (none here)."""
        return state

    # -- crop -----------------------------------------------------------------------
    @property
    def crop_floor(self) -> int:
        """The fewest tokens :meth:`crop` can keep (besides 0, which a cache does by
        resetting the layer): the end of the newest compressed unit (block) that would hold
        both kept and removed tokens.  A format without its own crop cannot be cropped."""
        return self.seq_len

    @property
    def crop_is_exact(self) -> bool:
        """Does every crop down to ``crop_floor`` leave the stream as if the removed tokens had
        never been appended (True), or may kept tokens stay compressed that such a stream would
        still hold in full precision (False; see docs/design.md)?"""
        return False

    def crop(self, n: int) -> None:
        """Remove the newest tokens, keeping the first ``n`` (``crop_floor <= n <= seq_len``,
        checked by :meth:`KVCache.crop`): every kept token keeps the value the stream held for it."""
        if n != self.seq_len:
            raise NotImplementedError(f"{type(self).__name__} cannot be cropped")  # pragma: no cover

    def dequantize_range(self, a: int, b: int) -> torch.Tensor:
        """Tokens ``[a, b)`` (``0 <= a <= b <= seq_len``) ``[B, H, b - a, D]``, bit for bit as
        :meth:`dequantize` holds them.  Formats without their own dequantize the whole stream."""
        return self.dequantize()[:, :, a:b]

    def range_cut(self, pos: int) -> int:
        """The first position >= ``pos`` where a range can start or end without splitting a
        compressed unit that :meth:`dequantize_range` would decode twice."""
        return pos

    def _empty(self) -> torch.Tensor:
        B, H, D = self._shape
        return torch.empty((B, H, 0, D), dtype=self.dtype, device=self.device)

    def _no_data(self, shape=None, dtype: Optional[torch.dtype] = None) -> torch.Tensor:
        """A tensor with no elements (default ``[B, H, 0, D]`` in the stream's dtype) for an
        attention operand with nothing stored yet; one per (shape, dtype, device), reused on
        every call, since it holds no data.  Internal to the ops' operands: what the stream
        hands to users (dequantize, state_dict) is a fresh tensor."""
        if shape is None:
            B, H, D = self._shape
            shape = (B, H, 0, D)
        key = (tuple(shape), dtype or self.dtype, self.device)
        cache = self.__dict__.setdefault("_no_data_cache", {})
        t = cache.get(key)
        if t is None:
            t = cache[key] = torch.empty(key[0], dtype=key[1], device=key[2])
        return t


class FullPrecisionStream(Stream):
    """FP16 baseline: every token kept as given."""

    max_abs = math.inf

    def __init__(self):
        super().__init__()
        self.data = Growable()

    def append(self, x, name="x"):
        self._check(x, name)
        self.data.append(x)

    def dequantize(self):
        return self.data.view() if self.data.buf is not None else None

    @property
    def seq_len(self):
        return self.data.length

    def tensors(self):
        return {"data": self.data.view()}

    crop_floor = 0
    crop_is_exact = True

    def crop(self, n):
        self.data.truncate(n)

    def dequantize_range(self, a, b):
        return self.data.view()[:, :, a:b]

    def load_state_dict(self, state):
        self._shape = None
        self._check(state["data"], "state['data']")
        self.data.reset(state["data"])


class _QuantStream(Stream):
    """Shared storage of the group-quantized streams: packed store + fp residual."""

    def __init__(self, spec: QuantSpec, residual_length: int, *, recent_window: int = 0,
                 check_finite: bool = True):
        super().__init__()
        self.spec, self.R, self.check_finite = spec, residual_length, check_finite
        self.W = recent_window
        self.codes, self.scale, self.zero = Growable(), Growable(), Growable()
        self.residual: Optional[torch.Tensor] = None

    def validate(self, x: torch.Tensor, name: str) -> None:
        super().validate(x, name)
        check_head_dim(x, name, self.spec)

    def _quantize_into_store(self, x: torch.Tensor) -> None:
        c, s, z = _ops.quantize(x, self.spec.bits, self.spec.group_size, self.spec.per_channel,
                                check_finite=self.check_finite)
        self.codes.append(c)
        self.scale.append(s)
        self.zero.append(z)

    @property
    def quantized_len(self) -> int:
        return self.codes.length

    @property
    def residual_len(self) -> int:
        return 0 if self.residual is None else self.residual.shape[2]

    @property
    def seq_len(self):
        return self.quantized_len + self.residual_len

    def dequantize(self):
        if self._shape is None:
            return None
        parts = []
        if self.codes.length:
            parts.append(_ops.dequantize(self.codes.view(), self.scale.view(), self.zero.view(),
                                         self.spec.bits, self.spec.per_channel, self.dtype))
        if self.residual_len:
            parts.append(self.residual)
        return torch.cat(parts, dim=2) if parts else self._empty()

    def tensors(self):
        return {"codes": self.codes.view(), "scale": self.scale.view(), "zero": self.zero.view(),
                "residual": self.residual}

    @property
    def _rows_per_group(self) -> int:
        """Tokens per scale row: G for per-channel keys (a stream's whole-axis group is R),
        1 per token."""
        return self.spec.group_size if self.spec.per_channel else 1

    def range_cut(self, pos):
        G = self._rows_per_group
        return -(-pos // G) * G if pos < self.quantized_len else pos

    def dequantize_range(self, a, b):
        q, parts = self.quantized_len, []
        if a < q:
            e, G = min(b, q), self._rows_per_group
            a0, e0 = a // G * G, -(-e // G) * G
            out = _ops.dequantize(self.codes.view()[:, :, a0:e0], self.scale.view()[:, :, a0 // G:e0 // G],
                                  self.zero.view()[:, :, a0 // G:e0 // G], self.spec.bits,
                                  self.spec.per_channel, self.dtype)
            parts.append(out[:, :, a - a0:e - a0])
        if b > q:
            parts.append(self.residual[:, :, max(a, q) - q:b - q])
        return torch.cat(parts, dim=2) if len(parts) > 1 else parts[0] if parts else self._empty()

    def _crop_residual(self, n: int) -> None:
        """Keep the first ``n`` tokens, all of them in the store or the residual as stored."""
        q = self.quantized_len
        if n >= q:
            self.residual = None if self.residual is None else self.residual[:, :, :n - q].contiguous()
            return
        for g in (self.codes, self.scale, self.zero):  # per-token rows (FIFO only)
            g.truncate(n)
        self.residual = None

    def _join_residual(self, x: torch.Tensor) -> torch.Tensor:
        if self.check_finite and not torch.isfinite(x).all():
            raise ValueError("argument 'x' contains NaN or Inf (cache check_finite=True)")
        return x if self.residual is None else torch.cat([self.residual, x], dim=2)

    def attention_operands(self):
        """(codes, scale, zero, residual) views for the fused decode-attention op; empty
        tensors (0 tokens) where nothing is stored yet."""
        B, H, D = self._shape
        spec = self.spec
        dev = self.device
        codes = self.codes.view()
        if codes is None:
            codes = self._no_data((B, H, 0, D * spec.bits // 32), torch.int32)
            ng = D if spec.per_channel else D // (D if spec.group_size == -1 else spec.group_size)
            scale = zero = self._no_data((B, H, 0, ng), torch.float16)
        else:
            scale, zero = self.scale.view(), self.zero.view()
        residual = self.residual if self.residual is not None else self._no_data()
        return codes, scale, zero, residual

    def load_state_dict(self, state):
        self._shape = None
        self._check(state["residual"], "state['residual']")
        self.residual = state["residual"]
        for name in ("codes", "scale", "zero"):
            getattr(self, name).reset(state.get(name))

    def _state(self):
        sd = super()._state()
        if self._shape is not None and "residual" not in sd:
            sd["residual"] = self._empty()
        return sd


class BlockFlushStream(_QuantStream):
    """KIVI keys (per-channel): tokens wait in a full-precision buffer; whenever it holds
    R tokens older than the recent window (W newest tokens) they are quantized together (R/G
    groups per channel).  A prefill of T tokens quantizes the first R * floor((T - W) / R)
    and buffers the rest.

    Crop: down to the quantized tokens (a block's scales span all of its tokens); exact when
    W = 0 (the residual then holds exactly the tokens after the last whole block)."""

    @property
    def crop_floor(self):
        return self.quantized_len

    @property
    def crop_is_exact(self):
        return self.W == 0

    def crop(self, n):
        self._crop_residual(n)

    def append(self, x, name="x"):
        self._check(x, name)
        full = self._join_residual(x)
        n = (max(full.shape[2] - self.W, 0) // self.R) * self.R
        if n:
            self._quantize_into_store(full[:, :, :n])
        self.residual = full[:, :, n:].contiguous()


class FifoStream(_QuantStream):
    """KIVI values (per-token): a FIFO of the last R + W tokens (residual and recent window)
    stays full precision; tokens pushed out of it are quantized on their own (per-token
    needs no other tokens).  R + W = 0 quantizes every token on arrival (naive per-token
    INT-b).

    Crop: to any length (per-token codes are separable); exact when R + W = 0, else the kept
    tokens that the removed ones pushed out of the FIFO stay quantized."""

    crop_floor = 0

    @property
    def crop_is_exact(self):
        return self.R + self.W == 0

    def crop(self, n):
        self._crop_residual(n)

    def append(self, x, name="x"):
        self._check(x, name)
        full = self._join_residual(x)
        n = max(full.shape[2] - self.R - self.W, 0)
        if n:
            self._quantize_into_store(full[:, :, :n])
        self.residual = full[:, :, n:].contiguous()


# ----------------------------------------------------------------------------- formats
def _fp16_compress(x, config, role, *, layer_idx=0, check_finite=True):
    check_cache_tensor(x)
    if check_finite and not torch.isfinite(x).all():
        raise ValueError("argument 'x' contains NaN or Inf")
    return FullPrecision(x)


def _fp16_stream(config, role, *, layer_idx=0, check_finite=True):
    return FullPrecisionStream()


def _group_compress(x, config, role, *, layer_idx=0, check_finite=True):
    return GroupQuantized.from_tensor(x, config.spec(role), check_finite=check_finite)


def _group_stream(config, role, *, layer_idx=0, check_finite=True):
    spec = config.spec(role)
    if spec.per_channel:
        # In a stream each flushed block of R tokens is quantized on its own, so a
        # whole-axis (KCVT) channel group becomes "the whole block": G = R.
        if spec.group_size == -1:
            spec = QuantSpec(spec.bits, config.residual_length, True)
        return BlockFlushStream(spec, config.residual_length, recent_window=config.recent_window,
                                check_finite=check_finite)
    return FifoStream(spec, config.residual_length, recent_window=config.recent_window,
                      check_finite=check_finite)


register_format(FP16Config, compress=_fp16_compress, new_stream=_fp16_stream)
register_format(GroupQuantBase, compress=_group_compress, new_stream=_group_stream)
