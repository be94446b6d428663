"""Pieces of the transformers integration shared by ``hf.QuantizedCache`` and
``hf_static.StaticQuantizedCache``: a model config's layer kinds and the mask row of the last
query."""
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
