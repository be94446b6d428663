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
// Per-token quantization for G a multiple of 32: one lane per 32-channel chunk of a row.
// A warp covers 32 consecutive chunks (2 KB of fp16, contiguous); a lane reduces its chunk
// in registers, G / 32 lanes combine a group with xor shuffles, and each lane packs its 32
// codes into BITS whole words (one vector store).  Versus the warp-per-row kernel this drops
// the per-element shuffles and the redundant per-lane scale computation (8 lanes per group
// at G = 32, D = 128).  Same make_qparams / quant_code: bit-identical codes and scales.
// ---------------------------------------------------------------------------
template <typename DType, int BITS>
__global__ void __launch_bounds__(256) GroupQuantizePerTokenChunkKernel(GroupQuantParams p) {
  constexpr int CH = 32;
  constexpr int VE = 16 / (int)sizeof(DType);  // elements per 16-byte load
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  constexpr int CPW = 32 / BITS;  // codes per word
  const int lane = threadIdx.x % 32;
  const int64_t items = p.N * p.T * (p.D / CH);
  const int lpg = (int)(p.group / CH);  // lanes per group: 1, 2, 4 or 8
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  int32_t status = 0;
  for (int64_t base = (int64_t)blockIdx.x * blockDim.x + threadIdx.x - lane; base < items; base += stride) {
    const int64_t it = base + lane;
    const bool valid = it < items;  // groups never straddle the end (items, G/32 | D/32)
    float v[CH];
    if (valid) {
      const uint4* src = reinterpret_cast<const uint4*>(x + it * CH);
#pragma unroll
      for (int u = 0; u < CH / VE; ++u) {
        const uint4 raw = src[u];
        const DType* e = reinterpret_cast<const DType*>(&raw);
#pragma unroll
        for (int k = 0; k < VE; ++k) v[u * VE + k] = to_float(e[k]);
      }
    } else {
#pragma unroll
      for (int k = 0; k < CH; ++k) v[k] = 0.f;
    }
    float mn = v[0], mx = v[0];
#pragma unroll
    for (int k = 0; k < CH; ++k) {
      if (p.status) status |= value_status(v[k]);
      mn = fminf(mn, v[k]);
      mx = fmaxf(mx, v[k]);
    }
    for (int o = 1; o < lpg; o <<= 1) {
      mn = fminf(mn, __shfl_xor_sync(kFullMask, mn, o));
      mx = fmaxf(mx, __shfl_xor_sync(kFullMask, mx, o));
    }
    if (!valid) continue;
    const QParams q = make_qparams(mn, mx, BITS);
    if (lane % lpg == 0) {  // it % lpg == 0: the group's first chunk
      p.scale[it / lpg] = q.s16;
      p.zero[it / lpg] = q.z16;
    }
    uint32_t w[BITS];
#pragma unroll
    for (int k = 0; k < BITS; ++k) w[k] = 0u;
#pragma unroll
    for (int k = 0; k < CH; ++k) w[k / CPW] |= quant_code(v[k], q.zero, q.inv, MAXQ) << ((k % CPW) * BITS);
    int32_t* dst = p.codes + it * BITS;
    if constexpr (BITS == 2) {
      *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
    } else {
#pragma unroll
      for (int k = 0; k < BITS; k += 4) *reinterpret_cast<uint4*>(dst + k) = make_uint4(w[k], w[k + 1], w[k + 2], w[k + 3]);
    }
  }
  report_status(p.status, status);
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

/// \brief Quantize and pack.  Requires D in {32, 64, 128, 256}; see GroupQuantParams.
template <typename DType, int EPL, int BITS>
cudaError_t GroupQuantize(const GroupQuantParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  if (p.per_channel) {
    constexpr int WARPS = 8;
    const int64_t blocks = p.N * (p.T / p.group);
    GroupQuantizePerChannelKernel<DType, EPL, BITS, WARPS>
        <<<(unsigned)blocks, WARPS * 32, 0, stream>>>(p);
  } else if (p.group % 32 == 0) {
    constexpr int THREADS = 256;
    const int64_t items = p.N * p.T * (p.D / 32);
    int64_t blocks = (items + THREADS - 1) / THREADS;
    const int64_t cap = (int64_t)num_sms() * 8;
    if (blocks > cap) blocks = cap;
    GroupQuantizePerTokenChunkKernel<DType, BITS><<<(unsigned)blocks, THREADS, 0, stream>>>(p);
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
