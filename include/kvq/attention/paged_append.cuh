// The token write of kvq.paged_append on CUDA (PagedWriteParams in paged_decode_attention.h):
// one grid-stride kernel copies every (token, head) row of keys and values into its page slot,
// 16 bytes per thread where every row is 16-byte aligned, one element per thread otherwise.
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "kvq/attention/paged_decode_attention.h"

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

}  // namespace attention
}  // namespace kvq
