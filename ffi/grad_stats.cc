// Gradient statistics: the number of non-finite elements and the sum of squares
// of the finite ones, in one pass over an fp16/bf16/fp32 buffer.
//
// The overflow check (any non-finite => skip the step) and global-norm clipping
// both need exactly these two numbers, and neither needs a temporary buffer.
#include <cmath>
#include <cstdint>
#include <limits>

#include "dtypes.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxascend {
namespace {

struct GradStats {
  double sumsq = 0.0;
  int64_t nonfinite = 0;
};

// Typed implementation. `load` converts one element to float. Eight independent
// accumulators let the compiler keep several additions in flight.
template <typename T, typename Load>
GradStats ComputeGradStats(const T* x, int64_t n, Load load) {
  constexpr int kLanes = 8;
  double acc[kLanes] = {0};
  int64_t bad[kLanes] = {0};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    for (int l = 0; l < kLanes; ++l) {
      const float v = load(x[i + l]);
      const bool finite = std::isfinite(v);
      bad[l] += finite ? 0 : 1;
      const double d = finite ? static_cast<double>(v) : 0.0;
      acc[l] += d * d;
    }
  }
  GradStats s;
  for (; i < n; ++i) {
    const float v = load(x[i]);
    if (std::isfinite(v)) {
      s.sumsq += static_cast<double>(v) * v;
    } else {
      ++s.nonfinite;
    }
  }
  for (int l = 0; l < kLanes; ++l) {
    s.sumsq += acc[l];
    s.nonfinite += bad[l];
  }
  return s;
}

// Dispatch: checks the dtype and the outputs, then runs the typed implementation.
ffi::Error GradStatsDispatch(ffi::AnyBuffer x, ffi::ResultBuffer<ffi::F32> sumsq,
                             ffi::ResultBuffer<ffi::S32> nonfinite) {
  if (sumsq->element_count() != 1 || nonfinite->element_count() != 1) {
    return ffi::Error::InvalidArgument("grad_stats: outputs must be scalars");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  GradStats s;
  switch (x.element_type()) {
    case ffi::F32:
      s = ComputeGradStats(x.typed_data<float>(), n, [](float v) { return v; });
      break;
    case ffi::F16:
      s = ComputeGradStats(reinterpret_cast<const uint16_t*>(x.untyped_data()), n,
                           [](uint16_t v) { return HalfToFloat(v); });
      break;
    case ffi::BF16:
      s = ComputeGradStats(reinterpret_cast<const uint16_t*>(x.untyped_data()), n,
                           [](uint16_t v) { return BFloat16ToFloat(v); });
      break;
    default:
      return ffi::Error::InvalidArgument(
          "grad_stats: unsupported dtype (expected float16, bfloat16 or float32)");
  }
  sumsq->typed_data()[0] = static_cast<float>(s.sumsq);
  const int64_t cap = std::numeric_limits<int32_t>::max();
  nonfinite->typed_data()[0] = static_cast<int32_t>(s.nonfinite < cap ? s.nonfinite : cap);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGradStats, GradStatsDispatch,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()            // x: gradient, any shape
                                  .Ret<ffi::Buffer<ffi::F32>>()     // sum of squares of finite x
                                  .Ret<ffi::Buffer<ffi::S32>>());   // count of inf/NaN in x

JAXASCEND_REGISTER_FFI("jaxascend_grad_stats", kGradStats);

}  // namespace jaxascend
