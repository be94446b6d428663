// Argument checks and small helpers for the torch-facing code.  Every user error is a
// TORCH_CHECK whose message names the op and the argument.
#pragma once
#include <torch/library.h>
#include <ATen/ATen.h>

#include <algorithm>
#include <string>
#include <type_traits>

#include "kvq/build_config.h"
#include "kvq/common/dispatch.h"
#include "kvq/common/exception.h"

// Error messages are assembled by kvq::msg (integers via std::to_string, shapes, dtypes and
// devices by hand) and handed to TORCH_CHECK as one string: no std::ostream number
// formatting happens in this module.  (NOTE: with the GPU build's torch, an integer streamed
// into a TORCH_CHECK message from this module crashed the process.)
#define KVQ_CHECK(cond, ...) TORCH_CHECK(cond, ::kvq::msg(__VA_ARGS__))
#define KVQ_CHECK_ARG(cond, op, arg, ...) KVQ_CHECK(cond, "kvq.", op, ": argument '", arg, "' ", __VA_ARGS__)

#define CHECK_FLOATING(op, t, name)                                                       \
  KVQ_CHECK_ARG((t).scalar_type() == at::kHalf || (t).scalar_type() == at::kBFloat16 ||    \
                    (t).scalar_type() == at::kFloat,                                      \
                op, name, "must be ", ::kvq::kDTypesText, ", got ", (t).scalar_type())
#define CHECK_DTYPE(op, t, name, dtype) \
  KVQ_CHECK_ARG((t).scalar_type() == (dtype), op, name, "must have dtype ", dtype, ", got ", (t).scalar_type())
#define CHECK_MIN_DIM(op, t, name, d) \
  KVQ_CHECK_ARG((t).dim() >= (d), op, name, "must have at least ", d, " dimensions, got shape ", (t).sizes())
#define CHECK_DIM(op, t, name, d) \
  KVQ_CHECK_ARG((t).dim() == (d), op, name, "must have ", d, " dimensions, got shape ", (t).sizes())
#define CHECK_SAME_DEVICE(op, a, aname, b, bname)                                          \
  KVQ_CHECK((a).device() == (b).device(), "kvq.", op, ": argument '", bname, "' is on ",   \
              (b).device(), " but '", aname, "' is on ", (a).device())

namespace kvq {

namespace detail {
// kvq::cat (kvq/common/exception.h) joins strings and numbers; these turn the torch-side
// types of a message into strings first.
template <typename T>
inline const T& piece(const T& x) { return x; }
inline const char* piece(bool x) { return x ? "true" : "false"; }
inline std::string piece(char x) { return std::string(1, x); }
inline const char* piece(at::ScalarType x) { return c10::toString(x); }
inline std::string piece(const c10::Device& x) {
  std::string s = c10::DeviceTypeName(x.type(), /*lower_case=*/true);
  return x.has_index() ? s + ":" + std::to_string((int)x.index()) : s;
}
inline std::string piece(at::IntArrayRef x) {
  std::string s = "[";
  for (size_t i = 0; i < x.size(); ++i) s += (i ? ", " : "") + std::to_string(x[i]);
  return s + "]";
}
}  // namespace detail

/// \brief Concatenate message parts (strings, numbers, bools, dtypes, devices, shapes).
template <typename... Args>
std::string msg(const Args&... args) {
  return ::kvq::cat(detail::piece(args)...);
}

inline DTypeId dtype_id(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DTypeId::kFloat32;
    case at::kHalf: return DTypeId::kFloat16;
    case at::kBFloat16: return DTypeId::kBFloat16;
    default: KVQ_CHECK(false, "kvq: unsupported dtype ", t);
  }
}

/// Least work one at::parallel_for task should do, in bytes moved or arithmetic operations
/// (about 10 us on one core).  Waking the thread pool costs microseconds on idle cores and
/// milliseconds when they are busy, so a loop over less work than this runs inline on the
/// calling thread.
constexpr int64_t kMinTaskWork = 64 * 1024;

/// \brief Grain for at::parallel_for(0, n, grain, f) when each iteration does
/// `work_per_iteration` units of work (see kMinTaskWork): parallel_for runs f(0, n) inline
/// when n <= grain, and otherwise gives every task at least `grain` iterations.
inline int64_t parallel_grain(int64_t work_per_iteration) {
  return std::max<int64_t>(1, kMinTaskWork / std::max<int64_t>(1, work_per_iteration));
}

/// \brief Contiguous, 16-byte aligned version of t (copies only when needed).
inline at::Tensor contiguous_aligned(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

/// \brief Product of all but the last `keep` dims.
inline int64_t leading_numel(const at::Tensor& t, int keep) {
  int64_t n = 1;
  for (int64_t i = 0; i < t.dim() - keep; ++i) n *= t.size(i);
  return n;
}

/// \brief Raise the user-facing error for a kernel status flag (host value).
/// `out_of_range`: what kStatusOutOfRange means for the op (default: group quantization's).
void raise_status(const char* op, const char* arg, int32_t status,
                  const char* out_of_range = "has entries with magnitude above 65504, which fp16 scales and zero "
                                             "points cannot represent");
/// kStatusOutOfRange of the HQMQ encoders.
constexpr const char* kHqmqOutOfRange =
    "has an entry above 65504 or a non-outlier 4-element chunk whose norm exceeds 61440, which the packed per-token "
    "radius scale cannot represent (Med3x outliers, e.g. hqmq-5, store such chunks exactly)";

/// \brief Turn a CUDA-free kvq::Error into a torch error.
template <typename F>
auto translate_errors(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const ::kvq::Error& e) {
    KVQ_CHECK(false, e.what());
  }
}

}  // namespace kvq
