// Runtime -> compile-time dispatch.  Every switch has a default branch that throws.
// Order of nesting: dtype -> bits -> group/size -> head dim.  Torch-free.
#pragma once
#include "kvq/build_config.h"
#include "kvq/common/exception.h"
#include "kvq/common/half.h"

namespace kvq {

/// \brief Element types understood by the kernels (mapped from torch dtypes in csrc/).
enum class DTypeId : int { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

#define KVQ_DISPATCH_DTYPE(dtype_id, DType, ...)                                   \
  [&] {                                                                            \
    switch (dtype_id) {                                                            \
      case ::kvq::DTypeId::kFloat32: { using DType = float; return __VA_ARGS__(); } \
      case ::kvq::DTypeId::kFloat16: { using DType = ::kvq::half_t; return __VA_ARGS__(); } \
      case ::kvq::DTypeId::kBFloat16: { using DType = ::kvq::bf16_t; return __VA_ARGS__(); } \
      default: KVQ_THROW("kvq: unsupported dtype id ", (int)(dtype_id));        \
    }                                                                              \
  }()

#define KVQ_DISPATCH_BITS(bits, BITS, ...)                                       \
  [&] {                                                                          \
    switch (bits) {                                                              \
      case 2: { constexpr int BITS = 2; return __VA_ARGS__(); }                  \
      case 4: { constexpr int BITS = 4; return __VA_ARGS__(); }                  \
      case 8: { constexpr int BITS = 8; return __VA_ARGS__(); }                  \
      default: KVQ_THROW("kvq: bits must be ", ::kvq::kBitsText, ", got ", (bits)); \
    }                                                                            \
  }()

/// Head dim D -> elements per lane EPL = D / 32 (D in kHeadDims).
#define KVQ_DISPATCH_HEAD_DIM_EPL(head_dim, EPL, ...)                            \
  [&] {                                                                          \
    switch (head_dim) {                                                          \
      case 32: { constexpr int EPL = 1; return __VA_ARGS__(); }                  \
      case 64: { constexpr int EPL = 2; return __VA_ARGS__(); }                  \
      case 128: { constexpr int EPL = 4; return __VA_ARGS__(); }                 \
      case 256: { constexpr int EPL = 8; return __VA_ARGS__(); }                 \
      default: KVQ_THROW("kvq: head dim must be ", ::kvq::kHeadDimsText, ", got ", (head_dim)); \
    }                                                                            \
  }()

}  // namespace kvq

/// `return EXPR(D)` for head dim `head_dim` in kHeadDims, `return EXPR(0)` otherwise
/// (the caller's EXPR turns 0 into its error value); a statement, for host entry points.
#define KVQ_SWITCH_HEAD_DIM_OR_0(head_dim, EXPR) \
  switch (head_dim) {                            \
    case 32: return EXPR(32);                    \
    case 64: return EXPR(64);                    \
    case 128: return EXPR(128);                  \
    case 256: return EXPR(256);                  \
    default: return EXPR(0);                     \
  }
/// `return FN##_b2 / _b4 / _b8(args...)` for code width `bits`, `return FALLBACK` otherwise: the
/// tensor-core decode entry points, one translation unit per code width.
#define KVQ_SWITCH_CODE_BITS(bits, FN, FALLBACK, ...) \
  switch (bits) {                                     \
    case 2: return FN##_b2(__VA_ARGS__);              \
    case 4: return FN##_b4(__VA_ARGS__);              \
    case 8: return FN##_b8(__VA_ARGS__);              \
    default: return FALLBACK;                         \
  }
