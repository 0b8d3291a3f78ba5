// What the files of the fused AdamW kernel (optim_adam.h) share; not part of its API.
//
//   optim_adam_scalar.h   the scalar path: the reference, and the element helpers (conversions,
//                         the stochastic rounding hash, the 8-bit codes, the bf16 master's
//                         rounding) the vector variants share
//   optim_adam_avx2.cc    the AVX2 + F16C variant (fp32, bf16 and int8 state; every master)
//   optim_adam_avx512.cc  the AVX-512F variant (fp32 and bf16 state; int8 runs the AVX2 one)
//   optim_adam.cc         run-time ISA selection and RunFusedAdamW
//
// Bitwise agreement between variants rests on three things: every variant performs the same
// IEEE operations in the same order; no multiply-add is contracted into an FMA (the pragmas
// below; GCC contracts by default and target("avx512f") implies FMA); and each range runs
// under the default floating-point environment (round to nearest even, no flush-to-zero),
// whatever the calling thread had set.
//
// Include it (through optim_adam_scalar.h) after every other header: its pragma turns contraction
// off for all that follows.
#pragma once

#include <cstdint>

#include "optim_adam.h"

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
namespace adam_kernel {

// ---------------------------------------------------------------------------------------------
// Dispatch tables: [grad type][param type] for one ISA and a float32 master; [rounding][grad type]
// for a bfloat16 one, whose params are bfloat16.

using AdamRangeFn = void (*)(const AdamBuffers&, const AdamScalars&, int64_t, int64_t);

// nullptr for a bfloat16 master with other params (RunFusedAdamW refuses those first).
template <template <AdamElem, AdamElem, AdamMaster> class Kernel>
AdamRangeFn SelectRange(AdamMaster master, AdamElem g, AdamElem p) {
  constexpr AdamMaster kF32 = AdamMaster::kF32;
  static const AdamRangeFn table[3][3] = {
      {Kernel<AdamElem::kF32, AdamElem::kF32, kF32>::fn, Kernel<AdamElem::kF32, AdamElem::kF16, kF32>::fn,
       Kernel<AdamElem::kF32, AdamElem::kBF16, kF32>::fn},
      {Kernel<AdamElem::kF16, AdamElem::kF32, kF32>::fn, Kernel<AdamElem::kF16, AdamElem::kF16, kF32>::fn,
       Kernel<AdamElem::kF16, AdamElem::kBF16, kF32>::fn},
      {Kernel<AdamElem::kBF16, AdamElem::kF32, kF32>::fn, Kernel<AdamElem::kBF16, AdamElem::kF16, kF32>::fn,
       Kernel<AdamElem::kBF16, AdamElem::kBF16, kF32>::fn},
  };
  constexpr AdamMaster kComp = AdamMaster::kBF16Compensated, kSr = AdamMaster::kBF16Stochastic;
  constexpr AdamElem kB = AdamElem::kBF16;
  static const AdamRangeFn bf16_master[2][3] = {
      {Kernel<AdamElem::kF32, kB, kComp>::fn, Kernel<AdamElem::kF16, kB, kComp>::fn,
       Kernel<AdamElem::kBF16, kB, kComp>::fn},
      {Kernel<AdamElem::kF32, kB, kSr>::fn, Kernel<AdamElem::kF16, kB, kSr>::fn, Kernel<AdamElem::kBF16, kB, kSr>::fn},
  };
  if (master == kF32) return table[static_cast<int>(g)][static_cast<int>(p)];
  if (p != kB) return nullptr;
  return bf16_master[master == kSr ? 1 : 0][static_cast<int>(g)];
}

// Kernel<G, P, M>::fn for one state format: S the element type of m and v (fp32 or bf16 state).
#define JAXASCEND_ADAM_KERNEL(Name, Range, S)              \
  template <AdamElem G, AdamElem P, AdamMaster M>          \
  struct Name {                                            \
    static constexpr AdamRangeFn fn = Range<G, P, S, M>;   \
  };

#if JAXASCEND_ADAM_X86
// The range of each (grad type, param type) for one state format and master, by variant:
// optim_adam_avx2.cc, and optim_adam_avx512.cc (not kInt8).
AdamRangeFn Avx2Range(AdamState state, AdamMaster master, AdamElem g, AdamElem p);
AdamRangeFn Avx512Range(AdamState state, AdamMaster master, AdamElem g, AdamElem p);

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

template <AdamElem G, AdamElem S, AdamMaster M>
inline void PrefetchInputs(const AdamBuffers& b, int64_t i) {
  if constexpr (M == AdamMaster::kF32) {
    PrefetchAhead(b.master_in, i, 4);
  } else {
    PrefetchAhead(b.master16_in, i, 2);
    if constexpr (M == AdamMaster::kBF16Compensated) PrefetchAhead(b.comp_in, i, 2);
  }
  PrefetchAhead(b.m_in, i, S == AdamElem::kF32 ? 4 : 2);
  PrefetchAhead(b.v_in, i, S == AdamElem::kF32 ? 4 : 2);
  PrefetchAhead(b.grad, i, G == AdamElem::kF32 ? 4 : 2);
}
#endif  // JAXASCEND_ADAM_X86

}  // namespace adam_kernel
}  // namespace jaxascend
