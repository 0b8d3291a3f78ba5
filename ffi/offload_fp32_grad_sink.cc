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
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "dtypes.h"
#include "offload_grad_sink.h"
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
    if (arrivals < 1) throw nb::value_error("Fp32BufferSink.add_tensor: arrivals must be >= 1");
    const std::string what = "Fp32BufferSink.add_tensor(" + std::to_string(tensor) + ")";
    ffi::DataType dtype;
    if (!ParseGradDtype(dtype_name, &dtype)) {
      throw nb::value_error((what + ": dtype '" + dtype_name + "' is not float32, float16 or bfloat16").c_str());
    }
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
    auto target = std::make_shared<Target>();
    target->offset = offset;
    target->layers = layers;
    target->layer_elements = layer_elements;
    target->dtype = dtype;
    target->arrivals = arrivals;
    target->received.reset(new std::atomic<int64_t>[layers]);
    for (int64_t i = 0; i < layers; ++i) target->received[i].store(0);
    std::lock_guard<std::mutex> lock(mu_);
    if (!targets_.emplace(tensor, std::move(target)).second) {
      throw nb::value_error((what + ": tensor " + std::to_string(tensor) + " is already routed").c_str());
    }
  }

  std::string Consume(int64_t tensor, int64_t layer, ffi::DataType dtype, const void* data,
                      size_t bytes, GradStats* stats) override {
    std::shared_ptr<Target> t = FindTarget(tensor);
    if (!t) return "grad_sink: the fp32 buffer sink has no tensor " + std::to_string(tensor);
    std::string bad = CheckGradientLayer(tensor, layer, t->layers, "takes", t->dtype, dtype,
                                         static_cast<size_t>(t->layer_elements) * ItemSize(t->dtype), bytes);
    if (!bad.empty()) return bad;
    float* dst = base_ + t->offset + layer * t->layer_elements;
    const int64_t seen = t->received[layer].fetch_add(1, std::memory_order_relaxed);
    if (seen % t->arrivals == 0) {
      // Layers of different (tensor, layer) pairs never overlap, so no lock is held while copying.
      WidenToFloat(dtype, data, dst, t->layer_elements);
    } else {
      // A later arrival of a tied table's gradient: summed in the compute dtype's arithmetic
      // (what the SSD sink stores), one element at a time, then widened back in place.
      AddWidened(dtype, data, dst, t->layer_elements);
      if ((seen + 1) % t->arrivals == 0) *stats = ComputeGradStats(dst, t->layer_elements, [](float v) { return v; });
    }
    if ((seen + 1) % t->arrivals != 0) *stats = GradStats();
    return "";
  }

  // How many times each layer of `tensor` was consumed since the last Reset().
  std::vector<int64_t> Received(int64_t tensor) {
    std::shared_ptr<Target> t = FindTarget(tensor);
    if (!t) throw nb::value_error(("Fp32BufferSink.received: no tensor " + std::to_string(tensor)).c_str());
    std::vector<int64_t> out(static_cast<size_t>(t->layers));
    for (size_t i = 0; i < out.size(); ++i) out[i] = t->received[i].load();
    return out;
  }

  void Reset() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, t] : targets_) {
      for (int64_t i = 0; i < t->layers; ++i) t->received[i].store(0);
    }
  }

 private:
  struct Target {
    int64_t offset = 0;
    int64_t layers = 0;
    int64_t layer_elements = 0;
    int64_t arrivals = 1;
    ffi::DataType dtype = ffi::F32;
    std::unique_ptr<std::atomic<int64_t>[]> received;
  };

  std::shared_ptr<Target> FindTarget(int64_t tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = targets_.find(tensor);
    return it == targets_.end() ? nullptr : it->second;
  }

  Fp32Buffer buffer_;  // keeps the numpy buffer alive while the sink may write into it
  float* base_;
  size_t size_;
  std::mutex mu_;  // guards targets_
  std::map<int64_t, std::shared_ptr<Target>> targets_;
};

void BindFp32BufferSink(nb::module_& m) {
  nb::class_<Fp32BufferSink>(m, "Fp32BufferSink",
                             "Gradient sink that widens each layer into its place in one float32 host buffer.")
      .def(nb::new_([](Fp32Buffer buffer) { return std::make_shared<Fp32BufferSink>(buffer); }), nb::arg("buffer"))
      .def("add_tensor", &Fp32BufferSink::AddTensor, nb::arg("tensor"), nb::arg("offset"), nb::arg("layers"),
           nb::arg("layer_elements"), nb::arg("dtype"), nb::arg("arrivals") = 1,
           "Routes tensor id `tensor` (layers x layer_elements, dtype) to the buffer from element `offset`.")
      .def("received", &Fp32BufferSink::Received, nb::arg("tensor"),
           "Per layer, how many times the sink consumed it since reset().")
      .def("reset", &Fp32BufferSink::Reset, "Zeroes the receipt counters.");
  m.def(
      "register_fp32_buffer_sink", [](std::shared_ptr<Fp32BufferSink> sink) { return GradientSinks().Register(sink); },
      nb::arg("sink"), "Makes an Fp32BufferSink reachable from jaxascend_grad_sink; returns its handle.");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindFp32BufferSink);

}  // namespace jaxascend
