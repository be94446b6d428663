"""Hugging Face ``transformers`` integration: a compressed KV ``Cache`` and the ``"kvq"``
attention function that reads it.

>>> import kvquant_ext as kvq, kvquant_ext.hf                       # registers "kvq"
>>> model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvq")
>>> out = model.generate(**inputs, past_key_values=kvq.hf.QuantizedCache("kivi-2"))

For compiled decoding (``torch.compile``, CUDA graphs) use
:class:`~kvquant_ext.hf_static.StaticQuantizedCache` instead: preallocated pages per batch row,
no host synchronisation in a decode step.

(``kvq.hf.enable(model)`` switches an already loaded model to ``"kvq"`` attention;
with transformers versions that renamed the argument, pass ``cache=`` instead of
``past_key_values=`` — :func:`cache_kwarg` tells which one a model takes.)

How a step runs
---------------
* **Prefill** (the first forward of a layer, any number of tokens): the layer's
  ``update`` stores the fresh keys/values in the compressed cache (following the
  method's streaming rule) and returns the *fresh full-precision* tensors, so prefill
  attention is exact; it runs through ``F.scaled_dot_product_attention``.
* **Decode** (one new token): ``update`` appends the token to the compressed cache and
  returns a *handle* instead of tensors: zero-stride placeholder tensors of the right
  shape ``[B, H, T, D]`` (no memory) carrying the attribute ``_kvq_handle``.  The
  ``"kvq"`` attention function recognises the handle and calls
  :func:`kvquant_ext.decode_attention` on the compressed layer with the model's scale
  and the padding mask as a ``[B, T]`` bool — the cache is never dequantized whole.
* **Several new tokens on a non-empty layer** (chunked prefill, assisted decoding, a
  follow-up prompt): the new tokens are appended and ``update`` returns placeholders whose
  handle carries the fresh full-precision tokens; the ``"kvq"`` attention function runs
  :func:`kvquant_ext.prefix_attention`, which reads the compressed past chunk by chunk
  (never a full-precision copy of it) and the fresh tokens causally.  FP16 layers return
  their stored tensors and run SDPA, as ``DynamicCache``.

The attention function does not receive the cache object, hence the handle: it travels
with the key tensor that ``Cache.update`` returns, which is exactly what the model
passes on to the attention function, so there is no global state and several caches
(threads, models) can be live at once.

If the model does *not* use ``"kvq"`` attention — or its code replaces the returned
tensors before attention, which would drop the handle — the cache notices (no handle came
back to it at prefill) and falls back to returning dequantized tensors on decode, with a
one-time warning: results stay correct, only slower.  Placeholders are therefore only
ever handed out on a path where a handle has already made the round trip.

Sliding-window layers (Gemma-2/3, Mistral with ``sliding_window``) are kept in full
precision by transformers' own ``DynamicSlidingWindowLayer`` (they only hold the last
``sliding_window - 1`` tokens, so compressing them buys little).  Which layers slide is
taken from ``model_config`` when given, else learned from the model's attention module
the first time the ``"kvq"`` attention function sees each layer.
"""
from __future__ import annotations

import copy

import inspect
import warnings
from typing import Any, Dict, Optional, Tuple

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

try:  # transformers >= 4.48
    from transformers import AttentionInterface
except ImportError:  # pragma: no cover
    from transformers.modeling_utils import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

try:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # pragma: no cover - very old transformers
    AttentionMaskInterface = sdpa_mask = None

from .attention import decode_attention, prefix_attention
from ._hf_common import crop_count, last_query_mask, layer_kinds
from .cache import KVCache
from .config import CompressionConfig, get_config
from .hf_static import STATIC_ATTR, StaticQuantizedCache, StaticQuantizedLayer
from .streams import FullPrecisionStream

ATTN_NAME = "kvq"

__all__ = ["ATTN_NAME", "QuantizedCache", "QuantizedLayer", "StaticQuantizedCache", "StaticQuantizedLayer",
           "cache_kwarg", "enable", "kvq_attention_forward", "register"]


# ----------------------------------------------------------------------------- handle
class _Handle:
    """What ``update`` hands to the attention function (attached to the key tensor)."""

    __slots__ = ("layer", "decode", "prefix")

    def __init__(self, layer: "QuantizedLayer", decode: bool, prefix=None):
        # prefix: (fresh keys, fresh values, past length) of several new tokens on a filled layer
        self.layer, self.decode, self.prefix = layer, decode, prefix


def _tag(key: torch.Tensor, value: torch.Tensor, handle: _Handle):
    key._kvq_handle = handle  # plain Python attribute on the tensor object
    return key, value


# ----------------------------------------------------------------------------- layers
class QuantizedLayer(CacheLayerMixin):
    """One model layer of a :class:`QuantizedCache`.

    ``kind`` is ``"compressed"`` (tokens live in the parent's :class:`~kvquant_ext.KVCache`
    at the same layer index), ``"sliding"`` (a full-precision
    ``DynamicSlidingWindowLayer`` in ``self.inner``) or ``None`` until known; an
    undecided layer keeps its prefill tokens in ``self.pending`` until the attention
    function (which sees the model's attention module) or the next ``update`` decides.
    """

    is_compileable = False
    supports_early_init = False

    def __init__(self, parent: "QuantizedCache", layer_idx: int, kind: Optional[str] = None,
                 sliding_window: Optional[int] = None):
        super().__init__()
        self.parent, self.layer_idx = parent, layer_idx
        self.kind: Optional[str] = None
        self.inner: Optional[DynamicSlidingWindowLayer] = None
        self.pending: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        self.attn_seen = False  # the "kvq" attention function consumed one of our handles
        self._zero: Optional[torch.Tensor] = None
        self._record_past = False
        self.unappended: Optional[Tuple[torch.Tensor, torch.Tensor]] = None
        if kind is not None:
            self.resolve(kind, sliding_window)

    # -- type resolution -----------------------------------------------------------
    @property
    def is_sliding(self) -> bool:  # read by transformers' mask creation
        return self.kind == "sliding"

    def resolve(self, kind: str, sliding_window: Optional[int] = None) -> None:
        if kind not in ("compressed", "sliding"):
            raise ValueError(f"argument 'kind' must be 'compressed' or 'sliding', got {kind!r}")
        if self.kind is not None:
            return
        if kind == "sliding":
            if not sliding_window:
                raise ValueError("argument 'sliding_window' must be a positive int for a sliding layer")
            self.inner = DynamicSlidingWindowLayer(sliding_window=int(sliding_window))
            self.inner.record_past = self._record_past
        self.kind = kind
        if self.pending is not None:
            k, v = self.pending
            self.pending = None
            self._store(k, v)

    def _store(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.kind == "sliding":
            self.inner.update(k, v)
        else:
            self.parent.kv.update(k, v, self.layer_idx)

    # -- CacheLayerMixin -----------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True
        self.device = key_states.device

    def append_unappended(self) -> None:
        """Append the tokens of a several-token step whose attention has not run yet."""
        if self.unappended is not None:
            k, v = self.unappended
            self.unappended = None
            self.parent.kv.update(k, v, self.layer_idx)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.append_unappended()
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if self.kind is None:
            if self.pending is None:
                # First tokens of an undecided layer: keep them until the attention function
                # tells us whether the layer slides; attend on them as given (exact prefill).
                self.pending = (key_states, value_states)
                return _tag(key_states, value_states, _Handle(self, decode=False))
            self.resolve("compressed")  # no "kvq" attention ran: we cannot know better
        if self.kind == "sliding":
            k, v = self.inner.update(key_states, value_states)
            return _tag(k, v, _Handle(self, decode=False))

        kv, idx = self.parent.kv, self.layer_idx
        past = kv.get_seq_length(idx)
        t = key_states.shape[-2]
        if past == 0:  # prefill: attention on the fresh full-precision tokens
            kv.update(key_states, value_states, idx)
            return _tag(key_states, value_states, _Handle(self, decode=False))
        if t == 1 and self.attn_seen:  # decode: hand the compressed layer to decode_attention
            kv.update(key_states, value_states, idx)
            B, H, _, D = key_states.shape
            if self._zero is None or self._zero.dtype != key_states.dtype or \
                    self._zero.device != key_states.device:
                self._zero = key_states.new_zeros(())
            placeholder = self._zero.expand(B, H, past + 1, D)
            return _tag(placeholder, self._zero.expand(B, H, past + 1, value_states.shape[-1]),
                        _Handle(self, decode=True))
        if self.attn_seen:
            # several tokens on a filled layer: kvq.prefix_attention reads the past as the cache
            # holds it before they arrive, chunk by chunk, then the attention function appends
            # them (``unappended`` until then; every other access appends them first).
            # FP16 layers return the stored tensors themselves, for SDPA.
            kst, vst = kv.layers[idx].key, kv.layers[idx].value
            if isinstance(kst, FullPrecisionStream) and isinstance(vst, FullPrecisionStream):
                kv.update(key_states, value_states, idx)
                return _tag(kst.dequantize(), vst.dequantize(), _Handle(self, decode=False))
            kst.validate(key_states, "key_states")
            vst.validate(value_states, "value_states")
            self.unappended = (key_states, value_states)
            B, H, _, D = key_states.shape
            z = key_states.new_zeros(())
            return _tag(z.expand(B, H, past + t, D), z.expand(B, H, past + t, value_states.shape[-1]),
                        _Handle(self, decode=False, prefix=(key_states, value_states, past)))
        if t == 1:
            self.parent._warn_fallback()
        # no "kvq" attention: past in, fresh appended
        k_past, v_past = kv.dequantize(idx)
        kv.update(key_states, value_states, idx)
        k = torch.cat([k_past, key_states], dim=-2)
        v = torch.cat([v_past, value_states], dim=-2)
        return _tag(k, v, _Handle(self, decode=False))

    def get_seq_length(self, *args) -> int:
        self.append_unappended()
        if self.kind == "sliding":
            return self.inner.get_seq_length()
        if self.pending is not None:
            return self.pending[0].shape[-2]
        return self.parent.kv.get_seq_length(self.layer_idx)

    def get_mask_sizes(self, query, *args) -> Tuple[int, int]:
        # transformers >= 5.2x passes query_length (int); earlier 5.x passed cache_position.
        if self.kind == "sliding":
            return self.inner.get_mask_sizes(query, *args)
        q = query if isinstance(query, int) else int(query.shape[0])
        return self.get_seq_length() + q, 0

    def get_max_length(self) -> int:
        return self.inner.get_max_length() if self.kind == "sliding" else -1

    def get_max_cache_shape(self) -> int:  # older name
        return self.get_max_length()

    @property
    def nbytes(self) -> int:
        self.append_unappended()
        if self.kind == "sliding":
            if not self.inner.is_initialized or self.inner.keys is None:
                return 0
            return sum(t.numel() * t.element_size() for t in (self.inner.keys, self.inner.values))
        if self.pending is not None:
            return sum(t.numel() * t.element_size() for t in self.pending)
        kv = self.parent.kv
        if self.layer_idx >= kv.num_layers:
            return 0
        l = kv.layers[self.layer_idx]
        return l.key.nbytes + l.value.nbytes

    def reset(self) -> None:
        self.append_unappended()
        self.pending = None
        if self.kind == "sliding":
            self.inner.reset()
        elif self.layer_idx < self.parent.kv.num_layers:
            self.parent.kv.reset(self.layer_idx)

    # -- crop (assisted decoding, prompt lookup) ------------------------------------------
    def crop(self, tokens_to_remove: int) -> None:
        """transformers' semantics: remove ``-tokens_to_remove`` newest tokens (0: nothing to
        do; a positive value is refused, as by ``DynamicLayer``).  Compressed layers follow
        :meth:`kvquant_ext.KVCache.crop` (a crop into a compressed block raises ``ValueError``)."""
        tokens_to_remove = crop_count(tokens_to_remove)
        self.append_unappended()
        if tokens_to_remove > 0:
            raise ValueError(f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                             "Please use a negative integer to remove that number of tokens from the cache instead.")
        if self.kind == "sliding":
            self.inner.crop(tokens_to_remove)
        elif tokens_to_remove == 0:
            return
        elif self.pending is not None:
            self.pending = tuple(t[..., :max(t.shape[-2] + tokens_to_remove, 0), :] for t in self.pending)
        elif self.layer_idx < self.parent.kv.num_layers:
            self._refuse_inexact_crop()
            self.parent.kv.crop(tokens_to_remove, self.layer_idx)

    def _refuse_inexact_crop(self) -> None:
        # transformers >= 5.2x refuses a cache that is not croppable before generating
        if self.kind == "compressed" and not self.is_croppable:
            raise ValueError(f"this QuantizedCache ({type(self.parent.config).__name__}) cannot be cropped "
                             "exactly (kept tokens would stay in the compressed form the removed ones pushed "
                             "them into); assisted decoding and prompt lookup need a croppable preset "
                             "(fp16, per-token INT, FlexGen, HQMQ or GEAR without a recent window)")

    @property
    def is_croppable(self) -> bool:
        """Can ``crop`` put the layer back as it was (transformers requires it for assisted
        decoding)?  Sliding and undecided layers: yes (full precision); compressed layers:
        :meth:`kvquant_ext.KVCache.crop_is_exact` of the config (e.g. per-token INT, HQMQ
        without a window, fp16: yes; KIVI, whose values sit in a FIFO: no)."""
        if self.kind == "sliding":
            return self.inner.is_croppable
        if self.kind is None:
            return True
        return self.parent.kv.crop_is_exact(self.layer_idx)

    def activate_past_recording(self, **kwargs) -> None:
        """A sliding layer keeps tokens past its window until the next ``crop`` (so that crop
        can roll it back); compressed layers keep every token anyway.  ``kwargs`` (transformers
        passes ``recurrent_states_to_keep`` for recurrent layers) do not apply to attention
        layers."""
        self.record_past = True

    @property
    def record_past(self) -> bool:
        return self._record_past

    @record_past.setter
    def record_past(self, on: bool) -> None:
        self._record_past = bool(on)
        if self.inner is not None:
            self.inner.record_past = self._record_past

    # -- batch (beam search, contrastive search, batch expansion) ----------------------
    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the batch rows ``indices`` (repeats allowed); see :meth:`KVCache.batch_select`."""
        self.append_unappended()
        if self.kind == "sliding":
            self.inner.batch_select_indices(indices)
        elif self.pending is not None:
            self.pending = tuple(t[indices] for t in self.pending)
        elif self.layer_idx < self.parent.kv.num_layers:
            self.parent.kv.batch_select(indices, self.layer_idx)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Beam search: row ``b`` becomes old row ``beam_idx[b]``."""
        self.batch_select_indices(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        self.append_unappended()
        if self.kind == "sliding":
            self.inner.batch_repeat_interleave(repeats)
        elif self.pending is not None:
            self.pending = tuple(t.repeat_interleave(repeats, dim=0) for t in self.pending)
        elif self.layer_idx < self.parent.kv.num_layers:
            self.parent.kv.batch_repeat_interleave(repeats, self.layer_idx)

    def offload(self):  # pragma: no cover - offloading is not supported
        pass

    def prefetch(self):  # pragma: no cover
        pass

    def __repr__(self):
        return f"QuantizedLayer(idx={self.layer_idx}, kind={self.kind}, tokens={self.get_seq_length()})"


# ----------------------------------------------------------------------------- cache
class QuantizedCache(Cache):
    """A transformers ``Cache`` whose full-attention layers live in a compressed
    :class:`kvquant_ext.KVCache`; decode attention reads them through
    :func:`kvquant_ext.decode_attention` (use ``attn_implementation="kvq"``).

    Parameters
    ----------
    config : a :class:`~kvquant_ext.config.CompressionConfig` or a preset name.
    model_config : optional transformers config; when given, sliding-window layers are
        known up front (otherwise they are learned at the first forward, see module doc).
    check_finite : raise on NaN/Inf in cached tokens (default True).
    compress_sliding : compress sliding-window layers too (they then keep every token, the
        window being applied by the attention mask) instead of keeping their last
        ``sliding_window - 1`` tokens in full precision (default False).  Worth it when the
        window is long compared with the context (e.g. Mistral-7B-v0.1's 4096).
    """

    def __init__(self, config="kivi-2", model_config=None, *, check_finite: bool = True,
                 compress_sliding: bool = False):
        if isinstance(config, str):
            config = get_config(config)
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"argument 'config' must be a CompressionConfig or preset name, "
                            f"got {type(config).__name__}")
        self.config, self.compress_sliding = config, bool(compress_sliding)
        n = None if model_config is None else len(layer_kinds(model_config))
        self.kv = KVCache(config, n, check_finite=check_finite)
        self._warned = False
        self._record_past = False
        super().__init__(layers=[])
        if model_config is not None:
            for i, (kind, window) in enumerate(layer_kinds(model_config)):
                if self.compress_sliding:
                    kind, window = "compressed", None
                self.layers.append(QuantizedLayer(self, i, kind, window))

    def _layer(self, layer_idx: int) -> QuantizedLayer:
        while len(self.layers) <= layer_idx:
            self.layers.append(QuantizedLayer(self, len(self.layers)))
            self.layers[-1].record_past = self._record_past
        return self.layers[layer_idx]

    def append_unappended(self) -> None:
        for layer in self.layers:
            layer.append_unappended()

    def crop(self, tokens_to_remove: int) -> None:
        """``QuantizedLayer.crop`` on every layer, after checking that every compressed layer
        allows it (a refused crop changes no layer)."""
        tokens_to_remove = crop_count(tokens_to_remove)
        self.append_unappended()
        if tokens_to_remove < 0:
            for layer in self.layers:
                if layer.kind == "compressed" and layer.layer_idx < self.kv.num_layers:
                    layer._refuse_inexact_crop()
                    self.kv._crop_plan(tokens_to_remove, layer.layer_idx)
        super().crop(tokens_to_remove)

    def activate_past_recording(self, **kwargs) -> None:
        """Sliding layers, including those created later, keep the tokens a ``crop`` may need
        (``kwargs``: as transformers' ``Cache.activate_past_recording``; none applies here)."""
        self._record_past = True
        for layer in self.layers:
            layer.activate_past_recording()

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        return self._layer(layer_idx).update(key_states, value_states)

    def load_prefill(self, past: Cache) -> None:
        """Fill this empty cache from ``past``, a transformers cache (e.g. ``DynamicCache``)
        after the model's prefill forward, as that forward would have filled it for a model
        that runs the ``"kvq"`` attention: compressed layers compress ``past``'s keys and values
        by the method's rule, sliding-window layers take a copy of ``past``'s window (which
        must be of the same kind), and later decode steps go through
        :func:`kvquant_ext.decode_attention`.  One uncompressed prefill can so feed several
        caches with different configs."""
        if self.get_seq_length() != 0:
            raise ValueError("load_prefill: the cache already holds tokens")
        for i, src in enumerate(past.layers):
            layer = self._layer(i)
            if layer.kind == "sliding":
                if not isinstance(src, DynamicSlidingWindowLayer) or \
                        src.sliding_window != layer.inner.sliding_window:
                    raise ValueError(f"argument 'past': layer {i} is not a sliding-window layer of "
                                     f"window {layer.inner.sliding_window} as this cache's is")
                layer.inner = copy.deepcopy(src)
                layer.lazy_initialization(src.keys, src.values)
            else:
                if isinstance(src, DynamicSlidingWindowLayer):
                    raise ValueError(f"argument 'past': layer {i} is a sliding-window layer (it "
                                     "lost older tokens); this cache compresses every token there")
                layer.update(src.keys, src.values)
            layer.attn_seen = True

    def _warn_fallback(self):
        if not self._warned:
            self._warned = True
            warnings.warn("kvq QuantizedCache: the model does not use attn_implementation='kvq', so "
                          "decode steps dequantize the whole cache (correct but slow); call "
                          "kvquant_ext.hf.enable(model) or load with attn_implementation='kvq'",
                          RuntimeWarning, stacklevel=3)

    @property
    def nbytes(self) -> int:
        """Every stored byte: compressed layers (codes, scales, ..., residual) plus the
        full-precision sliding-window layers."""
        return sum(l.nbytes for l in self.layers)

    @property
    def kv_numel(self) -> int:
        """Number of key + value elements the cache represents (for bits/element)."""
        self.append_unappended()
        n = 0
        for l in self.layers:
            if l.kind == "sliding" and l.inner.keys is not None and l.inner.keys.numel():
                n += l.inner.keys.numel() + l.inner.values.numel()
            elif l.kind == "compressed" and l.layer_idx < self.kv.num_layers:
                s = self.kv.layers[l.layer_idx].key
                if s._shape is not None:
                    B, H, D = s._shape
                    n += 2 * B * H * s.seq_len * D
            elif l.pending is not None:
                n += l.pending[0].numel() + l.pending[1].numel()
        return n

    # -- state -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Everything needed to rebuild the cache: the compressed layers' state (see
        :meth:`kvquant_ext.KVCache.state_dict`) plus each layer's kind and the
        full-precision sliding/pending tensors."""
        self.append_unappended()
        layers = []
        for l in self.layers:
            d: Dict[str, Any] = {"kind": l.kind, "attn_seen": l.attn_seen}
            if l.kind == "sliding":
                d.update(sliding_window=l.inner.sliding_window,
                         cumulative_length=l.inner.cumulative_length,
                         keys=None if l.inner.keys is None else l.inner.keys.clone(),
                         values=None if l.inner.values is None else l.inner.values.clone())
            if l.pending is not None:
                d["pending"] = tuple(t.clone() for t in l.pending)
            layers.append(d)
        return {"format": 1, "config": self.config.to_dict(), "kv": self.kv.state_dict(),
                "layers": layers}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        if state.get("format") != 1:
            raise ValueError(f"unknown QuantizedCache state format {state.get('format')!r}")
        self.kv.load_state_dict(state["kv"])
        self.layers = []
        for i, d in enumerate(state["layers"]):
            l = QuantizedLayer(self, i)
            l.attn_seen = bool(d.get("attn_seen", False))
            if d["kind"] == "sliding":
                l.resolve("sliding", d["sliding_window"])
                if d.get("keys") is not None:
                    inner = l.inner
                    inner.lazy_initialization(d["keys"], d["values"])
                    inner.keys, inner.values = d["keys"].clone(), d["values"].clone()
                    inner.cumulative_length = int(d["cumulative_length"])
            elif d["kind"] == "compressed":
                l.kind = "compressed"
            if d.get("pending") is not None:
                l.pending = tuple(t.clone() for t in d["pending"])
            if d["kind"] is not None or d.get("pending") is not None:
                l.is_initialized = True
            self.layers.append(l)


# ----------------------------------------------------------------------------- attention
def kvq_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                          value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                          dropout: float = 0.0, scaling: Optional[float] = None,
                          is_causal: Optional[bool] = None, **kwargs):
    """The ``"kvq"`` attention function (``AttentionInterface`` signature).

    ``query`` ``[B, Hq, q, D]``; returns ``([B, q, Hq, D], None)``.  Decode steps whose key
    carries a :class:`QuantizedCache` handle run :func:`kvquant_ext.decode_attention` on the
    compressed layer; keys of a :class:`StaticQuantizedCache` layer (its pool tensors on decode
    steps, the fresh tokens at prefill) carry the layer, which attends; everything else
    (prefill, sliding layers, plain caches) runs SDPA.
    """
    static = getattr(key, STATIC_ATTR, None)
    if static is not None:
        return static.attention(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                is_causal=is_causal, **kwargs)
    handle = getattr(key, "_kvq_handle", None)
    if handle is not None:
        layer = handle.layer
        layer.attn_seen = True
        if layer.kind is None:
            window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
            if window and getattr(module, "is_sliding", True) and not layer.parent.compress_sliding:
                layer.resolve("sliding", window)
            else:
                layer.resolve("compressed")
        if handle.decode:
            if kwargs.get("softcap") is not None:
                raise NotImplementedError("kvq decode attention does not support logit softcapping")
            T = key.shape[-2]
            mask = last_query_mask(attention_mask, T)
            out = decode_attention(query, layer.parent.kv, layer.layer_idx, scaling, attn_mask=mask)
            return out.transpose(1, 2).contiguous(), None
        if handle.prefix is not None:
            if kwargs.get("softcap") is not None:
                raise NotImplementedError("kvq prefix attention does not support logit softcapping")
            k, v, past = handle.prefix
            mask = None
            if attention_mask is not None:
                mask = attention_mask if attention_mask.dim() == 4 else attention_mask[:, None]
                mask = mask[:, :1, -query.shape[2]:, :past + k.shape[2]]
            out = prefix_attention(query, layer.parent.kv, layer.layer_idx, k, v, scaling,
                                   past_length=past, attn_mask=mask)
            layer.append_unappended()
            return out.transpose(1, 2).contiguous(), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                  scaling=scaling, is_causal=is_causal, **kwargs)


_registered = False


def register() -> None:
    """Register ``"kvq"`` with transformers' ``AttentionInterface`` (and its mask
    interface, reusing the SDPA boolean masks).  Idempotent; done on import."""
    global _registered
    if _registered:
        return
    AttentionInterface.register(ATTN_NAME, kvq_attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    _registered = True


def enable(model):
    """Switch a loaded model to ``"kvq"`` attention (returns the model)."""
    register()
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTN_NAME)
    else:  # pragma: no cover
        model.config._attn_implementation = ATTN_NAME
    return model


def cache_kwarg(model) -> str:
    """``"cache"`` on transformers versions whose forward takes ``cache=`` (the rename of
    ``past_key_values``), else ``"past_key_values"``."""
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return "past_key_values"
    return "cache" if "cache" in params else "past_key_values"


register()

