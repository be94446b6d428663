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
// Packed layout, per (row n = flattened leading index, token t):
//   codes  int32 [N, T, W],  W = ceil(C * F / 32),  C = D / 4 chunks,
//          F = DB + RB bits per chunk, DB = ceil(log2(24 S)), RB = radius_bits.
//          Chunk c's field sits at bits [c F, (c + 1) F) of the row's little-endian
//          bitstream of 32-bit words (a field spans at most two words):
//          field = dir << RB | rcode.
//   scale  fp16 bits [N, T]  = largest radius of the row's non-outlier chunks, rounded up.
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
constexpr float kMaxAbs = 65504.0f;  // fp16 max: scales and outlier values must fit

/// \brief Parameters of one HQMQ encode or decode call.
struct HqmqParams {
  const void* x = nullptr;            // [N, T, D] input (encode), contiguous, 16-byte aligned
  void* out = nullptr;                // [N, T, D] output (decode)
  const float* secondary = nullptr;   // [H, S, 4] unit quaternions
  int32_t* codes = nullptr;           // [N, T, W]
  uint16_t* scale = nullptr;          // [N, T] fp16 bits
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
  int dir_bits = 0;                   // DB = ceil(log2(24 S))
  int field_bits = 0;                 // F = DB + RB
  int words = 0;                      // W = ceil(C F / 32)
};

/// \brief DB = ceil(log2(24 S)).
KVQ_HOST_DEVICE int hqmq_dir_bits(int64_t S) {
  int b = 0;
  while (((int64_t)1 << b) < kHurwitzUnits * S) ++b;
  return b;
}

/// \brief Words per packed row.
KVQ_HOST_DEVICE int hqmq_words(int64_t D, int64_t S, int radius_bits) {
  const int64_t F = hqmq_dir_bits(S) + radius_bits;
  return (int)((D / 4 * F + 31) / 32);
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

/// \brief Read chunk c's field from a packed row.
KVQ_HOST_DEVICE uint32_t read_field(const uint32_t* row, int c, int F) {
  const int bit = c * F, w = bit >> 5, o = bit & 31;
  uint64_t v = row[w] >> o;
  if (o + F > 32) v |= (uint64_t)row[w + 1] << (32 - o);
  return (uint32_t)v & ((1u << F) - 1u);
}

/// \brief Word j of a packed row from the row's C fields.
KVQ_HOST_DEVICE uint32_t assemble_word(const uint32_t* fields, int C, int F, int j) {
  const int lo = 32 * j;
  int c0 = lo / F, c1 = (lo + 31) / F;
  if (c1 > C - 1) c1 = C - 1;
  uint32_t w = 0;
  for (int c = c0; c <= c1; ++c) {
    const int o = c * F - lo;
    const uint64_t f = fields[c];
    w |= (o >= 0) ? (uint32_t)(f << o) : (uint32_t)(f >> (-o));
  }
  return w;
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

/// \brief Encode rows [row_begin, row_end): codes, scale, and (with a threshold) the
/// outlier mask/count scratch.  Records are written afterwards by hqmq_write_records_cpu.
template <typename DType>
void hqmq_encode_cpu(const HqmqParams& p, int64_t row_begin, int64_t row_end) {
  const DType* x = static_cast<const DType*>(p.x);
  const int C = (int)(p.D / 4), F = p.field_bits, RB = p.radius_bits;
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
    const uint16_t s16 = float_to_half_bits_ru(rmax);
    const float step = div_rn(half_bits_to_float(s16), maxq);
    if (p.status && rmax > kMaxAbs) status |= kStatusOutOfRange;
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
    p.scale[row] = s16;
    uint32_t* words = reinterpret_cast<uint32_t*>(p.codes) + row * p.words;
    for (int j = 0; j < p.words; ++j) words[j] = assemble_word(fields, C, F, j);
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
    const float step = div_rn(half_bits_to_float(p.scale[row]), maxq);
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codes) + row * p.words;
    for (int c = 0; c < C; ++c) {
      float o[4];
      decode_chunk(read_field(words, c, p.field_bits), p.radius_bits, step, sec, p.S, o);
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
