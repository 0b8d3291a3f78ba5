// The AVX-512F variant of the fused AdamW kernel (optim_adam_kernel.h): 16 lanes, fp32 and bf16
// state (int8 state runs the AVX2 variant), fp32 and bf16 master; bitwise equal to the scalar path
// (optim_adam_scalar.h), which also runs the tails. Compiled with target attributes and chosen
// at run time (optim_adam.cc).
#include "optim_adam_scalar.h"

#if JAXASCEND_ADAM_X86
namespace jaxascend {
namespace adam_kernel {
namespace {

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

// 16 lanes of lowbias32(uint32(index + lane) * kGolden + seed) >> 16: v's stochastic rounding
// bits (RoundingHash >> 16) or, salted, the master's (MasterRoundingBits).
JAXASCEND_TARGET_AVX512 inline __m512i HashBits16(uint32_t seed, int64_t index) {
  const uint32_t first = static_cast<uint32_t>(index) * kGolden + seed;
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

JAXASCEND_TARGET_AVX512 inline __m512i RoundingBits16(const AdamBuffers& b, int64_t i) {
  return HashBits16(b.rounding_seed, b.rounding_index + i);
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

// LoadMaster of elements i .. i + 15 (LoadMaster8's twin).
template <AdamMaster M>
JAXASCEND_TARGET_AVX512 inline __m512 LoadMaster16(const AdamBuffers& b, int64_t i) {
  if constexpr (M == AdamMaster::kF32) {
    return _mm512_loadu_ps(b.master_in + i);
  } else if constexpr (M == AdamMaster::kBF16Stochastic) {
    return Load16<AdamElem::kBF16>(b.master16_in, i);
  } else {
    const __m512i high = _mm512_castps_si512(Load16<AdamElem::kBF16>(b.master16_in, i));
    const __m512i low = _mm512_cvtepi16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b.comp_in + i)));
    return _mm512_castsi512_ps(_mm512_add_epi32(high, low));
  }
}

// StoreMaster of elements i .. i + 15: x their old master, u their update (StoreMaster8's twin).
template <AdamMaster M, AdamElem P>
JAXASCEND_TARGET_AVX512 inline void StoreMaster16(const AdamBuffers& b, __m512 lr, int64_t i, __m512 x, __m512 u) {
  const __m512 new_master = _mm512_sub_ps(x, _mm512_mul_ps(lr, u));
  if constexpr (M == AdamMaster::kF32) {
    _mm512_storeu_ps(b.master_out + i, new_master);
    Store16<P>(b.params_out, i, new_master);
  } else {
    const __m512i y = _mm512_castps_si512(new_master);
    __m256i bits;
    if constexpr (M == AdamMaster::kBF16Stochastic) {
      const __m512i r = HashBits16(b.rounding_seed ^ kAdamMasterSalt, b.rounding_index + i);
      bits = PackBf16x16(new_master, _mm512_srli_epi32(_mm512_add_epi32(y, r), 16));
    } else {
      // SplitMasterBits: a tie that rounds down (low 17 bits 0x08000) is held one ulp toward zero.
      const __mmask16 tie_down = _mm512_cmpeq_epi32_mask(_mm512_and_si512(y, _mm512_set1_epi32(0x1ffff)),
                                                         _mm512_set1_epi32(0x8000));
      const __m512i u = _mm512_mask_sub_epi32(y, tie_down, y, _mm512_set1_epi32(1));
      bits = PackBf16x16(new_master, _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x8000)), 16));
      // vpmovdw truncates each lane to its low 16 bits.
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.comp_out + i), _mm512_cvtepi32_epi16(u));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(b.master16_out + i), bits);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(b.params_out) + i), bits);
  }
}

template <AdamElem G, AdamElem P, AdamElem S, AdamMaster M>
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
    PrefetchInputs<G, S, M>(b, i);
    const __m512 g = _mm512_mul_ps(Load16<G>(b.grad, i), grad_scale);
    const __m512 master = LoadMaster16<M>(b, i);
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(omb1, g),
                                   _mm512_mul_ps(b1, Load16<S>(b.m_in, i)));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(omb2, _mm512_mul_ps(g, g)),
                                   _mm512_mul_ps(b2, Load16<S>(b.v_in, i)));
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(v, inv_bc2)), eps);
    const __m512 update = _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(m, inv_bc1), denom),
                                        _mm512_mul_ps(wd, master));
    Store16<S>(b.m_out, i, m);
    StoreV16<S>(b, i, v);
    StoreMaster16<M, P>(b, lr, i, master, update);
  }
  AdamRangeScalar<G, P, S, M>(b, s, i, end);
}

JAXASCEND_ADAM_KERNEL(Avx512Kernel, AdamRangeAvx512, AdamElem::kF32)
JAXASCEND_ADAM_KERNEL(Avx512Bf16Kernel, AdamRangeAvx512, AdamElem::kBF16)

}  // namespace

AdamRangeFn Avx512Range(AdamState state, AdamMaster master, AdamElem g, AdamElem p) {
  return state == AdamState::kBF16 ? SelectRange<Avx512Bf16Kernel>(master, g, p)
                                   : SelectRange<Avx512Kernel>(master, g, p);
}

}  // namespace adam_kernel
}  // namespace jaxascend
#endif  // JAXASCEND_ADAM_X86
