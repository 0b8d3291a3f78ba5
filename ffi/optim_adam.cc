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

template <AdamElem G, AdamElem P>
void AdamRangeScalar(const AdamBuffers& b, const AdamScalars& s, int64_t begin, int64_t end) {
  const float inv_bc1 = 1.0f / s.bias_correction1;
  const float inv_bc2 = 1.0f / s.bias_correction2;
  for (int64_t i = begin; i < end; ++i) {
    const float g = LoadElement<G>(b.grad, i) * s.grad_scale;
    const float master = b.master_in[i];
    const float m = s.one_minus_b1 * g + s.b1 * b.m_in[i];
    const float v = s.one_minus_b2 * (g * g) + s.b2 * b.v_in[i];
    const float denom = std::sqrt(v * inv_bc2) + s.eps;
    const float update = (m * inv_bc1) / denom + s.weight_decay * master;
    const float new_master = master - s.lr * update;
    b.master_out[i] = new_master;
    b.m_out[i] = m;
    b.v_out[i] = v;
    StoreElement<P>(b.params_out, i, new_master);
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

template <AdamElem G>
inline void PrefetchInputs(const AdamBuffers& b, int64_t i) {
  PrefetchAhead(b.master_in, i, 4);
  PrefetchAhead(b.m_in, i, 4);
  PrefetchAhead(b.v_in, i, 4);
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
      const __m256i quiet_nan = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
      const __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
      const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
      // Values are < 2**16, so the saturating pack is exact; it interleaves 128-bit lanes,
      // which the permute undoes.
      h = _mm256_castsi256_si128(
          _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

template <AdamElem G, AdamElem P>
JAXASCEND_TARGET_AVX2 void AdamRangeAvx2(const AdamBuffers& b, const AdamScalars& s,
                                         int64_t begin, int64_t end) {
  const __m256 lr = _mm256_set1_ps(s.lr), b1 = _mm256_set1_ps(s.b1), b2 = _mm256_set1_ps(s.b2);
  const __m256 eps = _mm256_set1_ps(s.eps), wd = _mm256_set1_ps(s.weight_decay);
  const __m256 grad_scale = _mm256_set1_ps(s.grad_scale);
  const __m256 inv_bc1 = _mm256_set1_ps(1.0f / s.bias_correction1);
  const __m256 inv_bc2 = _mm256_set1_ps(1.0f / s.bias_correction2);
  const __m256 omb1 = _mm256_set1_ps(s.one_minus_b1), omb2 = _mm256_set1_ps(s.one_minus_b2);
  int64_t i = begin;
  for (; i + 8 <= end; i += 8) {
    PrefetchInputs<G>(b, i);
    const __m256 g = _mm256_mul_ps(Load8<G>(b.grad, i), grad_scale);
    const __m256 master = _mm256_loadu_ps(b.master_in + i);
    const __m256 m = _mm256_add_ps(_mm256_mul_ps(omb1, g),
                                   _mm256_mul_ps(b1, _mm256_loadu_ps(b.m_in + i)));
    const __m256 v = _mm256_add_ps(_mm256_mul_ps(omb2, _mm256_mul_ps(g, g)),
                                   _mm256_mul_ps(b2, _mm256_loadu_ps(b.v_in + i)));
    const __m256 denom = _mm256_add_ps(_mm256_sqrt_ps(_mm256_mul_ps(v, inv_bc2)), eps);
    const __m256 update = _mm256_add_ps(_mm256_div_ps(_mm256_mul_ps(m, inv_bc1), denom),
                                        _mm256_mul_ps(wd, master));
    const __m256 new_master = _mm256_sub_ps(master, _mm256_mul_ps(lr, update));
    _mm256_storeu_ps(b.master_out + i, new_master);
    _mm256_storeu_ps(b.m_out + i, m);
    _mm256_storeu_ps(b.v_out + i, v);
    Store8<P>(b.params_out, i, new_master);
  }
  AdamRangeScalar<G, P>(b, s, i, end);
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
      const __m512i quiet_nan = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
      const __mmask16 is_nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
      h = _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(p) + i), h);
  }
}

template <AdamElem G, AdamElem P>
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
    PrefetchInputs<G>(b, i);
    const __m512 g = _mm512_mul_ps(Load16<G>(b.grad, i), grad_scale);
    const __m512 master = _mm512_loadu_ps(b.master_in + i);
    const __m512 m = _mm512_add_ps(_mm512_mul_ps(omb1, g),
                                   _mm512_mul_ps(b1, _mm512_loadu_ps(b.m_in + i)));
    const __m512 v = _mm512_add_ps(_mm512_mul_ps(omb2, _mm512_mul_ps(g, g)),
                                   _mm512_mul_ps(b2, _mm512_loadu_ps(b.v_in + i)));
    const __m512 denom = _mm512_add_ps(_mm512_sqrt_ps(_mm512_mul_ps(v, inv_bc2)), eps);
    const __m512 update = _mm512_add_ps(_mm512_div_ps(_mm512_mul_ps(m, inv_bc1), denom),
                                        _mm512_mul_ps(wd, master));
    const __m512 new_master = _mm512_sub_ps(master, _mm512_mul_ps(lr, update));
    _mm512_storeu_ps(b.master_out + i, new_master);
    _mm512_storeu_ps(b.m_out + i, m);
    _mm512_storeu_ps(b.v_out + i, v);
    Store16<P>(b.params_out, i, new_master);
  }
  AdamRangeScalar<G, P>(b, s, i, end);
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

template <AdamElem G, AdamElem P>
struct ScalarKernel {
  static constexpr AdamRangeFn fn = AdamRangeScalar<G, P>;
};
#if JAXASCEND_ADAM_X86
template <AdamElem G, AdamElem P>
struct Avx2Kernel {
  static constexpr AdamRangeFn fn = AdamRangeAvx2<G, P>;
};
template <AdamElem G, AdamElem P>
struct Avx512Kernel {
  static constexpr AdamRangeFn fn = AdamRangeAvx512<G, P>;
};
#endif

AdamRangeFn RangeFor(AdamIsa isa, AdamElem g, AdamElem p) {
#if JAXASCEND_ADAM_X86
  if (isa == AdamIsa::kAvx512) return SelectRange<Avx512Kernel>(g, p);
  if (isa == AdamIsa::kAvx2) return SelectRange<Avx2Kernel>(g, p);
#else
  (void)isa;  // only the scalar path is built
#endif
  return SelectRange<ScalarKernel>(g, p);
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
  const AdamRangeFn range = RangeFor(resolved, b.grad_type, b.param_type);
  ParallelFor(b.n, threads, kRangeAlign, kMinElementsPerThread,
              [&](int64_t begin, int64_t end) {
                DefaultFloatEnvironment env;
                range(b, s, begin, end);
              });
  return "";
}

}  // namespace jaxascend
