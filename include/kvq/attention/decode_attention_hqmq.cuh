// Fused decode attention over an HQMQ cache layer (params, outlier index and CPU twin:
// decode_attention_hqmq.h).  Torch-free.  Same flash-decoding skeleton as the group-quantized
// kernel (decode_attention.cuh, whose helpers this reuses): the token axis is split over CTAs
// (SplitPlan / split_plan), each warp runs its own online softmax over 32-token tiles streamed
// through a per-warp cp.async ring, the CTA merges its warps (write_split_partial), and the
// splits are merged from the workspace (SplitWs) by DecodeAttentionCombineKernel.
//
// Codebooks.  At kernel start the CTA builds, for its KV head h and each role, the 24 S
// codewords P[p] . secondary[h, s] (same Hamilton product as the CPU twin, fp32, then rounded
// to fp16x4 = 8 bytes, index dir = s * 24 + p) in shared memory: 18 KB per role at S = 96,
// 36 KB at S = 192.
//
// Tensor-core path (full 32-token tiles, transposed form as in decode_attention.cuh):
//   scores  S^T[t, j]  = mma(A = K (tokens x channels), B = (q / max|q|)^T)
//   output  O^T[d, j] += mma(A = V^T (channels x tokens), B = P^T)
//  K A-fragments: k-step kk covers chunks 4kk .. 4kk + 3 (16 channels); the columns are
//   permuted so that lane quad c owns exactly chunk 4kk + c: A columns 2c, 2c+1, 2c+8, 2c+9 =
//   the chunk's elements 0..3 (the q B-fragment follows: b0 = elements 0, 1, b1 = 2, 3 of head
//   i).  Per (token, chunk): the field is read from the tile's packed rows in shared memory
//   (plain bits + the chunk's base-R digit, smem_packed_field), the codeword is one 8-byte
//   shared load, and the element is codeword x rcode (HMUL2, exact
//   integer rcode <= 255 as fp16).  The per-token radius step scale / (2^RB - 1) and the q
//   normaliser are applied to the fp32 score afterwards.
//  V A-fragments: m-tile mv covers chunks 4mv .. 4mv + 3 with rows permuted so that rows i and
//   i + 8 are elements (i & 1) and (i & 1) + 2 of chunk 4mv + i / 2.  Lanes i and i ^ 1 need
//   the same chunk of tokens 2c, 2c+1, 2c+8, 2c+9: the even lane decodes the first two, the odd
//   lane the last two (per-token step folded in: codeword x fp16(rcode x step)), byte_perm
//   splits the element pairs and one xor-4 shuffle per register pair swaps the halves the
//   partner needs, so each (token, chunk) is decoded once.  Output channel of acc[mv][e]:
//   4 (4 mv + i / 2) + (i & 1) + 2 (e >> 1).
//  Med3x records of the tile (outlier index, decode_attention_hqmq.h): keys: each lane takes
//   records lane, lane + 32, ..., adds q_j . v (fp32, unnormalised q) into a per-warp [32][8]
//   shared buffer with shared atomics, and the buffer is added to the scaled scores before the
//   softmax.  Values: after the softmax the lanes store p[t][j] into the same buffer and every
//   lane walks the tile's records (broadcast loads); the lanes owning chunk c's channels add
//   p[t][j] v into their accumulators.  Both steps are skipped (warp-uniform branch) for tiles
//   without records, i.e. always at hqmq-3.79.
// F = 16 (hqmq-3.79) at D = 64 / 128 runs a second layout of this path, hqmq_warp_mma16 (FMT 3,
// comment block above it): each tile unpacked in place to 16-bit fields first (hqmq_unpack16),
// whole chunks per lane, 4096-entry codebooks, no exchange.
// CTA: hqmq_warps(D) warps (12 at D <= 128, 4 at D = 256) sharing the codebooks.  The fragment
// algorithm is emulated lane by lane on the CPU in tests/test_decode_attention_hqmq_emulation.py
// (keep it in sync when changing the layouts below).
// Generic path (tail tokens, g > 8, unaligned rows, codebooks too large for shared memory):
//   warp_generic_loop with a loader that decodes each lane's elements in fp32 with
//   hqmq::decode_chunk from the global secondary set (bit-identical to kvq.hqmq_decode) and adds
//   the token's records; tokens from Tc on (the recent window) are read from the residual.
#pragma once
#include "kvq/attention/decode_attention.cuh"
#include "kvq/attention/decode_attention_hqmq.h"
#include "kvq/hqmq/hqmq.h"

namespace kvq {
namespace attention {

/// Warps per CTA (they share the CTA's codebooks): 12 for D <= 128 (<= 168 registers, no spills in
/// the mma loop; hqmq-5 at D = 128 uses 210 KB of shared memory), 4 for D = 256 (whose rings
/// are twice as large: hqmq-5 would not fit 8 warps).
KVQ_HOST_DEVICE constexpr int hqmq_warps(int64_t D) { return D <= 128 ? 12 : 4; }
constexpr int kHqmqStages = 2;       // cp.async ring depth per warp
constexpr int kHqmqSmemLimit = 220 * 1024;  // dynamic, below the 227 KB opt-in maximum
constexpr int kHqmqTailChunk = 2;     // generic-loop tokens per step in the tail (4 made D = 128 spill)

/// Max units per packed row at head dim D (E <= 20 bits per chunk, digits <= 4 bits, scale 8).
template <int D>
struct HqmqDims {
  static constexpr int C = D / 4;
  static constexpr int UMAX = (C * 24 + 8 + 15) / 16;
  static constexpr int CODES_MAX = kTile * UMAX * 2;  // bytes of one role's tile of packed rows
};

/// Byte layout of one ring stage of the general path (runtime U): the K tile's packed rows, the
/// V tile's, 16 bytes of padding (a field read may touch two units past a row's end).
struct HqmqTileLayout {
  int kc, vc, bytes;
  KVQ_HOST_DEVICE static HqmqTileLayout make(int uk, int uv) {
    HqmqTileLayout l;
    l.kc = 0;
    l.vc = kTile * uk * 2;
    l.bytes = ((l.vc + kTile * uv * 2 + 16) + 15) / 16 * 16;
    return l;
  }
};

/// Shared-memory plan of one launch.
struct HqmqSmem {
  size_t cb_k = 0, cb_v = 0, q = 0, region = 0, total = 0;  // bytes
  bool mma = false;
};

/// \brief Can the tensor-core path run (before the shared-memory check)?
inline bool hqmq_mma_layout_ok(const HqmqAttnParams& p) {
  if (!supported_head_dim(p.D)) return false;
  if (p.Hq / p.H > 8) return false;
  for (const HqmqKV* s : {&p.k, &p.v}) {
    if (!aligned16(s->codes, s->codes_sb, s->codes_sh, 2)) return false;
  }
  return p.Tc >= kTile;
}

/// \brief Compile-time layout of the v2 path (FMT 3: F = 16, b_r = 4, R = 9) at head dim D.
/// Ring stage: K fields (32 rows of 4 W bytes: the 16-bit fields of the packed rows, unpacked),
/// V fields (rows padded by 16 bytes so that the lanes reading tokens 2c of one chunk block hit
/// distinct banks), K scales, V scales (fp16).  The tile's packed rows land by cp.async at KL
/// (inside the K fields) and VL (the end of the V fields) and are unpacked in place, one token
/// per lane (hqmq_unpack16).  Codebooks: 2^12 entries per role (all 12-bit direction indices;
/// entries past 24 S repeat entry 24 S - 1, as the general path clamps them), K at byte 0, V at CB.
template <int D>
struct Hq16 {
  static_assert(D == 64 || D == 128, "the v2 HQMQ layout is for D = 64 and 128");
  static constexpr hqmq::RowLayout ROW = hqmq::r9_layout<D, 12>();
  static constexpr int U = ROW.units;         // units per packed row (16 or 31)
  static constexpr int PACKED = kTile * U * 2;  // bytes of one role's packed tile
  static constexpr int W = D / 8;             // words per token row (32 chunks of 16 bits at D = 128)
  static constexpr int KROW = 4 * W;          // bytes per K row in the ring
  static constexpr int VROW = 4 * W + 16;     // bytes per V row (padded)
  static constexpr int KC = 0, VC = kTile * KROW, KS = VC + kTile * VROW, VS = KS + 2 * kTile;
  static constexpr int KL = KC, VL = KS - PACKED;
  static constexpr int STAGE = (VS + 2 * kTile + 15) / 16 * 16;
  static_assert(PACKED <= kTile * KROW && PACKED % 16 == 0, "packed tiles land inside their role's fields");
  static constexpr int NCB = 4096;            // direction indices of 12 bits
  static constexpr int CB = NCB * 8;          // bytes of one role's codebook (fp16x4 entries)
  static constexpr int NK = D / 16;           // k-steps of QK = K chunks per lane and token
  static constexpr int KW = NK / 2;           // K words per lane and token (2 or 4)
  static constexpr int VP = D / 32;           // m-tile pairs of PV = V chunks per lane and token
  static constexpr int VW = VP / 2;           // V words per lane and token (1 or 2)
};

/// Is the v2 path (FMT 3) possible for p?  (F = 16, b_r = 4, R = 9 for both roles, D in {64, 128}.)
inline bool hqmq_v2_ok(const HqmqAttnParams& p) {
  if (!(p.D == 64 || p.D == 128)) return false;
  for (const HqmqKV* s : {&p.k, &p.v})
    if (s->field_bits != 16 || s->radius_bits != 4 || s->row.R != 9 || s->S < 1 ||
        (int64_t)hqmq::kHurwitzUnits * s->S > 4096)
      return false;
  return true;
}

inline HqmqSmem hqmq_smem_plan(const HqmqAttnParams& p, int fmt = 0) {
  HqmqSmem m;
  const int g = (int)(p.Hq / p.H);
  m.q = (sizeof(float) * (size_t)g * p.D + 15) / 16 * 16;
  const size_t slot = sizeof(float) * (size_t)g * (p.D + 2);
  const size_t slot16 = (slot + 15) / 16 * 16;
  m.region = slot16;
  const int nw = hqmq_warps(p.D);
  m.total = m.q + nw * m.region;
  if (fmt == 3 && hqmq_mma_layout_ok(p) && hqmq_v2_ok(p)) {
    const size_t stage = p.D == 64 ? Hq16<64>::STAGE : Hq16<128>::STAGE;
    const size_t ring = (size_t)kHqmqStages * stage;
    const size_t region = (ring > slot16 ? ring : slot16) + sizeof(float) * kTile * 8;
    const size_t cb = (size_t)Hq16<128>::CB;
    const size_t total = 2 * cb + m.q + nw * region;
    if (total <= (size_t)kHqmqSmemLimit) {
      m.mma = true, m.cb_k = cb, m.cb_v = cb, m.region = region, m.total = total;
    }
  } else if (hqmq_mma_layout_ok(p)) {
    const HqmqTileLayout tl = HqmqTileLayout::make(p.k.row.units, p.v.row.units);
    const size_t ring = (size_t)kHqmqStages * tl.bytes;
    const size_t region = (ring > slot16 ? ring : slot16) + sizeof(float) * kTile * 8;  // + [32][8] buffer
    const size_t cbk = (size_t)hqmq::kHurwitzUnits * 8 * p.k.S, cbv = (size_t)hqmq::kHurwitzUnits * 8 * p.v.S;
    const size_t total = cbk + cbv + m.q + nw * region;
    if (total <= (size_t)kHqmqSmemLimit) {
      m.mma = true, m.cb_k = cbk, m.cb_v = cbv, m.region = region, m.total = total;
    }
  }
  return m;
}

/// rcode (< 1024) as an exact fp16 pair (magic-number conversion, as extract_pair).
__device__ __forceinline__ uint32_t rcode_pair(uint32_t rc) {
  return hsub2_u32((rc * 0x00010001u) | 0x64006400u, 0x64006400u);
}

/// Field formats the mma path is compiled for: 0 = any (runtime widths), 1 = hqmq-3.79 for
/// keys and values (S = 96, b_r = 4: F = 16), 2 = hqmq-5 (S = 192, b_r = 6: F = 19), 3 = the
/// F = 16 format on the v2 layout (hqmq_warp_mma16 below; D = 64 and 128 only).  FMT 1..3 also
/// fix R = 9 (24 S = 9 * 2^L), so the packed row layout is a compile-time constant
/// (hqmq::r9_layout<D, E>).
template <int FMT>
struct HqmqFmt {
  static constexpr int F = FMT == 1 || FMT == 3 ? 16 : FMT == 2 ? 19 : 0;
  static constexpr int RB = FMT == 1 || FMT == 3 ? 4 : FMT == 2 ? 6 : 0;
  static constexpr int E = FMT == 2 ? 15 : 12;  // plain bits per chunk (FMT > 0: r9_layout<D, E>)
};
inline int hqmq_fmt(const HqmqAttnParams& p) {
  auto is = [&](int F, int RB) {
    return p.k.field_bits == F && p.k.radius_bits == RB && p.v.field_bits == F && p.v.radius_bits == RB &&
           p.k.row.R == 9 && p.v.row.R == 9;
  };
  return is(16, 4) ? 1 : is(19, 6) ? 2 : 0;
}

/// Field of chunk `chunk` of a packed row in shared memory (reads may touch up to two units
/// past the row).  FMT > 0: the compile-time layout.
template <int FMT, int D>
__device__ __forceinline__ uint32_t smem_packed_field(const uint16_t* row, int chunk, const hqmq::RowLayout& rl) {
  if constexpr (FMT == 0) return hqmq::read_field(row, rl, chunk);
  else return hqmq::read_field_r9<D, HqmqFmt<FMT>::E>(row, chunk);
}

/// The fp16 bits of a packed row's radius scale (row in shared memory).
template <int FMT, int D>
__device__ __forceinline__ uint32_t smem_packed_scale(const uint16_t* row, const hqmq::RowLayout& rl) {
  if constexpr (FMT == 0) return hqmq::read_scale(row, rl);
  else return hqmq::read_scale_r9<D, HqmqFmt<FMT>::E>(row);
}

/// Field format of the launch: hqmq_fmt, with F = 16 / b_r = 4 on the v2 layout (3) wherever it
/// can hold the cache (hqmq_v2_ok: D = 64 / 128; F = 16 with b_r = 4 implies 24 S <= 4096);
/// elsewhere the general layout of hqmq_warp_mma (FMT 0 / 1 / 2) serves.
inline int hqmq_launch_fmt(const HqmqAttnParams& p) {
  const int fmt = hqmq_fmt(p);
  return fmt == 1 && hqmq_v2_ok(p) ? 3 : fmt;
}

/// o[k] for a runtime k in 0..3 without local memory.
__device__ __forceinline__ float pick4(const float (&o)[4], int k) {
  return k == 0 ? o[0] : k == 1 ? o[1] : k == 2 ? o[2] : o[3];
}

/// This lane's D / 32 elements of row `row` of (leading index pb, head h) of one role -- a batch
/// row and token, or a page and in-page row -- fp32: the dense decode, no Med3x records.
template <int D>
__device__ __forceinline__ void hqmq_load_row(const HqmqKV& s, int64_t pb, int64_t h, int64_t row, int lane,
                                              float (&x)[D / 32]) {
  constexpr int EPL = D / 32;
  constexpr int STEP = EPL >= 4 ? 4 : EPL;
  const uint16_t* codes =
      reinterpret_cast<const uint16_t*>(s.codes) + pb * s.codes_sb + h * s.codes_sh + row * s.row.units;
  const float maxq = (float)((1 << s.radius_bits) - 1);
  const float step = hqmq::div_rn(half_bits_to_float(hqmq::read_scale(codes, s.row)), maxq);
  const float* sec = s.secondary + h * s.S * 4;
#pragma unroll
  for (int e = 0; e < EPL; e += STEP) {
    const int ch = lane * EPL + e;
    float o[4];
    hqmq::decode_chunk(hqmq::read_field(codes, s.row, ch / 4), s.radius_bits, step, sec, s.S, o);
#pragma unroll
    for (int u = 0; u < STEP; ++u) x[e + u] = STEP == 4 ? o[u] : pick4(o, (ch & 3) + u);
  }
}

/// Loader of the generic path: this lane's D / 32 elements of token t, fp32, records added.
template <int D>
__device__ __forceinline__ void hqmq_load_token(const HqmqAttnParams& p, const HqmqKV& s, int64_t b, int64_t h,
                                                int64_t t, int lane, float (&x)[D / 32]) {
  constexpr int EPL = D / 32;
  hqmq_load_row<D>(s, b, h, t, lane, x);
  int64_t ra, re;
  const int64_t n = b * p.H + h;
  hqmq_record_range(s, p.B * p.H, t / kHqmqTile, n, &ra, &re);
  for (int64_t k = ra; k < re; ++k) {
    const int4 rec = __ldg(reinterpret_cast<const int4*>(s.outliers) + k);
    const int cc = rec.y & 0xff;
    if (rec.x != t || (int64_t)((uint32_t)rec.y >> 8) != n) continue;
    const float v[4] = {half_bits_to_float((uint16_t)((uint32_t)rec.z & 0xffffu)),
                        half_bits_to_float((uint16_t)((uint32_t)rec.z >> 16)),
                        half_bits_to_float((uint16_t)((uint32_t)rec.w & 0xffffu)),
                        half_bits_to_float((uint16_t)((uint32_t)rec.w >> 16))};
#pragma unroll
    for (int e = 0; e < EPL; ++e) {
      const int ch = lane * EPL + e;
      if (ch / 4 == cc) x[e] += pick4(v, ch & 3);
    }
  }
}

/// Addresses of one 32-token tile of a (row, KV head): the K / V packed rows (32 rows of U
/// units each, contiguous, 16-byte aligned).
struct HqmqTilePtrs {
  const int16_t* kc;
  const int16_t* vc;
};

/// Tile source of the tensor-core paths: a contiguous cache row [T, W] / [T] of (b, h); the
/// tile at t0 is t0 rows past the row's start.  (Paged caches supply HqmqPageTiles instead.)
struct HqmqRowTiles {
  HqmqTilePtrs row;
  int64_t uk, uv;
  __device__ __forceinline__ HqmqTilePtrs at(int64_t t0) const { return {row.kc + t0 * uk, row.vc + t0 * uv}; }
};
__device__ __forceinline__ HqmqRowTiles hqmq_row_tiles(const HqmqAttnParams& p, int64_t b, int64_t h) {
  HqmqRowTiles r;
  r.row = {p.k.codes + b * p.k.codes_sb + h * p.k.codes_sh, p.v.codes + b * p.v.codes_sb + h * p.v.codes_sh};
  r.uk = p.k.row.units, r.uv = p.v.row.units;
  return r;
}

// ---------------------------------------------------------------------------
// Tensor-core path of one warp over its tiles of [t_begin, t_end) (full tiles), the
// tiles' addresses from `tiles` (HqmqRowTiles, HqmqPageTiles: at(t0) -> HqmqTilePtrs).
// ---------------------------------------------------------------------------
template <typename DType, int D, int FMT, typename Tiles>
__device__ void hqmq_warp_mma(const HqmqAttnParams& p, const Tiles& tiles, int64_t b, int64_t h, int g,
                              int64_t t_begin, int64_t t_end, int warp, float* slot, char* ring, float* buf,
                              const uint2* cbk, const uint2* cbv, const float* s_q) {
  constexpr int NK = D / 16;  // k-steps of QK (4 chunks each)
  constexpr int MV = D / 16;  // m-tiles of PV (4 chunks each)
  constexpr int C = D / 4;
  constexpr int NW = hqmq_warps(D);
  const int lane = threadIdx.x % 32, i = lane >> 2, c = lane & 3;
  const int64_t BH = p.B * p.H, n = b * p.H + h;
  const HqmqTileLayout TL = HqmqTileLayout::make(p.k.row.units, p.v.row.units);
  const int UK = p.k.row.units, UV = p.v.row.units;
  using FM = HqmqFmt<FMT>;  // compile-time widths where FMT != 0
  const int RBK = FM::RB ? FM::RB : p.k.radius_bits, RBV = FM::RB ? FM::RB : p.v.radius_bits;
  const hqmq::RowLayout& rowk = p.k.row;  // (kernel parameter space: no registers)
  const hqmq::RowLayout& rowv = p.v.row;
  const uint32_t rmk = (1u << RBK) - 1u, rmv = (1u << RBV) - 1u;
  const uint32_t dmaxk = (uint32_t)(hqmq::kHurwitzUnits * p.k.S - 1), dmaxv = (uint32_t)(hqmq::kHurwitzUnits * p.v.S - 1);
  const float inv_k = 1.f / (float)rmk, inv_v = 1.f / (float)rmv;

  // ---- q^T B-fragments of head i (chunk 4kk + c), normalised per head ----
  float qm = 0.f;
  if (i < g) {
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) qm = fmaxf(qm, fabsf(s_q[i * D + 4 * (4 * kk + c) + e]));
  }
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 1));
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 2));
  qm = qm > 0.f ? qm : 1.f;
  const float rq = 1.f / qm;
  uint32_t qb[NK][2];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float* qc = s_q + i * D + 4 * (4 * kk + c);
    qb[kk][0] = i < g ? pack_half2(qc[0] * rq, qc[1] * rq) : 0u;
    qb[kk][1] = i < g ? pack_half2(qc[2] * rq, qc[3] * rq) : 0u;
  }
  const float qmA = __shfl_sync(0xffffffffu, qm, (2 * c) * 4);
  const float qmB = __shfl_sync(0xffffffffu, qm, (2 * c + 1) * 4);
  const float sl = p.scale * kLog2e;

  float acc[MV][4];
#pragma unroll
  for (int mv = 0; mv < MV; ++mv)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mv][e] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;

  const int64_t first = t_begin + warp * kTile;
  const int ntiles =
      first < t_end ? (int)((t_end - first + NW * kTile - 1) / (NW * kTile)) : 0;
  auto issue = [&](int k) {
    if (k < ntiles) {
      const int64_t t0 = first + (int64_t)k * NW * kTile;
      char* st = ring + (k % kHqmqStages) * TL.bytes;
      const HqmqTilePtrs tp = tiles.at(t0);
      warp_copy_async<HqmqDims<D>::CODES_MAX>(st + TL.kc, tp.kc, kTile * UK * 2, lane);
      warp_copy_async<HqmqDims<D>::CODES_MAX>(st + TL.vc, tp.vc, kTile * UV * 2, lane);
    }
    cp_async_commit();
  };
#pragma unroll
  for (int k = 0; k < kHqmqStages - 1; ++k) issue(k);

  for (int k = 0; k < ntiles; ++k) {
    issue(k + kHqmqStages - 1);
    cp_async_wait<kHqmqStages - 1>();
    __syncwarp();
    const int64_t t0 = first + (int64_t)k * NW * kTile;
    const char* st = ring + (k % kHqmqStages) * TL.bytes;
    const uint16_t* s_kc = reinterpret_cast<const uint16_t*>(st + TL.kc);
    const uint16_t* s_vc = reinterpret_cast<const uint16_t*>(st + TL.vc);

    // ---------------- S^T = K q^T: 2 m-tiles of 16 tokens ----------------
    float sc[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] = 0.f;
    const uint16_t* krow[4];  // token rows i, i + 8, 16 + i, 24 + i
#pragma unroll
    for (int u = 0; u < 4; ++u) krow[u] = s_kc + (8 * u + i) * UK;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t a[4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t f = smem_packed_field<FMT, D>(krow[2 * mt + hh], 4 * kk + c, rowk);
          uint32_t dir = f >> RBK;
          dir = dir < dmaxk ? dir : dmaxk;  // corrupt codes stay in the codebook
          const uint2 cw = cbk[dir];
          const uint32_t r2 = rcode_pair(f & rmk);
          a[hh] = hmul2_u32(cw.x, r2);      // rows i / i + 8, columns 2c, 2c+1: elements 0, 1
          a[2 + hh] = hmul2_u32(cw.y, r2);  // columns 2c+8, 2c+9: elements 2, 3
        }
        mma16816(sc[mt], a, qb[kk][0], qb[kk][1]);
      }
    }
    // true score / sl = qm_j * step_t * sc (+ records); lane's tokens 16 mt + i + 8 (e >> 1)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float stp = half_bits_to_float((uint16_t)smem_packed_scale<FMT, D>(krow[2 * mt + hh], rowk)) * inv_k;
        sc[mt][2 * hh] *= stp * qmA;
        sc[mt][2 * hh + 1] *= stp * qmB;
      }
    int64_t ra, re;
    hqmq_record_range(p.k, BH, t0 / kHqmqTile, n, &ra, &re);
    if (ra < re) {  // warp-uniform: Med3x key records of this tile
      for (int x = lane; x < kTile * 8; x += 32) buf[x] = 0.f;
      __syncwarp();
      for (int64_t r = ra + lane; r < re; r += 32) {
        const int4 rec = __ldg(reinterpret_cast<const int4*>(p.k.outliers) + r);
        const int cc = rec.y & 0xff;
        const int64_t tl = (int64_t)rec.x - t0;
        if (tl < 0 || tl >= kTile || (int64_t)((uint32_t)rec.y >> 8) != n || cc >= C) continue;
        const float v0 = half_bits_to_float((uint16_t)((uint32_t)rec.z & 0xffffu));
        const float v1 = half_bits_to_float((uint16_t)((uint32_t)rec.z >> 16));
        const float v2 = half_bits_to_float((uint16_t)((uint32_t)rec.w & 0xffffu));
        const float v3 = half_bits_to_float((uint16_t)((uint32_t)rec.w >> 16));
        for (int j = 0; j < g; ++j) {
          const float* qc = s_q + j * D + 4 * cc;
          atomicAdd(&buf[tl * 8 + j], qc[0] * v0 + qc[1] * v1 + qc[2] * v2 + qc[3] * v3);
        }
      }
      __syncwarp();
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][e] += buf[(16 * mt + i + 8 * (e >> 1)) * 8 + 2 * c + (e & 1)];
      __syncwarp();  // buf is reused for the value records below
    }
    // ---------------- online softmax: heads 2c (e even) and 2c + 1 (e odd) ----------------
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] *= sl;
    float alA, alB;
    tile_online_softmax(sc, p.mask != nullptr ? p.mask + b * p.mask_sb + t0 : nullptr, i, mA, mB, lA, lB, alA, alB);
    if (__any_sync(0xffffffffu, alA != 1.f || alB != 1.f)) {  // a running max moved
#pragma unroll
      for (int mv = 0; mv < MV; ++mv) acc[mv][0] *= alA, acc[mv][1] *= alB, acc[mv][2] *= alA, acc[mv][3] *= alB;
    }
    uint32_t pt[2][2];
    tile_pt_fragments(sc, pt);

    // ---------------- O^T += V^T P^T over 2 k-steps of 16 tokens ----------------
    // Lane (i, c) needs chunk 4 mv + i / 2 of tokens 2c, 2c+1 (A regs 0, 1) and 2c+8, 2c+9
    // (regs 2, 3), elements (i & 1) and (i & 1) + 2.  Lanes i and i ^ 1 (lane ^ 4) need the
    // same chunk: the even one decodes tokens 2c, 2c+1, the odd one 2c+8, 2c+9, and each
    // hands the partner the element pair it does not use (one shuffle per A register pair).
    const int odd = i & 1;
    const uint32_t sel_own = odd ? 0x7632u : 0x5410u;   // my element of a pair: high / low halves
    const uint32_t sel_give = odd ? 0x5410u : 0x7632u;  // the partner's
#pragma unroll
    for (int kst = 0; kst < 2; ++kst) {
      const uint16_t* vrow[2];  // my tokens 16 kst + 2c + 8 odd + {0, 1}
      float stp[2];             // their radius steps (folded into the A elements)
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int tl = 16 * kst + 2 * c + 8 * odd + u;
        vrow[u] = s_vc + tl * UV;
        stp[u] = half_bits_to_float((uint16_t)smem_packed_scale<FMT, D>(vrow[u], rowv)) * inv_v;
      }
#pragma unroll
      for (int mv = 0; mv < MV; ++mv) {
        const int cv = 4 * mv + (i >> 1);
        uint32_t x01[2], x23[2];
#pragma unroll
        for (int u = 0; u < 2; ++u) {
          const uint32_t f = smem_packed_field<FMT, D>(vrow[u], cv, rowv);
          uint32_t dir = f >> RBV;
          dir = dir < dmaxv ? dir : dmaxv;
          const uint2 cw = cbv[dir];
          const float rs = (float)(f & rmv) * stp[u];
          const uint32_t r2 = pack_half2(rs, rs);
          x01[u] = hmul2_u32(cw.x, r2);  // elements 0, 1 of token u
          x23[u] = hmul2_u32(cw.y, r2);  // elements 2, 3
        }
        const uint32_t own_lo = __byte_perm(x01[0], x01[1], sel_own);  // element odd, my 2 tokens
        const uint32_t own_hi = __byte_perm(x23[0], x23[1], sel_own);  // element odd + 2
        const uint32_t got_lo = __shfl_xor_sync(0xffffffffu, __byte_perm(x01[0], x01[1], sel_give), 4);
        const uint32_t got_hi = __shfl_xor_sync(0xffffffffu, __byte_perm(x23[0], x23[1], sel_give), 4);
        uint32_t a[4];
        a[0] = odd ? got_lo : own_lo;  // row i: element odd, tokens 2c, 2c+1
        a[1] = odd ? got_hi : own_hi;  // row i + 8: element odd + 2, tokens 2c, 2c+1
        a[2] = odd ? own_lo : got_lo;  // row i, tokens 2c+8, 2c+9
        a[3] = odd ? own_hi : got_hi;  // row i + 8, tokens 2c+8, 2c+9
        mma16816(acc[mv], a, pt[kst][0], pt[kst][1]);
      }
    }
    hqmq_record_range(p.v, BH, t0 / kHqmqTile, n, &ra, &re);
    if (ra < re) {  // warp-uniform: Med3x value records of this tile
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) buf[(16 * mt + i + 8 * (e >> 1)) * 8 + 2 * c + (e & 1)] = sc[mt][e];
      __syncwarp();
      for (int64_t r = ra; r < re; ++r) {
        const int4 rec = __ldg(reinterpret_cast<const int4*>(p.v.outliers) + r);  // broadcast
        const int cc = rec.y & 0xff;
        const int64_t tl = (int64_t)rec.x - t0;
        if (tl < 0 || tl >= kTile || (int64_t)((uint32_t)rec.y >> 8) != n || cc >= C) continue;
        const uint32_t lo = (i & 1) ? ((uint32_t)rec.z >> 16) : ((uint32_t)rec.z & 0xffffu);
        const uint32_t hi = (i & 1) ? ((uint32_t)rec.w >> 16) : ((uint32_t)rec.w & 0xffffu);
        const float vlo = half_bits_to_float((uint16_t)lo), vhi = half_bits_to_float((uint16_t)hi);
        const bool mine = (i >> 1) == (cc & 3);
        const float pA = mine ? buf[tl * 8 + 2 * c] : 0.f, pB = mine ? buf[tl * 8 + 2 * c + 1] : 0.f;
        const int cm = cc >> 2;
        // FMA with a zero weight into every m-tile: a predicated update acc[mv] if mv == cm is
        // turned into a dynamically indexed acc[cm] by the compiler, i.e. acc in local memory
#pragma unroll
        for (int mv = 0; mv < MV; ++mv) {
          const float wA = mv == cm ? pA : 0.f, wB = mv == cm ? pB : 0.f;
          acc[mv][0] = fmaf(wA, vlo, acc[mv][0]);
          acc[mv][1] = fmaf(wB, vlo, acc[mv][1]);
          acc[mv][2] = fmaf(wA, vhi, acc[mv][2]);
          acc[mv][3] = fmaf(wB, vhi, acc[mv][3]);
        }
      }
      __syncwarp();
    }
    __syncwarp();  // every lane has read this stage: the next issue() may overwrite it
  }
  cp_async_wait<0>();
  __syncwarp();
  // ---- this warp's partial: (m, l), then the accumulators in its channel order ----
  warp_store_ml(slot, D, g, i, c, mA, mB, lA, lB);
#pragma unroll
  for (int mv = 0; mv < MV; ++mv) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + (e & 1);
      if (head >= g) continue;
      const int ch = 4 * (4 * mv + (i >> 1)) + (i & 1) + 2 * (e >> 1);
      slot[head * (D + 2) + 2 + ch] = acc[mv][e];
    }
  }
  __syncwarp();
}

// ---------------------------------------------------------------------------
// v2 tensor-core path for the F = 16 format (hqmq-3.79: b_r = 4, 12-bit directions), D = 64
// and 128 (FMT 3).  Differences from hqmq_warp_mma (same skeleton, softmax and records):
//  - each tile's packed rows are unpacked in place, one token per lane, into rows of 16-bit
//    fields dir << 4 | rcode and fp16 scales (hqmq_unpack16), which the loop below reads;
//  - chunk <-> fragment maps chosen so that a lane's chunks of a token are consecutive words:
//    QK k-step kk, lane quad c: chunk NK c + kk (K words of a token row: one LDS.128 at D = 128);
//    PV m-tile pair m (m-tiles 2m, 2m + 1), lane row group i: chunk VP i + m, its elements 0, 1
//    in rows i, i + 8 of m-tile 2m and 2, 3 in rows i, i + 8 of m-tile 2m + 1, so each lane
//    decodes all 4 elements of its chunk for its 4 tokens 2c, 2c+1, 2c+8, 2c+9 (no exchange
//    between lanes; every (token, chunk) is still decoded once per warp).
//  - codeword address = (w >> 1) & 0x7ff8 (low field of word w) or (w >> 17) & 0x7ff8 (high
//    field): no clamp (the padded codebook holds every 12-bit index) and no base add (K
//    codebook at shared offset 0, V at a compile-time offset).
//  - K: element = fp16(cw 2^15) x (rcode 2^-24) with the rcodes of a word masked in place as
//    fp16 subnormals (one LOP3 per word, HMUL2 with a .H0_H0 / .H1_H1 operand): the product
//    cw rcode 2^-9 is exact up to one fp16 rounding (absolute 2^-25 where subnormal, i.e.
//    2^-16 in units of cw rcode); 2^9 / (2^b_r - 1) goes into the fp32 score factor.
//  - V: element = fp16(cw 16/15) x fp16(rcode/16 x scale) (rcode/16 exact by the magic-number
//    HFMA2, x scale one HMUL2 per word and token, the fp16 scale pair loaded with one LDS.32):
//    the same three fp16 roundings as the general path, no fp32 conversions per chunk, no overflow
//    (rcode/16 x scale <= 15/16 x 65504).
//  - tile copies with compile-time sizes (no predicates except the scales), the tile's
//    addresses from the tile source (contiguous rows or pages).
// ---------------------------------------------------------------------------
/// a * (b.lo, b.lo) and a * (b.hi, b.hi) (fp16x2; ptxas folds the duplication into HMUL2's
/// operand swizzle).
__device__ __forceinline__ uint32_t hmul2_lo_u32(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("{.reg .b16 l, h; .reg .b32 x; mov.b32 {l, h}, %2; mov.b32 x, {l, l}; mul.rn.f16x2 %0, %1, x;}"
      : "=r"(d)
      : "r"(a), "r"(b));
  return d;
}
__device__ __forceinline__ uint32_t hmul2_hi_u32(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("{.reg .b16 l, h; .reg .b32 x; mov.b32 {l, h}, %2; mov.b32 x, {h, h}; mul.rn.f16x2 %0, %1, x;}"
      : "=r"(d)
      : "r"(a), "r"(b));
  return d;
}
/// Byte offset of the codeword of the low (HI = false) or high field of word w (F = 16, b_r = 4).
template <bool HI>
__device__ __forceinline__ uint32_t cw16_off(uint32_t w) {
  return HI ? (w >> 17) & 0x7ff8u : (w >> 1) & 0x7ff8u;
}
__device__ __forceinline__ uint2 lds_u2(const char* base, uint32_t off) {
  return *reinterpret_cast<const uint2*>(base + off);
}
/// N consecutive words of shared memory (one 16- or 8-byte load, or a word).
template <int N>
__device__ __forceinline__ void lds_n(const char* src, uint32_t (&w)[N]) {
  if constexpr (N == 4) {
    const uint4 v = *reinterpret_cast<const uint4*>(src);
    w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
  } else if constexpr (N == 2) {
    const uint2 v = *reinterpret_cast<const uint2*>(src);
    w[0] = v.x, w[1] = v.y;
  } else {
    w[0] = *reinterpret_cast<const uint32_t*>(src);
  }
}

/// Unpack one role's packed tile (landed at byte `src` of stage `st`) into rows of 16-bit fields
/// (at `dst`, ROWB bytes apart) and fp16 radius scales (at `sdst`): lane t unpacks token t.  The
/// packed and unpacked rows overlap, so every lane reads its whole packed row before any writes.
template <int D, int ROWB>
__device__ __forceinline__ void hqmq_unpack16(char* st, int src, int dst, int sdst, int lane) {
  using L = Hq16<D>;
  constexpr int NW = (L::U + 1) / 2 + 1;  // the words holding a row from its word-aligned start, + 0
  const int u0 = lane * L::U;
  const uint32_t* base = reinterpret_cast<const uint32_t*>(st + src) + (u0 >> 1);
  uint32_t w[NW];
#pragma unroll
  for (int j = 0; j < NW - 1; ++j) w[j] = base[j];  // (never past the tile: no read of a neighbour's writes)
  w[NW - 1] = 0u;
  __syncwarp();
  uint32_t r[NW - 1];  // row bit b = bit b % 32 of r[b / 32]
#pragma unroll
  for (int j = 0; j < NW - 1; ++j) r[j] = __funnelshift_r(w[j], w[j + 1], (u0 & 1) * 16);
  uint32_t out[L::W];
  const uint32_t s16 = hqmq::unpack_row16<D>(r, out);
  uint4* d4 = reinterpret_cast<uint4*>(st + dst + lane * ROWB);
#pragma unroll
  for (int j = 0; j < L::W / 4; ++j) d4[j] = make_uint4(out[4 * j], out[4 * j + 1], out[4 * j + 2], out[4 * j + 3]);
  reinterpret_cast<uint16_t*>(st + sdst)[lane] = (uint16_t)s16;
}

template <typename DType, int D, typename Tiles>
__device__ void hqmq_warp_mma16(const HqmqAttnParams& p, const Tiles& tiles, int64_t b, int64_t h, int g,
                                int64_t t_begin, int64_t t_end, int warp, float* slot, char* ring, float* buf,
                                const char* cb, const float* s_q) {
  using L = Hq16<D>;
  constexpr int NK = L::NK, MV = D / 16, VP = L::VP, C = D / 4;
  constexpr int NW = hqmq_warps(D);
  const int lane = threadIdx.x % 32, i = lane >> 2, c = lane & 3;
  const int64_t BH = p.B * p.H, n = b * p.H + h;
  const float kf = 512.f / 15.f;  // K: 2^9 / (2^b_r - 1)

  // ---- q^T B-fragments of head i (chunk NK c + kk), normalised per head ----
  float qm = 0.f;
  if (i < g) {
#pragma unroll
    for (int kk = 0; kk < NK; ++kk)
#pragma unroll
      for (int e = 0; e < 4; ++e) qm = fmaxf(qm, fabsf(s_q[i * D + 4 * (NK * c + kk) + e]));
  }
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 1));
  qm = fmaxf(qm, __shfl_xor_sync(0xffffffffu, qm, 2));
  qm = qm > 0.f ? qm : 1.f;
  const float rq = 1.f / qm;
  uint32_t qb[NK][2];
#pragma unroll
  for (int kk = 0; kk < NK; ++kk) {
    const float* qc = s_q + i * D + 4 * (NK * c + kk);
    qb[kk][0] = i < g ? pack_half2(qc[0] * rq, qc[1] * rq) : 0u;
    qb[kk][1] = i < g ? pack_half2(qc[2] * rq, qc[3] * rq) : 0u;
  }
  const float qmA = __shfl_sync(0xffffffffu, qm, (2 * c) * 4) * kf;
  const float qmB = __shfl_sync(0xffffffffu, qm, (2 * c + 1) * 4) * kf;
  const float sl = p.scale * kLog2e;

  float acc[MV][4];
#pragma unroll
  for (int mv = 0; mv < MV; ++mv)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[mv][e] = 0.f;
  float mA = -INFINITY, mB = -INFINITY, lA = 0.f, lB = 0.f;

  const int64_t first = t_begin + warp * kTile;
  const int ntiles = first < t_end ? (int)((t_end - first + NW * kTile - 1) / (NW * kTile)) : 0;
  auto issue = [&](int k) {
    if (k < ntiles) {
      char* st = ring + (k & 1) * L::STAGE;
      const HqmqTilePtrs tp = tiles.at(first + (int64_t)k * NW * kTile);
      const char* kc_src = reinterpret_cast<const char*>(tp.kc);
      const char* vc_src = reinterpret_cast<const char*>(tp.vc);
#pragma unroll
      for (int j = 0; j < (L::PACKED / 16 + 31) / 32; ++j) {  // the packed tiles, 16 bytes per lane and step
        const int piece = 16 * (32 * j + lane);
        if (piece < L::PACKED) {
          cp_async16(st + L::KL + piece, kc_src + piece);
          cp_async16(st + L::VL + piece, vc_src + piece);
        }
      }
    }
    cp_async_commit();
  };
  static_assert(kHqmqStages == 2, "stage = k & 1");
  issue(0);

  for (int k = 0; k < ntiles; ++k) {
    issue(k + 1);
    cp_async_wait<1>();
    __syncwarp();
    const int64_t t0 = first + (int64_t)k * NW * kTile;
    char* st = ring + (k & 1) * L::STAGE;
    hqmq_unpack16<D, L::KROW>(st, L::KL, L::KC, L::KS, lane);
    hqmq_unpack16<D, L::VROW>(st, L::VL, L::VC, L::VS, lane);
    __syncwarp();
    const uint16_t* s_ks = reinterpret_cast<const uint16_t*>(st + L::KS);

    // ---------------- S^T = K q^T: 2 m-tiles of 16 tokens ----------------
    uint32_t kw[4][L::KW];  // token rows i, i + 8, 16 + i, 24 + i: chunks NK c .. NK c + NK - 1
#pragma unroll
    for (int u = 0; u < 4; ++u) lds_n<L::KW>(st + L::KC + (8 * u + i) * L::KROW + 4 * L::KW * c, kw[u]);
    float sc[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] = 0.f;
#pragma unroll
    for (int kk = 0; kk < NK; ++kk) {
#pragma unroll
      for (int mt = 0; mt < 2; ++mt) {
        uint32_t a[4];
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          const uint32_t w = kw[2 * mt + hh][kk >> 1];
          const uint32_t rr = w & 0x000f000fu;  // both rcodes as fp16 subnormals rcode 2^-24
          const bool hi = kk & 1;
          const uint2 cw = lds_u2(cb, hi ? cw16_off<true>(w) : cw16_off<false>(w));
          a[hh] = hi ? hmul2_hi_u32(cw.x, rr) : hmul2_lo_u32(cw.x, rr);      // rows i / i + 8: elements 0, 1
          a[2 + hh] = hi ? hmul2_hi_u32(cw.y, rr) : hmul2_lo_u32(cw.y, rr);  // elements 2, 3
        }
        mma16816(sc[mt], a, qb[kk][0], qb[kk][1]);
      }
    }
    // true score / sl = qm_j * scale_t / 15 * 2^9 * sc (+ records); tokens 16 mt + i + 8 (e >> 1)
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const float stp = half_bits_to_float(s_ks[16 * mt + i + 8 * hh]);
        sc[mt][2 * hh] *= stp * qmA;
        sc[mt][2 * hh + 1] *= stp * qmB;
      }
    int64_t ra = 0, re = 0;  // (the index arithmetic only where the role has records at all)
    if (p.k.num_outliers > 0) hqmq_record_range(p.k, BH, t0 / kHqmqTile, n, &ra, &re);
    if (ra < re) {  // warp-uniform: Med3x key records of this tile (as hqmq_warp_mma)
      for (int x = lane; x < kTile * 8; x += 32) buf[x] = 0.f;
      __syncwarp();
      for (int64_t r = ra + lane; r < re; r += 32) {
        const int4 rec = __ldg(reinterpret_cast<const int4*>(p.k.outliers) + r);
        const int cc = rec.y & 0xff;
        const int64_t tl = (int64_t)rec.x - t0;
        if (tl < 0 || tl >= kTile || (int64_t)((uint32_t)rec.y >> 8) != n || cc >= C) continue;
        const float v0 = half_bits_to_float((uint16_t)((uint32_t)rec.z & 0xffffu));
        const float v1 = half_bits_to_float((uint16_t)((uint32_t)rec.z >> 16));
        const float v2 = half_bits_to_float((uint16_t)((uint32_t)rec.w & 0xffffu));
        const float v3 = half_bits_to_float((uint16_t)((uint32_t)rec.w >> 16));
        for (int j = 0; j < g; ++j) {
          const float* qc = s_q + j * D + 4 * cc;
          atomicAdd(&buf[tl * 8 + j], qc[0] * v0 + qc[1] * v1 + qc[2] * v2 + qc[3] * v3);
        }
      }
      __syncwarp();
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) sc[mt][e] += buf[(16 * mt + i + 8 * (e >> 1)) * 8 + 2 * c + (e & 1)];
      __syncwarp();  // buf is reused for the value records below
    }
    // ---------------- online softmax: heads 2c (e even) and 2c + 1 (e odd) ----------------
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int e = 0; e < 4; ++e) sc[mt][e] *= sl;
    float alA, alB;
    tile_online_softmax(sc, p.mask != nullptr ? p.mask + b * p.mask_sb + t0 : nullptr, i, mA, mB, lA, lB, alA, alB);
    if (__any_sync(0xffffffffu, alA != 1.f || alB != 1.f)) {  // a running max moved
#pragma unroll
      for (int mv = 0; mv < MV; ++mv) acc[mv][0] *= alA, acc[mv][1] *= alB, acc[mv][2] *= alA, acc[mv][3] *= alB;
    }
    uint32_t pt[2][2];
    tile_pt_fragments(sc, pt);

    // ---------------- O^T += V^T P^T over 2 k-steps of 16 tokens ----------------
    // Lane (i, c): tokens 16 kst + 2c + {0, 1, 8, 9} (u = 0..3), chunks VP i + m (m < VP).
#pragma unroll
    for (int kst = 0; kst < 2; ++kst) {
      const char* vrow = st + L::VC + (16 * kst + 2 * c) * L::VROW + 4 * L::VW * i;
      uint32_t vw[4][L::VW];
      lds_n<L::VW>(vrow, vw[0]);
      lds_n<L::VW>(vrow + L::VROW, vw[1]);
      lds_n<L::VW>(vrow + 8 * L::VROW, vw[2]);
      lds_n<L::VW>(vrow + 9 * L::VROW, vw[3]);
      const uint32_t s01 = *reinterpret_cast<const uint32_t*>(st + L::VS + 2 * (16 * kst + 2 * c));  // fp16 pair
      const uint32_t s89 = *reinterpret_cast<const uint32_t*>(st + L::VS + 2 * (16 * kst + 2 * c + 8));
      uint32_t rs[4][L::VW];  // (rcode / 16 x scale) of the word's low and high fields, fp16x2
#pragma unroll
      for (int u = 0; u < 4; ++u)
#pragma unroll
        for (int x = 0; x < L::VW; ++x) {
          uint32_t m;  // 1024 + rcode of both fields: (w & 0x000f000f) | 0x64006400 in one LOP3
          asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(m) : "r"(vw[u][x]), "r"(0x000f000fu), "r"(0x64006400u));
          const uint32_t r16 = hfma2_u32(m, half2_pow2_bits(-4, false), half2_pow2_bits(6, true));  // rcode / 16
          const uint32_t sp = u == 0 || u == 2 ? (u == 0 ? s01 : s89) : (u == 1 ? s01 : s89);
          rs[u][x] = (u & 1) ? hmul2_hi_u32(r16, sp) : hmul2_lo_u32(r16, sp);
        }
#pragma unroll
      for (int m = 0; m < VP; ++m) {
        uint32_t y01[4], y23[4];  // elements (0, 1) and (2, 3) of chunk VP i + m, token u
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const uint32_t w = vw[u][m >> 1];
          const bool hi = m & 1;
          const uint2 cw = lds_u2(cb + L::CB, hi ? cw16_off<true>(w) : cw16_off<false>(w));
          const uint32_t r = rs[u][m >> 1];
          y01[u] = hi ? hmul2_hi_u32(cw.x, r) : hmul2_lo_u32(cw.x, r);
          y23[u] = hi ? hmul2_hi_u32(cw.y, r) : hmul2_lo_u32(cw.y, r);
        }
        uint32_t a[4];  // rows i (element 0 / 2), i + 8 (element 1 / 3); tokens 2c, 2c+1 | 2c+8, 2c+9
        a[0] = __byte_perm(y01[0], y01[1], 0x5410);
        a[1] = __byte_perm(y01[0], y01[1], 0x7632);
        a[2] = __byte_perm(y01[2], y01[3], 0x5410);
        a[3] = __byte_perm(y01[2], y01[3], 0x7632);
        mma16816(acc[2 * m], a, pt[kst][0], pt[kst][1]);
        a[0] = __byte_perm(y23[0], y23[1], 0x5410);
        a[1] = __byte_perm(y23[0], y23[1], 0x7632);
        a[2] = __byte_perm(y23[2], y23[3], 0x5410);
        a[3] = __byte_perm(y23[2], y23[3], 0x7632);
        mma16816(acc[2 * m + 1], a, pt[kst][0], pt[kst][1]);
      }
    }
    ra = re = 0;
    if (p.v.num_outliers > 0) hqmq_record_range(p.v, BH, t0 / kHqmqTile, n, &ra, &re);
    if (ra < re) {  // warp-uniform: Med3x value records of this tile
#pragma unroll
      for (int mt = 0; mt < 2; ++mt)
#pragma unroll
        for (int e = 0; e < 4; ++e) buf[(16 * mt + i + 8 * (e >> 1)) * 8 + 2 * c + (e & 1)] = sc[mt][e];
      __syncwarp();
      for (int64_t r = ra; r < re; ++r) {
        const int4 rec = __ldg(reinterpret_cast<const int4*>(p.v.outliers) + r);  // broadcast
        const int cc = rec.y & 0xff;
        const int64_t tl = (int64_t)rec.x - t0;
        if (tl < 0 || tl >= kTile || (int64_t)((uint32_t)rec.y >> 8) != n || cc >= C) continue;
        // chunk cc lives in lanes i = cc / VP, m-tiles 2 (cc % VP) (elements 0, 1 in rows i, i + 8)
        // and 2 (cc % VP) + 1 (elements 2, 3)
        const float v0 = half_bits_to_float((uint16_t)((uint32_t)rec.z & 0xffffu));
        const float v1 = half_bits_to_float((uint16_t)((uint32_t)rec.z >> 16));
        const float v2 = half_bits_to_float((uint16_t)((uint32_t)rec.w & 0xffffu));
        const float v3 = half_bits_to_float((uint16_t)((uint32_t)rec.w >> 16));
        const bool mine = i == cc / VP;
        const float pA = mine ? buf[tl * 8 + 2 * c] : 0.f, pB = mine ? buf[tl * 8 + 2 * c + 1] : 0.f;
        const int cm = cc % VP;
        // zero-weight FMAs into every m-tile (a dynamically indexed acc would go to local memory)
#pragma unroll
        for (int mv = 0; mv < MV; ++mv) {
          const float wA = (mv >> 1) == cm ? pA : 0.f, wB = (mv >> 1) == cm ? pB : 0.f;
          const float vr = (mv & 1) ? v2 : v0, vr8 = (mv & 1) ? v3 : v1;  // rows i, i + 8
          acc[mv][0] = fmaf(wA, vr, acc[mv][0]);
          acc[mv][1] = fmaf(wB, vr, acc[mv][1]);
          acc[mv][2] = fmaf(wA, vr8, acc[mv][2]);
          acc[mv][3] = fmaf(wB, vr8, acc[mv][3]);
        }
      }
      __syncwarp();
    }
    __syncwarp();  // every lane has read this stage: the next issue() may overwrite it
  }
  cp_async_wait<0>();
  __syncwarp();
  // ---- this warp's partial: (m, l), then the accumulators in its channel order ----
  warp_store_ml(slot, D, g, i, c, mA, mB, lA, lB);
#pragma unroll
  for (int mv = 0; mv < MV; ++mv) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int head = 2 * c + (e & 1);
      if (head >= g) continue;
      const int ch = 4 * (VP * i + (mv >> 1)) + 2 * (mv & 1) + (e >> 1);
      slot[head * (D + 2) + 2 + ch] = acc[mv][e];
    }
  }
  __syncwarp();
}

/// Launch format of an instantiation that runs the CUDA-core loop only (no tensor-core code).
constexpr int kHqmqNoMma = -1;

/// Does launch format FMT at head dim D run the v2 layout (hqmq_warp_mma16)?
template <int D, int FMT>
constexpr bool kHqmqV2 = FMT == 3 && (D == 64 || D == 128);

/// \brief The CTA builds KV head h's codebooks in shared memory (every thread takes part; the
/// caller synchronises before use).  v2 (kHqmqV2): 4096 entries per role at smem + role * 32 KB,
/// K x 2^15, V x 16/15, indices past 24 S repeating entry 24 S - 1.  Otherwise entry
/// s * 24 + u = P[u] . secondary[h, s] (fp16x4), K at smem, V at smem + sm.cb_k.
template <int D, int FMT>
__device__ void hqmq_build_codebooks(const HqmqKV& k, const HqmqKV& v, int64_t h, char* smem, const HqmqSmem& sm) {
  if constexpr (kHqmqV2<D, FMT>) {  // v2 codebooks (hqmq_warp_mma16): 4096 entries per role, K x 2^15, V x 16/15
    for (int role = 0; role < 2; ++role) {
      const HqmqKV& s = role ? v : k;
      uint2* cb = reinterpret_cast<uint2*>(smem) + role * 4096;
      const float f = role ? 16.f / 15.f : 32768.f;
      const int ne = (int)(hqmq::kHurwitzUnits * s.S);  // <= 4096 (hqmq_v2_ok)
      auto entry = [&](int x) {
        const int si = x / hqmq::kHurwitzUnits, u = x % hqmq::kHurwitzUnits;
        const float* sec = s.secondary + (h * s.S + si) * 4;
        float p0, p1, p2, p3, q0, q1, q2, q3;
        hqmq::hurwitz_unit(u, p0, p1, p2, p3);
        hqmq::hamilton(p0, p1, p2, p3, sec[0], sec[1], sec[2], sec[3], q0, q1, q2, q3);
        return make_uint2(pack_half2(q0 * f, q1 * f), pack_half2(q2 * f, q3 * f));
      };
      for (int e = threadIdx.x; e < ne; e += blockDim.x) cb[e] = entry(e);
      if (ne < 4096) {  // indices past 24 S: the clamped entry 24 S - 1 (as the general path)
        const uint2 last = entry(ne - 1);
        for (int e = ne + threadIdx.x; e < 4096; e += blockDim.x) cb[e] = last;
      }
    }
  } else {  // build this head's codebooks: entry s * 24 + u = P[u] . secondary[h, s], fp16x4
    for (int role = 0; role < 2; ++role) {
      const HqmqKV& s = role ? v : k;
      uint2* cb = reinterpret_cast<uint2*>(role ? smem + sm.cb_k : smem);
      const float* sec = s.secondary + h * s.S * 4;
      for (int64_t e = threadIdx.x; e < (int64_t)hqmq::kHurwitzUnits * s.S; e += blockDim.x) {
        const int64_t si = e / hqmq::kHurwitzUnits;
        const int u = (int)(e % hqmq::kHurwitzUnits);
        float p0, p1, p2, p3, q0, q1, q2, q3;
        hqmq::hurwitz_unit(u, p0, p1, p2, p3);
        hqmq::hamilton(p0, p1, p2, p3, sec[4 * si], sec[4 * si + 1], sec[4 * si + 2], sec[4 * si + 3], q0, q1, q2,
                     q3);
        cb[e] = make_uint2(pack_half2(q0, q1), pack_half2(q2, q3));
      }
    }
  }
}

/// \brief The CTA's tensor-core part: when sm.mma and t_begin < t_end (uniform per CTA), the
/// codebooks of KV head h, then each warp's tiles of [t_begin, t_end) (whole tiles, addresses
/// from `tiles`) into its slot; otherwise every warp's slot starts empty.  s_q must be written (the barrier here publishes it).  FMT < 0 (kHqmqNoMma): no tensor-core code is instantiated and
/// the slots start empty.
template <typename DType, int D, int FMT, typename Tiles>
__device__ __forceinline__ void hqmq_cta_mma(const HqmqAttnParams& p, const HqmqSmem& sm, const Tiles& tiles,
                                             int64_t b, int64_t h, int g, int64_t t_begin, int64_t t_end,
                                             char* smem, char* region, const float* s_q) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* slot = reinterpret_cast<float*>(region);
  if constexpr (FMT >= 0) {
    const bool do_mma = sm.mma && t_begin < t_end;
    if (do_mma) hqmq_build_codebooks<D, FMT>(p.k, p.v, h, smem, sm);
    __syncthreads();
    if (do_mma) {
      float* buf = reinterpret_cast<float*>(region + sm.region - sizeof(float) * kTile * 8);
      if constexpr (kHqmqV2<D, FMT>)
        hqmq_warp_mma16<DType, D>(p, tiles, b, h, g, t_begin, t_end, warp, slot, region, buf, smem, s_q);
      else
        hqmq_warp_mma<DType, D, FMT>(p, tiles, b, h, g, t_begin, t_end, warp, slot, region, buf,
                                     reinterpret_cast<const uint2*>(smem),
                                     reinterpret_cast<const uint2*>(smem + sm.cb_k), s_q);
      return;
    }
  } else {
    __syncthreads();
  }
  for (int x = lane; x < g * (D + 2); x += 32) slot[x] = (x % (D + 2)) == 0 ? -INFINITY : 0.f;
  __syncwarp();
}

template <typename DType, int D, int FMT>
__global__ void __launch_bounds__(hqmq_warps(D) * 32, 1)
    HqmqDecodeAttentionKernel(HqmqAttnParams p, SplitPlan plan, HqmqSmem sm) {
  pdl_allow_dependents();  // the combine kernel may launch; it waits for this grid
  extern __shared__ __align__(16) char smem[];
  const int split = blockIdx.y;  // split_grid
  const int64_t bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int g = (int)(p.Hq / p.H);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  float* s_q = reinterpret_cast<float*>(smem + sm.cb_k + sm.cb_v);
  char* regions = smem + sm.cb_k + sm.cb_v + sm.q;
  char* region = regions + warp * sm.region;
  float* slot = reinterpret_cast<float*>(region);
  {
    const DType* q = static_cast<const DType*>(p.q) + (b * p.Hq + h * g) * D;
    for (int x = threadIdx.x; x < g * D; x += blockDim.x) s_q[x] = to_float(q[x]);
  }
  const int64_t t_begin = split * plan.chunk_main;
  const int64_t t_end = t_begin + plan.chunk_main < plan.t_main ? t_begin + plan.chunk_main : plan.t_main;
  hqmq_cta_mma<DType, D, FMT>(p, sm, hqmq_row_tiles(p, b, h), b, h, g, t_begin, t_end, smem, region, s_q);
  // ---- this warp's share of the tail [t_main, T): encoded tokens past the last full tile, then the
  // recent window ----
  const int64_t tail = p.T - plan.t_main;
  if (tail > 0) {
    const int64_t nchunks = (tail + plan.tail_chunk - 1) / plan.tail_chunk;
    for (int64_t k = plan.tail_first(split, warp); k >= 0 && k < nchunks; k += plan.tail_stride(hqmq_warps(D))) {
      const int64_t a = plan.t_main + k * plan.tail_chunk;
      const int64_t e = a + plan.tail_chunk < p.T ? a + plan.tail_chunk : p.T;
      auto load = [&](int64_t t, float (&kx)[D / 32], float (&vx)[D / 32]) {
        if (t < p.Tc) {
          hqmq_load_token<D>(p, p.k, b, h, t, lane, kx);
          hqmq_load_token<D>(p, p.v, b, h, t, lane, vx);
        } else {  // the recent window: full-precision rows
          const int64_t r = t - p.Tc;
          load_fp_row<DType, D>(static_cast<const DType*>(p.k.residual) + b * p.k.res_sb + h * p.k.res_sh + r * D,
                                lane, kx);
          load_fp_row<DType, D>(static_cast<const DType*>(p.v.residual) + b * p.v.res_sb + h * p.v.res_sh + r * D,
                                lane, vx);
        }
      };
      // heads in passes of <= 8 (independent softmax states; register arrays of 16 heads
      // spill), each pass decoding the chunk's tokens again; kHqmqTailChunk tokens per step
      for (int j0 = 0; j0 < g; j0 += 8)
        warp_generic_loop<D, 8, kHqmqTailChunk>(p.mask, p.mask_sb, p.scale, b, g - j0 < 8 ? g - j0 : 8, a, e,
                                slot + j0 * (D + 2), s_q + j0 * D, load);
    }
  }
  __syncthreads();
  const SplitWs ws(p.ws, p.B * p.Hq, plan.splits(), D);
  write_split_partial<D, hqmq_warps(D)>(ws, regions, sm.region, b * p.Hq + h * g, g, plan.splits(), split);
}

}  // namespace attention
}  // namespace kvq
