// Paged KV entry points: the token write of paged_append, the plan launch, the CUDA-core
// instantiations (every token through the generic loop: fp32 caches, full-precision-only
// layers, layouts the tensor-core path does not read) and dispatch to the tensor-core
// instantiations generated from paged_decode_attention_mma_kernels.cu.in (HQMQ pages:
// paged_decode_attention_hqmq_kernels.cu).  Kernels: include/kvq/attention/paged_append.cuh and
// paged_decode_attention.cuh.
#include "kvq/attention/paged_append.cuh"
#include "kvq/attention/paged_decode_attention.cuh"
#include "kvq/cuda_api.h"
#include "kvq/common/dispatch.h"

namespace kvq {
namespace attention {

#define KVQ_DECLARE_PAGED_MMA(B)                                                                   \
  cudaError_t paged_decode_attention_mma_b##B(const DecodeAttnParams&, DTypeId, cudaStream_t);
KVQ_DECLARE_PAGED_MMA(2)
KVQ_DECLARE_PAGED_MMA(4)
KVQ_DECLARE_PAGED_MMA(8)
#undef KVQ_DECLARE_PAGED_MMA

bool paged_decode_attention_mma_ok(const DecodeAttnParams& p, DTypeId dtype) {
  if (!(dtype == DTypeId::kFloat16 || dtype == DTypeId::kBFloat16)) return false;
  if (p.k.codes == nullptr || p.v.codes == nullptr) return false;  // no compressed pool
  if (p.paged.page_shift < 5) return false;  // pages of whole 32-token tiles
  if (p.k.per_channel && ((int64_t(1) << p.paged.page_shift) % p.k.group) != 0) return false;
  return decode_attention_mma_ok(p);
}

/// fp16 full-precision pages on the tensor cores: fp16 caches without a compressed pool, the
/// query heads of a KV head within the 8 mma columns, 16-byte aligned page rows.
static bool paged_fp_tiles_ok(const DecodeAttnParams& p, DTypeId dtype) {
  return dtype == DTypeId::kFloat16 && p.k.codes == nullptr && (p.D == 64 || p.D == 128 || p.D == 256) &&
         p.Hq / p.H <= 8 && p.paged.page_shift >= 5 && aligned16(p.k.residual, p.k.res_sb, p.k.res_sh, 2) &&
         aligned16(p.v.residual, p.v.res_sb, p.v.res_sh, 2);
}

#define KVQ_PAGED_FPT(EXPR)              \
  switch (p.D) {                         \
    case 64: return EXPR(64);            \
    case 128: return EXPR(128);          \
    default: return EXPR(256);           \
  }

cudaError_t paged_decode_plan_cuda(const int32_t* seq_lens, const int32_t* comp_lens, int64_t num_seqs,
                                   int64_t max_items, int32_t* work, cudaStream_t stream) {
  if (max_items < paged_min_items(num_seqs)) return cudaErrorInvalidValue;
  return LaunchPagedDecodePlan(seq_lens, comp_lens, num_seqs, max_items, work, stream);
}

static bool aligned16_rows(const void* base, int64_t sn, int64_t sh, int64_t elem) {
  return reinterpret_cast<uintptr_t>(base) % 16 == 0 && (sn * elem) % 16 == 0 && (sh * elem) % 16 == 0;
}

cudaError_t paged_write_rows_cuda(const PagedWriteParams& p, cudaStream_t stream) {
  if (p.elem_bytes != 2 && p.elem_bytes != 4) return cudaErrorInvalidValue;
  const int64_t e = p.elem_bytes;
  if ((p.D * e) % 16 == 0 && aligned16_rows(p.k, p.k_sn, p.k_sh, e) && aligned16_rows(p.v, p.v_sn, p.v_sh, e) &&
      reinterpret_cast<uintptr_t>(p.k_fp) % 16 == 0 && reinterpret_cast<uintptr_t>(p.v_fp) % 16 == 0)
    return LaunchPagedWriteRows<uint4>(p, stream);
  return e == 2 ? LaunchPagedWriteRows<uint16_t>(p, stream) : LaunchPagedWriteRows<uint32_t>(p, stream);
}

cudaError_t paged_compress_cuda(const PagedCompressParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> cudaError_t {
    return KVQ_DISPATCH_BITS(p.bits, BITS,
                             [&]() -> cudaError_t { return LaunchPagedCompress<DType, BITS>(p, stream); });
  });
}

cudaError_t paged_decode_attention_cuda(const DecodeAttnParams& p, DTypeId dtype, cudaStream_t stream) {
  if (p.paged.block_table == nullptr || p.paged.work == nullptr) return cudaErrorInvalidValue;
  if (paged_decode_attention_mma_ok(p, dtype)) {
    KVQ_SWITCH_CODE_BITS(p.k.bits, paged_decode_attention_mma, cudaErrorInvalidValue, p, dtype, stream)
  }
  if (paged_fp_tiles_ok(p, dtype)) {
#define KVQ_LAUNCH_FPT(D) LaunchPagedDecodeAttention<half_t, D, 2, true, false, 0, true>(p, stream)
    KVQ_PAGED_FPT(KVQ_LAUNCH_FPT)
#undef KVQ_LAUNCH_FPT
  }
#define KVQ_LAUNCH(D) \
  (D == 0 ? cudaErrorInvalidValue : LaunchPagedDecodeAttention<DType, (D == 0 ? 32 : D), 2, true, false>(p, stream))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> cudaError_t { KVQ_SWITCH_HEAD_DIM_OR_0(p.D, KVQ_LAUNCH) });
#undef KVQ_LAUNCH
}

}  // namespace attention
}  // namespace kvq
