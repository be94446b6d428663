// CUDA kernels for group quantize/dequantize with bit packing.  Torch-free.
// Block format and arithmetic: group_quant.h.
//
// Thread mapping: one warp per token row, lane l owns the EPL = D / 32 consecutive
// channels [l * EPL, (l + 1) * EPL) and loads them with one vector load (EPL * sizeof(T)
// bytes).  Per-token groups are lane-aligned (G / EPL lanes, a power of two) and reduced
// with xor shuffles; per-channel groups are reduced over the tokens of a tile in shared
// memory.  Packing gathers EPL * BITS bits per lane into 32-bit words with shuffles.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "kvq/common/half.h"
#include "kvq/quant/group_quant.h"

namespace kvq {
namespace quant {

constexpr unsigned kFullMask = 0xffffffffu;

template <typename T, int N>
struct alignas(sizeof(T) * N) VecT {
  T v[N];
};

/// \brief Load EPL elements of one row as floats (one vector load).
template <typename DType, int EPL>
__device__ __forceinline__ void load_row_slice(const DType* row, int lane, float (&v)[EPL]) {
  VecT<DType, EPL> d = reinterpret_cast<const VecT<DType, EPL>*>(row)[lane];
#pragma unroll
  for (int i = 0; i < EPL; ++i) v[i] = to_float(d.v[i]);
}

template <typename DType, int EPL>
__device__ __forceinline__ void store_row_slice(DType* row, int lane, const float (&v)[EPL]) {
  VecT<DType, EPL> d;
#pragma unroll
  for (int i = 0; i < EPL; ++i) d.v[i] = from_float<DType>(v[i]);
  reinterpret_cast<VecT<DType, EPL>*>(row)[lane] = d;
}

/// \brief Pack the EPL codes of every lane into the row's words (LSB-first) and store them.
template <int EPL, int BITS>
__device__ __forceinline__ void pack_and_store(const uint32_t (&code)[EPL], int lane,
                                               int32_t* words) {
  constexpr int LANE_BITS = EPL * BITS;
  uint64_t v = 0;
#pragma unroll
  for (int i = 0; i < EPL; ++i) v |= (uint64_t)code[i] << (i * BITS);
  if constexpr (LANE_BITS >= 32) {
    constexpr int WPL = LANE_BITS / 32;  // words per lane (1 or 2)
#pragma unroll
    for (int i = 0; i < WPL; ++i) words[lane * WPL + i] = (int32_t)(uint32_t)(v >> (32 * i));
  } else {
    constexpr int LPW = 32 / LANE_BITS;  // lanes per word
    uint32_t w = (uint32_t)v;
#pragma unroll
    for (int o = 1; o < LPW; o <<= 1) w |= __shfl_down_sync(kFullMask, w, o) << (o * LANE_BITS);
    if (lane % LPW == 0) words[lane / LPW] = (int32_t)w;
  }
}

/// \brief Unpack the EPL codes of this lane from a row's words.
template <int EPL, int BITS>
__device__ __forceinline__ void load_and_unpack(const int32_t* words, int lane,
                                                uint32_t (&code)[EPL]) {
  constexpr int LANE_BITS = EPL * BITS;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  uint64_t v;
  if constexpr (LANE_BITS >= 32) {
    constexpr int WPL = LANE_BITS / 32;
    if constexpr (WPL == 2) {
      uint2 w = reinterpret_cast<const uint2*>(words)[lane];
      v = (uint64_t)w.x | ((uint64_t)w.y << 32);
    } else {
      v = (uint32_t)words[lane];
    }
  } else {
    constexpr int LPW = 32 / LANE_BITS;
    v = (uint32_t)words[lane / LPW] >> ((lane % LPW) * LANE_BITS);
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) code[i] = (uint32_t)(v >> (i * BITS)) & MASK;
}

__device__ __forceinline__ void report_status(int32_t* status, int32_t local) {
  if (status == nullptr) return;
  int32_t any = __reduce_or_sync(kFullMask, local);
  if (any && (threadIdx.x % 32) == 0) atomicOr(status, any);
}

// ---------------------------------------------------------------------------
// Per-token quantization: one warp per token row, ROWS rows in flight per warp.
// ---------------------------------------------------------------------------
template <typename DType, int EPL, int BITS, int ROWS>
__global__ void GroupQuantizePerTokenKernel(GroupQuantParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / 32;
  const int64_t rows = p.N * p.T;
  const int lpg = (int)(p.group / EPL);  // lanes per group (power of two, <= 32)
  const int ngroups = (int)(p.D / p.group);
  constexpr int D = EPL * 32;
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  const DType* x = static_cast<const DType*>(p.x);
  int32_t status = 0;
  for (int64_t r0 = warp * ROWS; r0 < rows; r0 += nwarps * ROWS) {
    float v[ROWS][EPL];
#pragma unroll
    for (int j = 0; j < ROWS; ++j)
      if (r0 + j < rows) load_row_slice<DType, EPL>(x + (r0 + j) * D, lane, v[j]);
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int64_t r = r0 + j;
      if (r >= rows) break;  // warp-uniform
      float mn = v[j][0], mx = v[j][0];
#pragma unroll
      for (int i = 0; i < EPL; ++i) {
        if (p.status) status |= value_status(v[j][i]);
        mn = fminf(mn, v[j][i]);
        mx = fmaxf(mx, v[j][i]);
      }
      for (int o = 1; o < lpg; o <<= 1) {
        mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      }
      QParams q = make_qparams(mn, mx, BITS);
      if (lane % lpg == 0) {
        p.scale[r * ngroups + lane / lpg] = q.s16;
        p.zero[r * ngroups + lane / lpg] = q.z16;
      }
      uint32_t code[EPL];
#pragma unroll
      for (int i = 0; i < EPL; ++i) code[i] = quant_code(v[j][i], q.zero, q.inv, MAXQ);
      pack_and_store<EPL, BITS>(code, lane, p.codes + r * (D * BITS / 32));
    }
  }
  report_status(p.status, status);
}

// ---------------------------------------------------------------------------
// Per-token quantization for G a multiple of 32 (v7): one lane per 32-channel chunk of a row,
// chunks staged through shared memory so that every global access is coalesced.
//
// A warp owns "tiles" of 32 consecutive chunks (2 KB of 16-bit input, 4 KB of fp32; rows never
// straddle a tile since D / 32 divides 32).  It copies tile k + 1 into its second shared-memory
// buffer with 16-byte cp.async (lane l copies vectors u * 32 + l: 512 contiguous bytes per
// warp instruction) while it works on tile k, then each lane reads its own chunk (NV 16-byte
// vectors).  The buffer index is XOR-swizzled (s ^ ((s >> 3) & 7)) so that both the copy and the
// per-lane read hit 8 distinct 16-byte bank groups per quarter warp.
//
// Per chunk: min/max on the raw 16-bit values (HMNMX2, NaN-propagating, two elements per
// instruction), G / 32 lanes combine with xor shuffles, each lane computes the group's
// make_qparams and packs its 32 codes into BITS words (one 8/16-byte store).  Codes by the
// 1.5 * 2^23 add and one shift-add each, as in the per-channel tile kernel (see the comment
// above quantize_pack_store): bit-identical to quant_code() when every value of the group is
// finite with |x| <= kMaxAbs (then q = (x - zero) * inv lies in [0, maxq * (1 + 2^-22)], so
// neither clamp can change the rounded code).  A warp whose tile holds any NaN, Inf or
// |x| > kMaxAbs takes the exact fallback instead: NaN-ignoring fminf/fmaxf, quant_code()
// and value_status() per element, i.e. literally the CPU op's arithmetic.  The fast path never
// sees a value that could set a status flag, so it skips the per-element check.
// ---------------------------------------------------------------------------
/// \brief Sum over the first M codes of a word of (bits of 1.5 * 2^23) << (i * BITS), mod 2^32.
template <int BITS>
__host__ __device__ constexpr uint32_t magic_word_sum(int m) {
  uint32_t s = 0;
  for (int i = 0; i < m; ++i) s += 0x4b400000u << (i * BITS);
  return s;
}

/// 16-byte cp.async to a shared-memory address (as from __cvta_generic_to_shared).
__device__ __forceinline__ void gq_cp_async16(uint32_t smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem), "l"(gmem) : "memory");
}
__device__ __forceinline__ void gq_cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void gq_cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/// 16-byte slot swizzle of a warp tile buffer (bijective inside every aligned 8-slot block).
__device__ __forceinline__ int gq_swz(int s) { return s ^ ((s >> 3) & 7); }

/// \brief NaN-propagating elementwise min (MAX = false) or max of two words of packed DType
/// (raw bits).
template <typename DType, bool MAX>
__device__ __forceinline__ uint32_t vminmax_nan(uint32_t a, uint32_t b) {
  if constexpr (sizeof(DType) == 4) {
    float r;
    if constexpr (MAX)
      asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(__uint_as_float(a)), "f"(__uint_as_float(b)));
    else
      asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(__uint_as_float(a)), "f"(__uint_as_float(b)));
    return __float_as_uint(r);
  } else {
    using V2 = typename std::conditional<std::is_same<DType, half_t>::value, __half2, __nv_bfloat162>::type;
    const V2 x = *reinterpret_cast<const V2*>(&a), y = *reinterpret_cast<const V2*>(&b);
    V2 r;
    if constexpr (MAX) r = __hmax2_nan(x, y);
    else r = __hmin2_nan(x, y);
    return *reinterpret_cast<const uint32_t*>(&r);
  }
}
template <typename DType>
__device__ __forceinline__ uint32_t vmin_nan(uint32_t a, uint32_t b) { return vminmax_nan<DType, false>(a, b); }
template <typename DType>
__device__ __forceinline__ uint32_t vmax_nan(uint32_t a, uint32_t b) { return vminmax_nan<DType, true>(a, b); }

/// \brief min / max of a 32-value chunk (NV raw 16-byte vectors), NaN-propagating; `bad` is set
/// when the chunk holds a NaN, an infinity or a magnitude above kMaxAbs.
template <typename DType, int NV>
__device__ __forceinline__ void chunk_minmax_fast(const uint4 (&r)[NV], float& mn, float& mx,
                                                  bool& bad) {
  constexpr int NW = 4 * NV;
  const uint32_t* w = reinterpret_cast<const uint32_t*>(r);
  uint32_t a[4], b[4];  // four independent chains, then a 2-level tree
#pragma unroll
  for (int j = 0; j < 4; ++j) a[j] = b[j] = w[j];
#pragma unroll
  for (int i = 4; i < NW; ++i) {
    a[i % 4] = vmin_nan<DType>(a[i % 4], w[i]);
    b[i % 4] = vmax_nan<DType>(b[i % 4], w[i]);
  }
  a[0] = vmin_nan<DType>(vmin_nan<DType>(a[0], a[1]), vmin_nan<DType>(a[2], a[3]));
  b[0] = vmax_nan<DType>(vmax_nan<DType>(b[0], b[1]), vmax_nan<DType>(b[2], b[3]));
  if constexpr (sizeof(DType) == 4) {
    mn = __uint_as_float(a[0]);
    mx = __uint_as_float(b[0]);
    bad = !(mn >= -kMaxAbs && mx <= kMaxAbs);  // false for NaN
  } else {
    const DType* ea = reinterpret_cast<const DType*>(&a[0]);
    const DType* eb = reinterpret_cast<const DType*>(&b[0]);
    const float a0 = to_float(ea[0]), a1 = to_float(ea[1]);
    const float b0 = to_float(eb[0]), b1 = to_float(eb[1]);
    mn = fminf(a0, a1);
    mx = fmaxf(b0, b1);
    bad = !(a0 >= -kMaxAbs && a1 >= -kMaxAbs && b0 <= kMaxAbs && b1 <= kMaxAbs);
  }
}

/// \brief Codes of a 32-value chunk packed into BITS words (fast path; see the comment above).
template <typename DType, int NV, int BITS>
__device__ __forceinline__ void quantize_chunk_fast(const uint4 (&r)[NV], float z, float inv,
                                                    uint32_t (&w)[BITS]) {
  constexpr int CPW = 32 / BITS;
  const DType* e = reinterpret_cast<const DType*>(r);
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    // _rn intrinsics: never contracted into an FFMA (the rounding of each step matters)
    const float q = __fmul_rn(__fsub_rn(to_float(e[i]), z), inv);
    const uint32_t b = __float_as_uint(__fadd_rn(q, 12582912.f));  // 0x4b400000 + rint(q)
    const int j = i / CPW, sh = (i % CPW) * BITS;
    w[j] = (i % CPW == 0) ? b : w[j] + (b << sh);
  }
#pragma unroll
  for (int j = 0; j < BITS; ++j) w[j] -= magic_word_sum<BITS>(CPW);
}

template <int BITS>
__device__ __forceinline__ void store_chunk_words(int32_t* dst, const uint32_t (&w)[BITS]) {
  if constexpr (BITS == 2) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
#pragma unroll
    for (int k = 0; k < BITS; k += 4)
      *reinterpret_cast<uint4*>(dst + k) = make_uint4(w[k], w[k + 1], w[k + 2], w[k + 3]);
  }
}

/// Warps per block of the per-token tile kernel (2 buffers x 32 chunks each: 32 KB per block).
template <typename DType>
constexpr int per_token_tile_warps() {
  return sizeof(DType) == 4 ? 4 : 8;
}

template <typename DType, int BITS>
__global__ void __launch_bounds__(per_token_tile_warps<DType>() * 32)
    GroupQuantizePerTokenTileKernel(GroupQuantParams p, int lpg_log2) {
  constexpr int WARPS = per_token_tile_warps<DType>();
  constexpr int NV = 2 * (int)sizeof(DType);  // 16-byte vectors per 32-channel chunk
  constexpr int TV = 32 * NV;                 // vectors per tile
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  constexpr int CPW = 32 / BITS;
  __shared__ __align__(16) uint4 s_tile[WARPS][2][TV];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t chunks = p.N * p.T * (p.D / 32);
  const int64_t tiles = (chunks + 31) / 32;
  const int64_t nvec = chunks * NV;
  const int64_t tstride = (int64_t)gridDim.x * WARPS;
  const int lpg = 1 << lpg_log2;  // lanes per group: 1, 2, 4 or 8
  const uint4* src = static_cast<const uint4*>(p.x);
  const bool check = p.status != nullptr;
  int32_t status = 0;
  // shared-memory byte address of this lane's copy slot u in buffer 0 (buffer 1: + TV * 16)
  const uint32_t sbase = (uint32_t)__cvta_generic_to_shared(&s_tile[warp][0][0]);
  uint32_t sdst[NV];
#pragma unroll
  for (int u = 0; u < NV; ++u) sdst[u] = sbase + 16u * (uint32_t)gq_swz(u * 32 + lane);
  auto issue = [&](int64_t t, int buf) {
    const uint4* g = src + t * TV + lane;
    const uint32_t off = (uint32_t)buf * (TV * 16);
    if ((t + 1) * TV <= nvec) {  // whole tile in range (all but possibly the last one)
#pragma unroll
      for (int u = 0; u < NV; ++u) gq_cp_async16(sdst[u] + off, g + u * 32);
    } else {
#pragma unroll
      for (int u = 0; u < NV; ++u)
        if (t * TV + u * 32 + lane < nvec) gq_cp_async16(sdst[u] + off, g + u * 32);
    }
  };
  int64_t t = (int64_t)blockIdx.x * WARPS + warp;
  if (t < tiles) issue(t, 0);
  gq_cp_async_commit();
  for (int b = 0; t < tiles; t += tstride, b ^= 1) {  // warp-uniform loop
    if (t + tstride < tiles) issue(t + tstride, b ^ 1);
    gq_cp_async_commit();
    gq_cp_async_wait<1>();  // this lane's copies of tile t have landed
    __syncwarp();           // ... and every other lane's
    uint4 r[NV];
#pragma unroll
    for (int v = 0; v < NV; ++v) r[v] = s_tile[warp][b][gq_swz(lane * NV + v)];
    __syncwarp();  // buffer b is refilled at the next iteration
    const int64_t c = t * 32 + lane;  // this lane's chunk
    const bool valid = c < chunks;    // groups never straddle the end (G / 32 | D / 32)
    float mn, mx;
    bool bad;
    chunk_minmax_fast<DType, NV>(r, mn, mx, bad);
    if (!__any_sync(kFullMask, bad && valid)) {
      for (int o = 1; o < lpg; o <<= 1) {
        mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      }
      if (valid) {
        const QParams q = make_qparams(mn, mx, BITS);
        if ((lane & (lpg - 1)) == 0) {
          p.scale[c >> lpg_log2] = q.s16;
          p.zero[c >> lpg_log2] = q.z16;
        }
        uint32_t w[BITS];
        quantize_chunk_fast<DType, NV, BITS>(r, q.zero, q.inv, w);
        store_chunk_words<BITS>(p.codes + c * BITS, w);
      }
    } else {
      // exact fallback: the CPU op's arithmetic, element by element
      const DType* e = reinterpret_cast<const DType*>(r);
      mn = INFINITY;
      mx = -INFINITY;
#pragma unroll
      for (int i = 0; i < 32; ++i) {
        const float v = to_float(e[i]);
        if (check && valid) status |= value_status(v);
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
      }
      for (int o = 1; o < lpg; o <<= 1) {
        mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, o));
        mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
      }
      if (valid) {
        const QParams q = make_qparams(mn, mx, BITS);
        if ((lane & (lpg - 1)) == 0) {
          p.scale[c >> lpg_log2] = q.s16;
          p.zero[c >> lpg_log2] = q.z16;
        }
        uint32_t w[BITS];
#pragma unroll
        for (int k = 0; k < BITS; ++k) w[k] = 0u;
#pragma unroll
        for (int i = 0; i < 32; ++i)
          w[i / CPW] |= quant_code(to_float(e[i]), q.zero, q.inv, MAXQ) << ((i % CPW) * BITS);
        store_chunk_words<BITS>(p.codes + c * BITS, w);
      }
    }
  }
  gq_cp_async_wait<0>();
  if (check) report_status(p.status, status);
}

// ---------------------------------------------------------------------------
// Per-channel quantization: one block per (matrix n, group of G tokens).  Pass 1 reduces
// min/max per channel over the G tokens (warps stride over tokens, then shared memory);
// pass 2 re-reads the tile (L1/L2-resident for KIVI group sizes) and packs.
// NOTE: keeping the rows in registers between the passes measured slower on the H200
// (93 vs 43 us at G = 32, [8, 8, 4096, 128] fp16), so the tile is re-read.
// ---------------------------------------------------------------------------
template <typename DType, int EPL, int BITS, int WARPS>
__global__ void __launch_bounds__(WARPS * 32)
    GroupQuantizePerChannelKernel(GroupQuantParams p) {
  constexpr int D = EPL * 32;
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  __shared__ float s_min[WARPS][D];
  __shared__ float s_max[WARPS][D];
  __shared__ float s_zero[D];
  __shared__ float s_inv[D];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t ngroups = p.T / p.group;
  const int64_t n = blockIdx.x / ngroups, g = blockIdx.x % ngroups;
  const DType* x = static_cast<const DType*>(p.x) + (n * p.T + g * p.group) * D;
  int32_t status = 0;

  float mn[EPL], mx[EPL];
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    mn[i] = INFINITY;
    mx[i] = -INFINITY;
  }
  for (int64_t t = warp; t < p.group; t += WARPS) {
    float v[EPL];
    load_row_slice<DType, EPL>(x + t * D, lane, v);
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      if (p.status) status |= value_status(v[i]);
      mn[i] = fminf(mn[i], v[i]);
      mx[i] = fmaxf(mx[i], v[i]);
    }
  }
#pragma unroll
  for (int i = 0; i < EPL; ++i) {
    s_min[warp][lane * EPL + i] = mn[i];
    s_max[warp][lane * EPL + i] = mx[i];
  }
  __syncthreads();
  for (int c = threadIdx.x; c < D; c += WARPS * 32) {
    float a = s_min[0][c], b = s_max[0][c];
#pragma unroll
    for (int w = 1; w < WARPS; ++w) {
      a = fminf(a, s_min[w][c]);
      b = fmaxf(b, s_max[w][c]);
    }
    QParams q = make_qparams(a, b, BITS);
    p.scale[blockIdx.x * (int64_t)D + c] = q.s16;
    p.zero[blockIdx.x * (int64_t)D + c] = q.z16;
    s_zero[c] = q.zero;
    s_inv[c] = q.inv;
  }
  __syncthreads();
  int32_t* codes = p.codes + (n * p.T + g * p.group) * (D * BITS / 32);
  for (int64_t t = warp; t < p.group; t += WARPS) {
    float v[EPL];
    load_row_slice<DType, EPL>(x + t * D, lane, v);
    uint32_t code[EPL];
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      code[i] = quant_code(v[i], s_zero[lane * EPL + i], s_inv[lane * EPL + i], MAXQ);
    pack_and_store<EPL, BITS>(code, lane, codes + t * (D * BITS / 32));
  }
  report_status(p.status, status);
}

// ---------------------------------------------------------------------------
// Per-channel quantization, "lane owns channels, loops over tokens" (v6).
// A thread owns VE = 16 / sizeof(DType) consecutive channels (one 16-byte load per token) and
// a strided subset of the group's tokens; a token row is CPL = D / VE threads wide, so a
// warp's load of one step covers 32 / CPL whole rows (contiguous).  min/max is accumulated on
// the raw 16-bit values (HMNMX2: exact, two elements per instruction), combined over the
// thread slices in shared memory, and the thread's tokens stay in registers for the pack.
// Codes: (x - zero) * inv clamped below at 0 and rounded by adding 1.5 * 2^23 (the fp32 add
// rounds to nearest even, like __float2int_rn / nearbyint); the code is then the low bits of
// the sum and a lane packs its VE codes with one LEA each (the constant high bits are
// subtracted once per word).  No upper clamp is needed: with zero <= min, scale >= range /
// maxq rounded up and three fp32 roundings, (x - zero) * inv <= maxq * (1 + 4 * 2^-24) for
// every finite x of the group, which rounds to <= maxq; a NaN product (only with the finite
// check off) becomes 0 through fmaxf, as in quant_code().  Bit-identical to quant_code().
// ---------------------------------------------------------------------------

/// \brief Elementwise min/max of 16 bytes of DType held as raw bits (exact for every type).
template <typename DType>
struct RawMinMax {
  uint4 mn, mx;
  __device__ __forceinline__ void init() {
    uint32_t pinf, ninf;
    if constexpr (sizeof(DType) == 4) {
      pinf = 0x7f800000u;
      ninf = 0xff800000u;
    } else if constexpr (std::is_same<DType, half_t>::value) {
      pinf = 0x7c007c00u;
      ninf = 0xfc00fc00u;
    } else {
      pinf = 0x7f807f80u;
      ninf = 0xff80ff80u;
    }
    mn = make_uint4(pinf, pinf, pinf, pinf);
    mx = make_uint4(ninf, ninf, ninf, ninf);
  }
  __device__ __forceinline__ static uint32_t vmin(uint32_t a, uint32_t b) {
    if constexpr (sizeof(DType) == 4) {
      return __float_as_uint(fminf(__uint_as_float(a), __uint_as_float(b)));
    } else if constexpr (std::is_same<DType, half_t>::value) {
      __half2 r = __hmin2(*reinterpret_cast<const __half2*>(&a),
                          *reinterpret_cast<const __half2*>(&b));
      return *reinterpret_cast<const uint32_t*>(&r);
    } else {
      __nv_bfloat162 r = __hmin2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                 *reinterpret_cast<const __nv_bfloat162*>(&b));
      return *reinterpret_cast<const uint32_t*>(&r);
    }
  }
  __device__ __forceinline__ static uint32_t vmax(uint32_t a, uint32_t b) {
    if constexpr (sizeof(DType) == 4) {
      return __float_as_uint(fmaxf(__uint_as_float(a), __uint_as_float(b)));
    } else if constexpr (std::is_same<DType, half_t>::value) {
      __half2 r = __hmax2(*reinterpret_cast<const __half2*>(&a),
                          *reinterpret_cast<const __half2*>(&b));
      return *reinterpret_cast<const uint32_t*>(&r);
    } else {
      __nv_bfloat162 r = __hmax2(*reinterpret_cast<const __nv_bfloat162*>(&a),
                                 *reinterpret_cast<const __nv_bfloat162*>(&b));
      return *reinterpret_cast<const uint32_t*>(&r);
    }
  }
  __device__ __forceinline__ void update(const uint4& v) {
    mn = make_uint4(vmin(mn.x, v.x), vmin(mn.y, v.y), vmin(mn.z, v.z), vmin(mn.w, v.w));
    mx = make_uint4(vmax(mx.x, v.x), vmax(mx.y, v.y), vmax(mx.z, v.z), vmax(mx.w, v.w));
  }
};


/// \brief Packing shape of one 16-byte load of DType at BITS bits: VE codes in NW 32-bit
/// accumulators of PER_W codes each (LSB-first).
template <typename DType, int BITS>
struct PackShape {
  static constexpr int VE = 16 / (int)sizeof(DType);
  static constexpr int LANE_BITS = VE * BITS;
  static constexpr int CPW = 32 / BITS;
  static constexpr int NW = LANE_BITS >= 32 ? LANE_BITS / 32 : 1;  // 32-bit accumulators
  static constexpr int PER_W = VE < CPW ? VE : CPW;                 // codes per accumulator
};

/// \brief Codes of the VE values of one 16-byte load, packed into w (PackShape layout).
template <typename DType, int BITS>
__device__ __forceinline__ void quantize_pack(const uint4& raw, const float* z, const float* inv,
                                              bool check, int32_t& status,
                                              uint32_t (&w)[PackShape<DType, BITS>::NW]) {
  using PS = PackShape<DType, BITS>;
  constexpr int VE = PS::VE, NW = PS::NW, PER_W = PS::PER_W;
  const DType* e = reinterpret_cast<const DType*>(&raw);
  float v[VE];
#pragma unroll
  for (int i = 0; i < VE; ++i) v[i] = to_float(e[i]);
  if (check) {
#pragma unroll
    for (int i = 0; i < VE; ++i) status |= value_status(v[i]);
  }
#pragma unroll
  for (int i = 0; i < VE; ++i) {
    const float q = fmaxf((v[i] - z[i]) * inv[i], 0.f);
    const uint32_t b = __float_as_uint(q + 12582912.f);  // 0x4b400000 + rint(q)
    const int j = i / PER_W, sh = (i % PER_W) * BITS;
    w[j] = (i % PER_W == 0) ? b : w[j] + (b << sh);
  }
#pragma unroll
  for (int j = 0; j < NW; ++j) w[j] -= magic_word_sum<BITS>(PER_W);
}

/// \brief Code i (0 <= i < VE) of words packed by quantize_pack.
template <typename DType, int BITS>
__device__ __forceinline__ uint32_t packed_code(const uint32_t (&w)[PackShape<DType, BITS>::NW], int i) {
  using PS = PackShape<DType, BITS>;
  return (w[i / PS::PER_W] >> ((i % PS::PER_W) * BITS)) & ((1u << BITS) - 1u);
}

/// \brief Store the VE * BITS packed bits of w at byte offset k * VE * BITS / 8 of a codes row.
template <typename DType, int BITS>
__device__ __forceinline__ void store_packed(const uint32_t (&w)[PackShape<DType, BITS>::NW],
                                             int32_t* row, int k) {
  constexpr int LANE_BITS = PackShape<DType, BITS>::LANE_BITS;
  char* dst = reinterpret_cast<char*>(row) + k * (LANE_BITS / 8);
  if constexpr (LANE_BITS == 8) {
    *reinterpret_cast<uint8_t*>(dst) = (uint8_t)w[0];
  } else if constexpr (LANE_BITS == 16) {
    *reinterpret_cast<uint16_t*>(dst) = (uint16_t)w[0];
  } else if constexpr (LANE_BITS == 32) {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  } else {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  }
}

/// \brief Quantize the VE values of one 16-byte load and store their VE * BITS packed bits at
/// byte offset k * VE * BITS / 8 of the codes row (LSB-first, little-endian).
template <typename DType, int BITS>
__device__ __forceinline__ void quantize_pack_store(const uint4& raw, const float* z,
                                                    const float* inv, int32_t* row, int k,
                                                    bool check, int32_t& status) {
  uint32_t w[PackShape<DType, BITS>::NW];
  quantize_pack<DType, BITS>(raw, z, inv, check, status, w);
  store_packed<DType, BITS>(w, row, k);
}

/// \brief Load zero / inv of channels [k * VE, (k + 1) * VE) from shared memory.
template <int VE>
__device__ __forceinline__ void load_qp(const float* s_zero, const float* s_inv, int k,
                                        float (&z)[VE], float (&inv)[VE]) {
#pragma unroll
  for (int i = 0; i < VE; i += 4) {
    const float4 a = *reinterpret_cast<const float4*>(s_zero + k * VE + i);
    const float4 b = *reinterpret_cast<const float4*>(s_inv + k * VE + i);
    z[i] = a.x, z[i + 1] = a.y, z[i + 2] = a.z, z[i + 3] = a.w;
    inv[i] = b.x, inv[i + 1] = b.y, inv[i + 2] = b.z, inv[i + 3] = b.w;
  }
}

/// \brief Per-channel qparams of one tile-kernel block (one group of S = blockDim.x / CPL
/// token slices x D channels): every thread publishes its raw min / max mm (channels k * VE..),
/// thread c < D reduces channel c over the slices, stores scale[c] / zero[c] (this group's
/// row) and, in shared memory after the 2 * blockDim.x uint4 of the exchange, qp[c] = zero,
/// qp[D + c] = inv and with SCALE qp[2 D + c] = scale (floats).  BOUNDS (GEAR's masked
/// min / max, gear.h): a channel whose min > max (every entry masked) takes min = max = 0,
/// and qp[3 D + c] = min, qp[4 D + c] = max.  Ends with a barrier; returns qp.
template <typename DType, int D, int BITS, bool SCALE = false, bool BOUNDS = false>
__device__ __forceinline__ float* tile_group_qparams(const RawMinMax<DType>& mm, int S, unsigned char* smem,
                                                     uint16_t* scale, uint16_t* zero) {
  uint4* s_mn = reinterpret_cast<uint4*>(smem);  // [S][D] DType
  uint4* s_mx = s_mn + blockDim.x;
  float* qp = reinterpret_cast<float*>(s_mx + blockDim.x);
  s_mn[threadIdx.x] = mm.mn;  // = element (s, k * VE)
  s_mx[threadIdx.x] = mm.mx;
  __syncthreads();
  const DType* emn = reinterpret_cast<const DType*>(s_mn);
  const DType* emx = reinterpret_cast<const DType*>(s_mx);
  for (int c = threadIdx.x; c < D; c += blockDim.x) {
    float a = INFINITY, b = -INFINITY;
    for (int j = 0; j < S; ++j) {
      a = fminf(a, to_float(emn[j * D + c]));
      b = fmaxf(b, to_float(emx[j * D + c]));
    }
    if constexpr (BOUNDS) {
      if (!(a <= b)) a = b = 0.f;
      qp[3 * D + c] = a;
      qp[4 * D + c] = b;
    }
    const QParams q = make_qparams(a, b, BITS);
    scale[c] = q.s16;
    zero[c] = q.z16;
    qp[c] = q.zero;
    qp[D + c] = q.inv;
    if constexpr (SCALE) qp[2 * D + c] = q.scale;
  }
  __syncthreads();
  return qp;
}

/// One block per group of G = TPT * (blockDim.x / CPL) tokens; every token in registers.
/// Dynamic shared memory: 2 * blockDim.x * 16 + 2 * D * 4 bytes.
template <typename DType, int D, int BITS, int TPT>
__global__ void __launch_bounds__(512) GroupQuantizePerChannelTileKernel(GroupQuantParams p) {
  constexpr int VE = 16 / (int)sizeof(DType), CPL = D / VE, W = D * BITS / 32;
  extern __shared__ __align__(16) unsigned char kvq_smem[];
  const int S = blockDim.x / CPL;  // token slices
  const int k = threadIdx.x % CPL, s = threadIdx.x / CPL;
  const int64_t grp = blockIdx.x;  // n * (T / G) + g; its rows are [grp * G, grp * G + G)
  const int64_t G = (int64_t)S * TPT;
  const uint4* src = reinterpret_cast<const uint4*>(p.x) + (grp * G + s) * CPL + k;
  uint4 raw[TPT];
#pragma unroll
  for (int i = 0; i < TPT; ++i) raw[i] = __ldcs(src + (int64_t)i * S * CPL);  // token s + i S
  RawMinMax<DType> mm;
  mm.init();
#pragma unroll
  for (int i = 0; i < TPT; ++i) mm.update(raw[i]);
  const float* s_zero = tile_group_qparams<DType, D, BITS>(mm, S, kvq_smem, p.scale + grp * D, p.zero + grp * D);
  const float* s_inv = s_zero + D;
  float z[VE], inv[VE];
  load_qp<VE>(s_zero, s_inv, k, z, inv);
  const bool check = p.status != nullptr;
  int32_t status = 0;
  int32_t* codes = p.codes + (grp * G + s) * W;
#pragma unroll
  for (int i = 0; i < TPT; ++i)
    quantize_pack_store<DType, BITS>(raw[i], z, inv, codes + (int64_t)i * S * W, k, check, status);
  if (check) report_status(p.status, status);
}

// ---------------------------------------------------------------------------
// Per-channel quantization of large groups (KCVT: G = T), split over T in three launches:
//   1. GroupMinMaxPartialKernel: block (group, chunk) -> per-channel min/max of the chunk's
//      tokens into ws partial [NG][C][2][D] (float).
//   2. GroupQParamsKernel: block per group reduces its C partials, writes scale / zero and
//      ws qp [NG][2][D] (zero, inv as float).
//   3. GroupQuantizeChunkKernel: block (group, chunk) re-reads its tokens and packs them.
//      Blocks run in reverse order so the first ones find the data pass 1 read last in L2.
// ---------------------------------------------------------------------------
struct SplitPlan {
  int64_t ng = 0;      // groups N * T / G
  int64_t chunks = 0;  // C, per group
  int64_t tokens = 0;  // per chunk (the last one may be shorter)
};

inline SplitPlan split_plan(const GroupQuantParams& p, int sms) {
  SplitPlan s;
  s.ng = p.N * (p.T / p.group);
  const int64_t target = (int64_t)sms * 8;  // blocks of 256 threads
  int64_t c = (target + s.ng - 1) / s.ng;
  const int64_t cmax = (p.group + 127) / 128;  // at least 128 tokens per chunk
  s.chunks = c < 1 ? 1 : c > cmax ? cmax : c;
  s.tokens = (p.group + s.chunks - 1) / s.chunks;
  s.chunks = (p.group + s.tokens - 1) / s.tokens;
  return s;
}

template <typename DType, int D>
__global__ void __launch_bounds__(256) GroupMinMaxPartialKernel(GroupQuantParams p, int64_t chunks,
                                                                 int64_t tokens) {
  constexpr int VE = 16 / (int)sizeof(DType), CPL = D / VE;
  constexpr int S = 256 / CPL, U = 4;
  __shared__ uint4 s_mn[256], s_mx[256];
  const int k = threadIdx.x % CPL, s = threadIdx.x / CPL;
  const int64_t grp = blockIdx.x / chunks, j = blockIdx.x % chunks;
  const int64_t t0 = j * tokens, t1 = t0 + tokens < p.group ? t0 + tokens : p.group;
  const uint4* src = reinterpret_cast<const uint4*>(p.x) + (grp * p.group) * CPL + k;
  const bool check = p.status != nullptr;
  int32_t status = 0;
  RawMinMax<DType> mm;
  mm.init();
  int64_t t = t0 + s;
  for (; t + (U - 1) * S < t1; t += U * S) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = src[(t + u * S) * CPL];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      mm.update(r[u]);
      if (check) {
        const DType* e = reinterpret_cast<const DType*>(&r[u]);
#pragma unroll
        for (int i = 0; i < VE; ++i) status |= value_status(to_float(e[i]));
      }
    }
  }
  for (; t < t1; t += S) {
    const uint4 r = src[t * CPL];
    mm.update(r);
    if (check) {
      const DType* e = reinterpret_cast<const DType*>(&r);
#pragma unroll
      for (int i = 0; i < VE; ++i) status |= value_status(to_float(e[i]));
    }
  }
  s_mn[threadIdx.x] = mm.mn;
  s_mx[threadIdx.x] = mm.mx;
  __syncthreads();
  const DType* emn = reinterpret_cast<const DType*>(s_mn);
  const DType* emx = reinterpret_cast<const DType*>(s_mx);
  float* out = p.ws + (grp * chunks + j) * 2 * D;
  for (int c = threadIdx.x; c < D; c += 256) {
    float a = INFINITY, b = -INFINITY;
#pragma unroll 4
    for (int q = 0; q < S; ++q) {
      a = fminf(a, to_float(emn[q * D + c]));
      b = fmaxf(b, to_float(emx[q * D + c]));
    }
    out[c] = a;
    out[D + c] = b;
  }
  if (check) report_status(p.status, status);
}

template <int D, int BITS>
__global__ void __launch_bounds__(D) GroupQParamsKernel(GroupQuantParams p, int64_t ng,
                                                          int64_t chunks) {
  const int c = threadIdx.x;
  const int64_t grp = blockIdx.x;
  const float* part = p.ws + grp * chunks * 2 * D;
  float a = INFINITY, b = -INFINITY;
  for (int64_t j = 0; j < chunks; ++j) {
    a = fminf(a, part[j * 2 * D + c]);
    b = fmaxf(b, part[j * 2 * D + D + c]);
  }
  const QParams q = make_qparams(a, b, BITS);
  p.scale[grp * D + c] = q.s16;
  p.zero[grp * D + c] = q.z16;
  float* qp = p.ws + ng * chunks * 2 * D + grp * 2 * D;
  qp[c] = q.zero;
  qp[D + c] = q.inv;
}

template <typename DType, int D, int BITS>
__global__ void __launch_bounds__(256) GroupQuantizeChunkKernel(GroupQuantParams p, int64_t ng,
                                                                 int64_t chunks, int64_t tokens) {
  constexpr int VE = 16 / (int)sizeof(DType), CPL = D / VE, W = D * BITS / 32;
  constexpr int S = 256 / CPL, U = 4;
  __shared__ __align__(16) float s_qp[2 * D];
  const int k = threadIdx.x % CPL, s = threadIdx.x / CPL;
  const int64_t b = (int64_t)gridDim.x - 1 - blockIdx.x;  // reverse order: L2 reuse
  const int64_t grp = b / chunks, j = b % chunks;
  const int64_t t0 = j * tokens, t1 = t0 + tokens < p.group ? t0 + tokens : p.group;
  const float* qp = p.ws + ng * chunks * 2 * D + grp * 2 * D;
  for (int c = threadIdx.x; c < 2 * D; c += 256) s_qp[c] = qp[c];
  __syncthreads();
  float z[VE], inv[VE];
  load_qp<VE>(s_qp, s_qp + D, k, z, inv);
  const uint4* src = reinterpret_cast<const uint4*>(p.x) + (grp * p.group) * CPL + k;
  int32_t* codes = p.codes + grp * p.group * W;
  int32_t dummy = 0;
  int64_t t = t0 + s;
  for (; t + (U - 1) * S < t1; t += U * S) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) r[u] = __ldcs(src + (t + u * S) * CPL);
#pragma unroll
    for (int u = 0; u < U; ++u)
      quantize_pack_store<DType, BITS>(r[u], z, inv, codes + (t + u * S) * W, k, false, dummy);
  }
  for (; t < t1; t += S)
    quantize_pack_store<DType, BITS>(__ldcs(src + t * CPL), z, inv, codes + t * W, k, false, dummy);
}

// ---------------------------------------------------------------------------
// Per-channel quantization of large groups (KCVT: G = T) in one launch that reads the input
// once: a thread-block cluster of kKcvtCluster CTAs per group (sm_90 distributed shared
// memory).  CTA r of the cluster owns tokens [r * tc, (r + 1) * tc) of the group and keeps them
// in shared memory (tc * D * sizeof(DType) bytes):
//   1. load the chunk into shared memory with kKcvtSubChunks bulk copies (TMA engine, mbarrier
//      completion; the chunk is contiguous in global memory), raw min/max per channel of each
//      part as soon as it lands (thread = token slice s x 16-byte channel segment k,
//      the layout and reduction order of GroupMinMaxPartialKernel), reduced over the slices
//      into this CTA's partial s_part[2][D];
//   2. cluster barrier; every CTA reduces the cluster's partials in rank order (chunk order,
//      as GroupQParamsKernel does) through DSMEM and computes the qparams (rank 0 writes
//      scale / zero); it then arrives on a second cluster barrier and waits on it only before
//      exiting (its partial must stay readable until every CTA has read it);
//   3. pack the chunk from shared memory (quantize_pack_store: the tile kernels' arithmetic,
//      bit-identical to the CPU op).
// Replaces a cooperative-launch kernel (cross-block flags in global memory: 67.9 us, slower
// than the three-launch split path's 48.5 us on the H200, [8, 8, 4096, 128] fp16): the cluster
// barrier is hardware, and only the 8 CTAs of one group wait for each other.
// ---------------------------------------------------------------------------
constexpr int kKcvtCluster = 8;                       // CTAs per group (portable cluster size)
constexpr int kKcvtClusterSmem = 200 * 1024;          // max dynamic shared memory per CTA (chunk)
constexpr int kKcvtSubChunks = 4;                     // bulk copies (and barriers) per chunk

__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
}
__device__ __forceinline__ uint32_t cluster_ctarank() {
  uint32_t r;
  asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
  return r;
}
/// Load a float from the shared memory of CTA `rank` of this cluster (generic address of the
/// same variable in this CTA).
__device__ __forceinline__ float ld_dsmem_f32(const float* local, uint32_t rank) {
  const uint32_t a = (uint32_t)__cvta_generic_to_shared(local);
  uint32_t remote;
  float v;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(a), "r"(rank));
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
  return v;
}

// mbarrier + bulk-copy (TMA engine) helpers: one thread posts a copy of `bytes` contiguous
// global bytes into this CTA's shared memory; every thread waits on the barrier's phase 0.
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void bulk_copy_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_wait_phase0(uint64_t* bar) {
  asm volatile(
      "{\n .reg .pred p;\n KVQ_MBAR_WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], 0;\n"
      " @!p bra KVQ_MBAR_WAIT_%=;\n}\n" ::"r"(smem_u32(bar))
      : "memory");
}

template <typename DType, int D, int BITS>
__global__ void __cluster_dims__(kKcvtCluster, 1, 1) __launch_bounds__(256, 1)
    GroupQuantizeKcvtClusterKernel(GroupQuantParams p, int64_t tc) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int VE = 16 / (int)sizeof(DType), CPL = D / VE, S = 256 / CPL, NSUB = kKcvtSubChunks;
  constexpr int W = D * BITS / 32;
  extern __shared__ __align__(128) uint4 s_tile[];  // [tc][CPL]: the chunk, as in global memory
  __shared__ uint4 s_mn[256], s_mx[256];
  __shared__ __align__(8) uint64_t s_bar[NSUB];
  __shared__ __align__(16) float s_part[2 * D];  // this CTA's (min, max) per channel
  __shared__ __align__(16) float s_qp[2 * D];    // (zero, inv) per channel
  const int k = threadIdx.x % CPL, s = threadIdx.x / CPL;
  const uint32_t rank = cluster_ctarank();
  const int64_t grp = blockIdx.x / kKcvtCluster, G = p.group;
  const int64_t t0 = (int64_t)rank * tc, t1 = t0 + tc < G ? t0 + tc : G;
  const bool check = p.status != nullptr;
  int32_t status = 0, dummy = 0;
  // 1. the chunk -> shared memory by NSUB bulk copies (all bytes in flight at once, no
  // registers), min/max of each sub-chunk as soon as it has landed
  const int64_t rows = t1 > t0 ? t1 - t0 : 0, sub = (rows + NSUB - 1) / NSUB;
  if (threadIdx.x == 0) {
#pragma unroll
    for (int j = 0; j < NSUB; ++j) mbar_init(&s_bar[j], 1);
    mbar_init_fence();
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    const uint4* src = reinterpret_cast<const uint4*>(p.x) + (grp * G + t0) * CPL;
#pragma unroll
    for (int j = 0; j < NSUB; ++j) {
      const int64_t a = j * sub, e = a + sub < rows ? a + sub : rows;
      if (e > a) bulk_copy_g2s(s_tile + a * CPL, src + a * CPL, (uint32_t)((e - a) * CPL * 16), &s_bar[j]);
    }
  }
  RawMinMax<DType> mm;
  mm.init();
#pragma unroll 1
  for (int j = 0; j < NSUB; ++j) {
    const int64_t a = j * sub, e = a + sub < rows ? a + sub : rows;
    if (e <= a) break;
    mbar_wait_phase0(&s_bar[j]);
    for (int64_t t = a + s; t < e; t += S) {  // rows in increasing order per thread, as before
      const uint4 r = s_tile[t * CPL + k];
      mm.update(r);
      if (check) {
        const DType* el = reinterpret_cast<const DType*>(&r);
#pragma unroll
        for (int q = 0; q < VE; ++q) status |= value_status(to_float(el[q]));
      }
    }
  }
  s_mn[threadIdx.x] = mm.mn;
  s_mx[threadIdx.x] = mm.mx;
  __syncthreads();
  {
    const DType* emn = reinterpret_cast<const DType*>(s_mn);
    const DType* emx = reinterpret_cast<const DType*>(s_mx);
    for (int c = threadIdx.x; c < D; c += 256) {
      float a = INFINITY, b = -INFINITY;
#pragma unroll 4
      for (int q = 0; q < S; ++q) {
        a = fminf(a, to_float(emn[q * D + c]));
        b = fmaxf(b, to_float(emx[q * D + c]));
      }
      s_part[c] = a;
      s_part[D + c] = b;
    }
  }
  // 2. the group's qparams from the cluster's partials, in rank (= chunk) order
  cluster_arrive_release();
  cluster_wait_acquire();
  for (int c = threadIdx.x; c < D; c += 256) {
    float a = INFINITY, b = -INFINITY;
#pragma unroll
    for (uint32_t r = 0; r < (uint32_t)kKcvtCluster; ++r) {
      a = fminf(a, ld_dsmem_f32(s_part + c, r));
      b = fmaxf(b, ld_dsmem_f32(s_part + D + c, r));
    }
    const QParams q = make_qparams(a, b, BITS);
    if (rank == 0) {
      p.scale[grp * D + c] = q.s16;
      p.zero[grp * D + c] = q.z16;
    }
    s_qp[c] = q.zero;
    s_qp[D + c] = q.inv;
  }
  cluster_arrive_release();  // done reading the other CTAs' partials
  __syncthreads();
  // 3. pack from shared memory
  float z[VE], inv[VE];
  load_qp<VE>(s_qp, s_qp + D, k, z, inv);
  int32_t* codes = p.codes + grp * G * W;
  for (int64_t t = t0 + s; t < t1; t += S)
    quantize_pack_store<DType, BITS>(s_tile[(t - t0) * CPL + k], z, inv, codes + t * W, k, false, dummy);
  if (check) report_status(p.status, status);
  cluster_wait_acquire();  // keep s_part alive until every CTA of the cluster has read it
#else
  __trap();  // launched only on sm_90+ (LaunchKcvtCluster checks the device)
#endif
}

// ---------------------------------------------------------------------------
// Per-channel dequantization: a thread owns VE channels (one 16-byte store per token) and
// loops over a chunk of one group's tokens with that group's scale / zero in registers.
// Code -> float by OR-ing it into the mantissa of 2^23 and subtracting 2^23 (exact).
// Requires 16-byte-aligned scale / zero (else the warp-per-row kernel runs).
// ---------------------------------------------------------------------------
template <typename DType, int D, int BITS>
__global__ void __launch_bounds__(128) GroupDequantizePerChannelKernel(GroupQuantParams p,
                                                                        int64_t chunks,
                                                                        int64_t tokens) {
  constexpr int VE = 16 / (int)sizeof(DType), CPL = D / VE, W = D * BITS / 32;
  constexpr int LANE_BITS = VE * BITS, S = 128 / CPL, U = 4;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int k = threadIdx.x % CPL, s = threadIdx.x / CPL;
  const int64_t grp = blockIdx.x / chunks, j = blockIdx.x % chunks;
  const int64_t t0 = j * tokens, t1 = t0 + tokens < p.group ? t0 + tokens : p.group;
  float sc[VE], zr[VE];
  {
    const uint16_t* ps = p.scale + grp * D + k * VE;
    const uint16_t* pz = p.zero + grp * D + k * VE;
    uint16_t hs[VE], hz[VE];
    if constexpr (VE == 8) {
      *reinterpret_cast<uint4*>(hs) = *reinterpret_cast<const uint4*>(ps);
      *reinterpret_cast<uint4*>(hz) = *reinterpret_cast<const uint4*>(pz);
    } else {
      *reinterpret_cast<uint2*>(hs) = *reinterpret_cast<const uint2*>(ps);
      *reinterpret_cast<uint2*>(hz) = *reinterpret_cast<const uint2*>(pz);
    }
#pragma unroll
    for (int i = 0; i < VE; ++i) {
      sc[i] = half_bits_to_float(hs[i]);
      zr[i] = half_bits_to_float(hz[i]);
    }
  }
  const char* cbase =
      reinterpret_cast<const char*>(p.codes + grp * p.group * W) + k * (LANE_BITS / 8);
  uint4* obase = reinterpret_cast<uint4*>(static_cast<DType*>(p.out) + grp * p.group * D) + k;
  auto load_bits = [&](int64_t t) -> uint64_t {
    const char* a = cbase + t * (W * 4);
    if constexpr (LANE_BITS == 8) return *reinterpret_cast<const uint8_t*>(a);
    else if constexpr (LANE_BITS == 16) return *reinterpret_cast<const uint16_t*>(a);
    else if constexpr (LANE_BITS == 32) return *reinterpret_cast<const uint32_t*>(a);
    else {
      const uint2 v = *reinterpret_cast<const uint2*>(a);
      return (uint64_t)v.x | ((uint64_t)v.y << 32);
    }
  };
  auto emit = [&](int64_t t, uint64_t bits) {
    uint4 o;
    DType* e = reinterpret_cast<DType*>(&o);
#pragma unroll
    for (int i = 0; i < VE; ++i) {
      const uint32_t word = (uint32_t)(bits >> (i * BITS >= 32 ? 32 : 0));
      const uint32_t q = (word >> ((i * BITS) % 32)) & MASK;
      const float f = __uint_as_float(0x4b000000u | q) - 8388608.f;  // == (float)q
      e[i] = from_float<DType>(fmaf(f, sc[i], zr[i]));
    }
    __stcs(obase + t * CPL, o);
  };
  int64_t t = t0 + s;
  for (; t + (U - 1) * S < t1; t += U * S) {
    uint64_t b[U];
#pragma unroll
    for (int u = 0; u < U; ++u) b[u] = load_bits(t + u * S);
#pragma unroll
    for (int u = 0; u < U; ++u) emit(t + u * S, b[u]);
  }
  for (; t < t1; t += S) emit(t, load_bits(t));
}

// ---------------------------------------------------------------------------
// Per-token dequantization (v7), G % VE == 0: a thread owns VE = 16 / sizeof(DType) consecutive
// channels of one token (item i = row * D / VE + k): one 16-byte store (a warp stores 512
// contiguous bytes), its VE * BITS code bits at byte i * VE * BITS / 8 of the packed rows, and
// the scale / zero of its group, index i >> log2(G / VE).  U items per thread have their loads
// issued before any is converted.  Arithmetic as the per-channel kernel: code -> float through
// the 2^23 mantissa trick (exact), then fmaf (code * scale is exact, so this equals the CPU's
// code * scale + zero).
// ---------------------------------------------------------------------------
template <int LANE_BITS>
__device__ __forceinline__ uint64_t load_lane_bits(const char* a) {
  if constexpr (LANE_BITS == 8) return *reinterpret_cast<const uint8_t*>(a);
  else if constexpr (LANE_BITS == 16) return *reinterpret_cast<const uint16_t*>(a);
  else if constexpr (LANE_BITS == 32) return *reinterpret_cast<const uint32_t*>(a);
  else {
    const uint2 v = *reinterpret_cast<const uint2*>(a);
    return (uint64_t)v.x | ((uint64_t)v.y << 32);
  }
}

template <typename DType, int BITS>
__global__ void __launch_bounds__(256) GroupDequantizePerTokenKernel(GroupQuantParams p,
                                                                      int ipg_log2) {
  constexpr int VE = 16 / (int)sizeof(DType), LANE_BITS = VE * BITS, U = 4;
  constexpr uint32_t MASK = (1u << BITS) - 1u;
  const int64_t items = p.N * p.T * (p.D / VE);
  const int64_t step = (int64_t)blockDim.x;
  const int64_t stride = (int64_t)gridDim.x * blockDim.x * U;
  const char* cb = reinterpret_cast<const char*>(p.codes);
  uint4* out = static_cast<uint4*>(p.out);
  for (int64_t i0 = (int64_t)blockIdx.x * blockDim.x * U + threadIdx.x; i0 < items; i0 += stride) {
    uint64_t bits[U];
    uint16_t hs[U], hz[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * step;
      bits[u] = 0;
      hs[u] = hz[u] = 0;
      if (i < items) {
        bits[u] = load_lane_bits<LANE_BITS>(cb + i * (LANE_BITS / 8));
        hs[u] = p.scale[i >> ipg_log2];
        hz[u] = p.zero[i >> ipg_log2];
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int64_t i = i0 + u * step;
      if (i >= items) break;
      const float s = half_bits_to_float(hs[u]), z = half_bits_to_float(hz[u]);
      uint4 o;
      DType* e = reinterpret_cast<DType*>(&o);
#pragma unroll
      for (int k = 0; k < VE; ++k) {
        const uint32_t word = (uint32_t)(bits[u] >> (k * BITS >= 32 ? 32 : 0));
        const uint32_t q = (word >> ((k * BITS) % 32)) & MASK;
        const float f = __uint_as_float(0x4b000000u | q) - 8388608.f;  // == (float)q
        e[k] = from_float<DType>(fmaf(f, s, z));
      }
      __stcs(out + i, o);
    }
  }
}

// ---------------------------------------------------------------------------
// Dequantization (both groupings): one warp per token row.
// ---------------------------------------------------------------------------
template <typename DType, int EPL, int BITS, int ROWS>
__global__ void GroupDequantizeKernel(GroupQuantParams p) {
  constexpr int D = EPL * 32;
  const int lane = threadIdx.x % 32;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) / 32;
  const int64_t rows = p.N * p.T;
  DType* out = static_cast<DType*>(p.out);
  for (int64_t r0 = warp * ROWS; r0 < rows; r0 += nwarps * ROWS) {
#pragma unroll
    for (int j = 0; j < ROWS; ++j) {
      const int64_t r = r0 + j;
      if (r >= rows) break;
      uint32_t code[EPL];
      load_and_unpack<EPL, BITS>(p.codes + r * (D * BITS / 32), lane, code);
      float v[EPL];
      if (p.per_channel) {
        const int64_t n = r / p.T, t = r % p.T;
        const int64_t base = (n * (p.T / p.group) + t / p.group) * D + lane * EPL;
#pragma unroll
        for (int i = 0; i < EPL; ++i)
          v[i] = (float)code[i] * half_bits_to_float(p.scale[base + i]) +
                 half_bits_to_float(p.zero[base + i]);
      } else {
        const int64_t si = r * (D / p.group) + (lane * EPL) / p.group;
        const float s = half_bits_to_float(p.scale[si]), z = half_bits_to_float(p.zero[si]);
#pragma unroll
        for (int i = 0; i < EPL; ++i) v[i] = (float)code[i] * s + z;
      }
      store_row_slice<DType, EPL>(out + r * D, lane, v);
    }
  }
}

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------
inline int num_sms() {
  static int sms = [] {
    int dev = 0, n = 132;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, dev);
    return n;
  }();
  return sms;
}

/// \brief Blocks of `kernel` (no dynamic shared memory) resident per SM, at least 1.
template <typename Kernel>
inline int resident_blocks(Kernel kernel, int threads) {
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, 0) != cudaSuccess) {
    (void)cudaGetLastError();
    n = 1;
  }
  return n < 1 ? 1 : n;
}

/// \brief log2 of a power of two.
inline int ilog2(int64_t v) {
  int l = 0;
  while ((int64_t{1} << (l + 1)) <= v) ++l;
  return l;
}

/// Tokens per thread of the per-channel tile kernel (TPT 16-byte loads held in registers).
constexpr int kTileTokensPerThread = 8;

/// \brief Block size of the per-channel tile kernel for group size G, or 0 where it does not
/// apply (G * CPL / TPT must be a whole number of warps, at most 512 threads).
template <typename DType, int D>
inline int per_channel_tile_threads(int64_t G) {
  constexpr int CPL = D / (16 / (int)sizeof(DType));
  if (G <= 0 || G % kTileTokensPerThread != 0) return 0;
  const int64_t threads = G / kTileTokensPerThread * CPL;
  return (threads >= 32 && threads <= 512 && threads % 32 == 0) ? (int)threads : 0;
}

/// \brief Floats of p.ws the per-channel split-T path needs (0: p is not quantized that way).
/// Used for per-channel groups of >= 256 tokens that the tile kernel does not cover (KCVT).
template <typename DType, int EPL>
int64_t GroupQuantizeWsFloats(const GroupQuantParams& p) {
  constexpr int D = EPL * 32;
  if (!p.per_channel || p.group < 256 || p.N * p.T == 0) return 0;
  if (per_channel_tile_threads<DType, D>(p.group) > 0) return 0;
  const SplitPlan sp = split_plan(p, num_sms());
  return sp.ng * 2 * D * (sp.chunks + 1);  // the split path (the cluster kernel needs none)
}

/// \brief KCVT quantize by GroupQuantizeKcvtClusterKernel.  Returns false, having launched
/// nothing, where it does not apply: devices below sm_90, a chunk (G / kKcvtCluster tokens)
/// above kKcvtClusterSmem bytes (fp16: G > 6400 at D = 128, G > 3200 at D = 256), or a refused
/// launch (no cluster fits); the caller then takes the split path.
template <typename DType, int D, int BITS>
bool LaunchKcvtCluster(const GroupQuantParams& p, cudaStream_t stream) {
  constexpr int CPL = D / (16 / (int)sizeof(DType));
  auto kernel = GroupQuantizeKcvtClusterKernel<DType, D, BITS>;
  static const bool ok = [&] {
    int dev = 0, major = 0;
    if (cudaGetDevice(&dev) != cudaSuccess ||
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess ||
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kKcvtClusterSmem) !=
            cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return major >= 9;
  }();
  const int64_t tc = (p.group + kKcvtCluster - 1) / kKcvtCluster;
  const int64_t smem = tc * CPL * 16;
  const int64_t ng = p.N * (p.T / p.group);
  if (!ok || smem > kKcvtClusterSmem || ng * kKcvtCluster > 0x7fffffff) return false;
  kernel<<<(unsigned)(ng * kKcvtCluster), 256, (size_t)smem, stream>>>(p, tc);
  if (cudaGetLastError() != cudaSuccess) return false;  // not sticky: a launch-configuration error
  return true;
}

/// \brief Quantize and pack.  Requires D in {32, 64, 128, 256}; see GroupQuantParams.
template <typename DType, int EPL, int BITS>
cudaError_t GroupQuantize(const GroupQuantParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  if (p.per_channel) {
    constexpr int D = EPL * 32;
    const int64_t blocks = p.N * (p.T / p.group);
    const int threads = per_channel_tile_threads<DType, D>(p.group);
    if (threads > 0) {
      const size_t smem = 2 * (size_t)threads * 16 + 2 * D * sizeof(float);
      GroupQuantizePerChannelTileKernel<DType, D, BITS, kTileTokensPerThread>
          <<<(unsigned)blocks, threads, smem, stream>>>(p);
    } else if (p.ws != nullptr && GroupQuantizeWsFloats<DType, EPL>(p) > 0) {
      if (LaunchKcvtCluster<DType, D, BITS>(p, stream)) return cudaSuccess;
      const SplitPlan sp = split_plan(p, num_sms());
      const unsigned nb = (unsigned)(sp.ng * sp.chunks);
      GroupMinMaxPartialKernel<DType, D><<<nb, 256, 0, stream>>>(p, sp.chunks, sp.tokens);
      GroupQParamsKernel<D, BITS><<<(unsigned)sp.ng, D, 0, stream>>>(p, sp.ng, sp.chunks);
      GroupQuantizeChunkKernel<DType, D, BITS><<<nb, 256, 0, stream>>>(p, sp.ng, sp.chunks,
                                                                        sp.tokens);
    } else {
      constexpr int WARPS = 8;
      GroupQuantizePerChannelKernel<DType, EPL, BITS, WARPS>
          <<<(unsigned)blocks, WARPS * 32, 0, stream>>>(p);
    }
  } else if (p.group % 32 == 0) {
    constexpr int THREADS = per_token_tile_warps<DType>() * 32;
    static const int per_sm =
        resident_blocks(GroupQuantizePerTokenTileKernel<DType, BITS>, THREADS);
    const int64_t tiles = (p.N * p.T * (p.D / 32) + 31) / 32;
    int64_t blocks = (tiles + THREADS / 32 - 1) / (THREADS / 32);
    const int64_t cap = (int64_t)num_sms() * per_sm;  // one wave; warps stride over tiles
    if (blocks > cap) blocks = cap;
    GroupQuantizePerTokenTileKernel<DType, BITS>
        <<<(unsigned)blocks, THREADS, 0, stream>>>(p, ilog2(p.group / 32));
  } else {
    constexpr int ROWS = (EPL >= 8) ? 2 : 4, THREADS = 256;
    const int64_t warps_needed = (p.N * p.T + ROWS - 1) / ROWS;
    int64_t blocks = (warps_needed + THREADS / 32 - 1) / (THREADS / 32);
    const int64_t cap = (int64_t)num_sms() * 16;
    if (blocks > cap) blocks = cap;
    GroupQuantizePerTokenKernel<DType, EPL, BITS, ROWS><<<(unsigned)blocks, THREADS, 0, stream>>>(p);
  }
  return cudaGetLastError();
}

/// \brief Unpack and dequantize.
template <typename DType, int EPL, int BITS>
cudaError_t GroupDequantize(const GroupQuantParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  constexpr int D = EPL * 32;
  const uintptr_t sz_addr =
      reinterpret_cast<uintptr_t>(p.scale) | reinterpret_cast<uintptr_t>(p.zero);
  if (p.per_channel && sz_addr % 16 == 0) {
    // chunks of up to 64 tokens of one group; 128 threads = 128 / CPL token slices
    const int64_t tokens = p.group < 64 ? p.group : 64;
    const int64_t chunks = (p.group + tokens - 1) / tokens;
    const int64_t blocks = p.N * (p.T / p.group) * chunks;
    GroupDequantizePerChannelKernel<DType, D, BITS>
        <<<(unsigned)blocks, 128, 0, stream>>>(p, chunks, tokens);
    return cudaGetLastError();
  }
  constexpr int VE = 16 / (int)sizeof(DType);
  const uintptr_t co_addr =
      reinterpret_cast<uintptr_t>(p.codes) | reinterpret_cast<uintptr_t>(p.out);
  if (!p.per_channel && p.group % VE == 0 && co_addr % 16 == 0) {
    constexpr int THREADS = 256, U = 4;
    static const int per_sm = resident_blocks(GroupDequantizePerTokenKernel<DType, BITS>, THREADS);
    const int64_t items = p.N * p.T * (p.D / VE);
    int64_t blocks = (items + THREADS * U - 1) / (THREADS * U);
    const int64_t cap = (int64_t)num_sms() * per_sm;
    if (blocks > cap) blocks = cap;
    GroupDequantizePerTokenKernel<DType, BITS>
        <<<(unsigned)blocks, THREADS, 0, stream>>>(p, ilog2(p.group / VE));
    return cudaGetLastError();
  }
  constexpr int ROWS = 4, THREADS = 256;
  const int64_t warps_needed = (p.N * p.T + ROWS - 1) / ROWS;
  int64_t blocks = (warps_needed + THREADS / 32 - 1) / (THREADS / 32);
  const int64_t cap = (int64_t)num_sms() * 16;
  if (blocks > cap) blocks = cap;
  GroupDequantizeKernel<DType, EPL, BITS, ROWS><<<(unsigned)blocks, THREADS, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace quant
}  // namespace kvq
