"""kvq.compress objects and the streaming kvq.KVCache (KIVI rule, docs/methods.md)."""
import io

import re

import pytest
import torch

import kvquant_ext as kvq
from conftest import CUDA
from reference.quant_reference import kivi_stream_ref, quantize_ref
from test_group_quant import make_kv

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
GROUP_PRESETS = ["kivi-2", "kivi-4", "kcvt-4", "int4-per-token", "int2-per-token", "flexgen-4"]


# ----------------------------------------------------------------------------- compress
@pytest.mark.parametrize("preset", GROUP_PRESETS + ["fp16"])
@pytest.mark.parametrize("role", ["key", "value"])
@pytest.mark.parametrize("T", [1, 17, 100])
def test_compress_roundtrip_and_bytes(preset, role, T):
    x = make_kv(2, 2, T, 128, torch.float16)
    c = kvq.compress(x, preset, role)
    y = c.decompress()
    assert y.shape == x.shape and y.dtype == x.dtype
    n = x.numel()
    assert c.bits_per_element == pytest.approx(8 * c.nbytes / n)
    if preset == "fp16":
        assert torch.equal(y, x) and c.nbytes == 2 * n
        return
    cfg = kvq.get_config(preset)
    spec = cfg.spec(role)
    # bytes formula: codes + fp16 scale/zero per group + full-precision tail
    tq = T - T % spec.group_size if spec.per_channel and spec.group_size > 0 else T
    G = spec.group_size if spec.group_size > 0 else (tq if spec.per_channel else 128)
    ngroups = (tq // G) * 128 if spec.per_channel else tq * (128 // G)
    expect = 2 * 2 * (tq * 128 * spec.bits // 8 + 2 * 2 * ngroups + (T - tq) * 128 * 2)
    assert c.nbytes == expect
    # the full-precision tail is exact; the rest within half a step (+fp16 output rounding)
    assert torch.equal(y[:, :, tq:], x[:, :, tq:])
    err = (y[:, :, :tq].float() - x[:, :, :tq].float()).abs()
    _, s, _ = quantize_ref(x[:, :, :tq], spec.bits, spec.group_size, spec.per_channel)
    if tq:
        bound = s.float().max() / 2 + x.float().abs().max() * 2 ** -11
        assert err.max() <= bound


def test_bits_per_element_table():
    """T=2048, D=128: the bits/element stated in the README."""
    x = make_kv(1, 8, 2048, 128, torch.float16)
    got = {p: (kvq.compress(x, p, "key").bits_per_element + kvq.compress(x, p, "value").bits_per_element) / 2
           for p in GROUP_PRESETS}
    assert got["kivi-2"] == pytest.approx(3.0)        # 2 + 32/32 (keys and values)
    assert got["kivi-4"] == pytest.approx(5.0)
    assert got["kcvt-4"] == pytest.approx(4 + (32 / 2048 + 32 / 128) / 2)
    assert got["int4-per-token"] == pytest.approx(4.25)
    assert got["flexgen-4"] == pytest.approx(4.5)


def test_compress_errors():
    x = make_kv(1, 2, 64, 128, torch.float16)
    with pytest.raises(ValueError, match="'role'"):
        kvq.compress(x, "kivi-2", "query")
    with pytest.raises(ValueError, match="unknown preset"):
        kvq.compress(x, "kivi-3", "key")
    with pytest.raises(ValueError, match=r"'x' must have shape \[B, H, T, D\]"):
        kvq.compress(x[0], "kivi-2", "key")
    with pytest.raises(TypeError, match="'x'"):
        kvq.compress(x.to(torch.int32), "kivi-2", "key")
    with pytest.raises(ValueError, match="'bits'"):
        kvq.KIVIConfig(bits=3)
    with pytest.raises(ValueError, match="'residual_length'"):
        kvq.KIVIConfig(bits=2, group_size=32, residual_length=48)
    y = x.clone()
    y[0, 0, 70 % 64, 3] = float("nan")
    with pytest.raises((RuntimeError, ValueError), match="NaN"):
        kvq.compress(y, "kivi-2", "key")


# ----------------------------------------------------------------------------- streaming
def _stream_check(stream, appended, R, spec):
    """Stored scales equal the reference's per-block scales bit for bit (so the grouping
    boundaries are right), the residual is the exact last tokens, and every quantized entry
    is within half a step."""
    blocks, residual = kivi_stream_ref(appended, R, spec.per_channel)
    full = torch.cat(appended, dim=2)
    assert stream.residual_len == residual.shape[2]
    assert torch.equal(stream.residual, residual)
    nq = sum(b.shape[2] for b in blocks)
    assert stream.quantized_len == nq
    if nq:
        G = spec.group_size if spec.group_size > 0 else R
        ref_scales = torch.cat([quantize_ref(b.cpu(), spec.bits, G if spec.per_channel else spec.group_size,
                                             spec.per_channel)[1] for b in blocks], dim=2)
        assert torch.equal(stream.scale.view().cpu(), ref_scales.cpu())
    deq = stream.dequantize()
    assert deq.shape == full.shape
    assert torch.equal(deq[:, :, nq:], full[:, :, nq:])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", ["kivi-2", "kivi-4", "kcvt-4", "int4-per-token", "flexgen-4"])
@pytest.mark.parametrize("prefill", [1, 100, 300])
def test_streaming_rule(device, preset, prefill):
    cfg = kvq.get_config(preset)
    cache = kvq.KVCache(cfg)
    B, H, D = 2, 2, 64
    ks, vs = [], []
    k, v = make_kv(B, H, prefill, D, torch.float16, device), make_kv(B, H, prefill, D, torch.float16, device)
    cache.update(k, v, 0)
    ks.append(k), vs.append(v)
    for step in range(260):
        k, v = make_kv(B, H, 1, D, torch.float16, device), make_kv(B, H, 1, D, torch.float16, device)
        cache.update(k, v, 0)
        ks.append(k), vs.append(v)
        if step in (0, 27, 128, 259):
            layer = cache.layers[0]
            _stream_check(layer.key, ks, cfg.residual_length, cfg.key_spec())
            _stream_check(layer.value, vs, cfg.residual_length, cfg.value_spec())
    assert cache.get_seq_length(0) == prefill + 260
    K, V = cache.dequantize(0)
    assert K.shape == (B, H, prefill + 260, D)


def test_kivi_prefill_split_example():
    """Prefill of T=300 with R=128: keys quantize 256 and keep 44; values keep 128."""
    cache = kvq.KVCache("kivi-2")
    cache.update(make_kv(1, 2, 300, 128, torch.float16), make_kv(1, 2, 300, 128, torch.float16), 0)
    key, value = cache.layers[0].key, cache.layers[0].value
    assert (key.quantized_len, key.residual_len) == (256, 44)
    assert (value.quantized_len, value.residual_len) == (172, 128)
    for _ in range(84):
        cache.update(make_kv(1, 2, 1, 128, torch.float16), make_kv(1, 2, 1, 128, torch.float16), 0)
    assert (key.quantized_len, key.residual_len) == (384, 0)  # buffer flushed at R
    assert (value.quantized_len, value.residual_len) == (256, 128)


def test_cache_nbytes_and_multilayer():
    cache = kvq.KVCache("kivi-2", num_layers=3)
    for layer in range(3):
        cache.update(make_kv(1, 2, 256, 128, torch.float16), make_kv(1, 2, 256, 128, torch.float16), layer)
    # keys: 256 quantized (2 bits + 1 bit of scale/zero per element); values 128 quantized + 128 fp16
    per_layer = 2 * 256 * 128 * 3 // 8 + 2 * (128 * 128 * 3 // 8 + 128 * 128 * 2)
    assert cache.nbytes == 3 * per_layer
    assert cache.get_seq_length(2) == 256 and cache.get_seq_length(5) == 0


def test_cache_state_dict_roundtrip():
    cache = kvq.KVCache("kivi-2")
    for layer in range(2):
        cache.update(make_kv(2, 2, 150, 64, torch.float16), make_kv(2, 2, 150, 64, torch.float16), layer)
        cache.update(make_kv(2, 2, 1, 64, torch.float16), make_kv(2, 2, 1, 64, torch.float16), layer)
    buf = io.BytesIO()
    torch.save(cache.state_dict(), buf)
    buf.seek(0)
    other = kvq.KVCache(kvq.get_config("kivi-2"))
    other.load_state_dict(torch.load(buf))
    for layer in range(2):
        for a, b in zip(cache.dequantize(layer), other.dequantize(layer)):
            assert torch.equal(a, b)
    assert other.nbytes == cache.nbytes
    # streaming continues identically after the round trip
    k, v = make_kv(2, 2, 40, 64, torch.float16), make_kv(2, 2, 40, 64, torch.float16)
    cache.update(k, v, 0)
    other.update(k, v, 0)
    assert torch.equal(cache.dequantize(0)[0], other.dequantize(0)[0])
    with pytest.raises(ValueError, match="config"):
        kvq.KVCache("kivi-4").load_state_dict(cache.state_dict())


def test_cache_bad_updates():
    cache = kvq.KVCache("kivi-2")
    cache.update(make_kv(1, 2, 10, 64, torch.float16), make_kv(1, 2, 10, 64, torch.float16), 0)
    with pytest.raises(ValueError, match="'key' has shape"):
        cache.update(make_kv(1, 3, 1, 64, torch.float16), make_kv(1, 3, 1, 64, torch.float16), 0)
    with pytest.raises(TypeError, match="'key' has dtype"):
        cache.update(make_kv(1, 2, 1, 64, torch.float32), make_kv(1, 2, 1, 64, torch.float32), 0)
    with pytest.raises(ValueError, match="'layer_idx'"):
        cache.update(make_kv(1, 2, 1, 64, torch.float16), make_kv(1, 2, 1, 64, torch.float16), -1)
    with pytest.raises(IndexError, match="'layer_idx'"):
        cache.dequantize(4)
    with pytest.raises(TypeError, match="'config'"):
        kvq.KVCache(42)
    bad = make_kv(1, 2, 1, 64, torch.float16)
    bad[0, 0, 0, 0] = float("inf")
    with pytest.raises((RuntimeError, ValueError), match="NaN or Inf"):
        cache.update(bad, make_kv(1, 2, 1, 64, torch.float16), 0)


@pytest.mark.parametrize("preset", ["kivi-2", "gear-2", "hqmq-5", "fp16"])
def test_update_is_atomic(preset):
    """A rejected value must not leave the keys one append ahead."""
    cache = kvq.KVCache(preset)
    k, v = make_kv(1, 2, 40, 64, torch.float16), make_kv(1, 2, 40, 64, torch.float16)
    cache.update(k, v, 0)
    bad = v[:, :, :3].clone()
    bad[0, 1, 2, 5] = float("nan")
    with pytest.raises(ValueError, match="'value' contains NaN"):
        cache.update(k[:, :, :3], bad, 0)
    with pytest.raises(ValueError, match="'value'"):
        cache.update(k[:, :, :3], make_kv(1, 2, 3, 32, torch.float16), 0)
    assert cache.layers[0].key.seq_len == cache.layers[0].value.seq_len == 40


# ----------------------------------------------------------------------------- value checks
def _chunks(sizes=(70, 1, 64, 1, 1, 64)):
    """A prefill, then appends crossing the residual / buffer flush points."""
    return [make_kv(1, 2, n, 64, torch.float16) for n in sizes]


@pytest.mark.parametrize("preset", sorted(kvq.PRESETS))
def test_update_checks_values_once(preset, monkeypatch):
    """One KVCache.update checks key and value (NaN/Inf, fp16 range) with a single host
    sync (plus, for GEAR, one per compressed block's factors); the streams and the
    compression ops it calls skip their own checks."""
    flags, syncs = [], {"bool": 0, "float": 0}
    for name in ("quantize", "gear_compress", "hqmq_encode"):
        def wrap(*a, _real=getattr(kvq.ops, name), check_finite=True, **kw):
            flags.append(check_finite)
            return _real(*a, check_finite=check_finite, **kw)
        monkeypatch.setattr(kvq.ops, name, wrap)
    for dunder, key in (("__bool__", "bool"), ("__float__", "float")):
        def counted(self, _real=getattr(torch.Tensor, dunder), _key=key):
            syncs[_key] += 1
            return _real(self)
        monkeypatch.setattr(torch.Tensor, dunder, counted)
    cache = kvq.KVCache(preset)
    keys, values = _chunks(), _chunks()
    for k, v in zip(keys, values):
        cache.update(k, v, 0)
    monkeypatch.undo()
    # GEAR adds one check per compressed block with factors: fp16 factors that overflow are
    # refused before either role is stored
    blocks = 0
    if isinstance(cache.config, kvq.GEARConfig):
        cfg = cache.config
        for st in (cache.layers[0].key, cache.layers[0].value):
            blocks += (1 if st.T0 and cfg.rank else 0) + (st.num_decode_blocks if cfg.rank_decode else 0)
    assert syncs == {"bool": blocks, "float": len(keys)}
    assert not any(flags)
    if preset != "fp16":
        assert flags  # the compression ops did run
    K, V = cache.dequantize(0)
    assert K.shape[2] == V.shape[2] == sum(k.shape[2] for k in keys)


@pytest.mark.parametrize("preset", ["kivi-2", "gear-2", "hqmq-5", "fp16"])
def test_update_value_errors_name_the_argument(preset):
    cache = kvq.KVCache(preset)
    k, v = make_kv(1, 2, 40, 64, torch.float32), make_kv(1, 2, 40, 64, torch.float32)
    for role, bad in (("key", float("inf")), ("value", float("nan")), ("value", float("-inf"))):
        kb, vb = k.clone(), v.clone()
        (kb if role == "key" else vb)[0, 1, 7, 3] = bad
        with pytest.raises(ValueError, match=f"'{role}' contains NaN or Inf"):
            cache.update(kb, vb, 0)
    big = v.clone()
    big[0, 0, 0, 0] = 7e4
    if preset == "fp16":
        cache.update(k, big, 0)  # full precision holds any finite value
    else:
        # the stream's bound: 65504 (fp16 scales), 61440 for HQMQ's coded chunks (kvq.hqmq.MAX_SCALE);
        # Med3x stores outlier chunks exactly, so their entries may reach 65504
        stream = kvq.get_config(preset).new_stream("value")
        assert stream.max_abs == (61440.0 if preset.startswith("hqmq") else 65504.0)
        text = stream.range_text()
        assert text.endswith("above 65504") if preset != "hqmq-3.79" else text.endswith("above 61440")
        with pytest.raises(ValueError, match=re.escape(f"'value' has {text}")):
            cache.update(k, big, 0)
        assert cache.get_seq_length(0) == 0
    cache.update(k, v, 0)
    unchecked = kvq.KVCache(preset, check_finite=False)
    nan = v.clone()
    nan[0, 0, 0, 0] = float("nan")
    unchecked.update(k, nan, 0)  # no check at all
    assert unchecked.get_seq_length(0) == 40


@pytest.mark.parametrize("preset", ["hqmq-3.79", "kivi-2"])
def test_reset_keeps_the_layer_index(preset):
    cache = kvq.KVCache(preset)
    kv = [(make_kv(1, 2, 40, 64, torch.float16), make_kv(1, 2, 40, 64, torch.float16)) for _ in range(3)]
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    before = cache.dequantize(2)
    cache.reset(2)
    assert cache.get_seq_length(2) == 0 and cache.get_seq_length(1) == 40
    cache.update(*kv[2], 2)
    for a, b in zip(before, cache.dequantize(2)):
        assert torch.equal(a, b)  # the same layer's codebooks as before the reset
    if preset.startswith("hqmq"):
        cfg = cache.config
        for role in ("key", "value"):
            sec = kvq.hqmq_secondary(2, cfg.secondary_size, cfg.seed, layer_idx=2, role=role)
            assert torch.equal(getattr(cache.layers[2], role).secondary, sec)
    with pytest.raises(IndexError, match="'layer_idx'"):
        cache.reset(3)


def test_update_refuses_a_value_unlike_its_key():
    """A value with another head dim, dtype or device than its key is refused at update (before
    anything is appended), not later inside decode attention."""
    k = make_kv(1, 2, 40, 128, torch.float16)
    for preset in ("kivi-2", "fp16", "hqmq-3.79"):
        cache = kvq.KVCache(preset)  # a fresh layer: nothing to compare against but the key
        with pytest.raises(ValueError, match="'value'"):
            cache.update(k, make_kv(1, 2, 40, 64, torch.float16), 0)
        with pytest.raises(TypeError, match="'value'"):
            cache.update(k, k.float(), 0)
        assert cache.get_seq_length(0) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_decode_attention_in_the_cache_dtype(device):
    """An fp32 cache queried with an fp16 q attends in fp32 and answers in fp16 (the CUDA ops
    require q in the cache dtype: the cast happens in kvq.decode_attention)."""
    k = make_kv(1, 2, 300, 64, torch.float32).to(device)
    q = torch.randn(1, 8, 64, device=device)
    for preset in ("kivi-2", "int4-per-token", "gear-2", "hqmq-3.79", "fp16"):
        cache = kvq.KVCache(preset)
        cache.update(k, k * 0.5, 0)
        out = kvq.decode_attention(q.half(), cache, 0)
        assert out.dtype == torch.float16
        torch.testing.assert_close(out, kvq.decode_attention(q.half().float(), cache, 0).half())


@pytest.mark.parametrize("preset", ["fp16", "kivi-2", "gear-2", "hqmq-3.79"])
def test_load_state_dict_refuses_missing_or_truncated_tensors(preset):
    """A state with a tensor missing or truncated is refused when it is loaded (ValueError) and
    leaves the cache as it was, instead of failing or answering non-finite values in decode."""
    src = kvq.KVCache(preset)
    k, v = make_kv(1, 2, 300, 64, torch.float16), make_kv(1, 2, 300, 64, torch.float16)
    src.update(k, v, 0)
    src.update(k[:, :, :5], v[:, :, :5], 0)
    state = src.state_dict()
    names = [n for n, t in state.items() if n.startswith("layers.0.key.") and isinstance(t, torch.Tensor)]
    target = kvq.KVCache(preset)
    target.update(k[:, :, :7], v[:, :, :7], 0)
    before = target.dequantize(0)
    for name in names:
        t = state[name]
        bad_states = [{n: x for n, x in state.items() if n != name}]
        if t.dim() >= 3 and t.shape[2] > 1:
            bad_states.append({**state, name: t[:, :, :t.shape[2] // 2]})
        for bad in bad_states:
            try:
                target.load_state_dict(bad)
            except ValueError:
                pass
            else:  # accepted: then it must be the cache it claims to be (nothing silently wrong)
                K, V = target.dequantize(0)
                assert K.shape == V.shape and torch.isfinite(K).all() and torch.isfinite(V).all(), name
                target = kvq.KVCache(preset)
                target.update(k[:, :, :7], v[:, :, :7], 0)
                before = target.dequantize(0)
                continue
            after = target.dequantize(0)
            assert torch.equal(after[0], before[0]) and torch.equal(after[1], before[1]), name
    target.load_state_dict(state)
    assert torch.equal(target.dequantize(0)[0], src.dequantize(0)[0])


@pytest.mark.parametrize("preset", ["kivi-2", "gear-2", "hqmq-3.79", "hqmq-5"])
def test_compress_decompress_compiles_fullgraph(preset):
    """kvq.compress(...).decompress() traces into one graph (no data-dependent Python branching)
    and gives the eager result."""
    torch._dynamo.reset()
    x = make_kv(1, 2, 128, 64, torch.float32)
    f = torch.compile(lambda t: kvq.compress(t, preset, "key", check_finite=False).decompress(), fullgraph=True)
    torch.testing.assert_close(f(x), kvq.compress(x, preset, "key").decompress(), rtol=0, atol=0)


# ----------------------------------------------------------------------------- skip_layers
def test_skip_layers_keep_those_layers_in_full_precision():
    cfg = kvq.KIVIConfig(bits=2, skip_layers=(0, -1))
    c = kvq.KVCache(cfg, 4)
    xs = [make_kv(1, 2, 200, 64, torch.float16) for _ in range(4)]
    for i, x in enumerate(xs):
        c.update(x, x, i)
    plain = kvq.KVCache("kivi-2")
    for i, x in enumerate(xs):
        plain.update(x, x, i)
    for i, x in enumerate(xs):
        K, V = c.dequantize(i)
        if i in (0, 3):
            assert torch.equal(K, x) and torch.equal(V, x)
        else:
            assert torch.equal(K, plain.dequantize(i)[0]) and not torch.equal(K, x)
    per_layer = [plain.layers[i].key.nbytes + plain.layers[i].value.nbytes for i in range(4)]
    assert c.nbytes == 2 * 2 * xs[0].numel() * 2 + per_layer[1] + per_layer[2]
    q = torch.randn(1, 4, 64).half()
    K, V = xs[3], xs[3]
    ref = torch.nn.functional.scaled_dot_product_attention(q.unsqueeze(2), K, V, enable_gqa=True).squeeze(2)
    torch.testing.assert_close(kvq.decode_attention(q, c, 3), ref, atol=2e-3, rtol=2e-3)
    d = kvq.KVCache(cfg, 4)
    d.load_state_dict(c.state_dict())
    assert all(torch.equal(a, b) for i in range(4) for a, b in zip(c.dequantize(i), d.dequantize(i)))


def test_skip_layers_negative_entries_need_the_layer_count():
    with pytest.raises(ValueError, match="num_layers"):
        kvq.KVCache(kvq.GEARConfig(skip_layers=(-1,)))
    c = kvq.KVCache(kvq.GEARConfig(skip_layers=(1,)))  # non-negative: resolved without it
    c.update(make_kv(1, 2, 64, 64, torch.float16), make_kv(1, 2, 64, 64, torch.float16), 1)
    assert type(c.layers[1].key).__name__ == "FullPrecisionStream"
    assert type(c.layers[0].key).__name__ == "GEARStream"
    for bad in [(0, 0), (1.0,), "0", (True,)]:
        with pytest.raises(ValueError, match="skip_layers"):
            kvq.HQMQConfig(skip_layers=bad)
    assert kvq.HQMQConfig(skip_layers=[2, -1]).skip_layers == (2, -1)  # a list is stored as a tuple
    cfg = kvq.KIVIConfig(skip_layers=(0, -1))
    assert kvq.CompressionConfig.from_dict(cfg.to_dict()) == cfg
    # paged: tests/test_paged.py::test_skip_layers_keep_their_layers_in_full_precision


def test_a_refused_gear_block_leaves_the_layer_as_it_was(monkeypatch):
    """GEAR compresses both roles' blocks before storing either: when the value block's
    low-rank factors overflow fp16 the update is refused naming 'value', and the keys were
    not stored either (with check_finite=False the block is stored as it comes)."""
    import kvquant_ext.gear as kg
    real = kg.GEARCompressed.from_tensor

    def inf_values(x, config, role, **kw):
        c = real(x, config, role, **kw)
        if role == "value":
            c.fields["A"] = torch.full_like(c.fields["A"], float("inf"))
        return c
    x = make_kv(1, 2, 128, 64, torch.float16)
    cache = kvq.KVCache("gear-2")
    cache.update(x, x, 0)  # the prefill block
    before = [t.clone() for t in cache.dequantize(0)]
    monkeypatch.setattr(kg.GEARCompressed, "from_tensor", staticmethod(inf_values))
    nb = cache.config.buffer_length
    step = make_kv(1, 2, nb, 64, torch.float16)  # completes one decode block
    with pytest.raises(ValueError, match="'value'.*fp16 low-rank factors"):
        cache.update(step, step, 0)
    assert cache.get_seq_length(0) == 128
    assert all(torch.equal(a, b) for a, b in zip(before, cache.dequantize(0)))
    loose = kvq.KVCache("gear-2", check_finite=False)
    loose.update(x, x, 0)
    loose.update(step, step, 0)  # the user skipped the checks: stored as it comes
    assert loose.get_seq_length(0) == 128 + nb


# ----------------------------------------------------------------------------- batch operations
# A prefill of 70, single tokens to 100, then steps of 5 to 230: every preset ends with a
# non-empty compressed part and a non-empty full-precision part (KIVI residual, GEAR buffer
# with decode blocks stored, HQMQ window), and HQMQ-5 with Med3x outlier records.
_CUTS = [70] + list(range(71, 100)) + list(range(105, 231, 5))


def _streamed(preset, K, V, cuts=_CUTS, like=None):
    """A 2-layer cache fed K[l], V[l] [B, H, T, D] in the chunks ``cuts``.  ``like``: take the
    Med3x thresholds of that cache (a statistic of the first append's whole batch)."""
    cache = kvq.KVCache(preset)
    if like is not None and getattr(cache.config, "outlier_factor", None) is not None:
        for l in range(2):
            for role in ("key", "value"):
                getattr(cache._ensure(l), role).threshold = getattr(like.layers[l], role).threshold
    a = 0
    for b in cuts:
        for l in range(2):
            cache.update(K[l][:, :, a:b], V[l][:, :, a:b], l)
        a = b
    return cache


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if isinstance(sa[k], torch.Tensor):
            assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
            assert torch.equal(sa[k], sb[k]), k
        else:
            assert sa[k] == sb[k], k


def _kv(B, T, H=2, D=64):
    K = [make_kv(B, H, T, D, torch.float16) for _ in range(2)]
    V = [make_kv(B, H, T, D, torch.float16, outlier_channels=False) for _ in range(2)]
    return K, V


@pytest.mark.parametrize("preset", sorted(kvq.PRESETS))
def test_batch_select_equals_a_cache_of_the_selected_rows(preset):
    K, V = _kv(3, 230)
    cache = _streamed(preset, K, V)
    st = cache.layers[0].key
    if preset == "hqmq-5":
        assert st.outliers.length > 0  # the records are renumbered, not just copied
    idx = torch.tensor([2, 0, 0, 1])
    ref = _streamed(preset, [k[idx] for k in K], [v[idx] for v in V], like=cache)
    cache.batch_select(idx)
    _assert_same_state(cache, ref)
    q = torch.randn(4, 8, 64, dtype=torch.float16)
    assert torch.equal(kvq.decode_attention(q, cache, 1), kvq.decode_attention(q, ref, 1))
    # batch_repeat_interleave: row b -> rows 2b, 2b + 1
    cache.batch_repeat_interleave(2)
    rep = torch.tensor([2, 2, 0, 0, 0, 0, 1, 1])
    ref2 = _streamed(preset, [k[rep] for k in K], [v[rep] for v in V], like=ref)
    _assert_same_state(cache, ref2)


def test_batch_select_one_layer_and_errors():
    K, V = _kv(2, 150)
    cache = _streamed("kivi-2", K, V, cuts=[150])
    before = cache.state_dict()
    for bad, err, match in ((torch.tensor([0, 2]), ValueError, r"'indices'.*\[0, 2\].*\[0, 2\)"),
                            (torch.tensor([-1]), ValueError, "'indices'"),
                            (torch.tensor([], dtype=torch.int64), ValueError, "at least one"),
                            (torch.tensor([0.0]), TypeError, "'indices'.*integer"),
                            (torch.tensor([[0]]), TypeError, "'indices'.*1-D"),
                            ("0", TypeError, "'indices'")):
        with pytest.raises(err, match=match):
            cache.batch_select(bad)
    with pytest.raises(ValueError, match="'repeats'"):
        cache.batch_repeat_interleave(0)
    assert all(not isinstance(v, torch.Tensor) or torch.equal(v, cache.state_dict()[k])
               for k, v in before.items())
    k1 = cache.dequantize(1)[0].clone()
    cache.batch_select([1], layer_idx=1)  # one layer; a list is accepted
    assert cache.layers[0].key._shape[0] == 2 and cache.layers[1].key._shape[0] == 1
    assert torch.equal(cache.dequantize(1)[0], k1[1:])
    with pytest.raises(IndexError, match="'layer_idx'"):
        cache.batch_select([0], layer_idx=5)
    kvq.KVCache("kivi-2").batch_select([3])  # nothing stored yet: nothing to check against


# ----------------------------------------------------------------------------- crop
_EXACT_CROP = {"fp16", "int4-per-token", "int2-per-token", "flexgen-4", "hqmq-3.79-paper", "hqmq-5",
               "gear-2", "gear-2-paper", "gear-4", "gearl-2", "gearl-4", "outlier-2"}


def _step(cache, K, V, a, b):
    for t in range(a, b):
        for l in range(2):
            cache.update(K[l][:, :, t:t + 1], V[l][:, :, t:t + 1], l)


@pytest.mark.parametrize("k", [1, 7, 40])
@pytest.mark.parametrize("preset", sorted(kvq.PRESETS))
def test_crop_equals_a_cache_that_never_got_the_tokens(preset, k):
    """150 tokens one by one, crop the newest k: the kept tokens keep their values; where the
    rule is exact the state is that of a cache fed 150 - k tokens, else it becomes that once
    k more tokens have pushed the early-compressed ones out; into a compressed block: refused."""
    n = 150
    K, V = _kv(2, n + 20)
    cache = _streamed(preset, K, V, cuts=list(range(1, n + 1)))
    assert cache.crop_is_exact(0) == (preset in _EXACT_CROP)
    floor = max(cache.layers[0].key.crop_floor, cache.layers[0].value.crop_floor)
    before = cache.state_dict()
    full = [t.clone() for t in cache.dequantize(0)]
    if n - k < floor:
        with pytest.raises(ValueError, match=rf"'max_length'.*crop it to {floor} tokens or more"):
            cache.crop(-k)
        _assert_same_state(cache, _streamed(preset, K, V, cuts=list(range(1, n + 1))))
        return
    cache.crop(n - k) if k % 2 else cache.crop(-k)  # both spellings
    assert cache.get_seq_length(0) == cache.get_seq_length(1) == n - k
    assert all(torch.equal(a[:, :, :n - k], b) for a, b in zip(full, cache.dequantize(0)))
    ref = _streamed(preset, K, V, cuts=list(range(1, n - k + 1)))
    if preset in _EXACT_CROP:
        _assert_same_state(cache, ref)
    _step(cache, K, V, n - k, n + 12)  # k + 12 more: the early-compressed tokens' turn has come
    _step(ref, K, V, n - k, n + 12)
    _assert_same_state(cache, ref)
    q = torch.randn(2, 8, 64, dtype=torch.float16)
    assert torch.equal(kvq.decode_attention(q, cache, 0), kvq.decode_attention(q, ref, 0))


def test_crop_keeps_views_and_edge_cases():
    x = make_kv(1, 2, 40, 64, torch.float16)
    cache = kvq.KVCache("fp16")
    cache.update(x, x, 0)
    view = cache.dequantize(0)[0]
    cache.crop(30)
    cache.update(-x[:, :, :5], -x[:, :, :5], 0)  # writes rows 30..34 of a copy
    assert torch.equal(view, x)
    cache.crop(100)  # longer than the layer: nothing to do
    assert cache.get_seq_length(0) == 35
    cache.crop(-1000)  # more than it holds: empty, as a fresh layer
    assert cache.get_seq_length(0) == 0 and cache.layers[0].key._shape is None
    with pytest.raises(TypeError, match="'max_length'"):
        cache.crop(1.5)
    two = kvq.KVCache("kivi-2", num_layers=2)
    two.update(make_kv(1, 2, 150, 64, torch.float16), make_kv(1, 2, 150, 64, torch.float16), 0)
    two.update(make_kv(1, 2, 100, 64, torch.float16), make_kv(1, 2, 100, 64, torch.float16), 1)
    with pytest.raises(ValueError, match="layer 0 cannot keep 120"):
        two.crop(120)  # layer 1 (100 tokens, all in the residual) is not touched either
    assert two.get_seq_length(1) == 100
    two.crop(90, layer_idx=1)
    assert (two.get_seq_length(0), two.get_seq_length(1)) == (150, 90)


def test_hqmq_bounds_coded_chunks_and_med3_entries_separately():
    """A coded chunk's norm must fit the packed radius scale (<= 61440); a Med3x outlier chunk is
    stored exactly in fp16, so its entries may reach 65504."""
    torch.manual_seed(0)
    x = torch.randn(1, 2, 40, 64, dtype=torch.float16)
    x[0, 0, 3, 4] = 63000.0  # an outlier chunk of hqmq-5 (far above 3x the median norm)
    cache = kvq.KVCache("hqmq-5")
    cache.update(x, x, 0)
    K, V = cache.dequantize(0)
    assert K[0, 0, 3, 4] == x[0, 0, 3, 4] and V[0, 0, 3, 4] == x[0, 0, 3, 4]
    plain = kvq.KVCache("hqmq-3.79-paper")  # no Med3x: the chunk is coded, its norm is too large
    with pytest.raises(ValueError, match="'key' has 4-element chunks with norm above 61440"):
        plain.update(x, x, 0)
    assert plain.get_seq_length(0) == 0
    y = x.float()
    y[0, 1, 5, 8] = 70000.0  # beyond fp16: not even an outlier record holds it
    with pytest.raises(ValueError, match="entries above 65504"):
        kvq.KVCache("hqmq-5").update(y, y, 0)
