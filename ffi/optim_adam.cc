// Fused host AdamW kernel (see optim_adam.h): run-time ISA selection and RunFusedAdamW, which
// splits the elements over the compute pool and runs the chosen variant's range on each part.
// The variants: optim_adam_scalar.h, optim_adam_avx2.cc, optim_adam_avx512.cc (what they share
// and why they agree bit for bit: optim_adam_kernel.h). The FFI target is optim_adam_ffi.cc,
// the numpy entry optim_adam_bindings.cc; both call RunFusedAdamW.
#include "optim_adam.h"

#include <cstdlib>
#include <cstring>
#include <string>

#include "optim_compute_pool.h"
#include "optim_adam_scalar.h"  // last: see optim_adam_kernel.h

namespace jaxascend {
namespace {

using namespace adam_kernel;

#if JAXASCEND_ADAM_X86
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

JAXASCEND_ADAM_KERNEL(ScalarKernel, AdamRangeScalar, AdamElem::kF32)
JAXASCEND_ADAM_KERNEL(ScalarBf16Kernel, AdamRangeScalar, AdamElem::kBF16)
template <AdamElem G, AdamElem P, AdamMaster M>
struct ScalarInt8Kernel {
  static constexpr AdamRangeFn fn = AdamRangeInt8Scalar<G, P, M>;
};

AdamRangeFn RangeFor(AdamIsa isa, const AdamBuffers& b) {
  const AdamState state = b.state_type;
  const AdamMaster master = b.master_type;
  const AdamElem g = b.grad_type, p = b.param_type;
#if JAXASCEND_ADAM_X86
  if (state == AdamState::kInt8 && (isa == AdamIsa::kAvx512 || isa == AdamIsa::kAvx2)) {
    return Avx2Range(state, master, g, p);  // no AVX-512 variant of its own
  }
  if (isa == AdamIsa::kAvx512) return Avx512Range(state, master, g, p);
  if (isa == AdamIsa::kAvx2) return Avx2Range(state, master, g, p);
#else
  (void)isa;  // only the scalar path is built
#endif
  if (state == AdamState::kInt8) return SelectRange<ScalarInt8Kernel>(master, g, p);
  return state == AdamState::kBF16 ? SelectRange<ScalarBf16Kernel>(master, g, p)
                                   : SelectRange<ScalarKernel>(master, g, p);
}

// "" or what is wrong with b's master buffers (the top of optim_adam.h says what each format
// needs); the pointers of an empty call are not looked at.
std::string CheckMaster(const AdamBuffers& b) {
  if (b.master_type != AdamMaster::kF32 && b.param_type != AdamElem::kBF16) {
    return std::string("adamw: a bfloat16 master needs bfloat16 params_out, got ") + AdamElemName(b.param_type);
  }
  if (b.n == 0) return "";
  if (b.master_type == AdamMaster::kF32) {
    return b.master_in == nullptr || b.master_out == nullptr ? "adamw: a float32 master needs master_in and master_out"
                                                             : "";
  }
  if (b.master16_in == nullptr || b.master16_out == nullptr) {
    return "adamw: a bfloat16 master needs master16_in and master16_out";
  }
  if (b.master_type == AdamMaster::kBF16Compensated && (b.comp_in == nullptr || b.comp_out == nullptr)) {
    return "adamw: a compensated bfloat16 master needs comp_in and comp_out";
  }
  return "";
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

const char* AdamElemName(AdamElem elem) {
  switch (elem) {
    case AdamElem::kF32: return "float32";
    case AdamElem::kF16: return "float16";
    case AdamElem::kBF16: return "bfloat16";
  }
  return "unknown";
}

AdamScalars AdamScalarsFromArray(const float* values) {
  AdamScalars s;
  static_assert(sizeof(AdamScalars) == kAdamScalarCount * sizeof(float), "packed floats");
  std::memcpy(&s, values, sizeof s);
  return s;
}

std::string AdamCountMismatch(const char* name, int64_t count, int64_t n) {
  return std::string("adamw: ") + name + " has " + std::to_string(count) + " elements but master has " +
         std::to_string(n);
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
  error = CheckMaster(b);
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
  const AdamRangeFn range = RangeFor(resolved, b);
  ParallelFor(b.n, threads, align, kMinElementsPerThread,
              [&](int64_t begin, int64_t end) {
                DefaultFloatEnvironment env;
                range(b, s, begin, end);
              });
  return "";
}

}  // namespace jaxascend
