// Batched power iteration: dtype dispatch to the per-dtype instantiations generated from
// power_svd_dtype_kernels.cu.in (torch-free; nvcc, C++17).
#include "kvq/cuda_api.h"
#include "kvq/linalg/power_svd.cuh"

namespace kvq {
namespace linalg {

cudaError_t power_iter_cuda_f32(const PowerIterParams& p, cudaStream_t stream);
cudaError_t power_iter_cuda_f16(const PowerIterParams& p, cudaStream_t stream);
cudaError_t power_iter_cuda_bf16(const PowerIterParams& p, cudaStream_t stream);

cudaError_t power_iter_cuda(const PowerIterParams& p, DTypeId dtype, cudaStream_t stream) {
  if (p.rank < 1 || p.rank > kMaxRank) KVQ_THROW("kvq: rank must be 1..8, got ", p.rank);
  switch (dtype) {
    case DTypeId::kFloat32: return power_iter_cuda_f32(p, stream);
    case DTypeId::kFloat16: return power_iter_cuda_f16(p, stream);
    case DTypeId::kBFloat16: return power_iter_cuda_bf16(p, stream);
    default: KVQ_THROW("kvq: unsupported dtype id ", (int)dtype);
  }
}

}  // namespace linalg
}  // namespace kvq
