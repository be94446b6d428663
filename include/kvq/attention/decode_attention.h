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

/// \brief Decode attention call.  Workspace holds split partials (CUDA only).
struct DecodeAttnParams {
  const void* q = nullptr;       // [B, Hq, D] contiguous, same dtype as the residuals
  void* out = nullptr;           // [B, Hq, D]
  const uint8_t* mask = nullptr;  // optional [B, T] (nonzero = attend), row stride mask_sb
  int64_t mask_sb = 0;
  QuantKV k, v;
  int64_t B = 0, H = 0, Hq = 0, D = 0, T = 0;
  float scale = 1.f;
  // CUDA split-K workspace: partial (m, l) [B * Hq, splits, 2] and acc [B * Hq, splits, D]
  float* ws = nullptr;
  int splits = 0;
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

/// \brief CPU twin: attention of the g query heads of (b, h) in fp32.  Each token's key and
/// value are dequantized once and used by all g query heads (GQA).  `row` and `kbuf` are
/// caller-provided scratch (resized here).
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
  auto load = [&](const QuantKV& s, int64_t t) {
    if (t < s.Tq) {
      for (int64_t c = 0; c < D; ++c) xt[c] = dequant_at(s, b, h, t, c, D);
    } else {
      const DType* r = static_cast<const DType*>(s.residual) + b * s.res_sb + h * s.res_sh + (t - s.Tq) * D;
      for (int64_t c = 0; c < D; ++c) xt[c] = to_float(r[c]);
    }
  };
  auto masked = [&](int64_t t) { return p.mask && !p.mask[b * p.mask_sb + t]; };
  std::vector<float> m(g, -INFINITY), l(g, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    if (masked(t)) {
      for (int64_t j = 0; j < g; ++j) row[j * T + t] = -INFINITY;
      continue;
    }
    load(p.k, t);
    for (int64_t j = 0; j < g; ++j) {
      float s = 0.f;
      for (int64_t c = 0; c < D; ++c) s += qf[j * D + c] * xt[c];
      row[j * T + t] = s * p.scale;
      m[j] = std::fmax(m[j], row[j * T + t]);
    }
  }
  for (int64_t t = 0; t < T; ++t) {
    if (masked(t)) continue;
    load(p.v, t);
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
