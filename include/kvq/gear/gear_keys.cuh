// Fused GEAR compress of KEY caches (per-channel vectors) for long matrices: outlier
// selection + outlier fill + per-channel group quantization + fp16 residual in one kernel
// that reads x once.  Torch-free.  Plan and selection scheme: gear_keys.h.  The outputs equal
// those of the multi-kernel path (OutlierSelect -> GearGroupBounds -> GearClampQuantResid ->
// GearZeroOutliers) bit for bit: the same total order (16-bit order key, then smaller index
// counts as larger), values as raw input bits, the group bounds of gear.h (fminf / fmaxf over
// the non-outlier entries; an empty group quantizes as min = max = 0), the outliers' clamp
// into them, make_qparams / quant_code / FMA arithmetic of GearClampQuantResidKernel.
#pragma once
#include <cuda_runtime.h>

#include <type_traits>

#include "kvq/gear/gear.h"
#include "kvq/gear/gear_keys.h"
#include "kvq/quant/group_quant.cuh"
#include "kvq/select/outlier_topk.cuh"

namespace kvq {
namespace gear {

constexpr unsigned kGkFull = 0xffffffffu;

/// \brief Two packed 16-bit floats (raw bits) -> their two 16-bit order keys
/// (select::orderable_key16 on each half: sign set -> ~h, else h | 0x8000).
__device__ __forceinline__ uint32_t gk_keys2(uint32_t w) {
  return w ^ 0x80008000u ^ (((w >> 15) & 0x00010001u) * 0x7fffu);
}
__device__ __forceinline__ uint32_t gk_half(const uint4& v, int c) {
  const uint32_t w = c < 2 ? v.x : c < 4 ? v.y : c < 6 ? v.z : v.w;
  return (c & 1) ? (w >> 16) : (w & 0xffffu);
}
__device__ __forceinline__ uint32_t gk_word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}
/// Slab row of token t (16-byte slots).  When tpt is a multiple of 8 the 32 lanes of a warp
/// (tokens tpt apart) would all hit the same banks: XOR the row with the owner thread inside
/// its aligned block of 8 (one owner per block, so the map is a bijection).
__device__ __forceinline__ int gk_slot(int t, int owner, int tpt) {
  return (tpt & 7) ? t : (t ^ (owner & 7));
}

/// \brief Composite keys of one side as seen by the selection: top: ck = key16 << 16 |
/// (0xffff - t); bottom: ~ck (so "largest" means "smallest" for the bottom side).
__device__ __forceinline__ uint32_t gk_idx(uint32_t kk, int side) {
  return side == 0 ? 0xffffu - (kk & 0xffffu) : (kk & 0xffffu);
}
__device__ __forceinline__ uint32_t gk_val_bits(uint32_t kk, int side) {
  return select::key16_to_bits(side == 0 ? (kk >> 16) : ((~kk) >> 16));
}

/// \brief kth-largest (kth >= 1, kth <= n) of n NBITS-bit keys key_at(0..n) (every key
/// < 2^NBITS) by a bitwise search (at most NBITS warp-wide counting passes).  The search stops
/// as soon as exactly kth keys are >= the current prefix: the answer is then the smallest of
/// them (one more pass) -- the same value the remaining passes would reach, typically after
/// about half the passes.  Warp-uniform arguments; result in every lane.
template <int NBITS = 32, class F>
__device__ __forceinline__ uint32_t gk_kth_largest(const F& key_at, int n, int kth, int lane);

/// \brief The bitwise search shared by gk_kth_largest and gk_kth_largest_reg, from bit b down
/// with ans = the common prefix of the bits above b (have = n keys >= it).  count_ge(cand): this
/// lane's number of keys >= cand; min_ge(ans): this lane's smallest key >= ans (0xffffffff if
/// none).  Warp-uniform n, kth; result in every lane.
template <class C, class M>
__device__ __forceinline__ uint32_t gk_kth_search(uint32_t ans, int b, int n, int kth, const C& count_ge,
                                                  const M& min_ge) {
  int have = n;  // keys >= ans (warp-uniform)
  for (; b >= 0 && have != kth; --b) {
    const uint32_t cand = ans | (1u << b);
    const int cnt = (int)__reduce_add_sync(kGkFull, (unsigned)count_ge(cand));
    if (cnt >= kth) {
      ans = cand;
      have = cnt;
    }
  }
  if (have == kth) ans = __reduce_min_sync(kGkFull, min_ge(ans));
  return ans;
}

template <int NBITS, class F>
__device__ __forceinline__ uint32_t gk_kth_largest(const F& key_at, int n, int kth, int lane) {
  static_assert(NBITS >= 1 && NBITS <= 32, "key width");
  uint32_t ans = 0;
  int b = NBITS - 1;
  auto count_ge = [&](uint32_t cand) {
    int cnt = 0;
    for (int i = lane; i < n; i += 32) cnt += key_at(i) >= cand ? 1 : 0;
    return cnt;
  };
  auto min_ge = [&](uint32_t ans) {
    uint32_t m = 0xffffffffu;
    for (int i = lane; i < n; i += 32) {
      const uint32_t kk = key_at(i);
      if (kk >= ans && kk < m) m = kk;
    }
    return m;
  };
  return gk_kth_search(ans, b, n, kth, count_ge, min_ge);
}
/// \brief gk_kth_largest over keys held in registers: entry i = r * 32 + lane is v[r], valid
/// iff i < n (padding is never read).  PREFIX: first the warp min / max of the valid keys; the
/// passes over the bits above their highest differing bit are skipped, ans starting at their
/// common prefix (every skipped pass would count n or 0 keys: the same ans / have as the full
/// search, so the same result).  Warp-uniform n, kth (1 <= kth <= n); result in every lane.
template <int NBITS, bool PREFIX, int R>
__device__ __forceinline__ uint32_t gk_kth_largest_reg(const uint32_t (&v)[R], int n, int kth, int lane) {
  static_assert(NBITS >= 1 && NBITS <= 32, "key width");
  uint32_t ans = 0;
  int b = NBITS - 1;
  if constexpr (PREFIX) {
    uint32_t lo = 0xffffffffu, hi = 0u;
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r * 32 + lane < n) {
        lo = min(lo, v[r]);
        hi = max(hi, v[r]);
      }
    lo = __reduce_min_sync(kGkFull, lo);
    hi = __reduce_max_sync(kGkFull, hi);
    const uint32_t d = lo ^ hi;
    if (d == 0u) return hi;  // all n keys equal
    b = 31 - __clz(d);
    ans = b == 31 ? 0u : (hi & (0xffffffffu << (b + 1)));
  }
  auto count_ge = [&](uint32_t cand) {
    int cnt = 0;
#pragma unroll
    for (int r = 0; r < R; ++r) cnt += (r * 32 + lane < n && v[r] >= cand) ? 1 : 0;
    return cnt;
  };
  auto min_ge = [&](uint32_t a) {
    uint32_t m = 0xffffffffu;
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (r * 32 + lane < n && v[r] >= a && v[r] < m) m = v[r];
    return m;
  };
  return gk_kth_search(ans, b, n, kth, count_ge, min_ge);
}
/// \brief Position of the r-th (0-based) set bit of m; requires r < popc(m) (5 popc steps; the
/// hardware-less __fns is a longer software search on sm_90).
__device__ __forceinline__ int gk_nth_bit(uint32_t m, int r) {
  int pos = 0;
#pragma unroll
  for (int w = 16; w >= 1; w >>= 1) {
    const int c = __popc(m & ((1u << w) - 1u));
    if (r >= c) {
      r -= c;
      m >>= w;
      pos += w;
    }
  }
  return pos;
}
/// \brief Smallest key > K among key_at(0..n) (0xffffffff when none).
template <class F>
__device__ __forceinline__ uint32_t gk_min_above(const F& key_at, int n, uint32_t K, int lane) {
  uint32_t m = 0xffffffffu;
  for (int i = lane; i < n; i += 32) {
    const uint32_t kk = key_at(i);
    if (kk > K && kk < m) m = kk;
  }
  return __reduce_min_sync(kGkFull, m);
}

/// \brief One CTA per (slab of 8 channels, matrix): grid (D / 8, N), 256 threads.
/// Writes outlier values / indices (p.ovalues / p.oindices, int16), codes / scale / zero
/// (p.q), the fp16 residual p.resid (0 at outliers and where non-finite) and p.status.
/// SEL (split path, k > 0 only): steps 1-4 only; instead of step 5 it writes p.keys_sel
/// (thr_top, thr_bot per channel) for GearKeysQuantResidKernel; no outlier mask.
template <typename DType, int BITS, bool SEL = false>
__global__ void __launch_bounds__(kGearKeysThreads, 2) GearKeysKernel(GearParams p, GearKeysPlan pl) {
  constexpr int NT = kGearKeysThreads, NC = kGearKeysChannels;
  static_assert(sizeof(DType) == 2, "16-bit dtypes only");
  extern __shared__ uint4 gk_smem[];
  uint4* slab = gk_smem;                                                  // [slots]
  // outlier flags: byte j * NT + i = channel bits of token i * tpt + j (thread-major: the
  // final loop's byte reads are conflict-free)
  uint32_t* omask = reinterpret_cast<uint32_t*>(gk_smem + pl.slots);       // [tpt * NT] bytes (not SEL)
  const int mask_u4 = SEL ? 0 : pl.tpt * (NT / 16);
  uint16_t* exch = reinterpret_cast<uint16_t*>(gk_smem + pl.slots + mask_u4);  // [2][NC][NT]
  uint32_t* buf = reinterpret_cast<uint32_t*>(gk_smem + pl.slots + mask_u4);   // [2][NC][cap] (aliases exch)
  __shared__ int s_cnt[2][NC];
  __shared__ float s_red[NT / 32][NC][2];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int s = blockIdx.x;
  const int64_t n = blockIdx.y;
  const int T = (int)p.T, D = (int)p.D, tpt = pl.tpt, cap = pl.cap;
  const int k = (int)p.k, kt = k + 1;
  const int t0 = tid * tpt;
  const int t1 = min(t0 + tpt, T);
  const int sw = (tpt & 7) ? 0 : (tid & 7);  // gk_slot for this thread's own tokens
  const uint4* xg = reinterpret_cast<const uint4*>(static_cast<const DType*>(p.x) + n * p.T * p.D + s * NC);
  const int rstride = D / NC;  // uint4 per token row of x
  if (!SEL && p.k > 0)
    for (int i = tid; i < tpt * (NT / 4); i += NT) omask[i] = 0u;  // barriers follow before use

  // ---- 1. load the slab once (cp.async: all of the thread's rows in flight at once, no
  // registers held; each thread later reads back only the rows it copied itself, so its own
  // wait_group suffices); per-thread max / min order keys per channel; finite check
  {
    const uint32_t sb = (uint32_t)__cvta_generic_to_shared(slab);
    for (int t = t0; t < t1; ++t)
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(sb + 16u * (uint32_t)(t ^ sw)),
                   "l"(xg + (int64_t)t * rstride)
                   : "memory");
    asm volatile("cp.async.commit_group;\n" ::: "memory");
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
  }
  uint32_t kmax[4] = {0u, 0u, 0u, 0u}, kmin[4] = {~0u, ~0u, ~0u, ~0u}, amax = 0u;
#pragma unroll 4
  for (int t = t0; t < t1; ++t) {
    const uint4 v = slab[t ^ sw];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const uint32_t w = gk_word(v, i);
      amax = __vmaxu2(amax, w & 0x7fff7fffu);
      const uint32_t k2 = gk_keys2(w);
      kmax[i] = __vmaxu2(kmax[i], k2);
      kmin[i] = __vminu2(kmin[i], k2);
    }
  }
  if (p.status) {
    // |x| <= 65504 <=> abs bits <= 0x7bff (fp16) / 0x477f (bf16); exact flags only if not
    constexpr uint32_t kOk = std::is_same<DType, half_t>::value ? 0x7bffu : 0x477fu;
    int32_t status = 0;
    if ((amax & 0xffffu) > kOk || (amax >> 16) > kOk) {
      for (int t = t0; t < t1; ++t) {
        const uint4 v = slab[t ^ sw];
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          DType h;
          h.bits = (uint16_t)gk_half(v, c);
          status |= quant::value_status(to_float(h));
        }
      }
    }
    status = (int32_t)__reduce_or_sync(kGkFull, (unsigned)status);
    if (lane == 0 && status) atomicOr(p.status, status);
  }

  DType* ovalues = static_cast<DType*>(const_cast<void*>(p.ovalues));
  int16_t* oindices = static_cast<int16_t*>(const_cast<void*>(p.oindices));
  if (k > 0) {
    // ---- 2. thread maxima / minima -> shared; tau per channel (warp c)
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      const int i = c >> 1, sh = (c & 1) * 16;
      exch[(0 * NC + c) * NT + tid] = (uint16_t)(kmax[i] >> sh);
      exch[(1 * NC + c) * NT + tid] = (uint16_t)(kmin[i] >> sh);
    }
    __syncthreads();
    // ---- 3. per channel (warp c): tau of both sides, then the candidates {key >= tau_top},
    // {key <= tau_bot} collected from the slab rows of the threads whose extremum passes tau
    // only, in token order (threads own contiguous tokens; ballot-compacted appends, no
    // atomics), so that step 4 can place the selected entries by a ballot prefix.
    const int c = warp;
    const unsigned below = (1u << lane) - 1u;
    {
      const uint16_t* em = exch + (0 * NC + c) * NT;
      const uint16_t* en = exch + (1 * NC + c) * NT;
      // this lane's 8 thread maxima / (complemented) minima in registers: r <-> thread lane + 32 r
      uint32_t vT[NT / 32], vB[NT / 32];
#pragma unroll
      for (int j = 0; j < NT / 32; ++j) {
        vT[j] = em[lane + 32 * j];
        vB[j] = 0xffffu - (uint32_t)en[lane + 32 * j];
      }
      // at least kt thread maxima are >= tau_top, hence at least kt entries (bottom alike)
      const uint32_t tt = gk_kth_largest_reg<16, false>(vT, NT, kt, lane);
      const uint32_t tb = 0xffffu - gk_kth_largest_reg<16, false>(vB, NT, kt, lane);
      uint32_t selT = 0u, selB = 0u;  // bit j: thread lane + 32 j passes tau
#pragma unroll
      for (int j = 0; j < NT / 32; ++j) {
        selT |= (vT[j] >= tt ? 1u : 0u) << j;
        selB |= (0xffffu - vB[j] <= tb ? 1u : 0u) << j;
      }
      __syncthreads();  // exch is dead from here on (buf aliases it)
      const uint16_t* slab16 = reinterpret_cast<const uint16_t*>(slab);
      for (int side = 0; side < 2; ++side) {
        const uint32_t tau = side == 0 ? tt : tb, sel = side == 0 ? selT : selB;
        uint32_t* b = buf + (side * NC + c) * cap;
        // the selected threads in token order: chunk masks (thread lane + 32 j) and their counts
        uint32_t M[NT / 32];
        int S = 0;
#pragma unroll
        for (int j = 0; j < NT / 32; ++j) {
          M[j] = __ballot_sync(kGkFull, (sel >> j) & 1u);
          S += __popc(M[j]);
        }
        int cnt = 0;
#pragma unroll 1
        for (int r0 = 0; r0 < S; r0 += 32) {  // warp-uniform: one selected thread per lane
          // o: the thread of rank g = r0 + lane among the selected ones (-1: none)
          int o = -1;
          {
            int rem = r0 + lane, jj = -1;
            uint32_t mj = 0u;
#pragma unroll
            for (int j = 0; j < NT / 32; ++j) {  // chunk of rank g (selects only), then one search
              const int pc = __popc(M[j]);
              if (jj < 0 && rem < pc) {
                jj = j;
                mj = M[j];
              } else if (jj < 0) {
                rem -= pc;
              }
            }
            if (jj >= 0) o = 32 * jj + gk_nth_bit(mj, rem);
          }
          // pass 1: this thread's tokens: candidate count and (first 32 tokens) bitmask
          const int tb0 = o * tpt;
          const int u1 = o < 0 ? 0 : min(tpt, T - tb0);
          int lc = 0;
          uint32_t lm = 0u;
#pragma unroll 8
          for (int u = 0; u < u1; ++u) {
            const int t = tb0 + u;
            const uint32_t key = select::orderable_key16(slab16[gk_slot(t, o, tpt) * 8 + c]);
            const bool cand = side == 0 ? key >= tau : key <= tau;
            lc += cand ? 1 : 0;
            if (u < 32) lm |= (cand ? 1u : 0u) << u;
          }
          // warp exclusive prefix of the counts: lanes are in token order
          int inc = lc;
#pragma unroll
          for (int d = 1; d < 32; d <<= 1) {
            const int y = __shfl_up_sync(kGkFull, inc, d);
            if (lane >= d) inc += y;
          }
          int pos = cnt + inc - lc;
          cnt += __shfl_sync(kGkFull, inc, 31);
          // pass 2: append this thread's candidates in token order
          while (lm != 0u) {
            const int u = __ffs(lm) - 1;
            lm &= lm - 1u;
            const int t = tb0 + u;
            const uint32_t key = select::orderable_key16(slab16[gk_slot(t, o, tpt) * 8 + c]);
            const uint32_t ck = (key << 16) | (0xffffu - (uint32_t)t);
            if (pos < cap) b[pos] = side == 0 ? ck : ~ck;
            ++pos;
          }
#pragma unroll 1
          for (int u = 32; u < u1; ++u) {  // (tpt > 32 only)
            const int t = tb0 + u;
            const uint32_t key = select::orderable_key16(slab16[gk_slot(t, o, tpt) * 8 + c]);
            if (side == 0 ? key >= tau : key <= tau) {
              const uint32_t ck = (key << 16) | (0xffffu - (uint32_t)t);
              if (pos < cap) b[pos] = side == 0 ? ck : ~ck;
              ++pos;
            }
          }
        }
        if (lane == 0) s_cnt[side][c] = cnt;
      }
      __syncwarp();
    }
    // ---- 4. exact selection per (channel, side): warp c (its own buffers only)
    {
      auto mark = [&](int t) {  // token t of channel c is an outlier
        if constexpr (!SEL) {
          const int o = t / tpt, b = (t - o * tpt) * NT + o;
          atomicOr(&omask[b >> 2], 1u << ((b & 3) * 8 + c));
        }
      };
      const int64_t vbase = (n * p.D + s * NC + c) * 2 * (int64_t)k;
      for (int side = 0; side < 2; ++side) {
        const int cn = s_cnt[side][c];
        uint32_t Kkt, Kk;
        if (cn <= 4 * 32) {
          // candidates in registers (entry r * 32 + lane); searches as below, prefix start
          const uint32_t* b = buf + (side * NC + c) * cap;
          uint32_t v[4];
#pragma unroll
          for (int r = 0; r < 4; ++r) v[r] = r * 32 + lane < cn ? b[r * 32 + lane] : 0u;
          Kkt = gk_kth_largest_reg<32, true>(v, cn, kt, lane);
          {
            uint32_t m = 0xffffffffu;
#pragma unroll
            for (int r = 0; r < 4; ++r)
              if (r * 32 + lane < cn && v[r] > Kkt && v[r] < m) m = v[r];
            Kk = __reduce_min_sync(kGkFull, m);  // gk_min_above
          }
          int base = 0;
#pragma unroll
          for (int r = 0; r < 4; ++r) {
            if (r * 32 >= cn) break;  // warp-uniform
            const int i = r * 32 + lane;
            const bool take = i < cn && v[r] >= Kk;
            const unsigned m = __ballot_sync(kGkFull, take);
            if (take) {
              const int pos = base + __popc(m & below);
              const uint32_t idx = gk_idx(v[r], side);
              ovalues[vbase + side * k + pos].bits = (uint16_t)gk_val_bits(v[r], side);
              oindices[vbase + side * k + pos] = (int16_t)idx;
              mark((int)idx);
            }
            base += __popc(m);
          }
        } else if (cn <= cap) {
          const uint32_t* b = buf + (side * NC + c) * cap;
          auto at = [&](int i) { return b[i]; };
          Kkt = gk_kth_largest(at, cn, kt, lane);
          Kk = gk_min_above(at, cn, Kkt, lane);
          // the k entries >= Kk; the buffer is in token order, so a ballot prefix is their rank
          // by index
          int base = 0;
          for (int i0 = 0; i0 < cn; i0 += 32) {
            const int i = i0 + lane;
            const uint32_t kk = i < cn ? b[i] : 0u;
            const bool take = i < cn && kk >= Kk;
            const unsigned m = __ballot_sync(kGkFull, take);
            if (take) {
              const int pos = base + __popc(m & below);
              const uint32_t idx = gk_idx(kk, side);
              ovalues[vbase + side * k + pos].bits = (uint16_t)gk_val_bits(kk, side);
              oindices[vbase + side * k + pos] = (int16_t)idx;
              mark((int)idx);
            }
            base += __popc(m);
          }
        } else {
          // NOTE: many ties at tau overflowed the buffer: the same search over the channel.
          auto at = [&](int t) {
            const uint4 v = slab[gk_slot(t, t / tpt, tpt)];
            const uint32_t ck = (select::orderable_key16(gk_half(v, c)) << 16) | (0xffffu - (uint32_t)t);
            return side == 0 ? ck : ~ck;
          };
          Kkt = gk_kth_largest(at, T, kt, lane);
          Kk = gk_min_above(at, T, Kkt, lane);
          int base = 0;
          for (int tb = 0; tb < T; tb += 32) {
            const int t = tb + lane;
            const bool sel = t < T && at(t) >= Kk;
            const unsigned m = __ballot_sync(kGkFull, sel);
            if (sel) {
              const int pos = base + __popc(m & below);
              const uint32_t kk = at(t);
              ovalues[vbase + side * k + pos].bits = (uint16_t)gk_val_bits(kk, side);
              oindices[vbase + side * k + pos] = (int16_t)t;
              mark(t);
            }
            base += __popc(m);
          }
        }
        if constexpr (SEL) {  // [N][2][D]: thr_top, thr_bot
          if (lane == 0) p.keys_sel[n * 2 * p.D + side * p.D + s * NC + c] = side == 0 ? Kk : ~Kk;
        }
      }
    }
    __syncthreads();
  }
  if constexpr (SEL) return;  // step 5: GearKeysQuantResidKernel

  // ---- 5. group bounds + outlier fill + per-channel group quantization + residual
  // (compiled twice: with and without outliers, so the k == 0 path carries no mask / fill
  // instructions and the k > 0 path no predicates on k; same arithmetic either way)
  const uint8_t* om = reinterpret_cast<const uint8_t*>(omask) + tid;
  auto phase5 = [&](auto has_k) {
    constexpr bool HK = decltype(has_k)::value;
    auto x_of = [&](uint32_t h) {
      DType d;
      d.bits = (uint16_t)h;
      return to_float(d);
    };
    // min / max over the group's non-outlier entries (HK; all entries for k == 0): the group
    // bounds, which are also the min / max of xc (the outliers are filled inside them)
    float mn[NC], mx[NC];
#pragma unroll
    for (int c = 0; c < NC; ++c) {
      mn[c] = INFINITY;
      mx[c] = -INFINITY;
    }
    for (int t = t0; t < t1; ++t) {
      const uint4 v = slab[t ^ sw];
      const uint32_t m = HK ? (uint32_t)om[(t - t0) * NT] : 0u;  // outlier channel bits
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float xv = ((m >> c) & 1u) ? NAN : x_of(gk_half(v, c));  // NaN: ignored
        mn[c] = fminf(mn[c], xv);
        mx[c] = fmaxf(mx[c], xv);
      }
    }
    const int lanes = pl.lanes;
    if (lanes > 0) {
      for (int o = 1; o < lanes; o <<= 1) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          mn[c] = fminf(mn[c], __shfl_xor_sync(kGkFull, mn[c], o));
          mx[c] = fmaxf(mx[c], __shfl_xor_sync(kGkFull, mx[c], o));
        }
      }
    } else {  // KCVT: the whole channel is one group
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          mn[c] = fminf(mn[c], __shfl_xor_sync(kGkFull, mn[c], o));
          mx[c] = fmaxf(mx[c], __shfl_xor_sync(kGkFull, mx[c], o));
        }
      }
      if (lane == 0) {
#pragma unroll
        for (int c = 0; c < NC; ++c) {
          s_red[warp][c][0] = mn[c];
          s_red[warp][c][1] = mx[c];
        }
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        float a = s_red[0][c][0], b = s_red[0][c][1];
        for (int w = 1; w < NT / 32; ++w) {
          a = fminf(a, s_red[w][c][0]);
          b = fmaxf(b, s_red[w][c][1]);
        }
        mn[c] = a;
        mx[c] = b;
      }
    }
    if (t0 >= T) return;  // no tokens (after the last block-wide barrier)
    if constexpr (HK) {
#pragma unroll
      for (int c = 0; c < NC; ++c)
        if (group_empty(mn[c], mx[c])) mn[c] = mx[c] = 0.f;  // empty group: quantizes as zeros
    }
    // xc at an outlier: its clamp into the group bounds (gear_clamp_cpu); inliers: x
    auto xc_of = [&](uint32_t h, int c, uint32_t m) {
      float v = x_of(h);
      if (HK && ((m >> c) & 1u)) v = to_float(from_float<DType>(fminf(fmaxf(v, mn[c]), mx[c])));
      return v;
    };
    float qs[NC], qz[NC], qi[NC];
    {
      uint16_t s16[NC], z16[NC];
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const quant::QParams q = quant::make_qparams(mn[c], mx[c], BITS);
        qs[c] = q.scale;
        qz[c] = q.zero;
        qi[c] = q.inv;
        s16[c] = q.s16;
        z16[c] = q.z16;
      }
      const int64_t G = p.q.group;
      const bool writer = lanes > 0 ? (tid % lanes) == 0 : tid == 0;
      if (writer) {
        const int64_t si = (n * (p.T / G) + t0 / G) * p.D + s * NC;
        uint4 sv, zv;
        sv.x = s16[0] | ((uint32_t)s16[1] << 16);
        sv.y = s16[2] | ((uint32_t)s16[3] << 16);
        sv.z = s16[4] | ((uint32_t)s16[5] << 16);
        sv.w = s16[6] | ((uint32_t)s16[7] << 16);
        zv.x = z16[0] | ((uint32_t)z16[1] << 16);
        zv.y = z16[2] | ((uint32_t)z16[3] << 16);
        zv.z = z16[4] | ((uint32_t)z16[5] << 16);
        zv.w = z16[6] | ((uint32_t)z16[7] << 16);
        *reinterpret_cast<uint4*>(p.q.scale + si) = sv;
        *reinterpret_cast<uint4*>(p.q.zero + si) = zv;
      }
    }
    constexpr float maxq = (float)((1 << BITS) - 1);
    uint8_t* codes = reinterpret_cast<uint8_t*>(p.q.codes) + (n * p.T) * (p.D * BITS / 8) + s * BITS;
    uint16_t* resid = p.resid + (n * p.T) * p.D + s * NC;
    for (int t = t0; t < t1; ++t) {
      const uint4 v = slab[t ^ sw];
      uint64_t word = 0;
      uint32_t r[NC];
      const uint32_t m = HK ? (uint32_t)om[(t - t0) * NT] : 0u;  // outlier channel bits
#pragma unroll
      for (int c = 0; c < NC; ++c) {
        const float xv = xc_of(gk_half(v, c), c, m);
        const uint32_t code = quant::quant_code(xv, qz[c], qi[c], maxq);
        word |= (uint64_t)code << (c * BITS);
        // NOTE: code * scale + zero as one FMA, as GearClampQuantResidKernel.
        const float d = xv - __fmaf_rn((float)code, qs[c], qz[c]);
        bool zero = !isfinite(d);
        // outliers: the entries step 4 stored (marked in omask)
        if constexpr (HK) zero = zero || ((m >> c) & 1u);
        r[c] = __half_as_ushort(__float2half_rn(zero ? 0.f : d));
      }
      uint4 o;
      o.x = r[0] | (r[1] << 16);
      o.y = r[2] | (r[3] << 16);
      o.z = r[4] | (r[5] << 16);
      o.w = r[6] | (r[7] << 16);
      *reinterpret_cast<uint4*>(resid + (int64_t)t * p.D) = o;
      uint8_t* cw = codes + (int64_t)t * (p.D * BITS / 8);
      if constexpr (BITS == 2) {
        *reinterpret_cast<uint16_t*>(cw) = (uint16_t)word;
      } else if constexpr (BITS == 4) {
        *reinterpret_cast<uint32_t*>(cw) = (uint32_t)word;
      } else {
        *reinterpret_cast<uint2*>(cw) = make_uint2((uint32_t)word, (uint32_t)(word >> 32));
      }
    }
  };
  if (k > 0)
    phase5(std::true_type{});
  else
    phase5(std::false_type{});
}

/// \brief Split path, step 5: outlier fill + per-channel group quantization + fp16 residual,
/// one block per group of G = kGearKeysQuantTokens * (blockDim.x / CPL) tokens of one matrix x
/// all D channels (the layout of quant::GroupQuantizePerChannelTileKernel: thread (s, kq)
/// holds channels kq * 8.. of tokens s + i S in registers; coalesced 16-byte loads and
/// residual stores).  HK (k > 0): the outliers are the entries with ck >= thr_top or
/// ck <= thr_bot (p.keys_sel of GearKeysKernel<.., true>; ck = orderable_key16(x) << 16 |
/// (0xffff - t) of the raw value); the group bounds are the min / max over the others (an
/// empty group: 0, 0), xc = DType(clamp(x, lo, hi)) at the outliers and x elsewhere, residual
/// 0 at the outliers; the finite check of x was done by the selection kernel.  !HK (k == 0): xc = x and the finite
/// check here.  Min / max, qparams and codes by the tile kernel's helpers (RawMinMax,
/// tile_group_qparams, quantize_pack: bit-identical to make_qparams / quant_code on xc), the
/// residual xc - fma(code, scale, zero) as GearKeysKernel's step 5 (0 where non-finite).
template <typename DType, int D, int BITS, bool HK>
__global__ void __launch_bounds__(512) GearKeysQuantResidKernel(GearParams p) {
  constexpr int TPT = kGearKeysQuantTokens, VE = 8, CPL = D / VE, W = D * BITS / 32;
  static_assert(sizeof(DType) == 2 && TPT == quant::kTileTokensPerThread, "16-bit tile layout");
  extern __shared__ __align__(16) unsigned char gkq_smem[];
  const int S = blockDim.x / CPL;  // token slices
  const int kq = threadIdx.x % CPL, s = threadIdx.x / CPL;
  const int64_t grp = blockIdx.x;  // n * (T / G) + g; its rows are [grp * G, grp * G + G)
  const int G = S * TPT;
  const int64_t n = grp / (p.T / G);
  const uint4* src = reinterpret_cast<const uint4*>(p.x) + (grp * G + s) * CPL + kq;
  uint4 raw[TPT];
#pragma unroll
  for (int i = 0; i < TPT; ++i) raw[i] = __ldcs(src + (int64_t)i * S * CPL);  // token s + i S
  uint32_t om[TPT / 4] = {};  // outlier bits: token i, channel c -> word i / 4, bit (i % 4) * 8 + c
  auto outlier = [&](int i, int c) { return ((om[i / 4] >> ((i % 4) * 8 + c)) & 1u) != 0u; };
  if constexpr (HK) {
    const uint32_t* ws = p.keys_sel + n * 2 * D + kq * VE;
    uint32_t tt[VE], tb[VE];
#pragma unroll
    for (int c = 0; c < VE; c += 4) {
      const uint4 e = *reinterpret_cast<const uint4*>(ws + c);
      const uint4 f = *reinterpret_cast<const uint4*>(ws + D + c);
      tt[c] = e.x, tt[c + 1] = e.y, tt[c + 2] = e.z, tt[c + 3] = e.w;
      tb[c] = f.x, tb[c + 1] = f.y, tb[c + 2] = f.z, tb[c + 3] = f.w;
    }
    const uint32_t t0 = (uint32_t)(grp * G - n * p.T) + (uint32_t)s;  // token of raw[0] in its matrix
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      const uint32_t tlow = 0xffffu - (t0 + (uint32_t)(i * S));
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const uint32_t k2 = gk_keys2(gk_word(raw[i], j));
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = 2 * j + h;
          const uint32_t ck = (((k2 >> (16 * h)) & 0xffffu) << 16) | tlow;
          if (ck >= tt[c] || ck <= tb[c]) om[i / 4] |= 1u << ((i % 4) * 8 + c);
        }
      }
    }
  }
  // group bounds: min / max over the non-outlier entries (HK: outliers replaced by a NaN,
  // which RawMinMax's min / max ignore, as fminf / fmaxf ignore NaN inliers)
  quant::RawMinMax<DType> mm;
  mm.init();
#pragma unroll
  for (int i = 0; i < TPT; ++i) {
    if constexpr (HK) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t x2 = gk_word(raw[i], j);
        if (outlier(i, 2 * j)) x2 = (x2 & 0xffff0000u) | 0x7fffu;
        if (outlier(i, 2 * j + 1)) x2 = (x2 & 0x0000ffffu) | 0x7fff0000u;
        w[j] = x2;
      }
      mm.update(make_uint4(w[0], w[1], w[2], w[3]));
    } else {
      mm.update(raw[i]);
    }
  }
  // qparams of the bounds (an empty group: of 0, 0), the bounds at qp + 3 D / 4 D (HK)
  const float* qp = quant::tile_group_qparams<DType, D, BITS, true, HK>(mm, S, gkq_smem, p.q.scale + grp * D,
                                                                        p.q.zero + grp * D);
  if constexpr (HK) {  // xc: outliers clamped into the group bounds (gear_clamp_cpu), inliers x
    float lo[VE], hi[VE];
#pragma unroll
    for (int c = 0; c < VE; ++c) {
      lo[c] = qp[3 * D + kq * VE + c];
      hi[c] = qp[4 * D + kq * VE + c];
    }
#pragma unroll
    for (int i = 0; i < TPT; ++i) {
      uint32_t w[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t x2 = gk_word(raw[i], j);
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int c = 2 * j + h;
          if (outlier(i, c)) {
            DType d;
            d.bits = (uint16_t)(x2 >> (16 * h));
            const uint32_t xb = from_float<DType>(fminf(fmaxf(to_float(d), lo[c]), hi[c])).bits;
            x2 = (x2 & ~(0xffffu << (16 * h))) | (xb << (16 * h));
          }
        }
        w[j] = x2;
      }
      raw[i] = make_uint4(w[0], w[1], w[2], w[3]);  // xc from here on
    }
  }
  float z[VE], inv[VE], sc[VE];
  quant::load_qp<VE>(qp, qp + D, kq, z, inv);
#pragma unroll
  for (int c = 0; c < VE; c += 4) {
    const float4 a = *reinterpret_cast<const float4*>(qp + 2 * D + kq * VE + c);
    sc[c] = a.x, sc[c + 1] = a.y, sc[c + 2] = a.z, sc[c + 3] = a.w;
  }
  const bool check = !HK && p.status != nullptr;
  int32_t status = 0;
  int32_t* codes = p.q.codes + (grp * G + s) * W;
  uint4* resid = reinterpret_cast<uint4*>(p.resid) + (grp * G + s) * CPL + kq;
#pragma unroll
  for (int i = 0; i < TPT; ++i) {
    uint32_t w[quant::PackShape<DType, BITS>::NW];
    quant::quantize_pack<DType, BITS>(raw[i], z, inv, check, status, w);
    quant::store_packed<DType, BITS>(w, codes + (int64_t)i * S * W, kq);
    uint32_t r[VE];
#pragma unroll
    for (int c = 0; c < VE; ++c) {
      DType h;
      h.bits = (uint16_t)gk_half(raw[i], c);
      const float xv = to_float(h);
      const uint32_t code = quant::packed_code<DType, BITS>(w, c);
      // NOTE: code * scale + zero as one FMA, as GearKeysKernel's step 5.
      const float d = xv - __fmaf_rn((float)code, sc[c], z[c]);
      bool zero = !isfinite(d);
      if constexpr (HK) zero = zero || outlier(i, c);
      r[c] = __half_as_ushort(__float2half_rn(zero ? 0.f : d));
    }
    resid[(int64_t)i * S * CPL] = make_uint4(r[0] | (r[1] << 16), r[2] | (r[3] << 16), r[4] | (r[5] << 16),
                                             r[6] | (r[7] << 16));
  }
  if (check) quant::report_status(p.status, status);
}

template <typename DType, int BITS, int D>
cudaError_t GearKeysLaunchQuantResid(const GearParams& p, const GearKeysPlan& pl, cudaStream_t stream) {
  const unsigned blocks = (unsigned)(p.N * p.T / p.q.group);
  // exchange + qp (zero, inv, scale; with outliers also the group bounds)
  const size_t smem = 2 * (size_t)pl.qthreads * 16 + (p.k > 0 ? 5 : 3) * D * sizeof(float);
  if (p.k > 0)
    GearKeysQuantResidKernel<DType, D, BITS, true><<<blocks, pl.qthreads, smem, stream>>>(p);
  else
    GearKeysQuantResidKernel<DType, D, BITS, false><<<blocks, pl.qthreads, smem, stream>>>(p);
  return cudaGetLastError();
}

/// \brief Launch GearKeysKernel (pl = gear_keys_plan(...) with pl.ok); pl.split: the
/// selection-only GearKeysKernel (k > 0, needs p.keys_sel) + GearKeysQuantResidKernel.
template <typename DType, int BITS>
cudaError_t GearKeysCompress(const GearParams& p, const GearKeysPlan& pl, cudaStream_t stream) {
  if (!pl.ok) return cudaErrorInvalidValue;
  const dim3 grid((unsigned)(p.D / kGearKeysChannels), (unsigned)p.N);
  if (pl.split) {
    if (p.k > 0) {
      if (p.keys_sel == nullptr) return cudaErrorInvalidValue;
      static const cudaError_t attr = cudaFuncSetAttribute(
          GearKeysKernel<DType, BITS, true>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
      if (attr != cudaSuccess) return attr;
      GearKeysKernel<DType, BITS, true><<<grid, kGearKeysThreads, pl.smem, stream>>>(p, pl);
      const cudaError_t e = cudaGetLastError();
      if (e != cudaSuccess) return e;
    }
    switch (p.D) {
      case 32: return GearKeysLaunchQuantResid<DType, BITS, 32>(p, pl, stream);
      case 64: return GearKeysLaunchQuantResid<DType, BITS, 64>(p, pl, stream);
      case 128: return GearKeysLaunchQuantResid<DType, BITS, 128>(p, pl, stream);
      case 256: return GearKeysLaunchQuantResid<DType, BITS, 256>(p, pl, stream);
      default: return cudaErrorInvalidValue;
    }
  }
  static const cudaError_t attr = cudaFuncSetAttribute(
      GearKeysKernel<DType, BITS>, cudaFuncAttributeMaxDynamicSharedMemorySize, 200 * 1024);
  if (attr != cudaSuccess) return attr;
  GearKeysKernel<DType, BITS><<<grid, kGearKeysThreads, pl.smem, stream>>>(p, pl);
  return cudaGetLastError();
}

}  // namespace gear
}  // namespace kvq
