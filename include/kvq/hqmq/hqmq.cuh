// CUDA kernels of HQMQ encode/decode.  Torch-free.  Format and arithmetic: hqmq.h.
//
// Thread mapping (encode and decode): a block works on one row group n (one KV head's
// secondary set, copied once into shared memory as float4) and a tile of TOKENS_PER_BLOCK
// tokens.  Within a warp, a token is handled by LPT lanes, each owning CPT consecutive
// chunks (C = LPT * CPT: D=32 -> 8x1, D=64 -> 16x1, D=128 -> 32x1, D=256 -> 32x2), loaded
// with one 8/16/32-byte vector load.  Row reductions (radius scale, outlier mask) are xor
// shuffles inside the LPT-lane group.  Each lane searches the S secondary quaternions for its
// chunks (S products, broadcast reads of shared memory); the fields are staged in a per-warp
// shared buffer and lane j of the token's LPT lanes assembles units j, j + LPT, ... of the
// packed row.
#pragma once
#include <cuda_runtime.h>

#include "kvq/common/half.h"
#include "kvq/hqmq/hqmq.h"

namespace kvq {
namespace hqmq {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kThreads = 256;
constexpr int kTokensPerBlock = 64;

template <typename T, int N>
struct alignas(sizeof(T) * N) VecT {
  T v[N];
};

// ---------------------------------------------------------------------------
// Tensor-core search (S <= kTcMaxSecondary).  Exact: the CPU op's codeword is found.
//
// Phase 1 (approximate, all S): for a tile of 32 chunks (two m16 tiles) and a group of 4
// secondaries, two mma.sync m16n8k8 tf32 give four linear forms of v = u . conj(s) per
// (chunk, secondary): p = v0 + v1, q = v0 - v1, r = v2 + v3, w = v2 - v3 (the columns of the
// B operand are the forms' coefficient vectors, split hi + lo in tf32 over k = 8; A = [u, u],
// exact in tf32 for fp16/bf16 input).  Twice the Hurwitz score is then
//   max(max(|p|,|q|) + max(|r|,|w|), |p| + |q|, |r| + |w|)   (|v0|+|v1| = max(|p|,|q|),
//   2 max(|v0|,|v1|) = |p| + |q|), i.e. 3 FADD + 4 FMNMX, and 1 FMNMX keeps its bucket's max.
//   Lane t of a quad (the C fragment's columns 2t, 2t+1) owns secondaries [t Q, (t+1) Q),
//   Q = S_pad / 4, in kTcBuckets buckets of G = S_pad / 32 consecutive secondaries: bucket
//   b = 8 t + j covers s in [b G, (b+1) G).
// Phase 2 (exact, the chunk's owner lane): every bucket whose approximate max is within T of
// the chunk's best approximate score is searched with the CPU op's arithmetic (mul_conj,
// hurwitz_score, first maximum in ascending s).  T = 2 E, where E bounds |approx - 2 cpu
// score| for every secondary (tf32 rounding of u and of the coefficients, tensor-core
// accumulation, the CPU op's own fp32 rounding; see tc_threshold), so the CPU op's argmax
// (and every s tied with it) lies in a searched bucket.  Non-finite or extreme chunks get
// T = inf (all buckets: the CPU loop itself); all-zero chunks take s = 0 directly, as the
// CPU op does (every score is 0).
// ---------------------------------------------------------------------------
constexpr int kTcBuckets = 8;          // buckets per lane; 32 per chunk (one uint32 mask)
constexpr int kTcMaxSecondary = 512;   // fragments: S_pad * 128 bytes of shared memory

/// \brief G = secondaries per bucket; S_pad = 32 G.
KVQ_HOST_DEVICE int hqmq_tc_bucket(int64_t S) { return (int)((S + 31) / 32); }

__device__ __forceinline__ float to_tf32(float x) {
  uint32_t r;
  asm("cvt.rna.tf32.f32 %0, %1;\n" : "=r"(r) : "f"(x));
  return __uint_as_float(r);
}

/// \brief d = A (16 x 8: rows g, g + 8 in a[0], a[1]; a[2], a[3] = k + 4) * B (8 x 8), tf32.
/// The kernel passes A = [tf32_rna(u), tf32_rz(u)] (equal for fp16/bf16 input): two distinct
/// values, so the compiler keeps the 4-register operand tuple live across the search loop
/// instead of re-copying a duplicated register every iteration.
__device__ __forceinline__ void mma_tf32_1688(float (&d)[4], const uint32_t (&a)[4], float b0,
                                              float b1) {
  asm("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%10,%10,%10,%10};\n"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(__float_as_uint(b0)),
        "r"(__float_as_uint(b1)), "f"(0.f));
}

/// \brief Twice the Hurwitz score from the forms p, q, r, w (see above) is the maximum of the
/// three non-negative values t[0] = max(|p|,|q|) + max(|r|,|w|), t[1] = |p| + |q|,
/// t[2] = |r| + |w|, returned as fp32 bit patterns (non-negative floats order as unsigned
/// integers, so a running maximum takes two new values per 3-input VIMNMX3).
__device__ __forceinline__ void tc_score2_terms(float p, float q, float r, float w,
                                                uint32_t (&t)[3]) {
  t[0] = __float_as_uint(fmaxf(fabsf(p), fabsf(q)) + fmaxf(fabsf(r), fabsf(w)));
  t[1] = __float_as_uint(fabsf(p) + fabsf(q));
  t[2] = __float_as_uint(fabsf(r) + fabsf(w));
}

/// \brief Coefficients of u_i (i = 0..3) in the forms p or q (odd) and r or w (odd) of
/// v = u . conj(s): row i of v's coefficient matrix, then sums/differences of its columns.
KVQ_HOST_DEVICE void tc_form_coeffs(float s0, float s1, float s2, float s3, int i, bool odd,
                                    float& c_pq, float& c_rw) {
  // coefficients of u_i in v0, v1, v2, v3 (mul_conj)
  float m0, m1, m2, m3;
  if (i == 0) { m0 = s0; m1 = -s1; m2 = -s2; m3 = -s3; }
  else if (i == 1) { m0 = s1; m1 = s0; m2 = s3; m3 = -s2; }
  else if (i == 2) { m0 = s2; m1 = -s3; m2 = s0; m3 = s1; }
  else { m0 = s3; m1 = s2; m2 = -s1; m3 = s0; }
  c_pq = odd ? add_rn(m0, -m1) : add_rn(m0, m1);
  c_rw = odd ? add_rn(m2, -m3) : add_rn(m2, m3);
}

/// \brief tf32 by truncation (round toward zero): clear the 13 low mantissa bits.
__device__ __forceinline__ float tf32_rz(float x) {
  return __uint_as_float(__float_as_uint(x) & 0xffffe000u);
}

/// \brief Candidate margin T (in units of twice the score) for a chunk, or +inf for a chunk
/// that must be searched in full.  For unit secondaries, E = 4 d + 2^-14 |u|_1 bounds
/// |approx - 2 cpu| for every secondary, d = |u - tf32_rz(u)|_1 >= |u - tf32_rna(u)|_1 (0 for
/// fp16/bf16 input; either rounding of u may meet either half of the coefficient split): the
/// forms' coefficients are <= sqrt(2) and twice the score adds two forms, so the input
/// rounding costs <= 2 sqrt(2) d; the tf32 hi + lo split of the coefficients <= 2^-20 |u|_1;
/// tensor-core accumulation (exact products, truncating alignment: <= 2^-18 |u|_1) is
/// allowed 2^-15; the fp32 adds of tc_score2 <= 2^-21; the CPU op's own rounding of twice
/// its score <= 2^-19.  Every term scales with the secondaries' magnitude: nu = max(1,
/// max_s |s|_2) (NaN/Inf: full search).  T = 2 E: the CPU op's best secondary s* (and any
/// tied with it) has approx(s*) >= 2 cpu(s*) - E >= 2 cpu(s') - E >= approx(s') - 2 E for
/// the approximate best s'.
__device__ __forceinline__ float tc_threshold(float x0, float x1, float x2, float x3, float nu) {
  const float l1 = (fabsf(x0) + fabsf(x1)) + (fabsf(x2) + fabsf(x3));
  const float d1 = (fabsf(x0 - tf32_rz(x0)) + fabsf(x1 - tf32_rz(x1))) +
                   (fabsf(x2 - tf32_rz(x2)) + fabsf(x3 - tf32_rz(x3)));
  const float size = l1 * nu;
  const bool ok = size >= 0x1p-100f && size <= 0x1p100f;  // false for NaN / Inf
  return ok ? fmaf(8.f, d1, l1 * 0x1p-13f) * nu : INFINITY;
}

/// \brief The CPU op's search restricted to the buckets in mask (bucket b: s in [b G, (b+1) G)),
/// in ascending s: the first maximum of hurwitz_score over the searched secondaries.
__device__ __forceinline__ void tc_search_buckets(const float (&x)[4], const float4* s_sec, int S,
                                                  int G, uint32_t mask, float& best, int& bs) {
  best = -1.f;
  bs = 0;
  while (mask) {
    const int b = __ffs(mask) - 1;
    mask &= mask - 1;
    const int s_end = min((b + 1) * G, S);
    for (int s = b * G; s < s_end; ++s) {
      const float4 q = s_sec[s];
      float v0, v1, v2, v3;
      mul_conj(x[0], x[1], x[2], x[3], q.x, q.y, q.z, q.w, v0, v1, v2, v3);
      const float sc = hurwitz_score(v0, v1, v2, v3);
      if (sc > best) {
        best = sc;
        bs = s;
      }
    }
  }
}

template <typename DType, int CPT, int LPT, bool TC>
__global__ void __launch_bounds__(kThreads, TC ? 2 : 1) HqmqEncodeKernel(HqmqParams p) {
  extern __shared__ float4 smem[];
  __shared__ uint32_t s_nu;  // TC: bits of max_s |s|_2 (>= 0: ordered as unsigned)
  constexpr int C = CPT * LPT;
  constexpr int TPW = 32 / LPT;  // tokens per warp and iteration
  constexpr int WC = 32 * CPT;   // chunks per warp and iteration
  const int G = TC ? hqmq_tc_bucket(p.S) : 0;
  const int Q = kTcBuckets * G;  // groups of 4 secondaries (TC)
  float4* s_frag = smem;                                   // TC: [Q][32 lanes]
  float4* s_sec = smem + (TC ? 32 * Q : 0);                // [S]
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  float4* s_u = s_sec + p.S + warp * WC;                   // TC: [WC] this warp's chunks
  uint32_t* s_words = reinterpret_cast<uint32_t*>(s_sec + p.S + (TC ? nwarps * WC : 0));
  float* s_thr = reinterpret_cast<float*>(s_words + warp * 4 * WC);  // TC: [WC] margins T
  uint32_t* s_cand = s_words + warp * 4 * WC + WC;                    // TC: [WC] bucket masks
  float* s_m1 = reinterpret_cast<float*>(s_words + warp * 4 * WC + 2 * WC);  // TC: [WC]
  uint32_t* s_fields = TC ? s_words + warp * 4 * WC + 3 * WC : s_words + warp * WC;
  const int g = lane / LPT, l = lane % LPT;
  uint32_t* fields = s_fields + g * C;  // this token's C fields
  const int RB = p.radius_bits, U = p.row.units;
  const float maxq = (float)((1 << RB) - 1);
  const bool has_thr = p.threshold != nullptr;
  const int64_t S = p.S;
  const DType* x = static_cast<const DType*>(p.x);
  int32_t status = 0;

  const int64_t t_begin = (int64_t)blockIdx.x * kTokensPerBlock;
  const int64_t t_end = min(p.T, t_begin + kTokensPerBlock);
  for (int64_t n = blockIdx.y; n < p.N; n += gridDim.y) {
    const int64_t h = n % p.H;
    __syncthreads();  // the previous head's readers of s_sec / s_frag / s_nu are done
    if (TC && threadIdx.x == 0) s_nu = 0u;
    const float4* sec_g = reinterpret_cast<const float4*>(p.secondary) + h * S;
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) s_sec[i] = sec_g[i];
    __syncthreads();
    float nu = 1.f;
    if (TC) {
      // B fragments (from the staged secondaries): lane (gg, tt) of group grp holds column gg
      // of both mma's B: secondary grp + (gg / 2) Q, form gg % 2 (p/q, then r/w), rows tt (hi)
      // and tt + 4 (lo).
      for (int e = threadIdx.x; e < 32 * Q; e += blockDim.x) {
        const int grp = e >> 5, gg = (e & 31) >> 2, tt = e & 3;
        const int64_t s = grp + (int64_t)(gg >> 1) * Q;
        float4 f = make_float4(0.f, 0.f, 0.f, 0.f);
        if (s < S) {
          const float4 q = s_sec[s];
          float c_pq, c_rw;
          tc_form_coeffs(q.x, q.y, q.z, q.w, tt, gg & 1, c_pq, c_rw);
          f.x = to_tf32(c_pq);
          f.y = to_tf32(c_pq - f.x);
          f.z = to_tf32(c_rw);
          f.w = to_tf32(c_rw - f.z);
        }
        s_frag[e] = f;
      }
      float m = 0.f;
      for (int64_t i = threadIdx.x; i < S; i += blockDim.x) {
        const float4 q = s_sec[i];
        m = fmaxf(m, sqrtf(q.x * q.x + q.y * q.y + q.z * q.z + q.w * q.w));
        if (q.x != q.x || q.y != q.y || q.z != q.z || q.w != q.w) m = INFINITY;
      }
      atomicMax(&s_nu, __float_as_uint(m));
      __syncthreads();
      nu = fmaxf(1.f, __uint_as_float(s_nu));
    }
    const float thr = has_thr ? p.threshold[h] : INFINITY;

    // Warp-uniform loop: every lane runs every iteration (shuffles need all 32 lanes).
    for (int64_t t0 = t_begin + (int64_t)warp * TPW; t0 < t_end; t0 += (int64_t)nwarps * TPW) {
      const int64_t t = t0 + g;
      const bool valid = t < t_end;
      const int64_t row = n * p.T + t;
      float xc[CPT][4];
      if (valid) {
        VecT<DType, 4 * CPT> d =
            reinterpret_cast<const VecT<DType, 4 * CPT>*>(x + row * p.D)[l];
#pragma unroll
        for (int k = 0; k < CPT; ++k)
#pragma unroll
          for (int i = 0; i < 4; ++i) xc[k][i] = to_float(d.v[4 * k + i]);
      } else {
#pragma unroll
        for (int k = 0; k < CPT; ++k)
#pragma unroll
          for (int i = 0; i < 4; ++i) xc[k][i] = 0.f;
      }
      float r[CPT];
      bool outl[CPT];
      float rmax = 0.f;
      uint64_t mask = 0;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        if (p.status) {
#pragma unroll
          for (int i = 0; i < 4; ++i) status |= value_status(xc[k][i]);
        }
        r[k] = chunk_norm(xc[k][0], xc[k][1], xc[k][2], xc[k][3]);
        outl[k] = has_thr && r[k] > thr;
        if (outl[k]) mask |= (uint64_t)1 << (l * CPT + k);
        else rmax = fmaxf(rmax, r[k]);
      }
#pragma unroll
      for (int o = 1; o < LPT; o <<= 1) rmax = fmaxf(rmax, __shfl_xor_sync(kFullMask, rmax, o));
      if (has_thr) {
        uint32_t lo = (uint32_t)mask, hi = (uint32_t)(mask >> 32);
#pragma unroll
        for (int o = 1; o < LPT; o <<= 1) {
          lo |= __shfl_xor_sync(kFullMask, lo, o);
          hi |= __shfl_xor_sync(kFullMask, hi, o);
        }
        mask = (uint64_t)lo | ((uint64_t)hi << 32);
      }
      const uint32_t scode = scale_code(rmax, p.row.scale_bits);
      const float step = div_rn(half_bits_to_float((uint16_t)(scode << (15 - p.row.scale_bits))), maxq);
      if (p.status && valid && rmax > kMaxScale) status |= kStatusOutOfRange;

      // Nearest codeword.
      int bs[CPT];
      if (TC) {
        // Chunk k of this lane is row lane of tile k (s_u[lane * CPT + k]).
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
          s_u[lane * CPT + k] = make_float4(xc[k][0], xc[k][1], xc[k][2], xc[k][3]);
          s_thr[lane * CPT + k] = tc_threshold(xc[k][0], xc[k][1], xc[k][2], xc[k][3], nu);
        }
        __syncwarp();
        const int gq = lane >> 2, tq = lane & 3;
        const float* s_uf = reinterpret_cast<const float*>(s_u);
        uint8_t* s_candb = reinterpret_cast<uint8_t*>(s_cand);
#pragma unroll 1
        for (int k = 0; k < CPT; ++k) {
          // rows of the two m16 tiles: gq, gq + 8, 16 + gq, 24 + gq
          uint32_t a[2][4];
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const float u = s_uf[((16 * mt + 8 * hh + gq) * CPT + k) * 4 + tq];
              a[mt][hh] = __float_as_uint(to_tf32(u));          // k = tq: round to nearest
              a[mt][2 + hh] = __float_as_uint(tf32_rz(u));      // k = tq + 4: truncated
            }
          // bmax: per row, bucket maxima of twice the score as fp32 bits.  Two groups per
          // step: 6 terms per row merged with 3 VIMNMX3.
          uint32_t bmax[2][2][kTcBuckets];
          const float4* fr = s_frag + lane;
#pragma unroll
          for (int j = 0; j < kTcBuckets; ++j) {
#pragma unroll
            for (int mt = 0; mt < 2; ++mt)
#pragma unroll
              for (int hh = 0; hh < 2; ++hh) bmax[mt][hh][j] = 0u;
            const float4* const fend = fr + 32 * G;
#pragma unroll 1
            for (; fr + 32 < fend; fr += 64) {
              const float4 b0 = fr[0], b1 = fr[32];
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                float c1[4], c2[4], d1[4], d2[4];
                mma_tf32_1688(c1, a[mt], b0.x, b0.y);  // p, q
                mma_tf32_1688(c2, a[mt], b0.z, b0.w);  // r, w
                mma_tf32_1688(d1, a[mt], b1.x, b1.y);
                mma_tf32_1688(d2, a[mt], b1.z, b1.w);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                  uint32_t t0[3], t1[3];
                  tc_score2_terms(c1[2 * hh], c1[2 * hh + 1], c2[2 * hh], c2[2 * hh + 1], t0);
                  tc_score2_terms(d1[2 * hh], d1[2 * hh + 1], d2[2 * hh], d2[2 * hh + 1], t1);
                  uint32_t& m = bmax[mt][hh][j];
                  m = __vimax3_u32(m, t0[0], t0[1]);
                  m = __vimax3_u32(m, t0[2], t1[0]);
                  m = __vimax3_u32(m, t1[1], t1[2]);
                }
              }
            }
            if (fr != fend) {  // odd G: one group left
              const float4 b0 = fr[0];
              fr += 32;
#pragma unroll
              for (int mt = 0; mt < 2; ++mt) {
                float c1[4], c2[4];
                mma_tf32_1688(c1, a[mt], b0.x, b0.y);
                mma_tf32_1688(c2, a[mt], b0.z, b0.w);
#pragma unroll
                for (int hh = 0; hh < 2; ++hh) {
                  uint32_t t0[3];
                  tc_score2_terms(c1[2 * hh], c1[2 * hh + 1], c2[2 * hh], c2[2 * hh + 1], t0);
                  uint32_t& m = bmax[mt][hh][j];
                  m = __vimax3_u32(m, t0[0], t0[1]);
                  m = max(m, t0[2]);
                }
              }
            }
          }
#pragma unroll
          for (int mt = 0; mt < 2; ++mt)
#pragma unroll
            for (int hh = 0; hh < 2; ++hh) {
              const int c = (16 * mt + 8 * hh + gq) * CPT + k;
              uint32_t mb = bmax[mt][hh][0];
#pragma unroll
              for (int j = 1; j + 1 < kTcBuckets; j += 2)
                mb = __vimax3_u32(mb, bmax[mt][hh][j], bmax[mt][hh][j + 1]);
              if (kTcBuckets % 2 == 0) mb = max(mb, bmax[mt][hh][kTcBuckets - 1]);
              mb = max(mb, __shfl_xor_sync(kFullMask, mb, 1));
              mb = max(mb, __shfl_xor_sync(kFullMask, mb, 2));
              const float m1 = __uint_as_float(mb);
              if (tq == 0) s_m1[c] = m1;
              const float lim = m1 - s_thr[c];
              // bit j = !(bmax_j < lim): sign bits of bmax_j - lim funnelled in, then inverted
              // (lim = -inf: +inf.  Chunks with T = inf search all buckets anyway, below.)
              uint32_t neg = 0;
#pragma unroll
              for (int j = kTcBuckets - 1; j >= 0; --j)
                neg = __funnelshift_l(__float_as_uint(__uint_as_float(bmax[mt][hh][j]) - lim), neg, 1);
              const uint32_t bits = ~neg & ((1u << kTcBuckets) - 1u);
              s_candb[4 * c + tq] = (uint8_t)bits;  // bucket 8 tq + j of chunk c
            }
        }
        __syncwarp();
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
          bs[k] = 0;
          const bool zero = (xc[k][0] == 0.f && xc[k][1] == 0.f && xc[k][2] == 0.f &&
                             xc[k][3] == 0.f);  // every score is 0: the CPU op picks s = 0
          if (!valid || outl[k] || zero) continue;
          // T = inf (non-finite or extreme chunk): every bucket, i.e. the CPU op's loop
          const int c = lane * CPT + k;
          const float tc = s_thr[c];
          float best;
          tc_search_buckets(xc[k], s_sec, (int)S, G, tc == INFINITY ? ~0u : s_cand[c], best, bs[k]);
          // Guard: the searched best must agree with the approximate maximum to within E = T/2
          // (it does whenever the error bound holds); otherwise search every bucket.
          if (tc != INFINITY && !(fabsf(2.f * best - s_m1[c]) <= 0.5f * tc))
            tc_search_buckets(xc[k], s_sec, (int)S, G, ~0u, best, bs[k]);
        }
      } else {
        float best[CPT];
#pragma unroll
        for (int k = 0; k < CPT; ++k) {
          best[k] = -1.f;
          bs[k] = 0;
        }
#pragma unroll 4
        for (int s = 0; s < (int)S; ++s) {
          const float4 q = s_sec[s];
#pragma unroll
          for (int k = 0; k < CPT; ++k) {
            float v0, v1, v2, v3;
            mul_conj(xc[k][0], xc[k][1], xc[k][2], xc[k][3], q.x, q.y, q.z, q.w, v0, v1, v2, v3);
            const float sc = hurwitz_score(v0, v1, v2, v3);
            if (sc > best[k]) {
              best[k] = sc;
              bs[k] = s;
            }
          }
        }
      }
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        const float4 q = s_sec[bs[k]];
        float v0, v1, v2, v3;
        mul_conj(xc[k][0], xc[k][1], xc[k][2], xc[k][3], q.x, q.y, q.z, q.w, v0, v1, v2, v3);
        const uint32_t dir = (uint32_t)(bs[k] * kHurwitzUnits + hurwitz_nearest(v0, v1, v2, v3));
        fields[l * CPT + k] = outl[k] ? 0u : ((dir << RB) | radius_code(r[k], step, maxq));
      }
      __syncwarp();
      if (valid) {
        uint16_t* units = reinterpret_cast<uint16_t*>(p.codes) + row * U;
        for (int j = l; j < U; j += LPT) units[j] = assemble_unit(fields, p.row, scode, j);
        if (l == 0 && has_thr) {
          p.flag_mask[row] = (int64_t)mask;
          p.flag_count[row] = __popcll(mask);
        }
      }
      __syncwarp();  // fields, s_u, s_thr, s_cand are rewritten in the next iteration
    }
  }
  if (p.status) {
    const int32_t any = __reduce_or_sync(kFullMask, status);
    if (any && lane == 0) atomicOr(p.status, any);
  }
}

/// \brief One thread per row: write the row's outlier records at p.offsets[row].
template <typename DType>
__global__ void HqmqWriteRecordsKernel(HqmqParams p) {
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t rows = p.N * p.T;
  for (int64_t row = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; row < rows;
       row += (int64_t)gridDim.x * blockDim.x) {
    uint64_t mask = (uint64_t)p.flag_mask[row];
    if (!mask) continue;
    int64_t k = p.offsets[row];
    const int64_t n = row / p.T, t = row % p.T;
    while (mask) {
      const int c = __ffsll((long long)mask) - 1;
      mask &= mask - 1;
      const DType* xc = x + row * p.D + 4 * c;
      int32_t rec[4];
      make_record(t, n, c, to_float(xc[0]), to_float(xc[1]), to_float(xc[2]), to_float(xc[3]),
                  rec);
      reinterpret_cast<int4*>(p.outliers)[k] = make_int4(rec[0], rec[1], rec[2], rec[3]);
      ++k;
    }
  }
}

template <typename DType, int CPT, int LPT>
__global__ void __launch_bounds__(kThreads) HqmqDecodeKernel(HqmqParams p) {
  extern __shared__ float4 smem[];
  constexpr int TPW = 32 / LPT;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int nwarps = blockDim.x >> 5;
  const int g = lane / LPT, l = lane % LPT;
  const int RB = p.radius_bits, U = p.row.units;
  const float maxq = (float)((1 << RB) - 1);
  const int64_t S = p.S;
  DType* out = static_cast<DType*>(p.out);
  const float* s_sec = reinterpret_cast<const float*>(smem);

  const int64_t t_begin = (int64_t)blockIdx.x * kTokensPerBlock;
  const int64_t t_end = min(p.T, t_begin + kTokensPerBlock);
  for (int64_t n = blockIdx.y; n < p.N; n += gridDim.y) {
    const int64_t h = n % p.H;
    __syncthreads();
    const float4* sec_g = reinterpret_cast<const float4*>(p.secondary) + h * S;
    for (int64_t i = threadIdx.x; i < S; i += blockDim.x) smem[i] = sec_g[i];
    __syncthreads();
    for (int64_t t0 = t_begin + (int64_t)warp * TPW; t0 < t_end; t0 += (int64_t)nwarps * TPW) {
      const int64_t t = t0 + g;
      if (t >= t_end) continue;  // no shuffles below
      const int64_t row = n * p.T + t;
      const uint16_t* units = reinterpret_cast<const uint16_t*>(p.codes) + row * U;
      const float step = div_rn(half_bits_to_float(read_scale(units, p.row)), maxq);
      VecT<DType, 4 * CPT> d;
#pragma unroll
      for (int k = 0; k < CPT; ++k) {
        float o[4];
        decode_chunk(read_field(units, p.row, l * CPT + k), RB, step, s_sec, S, o);
#pragma unroll
        for (int i = 0; i < 4; ++i) d.v[4 * k + i] = from_float<DType>(o[i]);
      }
      reinterpret_cast<VecT<DType, 4 * CPT>*>(out + row * p.D)[l] = d;
    }
  }
}

/// \brief One thread per record: overwrite the outlier chunk (out-of-range records skipped).
template <typename DType>
__global__ void HqmqApplyRecordsKernel(HqmqParams p) {
  DType* out = static_cast<DType*>(p.out);
  for (int64_t k = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; k < p.num_outliers;
       k += (int64_t)gridDim.x * blockDim.x) {
    const int4 rv = reinterpret_cast<const int4*>(p.outliers)[k];
    const int32_t rec[4] = {rv.x, rv.y, rv.z, rv.w};
    if (!record_valid(rec, p)) continue;
    const int64_t t = rec[0], n = (int64_t)((uint32_t)rec[1] >> 8), c = rec[1] & 0xff;
    VecT<DType, 4> d;
    const uint32_t a = (uint32_t)rec[2], b = (uint32_t)rec[3];
    d.v[0] = from_float<DType>(half_bits_to_float((uint16_t)(a & 0xffffu)));
    d.v[1] = from_float<DType>(half_bits_to_float((uint16_t)(a >> 16)));
    d.v[2] = from_float<DType>(half_bits_to_float((uint16_t)(b & 0xffffu)));
    d.v[3] = from_float<DType>(half_bits_to_float((uint16_t)(b >> 16)));
    reinterpret_cast<VecT<DType, 4>*>(out + (n * p.T + t) * p.D)[c] = d;
  }
}

// ---------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------
inline dim3 hqmq_grid(const HqmqParams& p) {
  const int64_t tiles = (p.T + kTokensPerBlock - 1) / kTokensPerBlock;
  const int64_t ny = p.N < 65535 ? p.N : 65535;
  return dim3((unsigned)tiles, (unsigned)ny, 1);
}

/// \brief Shared memory of the encode kernel (TC: fragments, secondaries, per-warp chunks,
/// margins, candidate masks, approximate maxima and fields; otherwise secondaries and fields).
inline size_t hqmq_encode_smem(int64_t S, int CPT, bool tc) {
  const size_t wc = 32 * (size_t)CPT, warps = kThreads / 32;
  if (!tc) return (size_t)S * sizeof(float4) + warps * wc * sizeof(uint32_t);
  const size_t q = (size_t)kTcBuckets * hqmq_tc_bucket(S);
  return (32 * q + (size_t)S) * sizeof(float4) + warps * wc * (sizeof(float4) + 4 * sizeof(uint32_t));
}

/// \brief Dense encode (packed rows, outlier mask/count scratch).  C = CPT * LPT chunks.
/// S <= kTcMaxSecondary: tensor-core search (exact); larger S: the fp32 S-way loop.
template <typename DType, int CPT, int LPT>
cudaError_t HqmqEncode(const HqmqParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  if (p.S <= kTcMaxSecondary) {
    static const cudaError_t attr = cudaFuncSetAttribute(
        HqmqEncodeKernel<DType, CPT, LPT, true>, cudaFuncAttributeMaxDynamicSharedMemorySize,
        (int)hqmq_encode_smem(kTcMaxSecondary, CPT, true));
    if (attr != cudaSuccess) return attr;
    HqmqEncodeKernel<DType, CPT, LPT, true>
        <<<hqmq_grid(p), kThreads, hqmq_encode_smem(p.S, CPT, true), stream>>>(p);
  } else {
    HqmqEncodeKernel<DType, CPT, LPT, false>
        <<<hqmq_grid(p), kThreads, hqmq_encode_smem(p.S, CPT, false), stream>>>(p);
  }
  return cudaGetLastError();
}

/// \brief Outlier records (after p.offsets has been computed from p.flag_count).
template <typename DType>
cudaError_t HqmqWriteRecords(const HqmqParams& p, cudaStream_t stream) {
  const int64_t rows = p.N * p.T;
  if (rows == 0 || p.num_outliers == 0) return cudaSuccess;
  int64_t blocks = (rows + 255) / 256;
  if (blocks > 65535) blocks = 65535;
  HqmqWriteRecordsKernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

/// \brief Decode (dense part, then the outlier records, in stream order).
template <typename DType, int CPT, int LPT>
cudaError_t HqmqDecode(const HqmqParams& p, cudaStream_t stream) {
  if (p.N * p.T == 0) return cudaSuccess;
  const size_t smem = (size_t)p.S * sizeof(float4);
  HqmqDecodeKernel<DType, CPT, LPT><<<hqmq_grid(p), kThreads, smem, stream>>>(p);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess || p.num_outliers == 0) return err;
  int64_t blocks = (p.num_outliers + 255) / 256;
  if (blocks > 65535) blocks = 65535;
  HqmqApplyRecordsKernel<DType><<<(unsigned)blocks, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace hqmq
}  // namespace kvq
