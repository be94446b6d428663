// Asymmetric min/max group quantization with bit packing: the block format, the
// arithmetic shared by host and device, and the CPU twin of the CUDA kernels.
// Torch-free.
//
// Packed layout ("token-major, LSB-first"), identical for keys and values:
//   codes  int32 [N, T, D * BITS / 32]   word w of token t holds channels
//          [w * CPW, (w + 1) * CPW) with CPW = 32 / BITS codes per word; channel c sits
//          at bits [(c % CPW) * BITS, (c % CPW + 1) * BITS).  A 16-byte load therefore
//          covers 64 (2-bit), 32 (4-bit) or 16 (8-bit) consecutive channels of one token,
//          which is what the fused decode-attention kernels read.
//   scale, zero  fp16 bits
//          per-channel (keys):  [N, T / G, D]  one pair per G consecutive tokens of a channel
//          per-token (values):  [N, T, D / G]  one pair per G consecutive channels of a token
//   dequantized x' = code * scale + zero   (fp32 arithmetic)
//
// Scale and zero are rounded to fp16 *before* the codes are computed (zero rounded down,
// scale rounded up), so the stored pair always covers the group and |x - x'| <= scale / 2.
#pragma once
#include <cmath>
#include <cstdint>

#include "kvq/common/half.h"
#include "kvq/common/macros.h"

namespace kvq {
namespace quant {

/// \brief Largest finite magnitude accepted (fp16 max), so scale/zero stay representable.
constexpr float kMaxAbs = 65504.0f;

/// \brief Parameters of one group-quantize (or dequantize) call.
struct GroupQuantParams {
  const void* x;        // [N, T, D] input (quantize) -- contiguous, 16-byte aligned
  void* out;            // [N, T, D] output (dequantize)
  int32_t* codes;       // [N, T, D * bits / 32]
  uint16_t* scale;      // fp16 bits; [N, T / G, D] per-channel, [N, T, D / G] per-token
  uint16_t* zero;       // same shape as scale
  int32_t* status;      // optional [1] flag, OR of StatusFlag (nullptr: no finite check)
  float* ws = nullptr;  // CUDA per-channel split-T path: group_quantize_ws_floats() floats
                        // (nullptr: that path falls back to one block per group)
  int64_t N = 0;        // batch * heads (flattened leading dims)
  int64_t T = 0;        // tokens
  int64_t D = 0;        // channels (head dim)
  int64_t group = 0;    // G, resolved (whole axis already replaced by T or D)
  int bits = 0;         // 2, 4 or 8
  bool per_channel = false;
};

/// \brief Quantization parameters of one group, computed identically on host and device.
struct QParams {
  float scale;  // fp16-rounded scale, as float
  float zero;   // fp16-rounded zero point, as float
  float inv;    // 1 / scale, or 0 for a constant group
  uint16_t s16;
  uint16_t z16;
};

KVQ_HOST_DEVICE QParams make_qparams(float mn, float mx, int bits) {
  QParams p;
  // -0 -> +0: which signed zero a min/max reduction returns depends on the order of its
  // operands (fminf(-0, +0) may return either), so a group whose minimum is zero must not
  // carry that sign into the stored zero point (same value either way; bit-identical CPU and
  // CUDA outputs whatever order each reduces in)
  mn = mn + 0.f;
  p.z16 = float_to_half_bits_rd(mn);
  p.zero = half_bits_to_float(p.z16);
  // NOTE: multiply by the fp32 constant 1/(2^bits - 1) rather than divide: identical on host
  // and device, and cheaper than an IEEE division in the per-token kernel.
  const float inv_maxq = bits == 2 ? 1.f / 3.f : bits == 4 ? 1.f / 15.f : 1.f / 255.f;
  float s = (mx - p.zero) * inv_maxq;
  p.s16 = float_to_half_bits_ru(s > 0.f ? s : 0.f);
  p.scale = half_bits_to_float(p.s16);
  p.inv = p.scale > 0.f ? 1.0f / p.scale : 0.f;
  return p;
}

/// \brief Code of one value: clamp(round((x - zero) / scale), 0, 2^bits - 1).
KVQ_HOST_DEVICE uint32_t quant_code(float x, float zero, float inv, float maxq) {
  float q = (x - zero) * inv;
  q = fminf(fmaxf(q, 0.f), maxq);  // NaN -> 0 (only possible with the check disabled)
#if defined(__CUDA_ARCH__)
  return (uint32_t)__float2int_rn(q);
#else
  return (uint32_t)std::nearbyint(q);
#endif
}

/// \brief Nonzero StatusFlag bits for a value that cannot be quantized safely.
KVQ_HOST_DEVICE int32_t value_status(float x) {
  if (fabsf(x) <= kMaxAbs) return kStatusOk;
  return (x != x || fabsf(x) == INFINITY) ? kStatusNonFinite : kStatusOutOfRange;
}

/// \brief Words per packed token row.
KVQ_HOST_DEVICE int64_t words_per_row(int64_t D, int bits) { return D * bits / 32; }

// ---------------------------------------------------------------------------
// CPU twin.  Work is split in "units" so the caller can parallelise over them:
//   per-channel: one unit = one group of G tokens of one [T, D] matrix
//   per-token:   one unit = one token row
// ---------------------------------------------------------------------------

inline int64_t group_quant_cpu_units(const GroupQuantParams& p) {
  return p.per_channel ? (p.group > 0 ? p.N * (p.T / p.group) : 0) : p.N * p.T;
}

/// \brief Input bytes one unit of group_quantize_cpu reads (`elem_bytes` per element).
inline int64_t group_quant_cpu_unit_bytes(const GroupQuantParams& p, int64_t elem_bytes) {
  return (p.per_channel ? p.group : 1) * p.D * elem_bytes;
}

/// \brief Pack `D` codes of one row (LSB-first within 32-bit words).
inline void pack_row(const uint32_t* code, int64_t D, int bits, int32_t* words) {
  const int cpw = 32 / bits;
  for (int64_t w = 0; w < D / cpw; ++w) {
    uint32_t v = 0;
    for (int j = 0; j < cpw; ++j) v |= code[w * cpw + j] << (j * bits);
    words[w] = (int32_t)v;
  }
}

template <typename DType>
void group_quantize_cpu(const GroupQuantParams& p, int64_t unit_begin, int64_t unit_end) {
  const DType* x = static_cast<const DType*>(p.x);
  const int64_t D = p.D, G = p.group, W = words_per_row(D, p.bits);
  const float maxq = (float)((1 << p.bits) - 1);
  int32_t status = 0;
  uint32_t code[512];
  if (p.per_channel) {
    const int64_t ngroups = p.T / G;
    QParams qp[512];
    for (int64_t u = unit_begin; u < unit_end; ++u) {
      const int64_t n = u / ngroups, g = u % ngroups;
      const DType* xg = x + (n * p.T + g * G) * D;
      for (int64_t c = 0; c < D; ++c) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t t = 0; t < G; ++t) {
          float v = to_float(xg[t * D + c]);
          if (p.status) status |= value_status(v);
          mn = fminf(mn, v);
          mx = fmaxf(mx, v);
        }
        qp[c] = make_qparams(mn, mx, p.bits);
        p.scale[(n * ngroups + g) * D + c] = qp[c].s16;
        p.zero[(n * ngroups + g) * D + c] = qp[c].z16;
      }
      for (int64_t t = 0; t < G; ++t) {
        for (int64_t c = 0; c < D; ++c)
          code[c] = quant_code(to_float(xg[t * D + c]), qp[c].zero, qp[c].inv, maxq);
        pack_row(code, D, p.bits, p.codes + (n * p.T + g * G + t) * W);
      }
    }
  } else {
    const int64_t ngroups = D / G;
    for (int64_t r = unit_begin; r < unit_end; ++r) {
      const DType* xr = x + r * D;
      for (int64_t g = 0; g < ngroups; ++g) {
        float mn = INFINITY, mx = -INFINITY;
        for (int64_t c = g * G; c < (g + 1) * G; ++c) {
          float v = to_float(xr[c]);
          if (p.status) status |= value_status(v);
          mn = fminf(mn, v);
          mx = fmaxf(mx, v);
        }
        QParams q = make_qparams(mn, mx, p.bits);
        p.scale[r * ngroups + g] = q.s16;
        p.zero[r * ngroups + g] = q.z16;
        for (int64_t c = g * G; c < (g + 1) * G; ++c)
          code[c] = quant_code(to_float(xr[c]), q.zero, q.inv, maxq);
      }
      pack_row(code, D, p.bits, p.codes + r * W);
    }
  }
  if (p.status && status) __atomic_fetch_or(p.status, status, __ATOMIC_RELAXED);
}

/// \brief Dequantize token rows [row_begin, row_end) of the flattened [N * T] rows.
template <typename DType>
void group_dequantize_cpu(const GroupQuantParams& p, int64_t row_begin, int64_t row_end) {
  DType* out = static_cast<DType*>(p.out);
  const int64_t D = p.D, G = p.group, W = words_per_row(D, p.bits);
  const int cpw = 32 / p.bits;
  const uint32_t mask = (1u << p.bits) - 1u;
  for (int64_t r = row_begin; r < row_end; ++r) {
    const int64_t n = r / p.T, t = r % p.T;
    const uint32_t* words = reinterpret_cast<const uint32_t*>(p.codes) + r * W;
    for (int64_t c = 0; c < D; ++c) {
      const int64_t si = p.per_channel ? (n * (p.T / G) + t / G) * D + c : r * (D / G) + c / G;
      const float s = half_bits_to_float(p.scale[si]);
      const float z = half_bits_to_float(p.zero[si]);
      const uint32_t q = (words[c / cpw] >> ((c % cpw) * p.bits)) & mask;
      out[r * D + c] = from_float<DType>((float)q * s + z);
    }
  }
}

}  // namespace quant
}  // namespace kvq
