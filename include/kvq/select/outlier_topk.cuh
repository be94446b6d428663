// CUDA kernels for per-vector top-k / bottom-k selection.  Torch-free.  Layout, order and
// tie rule: outlier_topk.h.
//
// Two paths, both exact (same entries as the CPU twin):
//  * L <= 256 (value tokens, decode-block key channels): one warp per vector, the vector
//    in registers (up to 8 entries per lane), k + 1 rounds of a warp arg-max (and arg-min)
//    on the composite key: 32-bit (one __reduce_max_sync) for fp16/bf16, 64-bit for fp32.
//  * L > 256 (prefill key channels, up to T = 128k and beyond): the vector's 32-bit
//    order keys are written once to a workspace (transposed for key channels, so each
//    vector is contiguous), then one 256-thread block per vector runs an MSB-first 8-bit
//    radix select on the 64-bit composite key (value, -index) for the top and the bottom
//    side in the same passes (usually 2-4 passes; it stops as soon as the k-th entry is
//    alone in its bucket; lanes with equal digits share one shared-memory atomic), then
//    one ordered compaction pass (per-thread contiguous chunks + one block scan) writes the
//    selected entries in index order.  No sort, no bound on k.
#pragma once
#include <cuda_runtime.h>

#include "kvq/common/half.h"
#include "kvq/select/outlier_topk.h"

namespace kvq {
namespace select {

constexpr unsigned kSelFullMask = 0xffffffffu;

template <typename DType>
__device__ __forceinline__ float load_elem(const DType* x, const OutlierSelectParams& p,
                                           int64_t n, int64_t v, int64_t j) {
  const int64_t off = p.per_channel ? (n * p.T + j) * p.D + v : (n * p.T + v) * p.D + j;
  return to_float(x[off]);
}

/// Warp-wide max / min of a composite key (one instruction for 32-bit keys).
__device__ __forceinline__ uint32_t warp_max_key(uint32_t x) { return __reduce_max_sync(kSelFullMask, x); }
__device__ __forceinline__ uint32_t warp_min_key(uint32_t x) { return __reduce_min_sync(kSelFullMask, x); }
__device__ __forceinline__ uint64_t warp_max_key(uint64_t x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t y = __shfl_xor_sync(kSelFullMask, x, o);
    x = y > x ? y : x;
  }
  return x;
}
__device__ __forceinline__ uint64_t warp_min_key(uint64_t x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const uint64_t y = __shfl_xor_sync(kSelFullMask, x, o);
    x = y < x ? y : x;
  }
  return x;
}

/// \brief Warp-wide top / bottom selection over MAXE composite keys per lane (element i of
/// a lane is vector entry 32 i + lane; `valid` marks present ones): k + 1 rounds of warp
/// arg-max and arg-min (k rounds when 2k + 1 > L).  Sets the lane's masks of top-k and
/// bottom-k entries and the (k+1)-th largest / smallest keys (the inlier bounds).
template <int MAXE, typename KeyT>
__device__ __forceinline__ void warp_select_rounds(const KeyT (&key)[MAXE], unsigned valid, int64_t k, int64_t L,
                                                   unsigned& topm, unsigned& botm, KeyT& hi_key, KeyT& lo_key) {
  const int64_t kt = (L >= 2 * k + 1) ? k + 1 : k;
  for (int64_t round = 0; round < kt; ++round) {
    KeyT best = 0;
#pragma unroll
    for (int i = 0; i < MAXE; ++i)
      if (((valid & ~topm) >> i) & 1u) best = key[i] > best ? key[i] : best;
    best = warp_max_key(best);
    if (round < k) {
#pragma unroll
      for (int i = 0; i < MAXE; ++i)
        if (((valid >> i) & 1u) && key[i] == best) topm |= 1u << i;
    } else {
      hi_key = best;
    }
  }
  for (int64_t round = 0; round < kt; ++round) {
    KeyT best = ~KeyT(0);
#pragma unroll
    for (int i = 0; i < MAXE; ++i)
      if (((valid & ~botm) >> i) & 1u) best = key[i] < best ? key[i] : best;
    best = warp_min_key(best);
    if (round < k) {
#pragma unroll
      for (int i = 0; i < MAXE; ++i)
        if (((valid >> i) & 1u) && key[i] == best) botm |= 1u << i;
    } else {
      lo_key = best;
    }
  }
}

/// \brief Warp path: one warp per vector of length L <= 256.
template <typename DType, typename IdType>
__global__ void __launch_bounds__(256) OutlierSelectWarpKernel(OutlierSelectParams p) {
  constexpr int MAXE = 8;
  const int lane = threadIdx.x & 31;
  const int64_t V = num_vectors(p), L = vector_length(p), k = p.k;
  const int64_t vv = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  if (vv >= p.N * V) return;  // warp-uniform
  const int64_t n = vv / V, v = vv % V;
  const DType* x = static_cast<const DType*>(p.x);
  uint64_t key[MAXE];
  unsigned valid = 0;
#pragma unroll
  for (int i = 0; i < MAXE; ++i) {
    const int64_t j = i * 32 + lane;
    key[i] = 0;
    if (j < L) {
      key[i] = composite_key(orderable_key(load_elem(x, p, n, v, j)), (uint32_t)j);
      valid |= 1u << i;
    }
  }
  const int64_t kt = (L >= 2 * k + 1) ? k + 1 : k;
  unsigned topm = 0, botm = 0;
  uint64_t hi_key = 0, lo_key = 0;
  warp_select_rounds<MAXE>(key, valid, k, L, topm, botm, hi_key, lo_key);
  DType* values = static_cast<DType*>(p.values);
  IdType* indices = static_cast<IdType*>(p.indices);
  const int64_t base = vv * 2 * k;
  int pos_t = 0, pos_b = 0;
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int i = 0; i < MAXE; ++i) {
    const bool ft = (topm >> i) & 1u, fb = (botm >> i) & 1u;
    const unsigned bt = __ballot_sync(kSelFullMask, ft), bb = __ballot_sync(kSelFullMask, fb);
    const DType val = from_float<DType>(key_to_float((uint32_t)(key[i] >> 32)));
    if (ft) {
      const int64_t pos = base + pos_t + __popc(bt & below);
      values[pos] = val;
      indices[pos] = (IdType)(i * 32 + lane);
    }
    if (fb) {
      const int64_t pos = base + k + pos_b + __popc(bb & below);
      values[pos] = val;
      indices[pos] = (IdType)(i * 32 + lane);
    }
    pos_t += __popc(bt);
    pos_b += __popc(bb);
  }
  if (p.bounds && lane == 0) {
    const bool inl = kt == k + 1;
    p.bounds[vv * 2] = inl ? key_to_float((uint32_t)(lo_key >> 32)) : 0.f;
    p.bounds[vv * 2 + 1] = inl ? key_to_float((uint32_t)(hi_key >> 32)) : 0.f;
  }
}

/// \brief 16-bit dtypes: order key of the raw fp16 / bf16 bits (same order as the float).
__device__ __forceinline__ uint32_t orderable_key16(uint32_t h) {
  return (h & 0x8000u) ? (~h & 0xffffu) : (h | 0x8000u);
}
__device__ __forceinline__ uint16_t key16_to_bits(uint32_t o) {
  return (uint16_t)((o & 0x8000u) ? (o & 0x7fffu) : (~o & 0xffffu));
}

/// \brief Warp path for fp16 / bf16 (L <= 256): the composite key (value, -index) fits in
/// 32 bits, so every round is one __reduce_max_sync / __reduce_min_sync.  Same selection as
/// the 64-bit path (the 16-bit order equals the float order, -0 < +0).
template <typename DType, typename IdType, int MAXE>
__global__ void __launch_bounds__(256) OutlierSelectWarp16Kernel(OutlierSelectParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t V = num_vectors(p), L = vector_length(p), k = p.k;
  const int64_t vv = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  if (vv >= p.N * V) return;  // warp-uniform
  const int64_t n = vv / V, v = vv % V;
  const DType* x = static_cast<const DType*>(p.x);
  uint32_t key[MAXE];
  unsigned valid = 0;
#pragma unroll
  for (int i = 0; i < MAXE; ++i) {
    const int64_t j = i * 32 + lane;
    key[i] = 0;
    if (j < L) {
      const int64_t off = p.per_channel ? (n * p.T + j) * p.D + v : (n * p.T + v) * p.D + j;
      key[i] = (orderable_key16(x[off].bits) << 16) | (0xffffu - (uint32_t)j);
      valid |= 1u << i;
    }
  }
  const int64_t kt = (L >= 2 * k + 1) ? k + 1 : k;
  unsigned topm = 0, botm = 0;
  uint32_t hi_key = 0, lo_key = 0;
  warp_select_rounds<MAXE>(key, valid, k, L, topm, botm, hi_key, lo_key);
  DType* values = static_cast<DType*>(p.values);
  IdType* indices = static_cast<IdType*>(p.indices);
  const int64_t base = vv * 2 * k;
  int pos_t = 0, pos_b = 0;
  const unsigned below = (1u << lane) - 1u;
#pragma unroll
  for (int i = 0; i < MAXE; ++i) {
    const bool ft = (topm >> i) & 1u, fb = (botm >> i) & 1u;
    const unsigned bt = __ballot_sync(kSelFullMask, ft), bb = __ballot_sync(kSelFullMask, fb);
    DType val;
    val.bits = key16_to_bits(key[i] >> 16);
    if (ft) {
      const int64_t pos = base + pos_t + __popc(bt & below);
      values[pos] = val;
      indices[pos] = (IdType)(i * 32 + lane);
    }
    if (fb) {
      const int64_t pos = base + k + pos_b + __popc(bb & below);
      values[pos] = val;
      indices[pos] = (IdType)(i * 32 + lane);
    }
    pos_t += __popc(bt);
    pos_b += __popc(bb);
  }
  if (p.bounds && lane == 0) {
    const bool inl = kt == k + 1;
    DType hv, lv;
    hv.bits = key16_to_bits(hi_key >> 16);
    lv.bits = key16_to_bits(lo_key >> 16);
    p.bounds[vv * 2] = inl ? to_float(lv) : 0.f;
    p.bounds[vv * 2 + 1] = inl ? to_float(hv) : 0.f;
  }
}

/// \brief Key channels: x [N, T, D] -> keys [N, D, T] (32x32 tiles through shared memory).
/// grid (ceil(D / 32), ceil(T / 32), N), block (32, 8).
template <typename DType>
__global__ void OutlierKeysTransposeKernel(OutlierSelectParams p) {
  __shared__ uint32_t tile[32][33];
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t n = blockIdx.z, c0 = (int64_t)blockIdx.x * 32, t0 = (int64_t)blockIdx.y * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t t = t0 + i, c = c0 + threadIdx.x;
    if (t < p.T && c < p.D) tile[i][threadIdx.x] = orderable_key(to_float(x[(n * p.T + t) * p.D + c]));
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t c = c0 + i, t = t0 + threadIdx.x;
    if (c < p.D && t < p.T) p.keys_ws[(n * p.D + c) * p.T + t] = tile[threadIdx.x][i];
  }
}

/// \brief 16-bit dtypes, L <= 65536: the same transpose writing 16-bit order keys
/// (orderable_key16 of the raw bits) into keys_ws viewed as uint16_t -- half the workspace
/// traffic, and the composite key (value, -index) fits in 32 bits.
template <typename DType>
__global__ void OutlierKeysTranspose16Kernel(OutlierSelectParams p) {
  __shared__ uint16_t tile[32][34];
  const DType* x = static_cast<const DType*>(p.x);
  uint16_t* keys = reinterpret_cast<uint16_t*>(p.keys_ws);
  const int64_t n = blockIdx.z, c0 = (int64_t)blockIdx.x * 32, t0 = (int64_t)blockIdx.y * 32;
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t t = t0 + i, c = c0 + threadIdx.x;
    if (t < p.T && c < p.D) tile[i][threadIdx.x] = (uint16_t)orderable_key16(x[(n * p.T + t) * p.D + c].bits);
  }
  __syncthreads();
  for (int i = threadIdx.y; i < 32; i += 8) {
    const int64_t c = c0 + i, t = t0 + threadIdx.x;
    if (c < p.D && t < p.T) keys[(n * p.D + c) * p.T + t] = tile[threadIdx.x][i];
  }
}

template <typename DType>
__global__ void OutlierKeys16Kernel(OutlierSelectParams p) {
  const DType* x = static_cast<const DType*>(p.x);
  uint16_t* keys = reinterpret_cast<uint16_t*>(p.keys_ws);
  const int64_t total = p.N * p.T * p.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    keys[i] = (uint16_t)orderable_key16(x[i].bits);
}

/// \brief Value tokens longer than 256: keys in the same (already contiguous) layout.
template <typename DType>
__global__ void OutlierKeysKernel(OutlierSelectParams p) {
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t total = p.N * p.T * p.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    p.keys_ws[i] = orderable_key(to_float(x[i]));
}

/// \brief Composite keys of the radix path: K16 = 16-bit order keys (fp16 / bf16 with
/// L <= 65536) and 32-bit composites (value16 << 16 | 0xffff - j), else 32-bit float order
/// keys and 64-bit composites.  Same total order either way (value, then smaller index).
template <typename DType, bool K16>
struct RadixKeys;
template <typename DType>
struct RadixKeys<DType, true> {
  using CK = uint32_t;
  static constexpr int BITS = 32;
  const uint16_t* k;
  __device__ __forceinline__ uint32_t load(int64_t j) const { return k[j]; }
  __device__ __forceinline__ static CK composite(uint32_t kv, uint32_t j) {
    return (kv << 16) | (0xffffu - j);
  }
  __device__ __forceinline__ static DType value(uint32_t kv) {
    DType v;
    v.bits = key16_to_bits(kv);
    return v;
  }
  __device__ __forceinline__ static float bound(uint32_t kv) { return to_float(value(kv)); }
};
template <typename DType>
struct RadixKeys<DType, false> {
  using CK = uint64_t;
  static constexpr int BITS = 64;
  const uint32_t* k;
  __device__ __forceinline__ uint32_t load(int64_t j) const { return k[j]; }
  __device__ __forceinline__ static CK composite(uint32_t kv, uint32_t j) {
    return composite_key(kv, j);
  }
  __device__ __forceinline__ static DType value(uint32_t kv) {
    return from_float<DType>(key_to_float(kv));
  }
  __device__ __forceinline__ static float bound(uint32_t kv) { return key_to_float(kv); }
};

/// \brief Radix path: one block of 256 threads per vector (keys contiguous in keys_ws).
template <typename DType, typename IdType, bool K16>
__global__ void __launch_bounds__(256) OutlierSelectRadixKernel(OutlierSelectParams p) {
  constexpr int THREADS = 256;
  using RK = RadixKeys<DType, K16>;
  using CK = typename RK::CK;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t vv = blockIdx.x;
  const int64_t L = vector_length(p), k = p.k;
  const int64_t kt = (L >= 2 * k + 1) ? k + 1 : k;  // >= 1 (k >= 1 here)
  RK keys;
  if constexpr (K16) {
    keys.k = reinterpret_cast<const uint16_t*>(p.keys_ws) + vv * L;
  } else {
    keys.k = p.keys_ws + vv * L;
  }
  __shared__ int hist[2][256];
  __shared__ unsigned long long s_prefix[2];
  __shared__ int s_shift[2];
  __shared__ int64_t s_need[2];
  __shared__ int s_done[2];
  if (tid < 2) {
    s_prefix[tid] = 0;
    s_shift[tid] = RK::BITS;
    s_need[tid] = kt;
    s_done[tid] = 0;
  }
  __syncthreads();
  for (int pass = 0; pass < 8; ++pass) {
    const int dT = s_done[0], dB = s_done[1];
    if (dT && dB) break;  // block-uniform (read after a barrier)
    const uint64_t pT = s_prefix[0], pB = s_prefix[1];
    const int shT = s_shift[0], shB = s_shift[1];
    hist[0][tid] = 0;
    hist[1][tid] = 0;
    __syncthreads();
    // NOTE: the upper digits of float keys take few distinct values, so lanes with the same
    // digit are aggregated (__match_any_sync) into one shared atomic by a leader lane.
    for (int64_t j0 = 0; j0 < L; j0 += THREADS) {  // uniform trip count: whole warps
      const int64_t j = j0 + tid;
      CK ck = 0;
      if (j < L) ck = RK::composite(keys.load(j), (uint32_t)j);
      const bool inT = j < L && !dT && (shT == RK::BITS || (uint64_t)(ck >> (shT & (RK::BITS - 1))) == pT);
      const bool inB = j < L && !dB && (shB == RK::BITS || (uint64_t)(ck >> (shB & (RK::BITS - 1))) == pB);
      const unsigned mT = __ballot_sync(kSelFullMask, inT), mB = __ballot_sync(kSelFullMask, inB);
      if (inT) {
        const unsigned dg = (unsigned)(ck >> (shT - 8)) & 255u;
        const unsigned peers = __match_any_sync(mT, dg);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[0][dg], __popc(peers));
      }
      if (inB && pass > 0) {  // pass 0: both sides see every entry, one histogram serves
        const unsigned dg = (unsigned)(ck >> (shB - 8)) & 255u;
        const unsigned peers = __match_any_sync(mB, dg);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[1][dg], __popc(peers));
      }
    }
    __syncthreads();
    if (warp < 2 && !(warp == 0 ? dT : dB)) {
      const int side = warp;
      const bool desc = side == 0;  // top: scan digits from 255 down
      // every lane reads s_need before the winning lane rewrites it (racecheck on the H200
      // flagged the read/write pair when only the shuffles below ordered them)
      const int64_t need = s_need[side];
      __syncwarp();
      int cnt[8];
      int s = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int o = 8 * lane + e;
        cnt[e] = hist[pass == 0 ? 0 : side][desc ? 255 - o : o];
        s += cnt[e];
      }
      int incl = s;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(kSelFullMask, incl, o);
        if (lane >= o) incl += y;
      }
      const int excl = incl - s;
      if (excl < need && need <= incl) {  // exactly one lane
        int acc = excl;
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          if (acc < need && need <= acc + cnt[e]) {
            const int o = 8 * lane + e;
            const uint64_t digit = desc ? 255 - o : o;
            const int shift = (side == 0 ? shT : shB) - 8;
            const uint64_t prefix = side == 0 ? pT : pB;
            s_prefix[side] = (prefix << 8) | digit;
            s_shift[side] = shift;
            s_need[side] = need - acc;
            s_done[side] = (cnt[e] == 1 || shift == 0) ? 1 : 0;
          }
          acc += cnt[e];
        }
      }
    }
    __syncthreads();
  }
  // The kt-th entry E of each side is now alone with its prefix: (key >> shift) == prefix.
  // Ordered compaction: thread t owns the contiguous entries [t*C, (t+1)*C), counts its
  // selected entries, one block-wide exclusive scan gives its output offsets, and a second
  // walk over the (L1-resident) chunk writes them, so both halves come out in index order.
  const uint64_t PT = s_prefix[0], PB = s_prefix[1];
  const int ST = s_shift[0], SB = s_shift[1];
  const bool inl = kt == k + 1;
  DType* values = static_cast<DType*>(p.values);
  IdType* indices = static_cast<IdType*>(p.indices);
  const int64_t base = vv * 2 * k;
  if (p.bounds && !inl && tid == 0) {
    p.bounds[vv * 2] = 0.f;
    p.bounds[vv * 2 + 1] = 0.f;
  }
  const int64_t C = (L + THREADS - 1) / THREADS;
  const int64_t jb = tid * C, je = jb + C < L ? jb + C : L;
  uint64_t cnt = 0;  // top count | bottom count << 32
  for (int64_t j = jb; j < je; ++j) {
    const uint32_t kv = keys.load(j);
    const CK ck = RK::composite(kv, (uint32_t)j);
    const uint64_t a = (uint64_t)(ck >> ST), b = (uint64_t)(ck >> SB);
    cnt += (inl ? a > PT : a >= PT) ? 1ull : 0ull;
    cnt += (inl ? b < PB : b <= PB) ? (1ull << 32) : 0ull;
    if (inl && p.bounds) {
      if (a == PT) p.bounds[vv * 2 + 1] = RK::bound(kv);
      if (b == PB) p.bounds[vv * 2] = RK::bound(kv);
    }
  }
  uint64_t incl = cnt;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const uint64_t y = __shfl_up_sync(kSelFullMask, incl, o);
    if (lane >= o) incl += y;
  }
  __shared__ unsigned long long s_wtot[THREADS / 32];
  if (lane == 31) s_wtot[warp] = incl;
  __syncthreads();
  uint64_t woff = 0;
#pragma unroll
  for (int w = 0; w < THREADS / 32; ++w) woff += (w < warp) ? s_wtot[w] : 0ull;
  const uint64_t excl = woff + incl - cnt;
  int64_t pt = base + (int64_t)(excl & 0xffffffffull);
  int64_t pb = base + k + (int64_t)(excl >> 32);
  if (cnt != 0) {
    for (int64_t j = jb; j < je; ++j) {
      const uint32_t kv = keys.load(j);
      const CK ck = RK::composite(kv, (uint32_t)j);
      const uint64_t a = (uint64_t)(ck >> ST), b = (uint64_t)(ck >> SB);
      const bool ft = inl ? a > PT : a >= PT;
      const bool fb = inl ? b < PB : b <= PB;
      if (ft) {
        values[pt] = RK::value(kv);
        indices[pt++] = (IdType)j;
      }
      if (fb) {
        values[pb] = RK::value(kv);
        indices[pb++] = (IdType)j;
      }
    }
  }
}

/// \brief Select the k largest and k smallest entries of every vector (k >= 1, 2k <= L).
/// Requires p.keys_ws with N * V * L entries when L > 256.
template <typename DType, typename IdType>
cudaError_t OutlierSelect(const OutlierSelectParams& p, cudaStream_t stream) {
  const int64_t V = num_vectors(p), L = vector_length(p), nvec = p.N * V;
  if (nvec == 0 || p.k == 0 || L == 0) return cudaSuccess;
  if (L <= 256) {
    const int64_t blocks = (nvec + 7) / 8;
    if constexpr (sizeof(DType) == 2) {
      if (L <= 64)
        OutlierSelectWarp16Kernel<DType, IdType, 2><<<(unsigned)blocks, 256, 0, stream>>>(p);
      else if (L <= 128)
        OutlierSelectWarp16Kernel<DType, IdType, 4><<<(unsigned)blocks, 256, 0, stream>>>(p);
      else
        OutlierSelectWarp16Kernel<DType, IdType, 8><<<(unsigned)blocks, 256, 0, stream>>>(p);
    } else {
      OutlierSelectWarpKernel<DType, IdType><<<(unsigned)blocks, 256, 0, stream>>>(p);
    }
    return cudaGetLastError();
  }
  if (p.keys_ws == nullptr) return cudaErrorInvalidValue;
  // 16-bit dtypes with L <= 65536: 16-bit keys, 32-bit composites (the value is resolved
  // after 2 radix passes instead of 3, half the key bytes); else 32-bit float keys.
  const bool k16 = sizeof(DType) == 2 && L <= 65536;
  const int64_t total = p.N * p.T * p.D;
  int64_t blocks = (total + 255) / 256;
  if (blocks > 65536) blocks = 65536;
  if (p.per_channel && p.N > 65535) return cudaErrorInvalidConfiguration;
  const dim3 tgrid((unsigned)((p.D + 31) / 32), (unsigned)((p.T + 31) / 32), (unsigned)p.N);
  if constexpr (sizeof(DType) == 2) {
    if (k16) {
      if (p.per_channel)
        OutlierKeysTranspose16Kernel<DType><<<tgrid, dim3(32, 8), 0, stream>>>(p);
      else
        OutlierKeys16Kernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
      cudaError_t err = cudaGetLastError();
      if (err != cudaSuccess) return err;
      OutlierSelectRadixKernel<DType, IdType, true><<<(unsigned)nvec, 256, 0, stream>>>(p);
      return cudaGetLastError();
    }
  }
  if (p.per_channel)
    OutlierKeysTransposeKernel<DType><<<tgrid, dim3(32, 8), 0, stream>>>(p);
  else
    OutlierKeysKernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  OutlierSelectRadixKernel<DType, IdType, false><<<(unsigned)nvec, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace select
}  // namespace kvq
