// MemorySink: a gradient sink that copies each layer into a host byte buffer per tensor.
//
// jaxascend_grad_sink (offload_grad_sink.cc) hands it one layer of one tensor at a time; it
// copies the bytes to offset layer * layer_bytes of the tensor's buffer. Several arrivals of one
// layer (a tied table's lookup and head) are summed as XLA adds 16-bit arrays, as the SSD store
// sink sums them, and the last one carries the statistics of the sum.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>

#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload_grad_sink.h"
#include "offload_grad_sink_routes.h"
#include "optim_grad_stats.h"
#include "registry.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

// Copies each tensor's layers into one host buffer per tensor, at offset layer * layer_bytes.
class MemorySink : public GradientSink {
 public:
  void AddTensor(int64_t tensor, nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> buffer,
                 int64_t layer_bytes, int64_t arrivals) {
    CheckArrivals("MemorySink.add_tensor", arrivals);
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
    const Arrival arrival(t.seen[static_cast<size_t>(layer)]++, t.arrivals);
    if (arrival.first) {
      std::memcpy(t.base + offset, data, bytes);
    } else {
      const int64_t n = static_cast<int64_t>(bytes) / (dtype == ffi::DataType::F32 ? 4 : 2);
      AddGradients(dtype, t.base + offset, data, t.base + offset, n);
      if (arrival.last) GradStatsOf(dtype, t.base + offset, n, stats);
    }
    if (!arrival.last) *stats = GradStats();
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

void BindMemorySink(nb::module_& m) {
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
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindMemorySink);

}  // namespace jaxascend
