// Per-lane top-3 / bottom-3 selection network of the fused GEAR value kernel
// (gear_values.cuh, KMAX = 2).  Host + device, torch-free, no CUDA headers.
#pragma once
#include <cstdint>

#include "kvq/common/macros.h"

namespace kvq {
namespace gear {

// ---- per-lane top-3 / bottom-3 of the 16 composite keys (KMAX = 2: list depth P = 3) by a
// selection network instead of 16 insertions (≈ 82 instead of ≈ 132 integer min / max per
// lane; sm_90 has a 3-input VIMNMX3): four sorted 4-groups (5 compare-exchanges each, which
// serve both sides), then three top-3 merges per side.  Pure functions of the keys, also
// compiled for the host (tests/test_gear.py::test_gear_values_select3_network_host checks
// them against a sort).
// Merge of two descending lists a, b (>= 3 entries each) into the 3 largest of their union:
//   c0 = max(a0, b0),  c1 = max(min(a0, b0), a1, b1),  c2 = max(min(a0, b1), min(a1, b0), a2, b2).
KVQ_HOST_DEVICE uint32_t gv_umax(uint32_t a, uint32_t b) { return a > b ? a : b; }
KVQ_HOST_DEVICE uint32_t gv_umin(uint32_t a, uint32_t b) { return a < b ? a : b; }

/// c = the 3 largest of a[0..2] ∪ b[0..2] (both descending), descending.
KVQ_HOST_DEVICE void gv_top3_merge(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t b0, uint32_t b1,
                                   uint32_t b2, uint32_t (&c)[3]) {
  c[0] = gv_umax(a0, b0);
  c[1] = gv_umax(gv_umax(gv_umin(a0, b0), a1), b1);
  c[2] = gv_umax(gv_umax(gv_umin(a0, b1), gv_umin(a1, b0)), gv_umax(a2, b2));
}

/// c = the 3 smallest of a[0..2] ∪ b[0..2] (both ascending), ascending.
KVQ_HOST_DEVICE void gv_bot3_merge(uint32_t a0, uint32_t a1, uint32_t a2, uint32_t b0, uint32_t b1,
                                   uint32_t b2, uint32_t (&c)[3]) {
  c[0] = gv_umin(a0, b0);
  c[1] = gv_umin(gv_umin(gv_umax(a0, b0), a1), b1);
  c[2] = gv_umin(gv_umin(gv_umax(a0, b1), gv_umax(a1, b0)), gv_umin(a2, b2));
}

/// tl = the 3 largest of key[0..15] (descending), bl = the 3 smallest (ascending): the same
/// lists as 16 insertions into depth-3 lists (for distinct keys; as multisets with ties).
KVQ_HOST_DEVICE void gv_select3_16(const uint32_t (&key)[16], uint32_t (&tl)[3],
                                   uint32_t (&bl)[3]) {
  uint32_t s[16];
#pragma unroll
  for (int i = 0; i < 16; ++i) s[i] = key[i];
  // sort each group of 4 descending: (0,1) (2,3) (0,2) (1,3) (1,2)
#pragma unroll
  for (int g = 0; g < 16; g += 4) {
    const int pr[5][2] = {{0, 1}, {2, 3}, {0, 2}, {1, 3}, {1, 2}};
#pragma unroll
    for (int c = 0; c < 5; ++c) {
      const uint32_t hi = gv_umax(s[g + pr[c][0]], s[g + pr[c][1]]);
      const uint32_t lo = gv_umin(s[g + pr[c][0]], s[g + pr[c][1]]);
      s[g + pr[c][0]] = hi;
      s[g + pr[c][1]] = lo;
    }
  }
  uint32_t t01[3], t23[3], b01[3], b23[3];
  gv_top3_merge(s[0], s[1], s[2], s[4], s[5], s[6], t01);
  gv_top3_merge(s[8], s[9], s[10], s[12], s[13], s[14], t23);
  gv_bot3_merge(s[3], s[2], s[1], s[7], s[6], s[5], b01);
  gv_bot3_merge(s[11], s[10], s[9], s[15], s[14], s[13], b23);
  gv_top3_merge(t01[0], t01[1], t01[2], t23[0], t23[1], t23[2], tl);
  gv_bot3_merge(b01[0], b01[1], b01[2], b23[0], b23[1], b23[2], bl);
}

}  // namespace gear
}  // namespace kvq
