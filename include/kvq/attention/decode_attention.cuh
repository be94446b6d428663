// Fused decode attention over a group-quantized KV cache + full-precision residual.
// Torch-free.  Flash-decoding: the token axis is split over CTAs (one (batch, KV head)
// per CTA row), each warp runs its own online softmax over 32-token tiles, the CTA merges
// its warps, and a small combine kernel merges the splits.
//
// Tensor-core path (tokens quantized in both K and V, the bulk of a long cache):
//   scores  S[h, t]  = mma(A = q / max|q| (heads x channels), B = K^T (channels x tokens))
//   output  O[h, d] += mma(A = P (heads x tokens), B = V (tokens x channels))
// K and V B-fragments are built in registers straight from the packed codes: one shift +
// LOP3 turns two codes of a 32-bit word into an fp16x2 pair (magic 0x6400 trick), one
// HFMA2 applies scale and zero.  Because the QK reduction runs over channels and the PV
// reduction over tokens, each thread may take whatever channel pairs its words hold; the
// q fragment and the output channel map follow the same assignment (see ChannelMap).
// All query heads sharing a KV head (GQA) are the M rows of one mma: each KV tile is read
// once for all of them.
// Generic path (residual tokens, the ragged edge, formats the mma path does not cover):
// one token per warp step, lanes over channels, fp32.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kvq/attention/decode_attention.h"

namespace kvq {
namespace attention {

constexpr int kWarps = 4;
constexpr int kTile = 32;  // tokens per warp step on the mma path
constexpr int kMaxGroup = 16;  // query heads per KV head handled in one CTA
constexpr float kLog2e = 1.4426950408889634f;

template <int BITS>
struct Pack {
  static constexpr int CPW = 32 / BITS;  // codes per word
  static constexpr int PO = CPW / 2;     // pair offset: (code s, code s + PO) share a LOP3
  static constexpr uint32_t MASK = ((1u << BITS) - 1u) * 0x00010001u;
};

__device__ __forceinline__ uint32_t hsub2_u32(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t hfma2_u32(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

/// \brief Codes s and s + PO of a packed word as an exact fp16x2 pair.
template <int BITS>
__device__ __forceinline__ uint32_t extract_pair(uint32_t w, int s) {
  const uint32_t x = ((w >> (s * BITS)) & Pack<BITS>::MASK) | 0x64006400u;
  return hsub2_u32(x, 0x64006400u);
}

/// \brief D = A(16x16, fp16) * B(16x8, fp16) + C, fp32 accumulate.  NA = 2 keeps only the
/// outputs of rows 0..7 (rows 8..15 of A are zero; their outputs are discarded).
template <int NA>
__device__ __forceinline__ void mma16816(float (&d)[NA], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1) {
  if constexpr (NA == 4) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    float t2, t3;
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%10,%10};\n"
        : "+f"(d[0]), "+f"(d[1]), "=f"(t2), "=f"(t3)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(0.f));
  }
}

template <int N>
__device__ __forceinline__ void load_words(const int32_t* src, uint32_t (&w)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      uint4 v = __ldg(reinterpret_cast<const uint4*>(src) + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    uint2 v = __ldg(reinterpret_cast<const uint2*>(src));
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = (uint32_t)__ldg(src);
  }
}

__device__ __forceinline__ uint32_t ldg_u16(const uint16_t* p) {
  return (uint32_t)__ldg(reinterpret_cast<const unsigned short*>(p));
}

/// Channel assignment of the mma path for head dim D and code width BITS.
///  K (QK B-fragment): lane quad c owns pairs P = c * D/8 + p, p < D/8, i.e. the channels
///  [c * D/4, (c + 1) * D/4); k-step kk uses pairs 2kk (regs b0) and 2kk + 1 (b1).
///  V (PV B-fragment): lane row i owns pairs P = i * D/16 + p, p < D/16, i.e. channels
///  [i * D/8, (i + 1) * D/8); pair p feeds n-tiles 2p (code s) and 2p + 1 (code s + PO).
template <int D, int BITS>
struct ChannelMap {
  using PK = Pack<BITS>;
  static constexpr int KP = D / 8;                  // K pairs per lane quad
  static constexpr int WK = KP / PK::PO;             // K words per token per lane quad
  static constexpr int VP = D / 16;                  // V pairs per lane row
  static constexpr int WV = (VP >= PK::PO) ? VP / PK::PO : 1;  // V words per token per lane row
  /// Channel of the `p`-th pair of a run starting at pair index P0, member 0 or 1.
  __device__ __forceinline__ static int channel(int pair, int member) {
    return (pair / PK::PO) * PK::CPW + pair % PK::PO + member * PK::PO;
  }
};

// ---------------------------------------------------------------------------
// Tensor-core path for tokens [t_begin, t_end) (multiple of kTile, all quantized).
// ---------------------------------------------------------------------------
template <typename DType, int D, int BITS, bool KPC, bool TWO_ROWS>
__device__ void warp_mma(const DecodeAttnParams& p, int64_t b, int64_t h, int g, int64_t t_begin,
                         int64_t t_end, int warp, float* slot) {
  using CM = ChannelMap<D, BITS>;
  using PK = Pack<BITS>;
  constexpr int NK = D / 16;  // k-steps of QK
  constexpr int NV = D / 8;   // n-tiles of PV
  const int lane = threadIdx.x % 32, i = lane >> 2, c = lane & 3;
  const int h0 = i, h1 = i + 8;
  const DType* q = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;

  // ---- q fragments, normalised per head so fp16 cannot overflow ----
  float qm0 = 0.f, qm1 = 0.f;
#pragma unroll
  for (int pp = 0; pp < CM::KP; ++pp) {
#pragma unroll
    for (int m = 0; m < 2; ++m) {
      const int ch = c * (D / 4) + CM::channel(pp, m);
      if (h0 < g) qm0 = fmaxf(qm0, fabsf(to_float(q[h0 * D + ch])));
      if (TWO_ROWS && h1 < g) qm1 = fmaxf(qm1, fabsf(to_float(q[h1 * D + ch])));
    }
  }
  qm0 = fmaxf(qm0, __shfl_xor_sync(0xffffffffu, qm0, 1));
  qm0 = fmaxf(qm0, __shfl_xor_sync(0xffffffffu, qm0, 2));
  qm1 = fmaxf(qm1, __shfl_xor_sync(0xffffffffu, qm1, 1));
  qm1 = fmaxf(qm1, __shfl_xor_sync(0xffffffffu, qm1, 2));
  qm0 = qm0 > 0.f ? qm0 : 1.f;
  qm1 = qm1 > 0.f ? qm1 : 1.f;
  const float sf0 = qm0 * p.scale * kLog2e, sf1 = qm1 * p.scale * kLog2e;
  uint32_t qa[NK][4];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // r = 0: pair 2kk (a0/a1), r = 1: pair 2kk + 1 (a2/a3)
      const int pp = 2 * kk + r;
      const int cha = c * (D / 4) + CM::channel(pp, 0), chb = c * (D / 4) + CM::channel(pp, 1);
      qa[kk][2 * r] = h0 < g ? pack_half2(to_float(q[h0 * D + cha]) / qm0, to_float(q[h0 * D + chb]) / qm0) : 0u;
      qa[kk][2 * r + 1] = (TWO_ROWS && h1 < g)
                              ? pack_half2(to_float(q[h1 * D + cha]) / qm1, to_float(q[h1 * D + chb]) / qm1)
                              : 0u;
    }
  }

  // With <= 8 query heads per KV head (TWO_ROWS = false) the mma rows 8..15 are zero: their
  // outputs are discarded (mma_top) and no registers hold them.
  constexpr int NA = TWO_ROWS ? 4 : 2;
  float m0 = -INFINITY, m1 = -INFINITY, l0 = 0.f, l1 = 0.f;
  float acc[NV][NA];
#pragma unroll
  for (int n = 0; n < NV; ++n)
#pragma unroll
    for (int e = 0; e < NA; ++e) acc[n][e] = 0.f;

  const QuantKV& K = p.k;
  const QuantKV& V = p.v;
  const int32_t* kcodes = K.codes + b * K.codes_sb + h * K.codes_sh;
  const uint16_t* kscale = K.scale + b * K.scale_sb + h * K.scale_sh;
  const uint16_t* kzero = K.zero + b * K.scale_sb + h * K.scale_sh;
  const int32_t* vcodes = V.codes + b * V.codes_sb + h * V.codes_sh;
  const uint16_t* vscale = V.scale + b * V.scale_sb + h * V.scale_sh;
  const uint16_t* vzero = V.zero + b * V.scale_sb + h * V.scale_sh;
  constexpr int WROW = D * BITS / 32;
  const int64_t kgroups_per_row = KPC ? 1 : D / K.group;  // per-token keys
  const int kj = KPC ? 0 : (int)((c * (D / 4)) / K.group);  // per-token key group of this lane quad
  const int64_t vgroups_per_row = D / V.group;
  const int vj = (int)((i * (D / 8)) / V.group);  // value group of this lane row
  const int v_first_word = (i * CM::VP) / PK::PO;
  const int soff = (i * CM::VP) % PK::PO;  // nonzero only when a row uses part of a word

  for (int64_t t0 = t_begin + warp * kTile; t0 < t_end; t0 += kWarps * kTile) {
    // ---------------- issue every load of the tile first (one memory round trip) ----------
    uint32_t kw[4][CM::WK];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) load_words<CM::WK>(kcodes + (t0 + nt * 8 + i) * WROW + c * CM::WK, kw[nt]);
    uint32_t vw[2][4][CM::WV];
    uint32_t vsz[2][4];  // scale | zero << 16 of the 4 tokens of each k-step
#pragma unroll
    for (int kst = 0; kst < 2; ++kst) {
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int64_t t = t0 + 16 * kst + 2 * c + (u & 1) + 8 * (u >> 1);
        load_words<CM::WV>(vcodes + t * WROW + v_first_word, vw[kst][u]);
        const int64_t off = t * vgroups_per_row + vj;
        vsz[kst][u] = ldg_u16(vscale + off) | (ldg_u16(vzero + off) << 16);
      }
    }
    uint32_t ks[CM::KP], kz[CM::KP];
    uint32_t ksz[4];  // per-token keys: scale | zero << 16 of each n-tile's token
    if constexpr (KPC) {
      const int64_t gi = t0 / K.group;
      const uint16_t* sp = kscale + gi * D + c * (D / 4);
      const uint16_t* zp = kzero + gi * D + c * (D / 4);
      uint32_t sw[D / 8], zw[D / 8];  // D/4 halves as D/8 words
#pragma unroll
      for (int u = 0; u < D / 32; ++u) {
        uint4 a = __ldg(reinterpret_cast<const uint4*>(sp) + u);
        uint4 z = __ldg(reinterpret_cast<const uint4*>(zp) + u);
        sw[4 * u] = a.x, sw[4 * u + 1] = a.y, sw[4 * u + 2] = a.z, sw[4 * u + 3] = a.w;
        zw[4 * u] = z.x, zw[4 * u + 1] = z.y, zw[4 * u + 2] = z.z, zw[4 * u + 3] = z.w;
      }
#pragma unroll
      for (int pp = 0; pp < CM::KP; ++pp) {
        const int la = CM::channel(pp, 0), lb = CM::channel(pp, 1);  // same parity
        const uint32_t sel = (la & 1) ? 0x7632u : 0x5410u;
        ks[pp] = __byte_perm(sw[la / 2], sw[lb / 2], sel);
        kz[pp] = __byte_perm(zw[la / 2], zw[lb / 2], sel);
      }
    } else {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int64_t off = (t0 + nt * 8 + i) * kgroups_per_row + kj;
        ksz[nt] = ldg_u16(kscale + off) | (ldg_u16(kzero + off) << 16);
      }
    }
    // ---------------- scores for 4 n-tiles of 8 tokens ----------------
    float sc[4][NA];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      if constexpr (!KPC) {
        const uint32_t s = ksz[nt] & 0xffffu, z = ksz[nt] >> 16;
#pragma unroll
        for (int pp = 0; pp < CM::KP; ++pp) ks[pp] = s | (s << 16), kz[pp] = z | (z << 16);
      }
#pragma unroll
      for (int e = 0; e < NA; ++e) sc[nt][e] = 0.f;
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        const int pa = 2 * kk, pb = 2 * kk + 1;
        const uint32_t b0 = hfma2_u32(extract_pair<BITS>(kw[nt][pa / PK::PO], pa % PK::PO), ks[pa], kz[pa]);
        const uint32_t b1 = hfma2_u32(extract_pair<BITS>(kw[nt][pb / PK::PO], pb % PK::PO), ks[pb], kz[pb]);
        mma16816<NA>(sc[nt], qa[kk], b0, b1);
      }
    }
    // ---------------- online softmax (rows h0, h1) ----------------
    float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int64_t t = t0 + nt * 8 + 2 * c + e;
        const bool keep = p.mask == nullptr || p.mask[b * p.mask_sb + t] != 0;
        sc[nt][e] = keep ? sc[nt][e] * sf0 : -INFINITY;
        mx0 = fmaxf(mx0, sc[nt][e]);
        if constexpr (TWO_ROWS) {
          sc[nt][2 + e] = keep ? sc[nt][2 + e] * sf1 : -INFINITY;
          mx1 = fmaxf(mx1, sc[nt][2 + e]);
        }
      }
    }
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
    mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
    const float mn0 = fmaxf(m0, mx0);
    const float al0 = mn0 == -INFINITY ? 1.f : exp2f(m0 - mn0);
    m0 = mn0;
    float mn1 = -INFINITY, al1 = 1.f;
    if constexpr (TWO_ROWS) {
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
      mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
      mn1 = fmaxf(m1, mx1);
      al1 = mn1 == -INFINITY ? 1.f : exp2f(m1 - mn1);
      m1 = mn1;
    }
    float ps0 = 0.f, ps1 = 0.f;
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        sc[nt][e] = sc[nt][e] == -INFINITY ? 0.f : exp2f(sc[nt][e] - mn0);
        ps0 += sc[nt][e];
        if constexpr (TWO_ROWS) {
          sc[nt][2 + e] = sc[nt][2 + e] == -INFINITY ? 0.f : exp2f(sc[nt][2 + e] - mn1);
          ps1 += sc[nt][2 + e];
        }
      }
    }
    l0 = l0 * al0 + ps0;
    l1 = l1 * al1 + ps1;
#pragma unroll
    for (int n = 0; n < NV; ++n) {
      acc[n][0] *= al0, acc[n][1] *= al0;
      if constexpr (TWO_ROWS) acc[n][2] *= al1, acc[n][3] *= al1;
    }

    // ---------------- P . V over 2 k-steps of 16 tokens ----------------
#pragma unroll
    for (int kst = 0; kst < 2; ++kst) {
      uint32_t pa[4];
      pa[0] = pack_half2(sc[2 * kst][0], sc[2 * kst][1]);
      pa[2] = pack_half2(sc[2 * kst + 1][0], sc[2 * kst + 1][1]);
      if constexpr (TWO_ROWS) {
        pa[1] = pack_half2(sc[2 * kst][2], sc[2 * kst][3]);
        pa[3] = pack_half2(sc[2 * kst + 1][2], sc[2 * kst + 1][3]);
      } else {
        pa[1] = pa[3] = 0u;
      }
      const uint32_t S01 = __byte_perm(vsz[kst][0], vsz[kst][1], 0x5410u);
      const uint32_t Z01 = __byte_perm(vsz[kst][0], vsz[kst][1], 0x7632u);
      const uint32_t S89 = __byte_perm(vsz[kst][2], vsz[kst][3], 0x5410u);
      const uint32_t Z89 = __byte_perm(vsz[kst][2], vsz[kst][3], 0x7632u);
#pragma unroll
      for (int pp = 0; pp < CM::VP; ++pp) {
        const int qq = soff + pp;
        const int wi = qq / PK::PO, s = qq % PK::PO;
        const uint32_t xa = extract_pair<BITS>(vw[kst][0][wi], s), xb = extract_pair<BITS>(vw[kst][1][wi], s);
        const uint32_t xc = extract_pair<BITS>(vw[kst][2][wi], s), xd = extract_pair<BITS>(vw[kst][3][wi], s);
        mma16816<NA>(acc[2 * pp], pa, hfma2_u32(__byte_perm(xa, xb, 0x5410u), S01, Z01),
                     hfma2_u32(__byte_perm(xc, xd, 0x5410u), S89, Z89));
        mma16816<NA>(acc[2 * pp + 1], pa, hfma2_u32(__byte_perm(xa, xb, 0x7632u), S01, Z01),
                     hfma2_u32(__byte_perm(xc, xd, 0x7632u), S89, Z89));
      }
    }
  }
  // ---- reduce l over the lane quad, write this warp's partial ----
  l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
  l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
  l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
#pragma unroll
  for (int nt = 0; nt < NV; ++nt) {
#pragma unroll
    for (int e = 0; e < NA; ++e) {
      const int n = 2 * c + (e & 1);  // column of the n-tile = lane row n's channel
      const int hrow = (e >> 1) ? h1 : h0;
      if (hrow >= g) continue;
      const int pair = n * CM::VP + nt / 2;
      const int ch = (pair / PK::PO) * PK::CPW + pair % PK::PO + (nt % 2) * PK::PO;
      slot[hrow * (D + 2) + 2 + ch] = acc[nt][e];
    }
  }
  if (c == 0) {
    if (h0 < g) slot[h0 * (D + 2)] = m0, slot[h0 * (D + 2) + 1] = l0;
    if (TWO_ROWS && h1 < g) slot[h1 * (D + 2)] = m1, slot[h1 * (D + 2) + 1] = l1;
  }
}

// ---------------------------------------------------------------------------
// Generic path: tokens [t_begin, t_end), any mix of quantized and residual tokens.
// ---------------------------------------------------------------------------
template <typename DType, int D>
__device__ __forceinline__ void load_token(const QuantKV& s, int64_t b, int64_t h, int64_t t, int lane,
                                           float (&x)[D / 32]) {
  constexpr int EPL = D / 32;
  if (t < s.Tq) {
#pragma unroll
    for (int e = 0; e < EPL; ++e) x[e] = dequant_at(s, b, h, t, lane * EPL + e, D);
  } else {
    const DType* r = static_cast<const DType*>(s.residual) + b * s.res_sb + h * s.res_sh + (t - s.Tq) * D;
#pragma unroll
    for (int e = 0; e < EPL; ++e) x[e] = to_float(r[lane * EPL + e]);
  }
}

template <typename DType, int D, int MAXG>
__device__ void warp_generic(const DecodeAttnParams& p, int64_t b, int64_t h, int g, int64_t t_begin,
                             int64_t t_end, int warp, float* slot, const float* s_q) {
  constexpr int EPL = D / 32;
  const int lane = threadIdx.x % 32;
  float m[MAXG], l[MAXG], acc[MAXG][EPL];
#pragma unroll
  for (int j = 0; j < MAXG; ++j) {
    m[j] = -INFINITY, l[j] = 0.f;
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[j][e] = 0.f;
  }
  const float sl = p.scale * kLog2e;
  for (int64_t t = t_begin + warp; t < t_end; t += kWarps) {
    if (p.mask != nullptr && p.mask[b * p.mask_sb + t] == 0) continue;
    float kx[EPL], vx[EPL];
    load_token<DType, D>(p.k, b, h, t, lane, kx);
    load_token<DType, D>(p.v, b, h, t, lane, vx);
#pragma unroll
    for (int j = 0; j < MAXG; ++j) {
      if (j >= g) break;
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) s += s_q[j * D + lane * EPL + e] * kx[e];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      s *= sl;
      const float mn = fmaxf(m[j], s);
      const float al = exp2f(m[j] - mn), pe = exp2f(s - mn);
      m[j] = mn;
      l[j] = l[j] * al + pe;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[j][e] = acc[j][e] * al + pe * vx[e];
    }
  }
#pragma unroll
  for (int j = 0; j < MAXG; ++j) {
    if (j >= g) break;
    float* row = slot + j * (D + 2);
#pragma unroll
    for (int e = 0; e < EPL; ++e) row[2 + lane * EPL + e] = acc[j][e];
    if (lane == 0) row[0] = m[j], row[1] = l[j];
  }
}

/// \brief How the token axis is split over CTAs (computed on the host).
struct SplitPlan {
  int64_t t_main = 0;      // tokens [0, t_main) go through the mma path
  int ns_main = 0;         // CTAs per (b, h) on the mma path
  int64_t chunk_main = 0;  // tokens per mma CTA (multiple of kTile)
  int ns_tail = 0;         // CTAs per (b, h) on the generic path
  int64_t chunk_tail = 0;
  KVQ_HOST_DEVICE int splits() const { return ns_main + ns_tail; }
};

template <typename DType, int D, int BITS, bool KPC, bool TWO_ROWS, bool MMA>
__global__ void __launch_bounds__(kWarps * 32, D <= 128 ? 3 : 1)
    DecodeAttentionKernel(DecodeAttnParams p, SplitPlan plan) {
  extern __shared__ float smem[];
  const int split = blockIdx.x;
  const int64_t bh = blockIdx.y, b = bh / p.H, h = bh % p.H;
  const int g = (int)(p.Hq / p.H);
  const int warp = threadIdx.x / 32;
  float* s_q = smem;                                 // [g][D]
  float* slots = smem + g * D;                       // [kWarps][g][D + 2]
  float* slot = slots + warp * g * (D + 2);
  const bool on_mma = split < plan.ns_main;
  int64_t t_begin, t_end;
  if (on_mma) {
    t_begin = split * plan.chunk_main;
    t_end = t_begin + plan.chunk_main < plan.t_main ? t_begin + plan.chunk_main : plan.t_main;
  } else {
    t_begin = plan.t_main + (split - plan.ns_main) * plan.chunk_tail;
    t_end = t_begin + plan.chunk_tail < p.T ? t_begin + plan.chunk_tail : p.T;
  }
  if constexpr (MMA) {
    if (on_mma) {
      warp_mma<DType, D, BITS, KPC, TWO_ROWS>(p, b, h, g, t_begin, t_end, warp, slot);
    }
  }
  if (!(MMA && on_mma)) {
    const DType* q = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;
    for (int x = threadIdx.x; x < g * D; x += blockDim.x) s_q[x] = to_float(q[x]);
    __syncthreads();
    // the mma path only takes g <= 8, so its kernels need 8 generic head slots
    warp_generic<DType, D, MMA ? 8 : kMaxGroup>(p, b, h, g, t_begin, t_end, warp, slot, s_q);
  }
  __syncthreads();
  // ---- merge the warps and write the split partial ----
  const int64_t S = plan.splits();
  for (int x = threadIdx.x; x < g * (D + 2); x += blockDim.x) {
    const int j = x / (D + 2), col = x % (D + 2);
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) M = fmaxf(M, slots[(w * g + j) * (D + 2)]);
    float out = 0.f;
    if (col == 0) {
      out = M;
    } else {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float mw = slots[(w * g + j) * (D + 2)];
        const float wgt = (M == -INFINITY) ? 0.f : exp2f(mw - M);
        out += wgt * slots[(w * g + j) * (D + 2) + col];
      }
    }
    const int64_t row = (b * p.Hq + h * g + j) * S + split;
    p.ws[row * (D + 2) + col] = out;
  }
}

/// \brief Merge split partials: out = sum_s w_s acc_s / sum_s w_s l_s, w_s = 2^(m_s - M).
template <typename DType, int D>
__global__ void DecodeAttentionCombineKernel(DecodeAttnParams p, int splits) {
  const int64_t row = blockIdx.x;  // b * Hq + hq
  const float* ws = p.ws + row * splits * (D + 2);
  float M = -INFINITY;
  for (int s = 0; s < splits; ++s) M = fmaxf(M, ws[s * (D + 2)]);
  float L = 0.f;
  for (int s = 0; s < splits; ++s) {
    const float w = M == -INFINITY ? 0.f : exp2f(ws[s * (D + 2)] - M);
    L += w * ws[s * (D + 2) + 1];
  }
  DType* out = static_cast<DType*>(p.out) + row * D;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float a = 0.f;
    for (int s = 0; s < splits; ++s) {
      const float w = M == -INFINITY ? 0.f : exp2f(ws[s * (D + 2)] - M);
      a += w * ws[s * (D + 2) + 2 + d];
    }
    out[d] = from_float<DType>(L > 0.f ? a / L : 0.f);
  }
}

/// \brief Can the tensor-core path read this cache layer?
inline bool decode_attention_mma_ok(const DecodeAttnParams& p) {
  const int64_t D = p.D;
  if (!(D == 64 || D == 128 || D == 256)) return false;
  if (p.k.bits != p.v.bits) return false;
  if (p.Hq / p.H > 8) return false;  // one mma row block (TWO_ROWS = false instantiations)
  const bool k_ok = p.k.per_channel ? (p.k.group % kTile == 0) : (p.k.group >= D / 4 && D % p.k.group == 0);
  const bool v_ok = !p.v.per_channel && p.v.group >= D / 8 && D % p.v.group == 0;
  return k_ok && v_ok;
}

inline SplitPlan decode_attention_plan(const DecodeAttnParams& p, int num_sms) {
  SplitPlan plan;
  const int64_t BH = p.B * p.H;
  const int64_t target = 4 * (int64_t)num_sms;
  const int64_t want = (target + BH - 1) / BH;
  if (decode_attention_mma_ok(p)) {
    int64_t tq = p.k.Tq < p.v.Tq ? p.k.Tq : p.v.Tq;
    if (tq > p.T) tq = p.T;
    plan.t_main = (tq / kTile) * kTile;
  }
  if (plan.t_main > 0) {
    int64_t ns = want;
    const int64_t max_ns = (plan.t_main + 127) / 128;
    if (ns > max_ns) ns = max_ns;
    if (ns < 1) ns = 1;
    int64_t chunk = (plan.t_main + ns - 1) / ns;
    chunk = (chunk + kTile - 1) / kTile * kTile;
    plan.chunk_main = chunk;
    plan.ns_main = (int)((plan.t_main + chunk - 1) / chunk);
  }
  const int64_t tail = p.T - plan.t_main;
  if (tail > 0) {
    // The generic path walks tokens one at a time per warp: keep its chunks short (32
    // tokens = 8 per warp) so the residual window does not serialise the launch.
    const int64_t tail_chunk = plan.t_main > 0 ? 32 : 64;
    int64_t ns = plan.t_main > 0 ? (tail + tail_chunk - 1) / tail_chunk : want;
    const int64_t max_ns = (tail + tail_chunk - 1) / tail_chunk;
    if (ns > max_ns) ns = max_ns;
    if (ns < 1) ns = 1;
    plan.chunk_tail = (tail + ns - 1) / ns;
    plan.ns_tail = (int)((tail + plan.chunk_tail - 1) / plan.chunk_tail);
  }
  return plan;
}

inline size_t decode_attention_smem_bytes(const DecodeAttnParams& p) {
  const int64_t g = p.Hq / p.H;
  return sizeof(float) * (size_t)(g * p.D + kWarps * g * (p.D + 2));
}

template <typename DType, int D, int BITS, bool KPC, bool TWO_ROWS, bool MMA>
cudaError_t LaunchDecodeAttention(const DecodeAttnParams& p, const SplitPlan& plan, cudaStream_t stream) {
  auto kernel = DecodeAttentionKernel<DType, D, BITS, KPC, TWO_ROWS, MMA>;
  const size_t smem = decode_attention_smem_bytes(p);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  dim3 grid((unsigned)plan.splits(), (unsigned)(p.B * p.H));
  kernel<<<grid, kWarps * 32, smem, stream>>>(p, plan);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  DecodeAttentionCombineKernel<DType, D><<<(unsigned)(p.B * p.Hq), D < 128 ? D : 128, 0, stream>>>(p, plan.splits());
  return cudaGetLastError();
}

}  // namespace attention
}  // namespace kvq
