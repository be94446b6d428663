// kvq.paged_append on CUDA (PagedWriteParams, PagedCompressParams in paged_decode_attention.h):
// the token write, one grid-stride kernel that copies every (token, head) row of keys and values
// into its page slot, 16 bytes per thread where every row is 16-byte aligned, one element per
// thread otherwise; then the page compression, one CTA per (pair, head, role) that
// group-quantizes a full-precision page straight into its compressed page (no gather, no
// scatter: one launch for every pair of both roles).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/attention/paged_decode_attention.h"
#include "kvq/common/half.h"
#include "kvq/quant/group_quant.h"

namespace kvq {
namespace attention {

template <typename VEC>
__global__ void PagedWriteRowsKernel(PagedWriteParams p) {
  const int64_t chunks = p.D * p.elem_bytes / (int64_t)sizeof(VEC);  // VEC units per row
  const int64_t per_role = p.N * p.H * chunks;
  const int64_t P = int64_t(1) << p.page_shift;
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < 2 * per_role;
       i += (int64_t)gridDim.x * blockDim.x) {
    const bool value = i >= per_role;
    const int64_t j = value ? i - per_role : i;
    const int64_t c = j % chunks, r = j / chunks;
    const int64_t h = r % p.H, n = r / p.H;
    const int64_t slot = p.slots[n];
    if (slot < 0 || (slot >> p.page_shift) >= p.pages) continue;  // padding / outside the pool
    const int64_t page = slot >> p.page_shift, row = slot & (P - 1);
    const char* src = static_cast<const char*>(value ? p.v : p.k) +
                      (n * (value ? p.v_sn : p.k_sn) + h * (value ? p.v_sh : p.k_sh)) * p.elem_bytes;
    char* dst = static_cast<char*>(value ? p.v_fp : p.k_fp) + ((page * p.H + h) * P + row) * p.D * p.elem_bytes;
    reinterpret_cast<VEC*>(dst)[c] = reinterpret_cast<const VEC*>(src)[c];
  }
}

template <typename VEC>
cudaError_t LaunchPagedWriteRows(const PagedWriteParams& p, cudaStream_t stream) {
  const int64_t work = 2 * p.N * p.H * (p.D * p.elem_bytes / (int64_t)sizeof(VEC));
  if (work == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int64_t blocks = (work + kThreads - 1) / kThreads;
  PagedWriteRowsKernel<VEC><<<(unsigned)(blocks < 16384 ? blocks : 16384), kThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

/// Quantization parameters a compression CTA keeps in shared memory at once (zero and 1 / scale
/// of each group entry of a block of tokens).
constexpr int kCompressEntries = 2048;
constexpr int kCompressThreads = 256;

/// \brief CTA (pair m = blockIdx.x, head h = blockIdx.y, role blockIdx.z) quantizes page src[m]
/// of the role into page dst[m] (skipped when dst[m] is the scratch page 0 or a pair lies outside
/// the pools), in blocks of tokens: per channel one group of G tokens at a time (D entries), per
/// token as many tokens as kCompressEntries entries allow.  Pass 1: thread per entry, min / max
/// over its group, make_qparams (scale / zero stored); pass 2: thread per 32-bit word of codes,
/// quant_code of its 32 / BITS channels.  The arithmetic is group_quantize_cpu's, so the pages
/// equal the CPU twin's bit for bit.
template <typename DType, int BITS>
__global__ void __launch_bounds__(kCompressThreads) PagedCompressKernel(PagedCompressParams p) {
  const int64_t m = blockIdx.x, h = blockIdx.y;
  const int64_t src = p.src[m], dst = p.dst[m];
  if (dst <= 0 || dst >= p.comp_pages || src < 0 || src >= p.fp_pages) return;  // uniform per CTA
  __shared__ float s_zero[kCompressEntries], s_inv[kCompressEntries];
  const PagedCompressRole r = blockIdx.z == 0 ? p.role[0] : p.role[1];
  const int64_t P = p.P, D = p.D, G = r.group;
  constexpr int CPW = 32 / BITS;
  constexpr float MAXQ = (float)((1 << BITS) - 1);
  const int64_t W = D / CPW, nq = paged_compress_qparams(p, r);
  const DType* x = static_cast<const DType*>(r.fp) + (src * p.H + h) * P * D;
  int32_t* codes = r.codes + (dst * p.H + h) * P * W;
  uint16_t* scale = r.scale + (dst * p.H + h) * nq;
  uint16_t* zero = r.zero + (dst * p.H + h) * nq;
  const int64_t per_tok = r.per_channel ? 0 : D / G;  // entries per token (per-token groups)
  int64_t tb = r.per_channel ? G : kCompressEntries / per_tok;
  if (tb > P) tb = P;
  for (int64_t t0 = 0; t0 < P; t0 += tb) {
    const int64_t ne = r.per_channel ? D : tb * per_tok;
    for (int64_t e = threadIdx.x; e < ne; e += blockDim.x) {
      // entry e: channel e of the group (per channel), group e % per_tok of token t0 + e / per_tok
      const DType* v = r.per_channel ? x + t0 * D + e : x + (t0 + e / per_tok) * D + (e % per_tok) * G;
      const int64_t step = r.per_channel ? D : 1;
      float mn = INFINITY, mx = -INFINITY;
      for (int64_t j = 0; j < G; ++j) {
        const float f = to_float(v[j * step]);
        mn = fminf(mn, f);
        mx = fmaxf(mx, f);
      }
      const quant::QParams q = quant::make_qparams(mn, mx, BITS);
      const int64_t out = r.per_channel ? t0 / G * D + e : t0 * per_tok + e;
      scale[out] = q.s16;
      zero[out] = q.z16;
      s_zero[e] = q.zero;
      s_inv[e] = q.inv;
    }
    __syncthreads();
    for (int64_t i = threadIdx.x; i < tb * W; i += blockDim.x) {
      const int64_t t = t0 + i / W, c0 = (i % W) * CPW;
      const DType* row = x + t * D + c0;
      uint32_t word = 0;
#pragma unroll
      for (int j = 0; j < CPW; ++j) {
        const int64_t c = c0 + j, e = r.per_channel ? c : (t - t0) * per_tok + c / G;
        word |= quant::quant_code(to_float(row[j]), s_zero[e], s_inv[e], MAXQ) << (j * BITS);
      }
      codes[t * W + i % W] = (int32_t)word;
    }
    __syncthreads();
  }
}

template <typename DType, int BITS>
cudaError_t LaunchPagedCompress(const PagedCompressParams& p, cudaStream_t stream) {
  if (p.M == 0 || p.H == 0) return cudaSuccess;
  if (p.M > 2147483647 || p.H > 65535) return cudaErrorInvalidValue;
  PagedCompressKernel<DType, BITS><<<dim3((unsigned)p.M, (unsigned)p.H, 2), kCompressThreads, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace attention
}  // namespace kvq
