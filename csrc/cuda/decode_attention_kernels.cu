// Decode-attention entry points: split planning (sized by the occupancy of the kernel that
// will run), the generic (CUDA-core) instantiations, and dispatch to the tensor-core
// instantiations generated from decode_attention_mma_kernels.cu.in (one file per code width).
#include "kvq/attention/decode_attention.cuh"
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

#define KVQ_GENERIC_DISPATCH(EXPR)                 \
  switch (p.D) {                                   \
    case 32: return EXPR(32);                      \
    case 64: return EXPR(64);                      \
    case 128: return EXPR(128);                    \
    case 256: return EXPR(256);                    \
    default: return EXPR(0);                       \
  }

static int occupancy(const DecodeAttnParams& p, DTypeId dtype) {
  if (decode_attention_mma_ok(p)) {
    switch (p.k.bits) {
      case 2: return decode_attention_mma_occupancy_b2(p, dtype);
      case 4: return decode_attention_mma_occupancy_b4(p, dtype);
      case 8: return decode_attention_mma_occupancy_b8(p, dtype);
      default: return 0;
    }
  }
  const int g = (int)(p.Hq / p.H);
#define KVQ_OCC(D) (D == 0 ? 0 : DecodeAttentionOccupancy<DType, (D == 0 ? 32 : D), 2, true, false>(g))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> int { KVQ_GENERIC_DISPATCH(KVQ_OCC) });
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
    switch (p.k.bits) {
      case 2: return decode_attention_mma_b2(p, plan, dtype, stream);
      case 4: return decode_attention_mma_b4(p, plan, dtype, stream);
      case 8: return decode_attention_mma_b8(p, plan, dtype, stream);
      default: return cudaErrorInvalidValue;
    }
  }
#define KVQ_LAUNCH(D) \
  (D == 0 ? cudaErrorInvalidValue : LaunchDecodeAttention<DType, (D == 0 ? 32 : D), 2, true, false>(p, plan, stream))
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&]() -> cudaError_t { KVQ_GENERIC_DISPATCH(KVQ_LAUNCH) });
#undef KVQ_LAUNCH
}

}  // namespace attention
}  // namespace kvq
