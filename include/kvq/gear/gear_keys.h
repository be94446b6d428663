// GEAR compress, KEY side (per-channel vectors), long matrices: the launch plan of the fused
// kernel of gear_keys.cuh (outlier selection + outlier fill + per-channel group quantization +
// fp16 residual in ONE pass over x).  Torch-free, host only.
//
// A CTA owns one slab of 8 channels of one [T, D] matrix: the slab [T, 8] (16 bytes per
// token row) stays in shared memory; thread i owns the contiguous tokens
// [i * tpt, (i + 1) * tpt).  The selection is exact (same entries as outlier_topk.h):
//   1. per thread and channel the max / min 16-bit order key of its tokens;
//   2. per channel tau = kt-th largest of the 256 thread maxima (kt = k + 1): at least kt
//      entries have key >= tau, so the top-kt all lie in {key >= tau} (likewise bottom);
//   3. those candidates (typically ~kt + a few) are appended to a per-channel buffer of
//      `cap` entries; a warp finds the kt-th / k-th largest composite key (value, -index)
//      among them by a bitwise search and writes the k selected entries in index order;
//      a buffer overflow (many ties at tau) falls back to the same search over the whole
//      channel (exact, slower).
//   4. per quantization group (the tokens of `lanes` threads, or the whole channel): the bounds
//      (min / max over the non-outlier entries, gear.h), the outliers clamped into them,
//      quantization and the fp16 residual (0 at the outliers).
// Split path (plan.split: KIVI grouping G < T where the per-channel tile layout applies):
// the kernel above runs steps 1-3 only and writes per (matrix, channel) the two composite
// thresholds to a workspace (GearParams::keys_sel, [N][2][D] 32-bit words); a second,
// coalesced kernel (one block per group of G tokens x all D channels, tokens in registers,
// as the KIVI tile kernel) marks the outliers by the thresholds, takes the group bounds,
// fills the outliers, quantizes and writes the fp16 residual.
// k == 0 (GEAR-L): only the second kernel (no outlier test, no fill).
#pragma once
#include <cstddef>
#include <cstdint>

#include "kvq/build_config.h"

namespace kvq {
namespace gear {

/// \brief Launch plan of GearKeysKernel; ok == false: use the multi-kernel path.
struct GearKeysPlan {
  bool ok = false;
  int tpt = 0;       // tokens per thread (contiguous)
  int lanes = 0;     // threads per quantization group (1..32), 0: KCVT (G == T, block reduce)
  int cap = 0;       // candidate buffer entries per (channel, side)
  int slots = 0;     // 16-byte slab rows in shared memory (T rounded up to 8)
  size_t smem = 0;   // dynamic shared memory bytes
  bool split = false;  // selection-only kernel (k > 0) + GearKeysQuantResidKernel
  int qthreads = 0;    // split: threads per block of GearKeysQuantResidKernel
};

/// Tokens per thread of GearKeysQuantResidKernel (= quant::kTileTokensPerThread).
constexpr int kGearKeysQuantTokens = 8;
/// Words of the split path's selection workspace (GearParams::keys_sel).
inline int64_t gear_keys_sel_words(int64_t N, int64_t D) { return N * 2 * D; }

constexpr int kGearKeysThreads = 256;
constexpr int kGearKeysChannels = 8;  // channels per CTA (one 16-byte chunk of a token row)

/// \brief Plan for a per-channel compress of N [T, D] 16-bit matrices with groups of G tokens
/// (G == T: whole channel) and k outliers per side.  Requires 256 < T <= 16384 (int16
/// indices, 16-bit composite index), D % 8 == 0, N <= 65535, k + 1 <= active threads.
inline GearKeysPlan gear_keys_plan(int64_t N, int64_t T, int64_t D, int64_t G, int64_t k) {
  GearKeysPlan pl;
  constexpr int NT = kGearKeysThreads;
  if (N <= 0 || N > 65535 || T <= 256 || T > 16384 || D <= 0 || D % kGearKeysChannels != 0 ||
      G <= 0 || T % G != 0 || k < 0 || 2 * k >= T)
    return pl;
  const int64_t min_tpt = (T + NT - 1) / NT;
  // split: G < T and the tile layout (G / 8 token slices x D / 8 lanes, whole warps, <= 512
  // threads); the selection then needs no group alignment: tpt = min_tpt
  if (G < T && G % kGearKeysQuantTokens == 0) {
    const int64_t qt = G / kGearKeysQuantTokens * (D / 8);
    if (qt >= 32 && qt <= 512 && qt % 32 == 0 && supported_head_dim(D)) {
      pl.split = true;
      pl.qthreads = (int)qt;
    }
  }
  if (pl.split) {
    pl.tpt = (int)min_tpt;
    pl.lanes = 0;  // unused: the selection kernel quantizes nothing
  } else if (G == T) {
    pl.tpt = (int)min_tpt;
    pl.lanes = 0;
  } else {
    for (int p = 5; p >= 0; --p) {  // smallest tpt = G / 2^p >= min_tpt (2^p threads per group)
      if (G % (1 << p) == 0 && (G >> p) >= min_tpt) {
        pl.tpt = (int)(G >> p);
        pl.lanes = 1 << p;
        break;
      }
    }
    if (pl.tpt == 0) return pl;
  }
  const int64_t active = (T + pl.tpt - 1) / pl.tpt;
  const int64_t kt = k + 1;
  if (k > 0 && kt > active) return pl;
  int64_t cap = (2 * kt + 32 + 31) / 32 * 32;
  if (cap < 128) cap = 128;
  if (k > 0 && cap > 512) return pl;  // large k: the multi-kernel radix path
  pl.cap = (int)cap;
  pl.slots = (int)((T + 7) / 8 * 8);
  const size_t exch = (size_t)2 * kGearKeysChannels * NT * sizeof(uint16_t);  // thread max / min keys
  const size_t buf = (size_t)2 * kGearKeysChannels * cap * sizeof(uint32_t);
  const size_t mask = pl.split ? 0 : (size_t)pl.tpt * NT;  // outlier flag bytes (a multiple of 16)
  pl.smem = (size_t)pl.slots * 16 + mask + (exch > buf ? exch : buf);
  if (pl.smem > 200 * 1024) return pl;
  pl.ok = true;
  return pl;
}

}  // namespace gear
}  // namespace kvq
