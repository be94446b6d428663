// GEAR compress, VALUE side (per-token vectors, per_channel = False), long matrices: one
// kernel that reads every token row once and writes everything the select -> group bounds ->
// fill + quantize + residual -> zero-outliers chain writes (outlier_topk.cuh
// OutlierSelectWarp16, gear.cuh GearGroupBounds / GearClampQuantResid / GearZeroOutliers),
// with the CPU op's results.  Torch-free.
//
// Scope: fp16 / bf16, D in {64, 128, 256}, per-token groups G (power of two, 8 <= G <= D),
// 0 <= k <= KMAX (2, 4 or 8 by instantiation; k = 0: GEAR-L, no outliers: the bounds are the
// plain group min / max).  Everything else takes the multi-kernel path.
//
// Layout: 16 consecutive channels per lane (two 16-byte loads), LPR = D / 16 lanes per row
// (4, 8, 16), 32 / LPR rows per warp and pass (rows strided over the grid, the next pass's
// words prefetched), so the per-row work (selection rounds, group shuffles, qparams, entry
// writes) is shared by 16-channel lanes.
//  1. keys: the 32-bit composite (order key of the 16-bit value << 16 | b * 0x101), b = 0xff - j:
//     the strict order (value, -index) of outlier_topk.h, -0 < +0, NaNs at the ends.
//  2. selection: each lane keeps its P = min(KMAX + 1, 16) largest and smallest keys, then
//     k + 1 rounds of a log2(LPR)-step xor butterfly (max / min) over the row's lanes on the
//     list heads (the winning lane pops its head; keys are unique, so exactly one lane wins).
//     A lane holds at most k + 1 of the top k + 1, so the lists never run dry.  Round k
//     yields hiK / loK, the (k+1)-th largest / smallest keys: outliers are exactly the keys
//     > hiK or < loK.  Lanes write the 2k selected entries at their rank by index (the
//     winners are known to every lane of the row); after the residual stores (and a
//     __syncwarp) they also store the outliers' residual 0.
//     The per-lane lists: KMAX = 2 (GearValuesCompressK2Kernel, which serves k <= 2: s = 2 %
//     at D = 128, and GEAR-L) by a selection network (gear_select3.h: four sorted 4-groups,
//     top-3 merges), KMAX = 4 / 8 (GearValuesCompressKernel, 2 < k <= 8) by insertion
//     networks of unsigned max / min; both give the same lists (dispatch: gear_values_kernels.cu).
//  3. group bounds (gear.h): min / max over the group's non-outlier entries, NaN ignored (as
//     fminf / fmaxf); an empty group (k > 0) takes 0, 0.  Fast path (warp-uniform: no value
//     of the warp's rows outside [-65504, 65504], NaN / Inf included, read off the lane's
//     extreme keys; G >= 16): a lane's inlier min / max are its list heads after the rounds.
//  4. xc: inliers x, outliers fminf(fmaxf(x, lo), hi) with their group's bounds (the clamp's
//     value only decides the outlier's code: its residual is zeroed).  make_qparams, codes
//     (the 1.5 * 2^23 rounding add == __float2int_rn of the clamped q, as group_quant.cuh's
//     fast path; the fast path drops the q clamps), packed like group_quant.
//  5. resid = fp16(xc - fma(code, scale, zero)), 0 where non-finite or at an outlier.
//  6. status: value_status of x (the clamp step's finite check).
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <type_traits>

#include "kvq/gear/gear.h"
#include "kvq/gear/gear_select3.h"
#include "kvq/quant/group_quant.cuh"
#include "kvq/select/outlier_topk.cuh"

namespace kvq {
namespace gear {

/// \brief Does the fused value-side kernel handle this compress?  (16-bit dtype, per-token
/// groups, D in {64, 128, 256}, 0 <= k <= 8; k = 0 is GEAR-L: no selection output, no clamp.)
inline bool gear_values_supported(const GearParams& p, int dtype_bytes) {
  const int64_t G = p.q.group;
  return dtype_bytes == 2 && !p.per_channel && p.k >= 0 && p.k <= 8 &&
         (p.D == 64 || p.D == 128 || p.D == 256) && G >= 8 && G <= p.D && (G & (G - 1)) == 0 &&
         p.D % G == 0 && (p.q.bits == 2 || p.q.bits == 4 || p.q.bits == 8) && p.resid != nullptr &&
         (p.k == 0 || (p.ovalues != nullptr && p.oindices != nullptr));
}

/// Channels per lane: 16 (two 16-byte loads of 16-bit values), so that the per-row work
/// (selection rounds, group shuffles, qparams, entry writes) is shared by D / 16 lanes.
constexpr int kGvElems = 16;

/// The NW = 8 words of lane lr of a row (two 16-byte loads).
template <int NW>
__device__ __forceinline__ void gv_load_lane(const uint32_t* row, int lr, uint32_t (&w)[NW]) {
  static_assert(NW == 8, "two 16-byte loads per lane");
  const uint4* r4 = reinterpret_cast<const uint4*>(row) + 2 * lr;
  const uint4 a = r4[0], b = r4[1];
  w[0] = a.x;
  w[1] = a.y;
  w[2] = a.z;
  w[3] = a.w;
  w[4] = b.x;
  w[5] = b.y;
  w[6] = b.z;
  w[7] = b.w;
}

template <int NW>
__device__ __forceinline__ void gv_store_lane(uint16_t* row, int lr, const uint32_t (&w)[NW]) {
  static_assert(NW == 8, "two 16-byte stores per lane");
  uint4* r4 = reinterpret_cast<uint4*>(row) + 2 * lr;
  r4[0] = make_uint4(w[0], w[1], w[2], w[3]);
  r4[1] = make_uint4(w[4], w[5], w[6], w[7]);
}

/// prmt.b32 (default mode: a selector nibble with bit 3 set replicates the byte's sign).
__device__ __forceinline__ uint32_t gv_prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

/// Selected entry t (t < k: top entry t, else bottom entry t - k), t < 2k.
template <int KMAX>
__device__ __forceinline__ uint32_t gv_entry(const uint32_t (&tb)[KMAX], const uint32_t (&bb)[KMAX],
                                             int t, int k) {
  const bool top = t < k;
  const int tt = top ? t : t - k;
  uint32_t item = 0u;
#pragma unroll
  for (int rr = 0; rr < KMAX; ++rr)
    if (rr == tt) item = top ? tb[rr] : bb[rr];
  return item;
}

/// The lane's E codes, given as the bits of 1.5 * 2^23 + code, packed (code i at bit
/// (i % (32 / BITS)) * BITS of word i / (32 / BITS)) by shift-adds and stored (E * BITS / 32
/// words at words[lr * that]).
template <int E, int BITS>
__device__ __forceinline__ void gv_pack_store(const uint32_t (&mb)[E], int32_t* words, int lr) {
  constexpr int CPW = 32 / BITS, WPL = E / CPW;
  static_assert(E % CPW == 0 && (WPL == 1 || WPL == 2 || WPL == 4), "whole words per lane");
  uint32_t o[WPL];
#pragma unroll
  for (int wi = 0; wi < WPL; ++wi) {
    uint32_t s = 0u - quant::magic_word_sum<BITS>(CPW);
#pragma unroll
    for (int j = 0; j < CPW; ++j) s += mb[wi * CPW + j] << (j * BITS);
    o[wi] = s;
  }
  uint32_t* dst = reinterpret_cast<uint32_t*>(words) + lr * WPL;
  if constexpr (WPL == 1) {
    dst[0] = o[0];
  } else {
#pragma unroll
    for (int wi = 0; wi < WPL; wi += 2) reinterpret_cast<uint2*>(dst)[wi / 2] = make_uint2(o[wi], o[wi + 1]);
  }
}

template <typename DType>
__device__ __forceinline__ float gv_to_float(uint32_t bits16) {
  DType v;
  v.bits = (uint16_t)bits16;
  return to_float(v);
}

/// \brief The fused value-side compress (see the file comment): the body of both kernels.
template <typename DType, int D, int BITS, int KMAX>
__device__ __forceinline__ void gv_compress_body(const GearParams& p) {
  constexpr int E = kGvElems;                   // channels per lane (two 16-byte loads)
  constexpr int LPR = D / E;                    // lanes per row: 4, 8 or 16
  constexpr int RPW = 32 / LPR;                 // rows per warp and pass: 8, 4 or 2
  constexpr int NW = E / 2;                     // 32-bit words per lane
  constexpr int NC = E / 8;                     // 8-channel chunks per lane (G >= 8)
  constexpr int P = KMAX + 1 < E ? KMAX + 1 : E;  // list depth
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  constexpr unsigned FULL = 0xffffffffu;
  static_assert(D % E == 0 && LPR >= 2 && LPR <= 32 && 2 * KMAX <= D, "layout");
  const int lane = threadIdx.x & 31;
  const int lr = lane % LPR;                    // lane within the row's group
  const int64_t rows = p.N * p.T;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t step = (((int64_t)gridDim.x * blockDim.x) >> 5) * RPW;  // rows per pass
  const int k = (int)p.k, G = (int)p.q.group;
  const bool small_g = G < E;                   // G == 8: NC groups per lane
  const int lpg = small_g ? 1 : G / E;          // lanes per group
  const int gpr = D / G;                        // groups per row
  const bool check = p.status != nullptr;
  const uint32_t* x = static_cast<const uint32_t*>(p.x);
  DType* ovalues = static_cast<DType*>(const_cast<void*>(p.ovalues));
  uint8_t* oindices = static_cast<uint8_t*>(const_cast<void*>(p.oindices));
  constexpr uint32_t LIM = std::is_same<DType, bf16_t>::value ? 0x477fu : 0x7bffu;  // largest |x| <= kMaxAbs
  constexpr uint32_t HI_OK = ((0x8000u | LIM) << 16) | 0xffffu;    // keys in [LO_OK, HI_OK]:
  constexpr uint32_t LO_OK = (0x7fffu - LIM) << 16;                 // |x| <= kMaxAbs
  // tie bytes b = 0xff - j of the lane's channels j = lr * E + i, four per word
  // (bytes 0xff - j0 - 4q - t, t = 0..3, j0 = lr * E <= 240: no byte borrows, so one
  // multiply-subtract per word)
  uint32_t tie[E / 4];
  {
    const uint32_t tie0 = (0xffu - (uint32_t)(lr * E)) * 0x01010101u - 0x03020100u;
#pragma unroll
    for (int q = 0; q < E / 4; ++q) tie[q] = tie0 - (uint32_t)q * 0x04040404u;
  }
  const int gidx = small_g ? 0 : (lr * E) / G;          // G >= E: this lane's group
  const bool gwriter = small_g || ((lr * E) & (G - 1)) == 0;  // its first lane
  int32_t status = 0;
  uint32_t nxt[NW];
  {
    const int64_t r0 = warp * RPW + lane / LPR;
    if (r0 < rows) gv_load_lane<NW>(x + r0 * (D / 2), lr, nxt);
  }
  for (int64_t rb = warp * RPW; rb < rows; rb += step) {  // warp-uniform
    const int64_t r = rb + lane / LPR;          // this lane's row
    const bool valid = r < rows;
    uint32_t w[NW];
#pragma unroll
    for (int i = 0; i < NW; ++i) w[i] = valid ? nxt[i] : 0u;
    if (r + step < rows) gv_load_lane<NW>(x + (r + step) * (D / 2), lr, nxt);

    // ---- 1. composite keys: (order key of the 16-bit value << 16) | tie, tie = b * 0x101 with
    // b = 0xff - j (j < 256 the channel): the strict order (value, -index), -0 < +0, NaNs at the
    // ends.  Per word: the two order keys at once (prmt sign replication: a negative half flips
    // all 16 bits, a positive one only the sign bit), then one prmt per element.
    uint32_t key[E];
#pragma unroll
    for (int q = 0; q < NW; ++q) {
      const uint32_t ok2 = w[q] ^ (gv_prmt(w[q], 0u, 0xbb99u) | 0x80008000u);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int i = 2 * q + h, t = i & 3;
        key[i] = gv_prmt(ok2, tie[i / 4],
                         (4u + t) | ((4u + t) << 4) | ((2u * h) << 8) | ((2u * h + 1) << 12));
      }
    }

    // ---- 2. selection
    uint32_t tl[P], bl[P];
#pragma unroll
    for (int d = 0; d < P; ++d) {
      tl[d] = 0u;
      bl[d] = FULL;
    }
    if constexpr (KMAX == 2 && P == 3 && E == 16) {  // selection network (same lists)
      gv_select3_16(key, tl, bl);
    } else {
#pragma unroll
      for (int i = 0; i < E; ++i) {
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
    }
    // any |x| > kMaxAbs, Inf or NaN in this lane (in key order: outside [LO_OK, HI_OK])
    const bool lane_bad = valid && (tl[0] > HI_OK || bl[0] < LO_OK);
    uint32_t tb[KMAX], bb[KMAX];
    uint32_t hiK = 0u, loK = FULL;
#pragma unroll
    for (int rr = 0; rr <= KMAX; ++rr) {
      if (rr <= k) {  // warp-uniform
        uint32_t bt = tl[0], bm = bl[0];
#pragma unroll
        for (int o = 1; o < LPR; o <<= 1) {  // butterfly within the row's lanes
          bt = max(bt, __shfl_xor_sync(FULL, bt, o));
          bm = min(bm, __shfl_xor_sync(FULL, bm, o));
        }
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
    // selected entries: entry t < k is top entry t, k <= t < 2k bottom entry t - k; lane lr
    // writes entries lr, lr + LPR, ... at their rank by index (larger tie = smaller index)
#pragma unroll
    for (int t0 = 0; t0 < 2 * KMAX; t0 += LPR) {
      const int t = t0 + lr;
      if (valid && t < 2 * k) {
        const uint32_t item = gv_entry<KMAX>(tb, bb, t, k);
        const bool top = t < k;
        int rank = 0;
#pragma unroll
        for (int rr = 0; rr < KMAX; ++rr)
          if (rr < k) rank += ((top ? tb[rr] : bb[rr]) & 0xffu) > (item & 0xffu) ? 1 : 0;
        const int64_t pos = r * 2 * k + (top ? 0 : k) + rank;
        DType v;
        v.bits = select::key16_to_bits(item >> 16);
        ovalues[pos] = v;
        oindices[pos] = (uint8_t)(0xffu - (item & 0xffu));
      }
    }
    // fast path (warp-uniform): every value of the warp's rows finite with |x| <= kMaxAbs;
    // then key order is value order (-0 < +0: the sign of a zero bound changes no output,
    // make_qparams normalises it and only outliers are clamped), and the codes need neither
    // clamp nor finite check (group_quant.cuh's fast-path argument: every xc lies in its
    // group's [min, max])
    const bool fast = !__any_sync(FULL, lane_bad);

    // ---- 3. group bounds: min / max over the non-outlier entries (outliers: key > hiK or
    // key < loK), per 8-channel chunk, then (G >= E) over the chunks of the lane and the
    // G / E lanes of the group; an empty group (k > 0): 0, 0
    float xv[E];
#pragma unroll
    for (int i = 0; i < E; ++i) xv[i] = gv_to_float<DType>((w[i / 2] >> (16 * (i & 1))) & 0xffffu);
    float mn[NC], mx[NC];
    if (fast && !small_g) {  // warp-uniform
      // after the k rounds bl[0] / tl[0] are the lane's smallest / largest key that is not a
      // bottom / top outlier (the rounds popped exactly those): its inlier min / max, unless
      // the lane holds outliers only (bl[0] > hiK)
      const bool has = bl[0] <= hiK;
      mn[0] = has ? gv_to_float<DType>(select::key16_to_bits(bl[0] >> 16)) : INFINITY;
      mx[0] = has ? gv_to_float<DType>(select::key16_to_bits(tl[0] >> 16)) : -INFINITY;
    } else {
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        mn[c] = INFINITY;
        mx[c] = -INFINITY;
#pragma unroll
        for (int i = 8 * c; i < 8 * c + 8; ++i) {
          const float f = (key[i] > hiK || key[i] < loK) ? NAN : xv[i];  // NaN: ignored
          mn[c] = fminf(mn[c], f);
          mx[c] = fmaxf(mx[c], f);
        }
      }
      if (!small_g) {
#pragma unroll
        for (int c = 1; c < NC; ++c) {
          mn[0] = fminf(mn[0], mn[c]);
          mx[0] = fmaxf(mx[0], mx[c]);
        }
      }
    }
    if (!small_g) {  // warp-uniform
#pragma unroll
      for (int o = 1; o < LPR; o <<= 1) {  // o < lpg <= LPR: stays within the row's lanes
        if (o < lpg) {                      // warp-uniform
          mn[0] = fminf(mn[0], __shfl_xor_sync(FULL, mn[0], o));
          mx[0] = fmaxf(mx[0], __shfl_xor_sync(FULL, mx[0], o));
        }
      }
#pragma unroll
      for (int c = 1; c < NC; ++c) {
        mn[c] = mn[0];
        mx[c] = mx[0];
      }
    }
    if (k > 0) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
        if (group_empty(mn[c], mx[c])) mn[c] = mx[c] = 0.f;
    }

    // ---- 4. xc: x at inliers, outliers clamped into their group's bounds (only their value
    // matters: it decides the code, the residual is zeroed); + finite check of x
    float v[E];
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const int c = i / 8;
      v[i] = (key[i] > hiK || key[i] < loK) ? fminf(fmaxf(xv[i], mn[c]), mx[c]) : xv[i];
    }
    if (check && lane_bad) {  // the exact flags
#pragma unroll
      for (int i = 0; i < E; ++i) status |= quant::value_status(xv[i]);
    }
    float qzero[NC], qinv[NC], qscale[NC];
    if (small_g) {  // warp-uniform; G == 8: NC groups per lane
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const quant::QParams q = quant::make_qparams(mn[c], mx[c], BITS);
        if (valid) {
          p.q.scale[r * gpr + lr * NC + c] = q.s16;
          p.q.zero[r * gpr + lr * NC + c] = q.z16;
        }
        qzero[c] = q.zero;
        qinv[c] = q.inv;
        qscale[c] = q.scale;
      }
    } else {
      const quant::QParams q = quant::make_qparams(mn[0], mx[0], BITS);
      if (valid && gwriter) {
        p.q.scale[r * gpr + gidx] = q.s16;
        p.q.zero[r * gpr + gidx] = q.z16;
      }
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        qzero[c] = q.zero;
        qinv[c] = q.inv;
        qscale[c] = q.scale;
      }
    }
    // codes as the bits of m = 1.5 * 2^23 + rint(q) (ties to even; packed by shift-adds, the
    // magic sums subtracted per word), residuals (outliers zeroed below)
    // (two copies: the fast one without the clamps of q and the finite check of the residual)
    auto codes_resid = [&](auto fast_c) {
      constexpr bool FAST = decltype(fast_c)::value;
      uint32_t mb[E];
      float d[E];
#pragma unroll
      for (int i = 0; i < E; ++i) {
        const int c = i / 8;
        float qv = __fmul_rn(__fsub_rn(v[i], qzero[c]), qinv[c]);
        if (!FAST) qv = fminf(fmaxf(qv, 0.f), MAXQ);  // NaN -> 0, as quant_code
        const float m = __fadd_rn(qv, 12582912.f);
        mb[i] = __float_as_uint(m);
        const float cf = __fsub_rn(m, 12582912.f);    // (float)code, exact
        // NOTE: code * scale + zero as one FMA, as GearClampQuantResidKernel.
        const float dd = __fsub_rn(v[i], __fmaf_rn(cf, qscale[c], qzero[c]));
        d[i] = (FAST || isfinite(dd)) ? dd : 0.f;
      }
      uint32_t rw[NW];  // fp16 residual words
#pragma unroll
      for (int i = 0; i < E; i += 2) {
        const __half2 h2 = __floats2half2_rn(d[i], d[i + 1]);
        rw[i / 2] = *reinterpret_cast<const uint32_t*>(&h2);
      }
      if (valid) {
        gv_pack_store<E, BITS>(mb, p.q.codes + r * (D * BITS / 32), lr);
        gv_store_lane<NW>(p.resid + r * D, lr, rw);
      }
    };
    if (fast) {
      codes_resid(std::true_type{});
    } else {
      codes_resid(std::false_type{});
    }
    // outliers: residual 0 (after the row's stores: __syncwarp orders the warp's stores)
    __syncwarp();
#pragma unroll
    for (int t0 = 0; t0 < 2 * KMAX; t0 += LPR) {
      const int t = t0 + lr;
      if (valid && t < 2 * k) {
        const uint32_t item = gv_entry<KMAX>(tb, bb, t, k);
        p.resid[r * D + (0xffu - (item & 0xffu))] = 0;
      }
    }
    __syncwarp();  // before the next pass (WAR on nothing shared; keeps the warp converged)
  }
  quant::report_status(p.status, check ? status : 0);
}

/// \brief The fused value-side compress, KMAX = 4 / 8.  256 threads, any grid.
template <typename DType, int D, int BITS, int KMAX>
__global__ void __launch_bounds__(256) GearValuesCompressKernel(GearParams p) {
  gv_compress_body<DType, D, BITS, KMAX>(p);
}

/// \brief KMAX = 2 (k <= 2: s = 2 % at D = 128, GEAR-L): 3 CTAs of 256 per SM requested, so
/// that ptxas stays within 80 registers (2 CTAs per SM otherwise).
template <typename DType, int D, int BITS>
__global__ void __launch_bounds__(256, 3) GearValuesCompressK2Kernel(GearParams p) {
  gv_compress_body<DType, D, BITS, 2>(p);
}

/// \brief Launch (p: the long-path GearParams of gear_compress; gear_values_supported).
template <typename DType, int D, int BITS, int KMAX>
cudaError_t GearValuesCompress(const GearParams& p, cudaStream_t stream) {
  const int64_t rows = p.N * p.T;
  if (rows == 0) return cudaSuccess;
  void (*kernel)(GearParams) = nullptr;
  if constexpr (KMAX == 2) {
    kernel = GearValuesCompressK2Kernel<DType, D, BITS>;
  } else {
    kernel = GearValuesCompressKernel<DType, D, BITS, KMAX>;
  }
  constexpr int RPW = 32 / (D / kGvElems);
  // one resident wave: the warps stride over the rows (and prefetch the next ones)
  static const int per_sm = [&] {
    int b = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, kernel, 256, 0) != cudaSuccess) b = 0;
    return b > 0 ? b : 4;
  }();
  int64_t blocks = (rows + 8 * RPW - 1) / (8 * RPW);  // 8 warps x RPW rows per block and pass
  const int64_t cap = (int64_t)quant::num_sms() * per_sm;
  if (blocks > cap) blocks = cap;
  kernel<<<(unsigned)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace gear
}  // namespace kvq
