// Bit-exact fp16 / bf16 <-> fp32 conversions usable on host and device, plus directed
// rounding to fp16.  Torch-free.  Host and device use the same integer code so that the
// CPU twin and the CUDA kernels store bit-identical scales and zero points.
#pragma once
#include <cstdint>
#include <cstring>

#include "kvq/common/macros.h"

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#endif

namespace kvq {

KVQ_HOST_DEVICE uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
#endif
}

KVQ_HOST_DEVICE float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, 4);
  return f;
#endif
}

/// \brief fp16 bits -> float (exact).
KVQ_HOST_DEVICE float half_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu;
  uint32_t man = h & 0x3ffu;
  if (exp == 0) {
    // zero or subnormal: value = man * 2^-24
    float v = (float)man * 5.9604644775390625e-8f;
    return (h & 0x8000u) ? -v : v;
  }
  if (exp == 31) return bits_as_float(sign | 0x7f800000u | (man << 13));
  return bits_as_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

/// \brief float -> fp16 bits, round to nearest even (IEEE), overflow to Inf.
KVQ_HOST_DEVICE uint16_t float_to_half_bits_rn(float f) {
  uint32_t x = float_as_bits(f);
  uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t ax = x & 0x7fffffffu;
  if (ax >= 0x7f800000u) return (uint16_t)(sign | 0x7c00u | (ax > 0x7f800000u ? 0x200u : 0u));
  if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u);  // rounds to >= 65520 -> Inf
  if (ax < 0x38800000u) {
    // result is subnormal (or zero) in fp16: value / 2^-24 rounded to nearest even
    if (ax < 0x33000000u) return (uint16_t)sign;  // < 2^-25: rounds to 0
    uint32_t e = ax >> 23;
    uint32_t m = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e;  // so that result = m >> (shift) ... (see below)
    // value = m * 2^(e-150); in units of 2^-24: m * 2^(e-126) = m >> (126-e)
    uint32_t q = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) q++;
    return (uint16_t)(sign | q);
  }
  uint32_t e = (ax >> 23) - 112u;
  uint32_t m = ax & 0x7fffffu;
  uint32_t q = (e << 10) | (m >> 13);
  uint32_t rem = m & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (q & 1u))) q++;
  return (uint16_t)(sign | q);
}

/// \brief Next fp16 value towards -Inf (input finite).
KVQ_HOST_DEVICE uint16_t half_bits_next_down(uint16_t h) {
  if (h == 0x0000u) return 0x8001u;
  if (h & 0x8000u) return (uint16_t)(h + 1u);
  return (uint16_t)(h - 1u);
}

/// \brief Next fp16 value towards +Inf (input finite).
KVQ_HOST_DEVICE uint16_t half_bits_next_up(uint16_t h) {
  if (h == 0x8000u) return 0x0001u;
  if (h & 0x8000u) return (uint16_t)(h - 1u);
  return (uint16_t)(h + 1u);
}

/// \brief Largest fp16 <= f (f finite, |f| <= 65504).
KVQ_HOST_DEVICE uint16_t float_to_half_bits_rd(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rd(f));
#endif
  uint16_t h = float_to_half_bits_rn(f);
  if (half_bits_to_float(h) > f) h = half_bits_next_down(h);
  return h;
}

/// \brief Smallest fp16 >= f (f finite, |f| <= 65504).
KVQ_HOST_DEVICE uint16_t float_to_half_bits_ru(float f) {
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_ru(f));
#endif
  uint16_t h = float_to_half_bits_rn(f);
  if (half_bits_to_float(h) < f) h = half_bits_next_up(h);
  return h;
}

/// \brief bf16 bits -> float (exact).
KVQ_HOST_DEVICE float bf16_bits_to_float(uint16_t b) { return bits_as_float((uint32_t)b << 16); }

/// \brief float -> bf16 bits, round to nearest even; NaN stays NaN.
KVQ_HOST_DEVICE uint16_t float_to_bf16_bits_rn(float f) {
  uint32_t x = float_as_bits(f);
  if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u);
  uint32_t lsb = (x >> 16) & 1u;
  x += 0x7fffu + lsb;
  return (uint16_t)(x >> 16);
}

/// Storage types for 16-bit floats (bit containers; conversions above).
struct half_t {
  uint16_t bits;
};
struct bf16_t {
  uint16_t bits;
};

/// \brief Load/store one element of storage type T as float.
template <typename T>
struct FloatIO;
template <>
struct FloatIO<float> {
  KVQ_HOST_DEVICE static float load(float v) { return v; }
  KVQ_HOST_DEVICE static float store(float v) { return v; }
};
template <>
struct FloatIO<half_t> {
  KVQ_HOST_DEVICE static float load(half_t v) {
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(v.bits));
#else
    return half_bits_to_float(v.bits);
#endif
  }
  KVQ_HOST_DEVICE static half_t store(float v) {
#if defined(__CUDA_ARCH__)
    return half_t{__half_as_ushort(__float2half_rn(v))};
#else
    return half_t{float_to_half_bits_rn(v)};
#endif
  }
};
template <>
struct FloatIO<bf16_t> {
  KVQ_HOST_DEVICE static float load(bf16_t v) { return bf16_bits_to_float(v.bits); }
  KVQ_HOST_DEVICE static bf16_t store(float v) {
#if defined(__CUDA_ARCH__)
    return bf16_t{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
#else
    return bf16_t{float_to_bf16_bits_rn(v)};
#endif
  }
};

template <typename T>
KVQ_HOST_DEVICE float to_float(T v) {
  return FloatIO<T>::load(v);
}
template <typename T>
KVQ_HOST_DEVICE T from_float(float v) {
  return FloatIO<T>::store(v);
}

}  // namespace kvq
