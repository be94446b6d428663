// Fused decode attention over a group-quantized KV cache + full-precision residual.
// Torch-free.  Flash-decoding: the token axis is split over CTAs (one (batch, KV head)
// per CTA row), each warp runs its own online softmax over 32-token tiles, the CTA merges
// its warps and writes its split partial; a small combine kernel (a programmatic dependent
// launch) merges each row's splits.
//
// Tensor-core path (tokens quantized in both K and V, the bulk of a long cache), in
// transposed form so that the <= 8 query heads of a KV head are the N = 8 mma columns:
//   scores  S^T[t, h]  = mma(A = K (tokens x channels), B = (q / max|q|)^T (channels x heads))
//   output  O^T[d, h] += mma(A = V^T (channels x tokens), B = P^T (tokens x heads))
// K and V A-fragments are built in registers straight from the packed codes: one shift +
// LOP3 turns two codes of a 32-bit word into an fp16x2 pair (magic 0x6400 trick), HADD2
// removes the bias, HFMA2 applies scale and zero.  Because the QK reduction runs over
// channels and the PV reduction over tokens, each thread may take whatever channel pairs its
// words hold; the q fragment and the output channel map follow the same assignment (see
// ChannelMap).  movmatrix.trans turns the fp16 scores into the P^T operand.  Each warp streams
// its tiles (codes, scales, zeros) through a cp.async ring in shared memory.
// Generic path (residual tokens, the ragged edge, formats the mma path does not cover):
// one token per warp step, lanes over channels, fp32.
#pragma once
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <type_traits>

#include "kvq/attention/decode_attention.h"
#include "kvq/build_config.h"

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

__device__ __forceinline__ constexpr uint32_t half2_pow2_bits(int e, bool neg) {  // (+-2^e, +-2^e), |e| <= 14
  return ((neg ? 0x8000u : 0u) | (uint32_t)(e + 15) << 10) * 0x00010001u;
}
/// \brief Codes s and s + PO of a packed word w as an exact fp16x2 pair (w8 = w >> 8, one
/// shift per word).  The field is masked in place (bit offset off = (s BITS) % 8 of w or w8,
/// magic exponent 0x6400 in one LOP3): x = 1024 + code 2^off, exact; then
/// code = x 2^-off - 1024 2^-off in one HFMA2 (exact: power-of-two scaling, one rounding of an
/// exactly representable result) -- no per-pair shift.
template <int BITS>
__device__ __forceinline__ uint32_t extract_pair(uint32_t w, uint32_t w8, int s) {
  const int pos = s * BITS, off = pos % 8;
  uint32_t x;  // (src & mask) | 0x64006400 in one LOP3 (0xEA = (a & b) | c)
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n"
      : "=r"(x)
      : "r"(pos >= 8 ? w8 : w), "r"(Pack<BITS>::MASK << off), "r"(0x64006400u));
  if (off == 0) return hsub2_u32(x, 0x64006400u);
  return hfma2_u32(x, half2_pow2_bits(-off, false), half2_pow2_bits(10 - off, true));
}

/// \brief Codes s and s + PO of a packed word as exact fp16 *subnormals*, masked in place:
/// value = code * 2^(off - 24) with off = (s * BITS) % 8 (fields past bit 8 of a half-word come
/// from w8 = w >> 8, one shift per word).  One LOP3 per pair and no bias to subtract: the scale
/// goes into the other mma operand and the factor 2^(off - 24) is undone on the fp32 result.
template <int BITS>
__device__ __forceinline__ uint32_t sub_pair(uint32_t w, uint32_t w8, int s) {
  const int pos = s * BITS;
  return (pos >= 8 ? w8 : w) & (Pack<BITS>::MASK << (pos % 8));
}
/// Bit offset of pair s inside its byte (see sub_pair).
template <int BITS>
__device__ __forceinline__ constexpr int sub_off(int s) { return (s * BITS) % 8; }
__device__ __forceinline__ uint32_t hmul2_u32(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

/// \brief D = A(16x16, fp16) * B(16x8, fp16) + D, fp32 accumulate.
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/// N consecutive 32-bit words from shared memory (16/8-byte vector loads where N allows).
template <int N>
__device__ __forceinline__ void lds_words(const int32_t* src, uint32_t (&w)[N]) {
  if constexpr (N % 4 == 0) {
#pragma unroll
    for (int i = 0; i < N / 4; ++i) {
      const uint4 v = reinterpret_cast<const uint4*>(src)[i];
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = (uint32_t)src[0];
  }
}


// ---------------------------------------------------------------------------
// Per-warp shared-memory pipeline of the mma path.  Each warp owns a ring of kStages<BITS, D>
// tile buffers; it issues cp.async copies of its tile k + S - 1 while computing tile k, so
// S - 1 tiles (~3.5 KB each at 2 bits, D = 128) per warp are in flight.
// ---------------------------------------------------------------------------
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned s = (unsigned)__cvta_generic_to_shared(smem);
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(s), "l"(gmem));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
/// Warp-cooperative copy of `bytes` <= MAXB (multiples of 16, both ends 16-byte aligned):
/// fully unrolled, one predicated 16-byte cp.async per lane and step.
template <int MAXB>
__device__ __forceinline__ void warp_copy_async(void* dst, const void* src, int bytes, int lane) {
#pragma unroll
  for (int j = 0; j < (MAXB / 16 + 31) / 32; ++j) {
    const int x = lane + 32 * j;
    if (x * 16 < bytes) cp_async16(static_cast<char*>(dst) + 16 * x, static_cast<const char*>(src) + 16 * x);
  }
}

/// Per-CTA header of the GEAR extras in shared memory (after q; every warp of a CTA serves the
/// same (batch, KV head)): per segment the (batch, head) bases of both roles, written once by
/// the kernel prologue and laid out for 16-byte loads, so that a tile's addresses cost a few
/// shared loads and 32-bit operations instead of gear_seg's 64-bit products of the parameter
/// strides; then the channel -> position tables of the dense correction tiles (QK mma order
/// for keys, PV mma order for values).  The low-rank B factors (kB / vB) are read at a warp's
/// first tile of a block (q . B_k) and at its last (the B_v flush): once per tile in the
/// 64-token decode blocks, where every tile of a warp starts a new block.
struct alignas(16) GearSegCta {
  const char* kA;  // low-rank rows, fp16 [T_seg, r] (nullptr: r = 0)
  const char* vA;
  const char* vod;  // values: corrections and indices, [T_seg, 2k]
  const char* voi;
  const char* koff;  // keys: per-tile entry offsets (int32) of block 0, and their block stride in bytes
  long long f_sblk;
  const char* kod;  // keys: corrections (cache dtype) of block 0, block stride in bytes
  long long d_sblk;
  const char* koi;  // keys: packed indices (int16) of block 0, block stride in bytes
  long long o_sblk;
  uint32_t flags;   // the segment's part of GearTileDesc::flags (ranks, outlier kinds, 2k of values)
  int kr2, vr2;     // bytes per A row (2 r) of keys / values
  int vnk;          // 2k of values
  const char* kB;   // low-rank B (fp16 [D, r]) of block 0 of keys (nullptr: r = 0), block stride in bytes
  long long kB_sblk;
  const char* vB;   // the same of values
  long long vB_sblk;
};
// issue() reads a GearSegCta as 16-byte words 0 (kA, vA), 1 (vod, voi), 2 (koff, f_sblk), 5 (flags ...),
// 6 (kB, kB_sblk), 7 (vB, vB_sblk)
static_assert(sizeof(GearSegCta) == 128 && offsetof(GearSegCta, vod) == 16 && offsetof(GearSegCta, koff) == 32 &&
                  offsetof(GearSegCta, flags) == 80 && offsetof(GearSegCta, vnk) == 92 &&
                  offsetof(GearSegCta, kB) == 96 && offsetof(GearSegCta, vB) == 112,
              "GearSegCta layout");
struct GearCta {
  static constexpr int SEG = 0;                                   // GearSegCta [segment]
  static constexpr int KLUT = 2 * (int)sizeof(GearSegCta);        // uint8 [D]: key channel -> position
  KVQ_HOST_DEVICE static int vlut(int D) { return KLUT + D; }      // uint8 [D]: value channel -> position
  KVQ_HOST_DEVICE static int bytes(int D) { return (KLUT + 2 * D + 15) / 16 * 16; }
};
/// What issue() tells the compute step about a tile (written into its ring stage by lane 0).
struct alignas(16) GearTileDesc {
  uint32_t flags;   // see kGd*
  int bid;          // block id: 0 prefill, 1 + decode block
  int ts0;          // first token of the tile within its segment
  int pad;
};
constexpr uint32_t kGdKOut = 1u << 10;    // key outliers (window index of the tile offsets: bits 8..9)
constexpr uint32_t kGdVOut = 1u << 11;    // value outliers (2k per token: bits 16..23)
constexpr uint32_t kGdVStaged = 1u << 12;  // ... staged in the ring (uint8 indices, 2k <= VO_MAX)
constexpr uint32_t kGdLast = 1u << 13;    // the warp's last tile of this block
// low-rank ranks: key r in bits 0..3, value r in bits 4..7

/// Byte layout of one 32-token tile in shared memory (KPC: keys grouped per channel; GEAR:
/// plus the tile's rows of the key and value low-rank factors A (up to 8 fp16 columns), a
/// 32-byte window of the key outlier tile offsets, the tile's value outliers (up to 8
/// per token: corrections v - xhat of VB bytes, uint8 channels) and its GearTileDesc).
template <int D, int BITS, bool KPC, bool GEAR = false, int VB = 2>
struct TileLayout {
  static constexpr int CODES = kTile * D * BITS / 8;             // K or V codes of the tile
  static constexpr int KS = KPC ? 2 * D : kTile * 4 * 2;         // K scale (or zero): 1 row / <= 4 groups x 32 tokens
  static constexpr int VS = kTile * 8 * 2;                       // V scale (or zero): <= 8 groups x 32 tokens
  static constexpr int KC_OFF = 0, VC_OFF = CODES, KS_OFF = 2 * CODES, KZ_OFF = KS_OFF + KS,
                       VS_OFF = KZ_OFF + KS, VZ_OFF = VS_OFF + VS;
  static constexpr int A_BYTES = GEAR ? kTile * 8 * 2 : 0;
  static constexpr int KO_BYTES = GEAR ? 32 : 0;
  static constexpr int VO_MAX = 8;  // value outliers per token staged in shared memory
  static constexpr int VOV_BYTES = GEAR ? kTile * VO_MAX * VB : 0, VOI_BYTES = GEAR ? kTile * VO_MAX : 0;
  static constexpr int GD_BYTES = GEAR ? (int)sizeof(GearTileDesc) : 0;  // the tile's GearTileDesc
  static constexpr int KA_OFF = VZ_OFF + VS, VA_OFF = KA_OFF + A_BYTES, KO_OFF = VA_OFF + A_BYTES,
                       VOV_OFF = KO_OFF + KO_BYTES, VOI_OFF = VOV_OFF + VOV_BYTES, GD_OFF = VOI_OFF + VOI_BYTES;
  static constexpr int BYTES = GD_OFF + GD_BYTES;
  // GEAR: 2 stages keep 3 CTAs (12 warps) per SM within shared memory
  static constexpr int STAGES = GEAR ? 2 : KA_OFF <= 4096 ? 3 : 2;
  static constexpr int RING = STAGES * BYTES;
};

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
//
// Transposed form, so that no mma row is wasted on absent query heads:
//   S^T (tokens x heads) = K (tokens x channels, A operand) . q^T (channels x heads, B)
//   O^T (channels x heads) += V^T (channels x tokens, A operand) . P^T (tokens x heads, B)
// The g <= 8 query heads of a KV head are the N = 8 columns.  S^T comes out of the first mma
// in the C layout (lane (i, c): tokens i, i + 8, heads 2c, 2c + 1); movmatrix.trans turns each
// 8 x 8 fp16 block of P into the B layout of the second (lane (i, c): head i, tokens 2c, 2c + 1).
// Each lane therefore keeps the softmax state (m, l) of heads 2c and 2c + 1.
// ---------------------------------------------------------------------------
/// Four 8x8 b16 matrices from shared memory (lanes 8j..8j+7 give the row addresses of matrix
/// j), transposed or not: the A fragment of an m16n8k16 mma from a row-major 16 x 16 tile.
template <bool TRANS>
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&a)[4], unsigned saddr) {
  if constexpr (TRANS)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(saddr) : "memory");
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(saddr) : "memory");
}
/// 16-bit store to a shared-memory address (ordered with the ldmatrix reads of the same tile).
__device__ __forceinline__ void sts_u16(uint32_t saddr, uint32_t v) {
  asm volatile("st.shared.u16 [%0], %1;\n" ::"r"(saddr), "h"((unsigned short)v) : "memory");
}
__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t x) {
  uint32_t y;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}


// ---------------------------------------------------------------------------
// GEAR extras of the mma path (GEAR = true): the low-rank factors and the outliers of a
// GEAR layer (decode_attention.h, GearSeg), added without forming the dense correction:
//   scores  += A_k[t] . (q B_k)                  one extra mma per 16 tokens
//   output  += (sum_t p_t A_v[t]) B_v^T           U accumulated by mma, flushed per block
//   outliers: key entry (t, c, d): score_t += q_c d; value entry (t, c, d): out_c += p_t d,
//   d = v - Khat[t, c] (or v - Vhat[t, c]), Khat / Vhat = backbone + low rank at that position
//   (decompression overwrites the entry), precomputed once per block by the cache layer and
//   stored next to each entry (GearSeg::od).  Key entries are stored sorted by token with
//   per-tile offsets, so a tile's entries are one contiguous range (lanes take one entry
//   each, loaded before the QK mma); value entries are the 2k entries of each token (staged in
//   the ring; two lanes per token, k entries each).  Both kinds of correction are written
//   (fp16) into a per-warp dense tile of 16 tokens x D, at the position of their channel in
//   the QK (keys) or PV (values) mma (tables in GearCta), which then runs through the tensor
//   cores with q or P like the codes (ldmatrix, .trans for values); the entries are cleared
//   after.  Per tile, issue() reads the segment's GearSegCta and passes a GearTileDesc (flags,
//   block) through the ring stage: no 64-bit parameter arithmetic in the tile loop.
// ---------------------------------------------------------------------------
/// Per-warp scratch of the GEAR extras (byte offsets for g query heads; 16-byte multiples).
struct GearScratch {
  static constexpr int QB = 0;                     // float [8][8]: q . B_k of the current block (D > 128)
  static constexpr int DV = QB + 64 * 4;            // fp16 [16 tokens][D + 8]: value outlier corrections
                                                   // of half a tile, in mma order (padded rows)
  KVQ_HOST_DEVICE static int bytes(int D) { return (DV + 16 * (D + 8) * 2 + 15) / 16 * 16; }
};

/// One role's segment, with the (batch, head, block) offsets applied.
struct GearSegView {
  const uint16_t* A;    // [T_seg, r]
  const uint16_t* Bf;   // [D, r] of the block
  const char* od;       // outlier corrections of the (batch, head[, block]) (bytes)
  const char* oi;       // outlier indices
  const int32_t* off;   // keys: tile offsets of the block
  int r, k, ibytes;
};
template <typename DType>
__device__ __forceinline__ GearSegView gear_seg(const GearKV& g, int64_t b, int64_t h, int seg, int blk) {
#define KVQ_SEL(f) (seg ? g.seg[1].f : g.seg[0].f)
  GearSegView v;
  v.r = KVQ_SEL(r), v.k = KVQ_SEL(k), v.ibytes = KVQ_SEL(ibytes);
  v.A = KVQ_SEL(A) + b * KVQ_SEL(A_sb) + h * KVQ_SEL(A_sh);
  v.Bf = KVQ_SEL(Bf) + b * KVQ_SEL(B_sb) + h * KVQ_SEL(B_sh) + (int64_t)blk * KVQ_SEL(B_sblk);
  const int64_t o = b * KVQ_SEL(o_sb) + h * KVQ_SEL(o_sh) + (int64_t)blk * KVQ_SEL(o_sblk);
  const int64_t d = b * KVQ_SEL(d_sb) + h * KVQ_SEL(d_sh) + (int64_t)blk * KVQ_SEL(d_sblk);
  v.od = static_cast<const char*>(KVQ_SEL(od)) + d * (int64_t)sizeof(DType);
  v.oi = static_cast<const char*>(KVQ_SEL(oi)) + o * v.ibytes;
  v.off = KVQ_SEL(off) + b * KVQ_SEL(f_sb) + h * KVQ_SEL(f_sh) + (int64_t)blk * KVQ_SEL(f_sblk);
#undef KVQ_SEL
  return v;
}
/// fp16 bits of an outlier correction stored in the cache dtype (the dense correction tile is fp16).
template <typename DType>
__device__ __forceinline__ uint16_t gear_delta_bits(DType d) {
  if constexpr (std::is_same<DType, half_t>::value) {
    return d.bits;
  } else {
    const __half x = __float2half_rn(to_float(d));
    return *reinterpret_cast<const uint16_t*>(&x);
  }
}
/// fp16 bits of the correction e of a cache-dtype array in global memory (read-only path).
template <typename DType>
__device__ __forceinline__ uint32_t gear_delta_ldg(const DType* od, int e) {
  if constexpr (sizeof(DType) == 2) {
    DType d;
    d.bits = __ldg(reinterpret_cast<const unsigned short*>(od) + e);
    return gear_delta_bits(d);
  } else {
    const __half x = __float2half_rn(__ldg(reinterpret_cast<const float*>(od) + e));
    return *reinterpret_cast<const uint16_t*>(&x);
  }
}
/// KV staged value entries of a lane (uint8 channels, corrections in the cache dtype; KV
/// consecutive entries starting at an offset that is a multiple of KV): vector loads where
/// KV = 2, 4 allows.
template <typename DType, int KV>
__device__ __forceinline__ void gear_stage_entries(const uint8_t* oi, const DType* od, uint32_t (&ch)[KV],
                                                   uint32_t (&dl)[KV]) {
  if constexpr (KV == 2 || KV == 4) {
    using IW = typename std::conditional<KV == 2, uint16_t, uint32_t>::type;
    const uint32_t w = *reinterpret_cast<const IW*>(oi);
#pragma unroll
    for (int j = 0; j < KV; ++j) ch[j] = (w >> (8 * j)) & 255u;
  } else {
#pragma unroll
    for (int j = 0; j < KV; ++j) ch[j] = oi[j];
  }
  if constexpr (sizeof(DType) == 2 && (KV == 2 || KV == 4)) {
    uint32_t w[KV / 2];
    if constexpr (KV == 2) {
      w[0] = *reinterpret_cast<const uint32_t*>(od);
    } else {
      const uint2 v = *reinterpret_cast<const uint2*>(od);
      w[0] = v.x, w[1] = v.y;
    }
#pragma unroll
    for (int j = 0; j < KV; ++j) {
      DType d;
      d.bits = (uint16_t)(w[j / 2] >> (16 * (j & 1)));
      dl[j] = gear_delta_bits(d);
    }
  } else {
#pragma unroll
    for (int j = 0; j < KV; ++j) dl[j] = gear_delta_bits(od[j]);
  }
}
__device__ __forceinline__ int gear_idx(const char* oi, int ibytes, int j) {
  return ibytes == 1 ? (int)reinterpret_cast<const uint8_t*>(oi)[j]
                     : ibytes == 2 ? (int)reinterpret_cast<const int16_t*>(oi)[j] : reinterpret_cast<const int32_t*>(oi)[j];
}
/// Two fp16 entries (cols j, j + 1 of row `row` of an [rows, r] fp16 array), zero beyond r.
__device__ __forceinline__ uint32_t gear_pair(const uint16_t* a, int row, int j, int r) {
  const uint32_t lo = j < r ? (uint32_t)a[row * r + j] : 0u;
  const uint32_t hi = j + 1 < r ? (uint32_t)a[row * r + j + 1] : 0u;
  return lo | (hi << 16);
}
/// Prefetch [p, p + bytes) into L1 (a hint: no effect on results; every address prefetched
/// lies inside the range): the warp's lanes take one 128-byte line each.
__device__ __forceinline__ void gear_prefetch_l1(const char* p, int bytes, int lane) {
  for (int x = lane; x * 128 < bytes + 127; x += 32) {
    const char* a = p + (x * 128 < bytes ? x * 128 : bytes - 1);
    asm volatile("prefetch.global.L1 [%0];\n" ::"l"(a));
  }
}

/// 2^x for x <= 0 (or -inf -> 0) with one MUFU.EX2: exp2f's range scaling for results below
/// 2^-126 costs three instructions per call and only matters for probabilities that are 0 in fp16.
__device__ __forceinline__ float exp2_nonpos(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

/// \brief Online-softmax step of one 32-token tile of scores in the mma C layout (lane (i, c):
/// tokens i, i + 8 of m-tiles 0, 1; heads 2c (e even) and 2c + 1 (e odd), log2 domain).
/// Applies the mask row (nullptr: none), updates the running max m and sum l of the lane's two
/// heads, turns sc into p = 2^(s - m) and returns the factors al* that rescale older
/// accumulators.
__device__ __forceinline__ void tile_online_softmax(float (&sc)[2][4], const uint8_t* mrow, int i, float& mA,
                                                    float& mB, float& lA, float& lB, float& alA, float& alB) {
  if (mrow != nullptr) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (mrow[16 * mt + i + 8 * (e >> 1)] == 0) sc[mt][e] = -INFINITY;
  }
  float xA = fmaxf(fmaxf(sc[0][0], sc[0][2]), fmaxf(sc[1][0], sc[1][2]));
  float xB = fmaxf(fmaxf(sc[0][1], sc[0][3]), fmaxf(sc[1][1], sc[1][3]));
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    xA = fmaxf(xA, __shfl_xor_sync(0xffffffffu, xA, o));
    xB = fmaxf(xB, __shfl_xor_sync(0xffffffffu, xB, o));
  }
  const float nA = fmaxf(mA, xA), nB = fmaxf(mB, xB);
  alA = nA == -INFINITY ? 1.f : exp2_nonpos(mA - nA), alB = nB == -INFINITY ? 1.f : exp2_nonpos(mB - nB);
  mA = nA, mB = nB;
  const float uA = nA == -INFINITY ? 0.f : nA, uB = nB == -INFINITY ? 0.f : nB;  // exp2(-inf - u) = 0
  float psA = 0.f, psB = 0.f;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      sc[mt][e] = exp2_nonpos(sc[mt][e] - ((e & 1) ? uB : uA));
      if (e & 1) psB += sc[mt][e]; else psA += sc[mt][e];
    }
  lA = lA * alA + psA;
  lB = lB * alB + psB;
}

/// \brief End of a warp's tiles: reduce the running sums l over the 8 lanes sharing c and
/// store (m, l) of heads 2c, 2c + 1 at the head of their rows of the warp's slot [g][D + 2]
/// (the accumulators go to columns 2.. by the caller's channel map).
__device__ __forceinline__ void warp_store_ml(float* slot, int D, int g, int i, int c, float mA, float mB, float lA,
                                              float lB) {
#pragma unroll
  for (int o = 4; o < 32; o <<= 1) {
    lA += __shfl_xor_sync(0xffffffffu, lA, o);
    lB += __shfl_xor_sync(0xffffffffu, lB, o);
  }
  if (i == 0) {
    if (2 * c < g) slot[(2 * c) * (D + 2)] = mA, slot[(2 * c) * (D + 2) + 1] = lA;
    if (2 * c + 1 < g) slot[(2 * c + 1) * (D + 2)] = mB, slot[(2 * c + 1) * (D + 2) + 1] = lB;
  }
}

/// \brief P^T B-fragments of a tile's probabilities: pt[kst][0] = tokens 16kst + 0..7,
/// pt[kst][1] = tokens 16kst + 8..15 (lane (i, c): head i, tokens 2c, 2c + 1).
__device__ __forceinline__ void tile_pt_fragments(const float (&sc)[2][4], uint32_t (&pt)[2][2]) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    pt[mt][0] = movmatrix_trans(pack_half2(sc[mt][0], sc[mt][1]));
    pt[mt][1] = movmatrix_trans(pack_half2(sc[mt][2], sc[mt][3]));
  }
}

/// The GearCta header of (b, h): threads 0, 1 write the GearSegCta of segments 0, 1, the
/// others the position tables (the caller synchronizes).
template <typename DType, int D, int BITS, int VO_MAX>
__device__ __forceinline__ void gear_cta_fill(const DecodeAttnParams& p, int64_t b, int64_t h, char* gcta) {
  using PK = Pack<BITS>;
  using CM = ChannelMap<D, BITS>;
  const int tid = threadIdx.x;
  if (tid < 2) {
    const GearSeg& K = p.gk.seg[tid];
    const GearSeg& V = p.gv.seg[tid];
    GearSegCta gs;
    gs.kA = K.r > 0 ? reinterpret_cast<const char*>(K.A + b * K.A_sb + h * K.A_sh) : nullptr;
    gs.vA = V.r > 0 ? reinterpret_cast<const char*>(V.A + b * V.A_sb + h * V.A_sh) : nullptr;
    const bool ko = K.k > 0 && K.od != nullptr, vo = V.k > 0 && V.od != nullptr;
    gs.koff = ko ? reinterpret_cast<const char*>(K.off + b * K.f_sb + h * K.f_sh) : nullptr;
    gs.f_sblk = K.f_sblk * 4;
    gs.kod = ko ? static_cast<const char*>(K.od) + (b * K.d_sb + h * K.d_sh) * (int64_t)sizeof(DType) : nullptr;
    gs.d_sblk = K.d_sblk * (int64_t)sizeof(DType);
    gs.koi = ko ? static_cast<const char*>(K.oi) + (b * K.o_sb + h * K.o_sh) * K.ibytes : nullptr;
    gs.o_sblk = K.o_sblk * K.ibytes;
    gs.vod = vo ? static_cast<const char*>(V.od) + (b * V.d_sb + h * V.d_sh) * (int64_t)sizeof(DType) : nullptr;
    gs.voi = vo ? static_cast<const char*>(V.oi) + (b * V.o_sb + h * V.o_sh) * V.ibytes : nullptr;
    const int nk = vo ? 2 * V.k : 0;
    const bool vstaged = vo && nk <= VO_MAX && V.ibytes == 1;
    gs.flags = (uint32_t)K.r | ((uint32_t)V.r << 4) | (ko ? kGdKOut : 0u) | (vo ? kGdVOut : 0u) |
               (vstaged ? kGdVStaged : 0u) | ((uint32_t)nk << 16);
    gs.kr2 = 2 * K.r, gs.vr2 = 2 * V.r, gs.vnk = nk;
    gs.kB = K.r > 0 ? reinterpret_cast<const char*>(K.Bf + b * K.B_sb + h * K.B_sh) : nullptr;
    gs.kB_sblk = K.B_sblk * 2;
    gs.vB = V.r > 0 ? reinterpret_cast<const char*>(V.Bf + b * V.B_sb + h * V.B_sh) : nullptr;
    gs.vB_sblk = V.B_sblk * 2;
    reinterpret_cast<GearSegCta*>(gcta + GearCta::SEG)[tid] = gs;
  }
  uint8_t* klut = reinterpret_cast<uint8_t*>(gcta + GearCta::KLUT);
  uint8_t* vlut = reinterpret_cast<uint8_t*>(gcta + GearCta::vlut(D));
  for (int ch = tid; ch < D; ch += blockDim.x) {
    // keys: lane quad cq = ch / (D / 4) holds channel ch as member r / PO of pair pp of its run;
    // k-step pp / 2, k row 8 (pp & 1) + 2 cq + r / PO
    const int cq = ch / (D / 4), l = ch % (D / 4), r = l % PK::CPW;
    const int pp = (l / PK::CPW) * PK::PO + r % PK::PO;
    klut[ch] = (uint8_t)(16 * (pp >> 1) + 8 * (pp & 1) + 2 * cq + r / PK::PO);
    // values: pair prv of lane row prv / VP feeds m-tile prv % VP; member rv / PO is row + 8
    const int rv = ch % PK::CPW, prv = (ch / PK::CPW) * PK::PO + rv % PK::PO;
    vlut[ch] = (uint8_t)(16 * (prv % CM::VP) + prv / CM::VP + 8 * (rv / PK::PO));
  }
}

/// PAGED: p.paged.block_table is set and b is a sequence index; every tile's addresses come from
/// its page (tiles never straddle pages: P and t_begin are multiples of kTile, GEAR is off).
template <typename DType, int D, int BITS, bool KPC, bool GEAR, int NGV, bool PAGED = false>
__device__ void warp_mma(const DecodeAttnParams& p, int64_t b, int64_t h, int g, int64_t t_begin,
                         int64_t t_end, int warp, float* slot, char* ring, char* gscr, const float* s_q,
                         const char* gcta) {
  using CM = ChannelMap<D, BITS>;
  using TL = TileLayout<D, BITS, KPC, GEAR, sizeof(DType)>;
  using PK = Pack<BITS>;
  constexpr int NK = D / 16;  // k-steps of QK
  constexpr int MV = D / 16;  // m-tiles (16 channels) of PV
  // SUBK: per-channel keys as subnormal codes, scales folded into q, zero points by one more
  // mma per k-step.  SUBV (NGV = D / G > 0): values likewise, scales folded into P per value group; m-tile M is
  // channels [16 M, 16 M + 16) (one group: G % 16 == 0), lane row i holding channels
  // 16 M + 2 i (row i) and 16 M + 2 i + 1 (row i + 8).  GEAR layers keep the dequantizing value
  // path: their outlier and low-rank terms add into acc in plain units, which the subnormal
  // units of SUBV (2^(off - 24) per row) cannot take in fp16.  Their keys use SUBK: the scores
  // are brought to plain units (sc 2^24 + q . zero, exact) before the GEAR terms are added.
  constexpr bool SUBK = KPC;
  // NGV: value groups per token (compile time).  2-bit only: at 4 and 8 bits a lane would
  // need every other code word of a token (8 LDS.32 per token instead of 2 LDS.128), which
  // measured slower than dequantizing (kivi-4 152 vs 131 us, B = 8, L = 32k)
  constexpr bool SUBV = !GEAR && NGV > 0 && NGV <= MV && BITS == 2;
  constexpr int NKF = SUBK ? NK : 1;
  const int lane = threadIdx.x % 32, i = lane >> 2, c = lane & 3;
  const DType* q = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;

  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;
  float acc[MV][4];  // O^T: rows = channels (i, i + 8 of m-tile), cols = heads 2c, 2c + 1
#pragma unroll
  for (int n = 0; n < MV; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[n][e] = 0.f;
  constexpr int NZ = SUBV ? NGV : 1;
  float zacc[NZ][2];  // SUBV: sum_t p_t z_t of each value group, heads 2c, 2c + 1
#pragma unroll
  for (int j = 0; j < NZ; ++j) zacc[j][0] = zacc[j][1] = 0.f;

  const QuantKV& K = p.k;
  const QuantKV& V = p.v;
  const int32_t* kcodes = K.codes + b * K.codes_sb + h * K.codes_sh;
  const uint16_t* kscale = K.scale + b * K.scale_sb + h * K.scale_sh;
  const uint16_t* kzero = K.zero + b * K.scale_sb + h * K.scale_sh;
  const int32_t* vcodes = V.codes + b * V.codes_sb + h * V.codes_sh;
  const uint16_t* vscale = V.scale + b * V.scale_sb + h * V.scale_sh;
  const uint16_t* vzero = V.zero + b * V.scale_sb + h * V.scale_sh;
  constexpr int WROW = D * BITS / 32;
  const int ngk = KPC ? 1 : (int)(D / K.group);             // per-token key groups per token
  const int kj = KPC ? 0 : (int)((c * (D / 4)) / K.group);  // per-token key group of this lane quad
  const int ngv = (int)(D / V.group);
  const int vj = (int)((i * (D / 8)) / V.group);  // value group of this lane row
  const int v_first_word = (i * CM::VP) / PK::PO;
  const int soff = (i * CM::VP) % PK::PO;  // nonzero only when a row uses part of a word
  // SUBV lane constants: word, byte and bit offset of channels 2 i (row i) and 2 i + 1 (row
  // i + 8) of an m-tile; PRMT selectors put that byte of two tokens' words in bytes 0 and 2
  const int v_wofs = (2 * i * BITS) / 32;
  const int v_by0 = ((2 * i * BITS) % 32) / 8, v_by1 = (((2 * i + 1) * BITS) % 32) / 8;
  const int v_off0 = (2 * i * BITS) % 8, v_off1 = ((2 * i + 1) * BITS) % 8;
  const uint32_t v_sel0 = (uint32_t)(v_by0 | (v_by0 << 4) | ((4 + v_by0) << 8) | ((4 + v_by0) << 12));
  const uint32_t v_sel1 = (uint32_t)(v_by1 | (v_by1 << 4) | ((4 + v_by1) << 8) | ((4 + v_by1) << 12));
  const uint32_t v_m0 = PK::MASK << v_off0, v_m1 = PK::MASK << v_off1;
  const int kgroup = (int)K.group;

  // ---- GEAR state (see GearScratch) ----
  using GS = GearScratch;
  uint16_t* s_dv = reinterpret_cast<uint16_t*>(gscr + GS::DV);
  constexpr int DVS = D + 8;  // row stride (halves) of s_dv: 8 ldmatrix rows hit distinct banks
  float* s_qb = reinterpret_cast<float*>(gscr + GS::QB);
  float u[2] = {0.f, 0.f};  // U[rank i][heads 2c, 2c + 1] (C rows i; rows i + 8 stay zero)
  uint32_t qlr = 0;         // B fragment of the key low-rank mma: qB[head i][ranks 2c, 2c + 1] / max|q_i|
  int cur_bid = -1;
  if constexpr (GEAR) {
    for (int x = lane; x < 16 * DVS / 2; x += 32) reinterpret_cast<uint32_t*>(s_dv)[x] = 0u;
    __syncwarp();
  }

  // this warp's tiles: t0 = t_begin + (warp + kWarps * k) * kTile, k < ntiles
  const int64_t first = t_begin + warp * kTile;
  const int ntiles = first < t_end ? (int)((t_end - first + kWarps * kTile - 1) / (kWarps * kTile)) : 0;
  // the next tile to issue, with its source pointers advanced incrementally (tiles are issued
  // in order; no 64-bit multiplies or divisions per tile)
  constexpr int kStep = kWarps * kTile;  // tokens between a warp's consecutive tiles
  int64_t is_t0 = first;
  int is_stage = 0;
  const int32_t* is_kc = kcodes + first * WROW;
  const int32_t* is_vc = vcodes + first * WROW;
  const uint16_t* is_vs = vscale + first * ngv;
  const uint16_t* is_vz = vzero + first * ngv;
  // per-channel keys: the row of group t0 / G (kgstep rows per tile when G divides the step)
  const int kgstep = KPC ? (kStep % kgroup == 0 ? kStep / kgroup : 0) : 0;
  const int64_t k_row0 = KPC ? (first / kgroup) * D : first * ngk;
  const uint16_t* is_ks = kscale + k_row0;
  const uint16_t* is_kz = kzero + k_row0;
  // paged: this sequence's block-table row; page index and row of a token are a shift and a mask
  const int32_t* bt = PAGED ? p.paged.block_table + b * p.paged.bt_stride : nullptr;
  const int pshift = p.paged.page_shift, prmask = (1 << pshift) - 1;
  auto issue = [&](int k) {
    if (k < ntiles) {
      const int64_t t0 = is_t0;
      char* st = ring + is_stage * TL::BYTES;
      if constexpr (PAGED) {  // the tile's rows of its page
        const int64_t pg = __ldg(bt + (int)(t0 >> pshift));
        const int r = (int)t0 & prmask;
        is_kc = K.codes + pg * K.codes_sb + h * K.codes_sh + r * WROW;
        is_vc = V.codes + pg * V.codes_sb + h * V.codes_sh + r * WROW;
        const int64_t vs0 = pg * V.scale_sb + h * V.scale_sh + r * ngv;
        is_vs = V.scale + vs0, is_vz = V.zero + vs0;
        const int64_t ks0 = pg * K.scale_sb + h * K.scale_sh + (KPC ? (int64_t)(r / kgroup) * D : (int64_t)r * ngk);
        is_ks = K.scale + ks0, is_kz = K.zero + ks0;
      }
      warp_copy_async<TL::CODES>(st + TL::KC_OFF, is_kc, TL::CODES, lane);
      warp_copy_async<TL::CODES>(st + TL::VC_OFF, is_vc, TL::CODES, lane);
      if constexpr (KPC) {
        warp_copy_async<2 * D>(st + TL::KS_OFF, is_ks, 2 * D, lane);
        warp_copy_async<2 * D>(st + TL::KZ_OFF, is_kz, 2 * D, lane);
      } else {
        warp_copy_async<TL::KS>(st + TL::KS_OFF, is_ks, kTile * ngk * 2, lane);
        warp_copy_async<TL::KS>(st + TL::KZ_OFF, is_kz, kTile * ngk * 2, lane);
      }
      warp_copy_async<TL::VS>(st + TL::VS_OFF, is_vs, kTile * ngv * 2, lane);
      warp_copy_async<TL::VS>(st + TL::VZ_OFF, is_vz, kTile * ngv * 2, lane);
      is_t0 += kStep;
      if constexpr (!PAGED) {
        is_kc += kStep * WROW, is_vc += kStep * WROW, is_vs += kStep * ngv, is_vz += kStep * ngv;
        if constexpr (KPC) {
          const int64_t row = kgstep ? (int64_t)kgstep * D : (is_t0 / kgroup - t0 / kgroup) * D;
          is_ks += row, is_kz += row;
        } else {
          is_ks += kStep * ngk, is_kz += kStep * ngk;
        }
      }
      is_stage = is_stage + 1 == TL::STAGES ? 0 : is_stage + 1;
      if constexpr (GEAR) {
        // segment, block and position of the tile (32-bit; the division only in segment 1)
        const int t = (int)t0, T0 = (int)p.gear_t0, nb = (int)p.gear_nb;
        const int seg = t >= T0 ? 1 : 0;
        const int ts0 = seg ? t - T0 : t;
        const int blk = seg ? ts0 / nb : 0;
        const int tb0 = ts0 - blk * nb, jt = tb0 / kTile;
        const uint4* gs = reinterpret_cast<const uint4*>(gcta + GearCta::SEG + seg * (int)sizeof(GearSegCta));
        const uint4 g0 = gs[0], g1 = gs[1], g2 = gs[2], g5 = gs[5];  // (kA, vA), (vod, voi), (koff, f_sblk), flags..
        auto ptr = [](uint32_t lo, uint32_t hi) { return reinterpret_cast<const char*>(((uint64_t)hi << 32) | lo); };
        const uint32_t sf = g5.x;
        const int kr2 = (int)g5.y, vr2 = (int)g5.z, nk = (int)g5.w;
        if (sf & 0x0Fu) warp_copy_async<TL::A_BYTES>(st + TL::KA_OFF, ptr(g0.x, g0.y) + ts0 * kr2, kTile * kr2, lane);
        if (sf & 0xF0u) warp_copy_async<TL::A_BYTES>(st + TL::VA_OFF, ptr(g0.z, g0.w) + ts0 * vr2, kTile * vr2, lane);
        if (sf & kGdKOut)  // the 16-byte aligned window of 8 tile offsets holding tiles j, j + 1
          warp_copy_async<32>(st + TL::KO_OFF,
                              ptr(g2.x, g2.y) + blk * (int64_t)(((uint64_t)g2.w << 32) | g2.z) + (jt & ~3) * 4, 32,
                              lane);
        if (sf & kGdVStaged) {
          warp_copy_async<TL::VOV_BYTES>(st + TL::VOV_OFF, ptr(g1.x, g1.y) + ts0 * nk * (int)sizeof(DType),
                                         kTile * nk * (int)sizeof(DType), lane);
          warp_copy_async<TL::VOI_BYTES>(st + TL::VOI_OFF, ptr(g1.z, g1.w) + ts0 * nk, kTile * nk, lane);
        }
        // the warp's next tile (t + kStep) lies in a later block, or there is none; its previous
        // tile (t - kStep) in an earlier one, or there is none
        const bool last = k + 1 >= ntiles || tb0 + kStep >= (seg ? nb : T0);
        const bool bfirst = k == 0 || tb0 < kStep;
        // the block's B rows that the compute step reads from global memory at this tile (q . B_k
        // at the warp's first tile of the block, the B_v flush at its last): into L1 one tile ahead
        if (bfirst && (sf & 0x0Fu)) {
          const uint4 g6 = gs[6];
          gear_prefetch_l1(ptr(g6.x, g6.y) + blk * (int64_t)(((uint64_t)g6.w << 32) | g6.z), D * kr2, lane);
        }
        if (last && (sf & 0xF0u)) {
          const uint4 g7 = gs[7];
          gear_prefetch_l1(ptr(g7.x, g7.y) + blk * (int64_t)(((uint64_t)g7.w << 32) | g7.z), D * vr2, lane);
        }
        if (lane == 0) {
          *reinterpret_cast<uint4*>(st + TL::GD_OFF) =
              make_uint4(sf | ((uint32_t)(jt & 3) << 8) | (last ? kGdLast : 0u), (uint32_t)(seg ? 1 + blk : 0),
                         (uint32_t)ts0, 0u);
        }
      }
    }
    cp_async_commit();  // (possibly empty) group: keeps the wait count uniform
  };
  // D >= 128: the first tiles' copies go out before the q fragments are built, so that the
  // latency of the q loads below overlaps theirs (written out rather than as a loop over
  // STAGES - 1: the loop form made ptxas spill two q fragments in the 2-bit mma loop).  D = 64:
  // after them, as before -- issued first, the 2-bit kernels grew from 128 to 133 registers
  // (4 -> 3 CTAs per SM).  (ptxas of nvcc 13.0, sm_90.)
  constexpr bool kTilesFirst = D >= 128;
  static_assert(TL::STAGES == 2 || TL::STAGES == 3, "the prologues issue STAGES - 1 tiles");
  if constexpr (kTilesFirst) {
    issue(0);
    if (TL::STAGES > 2) issue(1);
  }

  // ---- q^T B-fragments of head i, normalised per head so fp16 cannot overflow ----
  float qm = 0.f;
  if (i < g) {
#pragma unroll
    for (int pp = 0; pp < CM::KP; ++pp)
#pragma unroll
      for (int m = 0; m < 2; ++m) qm = fmaxf(qm, fabsf(to_float(q[i * D + c * (D / 4) + CM::channel(pp, m)])));
  }
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 1));
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 2));
  qm = qm > 0.f ? qm : 1.f;
  const float rq = 1.f / qm;
  // qb: the B fragments of q^T / max|q|; qf (per-channel keys, subnormal codes): the same
  // divided by 2^off of each pair (exact powers of two), so that (code 2^(off-24)) . (qf s) =
  // code q s 2^-24 whatever the pair's bit offset
  uint32_t qb[NK][2], qf[NKF][2];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {  // r = 0: pair 2kk (k rows 2c, 2c+1), r = 1: pair 2kk + 1 (rows 2c+8, 2c+9)
      const int pp = 2 * kk + r;
      const int cha = c * (D / 4) + CM::channel(pp, 0), chb = c * (D / 4) + CM::channel(pp, 1);
      const float xa = i < g ? to_float(q[i * D + cha]) * rq : 0.f, xb = i < g ? to_float(q[i * D + chb]) * rq : 0.f;
      qb[kk][r] = pack_half2(xa, xb);
      if constexpr (SUBK) {
        const float f = 1.f / (float)(1 << sub_off<BITS>(pp % PK::PO));
        qf[kk][r] = pack_half2(xa * f, xb * f);
      }
    }
  }
  // this lane's softmax heads are 2c and 2c + 1: their score factors (log2 domain)
  const float sl = p.scale * kLog2e;
  const float sfA = __shfl_sync(0xffffffffu, qm, (2 * c) * 4) * sl;
  const float sfB = __shfl_sync(0xffffffffu, qm, (2 * c + 1) * 4) * sl;
  if constexpr (!kTilesFirst) {
#pragma unroll
    for (int k = 0; k < TL::STAGES - 1; ++k) issue(k);
  }

  int64_t t0 = first - kStep;
  int stage = TL::STAGES - 1;
  for (int k = 0; k < ntiles; ++k) {
    issue(k + TL::STAGES - 1);
    cp_async_wait<TL::STAGES - 1>();
    __syncwarp();
    t0 += kStep;
    stage = stage + 1 == TL::STAGES ? 0 : stage + 1;
    const char* st = ring + stage * TL::BYTES;
    const int32_t* s_kc = reinterpret_cast<const int32_t*>(st + TL::KC_OFF);
    const int32_t* s_vc = reinterpret_cast<const int32_t*>(st + TL::VC_OFF);
    const uint16_t* s_ks = reinterpret_cast<const uint16_t*>(st + TL::KS_OFF);
    const uint16_t* s_kz = reinterpret_cast<const uint16_t*>(st + TL::KZ_OFF);
    const uint16_t* s_vs = reinterpret_cast<const uint16_t*>(st + TL::VS_OFF);
    const uint16_t* s_vz = reinterpret_cast<const uint16_t*>(st + TL::VZ_OFF);

    const uint16_t* s_ka = reinterpret_cast<const uint16_t*>(st + TL::KA_OFF);
    const uint16_t* s_va = reinterpret_cast<const uint16_t*>(st + TL::VA_OFF);
    constexpr int KE = 4;  // key outlier entries per lane loaded ahead of their mma
    // entry: fp16 bits of its correction | packed index << 16 (0xFFFF: none)
    uint32_t e_w[KE];
    int e_lo = 0, e_hi = 0;
    uint32_t gf = 0;  // GearTileDesc::flags of this tile
    const char* kod = nullptr;
    const char* koi = nullptr;
    int gbid = 0;
    if constexpr (GEAR) {
      const GearTileDesc* gd = reinterpret_cast<const GearTileDesc*>(st + TL::GD_OFF);
      gf = gd->flags, gbid = gd->bid;
      if (gf & kGdKOut) {  // this tile's key outlier entries [e_lo, e_hi): start their loads now
        const GearSegCta* gs = reinterpret_cast<const GearSegCta*>(gcta + GearCta::SEG) + (gbid > 0 ? 1 : 0);
        kod = gs->kod, koi = gs->koi;
        if (gbid > 1) kod += (int64_t)(gbid - 1) * gs->d_sblk, koi += (int64_t)(gbid - 1) * gs->o_sblk;
        const int32_t* s_ko = reinterpret_cast<const int32_t*>(st + TL::KO_OFF);
        const int j = (gf >> 8) & 3;
        e_lo = s_ko[j], e_hi = s_ko[j + 1];
        const DType* od = reinterpret_cast<const DType*>(kod);
        const uint16_t* oi = reinterpret_cast<const uint16_t*>(koi);
#pragma unroll
        for (int m = 0; m < KE; ++m) {
          const int e = e_lo + lane + 32 * m;
          e_w[m] = e < e_hi ? (gear_delta_ldg(od, e) | ((uint32_t)__ldg(oi + e) << 16)) : 0xFFFF0000u;
        }
      }
    }
    // ---------------- S^T = K q^T: 2 m-tiles of 16 tokens ----------------
    // key rows nt * 8 + i (nt = 0..3): m-tile nt / 2, row half nt % 2
    uint32_t kw[4][CM::WK];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) lds_words<CM::WK>(s_kc + (nt * 8 + i) * WROW + c * CM::WK, kw[nt]);
    uint32_t ksz[4];  // per-token keys: scale | zero << 16 of token row nt * 8 + i
    if constexpr (!KPC) {
#pragma unroll
      for (int nt = 0; nt < 4; ++nt) {
        const int off = (nt * 8 + i) * ngk + kj;
        ksz[nt] = (uint32_t)s_ks[off] | ((uint32_t)s_kz[off] << 16);
      }
    }
    const uint32_t* sw = reinterpret_cast<const uint32_t*>(s_ks + c * (D / 4));  // per-channel keys
    const uint32_t* zw = reinterpret_cast<const uint32_t*>(s_kz + c * (D / 4));
    float sc[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] = 0.f;
    float zc[4] = {0.f, 0.f, 0.f, 0.f};  // SUBK: q . zero of the tile's group (all rows equal)
    if constexpr (SUBK) {
      // this lane quad's scale and zero rows (channels [c D/4, (c + 1) D/4)) as words
      uint32_t swr[D / 8], zwr[D / 8];
      lds_words<D / 8>(reinterpret_cast<const int32_t*>(s_ks + c * (D / 4)), swr);
      lds_words<D / 8>(reinterpret_cast<const int32_t*>(s_kz + c * (D / 4)), zwr);
      auto pair_of = [&](const uint32_t(&w)[D / 8], int pp) {  // (x[ch(pp, 0)], x[ch(pp, 1)]) as fp16x2
        const int la = CM::channel(pp, 0), lb = CM::channel(pp, 1);  // same parity
        return __byte_perm(w[la / 2], w[lb / 2], (la & 1) ? 0x7632u : 0x5410u);
      };
#pragma unroll
      for (int kk = 0; kk < NK; ++kk) {
        const int pa = 2 * kk, pb = 2 * kk + 1;
        const uint32_t b0 = hmul2_u32(qf[kk][0], pair_of(swr, pa)), b1 = hmul2_u32(qf[kk][1], pair_of(swr, pb));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          const uint32_t w0a = kw[2 * mt][pa / PK::PO], w1a = kw[2 * mt + 1][pa / PK::PO];
          const uint32_t w0b = kw[2 * mt][pb / PK::PO], w1b = kw[2 * mt + 1][pb / PK::PO];
          uint32_t a[4];
          a[0] = sub_pair<BITS>(w0a, w0a >> 8, pa % PK::PO);
          a[1] = sub_pair<BITS>(w1a, w1a >> 8, pa % PK::PO);
          a[2] = sub_pair<BITS>(w0b, w0b >> 8, pb % PK::PO);
          a[3] = sub_pair<BITS>(w1b, w1b >> 8, pb % PK::PO);
          mma16816(sc[mt], a, b0, b1);
        }
        // zero points: every row of sc gets sum_c q_c z_c (A = the zero row in every row, B = q;
        // exact products, unlike an fp16 q . z operand)
        const uint32_t za = pair_of(zwr, pa), zb = pair_of(zwr, pb);
        const uint32_t az[4] = {za, za, zb, zb};
        mma16816(zc, az, qb[kk][0], qb[kk][1]);
      }
      if constexpr (GEAR) {  // plain units before the GEAR terms add theirs: sc 2^24 + q . zero (exact scaling)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt)
#pragma unroll
          for (int e = 0; e < 4; ++e) sc[mt][e] = fmaf(sc[mt][e], 16777216.f, zc[e & 1]);
      }
    }
#pragma unroll
    for (int kk = 0; kk < (SUBK ? 0 : NK); ++kk) {
      const int pa = 2 * kk, pb = 2 * kk + 1;
      uint32_t ksa[2], kza[2], ksb[2], kzb[2];  // [row half]: scale/zero of pairs pa, pb
      if constexpr (KPC) {
        const int la = CM::channel(pa, 0), lb = CM::channel(pa, 1);  // same parity
        const int ma = CM::channel(pb, 0), mb = CM::channel(pb, 1);
        ksa[0] = ksa[1] = __byte_perm(sw[la / 2], sw[lb / 2], (la & 1) ? 0x7632u : 0x5410u);
        kza[0] = kza[1] = __byte_perm(zw[la / 2], zw[lb / 2], (la & 1) ? 0x7632u : 0x5410u);
        ksb[0] = ksb[1] = __byte_perm(sw[ma / 2], sw[mb / 2], (ma & 1) ? 0x7632u : 0x5410u);
        kzb[0] = kzb[1] = __byte_perm(zw[ma / 2], zw[mb / 2], (ma & 1) ? 0x7632u : 0x5410u);
      }
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        if constexpr (!KPC) {
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) {
            const uint32_t s1 = ksz[2 * mt + hh] & 0xffffu, z1 = ksz[2 * mt + hh] >> 16;
            ksa[hh] = ksb[hh] = s1 | (s1 << 16);
            kza[hh] = kzb[hh] = z1 | (z1 << 16);
          }
        }
        uint32_t a[4];
        const uint32_t w0a = kw[2 * mt][pa / PK::PO], w1a = kw[2 * mt + 1][pa / PK::PO];
        const uint32_t w0b = kw[2 * mt][pb / PK::PO], w1b = kw[2 * mt + 1][pb / PK::PO];
        a[0] = hfma2_u32(extract_pair<BITS>(w0a, w0a >> 8, pa % PK::PO), ksa[0], kza[0]);
        a[1] = hfma2_u32(extract_pair<BITS>(w1a, w1a >> 8, pa % PK::PO), ksa[1], kza[1]);
        a[2] = hfma2_u32(extract_pair<BITS>(w0b, w0b >> 8, pb % PK::PO), ksb[0], kzb[0]);
        a[3] = hfma2_u32(extract_pair<BITS>(w1b, w1b >> 8, pb % PK::PO), ksb[1], kzb[1]);
        mma16816(sc[mt], a, qb[kk][0], qb[kk][1]);
      }
    }
    if constexpr (GEAR) {
      const int kr = (int)(gf & 15u);
      if (gbid != cur_bid) {  // a new block for this warp (rare: once per block and warp)
        cur_bid = gbid;
        if (kr > 0) {
          if constexpr (D <= 128) {
            // q . B_k of this block, scaled like q, on the tensor cores: B_k^T (ranks x channels)
            // is written (fp16) into the per-warp dense tile s_dv (zero here: row j = rank j < kr,
            // column = the channel's QK position, table klut) and runs through the QK mma with
            // the q fragments like the key outlier corrections, then is cleared.  C (lane (i, c):
            // rank i, heads 2c, 2c + 1; rows >= kr zero) transposed by movmatrix is the B fragment
            // of the low-rank score mma (head i, ranks 2c, 2c + 1).  B_k rows were prefetched by
            // issue().
            const GearSegCta* gs = reinterpret_cast<const GearSegCta*>(gcta + GearCta::SEG) + (gbid > 0 ? 1 : 0);
            const uint16_t* bk =
                reinterpret_cast<const uint16_t*>(gs->kB + (gbid > 1 ? (int64_t)(gbid - 1) * gs->kB_sblk : 0));
            const uint8_t* klut = reinterpret_cast<const uint8_t*>(gcta + GearCta::KLUT);
            const uint32_t dv_base = (unsigned)__cvta_generic_to_shared(s_dv);
            // (lane's channels one at a time: unrolled, the fp16 D = 128 2-bit kernel spilled a
            // register that the tile loop reloads every tile; ptxas of nvcc 13.0)
#pragma unroll 1
            for (int m = 0; m < D / 32; ++m) {
              const int ch = lane + 32 * m;
              const uint32_t at = dv_base + 2u * klut[ch];  // channel ch in row 0
              const uint16_t* row = bk + ch * kr;
              if constexpr (sizeof(DType) == 2) {
#pragma unroll
                for (int j = 0; j < 8; ++j)  // (kr <= 8: constant offsets, no loop)
                  if (j < kr) sts_u16(at + 2u * (uint32_t)(j * DVS), __ldg(row + j));
              } else {  // (fp32 caches: the unrolled form made ptxas spill in the tile loop)
                for (int j = 0; j < kr; ++j) sts_u16(at + 2u * (uint32_t)(j * DVS), __ldg(row + j));
              }
            }
            __syncwarp();
            float d[4] = {0.f, 0.f, 0.f, 0.f};
            // ldmatrix.x4 rows of this lane: ranks (lane & 7) + 8 ((lane >> 3) & 1), k + 8 (lane >> 4)
            const unsigned ld_base = dv_base + 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * DVS + 8 * (lane >> 4));
#pragma unroll
            for (int kk = 0; kk < NK; ++kk) {
              uint32_t a[4];
              ldmatrix_x4<false>(a, ld_base + 32u * kk);
              mma16816(d, a, qb[kk][0], qb[kk][1]);
            }
            __syncwarp();
#pragma unroll 1
            for (int m = 0; m < D / 32; ++m) {
              const uint32_t at = dv_base + 2u * klut[lane + 32 * m];
              if constexpr (sizeof(DType) == 2) {
#pragma unroll 2  // (fully unrolled like the loads above, ptxas spilled a register in the tile loop)
                for (int j = 0; j < kr; ++j) sts_u16(at + 2u * (uint32_t)(j * DVS), 0u);
              } else {
                for (int j = 0; j < kr; ++j) sts_u16(at + 2u * (uint32_t)(j * DVS), 0u);
              }
            }
            __syncwarp();
            qlr = movmatrix_trans(pack_half2(d[0], d[1]));
          } else {
            // D = 256: q . B_k by lanes over channels and butterfly sums (the dense-tile form above
            // made ptxas spill q fragments in the tile loop of these 255-register kernels)
            const uint16_t* bk = gear_seg<DType>(p.gk, b, h, gbid > 0 ? 1 : 0, gbid > 0 ? gbid - 1 : 0).Bf;
            for (int hr = 0; hr < g * kr; ++hr) {
              const int hh = hr / kr, j = hr - hh * kr;
              float a = 0.f;
#pragma unroll
              for (int m = 0; m < D / 32; ++m) {
                const int ch = lane + 32 * m;
                a += s_q[hh * D + ch] * half_bits_to_float(__ldg(bk + ch * kr + j));
              }
#pragma unroll
              for (int o = 16; o > 0; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
              if (lane == 0) s_qb[hh * 8 + j] = a;
            }
            __syncwarp();
            const float q0 = (i < g && 2 * c < kr) ? s_qb[i * 8 + 2 * c] * rq : 0.f;
            const float q1 = (i < g && 2 * c + 1 < kr) ? s_qb[i * 8 + 2 * c + 1] * rq : 0.f;
            qlr = pack_half2(q0, q1);
          }
        }
      }
      if (kr > 0) {  // scores += A_k[t] . qB: one mma per 16 tokens (ranks = k, zero beyond r)
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
          uint32_t a[4];
          a[0] = gear_pair(s_ka, 16 * mt + i, 2 * c, kr);
          a[1] = gear_pair(s_ka, 16 * mt + i + 8, 2 * c, kr);
          a[2] = a[3] = 0u;
          mma16816(sc[mt], a, qlr, 0u);
        }
      }
      if (gf & kGdKOut) {
        // key outliers: score_t += q_c d_tc.  The tile's entries (sorted by token, one per lane
        // and round) write their stored corrections into a dense fp16 tile of half the tokens,
        // channels in QK mma order (position table klut), which runs through the QK mma with q
        // like the codes; then the entries are cleared (the value path finds the tile zero).
        const uint8_t* klut = reinterpret_cast<const uint8_t*>(gcta + GearCta::KLUT);
        const DType* od = reinterpret_cast<const DType*>(kod);
        const uint16_t* oi = reinterpret_cast<const uint16_t*>(koi);
        const uint32_t dv_base = (unsigned)__cvta_generic_to_shared(s_dv);
        // shared address of an entry (packed index pk) in the dense tile of its half
        auto kaddr = [&](uint32_t pk) {
          return dv_base + (((pk >> 8) & 15u) * DVS + klut[pk & (D - 1)]) * 2u;
        };
        uint32_t e_ad[KE];  // (garbage for no entry: never stored)
#pragma unroll
        for (int m = 0; m < KE; ++m) e_ad[m] = kaddr(e_w[m] >> 16);
        // entry m exists (bit 31 of e_w clear) and lies in half mt (token >> 4: bit 28)
        auto in_half = [&](int m, int mt) { return (e_w[m] & 0x90000000u) == (mt ? 0x10000000u : 0u); };
        // ldmatrix.x4 rows of this lane: tokens (lane & 7) + 8 ((lane >> 3) & 1), k + 8 (lane >> 4)
        const unsigned ld_base = dv_base + 2u * (((lane & 7) + 8 * ((lane >> 3) & 1)) * DVS + 8 * (lane >> 4));
#pragma unroll
        for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
          for (int m = 0; m < KE; ++m)
            if (in_half(m, mt)) sts_u16(e_ad[m], e_w[m]);
          for (int e0 = e_lo + 32 * KE; e0 < e_hi; e0 += 32) {  // entries beyond the preloaded rounds (rare)
            const int e = e0 + lane;
            const uint32_t pk = e < e_hi ? (uint32_t)__ldg(oi + e) : 0u;
            if (e < e_hi && ((pk >> 12) & 1u) == (uint32_t)mt) sts_u16(kaddr(pk), gear_delta_ldg(od, e));
          }
          __syncwarp();
#pragma unroll
          for (int kk = 0; kk < NK; ++kk) {
            uint32_t a[4];
            ldmatrix_x4<false>(a, ld_base + 32u * kk);
            mma16816(sc[mt], a, qb[kk][0], qb[kk][1]);
          }
          __syncwarp();
#pragma unroll
          for (int m = 0; m < KE; ++m)
            if (in_half(m, mt)) sts_u16(e_ad[m], 0u);
          for (int e0 = e_lo + 32 * KE; e0 < e_hi; e0 += 32) {
            const int e = e0 + lane;
            const uint32_t pk = e < e_hi ? (uint32_t)__ldg(oi + e) : 0u;
            if (e < e_hi && ((pk >> 12) & 1u) == (uint32_t)mt) sts_u16(kaddr(pk), 0u);
          }
          __syncwarp();
        }
      }
    }
    // ---------------- online softmax: heads 2c (e even) and 2c + 1 (e odd) ----------------
    if constexpr (SUBK && !GEAR) {  // (sc 2^24 + q . zero) * score factor
      const float zA = zc[0] * sfA, zB = zc[1] * sfB, kA = 16777216.f * sfA, kB = 16777216.f * sfB;
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][e] = (e & 1) ? fmaf(sc[mt][e], kB, zB) : fmaf(sc[mt][e], kA, zA);
    } else {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][e] *= (e & 1) ? sfB : sfA;
    }
    float alA, alB;
    tile_online_softmax(sc, p.mask != nullptr ? p.mask + b * p.mask_sb + t0 : nullptr, i, mA, mB, lA, lB, alA, alB);
    if (__any_sync(0xffffffffu, alA != 1.f || alB != 1.f)) {  // a running max moved
#pragma unroll
      for (int n = 0; n < MV; ++n) acc[n][0] *= alA, acc[n][1] *= alB, acc[n][2] *= alA, acc[n][3] *= alB;
      if constexpr (SUBV) {
#pragma unroll
        for (int j = 0; j < NZ; ++j) zacc[j][0] *= alA, zacc[j][1] *= alB;
      }
      if constexpr (GEAR) {
        u[0] *= alA, u[1] *= alB;
      }
    }
    uint32_t pt[2][2];
    tile_pt_fragments(sc, pt);

    // ---------------- O^T += V^T P^T over 2 k-steps of 16 tokens ----------------
    if constexpr (SUBV) {
      // m-tile M: A = subnormal codes of channels 16 M + 2 i (+ 1), B = P^T scaled per token by
      // the scale of M's value group; zero points per group in zacc (plain units)
#pragma unroll
      for (int kst = 0; kst < 2; ++kst) {
        const int t01 = 16 * kst + 2 * c;  // tokens t01, t01 + 1 (a0, a1, b0), t01 + 8, t01 + 9 (a2, a3, b1)
        uint32_t vw[4][MV];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int32_t* row = s_vc + (t01 + (u & 1) + 8 * (u >> 1)) * WROW;
          if constexpr (BITS == 2) {
            lds_words<MV>(row, vw[u]);
          } else {
#pragma unroll
            for (int M = 0; M < MV; ++M) vw[u][M] = (uint32_t)row[M * (BITS / 2) + v_wofs];
          }
        }
        // scale and zero rows of tokens (t01, t01 + 1) and (t01 + 8, t01 + 9): NGV words each
        // (token t01's groups in words [0, NGV / 2), t01 + 1's after; NGV = 1: one pair)
        constexpr int NW = NGV > 0 ? NGV : 1;
        uint32_t sw01[NW], sw89[NW], zw01[NW], zw89[NW];
        {
          const int32_t* vs32 = reinterpret_cast<const int32_t*>(s_vs);
          const int32_t* vz32 = reinterpret_cast<const int32_t*>(s_vz);
          lds_words<NW>(vs32 + t01 * NW / 2, sw01), lds_words<NW>(vs32 + (t01 + 8) * NW / 2, sw89);
          lds_words<NW>(vz32 + t01 * NW / 2, zw01), lds_words<NW>(vz32 + (t01 + 8) * NW / 2, zw89);
        }
        auto tok_pair = [&](const uint32_t(&w)[NW], int gi) {  // (x[t][gi], x[t + 1][gi]) as fp16x2
          if constexpr (NW == 1) return w[0];
          else return __byte_perm(w[gi / 2], w[NW / 2 + gi / 2], (gi & 1) ? 0x7632u : 0x5410u);
        };
        uint32_t ps0 = 0u, ps1 = 0u;
#pragma unroll
        for (int M = 0; M < MV; ++M) {
          constexpr int MPG = MV / NW;  // m-tiles per value group
          if (M % MPG == 0) {  // first m-tile of a value group: its B operands
            const int gi = M / MPG;
            ps0 = hmul2_u32(pt[kst][0], tok_pair(sw01, gi)), ps1 = hmul2_u32(pt[kst][1], tok_pair(sw89, gi));
            // the group's zero points: zacc += sum_t p_t z_t (A = the tokens' zero points in every
            // row, B = P^T: exact products; rows i + 8 discarded)
            float d[4] = {zacc[gi][0], zacc[gi][1], 0.f, 0.f};
            const uint32_t z01 = tok_pair(zw01, gi), z89 = tok_pair(zw89, gi);
            const uint32_t az[4] = {z01, z01, z89, z89};
            mma16816(d, az, pt[kst][0], pt[kst][1]);
            zacc[gi][0] = d[0], zacc[gi][1] = d[1];
          }
          const uint32_t x01 = __byte_perm(vw[0][M], vw[1][M], v_sel0), x89 = __byte_perm(vw[2][M], vw[3][M], v_sel0);
          const uint32_t y01 = BITS == 8 ? __byte_perm(vw[0][M], vw[1][M], v_sel1) : x01;
          const uint32_t y89 = BITS == 8 ? __byte_perm(vw[2][M], vw[3][M], v_sel1) : x89;
          const uint32_t a[4] = {x01 & v_m0, y01 & v_m1, x89 & v_m0, y89 & v_m1};
          mma16816(acc[M], a, ps0, ps1);
        }
      }
    }
#pragma unroll
    for (int kst = 0; kst < (SUBV ? 0 : 2); ++kst) {
      // tokens u: 2c, 2c + 1, 2c + 8, 2c + 9 of the k-step
      uint32_t vw[4][CM::WV], vsz[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int tl = 16 * kst + 2 * c + (u & 1) + 8 * (u >> 1);
        lds_words<CM::WV>(s_vc + tl * WROW + v_first_word, vw[u]);
        const int off = tl * ngv + vj;
        vsz[u] = (uint32_t)s_vs[off] | ((uint32_t)s_vz[off] << 16);
      }
      const uint32_t S01 = __byte_perm(vsz[0], vsz[1], 0x5410u), Z01 = __byte_perm(vsz[0], vsz[1], 0x7632u);
      const uint32_t S89 = __byte_perm(vsz[2], vsz[3], 0x5410u), Z89 = __byte_perm(vsz[2], vsz[3], 0x7632u);
#pragma unroll
      for (int wi = 0; wi < CM::WV; ++wi) {
        // token pairs side by side: low 16 bits of each word hold codes 0..PO-1 (member 0 of
        // pairs), high 16 bits codes PO..2PO-1 (member 1)
        const uint32_t X01 = __byte_perm(vw[0][wi], vw[1][wi], 0x5410u), Y01 = __byte_perm(vw[0][wi], vw[1][wi], 0x7632u);
        const uint32_t X89 = __byte_perm(vw[2][wi], vw[3][wi], 0x5410u), Y89 = __byte_perm(vw[2][wi], vw[3][wi], 0x7632u);
#pragma unroll
        for (int pp = 0; pp < CM::VP; ++pp) {
          const int qq = soff + pp;
          if (qq / PK::PO != wi) continue;  // resolved at compile time except for soff
          const int s = qq % PK::PO;
          uint32_t a[4];
          // channel row i (member 0), tokens 2c, 2c+1
          a[0] = hfma2_u32(extract_pair<BITS>(X01, X01 >> 8, s), S01, Z01);
          a[1] = hfma2_u32(extract_pair<BITS>(Y01, Y01 >> 8, s), S01, Z01);  // row i + 8 (member 1)
          a[2] = hfma2_u32(extract_pair<BITS>(X89, X89 >> 8, s), S89, Z89);  // row i, tokens 2c+8, 2c+9
          a[3] = hfma2_u32(extract_pair<BITS>(Y89, Y89 >> 8, s), S89, Z89);
          mma16816(acc[pp], a, pt[kst][0], pt[kst][1]);
        }
      }
    }
    if constexpr (GEAR) {
      const int vr = (int)((gf >> 4) & 15u);
      if (vr > 0) {  // U^T (ranks x heads) += A_v^T (ranks x tokens) . P^T
#pragma unroll
        for (int kst = 0; kst < 2; ++kst) {
          uint32_t a[4];
          const int tA = 16 * kst + 2 * c;
          a[0] = i < vr ? ((uint32_t)s_va[tA * vr + i] | ((uint32_t)s_va[(tA + 1) * vr + i] << 16)) : 0u;
          a[2] = i < vr ? ((uint32_t)s_va[(tA + 8) * vr + i] | ((uint32_t)s_va[(tA + 9) * vr + i] << 16)) : 0u;
          a[1] = a[3] = 0u;
          float d[4] = {u[0], u[1], 0.f, 0.f};
          mma16816(d, a, pt[kst][0], pt[kst][1]);
          u[0] = d[0], u[1] = d[1];
        }
      }
      if (gf & kGdVOut) {
        // value outliers: out_c += p_t d_tc.  The stored corrections go into a dense fp16 tile
        // (half a tile of tokens at a time, channels in this kernel's PV mma order: position
        // table vlut) that runs through the PV mma like the codes, then the entries are cleared.
        const uint8_t* vlut = reinterpret_cast<const uint8_t*>(gcta + GearCta::vlut(D));
        const int nk = (int)(gf >> 16) & 255;
        // ldmatrix.x4.trans rows of this lane: tokens (lane & 7) + 8 (lane >> 4), positions + 8 ((lane >> 3) & 1)
        const unsigned ld_base = (unsigned)__cvta_generic_to_shared(
            s_dv + ((lane & 7) + 8 * (lane >> 4)) * DVS + 8 * ((lane >> 3) & 1));
        auto pv_mma = [&](int kst) {
          __syncwarp();
#pragma unroll
          for (int pp = 0; pp < MV; ++pp) {
            uint32_t a[4];
            ldmatrix_x4<true>(a, ld_base + 32u * pp);
            mma16816(acc[pp], a, pt[kst][0], pt[kst][1]);
          }
          __syncwarp();
        };
        if (gf & kGdVStaged) {
          // staged in the ring (uint8 channels, 2k <= VO_MAX): lanes 2x, 2x + 1 take token
          // 16 kst + x, entries [k (lane & 1), k (lane & 1) + k) of its 2k
          const uint8_t* voi = reinterpret_cast<const uint8_t*>(st + TL::VOI_OFF);
          const DType* vov = reinterpret_cast<const DType*>(st + TL::VOV_OFF);
          const uint32_t my_row = (unsigned)__cvta_generic_to_shared(s_dv + (lane >> 1) * DVS);
          auto run = [&](auto kv_c) {  // k = KV entries per lane, unrolled exactly
            constexpr int KV = decltype(kv_c)::value;
#pragma unroll
            for (int kst = 0; kst < 2; ++kst) {
              const int j0 = (16 * kst + (lane >> 1)) * (2 * KV) + (lane & 1) * KV;
              uint32_t ch[KV], dl[KV], at[KV];
              gear_stage_entries<DType, KV>(voi + j0, vov + j0, ch, dl);
#pragma unroll
              for (int jj = 0; jj < KV; ++jj) {
                at[jj] = my_row + 2u * vlut[ch[jj] & (D - 1)];  // (a channel >= D, invalid input, stays in the tile)
                sts_u16(at[jj], dl[jj]);
              }
              pv_mma(kst);
#pragma unroll
              for (int jj = 0; jj < KV; ++jj) sts_u16(at[jj], 0u);
              __syncwarp();
            }
          };
          switch (nk >> 1) {
            case 1: run(std::integral_constant<int, 1>{}); break;
            case 2: run(std::integral_constant<int, 2>{}); break;
            case 3: run(std::integral_constant<int, 3>{}); break;
            default: run(std::integral_constant<int, 4>{}); break;
          }
        } else {
          // from global memory (more than VO_MAX entries per token, or wider indices; rare):
          // lane = token, half a tile at a time
          const GearSegView vg = gear_seg<DType>(p.gv, b, h, gbid > 0 ? 1 : 0, gbid > 0 ? gbid - 1 : 0);
          const int tl = lane;
          const int ts0 = reinterpret_cast<const GearTileDesc*>(st + TL::GD_OFF)->ts0;
          const DType* od = reinterpret_cast<const DType*>(vg.od) + (int64_t)(ts0 + tl) * nk;
          const int toff = (ts0 + tl) * nk;
          uint16_t* my_row = s_dv + (tl & 15) * DVS;
#pragma unroll
          for (int kst = 0; kst < 2; ++kst) {
            const bool mine = (tl >> 4) == kst;
            if (mine)
              for (int j = 0; j < nk; ++j)
                my_row[vlut[gear_idx(vg.oi, vg.ibytes, toff + j) & (D - 1)]] = gear_delta_bits(od[j]);
            pv_mma(kst);
            if (mine)
              for (int j = 0; j < nk; ++j) my_row[vlut[gear_idx(vg.oi, vg.ibytes, toff + j) & (D - 1)]] = 0;
            __syncwarp();
          }
        }
      }
      // end of a block for this warp: O^T += B_v (channels x ranks) . U (ranks x heads)
      if (vr > 0 && (gf & kGdLast)) {  // (B_v rows prefetched by issue())
        const GearSegCta* gs = reinterpret_cast<const GearSegCta*>(gcta + GearCta::SEG) + (gbid > 0 ? 1 : 0);
        const uint16_t* bv = reinterpret_cast<const uint16_t*>(gs->vB + (gbid > 1 ? (int64_t)(gbid - 1) * gs->vB_sblk : 0));
        const uint32_t ub = movmatrix_trans(pack_half2(u[0], u[1]));  // lane (i, c): head i, ranks 2c, 2c + 1
#pragma unroll
        for (int pp = 0; pp < MV; ++pp) {
          const int pair = i * CM::VP + pp;
          const int ch0 = (pair / PK::PO) * PK::CPW + pair % PK::PO, ch1 = ch0 + PK::PO;
          uint32_t a[4];
          a[0] = gear_pair(bv, ch0, 2 * c, vr);  // (generic loads: __ldg here made ptxas spill)
          a[1] = gear_pair(bv, ch1, 2 * c, vr);
          a[2] = a[3] = 0u;
          mma16816(acc[pp], a, ub, 0u);
        }
        u[0] = u[1] = 0.f;
      }
    }
    __syncwarp();  // every lane has read this stage: the next issue() may overwrite it
  }
  cp_async_wait<0>();  // only empty groups remain; drain before the ring is reused
  __syncwarp();
  // ---- this warp's partial: (m, l), then the accumulators in its channel order ----
  warp_store_ml(slot, D, g, i, c, mA, mB, lA, lB);
  if constexpr (SUBV) {  // undo the subnormal factors: row i has 2^(off0 - 24), row i + 8 2^(off1 - 24)
    const float f0 = 16777216.f / (float)(1 << v_off0), f1 = 16777216.f / (float)(1 << v_off1);
#pragma unroll
    for (int M = 0; M < MV; ++M)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int head = 2 * c + (e & 1);
        if (head < g)
          slot[head * (D + 2) + 2 + 16 * M + 2 * i + (e >> 1)] =
              fmaf(acc[M][e], (e >> 1) ? f1 : f0, zacc[M / (MV / NZ)][e & 1]);
      }
  }
#pragma unroll
  for (int pp = 0; pp < (SUBV ? 0 : MV); ++pp) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + (e & 1);
      if (head >= g) continue;
      const int pair = i * CM::VP + pp;
      const int ch = (pair / PK::PO) * PK::CPW + pair % PK::PO + (e >> 1) * PK::PO;
      slot[head * (D + 2) + 2 + ch] = acc[pp][e];
    }
  }
}

// ---------------------------------------------------------------------------
// Generic path: tokens [t_begin, t_end), any mix of quantized and residual tokens.
// ---------------------------------------------------------------------------
/// This lane's D / 32 elements of row `row` of batch (or page) `pb` of a quantized store.
template <typename DType, int D>
__device__ __forceinline__ void load_quant_row(const QuantKV& s, int64_t pb, int64_t h, int row, int lane,
                                               float (&x)[D / 32]) {
  constexpr int EPL = D / 32;
  // dequant_at with cheaper index arithmetic: 32-bit token and group indices, shifts
  // instead of divisions by the code width
  const int bits = s.bits;
  const int lcpw = bits == 2 ? 4 : bits == 4 ? 3 : 2;  // log2(codes per word)
  const int W = (D * bits) >> 5, c0 = lane * EPL, tt = row, G = (int)s.group;
  const int32_t* r = s.codes + pb * s.codes_sb + h * s.codes_sh + (int64_t)tt * W;
  const int64_t base = pb * s.scale_sb + h * s.scale_sh;
  const uint32_t mask = (1u << bits) - 1u;
#pragma unroll
  for (int e = 0; e < EPL; ++e) {
    const int ch = c0 + e;
    const uint32_t w = (uint32_t)__ldg(r + (ch >> lcpw));
    const uint32_t code = (w >> ((ch & ((1 << lcpw) - 1)) * bits)) & mask;
    const int64_t si = base + (s.per_channel ? (int64_t)(tt / G) * D + ch : (int64_t)tt * (D / G) + ch / G);
    x[e] = (float)code * half_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(s.scale) + si)) +
           half_bits_to_float(__ldg(reinterpret_cast<const unsigned short*>(s.zero) + si));
  }
}
/// This lane's D / 32 elements (channels lane * D / 32 ..) of a full-precision row of D elements.
template <typename DType, int D>
__device__ __forceinline__ void load_fp_row(const DType* r, int lane, float (&x)[D / 32]) {
  constexpr int EPL = D / 32;
#pragma unroll
  for (int e = 0; e < EPL; ++e) x[e] = to_float(r[lane * EPL + e]);
}
/// This lane's D / 32 elements of row `row` of batch (or page) `pb` of the full-precision store.
template <typename DType, int D>
__device__ __forceinline__ void load_residual_row(const QuantKV& s, int64_t pb, int64_t h, int64_t row, int lane,
                                                  float (&x)[D / 32]) {
  load_fp_row<DType, D>(static_cast<const DType*>(s.residual) + pb * s.res_sb + h * s.res_sh + row * D, lane, x);
}
template <typename DType, int D>
__device__ __forceinline__ void load_token(const QuantKV& s, int64_t b, int64_t h, int64_t t, int lane,
                                           float (&x)[D / 32]) {
  if (t < s.Tq) load_quant_row<DType, D>(s, b, h, (int)t, lane, x);
  else load_residual_row<DType, D>(s, b, h, t - s.Tq, lane, x);
}

/// Tokens per step of the generic loop: its K / V registers (2 * C * D / 32 floats) stay at 32
/// (D = 32 / 64: 8 tokens, 128: 4, 256: 2); more made the mma kernels (168 registers) spill.
template <int D>
KVQ_HOST_DEVICE constexpr int generic_chunk() {
  return D <= 64 ? 8 : (512 / D > 1 ? 512 / D : 1);
}

/// \brief The generic path's loop, shared by the decode-attention kernels: continues the
/// warp's running (m, l, acc) from `slot` over tokens [t_begin, t_end), C tokens per step,
/// and writes it back.  `load(t, kx, vx)` fills this lane's D / 32 key and value elements
/// (lane owns elements [lane * D / 32, (lane + 1) * D / 32)); `s_q` is q as floats [g][D].
/// The loop is latency-bound (a dependent chain of loads, butterfly reductions and exp2 per
/// step): a step issues its C tokens' loads back to back, reduces the C scores of a head in
/// interleaved butterflies and rescales (m, l, acc) once per head and step.  Masked tokens and
/// the slots past t_end score -inf.  (H200: the mma kernels' residual windows measured within
/// 2 % of the former one-token loop -- their tails were not the bottleneck; the CUDA-core-only
/// kernels stream every token through here.)
template <int D, int MAXG, int C = generic_chunk<D>(), typename Load>
__device__ __forceinline__ void warp_generic_loop(const uint8_t* mask, int64_t mask_sb, float scale, int64_t b,
                                                  int g, int64_t t_begin, int64_t t_end, float* slot,
                                                  const float* s_q, Load&& load) {
  static_assert(C >= 1, "chunk");
  constexpr int EPL = D / 32;
  const int lane = threadIdx.x % 32;
  float m[MAXG], l[MAXG], acc[MAXG][EPL];
#pragma unroll
  for (int j = 0; j < MAXG; ++j) {
    if (j >= g) break;
    const float* row = slot + j * (D + 2);
    m[j] = row[0], l[j] = row[1];
#pragma unroll
    for (int e = 0; e < EPL; ++e) acc[j][e] = row[2 + lane * EPL + e];
  }
  __syncwarp();
  const float sl = scale * kLog2e;
  for (int64_t t0 = t_begin; t0 < t_end; t0 += C) {
    float kx[C][EPL], vx[C][EPL];
    bool live[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int64_t t = t0 + c;
      live[c] = t < t_end;
      if (live[c]) {
        load(t, kx[c], vx[c]);
        if (mask != nullptr && mask[b * mask_sb + t] == 0) {  // weight 0: not even a NaN of it
          live[c] = false;
#pragma unroll
          for (int e = 0; e < EPL; ++e) vx[c][e] = 0.f;
        }
      } else {
#pragma unroll
        for (int e = 0; e < EPL; ++e) kx[c][e] = 0.f, vx[c][e] = 0.f;
      }
    }
#pragma unroll
    for (int j = 0; j < MAXG; ++j) {
      if (j >= g) break;
      float qj[EPL], s[C];
#pragma unroll
      for (int e = 0; e < EPL; ++e) qj[e] = s_q[j * D + lane * EPL + e];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        s[c] = 0.f;
#pragma unroll
        for (int e = 0; e < EPL; ++e) s[c] += qj[e] * kx[c][e];
      }
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
        for (int c = 0; c < C; ++c) s[c] += __shfl_xor_sync(0xffffffffu, s[c], o);
      }
      float mn = m[j];
#pragma unroll
      for (int c = 0; c < C; ++c) {
        s[c] = live[c] ? s[c] * sl : -INFINITY;
        mn = fmaxf(mn, s[c]);
      }
      if (mn == -INFINITY) continue;  // warp-uniform: nothing live yet
      const float al = exp2f(m[j] - mn);
      m[j] = mn;
      float ps = 0.f;
#pragma unroll
      for (int e = 0; e < EPL; ++e) acc[j][e] *= al;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const float pe = exp2f(s[c] - mn);
        ps += pe;
#pragma unroll
        for (int e = 0; e < EPL; ++e) acc[j][e] += pe * vx[c][e];
      }
      l[j] = l[j] * al + ps;
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
  __syncwarp();
}

template <typename DType, int D, int MAXG, int C = generic_chunk<D>()>
__device__ void warp_generic(const DecodeAttnParams& p, int64_t b, int64_t h, int g, int64_t t_begin,
                             int64_t t_end, float* slot, const float* s_q) {
  const int lane = threadIdx.x % 32;
  warp_generic_loop<D, MAXG, C>(p.mask, p.mask_sb, p.scale, b, g, t_begin, t_end, slot, s_q,
                             [&](int64_t t, float (&kx)[D / 32], float (&vx)[D / 32]) {
                               load_token<DType, D>(p.k, b, h, t, lane, kx);
                               load_token<DType, D>(p.v, b, h, t, lane, vx);
                             });
}

/// \brief The split-K workspace of `rows` output rows (B * Hq) and `splits` splits:
/// acc [rows, splits, D], then (m, l) [rows, splits] (B * Hq * splits * (D + 2) floats in all).
/// The base is 16-byte aligned and D % 4 == 0, so every acc row can be read as float4.
struct SplitWs {
  float* acc;
  float2* ml;
  KVQ_HOST_DEVICE SplitWs(float* ws, int64_t rows, int64_t splits, int64_t D)
      : acc(ws), ml(reinterpret_cast<float2*>(ws + rows * splits * D)) {}
};

/// \brief Merge the NW warp slots of a CTA (slot w at `slots + w * stride`, [g][D + 2] floats
/// of (m, l, acc) each) and write the CTA's split partial: rows row0 .. row0 + g - 1, split
/// `split` of the workspace.
template <int D, int NW>
__device__ __forceinline__ void write_split_partial(const SplitWs& ws, const char* slots, size_t stride,
                                                    int64_t row0, int g, int64_t splits, int split) {
  for (int x = threadIdx.x; x < g * (D + 2); x += blockDim.x) {
    const int j = x / (D + 2), col = x % (D + 2);
    auto wslot = [&](int w) { return reinterpret_cast<const float*>(slots + w * stride) + j * (D + 2); };
    float M = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) M = fmaxf(M, wslot(w)[0]);
    float out = 0.f;
    if (col == 0) {
      out = M;
    } else {
#pragma unroll
      for (int w = 0; w < NW; ++w) {
        const float mw = wslot(w)[0];
        const float wgt = (M == -INFINITY) ? 0.f : exp2f(mw - M);
        out += wgt * wslot(w)[col];
      }
    }
    const int64_t row = (row0 + j) * splits + split;
    if (col < 2) reinterpret_cast<float*>(ws.ml + row)[col] = out;
    else ws.acc[row * D + col - 2] = out;
  }
}

/// Shared-memory floats merge_split_rows needs for `nrows` rows of `splits` splits.
KVQ_HOST_DEVICE int64_t merge_scratch_floats(int64_t nrows, int64_t splits) { return 2 * nrows * splits + nrows; }

/// \brief Merge the split partials of output rows row0 .. row0 + nrows - 1 and write them:
///   out = sum_s w_s acc_s / sum_s w_s l_s,  w_s = 2^(m_s - M),  M = max_s m_s
/// (fp32; w_s l_s summed lane-strided + butterfly by one warp per row, w_s acc_s in split order
/// per output: the result depends only on the partials, not on the block shape that runs it).
/// Block-wide (blockDim.x a multiple of 32, every thread calls it); `scratch`:
/// merge_scratch_floats(nrows, splits) floats of shared memory.
template <typename DType, int D>
__device__ __forceinline__ void merge_split_rows(const SplitWs& ws, DType* out, int64_t row0, int nrows, int splits,
                                                 float* scratch) {
  constexpr int DV = D / 4;  // float4 columns per row
  constexpr int SB = 16;     // splits per batch of loads (16 float4 in flight per thread)
  const int tid = threadIdx.x, nth = blockDim.x, lane = tid % 32, warp = tid / 32, nwarps = nth / 32;
  const int nx = nrows * DV;
  float* s_w = scratch;                 // [nrows][splits]: m, then the weights w
  float* s_l = s_w + nrows * splits;    // [nrows][splits]: l
  float* s_L = s_l + nrows * splits;    // [nrows]: sum_s w_s l_s
  float4 v[SB];
  auto load = [&](int x, int s0) {  // acc of column x, splits s0 .. s0 + SB - 1
    const int j = x / DV;
    const float4* src = reinterpret_cast<const float4*>(ws.acc + ((row0 + j) * splits + s0) * D) + (x - j * DV);
#pragma unroll
    for (int u = 0; u < SB; ++u) v[u] = s0 + u < splits ? __ldcg(src + u * DV) : make_float4(0.f, 0.f, 0.f, 0.f);
  };
  if (tid < nx) load(tid, 0);  // the first batch is in flight while the weights are computed
  for (int j = warp; j < nrows; j += nwarps) {
    const float2* ml = ws.ml + (row0 + j) * splits;
    float M = -INFINITY;
    for (int s = lane; s < splits; s += 32) {
      const float2 e = __ldcg(ml + s);
      s_w[j * splits + s] = e.x, s_l[j * splits + s] = e.y;
      M = fmaxf(M, e.x);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
    float L = 0.f;
    for (int s = lane; s < splits; s += 32) {
      const float w = M == -INFINITY ? 0.f : exp2f(s_w[j * splits + s] - M);
      s_w[j * splits + s] = w;
      L = fmaf(w, s_l[j * splits + s], L);
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) L += __shfl_xor_sync(0xffffffffu, L, o);
    if (lane == 0) s_L[j] = L;
  }
  __syncthreads();
  for (int x = tid; x < nx; x += nth) {
    const int j = x / DV;
    const float* w = s_w + j * splits;
    float4 a = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int s0 = 0; s0 < splits; s0 += SB) {
      if (s0 > 0) load(x, s0);
#pragma unroll
      for (int u = 0; u < SB; ++u) {
        if (s0 + u < splits) {
          const float wu = w[s0 + u];
          a.x = fmaf(wu, v[u].x, a.x), a.y = fmaf(wu, v[u].y, a.y);
          a.z = fmaf(wu, v[u].z, a.z), a.w = fmaf(wu, v[u].w, a.w);
        }
      }
    }
    if (x + nth < nx) load(x + nth, 0);
    const float L = s_L[j];
    DType* o = out + (row0 + j) * D + 4 * (x - j * DV);
    o[0] = from_float<DType>(L > 0.f ? a.x / L : 0.f);
    o[1] = from_float<DType>(L > 0.f ? a.y / L : 0.f);
    o[2] = from_float<DType>(L > 0.f ? a.z / L : 0.f);
    o[3] = from_float<DType>(L > 0.f ? a.w / L : 0.f);
  }
}

// Programmatic dependent launch (sm_90): the combine kernel is launched while the split kernel
// still runs (every split CTA allows it as soon as it starts) and waits in griddepcontrol.wait
// until that grid has completed and its writes are visible -- its launch latency is hidden
// behind the split kernel's tail.  Both instructions are no-ops without such a dependency.
__device__ __forceinline__ void pdl_allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}

/// \brief How the token axis is split over CTAs (computed on the host).  CTAs [0, ns) of a
/// (batch, KV head) row run the mma path over their chunk of [0, t_main); the tail [t_main, T)
/// (the residual window) runs on the generic path in chunks of `tail_chunk` tokens, chunk k on
/// worker CTA k % W, warp (k / W) % warps, where the W workers are either the same ns CTAs after
/// their mma chunk (nt == 0) or nt extra CTAs [ns, ns + nt) that only run the tail, concurrently
/// with the mma CTAs (chosen when the last wave has room: small batches).
struct SplitPlan {
  int64_t t_main = 0;      // tokens [0, t_main) go through the mma path
  int64_t chunk_main = 0;  // tokens per CTA on the mma path (multiple of kWarps * kTile)
  int64_t tail_chunk = 1;  // tail tokens per (CTA, warp) chunk
  int ns = 1;              // mma CTAs per (b, h)
  int nt = 0;              // tail-only CTAs per (b, h)
  KVQ_HOST_DEVICE int splits() const { return ns + nt; }
  /// First tail chunk of (split, warp), or -1 if that CTA runs no tail; then every tail_stride.
  KVQ_HOST_DEVICE int64_t tail_first(int split, int warp) const {
    if (nt == 0) return split + (int64_t)ns * warp;
    return split < ns ? -1 : (split - ns) + (int64_t)nt * warp;
  }
  KVQ_HOST_DEVICE int64_t tail_stride(int warps) const { return (int64_t)(nt > 0 ? nt : ns) * warps; }
};

/// Shared memory: q as floats [g][D] (generic path, GEAR), then per warp max(ring, slot)
/// bytes (the mma ring; the warp's (m, l, acc) slot [g][D + 2] floats reuses its start),
/// followed by the GEAR scratch for GEAR layers.
/// The mma kernels (g <= 8 query heads per KV head: the N = 8 mma columns) size shared memory
/// for 8 heads whatever g is, so that every offset is a compile-time constant (the tile loop
/// rematerializes its ring and scratch pointers instead of keeping them in registers).
constexpr int kMmaMaxGroup = 8;
template <bool MMA>
KVQ_HOST_DEVICE int layout_group(int g) { return MMA ? kMmaMaxGroup : g; }
template <int D, int BITS, bool KPC, bool MMA, bool GEAR = false, int VB = 2>
KVQ_HOST_DEVICE size_t warp_region_bytes(int g) {
  using TL = TileLayout<D, BITS, KPC, GEAR, VB>;
  const size_t slot = sizeof(float) * (size_t)layout_group<MMA>(g) * (D + 2);
  size_t r = slot;
  if constexpr (MMA) r = TL::RING > slot ? TL::RING : slot;
  r = (r + 15) / 16 * 16;
  if constexpr (GEAR) r += GearScratch::bytes(D);
  return r;
}
KVQ_HOST_DEVICE size_t q_region_bytes(int g, int D) { return (sizeof(float) * (size_t)g * D + 15) / 16 * 16; }
/// q (and, for GEAR layers, the GearCta header after it): the part of shared memory before the warp regions.
template <bool MMA, bool GEAR>
KVQ_HOST_DEVICE size_t head_region_bytes(int g, int D) {
  return q_region_bytes(layout_group<MMA>(g), D) + (GEAR ? (size_t)GearCta::bytes(D) : 0);
}
template <int D, int BITS, bool KPC, bool MMA, bool GEAR = false, int VB = 2>
inline size_t decode_attention_smem_bytes(int g) {
  return head_region_bytes<MMA, GEAR>(g, D) + kWarps * warp_region_bytes<D, BITS, KPC, MMA, GEAR, VB>(g);
}

// Resident CTAs per SM the D <= 128 kernels are compiled for: 3 caps registers at 168 (the
// 2-bit D = 128 mma kernel wants 180 and spills ~56 bytes); 2 gives it 255 but 8 warps/SM.
#ifndef KVQ_MINB
#define KVQ_MINB 3
#endif
template <typename DType, int D, int BITS, bool KPC, bool MMA, bool GEAR, int NGV = 0>
__global__ void __launch_bounds__(kWarps * 32, D <= 128 ? KVQ_MINB : 1)
    DecodeAttentionKernel(DecodeAttnParams p, SplitPlan plan) {
  pdl_allow_dependents();
  extern __shared__ __align__(16) char smem[];
  const int split = blockIdx.y;  // split_grid
  const int64_t bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int g = (int)(p.Hq / p.H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_q = reinterpret_cast<float*>(smem);  // [g][D]
  char* gcta = smem + q_region_bytes(layout_group<MMA>(g), D);  // GEAR: GearCta header
  const size_t qbytes = head_region_bytes<MMA, GEAR>(g, D);
  const size_t wbytes = warp_region_bytes<D, BITS, KPC, MMA, GEAR, sizeof(DType)>(g);
  char* region = smem + qbytes + warp * wbytes;
  float* slot = reinterpret_cast<float*>(region);
  const DType* qg = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;
  if constexpr (GEAR) {  // the GEAR extras read q in fp32; the GearCta header
    for (int x = threadIdx.x; x < g * D; x += blockDim.x) s_q[x] = to_float(qg[x]);
    if (MMA) gear_cta_fill<DType, D, BITS, TileLayout<D, BITS, KPC, GEAR, sizeof(DType)>::VO_MAX>(p, b, h, gcta);
    __syncthreads();
  }
  const int64_t t_begin = split * plan.chunk_main;
  const int64_t t_end = t_begin + plan.chunk_main < plan.t_main ? t_begin + plan.chunk_main : plan.t_main;
  bool have_mma = false;
  if constexpr (MMA) {
    if (t_begin < t_end) {
      warp_mma<DType, D, BITS, KPC, GEAR, NGV>(p, b, h, g, t_begin, t_end, warp, slot, region,
                                               region + (wbytes - (GEAR ? GearScratch::bytes(D) : 0)), s_q, gcta);
      have_mma = true;
    }
  }
  if (!have_mma) {
    for (int x = lane; x < g * (D + 2); x += 32) slot[x] = (x % (D + 2)) == 0 ? -INFINITY : 0.f;
    __syncwarp();
  }
  // ---- this warp's share of the tail [t_main, T) ----
  const int64_t tail = p.T - plan.t_main;
  if (tail > 0 && plan.tail_first(split, 0) >= 0) {  // uniform per CTA
    if constexpr (!GEAR) {
      for (int x = threadIdx.x; x < g * D; x += blockDim.x) s_q[x] = to_float(qg[x]);
      __syncthreads();
    }
    const int64_t nchunks = (tail + plan.tail_chunk - 1) / plan.tail_chunk;
    for (int64_t k = plan.tail_first(split, warp); k >= 0 && k < nchunks; k += plan.tail_stride(kWarps)) {
      const int64_t a = plan.t_main + k * plan.tail_chunk;
      const int64_t e = a + plan.tail_chunk < p.T ? a + plan.tail_chunk : p.T;
      // the mma instantiations only take g <= 8; the generic ones (16 heads) step half as many
      // tokens, GEAR kernels 1 (more made them spill)
      constexpr int kChunk = GEAR ? 1 : (MMA ? generic_chunk<D>() : (generic_chunk<D>() + 1) / 2);
      warp_generic<DType, D, MMA ? 8 : kMaxGroup, kChunk>(p, b, h, g, a, e, slot, s_q);
    }
  }
  __syncthreads();
  // ---- merge the warps and write the split partial ----
  const SplitWs ws(p.ws, p.B * p.Hq, plan.splits(), D);
  write_split_partial<D, kWarps>(ws, smem + qbytes, wbytes, b * p.Hq + h * g, g, plan.splits(), split);
}

/// \brief Two-launch combine: one CTA per output row merges its splits (merge_split_rows).
template <typename DType, int D>
__global__ void DecodeAttentionCombineKernel(float* ws, void* out, int64_t rows, int splits) {
  pdl_wait_prerequisites();
  extern __shared__ __align__(16) char smem[];
  merge_split_rows<DType, D>(SplitWs(ws, rows, splits, D), static_cast<DType*>(out), blockIdx.x, 1, splits,
                             reinterpret_cast<float*>(smem));
}

/// \brief Launch `kernel` as a programmatic dependent of the kernel just launched on `stream`
/// (it may start while that one drains and waits in pdl_wait_prerequisites); a plain launch
/// where that is refused.
template <typename... KArgs, typename... Args>
cudaError_t launch_programmatic_dependent(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                          cudaStream_t stream, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  if (cudaLaunchKernelEx(&cfg, kernel, args...) == cudaSuccess) return cudaSuccess;
  (void)cudaGetLastError();
  kernel<<<grid, block, smem, stream>>>(args...);
  return cudaGetLastError();
}

/// \brief Launch the combine over `rows` = B * Hq output rows as a programmatic dependent of
/// the split kernel just launched on `stream`.
template <typename DType, int D>
cudaError_t LaunchDecodeAttentionCombine(float* ws, void* out, int64_t rows, int splits, cudaStream_t stream) {
  auto kernel = DecodeAttentionCombineKernel<DType, D>;
  const size_t smem = sizeof(float) * (size_t)merge_scratch_floats(1, splits);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  // one float4 column per thread
  return launch_programmatic_dependent(kernel, dim3((unsigned)rows), dim3(D / 4 > 32 ? D / 4 : 32), smem, stream, ws,
                                       out, rows, splits);
}

inline bool aligned16(const void* ptr, int64_t sb, int64_t sh, int64_t elem) {
  return reinterpret_cast<uintptr_t>(ptr) % 16 == 0 && (sb * elem) % 16 == 0 && (sh * elem) % 16 == 0;
}

/// \brief Can the tensor-core path read this cache layer?  (Formats it covers, and 16-byte
/// aligned rows for its cp.async tile copies.)
inline bool decode_attention_mma_ok(const DecodeAttnParams& p) {
  const int64_t D = p.D;
  if (!supported_mma_head_dim(D)) return false;
  if (p.k.bits != p.v.bits) return false;
  if (p.Hq / p.H > 8) return false;  // the query heads of a KV head are the N = 8 mma columns
  const bool k_ok = p.k.per_channel ? (p.k.group % kTile == 0) : (p.k.group >= D / 4 && D % p.k.group == 0);
  // GEAR layers dequantize values (lane row = one group: G >= D / 8); the others fold the
  // value scales into P per m-tile of 16 channels (G % 16 == 0)
  const bool v_ok = !p.v.per_channel && p.v.group >= D / 8 && D % p.v.group == 0 && (p.gear || p.v.group % 16 == 0);
  if (!(k_ok && v_ok)) return false;
  for (const QuantKV* s : {&p.k, &p.v}) {
    if (s->Tq == 0) continue;
    if (!aligned16(s->codes, s->codes_sb, s->codes_sh, 4) || !aligned16(s->scale, s->scale_sb, s->scale_sh, 2) ||
        !aligned16(s->zero, s->scale_sb, s->scale_sh, 2))
      return false;
  }
  if (p.gear) {  // GEAR: KIVI backbone, blocks of whole tiles, A rows copied by cp.async
    if (!p.k.per_channel || p.gear_t0 % kTile != 0 || p.gear_nb % kTile != 0) return false;
    for (const GearKV* gk : {&p.gk, &p.gv})
      for (const GearSeg& sg : gk->seg)
        if ((sg.r > 0 && !aligned16(sg.A, sg.A_sb, sg.A_sh, 2)) ||
            (sg.off != nullptr && (!aligned16(sg.off, sg.f_sb, sg.f_sh, 4) || (sg.f_sblk * 4) % 16 != 0 ||
                                   sg.off_len < gear_off_len(&sg == &gk->seg[0] ? p.gear_t0 : p.gear_nb))) ||
            (sg.off == nullptr && sg.k > 0 &&
             (!aligned16(sg.od, sg.d_sb, sg.d_sh, p.dtype_bytes) || !aligned16(sg.oi, sg.o_sb, sg.o_sh, 1))))
          return false;
  }
  return true;
}

/// \brief Grid of the split kernels for `bh_rows` = B * H rows: (B * H, splits), so that the
/// linear CTA index split * B * H + bh runs over split 0 of every row, then split 1, ...: the
/// mma CTAs (splits < ns) of all rows come before the tail-only CTAs (splits >= ns).  The
/// hardware hands out CTAs in linear order, one per SM before any SM gets a second, so the mma
/// CTAs land on distinct SMs when there are no more of them than SMs (B = 1, L = 4k, H = 8: 128
/// mma + 128 tail CTAs on 132 SMs; in the former (split, row) grid each row's 16 mma and 16
/// tail CTAs were consecutive and about half of the SMs ran two mma CTAs).
inline dim3 split_grid(const SplitPlan& plan, int64_t bh_rows) {
  return dim3((unsigned)bh_rows, (unsigned)plan.splits());
}

/// \brief Split plan for T tokens of which [0, t_main) (a multiple of kTile) go through an
/// mma path, BH (batch, KV head) rows, CTAs of `warps` warps, `ctas_per_sm` resident CTAs per
/// SM of the kernel that will run.  The mma path is sized to whole waves: ns minimises
/// ceil(ns * BH / slots) / ns.
inline SplitPlan split_plan(int64_t t_main, int64_t T, int64_t BH, int num_sms, int ctas_per_sm, int warps) {
  SplitPlan plan;
  const int64_t slots = (int64_t)num_sms * (ctas_per_sm > 0 ? ctas_per_sm : 1);
  plan.t_main = t_main;
  const int64_t kStep = (int64_t)warps * kTile;  // tokens per CTA step (one tile per warp)
  if (plan.t_main > 0) {
    const int64_t steps = (plan.t_main + kStep - 1) / kStep;
    const int64_t max_ns = (steps + 1) / 2 > 0 ? (steps + 1) / 2 : 1;  // >= 2 tiles per warp
    int64_t best = 1;
    double best_cost = 1e300;
    // cost ~ waves x (steps per CTA + 2): the +2 charges each CTA's fixed work (q fragments,
    // pipeline fill and drain, the warp merge and its partial) so that many short waves do
    // not win over one long one on rounding alone (H200, B = 8, L = 32k: 37 splits in 6 waves
    // measured slower than 6 splits in one)
    for (int64_t ns = 1; ns <= max_ns && ns <= 4 * slots; ++ns) {
      const int64_t per = (steps + ns - 1) / ns;              // steps per CTA
      const int64_t waves = (ns * BH + slots - 1) / slots;
      const double cost = (double)waves * (double)(per + 2);
      if (cost < best_cost * 0.999) best_cost = cost, best = ns;
    }
    const int64_t per = (steps + best - 1) / best;
    plan.chunk_main = per * kStep;
    plan.ns = (int)((plan.t_main + plan.chunk_main - 1) / plan.chunk_main);
  } else {
    const int64_t want = (4 * (int64_t)num_sms + BH - 1) / BH;
    const int64_t max_ns = (T + 63) / 64;
    plan.ns = (int)(want < max_ns ? (want > 0 ? want : 1) : (max_ns > 0 ? max_ns : 1));
  }
  const int64_t tail = T - plan.t_main;
  if (tail > 0 && plan.t_main > 0) {
    // tail-only CTAs when the mma CTAs fit in one wave with room to spare and each tail warp's
    // share (>= 2 tokens; ~0.4 of a tile step each on the H200) hides under the mma chunk:
    // the residual window then runs concurrently instead of after the mma chunk (B = 1, L = 4k:
    // 16 mma CTAs per KV head, 2 tiles per warp, then 2 residual tokens per warp)
    const int64_t used = (int64_t)plan.ns * BH, spare = used <= slots ? slots - used : 0;  // one wave only
    const int64_t want = (tail + 2 * warps - 1) / (2 * warps);
    const int64_t nt = want < spare / BH ? want : spare / BH;
    if (nt >= 1) {
      const int64_t per = plan.chunk_main / kStep;  // tile steps per mma CTA
      const int64_t tc = (tail + nt * warps - 1) / (nt * warps);
      if (tc <= 2 * per) plan.nt = (int)nt;
    }
  }
  if (tail > 0) {
    const int64_t workers = (int64_t)(plan.nt > 0 ? plan.nt : plan.ns) * warps;
    // the generic path is latency-bound (~2 us per token per warp on the H200): spread the
    // tail as thinly as the CTAs allow, at least 2 tokens per chunk
    int64_t tc = (tail + workers - 1) / workers;
    plan.tail_chunk = tc < 2 ? 2 : tc;
  }
  return plan;
}

/// \brief Split plan of the group-quantized kernels (see split_plan).
inline SplitPlan decode_attention_plan(const DecodeAttnParams& p, int num_sms, int ctas_per_sm) {
  int64_t t_main = 0;
  if (decode_attention_mma_ok(p)) {
    int64_t tq = p.k.Tq < p.v.Tq ? p.k.Tq : p.v.Tq;
    if (tq > p.T) tq = p.T;
    t_main = (tq / kTile) * kTile;
  }
  return split_plan(t_main, p.T, p.B * p.H, num_sms, ctas_per_sm, kWarps);
}

template <typename DType, int D, int BITS, bool KPC, bool MMA, bool GEAR = false, int NGV = 0>
cudaError_t LaunchDecodeAttention(const DecodeAttnParams& p, const SplitPlan& plan, cudaStream_t stream) {
  auto kernel = DecodeAttentionKernel<DType, D, BITS, KPC, MMA, GEAR, NGV>;
  const int g = (int)(p.Hq / p.H);
  const size_t smem = decode_attention_smem_bytes<D, BITS, KPC, MMA, GEAR, sizeof(DType)>(g);
  if (smem > 48 * 1024) {
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
    if (e != cudaSuccess) return e;
  }
  if (reinterpret_cast<uintptr_t>(p.ws) % 16 != 0) return cudaErrorMisalignedAddress;
  kernel<<<split_grid(plan, p.B * p.H), kWarps * 32, smem, stream>>>(p, plan);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  return LaunchDecodeAttentionCombine<DType, D>(p.ws, p.out, p.B * p.Hq, plan.splits(), stream);
}

/// \brief Resident CTAs per SM of an instantiation (0 on error), for the split plan.
template <typename DType, int D, int BITS, bool KPC, bool MMA, bool GEAR = false, int NGV = 0>
int DecodeAttentionOccupancy(int g) {
  static int cache[kMaxGroup + 1] = {};  // per instantiation and g (benign race: same value)
  if (g >= 1 && g <= kMaxGroup && cache[g] > 0) return cache[g];
  auto kernel = DecodeAttentionKernel<DType, D, BITS, KPC, MMA, GEAR, NGV>;
  const size_t smem = decode_attention_smem_bytes<D, BITS, KPC, MMA, GEAR, sizeof(DType)>(g);
  if (smem > 48 * 1024 &&
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem) != cudaSuccess)
    return 0;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kWarps * 32, smem) != cudaSuccess) return 0;
  if (g >= 1 && g <= kMaxGroup) cache[g] = n;
  return n;
}

}  // namespace attention
}  // namespace kvq
