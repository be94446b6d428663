// Fused GEAR compress for short matrices (decode blocks: T <= 256 tokens, D <= 256): ONE
// launch, one 256-thread CTA per [T, D] matrix, the matrix resident in shared memory.
// Replaces outlier select + clamp + quantize + residual + zero-outliers + power iteration
// (6 launches and the xc / resid / bounds round trips through global memory).  Torch-free.
//
// Steps (each separated by a barrier), all on the fp32 tile Rs [rows_pad, DMAX + 8]:
//   1. load x (16-byte loads), finite check of x, rows >= T zero;
//   2. outliers: one warp per vector (key channel / value token), the 64-bit composite key
//      (value, -index) of OutlierSelectWarpKernel, k + 1 rounds of a warp arg-max / arg-min;
//      values / indices written in index order and an outlier bit mask in shared;
//   3. group quantization, one thread per group: the group bounds (gear_group_bounds:
//      fminf / fmaxf over the unmasked entries in vector order), xc = the outlier fill of
//      gear_clamp_cpu (in place, rounded through DType), min/max of xc, make_qparams,
//      codes into a byte tile and, in the same loop, the residual fp16(xc - (code * scale +
//      zero)), 0 where non-finite or at an outlier, written back into Rs (as the float of
//      the fp16 value);
//   4. pack the byte codes into words (group_quant format);
//   5. linalg::pow_small_run on Rs: the same code as PowerIterSmallKernel.
// Bit-compatibility: every step uses the arithmetic of the multi-launch path (and so the
// CPU twin for outliers, scale, zero and codes); the factors equal those of the multi-launch
// CUDA path (same fp16 residual, same power-iteration code).
#pragma once
#include <cuda_runtime.h>

#include "kvq/common/half.h"
#include "kvq/gear/gear.h"
#include "kvq/linalg/power_svd.cuh"
#include "kvq/quant/group_quant.h"
#include "kvq/select/outlier_topk.cuh"

namespace kvq {
namespace gear {

constexpr int kGearSmallThreads = linalg::kPowThreads;  // 256
constexpr size_t kGearSmallSmemMax = 200 * 1024;        // >= gear_small_smem() limit

template <typename DType, int DMAX, int RB>
__global__ void __launch_bounds__(kGearSmallThreads, 1) GearCompressSmallKernel(GearSmallParams p,
                                                                             int rows_pad) {
  constexpr int STRIDE = linalg::PowerDims<DMAX>::STRIDE;
  constexpr int VEC = 16 / (int)sizeof(DType);
  constexpr unsigned FULL = 0xffffffffu;
  extern __shared__ float4 gear_small_smem_f4[];
  float* Rs = reinterpret_cast<float*>(gear_small_smem_f4);
  float* Ps = Rs + rows_pad * STRIDE;
  uint8_t* codes8 = reinterpret_cast<uint8_t*>(Ps + rows_pad * linalg::kBStride);
  uint32_t* mask = reinterpret_cast<uint32_t*>(codes8 + rows_pad * DMAX);

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int64_t n = blockIdx.x;
  const int T = (int)p.T, D = (int)p.D;
  const DType* X = static_cast<const DType*>(p.x) + n * (int64_t)T * D;

  // ---- 1. load (D is a multiple of 32, rows 16-byte aligned) + finite check
  int32_t status = 0;
  {
    const int vpr = D / VEC, total = rows_pad * vpr;
    for (int idx = tid; idx < total; idx += kGearSmallThreads) {
      const int row = idx / vpr, j = (idx - row * vpr) * VEC;
      float* dst = Rs + row * STRIDE + j;
      if (row < T) {
        const linalg::PowVec<DType, VEC> v =
            *reinterpret_cast<const linalg::PowVec<DType, VEC>*>(X + (int64_t)row * D + j);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float f = to_float(v.v[e]);
          if (p.status) status |= quant::value_status(f);
          dst[e] = f;
        }
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) dst[e] = 0.f;
      }
    }
    for (int i = tid; i < rows_pad * DMAX / 32; i += kGearSmallThreads) mask[i] = 0u;
  }
  if (p.status) {
    status = __reduce_or_sync(FULL, status);
    if (lane == 0 && status) atomicOr(p.status, status);
  }
  __syncthreads();

  // ---- 2. outliers (warp per vector)
  const int64_t k = p.k;
  if (k > 0) {
    const int V = p.per_channel ? D : T, L = p.per_channel ? T : D;
    DType* values = static_cast<DType*>(p.ovalues);
    for (int v = warp; v < V; v += kGearSmallThreads / 32) {  // warp-uniform
      uint64_t key[8];
      unsigned valid = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int j = i * 32 + lane;
        key[i] = 0;
        if (j < L) {
          const float f = p.per_channel ? Rs[j * STRIDE + v] : Rs[v * STRIDE + j];
          key[i] = select::composite_key(select::orderable_key(f), (uint32_t)j);
          valid |= 1u << i;
        }
      }
      unsigned topm = 0, botm = 0;
      uint64_t hi_key = 0, lo_key = 0;
      select::warp_select_rounds<8>(key, valid, k, L, topm, botm, hi_key, lo_key);
      const int64_t base = (n * V + v) * 2 * k;
      int pos_t = 0, pos_b = 0;
      const unsigned below = (1u << lane) - 1u;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const bool ft = (topm >> i) & 1u, fb = (botm >> i) & 1u;
        const unsigned bt = __ballot_sync(FULL, ft), bb = __ballot_sync(FULL, fb);
        const int j = i * 32 + lane;
        if (ft || fb) {
          const DType val = from_float<DType>(select::key_to_float((uint32_t)(key[i] >> 32)));
          const int64_t pos = ft ? base + pos_t + __popc(bt & below) : base + k + pos_b + __popc(bb & below);
          values[pos] = val;
          p.oindices[pos] = (uint8_t)j;
          const int bit = p.per_channel ? j * DMAX + v : v * DMAX + j;
          atomicOr(&mask[bit >> 5], 1u << (bit & 31));
        }
        pos_t += __popc(bt);
        pos_b += __popc(bb);
      }
    }
    __syncthreads();
  }

  // ---- 3. outlier fill + quantize + residual: one thread per group
  {
    const int G = (int)p.group, bits = p.bits;
    const float maxq = (float)((1 << bits) - 1);
    const int gpr = p.per_channel ? 0 : D / G;
    const int nunits = p.per_channel ? (T / G) * D : T * gpr;
    const int step = p.per_channel ? STRIDE : 1;
    for (int u = tid; u < nunits; u += kGearSmallThreads) {
      int t0, c0;
      if (p.per_channel) {
        t0 = (u / D) * G;
        c0 = u - (u / D) * D;
      } else {
        t0 = u / gpr;
        c0 = (u - t0 * gpr) * G;
      }
      const int e0 = t0 * STRIDE + c0;
      const int b0 = t0 * DMAX + c0, bstep = p.per_channel ? DMAX : 1;  // mask bits
      auto outlier = [&](int i) {
        const int bit = b0 + i * bstep;
        return ((mask[bit >> 5] >> (bit & 31)) & 1u) != 0u;
      };
      if (k > 0) {  // xc: gear_clamp_cpu with the group bounds of gear_group_bounds
        float lo = INFINITY, hi = -INFINITY;
        for (int i = 0; i < G; ++i) {
          if (outlier(i)) continue;
          const float v = Rs[e0 + i * step];
          lo = fminf(lo, v);
          hi = fmaxf(hi, v);
        }
        const bool empty = group_empty(lo, hi);
        for (int i = 0; i < G; ++i) {
          float* e = Rs + e0 + i * step;
          if (empty)
            *e = 0.f;
          else if (outlier(i))
            *e = to_float(from_float<DType>(fminf(fmaxf(*e, lo), hi)));
        }
      }
      float mn = INFINITY, mx = -INFINITY;
      for (int i = 0; i < G; ++i) {
        const float v = Rs[e0 + i * step];
        mn = fminf(mn, v);
        mx = fmaxf(mx, v);
      }
      const quant::QParams q = quant::make_qparams(mn, mx, bits);
      p.scale[n * nunits + u] = q.s16;
      p.zero[n * nunits + u] = q.z16;
      for (int i = 0; i < G; ++i) {
        const int t = p.per_channel ? t0 + i : t0, c = p.per_channel ? c0 : c0 + i;
        float* e = Rs + e0 + i * step;
        const float xv = *e;
        const uint32_t code = quant::quant_code(xv, q.zero, q.inv, maxq);
        codes8[t * DMAX + c] = (uint8_t)code;
        // NOTE: same expression as GearResidualKernel (code * scale + zero, one FMA).
        const float d = xv - __fmaf_rn((float)code, q.scale, q.zero);
        float r = __half2float(__float2half_rn(isfinite(d) ? d : 0.f));
        if (outlier(i)) r = 0.f;
        *e = r;
      }
    }
  }
  __syncthreads();

  // ---- 4. pack the codes (LSB-first words, group_quant layout)
  {
    const int bits = p.bits, cpw = 32 / bits, W = D * bits / 32;
    int32_t* codes = p.codes + n * (int64_t)T * W;
    for (int idx = tid; idx < T * W; idx += kGearSmallThreads) {
      const int t = idx / W, w = idx - t * W;
      const uint8_t* cs = codes8 + t * DMAX + w * cpw;
      uint32_t word = 0;
      for (int j = 0; j < cpw; ++j) word |= (uint32_t)cs[j] << (j * bits);
      codes[idx] = (int32_t)word;
    }
  }

  // ---- 5. low-rank factors of the residual (Rs complete after the barrier above)
  if (p.rank > 0) {
    const int r = p.rank;
    linalg::pow_small_run<half_t, DMAX, RB>(Rs, Ps, rows_pad, T, D, r, p.iters, p.seed,
                                            reinterpret_cast<half_t*>(p.A) + n * (int64_t)T * r,
                                            reinterpret_cast<half_t*>(p.B) + n * (int64_t)D * r);
  }
}

/// \brief Launch the fused compress (p.T, p.D must satisfy gear_small_smem() > 0; D a
/// multiple of 32; index type uint8).
template <typename DType, int DMAX, int RB>
cudaError_t GearCompressSmall(const GearSmallParams& p, cudaStream_t stream) {
  if (p.N == 0) return cudaSuccess;
  const size_t smem = gear_small_smem(p.T, p.D);
  if (smem == 0 || p.D > DMAX || p.D % 32 != 0 || p.N > 0x7fffffff) return cudaErrorInvalidValue;
  if (p.rank > RB || (p.rank > 0 && p.iters < 1)) return cudaErrorInvalidValue;
  static const cudaError_t attr =
      cudaFuncSetAttribute(GearCompressSmallKernel<DType, DMAX, RB>,
                           cudaFuncAttributeMaxDynamicSharedMemorySize, (int)kGearSmallSmemMax);
  if (attr != cudaSuccess) return attr;
  const int rows_pad = (int)((p.T + 31) / 32 * 32);
  GearCompressSmallKernel<DType, DMAX, RB>
      <<<(unsigned)p.N, kGearSmallThreads, smem, stream>>>(p, rows_pad);
  return cudaGetLastError();
}

}  // namespace gear
}  // namespace kvq
