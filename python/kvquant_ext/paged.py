"""``PagedKVCache``: a pool of pages of compressed and full-precision KV tokens shared by many
sequences of different lengths (continuous batching), on the paged ops
(:func:`kvquant_ext.ops.paged_append`, ``paged_decode_plan``, ``paged_decode_attention`` and, for
HQMQ pages, ``paged_decode_attention_hqmq``).

A page holds ``page_size`` (P) tokens of one layer and every KV head.  A sequence's tokens fill
full-precision pages; a page that becomes full is compressed into a page of the compressed pool
in the same call (never recompressed later), so a sequence is ``comp_len`` compressed tokens
(whole pages) followed by fewer than P full-precision ones.  Page 0 of each pool is scratch:
padding slots may point there, and no sequence ever owns it.
"""
from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _ops
from ._build_config import DTYPES_TEXT, HEAD_DIMS, HEAD_DIMS_TEXT
from .config import CompressionConfig, FP16Config, GroupQuantBase, HQMQConfig, QuantSpec, get_config
from .hqmq import MAX_SCALE, chunk_norms, hqmq_secondary
from .streams import max_abs_of

__all__ = ["PagedKVCache"]


def _paged_spec(spec: QuantSpec, page_size: int, head_dim: int) -> QuantSpec:
    """The group spec of one page: whole-axis groups (-1) become the page (keys) or the head
    dim (values); per-channel groups must divide the page."""
    g = spec.group_size
    if spec.per_channel:
        g = page_size if g == -1 else g
        if page_size % g:
            raise ValueError(f"argument 'page_size' ({page_size}) must be a multiple of the key group size ({g})")
    else:
        g = head_dim if g == -1 else g
        if head_dim % g:
            raise ValueError(f"argument 'head_dim' ({head_dim}) must be a multiple of the group size ({g})")
    return QuantSpec(spec.bits, g, spec.per_channel)


@dataclass
class _Seq:
    length: int = 0
    comp_pages: List[int] = field(default_factory=list)
    fp_pages: List[int] = field(default_factory=list)
    row: Optional[torch.Tensor] = None  # int32 block-table row (host), None when the pages changed


class _Layer:
    """The pools and the per-sequence page lists of one layer.  Compressed pools per role:
    group quantization (codes, scale, zero), HQMQ (packed rows) and the role's secondary sets
    in ``secondary``."""

    def __init__(self, H, P, D, dtype, device, n_fp, n_comp, kspec, vspec, hqmq=None, layer_idx=0):
        # the page format: group quantization (kspec / vspec), HQMQ (hqmq) or full precision only
        self.kspec, self.vspec, self.hqmq = kspec, vspec, hqmq
        self.compressed = kspec is not None or hqmq is not None
        self.k_fp = torch.zeros((n_fp, H, P, D), dtype=dtype, device=device)
        self.v_fp = torch.zeros_like(self.k_fp)
        self.free_fp = list(range(n_fp - 1, 0, -1))  # page 0: scratch
        self.comp = None
        self.secondary = None
        self.free_comp: List[int] = []
        if kspec is not None:
            self.comp = {}
            for role, spec in (("k", kspec), ("v", vspec)):
                W = D * spec.bits // 32
                sshape = (n_comp, H, P // spec.group_size, D) if spec.per_channel else (n_comp, H, P, D // spec.group_size)
                self.comp[role] = (torch.zeros((n_comp, H, P, W), dtype=torch.int32, device=device),
                                   torch.zeros(sshape, dtype=torch.float16, device=device),
                                   torch.zeros(sshape, dtype=torch.float16, device=device))
        elif hqmq is not None:
            U = _ops.hqmq_units(D, hqmq.secondary_size, hqmq.radius_bits)
            self.comp = {role: (torch.zeros((n_comp, H, P, U), dtype=torch.int16, device=device),)
                         for role in ("k", "v")}
            # the sets of the contiguous cache's stream of this (layer, role): equal codes
            self.secondary = {role: hqmq_secondary(H, hqmq.secondary_size, hqmq.seed, layer_idx=layer_idx,
                                                   role=name, device=device)
                              for role, name in (("k", "key"), ("v", "value"))}
        if self.comp is not None:
            self.free_comp = list(range(n_comp - 1, 0, -1))
        self.seqs: Dict[int, _Seq] = {}
        # a digest of the layer's page format and of every append and free it has seen: layers
        # with equal histories hold identical page lists (their pools and free lists evolve
        # identically), so they share one set of device tables and one plan per step
        self.history = hash(("compressed", self.compressed))

    def comp_tensors(self):
        """The compressed pools of both roles, in the order of the attention op's arguments."""
        if self.comp is None:
            return (None,) * 6
        if self.secondary is not None:
            return (*self.comp["k"], self.secondary["k"], *self.comp["v"], self.secondary["v"])
        return (*self.comp["k"], *self.comp["v"])


def default_page_size(config: CompressionConfig) -> int:
    """The page size P a pool of ``config`` gets when none is asked for: 32 for HQMQ, 128 for the
    rest.  HQMQ pages keep the window's tokens plus the newest partial page (up to
    ``recent_window + P - 1`` tokens) in full precision, and its split kernel attends to those
    on the CUDA-core loop, so a small page is both fewer bytes and less time (H200, hqmq-3.79,
    B = 8: 67.9 vs 81.8 us at L = 4k, 182.4 vs 202.4 us at L = 32k for P = 32 vs 128); the
    other formats run their full-precision pages on the tensor cores and measure the same at
    every P, so they keep the fewer, larger pages.  (``StaticQuantizedCache`` keeps 128 for
    every format: it writes a prompt P tokens per row at a time.)"""
    return 32 if isinstance(config, HQMQConfig) else 128


class PagedKVCache:
    """Paged compressed KV cache for many sequences (continuous batching).

    Parameters
    ----------
    config : a :class:`~kvquant_ext.config.CompressionConfig` or preset name: ``fp16``, a
        group-quantization family (KIVI, KCVT, per-token INT, FlexGen) or HQMQ without Med3x
        outliers (``hqmq-3.79``, ``hqmq-3.79-paper``; pages are encoded as
        :func:`kvquant_ext.hqmq_encode` encodes them, with the contiguous cache's secondary sets).
        The config's ``skip_layers`` (negative entries count from the last layer) are kept in
        full-precision pages only.
    num_layers, num_kv_heads, head_dim : the model's cache shape.
    max_tokens : tokens of all live sequences together that the compressed pool holds
        (the full-precision pool holds each sequence's last partial page, plus staging pages
        for prompts).
    dtype, device : of the full-precision pages and the queries.
    page_size : P, a power of two >= 32, a multiple of the key group size (default:
        :func:`default_page_size`, 32 for HQMQ and 128 for the rest).
    max_seqs : live sequences at once.
    recent_window : W, a multiple of P: the most recent W to W + P - 1 tokens of every sequence
        stay in full precision (a page is compressed once W newer tokens follow it; 0: when it
        fills).  Counted in ``nbytes``.  Default: the config's ``recent_window`` rounded up to
        a multiple of P (pages hold whole P tokens, so at least the config's window stays
        full precision).
    check_finite : raise on NaN/Inf in appended tokens (one check per append).
    staging_pages : full-precision pages of each compressed layer, beyond the
        ``2 + recent_window / P`` of every sequence, that let one append take more than P tokens
        per sequence at once (default: between 8 and 64, from ``max_tokens``; 0 appends P tokens
        per sequence per round).
    """

    def __init__(self, config, *, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int,
                 dtype: torch.dtype = torch.float16, device="cpu", page_size: Optional[int] = None,
                 max_seqs: int = 256,
                 recent_window: Optional[int] = None, check_finite: bool = True,
                 staging_pages: Optional[int] = None):
        if isinstance(config, str):
            config = get_config(config)
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"argument 'config' must be a CompressionConfig or preset name, got {type(config).__name__}")
        if page_size is None:
            page_size = default_page_size(config)
        if recent_window is None and isinstance(page_size, int) and page_size > 0:
            recent_window = -(-config.recent_window // page_size) * page_size
        if isinstance(config, HQMQConfig) and config.outlier_factor is not None:
            raise NotImplementedError(f"PagedKVCache does not store the Med3x outliers of an HQMQConfig yet "
                                      f"(outlier_factor={config.outlier_factor}); HQMQ without them (hqmq-3.79) "
                                      "is supported")
        if not isinstance(config, (FP16Config, GroupQuantBase, HQMQConfig)):
            raise NotImplementedError(f"PagedKVCache does not support {type(config).__name__} yet; supported: "
                                      "fp16, the group-quantization presets (KIVI, KCVT, per-token INT, FlexGen) "
                                      "and HQMQ without Med3x outliers")
        for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("max_tokens", max_tokens),
                        ("max_seqs", max_seqs)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"argument '{name}' must be a positive int, got {v!r}")
        if head_dim not in HEAD_DIMS:
            raise ValueError(f"argument 'head_dim' must be {HEAD_DIMS_TEXT}, got {head_dim!r}")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 32 or page_size & (page_size - 1):
            raise ValueError(f"argument 'page_size' must be a power of two >= 32, got {page_size!r}")
        if (isinstance(recent_window, bool) or not isinstance(recent_window, int) or recent_window < 0
                or recent_window % page_size):
            raise ValueError(f"argument 'recent_window' must be a non-negative multiple of page_size={page_size}, "
                             f"got {recent_window!r}")
        if dtype not in _ops.FLOAT_DTYPES:
            raise TypeError(f"argument 'dtype' must be {DTYPES_TEXT}, got {dtype}")
        if staging_pages is not None and (isinstance(staging_pages, bool) or not isinstance(staging_pages, int)
                                          or staging_pages < 0):
            raise ValueError(f"argument 'staging_pages' must be an int >= 0, got {staging_pages!r}")
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.config, self.dtype, self.device = config, dtype, device
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.page_size, self.max_seqs, self.check_finite = page_size, max_seqs, check_finite
        self.recent_window = recent_window
        P = page_size
        self.kspec = self.vspec = None
        self.hqmq = config if isinstance(config, HQMQConfig) else None
        if isinstance(config, GroupQuantBase):
            self.kspec = _paged_spec(config.key_spec(), P, head_dim)
            self.vspec = _paged_spec(config.value_spec(), P, head_dim)
        self.compressed = self.kspec is not None or self.hqmq is not None
        if staging_pages is None:
            staging_pages = max(8, min(64, -(-max_tokens // P)))
        self.staging_pages = staging_pages if self.compressed else 0
        self.layers = []
        for i in range(num_layers):
            if self.compressed and not config.skips_layer(i, num_layers):
                n_comp = 1 + -(-max_tokens // P)
                n_fp = 1 + (2 + recent_window // P) * max_seqs + self.staging_pages
                fmt = (self.kspec, self.vspec, self.hqmq)
            else:  # fp16, or a layer of skip_layers: every token in full-precision pages
                n_comp, n_fp, fmt = 0, 1 + -(-max_tokens // P) + max_seqs, (None, None, None)
            self.layers.append(_Layer(num_kv_heads, P, head_dim, dtype, self.device, n_fp, n_comp, *fmt, layer_idx=i))
        self._slots = None
        self._table_cache: Dict[tuple, tuple] = {}
        self._next_id = 0
        self._live: Dict[int, None] = {}

    # ------------------------------------------------------------------ sequences
    def add_sequence(self) -> int:
        """A new empty sequence; returns its id."""
        if len(self._live) >= self.max_seqs:
            raise RuntimeError(f"PagedKVCache holds max_seqs={self.max_seqs} live sequences; free one first")
        sid = self._next_id
        self._next_id += 1
        self._live[sid] = None
        for layer in self.layers:
            layer.seqs[sid] = _Seq()
        return sid

    def free(self, seq_id: int) -> None:
        """Return the sequence's pages to the pools (they are reused by later sequences)."""
        self._check_ids([seq_id])
        for layer in self.layers:
            layer.history = hash((layer.history, "free", seq_id))
            s = layer.seqs.pop(seq_id)
            layer.free_comp.extend(reversed(s.comp_pages))
            layer.free_fp.extend(reversed(s.fp_pages))
        del self._live[seq_id]

    def seq_len(self, seq_id: int, layer_idx: int = 0) -> int:
        self._check_ids([seq_id])
        return self._layer(layer_idx).seqs[seq_id].length

    def _check_ids(self, seq_ids) -> None:
        for s in seq_ids:
            if s not in self._live:
                raise KeyError(f"argument 'seq_ids': {s!r} is not a live sequence of this cache")
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"argument 'seq_ids' lists a sequence twice: {list(seq_ids)}")

    def _layer(self, layer_idx: int) -> _Layer:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"argument 'layer_idx' must be in [0, {self.num_layers}), got {layer_idx!r}")
        return self.layers[layer_idx]

    def _check_dtype_device(self, name: str, x: torch.Tensor) -> None:
        if x.dtype != self.dtype:
            raise TypeError(f"argument '{name}' must have the cache dtype {self.dtype}, got {x.dtype}")
        if x.device != self.device:
            raise ValueError(f"argument '{name}' is on {x.device}, but this cache is on {self.device}")

    # ------------------------------------------------------------------ append
    def append(self, layer_idx: int, seq_ids: Sequence[int], k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``k, v [n, H, T, D]``: T new tokens to each of the n listed sequences."""
        layer = self._layer(layer_idx)
        seq_ids = list(seq_ids)
        self._check_ids(seq_ids)
        H, D = self.num_kv_heads, self.head_dim
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise TypeError(f"argument '{name}' must be a torch.Tensor, got {type(x).__name__}")
            if x.dim() != 4 or x.shape[0] != len(seq_ids) or x.shape[1] != H or x.shape[3] != D:
                raise ValueError(f"argument '{name}' must be [n={len(seq_ids)}, H={H}, T, D={D}], got {tuple(x.shape)}")
            self._check_dtype_device(name, x)
        if v.shape != k.shape:
            raise ValueError(f"arguments 'k' {tuple(k.shape)} and 'v' {tuple(v.shape)} must have the same shape")
        T = k.shape[2]
        if T == 0 or not seq_ids:
            return
        if self.check_finite:
            self._check_tokens(layer, k, v)
        self._reserve(layer, seq_ids, T)
        P = self.page_size
        # rounds: each takes at most `step` tokens per sequence, so that its full-precision pages fit
        step = T if not layer.compressed else max(P, P * (self.staging_pages // len(seq_ids)))
        for a in range(0, T, step):
            self._append_round(layer, seq_ids, k[:, :, a:a + step], v[:, :, a:a + step])
        layer.history = hash((layer.history, tuple(seq_ids), T))

    def _check_tokens(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor) -> None:
        """Raise if ``k`` or ``v`` holds NaN/Inf, or (compressed layers) magnitudes the pages' fp16
        scales cannot represent.  Synchronises with the device once."""
        # compressed pages hold fp16 scales / zero points (group quantization: |x| <= 65504)
        # or packed radius scales (HQMQ: 4-element chunk norms <= 61440); one reduction, one sync
        mag = (lambda x: chunk_norms(x).amax()) if layer.hqmq is not None else max_abs_of
        bound = MAX_SCALE if layer.hqmq is not None else 65504.0
        m = float(torch.maximum(mag(k), mag(v)))
        if not math.isfinite(m):
            raise ValueError("argument 'k' or 'v' contains NaN or Inf (cache check_finite=True)")
        if layer.compressed and m > bound:
            name = "k" if float(mag(k)) > bound else "v"
            what = "4-element chunks with norm" if layer.hqmq is not None else "entries with magnitude"
            raise ValueError(f"argument '{name}' has {what} above {bound:g}, which the compressed pages' "
                             "scales cannot represent (cache check_finite=True)")

    def _comp_pages_at(self, length: int) -> int:
        """Compressed pages of a sequence of `length` tokens: the whole pages older than the window."""
        return max(0, length - self.recent_window) // self.page_size

    def _reserve(self, layer: _Layer, seq_ids, T: int) -> None:
        """Raise (changing nothing) if the pools cannot take T more tokens of each sequence."""
        P = self.page_size
        if not layer.compressed:
            need = sum(-(-(layer.seqs[s].length + T) // P) - len(layer.seqs[s].fp_pages) for s in seq_ids)
            if need > len(layer.free_fp):
                raise RuntimeError(f"PagedKVCache is full: {need} more pages needed, {len(layer.free_fp)} free")
            return
        need = sum(self._comp_pages_at(layer.seqs[s].length + T) - len(layer.seqs[s].comp_pages) for s in seq_ids)
        if need > len(layer.free_comp):
            raise RuntimeError(f"PagedKVCache is full: {need} more compressed pages needed, "
                               f"{len(layer.free_comp)} free (max_tokens too small)")

    def _append_round(self, layer: _Layer, seq_ids, k, v) -> None:
        P, n, T = self.page_size, len(seq_ids), k.shape[2]
        slots, src, dst = [], [], []
        for s in seq_ids:
            st = layer.seqs[s]
            end = st.length + T
            while len(st.comp_pages) * P + len(st.fp_pages) * P < end:  # full-precision pages for the new tokens
                st.fp_pages.append(layer.free_fp.pop())
                st.row = None
            base = len(st.comp_pages) * P
            for t in range(st.length, end):
                slots.append(st.fp_pages[(t - base) // P] * P + (t - base) % P)
        # pages that are full after this round are compressed into new pages
        for s in seq_ids:
            st = layer.seqs[s]
            end = st.length + T
            nfull = self._comp_pages_at(end) - len(st.comp_pages)
            if layer.compressed and nfull > 0:
                for j in range(nfull):
                    src.append(st.fp_pages[j])
                    dst.append(layer.free_comp.pop())
        dev = self.device
        kt = k.permute(0, 2, 1, 3).reshape(n * T, self.num_kv_heads, self.head_dim)
        vt = v.permute(0, 2, 1, 3).reshape(n * T, self.num_kv_heads, self.head_dim)
        slot_t = torch.tensor(slots, dtype=torch.int64).to(dev, non_blocking=True)
        kw = {}
        if src:
            kw = dict(compress_src=torch.tensor(src, dtype=torch.int64).to(dev, non_blocking=True),
                      compress_dst=torch.tensor(dst, dtype=torch.int64).to(dev, non_blocking=True))
        self._write(layer, kt, vt, slot_t, kw.get("compress_src"), kw.get("compress_dst"))
        i = 0
        for s in seq_ids:
            st = layer.seqs[s]
            st.length += T
            nfull = self._comp_pages_at(st.length) - len(st.comp_pages)
            if layer.compressed and nfull > 0:
                layer.free_fp.extend(reversed(st.fp_pages[:nfull]))
                st.fp_pages = st.fp_pages[nfull:]
                st.comp_pages.extend(dst[i:i + nfull])
                st.row = None
                i += nfull

    def _write(self, layer: _Layer, kt: torch.Tensor, vt: torch.Tensor, slots: torch.Tensor,
               src: Optional[torch.Tensor] = None, dst: Optional[torch.Tensor] = None) -> None:
        """Tokens ``kt, vt [N, H, D]`` into the full-precision slots ``slots`` (int64 ``[N]``), then
        the full-precision pages ``src`` compressed into the pages ``dst`` (int64 ``[M]``, or None).
        Device launches only: traceable by torch.compile."""
        if layer.hqmq is not None:
            _ops.paged_append(layer.k_fp, layer.v_fp, kt, vt, slots)
            if src is not None:
                self._encode_pages(layer, src, dst)
            return
        kw = {} if src is None else dict(compress_src=src, compress_dst=dst)
        ks, vs = layer.kspec, layer.vspec
        _ops.paged_append(layer.k_fp, layer.v_fp, kt, vt, slots, *layer.comp_tensors(), **kw,
                          bits=ks.bits if ks else 2, k_per_channel=ks.per_channel if ks else True,
                          v_per_channel=vs.per_channel if vs else False)

    def _encode_tokens(self, layer: _Layer, kt: torch.Tensor, vt: torch.Tensor, comp_slots: torch.Tensor) -> None:
        """HQMQ: tokens ``kt, vt [N, H, D]`` encoded straight into their slots of the compressed
        pools (``comp_slots`` int64 ``[N]``: page · P + position; device launches only).  HQMQ
        codes and radius scales are per token, so a page written token by token holds the codes
        :meth:`_encode_pages` gives the whole page."""
        page, pos = comp_slots // self.page_size, comp_slots % self.page_size
        for role, x in (("k", kt), ("v", vt)):
            codes, = layer.comp[role]
            c, _ = _ops.hqmq_encode(x.transpose(0, 1).unsqueeze(0).contiguous(), layer.secondary[role],
                                    layer.hqmq.radius_bits, check_finite=False)  # [1, H, N, U]
            codes[page, :, pos] = c[0].transpose(0, 1)

    def _encode_pages(self, layer: _Layer, src: torch.Tensor, dst: torch.Tensor) -> None:
        """HQMQ: full-precision pages ``src`` (each one ``[1, H, P, D]`` block) encoded into the
        compressed pages ``dst`` (int64 device tensors; device launches only)."""
        for role, fp in (("k", layer.k_fp), ("v", layer.v_fp)):
            codes, = layer.comp[role]
            c, _ = _ops.hqmq_encode(fp.index_select(0, src), layer.secondary[role], layer.hqmq.radius_bits,
                                    check_finite=False)
            codes.index_copy_(0, dst, c)

    # ------------------------------------------------------------------ attention
    def batch_tables(self, layer_idx: int, seq_ids: Sequence[int]):
        """Device tensors of the listed sequences: ``(block_table [n, max_pages], seq_lens [n],
        comp_lens [n])``, int32 (the engine-facing ops' inputs)."""
        return self._tables(self._layer(layer_idx), list(seq_ids))[:3]

    def _tables(self, layer: _Layer, seq_ids: List[int]):
        """(block_table, seq_lens, comp_lens, work) of a batch.  Built once per layer history and
        batch: in a decode step every layer, once appended, has the history of the first one, so
        the tables and the plan are built once per step and shared by all layers."""
        key = (layer.history, tuple(seq_ids))
        hit = self._table_cache.get(key)
        if hit is not None:
            return hit
        self._check_ids(seq_ids)
        seqs = [layer.seqs[s] for s in seq_ids]
        n, P = len(seqs), self.page_size
        for st in seqs:
            if st.row is None:
                st.row = torch.tensor(st.comp_pages + st.fp_pages or [0], dtype=torch.int32)
        bt = torch.nn.utils.rnn.pad_sequence([st.row for st in seqs], batch_first=True).to(self.device)
        lc = torch.tensor([st.length for st in seqs] + [len(st.comp_pages) * P for st in seqs],
                          dtype=torch.int32).to(self.device)
        lens, comp = lc[:n], lc[n:]
        work = _ops.paged_decode_plan(lens, comp, self.default_max_items(n))
        if len(self._table_cache) >= 16:
            self._table_cache.clear()
        self._table_cache[key] = (bt, lens, comp, work)
        return bt, lens, comp, work

    def default_max_items(self, num_seqs: int) -> int:
        """A work-list capacity that fills the device with about one wave of split CTAs per kind
        of token (compressed, full precision): the group-quantized and fp16 split kernels keep 3
        CTAs per SM resident, the HQMQ one (12 warps sharing the codebooks) one, so HQMQ pages
        take fewer, longer items (a CTA's fixed cost -- codebooks, pipeline fill -- is paid per
        item)."""
        if self._slots is None:
            sms = 88
            if self.device.type == "cuda":
                sms = torch.cuda.get_device_properties(self.device).multi_processor_count
            self._slots = sms if self.hqmq is not None else 3 * sms
        if self.hqmq is not None:
            return min(65535, 2 * num_seqs + 2 * max(1, self._slots // self.num_kv_heads))
        return min(65535, 2 * num_seqs + 2 + 2 * -(-self._slots // self.num_kv_heads))

    def decode_attention(self, q: torch.Tensor, layer_idx: int, seq_ids: Sequence[int],
                         scale: Optional[float] = None, *, return_lse: bool = False):
        """Attention of one query token per listed sequence: ``q [n, Hq, D]`` -> ``[n, Hq, D]``
        (and the log-sum-exp ``[n, Hq]`` with ``return_lse``)."""
        layer = self._layer(layer_idx)
        seq_ids = list(seq_ids)
        if not isinstance(q, torch.Tensor) or q.dim() != 3 or q.shape[0] != len(seq_ids) or q.shape[2] != self.head_dim:
            raise ValueError(f"argument 'q' must be [n={len(seq_ids)}, Hq, D={self.head_dim}], got "
                             f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
        self._check_dtype_device("q", q)
        if q.shape[1] % self.num_kv_heads:
            raise ValueError(f"argument 'q' has {q.shape[1]} heads, not a multiple of num_kv_heads={self.num_kv_heads}")
        bt, lens, comp, work = self._tables(layer, seq_ids)
        return self.decode_attention_from_tables(layer_idx, q, bt, lens, comp, work, scale, return_lse=return_lse)

    def decode_attention_from_tables(self, layer_idx: int, q: torch.Tensor, block_table: torch.Tensor,
                                     seq_lens: torch.Tensor, comp_lens: torch.Tensor, work: torch.Tensor,
                                     scale: Optional[float] = None, *, return_lse: bool = False):
        """:meth:`decode_attention` over device tables the caller built (``block_table``, ``seq_lens``,
        ``comp_lens`` as :meth:`batch_tables` returns them, ``work`` from
        :func:`kvquant_ext.ops.paged_decode_plan`), in passes of at most 8 query heads per KV head.
        No host work and no checks beyond the ops': traceable by torch.compile."""
        if scale is None:
            scale = self.head_dim ** -0.5
        g, H, n = q.shape[1] // self.num_kv_heads, self.num_kv_heads, q.shape[0]

        def run(qs):
            return self.attention_op(layer_idx, qs, block_table, seq_lens, comp_lens, work, float(scale))

        if g <= 8:  # one call (the tensor cores take up to 8 query heads per KV head)
            out, lse = run(q)
            return (out, lse) if return_lse else out
        outs, lses = [], []
        for j in range(0, g, 8):  # passes of <= 8 query heads
            m = min(8, g - j)
            o, l = run(q.view(n, H, g, self.head_dim)[:, :, j:j + m].reshape(n, H * m, -1))
            outs.append(o.view(n, H, m, -1))
            lses.append(l.view(n, H, m))
        out = torch.cat(outs, dim=2).reshape(q.shape)
        if not return_lse:
            return out
        return out, torch.cat(lses, dim=2).reshape(q.shape[:2])

    def attention_op(self, layer_idx: int, q, block_table, seq_lens, comp_lens, work, scale: float):
        """The raw attention op of this cache's page format over layer ``layer_idx``'s pools
        (no checks beyond the op's; at most 8 query heads per KV head): ``(out, lse)``."""
        layer = self.layers[layer_idx]
        if layer.hqmq is not None:
            return _ops.paged_decode_attention_hqmq(q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), block_table,
                                                    seq_lens, comp_lens, work, layer.hqmq.radius_bits, scale)
        ks, vs = layer.kspec, layer.vspec
        return _ops.paged_decode_attention(q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), block_table, seq_lens,
                                           comp_lens, work, ks.bits if ks else 2, ks.per_channel if ks else True,
                                           vs.per_channel if vs else False, scale)

    # ------------------------------------------------------------------ inspection
    def dequantize(self, layer_idx: int, seq_id: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` of one sequence as the cache holds them, ``[1, H, T, D]`` each."""
        layer = self._layer(layer_idx)
        self._check_ids([seq_id])
        st = layer.seqs[seq_id]
        P, H, D = self.page_size, self.num_kv_heads, self.head_dim
        out = []
        for role, fp in (("k", layer.k_fp), ("v", layer.v_fp)):
            parts = []
            if st.comp_pages:
                idx = torch.tensor(st.comp_pages, dtype=torch.int64, device=self.device)
                parts.append(self._dequantize_pages(layer, role, idx))  # [pages, H, P, D]
            nfp = st.length - len(st.comp_pages) * P
            if nfp > 0:
                idx = torch.tensor(st.fp_pages, dtype=torch.int64, device=self.device)
                parts.append(fp[idx])
            if not parts:
                out.append(torch.empty((1, H, 0, D), dtype=self.dtype, device=self.device))
                continue
            x = torch.cat(parts, dim=0).permute(1, 0, 2, 3).reshape(1, H, -1, D)[:, :, :st.length]
            out.append(x.contiguous())
        return out[0], out[1]

    def _dequantize_pages(self, layer: _Layer, role: str, idx: torch.Tensor) -> torch.Tensor:
        """The compressed pages ``idx`` (int64 ``[n]``, device) of role ``"k"``/``"v"`` decoded from
        their codes: ``[n, H, P, D]`` in the cache's dtype (device launches only)."""
        if layer.hqmq is not None:
            codes, = layer.comp[role]
            none = torch.empty((0, 4), dtype=torch.int32, device=idx.device)
            return _ops.hqmq_decode(codes[idx], layer.secondary[role], none, layer.hqmq.radius_bits,
                                    self.head_dim, self.dtype)
        codes, scale, zero = layer.comp[role]
        spec = layer.kspec if role == "k" else layer.vspec
        return _ops.dequantize(codes[idx], scale[idx], zero[idx], spec.bits, spec.per_channel, self.dtype)

    def _page_bytes(self, layer: _Layer) -> Tuple[int, int]:
        """Bytes of one compressed page (both roles) and of one full-precision token (both roles)."""
        fp_tok = 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()
        if layer.comp is None:
            return 0, fp_tok
        cp = sum(t[0].numel() * t.element_size() for role in ("k", "v") for t in layer.comp[role])
        return cp, fp_tok

    @staticmethod
    def _secondary_bytes(layer: _Layer) -> int:
        return 0 if layer.secondary is None else sum(t.numel() * t.element_size() for t in layer.secondary.values())

    @property
    def nbytes(self) -> int:
        """Bytes stored for the live tokens of every layer: compressed pages (codes, scales, zero
        points), the full-precision tokens and, in a layer holding HQMQ pages, its secondary sets."""
        P = self.page_size
        total = 0
        for layer in self.layers:
            cp, fp_tok = self._page_bytes(layer)
            pages = 0
            for st in layer.seqs.values():
                pages += len(st.comp_pages)
                total += len(st.comp_pages) * cp + (st.length - len(st.comp_pages) * P) * fp_tok
            total += self._secondary_bytes(layer) if pages else 0
        return total

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated for the pools (and HQMQ secondary sets) of every layer."""
        total = 0
        for layer in self.layers:
            pools = [t for role in ("k", "v") for t in (layer.comp[role] if layer.comp else ())]
            for t in (layer.k_fp, layer.v_fp, *pools):
                total += t.numel() * t.element_size()
            total += self._secondary_bytes(layer)
        return total
