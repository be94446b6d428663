// Library-owned error type for torch-free code (converted to torch errors in csrc/).
#pragma once
#include <stdexcept>
#include <string>
#include <type_traits>

namespace kvq {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

namespace detail {
inline void cat_one(std::string& s, const char* x) { s += x; }
inline void cat_one(std::string& s, const std::string& x) { s += x; }
template <typename T, typename std::enable_if<std::is_arithmetic<T>::value, int>::type = 0>
inline void cat_one(std::string& s, T x) { s += std::to_string(x); }
}  // namespace detail

/// \brief Concatenate strings and numbers (std::to_string: no iostreams, no locale).
template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (detail::cat_one(s, args), ...);
  return s;
}

/// KVQ_THROW("message ", value, ...): throw kvq::Error with the parts concatenated.
#define KVQ_THROW(...) throw ::kvq::Error(::kvq::cat(__VA_ARGS__))

}  // namespace kvq
