// Gradient statistics: the number of non-finite elements and the sum of squares
// of the finite ones, in one pass over an fp16/bf16/fp32 buffer.
//
// The overflow check (any non-finite => skip the step) and global-norm clipping
// both need exactly these two numbers, and neither needs a temporary buffer.
#include <cmath>
#include <cstdint>
#include <limits>

#include "optim_grad_stats.h"
#include "registry.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxascend {
namespace {

// Dispatch: checks the dtype and the outputs, then runs the typed implementation.
ffi::Error GradStatsDispatch(ffi::AnyBuffer x, ffi::ResultBuffer<ffi::F32> sumsq,
                             ffi::ResultBuffer<ffi::S32> nonfinite) {
  if (sumsq->element_count() != 1 || nonfinite->element_count() != 1) {
    return ffi::Error::InvalidArgument("grad_stats: outputs must be scalars");
  }
  const int64_t n = static_cast<int64_t>(x.element_count());
  GradStats s;
  if (!GradStatsOf(x.element_type(), x.untyped_data(), n, &s)) {
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
