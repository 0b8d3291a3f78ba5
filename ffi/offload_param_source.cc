// The parameter source: the layer scan asks it for layer L's compute-dtype weights, and it
// has read them from their SSD regions into an arena slot ahead of the ask.
//
// With offload.params: ssd the weights of the layer stack live in the shard store, one region
// per (leaf, layer), written by the optimizer step. Before each forward/backward the engine
// calls Begin(order) with the layers in the order the step will ask for them (0..L-1 for the
// forward, L-1..0 for the backward's recomputation under remat); the source at once queues
// reads of the first `depth` layers into arena slots (one slot holds one layer of every leaf,
// each leaf at a 4096-aligned offset). The FFI target jaxascend_param_source(layer) then waits
// for that layer's reads, copies the slot into XLA's output buffers, releases the slot and
// queues the next layer of the order. An ask the order did not foresee is still answered,
// with a synchronous read (counted as a miss): the order only decides the speed, never the
// values. Reads go through the store, so every block's crc32c is checked.
//
// Overlapped step (offload.overlap): the optimizer of step t runs in the background while step
// t+1's forward/backward is dispatched. Gate() marks every layer "not yet updated"; the
// optimizer calls MarkReady(layer) once layer `layer` of every leaf holds its new weights (on
// SSD for region leaves, in host memory for host leaves), or Fail(message) if it failed. A
// layer is read from SSD (ahead of the ask or not) only once it is ready, and Fetch waits for
// that, counting the time as `optimizer_wait_seconds`. Host leaves (params resident in host
// memory, served the same way so that the ordering holds for them too) are copied from their
// buffer, no slot and no read.
//
// Handover (region leaves, overlapped): Gate(true) says the optimizer will hand the forward each
// layer's new weights in memory. The optimizer takes a slot (TryAcquireHandover), fills it as
// the kernel emits the layer's chunks, and Handover(layer, slot) queues it as if it had been read:
// the forward's fetch of that layer needs no SSD read and does not wait for the write-back.
// Without a free slot the optimizer says SkipHandover(layer), and that layer is read from SSD
// once it is ready (written back). The backward's recomputation always reads from SSD.
//
// Layout follows the JAX FFI examples: the typed work in ParamSource::Fetch, the dispatch
// (ParamSourceDispatch) checks the outputs and turns a failure into an ffi::Error, the handler
// symbol binds the arguments.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "handle_table.h"
#include "offload_grad_sink.h"
#include "registry.h"
#include "ssd_arena.h"
#include "ssd_io_queue.h"
#include "ssd_shard_store.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

int64_t AlignUp(int64_t n) { return (n + 4095) / 4096 * 4096; }

class ParamSource {
 public:
  ParamSource(int64_t store_handle, std::string slot_class) : slot_class_(std::move(slot_class)) {
    std::shared_ptr<ShardStore> store = ShardStores().Find(store_handle);
    if (!store) throw nb::value_error(("ParamSource: " + ShardStores().Missing(store_handle)).c_str());
    store_ = store;
  }

  ~ParamSource() { Drain(); }

  // Adds one leaf held in host memory: `buffer` holds every layer, `layer_bytes` each.
  void AddHostLeaf(nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> buffer, int64_t layer_bytes,
                   const std::string& dtype_name) {
    const std::string what = "ParamSource.add_host_leaf(" + std::to_string(leaves_.size()) + ")";
    Leaf leaf;
    if (!ParseGradDtype(dtype_name, &leaf.dtype)) {
      throw nb::value_error((what + ": dtype '" + dtype_name + "' is not float32, float16 or bfloat16").c_str());
    }
    if (layer_bytes < 1 || static_cast<int64_t>(buffer.size()) % layer_bytes != 0) {
      throw nb::value_error((what + ": a buffer of " + std::to_string(buffer.size()) +
                             " bytes is not a whole number of layers of " + std::to_string(layer_bytes) + " bytes")
                                .c_str());
    }
    const int64_t layers = static_cast<int64_t>(buffer.size()) / layer_bytes;
    if (!leaves_.empty() && (leaves_[0].host == nullptr || layers != num_layers())) {
      throw nb::value_error((what + ": every leaf of a source must be a host leaf with " +
                             std::to_string(num_layers()) + " layers")
                                .c_str());
    }
    std::lock_guard<std::mutex> lock(mu_);
    leaf.host = buffer.data();
    leaf.host_layers = layers;
    leaf.buffer = buffer;  // keeps the array alive
    leaf.layer_bytes = layer_bytes;
    leaves_.push_back(std::move(leaf));
    ready_.assign(static_cast<size_t>(layers), 1);
  }

  // Adds one leaf of the layer stack: one region per layer, each `layer_bytes` long.
  void AddLeaf(const std::vector<int32_t>& regions, int64_t layer_bytes, const std::string& dtype_name) {
    const std::string what = "ParamSource.add_leaf(" + std::to_string(leaves_.size()) + ")";
    Leaf leaf;
    if (!ParseGradDtype(dtype_name, &leaf.dtype)) {
      throw nb::value_error((what + ": dtype '" + dtype_name + "' is not float32, float16 or bfloat16").c_str());
    }
    if (regions.empty()) throw nb::value_error((what + ": at least one region (layer) is needed").c_str());
    if (!leaves_.empty() && leaves_[0].host != nullptr) {
      throw nb::value_error((what + ": the source serves host leaves; region leaves cannot join it").c_str());
    }
    if (!leaves_.empty() && regions.size() != leaves_[0].regions.size()) {
      throw nb::value_error((what + ": " + std::to_string(regions.size()) + " layers, but the first leaf has " +
                             std::to_string(leaves_[0].regions.size()))
                                .c_str());
    }
    std::shared_ptr<ShardStore> store = Store();
    if (!store) throw nb::value_error((what + ": the shard store is closed").c_str());
    for (size_t layer = 0; layer < regions.size(); ++layer) {
      const StoreRegion* r = store->region(regions[layer]);
      if (!r || r->nbytes != layer_bytes) {
        throw nb::value_error((what + ": layer " + std::to_string(layer) + " names region id " +
                               std::to_string(regions[layer]) + (r ? " of " + std::to_string(r->nbytes) + " bytes" : "") +
                               ", expected one of " + std::to_string(layer_bytes) + " bytes")
                                  .c_str());
      }
    }
    std::lock_guard<std::mutex> lock(mu_);
    leaf.regions = regions;
    leaf.layer_bytes = layer_bytes;
    leaf.slot_offset = slot_bytes_;
    slot_bytes_ += AlignUp(layer_bytes);
    leaves_.push_back(std::move(leaf));
    ready_.assign(regions.size(), 1);
  }

  // The optimizer of the previous step is about to update every layer: none is ready.
  void Gate(bool expect_handover) {
    std::lock_guard<std::mutex> lock(mu_);
    std::fill(ready_.begin(), ready_.end(), 0);
    const bool handover = expect_handover && !leaves_.empty() && leaves_[0].host == nullptr;
    handover_.assign(ready_.size(), handover ? kExpected : kNoHandover);
    failed_.clear();
  }

  // A slot for the optimizer to fill with layer `layer`'s new weights; -1 when none is free
  // (then the layer is read from SSD: SkipHandover).
  int32_t TryAcquireHandover(int64_t layer) {
    CheckLayer(layer, "try_acquire_handover");
    std::shared_ptr<ShardStore> store = Store();
    if (!store) throw nb::value_error("ParamSource.try_acquire_handover: the shard store is closed");
    int32_t slot = -1;
    if (!store->arena()->Acquire(slot_class_, slot_bytes_, &slot).ok()) return -1;
    return slot;
  }

  // Zero-copy views of a handover slot, one per leaf (its layer_bytes).
  nb::list HandoverViews(int32_t slot) {
    std::shared_ptr<ShardStore> store = Store();
    if (!store) throw nb::value_error("ParamSource.handover_views: the shard store is closed");
    uint8_t* base = store->arena()->slots()[slot].data;
    nb::list out;
    for (const Leaf& leaf : leaves_) {
      // The views keep the arena alive (a capsule owns a reference), so numpy never copies them.
      nb::capsule owner(new std::shared_ptr<Arena>(store->arena()),
                        [](void* p) noexcept { delete static_cast<std::shared_ptr<Arena>*>(p); });
      size_t shape[1] = {static_cast<size_t>(leaf.layer_bytes)};
      out.append(nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>(base + leaf.slot_offset, 1, shape, owner));
    }
    return out;
  }

  // The optimizer filled `slot` with layer `layer`: the forward takes it from there.
  void Handover(int64_t layer, int32_t slot) {
    CheckLayer(layer, "handover");
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      auto p = std::make_unique<Pending>();
      p->layer = static_cast<int32_t>(layer);
      p->slot = slot;
      p->handed = true;
      inflight_.push_back(std::move(p));
      handover_[layer] = kHanded;
      ++handovers_;
      IssueLocked();
      ready_cv_.notify_all();
    }
  }

  // No slot was free: the forward reads layer `layer` from SSD once it is ready.
  void SkipHandover(int64_t layer) {
    CheckLayer(layer, "skip_handover");
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    handover_[layer] = kNoHandover;
    ++handover_skips_;
    IssueLocked();
    ready_cv_.notify_all();
  }

  void CheckLayer(int64_t layer, const char* what) const {
    if (layer < 0 || layer >= num_layers()) {
      throw nb::value_error(("ParamSource." + std::string(what) + ": layer " + std::to_string(layer) +
                             " is out of range (" + std::to_string(num_layers()) + " layers)")
                                .c_str());
    }
  }

  // Layer `layer` holds its new weights: serve it (and read it ahead, if it is next in order).
  void MarkReady(int64_t layer) {
    CheckLayer(layer, "mark_ready");
    Status s;
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      ready_[layer] = 1;
      s = IssueLocked();
      ready_cv_.notify_all();
    }
    if (!s.ok()) throw std::runtime_error("param_source: " + s.message());
  }

  // The optimizer failed: every fetch still waiting (or to come) fails with `message`.
  void Fail(const std::string& message) {
    std::lock_guard<std::mutex> lock(mu_);
    failed_ = message.empty() ? "the optimizer step failed" : message;
    ready_cv_.notify_all();
  }

  bool ready(int64_t layer) {
    std::lock_guard<std::mutex> lock(mu_);
    return layer >= 0 && layer < num_layers() && ready_[layer] != 0;
  }

  // Bytes of one arena slot: one layer of every leaf, each 4096-aligned.
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t num_layers() const {
    if (leaves_.empty()) return 0;
    return leaves_[0].host ? leaves_[0].host_layers : static_cast<int64_t>(leaves_[0].regions.size());
  }
  int64_t num_leaves() const { return static_cast<int64_t>(leaves_.size()); }

  // Forgets what is in flight, then queues the first `depth` layers of `order`.
  void Begin(const std::vector<int32_t>& order, int depth) {
    if (depth < 1) throw nb::value_error("ParamSource.begin: depth must be >= 1");
    for (int32_t layer : order) CheckLayer(layer, "begin");
    Status s;
    {
      nb::gil_scoped_release release;
      std::lock_guard<std::mutex> lock(mu_);
      DrainLocked(/*keep_handed=*/true);  // a layer the optimizer already handed over stays
      order_ = order;
      forward_ = std::min(order.size(), static_cast<size_t>(num_layers()));
      next_ = 0;
      depth_ = depth;
      s = IssueLocked();
    }
    if (!s.ok()) throw std::runtime_error("param_source: " + s.message());
  }

  // Waits for what is in flight and releases its slots (after a step, and before closing).
  void Drain() {
    std::lock_guard<std::mutex> lock(mu_);
    DrainLocked();
    order_.clear();
    next_ = 0;
  }

  // Copies layer `layer` of every leaf into outs[k] (sizes[k] bytes, dtypes[k]); "" or the error.
  std::string Fetch(int64_t layer, const std::vector<void*>& outs, const std::vector<size_t>& sizes,
                    const std::vector<ffi::DataType>& dtypes) {
    const double asked = Now();
    std::unique_lock<std::mutex> lock(mu_);
    std::string err = FetchLocked(lock, layer, outs, sizes, dtypes);
    if (events_.size() < kMaxEvents) events_.push_back({layer, asked, Now()});
    return err;
  }

  // (layer, asked, served) of each fetch since the last call, in seconds of the monotonic clock
  // (Python's time.perf_counter on Linux): the timeline of a step.
  std::vector<std::tuple<int64_t, double, double>> TakeEvents() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<std::tuple<int64_t, double, double>> out;
    for (const Event& e : events_) out.emplace_back(e.layer, e.asked, e.served);
    events_.clear();
    return out;
  }

 private:
  static double Now() {
    return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
  }

  std::string FetchLocked(std::unique_lock<std::mutex>& lock, int64_t layer, const std::vector<void*>& outs,
                          const std::vector<size_t>& sizes, const std::vector<ffi::DataType>& dtypes) {
    if (layer < 0 || layer >= num_layers()) {
      return "param_source: layer " + std::to_string(layer) + " is out of range (" + std::to_string(num_layers()) +
             " layers)";
    }
    if (outs.size() != leaves_.size()) {
      return "param_source: the call has " + std::to_string(outs.size()) + " outputs for " +
             std::to_string(leaves_.size()) + " leaves";
    }
    for (size_t k = 0; k < leaves_.size(); ++k) {
      if (sizes[k] != static_cast<size_t>(leaves_[k].layer_bytes) || dtypes[k] != leaves_[k].dtype) {
        return "param_source: output " + std::to_string(k) + " is " + std::to_string(sizes[k]) + " bytes of " +
               GradDtypeName(dtypes[k]) + "; leaf " + std::to_string(k) + " has " +
               std::to_string(leaves_[k].layer_bytes) + " bytes of " + GradDtypeName(leaves_[k].dtype) + " per layer";
      }
    }
    auto handed = [&] {
      for (const auto& p : inflight_) {
        if (p->handed && p->layer == layer) return true;
      }
      return false;
    };
    if (!ready_[layer] && !handed() && failed_.empty()) {  // the previous step's optimizer is still on it
      const auto start = std::chrono::steady_clock::now();
      ready_cv_.wait(lock, [&] { return ready_[layer] != 0 || handed() || !failed_.empty(); });
      optimizer_wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    if (!ready_[layer] && !handed()) {
      return "param_source: layer " + std::to_string(layer) + " never received its new weights: " + failed_;
    }
    ++fetches_;
    if (leaves_[0].host != nullptr) {  // resident: a copy of the buffer's layer
      for (size_t k = 0; k < leaves_.size(); ++k) {
        std::memcpy(outs[k], leaves_[k].host + layer * leaves_[k].layer_bytes,
                    static_cast<size_t>(leaves_[k].layer_bytes));
        bytes_copied_ += leaves_[k].layer_bytes;
      }
      return "";
    }
    std::shared_ptr<ShardStore> store = Store();
    if (!store) return "param_source: the shard store is closed";
    auto it = inflight_.begin();
    while (it != inflight_.end() && (*it)->layer != layer) ++it;
    if (it == inflight_.end()) {  // not foreseen: read it now, straight into the outputs
      ++misses_;
      for (size_t k = 0; k < leaves_.size(); ++k) {
        const Status s = store->ReadToHost(leaves_[k].regions[layer], 0, outs[k], leaves_[k].layer_bytes);
        if (!s.ok()) return "param_source: reading layer " + std::to_string(layer) + ": " + s.message();
        bytes_read_ += leaves_[k].layer_bytes;
      }
      return "";
    }
    std::unique_ptr<Pending> p = std::move(*it);
    inflight_.erase(it);
    if (p->handed) handover_[layer] = kNoHandover;  // used: a later ask (the backward) reads it
    const auto start = std::chrono::steady_clock::now();
    Status s = p->ticket.Wait();
    wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (s.ok()) {
      const uint8_t* base = store->arena()->slots()[p->slot].data;
      for (size_t k = 0; k < leaves_.size(); ++k) {
        std::memcpy(outs[k], base + leaves_[k].slot_offset, static_cast<size_t>(leaves_[k].layer_bytes));
        (p->handed ? bytes_handed_ : bytes_read_) += leaves_[k].layer_bytes;
      }
    }
    store->arena()->Release(p->slot);
    if (!s.ok()) return "param_source: reading layer " + std::to_string(layer) + ": " + s.message();
    s = IssueLocked();
    if (!s.ok()) return "param_source: " + s.message();
    return "";
  }

 public:
  nb::dict Stats() {
    std::lock_guard<std::mutex> lock(mu_);
    nb::dict d;
    d["fetches"] = fetches_;
    d["misses"] = misses_;
    d["bytes_read"] = bytes_read_;
    d["wait_seconds"] = wait_seconds_;
    d["optimizer_wait_seconds"] = optimizer_wait_seconds_;
    d["bytes_copied"] = bytes_copied_;
    d["handovers"] = handovers_;
    d["bytes_handed"] = bytes_handed_;
    d["handover_skips"] = handover_skips_;
    return d;
  }

 private:
  struct Leaf {
    std::vector<int32_t> regions;
    int64_t layer_bytes = 0;
    int64_t slot_offset = 0;
    ffi::DataType dtype = ffi::F32;
    const uint8_t* host = nullptr;  // host leaf: every layer, layer_bytes each
    int64_t host_layers = 0;
    nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> buffer;
  };
  struct Pending {
    int32_t layer = 0;
    int32_t slot = -1;
    bool handed = false;  // filled by the optimizer, not read
    IoTicket ticket;
  };

  std::shared_ptr<ShardStore> Store() const {
    std::shared_ptr<ShardStore> s = store_.lock();
    return s && !s->closed() ? s : nullptr;
  }

  // Queues layers of the order while fewer than depth_ are in flight, stopping at a layer the
  // optimizer has not updated yet. Caller holds mu_.
  Status IssueLocked() {
    if (!leaves_.empty() && leaves_[0].host != nullptr) return Status::Ok();  // nothing to read
    std::shared_ptr<ShardStore> store = Store();
    if (!store) return Status::Closed("the shard store is closed");
    while (next_ < order_.size()) {
      const int32_t layer = order_[next_];
      if (next_ < forward_ && !handover_.empty() && handover_[layer] != kNoHandover) {
        if (handover_[layer] != kHanded) break;  // the optimizer will hand this one over
        ++next_;  // handed over: already in flight
        continue;
      }
      if (static_cast<int>(inflight_.size()) >= depth_ || !ready_[layer]) break;
      auto p = std::make_unique<Pending>();
      p->layer = order_[next_];
      Status s = store->arena()->Acquire(slot_class_, slot_bytes_, &p->slot);
      if (!s.ok()) return s;
      uint8_t* base = store->arena()->slots()[p->slot].data;
      for (const Leaf& leaf : leaves_) {
        s = store->SubmitRead(leaf.regions[p->layer], 0, leaf.layer_bytes, base + leaf.slot_offset,
                              AlignUp(leaf.layer_bytes), &p->ticket);
        if (!s.ok()) break;
      }
      ++next_;
      inflight_.push_back(std::move(p));
      if (!s.ok()) return s;
    }
    return Status::Ok();
  }

  void DrainLocked(bool keep_handed = false) {
    std::shared_ptr<ShardStore> store = store_.lock();
    std::deque<std::unique_ptr<Pending>> kept;
    for (auto& p : inflight_) {
      if (keep_handed && p->handed) {
        kept.push_back(std::move(p));
        continue;
      }
      p->ticket.Wait();  // a failed prefetch nobody asked for is moot
      if (store) store->arena()->Release(p->slot);
    }
    inflight_ = std::move(kept);
  }

  std::string slot_class_;
  std::weak_ptr<ShardStore> store_;
  std::mutex mu_;
  std::condition_variable ready_cv_;
  std::vector<uint8_t> ready_;  // per layer: its weights are this step's (see Gate)
  enum Handover : uint8_t { kNoHandover = 0, kExpected, kHanded };
  std::vector<uint8_t> handover_;  // per layer, this step's forward
  int64_t handovers_ = 0;
  int64_t bytes_handed_ = 0;
  int64_t handover_skips_ = 0;
  std::string failed_;
  std::vector<Leaf> leaves_;
  int64_t slot_bytes_ = 0;
  std::vector<int32_t> order_;
  size_t forward_ = 0;  // the first entries of the order: the forward (handed over, when expected)
  size_t next_ = 0;
  int depth_ = 1;
  std::deque<std::unique_ptr<Pending>> inflight_;
  int64_t fetches_ = 0;
  int64_t misses_ = 0;
  int64_t bytes_read_ = 0;
  double wait_seconds_ = 0.0;
  double optimizer_wait_seconds_ = 0.0;
  int64_t bytes_copied_ = 0;
  struct Event {
    int64_t layer;
    double asked, served;
  };
  static constexpr size_t kMaxEvents = 1 << 16;
  std::vector<Event> events_;
};

HandleTable<ParamSource>& ParamSources() {
  static HandleTable<ParamSource>* table =
      new HandleTable<ParamSource>("parameter source");  // never destroyed: FFI calls may outlive Python
  return *table;
}

// Dispatch: finds the source, collects the output buffers and fetches the layer into them.
ffi::Error ParamSourceDispatch(ffi::Buffer<ffi::S32> layer, ffi::RemainingRets outs, int64_t source) {
  if (layer.element_count() != 1) return ffi::Error::InvalidArgument("param_source: layer must be a scalar");
  std::shared_ptr<ParamSource> target = ParamSources().Find(source);
  if (!target) return ffi::Error::InvalidArgument("param_source: " + ParamSources().Missing(source));
  std::vector<void*> data;
  std::vector<size_t> sizes;
  std::vector<ffi::DataType> dtypes;
  for (size_t k = 0; k < outs.size(); ++k) {
    ffi::ErrorOr<ffi::Result<ffi::AnyBuffer>> out = outs.get<ffi::AnyBuffer>(k);
    if (out.has_error()) return out.error();
    data.push_back((*out)->untyped_data());
    sizes.push_back((*out)->size_bytes());
    dtypes.push_back((*out)->element_type());
  }
  std::string err = target->Fetch(layer.typed_data()[0], data, sizes, dtypes);
  if (!err.empty()) return ffi::Error::Internal(err);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(kParamSource, ParamSourceDispatch,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()  // layer: index in the stack
                                  .RemainingRets()               // one layer of every leaf, in leaf order
                                  .Attr<int64_t>("source"));     // handle from register_param_source

JAXASCEND_REGISTER_FFI("jaxascend_param_source", kParamSource);

namespace {
void BindParamSource(nb::module_& m) {
  nb::class_<ParamSource>(m, "ParamSource", "Reads layers of the stacked weights from SSD ahead of the layer scan.")
      .def(nb::new_([](int64_t store_handle, const std::string& slot_class) {
             return std::make_shared<ParamSource>(store_handle, slot_class);
           }),
           nb::arg("store_handle"), nb::arg("slot_class"))
      .def("add_host_leaf", &ParamSource::AddHostLeaf, nb::arg("buffer"), nb::arg("layer_bytes"), nb::arg("dtype"),
           "Adds one leaf held in host memory (a flat uint8 view of every layer).")
      .def("gate", &ParamSource::Gate, nb::arg("expect_handover") = false,
           "Marks every layer as not yet updated (an optimizer step starts); with expect_handover the optimizer "
           "hands the forward each layer in a slot.")
      .def("try_acquire_handover", &ParamSource::TryAcquireHandover, nb::arg("layer"))
      .def("handover_views", &ParamSource::HandoverViews, nb::arg("slot"))
      .def("handover", &ParamSource::Handover, nb::arg("layer"), nb::arg("slot"))
      .def("skip_handover", &ParamSource::SkipHandover, nb::arg("layer"))
      .def("mark_ready", &ParamSource::MarkReady, nb::arg("layer"), "Layer `layer` holds its new weights.")
      .def("fail", &ParamSource::Fail, nb::arg("message"), "Fails every fetch waiting for an update.")
      .def("ready", &ParamSource::ready, nb::arg("layer"))
      .def("add_leaf", &ParamSource::AddLeaf, nb::arg("regions"), nb::arg("layer_bytes"), nb::arg("dtype"),
           "Adds one leaf of the stack: one region id per layer, each layer_bytes long.")
      .def("begin", &ParamSource::Begin, nb::arg("order"), nb::arg("depth"),
           "Drops what is in flight and starts reading the first `depth` layers of `order`.")
      .def("drain", &ParamSource::Drain, nb::call_guard<nb::gil_scoped_release>(),
           "Waits for the reads in flight and releases their slots.")
      .def("take_events", &ParamSource::TakeEvents,
           "(layer, asked, served) of every fetch since the last call (monotonic-clock seconds).")
      .def("stats", &ParamSource::Stats, "fetches, misses, bytes_read, wait_seconds since creation.")
      .def_prop_ro("slot_bytes", &ParamSource::slot_bytes)
      .def_prop_ro("num_layers", &ParamSource::num_layers)
      .def_prop_ro("num_leaves", &ParamSource::num_leaves);
  m.def(
      "register_param_source",
      [](std::shared_ptr<ParamSource> source) { return ParamSources().Register(source); }, nb::arg("source"),
      "Makes a ParamSource reachable from jaxascend_param_source; returns its handle.");
  m.def(
      "unregister_param_source",
      [](int64_t handle) {
        std::shared_ptr<ParamSource> source = ParamSources().Take(handle);
        if (!source) return false;
        nb::gil_scoped_release release;
        source->Drain();
        return true;
      },
      nb::arg("handle"), "Removes a source (after draining its reads); later calls with its handle fail.");
  // The host half for backends whose FFI calls cannot run on the host (GPU): a pure_callback
  // copies layer `layer` of every leaf into `outs` (uint8 views of host buffers, e.g. pinned).
  m.def(
      "fetch_params_to_host",
      [](int64_t handle, int64_t layer, std::vector<nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig>> outs,
         std::vector<std::string> dtype_names) {
        std::shared_ptr<ParamSource> target = ParamSources().Find(handle);
        if (!target) throw nb::value_error(("param_source: " + ParamSources().Missing(handle)).c_str());
        if (dtype_names.size() != outs.size()) throw nb::value_error("param_source: one dtype per output is needed");
        std::vector<void*> data;
        std::vector<size_t> sizes;
        std::vector<ffi::DataType> dtypes(outs.size());
        for (size_t k = 0; k < outs.size(); ++k) {
          if (!ParseGradDtype(dtype_names[k], &dtypes[k])) {
            throw nb::value_error(("param_source: unsupported dtype " + dtype_names[k]).c_str());
          }
          data.push_back(outs[k].data());
          sizes.push_back(outs[k].size());
        }
        std::string err;
        {
          nb::gil_scoped_release release;
          err = target->Fetch(layer, data, sizes, dtypes);
        }
        if (!err.empty()) throw std::runtime_error(err);
      },
      nb::arg("handle"), nb::arg("layer"), nb::arg("outs"), nb::arg("dtypes"),
      "Copies one layer of every leaf into host byte buffers (the GPU path's host side).");
}
}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindParamSource);

}  // namespace jaxascend
