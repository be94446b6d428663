// Library-owned error type for torch-free code (converted to torch errors in csrc/).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

namespace kvq {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& msg) : std::runtime_error(msg) {}
};

#define KVQ_THROW(...)                          \
  do {                                          \
    std::ostringstream kvq_oss_;                \
    kvq_oss_ << __VA_ARGS__;                    \
    throw ::kvq::Error(kvq_oss_.str());         \
  } while (0)

}  // namespace kvq
