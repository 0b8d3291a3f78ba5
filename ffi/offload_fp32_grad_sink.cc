// The fp32 host gradient buffer sink (the `offload.fp32_grad_buffer` ablation).
//
// ZeRO-Offload / ZeRO-Infinity keep a full fp32 copy of the gradients in host memory (4 B per
// parameter) that the CPU optimizer reads. This sink reproduces that habit so its cost can be
// measured: jaxascend_grad_sink (offload_grad_sink.cc) hands it each layer's gradient in the compute
// dtype, and Consume widens it (exactly: fp16/bf16 -> fp32 is lossless) into its place in one
// caller-owned float32 buffer holding every parameter's gradient. The optimizer step then reads
// the gradients from that buffer instead of from the SSD store.
//
// Routing: tensor id -> (first element in the buffer, layers, elements per layer, dtype); layer
// l of the tensor lands at element offset + l * layer_elements. Receipts are counted per
// (tensor, layer), as the SSD store sink does, so a step can refuse stale gradients.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <utility>

#include "dtypes.h"
#include "offload_grad_sink.h"
#include "offload_grad_sink_routes.h"
#include "registry.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

using Fp32Buffer = nb::ndarray<float, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

size_t ItemSize(ffi::DataType type) { return type == ffi::F32 ? 4 : 2; }

// Widens `n` elements of `type` at `src` into `dst` (exact for every supported dtype).
void WidenToFloat(ffi::DataType type, const void* src, float* dst, int64_t n) {
  if (type == ffi::F32) {
    std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(src);
  if (type == ffi::BF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(in[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(in[i]);
  }
}

// dst[i] = widen(round(dst[i] + widen(src[i]))): the sum of two arrivals in the compute dtype
// (dst holds the first one widened), as AddGradients computes it.
void AddWidened(ffi::DataType type, const void* src, float* dst, int64_t n) {
  if (type == ffi::F32) {
    const float* in = static_cast<const float*>(src);
    for (int64_t i = 0; i < n; ++i) dst[i] += in[i];
    return;
  }
  const uint16_t* in = static_cast<const uint16_t*>(src);
  if (type == ffi::BF16) {
    for (int64_t i = 0; i < n; ++i) dst[i] = BFloat16ToFloat(FloatToBFloat16(dst[i] + BFloat16ToFloat(in[i])));
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] = HalfToFloat(FloatToHalf(dst[i] + HalfToFloat(in[i])));
  }
}

class Fp32BufferSink : public GradientSink {
 public:
  explicit Fp32BufferSink(Fp32Buffer buffer) : buffer_(buffer), base_(buffer.data()), size_(buffer.shape(0)) {}

  // Routes tensor id `tensor`: `layers` layers of `layer_elements` each, from element `offset`.
  void AddTensor(int64_t tensor, int64_t offset, int64_t layers, int64_t layer_elements,
                 const std::string& dtype_name, int64_t arrivals) {
    CheckArrivals("Fp32BufferSink.add_tensor", arrivals);
    const std::string what = "Fp32BufferSink.add_tensor(" + std::to_string(tensor) + ")";
    const ffi::DataType dtype = ParseGradDtypeOrThrow(what, dtype_name);
    if (offset < 0 || layers < 1 || layer_elements < 1) {
      throw nb::value_error((what + ": offset must be >= 0 and layers, layer_elements >= 1, got offset=" +
                             std::to_string(offset) + " layers=" + std::to_string(layers) +
                             " layer_elements=" + std::to_string(layer_elements))
                                .c_str());
    }
    if (offset + layers * layer_elements > static_cast<int64_t>(size_)) {
      throw nb::value_error((what + ": elements [" + std::to_string(offset) + ", " +
                             std::to_string(offset + layers * layer_elements) + ") do not fit the buffer of " +
                             std::to_string(size_) + " float32 elements")
                                .c_str());
    }
    const auto layer_bytes = static_cast<int64_t>(static_cast<size_t>(layer_elements) * ItemSize(dtype));
    auto target = std::make_shared<Target>(layers, layer_bytes, arrivals, dtype);
    target->offset = offset;
    target->layer_elements = layer_elements;
    routes_.Add(what, tensor, std::move(target));
  }

  std::string Consume(int64_t tensor, int64_t layer, ffi::DataType dtype, const void* data,
                      size_t bytes, GradStats* stats) override {
    std::string error;
    std::shared_ptr<Target> t = routes_.FindLayer(tensor, layer, dtype, bytes, &error);
    if (!t) return error;
    float* dst = base_ + t->offset + layer * t->layer_elements;
    const Arrival arrival(t->received[layer].fetch_add(1, std::memory_order_relaxed), t->arrivals);
    if (arrival.first) {
      // Layers of different (tensor, layer) pairs never overlap, so no lock is held while copying.
      WidenToFloat(dtype, data, dst, t->layer_elements);
    } else {
      // A later arrival of a tied table's gradient: summed in the compute dtype's arithmetic
      // (what the SSD sink stores), one element at a time, then widened back in place.
      AddWidened(dtype, data, dst, t->layer_elements);
      if (arrival.last) *stats = ComputeGradStats(dst, t->layer_elements, [](float v) { return v; });
    }
    if (!arrival.last) *stats = GradStats();
    return "";
  }

  auto& routes() { return routes_; }  // received() and reset() (BindReceipts)

 private:
  struct Target : RoutedTensor {
    using RoutedTensor::RoutedTensor;
    int64_t offset = 0;
    int64_t layer_elements = 0;
  };

  Fp32Buffer buffer_;  // keeps the numpy buffer alive while the sink may write into it
  float* base_;
  size_t size_;
  SinkRoutes<Target> routes_{"Fp32BufferSink", "the fp32 buffer sink", "takes"};
};

void BindFp32BufferSink(nb::module_& m) {
  nb::class_<Fp32BufferSink> cls(m, "Fp32BufferSink",
                                 "Gradient sink that widens each layer into its place in one float32 host buffer.");
  cls.def(nb::new_([](Fp32Buffer buffer) { return std::make_shared<Fp32BufferSink>(buffer); }), nb::arg("buffer"))
      .def("add_tensor", &Fp32BufferSink::AddTensor, nb::arg("tensor"), nb::arg("offset"), nb::arg("layers"),
           nb::arg("layer_elements"), nb::arg("dtype"), nb::arg("arrivals") = 1,
           "Routes tensor id `tensor` (layers x layer_elements, dtype) to the buffer from element `offset`.");
  BindReceipts(cls);
  m.def(
      "register_fp32_buffer_sink", [](std::shared_ptr<Fp32BufferSink> sink) { return GradientSinks().Register(sink); },
      nb::arg("sink"), "Makes an Fp32BufferSink reachable from jaxascend_grad_sink; returns its handle.");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindFp32BufferSink);

}  // namespace jaxascend
