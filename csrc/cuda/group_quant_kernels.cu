// Instantiations of the group quantize/dequantize kernels (torch-free; nvcc, C++17).
#include "kvq/cuda_api.h"
#include "kvq/quant/group_quant.cuh"

namespace kvq {
namespace quant {

cudaError_t group_quantize_cuda(const GroupQuantParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_BITS(p.bits, BITS, [&] {
      return KVQ_DISPATCH_HEAD_DIM_EPL(p.D, EPL, [&] {
        return GroupQuantize<DType, EPL, BITS>(p, stream);
      });
    });
  });
}

int64_t group_quantize_ws_floats(const GroupQuantParams& p, DTypeId dtype) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_HEAD_DIM_EPL(p.D, EPL,
                                     [&] { return GroupQuantizeWsFloats<DType, EPL>(p); });
  });
}

cudaError_t group_dequantize_cuda(const GroupQuantParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_BITS(p.bits, BITS, [&] {
      return KVQ_DISPATCH_HEAD_DIM_EPL(p.D, EPL, [&] {
        return GroupDequantize<DType, EPL, BITS>(p, stream);
      });
    });
  });
}

}  // namespace quant
}  // namespace kvq
