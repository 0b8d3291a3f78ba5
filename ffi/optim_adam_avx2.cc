// The AVX2 + F16C variant of the fused AdamW kernel (optim_adam_kernel.h): 8 lanes, fp32, bf16
// and int8 state, fp32 and bf16 master; bitwise equal to the scalar path (optim_adam_scalar.h),
// which also runs the tails. Compiled with target attributes and chosen at run time
// (optim_adam.cc), so the extension still loads on a CPU without AVX2.
#include "optim_adam_scalar.h"

#if JAXASCEND_ADAM_X86
namespace jaxascend {
namespace adam_kernel {
namespace {

// AVX2 + F16C: 8 lanes. FMA is deliberately not requested (see optim_adam_kernel.h).
#define JAXASCEND_TARGET_AVX2 __attribute__((target("avx2,f16c")))

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

// The 8 lanes of r (each < 2**16) packed to 16 bits, in order. The saturating pack is exact on
// such values; it interleaves 128-bit lanes, which the permute undoes.
JAXASCEND_TARGET_AVX2 inline __m128i Pack16x8(__m256i r) {
  return _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
}

// bf16 bits (each lane's high half of `rounded`) of x, a NaN keeping its top bits, quieted;
// the 8 halves packed in order.
JAXASCEND_TARGET_AVX2 inline __m128i PackBf16x8(__m256 x, __m256i rounded) {
  const __m256i high = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
  return Pack16x8(_mm256_blendv_epi8(rounded, quiet_nan, is_nan));
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

// 8 lanes of lowbias32(uint32(index + lane) * kGolden + seed): RoundingHash's (seed =
// b.rounding_seed) or, salted, MasterRoundingBits' before its shift.
JAXASCEND_TARGET_AVX2 inline __m256i HashLanes8(uint32_t seed, int64_t index) {
  const uint32_t first = static_cast<uint32_t>(index) * kGolden + seed;
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

// 8 lanes of the stochastic rounding hashes of elements i .. i + 7 (RoundingHash).
JAXASCEND_TARGET_AVX2 inline __m256i RoundingHash8(const AdamBuffers& b, int64_t i) {
  return HashLanes8(b.rounding_seed, b.rounding_index + i);
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

// Returns the update u (weight decay included); *m and *v get the new moments.
JAXASCEND_TARGET_AVX2 inline __m256 AdamUpdate8(const Avx2Scalars& c, __m256 grad, __m256 master,
                                                __m256 m_old, __m256 v_old, __m256* m, __m256* v) {
  const __m256 g = _mm256_mul_ps(grad, c.grad_scale);
  *m = _mm256_add_ps(_mm256_mul_ps(c.omb1, g), _mm256_mul_ps(c.b1, m_old));
  *v = _mm256_add_ps(_mm256_mul_ps(c.omb2, _mm256_mul_ps(g, g)), _mm256_mul_ps(c.b2, v_old));
  const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(*v, c.inv_bc2)), c.eps);
  return _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(*m, c.inv_bc1), denom), _mm256_mul_ps(c.wd, master));
}

// LoadMaster of elements i .. i + 7 (a compensated master joined: JoinMaster).
template <AdamMaster M>
JAXASCEND_TARGET_AVX2 inline __m256 LoadMaster8(const AdamBuffers& b, int64_t i) {
  if constexpr (M == AdamMaster::kF32) {
    return _mm256_loadu_ps(b.master_in + i);
  } else if constexpr (M == AdamMaster::kBF16Stochastic) {
    return Load8<AdamElem::kBF16>(b.master16_in, i);
  } else {
    const __m256i high = _mm256_castps_si256(Load8<AdamElem::kBF16>(b.master16_in, i));
    const __m256i low = _mm256_cvtepi16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.comp_in + i)));
    return _mm256_castsi256_ps(_mm256_add_epi32(high, low));
  }
}

// StoreMaster of elements i .. i + 7: x their old master, u their update.
template <AdamMaster M, AdamElem P>
JAXASCEND_TARGET_AVX2 inline void StoreMaster8(const AdamBuffers& b, const Avx2Scalars& c, int64_t i, __m256 x,
                                               __m256 u) {
  const __m256 new_master = _mm256_sub_ps(x, _mm256_mul_ps(c.lr, u));
  if constexpr (M == AdamMaster::kF32) {
    _mm256_storeu_ps(b.master_out + i, new_master);
    Store8<P>(b.params_out, i, new_master);
  } else {
    const __m256i y = _mm256_castps_si256(new_master);
    __m128i bits;
    if constexpr (M == AdamMaster::kBF16Stochastic) {
      const __m256i r = _mm256_srli_epi32(HashLanes8(b.rounding_seed ^ kAdamMasterSalt, b.rounding_index + i), 16);
      bits = PackBf16x8(new_master, _mm256_srli_epi32(_mm256_add_epi32(y, r), 16));
    } else {
      // SplitMasterBits: a tie that rounds down (low 17 bits 0x08000) is held one ulp toward zero.
      const __m256i tie_down = _mm256_cmpeq_epi32(_mm256_and_si256(y, _mm256_set1_epi32(0x1ffff)),
                                                  _mm256_set1_epi32(0x8000));
      const __m256i u = _mm256_add_epi32(y, tie_down);  // -1 in those lanes
      bits = PackBf16x8(new_master, _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x8000)), 16));
      const __m128i low = Pack16x8(_mm256_and_si256(u, _mm256_set1_epi32(0xffff)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(b.comp_out + i), low);
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(b.master16_out + i), bits);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(b.params_out) + i), bits);
  }
}

template <AdamElem G, AdamElem P, AdamElem S, AdamMaster M>
JAXASCEND_TARGET_AVX2 void AdamRangeAvx2(const AdamBuffers& b, const AdamScalars& s,
                                         int64_t begin, int64_t end) {
  const Avx2Scalars c = Broadcast8(s);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    PrefetchInputs<G, S, M>(b, i);
    __m256 m, v;
    const __m256 master = LoadMaster8<M>(b, i);
    const __m256 update = AdamUpdate8(c, Load8<G>(b.grad, i), master, Load8<S>(b.m_in, i), Load8<S>(b.v_in, i),
                                      &m, &v);
    Store8<S>(b.m_out, i, m);
    StoreV8<S>(b, i, v);
    StoreMaster8<M, P>(b, c, i, master, update);
  }
  AdamRangeScalar<G, P, S, M>(b, s, i, end);
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

template <AdamElem G, AdamElem P, AdamMaster M>
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
      const __m256 master = LoadMaster8<M>(b, i);
      const __m256 update = AdamUpdate8(c, Load8<G>(b.grad, i), master, m_old, _mm256_mul_ps(w_old, w_old), &m, &v);
      StoreMaster8<M, P>(b, c, i, master, update);
      const __m256 w = _mm256_sqrt_ps(v);
      _mm256_store_ps(m_new + j, m);
      _mm256_store_ps(w_new + j, w);
      m_max8 = _mm256_max_epu32(m_max8, _mm256_and_si256(_mm256_castps_si256(m), magnitude));
      w_max8 = _mm256_max_epu32(w_max8, _mm256_and_si256(_mm256_castps_si256(w), magnitude));
    }
    uint32_t m_max = HorizontalMax(m_max8), w_max = HorizontalMax(w_max8);
    for (int64_t t = j; t < n; ++t) {
      Int8Element<G, P, M>(b, s, inv_bc1_scalar, inv_bc2_scalar, start + t, m_scale, w_scale, &m_new[t], &w_new[t]);
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

JAXASCEND_ADAM_KERNEL(Avx2Kernel, AdamRangeAvx2, AdamElem::kF32)
JAXASCEND_ADAM_KERNEL(Avx2Bf16Kernel, AdamRangeAvx2, AdamElem::kBF16)
template <AdamElem G, AdamElem P, AdamMaster M>
struct Avx2Int8Kernel {
  static constexpr AdamRangeFn fn = AdamRangeInt8Avx2<G, P, M>;
};

}  // namespace

AdamRangeFn Avx2Range(AdamState state, AdamMaster master, AdamElem g, AdamElem p) {
  if (state == AdamState::kInt8) return SelectRange<Avx2Int8Kernel>(master, g, p);
  return state == AdamState::kBF16 ? SelectRange<Avx2Bf16Kernel>(master, g, p)
                                   : SelectRange<Avx2Kernel>(master, g, p);
}

}  // namespace adam_kernel
}  // namespace jaxascend
#endif  // JAXASCEND_ADAM_X86
