// The table of live gradient sinks and the gradient sink FFI target.
//
//   jaxascend_grad_sink(x, layer; sink, tensor) -> (sumsq, nonfinite)
//
// Called with has_side_effect=True from the backward rule of a custom_vjp identity, once per
// layer and tensor. It copies x out through the sink and, in the same pass, returns the
// statistics the optimizer needs before it may touch any state (overflow, global norm).
// The sinks themselves live in their own files (offload_grad_sink.h lists them); the host entry
// for GPU backends is offload_grad_sink_host.cc.
#include "offload_grad_sink.h"

#include <nanobind/nanobind.h>

#include <limits>
#include <memory>
#include <string>

#include "optim_grad_stats.h"
#include "registry.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {

HandleTable<GradientSink>& GradientSinks() {
  static HandleTable<GradientSink> table("gradient sink");
  return table;
}

namespace {

// Dispatch: finds the sink, checks the layer index, computes the statistics and consumes x.
ffi::Error GradSinkDispatch(ffi::AnyBuffer x, ffi::Buffer<ffi::S32> layer,
                            ffi::ResultBuffer<ffi::F32> sumsq,
                            ffi::ResultBuffer<ffi::S32> nonfinite, int64_t sink, int64_t tensor) {
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("grad_sink: layer must be a scalar");
  std::shared_ptr<GradientSink> target = GradientSinks().Find(sink);
  if (!target) return ffi::Error::InvalidArgument("grad_sink: " + GradientSinks().Missing(sink));
  GradStats s;
  const int64_t n = static_cast<int64_t>(x.element_count());
  if (!GradStatsOf(x.element_type(), x.untyped_data(), n, &s)) {
    return ffi::Error::InvalidArgument(
        "grad_sink: unsupported gradient dtype (expected float16, bfloat16 or float32)");
  }
  std::string err = target->Consume(tensor, layer.typed_data()[0], x.element_type(),
                                    x.untyped_data(), x.size_bytes(), &s);
  if (!err.empty()) return ffi::Error::Internal(err);
  sumsq->typed_data()[0] = static_cast<float>(s.sumsq);
  const int64_t cap = std::numeric_limits<int32_t>::max();
  nonfinite->typed_data()[0] = static_cast<int32_t>(s.nonfinite < cap ? s.nonfinite : cap);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kGradSink, GradSinkDispatch,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()           // x: one layer's gradient
                                  .Arg<ffi::Buffer<ffi::S32>>()    // layer: index in the stack
                                  .Ret<ffi::Buffer<ffi::F32>>()    // sum of squares of finite x
                                  .Ret<ffi::Buffer<ffi::S32>>()    // count of inf/NaN in x
                                  .Attr<int64_t>("sink")           // handle from GradientSinks()
                                  .Attr<int64_t>("tensor"));       // sink-defined tensor id

JAXASCEND_REGISTER_FFI("jaxascend_grad_sink", kGradSink);

namespace {
// Each sink's file binds its own register_*_sink; removing one is the same for every kind.
void BindSinkTable(nb::module_& m) {
  m.def(
      "unregister_sink", [](int64_t handle) { return GradientSinks().Remove(handle); }, nb::arg("handle"),
      "Removes a sink; later calls with its handle fail with an error.");
}
}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindSinkTable);

}  // namespace jaxascend
