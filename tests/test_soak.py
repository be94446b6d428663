"""Soak: one long streaming run of a ``kvq.KVCache`` layer per method family, on the CPU, and
the same run on CUDA in lock-step with the CPU (``test_soak_cuda_equals_cpu``).

Families and totals (B = H = 1, fp16; D = 64, HQMQ at D = 32, the smallest head dim, because
its codebook search costs ~10x a group quantization per token): fp16, kivi-2, kcvt-4,
int4-per-token, gear-2, gearl-2, hqmq-3.79 and hqmq-5 (Med3x records and their index), 100k
tokens each (the whole file: ~35 s on this 2-core machine with other jobs running).  Tokens
arrive in a fixed mix of 1-token decode steps and chunks of 2..300 tokens (~30 per append on
average).  At each of the ``CHECKPOINTS`` checkpoints, for keys and values:

* ``nbytes`` equals the sum of the stream's stored tensors and the layout's count
  (``test_fuzz.expected_stream_nbytes``: codes, scales, zeros, residual / buffer, outliers,
  corrections, tile offsets, factors, HQMQ records, secondary sets, Med3x threshold and index),
  and the compressed part costs exactly the method's bits per element (``figure_bits``; GEAR:
  the prefill block plus the decode-block figure per block; HQMQ-5: plus 128 bits per record);
* the tokens appended since the previous checkpoint dequantize within the method's bound
  (group quantization: scale/2 per entry with the reference's scales; GEAR: outliers exact and
  ||x - x^||_F <= ||scale/2||_F per block; HQMQ: the per-chunk bound; full-precision windows
  exact), read from the stored tensors' tail;
* memory stays flat: every growable buffer holds at most twice the rows it uses (+ its first
  allocation), the full-precision window stays within the method's, and the bytes held per
  token are the figure above (no buffer grows beyond the tokens stored);
* per-append time does not grow with the length: the median time of the 1-token appends
  after the last checkpoint is at most 3x (+ 50 us) that after the first one.  The run uses one
  intra-op thread (restored afterwards): on a shared machine the pool's wake-ups cost whole
  scheduler slices, which would swamp what is measured.

At the end the whole layer dequantizes to finite values within the bound of every token.

On CUDA the same tokens stream into a CUDA cache and a CPU cache side by side; at every
checkpoint the two hold the same stored layout and bytes, the CUDA cache reconstructs the
interval's tokens with the CPU cache's error (within 3 %), its streams pass the same memory
checks as on the CPU, the device memory the process holds beyond the start is the cache's own
storage (up to 1 MiB of allocator rounding per storage; the ops' one-time workspaces are made
by a warm-up stream first), and the
fastest 1-token append (synchronised) of each interval obeys the same growth bound.
"""
from __future__ import annotations

import statistics
import time

import pytest
import torch

import kvquant_ext as kvq
from kvquant_ext.gear import GEARStream
from kvquant_ext.hqmq import HQMQStream
from kvquant_ext.streams import FullPrecisionStream, _QuantStream
from conftest import requires_cuda
from reference import hqmq_reference as hq_ref
from reference.quant_reference import expand_scale, quantize_ref
from test_fuzz import (check_gear_block, check_growables, compressed_bytes,
                       expected_stream_nbytes, gear_block_bytes, growables, hqmq_chunk_check,
                       nbytes_of, quant_bound, stream_spec, window_ok)

FAMILIES = {  # preset: (head dim, total tokens)
    "fp16": (64, 100_000),
    "kivi-2": (64, 100_000),
    "kcvt-4": (64, 100_000),
    "int4-per-token": (64, 100_000),
    "gear-2": (64, 100_000),
    "gearl-2": (64, 100_000),
    "hqmq-3.79": (32, 100_000),
    "hqmq-5": (32, 100_000),
}
CHECKPOINTS = 5
# 1-token decode steps mixed with chunks (prompts, chunked prefill): ~30 tokens per append
PATTERN = [1, 1, 1, 1, 5, 1, 17, 1, 1, 64, 1, 129, 1, 300, 1, 2, 33, 1, 1, 48]
GROWTH = 3.0     # allowed growth of the median 1-token append time, first -> last checkpoint
SLACK_S = 50e-6  # plus this much (timer and scheduler noise on a loaded machine)


@pytest.fixture
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def make_data(T: int, D: int, seed: int) -> torch.Tensor:
    """Cache-like fp16 tokens [1, 1, T, D]: Gaussian with per-channel offsets and scales and a
    few outlier channels (keys-like), plus rare large entries."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(1, 1, T, D, generator=g)
    x = x * (0.5 + torch.rand(1, 1, 1, D, generator=g)) + torch.randn(1, 1, 1, D, generator=g)
    x[..., ::13] *= 6.0
    spikes = torch.rand(1, 1, T, D, generator=g) < 1e-4
    x = torch.where(spikes, 40 * torch.randn(1, 1, T, D, generator=g), x)
    return x.half()


def figure_bits(cfg, role: str, D: int) -> float:
    """Bits per element of the method's steady-state compressed storage at head dim D, from its
    parameters (docs/ops.md): group quantization b + 32/G (fp16 scale + zero per group of G
    entries); GEAR one decode block of n_b tokens (backbone, outliers with values / indices /
    corrections / tile offsets, rank_decode factors); HQMQ 16 U / D (one packed row of U 16-bit
    units per token vector: codes and radius scale) plus, with Med3x, the outlier index's 64 bits per 32 tokens (records are
    data-dependent: 128 bits each, added by the caller)."""
    if isinstance(cfg, kvq.FP16Config):
        return 16.0
    if isinstance(cfg, kvq.HQMQConfig):
        U = hq_ref.units(D, cfg.secondary_size, cfg.radius_bits)
        return 16 * U / D + (64 / (32 * D) if cfg.outlier_factor is not None else 0.0)
    if isinstance(cfg, kvq.GEARConfig):
        nb = cfg.buffer_length
        return 8 * gear_block_bytes(cfg, role, nb, D, 2, cfg.rank_decode, stream=True) / (nb * D)
    spec = stream_spec(cfg, role)
    G = spec.group_size if spec.group_size != -1 else D
    return spec.bits + 32 / G


def test_figures_are_the_documented_ones():
    """The bits/element the soak holds the streams to, at D = 64 (D = 32 for HQMQ)."""
    f = lambda p, r, D=64: figure_bits(kvq.get_config(p), r, D)
    assert f("kivi-2", "key") == f("kivi-2", "value") == 3.0
    assert f("kcvt-4", "key") == 4 + 32 / 128 and f("kcvt-4", "value") == 4.5  # R = 128 block / token
    assert f("int4-per-token", "key") == f("int4-per-token", "value") == 4.5
    # gear-2 decode block, n_b = 128 tokens x 64 channels: codes 2, scale/zero 0.5, rank-2 fp16
    # factors 2*(128+64)*16/8192 = 0.75; keys 2 outliers per side and channel (2 % of 128
    # tokens; value, int16 index and correction, 48 bits each: 256*48/8192 = 1.5) and 12 int32
    # tile offsets (0.046875); values 1 per side and token (value, uint8 index, correction: 1.25)
    assert f("gear-2", "key") == 2 + 0.5 + 1.5 + 0.046875 + 0.75
    assert f("gear-2", "value") == 2 + 0.5 + 1.25 + 0.75
    assert f("gearl-2", "key") == 2 + 0.5 + 0.046875 + 0.75  # no outliers; the offsets stay
    # hqmq-3.79 at D = 32: 8 plain fields of E = 8 + 4 bits, one 16-bit group of 5 base-9 digits,
    # 3 tail digits in 10 bits, >= 8 scale bits: 130 -> 9 units (an exact 15-bit fp16 scale)
    assert f("hqmq-3.79", "key", 32) == 16 * 9 / 32
    # hqmq-5: E = 9 + 6: 120 + 16 + 10 + 8 = 154 -> 10 units (a 14-bit scale)
    assert f("hqmq-5", "key", 32) == 16 * 10 / 32 + 64 / 1024
    # and at D = 128 the documented 3.875 / 4.625
    assert f("hqmq-3.79", "key", 128) == 3.875 and f("hqmq-5", "key", 128) == 4.625 + 64 / 4096


def expected_compressed_bits(stream, cfg, role: str, D: int) -> float:
    """Bits of the compressed part: tokens x figure (+ GEAR's prefill block, + HQMQ's per-layer
    secondary sets, threshold, index end and records)."""
    if isinstance(stream, FullPrecisionStream):
        return 16.0 * stream.seq_len * D
    if isinstance(stream, _QuantStream):
        return figure_bits(cfg, role, D) * stream.quantized_len * D
    if isinstance(stream, GEARStream):
        pre = 8 * gear_block_bytes(cfg, role, stream.T0, D, 2, cfg.rank, stream=True) if stream.T0 else 0
        return pre + figure_bits(cfg, role, D) * stream.num_decode_blocks * cfg.buffer_length * D
    T = stream.codes.length  # encoded tokens
    bits = figure_bits(cfg, role, D) * T * D + 128 * stream._records().shape[0]
    bits += 128 * cfg.secondary_size  # secondary set of the one head
    if cfg.outlier_factor is not None:
        bits += 32 + 64  # threshold, the index's last offset
        bits += 64 * (-(-T // 32) - T / 32)  # the last, partial tile's offset
    return bits


def storages(stream) -> dict:
    """``{data_ptr: bytes}`` of every storage the stream's tensors live in (growable capacity,
    and whatever a view such as the residual keeps alive), each storage once."""
    seen = {}
    for t in list(stream.tensors().values()) + [g.buf for _, g in growables(stream)]:
        if t is not None:
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return seen


def allocated_bytes(stream) -> int:
    return sum(storages(stream).values())


def check_stream_memory(st, role: str) -> None:
    """Flat memory of one stream: growable buffers at most twice their rows, every storage its
    tensors live in within 2x its nbytes (+ 256 KiB), nothing held outside the stored tensors."""
    check_growables(st)
    assert allocated_bytes(st) <= 2 * st.nbytes + (1 << 18), (
        f"{role}: {allocated_bytes(st)} bytes allocated for {st.nbytes} stored")
    extra = untracked(st)
    assert sum(extra.values()) <= 4096, (f"{role}: {sum(extra.values())} bytes of tensors held "
                                         f"outside the stored ones: {sorted(extra)[:5]}...")


def untracked(stream):
    """Tensors the stream holds outside ``tensors()`` and its growable buffers (attributes,
    lists, dicts): ``{name: bytes}``.  Everything a stream keeps must be counted."""
    known = {t.untyped_storage().data_ptr() for t in stream.tensors().values() if t is not None}
    known |= {g.buf.untyped_storage().data_ptr() for _, g in growables(stream) if g.buf is not None}
    out = {}

    def walk(name, v):
        if isinstance(v, torch.Tensor):
            if v.untyped_storage().data_ptr() not in known:
                out[name] = v.untyped_storage().nbytes()
        elif isinstance(v, (list, tuple)):
            for j, w in enumerate(v):
                walk(f"{name}[{j}]", w)
        elif isinstance(v, dict):
            for k, w in v.items():
                walk(f"{name}[{k!r}]", w)

    for name, v in vars(stream).items():
        walk(name, v)
    return out


def check_tail(stream, cfg, role: str, x: torch.Tensor, start: int) -> None:
    """Tokens [start, T) of the stream dequantize within the method's bound of ``x`` (the
    appended tokens), decoded from the tail of the stored tensors only."""
    T = stream.seq_len
    if isinstance(stream, FullPrecisionStream):
        assert torch.equal(stream.data.view()[:, :, start:], x[:, :, start:T])
        return
    if isinstance(stream, _QuantStream):
        spec = stream_spec(cfg, role)
        nq = stream.quantized_len
        assert torch.equal(stream.residual, x[:, :, nq:T]), "the full-precision residual is not exact"
        G = spec.group_size if spec.per_channel else 1
        a = min(start, nq) // G * G  # whole stored groups
        if a == nq:
            return
        rows = slice(a // G, nq // G) if spec.per_channel else slice(a, nq)
        codes = stream.codes.view()[:, :, a:nq]
        scale, zero = stream.scale.view()[:, :, rows], stream.zero.view()[:, :, rows]
        ref = x[:, :, a:nq]
        _, rs, rz = quantize_ref(ref, spec.bits, spec.group_size, spec.per_channel)
        assert torch.equal(scale, rs) and torch.equal(zero, rz), "stored scales differ from the reference"
        out = kvq.dequantize(codes, scale, zero, spec.bits, spec.per_channel, torch.float32)
        s = expand_scale(rs, ref.shape, spec.per_channel)
        z = expand_scale(rz, ref.shape, spec.per_channel)
        err = (out - ref.float()).abs()
        assert bool((err <= quant_bound(ref, s, z, spec.bits)).all()), f"{role}: quantization error above scale/2"
        return
    if isinstance(stream, GEARStream):
        nc = stream.compressed_len
        assert torch.equal(stream.buffer, x[:, :, nc:T]), "the full-precision buffer is not exact"
        offs, blocks = stream.block_offsets, stream.blocks
        for off, blk in zip(offs, blocks):
            end = off + blk.shape[2]
            if end <= start:
                continue
            ref = x[:, :, off:end]
            check_gear_block(ref, blk.decompress(), blk)
        return
    if isinstance(stream, HQMQStream):
        nres = stream.residual_len if hasattr(stream, "residual_len") else 0
        nc = T - nres
        if nres:
            assert torch.equal(stream.residual, x[:, :, nc:T])
        a = min(start, nc)
        if a == nc:
            return
        rec = stream._records()
        rec = rec[rec[:, 0] >= a].clone()
        rec[:, 0] -= a
        codes = stream.codes.view()[:, :, a:nc]
        out = kvq.hqmq_decode(codes, stream.secondary, rec, cfg.radius_bits, x.shape[3], torch.float16)
        ref = x[:, :, a:nc]
        where = torch.ones(ref.shape[:-1] + (ref.shape[-1] // 4,), dtype=torch.bool)
        # the radius scales from the packed rows (reference unpack of the documented layout)
        scale = hq_ref.unpack_rows(codes, x.shape[3], cfg.secondary_size, cfg.radius_bits)[2]
        hqmq_chunk_check(ref, out, scale, cfg.radius_bits, where)
        return
    raise AssertionError(type(stream))  # pragma: no cover


@pytest.mark.parametrize("preset", list(FAMILIES))
def test_soak(preset, one_thread):
    """Long stream: byte accounting and bits/element, error of the newest tokens, flat memory and
    non-growing per-append time at every checkpoint (module docstring)."""
    cfg = kvq.get_config(preset)
    D, total = FAMILIES[preset]
    data = {"key": make_data(total, D, 1), "value": make_data(total, D, 2)}
    cache = kvq.KVCache(cfg)
    marks = [total * (i + 1) // CHECKPOINTS for i in range(CHECKPOINTS)]
    step_times = [[] for _ in marks]  # 1-token append times per checkpoint interval
    n, i, c, last = 0, 0, 0, 0
    while n < total:
        m = min(PATTERN[i % len(PATTERN)], total - n, marks[c] - n)
        i += 1
        k, v = data["key"][:, :, n:n + m], data["value"][:, :, n:n + m]
        t0 = time.perf_counter()
        cache.update(k, v, 0)
        dt = time.perf_counter() - t0
        if m == 1:
            step_times[c].append(dt)
        n += m
        if n < marks[c]:
            continue
        # ---- checkpoint
        layer = cache.layers[0]
        for role in ("key", "value"):
            st = getattr(layer, role)
            assert st.seq_len == n
            assert st.nbytes == nbytes_of(st.tensors().values())
            assert st.nbytes == expected_stream_nbytes(st, cfg, role), f"{role}: nbytes off the layout"
            got = 8 * compressed_bytes(st)
            want = expected_compressed_bits(st, cfg, role, D)
            assert abs(got - want) < 1e-6 * want, (
                f"{role} at {n} tokens: compressed part {got / (n * D):.4f} bits/element, "
                f"the method's figure gives {want / (n * D):.4f}")
            assert window_ok(st, cfg), f"{role}: full-precision window grew past the method's"
            check_stream_memory(st, role)
            check_tail(st, cfg, role, data[role], last)
        last = n
        c += 1
    check_append_time(step_times, total)
    K, V = cache.dequantize(0)
    for role, got in (("key", K), ("value", V)):
        assert got.shape == (1, 1, total, D) and torch.isfinite(got).all()
        check_tail(getattr(cache.layers[0], role), cfg, role, data[role], 0)


@requires_cuda
@pytest.mark.parametrize("preset", list(FAMILIES))
def test_soak_cuda_equals_cpu(preset, one_thread):
    """The soak stream on CUDA next to the CPU: the same stored layout and bytes, the tokens of
    every checkpoint interval reconstructed as well as the CPU twin does, flat device memory,
    non-growing per-append time (module docstring)."""
    cfg = kvq.get_config(preset)
    D, total = FAMILIES[preset]
    data = {"key": make_data(total, D, 1), "value": make_data(total, D, 2)}
    cpu, gpu = kvq.KVCache(cfg), kvq.KVCache(cfg)
    # one-time device allocations of the ops (cuBLAS / cuBLASLt workspaces of GEAR's power
    # iteration, the HQMQ secondary sets) are made by a short warm-up stream, not counted below
    warm = kvq.KVCache(cfg)
    for a in range(0, 600, 300):
        warm.update(data["key"][:, :, a:a + 300].cuda(), data["value"][:, :, a:a + 300].cuda(), 0)
    warm.update(data["key"][:, :, :1].cuda(), data["value"][:, :, :1].cuda(), 0)
    del warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    marks = [total * (i + 1) // CHECKPOINTS for i in range(CHECKPOINTS)]
    step_times = [[] for _ in marks]
    n, i, c, last = 0, 0, 0, 0
    while n < total:
        m = min(PATTERN[i % len(PATTERN)], total - n, marks[c] - n)
        i += 1
        k, v = data["key"][:, :, n:n + m], data["value"][:, :, n:n + m]
        cpu.update(k, v, 0)
        kc, vc = k.cuda(), v.cuda()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        gpu.update(kc, vc, 0)
        torch.cuda.synchronize()
        if m == 1:
            step_times[c].append(time.perf_counter() - t0)
        del kc, vc
        n += m
        if n < marks[c]:
            continue
        check_cuda_checkpoint(cpu, gpu, data, last, n, base)
        last = n
        c += 1
    # the fastest rather than the median: other processes' kernels time-share the device
    # (a parallel test run), and a synchronised step waits for their slices
    check_append_time(step_times, total, "CUDA ", min)


def check_cuda_checkpoint(cpu, gpu, data, last: int, n: int, base: int) -> None:
    """One checkpoint of the CUDA soak (a function, so that nothing it allocates outlives it)."""
    owned = {}
    for role in ("key", "value"):
        st = getattr(gpu.layers[0], role)
        check_stream_memory(st, role)
        owned.update({p: b for p, b in storages(st).items() if p})  # device storages (0: empty)
    # the device memory the process holds beyond the start is the cache's own storage; the
    # caching allocator rounds each block up and leaves a remainder below 1 MiB unsplit, so a
    # storage may occupy up to 1 MiB more than its bytes
    held = torch.cuda.memory_allocated() - base
    assert held <= sum(owned.values()) + (len(owned) + 1) * (1 << 20), (
        f"{held} bytes of CUDA memory held at {n} tokens; the cache's {len(owned)} storages hold "
        f"{sum(owned.values())} ({gpu.nbytes} stored)")
    assert gpu.nbytes == cpu.nbytes, (n, gpu.nbytes, cpu.nbytes)
    sc, sg = cpu.state_dict(), gpu.state_dict()
    assert sorted(sc) == sorted(sg), sorted(set(sc) ^ set(sg))
    for name, want in sc.items():
        got = sg[name]
        if not isinstance(want, torch.Tensor):
            assert got == want, (name, got, want)
            continue
        # GEAR's block counters ("meta") stay on the host by design: no sync to read them
        host = name.endswith(".meta")
        assert got.device.type == ("cpu" if host else "cuda") and got.dtype == want.dtype and \
            got.shape == want.shape, (name, got.device, got.dtype, tuple(got.shape), want.dtype, tuple(want.shape))
        if host:
            assert torch.equal(got, want), (name, got, want)
    # the CUDA kernels round like their CPU twins up to rare one-step code differences
    # (tests/test_group_quant.py, test_hqmq.py) and low-rank factors computed in another
    # order (test_gear.py): the same error on the same tokens
    for role in ("key", "value"):
        x = data[role][:, :, last:n].float()
        e_cpu = _rel_err(getattr(cpu.layers[0], role).dequantize_range(last, n), x)
        e_gpu = _rel_err(getattr(gpu.layers[0], role).dequantize_range(last, n).cpu(), x)
        assert e_gpu <= 1.03 * e_cpu + 1e-3, (role, n, e_gpu, e_cpu)


def check_append_time(step_times, total: int, what: str = "", stat=statistics.median) -> None:
    """The ``stat`` (median) 1-token append time after the last checkpoint is within the growth
    bound of that after the first one."""
    first, final = stat(step_times[0]), stat(step_times[-1])
    assert final <= GROWTH * first + SLACK_S, (
        f"{stat.__name__} 1-token {what}append took {first * 1e6:.0f} us after the first checkpoint "
        f"and {final * 1e6:.0f} us after the last ({total} tokens)")


def _rel_err(got: torch.Tensor, x: torch.Tensor) -> float:
    return ((got.float() - x).norm() / x.norm()).item()
