// Instantiations of the batched power-iteration kernels (torch-free; nvcc, C++17).
// Dispatch: dtype -> d bucket (DMAX 64 / 128 / 256) -> internal width (RB,
// power_width(rank): 2 / 4 / 6 / 8).
#include "kvq/cuda_api.h"
#include "kvq/linalg/power_svd.cuh"

namespace kvq {
namespace linalg {

#define KVQ_DISPATCH_DMAX(d, DMAX, ...)                                           \
  [&] {                                                                          \
    if ((d) <= 64) { constexpr int DMAX = 64; return __VA_ARGS__(); }            \
    if ((d) <= 128) { constexpr int DMAX = 128; return __VA_ARGS__(); }          \
    if ((d) <= 256) { constexpr int DMAX = 256; return __VA_ARGS__(); }          \
    KVQ_THROW("kvq: lowrank_power_iter supports d <= 256, got ", (d));          \
  }()

#define KVQ_DISPATCH_RANK_BUCKET(r, RB, ...)                                      \
  [&] {                                                                          \
    switch (power_width(r)) {                                                    \
      case 2: { constexpr int RB = 2; return __VA_ARGS__(); }                    \
      case 4: { constexpr int RB = 4; return __VA_ARGS__(); }                    \
      case 6: { constexpr int RB = 6; return __VA_ARGS__(); }                    \
      case 8: { constexpr int RB = 8; return __VA_ARGS__(); }                    \
      default: KVQ_THROW("kvq: rank must be 1..8, got ", (r));                 \
    }                                                                            \
  }()

cudaError_t power_iter_cuda(const PowerIterParams& p, DTypeId dtype, cudaStream_t stream) {
  if (p.rank < 1 || p.rank > kMaxRank) KVQ_THROW("kvq: rank must be 1..8, got ", p.rank);
  return KVQ_DISPATCH_DTYPE(dtype, DType, [&] {
    return KVQ_DISPATCH_DMAX(p.d, DMAX, [&] {
      return KVQ_DISPATCH_RANK_BUCKET(p.rank, RB, [&] {
        return PowerIter<DType, DMAX, RB>(p, stream);
      });
    });
  });
}

}  // namespace linalg
}  // namespace kvq
