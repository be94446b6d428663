// CUDA kernels of the GEAR glue (see gear.h): clamp, residual, outlier zero/scatter and the
// fused dequantize + low-rank decompression.  Torch-free.  The quantization itself is
// kvq::quant::GroupQuantize, the selection kvq::select::OutlierSelect and the factors
// kvq::linalg::PowerIter; the row kernels reuse group_quant.cuh's vector loads/unpacking.
#pragma once
#include <cuda_runtime.h>

#include "kvq/gear/gear.h"
#include "kvq/quant/group_quant.cuh"

namespace kvq {
namespace gear {

inline unsigned gear_grid(int64_t work, int threads) {
  int64_t blocks = (work + threads - 1) / threads;
  const int64_t cap = (int64_t)quant::num_sms() * 32;
  if (blocks > cap) blocks = cap;
  return (unsigned)(blocks < 1 ? 1 : blocks);
}

/// \brief xc = clamp(x, lo_v, hi_v), plus the finite check of x.  One thread per 16 bytes
/// of a row (VEC consecutive elements; D is a multiple of 8 on this path).
template <typename DType>
__global__ void GearClampKernel(GearParams p) {
  constexpr int VEC = 16 / sizeof(DType);
  const DType* x = static_cast<const DType*>(p.x);
  DType* xc = static_cast<DType*>(p.xc);
  const int64_t V = p.per_channel ? p.D : p.T;
  const int64_t total = p.N * p.T * p.D / VEC;
  int32_t status = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e0 = i * VEC, row = e0 / p.D, c0 = e0 - row * p.D;
    const int64_t n = row / p.T, t = row - n * p.T;
    quant::VecT<DType, VEC> in = reinterpret_cast<const quant::VecT<DType, VEC>*>(x)[i], o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float v = to_float(in.v[e]);
      if (p.status) status |= quant::value_status(v);
      const int64_t b = (n * V + (p.per_channel ? c0 + e : t)) * 2;
      o.v[e] = from_float<DType>(fminf(fmaxf(v, p.bounds[b]), p.bounds[b + 1]));
    }
    reinterpret_cast<quant::VecT<DType, VEC>*>(xc)[i] = o;
  }
  if (p.status && status) atomicOr(p.status, status);
}

/// \brief Dequantized value of this lane's EPL channels of row r (group_quant format).
template <int EPL, int BITS>
__device__ __forceinline__ void gear_dequant_slice(const quant::GroupQuantParams& q, int64_t r,
                                                   int lane, float (&v)[EPL]) {
  constexpr int D = EPL * 32;
  uint32_t code[EPL];
  quant::load_and_unpack<EPL, BITS>(q.codes + r * (D * BITS / 32), lane, code);
  if (q.per_channel) {
    const int64_t n = r / q.T, t = r % q.T;
    const int64_t base = (n * (q.T / q.group) + t / q.group) * D + lane * EPL;
#pragma unroll
    for (int i = 0; i < EPL; ++i)
      v[i] = (float)code[i] * half_bits_to_float(q.scale[base + i]) + half_bits_to_float(q.zero[base + i]);
  } else {
    const int64_t si = r * (D / q.group) + (lane * EPL) / q.group;
    const float s = half_bits_to_float(q.scale[si]), z = half_bits_to_float(q.zero[si]);
#pragma unroll
    for (int i = 0; i < EPL; ++i) v[i] = (float)code[i] * s + z;
  }
}

/// \brief resid = fp16(src - dequant(codes)), one warp per token row.
template <typename DType, int EPL, int BITS>
__global__ void GearResidualKernel(GearParams p) {
  constexpr int D = EPL * 32;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const DType* src = static_cast<const DType*>(p.k > 0 ? p.xc : p.x);
  for (int64_t r = warp; r < p.N * p.T; r += nwarps) {
    float xv[EPL], dq[EPL];
    quant::load_row_slice<DType, EPL>(src + r * D, lane, xv);
    gear_dequant_slice<EPL, BITS>(p.q, r, lane, dq);
    quant::VecT<uint16_t, EPL> o;
#pragma unroll
    for (int i = 0; i < EPL; ++i) {
      const float d = xv[i] - dq[i];  // non-finite (check_finite=False) -> 0, as on the CPU
      o.v[i] = __half_as_ushort(__float2half_rn(isfinite(d) ? d : 0.f));
    }
    reinterpret_cast<quant::VecT<uint16_t, EPL>*>(p.resid + r * D)[lane] = o;
  }
}

/// \brief resid = 0 at every outlier position (one thread per stored outlier).
template <typename IdType>
__global__ void GearZeroOutliersKernel(GearParams p) {
  const IdType* idx = static_cast<const IdType*>(p.oindices);
  const int64_t V = p.per_channel ? p.D : p.T, total = p.N * V * 2 * p.k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t vv = i / (2 * p.k);
    p.resid[vec_offset(p, vv / V, vv % V, (int64_t)idx[i])] = 0;
  }
}

/// \brief out = dequant(codes) + A B^T, one warp per token row (B of the matrix via L1).
template <typename DType, int EPL, int BITS>
__global__ void GearDecompressKernel(GearParams p) {
  constexpr int D = EPL * 32;
  const int lane = threadIdx.x & 31;
  const int64_t warp = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) >> 5;
  const int64_t nwarps = ((int64_t)gridDim.x * blockDim.x) >> 5;
  const int r = p.rank;
  DType* out = static_cast<DType*>(p.out);
  for (int64_t row = warp; row < p.N * p.T; row += nwarps) {
    float v[EPL];
    gear_dequant_slice<EPL, BITS>(p.q, row, lane, v);
    if (r > 0) {
      const int64_t n = row / p.T;
      float a[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) a[i] = i < r ? half_bits_to_float(p.A[row * r + i]) : 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) {
        const uint16_t* b = p.B + (n * D + lane * EPL + e) * r;
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < r) v[e] += a[i] * half_bits_to_float(b[i]);
      }
    }
    quant::store_row_slice<DType, EPL>(out + row * D, lane, v);
  }
}

/// \brief out[outlier position] = stored value (runs after GearDecompressKernel).
template <typename DType, typename IdType>
__global__ void GearScatterOutliersKernel(GearParams p) {
  const IdType* idx = static_cast<const IdType*>(p.oindices);
  const DType* val = static_cast<const DType*>(p.ovalues);
  DType* out = static_cast<DType*>(p.out);
  const int64_t V = p.per_channel ? p.D : p.T, total = p.N * V * 2 * p.k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t vv = i / (2 * p.k);
    const int64_t j = (int64_t)idx[i];
    if (j < 0 || j >= (p.per_channel ? p.T : p.D)) continue;  // never write out of bounds
    out[vec_offset(p, vv / V, vv % V, j)] = val[i];
  }
}

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------
template <typename DType>
cudaError_t GearClamp(const GearParams& p, cudaStream_t stream) {
  const int64_t total = p.N * p.T * p.D / (16 / sizeof(DType));
  if (total == 0) return cudaSuccess;
  GearClampKernel<DType><<<gear_grid(total, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename DType, int EPL, int BITS>
cudaError_t GearResidual(const GearParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  GearResidualKernel<DType, EPL, BITS><<<gear_grid(p.N * p.T * 32, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename IdType>
cudaError_t GearZeroOutliers(const GearParams& p, cudaStream_t stream) {
  const int64_t total = p.N * (p.per_channel ? p.D : p.T) * 2 * p.k;
  if (total == 0) return cudaSuccess;
  GearZeroOutliersKernel<IdType><<<gear_grid(total, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename DType, int EPL, int BITS>
cudaError_t GearDecompress(const GearParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  GearDecompressKernel<DType, EPL, BITS><<<gear_grid(p.N * p.T * 32, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

template <typename DType, typename IdType>
cudaError_t GearScatterOutliers(const GearParams& p, cudaStream_t stream) {
  const int64_t total = p.N * (p.per_channel ? p.D : p.T) * 2 * p.k;
  if (total == 0) return cudaSuccess;
  GearScatterOutliersKernel<DType, IdType><<<gear_grid(total, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace gear
}  // namespace kvq
