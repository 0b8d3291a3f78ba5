// The parameter source's core: the ParamSource class (see offload_param_source.h) and the table
// of live sources.
#include "offload_param_source.h"

#include <nanobind/stl/string.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <stdexcept>

#include "offload_grad_sink.h"
#include "ssd_arena.h"
#include "ssd_bindings.h"

namespace ffi = xla::ffi;
namespace nb = nanobind;

namespace jaxascend {
namespace {

int64_t AlignUp(int64_t n) { return (n + 4095) / 4096 * 4096; }

}  // namespace

HandleTable<ParamSource>& ParamSources() {
  static HandleTable<ParamSource>* table =
      new HandleTable<ParamSource>("parameter source");  // never destroyed: FFI calls may outlive Python
  return *table;
}

ParamSource::ParamSource(int64_t store_handle, std::string slot_class)
    : slot_class_(std::move(slot_class)) {
  std::shared_ptr<ShardStore> store = ShardStores().Find(store_handle);
  if (!store) throw nb::value_error(("ParamSource: " + ShardStores().Missing(store_handle)).c_str());
  store_ = store;
}

void ParamSource::AddHostLeaf(nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig> buffer, int64_t layer_bytes,
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

void ParamSource::AddLeaf(const std::vector<int32_t>& regions, int64_t layer_bytes, const std::string& dtype_name) {
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

void ParamSource::SetLayerRegion(int64_t leaf, int64_t layer, int32_t region) {
  CheckLayer(layer, "set_layer_region");
  const std::string what = "ParamSource.set_layer_region(" + std::to_string(leaf) + ", " + std::to_string(layer) + ")";
  std::shared_ptr<ShardStore> store = Store();
  if (!store) throw nb::value_error((what + ": the shard store is closed").c_str());
  std::lock_guard<std::mutex> lock(mu_);
  if (leaf < 0 || leaf >= static_cast<int64_t>(leaves_.size()) || leaves_[leaf].host != nullptr) {
    throw nb::value_error((what + ": no such region leaf (" + std::to_string(leaves_.size()) + " leaves)").c_str());
  }
  const StoreRegion* r = store->region(region);
  if (!r || r->nbytes != leaves_[leaf].layer_bytes) {
    throw nb::value_error((what + ": region id " + std::to_string(region) + " is not one of " +
                           std::to_string(leaves_[leaf].layer_bytes) + " bytes")
                              .c_str());
  }
  leaves_[leaf].regions[layer] = region;
}

void ParamSource::Gate(bool expect_handover) {
  std::lock_guard<std::mutex> lock(mu_);
  std::fill(ready_.begin(), ready_.end(), 0);
  const bool handover = expect_handover && !leaves_.empty() && leaves_[0].host == nullptr;
  handover_.assign(ready_.size(), handover ? kExpected : kNoHandover);
  failed_.clear();
  end_waits_ = false;
  // Until the next forward begins, it is as good as asking for layer 0: a forward that will not
  // come is one the update is joined without (EndHandoverWaits).
  forward_pending_ = handover;
}

int32_t ParamSource::AcquireHandover(int64_t layer) {
  CheckLayer(layer, "acquire_handover");
  std::shared_ptr<ShardStore> store = Store();
  if (!store) throw nb::value_error("ParamSource.acquire_handover: the shard store is closed");
  int32_t slot = -1;
  nb::gil_scoped_release release;
  std::unique_lock<std::mutex> lock(mu_);
  // A slot reserved here is the read-ahead's too: IssueLocked counts it until the handover, so
  // the two never ask the arena for more slots than the class has.
  if (SlotsTakenLocked() && ForwardFreesSlotLocked()) {  // the forward is behind: wait for it, not for the disk
    const auto start = std::chrono::steady_clock::now();
    ready_cv_.wait(lock, [&] { return !SlotsTakenLocked() || !ForwardFreesSlotLocked(); });
    handover_wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  if (SlotsTakenLocked()) return -1;
  if (!store->arena()->Acquire(slot_class_, slot_bytes_, &slot).ok()) return -1;
  ++reserved_;
  return slot;
}

bool ParamSource::ForwardFreesSlotLocked() const {
  if (end_waits_ || !failed_.empty()) return false;
  if (!forward_pending_ && (served_ >= forward_ || served_ >= order_.size())) return false;
  const int32_t next = forward_pending_ ? 0 : order_[served_];  // a forward goes up the stack
  for (const auto& p : inflight_) {
    if (p->handed && p->layer == next) return true;
  }
  return false;
}

void ParamSource::EndHandoverWaits() {
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(mu_);
  end_waits_ = true;
  ready_cv_.notify_all();
}

nb::list ParamSource::HandoverViews(int32_t slot) {
  std::shared_ptr<ShardStore> store = Store();
  if (!store) throw nb::value_error("ParamSource.handover_views: the shard store is closed");
  uint8_t* base = store->arena()->slots()[slot].data;
  nb::list out;
  // The views keep the arena alive (a capsule owns a reference), so numpy never copies them.
  for (const Leaf& leaf : leaves_) out.append(ArenaView(store->arena(), base + leaf.slot_offset, leaf.layer_bytes));
  return out;
}

void ParamSource::Handover(int64_t layer, int32_t slot) {
  CheckLayer(layer, "handover");
  {
    nb::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(mu_);
    auto p = std::make_unique<Pending>();
    p->layer = static_cast<int32_t>(layer);
    p->slot = slot;
    p->handed = true;
    if (reserved_ > 0) --reserved_;
    inflight_.push_back(std::move(p));
    handover_[layer] = kHanded;
    ++handovers_;
    IssueLocked();
    ready_cv_.notify_all();
  }
}

void ParamSource::SkipHandover(int64_t layer) {
  CheckLayer(layer, "skip_handover");
  nb::gil_scoped_release release;
  std::lock_guard<std::mutex> lock(mu_);
  handover_[layer] = kNoHandover;
  ++handover_skips_;
  IssueLocked();
  ready_cv_.notify_all();
}

void ParamSource::CheckLayer(int64_t layer, const char* what) const {
  if (layer < 0 || layer >= num_layers()) {
    throw nb::value_error(("ParamSource." + std::string(what) + ": layer " + std::to_string(layer) +
                           " is out of range (" + std::to_string(num_layers()) + " layers)")
                              .c_str());
  }
}

void ParamSource::MarkReady(int64_t layer) {
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

void ParamSource::Fail(const std::string& message) {
  std::lock_guard<std::mutex> lock(mu_);
  failed_ = message.empty() ? "the optimizer step failed" : message;
  ready_cv_.notify_all();
}

bool ParamSource::ready(int64_t layer) {
  std::lock_guard<std::mutex> lock(mu_);
  return layer >= 0 && layer < num_layers() && ready_[layer] != 0;
}

void ParamSource::Begin(const std::vector<int32_t>& order, int depth) {
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
    served_ = 0;
    forward_pending_ = false;
    depth_ = depth;
    s = IssueLocked();
  }
  if (!s.ok()) throw std::runtime_error("param_source: " + s.message());
}

void ParamSource::Drain() {
  std::lock_guard<std::mutex> lock(mu_);
  DrainLocked();
  order_.clear();
  next_ = 0;
  served_ = 0;
  ready_cv_.notify_all();  // an optimizer waiting for the forward's slots: no forward now
}

std::string ParamSource::Fetch(int64_t layer, const std::vector<void*>& outs, const std::vector<size_t>& sizes,
                               const std::vector<ffi::DataType>& dtypes) {
  const double asked = Now();
  std::unique_lock<std::mutex> lock(mu_);
  std::string err = FetchLocked(lock, layer, outs, sizes, dtypes);
  ++served_;  // the forward (or backward) has passed this layer and released its slot
  ready_cv_.notify_all();
  if (events_.size() < kMaxEvents) events_.push_back({layer, asked, Now()});
  return err;
}

std::vector<std::tuple<int64_t, double, double>> ParamSource::TakeEvents() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::tuple<int64_t, double, double>> out;
  for (const Event& e : events_) out.emplace_back(e.layer, e.asked, e.served);
  events_.clear();
  return out;
}

double ParamSource::Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

std::string ParamSource::FetchLocked(std::unique_lock<std::mutex>& lock, int64_t layer, const std::vector<void*>& outs,
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

nb::dict ParamSource::Stats() {
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
  d["handover_wait_seconds"] = handover_wait_seconds_;
  return d;
}

Status ParamSource::IssueLocked() {
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
    if (SlotsTakenLocked() || !ready_[layer]) break;
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

void ParamSource::DrainLocked(bool keep_handed) {
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

}  // namespace jaxascend
