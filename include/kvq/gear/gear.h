// GEAR (quantized backbone + exact sparse outliers + low-rank residual): the pieces that
// glue kvq::select (outliers), kvq::quant (group quantization) and kvq::linalg (power
// iteration) together, with their CPU twins.  Torch-free.
//
// Compress, per [T, D] matrix (N = batch * heads matrices):
//   1. outliers: per vector (key channel / value token) the k largest and k smallest
//      entries (outlier_topk.h) -> values (input dtype, exact) + compact indices; the
//      bounds (lo, hi) = smallest / largest entry that is not an outlier.
//   2. xc = clamp(x, lo_v, hi_v): outliers pulled to the edge of the inlier range so they
//      do not stretch any quantization group (only outliers change).
//   3. backbone: kvq group quantization of xc (group_quant.h format, unchanged).
//   4. residual R = xc - dequant(codes), stored as fp16, and set to 0 at outlier positions
//      (an outlier is restored exactly, so its residual is irrelevant).
//   5. A [T, r], B [D, r] = lowrank_power_iter(R) (power_svd.h), stored as fp16.
// Decompress: out = dequant(codes) + A B^T, then every outlier position is overwritten by
// its stored value (so outliers come back bit-exact).
#pragma once
#include <cstdint>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"
#include "kvq/quant/group_quant.h"

namespace kvq {
namespace gear {

/// \brief Element-wise / row-wise GEAR glue parameters (one compress or decompress call).
struct GearParams {
  const void* x;             // [N, T, D] input (DType)
  void* xc;                  // [N, T, D] DType: x clamped into each vector's inlier range
  const float* bounds;       // [N, V, 2] (lo, hi) per vector
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
  // CUDA key split path (gear_keys.h, plan.split with k > 0): [N][4][D] per (matrix, channel)
  // lo, hi (float bits) and the composite outlier thresholds thr_top, thr_bot
  uint32_t* keys_sel = nullptr;
};

/// \brief One fused compress launch for short matrices (decode blocks, T <= 256): one CTA
/// per [T, D] matrix does outlier selection, clamp, quantization, residual and the power
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
/// mask u32 [rows_pad * DMAX / 32] | bounds float [max(DMAX, rows_pad), 2].
inline size_t gear_small_smem(int64_t T, int64_t D) {
  constexpr size_t kLimit = 200 * 1024;
  if (T <= 0 || T > 256 || D <= 0 || D > 256) return 0;
  const int64_t rows_pad = (T + 31) / 32 * 32;
  const int64_t dmax = D <= 64 ? 64 : (D <= 128 ? 128 : 256);
  const int64_t vmax = dmax > rows_pad ? dmax : rows_pad;
  const size_t bytes = (size_t)(rows_pad * (dmax + 8) * 4 + rows_pad * 9 * 4 + rows_pad * dmax +
                                rows_pad * dmax / 8 + vmax * 2 * 4);
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

/// \brief xc = clamp(x, lo_v, hi_v) on rows [r0, r1); ORs StatusFlag bits of x into *status.
template <typename DType>
void gear_clamp_cpu(const GearParams& p, int64_t r0, int64_t r1) {
  const DType* x = static_cast<const DType*>(p.x);
  DType* xc = static_cast<DType*>(p.xc);
  const int64_t V = p.per_channel ? p.D : p.T;
  int32_t status = 0;
  for (int64_t row = r0; row < r1; ++row) {
    const int64_t n = row / p.T, t = row % p.T;
    for (int64_t c = 0; c < p.D; ++c) {
      const float v = to_float(x[row * p.D + c]);
      if (p.status) status |= quant::value_status(v);
      const int64_t b = (n * V + (p.per_channel ? c : t)) * 2;
      xc[row * p.D + c] = from_float<DType>(fminf(fmaxf(v, p.bounds[b]), p.bounds[b + 1]));
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

/// \brief resid = 0 at the outlier positions of vectors [v0, v1).
template <typename IdType>
void gear_zero_outliers_cpu(const GearParams& p, int64_t v0, int64_t v1) {
  const IdType* idx = static_cast<const IdType*>(p.oindices);
  const int64_t V = p.per_channel ? p.D : p.T;
  for (int64_t vv = v0; vv < v1; ++vv)
    for (int64_t s = 0; s < 2 * p.k; ++s)
      p.resid[vec_offset(p, vv / V, vv % V, (int64_t)idx[vv * 2 * p.k + s])] = 0;
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
