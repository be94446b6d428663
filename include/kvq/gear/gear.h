// GEAR (quantized backbone + exact sparse outliers + low-rank residual): the pieces that
// glue kvq::select (outliers), kvq::quant (group quantization) and kvq::linalg (power
// iteration) together, with their CPU twins.  Torch-free.
//
// Compress, per [T, D] matrix (N = batch * heads matrices):
//   1. outliers: per vector (key channel / value token) the k largest and k smallest
//      entries (outlier_topk.h) -> values (input dtype, exact) + compact indices.
//   2. group bounds: per quantization group (G tokens of a key channel / G channels of a
//      value token) (lo, hi) = fminf / fmaxf over the group's NON-outlier entries (NaN
//      ignored, as fminf / fmaxf do); a group without such an entry is "empty".
//   3. xc: inliers unchanged (x, bit for bit); outliers clamp(x, lo, hi) = fminf(fmaxf(x, lo),
//      hi) of their own group, so they stretch no group's min / max; every entry of an empty
//      group +0.  So a group's min / max over xc is its inlier range, or 0 / 0 (scale 0,
//      codes 0, zero point 0) for an empty group.
//   4. backbone: kvq group quantization of xc (group_quant.h format, unchanged).
//   5. residual R = xc - dequant(codes), stored as fp16, and set to 0 at outlier positions
//      (an outlier is restored exactly, so its residual is irrelevant).
//   6. A [T, r], B [D, r] = lowrank_power_iter(R) (power_svd.h), stored as fp16.
// The value of xc at an outlier only decides its code (never read back by
// gear_decompress); the code is a function of that value alone, so an implementation may
// produce it from any clamp whose result has the same value (ties between -0 / +0 do not
// matter there).  At inliers no clamp is applied, so their residual bits never depend on
// fminf / fmaxf tie rules.
// Decompress: out = dequant(codes) + A B^T, then every outlier position is overwritten by
// its stored value (so outliers come back bit-exact).
#pragma once
#include <cmath>
#include <cstdint>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"
#include "kvq/quant/group_quant.h"

namespace kvq {
namespace gear {

/// \brief Element-wise / row-wise GEAR glue parameters (one compress or decompress call).
struct GearParams {
  const void* x;             // [N, T, D] input (DType)
  void* xc;                  // [N, T, D] DType: x with outliers filled within their group
  float* gbounds;            // [N * groups, 2] (lo, hi) per quantization group, in the order of
                             // q.scale; NaN, NaN: empty group (no non-outlier entry that is not NaN)
  uint8_t* omask;            // [N, T, D] 1 at outlier positions (CPU / multi-kernel CUDA path)
  uint16_t* resid;           // [N, T, D] fp16 bits: residual (compress)
  const void* ovalues;       // [N, V, 2k] DType outlier values
  const void* oindices;      // [N, V, 2k] IdType outlier indices (position along the vector)
  const uint16_t* A;         // [N, T, r] fp16 bits (decompress)
  const uint16_t* B;         // [N, D, r] fp16 bits (decompress)
  void* out;                 // [N, T, D] DType (decompress)
  int32_t* status;           // optional [1] StatusFlag (finite check of x)
  quant::GroupQuantParams q;  // backbone codes / scale / zero (+ N, T, D, group, bits)
  int64_t N = 0, T = 0, D = 0, k = 0;
  int rank = 0;
  bool per_channel = false;
  // CUDA key split path (gear_keys.h, plan.split with k > 0): [N][2][D] per (matrix, channel)
  // the composite outlier thresholds thr_top, thr_bot
  uint32_t* keys_sel = nullptr;
};

/// \brief One fused compress launch for short matrices (decode blocks, T <= 256): one CTA
/// per [T, D] matrix does outlier selection, outlier fill, quantization, residual and the power
/// iteration with the matrix resident in shared memory (gear_small.cuh).  Outputs exactly
/// those of the multi-launch path.
struct GearSmallParams {
  const void* x;      // [N, T, D] input (DType)
  int32_t* codes;     // [N, T, D * bits / 32]
  uint16_t* scale;    // fp16 bits, group_quant layout
  uint16_t* zero;
  void* ovalues;      // [N, V, 2k] DType
  uint8_t* oindices;  // [N, V, 2k] (L <= 256: uint8)
  uint16_t* A;        // [N, T, rank] fp16 bits
  uint16_t* B;        // [N, D, rank] fp16 bits
  int32_t* status;    // optional [1] StatusFlag (finite check of x)
  int64_t N = 0, T = 0, D = 0, group = 0, k = 0;
  int bits = 0, rank = 0, iters = 0;
  uint64_t seed = 0;
  bool per_channel = false;
};

/// \brief Dynamic shared memory (bytes) of the fused small-matrix compress kernel, or 0 when
/// the matrix does not qualify (T == 0, T > 256, D > 256, or over the budget).  Layout: Rs
/// float [rows_pad, DMAX + 8] | Ps float [rows_pad, 9] | codes u8 [rows_pad, DMAX] | outlier
/// mask u32 [rows_pad * DMAX / 32].
inline size_t gear_small_smem(int64_t T, int64_t D) {
  constexpr size_t kLimit = 200 * 1024;
  if (T <= 0 || T > 256 || D <= 0 || D > 256) return 0;
  const int64_t rows_pad = (T + 31) / 32 * 32;
  const int64_t dmax = D <= 64 ? 64 : (D <= 128 ? 128 : 256);
  const size_t bytes = (size_t)(rows_pad * (dmax + 8) * 4 + rows_pad * 9 * 4 + rows_pad * dmax +
                                rows_pad * dmax / 8);
  return bytes <= kLimit ? bytes : 0;
}

/// \brief Rows per tile and dynamic shared memory (bytes) of the fused clamp + quantize +
/// residual kernel of the long-matrix CUDA path (GearClampQuantResidKernel), or 0 when the
/// layout does not qualify: per-channel groups of G <= 128 tokens (one group per tile) or
/// per-token groups (64-row tiles); D a multiple of 8.
inline int gear_cqr_rows(int64_t T, int64_t D, int64_t G, bool per_channel) {
  if (T <= 0 || D <= 0 || D % 8 != 0 || G <= 0) return 0;
  const int64_t rows = per_channel ? G : 64;
  if (rows > 128 || rows * D * 5 > 100 * 1024) return 0;
  return (int)rows;
}
inline size_t gear_cqr_smem(int rows, int64_t D) { return (size_t)rows * (size_t)D * 5; }

/// \brief Flat offset of element j of vector v of matrix n.
KVQ_HOST_DEVICE int64_t vec_offset(const GearParams& p, int64_t n, int64_t v, int64_t j) {
  return p.per_channel ? (n * p.T + j) * p.D + v : (n * p.T + v) * p.D + j;
}

// ---------------------------------------------------------------------------
// CPU twins.  Ranges are over token rows [N * T) or over outlier vectors [N * V).
// ---------------------------------------------------------------------------

/// \brief Index of the quantization group of element (row, c) of the flattened [N * T, D]
/// rows, in the order of q.scale ([N, T / G, D] per-channel, [N * T, D / G] per-token).
KVQ_HOST_DEVICE int64_t group_index(const GearParams& p, int64_t row, int64_t c) {
  const int64_t G = p.q.group;
  if (!p.per_channel) return row * (p.D / G) + c / G;
  const int64_t n = row / p.T, t = row - n * p.T;
  return (n * (p.T / G) + t / G) * p.D + c;
}

/// \brief Quantization groups of the compress (units of gear_group_bounds).
KVQ_HOST_DEVICE int64_t num_groups(const GearParams& p) {
  if (p.q.group <= 0) return 0;
  return p.per_channel ? p.N * (p.T / p.q.group) * p.D : p.N * p.T * (p.D / p.q.group);
}

/// \brief The group bounds of an empty group fill it with +0 (make_qparams(0, 0): scale 0,
/// zero 0, codes 0); a group with an inlier keeps it.  lo / hi: the masked fminf / fmaxf
/// reduction from +INF / -INF.
KVQ_HOST_DEVICE bool group_empty(float lo, float hi) { return !(lo <= hi); }

/// \brief gbounds of group u: fminf / fmaxf over its non-outlier entries in vector order
/// (NaN ignored); NaN, NaN for an empty group.  (CPU twin and GearGroupBoundsKernel.)
template <typename DType>
KVQ_HOST_DEVICE void gear_group_bounds(const GearParams& p, int64_t u) {
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t G = p.q.group, D = p.D;
  int64_t e0, step;  // first element, stride along the vector
  if (p.per_channel) {
    const int64_t tg = u / D;  // tg = n * (T / G) + g: rows [tg G, tg G + G), channel u - tg D
    e0 = tg * G * D + (u - tg * D);
    step = D;
  } else {
    e0 = u * G;  // row u / (D / G), channels [(u mod D / G) G, ... + G)
    step = 1;
  }
  float lo = INFINITY, hi = -INFINITY;
  for (int64_t i = 0; i < G; ++i) {
    const int64_t e = e0 + i * step;
    if (p.omask[e]) continue;
    const float v = to_float(x[e]);
    lo = fminf(lo, v);
    hi = fmaxf(hi, v);
  }
  if (group_empty(lo, hi)) lo = hi = NAN;
  p.gbounds[2 * u] = lo;
  p.gbounds[2 * u + 1] = hi;
}

/// \brief xc on rows [r0, r1) (x at inliers, clamp into the group's inlier range at outliers,
/// +0 in empty groups); ORs StatusFlag bits of x into *status.
template <typename DType>
void gear_clamp_cpu(const GearParams& p, int64_t r0, int64_t r1) {
  const DType* x = static_cast<const DType*>(p.x);
  DType* xc = static_cast<DType*>(p.xc);
  int32_t status = 0;
  for (int64_t row = r0; row < r1; ++row) {
    for (int64_t c = 0; c < p.D; ++c) {
      const int64_t e = row * p.D + c;
      const float v = to_float(x[e]);
      if (p.status) status |= quant::value_status(v);
      const float* b = p.gbounds + 2 * group_index(p, row, c);
      if (b[0] != b[0])
        xc[e] = from_float<DType>(0.f);
      else if (p.omask[e])
        xc[e] = from_float<DType>(fminf(fmaxf(v, b[0]), b[1]));
      else
        xc[e] = x[e];
    }
  }
  if (p.status && status) __atomic_fetch_or(p.status, status, __ATOMIC_RELAXED);
}

/// \brief resid = fp16(src - deq) on rows [r0, r1), src = xc (or x when there are no
/// outliers), deq = the float dequantized backbone ([N, T, D]).
template <typename DType>
void gear_residual_cpu(const GearParams& p, const float* deq, int64_t r0, int64_t r1) {
  const DType* src = static_cast<const DType*>(p.k > 0 ? p.xc : p.x);
  // NOTE: a non-finite residual (possible only with check_finite=False) is stored as 0 so it
  // cannot spread through the low-rank factors to other tokens.
  for (int64_t i = r0 * p.D; i < r1 * p.D; ++i) {
    const float d = to_float(src[i]) - deq[i];
    p.resid[i] = float_to_half_bits_rn(std::isfinite(d) ? d : 0.f);
  }
}

/// \brief dst[position] = val at the outlier positions of vectors [v0, v1) (the residual's
/// zeros: dst = resid, val = 0; the outlier mask: dst = omask, val = 1).
template <typename IdType, typename T>
void gear_set_outliers_cpu(const GearParams& p, T* dst, T val, int64_t v0, int64_t v1) {
  const IdType* idx = static_cast<const IdType*>(p.oindices);
  const int64_t V = p.per_channel ? p.D : p.T;
  for (int64_t vv = v0; vv < v1; ++vv)
    for (int64_t s = 0; s < 2 * p.k; ++s)
      dst[vec_offset(p, vv / V, vv % V, (int64_t)idx[vv * 2 * p.k + s])] = val;
}

/// \brief out = DType(deq + A B^T) on rows [r0, r1) (deq: float dequantized backbone).
template <typename DType>
void gear_lowrank_add_cpu(const GearParams& p, const float* deq, int64_t r0, int64_t r1) {
  DType* out = static_cast<DType*>(p.out);
  const int r = p.rank;
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t n = row / p.T;
    const uint16_t* a = p.A + row * r;
    for (int64_t c = 0; c < p.D; ++c) {
      float v = deq[row * p.D + c];
      const uint16_t* b = p.B + (n * p.D + c) * r;
      for (int i = 0; i < r; ++i) v += half_bits_to_float(a[i]) * half_bits_to_float(b[i]);
      out[row * p.D + c] = from_float<DType>(v);
    }
  }
}

/// \brief out[outlier position] = stored value, vectors [v0, v1).
template <typename DType, typename IdType>
void gear_scatter_outliers_cpu(const GearParams& p, int64_t v0, int64_t v1) {
  const IdType* idx = static_cast<const IdType*>(p.oindices);
  const DType* val = static_cast<const DType*>(p.ovalues);
  DType* out = static_cast<DType*>(p.out);
  const int64_t V = p.per_channel ? p.D : p.T;
  for (int64_t vv = v0; vv < v1; ++vv)
    for (int64_t s = 0; s < 2 * p.k; ++s)
      out[vec_offset(p, vv / V, vv % V, (int64_t)idx[vv * 2 * p.k + s])] = val[vv * 2 * p.k + s];
}

}  // namespace gear
}  // namespace kvq
