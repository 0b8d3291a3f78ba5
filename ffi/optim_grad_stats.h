// Gradient statistics over one buffer: non-finite count and sum of squares of the finite
// elements. Shared by the grad_stats target and the gradient sink, which computes them in the
// same pass that copies a gradient out.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtypes.h"
#include "xla/ffi/api/ffi.h"

namespace jaxascend {

struct GradStats {
  double sumsq = 0.0;
  int64_t nonfinite = 0;
};

// Typed implementation. `load` converts one element to float. Eight independent
// accumulators let the compiler keep several additions in flight.
template <typename T, typename Load>
inline GradStats ComputeGradStats(const T* x, int64_t n, Load load) {
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

// Runs ComputeGradStats for an fp16/bf16/fp32 buffer; false for any other dtype.
inline bool GradStatsOf(xla::ffi::DataType dtype, const void* data, int64_t n, GradStats* out) {
  switch (dtype) {
    case xla::ffi::DataType::F32:
      *out = ComputeGradStats(static_cast<const float*>(data), n, [](float v) { return v; });
      return true;
    case xla::ffi::DataType::F16:
      *out = ComputeGradStats(static_cast<const uint16_t*>(data), n,
                              [](uint16_t v) { return HalfToFloat(v); });
      return true;
    case xla::ffi::DataType::BF16:
      *out = ComputeGradStats(static_cast<const uint16_t*>(data), n,
                              [](uint16_t v) { return BFloat16ToFloat(v); });
      return true;
    default:
      return false;
  }
}

}  // namespace jaxascend
