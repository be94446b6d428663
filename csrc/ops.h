// Declarations of every torch-facing function (CPU and CUDA implementations).
#pragma once
#include <ATen/ATen.h>

#include <tuple>

#include "kvq/quant/group_quant.h"

namespace kvq {

// ----- group quantization (csrc/group_quant.cpp) -----
/// Validated arguments and freshly allocated outputs of one quantize call.
struct QuantizeCall {
  at::Tensor x, codes, scale, zero, status;
  quant::GroupQuantParams params;
};
QuantizeCall prepare_quantize(const at::Tensor& x, int64_t bits, int64_t group_size,
                              bool per_channel, bool check_finite);
struct DequantizeCall {
  at::Tensor codes, scale, zero, out;
  quant::GroupQuantParams params;
};
DequantizeCall prepare_dequantize(const at::Tensor& codes, const at::Tensor& scale,
                                  const at::Tensor& zero, int64_t bits, bool per_channel,
                                  at::ScalarType dtype);

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x, int64_t bits,
                                                            int64_t group_size, bool per_channel,
                                                            bool check_finite);
at::Tensor dequantize_cpu(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                          int64_t bits, bool per_channel, at::ScalarType dtype);

#ifdef KVQ_WITH_CUDA
std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits,
                                                             int64_t group_size, bool per_channel,
                                                             bool check_finite);
at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                           int64_t bits, bool per_channel, at::ScalarType dtype);
#endif

}  // namespace kvq
