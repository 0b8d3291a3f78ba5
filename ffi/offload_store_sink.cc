// The SSD gradient sink: each layer's gradient goes from the backward pass straight into its
// region of the shard store.
//
// jaxascend_grad_sink (offload_grad_sink.cc) calls Consume(tensor, layer, dtype, data, bytes) once per
// tensor and layer while the jitted backward pass runs. `data` is only valid during that call,
// so Consume copies it into the store's arena staging slots and queues the write
// (ShardStore::WriteFromHost without waiting): the backward pass goes on while the disk
// writes, and it only stalls when every staging slot is still in flight. A write that fails
// after Consume returned is reported by the next Consume or by the store's Flush(), which the
// optimizer step calls before it reads any gradient region.
//
// Routing: tensor id -> one store region per layer, each exactly one layer's bytes, so every
// write starts at offset 0 and ends at the region's end (the store's alignment rule holds for
// any layer size). The sink also counts what it received per (tensor, layer), so the step can
// refuse to run on a gradient that never arrived (a stale one from the previous step).
//
// A tensor may expect several arrivals per layer (`arrivals`: a tied table's lookup and head
// each send their gradient, block by block): the first is written as above; a later one is
// added to what the region holds, piece by piece through a staging-sized buffer (read back,
// AddGradients, write), and the last one carries the statistics of the sum (the others report
// zeros), so the step's overflow check and norm see the summed gradient.
//
// Receipts for the overlapped step: Hold() marks every region as still being read by the
// optimizer; the optimizer Release()s each (tensor, layer) once it has read that layer's
// gradient. A gradient that arrives for a held region is refused with an error (it would
// overwrite what the optimizer of the previous step has not read yet): the ordering the
// overlapped step relies on is checked on every arrival, not assumed.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "offload_grad_sink.h"
#include "offload_grad_sink_routes.h"
#include "registry.h"
#include "ssd_shard_store.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

constexpr int32_t kNoMirror = -1;  // a layer whose gradient has no mirror (it waits on SSD)

class StoreSink : public GradientSink {
 public:
  explicit StoreSink(int64_t store_handle) : store_handle_(store_handle) {
    std::shared_ptr<ShardStore> store = ShardStores().Find(store_handle);
    if (!store) throw nb::value_error(("StoreSink: " + ShardStores().Missing(store_handle)).c_str());
    store_ = store;
  }

  // Routes tensor id `tensor` to `regions` (one per layer, each `layer_bytes` long); `mirrors`
  // (none, or one per layer, as long; -1: that layer has none): where each layer's whole gradient
  // is written too once it is complete (durable steps' log of gradients kept in memory regions).
  void AddTensor(int64_t tensor, const std::vector<int32_t>& regions, int64_t layer_bytes,
                 const std::string& dtype_name, int64_t arrivals, const std::vector<int32_t>& mirrors) {
    const std::string what = "StoreSink.add_tensor(" + std::to_string(tensor) + ")";
    CheckArrivals(what, arrivals);
    const ffi::DataType dtype = ParseGradDtypeOrThrow(what, dtype_name);
    if (regions.empty()) throw nb::value_error((what + ": at least one region (layer) is needed").c_str());
    std::shared_ptr<ShardStore> store = Store();
    if (!store) throw nb::value_error((what + ": " + ClosedMessage()).c_str());
    if (!mirrors.empty() && mirrors.size() != regions.size()) {
      throw nb::value_error((what + ": " + std::to_string(mirrors.size()) + " mirror regions for " +
                             std::to_string(regions.size()) + " layers")
                                .c_str());
    }
    std::vector<int32_t> all(regions);
    all.insert(all.end(), mirrors.begin(), mirrors.end());
    for (size_t layer = 0; layer < all.size(); ++layer) {
      if (layer >= regions.size() && all[layer] == kNoMirror) continue;  // a layer without a mirror
      const StoreRegion* r = store->region(all[layer]);
      if (!r) {
        throw nb::value_error((what + ": layer " + std::to_string(layer % regions.size()) +
                               " names unknown region id " + std::to_string(all[layer]))
                                  .c_str());
      }
      if (r->nbytes != layer_bytes) {
        throw nb::value_error((what + ": region '" + r->name + "' holds " + std::to_string(r->nbytes) +
                               " bytes, but one layer of the gradient is " + std::to_string(layer_bytes))
                                  .c_str());
      }
    }
    auto target = std::make_shared<Target>(static_cast<int64_t>(regions.size()), layer_bytes, arrivals, dtype);
    target->regions = regions;
    target->mirrors = mirrors;
    target->held.reset(new std::atomic<bool>[regions.size()]);
    for (size_t i = 0; i < regions.size(); ++i) target->held[i].store(false);
    routes_.Add(what, tensor, std::move(target));
  }

  std::string Consume(int64_t tensor, int64_t layer, ffi::DataType dtype, const void* data,
                      size_t bytes, GradStats* stats) override {
    std::string error;
    std::shared_ptr<Target> t = routes_.FindLayer(tensor, layer, dtype, bytes, &error);
    if (!t) return error;
    std::shared_ptr<ShardStore> store = Store();
    if (!store) return "grad_sink: " + ClosedMessage();
    if (t->held[layer].load(std::memory_order_acquire)) {
      early_.fetch_add(1, std::memory_order_relaxed);
      return "grad_sink: the gradient of tensor " + std::to_string(tensor) + " layer " + std::to_string(layer) +
             " arrived while the optimizer of the previous step had not yet read that region (overlap ordering "
             "violated)";
    }
    const Arrival arrival(t->received[layer].fetch_add(1, std::memory_order_relaxed), t->arrivals);
    Status s;
    if (arrival.first) {
      // Copies into a staging slot before returning; the disk write completes in the background.
      s = store->WriteFromHost(t->regions[layer], 0, data, t->layer_bytes, /*wait=*/false);
    } else {
      s = AddToStored(*store, *t, layer, data, stats);  // a later use of a tied table
    }
    if (s.ok() && arrival.last && !t->mirrors.empty() && t->mirrors[layer] != kNoMirror) {  // to its mirror too
      s = arrival.first ? store->WriteFromHost(t->mirrors[layer], 0, data, t->layer_bytes, /*wait=*/false)
                        : CopyStored(*store, *t, layer);
    }
    if (!s.ok()) {
      return "grad_sink: writing layer " + std::to_string(layer) + " of tensor " + std::to_string(tensor) +
             " to the SSD store: " + s.message();
    }
    if (!arrival.last) *stats = GradStats();  // the sum's statistics come with the last arrival
    return "";
  }

  auto& routes() { return routes_; }  // received() and reset() (BindReceipts)

  // Every region is being read by the optimizer until Release()d.
  void Hold() { SetHeld(true); }

  // The optimizer has read layer `layer` of `tensor`: the next step's gradient may land there.
  void Release(int64_t tensor, int64_t layer) {
    std::shared_ptr<Target> t = routes_.Find(tensor);
    if (!t || layer < 0 || layer >= t->layers) {
      throw nb::value_error(("StoreSink.release: no tensor " + std::to_string(tensor) + " layer " +
                             std::to_string(layer))
                                .c_str());
    }
    t->held[layer].store(false, std::memory_order_release);
  }

  void ReleaseAll() { SetHeld(false); }

  // Arrivals refused because their region was still held (0 unless the ordering broke).
  int64_t early_arrivals() const { return early_.load(); }

  int64_t store_handle() const { return store_handle_; }

 private:
  struct Target : RoutedTensor {
    using RoutedTensor::RoutedTensor;
    std::vector<int32_t> regions;  // one per layer
    std::vector<int32_t> mirrors;  // none, or one per layer
    std::unique_ptr<std::atomic<bool>[]> held;  // the optimizer has not read this layer yet
  };

  void SetHeld(bool held) {
    routes_.ForEach([held](Target& t) {
      for (int64_t i = 0; i < t.layers; ++i) t.held[i].store(held, std::memory_order_release);
    });
  }

  // Adds `data` to what the region holds, piece by piece through a staging-sized buffer (read
  // back, add as XLA adds 16-bit arrays, write), and sets `stats` to those of the sum.
  Status AddToStored(ShardStore& store, const Target& t, int64_t layer, const void* data, GradStats* stats) {
    const int64_t piece = store.options().staging_bytes;
    const int64_t item = t.dtype == ffi::F32 ? 4 : 2;
    std::lock_guard<std::mutex> lock(add_mu_);
    add_buffer_.resize(static_cast<size_t>(std::min(piece, t.layer_bytes)));
    GradStats total;
    for (int64_t offset = 0; offset < t.layer_bytes; offset += piece) {
      const int64_t n = std::min(piece, t.layer_bytes - offset);
      Status s = store.ReadToHost(t.regions[layer], offset, add_buffer_.data(), n);
      if (!s.ok()) return s;
      AddGradients(t.dtype, add_buffer_.data(), static_cast<const uint8_t*>(data) + offset, add_buffer_.data(),
                   n / item);
      GradStats part;
      GradStatsOf(t.dtype, add_buffer_.data(), n / item, &part);
      total.sumsq += part.sumsq;
      total.nonfinite += part.nonfinite;
      s = store.WriteFromHost(t.regions[layer], offset, add_buffer_.data(), n, /*wait=*/false);
      if (!s.ok()) return s;
    }
    *stats = total;
    return Status::Ok();
  }

  // Copies what layer `layer`'s region holds to its mirror, piece by piece (a summed gradient).
  Status CopyStored(ShardStore& store, const Target& t, int64_t layer) {
    const int64_t piece = store.options().staging_bytes;
    std::lock_guard<std::mutex> lock(add_mu_);
    add_buffer_.resize(static_cast<size_t>(std::min(piece, t.layer_bytes)));
    for (int64_t offset = 0; offset < t.layer_bytes; offset += piece) {
      const int64_t n = std::min(piece, t.layer_bytes - offset);
      Status s = store.ReadToHost(t.regions[layer], offset, add_buffer_.data(), n);
      if (!s.ok()) return s;
      s = store.WriteFromHost(t.mirrors[layer], offset, add_buffer_.data(), n, /*wait=*/false);
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }

  // The store is held weakly: closing it ends the sink's writes with a clear error instead of
  // keeping a closed store alive.
  std::shared_ptr<ShardStore> Store() const {
    std::shared_ptr<ShardStore> s = store_.lock();
    return s && !s->closed() ? s : nullptr;
  }

  std::string ClosedMessage() const {
    return "the shard store with handle " + std::to_string(store_handle_) + " is closed";
  }

  int64_t store_handle_;
  std::atomic<int64_t> early_{0};
  std::weak_ptr<ShardStore> store_;
  SinkRoutes<Target> routes_{"StoreSink", "the SSD store sink", "stores"};
  std::mutex add_mu_;  // guards add_buffer_
  std::vector<uint8_t> add_buffer_;
};

void BindStoreSink(nb::module_& m) {
  nb::class_<StoreSink> cls(m, "StoreSink", "Gradient sink that writes each layer into its SSD store region.");
  cls.def(nb::new_([](int64_t store_handle) { return std::make_shared<StoreSink>(store_handle); }),
          nb::arg("store_handle"))
      .def("add_tensor", &StoreSink::AddTensor, nb::arg("tensor"), nb::arg("regions"), nb::arg("layer_bytes"),
           nb::arg("dtype"), nb::arg("arrivals") = 1, nb::arg("mirrors") = std::vector<int32_t>(),
           "Routes tensor id `tensor` to one region id per layer, each layer_bytes long; `arrivals` per layer "
           "are summed (a tied table's uses); `mirrors`: a region per layer (-1: none) that each whole gradient is "
           "written to as well.");
  BindReceipts(cls);
  cls.def("hold", &StoreSink::Hold, "Marks every region as being read by the optimizer (arrivals refused).")
      .def("release", &StoreSink::Release, nb::arg("tensor"), nb::arg("layer"),
           "The optimizer has read this layer's gradient; the next one may arrive.")
      .def("release_all", &StoreSink::ReleaseAll)
      .def_prop_ro("early_arrivals", &StoreSink::early_arrivals)
      .def_prop_ro("store_handle", &StoreSink::store_handle);
  m.def(
      "register_store_sink", [](std::shared_ptr<StoreSink> sink) { return GradientSinks().Register(sink); },
      nb::arg("sink"),
      "Makes a StoreSink reachable from jaxascend_grad_sink; returns its handle.");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindStoreSink);

}  // namespace jaxascend
