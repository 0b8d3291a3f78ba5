// The host half of the gradient sink for backends whose FFI calls cannot run on the host (GPU).
//
//   consume_gradient(handle, tensor, layer, gradient, dtype) -> (sumsq, nonfinite)
//
// The jitted step copies one layer's gradient to host memory with an io_callback and calls this
// with its raw bytes: the same work as the FFI target jaxascend_grad_sink (offload_grad_sink.cc),
// statistics first, then the sink's Consume with the GIL released.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <utility>

#include "offload_grad_sink.h"
#include "optim_grad_stats.h"
#include "registry.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

std::pair<float, int64_t> ConsumeGradient(int64_t handle, int64_t tensor, int64_t layer,
                                          nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig> g,
                                          const std::string& dtype) {
  std::shared_ptr<GradientSink> target = GradientSinks().Find(handle);
  if (!target) throw nb::value_error(("grad_sink: " + GradientSinks().Missing(handle)).c_str());
  ffi::DataType type;
  if (!ParseGradDtype(dtype, &type)) {
    throw nb::value_error(("grad_sink: unsupported gradient dtype " + dtype).c_str());
  }
  GradStats s;
  const int64_t itemsize = type == ffi::DataType::F32 ? 4 : 2;
  GradStatsOf(type, g.data(), static_cast<int64_t>(g.size()) / itemsize, &s);
  std::string err;
  {
    nb::gil_scoped_release release;
    err = target->Consume(tensor, layer, type, g.data(), g.size(), &s);
  }
  if (!err.empty()) throw std::runtime_error(err);
  return std::make_pair(static_cast<float>(s.sumsq), s.nonfinite);
}

void BindGradSinkHost(nb::module_& m) {
  m.def("consume_gradient", &ConsumeGradient, nb::arg("handle"), nb::arg("tensor"), nb::arg("layer"),
        nb::arg("gradient"), nb::arg("dtype"),
        "Hands a host copy (raw bytes) of one layer's gradient to a sink; returns (sumsq, nonfinite).");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindGradSinkHost);

}  // namespace jaxascend
