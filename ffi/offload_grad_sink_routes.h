// The setup the gradient sinks share (offload_grad_sink.h lists them): the checks of their
// add_tensor, the table of routed tensors with per-layer receipts and the checks of Consume
// (StoreSink, Fp32BufferSink), and which arrival of its layer one Consume is (every sink, a tied
// table's gradient arriving once per use).
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "offload_grad_sink.h"

namespace jaxascend {

// Which of its layer's `arrivals` uses one Consume is, from how many came before it (`seen`):
// the first is stored as it is, a later one is added to what is stored, and only the last
// reports statistics (those of the sum; the others report zeros).
struct Arrival {
  Arrival(int64_t seen, int64_t arrivals) : first(seen % arrivals == 0), last((seen + 1) % arrivals == 0) {}
  bool first;
  bool last;
};

// add_tensor's check of `arrivals`; `what` (e.g. "StoreSink.add_tensor(3)") starts the ValueError.
inline void CheckArrivals(const std::string& what, int64_t arrivals) {
  if (arrivals < 1) throw nanobind::value_error((what + ": arrivals must be >= 1").c_str());
}

// add_tensor's gradient dtype by name; a ValueError starting with `what` for any other name.
inline xla::ffi::DataType ParseGradDtypeOrThrow(const std::string& what, const std::string& name) {
  xla::ffi::DataType dtype;
  if (!ParseGradDtype(name, &dtype)) {
    throw nanobind::value_error((what + ": dtype '" + name + "' is not float32, float16 or bfloat16").c_str());
  }
  return dtype;
}

// One routed tensor of a sink that counts receipts: `layers` layers of `layer_bytes` bytes of
// `dtype`, `arrivals` uses summed per layer (2 for a tied table), and per layer how many Consumes
// came since Reset(), so the step can refuse a gradient that never arrived (a stale one from the
// previous step). A sink's own target derives from it and adds where the bytes go.
struct RoutedTensor {
  RoutedTensor(int64_t layers, int64_t layer_bytes, int64_t arrivals, xla::ffi::DataType dtype)
      : layers(layers),
        layer_bytes(layer_bytes),
        arrivals(arrivals),
        dtype(dtype),
        received(new std::atomic<int64_t>[layers]) {
    for (int64_t i = 0; i < layers; ++i) received[i].store(0);
  }
  int64_t layers;
  int64_t layer_bytes;
  int64_t arrivals;
  xla::ffi::DataType dtype;
  std::unique_ptr<std::atomic<int64_t>[]> received;
};

// The checks a sink makes before it takes one layer of a tensor: the layer index, the dtype it
// `verb`s ("stores", "takes") and the byte size. Returns "" when all hold, else the message.
inline std::string CheckGradientLayer(int64_t tensor, int64_t layer, const RoutedTensor& t, const char* verb,
                                      xla::ffi::DataType dtype, size_t bytes) {
  const std::string name = "grad_sink: tensor " + std::to_string(tensor);
  if (layer < 0 || layer >= t.layers) {
    return "grad_sink: layer " + std::to_string(layer) + " is out of range for tensor " + std::to_string(tensor) +
           " (" + std::to_string(t.layers) + " layers)";
  }
  if (dtype != t.dtype) {
    return name + " " + verb + " " + GradDtypeName(t.dtype) + " gradients, got " + GradDtypeName(dtype);
  }
  const size_t want_bytes = static_cast<size_t>(t.layer_bytes);
  if (bytes != want_bytes) {
    return name + " expects " + std::to_string(want_bytes) + " bytes per layer, got " + std::to_string(bytes);
  }
  return "";
}

// A sink's routed tensors by id; add_tensor may run while a backward pass consumes, so every
// access holds the table's lock. `sink` names the class in received()'s messages ("StoreSink"),
// `noun` the sink in Consume's ("the SSD store sink"), `verb` what it does with a gradient
// ("stores").
template <typename Target>
class SinkRoutes {
 public:
  SinkRoutes(std::string sink, std::string noun, const char* verb)
      : sink_(std::move(sink)), noun_(std::move(noun)), verb_(verb) {}

  // Routes `tensor` to `target`, complete before it becomes visible; a ValueError starting with
  // `what` when the tensor is already routed.
  void Add(const std::string& what, int64_t tensor, std::shared_ptr<Target> target) {
    std::lock_guard<std::mutex> lock(mu_);
    if (!targets_.emplace(tensor, std::move(target)).second) {
      throw nanobind::value_error((what + ": tensor " + std::to_string(tensor) + " is already routed").c_str());
    }
  }

  std::shared_ptr<Target> Find(int64_t tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = targets_.find(tensor);
    return it == targets_.end() ? nullptr : it->second;
  }

  // The target of layer `layer` of `tensor` when Consume may take that layer (the tensor is
  // routed; the layer, the dtype and the byte size are those routed); else nullptr and *error.
  std::shared_ptr<Target> FindLayer(int64_t tensor, int64_t layer, xla::ffi::DataType dtype, size_t bytes,
                                    std::string* error) {
    std::shared_ptr<Target> t = Find(tensor);
    if (!t) {
      *error = "grad_sink: " + noun_ + " has no tensor " + std::to_string(tensor);
      return nullptr;
    }
    *error = CheckGradientLayer(tensor, layer, *t, verb_, dtype, bytes);
    return error->empty() ? t : nullptr;
  }

  // How many times each layer of `tensor` was consumed since the last Reset().
  std::vector<int64_t> Received(int64_t tensor) {
    std::shared_ptr<Target> t = Find(tensor);
    if (!t) throw nanobind::value_error((sink_ + ".received: no tensor " + std::to_string(tensor)).c_str());
    std::vector<int64_t> out(static_cast<size_t>(t->layers));
    for (size_t i = 0; i < out.size(); ++i) out[i] = t->received[i].load();
    return out;
  }

  void Reset() {
    ForEach([](Target& t) {
      for (int64_t i = 0; i < t.layers; ++i) t.received[i].store(0);
    });
  }

  // Runs fn(Target&) for every routed tensor, holding the lock.
  template <typename Fn>
  void ForEach(Fn fn) {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, t] : targets_) fn(*t);
  }

 private:
  std::string sink_;
  std::string noun_;
  const char* verb_;
  std::mutex mu_;  // guards targets_
  std::map<int64_t, std::shared_ptr<Target>> targets_;
};

// The receipt methods of a sink class with a SinkRoutes `routes()`: received(tensor), reset().
template <typename Sink>
void BindReceipts(nanobind::class_<Sink>& cls) {
  cls.def(
         "received", [](Sink& sink, int64_t tensor) { return sink.routes().Received(tensor); },
         nanobind::arg("tensor"), "Per layer, how many times the sink consumed it since reset().")
      .def(
          "reset", [](Sink& sink) { sink.routes().Reset(); }, "Zeroes the receipt counters.");
}

}  // namespace jaxascend
