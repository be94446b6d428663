// Per-vector top-k / bottom-k selection (GEAR's sparse outliers): the params struct, the
// total order shared by host and device, and the CPU twin.  Torch-free.
//
// A "vector" is one key channel along tokens (per_channel: element j of vector v of matrix
// n is x[n, j, v], length L = T) or one value token along channels (element j of vector v
// is x[n, v, j], length L = D).  Output layout, fixed k per vector:
//   values   DType  [N, V, 2k]   V = D (per_channel) or T
//   indices  IdType [N, V, 2k]   uint8 (L <= 256), int16 (L <= 32768) or int32
//   slots [0, k) hold the k largest entries, slots [k, 2k) the k smallest, each half in
//   increasing index order.  Values are the input entries themselves (exact).
//   bounds (optional) float [N, V, 2] = (lo, hi): the smallest and largest entry that is
//   NOT selected, i.e. the (k+1)-th smallest / largest; GEAR clamps the vector into
//   [lo, hi] before quantizing.  When no entry is left (L == 2k) both are 0.
//
// Ties: entries are ordered by the composite key (value, -index): among equal values a
// smaller index counts as larger.  This is a strict total order, so top-k and bottom-k are
// disjoint whenever 2k <= L and CPU and CUDA select exactly the same entries.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "kvq/common/exception.h"
#include "kvq/common/half.h"
#include "kvq/common/macros.h"

/// Stored index width (1, 2 or 4 bytes, see index_bytes) -> IdType.
#define KVQ_DISPATCH_INDEX_BYTES(nbytes, IdType, ...)                               \
  [&] {                                                                          \
    switch (nbytes) {                                                            \
      case 1: { using IdType = uint8_t; return __VA_ARGS__(); }                   \
      case 2: { using IdType = int16_t; return __VA_ARGS__(); }                   \
      case 4: { using IdType = int32_t; return __VA_ARGS__(); }                   \
      default: KVQ_THROW("kvq: index width must be 1, 2 or 4 bytes, got ", (nbytes)); \
    }                                                                            \
  }()

namespace kvq {
namespace select {

/// \brief Parameters of one outlier_select call (see the layout above).
struct OutlierSelectParams {
  const void* x;       // [N, T, D] input, contiguous
  void* values;        // [N, V, 2k] DType
  void* indices;       // [N, V, 2k] IdType
  float* bounds;       // optional [N, V, 2] (lo, hi); nullptr: not written
  uint32_t* keys_ws;   // CUDA only: [N * V * L] workspace for vectors longer than 256
  int64_t N = 0;       // matrices (batch * heads)
  int64_t T = 0;       // tokens
  int64_t D = 0;       // channels
  int64_t k = 0;       // entries per side, 2k <= L
  bool per_channel = false;
};

KVQ_HOST_DEVICE int64_t num_vectors(const OutlierSelectParams& p) {
  return p.per_channel ? p.D : p.T;
}
KVQ_HOST_DEVICE int64_t vector_length(const OutlierSelectParams& p) {
  return p.per_channel ? p.T : p.D;
}

/// \brief k = ceil(s/2 * L), at most L/2 (s = sparsity, both sides together).
/// NOTE: the 1e-9 slack keeps exact products (0.01 * 100 = 1) from rounding up; the Python
/// side (kvquant_ext.outlier_count) uses the identical double expression.
inline int64_t outlier_count(double sparsity, int64_t L) {
  if (!(sparsity > 0.0) || L <= 0) return 0;
  int64_t k = (int64_t)std::ceil(sparsity * 0.5 * (double)L - 1e-9);
  if (k < 0) k = 0;
  if (k > L / 2) k = L / 2;
  return k;
}

/// \brief Bytes of one stored index for vectors of length L (1, 2 or 4).
inline int index_bytes(int64_t L) { return L <= 256 ? 1 : (L <= 32768 ? 2 : 4); }

/// \brief Monotone map float -> uint32 (a < b  =>  key(a) < key(b); -0 < +0).
KVQ_HOST_DEVICE uint32_t orderable_key(float f) {
  uint32_t u = float_as_bits(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
/// \brief Inverse of orderable_key.
KVQ_HOST_DEVICE float key_to_float(uint32_t k) {
  return bits_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
/// \brief The strict total order used for selection: value first, then smaller index.
KVQ_HOST_DEVICE uint64_t composite_key(uint32_t vkey, uint32_t idx) {
  return ((uint64_t)vkey << 32) | (uint64_t)(0xffffffffu - idx);
}
KVQ_HOST_DEVICE uint32_t composite_index(uint64_t key) {
  return 0xffffffffu - (uint32_t)(key & 0xffffffffu);
}

// ---------------------------------------------------------------------------
// CPU twin: vectors [v_begin, v_end) of the flattened [N * V] vectors.
// ---------------------------------------------------------------------------
template <typename DType, typename IdType>
void outlier_select_cpu(const OutlierSelectParams& p, int64_t v_begin, int64_t v_end) {
  const DType* x = static_cast<const DType*>(p.x);
  DType* values = static_cast<DType*>(p.values);
  IdType* indices = static_cast<IdType*>(p.indices);
  const int64_t V = num_vectors(p), L = vector_length(p), k = p.k;
  std::vector<uint64_t> keys((size_t)L), top, bot;
  for (int64_t vv = v_begin; vv < v_end; ++vv) {
    const int64_t n = vv / V, v = vv % V;
    for (int64_t j = 0; j < L; ++j) {
      const int64_t off = p.per_channel ? (n * p.T + j) * p.D + v : (n * p.T + v) * p.D + j;
      keys[j] = composite_key(orderable_key(to_float(x[off])), (uint32_t)j);
    }
    // kt = k + 1 when an inlier exists (its value is the clamp bound), else k.
    const int64_t kt = (L >= 2 * k + 1) ? k + 1 : k;
    float lo = 0.f, hi = 0.f;
    top.assign(keys.begin(), keys.end());
    bot.assign(keys.begin(), keys.end());
    if (kt > 0) {
      std::nth_element(top.begin(), top.begin() + (kt - 1), top.end(), std::greater<uint64_t>());
      std::nth_element(bot.begin(), bot.begin() + (kt - 1), bot.end());
    }
    if (kt == k + 1) {
      hi = key_to_float((uint32_t)(top[k] >> 32));
      lo = key_to_float((uint32_t)(bot[k] >> 32));
    }
    top.resize(k);
    bot.resize(k);
    auto by_index = [](uint64_t a, uint64_t b) { return composite_index(a) < composite_index(b); };
    std::sort(top.begin(), top.end(), by_index);
    std::sort(bot.begin(), bot.end(), by_index);
    const int64_t base = vv * 2 * k;
    for (int64_t i = 0; i < k; ++i) {
      values[base + i] = from_float<DType>(key_to_float((uint32_t)(top[i] >> 32)));
      indices[base + i] = (IdType)composite_index(top[i]);
      values[base + k + i] = from_float<DType>(key_to_float((uint32_t)(bot[i] >> 32)));
      indices[base + k + i] = (IdType)composite_index(bot[i]);
    }
    if (p.bounds) {
      p.bounds[vv * 2] = lo;
      p.bounds[vv * 2 + 1] = hi;
    }
  }
}

}  // namespace select
}  // namespace kvq
