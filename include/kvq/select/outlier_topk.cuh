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
  for (int64_t round = 0; round < kt; ++round) {
    uint64_t best = 0;
#pragma unroll
    for (int i = 0; i < MAXE; ++i)
      if (((valid & ~topm) >> i) & 1u) best = key[i] > best ? key[i] : best;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      uint64_t other = __shfl_xor_sync(kSelFullMask, best, o);
      best = other > best ? other : best;
    }
    if (round < k) {
#pragma unroll
      for (int i = 0; i < MAXE; ++i)
        if (((valid >> i) & 1u) && key[i] == best) topm |= 1u << i;
    } else {
      hi_key = best;
    }
  }
  for (int64_t round = 0; round < kt; ++round) {
    uint64_t best = ~0ull;
#pragma unroll
    for (int i = 0; i < MAXE; ++i)
      if (((valid & ~botm) >> i) & 1u) best = key[i] < best ? key[i] : best;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      uint64_t other = __shfl_xor_sync(kSelFullMask, best, o);
      best = other < best ? other : best;
    }
    if (round < k) {
#pragma unroll
      for (int i = 0; i < MAXE; ++i)
        if (((valid >> i) & 1u) && key[i] == best) botm |= 1u << i;
    } else {
      lo_key = best;
    }
  }
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
  for (int64_t round = 0; round < kt; ++round) {
    uint32_t best = 0;
#pragma unroll
    for (int i = 0; i < MAXE; ++i)
      if (((valid & ~topm) >> i) & 1u) best = key[i] > best ? key[i] : best;
    best = __reduce_max_sync(kSelFullMask, best);
    if (round < k) {
#pragma unroll
      for (int i = 0; i < MAXE; ++i)
        if (((valid >> i) & 1u) && key[i] == best) topm |= 1u << i;
    } else {
      hi_key = best;
    }
  }
  for (int64_t round = 0; round < kt; ++round) {
    uint32_t best = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < MAXE; ++i)
      if (((valid & ~botm) >> i) & 1u) best = key[i] < best ? key[i] : best;
    best = __reduce_min_sync(kSelFullMask, best);
    if (round < k) {
#pragma unroll
      for (int i = 0; i < MAXE; ++i)
        if (((valid >> i) & 1u) && key[i] == best) botm |= 1u << i;
    } else {
      lo_key = best;
    }
  }
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

/// \brief Value tokens longer than 256: keys in the same (already contiguous) layout.
template <typename DType>
__global__ void OutlierKeysKernel(OutlierSelectParams p) {
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t total = p.N * p.T * p.D;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x)
    p.keys_ws[i] = orderable_key(to_float(x[i]));
}

/// \brief Radix path: one block of 256 threads per vector (keys contiguous in keys_ws).
template <typename DType, typename IdType>
__global__ void __launch_bounds__(256) OutlierSelectRadixKernel(OutlierSelectParams p) {
  constexpr int THREADS = 256;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t vv = blockIdx.x;
  const int64_t L = vector_length(p), k = p.k;
  const int64_t kt = (L >= 2 * k + 1) ? k + 1 : k;  // >= 1 (k >= 1 here)
  const uint32_t* keys = p.keys_ws + vv * L;
  __shared__ int hist[2][256];
  __shared__ unsigned long long s_prefix[2];
  __shared__ int s_shift[2];
  __shared__ int64_t s_need[2];
  __shared__ int s_done[2];
  if (tid < 2) {
    s_prefix[tid] = 0;
    s_shift[tid] = 64;
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
      uint64_t ck = 0;
      if (j < L) ck = composite_key(keys[j], (uint32_t)j);
      const bool inT = j < L && !dT && (shT == 64 || (ck >> shT) == pT);
      const bool inB = j < L && !dB && (shB == 64 || (ck >> shB) == pB);
      const unsigned mT = __ballot_sync(kSelFullMask, inT), mB = __ballot_sync(kSelFullMask, inB);
      if (inT) {
        const unsigned dg = (unsigned)(ck >> (shT - 8)) & 255u;
        const unsigned peers = __match_any_sync(mT, dg);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[0][dg], __popc(peers));
      }
      if (inB) {
        const unsigned dg = (unsigned)(ck >> (shB - 8)) & 255u;
        const unsigned peers = __match_any_sync(mB, dg);
        if (lane == __ffs(peers) - 1) atomicAdd(&hist[1][dg], __popc(peers));
      }
    }
    __syncthreads();
    if (warp < 2 && !(warp == 0 ? dT : dB)) {
      const int side = warp;
      const bool desc = side == 0;  // top: scan digits from 255 down
      // NOTE: read before the shuffles below, which order it before the winner's write.
      const int64_t need = s_need[side];
      int cnt[8];
      int s = 0;
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const int o = 8 * lane + e;
        cnt[e] = hist[side][desc ? 255 - o : o];
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
    const uint32_t kv = keys[j];
    const uint64_t ck = composite_key(kv, (uint32_t)j);
    const uint64_t a = ck >> ST, b = ck >> SB;
    cnt += (inl ? a > PT : a >= PT) ? 1ull : 0ull;
    cnt += (inl ? b < PB : b <= PB) ? (1ull << 32) : 0ull;
    if (inl && p.bounds) {
      if (a == PT) p.bounds[vv * 2 + 1] = key_to_float(kv);
      if (b == PB) p.bounds[vv * 2] = key_to_float(kv);
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
      const uint32_t kv = keys[j];
      const uint64_t ck = composite_key(kv, (uint32_t)j);
      const uint64_t a = ck >> ST, b = ck >> SB;
      const bool ft = inl ? a > PT : a >= PT;
      const bool fb = inl ? b < PB : b <= PB;
      if (ft) {
        values[pt] = from_float<DType>(key_to_float(kv));
        indices[pt++] = (IdType)j;
      }
      if (fb) {
        values[pb] = from_float<DType>(key_to_float(kv));
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
  if (p.per_channel) {
    if (p.N > 65535) return cudaErrorInvalidConfiguration;
    dim3 grid((unsigned)((p.D + 31) / 32), (unsigned)((p.T + 31) / 32), (unsigned)p.N);
    OutlierKeysTransposeKernel<DType><<<grid, dim3(32, 8), 0, stream>>>(p);
  } else {
    const int64_t total = p.N * p.T * p.D;
    int64_t blocks = (total + 255) / 256;
    if (blocks > 65536) blocks = 65536;
    OutlierKeysKernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
  }
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  OutlierSelectRadixKernel<DType, IdType><<<(unsigned)nvec, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace select
}  // namespace kvq
