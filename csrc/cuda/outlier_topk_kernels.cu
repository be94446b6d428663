// Instantiations of the per-vector top/bottom-k selection kernels (torch-free; nvcc, C++17).
#include "kvq/cuda_api.h"
#include "kvq/select/outlier_topk.cuh"

namespace kvq {
namespace select {

cudaError_t outlier_select_cuda(const OutlierSelectParams& p, DTypeId dtype, int index_bytes,
                                cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_INDEX_BYTES(index_bytes, IdType, [&] {
      return OutlierSelect<DType, IdType>(p, stream);
    });
  });
}

}  // namespace select
}  // namespace kvq
