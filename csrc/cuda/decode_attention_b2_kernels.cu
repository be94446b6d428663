// Tensor-core decode-attention instantiations for 2-bit caches (one file per code
// width so the builds run in parallel).  Torch-free; nvcc, C++17.
#include "kvq/attention/decode_attention.cuh"
#include "kvq/common/dispatch.h"

namespace kvq {
namespace attention {

cudaError_t decode_attention_mma_b2(const DecodeAttnParams& p, const SplitPlan& plan, DTypeId dtype,
                                     cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    switch (p.D) {
      case 64: return p.k.per_channel ? LaunchDecodeAttention<DType, 64, 2, true, false, true>(p, plan, stream)
                                      : LaunchDecodeAttention<DType, 64, 2, false, false, true>(p, plan, stream);
      case 128: return p.k.per_channel ? LaunchDecodeAttention<DType, 128, 2, true, false, true>(p, plan, stream)
                                       : LaunchDecodeAttention<DType, 128, 2, false, false, true>(p, plan, stream);
      case 256: return p.k.per_channel ? LaunchDecodeAttention<DType, 256, 2, true, false, true>(p, plan, stream)
                                       : LaunchDecodeAttention<DType, 256, 2, false, false, true>(p, plan, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

}  // namespace attention
}  // namespace kvq
