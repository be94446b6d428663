// HQMQ: Hurwitz quaternion multiplicative quantization (+ Med3x outliers).  The block
// format, the arithmetic shared by host and device, and the CPU twin of the CUDA kernels.
// Torch-free.
//
// Codebook (per KV head h): { p . s : p in P, s in S_h }, Hamilton product, p on the left.
//   P   = the 24 unit Hurwitz quaternions, indexed
//           p in [0, 8):   signed axis unit, component p / 2 = (p & 1) ? -1 : +1
//           p in [8, 24):  half unit, component i = ((p - 8) >> i & 1) ? -1/2 : +1/2
//         (component order w, x, y, z)
//   S_h = `secondary[h]`, S unit quaternions (fp32, [H, S, 4]).
//   direction index  dir = s * 24 + p  in [0, 24 S).
// Search: <u, p.s> = <u.conj(s), p>, and the best Hurwitz unit for v has the closed form
//   score(v) = max(max_i |v_i|, sum_i |v_i| / 2)   (axis unit if the first term wins or
//   ties, else the half unit with the signs of v), so one chunk costs S quaternion products.
//   Ties go to the lowest s; the chunk itself (not u = x / |x|) is used, which scales every
//   score by |x| and leaves the argmax unchanged.
//
// Packed row, per (row n = flattened leading index, token t): codes int16 [N, T, U], one
// little-endian bitstream of U 16-bit units per row.  C = D / 4 chunks; a chunk's field is
// dir << RB | rcode (F = DB + RB bits, DB = ceil(log2(24 S)), RB = radius_bits), split as
//   field = digit * 2^E + plain,   E = L + RB,  L = DB - 4,
// so plain = (dir mod 2^L) << RB | rcode and digit = dir >> L in [0, R), R = ceil(24 S / 2^L)
// (9 for S = 96 and S = 192: 24 S = 9 * 2^L).  The row holds, from bit 0:
//   plain fields  C x E bits (chunk c at bits [c E, (c + 1) E));
//   digit groups  G = C / K units of 16 bits, K = the most base-R digits a 16-bit unit holds
//                 (5 for R = 9, else 4): group j = sum_i digit(K j + i) R^i;
//   tail          the last C - G K digits as one base-R number in tail_bits bits (0 if none);
//   scale         the rest of the row's last unit, SB = min(15, 16 U - scale_at) >= 8 bits: the
//                 top SB bits of an fp16's 15 magnitude bits (5 exponent, SB - 5 mantissa
//                 bits), the smallest such value >= the largest radius of the row's non-outlier
//                 chunks; the fp16 value is scale_code << (15 - SB).  U = ceil((scale_at + 8) / 16).
// hqmq-3.79 (S = 96, RB = 4): 31 units at D = 128 (SB = 9), 16 at D = 64 (SB = 12); hqmq-5
// (S = 192, RB = 6): 37 / 19 units (SB = 9 / 12).  Coded chunk norms must be <= kMaxScale
// (61440, representable at every SB).
//   decode: chunk = (rcode * (scale / (2^RB - 1))) * (P[dir % 24] . S_h[dir / 24]).
//   outliers (Med3x) int32 [M, 4], one 16-byte record per outlier chunk:
//          {t, n << 8 | c, half(v0) | half(v1) << 16, half(v2) | half(v3) << 16}
//          (the chunk's four values as fp16 bits; exact for fp16 input).  The chunk's field
//          in `codes` is 0 (zero radius), so a decoder adds/overwrites records after the
//          dense decode.  Records come sorted by (n, t, c) from one encode call.
//   A chunk is an outlier when its norm is > threshold[h] (strictly); outliers do not
//   enter the row's radius scale.
#pragma once
#include <cmath>
#include <cstdint>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"

namespace kvq {
namespace hqmq {

constexpr int kHurwitzUnits = 24;
constexpr int kMaxSecondary = 2048;  // shared memory: S * 16 bytes
constexpr int kMaxChunks = 64;       // D <= 256 (the outlier mask is one uint64 per row)
constexpr float kMaxAbs = 65504.0f;    // fp16 max: outlier values must fit
constexpr float kMaxScale = 61440.0f;  // coded chunk norms must fit: exact at every scale width
constexpr int kMaxUnits = 128;         // units per row (D = 256, RB = 8, S = 2048: 101)

/// \brief Bit layout of a packed row (see the file comment).
struct RowLayout {
  int C = 0, E = 0, R = 0, K = 0, G = 0;
  int tail_bits = 0, groups_at = 0, tail_at = 0, scale_at = 0, scale_bits = 0, units = 0;
};

/// \brief Parameters of one HQMQ encode or decode call.
struct HqmqParams {
  const void* x = nullptr;            // [N, T, D] input (encode), contiguous, 16-byte aligned
  void* out = nullptr;                // [N, T, D] output (decode)
  const float* secondary = nullptr;   // [H, S, 4] unit quaternions
  int16_t* codes = nullptr;           // [N, T, U] packed rows
  const float* threshold = nullptr;   // [H] outlier threshold on chunk norms, or nullptr
  int64_t* flag_mask = nullptr;       // [N * T] scratch: outlier chunks of each row (encode)
  int32_t* flag_count = nullptr;      // [N * T] scratch: popcount of flag_mask
  const int64_t* offsets = nullptr;   // [N * T] exclusive prefix sum of flag_count
  int32_t* outliers = nullptr;        // [M, 4] records (encode writes, decode reads)
  int64_t num_outliers = 0;           // M
  int32_t* status = nullptr;          // optional [1], OR of StatusFlag
  int64_t N = 0;                      // rows of tokens (product of leading dims)
  int64_t H = 1;                      // KV heads; row n uses secondary[n % H]
  int64_t T = 0;                      // tokens
  int64_t D = 0;                      // head dim (multiple of 4, <= 256)
  int64_t S = 0;                      // secondary set size
  int radius_bits = 0;                // RB in 1..8
  RowLayout row;                      // hqmq_row_layout(D, S, RB); row.units = U
};

/// \brief DB = ceil(log2(24 S)).
KVQ_HOST_DEVICE constexpr int hqmq_dir_bits(int64_t S) {
  int b = 0;
  while (((int64_t)1 << b) < kHurwitzUnits * S) ++b;
  return b;
}

/// \brief The layout of a packed row at head dim D (see the file comment).
KVQ_HOST_DEVICE constexpr RowLayout hqmq_row_layout(int64_t D, int64_t S, int radius_bits) {
  RowLayout l;
  const int DB = hqmq_dir_bits(S), L = DB - 4;  // DB >= 5 (24 S >= 24)
  l.C = (int)(D / 4);
  l.E = L + radius_bits;
  l.R = (int)((kHurwitzUnits * S + ((int64_t)1 << L) - 1) >> L);  // in (8, 16]
  l.K = l.R == 9 ? 5 : 4;                                          // 9^5 < 2^16 < 10^5
  l.G = l.C / l.K;
  const int r = l.C - l.G * l.K;
  int64_t span = 1;
  for (int i = 0; i < r; ++i) span *= l.R;
  while (((int64_t)1 << l.tail_bits) < span) ++l.tail_bits;
  l.groups_at = l.C * l.E;
  l.tail_at = l.groups_at + 16 * l.G;
  l.scale_at = l.tail_at + l.tail_bits;
  l.units = (l.scale_at + 8 + 15) / 16;
  l.scale_bits = 16 * l.units - l.scale_at < 15 ? 16 * l.units - l.scale_at : 15;
  return l;
}

/// \brief Units per packed row (U).
KVQ_HOST_DEVICE int hqmq_units(int64_t D, int64_t S, int radius_bits) {
  return hqmq_row_layout(D, S, radius_bits).units;
}

/// \brief `width` (<= 25) bits of a packed row from bit `bit`.
KVQ_HOST_DEVICE uint32_t row_bits(const uint16_t* row, int units, int bit, int width) {
  const int j = bit >> 4, o = bit & 15;
  uint64_t v = row[j];
  if (j + 1 < units) v |= (uint64_t)row[j + 1] << 16;
  if (o + width > 32 && j + 2 < units) v |= (uint64_t)row[j + 2] << 32;
  return (uint32_t)(v >> o) & ((1u << width) - 1u);
}

/// \brief R^i.
KVQ_HOST_DEVICE uint32_t radix_pow(int R, int i) {
  uint32_t v = 1;
  for (int k = 0; k < i; ++k) v *= (uint32_t)R;
  return v;
}

/// \brief Chunk c's field (dir << RB | rcode) from a packed row.
KVQ_HOST_DEVICE uint32_t read_field(const uint16_t* row, const RowLayout& l, int c) {
  const uint32_t plain = row_bits(row, l.units, c * l.E, l.E);
  const int j = c / l.K;
  const uint32_t grp = j < l.G ? row_bits(row, l.units, l.groups_at + 16 * j, 16)
                               : row_bits(row, l.units, l.tail_at, l.tail_bits);
  const uint32_t digit = (grp / radix_pow(l.R, c - j * l.K)) % (uint32_t)l.R;
  return (digit << l.E) | plain;
}

/// \brief The fp16 bits of a packed row's radius scale.
KVQ_HOST_DEVICE uint16_t read_scale(const uint16_t* row, const RowLayout& l) {
  return (uint16_t)(row_bits(row, l.units, l.scale_at, l.scale_bits) << (15 - l.scale_bits));
}

/// \brief High word of a * b.
KVQ_HOST_DEVICE uint32_t umulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return (uint32_t)(((uint64_t)a * b) >> 32);
#endif
}

/// \brief x / 9^i for x < 2^16, i in 0..4 (the high word of x * ceil(2^32 / 9^i)).
KVQ_HOST_DEVICE uint32_t div_pow9(uint32_t x, int i) {
  const uint32_t m = i == 1 ? 477218589u : i == 2 ? 53024288u : i == 3 ? 5891588u : 654621u;
  return i == 0 ? x : umulhi32(x, m);
}

/// \brief The layout of the R = 9 formats with E-bit plain fields at head dim D (it depends on
/// D, E and R alone: S = 96 with b_r = E - 8 stands for all of them, e.g. hqmq-5's S = 192, b_r = 6).
template <int D, int E>
KVQ_HOST_DEVICE constexpr RowLayout r9_layout() {
  return hqmq_row_layout(D, 96, E - 8);
}

/// \brief read_field for an R = 9 format with compile-time layout r9_layout<D, E> (reads at most
/// two units past the chunk's bits; the CUDA tensor-core path's reader).
template <int D, int E>
KVQ_HOST_DEVICE uint32_t read_field_r9(const uint16_t* row, int chunk) {
  constexpr RowLayout L = r9_layout<D, E>();
  static_assert(L.R == 9 && L.E + 15 <= 32, "two units hold a plain field");
  const int bit = chunk * E, j = bit >> 4;
  const uint32_t plain = (((uint32_t)row[j] | (uint32_t)row[j + 1] << 16) >> (bit & 15)) & ((1u << E) - 1u);
  const int gi = chunk / 5;
  const int at = gi < L.G ? L.groups_at + 16 * gi : L.tail_at;
  const uint32_t gv = ((uint32_t)row[at >> 4] | (uint32_t)row[(at >> 4) + 1] << 16) >> (at & 15);
  const uint32_t q = div_pow9(gv & (gi < L.G ? 0xffffu : (1u << L.tail_bits) - 1u), chunk - 5 * gi);
  return ((q - 9u * umulhi32(q, 477218589u)) << E) | plain;
}

/// \brief read_scale for an R = 9 format with compile-time layout r9_layout<D, E>.
template <int D, int E>
KVQ_HOST_DEVICE uint32_t read_scale_r9(const uint16_t* row) {
  constexpr RowLayout L = r9_layout<D, E>();
  const int at = L.scale_at;
  const uint32_t v = ((uint32_t)row[at >> 4] | (uint32_t)row[(at >> 4) + 1] << 16) >> (at & 15);
  return (v & ((1u << L.scale_bits) - 1u)) << (15 - L.scale_bits);
}

/// \brief `width` bits from bit b of a row held in 32-bit words r (row bit b = bit b % 32 of
/// r[b / 32]); b and width are compile-time constants once the caller's loops are unrolled.
template <int N>
KVQ_HOST_DEVICE uint32_t reg_bits(const uint32_t (&r)[N], int b, int width) {
  const int j = b >> 5, o = b & 31;
  uint32_t v = r[j] >> o;
  if (o + width > 32) v |= r[j + 1] << (32 - o);
  return v & ((1u << width) - 1u);
}

/// \brief Every field of a packed F = 16, R = 9 row (E = 12: hqmq-3.79) held in words r, as
/// 16-bit fields dir << 4 | rcode two per word (out[w] = field 2w | field 2w + 1 << 16); returns
/// the scale's fp16 bits.  The CUDA v2 path unpacks each token of a tile with it.
template <int D, int N>
KVQ_HOST_DEVICE uint32_t unpack_row16(const uint32_t (&r)[N], uint32_t (&out)[D / 8]) {
  constexpr RowLayout R = r9_layout<D, 12>();
  static_assert(32 * N >= 16 * R.units, "r holds the row");
#pragma unroll
  for (int gi = 0; gi <= R.G; ++gi) {  // the G digit groups, then the tail
    const int n = gi < R.G ? 5 : R.C - 5 * R.G;
    uint32_t gv = n == 0 ? 0u : gi < R.G ? reg_bits(r, R.groups_at + 16 * gi, 16) : reg_bits(r, R.tail_at, R.tail_bits);
#pragma unroll
    for (int k = 0; k < n; ++k) {
      const int ch = 5 * gi + k;
      const uint32_t q = umulhi32(gv, 477218589u);  // gv / 9 (gv < 2^16)
      const uint32_t f = ((gv - 9u * q) << 12) | reg_bits(r, 12 * ch, 12);
      gv = q;
      out[ch >> 1] = (ch & 1) ? out[ch >> 1] | (f << 16) : f;
    }
  }
  return reg_bits(r, R.scale_at, R.scale_bits) << (15 - R.scale_bits);
}

/// \brief row_fields through unpack_row16: the row's units gathered into words first.
template <int D>
inline uint32_t unpack_fields16(const uint16_t* row, const RowLayout& l, uint32_t* fields) {
  uint32_t r[D / 8 + 1] = {}, out[D / 8];
  for (int j = 0; j < l.units; ++j) r[j >> 1] |= (uint32_t)row[j] << (16 * (j & 1));
  const uint32_t s = unpack_row16<D>(r, out);
  for (int c = 0; c < l.C; ++c) fields[c] = (out[c >> 1] >> (16 * (c & 1))) & 0xffffu;
  return s;
}

/// \brief The C fields (dir << b_r | rcode) and the scale's fp16 bits of a packed row, through
/// the arithmetic of the CUDA decode paths that read it: unpack_row16 (the v2 tensor-core path)
/// for F = 16, R = 9 at D = 64 / 128, read_field_r9 (the general tensor-core path) for the other
/// R = 9 formats with E = 12 or 15, else the generic reader.  The CPU decoders use it, so the
/// CPU tests cover that arithmetic.
inline uint32_t row_fields(const uint16_t* row, const RowLayout& l, int64_t D, uint32_t* fields) {
  const bool r9 = l.R == 9 && (l.E == 12 || l.E == 15);
  if (r9 && l.E == 12 && D == 64) return unpack_fields16<64>(row, l, fields);
  if (r9 && l.E == 12 && D == 128) return unpack_fields16<128>(row, l, fields);
  uint16_t pad[kMaxUnits + 2] = {};  // read_field_r9 may read two units past the row
  for (int j = 0; j < l.units; ++j) pad[j] = row[j];
#define KVQ_R9(DD, EE)                                                   \
  if (r9 && D == DD && l.E == EE) {                                      \
    for (int c = 0; c < l.C; ++c) fields[c] = read_field_r9<DD, EE>(pad, c); \
    return read_scale_r9<DD, EE>(pad);                                   \
  }
  KVQ_R9(32, 12) KVQ_R9(256, 12) KVQ_R9(32, 15) KVQ_R9(64, 15) KVQ_R9(128, 15) KVQ_R9(256, 15)
#undef KVQ_R9
  for (int c = 0; c < l.C; ++c) fields[c] = read_field(row, l, c);
  return read_scale(row, l);
}

/// \brief The SB-bit scale code of a row whose largest coded radius is rmax (rounded up; finite
/// values past the largest finite code clamp to it, NaN / Inf stay non-finite).
KVQ_HOST_DEVICE uint32_t scale_code(float rmax, int SB) {
  const int sh = 15 - SB;
  const uint32_t s16 = float_to_half_bits_ru(rmax);
  const uint32_t c = (s16 + (1u << sh) - 1u) >> sh, cmax = 0x7bffu >> sh;
  return s16 <= 0x7bffu && c > cmax ? cmax : c;
}

/// \brief Unit j of a packed row from the row's C fields and its scale code.
KVQ_HOST_DEVICE uint16_t assemble_unit(const uint32_t* fields, const RowLayout& l, uint32_t scode, int j) {
  const int lo = 16 * j, hi = lo + 16;
  uint64_t acc = 0;  // bits [lo - 32, hi) of the row, bit 0 = row bit lo - 32
  auto put = [&](int at, int width, uint32_t v) {
    if (width == 0 || at >= hi || at + width <= lo) return;
    acc |= (uint64_t)v << (at - lo + 32);
  };
  const uint32_t pmask = (1u << l.E) - 1u;
  int c0 = lo / l.E, c1 = (hi - 1) / l.E;
  if (c1 > l.C - 1) c1 = l.C - 1;
  for (int c = c0; c <= c1; ++c) put(c * l.E, l.E, fields[c] & pmask);
  for (int g = 0; g <= l.G; ++g) {  // the G groups, then the tail
    const int at = g < l.G ? l.groups_at + 16 * g : l.tail_at, width = g < l.G ? 16 : l.tail_bits;
    if (width == 0 || at >= hi || at + width <= lo) continue;
    const int n = g < l.G ? l.K : l.C - l.G * l.K;
    uint32_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = v * (uint32_t)l.R + (fields[g * l.K + i] >> l.E);
    put(at, width, v);
  }
  put(l.scale_at, l.scale_bits, scode);
  return (uint16_t)(acc >> 32);
}

// Arithmetic whose rounding is identical on host and device: no contraction into FMA
// (device intrinsics are never contracted; the host file is built with -ffp-contract=off).
KVQ_HOST_DEVICE float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVQ_HOST_DEVICE float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
KVQ_HOST_DEVICE float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVQ_HOST_DEVICE float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}
/// \brief Fused a * b + c, correctly rounded on host (std::fma) and device alike.
KVQ_HOST_DEVICE float fma_rn(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}
KVQ_HOST_DEVICE int round_rn(float q) {
#if defined(__CUDA_ARCH__)
  return __float2int_rn(q);
#else
  return (int)std::nearbyint(q);
#endif
}

/// \brief Chunk norm sqrt(((x0^2 + x1^2) + x2^2) + x3^2).
KVQ_HOST_DEVICE float chunk_norm(float x0, float x1, float x2, float x3) {
  return sqrt_rn(add_rn(add_rn(add_rn(mul_rn(x0, x0), mul_rn(x1, x1)), mul_rn(x2, x2)),
                        mul_rn(x3, x3)));
}

/// \brief v = x . conj(s) (Hamilton product): 4 multiplies + 12 explicit FMAs in a fixed
/// order (the search's hot loop; identical rounding on host and device).
KVQ_HOST_DEVICE void mul_conj(float x0, float x1, float x2, float x3, float s0, float s1,
                              float s2, float s3, float& v0, float& v1, float& v2, float& v3) {
  v0 = fma_rn(x3, s3, fma_rn(x2, s2, fma_rn(x1, s1, mul_rn(x0, s0))));
  v1 = fma_rn(x3, s2, fma_rn(-x2, s3, fma_rn(-x0, s1, mul_rn(x1, s0))));
  v2 = fma_rn(-x3, s1, fma_rn(x1, s3, fma_rn(-x0, s2, mul_rn(x2, s0))));
  v3 = fma_rn(x2, s1, fma_rn(-x1, s2, fma_rn(-x0, s3, mul_rn(x3, s0))));
}

/// \brief q = a . b (Hamilton product), fixed evaluation order.
KVQ_HOST_DEVICE void hamilton(float a0, float a1, float a2, float a3, float b0, float b1,
                              float b2, float b3, float& q0, float& q1, float& q2, float& q3) {
  q0 = add_rn(add_rn(add_rn(mul_rn(a0, b0), -mul_rn(a1, b1)), -mul_rn(a2, b2)), -mul_rn(a3, b3));
  q1 = add_rn(add_rn(add_rn(mul_rn(a0, b1), mul_rn(a1, b0)), mul_rn(a2, b3)), -mul_rn(a3, b2));
  q2 = add_rn(add_rn(add_rn(mul_rn(a0, b2), -mul_rn(a1, b3)), mul_rn(a2, b0)), mul_rn(a3, b1));
  q3 = add_rn(add_rn(add_rn(mul_rn(a0, b3), mul_rn(a1, b2)), -mul_rn(a2, b1)), mul_rn(a3, b0));
}

/// \brief Best inner product of v with a unit Hurwitz quaternion: max(max|v_i|, sum|v_i|/2).
KVQ_HOST_DEVICE float hurwitz_score(float v0, float v1, float v2, float v3) {
  const float a0 = fabsf(v0), a1 = fabsf(v1), a2 = fabsf(v2), a3 = fabsf(v3);
  const float m = fmaxf(fmaxf(a0, a1), fmaxf(a2, a3));
  const float h = mul_rn(add_rn(add_rn(add_rn(a0, a1), a2), a3), 0.5f);
  return fmaxf(m, h);
}

/// \brief Index (see the file comment) of the unit Hurwitz quaternion nearest to v.
KVQ_HOST_DEVICE int hurwitz_nearest(float v0, float v1, float v2, float v3) {
  const float a0 = fabsf(v0), a1 = fabsf(v1), a2 = fabsf(v2), a3 = fabsf(v3);
  const float m = fmaxf(fmaxf(a0, a1), fmaxf(a2, a3));
  const float h = mul_rn(add_rn(add_rn(add_rn(a0, a1), a2), a3), 0.5f);
  if (m >= h) {
    const int i = (a0 == m) ? 0 : (a1 == m) ? 1 : (a2 == m) ? 2 : 3;
    const float vi = i == 0 ? v0 : i == 1 ? v1 : i == 2 ? v2 : v3;
    return 2 * i + (vi < 0.f ? 1 : 0);
  }
  return 8 + (v0 < 0.f ? 1 : 0) + (v1 < 0.f ? 2 : 0) + (v2 < 0.f ? 4 : 0) + (v3 < 0.f ? 8 : 0);
}

/// \brief Components of unit Hurwitz quaternion number p (0..23).
KVQ_HOST_DEVICE void hurwitz_unit(int p, float& q0, float& q1, float& q2, float& q3) {
  if (p < 8) {
    const float sg = (p & 1) ? -1.f : 1.f;
    const int i = p >> 1;
    q0 = i == 0 ? sg : 0.f;
    q1 = i == 1 ? sg : 0.f;
    q2 = i == 2 ? sg : 0.f;
    q3 = i == 3 ? sg : 0.f;
  } else {
    const int m = p - 8;
    q0 = (m & 1) ? -0.5f : 0.5f;
    q1 = (m & 2) ? -0.5f : 0.5f;
    q2 = (m & 4) ? -0.5f : 0.5f;
    q3 = (m & 8) ? -0.5f : 0.5f;
  }
}

/// \brief Radius code: round(r / step) clamped to [0, 2^RB - 1]; 0 when step == 0.
KVQ_HOST_DEVICE uint32_t radius_code(float r, float step, float maxq) {
  if (!(step > 0.f)) return 0u;
  float q = div_rn(r, step);
  q = fminf(fmaxf(q, 0.f), maxq);  // NaN -> 0 (only with the finite check disabled)
  return (uint32_t)round_rn(q);
}

/// \brief Nonzero StatusFlag bits for a value that cannot be encoded safely.
KVQ_HOST_DEVICE int32_t value_status(float x) {
  if (fabsf(x) <= kMaxAbs) return kStatusOk;
  return (x != x || fabsf(x) == INFINITY) ? kStatusNonFinite : kStatusOutOfRange;
}

/// \brief Pack the 4 fp16 values of an outlier record.
KVQ_HOST_DEVICE void make_record(int64_t t, int64_t n, int c, float x0, float x1, float x2,
                                 float x3, int32_t* rec) {
  rec[0] = (int32_t)t;
  rec[1] = (int32_t)((n << 8) | c);
  rec[2] = (int32_t)((uint32_t)float_to_half_bits_rn(x0) | ((uint32_t)float_to_half_bits_rn(x1) << 16));
  rec[3] = (int32_t)((uint32_t)float_to_half_bits_rn(x2) | ((uint32_t)float_to_half_bits_rn(x3) << 16));
}

// ---------------------------------------------------------------------------
// CPU twin.  One unit of work = one token row (n, t) of the flattened [N * T] rows.
// ---------------------------------------------------------------------------

/// \brief Encode rows [row_begin, row_end): packed rows and (with a threshold) the outlier
/// mask/count scratch.  Records are written afterwards by hqmq_write_records_cpu.
template <typename DType>
void hqmq_encode_cpu(const HqmqParams& p, int64_t row_begin, int64_t row_end) {
  const DType* x = static_cast<const DType*>(p.x);
  const int C = (int)(p.D / 4), RB = p.radius_bits;
  const float maxq = (float)((1 << RB) - 1);
  int32_t status = 0;
  float xc[kMaxChunks][4], r[kMaxChunks];
  bool outl[kMaxChunks];
  uint32_t fields[kMaxChunks];
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t n = row / p.T, h = n % p.H;
    const float* sec = p.secondary + h * p.S * 4;
    const float thr = p.threshold ? p.threshold[h] : INFINITY;
    const DType* xr = x + row * p.D;
    float rmax = 0.f;
    uint64_t mask = 0;
    for (int c = 0; c < C; ++c) {
      for (int i = 0; i < 4; ++i) {
        xc[c][i] = to_float(xr[4 * c + i]);
        if (p.status) status |= value_status(xc[c][i]);
      }
      r[c] = chunk_norm(xc[c][0], xc[c][1], xc[c][2], xc[c][3]);
      outl[c] = p.threshold != nullptr && r[c] > thr;
      if (outl[c]) mask |= (uint64_t)1 << c;
      else rmax = fmaxf(rmax, r[c]);
    }
    const uint32_t scode = scale_code(rmax, p.row.scale_bits);
    const float step = div_rn(half_bits_to_float((uint16_t)(scode << (15 - p.row.scale_bits))), maxq);
    if (p.status && rmax > kMaxScale) status |= kStatusOutOfRange;
    for (int c = 0; c < C; ++c) {
      if (outl[c]) {
        fields[c] = 0u;
        continue;
      }
      float best = -1.f;
      int bs = 0;
      for (int64_t s = 0; s < p.S; ++s) {
        float v0, v1, v2, v3;
        mul_conj(xc[c][0], xc[c][1], xc[c][2], xc[c][3], sec[4 * s], sec[4 * s + 1],
                 sec[4 * s + 2], sec[4 * s + 3], v0, v1, v2, v3);
        const float sc = hurwitz_score(v0, v1, v2, v3);
        if (sc > best) {
          best = sc;
          bs = (int)s;
        }
      }
      float v0, v1, v2, v3;
      mul_conj(xc[c][0], xc[c][1], xc[c][2], xc[c][3], sec[4 * bs], sec[4 * bs + 1],
               sec[4 * bs + 2], sec[4 * bs + 3], v0, v1, v2, v3);
      const uint32_t dir = (uint32_t)(bs * kHurwitzUnits + hurwitz_nearest(v0, v1, v2, v3));
      fields[c] = (dir << RB) | radius_code(r[c], step, maxq);
    }
    uint16_t* units = reinterpret_cast<uint16_t*>(p.codes) + row * p.row.units;
    for (int j = 0; j < p.row.units; ++j) units[j] = assemble_unit(fields, p.row, scode, j);
    if (p.threshold) {
      p.flag_mask[row] = (int64_t)mask;
      int cnt = 0;
      for (uint64_t m = mask; m; m &= m - 1) ++cnt;
      p.flag_count[row] = cnt;
    }
  }
  if (p.status && status) __atomic_fetch_or(p.status, status, __ATOMIC_RELAXED);
}

/// \brief Write the outlier records of rows [row_begin, row_end) at p.offsets[row].
template <typename DType>
void hqmq_write_records_cpu(const HqmqParams& p, int64_t row_begin, int64_t row_end) {
  const DType* x = static_cast<const DType*>(p.x);
  for (int64_t row = row_begin; row < row_end; ++row) {
    uint64_t mask = (uint64_t)p.flag_mask[row];
    int64_t k = p.offsets[row];
    const int64_t n = row / p.T, t = row % p.T;
    for (int c = 0; c < 64 && mask; ++c) {
      if (!((mask >> c) & 1u)) continue;
      mask &= ~((uint64_t)1 << c);
      const DType* xc = x + row * p.D + 4 * c;
      make_record(t, n, c, to_float(xc[0]), to_float(xc[1]), to_float(xc[2]), to_float(xc[3]),
                  p.outliers + 4 * k);
      ++k;
    }
  }
}

/// \brief Decode one chunk from its field (host and device).
KVQ_HOST_DEVICE void decode_chunk(uint32_t field, int RB, float step, const float* sec, int64_t S,
                                  float (&o)[4]) {
  const uint32_t rcode = field & ((1u << RB) - 1u);
  const uint32_t dir = field >> RB;
  int64_t s = dir / kHurwitzUnits;
  const int pi = (int)(dir % kHurwitzUnits);
  if (s >= S) s = S - 1;  // only reachable with corrupt codes: stay in bounds
  float p0, p1, p2, p3, q0, q1, q2, q3;
  hurwitz_unit(pi, p0, p1, p2, p3);
  hamilton(p0, p1, p2, p3, sec[4 * s], sec[4 * s + 1], sec[4 * s + 2], sec[4 * s + 3], q0, q1, q2,
           q3);
  const float rq = mul_rn((float)rcode, step);
  o[0] = mul_rn(rq, q0);
  o[1] = mul_rn(rq, q1);
  o[2] = mul_rn(rq, q2);
  o[3] = mul_rn(rq, q3);
}

/// \brief Decode rows [row_begin, row_end) (dense part; records are applied afterwards).
template <typename DType>
void hqmq_decode_cpu(const HqmqParams& p, int64_t row_begin, int64_t row_end) {
  DType* out = static_cast<DType*>(p.out);
  const int C = (int)(p.D / 4);
  const float maxq = (float)((1 << p.radius_bits) - 1);
  for (int64_t row = row_begin; row < row_end; ++row) {
    const int64_t h = (row / p.T) % p.H;
    const float* sec = p.secondary + h * p.S * 4;
    const uint16_t* units = reinterpret_cast<const uint16_t*>(p.codes) + row * p.row.units;
    uint32_t fields[kMaxChunks];
    const float step = div_rn(half_bits_to_float((uint16_t)row_fields(units, p.row, p.D, fields)), maxq);
    for (int c = 0; c < C; ++c) {
      float o[4];
      decode_chunk(fields[c], p.radius_bits, step, sec, p.S, o);
      for (int i = 0; i < 4; ++i) out[row * p.D + 4 * c + i] = from_float<DType>(o[i]);
    }
  }
}

/// \brief Is record k in bounds for this call?
KVQ_HOST_DEVICE bool record_valid(const int32_t* rec, const HqmqParams& p) {
  const int64_t t = rec[0], n = (int64_t)((uint32_t)rec[1] >> 8), c = rec[1] & 0xff;
  return t >= 0 && t < p.T && n < p.N && c < p.D / 4;
}

/// \brief Overwrite outlier chunks [k_begin, k_end) of the records into p.out.
template <typename DType>
void hqmq_apply_records_cpu(const HqmqParams& p, int64_t k_begin, int64_t k_end) {
  DType* out = static_cast<DType*>(p.out);
  for (int64_t k = k_begin; k < k_end; ++k) {
    const int32_t* rec = p.outliers + 4 * k;
    if (!record_valid(rec, p)) continue;
    const int64_t t = rec[0], n = (int64_t)((uint32_t)rec[1] >> 8), c = rec[1] & 0xff;
    DType* o = out + (n * p.T + t) * p.D + 4 * c;
    const uint32_t a = (uint32_t)rec[2], b = (uint32_t)rec[3];
    o[0] = from_float<DType>(half_bits_to_float((uint16_t)(a & 0xffffu)));
    o[1] = from_float<DType>(half_bits_to_float((uint16_t)(a >> 16)));
    o[2] = from_float<DType>(half_bits_to_float((uint16_t)(b & 0xffffu)));
    o[3] = from_float<DType>(half_bits_to_float((uint16_t)(b >> 16)));
  }
}

}  // namespace hqmq
}  // namespace kvq
