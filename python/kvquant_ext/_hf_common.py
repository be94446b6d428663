"""Pieces of the transformers integration shared by ``hf.QuantizedCache`` and
``hf_static.StaticQuantizedCache``: a model config's layer kinds and the mask row of the last
query, the count ``crop`` takes."""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch


def layer_kinds(model_config) -> List[Tuple[str, Optional[int]]]:
    """Per decoder layer: ("compressed", None) or ("sliding", window) (sliding-window and
    chunked-attention layers)."""
    text = model_config.get_text_config(decoder=True) if hasattr(model_config, "get_text_config") \
        else model_config
    n = int(text.num_hidden_layers)
    window = getattr(text, "sliding_window", None)
    types = getattr(text, "layer_types", None)
    if types is None:
        types = ["sliding_attention" if window else "full_attention"] * n
    kinds = []
    for t in types:
        if t in ("sliding_attention", "chunked_attention"):
            w = window if t == "sliding_attention" else getattr(text, "attention_chunk_size", None)
            kinds.append(("sliding", w))
        else:
            kinds.append(("compressed", None))
    return kinds


def last_query_mask(attention_mask: Optional[torch.Tensor], T: int) -> Optional[torch.Tensor]:
    """The mask row of the model's last query → ``[B, T]`` bool (True = attend), None without a
    mask: for one decode token, the tokens it attends; for a prefill, the tokens a row holds."""
    if attention_mask is None:
        return None
    m = attention_mask
    if m.dim() == 4:
        m = m[:, 0, -1, :]
    elif m.dim() == 3:
        m = m[:, -1, :]
    if m.dtype != torch.bool:  # additive float mask: 0 attends, a large negative does not
        m = m > torch.finfo(m.dtype).min / 2
    return m[:, :T]


def crop_count(tokens_to_remove) -> int:
    """``crop``'s argument as an int (transformers < 5.2x passes a 0-dim integer tensor)."""
    if isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.dim() == 0 and \
            not tokens_to_remove.is_floating_point() and tokens_to_remove.dtype != torch.bool:
        return int(tokens_to_remove)
    if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, int):
        raise TypeError(f"argument 'tokens_to_remove' must be an int, got {type(tokens_to_remove).__name__}")
    return tokens_to_remove
