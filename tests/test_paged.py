"""kvq.PagedKVCache and the paged ops (paged_append, paged_decode_plan, paged_decode_attention,
paged_decode_attention_hqmq).

References: the stored K/V of a sequence equal a pure-PyTorch group quantization of its whole
pages plus its full-precision tail (tests/reference/quant_reference.py) -- for HQMQ pages, the
contiguous cache's encoding of the same tokens, bit for bit -- and the attention equals fp32
softmax attention over those stored K/V, sequence by sequence."""
import dataclasses
import math

import pytest
import torch

import kvquant_ext as kvq
from conftest import CUDA, MMA_HEAD_DIMS, requires_cuda
from reference import hqmq_reference as hq_ref
from reference.quant_reference import dequantize_ref, quantize_ref, unpack_ref

DEVICES = ["cpu"] + (["cuda"] if CUDA else [])
GROUP_PRESETS = ["kivi-2", "kivi-4", "kcvt-4", "int4-per-token", "int2-per-token", "flexgen-4"]
PRESETS = GROUP_PRESETS + ["fp16"]
HQMQ_PRESETS = ["hqmq-3.79-paper", "hqmq-3.79"]  # pages compressed when full / past a 128-token window


def make_kv(n, H, T, D, dtype, device, gen=None):
    """Structured data: channel offsets and a few outlier channels (keys), heavy rows (values)."""
    x = torch.randn(n, H, T, D, generator=gen)
    x += torch.linspace(-2, 2, D)  # per-channel offsets
    x[..., ::17] *= 6.0  # outlier channels
    return x.to(dtype).to(device)


def page_spec(preset, P, D):
    cfg = kvq.get_config(preset)
    out = []
    for spec in (cfg.key_spec(), cfg.value_spec()):
        g = spec.group_size
        g = (P if spec.per_channel else D) if g == -1 else g
        out.append((spec.bits, g, spec.per_channel))
    return out


def expected_kv(preset, k, v, P):
    """What the paged cache stores for one sequence [1, H, T, D]: whole pages quantized page by
    page (pure PyTorch), the tail in full precision."""
    T, D = k.shape[2], k.shape[3]
    if preset == "fp16":
        return k, v
    tc = T - T % P
    res = []
    for x, (bits, g, pc) in zip((k, v), page_spec(preset, P, D)):
        if tc == 0:
            res.append(x)
            continue
        pages = x[:, :, :tc].float().reshape(x.shape[1], tc // P, P, D).transpose(0, 1)  # [pages, H, P, D]
        codes, s, z = quantize_ref(pages.to(x.dtype), bits, g, pc)
        deq = dequantize_ref(codes, s, z, pc).to(x.dtype)  # [pages, H, P, D]
        deq = deq.transpose(0, 1).reshape(1, x.shape[1], tc, D)
        res.append(torch.cat([deq, x[:, :, tc:]], dim=2))
    return res[0], res[1]


def attention_ref(q, K, V, scale):
    """q [Hq, D], K/V [H, T, D] -> out [Hq, D], lse [Hq] (fp32)."""
    H, T, D = K.shape
    g = q.shape[0] // H
    if T == 0:
        return torch.zeros(q.shape), torch.full((q.shape[0],), -math.inf)
    qq = q.float().view(H, g, D)
    sc = torch.einsum("hgd,htd->hgt", qq, K.float()) * scale
    out = torch.einsum("hgt,htd->hgd", sc.softmax(-1), V.float())
    return out.reshape(-1, D), torch.logsumexp(sc, -1).reshape(-1)


def build(preset, lens, H, D, dtype, device, P=128, chunks=(None,), max_tokens=None, gen=None):
    """A cache with sequences of the given lengths, appended in prompt + decode steps."""
    cache = kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=H, head_dim=D,
                             max_tokens=max_tokens or max(64, sum(lens) + P * len(lens)), dtype=dtype,
                             device=device, page_size=P, max_seqs=max(4, len(lens)))
    ids = [cache.add_sequence() for _ in lens]
    data = {}
    for sid, L in zip(ids, lens):
        k = make_kv(1, H, L, D, dtype, device, gen)
        v = make_kv(1, H, L, D, dtype, device, gen)
        data[sid] = (k, v)
        pre = L if chunks[0] is None else min(L, chunks[0])
        cache.append(0, [sid], k[:, :, :pre], v[:, :, :pre])
        for t in range(pre, L):
            cache.append(0, [sid], k[:, :, t:t + 1], v[:, :, t:t + 1])
    return cache, ids, data


def check_attention(cache, ids, D, Hq, dtype, device, tol):
    q = torch.randn(len(ids), Hq, D).to(dtype).to(device)
    out, lse = cache.decode_attention(q, 0, ids, return_lse=True)
    assert out.shape == q.shape and out.dtype == dtype and lse.shape == (len(ids), Hq)
    for i, sid in enumerate(ids):
        K, V = cache.dequantize(0, sid)
        ref, ref_lse = attention_ref(q[i].cpu(), K[0].cpu(), V[0].cpu(), D ** -0.5)
        err = (out[i].float().cpu() - ref).norm() / ref.norm().clamp_min(1e-6)
        assert err < tol, f"seq {i} (len {cache.seq_len(sid)}): relative error {err:.2e}"
        if cache.seq_len(sid) == 0:
            assert torch.equal(out[i].cpu(), torch.zeros_like(out[i].cpu()))
            assert torch.isinf(lse[i].cpu()).all()
        else:
            assert torch.allclose(lse[i].float().cpu(), ref_lse, atol=2e-3, rtol=1e-3)


# ----------------------------------------------------------------------------- storage
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("L", [1, 127, 128, 129, 1000])
@pytest.mark.parametrize("chunks", [(None,), (5,)])
def test_stored_kv_equals_pagewise_quantization(preset, L, chunks):
    """Prompt or token-by-token, every odd length: whole pages hold the page-wise quantization,
    the tail is exact, and nbytes counts pages + full-precision tokens."""
    cache, ids, data = build(preset, [L], 2, 64, torch.float16, "cpu", chunks=chunks)
    K, V = cache.dequantize(0, ids[0])
    k, v = data[ids[0]]
    eK, eV = expected_kv(preset, k, v, 128)
    assert K.shape == k.shape and V.shape == v.shape
    torch.testing.assert_close(K, eK, rtol=0, atol=2e-3 * float(k.abs().max()))
    torch.testing.assert_close(V, eV, rtol=0, atol=2e-3 * float(v.abs().max()))
    tc = L - L % 128
    assert torch.equal(K[:, :, tc:], k[:, :, tc:]) and torch.equal(V[:, :, tc:], v[:, :, tc:])
    assert cache.seq_len(ids[0]) == L
    if preset == "fp16":
        assert cache.nbytes == 2 * k.numel() * 2
    else:
        (kb, kg, kpc), (vb, vg, vpc) = page_spec(preset, 128, 64)
        page = 0
        for bits, g, pc in ((kb, kg, kpc), (vb, vg, vpc)):
            groups = (128 // g) * 64 if pc else 128 * (64 // g)
            page += 2 * (128 * 64 * bits // 8 + 2 * 2 * groups)
        assert cache.nbytes == (tc // 128) * page + (L - tc) * 2 * 64 * 2 * 2


# ----------------------------------------------------------------------------- attention
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", PRESETS + HQMQ_PRESETS)
@pytest.mark.parametrize("D", MMA_HEAD_DIMS)
@pytest.mark.parametrize("g", [1, 4, 8, 16])
def test_paged_attention_mixed_lengths(device, preset, D, g):
    """One launch over sequences of lengths 0, 1, P - 1, P, P + 1, 1000 (odd prompt/decode mix)."""
    lens = [1, 127, 128, 129, 1000, 0]
    dtype = torch.float16
    # token-by-token appends on one shape (the storage test covers them on every preset)
    cache, ids, _ = build(preset, lens, 2, D, dtype, device, chunks=(100,) if (D, g) == (64, 4) else (None,))
    check_attention(cache, ids, D, 2 * g, dtype, device, 5e-3 if device == "cuda" else 1e-3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_paged_attention_dtypes(device, dtype):
    cache, ids, _ = build("kivi-4", [300, 77], 2, 128, dtype, device)
    check_attention(cache, ids, 128, 8, dtype, device, 2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79-paper"])
def test_continuous_batching_page_reuse_no_leak(device, preset):
    """Sequences freed mid-stream return their pages; pages filled with NaN before reuse never
    reach a later sequence's output."""
    H, D = 2, 64
    cache = kvq.PagedKVCache(preset, num_layers=2, num_kv_heads=H, head_dim=D, max_tokens=1024,
                             device=device, page_size=128, max_seqs=4)
    a, b = cache.add_sequence(), cache.add_sequence()
    for sid, L in ((a, 600), (b, 300)):
        for layer in range(2):
            cache.append(layer, [sid], make_kv(1, H, L, D, torch.float16, device),
                         make_kv(1, H, L, D, torch.float16, device))
    cap = cache.capacity_bytes
    cache.free(a)
    with pytest.raises(KeyError):
        cache.append(0, [a], make_kv(1, H, 1, D, torch.float16, device), make_kv(1, H, 1, D, torch.float16, device))
    for layer in cache.layers:  # poison every free page
        for t in (layer.k_fp, layer.v_fp):
            t[layer.free_fp] = float("nan")
        for codes, *scales in layer.comp.values():  # (codes, scale, zero) or HQMQ's (packed rows,)
            for t in scales:
                t[layer.free_comp] = float("nan")
            if not scales:  # HQMQ: all-ones rows, i.e. garbage fields and a NaN radius scale
                codes[layer.free_comp] = -1
                if len(layer.free_comp):
                    cfg = kvq.get_config(preset)
                    sc = hq_ref.unpack_rows(codes[layer.free_comp[:1]].cpu(), D, cfg.secondary_size, cfg.radius_bits,
                                            strict=False)[2]
                    assert sc.isnan().all()
    c = cache.add_sequence()
    for layer in range(2):
        cache.append(layer, [c], make_kv(1, H, 700, D, torch.float16, device),
                     make_kv(1, H, 700, D, torch.float16, device))
        for _ in range(3):
            cache.append(layer, [b, c], make_kv(2, H, 1, D, torch.float16, device),
                         make_kv(2, H, 1, D, torch.float16, device))
    assert cache.capacity_bytes == cap
    for layer in range(2):
        q = torch.randn(2, 4 * H, D, dtype=torch.float16, device=device)
        out = cache.decode_attention(q, layer, [b, c])
        assert torch.isfinite(out).all()
    check_attention(cache, [b, c], D, 4 * H, torch.float16, device, 5e-3 if device == "cuda" else 1e-3)


def test_bad_input_leaves_pool_unchanged():
    cache = kvq.PagedKVCache("kivi-2", num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=256, page_size=128,
                             max_seqs=2)
    a = cache.add_sequence()
    k = make_kv(1, 2, 200, 64, torch.float16, "cpu")
    cache.append(0, [a], k, k)
    before = (cache.nbytes, cache.seq_len(a), [t.clone() for t in cache.layers[0].comp_tensors()])
    bad = [
        (ValueError, lambda: cache.append(0, [a], k[:, :1], k[:, :1])),  # wrong heads
        (TypeError, lambda: cache.append(0, [a], k.float(), k.float())),  # wrong dtype
        (ValueError, lambda: cache.append(0, [a], k, k[:, :, :3])),  # k / v disagree
        (KeyError, lambda: cache.append(0, [99], k, k)),  # unknown id
        (ValueError, lambda: cache.append(0, [a, a], torch.cat([k, k]), torch.cat([k, k]))),  # listed twice
        (RuntimeError, lambda: cache.append(0, [a], make_kv(1, 2, 300, 64, torch.float16, "cpu"),
                                            make_kv(1, 2, 300, 64, torch.float16, "cpu"))),  # pool exhausted
        (IndexError, lambda: cache.append(3, [a], k, k)),
        (ValueError, lambda: cache.decode_attention(torch.randn(1, 3, 64, dtype=torch.float16), 0, [a])),
        (TypeError, lambda: cache.decode_attention(torch.randn(1, 4, 64), 0, [a])),
    ]
    nan = k.clone()
    nan[0, 0, 5, 5] = float("nan")
    bad.append((ValueError, lambda: cache.append(0, [a], nan, k)))
    for exc, f in bad:
        with pytest.raises(exc):
            f()
    assert cache.nbytes == before[0] and cache.seq_len(a) == before[1]
    for t, u in zip(cache.layers[0].comp_tensors(), before[2]):
        assert torch.equal(t, u)
    with pytest.raises(RuntimeError):
        cache.add_sequence(), cache.add_sequence()
    with pytest.raises(NotImplementedError):
        kvq.PagedKVCache("gear-2", num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=256)
    with pytest.raises(ValueError, match="page_size"):
        kvq.PagedKVCache("kivi-2", num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=256, page_size=48)


# ----------------------------------------------------------------------------- ops
@pytest.mark.parametrize("device", DEVICES)
def test_plan_items_cover_every_token_once(device):
    gen = torch.Generator().manual_seed(1)
    lens = torch.randint(0, 70000, (37,), generator=gen, dtype=torch.int32)
    lens[::5] = 0
    comp = (lens // 128 * 128).to(torch.int32)
    for max_items in (2 * 37 + 2, 500, 4000):
        work = kvq.ops.paged_decode_plan(lens.to(device), comp.to(device), max_items).cpu()
        n_items, cc, cf = int(work[0]), int(work[1]), int(work[2])
        if device == "cuda":  # the device plan writes the host plan's list (entries past the items are unused)
            host = kvq.ops.paged_decode_plan(lens, comp, max_items)
            used = torch.zeros_like(work, dtype=torch.bool)
            used[:4] = True
            for j in range(3):
                used[4 + j * max_items:4 + j * max_items + n_items] = True
            used[4 + 3 * max_items:] = True
            assert torch.equal(work[used], host[used])
        assert n_items <= max_items and cc % 128 == 0 and cc >= 256 and cf % 32 == 0
        mi = max_items
        seq, t0, t1 = work[4:4 + mi], work[4 + mi:4 + 2 * mi], work[4 + 2 * mi:4 + 3 * mi]
        first, count = work[4 + 3 * mi:4 + 3 * mi + 37], work[4 + 3 * mi + 37:]
        for s in range(37):
            f, c = int(first[s]), int(count[s])
            assert torch.all(seq[f:f + c] == s)
            pos = 0
            for i in range(f, f + c):
                assert int(t0[i]) == pos and int(t1[i]) > pos
                # a range never mixes compressed and full-precision tokens
                assert int(t1[i]) <= int(comp[s]) or int(t0[i]) >= int(comp[s])
                pos = int(t1[i])
            assert pos == int(lens[s])


def op_args(preset):
    """(cache, the attention op, its arguments) over two sequences of a CPU cache."""
    cache, ids, _ = build(preset, [300, 5], 2, 64, torch.float16, "cpu")
    layer = cache.layers[0]
    bt, lens, comp = cache.batch_tables(0, ids)
    work = kvq.ops.paged_decode_plan(lens, comp, 40)
    q = torch.randn(2, 4, 64, dtype=torch.float16)
    if cache.hqmq is not None:
        return cache, torch.ops.kvq.paged_decode_attention_hqmq.default, (
            q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), bt, lens, comp, work, 4, 0.125)
    return cache, torch.ops.kvq.paged_decode_attention.default, (
        q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), bt, lens, comp, work, 2, True, False, 0.125)


@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79-paper"])
def test_ops_opcheck(preset):
    cache, op, args = op_args(preset)
    torch.library.opcheck(op, args)
    lens, comp = (args[8], args[9]) if preset.startswith("hqmq") else (args[10], args[11])  # after the block table
    torch.library.opcheck(torch.ops.kvq.paged_decode_plan.default, (lens, comp, 40))
    layer = cache.layers[0]
    k = torch.randn(3, 2, 64, dtype=torch.float16)
    slots = torch.tensor([5, 6, 7], dtype=torch.int64)
    torch.library.opcheck(torch.ops.kvq.paged_append.default,
                          (layer.k_fp.clone(), layer.v_fp.clone(), k, k, slots),
                          test_utils=("test_schema", "test_faketensor"))
    if preset == "kivi-2":  # with page compression: every compressed pool is mutated in place
        pools = tuple(t.clone() for t in layer.comp_tensors())
        torch.library.opcheck(torch.ops.kvq.paged_append.default,
                              (layer.k_fp.clone(), layer.v_fp.clone(), k, k, slots, *pools,
                               torch.tensor([1, 2]), torch.tensor([1, 0]), 2, True, False),
                              test_utils=("test_schema", "test_faketensor"))


def append_ref(k_fp, v_fp, k, v, slots):
    """paged_append's token write, one row at a time: a negative slot writes nothing."""
    kf, vf = k_fp.clone(), v_fp.clone()
    P = kf.shape[2]
    for n, s in enumerate(slots.tolist()):
        if 0 <= s < kf.shape[0] * P:
            kf[s // P, :, s % P] = k[n]
            vf[s // P, :, s % P] = v[n]
    return kf, vf


def rows_in_layout(N, H, D, dtype, device, layout, g):
    """[N, H, D] tokens: contiguous; heads strided (every other head of a wider tensor); last
    dim strided; or starting one element past a 16-byte boundary."""
    if layout == "contiguous":
        return torch.randn(N, H, D, generator=g).to(dtype).to(device)
    if layout == "head_strided":
        return torch.randn(N, 2 * H, D, generator=g).to(dtype).to(device)[:, ::2]
    if layout == "last_strided":
        return torch.randn(N, H, 2 * D, generator=g).to(dtype).to(device)[..., ::2]
    flat = torch.randn(N * H * D + 1, generator=g).to(dtype).to(device)
    return flat[1:].view(N, H, D)  # misaligned


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("D", [4, 64, 128])
@pytest.mark.parametrize("layout", ["contiguous", "head_strided", "last_strided", "misaligned"])
def test_paged_append_writes_each_row_to_its_slot(device, dtype, D, layout):
    g = torch.Generator().manual_seed(D + len(layout))
    pages, H, P, N = 7, 3, 16, 50
    k_fp = torch.randn(pages, H, P, D, generator=g).to(dtype).to(device)
    v_fp = torch.randn(pages, H, P, D, generator=g).to(dtype).to(device)
    slots = torch.randperm(pages * P, generator=g)[:N]
    slots[::7] = -1  # padding tokens
    slots = slots.to(device)
    k = rows_in_layout(N, H, D, dtype, device, layout, g)
    v = rows_in_layout(N, H, D, dtype, device, layout, g)
    want_k, want_v = append_ref(k_fp, v_fp, k, v, slots)
    kvq.ops.paged_append(k_fp, v_fp, k, v, slots)
    assert torch.equal(k_fp, want_k) and torch.equal(v_fp, want_v)


def test_paged_append_refuses_a_slot_past_the_pool_on_cpu():
    k_fp, v_fp = torch.zeros(2, 1, 16, 64), torch.zeros(2, 1, 16, 64)
    k = torch.ones(3, 1, 64)
    with pytest.raises(RuntimeError, match="slot_mapping.*entry 2 is 32, past the pool's 32 slots"):
        kvq.ops.paged_append(k_fp, v_fp, k, k, torch.tensor([0, 1, 32]))
    assert not k_fp.any() and not v_fp.any()  # refused before any row is written


@requires_cuda
def test_cuda_paged_append_skips_a_slot_past_the_pool():
    k_fp = torch.zeros(2, 1, 16, 64, device="cuda", dtype=torch.float16)
    v_fp = torch.zeros_like(k_fp)
    k = torch.ones(3, 1, 64, device="cuda", dtype=torch.float16)
    kvq.ops.paged_append(k_fp, v_fp, k, 2 * k, torch.tensor([0, 40, 17], device="cuda"))
    assert k_fp.sum().item() == 2 * 64 and v_fp.sum().item() == 4 * 64
    assert k_fp[0, 0, 0].eq(1).all() and k_fp[1, 0, 1].eq(1).all()


def compress_pools(bits, specs, pages, H, P, D, dtype, device, g):
    """Full-precision pools of structured random pages and compressed pools of a sentinel
    (codes -1, scale / zero 0x7777) in the layout of paged_append's compression."""
    fp = [make_kv(pages, H, P, D, torch.float32, "cpu", g).to(dtype).to(device) for _ in range(2)]
    comp = []
    for G, pc in specs:
        sshape = (pages, H, P // G, D) if pc else (pages, H, P, D // G)
        comp += [torch.full((pages, H, P, D * bits // 32), -1, dtype=torch.int32, device=device),
                 torch.full(sshape, 0x7777, dtype=torch.int16, device=device).view(torch.float16),
                 torch.full(sshape, 0x7777, dtype=torch.int16, device=device).view(torch.float16)]
    return fp, comp


COMPRESS_CASES = [  # bits, (key group, per channel), (value group, per channel)
    (2, (32, True), (32, False)),   # KIVI
    (4, (-1, True), (16, False)),   # KCVT keys: one group per page
    (8, (16, True), (-1, False)),   # 8-bit, a value group per token
    (4, (64, False), (32, False)),  # per-token keys
    (2, (8, False), (32, True)),    # groups narrower than a code word; per-channel values
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bits,kspec,vspec", COMPRESS_CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("P,D", [(32, 64), (128, 128), (64, 256)])
def test_paged_append_compresses_pages_as_the_reference_quantizes_them(device, bits, kspec, vspec, dtype, P, D):
    """Each listed pair's full-precision page is quantized into its compressed page exactly as the
    pure-PyTorch reference quantizes that page (codes, scales and zero points bit for bit); a
    pair into the scratch page 0 and the pages not listed are left alone."""
    g = torch.Generator().manual_seed(bits * 1000 + P + D)
    pages, H = 6, 2
    specs = [((P if pc else D) if G == -1 else G, pc) for G, pc in (kspec, vspec)]
    (k_fp, v_fp), comp = compress_pools(bits, specs, pages, H, P, D, dtype, device, g)
    v_fp[2, 1, 3:9] = 0.0  # a constant group: scale 0
    before = [t.clone() for t in comp]
    src = torch.tensor([3, 1, 4, 2], device=device)
    dst = torch.tensor([2, 0, 5, 1], device=device)
    none = torch.empty(0, H, D, dtype=dtype, device=device)
    kvq.ops.paged_append(k_fp, v_fp, none, none, torch.empty(0, dtype=torch.int64, device=device), *comp,
                         compress_src=src, compress_dst=dst, bits=bits, k_per_channel=specs[0][1],
                         v_per_channel=specs[1][1])
    for r, (fp, (G, pc)) in enumerate(zip((k_fp, v_fp), specs)):
        codes, scale, zero = comp[3 * r:3 * r + 3]
        for a, b in zip(src.tolist(), dst.tolist()):
            if b == 0:
                continue
            rc, rs, rz = quantize_ref(fp[a].cpu(), bits, G, pc)
            assert torch.equal(unpack_ref(codes[b].cpu(), bits), rc), (r, a, b)
            assert torch.equal(scale[b].cpu().view(torch.int16), rs.view(torch.int16)), (r, a, b)
            assert torch.equal(zero[b].cpu().view(torch.int16), rz.view(torch.int16)), (r, a, b)
        for untouched in (0, 3, 4):
            for t, t0 in zip(comp[3 * r:3 * r + 3], before[3 * r:3 * r + 3]):
                assert torch.equal(t[untouched].view(torch.int16 if t.dtype == torch.float16 else t.dtype),
                                   t0[untouched].view(torch.int16 if t.dtype == torch.float16 else t.dtype))


@requires_cuda
@pytest.mark.parametrize("bits,kspec,vspec", COMPRESS_CASES)
def test_cuda_paged_append_compression_equals_the_cpu(bits, kspec, vspec):
    """The CUDA page compression writes the CPU twin's pages bit for bit (fp16 pools, many
    pairs, pages of 128 tokens of D = 128), and skips pairs outside the pools."""
    g = torch.Generator().manual_seed(bits)
    pages, H, P, D = 40, 8, 128, 128
    specs = [((P if pc else D) if G == -1 else G, pc) for G, pc in (kspec, vspec)]
    (k_fp, v_fp), comp = compress_pools(bits, specs, pages, H, P, D, torch.float16, "cpu", g)
    src = torch.randperm(pages, generator=g)[:30]
    dst = torch.randperm(pages, generator=g)[:30]
    kw = dict(bits=bits, k_per_channel=specs[0][1], v_per_channel=specs[1][1])
    none = torch.empty(0, H, D, dtype=torch.float16)
    slots = torch.empty(0, dtype=torch.int64)
    comp_cuda = [t.cuda() for t in comp]
    kvq.ops.paged_append(k_fp, v_fp, none, none, slots, *comp, compress_src=src, compress_dst=dst, **kw)
    bad_src, bad_dst = torch.cat([src, torch.tensor([pages, 1])]), torch.cat([dst, torch.tensor([1, pages])])
    kvq.ops.paged_append(k_fp.cuda(), v_fp.cuda(), none.cuda(), none.cuda(), slots.cuda(), *comp_cuda,
                         compress_src=bad_src.cuda(), compress_dst=bad_dst.cuda(), **kw)
    for a, b in zip(comp, comp_cuda):
        assert torch.equal(a.view(torch.int16) if a.dtype == torch.float16 else a,
                           b.cpu().view(torch.int16) if b.dtype == torch.float16 else b.cpu())


def test_paged_append_refuses_pairs_outside_the_pools_on_cpu():
    (k_fp, v_fp), comp = compress_pools(2, [(32, True), (32, False)], 3, 1, 32, 64, torch.float16, "cpu",
                                        torch.Generator().manual_seed(0))
    before = [t.clone() for t in comp]
    none, slots = torch.empty(0, 1, 64, dtype=torch.float16), torch.empty(0, dtype=torch.int64)
    for src, dst, name in (([1, 3], [1, 2], "compress_src.*entry 1 is 3"),
                           ([1, 2], [-1, 2], "compress_dst.*entry 0 is -1")):
        with pytest.raises(RuntimeError, match=name):
            kvq.ops.paged_append(k_fp, v_fp, none, none, slots, *comp, compress_src=torch.tensor(src),
                                 compress_dst=torch.tensor(dst))
        assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) if a.dtype == torch.float16 else
                   torch.equal(a, b) for a, b in zip(comp, before))


def test_op_bad_block_table_is_refused_on_cpu():
    cache, ids, _ = build("kivi-2", [300], 2, 64, torch.float16, "cpu")
    layer = cache.layers[0]
    bt, lens, comp = cache.batch_tables(0, ids)
    work = kvq.ops.paged_decode_plan(lens, comp, 40)
    q = torch.randn(1, 4, 64, dtype=torch.float16)
    bt[0, 0] = 10 ** 6
    with pytest.raises(RuntimeError, match="block_table"):
        kvq.ops.paged_decode_attention(q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), bt, lens, comp, work, 2,
                                       True, False, 0.125)
    with pytest.raises(RuntimeError, match="max_items"):
        kvq.ops.paged_decode_plan(lens, comp, 3)


# ----------------------------------------------------------------------------- CUDA graphs
@requires_cuda
@pytest.mark.parametrize("preset", ["kivi-2", "fp16", "hqmq-3.79-paper"])
def test_cuda_graph_replay_across_lengths(preset):
    """plan + attention captured once; replays after appends (new lengths, new pages) equal eager calls."""
    H, D = 2, 128
    cache, ids, _ = build(preset, [500, 40, 1300], H, D, torch.float16, "cuda", max_tokens=8192)
    layer = cache.layers[0]
    mp = 32
    bt = torch.zeros((3, mp), dtype=torch.int32, device="cuda")
    lens = torch.zeros(3, dtype=torch.int32, device="cuda")
    comp = torch.zeros(3, dtype=torch.int32, device="cuda")
    q = torch.randn(3, 4 * H, D, dtype=torch.float16, device="cuda")
    mi = cache.default_max_items(3)

    def load():
        b, l, c = cache.batch_tables(0, ids)
        bt.zero_()
        bt[:, :b.shape[1]] = b
        lens.copy_(l)
        comp.copy_(c)

    def run():
        work = kvq.ops.paged_decode_plan(lens, comp, mi)
        if cache.hqmq is not None:
            return kvq.ops.paged_decode_attention_hqmq(q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), bt, lens, comp,
                                                       work, cache.hqmq.radius_bits, D ** -0.5)[0]
        return kvq.ops.paged_decode_attention(q, layer.k_fp, layer.v_fp, *layer.comp_tensors(), bt, lens, comp, work,
                                              2, True, False, D ** -0.5)[0]

    load()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            out = run()
    torch.cuda.current_stream().wait_stream(s)
    for step in range(4):
        cache.append(0, ids, make_kv(3, H, 70, D, torch.float16, "cuda"), make_kv(3, H, 70, D, torch.float16, "cuda"))
        load()
        q.copy_(torch.randn_like(q))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run()), f"replay {step}"


def test_one_plan_per_step_shared_by_layers(monkeypatch):
    """Layers appended in lockstep share the block tables and the plan of a step; a layer that
    is ahead gets its own (and its own results)."""
    H, D, L = 2, 64, 3
    cache = kvq.PagedKVCache("kivi-2", num_layers=L, num_kv_heads=H, head_dim=D, max_tokens=2048, page_size=128)
    ids = [cache.add_sequence(), cache.add_sequence()]
    calls = []
    real = kvq.ops.paged_decode_plan
    monkeypatch.setattr(kvq.ops, "paged_decode_plan", lambda *a: calls.append(1) or real(*a))
    q = torch.randn(2, 4 * H, D, dtype=torch.float16)
    for step, T in enumerate((300, 1, 1)):
        for layer in range(L):
            cache.append(layer, ids, make_kv(2, H, T, D, torch.float16, "cpu"), make_kv(2, H, T, D, torch.float16, "cpu"))
            cache.decode_attention(q, layer, ids)
        assert len(calls) == step + 1
    cache.append(0, ids, make_kv(2, H, 1, D, torch.float16, "cpu"), make_kv(2, H, 1, D, torch.float16, "cpu"))
    out0 = cache.decode_attention(q, 0, ids)
    out1 = cache.decode_attention(q, 1, ids)
    assert len(calls) == 4  # layer 1 still has the history of the last step: its tables are cached
    for layer, out in ((0, out0), (1, out1)):
        for i, sid in enumerate(ids):
            K, V = cache.dequantize(layer, sid)
            ref, _ = attention_ref(q[i], K[0], V[0], D ** -0.5)
            assert (out[i].float() - ref).norm() / ref.norm() < 1e-3
    assert cache.seq_len(ids[0], 0) == 303 and cache.seq_len(ids[0], 1) == 302


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", ["kivi-2", "int4-per-token"])
def test_recent_window_keeps_the_newest_tokens_exact(device, preset):
    """recent_window = W: the newest W .. W + P - 1 tokens stay in full-precision pages (a page is
    compressed once W newer tokens follow it), older pages hold the page-wise quantization;
    attention over the mix matches the reference and nbytes counts the window."""
    P, W, H, D = 128, 256, 2, 64
    cache = kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=4096, page_size=P,
                             recent_window=W, device=device, max_seqs=4)
    lens = [1, 300, 640, 1000]
    ids, data = [], []
    for L in lens:
        sid = cache.add_sequence()
        k, v = make_kv(1, H, L, D, torch.float16, device), make_kv(1, H, L, D, torch.float16, device)
        cache.append(0, [sid], k[:, :, :L - 3], v[:, :, :L - 3])
        for t in range(L - 3, L):  # the last tokens one by one
            cache.append(0, [sid], k[:, :, t:t + 1], v[:, :, t:t + 1])
        ids.append(sid)
        data.append((k, v))
    nbytes = 0
    for sid, L, (k, v) in zip(ids, lens, data):
        tc = max(0, L - W) // P * P
        K, V = cache.dequantize(0, sid)
        assert torch.equal(K[:, :, tc:], k[:, :, tc:]) and torch.equal(V[:, :, tc:], v[:, :, tc:])
        assert L - tc >= min(L, W)
        eK, eV = expected_kv(preset, k[:, :, :tc].cpu(), v[:, :, :tc].cpu(), P)
        torch.testing.assert_close(K[:, :, :tc].cpu(), eK, rtol=0, atol=2e-3 * float(k.abs().max()))
        nbytes += (L - tc) * 2 * H * D * 2
    (kb, kg, kpc), (vb, vg, vpc) = page_spec(preset, P, D)
    page = sum(H * (P * D * b // 8 + 2 * 2 * ((P // g) * D if pc else P * (D // g)))
               for b, g, pc in ((kb, kg, kpc), (vb, vg, vpc)))
    nbytes += sum(max(0, L - W) // P for L in lens) * page
    assert cache.nbytes == nbytes
    check_attention(cache, ids, D, 4 * H, torch.float16, device, 5e-3 if device == "cuda" else 1e-3)
    with pytest.raises(ValueError, match="recent_window"):
        kvq.PagedKVCache(preset, num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=256, recent_window=100)


# ----------------------------------------------------------------------------- HQMQ pages
@pytest.mark.parametrize("preset", HQMQ_PRESETS)
@pytest.mark.parametrize("D", [32, 64, 128, 256])
@pytest.mark.parametrize("L", [1, 127, 128, 129, 1000])
def test_hqmq_pages_hold_the_contiguous_encoding(preset, D, L):
    """HQMQ encodes every token on its own: a compressed page decodes bit for bit to what the
    contiguous cache (same secondary sets) stores for those tokens, the newer tokens are exact,
    and nbytes counts the pages' codes and scales, the full-precision tokens and the sets."""
    cache, ids, data = build(preset, [L], 2, D, torch.float16, "cpu", chunks=(50,))
    k, v = data[ids[0]]
    tc = cache._comp_pages_at(L) * 128
    K, V = cache.dequantize(0, ids[0])
    ref = kvq.KVCache(dataclasses.replace(kvq.get_config(preset), recent_window=0))
    ref.update(k, v, 0)
    rK, rV = ref.dequantize(0)
    assert torch.equal(K[:, :, :tc], rK[:, :, :tc]) and torch.equal(V[:, :, :tc], rV[:, :, :tc])
    assert torch.equal(K[:, :, tc:], k[:, :, tc:]) and torch.equal(V[:, :, tc:], v[:, :, tc:])
    U = kvq.ops.hqmq_units(D, 96, 4)
    assert U == {64: 16, 128: 31}.get(D, U)
    layer = cache.layers[0]
    pages = layer.seqs[ids[0]].comp_pages
    assert len(pages) == tc // 128
    for role, x in (("k", k), ("v", v)):
        pool, = layer.comp[role]  # HQMQ pools: (packed rows,)
        assert pool.dtype == torch.int16 and pool.shape[1:] == (2, 128, U)
        if tc:
            # the pages hold, bit for bit, the contiguous encoding of the same tokens
            codes, _ = kvq.hqmq_encode(x[:, :, :tc], layer.secondary[role], 4)
            stored = pool[pages].transpose(0, 1).reshape(1, 2, tc, U)
            assert torch.equal(stored, codes)
            hq_ref.unpack_rows(stored, D, 96, 4, strict=True)
            rs = getattr(ref.layers[0], "key" if role == "k" else "value")
            assert torch.equal(stored, rs.codes.view()[:, :, :tc])
    sec = 2 * 2 * 96 * 4 * 4 if tc else 0  # both roles' [H, S, 4] fp32 sets
    assert cache.nbytes == (tc // 128) * 2 * 2 * 128 * 2 * U + (L - tc) * 2 * 2 * D * 2 + sec


HQMQ_FORMATS = {  # the kernel's launch formats: F = 16 / b_r = 4, R = 9 (fast path), runtime layouts
    "hqmq-3.79-paper": "hqmq-3.79-paper",
    "F16-rb5": kvq.HQMQConfig(secondary_size=48, radius_bits=5),  # 11-bit directions + 5 radius bits (FMT 0)
    "F19-rb6": kvq.HQMQConfig(secondary_size=192, radius_bits=6),  # E = 15, R = 9 (FMT 2)
    "R12-rb3": kvq.HQMQConfig(secondary_size=64, radius_bits=3),  # R = 12: 4 digits per group (FMT 0)
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fmt", list(HQMQ_FORMATS))
@pytest.mark.parametrize("P,D", [(32, 32), (32, 64), (32, 128), (32, 256), (256, 64), (256, 128)])
def test_hqmq_pages_tile_paths(device, fmt, P, D):
    """Every field format and page size: whole 32-token tiles of compressed pages (a tile is a
    page at P = 32), the partial tiles and full-precision tokens after them, GQA 4 and 8, equal the
    attention over what the pages store."""
    cache, ids, _ = build(HQMQ_FORMATS[fmt], [1, 40, 95, 300, 1000, 0], 2, D, torch.float16, device, P=P,
                          chunks=(200,))
    for g in (4, 8):
        check_attention(cache, ids, D, 2 * g, torch.float16, device, 5e-3 if device == "cuda" else 1e-3)


@requires_cuda
@pytest.mark.parametrize("D", [64, 128, 256])
def test_cuda_hqmq_pages_equal_the_contiguous_kernel(D):
    """Sequences of whole pages: the paged op and the contiguous HQMQ kernel run the same
    tensor-core tile loop over the same codes, so they agree to the rounding of their different
    split boundaries."""
    H, Hq, P = 8, 32, 128
    cfg = dataclasses.replace(kvq.get_config("hqmq-3.79-paper"), recent_window=0)
    lens = [4096, 1024, 2048]
    cache = kvq.PagedKVCache(cfg, num_layers=1, num_kv_heads=H, head_dim=D, max_tokens=sum(lens) + P,
                             device="cuda", page_size=P, max_seqs=4)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(len(lens), Hq, D, generator=gen).half().cuda()
    ids = [cache.add_sequence() for _ in lens]
    outs = []
    for i, (sid, L) in enumerate(zip(ids, lens)):
        k = make_kv(1, H, L, D, torch.float16, "cuda", gen)
        v = make_kv(1, H, L, D, torch.float16, "cuda", gen)
        cache.append(0, [sid], k, v)
        ref = kvq.KVCache(cfg)  # the same secondary sets (seeded per layer and role)
        ref.update(k, v, 0)
        outs.append(kvq.decode_attention(q[i:i + 1], ref, 0))
    out = cache.decode_attention(q, 0, ids)
    for i in range(len(lens)):
        err = (out[i].float() - outs[i][0].float()).norm() / outs[i].float().norm()
        assert err < 2e-3, f"seq {i}: paged vs contiguous relative error {err:.2e}"


@pytest.mark.parametrize("big", [40000.0, 30752.0])  # chunk norms 80000 and 61504
def test_hqmq_pages_refuse_chunk_norms_their_scales_cannot_hold(big):
    """Every entry finite and below 65504, but a chunk norm above 61440 (kvq.hqmq.MAX_SCALE, what
    the packed radius scale is guaranteed to hold): the append is refused (as the contiguous cache
    refuses it) and changes nothing; a chunk norm of exactly 61440 is taken."""
    cache = kvq.PagedKVCache("hqmq-3.79-paper", num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=512)
    sid = cache.add_sequence()
    k = make_kv(1, 2, 200, 64, torch.float16, "cpu")
    bad = k.clone()
    bad[0, 1, 150, 4:8] = big
    before = [t.clone() for t in cache.layers[0].comp_tensors()]
    with pytest.raises(ValueError, match="argument 'v'.*chunks with norm above 61440"):
        cache.append(0, [sid], k, bad)
    with pytest.raises(ValueError, match="argument 'k'.*chunks with norm above 61440"):
        cache.append(0, [sid], bad, k)
    assert cache.seq_len(sid) == 0
    assert all(torch.equal(a, b) for a, b in zip(cache.layers[0].comp_tensors(), before))
    with pytest.raises(ValueError, match="argument 'value'.*chunks with norm above 61440"):
        kvq.KVCache("hqmq-3.79-paper").update(k, bad, 0)
    ok = k.clone()
    ok[0, 1, 100, 4:8] = 30720.0  # norm exactly 61440
    cache.append(0, [sid], ok, k)
    assert cache.seq_len(sid) == 200
    K, _ = cache.dequantize(0, sid)
    assert torch.isfinite(K).all()
    assert float(K[0, 1, 100, 4:8].float().norm()) == pytest.approx(61440.0, rel=2e-3)


def test_hqmq_med3x_pages_are_refused():
    with pytest.raises(NotImplementedError, match="outlier_factor"):
        kvq.PagedKVCache("hqmq-5", num_layers=1, num_kv_heads=2, head_dim=64, max_tokens=256)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_hqmq_paged_attention_dtypes(device, dtype):
    cache, ids, _ = build("hqmq-3.79-paper", [300, 77, 0], 2, 128, dtype, device)
    check_attention(cache, ids, 128, 8, dtype, device, 2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_hqmq_op_bad_input():
    _, op, args = op_args("hqmq-3.79-paper")
    q, k_fp, v_fp, kc, ksec, vc, vsec, bt, lens, comp, work = args[:11]
    assert kc.dtype == torch.int16 and kc.shape[-1] == kvq.ops.hqmq_units(64, 96, 4)
    with pytest.raises(RuntimeError, match="'k_codes'.*16-bit units"):  # units of another format
        op(q, k_fp, v_fp, kc[..., :-1].contiguous(), ksec, vc, vsec, bt, lens, comp, work, 4, 0.1)
    with pytest.raises(RuntimeError, match="'k_codes'.*17 16-bit units"):  # radius bits 5: U = 17
        op(q, k_fp, v_fp, kc, ksec, vc, vsec, bt, lens, comp, work, 5, 0.1)
    with pytest.raises(RuntimeError, match="'k_codes'.*dtype"):  # the old int32 words
        op(q, k_fp, v_fp, kc.int(), ksec, vc, vsec, bt, lens, comp, work, 4, 0.1)
    with pytest.raises(RuntimeError, match="radius_bits"):
        op(q, k_fp, v_fp, kc, ksec, vc, vsec, bt, lens, comp, work, 9, 0.1)
    with pytest.raises(RuntimeError, match="v_secondary"):
        op(q, k_fp, v_fp, kc, ksec, vc, vsec[:1].contiguous(), bt, lens, comp, work, 4, 0.1)
    with pytest.raises(RuntimeError, match="v_codes"):  # not contiguous
        op(q, k_fp, v_fp, kc, ksec, vc.transpose(0, 1).contiguous().transpose(0, 1), vsec, bt, lens, comp,
           work, 4, 0.1)
    bad = bt.clone()
    bad[0, 0] = kc.shape[0]  # not a compressed page
    with pytest.raises(RuntimeError, match="block_table"):
        op(q, k_fp, v_fp, kc, ksec, vc, vsec, bad, lens, comp, work, 4, 0.1)


# ----------------------------------------------------------------------------- skip_layers
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79-paper"])
def test_skip_layers_keep_their_layers_in_full_precision(device, preset):
    """skip_layers=(0, -1): the first and last layers hold every token exactly in full-precision
    pages, the middle one is stored as without skip_layers; nbytes is the sum; each layer attends
    over what it stores (the layers' tables and plans are not shared across formats)."""
    H, D, L, lens = 2, 64, 3, [300, 129]
    cfg = dataclasses.replace(kvq.get_config(preset), skip_layers=(0, -1))
    kw = dict(num_layers=L, num_kv_heads=H, head_dim=D, max_tokens=2048, device=device, page_size=128)
    cache, plain = kvq.PagedKVCache(cfg, **kw), kvq.PagedKVCache(preset, **kw)
    ids = [cache.add_sequence() for _ in lens]
    pids = [plain.add_sequence() for _ in lens]
    data = {}
    for i, T in enumerate(lens):
        k, v = make_kv(1, H, T, D, torch.float16, device), make_kv(1, H, T, D, torch.float16, device)
        data[i] = (k, v)
        for layer in range(L):
            cache.append(layer, [ids[i]], k, v)
            plain.append(layer, [pids[i]], k, v)
    for i in range(len(lens)):
        k, v = data[i]
        for layer in (0, 2):
            K, V = cache.dequantize(layer, ids[i])
            assert torch.equal(K, k) and torch.equal(V, v)
        K, V = cache.dequantize(1, ids[i])
        pK, pV = plain.dequantize(1, pids[i])
        assert torch.equal(K, pK) and torch.equal(V, pV) and not torch.equal(K, k)
    fp_layer = sum(2 * H * T * D * 2 for T in lens)
    assert cache.nbytes == 2 * fp_layer + plain.nbytes // L
    assert cache.layers[0].comp is None and cache.layers[1].comp is not None
    q = torch.randn(len(lens), 4 * H, D).to(torch.float16).to(device)
    for layer in range(L):
        out = cache.decode_attention(q, layer, ids)
        for i in range(len(lens)):
            K, V = cache.dequantize(layer, ids[i])
            ref, _ = attention_ref(q[i].cpu(), K[0].cpu(), V[0].cpu(), D ** -0.5)
            err = (out[i].float().cpu() - ref).norm() / ref.norm()
            assert err < (5e-3 if device == "cuda" else 1e-3), (layer, i, float(err))


# ----------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("preset", ["kivi-2", "hqmq-3.79-paper", "fp16"])
def test_decode_step_compiles_fullgraph(preset):
    """One engine decode step -- write a token per sequence by slot (paged_append), plan, attend --
    traces into one graph (torch.compile fullgraph, aot_eager: the ops' fake implementations and
    mutation annotations) and gives the eager step's pools and outputs."""
    cache, ids, _ = build(preset, [300, 57], 2, 64, torch.float16, "cpu")
    layer = cache.layers[0]
    bt, lens, comp = cache.batch_tables(0, ids)
    P = cache.page_size
    slot = torch.tensor([layer.seqs[s].fp_pages[-1] * P + layer.seqs[s].length % P for s in ids])
    k = torch.randn(2, 2, 64).half()
    q = torch.randn(2, 8, 64).half()
    mi = cache.default_max_items(2)

    def step(k_fp, v_fp, q, k, slot, bt, lens, comp):
        kvq.ops.paged_append(k_fp, v_fp, k, k, slot)
        work = kvq.ops.paged_decode_plan(lens + 1, comp, mi)
        if cache.hqmq is not None:
            return kvq.ops.paged_decode_attention_hqmq(q, k_fp, v_fp, *layer.comp_tensors(), bt, lens + 1, comp, work,
                                                       cache.hqmq.radius_bits, 0.125)
        return kvq.ops.paged_decode_attention(q, k_fp, v_fp, *layer.comp_tensors(), bt, lens + 1, comp, work, 2,
                                              True, False, 0.125)

    pools = (layer.k_fp.clone(), layer.v_fp.clone())
    want = step(*pools, q, k, slot, bt, lens, comp)
    got_pools = (layer.k_fp.clone(), layer.v_fp.clone())
    got = torch.compile(step, fullgraph=True, backend="aot_eager")(*got_pools, q, k, slot, bt, lens, comp)
    assert torch.equal(got_pools[0], pools[0]) and torch.equal(got_pools[1], pools[1])
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
