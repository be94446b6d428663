// Instantiations of the fused GEAR key-side compress kernel (torch-free; nvcc, C++17).
#include "kvq/cuda_api.h"
#include "kvq/gear/gear_keys.cuh"

namespace kvq {
namespace gear {

cudaError_t gear_keys_compress_cuda(const GearParams& p, const GearKeysPlan& plan, DTypeId dtype,
                                    cudaStream_t stream) {
  return KVQ_DISPATCH_BITS(p.q.bits, BITS, [&] {
    switch (dtype) {
      case DTypeId::kFloat16: return GearKeysCompress<half_t, BITS>(p, plan, stream);
      case DTypeId::kBFloat16: return GearKeysCompress<bf16_t, BITS>(p, plan, stream);
      default: KVQ_THROW("kvq: gear_keys_compress: fp16 / bf16 only, got dtype id ", (int)dtype);
    }
  });
}

}  // namespace gear
}  // namespace kvq
