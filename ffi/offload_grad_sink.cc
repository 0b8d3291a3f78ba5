// The gradient sink FFI target and an in-memory sink.
//
//   jaxascend_grad_sink(x, layer; sink, tensor) -> (sumsq, nonfinite)
//
// Called with has_side_effect=True from the backward rule of a custom_vjp identity, once per
// layer and tensor. It copies x out through the sink and, in the same pass, returns the
// statistics the optimizer needs before it may touch any state (overflow, global norm).
#include "offload_grad_sink.h"

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <stdexcept>
#include <limits>
#include <map>
#include <mutex>
#include <utility>
#include <vector>

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

// Copies each tensor's layers into one host buffer per tensor, at offset layer * layer_bytes.
class MemorySink : public GradientSink {
 public:
  void AddTensor(int64_t tensor, nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> buffer,
                 int64_t layer_bytes, int64_t arrivals) {
    if (arrivals < 1) throw nb::value_error("MemorySink.add_tensor: arrivals must be >= 1");
    if (layer_bytes <= 0 || buffer.shape(0) % static_cast<size_t>(layer_bytes) != 0) {
      throw nb::value_error(("MemorySink.add_tensor: buffer of " + std::to_string(buffer.shape(0)) +
                             " bytes is not a whole number of layers of " +
                             std::to_string(layer_bytes) + " bytes")
                                .c_str());
    }
    std::lock_guard<std::mutex> lock(mu_);
    tensors_[tensor] = Target{buffer, buffer.data(), buffer.shape(0), static_cast<size_t>(layer_bytes), arrivals,
                              std::vector<int64_t>(buffer.shape(0) / static_cast<size_t>(layer_bytes), 0)};
  }

  std::string Consume(int64_t tensor, int64_t layer, ffi::DataType dtype, const void* data,
                      size_t bytes, GradStats* stats) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tensors_.find(tensor);
    if (it == tensors_.end()) return "grad_sink: memory sink has no tensor " + std::to_string(tensor);
    Target& t = it->second;
    if (bytes != t.layer_bytes) {
      return "grad_sink: tensor " + std::to_string(tensor) + " expects " +
             std::to_string(t.layer_bytes) + " bytes per layer, got " + std::to_string(bytes);
    }
    const size_t offset = static_cast<size_t>(layer) * t.layer_bytes;
    if (layer < 0 || offset + bytes > t.total) {
      return "grad_sink: layer " + std::to_string(layer) + " is out of range for tensor " +
             std::to_string(tensor);
    }
    // Several arrivals of one layer (a tied table's uses) are summed, as the sink on SSD sums them.
    const int64_t seen = t.seen[static_cast<size_t>(layer)]++;
    if (seen % t.arrivals == 0) {
      std::memcpy(t.base + offset, data, bytes);
    } else {
      const int64_t n = static_cast<int64_t>(bytes) / (dtype == ffi::DataType::F32 ? 4 : 2);
      AddGradients(dtype, t.base + offset, data, t.base + offset, n);
      if ((seen + 1) % t.arrivals == 0) GradStatsOf(dtype, t.base + offset, n, stats);
    }
    if ((seen + 1) % t.arrivals != 0) *stats = GradStats();
    ++t.writes;
    return "";
  }

  int64_t Writes(int64_t tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tensors_.find(tensor);
    return it == tensors_.end() ? 0 : it->second.writes;
  }

 private:
  struct Target {
    nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> keep_alive;
    uint8_t* base;
    size_t total;
    size_t layer_bytes;
    int64_t arrivals = 1;
    std::vector<int64_t> seen;
    int64_t writes = 0;
  };
  std::mutex mu_;
  std::map<int64_t, Target> tensors_;
};

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
void BindGradSink(nb::module_& m) {
  nb::class_<MemorySink>(m, "MemorySink", "Gradient sink that copies layers into host byte buffers.")
      .def(nb::new_([]() { return std::make_shared<MemorySink>(); }))
      .def("add_tensor", &MemorySink::AddTensor, nb::arg("tensor"), nb::arg("buffer"),
           nb::arg("layer_bytes"), nb::arg("arrivals") = 1,
           "Routes tensor id `tensor` into `buffer` (uint8, layers back to back); `arrivals` per layer are summed.")
      .def("writes", &MemorySink::Writes, nb::arg("tensor"), "Number of layers consumed for a tensor.");
  m.def(
      "register_memory_sink",
      [](std::shared_ptr<MemorySink> sink) { return GradientSinks().Register(sink); }, nb::arg("sink"),
      "Makes a MemorySink reachable from jaxascend_grad_sink; returns its handle.");
  m.def(
      "unregister_sink", [](int64_t handle) { return GradientSinks().Remove(handle); }, nb::arg("handle"),
      "Removes a sink; later calls with its handle fail with an error.");
  // The host half of the sink for backends whose FFI calls cannot run on the host (GPU): the
  // jitted step copies the gradient to host memory with an io_callback and calls this.
  m.def(
      "consume_gradient",
      [](int64_t handle, int64_t tensor, int64_t layer, nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig> g,
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
      },
      nb::arg("handle"), nb::arg("tensor"), nb::arg("layer"), nb::arg("gradient"), nb::arg("dtype"),
      "Hands a host copy (raw bytes) of one layer's gradient to a sink; returns (sumsq, nonfinite).");
}
}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindGradSink);

}  // namespace jaxascend
