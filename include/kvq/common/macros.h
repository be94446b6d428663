// Common macros shared by host (CPU twin) and device code.  Torch-free.
#pragma once

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVQ_HOST_DEVICE __host__ __device__ __forceinline__
#define KVQ_DEVICE __device__ __forceinline__
#else
#define KVQ_HOST_DEVICE inline
#define KVQ_DEVICE inline
#endif

#include <cstdint>

namespace kvq {

/// \brief Status codes reported by kernels through a device-side int flag.
enum StatusFlag : int32_t {
  kStatusOk = 0,
  kStatusNonFinite = 1,      // NaN or Inf in a tensor to compress
  kStatusOutOfRange = 2,     // |x| > 65504: not representable by fp16 scales/zeros
};

}  // namespace kvq
