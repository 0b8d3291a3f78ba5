// The scalar path of the fused AdamW kernel (optim_adam.h): the reference every vector variant
// must match bit for bit, and the element helpers the variants share with it (loads and stores
// in every element type, the stochastic rounding hash, the 8-bit codes, the bf16 master's
// rounding). Inline, so that the variants (optim_adam_avx2.cc, optim_adam_avx512.cc) run their
// tails and their int8 blocks with the same operations; optim_adam_kernel.h says what else they
// share.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "dtypes.h"
#include "optim_adam.h"
#include "optim_adam_kernel.h"

namespace jaxascend {
namespace adam_kernel {

// ---------------------------------------------------------------------------------------------
// Scalar path: the reference every vector variant must match bit for bit.

// fp32 -> fp16 as F16C's vcvtps2ph does it: dtypes.h rounding for numbers, and a NaN keeps the
// top ten bits of its payload with the quiet bit set.
inline uint16_t FloatToHalfLikeF16c(float f) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7e00u | ((u >> 13) & 0x3ffu));
  }
  return FloatToHalf(f);
}

template <AdamElem E>
inline float LoadElement(const void* p, int64_t i) {
  if constexpr (E == AdamElem::kF32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (E == AdamElem::kF16) {
    return HalfToFloat(static_cast<const uint16_t*>(p)[i]);
  } else {
    return BFloat16ToFloat(static_cast<const uint16_t*>(p)[i]);
  }
}

template <AdamElem E>
inline void StoreElement(void* p, int64_t i, float x) {
  if constexpr (E == AdamElem::kF32) {
    static_cast<float*>(p)[i] = x;
  } else if constexpr (E == AdamElem::kF16) {
    static_cast<uint16_t*>(p)[i] = FloatToHalfLikeF16c(x);
  } else {
    static_cast<uint16_t*>(p)[i] = FloatToBFloat16(x);
  }
}

// Stochastic rounding's random bits (optim_adam.h): Chris Wellons' lowbias32 of the element's
// index and the seed; v takes its top 16 bits, int8 m its low 16.
constexpr uint32_t kGolden = 0x9e3779b1u;

inline uint32_t Lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21f0aaadu;
  x ^= x >> 15;
  x *= 0x735a2d97u;
  return x ^ (x >> 15);
}

inline uint32_t RoundingHash(const AdamBuffers& b, int64_t i) {
  return Lowbias32(static_cast<uint32_t>(b.rounding_index + i) * kGolden + b.rounding_seed);
}

// A bfloat16 master's 16 random bits: the top half of a hash of its own (salted seed).
inline uint32_t MasterRoundingBits(const AdamBuffers& b, int64_t i) {
  return Lowbias32(static_cast<uint32_t>(b.rounding_index + i) * kGolden + (b.rounding_seed ^ kAdamMasterSalt)) >> 16;
}

// fp32 -> bf16 rounded up with the probability of the dropped half: (u + bits) >> 16; NaN as
// FloatToBFloat16 has it.
inline uint16_t FloatToBFloat16Stochastic(float f, uint32_t bits) {
  const uint32_t u = FloatToBits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + bits) >> 16);
}

// Stores the new v of element i in S, rounded as b.rounding says.
template <AdamElem S>
inline void StoreV(const AdamBuffers& b, int64_t i, float v) {
  if constexpr (S == AdamElem::kBF16) {
    if (b.rounding == AdamRounding::kStochastic) {
      static_cast<uint16_t*>(b.v_out)[i] = FloatToBFloat16Stochastic(v, RoundingHash(b, i) >> 16);
      return;
    }
  }
  StoreElement<S>(b.v_out, i, v);
}

// A compensated master's float32 value: its bits plus the companion as a signed 16-bit offset.
inline float JoinMaster(uint16_t master, uint16_t comp) {
  return BitsToFloat((static_cast<uint32_t>(master) << 16) + static_cast<uint32_t>(static_cast<int16_t>(comp)));
}

// The float32 bits a compensated master holds for y: y's own, but for a tie that rounds down
// (low half 0x8000 on an even high half), held one ulp toward zero (low half 0x7fff), so that
// the high half rounded ties away from zero is y to nearest, ties to even, and the low half read
// as a signed offset is exact (a tie rounding down needs +0x8000, which int16 lacks).
inline uint32_t SplitMasterBits(float y) {
  const uint32_t u = FloatToBits(y);
  return u - static_cast<uint32_t>((u & 0x1ffffu) == 0x8000u);
}

// The bf16 half of a compensated master from SplitMasterBits' u: y to nearest, ties to even (the
// companion is u's low 16 bits); NaN as FloatToBFloat16 has it.
inline uint16_t SplitMasterHigh(uint32_t u) {
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  return static_cast<uint16_t>((u + 0x8000u) >> 16);
}

// Element i of the master as float32: widened, or joined with its companion.
template <AdamMaster M>
inline float LoadMaster(const AdamBuffers& b, int64_t i) {
  if constexpr (M == AdamMaster::kF32) {
    return b.master_in[i];
  } else if constexpr (M == AdamMaster::kBF16Stochastic) {
    return BFloat16ToFloat(b.master16_in[i]);
  } else {
    return JoinMaster(b.master16_in[i], b.comp_in[i]);
  }
}

// Applies update u to element i's master x (LoadMaster's) and stores the new master, its
// companion (kBF16Compensated) and the params, as the top of optim_adam.h says.
template <AdamMaster M, AdamElem P>
inline void StoreMaster(const AdamBuffers& b, const AdamScalars& s, int64_t i, float x, float u) {
  const float new_master = x - s.lr * u;
  if constexpr (M == AdamMaster::kF32) {
    b.master_out[i] = new_master;
    StoreElement<P>(b.params_out, i, new_master);
  } else {
    uint16_t bits;
    if constexpr (M == AdamMaster::kBF16Stochastic) {
      bits = FloatToBFloat16Stochastic(new_master, MasterRoundingBits(b, i));
    } else {
      const uint32_t u = SplitMasterBits(new_master);
      bits = SplitMasterHigh(u);
      b.comp_out[i] = static_cast<uint16_t>(u);
    }
    b.master16_out[i] = bits;
    static_cast<uint16_t*>(b.params_out)[i] = bits;
  }
}

// One element of the update, given the old moments widened to float; returns the new ones.
template <AdamElem G, AdamElem P, AdamMaster M>
inline void AdamElement(const AdamBuffers& b, const AdamScalars& s, float inv_bc1, float inv_bc2,
                        int64_t i, float m_old, float v_old, float* m, float* v) {
  const float g = LoadElement<G>(b.grad, i) * s.grad_scale;
  const float master = LoadMaster<M>(b, i);
  *m = s.one_minus_b1 * g + s.b1 * m_old;
  *v = s.one_minus_b2 * (g * g) + s.b2 * v_old;
  const float denom = std::sqrt(*v * inv_bc2) + s.eps;
  const float update = (*m * inv_bc1) / denom + s.weight_decay * master;
  StoreMaster<M, P>(b, s, i, master, update);
}

// S: the element type of m and v (kF32, or kBF16 for AdamState::kBF16); M: the master's format.
template <AdamElem G, AdamElem P, AdamElem S, AdamMaster M>
void AdamRangeScalar(const AdamBuffers& b, const AdamScalars& s, int64_t begin, int64_t end) {
  const float inv_bc1 = 1.0f / s.bias_correction1;
  const float inv_bc2 = 1.0f / s.bias_correction2;
  for (int64_t i = begin; i < end; ++i) {
    float m, v;
    AdamElement<G, P, M>(b, s, inv_bc1, inv_bc2, i, LoadElement<S>(b.m_in, i), LoadElement<S>(b.v_in, i),
                         &m, &v);
    StoreElement<S>(b.m_out, i, m);
    StoreV<S>(b, i, v);
  }
}

// ---------------------------------------------------------------------------------------------
// 8-bit codes (AdamState::kInt8), scalar; state_codes.py is the numpy reference. A code of r in
// [0, 1) with M mantissa bits and 4 exponent bits: subnormal (r < 2**-15) round(r * 2**(15+M)),
// taken from the float adder (magic = 2**(8-M) has that ulp); else the float's bits rounded to
// M mantissa bits, ties to even, rebiased, saturated.
constexpr uint32_t kCodeBias = 111;  // code exponent 15 <-> float exponent field 126
constexpr uint32_t kSubnormalLimitBits = 112u << 23;  // 2**-15
constexpr int kMBits = 3;  // m: sign + E4M3
constexpr int kWBits = 4;  // w = sqrt(v): E4M4

template <int M>
inline uint32_t EncodeCode(float r) {
  const uint32_t u = FloatToBits(r);
  if (u < kSubnormalLimitBits) {
    const float magic = BitsToFloat(static_cast<uint32_t>(127 + 8 - M) << 23);
    return FloatToBits(r + magic) - FloatToBits(magic);
  }
  constexpr int shift = 23 - M;
  const uint32_t lsb = (u >> shift) & 1u;
  const int32_t code =
      static_cast<int32_t>((u + ((1u << (shift - 1)) - 1u) + lsb) >> shift) - static_cast<int32_t>(kCodeBias << M);
  constexpr int32_t largest = (1 << (4 + M)) - 1;
  return static_cast<uint32_t>(code < largest ? code : largest);
}

// The code of r rounded stochastically with 16 random bits: added below the kept bits (a normal
// r) or to the code in 16.16 fixed point (a subnormal one, exact there), then truncated.
template <int M>
inline uint32_t EncodeCodeStochastic(float r, uint32_t bits) {
  const uint32_t u = FloatToBits(r);
  if (u < kSubnormalLimitBits) {
    const int32_t fixed = static_cast<int32_t>(r * BitsToFloat(static_cast<uint32_t>(127 + 31 + M) << 23));
    return static_cast<uint32_t>((fixed + static_cast<int32_t>(bits)) >> 16);
  }
  constexpr int shift = 23 - M;
  const int32_t code = static_cast<int32_t>((u + (bits << (shift - 16))) >> shift) -
                       static_cast<int32_t>(kCodeBias << M);
  constexpr int32_t largest = (1 << (4 + M)) - 1;
  return static_cast<uint32_t>(code < largest ? code : largest);
}

template <int M>
inline float DecodeCode(uint32_t c) {
  if (c < (1u << M)) return static_cast<float>(static_cast<int32_t>(c)) * BitsToFloat(static_cast<uint32_t>(127 - 15 - M) << 23);
  return BitsToFloat((c + (kCodeBias << M)) << (23 - M));
}

// The power of two just above a block's largest magnitude (bits `maximum`) and its inverse;
// 0 and 0 for a block of zeros.
inline void BlockScale(uint32_t maximum, float* scale, float* inverse) {
  if (maximum == 0) {
    *scale = 0.0f;
    *inverse = 0.0f;
    return;
  }
  uint32_t field = (maximum >> 23) + 1;
  field = field < 1 ? 1 : (field > 253 ? 253 : field);
  *scale = BitsToFloat(field << 23);
  *inverse = BitsToFloat((254u - field) << 23);
}

inline float DecodeM(uint8_t c, float scale) {
  const float r = DecodeCode<kMBits>(c & 0x7fu) * scale;
  return (c & 0x80u) ? -r : r;
}

// `hash`: the element's RoundingHash when b.rounding is kStochastic (m takes the low 16 bits,
// w the high 16), unused otherwise.
inline uint8_t EncodeM(const AdamBuffers& b, uint32_t hash, float m, float inverse) {
  const uint32_t u = FloatToBits(m);
  const float r = BitsToFloat(u & 0x7fffffffu) * inverse;
  const uint32_t code = b.rounding == AdamRounding::kStochastic ? EncodeCodeStochastic<kMBits>(r, hash & 0xffffu)
                                                                : EncodeCode<kMBits>(r);
  return static_cast<uint8_t>(code | ((u >> 24) & 0x80u));
}

inline float DecodeW(uint8_t c, float scale) { return DecodeCode<kWBits>(c) * scale; }

inline uint8_t EncodeW(const AdamBuffers& b, uint32_t hash, float w, float inverse) {
  const float r = BitsToFloat(FloatToBits(w) & 0x7fffffffu) * inverse;
  if (b.rounding == AdamRounding::kStochastic) {
    return static_cast<uint8_t>(EncodeCodeStochastic<kWBits>(r, hash >> 16));
  }
  return static_cast<uint8_t>(EncodeCode<kWBits>(r));
}

// One kInt8 element's update: writes master and params, returns the new m and w = sqrt(v).
template <AdamElem G, AdamElem P, AdamMaster M>
inline void Int8Element(const AdamBuffers& b, const AdamScalars& s, float inv_bc1, float inv_bc2, int64_t i,
                        float m_scale, float w_scale, float* m, float* w) {
  const float m_old = DecodeM(static_cast<const uint8_t*>(b.m_in)[i], m_scale);
  const float w_old = DecodeW(static_cast<const uint8_t*>(b.v_in)[i], w_scale);
  float v;
  AdamElement<G, P, M>(b, s, inv_bc1, inv_bc2, i, m_old, w_old * w_old, m, &v);
  *w = std::sqrt(v);
}

// Ends a block: its new scales from the magnitudes' maxima, then the codes of n elements from
// the scratch (a vector variant passes the first element it has not encoded itself).
inline void EncodeBlockTail(const AdamBuffers& b, int64_t start, int64_t from, int64_t n, const float* m_new,
                            const float* w_new, float m_inverse, float w_inverse) {
  auto* mq = static_cast<uint8_t*>(b.m_out);
  auto* vq = static_cast<uint8_t*>(b.v_out);
  for (int64_t j = from; j < n; ++j) {
    const uint32_t hash = b.rounding == AdamRounding::kStochastic ? RoundingHash(b, start + j) : 0;
    mq[start + j] = EncodeM(b, hash, m_new[j], m_inverse);
    vq[start + j] = EncodeW(b, hash, w_new[j], w_inverse);
  }
}

inline uint32_t Magnitude(float x) { return FloatToBits(x) & 0x7fffffffu; }

template <AdamElem G, AdamElem P, AdamMaster M>
void AdamRangeInt8Scalar(const AdamBuffers& b, const AdamScalars& s, int64_t begin, int64_t end) {
  const float inv_bc1 = 1.0f / s.bias_correction1;
  const float inv_bc2 = 1.0f / s.bias_correction2;
  alignas(64) float m_new[kAdamMaxBlock];
  alignas(64) float w_new[kAdamMaxBlock];
  for (int64_t start = begin; start < end; start += b.block) {
    const int64_t n = std::min(b.block, end - start);
    const int64_t k = start / b.block;
    uint32_t m_max = 0, w_max = 0;
    for (int64_t j = 0; j < n; ++j) {
      Int8Element<G, P, M>(b, s, inv_bc1, inv_bc2, start + j, b.m_scale[k], b.v_scale[k], &m_new[j], &w_new[j]);
      m_max = std::max(m_max, Magnitude(m_new[j]));
      w_max = std::max(w_max, Magnitude(w_new[j]));
    }
    float m_inverse, w_inverse;
    BlockScale(m_max, &b.m_scale[k], &m_inverse);
    BlockScale(w_max, &b.v_scale[k], &w_inverse);
    EncodeBlockTail(b, start, 0, n, m_new, w_new, m_inverse, w_inverse);
  }
}

}  // namespace adam_kernel
}  // namespace jaxascend
