// Decode-attention entry points: split planning (sized by the occupancy of the kernel that
// will run), the generic (CUDA-core) instantiations, and dispatch to the tensor-core
// instantiations generated from decode_attention_mma_kernels.cu.in (one file per code width).
#include "kvq/attention/decode_attention.cuh"
#include "kvq/common/dispatch.h"
#include "kvq/cuda_api.h"
#include "kvq/quant/group_quant.cuh"

namespace kvq {
namespace attention {

#define KVQ_DECLARE_MMA(B)                                                                              \
  cudaError_t decode_attention_mma_b##B(const DecodeAttnParams&, const SplitPlan&, DTypeId, cudaStream_t); \
  int decode_attention_mma_occupancy_b##B(const DecodeAttnParams&, DTypeId);
KVQ_DECLARE_MMA(2)
KVQ_DECLARE_MMA(4)
KVQ_DECLARE_MMA(8)
#undef KVQ_DECLARE_MMA

static int occupancy(const DecodeAttnParams& p, DTypeId dtype) {
  if (decode_attention_mma_ok(p)) {
    KVQ_SWITCH_CODE_BITS(p.k.bits, decode_attention_mma_occupancy, 0, p, dtype)
  }
  const int g = (int)(p.Hq / p.H);
#define KVQ_OCC(D) (D == 0 ? 0 : DecodeAttentionOccupancy<DType, (D == 0 ? 32 : D), 2, true, false>(g))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> int { KVQ_SWITCH_HEAD_DIM_OR_0(p.D, KVQ_OCC) });
#undef KVQ_OCC
}

static SplitPlan plan_for(const DecodeAttnParams& p, DTypeId dtype) {
  return decode_attention_plan(p, quant::num_sms(), occupancy(p, dtype));
}

bool decode_attention_gear_cuda_ok(const DecodeAttnParams& p) { return decode_attention_mma_ok(p); }

int decode_attention_splits(const DecodeAttnParams& p, DTypeId dtype) { return plan_for(p, dtype).splits(); }

cudaError_t decode_attention_cuda(const DecodeAttnParams& p, DTypeId dtype, cudaStream_t stream) {
  const SplitPlan plan = plan_for(p, dtype);
  if (plan.splits() != p.splits) return cudaErrorInvalidValue;
  if (p.gear && plan.t_main != p.k.Tq) return cudaErrorInvalidValue;  // GEAR tokens need the mma path
  if (plan.t_main > 0) {
    KVQ_SWITCH_CODE_BITS(p.k.bits, decode_attention_mma, cudaErrorInvalidValue, p, plan, dtype, stream)
  }
#define KVQ_LAUNCH(D) \
  (D == 0 ? cudaErrorInvalidValue : LaunchDecodeAttention<DType, (D == 0 ? 32 : D), 2, true, false>(p, plan, stream))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> cudaError_t { KVQ_SWITCH_HEAD_DIM_OR_0(p.D, KVQ_LAUNCH) });
#undef KVQ_LAUNCH
}

}  // namespace attention
}  // namespace kvq
