// Scalar conversions between fp16/bf16 and fp32, portable and exact.
//
// These are the reference-correct paths; kernels may add vectorised variants
// (F16C, AVX-512) selected at run time, which must agree bit for bit.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxascend {

inline float BitsToFloat(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t FloatToBits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// IEEE binary16 -> binary32, exact for normals, subnormals, inf and NaN.
inline float HalfToFloat(uint16_t h) {
  const uint32_t shifted_exp = 0x7c00u << 13;  // exponent mask after shift
  uint32_t u = static_cast<uint32_t>(h & 0x7fffu) << 13;
  const uint32_t exp = u & shifted_exp;
  u += (127u - 15u) << 23;  // rebias exponent
  if (exp == shifted_exp) {
    u += (128u - 16u) << 23;  // inf/NaN: exponent all ones
  } else if (exp == 0) {
    u += 1u << 23;  // subnormal: renormalise through a float subtraction
    u = FloatToBits(BitsToFloat(u) - BitsToFloat(113u << 23));
  }
  u |= static_cast<uint32_t>(h & 0x8000u) << 16;
  return BitsToFloat(u);
}

// binary32 -> binary16, round to nearest even; overflow to inf, NaN kept quiet.
inline uint16_t FloatToHalf(float f) {
  uint32_t u = FloatToBits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  u &= 0x7fffffffu;
  if (u >= 0x7f800000u) {  // inf or NaN
    return static_cast<uint16_t>(sign | 0x7c00u | (u > 0x7f800000u ? 0x200u : 0u));
  }
  if (u >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf
  if (u < 0x38800000u) {  // result is subnormal or zero in half
    // Add 0.5f: the float adder does the rounding of the low bits for us.
    const float r = BitsToFloat(u) + 0.5f;
    return static_cast<uint16_t>(sign | (FloatToBits(r) - 0x3f000000u));
  }
  const uint32_t mant_odd = (u >> 13) & 1u;
  u += ((15u - 127u) << 23) + 0xfffu + mant_odd;  // rebias and round to nearest even
  return static_cast<uint16_t>(sign | (u >> 13));
}

inline float BFloat16ToFloat(uint16_t b) { return BitsToFloat(static_cast<uint32_t>(b) << 16); }

// binary32 -> bfloat16, round to nearest even; NaN stays NaN.
inline uint16_t FloatToBFloat16(float f) {
  uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace jaxascend
