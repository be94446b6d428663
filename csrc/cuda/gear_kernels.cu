// Instantiations of the GEAR glue kernels (torch-free; nvcc, C++17).
#include "kvq/cuda_api.h"
#include "kvq/gear/gear.cuh"

namespace kvq {
namespace gear {

cudaError_t gear_compress_small_cuda_f32(const GearSmallParams& p, cudaStream_t stream);
cudaError_t gear_compress_small_cuda_f16(const GearSmallParams& p, cudaStream_t stream);
cudaError_t gear_compress_small_cuda_bf16(const GearSmallParams& p, cudaStream_t stream);

cudaError_t gear_compress_small_cuda(const GearSmallParams& p, DTypeId dtype, cudaStream_t stream) {
  switch (dtype) {
    case DTypeId::kFloat32: return gear_compress_small_cuda_f32(p, stream);
    case DTypeId::kFloat16: return gear_compress_small_cuda_f16(p, stream);
    case DTypeId::kBFloat16: return gear_compress_small_cuda_bf16(p, stream);
    default: KVQ_THROW("kvq: unsupported dtype id ", (int)dtype);
  }
}

cudaError_t gear_group_bounds_cuda(const GearParams& p, DTypeId dtype, int index_bytes,
                                   cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_INDEX_BYTES(index_bytes, IdType, [&] { return GearGroupBounds<DType, IdType>(p, stream); });
  });
}

cudaError_t gear_clamp_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] { return GearClamp<DType>(p, stream); });
}

cudaError_t gear_clamp_quant_resid_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] { return GearClampQuantResid<DType>(p, stream); });
}

cudaError_t gear_residual_cuda(const GearParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_BITS(p.q.bits, BITS, [&] {
      return KVQ_DISPATCH_HEAD_DIM_EPL(p.D, EPL, [&] {
        return GearResidual<DType, EPL, BITS>(p, stream);
      });
    });
  });
}

cudaError_t gear_zero_outliers_cuda(const GearParams& p, int index_bytes, cudaStream_t stream) {
  return KVQ_DISPATCH_INDEX_BYTES(index_bytes, IdType, [&] {
    return GearZeroOutliers<IdType>(p, stream);
  });
}

cudaError_t gear_decompress_cuda(const GearParams& p, DTypeId dtype, int index_bytes,
                                 cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    cudaError_t err = KVQ_DISPATCH_BITS(p.q.bits, BITS, [&] {
      return KVQ_DISPATCH_HEAD_DIM_EPL(p.D, EPL, [&] {
        return GearDecompress<DType, EPL, BITS>(p, stream);
      });
    });
    if (err != cudaSuccess || p.k == 0) return err;
    return KVQ_DISPATCH_INDEX_BYTES(index_bytes, IdType, [&] {
      return GearScatterOutliers<DType, IdType>(p, stream);
    });
  });
}

}  // namespace gear
}  // namespace kvq
