// A process-wide 0/1 switch of the CUDA entry points, read once from an environment variable
// and settable at run time (the A/B switches of the decode-attention kernels).  Host code only.
#pragma once

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace kvq {

/// `name` set to "1", "true" or "on" gives `when_set`, anything else `when_unset`; exchange()
/// sets it (m >= 0) and returns the previous value, exchange(-1) only queries.
struct EnvSwitch {
  const char* name;
  int when_set = 1, when_unset = 0;
  std::atomic<int> mode{-1};  // -1: not read yet
  int get() {
    const int m = mode.load();
    if (m >= 0) return m;
    const char* e = std::getenv(name);
    const bool on = e != nullptr && (!std::strcmp(e, "1") || !std::strcmp(e, "true") || !std::strcmp(e, "on"));
    int expected = -1;
    mode.compare_exchange_strong(expected, on ? when_set : when_unset);
    return mode.load();
  }
  int exchange(int m) {
    const int prev = get();
    if (m >= 0) mode.store(m ? 1 : 0);
    return prev;
  }
};

}  // namespace kvq
