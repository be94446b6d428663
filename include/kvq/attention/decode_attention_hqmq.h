// Decode attention over an HQMQ-compressed KV cache layer (keys and values both HQMQ, packed
// rows + Med3x outlier records): params, the outlier index and the CPU
// twin.  Torch-free.  Format of one role: include/kvq/hqmq/hqmq.h.
//
//   out[b, hq] = softmax_t(scale * q[b, hq] . K[b, hq / g, t] + mask) . V[b, hq / g, t]
// with K/V token t < Tc = the HQMQ decode of its packed row + the token's Med3x records
// (outlier chunks decode to 0 in the dense codes, so a record's values are added), and token
// t >= Tc = row t - Tc of the role's full-precision residual (the cache's recent window).
//
// Outlier index (per role).  The fused kernel must find the records of the tokens it reads
// without scanning the whole list, so the records are kept ordered by the key
//   key(record) = (t / kHqmqTile) * (B * H) + n         (n = b * H + h, 32-token tiles)
// and `outlier_ptr` is the CSR over that key: the records of (tile j, row n) are
// outliers[outlier_ptr[j * B * H + n] .. outlier_ptr[j * B * H + n + 1]), int64,
// ceil(T / 32) * B * H + 1 entries.  Order inside one (tile, row) group is free.
// HQMQStream (python/kvquant_ext/hqmq.py) maintains this order and the pointer array at
// append time.  Pointers are clamped to [0, M]; a record whose (t, n, c) does not belong to
// its group is ignored (so corrupt input cannot read out of bounds).
// Without records (hqmq-3.79) `outlier_ptr` may be empty (nullptr here).
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"
#include "kvq/hqmq/hqmq.h"

namespace kvq {
namespace attention {

constexpr int kHqmqTile = 32;  // tokens per outlier-index tile (= the mma path's tile)

/// \brief One role (keys or values) of an HQMQ cache layer.
struct HqmqKV {
  const int16_t* codes = nullptr;    // [B, H, T, U] packed rows, inner [T, U] contiguous
  const float* secondary = nullptr;  // [H, S, 4] contiguous
  const int32_t* outliers = nullptr;  // [M, 4] records ordered by key (see above)
  const int64_t* outlier_ptr = nullptr;  // [ceil(T / 32) * B * H + 1] or nullptr (M == 0)
  int64_t num_outliers = 0;              // M
  int64_t codes_sb = 0, codes_sh = 0;    // batch / head strides of codes (units)
  int64_t S = 1;
  int radius_bits = 4, field_bits = 0;
  hqmq::RowLayout row;                   // hqmq_row_layout(D, S, radius_bits): row.units per token
  // the recent window: tokens Tc .. T - 1 in full precision (the dtype of q), [B, H, T - Tc, D]
  // with inner [T - Tc, D] contiguous; nullptr when T == Tc
  const void* residual = nullptr;
  int64_t res_sb = 0, res_sh = 0;  // batch / head strides (elements)
};

/// \brief Decode attention call.  Workspace holds split partials (CUDA only), in the layout
/// of DecodeAttnParams (B * Hq * splits * (D + 2) floats: acc, then (m, l), log2 domain).
struct HqmqAttnParams {
  const void* q = nullptr;        // [B, Hq, D] contiguous
  void* out = nullptr;            // [B, Hq, D]
  const uint8_t* mask = nullptr;  // optional [B, T] (nonzero = attend), row stride mask_sb
  int64_t mask_sb = 0;
  HqmqKV k, v;
  int64_t B = 0, H = 0, Hq = 0, D = 0, T = 0;
  int64_t Tc = 0;  // HQMQ-encoded tokens 0 .. Tc - 1; tokens Tc .. T - 1 are the roles' residual
  float scale = 1.f;
  float* ws = nullptr;
  int splits = 0;
};

/// \brief Record range [*begin, *end) of (tile j, row n), clamped to [0, M].
KVQ_HOST_DEVICE void hqmq_record_range(const HqmqKV& s, int64_t BH, int64_t j, int64_t n,
                                       int64_t* begin, int64_t* end) {
  if (s.outlier_ptr == nullptr || s.num_outliers == 0) {
    *begin = *end = 0;
    return;
  }
  int64_t a = s.outlier_ptr[j * BH + n], e = s.outlier_ptr[j * BH + n + 1];
  a = a < 0 ? 0 : (a > s.num_outliers ? s.num_outliers : a);
  e = e < a ? a : (e > s.num_outliers ? s.num_outliers : e);
  *begin = a, *end = e;
}

/// \brief The dense decode of one packed token row of head h into x [D] (fp32); Med3x records
/// are not added.
inline void hqmq_decode_row_cpu(const HqmqKV& s, int64_t h, const int16_t* row_in, int64_t D, float* x) {
  const uint16_t* row = reinterpret_cast<const uint16_t*>(row_in);
  uint32_t fields[hqmq::kMaxChunks];
  const float step = hqmq::div_rn(half_bits_to_float((uint16_t)hqmq::row_fields(row, s.row, D, fields)),
                                  (float)((1 << s.radius_bits) - 1));
  const float* sec = s.secondary + h * s.S * 4;
  for (int64_t c = 0; c < D / 4; ++c) {
    float o[4];
    hqmq::decode_chunk(fields[c], s.radius_bits, step, sec, s.S, o);
    for (int i = 0; i < 4; ++i) x[4 * c + i] = o[i];
  }
}

/// \brief Decode tokens [t0, t1) of row (b, h) of one role into x [t1 - t0][D] (fp32), records
/// of the covered tiles included.  t0 is a multiple of kHqmqTile.
inline void hqmq_decode_tokens_cpu(const HqmqAttnParams& p, const HqmqKV& s, int64_t b, int64_t h,
                                   int64_t t0, int64_t t1, float* x) {
  const int64_t D = p.D, C = D / 4, n = b * p.H + h;
  const int16_t* codes = s.codes + b * s.codes_sb + h * s.codes_sh;
  for (int64_t t = t0; t < t1; ++t) hqmq_decode_row_cpu(s, h, codes + t * s.row.units, D, x + (t - t0) * D);
  for (int64_t j = t0 / kHqmqTile; j * kHqmqTile < t1; ++j) {
    int64_t a, e;
    hqmq_record_range(s, p.B * p.H, j, n, &a, &e);
    for (int64_t k = a; k < e; ++k) {
      const int32_t* rec = s.outliers + 4 * k;
      const int64_t t = rec[0], rn = (int64_t)((uint32_t)rec[1] >> 8), c = rec[1] & 0xff;
      if (t < t0 || t >= t1 || t / kHqmqTile != j || rn != n || c >= C) continue;
      const uint32_t lo = (uint32_t)rec[2], hi = (uint32_t)rec[3];
      float* o = x + (t - t0) * D + 4 * c;
      o[0] += half_bits_to_float((uint16_t)(lo & 0xffffu));
      o[1] += half_bits_to_float((uint16_t)(lo >> 16));
      o[2] += half_bits_to_float((uint16_t)(hi & 0xffffu));
      o[3] += half_bits_to_float((uint16_t)(hi >> 16));
    }
  }
}

/// \brief Tokens [t0, t1) of row (b, h) of one role into x (fp32): decoded below Tc, copied
/// from the residual from Tc on.  t0 is a multiple of kHqmqTile.
template <typename DType>
inline void hqmq_tokens_cpu(const HqmqAttnParams& p, const HqmqKV& s, int64_t b, int64_t h, int64_t t0,
                            int64_t t1, float* x) {
  const int64_t D = p.D;
  if (t0 < p.Tc) hqmq_decode_tokens_cpu(p, s, b, h, t0, t1 < p.Tc ? t1 : p.Tc, x);
  for (int64_t t = t0 > p.Tc ? t0 : p.Tc; t < t1; ++t) {
    const DType* r = static_cast<const DType*>(s.residual) + b * s.res_sb + h * s.res_sh + (t - p.Tc) * D;
    for (int64_t c = 0; c < D; ++c) x[(t - t0) * D + c] = to_float(r[c]);
  }
}

/// \brief CPU twin: attention of the g query heads of (b, h) in fp32, one 32-token tile of
/// keys/values decoded at a time.  `row` and `buf` are caller-provided scratch.
template <typename DType>
void hqmq_decode_attention_cpu(const HqmqAttnParams& p, int64_t b, int64_t h, std::vector<float>& row,
                               std::vector<float>& buf) {
  const int64_t D = p.D, g = p.Hq / p.H, T = p.T;
  const DType* q = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;
  DType* out = static_cast<DType*>(p.out) + (b * p.Hq + h * g) * D;
  row.resize(g * T);
  buf.resize(kHqmqTile * D + 2 * g * D);
  float* xt = buf.data();
  float* qf = xt + kHqmqTile * D;
  float* acc = qf + g * D;
  for (int64_t i = 0; i < g * D; ++i) qf[i] = to_float(q[i]), acc[i] = 0.f;
  auto masked = [&](int64_t t) { return p.mask && !p.mask[b * p.mask_sb + t]; };
  std::vector<float> m(g, -INFINITY), l(g, 0.f);
  for (int64_t t0 = 0; t0 < T; t0 += kHqmqTile) {
    const int64_t t1 = t0 + kHqmqTile < T ? t0 + kHqmqTile : T;
    hqmq_tokens_cpu<DType>(p, p.k, b, h, t0, t1, xt);
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t j = 0; j < g; ++j) {
        if (masked(t)) {
          row[j * T + t] = -INFINITY;
          continue;
        }
        float s = 0.f;
        for (int64_t c = 0; c < D; ++c) s += qf[j * D + c] * xt[(t - t0) * D + c];
        row[j * T + t] = s * p.scale;
        m[j] = std::fmax(m[j], row[j * T + t]);
      }
  }
  for (int64_t t0 = 0; t0 < T; t0 += kHqmqTile) {
    const int64_t t1 = t0 + kHqmqTile < T ? t0 + kHqmqTile : T;
    hqmq_tokens_cpu<DType>(p, p.v, b, h, t0, t1, xt);
    for (int64_t t = t0; t < t1; ++t) {
      if (masked(t)) continue;
      for (int64_t j = 0; j < g; ++j) {
        const float e = std::exp(row[j * T + t] - m[j]);
        l[j] += e;
        for (int64_t c = 0; c < D; ++c) acc[j * D + c] += e * xt[(t - t0) * D + c];
      }
    }
  }
  for (int64_t j = 0; j < g; ++j)
    for (int64_t c = 0; c < D; ++c)
      out[j * D + c] = from_float<DType>(l[j] > 0.f ? acc[j * D + c] / l[j] : 0.f);
}

}  // namespace attention
}  // namespace kvq
