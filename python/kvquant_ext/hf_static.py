"""``kvq.hf.StaticQuantizedCache``: a compileable transformers cache on the paged pools of
:class:`kvquant_ext.PagedKVCache` (transformers' ``StaticCache`` for compressed presets).

>>> cache = kvq.hf.StaticQuantizedCache("kivi-2", model.config, max_batch_size=4, max_cache_len=4096)
>>> out = model.generate(**inputs, past_key_values=cache)   # decode compiled on CUDA

Static page layout
------------------
Every layer owns one ``PagedKVCache`` layer's pools, and every batch row ``b`` a fixed set of
their pages: compressed pages ``1 + b J .. b J + J`` (``J = ceil(max_cache_len / P)``; logical
page ``j`` of row ``b`` is compressed page ``1 + b J + j``) and a ring of ``R`` full-precision
pages ``1 + b R .. b R + R`` (logical page ``j`` is ring page ``j mod R``; ``R = W/P + 2`` for
a compressed layer, which holds the recent window, the page being filled and the page being
compressed; ``R = J + 1`` for a full-precision layer, whose ring never wraps).  Page 0 of both
pools is scratch.  So the slot of a row's next token, the page pair to compress when a page
leaves the window, the compressed length and the block table (compressed pages first, then the
full-precision ones) are tensor arithmetic on the row's length, a device tensor.

A decode step (one token per row) therefore runs device launches only: ``paged_append`` with
one slot and one (src, dst) page pair per row (scratch page 0 -> scratch page 0 for rows with
nothing to compress, which ``paged_append`` skips), the lengths advanced in place,
``paged_decode_plan`` and the paged attention op.  HQMQ codes are per token, so an HQMQ layer encodes each token into its slot of
the compressed pages as it writes it (B tokens per step, no page pairs): a page that leaves the
window is already encoded, with the codes the whole page would get.  The per-step state lives
in tensors mutated in place (marked as static addresses for CUDA graphs); the Python state
(batch size, flags) is fixed after the prefill, so a compiled step neither breaks the graph nor
recompiles from one step to the next.

Prefill (the first forward, eager): ``update`` returns the fresh keys/values and the ``"kvq"``
attention function reads the real tokens of every row off the attention mask it receives
(left padding is dropped: it costs neither memory nor decode compute), stores them page by page
by the same rule as ``PagedKVCache.append`` (so the pages hold the same codes), and attends on
the fresh tokens with SDPA.  Decode steps return the layer's persistent pool tensors, which
carry the layer as an attribute set once at allocation: the ``"kvq"`` attention function finds
the layer through it (torch.compile traces that lookup through the tensor's source) and attends
over each row's own tokens, ignoring the model's mask.  Several new tokens after the prefill
(chunked prefill, draft verification, a follow-up prompt; eager only) attend to the stored pages
read page by page (compressed pages decoded chunk by chunk, never the whole past at once) and to
each other in full precision, merged by an online softmax, and are then stored P at a time by
the decode step's rule.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from . import _ops
from ._hf_common import crop_count as _crop_count, last_query_mask, layer_kinds
from .attention import OnlineSoftmax
from .config import CompressionConfig, FP16Config, GroupQuantBase, HQMQConfig, get_config
from .paged import PagedKVCache

__all__ = ["StaticQuantizedCache", "StaticQuantizedLayer"]

STATIC_ATTR = "_kvq_static"  # attribute naming the StaticQuantizedLayer on its tensors


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"argument '{name}' must be a positive int, got {v!r}")
    return v


class _Layout:
    """The static page layout of one kind of layer (compressed or full precision): device
    tables indexed by batch row."""

    def __init__(self, n_fp: int, n_comp: int, rows: int, pages: int, device):
        self.ring = (n_fp - 1) // rows            # full-precision pages per row
        self.comp = max(0, n_comp - 1) // rows    # compressed pages per row (0: none)
        r = torch.arange(rows, dtype=torch.int64, device=device)
        j = torch.arange(pages, dtype=torch.int64, device=device)
        self.fp_base = 1 + r * self.ring
        self.comp_base = 1 + r * self.comp
        self.fp_table = (self.fp_base[:, None] + j % self.ring).to(torch.int32)
        self.comp_table = (self.comp_base[:, None] + j).to(torch.int32)
        self.page_idx = j.to(torch.int32)
        self.zeros = torch.zeros(rows, dtype=torch.int32, device=device)

    def tensors(self):
        return (self.fp_base, self.comp_base, self.fp_table, self.comp_table, self.page_idx, self.zeros)


class StaticQuantizedLayer(CacheLayerMixin):
    """One model layer of a :class:`StaticQuantizedCache`: the layer's pools in the parent's
    ``PagedKVCache``, the per-row lengths ``lens`` (int32 ``[max_batch_size]``) and ``seen``
    (int64 0-dim: tokens of the padded timeline the model has run, which
    :meth:`get_seq_length` returns, as ``StaticLayer`` returns its ``cumulative_length``)."""

    is_compileable = True
    is_croppable = True
    is_sliding = False
    supports_early_init = True

    def __init__(self, parent: "StaticQuantizedCache", layer_idx: int):
        super().__init__()
        self.parent, self.layer_idx = parent, layer_idx
        self.pages = None      # the PagedKVCache layer (pools) once allocated
        self.layout: Optional[_Layout] = None
        self.lens: Optional[torch.Tensor] = None
        self.seen: Optional[torch.Tensor] = None
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None  # new tokens the attention stores
        self.prefilled = False  # the prompt's real tokens are in the pages
        self.batch = 0          # rows of the current sequences (fixed by the prefill)
        self.max_items = 0

    # -- allocation --------------------------------------------------------------------
    def _bind(self, pages, layout: _Layout, device) -> None:
        self.pages, self.layout = pages, layout
        self.lens = torch.zeros(self.parent.max_batch_size, dtype=torch.int32, device=device)
        self.seen = torch.zeros((), dtype=torch.int64, device=device)
        setattr(pages.k_fp, STATIC_ATTR, self)
        setattr(pages.v_fp, STATIC_ATTR, self)
        self.device = device
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        p = self.parent
        if p.pool is None and key_states.dim() == 4 and 0 < key_states.shape[1] < p.num_kv_heads and \
                p.num_kv_heads % key_states.shape[1] == 0:
            # a tensor-parallel rank: its attention holds an equal share of the KV heads
            p.num_kv_heads = int(key_states.shape[1])
        p._allocate(key_states.dtype, key_states.device)

    # -- update ------------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        p = self.parent
        if self.pending is not None:
            raise RuntimeError("StaticQuantizedCache needs the model's \"kvq\" attention (attn_implementation="
                               "'kvq' or kvquant_ext.hf.enable(model)): the new tokens of layer "
                               f"{self.layer_idx} never reached it, so they are not stored")
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        p._check_states(key_states, value_states)
        B, _, T, _ = key_states.shape
        if not self.prefilled:
            if B > p.max_batch_size:
                raise ValueError(f"argument 'key_states' holds {B} rows, more than the cache's "
                                 f"max_batch_size={p.max_batch_size}")
            if T > p.max_cache_len:
                raise ValueError(f"argument 'key_states' holds {T} tokens, more than the cache's "
                                 f"max_cache_len={p.max_cache_len}")
            self.pending = (key_states, value_states)
            self.seen.fill_(T)
            setattr(key_states, STATIC_ATTR, self)
            return key_states, value_states
        if B != self.batch:
            raise ValueError(f"argument 'key_states' holds {B} rows, but the cache holds {self.batch} "
                             "sequences (call reset() before another batch)")
        if T != 1 and torch.compiler.is_compiling():
            raise NotImplementedError(f"a compiled StaticQuantizedCache step takes one new token per row, got {T} "
                                      "(argument 'key_states'); run several-token steps eagerly")
        if not torch.compiler.is_compiling():
            # eager steps check their input (one read-back); compiled steps are sync-free
            if int(self.seen) + T > p.max_cache_len:
                raise ValueError(f"argument 'key_states': the sequences would exceed the cache's "
                                 f"max_cache_len={p.max_cache_len}")
            if p.pool.check_finite:
                p.pool._check_tokens(self.pages, key_states, value_states)
        if T != 1:  # appended by the attention function, which reads their padding off its mask
            self.pending = (key_states, value_states)
            setattr(key_states, STATIC_ATTR, self)
            return key_states, value_states
        self._append_tokens(key_states, value_states)
        self.seen.add_(1)
        return self.pages.k_fp, self.pages.v_fp

    def _append_tokens(self, k: torch.Tensor, v: torch.Tensor, real: Optional[torch.Tensor] = None) -> None:
        """Up to P new tokens per row (``k, v [B, H, t, D]``, t <= P), each row's after its own
        length; device ops only, fixed shapes.  A token where ``real`` (bool ``[B, t]``) is False,
        or past max_cache_len, is not stored (slot -1) and does not count.  Group-quantized pages
        are compressed when they leave the recent window: with t <= P at most one page per row
        does, so one (src, dst) pair per row suffices (scratch page 0 -> 0, skipped, for the rows
        with none), and the ring (W/P + 2 pages) still holds that page, since the tokens land on
        the row's current page and the next one.  HQMQ tokens are encoded as they are written."""
        p, lay = self.parent, self.layout
        B, H, t, D = k.shape
        P, W = p.page_size, p.recent_window
        lens = self.lens[:B].to(torch.int64)
        keep = torch.ones(B, t, dtype=torch.bool, device=k.device) if real is None else real
        pos = lens[:, None] + keep.cumsum(1) - 1         # each kept token's position in its row
        keep = keep & (pos < p.max_cache_len)
        slot = torch.where(keep, (lay.fp_base[:B, None] + (pos // P) % lay.ring) * P + pos % P, -1)
        n = keep.sum(1)
        kt, vt = k.transpose(1, 2).reshape(B * t, H, D), v.transpose(1, 2).reshape(B * t, H, D)
        src = dst = None
        if self.pages.hqmq is not None:
            # per-token codes: each token is encoded into its compressed slot as it is written (a
            # scratch slot for the tokens not stored), so no page is encoded when it leaves the
            # window and a step encodes B tokens, not B pages
            cslot = torch.where(keep, (lay.comp_base[:B, None] + pos // P) * P + pos % P, 0)
            p.pool._encode_tokens(self.pages, kt, vt, cslot.reshape(B * t))
        elif self.pages.compressed:
            old = (lens - W).clamp(min=0) // P            # compressed pages before the tokens
            due = (lens + n - W).clamp(min=0) // P > old
            src = torch.where(due, lay.fp_base[:B] + old % lay.ring, 0)
            dst = torch.where(due, lay.comp_base[:B] + old, 0)
        p.pool._write(self.pages, kt, vt, slot.reshape(B * t), src, dst)
        self.lens[:B].add_(n.to(torch.int32))

    # -- attention (called by the "kvq" attention function) --------------------------------
    def attention(self, module, query, key, value, attention_mask, *, dropout=0.0, scaling=None,
                  is_causal=None, **kwargs):
        if not self.prefilled:
            return self._prefill_attention(module, query, key, value, attention_mask, dropout=dropout,
                                           scaling=scaling, is_causal=is_causal, **kwargs)
        if kwargs.get("softcap") is not None:
            raise NotImplementedError("kvq paged decode attention does not support logit softcapping")
        if self.pending is not None:
            return self._steps_attention(query, attention_mask, scaling), None
        return self._decode(query[:, :, 0].contiguous(), scaling)[:, None], None

    def _decode(self, q: torch.Tensor, scaling) -> torch.Tensor:
        """Attention of one query per row ``q [B, Hq, D]`` over the row's tokens."""
        p, lay, B = self.parent, self.layout, self.batch
        lens = self.lens[:B]
        if self.pages.compressed:
            c = (lens - p.recent_window).clamp(min=0) // p.page_size
            comp = c * p.page_size
            table = torch.where(lay.page_idx < c[:, None], lay.comp_table[:B], lay.fp_table[:B])
        else:
            comp, table = lay.zeros[:B], lay.fp_table[:B]
        work = _ops.paged_decode_plan(lens, comp, self.max_items)
        return p.pool.decode_attention_from_tables(self.layer_idx, q, table, lens, comp, work, scaling)

    def _steps_attention(self, query, attention_mask, scaling) -> torch.Tensor:
        """Several new tokens after the prefill (eager), with the results of as many decode steps:
        the tokens are stored P at a time by the decode step's rule (so pages compress when they
        would), and query ``i`` attends to what decode step ``i`` would see — its row's tokens up
        to its own, a page in its compressed form once the page has left the window at that step
        and in full precision before.  Compressed pages are decoded from their codes a chunk of
        whole pages at a time; full-precision tokens come from the row's ring (read before the new
        tokens overwrite it) and from the new tokens themselves; an fp32 online softmax merges
        the chunks.  A token whose own mask column is masked is padding: it is not stored and no
        query sees it.  Returns ``[B, T, Hq, D]``."""
        k, v = self.pending
        self.pending = None
        p, lay = self.parent, self.layout
        B, Hq, T, D = query.shape
        P, W, H, dev = p.page_size, p.recent_window, k.shape[1], query.device
        keep = torch.ones(B, T, dtype=torch.bool, device=dev)
        if attention_mask is not None:
            m = attention_mask[:, 0] if attention_mask.dim() == 4 else attention_mask  # [B, T, kv] or [B, kv]
            if m.dtype != torch.bool:
                m = m > torch.finfo(m.dtype).min / 2
            start = int(self.seen)
            cols = torch.arange(start, start + T, device=m.device)
            keep = (m[:, torch.arange(T, device=m.device), cols] if m.dim() == 3 else m[:, cols]).to(dev)
        lens = self.lens[:B].to(torch.int64)
        compressed = self.pages.compressed
        if compressed:  # the ring's pages, before the new tokens overwrite them
            comp0 = (lens - W).clamp(min=0) // P
            ring_pages = comp0[:, None] + torch.arange(-(-int((lens - comp0 * P).max()) // P), device=dev)
            ring = lay.fp_base[:B, None] + ring_pages % lay.ring
            ring_kv = [self._gather(pool, ring) for pool in (self.pages.k_fp, self.pages.v_fp)]
            ring_pos = (ring_pages[:, :, None] * P + torch.arange(P, device=dev)).reshape(B, -1)
        for a in range(0, T, P):
            self._append_tokens(k[:, :, a:a + P].contiguous(), v[:, :, a:a + P].contiguous(),
                                keep[:, a:a + P].contiguous())
        self.seen.add_(T)
        # what decode step i sees: the row's first qlen[:, i] tokens, its first qcomp[:, i] pages compressed
        qlen = lens[:, None] + keep.cumsum(1)
        qcomp = (qlen - W).clamp(min=0) // P if compressed else torch.zeros_like(qlen)
        acc = OnlineSoftmax(query, H, D ** -0.5 if scaling is None else scaling)
        chunk = max(P, (1 << 27) // (B * Hq * T) // P * P)  # keys per merge: ~2^27 fp32 scores, >= a page

        def attend(K, V, pos, valid, as_compressed):  # K, V [B, H, n, D]; pos, valid [B, n]
            for a in range(0, pos.shape[1], chunk):
                ps, ok = pos[:, a:a + chunk], valid[:, a:a + chunk]
                j = (ps // P)[:, None, :]
                side = j < qcomp[:, :, None] if as_compressed else j >= qcomp[:, :, None]
                allowed = ok[:, None, :] & (ps[:, None, :] < qlen[:, :, None]) & side
                # slots past a row's tokens may hold anything: their scores are masked, but a
                # non-finite value would still reach the weighted sum
                acc.add(K[:, :, a:a + chunk], V[:, :, a:a + chunk].masked_fill(~ok[:, None, :, None], 0), allowed)

        longest, most_comp = (int(x) for x in torch.stack([qlen[:, -1].max(), qcomp[:, -1].max()]).tolist())
        pages = -(-longest // P)
        step = chunk // P
        for j0 in range(0, most_comp if compressed else pages, step):
            jj = torch.arange(j0, min(pages, j0 + step), device=dev)
            pos = (jj[:, None] * P + torch.arange(P, device=dev)).reshape(1, -1).expand(B, -1)
            if compressed:  # the pages compressed by the end of the step
                K, V = (self._decoded(role, jj) for role in ("k", "v"))
                attend(K, V, pos, (pos // P) < qcomp[:, -1:], True)
            else:  # a full-precision layer's ring never wraps: every token is still in it
                idx = lay.fp_table[:B, j0:j0 + jj.numel()].long()
                attend(self._gather(self.pages.k_fp, idx), self._gather(self.pages.v_fp, idx), pos,
                       pos < qlen[:, -1:], False)
        if compressed:
            attend(*ring_kv, ring_pos, ring_pos < lens[:, None], False)
            attend(k, v, qlen - 1, keep, False)  # a new token's position: its step's length - 1
        return acc.result(query.dtype).transpose(1, 2)

    @staticmethod
    def _row_tokens(pages: torch.Tensor, B: int) -> torch.Tensor:
        """``[B n, H, P, D]`` pages (row-major) as the rows' tokens ``[B, H, n P, D]``."""
        x = pages.view(B, -1, *pages.shape[1:]).permute(0, 2, 1, 3, 4)
        return x.reshape(B, pages.shape[1], -1, pages.shape[-1])

    def _gather(self, pool: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Pages ``idx`` (``[B, n]``) of a full-precision pool as ``[B, H, n P, D]`` (a copy)."""
        return self._row_tokens(pool[idx.reshape(-1)], idx.shape[0])

    def _decoded(self, role: str, jj: torch.Tensor) -> torch.Tensor:
        """Every row's compressed logical pages ``jj`` of role ``"k"``/``"v"`` decoded from their
        codes, ``[B, H, len(jj) P, D]``."""
        idx = self.layout.comp_table[:self.batch, jj].long().reshape(-1)
        return self._row_tokens(self.parent.pool._dequantize_pages(self.pages, role, idx), self.batch)

    def _prefill_attention(self, module, query, key, value, attention_mask, **kw):
        k, v = self.pending
        q = k.shape[2]
        self._store_prefill(k, v, last_query_mask(attention_mask, q))
        mask = None if attention_mask is None else attention_mask[..., :q]
        return sdpa_attention_forward(module, query, key, value, mask, **kw)

    def _store_prefill(self, k: torch.Tensor, v: torch.Tensor, real: Optional[torch.Tensor]) -> None:
        """The real tokens of every row into the row's pages, P columns of the padded prompt at a
        time, by the decode step's rule (each page compressed in the round it leaves the window)."""
        p, P = self.parent, self.parent.page_size
        B, _, q, _ = k.shape
        keep = torch.ones(B, q, dtype=torch.bool, device=self.device) if real is None else real.to(self.device)
        if p.pool.check_finite and q:
            p.pool._check_tokens(self.pages, k.transpose(1, 2)[keep], v.transpose(1, 2)[keep])
        self.lens.zero_()
        for a in range(0, q, P):
            self._append_tokens(k[:, :, a:a + P].contiguous(), v[:, :, a:a + P].contiguous(),
                                keep[:, a:a + P].contiguous())
        self.batch, self.max_items = B, p.pool.default_max_items(B)
        self.pending, self.prefilled = None, True

    # -- CacheLayerMixin -----------------------------------------------------------------
    def get_seq_length(self, *args):
        """Tokens of the padded timeline run so far (a 0-dim device tensor once allocated)."""
        return self.seen if self.is_initialized else 0

    def get_mask_sizes(self, *args) -> Tuple[int, int]:
        # fixed, so that the compiled step's mask has one shape (the decode attention ignores it)
        return self.parent.max_cache_len, 0

    def get_max_length(self) -> int:
        return self.parent.max_cache_len

    def get_max_cache_shape(self) -> int:  # older name
        return self.get_max_length()

    def row_lengths(self) -> list:
        """Tokens stored for each row (host list; synchronises)."""
        return self.lens[:self.batch].tolist() if self.prefilled else []

    @property
    def nbytes(self) -> int:
        """Bytes stored for the rows' tokens, counted as ``PagedKVCache.nbytes`` counts them."""
        if not self.prefilled:
            return 0
        pool, P = self.parent.pool, self.parent.page_size
        cp, fp_tok = pool._page_bytes(self.pages)
        lens = self.row_lengths()
        comp = [pool._comp_pages_at(n) if self.pages.compressed else 0 for n in lens]
        total = sum(c * cp + (n - c * P) * fp_tok for c, n in zip(comp, lens))
        return total + (pool._secondary_bytes(self.pages) if any(comp) else 0)

    def reset(self) -> None:
        if self.is_initialized:
            self.lens.zero_()
            self.seen.zero_()
        self.pending, self.prefilled, self.batch = None, False, 0

    def crop_plan(self, tokens_to_remove: int) -> Optional[list]:
        """The rows' lengths after removing their ``-tokens_to_remove`` newest tokens (None: nothing
        to do), or ``ValueError`` where a row cannot be put back (changes nothing).

        A row's pages are a function of its length, so a crop sets the length back; the tokens
        of pages that become full precision again must still be in the row's ring of ``R`` pages,
        i.e. no page ``R`` or more past them has been started.  With ``R = W/P + 2`` that holds
        for any crop of up to P tokens (and for every crop of a full-precision layer, whose ring
        never wraps); the kept tokens then hold exactly the pages they alone would have built."""
        n = -tokens_to_remove
        if n == 0 or not self.prefilled:
            return None
        lens = self.row_lengths()
        new = [max(L - n, 0) for L in lens]
        if self.pages.compressed:
            P, W, R = self.parent.page_size, self.parent.recent_window, self.layout.ring
            for b, (L, L2) in enumerate(zip(lens, new)):
                oldest = -(-L // P) - R  # oldest logical page still in the row's ring
                if L2 and self.parent.pool._comp_pages_at(L2) < oldest:
                    keep = W + oldest * P
                    raise ValueError(f"argument 'tokens_to_remove' ({tokens_to_remove}): row {b} of layer "
                                     f"{self.layer_idx} holds {L} tokens, and its tokens before {keep} are "
                                     f"compressed with their full-precision copies overwritten; remove at most "
                                     f"{L - keep} tokens (the page size {P} always can be), or all {L}")
        return new

    def crop(self, tokens_to_remove) -> None:
        """transformers' semantics: remove the ``-tokens_to_remove`` newest tokens of the padded
        timeline from every row (a row shorter than that is emptied; a positive value is refused,
        as by ``DynamicLayer``).  Rules and errors: :meth:`crop_plan`.  Eager (reads the lengths)."""
        tokens_to_remove = _crop_count(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                             "Please use a negative integer to remove that number of tokens from the cache instead.")
        self._apply_crop(tokens_to_remove, self.crop_plan(tokens_to_remove))

    def _apply_crop(self, tokens_to_remove: int, new: Optional[list]) -> None:
        if new is None:
            return
        self.lens[:self.batch] = torch.tensor(new, dtype=torch.int32, device=self.lens.device)
        self.seen.sub_(min(-tokens_to_remove, int(self.seen)))

    def _select_rows(self, index, name: str) -> None:
        """Rows 0 .. n - 1 become copies of rows ``index`` ([n] ints in [0, rows)): their
        compressed pages and full-precision ring (whole row blocks of the pools, so every row's
        static page functions still hold) and lengths.  Eager (one host check of ``index``)."""
        if not self.prefilled:
            return
        rows, lay, pg = self.parent.max_batch_size, self.layout, self.pages
        index = torch.as_tensor(index, device=self.lens.device)
        if index.dim() != 1 or index.dtype == torch.bool or index.is_floating_point() or \
                not 0 < index.numel() <= rows:
            raise ValueError(f"argument '{name}' must be 1 to {rows} (max_batch_size) row indices, got "
                             f"{tuple(index.shape)} {index.dtype}")
        index = index.long()
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= self.batch:
            raise IndexError(f"argument '{name}' indexes rows [{lo}, {hi}] of a batch of {self.batch}")
        n = index.numel()

        def pick(pool, per_row):
            blocks = pool[1:1 + rows * per_row].view(rows, per_row, *pool.shape[1:])
            blocks[:n] = blocks.index_select(0, index)

        for t in (pg.k_fp, pg.v_fp):
            pick(t, lay.ring)
        if pg.comp is not None:
            for role in ("k", "v"):
                for t in pg.comp[role]:
                    pick(t, lay.comp)
        self.lens[:n] = self.lens.index_select(0, index)
        self.batch = n
        self.max_items = self.parent.pool.default_max_items(n)

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row b continues row ``beam_idx[b]`` (a copy of its pages and length)."""
        self._select_rows(beam_idx, "beam_idx")

    def batch_select_indices(self, indices) -> None:
        """Keep rows ``indices`` (as rows 0 .. len - 1)."""
        self._select_rows(indices, "indices")

    def batch_repeat_interleave(self, repeats) -> None:
        """Row b becomes rows b·repeats .. b·repeats + repeats - 1 (at most max_batch_size)."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats <= 0:
            raise ValueError(f"argument 'repeats' must be a positive int, got {repeats!r}")
        if self.prefilled:
            if self.batch * repeats > self.parent.max_batch_size:
                raise ValueError(f"argument 'repeats': {self.batch} rows x {repeats} exceed max_batch_size="
                                 f"{self.parent.max_batch_size}")
            idx = torch.arange(self.batch, device=self.lens.device).repeat_interleave(repeats)
            self._select_rows(idx, "repeats")

    def offload(self):  # pragma: no cover - offloading is not supported
        pass

    def prefetch(self):  # pragma: no cover
        pass

    def __repr__(self):
        return f"StaticQuantizedLayer(idx={self.layer_idx}, rows={self.batch}, prefilled={self.prefilled})"


class StaticQuantizedCache(Cache):
    """A compileable transformers ``Cache`` of preallocated compressed pages (use with
    ``attn_implementation="kvq"``): every batch row owns a static set of pages of each layer's
    :class:`~kvquant_ext.PagedKVCache` pools, so a decode step is device work only and
    ``torch.compile`` (``fullgraph=True``, CUDA graphs) can capture it.

    Parameters
    ----------
    config : a preset name or :class:`~kvquant_ext.config.CompressionConfig` that
        ``PagedKVCache`` stores: ``fp16``, the group-quantization presets (KIVI, KCVT, per-token
        INT, FlexGen) or HQMQ without Med3x outliers (``hqmq-3.79``, ``hqmq-3.79-paper``).
    model_config : the model's transformers config (layers, KV heads, head dim); models with
        sliding-window or chunked attention layers are refused.
    max_batch_size : rows the cache holds.
    max_cache_len : tokens of the padded timeline (prompt with its padding, plus generated
        tokens) a row may reach; every row stores only its real tokens.
    device, dtype : of the pools (default: those of the first ``update``).
    check_finite : raise on NaN/Inf in the prompt and in eager decode steps (compiled steps do
        not check).
    page_size : P, a power of two >= 32, a multiple of the key group size (default 128 for every
        format: a prompt is written P tokens per row at a time, so smaller pages cost prefill
        time; on the H200, hqmq-3.79 at B = 8 with a 4k prompt decodes at the same step time
        with P = 32, allocates 20 % less and prefills 2.65x slower).
    recent_window : W, a multiple of P, as ``PagedKVCache``'s (default: the config's window
        rounded up to a multiple of P).
    """

    def __init__(self, config, model_config, *, max_batch_size: int, max_cache_len: int, device=None,
                 dtype: Optional[torch.dtype] = None, check_finite: bool = True, page_size: int = 128,
                 recent_window: Optional[int] = None):
        if isinstance(config, str):
            config = get_config(config)
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"argument 'config' must be a CompressionConfig or preset name, "
                            f"got {type(config).__name__}")
        if not isinstance(config, (FP16Config, GroupQuantBase, HQMQConfig)) or \
                (isinstance(config, HQMQConfig) and config.outlier_factor is not None):
            raise NotImplementedError(f"argument 'config': StaticQuantizedCache does not support {config!r}; "
                                      "supported: fp16, the group-quantization presets (KIVI, KCVT, per-token "
                                      "INT, FlexGen) and HQMQ without Med3x outliers (hqmq-3.79, "
                                      "hqmq-3.79-paper)")
        if model_config is None or (not hasattr(model_config, "num_hidden_layers") and
                                    not hasattr(model_config, "get_text_config")):
            raise TypeError("argument 'model_config' must be the model's transformers config")
        kinds = layer_kinds(model_config)
        if any(kind != "compressed" for kind, _ in kinds):
            raise NotImplementedError("argument 'model_config' has sliding-window or chunked attention layers, "
                                      "which StaticQuantizedCache does not hold; use "
                                      "kvquant_ext.hf.QuantizedCache")
        text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") \
            else model_config
        heads = int(text.num_attention_heads)
        self.num_kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        self.head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        self.config, self.check_finite = config, bool(check_finite)
        self._max_batch_size = _positive_int("max_batch_size", max_batch_size)
        self._max_cache_len = _positive_int("max_cache_len", max_cache_len)
        self.page_size, self._recent_window = page_size, recent_window
        self.pool: Optional[PagedKVCache] = None
        super().__init__(layers=[StaticQuantizedLayer(self, i) for i in range(len(kinds))])
        if (device is None) != (dtype is None):
            raise ValueError("arguments 'device' and 'dtype' must be given together (or neither: then the "
                             "first update's are used)")
        if device is not None:
            self._allocate(dtype, torch.device(device))

    @property
    def max_batch_size(self) -> int:
        """Rows the cache holds."""
        return self._max_batch_size

    @property
    def max_cache_len(self) -> int:
        """Tokens of the padded timeline a row may reach."""
        return self._max_cache_len

    def _allocate(self, dtype: torch.dtype, device) -> None:
        """Every layer's pools, lengths and page tables (once)."""
        if self.pool is not None:
            return
        P = self.page_size
        if isinstance(P, bool) or not isinstance(P, int) or P < 32 or P & (P - 1):
            raise ValueError(f"argument 'page_size' must be a power of two >= 32, got {P!r}")
        pages = -(-self.max_cache_len // P)
        self.pool = PagedKVCache(self.config, num_layers=len(self.layers), num_kv_heads=self.num_kv_heads,
                                 head_dim=self.head_dim, max_tokens=self.max_batch_size * pages * P, dtype=dtype,
                                 device=device, page_size=P, max_seqs=self.max_batch_size,
                                 recent_window=self._recent_window, check_finite=self.check_finite,
                                 staging_pages=0)
        self.recent_window = self.pool.recent_window
        dev = self.pool.device
        layouts = {}
        for layer, pl in zip(self.layers, self.pool.layers):
            shape = (pl.k_fp.shape[0], 0 if pl.comp is None else pl.comp["k"][0].shape[0])
            if shape not in layouts:
                layouts[shape] = _Layout(*shape, self.max_batch_size, pages, dev)
            layer._bind(pl, layouts[shape], dev)
        if not torch.compiler.is_compiling():  # fixed addresses: CUDA graphs keep them
            mark = torch._dynamo.mark_static_address
            for layer, pl in zip(self.layers, self.pool.layers):
                for t in (pl.k_fp, pl.v_fp, layer.lens, layer.seen, *(pl.comp_tensors() if pl.comp else ())):
                    if t is not None:
                        mark(t)
            for lay in layouts.values():
                for t in lay.tensors():
                    mark(t)

    def _check_states(self, k: torch.Tensor, v: torch.Tensor) -> None:
        pool = self.pool
        for name, x in (("key_states", k), ("value_states", v)):
            if x.dim() != 4 or x.shape[1] != self.num_kv_heads or x.shape[3] != self.head_dim:
                raise ValueError(f"argument '{name}' must be [B, H={self.num_kv_heads}, T, D={self.head_dim}], "
                                 f"got {tuple(x.shape)}")
            if x.dtype != pool.dtype or x.device != pool.device:
                raise TypeError(f"argument '{name}' is {x.dtype} on {x.device}, but the cache holds "
                                f"{pool.dtype} on {pool.device}")

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_cache_len

    def get_max_length(self, layer_idx: Optional[int] = None) -> int:
        return self.max_cache_len

    @property
    def nbytes(self) -> int:
        """Bytes stored for the rows' tokens (compressed pages, full-precision tokens, HQMQ sets)."""
        return sum(layer.nbytes for layer in self.layers)

    @property
    def capacity_bytes(self) -> int:
        """Bytes allocated for the pools (0 before allocation)."""
        return 0 if self.pool is None else self.pool.capacity_bytes

    def crop(self, tokens_to_remove) -> None:
        """Remove the ``-tokens_to_remove`` newest tokens (assisted decoding, prompt lookup):
        :meth:`StaticQuantizedLayer.crop` on every layer, after every layer's check passed (a
        refused crop changes no layer)."""
        tokens_to_remove = _crop_count(tokens_to_remove)
        if tokens_to_remove > 0:
            self.layers[0].crop(tokens_to_remove)  # raises as DynamicLayer does
        plans = [layer.crop_plan(tokens_to_remove) for layer in self.layers]
        for layer, new in zip(self.layers, plans):
            layer._apply_crop(tokens_to_remove, new)

    def reorder_cache(self, beam_idx) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)

    def batch_select_indices(self, indices) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)

    def batch_repeat_interleave(self, repeats) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
