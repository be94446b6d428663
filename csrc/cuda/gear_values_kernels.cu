// Instantiations of the fused GEAR value-side compress (include/kvq/gear/gear_values.cuh):
// fp16 / bf16 x D {64, 128, 256} x bits {2, 4, 8} x KMAX {2, 4, 8}.  Torch-free; nvcc, C++17.
#include "kvq/cuda_api.h"
#include "kvq/gear/gear_values.cuh"

namespace kvq {
namespace gear {

bool gear_values_fused_ok(const GearParams& p, DTypeId dtype) {
  return dtype != DTypeId::kFloat32 && gear_values_supported(p, 2);
}

// k <= 2 (GEAR-L, gear-2 values): the KMAX = 2 kernel (selection network, 3 CTAs per SM);
// 2 < k <= 8: KMAX = 4 / 8 (insertion lists of depth KMAX + 1).  Same outputs (gear_values.cuh).
template <typename DType, int D, int BITS>
static cudaError_t gear_values_by_k(const GearParams& p, cudaStream_t stream) {
  if (p.k <= 2) return GearValuesCompress<DType, D, BITS, 2>(p, stream);
  if (p.k <= 4) return GearValuesCompress<DType, D, BITS, 4>(p, stream);
  return GearValuesCompress<DType, D, BITS, 8>(p, stream);
}

template <typename DType>
static cudaError_t gear_values_by_dtype(const GearParams& p, cudaStream_t stream) {
  return KVQ_DISPATCH_BITS(p.q.bits, BITS, [&] {
    switch (p.D) {
      case 64: return gear_values_by_k<DType, 64, BITS>(p, stream);
      case 128: return gear_values_by_k<DType, 128, BITS>(p, stream);
      case 256: return gear_values_by_k<DType, 256, BITS>(p, stream);
      default: return cudaErrorInvalidValue;
    }
  });
}

cudaError_t gear_values_compress_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream) {
  if (!gear_values_fused_ok(p, dtype)) return cudaErrorInvalidValue;
  if (dtype == DTypeId::kFloat16) return gear_values_by_dtype<half_t>(p, stream);
  return gear_values_by_dtype<bf16_t>(p, stream);
}

}  // namespace gear
}  // namespace kvq
