// Instantiations of the HQMQ encode/decode kernels (torch-free; nvcc, C++17).
#include "kvq/cuda_api.h"
#include "kvq/hqmq/hqmq.cuh"

namespace kvq {
namespace hqmq {

/// Head dim D -> (chunks per lane CPT, lanes per token LPT), C = D / 4 = CPT * LPT.
#define KVQ_DISPATCH_HQMQ_HEAD_DIM(head_dim, CPT, LPT, ...)                        \
  [&] {                                                                            \
    switch (head_dim) {                                                            \
      case 32: { constexpr int CPT = 1, LPT = 8; return __VA_ARGS__(); }           \
      case 64: { constexpr int CPT = 1, LPT = 16; return __VA_ARGS__(); }          \
      case 128: { constexpr int CPT = 1, LPT = 32; return __VA_ARGS__(); }         \
      case 256: { constexpr int CPT = 2, LPT = 32; return __VA_ARGS__(); }         \
      default: KVQ_THROW("kvq: hqmq head dim must be ", kHeadDimsText, ", got ", (head_dim)); \
    }                                                                              \
  }()

cudaError_t hqmq_encode_cuda(const HqmqParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_HQMQ_HEAD_DIM(p.D, CPT, LPT, [&] {
      return HqmqEncode<DType, CPT, LPT>(p, stream);
    });
  });
}

cudaError_t hqmq_write_records_cuda(const HqmqParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] { return HqmqWriteRecords<DType>(p, stream); });
}

cudaError_t hqmq_decode_cuda(const HqmqParams& p, DTypeId dtype, cudaStream_t stream) {
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_HQMQ_HEAD_DIM(p.D, CPT, LPT, [&] {
      return HqmqDecode<DType, CPT, LPT>(p, stream);
    });
  });
}

}  // namespace hqmq
}  // namespace kvq
