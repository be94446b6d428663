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

/// \brief gbounds of every group (gear_group_bounds, as the CPU twin).  One thread per group
/// (per-channel groups: consecutive threads = consecutive channels, coalesced).
template <typename DType>
__global__ void GearGroupBoundsKernel(GearParams p) {
  const int64_t total = num_groups(p);
  for (int64_t u = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; u < total;
       u += (int64_t)gridDim.x * blockDim.x)
    gear_group_bounds<DType>(p, u);
}

/// \brief xc of element e (row, c) with value v (gear_clamp_cpu): x at inliers, the clamp
/// into the group's bounds at outliers, +0 in an empty group; as a float of DType.
template <typename DType>
__device__ __forceinline__ float gear_fill(const GearParams& p, int64_t e, int64_t row, int64_t c, float v) {
  const float* b = p.gbounds + 2 * group_index(p, row, c);
  const float lo = b[0];
  if (lo != lo) return 0.f;
  if (!p.omask[e]) return v;
  return to_float(from_float<DType>(fminf(fmaxf(v, lo), b[1])));
}

/// \brief xc (gear_fill), plus the finite check of x.  One thread per 16 bytes of a row
/// (VEC consecutive elements; D is a multiple of 8 on this path).
template <typename DType>
__global__ void GearClampKernel(GearParams p) {
  constexpr int VEC = 16 / sizeof(DType);
  const DType* x = static_cast<const DType*>(p.x);
  DType* xc = static_cast<DType*>(p.xc);
  const int64_t total = p.N * p.T * p.D / VEC;
  int32_t status = 0;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t e0 = i * VEC, row = e0 / p.D, c0 = e0 - row * p.D;
    quant::VecT<DType, VEC> in = reinterpret_cast<const quant::VecT<DType, VEC>*>(x)[i], o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const float v = to_float(in.v[e]);
      if (p.status) status |= quant::value_status(v);
      o.v[e] = from_float<DType>(gear_fill<DType>(p, e0 + e, row, c0 + e, v));
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

/// \brief Long-matrix path, one launch for steps 2-4 of the recipe: a CTA loads a tile of
/// `rows` token rows of x (one per-channel group, or 64 rows for per-token groups) into
/// shared memory as floats (finite check of x), fills the outliers within their groups (k > 0;
/// gear_fill, as GearClampKernel), quantizes every group of the tile
/// (quant::make_qparams / quant_code: the arithmetic of group_quant, so codes, scale and
/// zero equal kvq.quantize of the filled x), writes the packed codes and the fp16 residual
/// xc - (code * scale + zero) (0 where non-finite; outliers are zeroed afterwards by
/// GearSetOutliersKernel).  Replaces GearClamp + group quantize + GearResidual: x is read
/// once instead of xc being written and read twice.  grid (ceil(T / rows), N), 256 threads.
template <typename DType>
__global__ void __launch_bounds__(256) GearClampQuantResidKernel(GearParams p, int rows) {
  constexpr int VEC = 16 / sizeof(DType);
  extern __shared__ float4 gear_cqr_smem_f4[];
  const int D = (int)p.D, G = (int)p.q.group, bits = p.q.bits;
  float* Rs = reinterpret_cast<float*>(gear_cqr_smem_f4);  // [rows, D]
  uint8_t* codes8 = reinterpret_cast<uint8_t*>(Rs + rows * D);
  const int tid = threadIdx.x;
  const int64_t n = blockIdx.y, t0 = (int64_t)blockIdx.x * rows;
  const int nr = (int)(p.T - t0 < rows ? p.T - t0 : rows);  // rows of this tile
  const DType* x = static_cast<const DType*>(p.x) + (n * p.T + t0) * D;
  int32_t status = 0;
  const int vpr = D / VEC;
  for (int idx = tid; idx < nr * vpr; idx += 256) {
    const int r = idx / vpr, c0 = (idx - r * vpr) * VEC;
    const quant::VecT<DType, VEC> in = reinterpret_cast<const quant::VecT<DType, VEC>*>(x + (int64_t)r * D)[c0 / VEC];
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      float v = to_float(in.v[e]);
      if (p.status) status |= quant::value_status(v);
      if (p.k > 0) {
        const int64_t row = n * p.T + t0 + r;
        v = gear_fill<DType>(p, row * D + c0 + e, row, c0 + e, v);
      }
      Rs[r * D + c0 + e] = v;
    }
  }
  if (p.status) {
    status = __reduce_or_sync(0xffffffffu, status);
    if ((tid & 31) == 0 && status) atomicOr(p.status, status);
  }
  __syncthreads();
  const float maxq = (float)((1 << bits) - 1);
  if (p.per_channel) {
    // The tile is one group: thread c owns channel c (column reads are conflict-free).
    for (int c = tid; c < D; c += 256) {
      float mn = INFINITY, mx = -INFINITY;
      for (int r = 0; r < G; ++r) {
        const float v = Rs[r * D + c];
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
      }
      const quant::QParams q = quant::make_qparams(mn, mx, bits);
      const int64_t si = (n * (p.T / G) + t0 / G) * D + c;
      p.q.scale[si] = q.s16;
      p.q.zero[si] = q.z16;
      for (int r = 0; r < G; ++r) {
        const float xv = Rs[r * D + c];
        const uint32_t code = quant::quant_code(xv, q.zero, q.inv, maxq);
        codes8[r * D + c] = (uint8_t)code;
        // NOTE: code * scale + zero as one FMA, as GearResidualKernel (gear_dequant_slice).
        const float d = xv - __fmaf_rn((float)code, q.scale, q.zero);
        Rs[r * D + c] = isfinite(d) ? d : 0.f;
      }
    }
  } else {
    // One warp per token row, lane l holds channels i * 32 + l; group min / max by xor
    // shuffles within min(G, 32) lanes, then across the G / 32 slices of a wider group.
    const int lane = tid & 31, warp = tid >> 5, nsl = D / 32, gpr = D / G;
    for (int r = warp; r < nr; r += 8) {
      float v[8], mn[8], mx[8];
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        v[i] = i < nsl ? Rs[r * D + i * 32 + lane] : 0.f;
        mn[i] = v[i];
        mx[i] = v[i];
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          if (o < G) {
            mn[i] = fminf(mn[i], __shfl_xor_sync(0xffffffffu, mn[i], o));
            mx[i] = fmaxf(mx[i], __shfl_xor_sync(0xffffffffu, mx[i], o));
          }
        }
      }
#pragma unroll
      for (int sl = 1; sl < 8; sl <<= 1) {
        if (sl * 32 < G) {  // slices i and i ^ sl belong to the same group
          float tn[8], tx[8];
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            tn[i] = fminf(mn[i], mn[i ^ sl]);
            tx[i] = fmaxf(mx[i], mx[i ^ sl]);
          }
#pragma unroll
          for (int i = 0; i < 8; ++i) {
            mn[i] = tn[i];
            mx[i] = tx[i];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        if (i < nsl) {
          const int c = i * 32 + lane;
          const quant::QParams q = quant::make_qparams(mn[i], mx[i], bits);
          if (c % G == 0) {
            const int64_t si = (n * p.T + t0 + r) * gpr + c / G;
            p.q.scale[si] = q.s16;
            p.q.zero[si] = q.z16;
          }
          const uint32_t code = quant::quant_code(v[i], q.zero, q.inv, maxq);
          codes8[r * D + c] = (uint8_t)code;
          const float d = v[i] - __fmaf_rn((float)code, q.scale, q.zero);
          Rs[r * D + c] = isfinite(d) ? d : 0.f;
        }
      }
    }
  }
  __syncthreads();
  // residual rows (fp16, 16-byte stores) and packed codes
  uint16_t* resid = p.resid + (n * p.T + t0) * D;
  for (int idx = tid; idx < nr * (D / 8); idx += 256) {
    const int r = idx / (D / 8), c0 = (idx - r * (D / 8)) * 8;
    quant::VecT<uint16_t, 8> o;
#pragma unroll
    for (int e = 0; e < 8; ++e) o.v[e] = __half_as_ushort(__float2half_rn(Rs[r * D + c0 + e]));
    reinterpret_cast<quant::VecT<uint16_t, 8>*>(resid + (int64_t)r * D)[c0 / 8] = o;
  }
  const int cpw = 32 / bits, W = D * bits / 32;
  int32_t* codes = p.q.codes + (n * p.T + t0) * W;
  for (int idx = tid; idx < nr * W; idx += 256) {
    const int r = idx / W, w = idx - r * W;
    const uint8_t* cs = codes8 + r * D + w * cpw;
    uint32_t word = 0;
    for (int j = 0; j < cpw; ++j) word |= (uint32_t)cs[j] << (j * bits);
    codes[idx] = (int32_t)word;
  }
}

/// \brief dst[position] = val at every stored outlier position (one thread per stored
/// outlier): the residual's zeros (resid, 0) and the outlier mask (omask, 1).
template <typename IdType, typename T>
__global__ void GearSetOutliersKernel(GearParams p, T* dst, T val) {
  const IdType* idx = static_cast<const IdType*>(p.oindices);
  const int64_t V = p.per_channel ? p.D : p.T, total = p.N * V * 2 * p.k;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total;
       i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t vv = i / (2 * p.k);
    dst[vec_offset(p, vv / V, vv % V, (int64_t)idx[i])] = val;
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
/// \brief omask + gbounds (p.omask zeroed by the caller; k > 0).
template <typename DType, typename IdType>
cudaError_t GearGroupBounds(const GearParams& p, cudaStream_t stream) {
  const int64_t total = p.N * (p.per_channel ? p.D : p.T) * 2 * p.k;
  if (total > 0)
    GearSetOutliersKernel<IdType, uint8_t><<<gear_grid(total, 256), 256, 0, stream>>>(p, p.omask, (uint8_t)1);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  const int64_t groups = num_groups(p);
  if (groups > 0) GearGroupBoundsKernel<DType><<<gear_grid(groups, 256), 256, 0, stream>>>(p);
  return cudaGetLastError();
}

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

template <typename DType>
cudaError_t GearClampQuantResid(const GearParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  const int rows = gear_cqr_rows(p.T, p.D, p.q.group, p.per_channel);
  if (rows == 0 || p.N > 65535 || (p.per_channel && p.T % rows != 0)) return cudaErrorInvalidValue;
  static const cudaError_t attr = cudaFuncSetAttribute(
      GearClampQuantResidKernel<DType>, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024);
  if (attr != cudaSuccess) return attr;
  const dim3 grid((unsigned)((p.T + rows - 1) / rows), (unsigned)p.N);
  GearClampQuantResidKernel<DType><<<grid, 256, gear_cqr_smem(rows, p.D), stream>>>(p, rows);
  return cudaGetLastError();
}

template <typename IdType>
cudaError_t GearZeroOutliers(const GearParams& p, cudaStream_t stream) {
  const int64_t total = p.N * (p.per_channel ? p.D : p.T) * 2 * p.k;
  if (total == 0) return cudaSuccess;
  GearSetOutliersKernel<IdType, uint16_t><<<gear_grid(total, 256), 256, 0, stream>>>(p, p.resid, (uint16_t)0);
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
