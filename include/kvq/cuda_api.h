// Host entry points of the CUDA kernels, compiled by nvcc in csrc/cuda/*.cu and called
// from the torch bindings.  Torch-free; each returns the launch's cudaError_t.
#pragma once
#include <cuda_runtime_api.h>

#include "kvq/common/dispatch.h"
#include "kvq/quant/group_quant.h"

namespace kvq {
namespace quant {

/// \brief Group-quantize and pack p.x into p.codes / p.scale / p.zero.
cudaError_t group_quantize_cuda(const GroupQuantParams& p, DTypeId dtype, cudaStream_t stream);
/// \brief Unpack and dequantize p.codes / p.scale / p.zero into p.out.
cudaError_t group_dequantize_cuda(const GroupQuantParams& p, DTypeId dtype, cudaStream_t stream);

}  // namespace quant
}  // namespace kvq
