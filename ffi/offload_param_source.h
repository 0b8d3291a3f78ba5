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
// layer's new weights in memory. The optimizer takes a slot (AcquireHandover), fills it as
// the kernel emits the layer's chunks, and Handover(layer, slot) queues it as if it had been read:
// the forward's fetch of that layer needs no SSD read and does not wait for the write-back.
// Where the slots are all taken by layers handed over and not fetched yet, the optimizer waits
// for the forward to take the next one (back-pressure: at most `depth` layers ahead), so in a
// running forward every layer goes over in memory. Where no slot will come that way the
// optimizer says SkipHandover(layer), and that layer is read from SSD once it is ready
// (written back). The backward's recomputation always reads from SSD.
//
// Layout follows the JAX FFI examples: the typed work in ParamSource::Fetch (offload_param_source.cc),
// the dispatch (ParamSourceDispatch, offload_param_source_ffi.cc) checks the outputs and turns a
// failure into an ffi::Error, the handler symbol binds the arguments. The host entry for GPU
// backends is offload_param_source_host.cc; the Python class and the handle table's
// register/unregister are offload_param_source_bindings.cc.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "handle_table.h"
#include "ssd_io_queue.h"
#include "ssd_shard_store.h"
#include "xla/ffi/api/ffi.h"

namespace jaxascend {

class ParamSource {
 public:
  ParamSource(int64_t store_handle, std::string slot_class);

  ~ParamSource() { Drain(); }

  // Adds one leaf held in host memory: `buffer` holds every layer, `layer_bytes` each.
  void AddHostLeaf(nanobind::ndarray<uint8_t, nanobind::ndim<1>, nanobind::c_contig> buffer,
                   int64_t layer_bytes, const std::string& dtype_name);

  // Adds one leaf of the layer stack: one region per layer, each `layer_bytes` long.
  void AddLeaf(const std::vector<int32_t>& regions, int64_t layer_bytes, const std::string& dtype_name);

  // Layer `layer` of leaf `leaf` is now read from region `region` (durable steps move a bfloat16
  // master's layer to another slot once its update is committed); from the next read of it on.
  void SetLayerRegion(int64_t leaf, int64_t layer, int32_t region);

  // The optimizer of the previous step is about to update every layer: none is ready.
  void Gate(bool expect_handover);

  // A slot for the optimizer to fill with layer `layer`'s new weights. While the read-ahead's
  // slots are all taken and the forward's next layer is one already handed over (so the forward
  // frees a slot without the optimizer's help), it waits for the forward: the optimizer runs at
  // most `depth` layers ahead of it, and every layer goes over in memory. -1 when no slot will
  // come that way (the forward is not running, or waits for a layer read from SSD; after
  // EndHandoverWaits; the arena's class is full): then the layer is read from SSD (SkipHandover).
  int32_t AcquireHandover(int64_t layer);

  // No forward will take the handed-over layers (the update is being joined without one): every
  // AcquireHandover waiting, or to come until the next Gate, returns -1.
  void EndHandoverWaits();

  // Zero-copy views of a handover slot, one per leaf (its layer_bytes).
  nanobind::list HandoverViews(int32_t slot);

  // The optimizer filled `slot` with layer `layer`: the forward takes it from there.
  void Handover(int64_t layer, int32_t slot);

  // No slot was free: the forward reads layer `layer` from SSD once it is ready.
  void SkipHandover(int64_t layer);

  void CheckLayer(int64_t layer, const char* what) const;

  // Layer `layer` holds its new weights: serve it (and read it ahead, if it is next in order).
  void MarkReady(int64_t layer);

  // The optimizer failed: every fetch still waiting (or to come) fails with `message`.
  void Fail(const std::string& message);

  bool ready(int64_t layer);

  // Bytes of one arena slot: one layer of every leaf, each 4096-aligned.
  int64_t slot_bytes() const { return slot_bytes_; }
  int64_t num_layers() const {
    if (leaves_.empty()) return 0;
    return leaves_[0].host ? leaves_[0].host_layers : static_cast<int64_t>(leaves_[0].regions.size());
  }
  int64_t num_leaves() const { return static_cast<int64_t>(leaves_.size()); }

  // Forgets what is in flight, then queues the first `depth` layers of `order`.
  void Begin(const std::vector<int32_t>& order, int depth);

  // Waits for what is in flight and releases its slots (after a step, and before closing).
  void Drain();

  // Copies layer `layer` of every leaf into outs[k] (sizes[k] bytes, dtypes[k]); "" or the error.
  std::string Fetch(int64_t layer, const std::vector<void*>& outs, const std::vector<size_t>& sizes,
                    const std::vector<xla::ffi::DataType>& dtypes);

  // (layer, asked, served) of each fetch since the last call, in seconds of the monotonic clock
  // (Python's time.perf_counter on Linux): the timeline of a step.
  std::vector<std::tuple<int64_t, double, double>> TakeEvents();

  // fetches, misses, bytes_read, wait_seconds, ... since creation.
  nanobind::dict Stats();

 private:
  struct Leaf {
    std::vector<int32_t> regions;
    int64_t layer_bytes = 0;
    int64_t slot_offset = 0;
    xla::ffi::DataType dtype = xla::ffi::F32;
    const uint8_t* host = nullptr;  // host leaf: every layer, layer_bytes each
    int64_t host_layers = 0;
    nanobind::ndarray<uint8_t, nanobind::ndim<1>, nanobind::c_contig> buffer;
  };
  struct Pending {
    int32_t layer = 0;
    int32_t slot = -1;
    bool handed = false;  // filled by the optimizer, not read
    IoTicket ticket;
  };

  static double Now();

  std::shared_ptr<ShardStore> Store() const {
    std::shared_ptr<ShardStore> s = store_.lock();
    return s && !s->closed() ? s : nullptr;
  }

  std::string FetchLocked(std::unique_lock<std::mutex>& lock, int64_t layer, const std::vector<void*>& outs,
                          const std::vector<size_t>& sizes, const std::vector<xla::ffi::DataType>& dtypes);

  // Queues layers of the order while fewer than depth_ are in flight, stopping at a layer the
  // optimizer has not updated yet. Caller holds mu_.
  Status IssueLocked();

  void DrainLocked(bool keep_handed = false);

  // The forward will free a slot by itself: its next layer is handed over. Caller holds mu_.
  bool ForwardFreesSlotLocked() const;

  // Every slot of the read-ahead is in flight or reserved for a handover. Caller holds mu_.
  bool SlotsTakenLocked() const { return static_cast<int>(inflight_.size()) + reserved_ >= depth_; }

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
  int reserved_ = 0;  // slots the optimizer holds for a handover not made yet (AcquireHandover)
  size_t served_ = 0;  // fetches since Begin: the forward's next layer is order_[served_]
  bool end_waits_ = false;  // EndHandoverWaits since the last Gate
  bool forward_pending_ = false;  // gated with a handover, and the forward has not begun yet
  double handover_wait_seconds_ = 0.0;  // the optimizer waiting in AcquireHandover for the forward
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

// The process-wide table of live sources: register_param_source adds one,
// unregister_param_source removes it, jaxascend_param_source and fetch_params_to_host find it.
HandleTable<ParamSource>& ParamSources();

}  // namespace jaxascend
