// Gradient sinks: where a gradient goes the moment the backward pass computes it.
//
// The FFI target jaxascend_grad_sink (offload_grad_sink.cc) is called inside a jitted backward pass
// with one layer's gradient of one tensor; it computes the overflow/norm statistics and hands
// the bytes to a sink found by an integer handle. On backends whose FFI calls cannot run on the
// host (GPU), consume_gradient (offload_grad_sink_host.cc) does the same with a host copy. The
// sinks: StoreSink (offload_store_sink.cc) stages the bytes in the arena and queues their write
// to the SSD store; Fp32BufferSink (offload_fp32_grad_sink.cc) widens them into one float32 host
// buffer (the fp32_grad_buffer ablation); MemorySink (offload_memory_sink.cc) copies into host
// arrays. What their setup shares (add_tensor's checks, the routed tensors and their receipts,
// the arrival count of a tied table) is in offload_grad_sink_routes.h.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dtypes.h"
#include "handle_table.h"
#include "optim_grad_stats.h"
#include "xla/ffi/api/ffi.h"

namespace jaxascend {

class GradientSink {
 public:
  virtual ~GradientSink() = default;
  // Takes `bytes` bytes of gradient `tensor` (a sink-defined id) for layer `layer` (0 for
  // tensors outside the layer stack). `stats` holds the statistics of `data` on entry; a sink
  // that sums several arrivals of one layer (a tied table's uses) sets them to zero for all but
  // the last arrival and to those of the sum for the last, so the step's totals are the summed
  // gradient's. Returns an empty string on success, else an error message.
  virtual std::string Consume(int64_t tensor, int64_t layer, xla::ffi::DataType dtype,
                              const void* data, size_t bytes, GradStats* stats) = 0;
};

// out[i] = prev[i] + add[i] for n elements of `dtype`, as XLA adds two 16-bit arrays on the CPU:
// in float32, rounded back to nearest even; float32 adds directly. `out` may alias `prev`.
inline void AddGradients(xla::ffi::DataType dtype, const void* prev, const void* add, void* out, int64_t n) {
  if (dtype == xla::ffi::DataType::F32) {
    const float* a = static_cast<const float*>(prev);
    const float* b = static_cast<const float*>(add);
    float* o = static_cast<float*>(out);
    for (int64_t i = 0; i < n; ++i) o[i] = a[i] + b[i];
    return;
  }
  const uint16_t* a = static_cast<const uint16_t*>(prev);
  const uint16_t* b = static_cast<const uint16_t*>(add);
  uint16_t* o = static_cast<uint16_t*>(out);
  if (dtype == xla::ffi::DataType::BF16) {
    for (int64_t i = 0; i < n; ++i) o[i] = FloatToBFloat16(BFloat16ToFloat(a[i]) + BFloat16ToFloat(b[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) o[i] = FloatToHalf(HalfToFloat(a[i]) + HalfToFloat(b[i]));
  }
}

// Gradient dtypes by the names Python passes ("float32", "float16", "bfloat16").
inline bool ParseGradDtype(const std::string& name, xla::ffi::DataType* type) {
  if (name == "float32") *type = xla::ffi::DataType::F32;
  else if (name == "float16") *type = xla::ffi::DataType::F16;
  else if (name == "bfloat16") *type = xla::ffi::DataType::BF16;
  else return false;
  return true;
}

inline const char* GradDtypeName(xla::ffi::DataType type) {
  switch (type) {
    case xla::ffi::DataType::F32: return "float32";
    case xla::ffi::DataType::F16: return "float16";
    case xla::ffi::DataType::BF16: return "bfloat16";
    default: return "another dtype";
  }
}

// The process-wide table of live sinks (offload_grad_sink.cc): each sink's register_*_sink
// binding adds it, unregister_sink removes it, jaxascend_grad_sink and consume_gradient find it.
HandleTable<GradientSink>& GradientSinks();

}  // namespace jaxascend
