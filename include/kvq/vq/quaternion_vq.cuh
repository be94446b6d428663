// CUDA kernels of HQMQ encode/decode.  Torch-free.  Format and arithmetic: quaternion_vq.h.
//
// Thread mapping (encode and decode): a block works on one row group n (one KV head's
// secondary set, copied once into shared memory as float4) and a tile of TOKENS_PER_BLOCK
// tokens.  Within a warp, a token is handled by LPT lanes, each owning CPT consecutive
// chunks (C = LPT * CPT: D=32 -> 8x1, D=64 -> 16x1, D=128 -> 32x1, D=256 -> 32x2), loaded
// with one 8/16/32-byte vector load.  Row reductions (radius scale, outlier mask) are xor
// shuffles inside the LPT-lane group.  Each lane searches the S secondary quaternions for its
// chunks (S products, broadcast reads of shared memory); the fields are staged in a per-warp
// shared buffer and lane j assembles word j of the row (coalesced 4-byte stores).
#pragma once
#include <cuda_runtime.h>

#include "kvq/common/half.h"
#include "kvq/vq/quaternion_vq.h"

namespace kvq {
namespace vq {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;
constexpr int kTokensPerBlock = 64;

template <typename T, int N>
struct alignas(sizeof(T) * N) VecT {
  T v[N];
};

template <typename DType, int CPT, int LPT>
__global__ void __launch_bounds__(kThreads) HqmqEncodeKernel(HqmqParams p) {
  extern __shared__ float4 smem[];
  constexpr int C = CPT * LPT;
  constexpr int TPW = 32 / LPT;  // tokens per warp and iteration
  float4* s_sec = smem;                                              // [S]
  uint32_t* s_fields = reinterpret_cast<uint32_t*>(smem + p.S);      // [warps][32 * CPT]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = lane / LPT, l = lane % LPT;
  uint32_t* fields = s_fields + warp * 32 * CPT + g * C;  // this token's C fields
  const int RB = p.radius_bits, F = p.field_bits, W = p.words;
  const float maxq = (float)((1 << RB) - 1);
  const bool has_thr = p.threshold != nullptr;
  const int64_t S = p.S;
  const DType* x = static_cast<const DType*>(p.x);
  int32_t status = 0;

  const int64_t t_begin = (int64_t)blockIdx.x * kTokensPerBlock;
  const int64_t t_end = min(p.T, t_begin + kTokensPerBlock);
  for (int64_t n = blockIdx.y; n < p.N; n += gridDim.y) {
    const int64_t h = n % p.H;
    __syncthreads();  // the previous head's readers of s_sec are done
    const float4* sec_g = reinterpret_cast<const float4*>(p.secondary) + h * S;
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) s_sec[i] = sec_g[i];
    __syncthreads();
    const float thr = has_thr ? p.threshold[h] : INFINITY;

    // Warp-uniform loop: every lane runs every iteration (shuffles need all 32 lanes).
    for (int64_t t0 = t_begin + (int64_t)warp * TPW; t0 < t_end; t0 += (int64_t)nwarps * TPW) {
      const int64_t t = t0 + g;
      const bool valid = t < t_end;
      const int64_t row = n * p.T + t;
      float xc[CPT][4];
      if (valid) {
        VecT<DType, 4 * CPT> d =
            reinterpret_cast<const VecT<DType, 4 * CPT>*>(x + row * p.D)[l];
#pragma unroll
        for (int k = 0; k < CPT; ++k)
#pragma unroll
          for (int i = 0; i < 4; ++i) xc[k][i] = to_float(d.v[4 * k + i]);
      } else {
#pragma unroll
        for (int k = 0; k < CPT; ++k)
#pragma unroll
          for (int i = 0; i < 4; ++i) xc[k][i] = 0.f;
      }
      float r[CPT];
      bool outl[CPT];
      float rmax = 0.f;
      uint64_t mask = 0;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        if (p.status) {
#pragma unroll
          for (int i = 0; i < 4; ++i) status |= value_status(xc[k][i]);
        }
        r[k] = chunk_norm(xc[k][0], xc[k][1], xc[k][2], xc[k][3]);
        outl[k] = has_thr && r[k] > thr;
        if (outl[k]) mask |= (uint64_t)1 << (l * CPT + k);
        else rmax = fmaxf(rmax, r[k]);
      }
#pragma unroll
      for (int o = 1; o < LPT; o <<= 1) rmax = fmaxf(rmax, __shfl_xor_sync(kFullMask, rmax, o));
      if (has_thr) {
        uint32_t lo = (uint32_t)mask, hi = (uint32_t)(mask >> 32);
#pragma unroll
        for (int o = 1; o < LPT; o <<= 1) {
          lo |= __shfl_xor_sync(kFullMask, lo, o);
          hi |= __shfl_xor_sync(kFullMask, hi, o);
        }
        mask = (uint64_t)lo | ((uint64_t)hi << 32);
      }
      const uint16_t s16 = float_to_half_bits_ru(rmax);
      const float step = div_rn(half_bits_to_float(s16), maxq);
      if (p.status && valid && rmax > kMaxAbs) status |= kStatusOutOfRange;

      // Nearest codeword: S quaternion products per chunk, secondary set from shared memory.
      float best[CPT];
      int bs[CPT];
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        best[k] = -1.f;
        bs[k] = 0;
      }
#pragma unroll 4
      for (int s = 0; s < (int)S; ++s) {
        const float4 q = s_sec[s];
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
          float v0, v1, v2, v3;
          mul_conj(xc[k][0], xc[k][1], xc[k][2], xc[k][3], q.x, q.y, q.z, q.w, v0, v1, v2, v3);
          const float sc = hurwitz_score(v0, v1, v2, v3);
          if (sc > best[k]) {
            best[k] = sc;
            bs[k] = s;
          }
        }
      }
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const float4 q = s_sec[bs[k]];
        float v0, v1, v2, v3;
        mul_conj(xc[k][0], xc[k][1], xc[k][2], xc[k][3], q.x, q.y, q.z, q.w, v0, v1, v2, v3);
        const uint32_t dir = (uint32_t)(bs[k] * kHurwitzUnits + hurwitz_nearest(v0, v1, v2, v3));
        fields[l * CPT + k] = outl[k] ? 0u : ((dir << RB) | radius_code(r[k], step, maxq));
      }
      __syncwarp();
      if (valid) {
        uint32_t* words = reinterpret_cast<uint32_t*>(p.codes) + row * W;
        for (int j = l; j < W; j += LPT) words[j] = assemble_word(fields, C, F, j);
        if (l == 0) {
          p.scale[row] = s16;
          if (has_thr) {
            p.flag_mask[row] = (int64_t)mask;
            p.flag_count[row] = __popcll(mask);
          }
        }
      }
      __syncwarp();  // fields are rewritten in the next iteration
    }
  }
  if (p.status) {
    const int32_t any = __reduce_or_sync(kFullMask, status);
    if (any && lane == 0) atomicOr(p.status, any);
  }
}

/// \brief One thread per row: write the row's outlier records at p.offsets[row].
template <typename DType>
__global__ void HqmqWriteRecordsKernel(HqmqParams p) {
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t rows = p.N * p.T;
  for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < rows;
       row += (int64_t)gridDim.x * blockDim.x) {
    uint64_t mask = (uint64_t)p.flag_mask[row];
    if (!mask) continue;
    int64_t k = p.offsets[row];
    const int64_t n = row / p.T, t = row % p.T;
    while (mask) {
      const int c = __ffsll((long long)mask) - 1;
      mask &= mask - 1;
      const DType* xc = x + row * p.D + 4 * c;
      int32_t rec[4];
      make_record(t, n, c, to_float(xc[0]), to_float(xc[1]), to_float(xc[2]), to_float(xc[3]),
                  rec);
      reinterpret_cast<int4*>(p.outliers)[k] = make_int4(rec[0], rec[1], rec[2], rec[3]);
      ++k;
    }
  }
}

template <typename DType, int CPT, int LPT>
__global__ void __launch_bounds__(kThreads) HqmqDecodeKernel(HqmqParams p) {
  extern __shared__ float4 smem[];
  constexpr int TPW = 32 / LPT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = lane / LPT, l = lane % LPT;
  const int RB = p.radius_bits, F = p.field_bits, W = p.words;
  const float maxq = (float)((1 << RB) - 1);
  const int64_t S = p.S;
  DType* out = static_cast<DType*>(p.out);
  const float* s_sec = reinterpret_cast<const float*>(smem);

  const int64_t t_begin = (int64_t)blockIdx.x * kTokensPerBlock;
  const int64_t t_end = min(p.T, t_begin + kTokensPerBlock);
  for (int64_t n = blockIdx.y; n < p.N; n += gridDim.y) {
    const int64_t h = n % p.H;
    __syncthreads();
    const float4* sec_g = reinterpret_cast<const float4*>(p.secondary) + h * S;
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) smem[i] = sec_g[i];
    __syncthreads();
    for (int64_t t0 = t_begin + (int64_t)warp * TPW; t0 < t_end; t0 += (int64_t)nwarps * TPW) {
      const int64_t t = t0 + g;
      if (t >= t_end) continue;  // no shuffles below
      const int64_t row = n * p.T + t;
      const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codes) + row * W;
      const float step = div_rn(half_bits_to_float(p.scale[row]), maxq);
      VecT<DType, 4 * CPT> d;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        float o[4];
        decode_chunk(read_field(words, l * CPT + k, F), RB, step, s_sec, S, o);
#pragma unroll
        for (int i = 0; i < 4; ++i) d.v[4 * k + i] = from_float<DType>(o[i]);
      }
      reinterpret_cast<VecT<DType, 4 * CPT>*>(out + row * p.D)[l] = d;
    }
  }
}

/// \brief One thread per record: overwrite the outlier chunk (out-of-range records skipped).
template <typename DType>
__global__ void HqmqApplyRecordsKernel(HqmqParams p) {
  DType* out = static_cast<DType*>(p.out);
  for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < p.num_outliers;
       k += (int64_t)gridDim.x * blockDim.x) {
    const int4 rv = reinterpret_cast<const int4*>(p.outliers)[k];
    const int32_t rec[4] = {rv.x, rv.y, rv.z, rv.w};
    if (!record_valid(rec, p)) continue;
    const int64_t t = rec[0], n = (int64_t)((uint32_t)rec[1] >> 8), c = rec[1] & 0xff;
    VecT<DType, 4> d;
    const uint32_t a = (uint32_t)rec[2], b = (uint32_t)rec[3];
    d.v[0] = from_float<DType>(half_bits_to_float((uint16_t)(a & 0xffffu)));
    d.v[1] = from_float<DType>(half_bits_to_float((uint16_t)(a >> 16)));
    d.v[2] = from_float<DType>(half_bits_to_float((uint16_t)(b & 0xffffu)));
    d.v[3] = from_float<DType>(half_bits_to_float((uint16_t)(b >> 16)));
    reinterpret_cast<VecT<DType, 4>*>(out + (n * p.T + t) * p.D)[c] = d;
  }
}

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------
inline dim3 hqmq_grid(const HqmqParams& p) {
  const int64_t tiles = (p.T + kTokensPerBlock - 1) / kTokensPerBlock;
  const int64_t ny = p.N < 65535 ? p.N : 65535;
  return dim3((unsigned)tiles, (unsigned)ny, 1);
}

/// \brief Dense encode (codes, scale, outlier mask/count scratch).  C = CPT * LPT chunks.
template <typename DType, int CPT, int LPT>
cudaError_t HqmqEncode(const HqmqParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  const size_t smem = (size_t)p.S * sizeof(float4) + (kThreads / 32) * 32 * CPT * sizeof(uint32_t);
  HqmqEncodeKernel<DType, CPT, LPT><<<hqmq_grid(p), kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

/// \brief Outlier records (after p.offsets has been computed from p.flag_count).
template <typename DType>
cudaError_t HqmqWriteRecords(const HqmqParams& p, cudaStream_t stream) {
  const int64_t rows = p.N * p.T;
  if (rows == 0 || p.num_outliers == 0) return cudaSuccess;
  int64_t blocks = (rows + 255) / 256;
  if (blocks > 65535) blocks = 65535;
  HqmqWriteRecordsKernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

/// \brief Decode (dense part, then the outlier records, in stream order).
template <typename DType, int CPT, int LPT>
cudaError_t HqmqDecode(const HqmqParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  const size_t smem = (size_t)p.S * sizeof(float4);
  HqmqDecodeKernel<DType, CPT, LPT><<<hqmq_grid(p), kThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_outliers == 0) return err;
  int64_t blocks = (p.num_outliers + 255) / 256;
  if (blocks > 65535) blocks = 65535;
  HqmqApplyRecordsKernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace vq
}  // namespace kvq
