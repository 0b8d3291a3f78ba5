// Fused host AdamW kernel (see optim_adam.h): the scalar, AVX2 and AVX-512 variants, run-time ISA
// selection, and RunFusedAdamW. The FFI target and the nanobind entry live in
// optim_adam_bindings.cc; both call RunFusedAdamW.
//
// Bitwise agreement between variants rests on three things: every variant performs the same
// IEEE operations in the same order; no multiply-add is contracted into an FMA (the pragmas
// below; GCC contracts by default and target("avx512f") implies FMA); and each range runs
// under the default floating-point environment (round to nearest even, no flush-to-zero),
// whatever the calling thread had set.
#include "optim_adam.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>

#include "optim_compute_pool.h"
#include "dtypes.h"

// -DJAXASCEND_ADAM_PORTABLE_ONLY builds only the scalar path (as on non-x86 targets).
#if (defined(__x86_64__) || defined(__i386__)) && !defined(JAXASCEND_ADAM_PORTABLE_ONLY)
#define JAXASCEND_ADAM_X86 1
#include <immintrin.h>
// GCC 12 reports _mm512_undefined_ps() inside its own AVX-512 headers as maybe-uninitialized
// once inlined (GCC bug 105593); the value is a don't-care operand by design.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#else
#define JAXASCEND_ADAM_X86 0
#endif

#if defined(__clang__)
#pragma clang fp contract(off)
#elif defined(__GNUC__)
#pragma GCC optimize("fp-contract=off")
#endif

namespace jaxascend {
namespace {

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

// One element of the update, given the old moments widened to float; returns the new ones.
template <AdamElem G, AdamElem P>
inline void AdamElement(const AdamBuffers& b, const AdamScalars& s, float inv_bc1, float inv_bc2,
                        int64_t i, float m_old, float v_old, float* m, float* v) {
  const float g = LoadElement<G>(b.grad, i) * s.grad_scale;
  const float master = b.master_in[i];
  *m = s.one_minus_b1 * g + s.b1 * m_old;
  *v = s.one_minus_b2 * (g * g) + s.b2 * v_old;
  const float denom = std::sqrt(*v * inv_bc2) + s.eps;
  const float update = (*m * inv_bc1) / denom + s.weight_decay * master;
  const float new_master = master - s.lr * update;
  b.master_out[i] = new_master;
  StoreElement<P>(b.params_out, i, new_master);
}

// S: the element type of m and v (kF32, or kBF16 for AdamState::kBF16).
template <AdamElem G, AdamElem P, AdamElem S>
void AdamRangeScalar(const AdamBuffers& b, const AdamScalars& s, int64_t begin, int64_t end) {
  const float inv_bc1 = 1.0f / s.bias_correction1;
  const float inv_bc2 = 1.0f / s.bias_correction2;
  for (int64_t i = begin; i < end; ++i) {
    float m, v;
    AdamElement<G, P>(b, s, inv_bc1, inv_bc2, i, LoadElement<S>(b.m_in, i), LoadElement<S>(b.v_in, i),
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
template <AdamElem G, AdamElem P>
inline void Int8Element(const AdamBuffers& b, const AdamScalars& s, float inv_bc1, float inv_bc2, int64_t i,
                        float m_scale, float w_scale, float* m, float* w) {
  const float m_old = DecodeM(static_cast<const uint8_t*>(b.m_in)[i], m_scale);
  const float w_old = DecodeW(static_cast<const uint8_t*>(b.v_in)[i], w_scale);
  float v;
  AdamElement<G, P>(b, s, inv_bc1, inv_bc2, i, m_old, w_old * w_old, m, &v);
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

template <AdamElem G, AdamElem P>
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
      Int8Element<G, P>(b, s, inv_bc1, inv_bc2, start + j, b.m_scale[k], b.v_scale[k], &m_new[j], &w_new[j]);
      m_max = std::max(m_max, Magnitude(m_new[j]));
      w_max = std::max(w_max, Magnitude(w_new[j]));
    }
    float m_inverse, w_inverse;
    BlockScale(m_max, &b.m_scale[k], &m_inverse);
    BlockScale(w_max, &b.v_scale[k], &w_inverse);
    EncodeBlockTail(b, start, 0, n, m_new, w_new, m_inverse, w_inverse);
  }
}

#if JAXASCEND_ADAM_X86
// ---------------------------------------------------------------------------------------------
// AVX2 + F16C: 8 lanes. FMA is deliberately not requested (see the top of the file).
#define JAXASCEND_TARGET_AVX2 __attribute__((target("avx2,f16c")))

// Software prefetch this many elements ahead of the loop. The hardware prefetchers follow the
// streams too, but the loop's long sqrt/div chains keep few iterations in flight, and asking
// early measured 5-10% faster on one thread (16M elements, fp16 gradients, AVX-512; runs on
// a shared 2-core machine, so the figure is rough).
constexpr int64_t kPrefetchAhead = 256;

// Prefetches the line holding element i + kPrefetchAhead of `base` (elements of `size`
// bytes). Prefetches never fault, so running past the end of a buffer is harmless; the
// address is formed as an integer so no out-of-bounds pointer is created.
inline void PrefetchAhead(const void* base, int64_t i, int64_t size) {
  const uintptr_t address = reinterpret_cast<uintptr_t>(base) + (i + kPrefetchAhead) * size;
  _mm_prefetch(reinterpret_cast<const char*>(address), _MM_HINT_T0);
}

template <AdamElem G, AdamElem S>
inline void PrefetchInputs(const AdamBuffers& b, int64_t i) {
  PrefetchAhead(b.master_in, i, 4);
  PrefetchAhead(b.m_in, i, S == AdamElem::kF32 ? 4 : 2);
  PrefetchAhead(b.v_in, i, S == AdamElem::kF32 ? 4 : 2);
  PrefetchAhead(b.grad, i, G == AdamElem::kF32 ? 4 : 2);
}

template <AdamElem E>
JAXASCEND_TARGET_AVX2 inline __m256 Load8(const void* p, int64_t i) {
  if constexpr (E == AdamElem::kF32) {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m128i h = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (E == AdamElem::kF16) {
      return _mm256_cvtph_ps(h);
    } else {
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
  }
}

// bf16 bits (each lane's high half of `rounded`) of x, a NaN keeping its top bits, quieted;
// the 8 halves packed in order.
JAXASCEND_TARGET_AVX2 inline __m128i PackBf16x8(__m256 x, __m256i rounded) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  // Values are < 2**16, so the saturating pack is exact; it interleaves 128-bit lanes, which
  // the permute undoes.
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

template <AdamElem E>
JAXASCEND_TARGET_AVX2 inline void Store8(void* p, int64_t i, __m256 x) {
  if constexpr (E == AdamElem::kF32) {
    _mm256_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    __m128i h;
    if constexpr (E == AdamElem::kF16) {
      h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
      // Round to nearest even on the bits: u + 0x7fff + lsb; NaN keeps its top bits, quieted.
      const __m256i u = _mm256_castps_si256(x);
      const __m256i high = _mm256_srli_epi32(u, 16);
      const __m256i lsb = _mm256_and_si256(high, _mm256_set1_epi32(1));
      const __m256i rounded = _mm256_srli_epi32(
          _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
      h = PackBf16x8(x, rounded);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// 8 lanes of the stochastic rounding hashes of elements i .. i + 7 (RoundingHash).
JAXASCEND_TARGET_AVX2 inline __m256i RoundingHash8(const AdamBuffers& b, int64_t i) {
  const uint32_t first = static_cast<uint32_t>(b.rounding_index + i) * kGolden + b.rounding_seed;
  const __m256i steps = _mm256_setr_epi32(0, static_cast<int>(kGolden), static_cast<int>(2 * kGolden),
                                          static_cast<int>(3 * kGolden), static_cast<int>(4 * kGolden),
                                          static_cast<int>(5 * kGolden), static_cast<int>(6 * kGolden),
                                          static_cast<int>(7 * kGolden));
  __m256i x = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int>(first)), steps);
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x21f0aaad));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x735a2d97));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

// Stores the new v of elements i .. i + 7 in S, rounded as b.rounding says.
template <AdamElem S>
JAXASCEND_TARGET_AVX2 inline void StoreV8(const AdamBuffers& b, int64_t i, __m256 v) {
  if constexpr (S == AdamElem::kBF16) {
    if (b.rounding == AdamRounding::kStochastic) {
      const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(v), _mm256_srli_epi32(RoundingHash8(b, i), 16)), 16);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.v_out) + i), PackBf16x8(v, rounded));
      return;
    }
  }
  Store8<S>(b.v_out, i, v);
}

// The hyperparameters broadcast to 8 lanes, and one 8-lane update: the scalar AdamElement's
// operations in its order. Returns the new master; *m and *v get the new moments.
struct Avx2Scalars {
  __m256 lr, b1, b2, eps, wd, grad_scale, inv_bc1, inv_bc2, omb1, omb2;
};

JAXASCEND_TARGET_AVX2 inline Avx2Scalars Broadcast8(const AdamScalars& s) {
  return {_mm256_set1_ps(s.lr), _mm256_set1_ps(s.b1), _mm256_set1_ps(s.b2), _mm256_set1_ps(s.eps),
          _mm256_set1_ps(s.weight_decay), _mm256_set1_ps(s.grad_scale),
          _mm256_set1_ps(1.0f / s.bias_correction1), _mm256_set1_ps(1.0f / s.bias_correction2),
          _mm256_set1_ps(s.one_minus_b1), _mm256_set1_ps(s.one_minus_b2)};
}

JAXASCEND_TARGET_AVX2 inline __m256 AdamUpdate8(const Avx2Scalars& c, __m256 grad, __m256 master,
                                                __m256 m_old, __m256 v_old, __m256* m, __m256* v) {
  const __m256 g = _mm256_mul_ps(grad, c.grad_scale);
  *m = _mm256_add_ps(_mm256_mul_ps(c.omb1, g), _mm256_mul_ps(c.b1, m_old));
  *v = _mm256_add_ps(_mm256_mul_ps(c.omb2, _mm256_mul_ps(g, g)), _mm256_mul_ps(c.b2, v_old));
  const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(*v, c.inv_bc2)), c.eps);
  const __m256 update = _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(*m, c.inv_bc1), denom),
                                      _mm256_mul_ps(c.wd, master));
  return _mm256_sub_ps(master, _mm256_mul_ps(c.lr, update));
}

template <AdamElem G, AdamElem P, AdamElem S>
JAXASCEND_TARGET_AVX2 void AdamRangeAvx2(const AdamBuffers& b, const AdamScalars& s,
                                         int64_t begin, int64_t end) {
  const Avx2Scalars c = Broadcast8(s);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    PrefetchInputs<G, S>(b, i);
    __m256 m, v;
    const __m256 new_master = AdamUpdate8(c, Load8<G>(b.grad, i), _mm256_loadu_ps(b.master_in + i),
                                          Load8<S>(b.m_in, i), Load8<S>(b.v_in, i), &m, &v);
    _mm256_storeu_ps(b.master_out + i, new_master);
    Store8<S>(b.m_out, i, m);
    StoreV8<S>(b, i, v);
    Store8<P>(b.params_out, i, new_master);
  }
  AdamRangeScalar<G, P, S>(b, s, i, end);
}

// kInt8 in AVX2: 8 codes at a time, the same integer and float operations as the scalar
// EncodeCode/DecodeCode (state_codes.py), blended per lane.
template <int M>
JAXASCEND_TARGET_AVX2 inline __m256 DecodeCode8(__m256i c) {
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(c),
                                   _mm256_set1_ps(BitsToFloat(static_cast<uint32_t>(127 - 15 - M) << 23)));
  const __m256 normal = _mm256_castsi256_ps(
      _mm256_slli_epi32(_mm256_add_epi32(c, _mm256_set1_epi32(static_cast<int>(kCodeBias << M))), 23 - M));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(1 << M), c);
  return _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
}

template <int M>
JAXASCEND_TARGET_AVX2 inline __m256i EncodeCode8(__m256 r) {
  constexpr int shift = 23 - M;
  const __m256i u = _mm256_castps_si256(r);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, shift), _mm256_set1_epi32(1));
  __m256i normal = _mm256_srli_epi32(
      _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32((1 << (shift - 1)) - 1)), lsb), shift);
  normal = _mm256_sub_epi32(normal, _mm256_set1_epi32(static_cast<int>(kCodeBias << M)));
  normal = _mm256_min_epi32(normal, _mm256_set1_epi32((1 << (4 + M)) - 1));
  const __m256 magic = _mm256_set1_ps(BitsToFloat(static_cast<uint32_t>(127 + 8 - M) << 23));
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(r, magic)), _mm256_castps_si256(magic));
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kSubnormalLimitBits)), u);
  return _mm256_blendv_epi8(normal, sub, is_sub);
}

template <int M>
JAXASCEND_TARGET_AVX2 inline __m256i EncodeCodeStochastic8(__m256 r, __m256i bits) {
  constexpr int shift = 23 - M;
  const __m256i u = _mm256_castps_si256(r);
  __m256i normal = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_slli_epi32(bits, shift - 16)), shift);
  normal = _mm256_sub_epi32(normal, _mm256_set1_epi32(static_cast<int>(kCodeBias << M)));
  normal = _mm256_min_epi32(normal, _mm256_set1_epi32((1 << (4 + M)) - 1));
  // Lanes that are not subnormal overflow the conversion; the blend drops them.
  const __m256i fixed = _mm256_cvttps_epi32(
      _mm256_mul_ps(r, _mm256_set1_ps(BitsToFloat(static_cast<uint32_t>(127 + 31 + M) << 23))));
  const __m256i sub = _mm256_srai_epi32(_mm256_add_epi32(fixed, bits), 16);
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(kSubnormalLimitBits)), u);
  return _mm256_blendv_epi8(normal, sub, is_sub);
}

JAXASCEND_TARGET_AVX2 inline __m256i LoadCodes8(const void* p, int64_t i) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(static_cast<const uint8_t*>(p) + i)));
}

// The low byte of each of 8 lanes, in order, stored as 8 bytes.
JAXASCEND_TARGET_AVX2 inline void StoreCodes8(void* p, int64_t i, __m256i codes) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i bytes = _mm256_shuffle_epi8(codes, pick);
  const __m128i packed = _mm_unpacklo_epi32(_mm256_castsi256_si128(bytes), _mm256_extracti128_si256(bytes, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(static_cast<uint8_t*>(p) + i), packed);
}

JAXASCEND_TARGET_AVX2 inline uint32_t HorizontalMax(__m256i x) {
  __m128i m = _mm_max_epu32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0x4e));
  m = _mm_max_epu32(m, _mm_shuffle_epi32(m, 0xb1));
  return static_cast<uint32_t>(_mm_cvtsi128_si32(m));
}

template <AdamElem G, AdamElem P>
JAXASCEND_TARGET_AVX2 void AdamRangeInt8Avx2(const AdamBuffers& b, const AdamScalars& s,
                                             int64_t begin, int64_t end) {
  const Avx2Scalars c = Broadcast8(s);
  const float inv_bc1_scalar = 1.0f / s.bias_correction1, inv_bc2_scalar = 1.0f / s.bias_correction2;
  const __m256i magnitude = _mm256_set1_epi32(0x7fffffff);
  const __m256i sign_bit = _mm256_set1_epi32(static_cast<int>(0x80000000u));
  const bool stochastic = b.rounding == AdamRounding::kStochastic;
  alignas(64) float m_new[kAdamMaxBlock];
  alignas(64) float w_new[kAdamMaxBlock];
  for (int64_t start = begin; start < end; start += b.block) {
    const int64_t n = std::min(b.block, end - start);
    const int64_t k = start / b.block;
    const float m_scale = b.m_scale[k], w_scale = b.v_scale[k];
    const __m256 m_scale8 = _mm256_set1_ps(m_scale), w_scale8 = _mm256_set1_ps(w_scale);
    __m256i m_max8 = _mm256_setzero_si256(), w_max8 = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const int64_t i = start + j;
      const __m256i mc = LoadCodes8(b.m_in, i);
      const __m256 m_mag = _mm256_mul_ps(DecodeCode8<kMBits>(_mm256_and_si256(mc, _mm256_set1_epi32(0x7f))),
                                         m_scale8);
      const __m256i m_sign = _mm256_slli_epi32(_mm256_and_si256(mc, _mm256_set1_epi32(0x80)), 24);
      const __m256 m_old = _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(m_mag), m_sign));
      const __m256 w_old = _mm256_mul_ps(DecodeCode8<kWBits>(LoadCodes8(b.v_in, i)), w_scale8);
      __m256 m, v;
      const __m256 new_master = AdamUpdate8(c, Load8<G>(b.grad, i), _mm256_loadu_ps(b.master_in + i), m_old,
                                            _mm256_mul_ps(w_old, w_old), &m, &v);
      _mm256_storeu_ps(b.master_out + i, new_master);
      Store8<P>(b.params_out, i, new_master);
      const __m256 w = _mm256_sqrt_ps(v);
      _mm256_store_ps(m_new + j, m);
      _mm256_store_ps(w_new + j, w);
      m_max8 = _mm256_max_epu32(m_max8, _mm256_and_si256(_mm256_castps_si256(m), magnitude));
      w_max8 = _mm256_max_epu32(w_max8, _mm256_and_si256(_mm256_castps_si256(w), magnitude));
    }
    uint32_t m_max = HorizontalMax(m_max8), w_max = HorizontalMax(w_max8);
    for (int64_t t = j; t < n; ++t) {
      Int8Element<G, P>(b, s, inv_bc1_scalar, inv_bc2_scalar, start + t, m_scale, w_scale, &m_new[t], &w_new[t]);
      m_max = std::max(m_max, Magnitude(m_new[t]));
      w_max = std::max(w_max, Magnitude(w_new[t]));
    }
    float m_inverse, w_inverse;
    BlockScale(m_max, &b.m_scale[k], &m_inverse);
    BlockScale(w_max, &b.v_scale[k], &w_inverse);
    const __m256 m_inverse8 = _mm256_set1_ps(m_inverse), w_inverse8 = _mm256_set1_ps(w_inverse);
    int64_t e = 0;
    for (; e + 8 <= n; e += 8) {
      const __m256i m_bits = _mm256_castps_si256(_mm256_load_ps(m_new + e));
      const __m256 m_r = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(m_bits, magnitude)), m_inverse8);
      const __m256i hash = stochastic ? RoundingHash8(b, start + e) : _mm256_setzero_si256();
      const __m256i m_magnitude_code = stochastic
          ? EncodeCodeStochastic8<kMBits>(m_r, _mm256_and_si256(hash, _mm256_set1_epi32(0xffff)))
          : EncodeCode8<kMBits>(m_r);
      const __m256i m_code = _mm256_or_si256(m_magnitude_code,
                                             _mm256_srli_epi32(_mm256_and_si256(m_bits, sign_bit), 24));
      StoreCodes8(b.m_out, start + e, m_code);
      const __m256i w_bits = _mm256_castps_si256(_mm256_load_ps(w_new + e));
      const __m256 w_r = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_and_si256(w_bits, magnitude)), w_inverse8);
      StoreCodes8(b.v_out, start + e, stochastic ? EncodeCodeStochastic8<kWBits>(w_r, _mm256_srli_epi32(hash, 16))
                                                 : EncodeCode8<kWBits>(w_r));
    }
    EncodeBlockTail(b, start, e, n, m_new, w_new, m_inverse, w_inverse);
  }
}

// ---------------------------------------------------------------------------------------------
// AVX-512F: 16 lanes; every conversion used here (vcvtph2ps, vcvtps2ph, vpmovdw) is AVX-512F.
#define JAXASCEND_TARGET_AVX512 __attribute__((target("avx512f")))

template <AdamElem E>
JAXASCEND_TARGET_AVX512 inline __m512 Load16(const void* p, int64_t i) {
  if constexpr (E == AdamElem::kF32) {
    return _mm512_loadu_ps(static_cast<const float*>(p) + i);
  } else {
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(p) + i));
    if constexpr (E == AdamElem::kF16) {
      return _mm512_cvtph_ps(h);
    } else {
      return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
  }
}

// bf16 bits (each lane's high half of `rounded`) of x, a NaN keeping its top bits, quieted;
// the 16 halves packed in order (PackBf16x8's AVX-512 twin).
JAXASCEND_TARGET_AVX512 inline __m256i PackBf16x16(__m512 x, __m512i rounded) {
  const __m512i quiet_nan = _mm512_or_si512(_mm512_srli_epi32(_mm512_castps_si512(x), 16), _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
}

template <AdamElem E>
JAXASCEND_TARGET_AVX512 inline void Store16(void* p, int64_t i, __m512 x) {
  if constexpr (E == AdamElem::kF32) {
    _mm512_storeu_ps(static_cast<float*>(p) + i, x);
  } else {
    __m256i h;
    if constexpr (E == AdamElem::kF16) {
      h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    } else {
      const __m512i u = _mm512_castps_si512(x);
      const __m512i high = _mm512_srli_epi32(u, 16);
      const __m512i lsb = _mm512_and_si512(high, _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
      h = PackBf16x16(x, rounded);
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

// 16 lanes of v's stochastic rounding bits of elements i .. i + 15 (RoundingHash >> 16).
JAXASCEND_TARGET_AVX512 inline __m512i RoundingBits16(const AdamBuffers& b, int64_t i) {
  const uint32_t first = static_cast<uint32_t>(b.rounding_index + i) * kGolden + b.rounding_seed;
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  __m512i x = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(first)),
                               _mm512_mullo_epi32(lanes, _mm512_set1_epi32(static_cast<int>(kGolden))));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x21f0aaad));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x735a2d97));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  return _mm512_srli_epi32(x, 16);
}

// Stores the new v of elements i .. i + 15 in S, rounded as b.rounding says.
template <AdamElem S>
JAXASCEND_TARGET_AVX512 inline void StoreV16(const AdamBuffers& b, int64_t i, __m512 v) {
  if constexpr (S == AdamElem::kBF16) {
    if (b.rounding == AdamRounding::kStochastic) {
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(_mm512_castps_si512(v), RoundingBits16(b, i)), 16);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.v_out) + i), PackBf16x16(v, rounded));
      return;
    }
  }
  Store16<S>(b.v_out, i, v);
}

template <AdamElem G, AdamElem P, AdamElem S>
JAXASCEND_TARGET_AVX512 void AdamRangeAvx512(const AdamBuffers& b, const AdamScalars& s,
                                             int64_t begin, int64_t end) {
  const __m512 lr = _mm512_set1_ps(s.lr), b1 = _mm512_set1_ps(s.b1), b2 = _mm512_set1_ps(s.b2);
  const __m512 eps = _mm512_set1_ps(s.eps), wd = _mm512_set1_ps(s.weight_decay);
  const __m512 grad_scale = _mm512_set1_ps(s.grad_scale);
  const __m512 inv_bc1 = _mm512_set1_ps(1.0f / s.bias_correction1);
  const __m512 inv_bc2 = _mm512_set1_ps(1.0f / s.bias_correction2);
  const __m512 omb1 = _mm512_set1_ps(s.one_minus_b1), omb2 = _mm512_set1_ps(s.one_minus_b2);
  int64_t i = begin;
  for (; i + 16 <= end; i += 16) {
    PrefetchInputs<G, S>(b, i);
    const __m512 g = _mm512_mul_ps(Load16<G>(b.grad, i), grad_scale);
    const __m512 master = _mm512_loadu_ps(b.master_in + i);
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(omb1, g),
                                   _mm512_mul_ps(b1, Load16<S>(b.m_in, i)));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(omb2, _mm512_mul_ps(g, g)),
                                   _mm512_mul_ps(b2, Load16<S>(b.v_in, i)));
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(v, inv_bc2)), eps);
    const __m512 update = _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(m, inv_bc1), denom),
                                        _mm512_mul_ps(wd, master));
    const __m512 new_master = _mm512_sub_ps(master, _mm512_mul_ps(lr, update));
    _mm512_storeu_ps(b.master_out + i, new_master);
    Store16<S>(b.m_out, i, m);
    StoreV16<S>(b, i, v);
    Store16<P>(b.params_out, i, new_master);
  }
  AdamRangeScalar<G, P, S>(b, s, i, end);
}

// Sets the default SSE environment (round to nearest even, no FTZ/DAZ, exceptions masked) for
// the duration of a range, so results do not depend on what the calling thread set.
class DefaultFloatEnvironment {
 public:
  DefaultFloatEnvironment() : saved_(_mm_getcsr()) { _mm_setcsr(0x1f80); }
  ~DefaultFloatEnvironment() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
};
#else
// Other architectures run only the scalar path; their default environment is left as found.
class DefaultFloatEnvironment {
 public:
  DefaultFloatEnvironment() {}
};
#endif  // JAXASCEND_ADAM_X86

// ---------------------------------------------------------------------------------------------
// Dispatch tables: [grad type][param type] for one ISA.

using AdamRangeFn = void (*)(const AdamBuffers&, const AdamScalars&, int64_t, int64_t);

template <template <AdamElem, AdamElem> class Kernel>
AdamRangeFn SelectRange(AdamElem g, AdamElem p) {
  static const AdamRangeFn table[3][3] = {
      {Kernel<AdamElem::kF32, AdamElem::kF32>::fn, Kernel<AdamElem::kF32, AdamElem::kF16>::fn,
       Kernel<AdamElem::kF32, AdamElem::kBF16>::fn},
      {Kernel<AdamElem::kF16, AdamElem::kF32>::fn, Kernel<AdamElem::kF16, AdamElem::kF16>::fn,
       Kernel<AdamElem::kF16, AdamElem::kBF16>::fn},
      {Kernel<AdamElem::kBF16, AdamElem::kF32>::fn, Kernel<AdamElem::kBF16, AdamElem::kF16>::fn,
       Kernel<AdamElem::kBF16, AdamElem::kBF16>::fn},
  };
  return table[static_cast<int>(g)][static_cast<int>(p)];
}

// Kernel<G, P>::fn for one state format: S the element type of m and v (fp32 or bf16 state).
#define JAXASCEND_ADAM_KERNEL(Name, Range, S)    \
  template <AdamElem G, AdamElem P>              \
  struct Name {                                  \
    static constexpr AdamRangeFn fn = Range<G, P, S>; \
  };
JAXASCEND_ADAM_KERNEL(ScalarKernel, AdamRangeScalar, AdamElem::kF32)
JAXASCEND_ADAM_KERNEL(ScalarBf16Kernel, AdamRangeScalar, AdamElem::kBF16)
template <AdamElem G, AdamElem P>
struct ScalarInt8Kernel {
  static constexpr AdamRangeFn fn = AdamRangeInt8Scalar<G, P>;
};
#if JAXASCEND_ADAM_X86
JAXASCEND_ADAM_KERNEL(Avx2Kernel, AdamRangeAvx2, AdamElem::kF32)
JAXASCEND_ADAM_KERNEL(Avx2Bf16Kernel, AdamRangeAvx2, AdamElem::kBF16)
JAXASCEND_ADAM_KERNEL(Avx512Kernel, AdamRangeAvx512, AdamElem::kF32)
JAXASCEND_ADAM_KERNEL(Avx512Bf16Kernel, AdamRangeAvx512, AdamElem::kBF16)
template <AdamElem G, AdamElem P>
struct Avx2Int8Kernel {
  static constexpr AdamRangeFn fn = AdamRangeInt8Avx2<G, P>;
};
#endif
#undef JAXASCEND_ADAM_KERNEL

AdamRangeFn RangeFor(AdamIsa isa, AdamState state, AdamElem g, AdamElem p) {
#if JAXASCEND_ADAM_X86
  if (state == AdamState::kInt8 && (isa == AdamIsa::kAvx512 || isa == AdamIsa::kAvx2)) {
    return SelectRange<Avx2Int8Kernel>(g, p);  // no AVX-512 variant of its own
  }
  if (isa == AdamIsa::kAvx512) {
    return state == AdamState::kBF16 ? SelectRange<Avx512Bf16Kernel>(g, p) : SelectRange<Avx512Kernel>(g, p);
  }
  if (isa == AdamIsa::kAvx2) {
    return state == AdamState::kBF16 ? SelectRange<Avx2Bf16Kernel>(g, p) : SelectRange<Avx2Kernel>(g, p);
  }
#else
  (void)isa;  // only the scalar path is built
#endif
  if (state == AdamState::kInt8) return SelectRange<ScalarInt8Kernel>(g, p);
  return state == AdamState::kBF16 ? SelectRange<ScalarBf16Kernel>(g, p) : SelectRange<ScalarKernel>(g, p);
}

// Ranges start at multiples of 64 elements (a cache line of every buffer, fp16 included), and
// a thread gets at least 32K elements: below that, waking a worker costs more than it saves.
constexpr int64_t kRangeAlign = 64;
constexpr int64_t kMinElementsPerThread = 1 << 15;

}  // namespace

const char* AdamIsaName(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kAuto: return "auto";
    case AdamIsa::kScalar: return "scalar";
    case AdamIsa::kAvx2: return "avx2";
    case AdamIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

bool ParseAdamIsa(const std::string& name, AdamIsa* isa) {
  for (AdamIsa candidate : {AdamIsa::kAuto, AdamIsa::kScalar, AdamIsa::kAvx2, AdamIsa::kAvx512}) {
    if (name == AdamIsaName(candidate)) {
      *isa = candidate;
      return true;
    }
  }
  return false;
}

bool AdamIsaSupported(AdamIsa isa) {
  switch (isa) {
    case AdamIsa::kAuto:
    case AdamIsa::kScalar:
      return true;
#if JAXASCEND_ADAM_X86
    // libgcc's feature probe also checks that the OS saves the AVX/AVX-512 registers (XCR0).
    case AdamIsa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
    case AdamIsa::kAvx512:
      return __builtin_cpu_supports("avx512f");
#else
    default:
      return false;
#endif
  }
  return false;
}

std::string ResolveAdamIsa(AdamIsa requested, AdamIsa* resolved) {
  AdamIsa isa = requested;
  if (isa == AdamIsa::kAuto) {
    const char* env = std::getenv("JAXASCEND_ADAM_ISA");
    if (env != nullptr && *env != '\0') {
      if (!ParseAdamIsa(env, &isa)) {
        return std::string("JAXASCEND_ADAM_ISA='") + env +
               "' is not one of auto, scalar, avx2, avx512";
      }
    }
  }
  if (isa == AdamIsa::kAuto) {
    isa = AdamIsaSupported(AdamIsa::kAvx512) ? AdamIsa::kAvx512
          : AdamIsaSupported(AdamIsa::kAvx2) ? AdamIsa::kAvx2
                                             : AdamIsa::kScalar;
  }
  if (!AdamIsaSupported(isa)) {
    return std::string("adamw: ISA '") + AdamIsaName(isa) + "' is not supported by this CPU";
  }
  *resolved = isa;
  return "";
}

const char* AdamStateName(AdamState state) {
  switch (state) {
    case AdamState::kF32: return "float32";
    case AdamState::kBF16: return "bfloat16";
    case AdamState::kInt8: return "int8";
  }
  return "unknown";
}

AdamScalars AdamScalarsFromArray(const float* values) {
  AdamScalars s;
  static_assert(sizeof(AdamScalars) == kAdamScalarCount * sizeof(float), "packed floats");
  std::memcpy(&s, values, sizeof s);
  return s;
}

std::string RunFusedAdamW(const AdamBuffers& b, const AdamScalars& s, int threads, AdamIsa isa) {
  if (threads < 1 || threads > kAdamMaxThreads) {
    return "adamw: threads=" + std::to_string(threads) + " must be in [1, " +
           std::to_string(kAdamMaxThreads) + "]";
  }
  if (b.n < 0) return "adamw: negative element count " + std::to_string(b.n);
  AdamIsa resolved;
  std::string error = ResolveAdamIsa(isa, &resolved);
  if (!error.empty()) return error;
  if (b.n == 0) return "";
  int64_t align = kRangeAlign;
  if (b.state_type == AdamState::kInt8) {
    if (b.block < kAdamMinBlock || b.block > kAdamMaxBlock || (b.block & (b.block - 1)) != 0) {
      return "adamw: int8 state block=" + std::to_string(b.block) + " must be a power of two in [" +
             std::to_string(kAdamMinBlock) + ", " + std::to_string(kAdamMaxBlock) + "]";
    }
    if (b.m_scale == nullptr || b.v_scale == nullptr) return "adamw: int8 state needs m_scale and v_scale";
    align = b.block;  // a range is whole blocks, so each block's scales belong to one thread
  }
  const AdamRangeFn range = RangeFor(resolved, b.state_type, b.grad_type, b.param_type);
  ParallelFor(b.n, threads, align, kMinElementsPerThread,
              [&](int64_t begin, int64_t end) {
                DefaultFloatEnvironment env;
                range(b, s, begin, end);
              });
  return "";
}

}  // namespace jaxascend
