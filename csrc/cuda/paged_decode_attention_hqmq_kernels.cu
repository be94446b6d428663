// Paged HQMQ decode-attention entry point: launch format, shared-memory plan and dispatch to the
// PagedHqmqAttentionKernel instantiations.  Kernels: include/kvq/attention/paged_decode_attention.cuh
// (over the HQMQ tile loops of decode_attention_hqmq.cuh).
#include "kvq/attention/paged_decode_attention.cuh"
#include "kvq/cuda_api.h"
#include "kvq/common/dispatch.h"

namespace kvq {
namespace attention {

// EXPR(D, FMT) for head dim p.D and launch format fmt: the F = 16 format (1; on the v2 layout, 3,
// at D = 64 / 128) or runtime field widths (0).  Pages hold no Med3x records, so hqmq-5's format
// (2) is not instantiated: any other width runs FMT 0.  fp16 / bf16 only (fp32: kHqmqNoMma).
#define KVQ_PAGED_HQMQ_FMT(EXPR, D, F16) \
  switch (fmt) {                         \
    case F16: return EXPR(D, F16);       \
    default: return EXPR(D, 0);          \
  }
#define KVQ_PAGED_HQMQ_DISPATCH(EXPR)          \
  switch (p.D) {                               \
    case 32: KVQ_PAGED_HQMQ_FMT(EXPR, 32, 1)   \
    case 64: KVQ_PAGED_HQMQ_FMT(EXPR, 64, 3)   \
    case 128: KVQ_PAGED_HQMQ_FMT(EXPR, 128, 3) \
    default: KVQ_PAGED_HQMQ_FMT(EXPR, 256, 1)  \
  }

cudaError_t paged_decode_attention_hqmq_cuda(const PagedHqmqParams& hp, DTypeId dtype, cudaStream_t stream) {
  const DecodeAttnParams& p = hp.base;
  if (p.paged.block_table == nullptr || p.paged.work == nullptr) return cudaErrorInvalidValue;
  if (!supported_head_dim(p.D) || p.Hq / p.H > kMaxGroup) return cudaErrorInvalidValue;
  HqmqAttnParams view = paged_hqmq_view(hp);
  if (dtype == DTypeId::kFloat32) {  // fp32 caches: exact fp32 decode on the CUDA-core loop
    view.Tc = 0;                     // (no tensor-core layout)
    const HqmqSmem sm = hqmq_smem_plan(view);
#define KVQ_LAUNCH(D) \
  (D == 0 ? cudaErrorInvalidValue : LaunchPagedHqmqAttention<float, (D == 0 ? 32 : D), kHqmqNoMma>(hp, sm, stream))
    KVQ_SWITCH_HEAD_DIM_OR_0(p.D, KVQ_LAUNCH)
#undef KVQ_LAUNCH
  }
  const int fmt = hqmq_launch_fmt(view);
  const HqmqSmem sm = hqmq_smem_plan(view, fmt);
#define KVQ_LAUNCH(D, FMT) LaunchPagedHqmqAttention<DType, D, FMT>(hp, sm, stream)
  switch (dtype) {
    case DTypeId::kFloat16: { using DType = half_t; KVQ_PAGED_HQMQ_DISPATCH(KVQ_LAUNCH) }
    case DTypeId::kBFloat16: { using DType = bf16_t; KVQ_PAGED_HQMQ_DISPATCH(KVQ_LAUNCH) }
    default: return cudaErrorInvalidValue;
  }
#undef KVQ_LAUNCH
}

}  // namespace attention
}  // namespace kvq
