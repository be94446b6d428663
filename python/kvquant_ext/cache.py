"""``KVCache``: a streaming multi-layer compressed key/value cache."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch

from .config import CompressionConfig, get_config
from .streams import FullPrecisionStream, max_abs_of


class LayerCache:
    """Keys and values of one layer, each a :class:`~kvquant_ext.streams.Stream`.  The
    streams do not check for NaN/Inf themselves: :meth:`KVCache.update` checks key and
    value together before appending either."""

    def __init__(self, config: CompressionConfig, layer_idx: int, num_layers: Optional[int] = None,
                 check_outputs: bool = True):
        if config.skips_layer(layer_idx, num_layers):  # skip_layers: kept in full precision
            self.key, self.value = FullPrecisionStream(), FullPrecisionStream()
        else:
            self.key = config.new_stream("key", check_finite=False, layer_idx=layer_idx)
            self.value = config.new_stream("value", check_finite=False, layer_idx=layer_idx)
        self.key.check_outputs = self.value.check_outputs = check_outputs


class KVCache:
    """Streaming compressed KV cache for any number of layers.

    ``update(key, value, layer_idx)`` appends ``[B, H, t, D]`` tokens following the
    method's streaming rule (KIVI residual, GEAR buffer, HQMQ per token);
    ``dequantize(layer_idx)`` returns the full ``(K, V)`` as the cache holds them.

    Parameters
    ----------
    config : a :class:`~kvquant_ext.config.CompressionConfig` (or a preset name).
    num_layers : optional; layers are also created on first use (needed when the config's
        ``skip_layers`` has negative entries, which count from the last layer).
    check_finite : raise on NaN/Inf in appended tokens (default True).
    """

    def __init__(self, config, num_layers: Optional[int] = None, *, check_finite: bool = True):
        if isinstance(config, str):
            config = get_config(config)
        if not isinstance(config, CompressionConfig):
            raise TypeError(f"argument 'config' must be a CompressionConfig or preset name, "
                            f"got {type(config).__name__}")
        self.config, self.check_finite = config, check_finite
        self.num_layers_hint = num_layers
        config.skips_layer(0, num_layers)  # a negative skip_layers entry needs num_layers
        self.layers: List[LayerCache] = []
        if num_layers is not None:
            self._ensure(num_layers - 1)

    def _ensure(self, layer_idx: int) -> LayerCache:
        if not isinstance(layer_idx, int) or layer_idx < 0:
            raise ValueError(f"argument 'layer_idx' must be a non-negative int, got {layer_idx!r}")
        while len(self.layers) <= layer_idx:
            self.layers.append(LayerCache(self.config, len(self.layers), self.num_layers_hint, self.check_finite))
        return self.layers[layer_idx]

    def reset(self, layer_idx: int) -> None:
        """Empty layer ``layer_idx`` (its new streams are built for that layer index)."""
        self._layer(layer_idx)
        self.layers[layer_idx] = LayerCache(self.config, layer_idx, self.num_layers_hint, self.check_finite)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int) -> None:
        """Append ``key``/``value`` tokens ``[B, H, t, D]`` to layer ``layer_idx``."""
        if isinstance(key, torch.Tensor) and isinstance(value, torch.Tensor) and key.dim() == 4 and value.dim() == 4:
            if key.shape != value.shape:
                raise ValueError(f"arguments 'key' {tuple(key.shape)} and 'value' {tuple(value.shape)} "
                                 "must have the same shape [B, H, T, D]")
            if key.dtype != value.dtype or key.device != value.device:
                raise TypeError(f"argument 'value' ({value.dtype} on {value.device}) must have the dtype and "
                                f"device of 'key' ({key.dtype} on {key.device})")
        layer = self._ensure(layer_idx)
        # validate both before appending either, so a bad value cannot leave the keys ahead
        layer.key.validate(key, "key")
        layer.value.validate(value, "value")
        if self.check_finite:
            self._check_values(key, value, layer)
        # both roles' compression first, then both commits: a refused block leaves the layer as it was
        commit_key = layer.key.prepare(key, "key")
        commit_value = layer.value.prepare(value, "value")
        commit_key()
        commit_value()

    @staticmethod
    def _check_values(key: torch.Tensor, value: torch.Tensor, layer: "LayerCache") -> None:
        """Raise on NaN/Inf in key or value, or on a magnitude its stream cannot store (max |x|,
        or HQMQ's chunk norms): one reduction over both and one host sync (the failure path alone
        looks at each separately)."""
        ks, vs = layer.key, layer.value
        m = float(torch.maximum(ks.magnitude(key) / ks.max_abs, vs.magnitude(value) / vs.max_abs))
        if math.isfinite(m) and m <= 1.0:
            return
        for name, t, st in (("key", key, ks), ("value", value, vs)):
            if not math.isfinite(float(max_abs_of(t))):
                raise ValueError(f"argument '{name}' contains NaN or Inf (cache check_finite=True)")
        name, st = ("key", ks) if float(ks.magnitude(key)) > ks.max_abs else ("value", vs)
        raise ValueError(f"argument '{name}' has {st.range_text()}, which this cache's format cannot represent "
                         "(cache check_finite=True)")

    def dequantize(self, layer_idx: int) -> Tuple[torch.Tensor, torch.Tensor]:
        """Full ``(K, V)`` of a layer, ``[B, H, T, D]`` each, as the cache holds them."""
        layer = self._layer(layer_idx)
        if layer.key.seq_len == 0 and layer.key.dequantize() is None:
            raise ValueError(f"layer {layer_idx} of the cache is empty")
        return layer.key.dequantize(), layer.value.dequantize()

    def _layer(self, layer_idx: int) -> LayerCache:
        if not isinstance(layer_idx, int) or not 0 <= layer_idx < len(self.layers):
            raise IndexError(f"argument 'layer_idx' {layer_idx!r} out of range: the cache has "
                             f"{len(self.layers)} layers")
        return self.layers[layer_idx]

    # -- batch ------------------------------------------------------------------------
    @property
    def batch_size(self) -> Optional[int]:
        """Rows of the batch the cache holds (None before the first append)."""
        for layer in self.layers:
            if layer.key._shape is not None:
                return layer.key._shape[0]
        return None

    def _layers_arg(self, layer_idx: Optional[int]) -> List[LayerCache]:
        return list(self.layers) if layer_idx is None else [self._layer(layer_idx)]

    def batch_select(self, indices, layer_idx: Optional[int] = None) -> None:
        """Keep the batch rows ``indices`` (a 1-D integer tensor or sequence, each in
        ``[0, B)``; repeats allowed, e.g. beam search's ``beam_idx``) of every layer, or of layer
        ``layer_idx`` only.  Each layer becomes the cache those rows' tokens would have built:
        every stored tensor is index-selected along its batch dimension and the structures that
        name (batch, head) positions (HQMQ's outlier records and their index) are rebuilt.  What
        is per head and not per row stays: HQMQ's secondary sets and Med3x threshold (computed
        over the batch of the first append)."""
        layers = self._layers_arg(layer_idx)
        if isinstance(indices, torch.Tensor):
            index = indices
        else:
            try:
                index = torch.as_tensor(indices)
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"argument 'indices' must be a 1-D integer tensor or sequence, "
                                f"got {type(indices).__name__}") from None
        if index.dim() != 1 or index.dtype.is_floating_point or index.dtype.is_complex or \
                index.dtype == torch.bool:
            raise TypeError(f"argument 'indices' must be a 1-D integer tensor, got "
                            f"{index.dtype} of shape {tuple(index.shape)}")
        if index.numel() == 0:
            raise ValueError("argument 'indices' must select at least one batch row")
        filled = [l for l in layers if l.key._shape is not None]
        if not filled:
            return
        lo, hi = int(index.min()), int(index.max())  # one host sync
        for layer in filled:  # all checked before any layer changes
            B = layer.key._shape[0]
            if lo < 0 or hi >= B:
                raise ValueError(f"argument 'indices' has entries in [{lo}, {hi}], outside the "
                                 f"cache's batch rows [0, {B})")
        for layer in filled:
            for st in (layer.key, layer.value):
                if st._shape is not None:
                    st.batch_select(index.to(device=st.device, dtype=torch.int64))

    def batch_repeat_interleave(self, repeats: int, layer_idx: Optional[int] = None) -> None:
        """Repeat every batch row ``repeats`` times in place (row b becomes rows
        ``b * repeats .. b * repeats + repeats - 1``), as ``Tensor.repeat_interleave(repeats, 0)``."""
        if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
            raise ValueError(f"argument 'repeats' must be an int >= 1, got {repeats!r}")
        for layer in self._layers_arg(layer_idx):
            if layer.key._shape is not None:
                B = layer.key._shape[0]
                self.batch_select(torch.arange(B).repeat_interleave(repeats), self.layers.index(layer))

    # -- crop -------------------------------------------------------------------------
    def crop(self, max_length: int, layer_idx: Optional[int] = None) -> None:
        """Remove the newest tokens of every layer (or of layer ``layer_idx``): keep the first
        ``max_length`` tokens, or with a negative ``max_length`` remove ``-max_length`` tokens
        (a layer shorter than ``max_length`` is left as it is).

        Every kept token keeps the value the cache held for it.  Where the streaming rule
        stores the removed tokens apart from the kept ones the layer becomes the one the kept
        tokens alone would have built (:meth:`crop_is_exact`); otherwise kept tokens that the
        removed ones pushed out of a full-precision window stay compressed.  A layer cannot
        be cropped into a compressed block that also holds removed tokens (a KIVI/KCVT
        per-channel key block, a GEAR block): that raises ``ValueError`` naming the shortest
        length it can be cropped to, and no layer changes.  ``max_length`` 0 empties the layers.
        The rule per method is in docs/design.md."""
        for i, n in self._crop_plan(max_length, layer_idx):
            if n == 0:
                self.reset(i)
            else:
                layer = self.layers[i]
                layer.key.crop(n)
                layer.value.crop(n)

    def _crop_plan(self, max_length: int, layer_idx: Optional[int] = None) -> List[Tuple[int, int]]:
        """``(layer, tokens to keep)`` of every layer :meth:`crop` changes; raises as it does,
        changing nothing."""
        if isinstance(max_length, bool) or not isinstance(max_length, int):
            raise TypeError(f"argument 'max_length' must be an int, got {type(max_length).__name__}")
        plan = []
        for layer in self._layers_arg(layer_idx):
            i = self.layers.index(layer)
            T = layer.key.seq_len
            n = max(T + max_length, 0) if max_length < 0 else min(max_length, T)
            if n == T:
                continue
            floor = max(layer.key.crop_floor, layer.value.crop_floor)
            if 0 < n < floor:
                raise ValueError(f"argument 'max_length' ({max_length}): layer {i} cannot keep {n} of its "
                                 f"{T} tokens: its first {floor} tokens are compressed in blocks that would "
                                 f"hold removed tokens too; crop it to {floor} tokens or more, or to 0")
            plan.append((i, n))
        return plan

    def crop_is_exact(self, layer_idx: int) -> bool:
        """Does a crop of layer ``layer_idx`` (down to what it allows) always leave it as the
        kept tokens alone would have built it?  A property of the config and layer (KIVI values
        and HQMQ/KIVI/GEAR recent windows: no; per-token INT, FlexGen, fp16, HQMQ without a
        window, KIVI/GEAR keys without a window: yes)."""
        layer = self.layers[layer_idx] if 0 <= layer_idx < len(self.layers) else \
            LayerCache(self.config, layer_idx, self.num_layers_hint, self.check_finite)
        return layer.key.crop_is_exact and layer.value.crop_is_exact

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if layer_idx >= len(self.layers):
            return 0
        return self.layers[layer_idx].key.seq_len

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def nbytes(self) -> int:
        """Every stored byte of every layer (codes, scales, zeros, outliers, factors, residual)."""
        return sum(l.key.nbytes + l.value.nbytes for l in self.layers)

    def state_dict(self) -> Dict[str, object]:
        sd: Dict[str, object] = {"config": self.config.to_dict(), "num_layers": len(self.layers)}
        for i, layer in enumerate(self.layers):
            for role in ("key", "value"):
                for name, t in getattr(layer, role).state_dict().items():
                    sd[f"layers.{i}.{role}.{name}"] = t
        return sd

    def load_state_dict(self, state: Dict[str, object]) -> None:
        cfg = CompressionConfig.from_dict(state["config"])
        if cfg != self.config:
            raise ValueError(f"state_dict was saved with config {cfg}, this cache has {self.config}")
        saved, self.layers = self.layers, []
        i = 0
        try:
            for i in range(int(state["num_layers"])):
                layer = self._ensure(i)
                for role in ("key", "value"):
                    prefix = f"layers.{i}.{role}."
                    sub = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
                    if sub:
                        getattr(layer, role).load_state_dict(sub)
                self._check_loaded(i, layer)
        except Exception as e:  # refuse the whole state; the cache stays as it was
            self.layers = saved
            if isinstance(e, ValueError):
                raise
            raise ValueError(f"argument 'state': layer {i} does not hold a valid cache ({type(e).__name__}: {e})") from e

    @staticmethod
    def _check_loaded(i: int, layer: "LayerCache") -> None:
        """A loaded layer must be a cache this class could have built: keys and values of the same
        length and shape, and each role readable back (every stored tensor present and consistent)."""
        k, v = layer.key, layer.value
        if k.seq_len != v.seq_len:
            raise ValueError(f"argument 'state': layer {i} keys hold {k.seq_len} tokens but values hold {v.seq_len}")
        if k.seq_len == 0:
            return
        K, V = k.dequantize(), v.dequantize()
        if K is None or V is None or K.shape != V.shape or K.shape[2] != k.seq_len:
            raise ValueError(f"argument 'state': layer {i} keys {None if K is None else tuple(K.shape)} and values "
                             f"{None if V is None else tuple(V.shape)} do not form a cache of {k.seq_len} tokens")
