// CUDA implementations of the kvq ops: shared argument checks (prepare_*), device guard,
// current stream, then the torch-free launchers of include/kvq (compiled by nvcc).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "kvq/cuda_api.h"
#include "ops.h"
#include "utils.h"

namespace kvq {

#define KVQ_CUDA_CALL(op, expr)                                                  \
  do {                                                                           \
    cudaError_t err_ = translate_errors([&] { return (expr); });                 \
    TORCH_CHECK(err_ == cudaSuccess, "kvq.", op, ": CUDA error: ", cudaGetErrorString(err_)); \
  } while (0)

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x, int64_t bits,
                                                             int64_t group_size, bool per_channel,
                                                             bool check_finite) {
  c10::cuda::CUDAGuard guard(x.device());
  QuantizeCall c = prepare_quantize(x, bits, group_size, per_channel, check_finite);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("quantize", quant::group_quantize_cuda(c.params, dtype_id(c.x.scalar_type()), stream));
  if (check_finite) raise_status("quantize", "x", c.status.item<int32_t>());
  return {c.codes, c.scale, c.zero};
}

at::Tensor dequantize_cuda(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& zero,
                           int64_t bits, bool per_channel, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(codes.device());
  DequantizeCall c = prepare_dequantize(codes, scale, zero, bits, per_channel, dtype);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("dequantize", quant::group_dequantize_cuda(c.params, dtype_id(dtype), stream));
  return c.out;
}

// ---- HQMQ (format: include/kvq/vq/quaternion_vq.h) ----
std::tuple<at::Tensor, at::Tensor, at::Tensor> hqmq_encode_cuda(
    const at::Tensor& x, const at::Tensor& secondary, int64_t radius_bits,
    const c10::optional<at::Tensor>& outlier_threshold, bool check_finite) {
  c10::cuda::CUDAGuard guard(x.device());
  HqmqEncodeCall c = prepare_hqmq_encode(x, secondary, radius_bits, outlier_threshold, check_finite);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  const auto dt = dtype_id(c.x.scalar_type());
  KVQ_CUDA_CALL("hqmq_encode", vq::hqmq_encode_cuda(c.params, dt, stream));
  if (check_finite) raise_status("hqmq_encode", "x", c.status.item<int32_t>());
  if (hqmq_prepare_records(c) > 0)  // syncs once for the record count (Med3x only)
    KVQ_CUDA_CALL("hqmq_encode", vq::hqmq_write_records_cuda(c.params, dt, stream));
  return {c.codes, c.scale, c.outliers};
}

at::Tensor hqmq_decode_cuda(const at::Tensor& codes, const at::Tensor& scale,
                            const at::Tensor& secondary, const at::Tensor& outliers,
                            int64_t radius_bits, int64_t head_dim, at::ScalarType dtype) {
  c10::cuda::CUDAGuard guard(codes.device());
  HqmqDecodeCall c =
      prepare_hqmq_decode(codes, scale, secondary, outliers, radius_bits, head_dim, dtype);
  auto stream = c10::cuda::getCurrentCUDAStream().stream();
  KVQ_CUDA_CALL("hqmq_decode", vq::hqmq_decode_cuda(c.params, dtype_id(dtype), stream));
  return c.out;
}
// ---- end HQMQ ----

}  // namespace kvq

TORCH_LIBRARY_IMPL(kvq, CUDA, m) {
  m.impl("quantize", &kvq::quantize_cuda);
  m.impl("dequantize", &kvq::dequantize_cuda);
  // ---- GEAR CUDA impls ----
  // ---- end GEAR CUDA impls ----
  // ---- HQMQ CUDA impls ----
  m.impl("hqmq_encode", &kvq::hqmq_encode_cuda);
  m.impl("hqmq_decode", &kvq::hqmq_decode_cuda);
  // ---- end HQMQ CUDA impls ----
  // ---- decode attention CUDA impls ----
  // ---- end decode attention CUDA impls ----
}
