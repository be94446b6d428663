// Decode-attention entry points: split planning, the generic (CUDA-core) instantiations,
// and dispatch to the tensor-core instantiations in decode_attention_mma_kernels.cu.in (one generated file per code width).
#include "kvq/attention/decode_attention.cuh"
#include "kvq/cuda_api.h"
#include "kvq/quant/group_quant.cuh"

namespace kvq {
namespace attention {

cudaError_t decode_attention_mma_b2(const DecodeAttnParams&, const SplitPlan&, DTypeId, cudaStream_t);
cudaError_t decode_attention_mma_b4(const DecodeAttnParams&, const SplitPlan&, DTypeId, cudaStream_t);
cudaError_t decode_attention_mma_b8(const DecodeAttnParams&, const SplitPlan&, DTypeId, cudaStream_t);

int decode_attention_splits(const DecodeAttnParams& p) {
  return decode_attention_plan(p, quant::num_sms()).splits();
}

cudaError_t decode_attention_cuda(const DecodeAttnParams& p, DTypeId dtype, cudaStream_t stream) {
  const SplitPlan plan = decode_attention_plan(p, quant::num_sms());
  if (plan.splits() != p.splits) return cudaErrorInvalidValue;
  if (plan.ns_main > 0) {
    switch (p.k.bits) {
      case 2: return decode_attention_mma_b2(p, plan, dtype, stream);
      case 4: return decode_attention_mma_b4(p, plan, dtype, stream);
      case 8: return decode_attention_mma_b8(p, plan, dtype, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    switch (p.D) {
      case 32: return LaunchDecodeAttention<DType, 32, 2, true, false, false>(p, plan, stream);
      case 64: return LaunchDecodeAttention<DType, 64, 2, true, false, false>(p, plan, stream);
      case 128: return LaunchDecodeAttention<DType, 128, 2, true, false, false>(p, plan, stream);
      case 256: return LaunchDecodeAttention<DType, 256, 2, true, false, false>(p, plan, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace attention
}  // namespace kvq
