// Decode attention over a group-quantized KV cache (KIVI / KCVT / per-token INT / FlexGen)
// plus its full-precision residual: params and the CPU twin.  Torch-free.
//
// Token t of a layer (0 <= t < T) is read as
//   key:   t < k.Tq ? dequant(k store, t) : k.residual[t - k.Tq]
//   value: t < v.Tq ? dequant(v store, t) : v.residual[t - v.Tq]
// (keys and values have different quantized lengths under KIVI's streaming rule).
// out[b, hq] = softmax_t(scale * q[b, hq] . K[b, hq / g, t] + mask) . V[b, hq / g, t],
// g = Hq / H (GQA).  Fully masked rows produce zeros.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"
#include "kvq/quant/group_quant.h"

namespace kvq {
namespace attention {

/// \brief One role (keys or values) of a group-quantized cache layer.
struct QuantKV {
  const int32_t* codes = nullptr;  // [B, H, Tq, D * bits / 32], inner [Tq, W] contiguous
  const uint16_t* scale = nullptr;  // fp16; per-channel [B, H, Tq / G, D], per-token [B, H, Tq, D / G]
  const uint16_t* zero = nullptr;   // same shape/strides as scale
  int64_t codes_sb = 0, codes_sh = 0;  // batch / head strides of codes (elements)
  int64_t scale_sb = 0, scale_sh = 0;  // batch / head strides of scale and zero (elements)
  int64_t Tq = 0;                      // quantized tokens
  int64_t group = 1;                   // G (resolved)
  int bits = 2;
  bool per_channel = false;
  const void* residual = nullptr;  // [B, H, Tr, D] in the cache dtype, inner [Tr, D] contiguous
  int64_t res_sb = 0, res_sh = 0;
  int64_t Tr = 0;
};

/// \brief GEAR extras of one role, for one of the two segments of a GEAR layer: segment 0 is
/// the prefill block (tokens [0, T0)), segment 1 the decode blocks of nb tokens each, stored
/// concatenated (tokens [T0, Tq)).  Token t of a segment reads
///   xhat = backbone(t) + A[t] . B[c]  (low rank, r <= 8; fp32), then every outlier entry
///   (t, c) of the segment adds its stored correction d = v - xhat (so x[t, c] = v up to d's
///   rounding; decompression overwrites with v).  The corrections are computed once per
///   block when it is compressed (python/kvquant_ext/gear.py, outlier_corrections); the exact
///   outlier values are not read here.
/// Values (per-token vectors): entries [B, H, T_seg, 2k], index = channel, of `ibytes`
/// bytes (uint8 / int16 / int32).  Keys (per-channel vectors), sorted by token for the
/// kernel: [B, H, nblk, M] entries (M = D 2k per block), int16 index (token mod 32) << 8 |
/// channel, and `off` [B, H, nblk, tiles + 1] int32: the entries of 32-token tile j of a block
/// are [off[j], off[j + 1]) (CUDA reads a 16-byte aligned window of 8 offsets: rows padded to
/// a multiple of 4 with 4 spare entries, see gear_off_len).  Corrections `od` in the cache
/// dtype, entry for entry in the layout of the indices (own strides, contiguous last dim).
struct GearSeg {
  const uint16_t* A = nullptr;  // fp16 [B, H, T_seg, r]
  const uint16_t* Bf = nullptr;  // fp16 [B, H, D, r] (segment 0) or [B, H, nblk, D, r]
  int64_t A_sb = 0, A_sh = 0, B_sb = 0, B_sh = 0, B_sblk = 0;
  int r = 0;
  const void* od = nullptr;  // outlier corrections v - xhat (cache dtype), one per index
  const void* oi = nullptr;  // outlier indices
  int64_t o_sb = 0, o_sh = 0, o_sblk = 0;  // batch / head / block (keys) strides of oi
  int64_t d_sb = 0, d_sh = 0, d_sblk = 0;  // the same of od
  int k = 0;                               // entries per side (2k per vector)
  int ibytes = 1;
  const int32_t* off = nullptr;            // keys: per-tile entry offsets (rows of off_len >= tiles + 1)
  int64_t f_sb = 0, f_sh = 0, f_sblk = 0;  // their batch / head / block strides
  int64_t off_len = 0;
};
struct GearKV {
  GearSeg seg[2];
};

/// Row length of the key outlier tile offsets the CUDA kernel needs for a block of T tokens.
KVQ_HOST_DEVICE int64_t gear_off_len(int64_t T) { return ((T + 31) / 32 + 1 + 3) / 4 * 4 + 4; }

KVQ_HOST_DEVICE int64_t gear_index(const void* oi, int ibytes, int64_t off) {
  return ibytes == 1 ? (int64_t) static_cast<const uint8_t*>(oi)[off]
                     : ibytes == 2 ? (int64_t) static_cast<const int16_t*>(oi)[off]
                                   : (int64_t) static_cast<const int32_t*>(oi)[off];
}
/// A[t] . B[c] of segment s (token t within the segment, block `blk` of segment 1).
KVQ_HOST_DEVICE float gear_lowrank(const GearSeg& s, int64_t b, int64_t h, int64_t t, int64_t blk, int64_t c) {
  const uint16_t* a = s.A + b * s.A_sb + h * s.A_sh + t * s.r;
  const uint16_t* bf = s.Bf + b * s.B_sb + h * s.B_sh + blk * s.B_sblk + c * s.r;
  float acc = 0.f;
  for (int j = 0; j < s.r; ++j) acc += half_bits_to_float(a[j]) * half_bits_to_float(bf[j]);
  return acc;
}

/// \brief Paged storage of a cache layer (paged_decode_attention.h): when `block_table` is
/// set, the batch index b of every QuantKV / residual address is a page id and token t of
/// sequence s lives in page block_table[s, t / P] at row t % P (P = 1 << page_shift): in the
/// compressed pool (QuantKV::codes / scale / zero, page stride codes_sb / scale_sb) for
/// t < comp_lens[s], in the full-precision pool (QuantKV::residual, page stride res_sb) for
/// comp_lens[s] <= t < seq_lens[s].  Lengths live on the device.
struct PagedKV {
  const int32_t* block_table = nullptr;  // [num_seqs, max_pages]
  int64_t bt_stride = 0;                 // elements between sequences' rows
  int page_shift = 5;
  const int32_t* seq_lens = nullptr;   // [num_seqs]
  const int32_t* comp_lens = nullptr;  // [num_seqs], multiples of P
  const int32_t* work = nullptr;       // CUDA: the plan (PagedWork layout), see paged_decode_attention.h
  int64_t max_items = 0;
  float* lse = nullptr;                // optional [num_seqs, Hq] log-sum-exp (natural log) of the scores
};

/// \brief Decode attention call.  Workspace holds split partials (CUDA only).
struct DecodeAttnParams {
  const void* q = nullptr;       // [B, Hq, D] contiguous, same dtype as the residuals
  void* out = nullptr;           // [B, Hq, D]
  const uint8_t* mask = nullptr;  // optional [B, T] (nonzero = attend), row stride mask_sb
  int64_t mask_sb = 0;
  QuantKV k, v;
  int64_t B = 0, H = 0, Hq = 0, D = 0, T = 0;
  int dtype_bytes = 2;  // of q, the residuals and GEAR outlier values
  float scale = 1.f;
  // GEAR layers (gear = true): k and v are the concatenated backbones of all blocks
  // (k.Tq == v.Tq), the residuals the full-precision buffers.
  bool gear = false;
  GearKV gk, gv;
  int64_t gear_t0 = 0, gear_nb = 1;  // prefill-block tokens; tokens per decode block
  // CUDA split-K workspace, B * Hq * splits * (D + 2) floats, 16-byte aligned (SplitWs in
  // decode_attention.cuh): acc [B * Hq, splits, D], then (m, l) [B * Hq, splits, 2]
  float* ws = nullptr;
  int splits = 0;
  PagedKV paged;  // paged layers only (B = num_seqs; T = the longest sequence bound)
};

/// \brief Dequantized element (b, h, t, c) of a quantized store (t < Tq).
KVQ_HOST_DEVICE float dequant_at(const QuantKV& s, int64_t b, int64_t h, int64_t t, int64_t c,
                                 int64_t D) {
  const int cpw = 32 / s.bits;
  const int64_t W = D * s.bits / 32;
  const uint32_t w = (uint32_t)s.codes[b * s.codes_sb + h * s.codes_sh + t * W + c / cpw];
  const uint32_t q = (w >> ((c % cpw) * s.bits)) & ((1u << s.bits) - 1u);
  const int64_t si = s.per_channel ? (t / s.group) * D + c : t * (D / s.group) + c / s.group;
  const int64_t off = b * s.scale_sb + h * s.scale_sh + si;
  return (float)q * half_bits_to_float(s.scale[off]) + half_bits_to_float(s.zero[off]);
}

/// \brief One GEAR outlier entry (token t, channel c, correction d = v - xhat), CPU twin only.
struct GearEntry {
  int64_t t, c;
  float d;
};

/// \brief CPU twin: the outlier entries of one role of (b, h), sorted by token.
template <typename DType>
void gear_entries_cpu(const DecodeAttnParams& p, const GearKV& g, bool keys, int64_t b, int64_t h,
                      std::vector<GearEntry>& out) {
  out.clear();
  const int64_t T0 = p.gear_t0, nb = p.gear_nb;
  const int64_t Tq = keys ? p.k.Tq : p.v.Tq;
  for (int sgi = 0; sgi < 2; ++sgi) {
    const GearSeg& s = g.seg[sgi];
    if (s.k == 0 || s.od == nullptr) continue;
    const int64_t tseg = sgi == 0 ? T0 : Tq - T0;
    const int64_t nblk = sgi == 0 ? 1 : tseg / nb;
    const int64_t base = b * s.o_sb + h * s.o_sh, dbase = b * s.d_sb + h * s.d_sh;
    const DType* od = static_cast<const DType*>(s.od);
    if (keys) {  // sorted by token: tile offsets + packed (token mod 32, channel)
      const int64_t tblk = sgi == 0 ? T0 : nb, ntile = (tblk + 31) / 32;
      for (int64_t blk = 0; blk < nblk; ++blk) {
        const int32_t* off = s.off + b * s.f_sb + h * s.f_sh + blk * s.f_sblk;
        const int64_t t0 = sgi == 0 ? 0 : T0 + blk * nb;
        for (int64_t tile = 0; tile < ntile; ++tile)
          for (int64_t e = off[tile]; e < off[tile + 1]; ++e) {
            const int64_t o = base + blk * s.o_sblk + e;
            const int64_t pk = gear_index(s.oi, 2, o) & 0xFFFF;
            out.push_back({t0 + tile * 32 + (pk >> 8), pk & 255, to_float(od[dbase + blk * s.d_sblk + e])});
          }
      }
    } else {  // per token: index = channel
      for (int64_t t = 0; t < tseg; ++t)
        for (int64_t j = 0; j < 2 * s.k; ++j) {
          const int64_t off = t * 2 * s.k + j;
          out.push_back({(sgi == 0 ? 0 : T0) + t, gear_index(s.oi, s.ibytes, base + off), to_float(od[dbase + off])});
        }
    }
  }
  std::stable_sort(out.begin(), out.end(), [](const GearEntry& a, const GearEntry& e) { return a.t < e.t; });
}

/// \brief CPU twin: attention of the g query heads of (b, h) in fp32.  Each token's key and
/// value are dequantized once and used by all g query heads (GQA).  `row` and `kbuf` are
/// caller-provided scratch (resized here).  GEAR layers add the low-rank term and the outlier
/// corrections of each compressed token (the kernel's arithmetic, in fp32).
template <typename DType>
void decode_attention_cpu(const DecodeAttnParams& p, int64_t b, int64_t h, std::vector<float>& row,
                          std::vector<float>& kbuf) {
  const int64_t D = p.D, g = p.Hq / p.H, T = p.T;
  const DType* q = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;
  DType* out = static_cast<DType*>(p.out) + (b * p.Hq + h * g) * D;
  row.resize(g * T);          // scores, then probabilities, [g][T]
  kbuf.resize(D + g * D + g * D);  // one token, q as float [g][D], accumulators [g][D]
  float* xt = kbuf.data();
  float* qf = xt + D;
  float* acc = qf + g * D;
  for (int64_t i = 0; i < g * D; ++i) qf[i] = to_float(q[i]), acc[i] = 0.f;
  std::vector<GearEntry> entries;
  size_t cursor = 0;
  auto load = [&](const QuantKV& s, const GearKV& gs, int64_t t) {
    if (t < s.Tq) {
      for (int64_t c = 0; c < D; ++c) xt[c] = dequant_at(s, b, h, t, c, D);
      if (p.gear) {
        const int sgi = t < p.gear_t0 ? 0 : 1;
        const GearSeg& sg = gs.seg[sgi];
        const int64_t ts = sgi == 0 ? t : t - p.gear_t0;
        if (sg.r > 0)
          for (int64_t c = 0; c < D; ++c) xt[c] += gear_lowrank(sg, b, h, ts, sgi == 0 ? 0 : ts / p.gear_nb, c);
        while (cursor < entries.size() && entries[cursor].t < t) ++cursor;
        for (; cursor < entries.size() && entries[cursor].t == t; ++cursor) xt[entries[cursor].c] += entries[cursor].d;
      }
    } else {
      const DType* r = static_cast<const DType*>(s.residual) + b * s.res_sb + h * s.res_sh + (t - s.Tq) * D;
      for (int64_t c = 0; c < D; ++c) xt[c] = to_float(r[c]);
    }
  };
  auto masked = [&](int64_t t) { return p.mask && !p.mask[b * p.mask_sb + t]; };
  std::vector<float> m(g, -INFINITY), l(g, 0.f);
  if (p.gear) gear_entries_cpu<DType>(p, p.gk, true, b, h, entries);
  cursor = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (masked(t)) {
      for (int64_t j = 0; j < g; ++j) row[j * T + t] = -INFINITY;
      continue;
    }
    load(p.k, p.gk, t);
    for (int64_t j = 0; j < g; ++j) {
      float s = 0.f;
      for (int64_t c = 0; c < D; ++c) s += qf[j * D + c] * xt[c];
      row[j * T + t] = s * p.scale;
      m[j] = std::fmax(m[j], row[j * T + t]);
    }
  }
  if (p.gear) gear_entries_cpu<DType>(p, p.gv, false, b, h, entries);
  cursor = 0;
  for (int64_t t = 0; t < T; ++t) {
    if (masked(t)) continue;
    load(p.v, p.gv, t);
    for (int64_t j = 0; j < g; ++j) {
      const float e = std::exp(row[j * T + t] - m[j]);
      l[j] += e;
      for (int64_t c = 0; c < D; ++c) acc[j * D + c] += e * xt[c];
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t c = 0; c < D; ++c)
      out[j * D + c] = from_float<DType>(l[j] > 0.f ? acc[j * D + c] / l[j] : 0.f);
}

}  // namespace attention
}  // namespace kvq
