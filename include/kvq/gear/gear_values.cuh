// GEAR compress, VALUE side (per-token vectors, per_channel = False), long matrices: one
// kernel that reads every token row once and writes everything the select -> clamp +
// quantize + residual -> zero-outliers chain writes (outlier_topk.cuh OutlierSelectWarp16,
// gear.cuh GearClampQuantResid + GearZeroOutliers), with the CPU op's results.  Torch-free.
//
// Scope: fp16 / bf16, D in {64, 128, 256}, per-token groups G (power of two, 8 <= G <= D),
// 1 <= k <= KMAX (2, 4 or 8 by instantiation).  Everything else keeps the old path.
//
// One warp per token row (rows strided over the grid, the next row's 16-bit words
// prefetched into registers); lane l owns the EPL = D / 32 consecutive channels
// [l * EPL, (l + 1) * EPL) (one 4, 8 or 16-byte load).
//  1. keys: the 32-bit composite (order key of the 16-bit value << 16 | 0xffff - j): the
//     strict order (value, -index) of outlier_topk.h, -0 < +0, NaNs at the ends.
//  2. selection: each lane keeps its P = min(KMAX + 1, EPL) largest and smallest keys
//     (insertion networks of unsigned max / min), then k + 1 rounds of one
//     __reduce_max_sync / __reduce_min_sync on the list heads (the winning lane pops its
//     head; keys are unique, so exactly one lane wins).  A lane holds at most k + 1 of the
//     top k + 1, so the lists never run dry.  Round k yields hiK / loK, the (k+1)-th
//     largest / smallest keys: outliers are exactly the keys > hiK or < loK, and the bounds
//     are their values.  Each lane t < 2k then writes one selected entry at its rank by
//     index (the k winners of each side are known to every lane from the reductions).
//  3. xc = clamp(x, lo, hi) with the CPU op's fmaxf / fminf semantics (glibc: ties return the
//     first operand, a NaN operand returns the other one), so -0 / +0 and NaN cases match.
//  4. per-token group min / max of xc (NaN ignored, as the CPU's fminf / fmaxf from
//     +-INF); a zero extremum takes the sign of the group's first zero (the CPU's sequential
//     fminf / fmaxf keeps the first of equal values).  make_qparams, codes (the 1.5 * 2^23
//     rounding add == __float2int_rn of the clamped q, as group_quant.cuh's fast path),
//     packed like group_quant.
//  5. resid = fp16(xc - fma(code, scale, zero)), 0 where non-finite or at an outlier.
//  6. status: value_status of x (the clamp step's finite check).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kvq/gear/gear.h"
#include "kvq/quant/group_quant.cuh"
#include "kvq/select/outlier_topk.cuh"

namespace kvq {
namespace gear {

/// \brief Does the fused value-side kernel handle this compress?  (16-bit dtype, per-token
/// groups, D in {64, 128, 256}, 1 <= k <= 8.)
inline bool gear_values_supported(const GearParams& p, int dtype_bytes) {
  const int64_t G = p.q.group;
  return dtype_bytes == 2 && !p.per_channel && p.k >= 1 && p.k <= 8 &&
         (p.D == 64 || p.D == 128 || p.D == 256) && G >= 8 && G <= p.D && (G & (G - 1)) == 0 &&
         p.D % G == 0 && (p.q.bits == 2 || p.q.bits == 4 || p.q.bits == 8) && p.resid != nullptr &&
         p.ovalues != nullptr && p.oindices != nullptr;
}

/// CPU fmaxf / fminf (glibc): x unless y is larger / smaller; a NaN y returns x, a NaN x
/// returns y.  ynan = isnan(y), precomputed per row.
__device__ __forceinline__ float gv_cpu_fmax(float x, float y, bool ynan) { return (x >= y || ynan) ? x : y; }
__device__ __forceinline__ float gv_cpu_fmin(float x, float y, bool ynan) { return (x <= y || ynan) ? x : y; }

/// First-zero code of an ordered combine: 0 none, 1 +0, 2 -0; a wins when it has one.
__device__ __forceinline__ int gv_first(int a, int b) { return a != 0 ? a : b; }

template <int NW>
__device__ __forceinline__ void gv_load_words(const uint32_t* row, int lane, uint32_t (&w)[NW]) {
  static_assert(NW == 1 || NW == 2 || NW == 4, "one 4, 8 or 16-byte load per lane");
  if constexpr (NW == 1) {
    w[0] = row[lane];
  } else if constexpr (NW == 2) {
    const uint2 v = reinterpret_cast<const uint2*>(row)[lane];
    w[0] = v.x;
    w[1] = v.y;
  } else {
    const uint4 v = reinterpret_cast<const uint4*>(row)[lane];
    w[0] = v.x;
    w[1] = v.y;
    w[2] = v.z;
    w[3] = v.w;
  }
}

template <int NW>
__device__ __forceinline__ void gv_store_words(uint16_t* row, int lane, const uint32_t (&w)[NW]) {
  if constexpr (NW == 1) {
    reinterpret_cast<uint32_t*>(row)[lane] = w[0];
  } else if constexpr (NW == 2) {
    reinterpret_cast<uint2*>(row)[lane] = make_uint2(w[0], w[1]);
  } else {
    reinterpret_cast<uint4*>(row)[lane] = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

template <typename DType>
__device__ __forceinline__ float gv_to_float(uint32_t bits16) {
  DType v;
  v.bits = (uint16_t)bits16;
  return to_float(v);
}

/// \brief The fused value-side compress (see the file comment).  256 threads, any grid.
template <typename DType, int D, int BITS, int KMAX>
__global__ void __launch_bounds__(256) GearValuesCompressKernel(GearParams p) {
  constexpr int EPL = D / 32;                         // channels per lane: 2, 4 or 8
  constexpr int NW = EPL / 2;                         // 32-bit words per lane (one load)
  constexpr int P = KMAX + 1 < EPL ? KMAX + 1 : EPL;  // list depth
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  constexpr unsigned FULL = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int64_t rows = p.N * p.T;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const int k = (int)p.k, G = (int)p.q.group;
  const int lpg = G / EPL;              // lanes per group (G >= 8 >= EPL)
  const int gpr = D / G;                // groups per row
  const bool check = p.status != nullptr;
  const uint32_t* x = static_cast<const uint32_t*>(p.x);
  DType* ovalues = static_cast<DType*>(const_cast<void*>(p.ovalues));
  uint8_t* oindices = static_cast<uint8_t*>(const_cast<void*>(p.oindices));
  int32_t status = 0;
  uint32_t nxt[NW];
  if (warp < rows) gv_load_words<NW>(x + warp * (D / 2), lane, nxt);
  for (int64_t r = warp; r < rows; r += nwarps) {  // warp-uniform
    uint32_t w[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = nxt[i];
    if (r + nwarps < rows) gv_load_words<NW>(x + (r + nwarps) * (D / 2), lane, nxt);

    // ---- 1. composite keys
    uint32_t key[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const uint32_t h = (w[i / 2] >> (16 * (i & 1))) & 0xffffu;
      key[i] = (select::orderable_key16(h) << 16) | (0xffffu - (uint32_t)(lane * EPL + i));
    }

    // ---- 2. selection
    uint32_t tl[P], bl[P];
#pragma unroll
    for (int d = 0; d < P; ++d) {
      tl[d] = 0u;
      bl[d] = FULL;
    }
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      uint32_t a = key[i], b = key[i];
#pragma unroll
      for (int d = 0; d < P; ++d) {
        const uint32_t th = max(tl[d], a), bh = min(bl[d], b);
        a = min(tl[d], a);
        b = max(bl[d], b);
        tl[d] = th;
        bl[d] = bh;
      }
    }
    uint32_t tb[KMAX], bb[KMAX];
    uint32_t hiK = 0u, loK = FULL;
#pragma unroll
    for (int rr = 0; rr <= KMAX; ++rr) {
      if (rr <= k) {  // warp-uniform
        const uint32_t bt = __reduce_max_sync(FULL, tl[0]);
        const uint32_t bm = __reduce_min_sync(FULL, bl[0]);
        if (rr < k) {
          tb[rr < KMAX ? rr : KMAX - 1] = bt;
          bb[rr < KMAX ? rr : KMAX - 1] = bm;
          const bool wt = tl[0] == bt, wb = bl[0] == bm;
#pragma unroll
          for (int d = 0; d + 1 < P; ++d) {
            tl[d] = wt ? tl[d + 1] : tl[d];
            bl[d] = wb ? bl[d + 1] : bl[d];
          }
          tl[P - 1] = wt ? 0u : tl[P - 1];
          bl[P - 1] = wb ? FULL : bl[P - 1];
        } else {
          hiK = bt;
          loK = bm;
        }
      }
    }
    // selected entries: lane t < k writes top entry t, lane k <= t < 2k bottom entry t - k,
    // each at its rank by index (larger low half = smaller index)
    if (lane < 2 * k) {
      const bool top = lane < k;
      const int t = top ? lane : lane - k;
      uint32_t item = 0u;
#pragma unroll
      for (int rr = 0; rr < KMAX; ++rr)
        if (rr == t) item = top ? tb[rr] : bb[rr];
      int rank = 0;
#pragma unroll
      for (int rr = 0; rr < KMAX; ++rr)
        if (rr < k) rank += ((top ? tb[rr] : bb[rr]) & 0xffffu) > (item & 0xffffu) ? 1 : 0;
      const int64_t pos = r * 2 * k + (top ? 0 : k) + rank;
      DType v;
      v.bits = select::key16_to_bits(item >> 16);
      ovalues[pos] = v;
      oindices[pos] = (uint8_t)(0xffffu - (item & 0xffffu));
    }
    const float hi = gv_to_float<DType>(select::key16_to_bits(hiK >> 16));
    const float lo = gv_to_float<DType>(select::key16_to_bits(loK >> 16));
    const bool hi_nan = hi != hi, lo_nan = lo != lo;

    // ---- 3. clamp (+ finite check of x)
    float v[EPL];
    bool bad = false;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float xv = gv_to_float<DType>((w[i / 2] >> (16 * (i & 1))) & 0xffffu);
      bad |= !(fabsf(xv) <= quant::kMaxAbs);
      v[i] = gv_cpu_fmin(gv_cpu_fmax(xv, lo, lo_nan), hi, hi_nan);
    }
    if (check && bad) {  // rare: the exact flags
#pragma unroll
      for (int i = 0; i < EPL; ++i)
        status |= quant::value_status(gv_to_float<DType>((w[i / 2] >> (16 * (i & 1))) & 0xffffu));
    }

    // ---- 4. group min / max (EPL <= 8 <= G: a group is G / EPL whole lanes), qparams, codes
    float mn = INFINITY, mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      mn = fminf(mn, v[i]);
      mx = fmaxf(mx, v[i]);
    }
    for (int o = 1; o < lpg; o <<= 1) {
      mn = fminf(mn, __shfl_xor_sync(FULL, mn, o));
      mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, o));
    }
    if (__any_sync(FULL, mn == 0.f || mx == 0.f)) {  // rare: a zero extremum takes the
      int fz = 0;                                      // sign of the group's first zero
#pragma unroll
      for (int i = EPL - 1; i >= 0; --i)
        if (v[i] == 0.f) fz = signbit(v[i]) ? 2 : 1;
      for (int o = 1; o < lpg; o <<= 1) {  // ordered combine: the lower lanes come first
        const int other = __shfl_xor_sync(FULL, fz, o);
        fz = (lane & o) ? gv_first(other, fz) : gv_first(fz, other);
      }
      const float z = fz == 2 ? -0.f : 0.f;
      if (mn == 0.f) mn = z;
      if (mx == 0.f) mx = z;
    }
    const quant::QParams q = quant::make_qparams(mn, mx, BITS);
    if (lane % lpg == 0) {
      p.q.scale[r * gpr + lane / lpg] = q.s16;
      p.q.zero[r * gpr + lane / lpg] = q.z16;
    }
    uint32_t code[EPL];
    float d[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      float qv = __fmul_rn(__fsub_rn(v[i], q.zero), q.inv);
      qv = fminf(fmaxf(qv, 0.f), MAXQ);           // NaN -> 0, as quant_code
      const float m = __fadd_rn(qv, 12582912.f);  // 1.5 * 2^23 + rint(qv) (ties to even)
      code[i] = __float_as_uint(m) - 0x4b400000u;
      const float cf = __fsub_rn(m, 12582912.f);  // (float)code, exact
      // NOTE: code * scale + zero as one FMA, as GearClampQuantResidKernel.
      const float dd = __fsub_rn(v[i], __fmaf_rn(cf, q.scale, q.zero));
      const bool out = key[i] > hiK || key[i] < loK;
      d[i] = (isfinite(dd) && !out) ? dd : 0.f;
    }
    uint32_t rw[NW];  // fp16 residual words
#pragma unroll
    for (int i = 0; i < EPL; i += 2) {
      const __half2 h2 = __floats2half2_rn(d[i], d[i + 1]);
      rw[i / 2] = *reinterpret_cast<const uint32_t*>(&h2);
    }
    quant::pack_and_store<EPL, BITS>(code, lane, p.q.codes + r * (D * BITS / 32));
    gv_store_words<NW>(p.resid + r * D, lane, rw);
  }
  quant::report_status(p.status, check ? status : 0);
}

/// \brief Launch (p: the long-path GearParams of gear_compress; gear_values_supported).
template <typename DType, int D, int BITS, int KMAX>
cudaError_t GearValuesCompress(const GearParams& p, cudaStream_t stream) {
  const int64_t rows = p.N * p.T;
  if (rows == 0) return cudaSuccess;
  auto kernel = GearValuesCompressKernel<DType, D, BITS, KMAX>;
  // one resident wave: the warps stride over the rows (and prefetch the next one)
  static const int per_sm = [&] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, 256, 0) != cudaSuccess) b = 0;
    return b > 0 ? b : 4;
  }();
  int64_t blocks = (rows + 7) / 8;  // 8 warps (rows) per block and pass
  const int64_t cap = (int64_t)quant::num_sms() * per_sm;
  if (blocks > cap) blocks = cap;
  kernel<<<(unsigned)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace gear
}  // namespace kvq
