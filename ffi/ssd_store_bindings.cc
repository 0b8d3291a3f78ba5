// Python bindings of the shard store (ssd_shard_store.h) and of its streaming pass
// (ssd_stream_pass.h); the owner class is jaxascend/ssd/store.py (SsdStore). A failed Status
// raises as ssd_bindings.cc says; every call that waits for I/O releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "registry.h"
#include "ssd_bindings.h"
#include "ssd_shard_store.h"
#include "ssd_stream_pass.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

using ConstBytesArg = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BytesArg = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

nb::dict CountersDict(const IoCounters& c) {
  nb::dict d;
  d["bytes_read"] = c.bytes[0];
  d["bytes_written"] = c.bytes[1];
  d["read_seconds"] = c.busy_seconds[0];
  d["write_seconds"] = c.busy_seconds[1];
  d["read_requests"] = c.requests[0];
  d["write_requests"] = c.requests[1];
  d["read_errors"] = c.errors[0];
  d["write_errors"] = c.errors[1];
  d["inflight"] = c.inflight;
  d["max_inflight"] = c.max_inflight;
  return d;
}

// Runs `io` (returning a Status) with the GIL released, then raises its error, if any.
template <typename Io>
void CheckWithoutGil(Io&& io) {
  Status st;
  {
    nb::gil_scoped_release release;
    st = io();
  }
  CheckStatus(st);
}

// Synchronous zero-copy I/O between a region and an arena slot.
void SlotIo(ShardStore& store, IoDirection dir, int32_t region, int64_t offset, int64_t nbytes, int32_t slot_id) {
  const ArenaSlot& slot = ArenaSlotOrRaise(*store.arena(), slot_id);
  if (nbytes > slot.nbytes) {
    RaiseStatus(Status::InvalidArgument("slot " + std::to_string(slot_id) + " ('" + slot.shape_class + "') holds " +
                                        std::to_string(slot.nbytes) + " bytes, not " + std::to_string(nbytes)));
  }
  Status s;
  {
    nb::gil_scoped_release release;
    IoTicket ticket;
    s = dir == IoDirection::kRead ? store.SubmitRead(region, offset, nbytes, slot.data, slot.capacity, &ticket)
                                  : store.SubmitWrite(region, offset, nbytes, slot.data, slot.capacity, &ticket);
    const Status waited = ticket.Wait();  // also after a failed submit: some blocks may be queued
    if (s.ok()) s = waited;
  }
  CheckStatus(s);
}

// region, offset, nbytes, read, write, write_region (-1: where it was read), write_offset
using SegmentTuple = std::tuple<int32_t, int64_t, int64_t, bool, bool, int32_t, int64_t>;

void BindStoreOptions(nb::module_& m) {
  nb::class_<StoreOptions>(m, "StoreOptions")
      .def(nb::init<>())
      .def_rw("dir", &StoreOptions::dir)
      .def_rw("shard_bytes", &StoreOptions::shard_bytes)
      .def_rw("block_bytes", &StoreOptions::block_bytes)
      .def_rw("staging_bytes", &StoreOptions::staging_bytes)
      .def_rw("staging_slots", &StoreOptions::staging_slots)
      .def_rw("io_threads", &StoreOptions::io_threads)
      .def_rw("io_engine", &StoreOptions::io_engine)
      .def_rw("queue_depth", &StoreOptions::queue_depth)
      .def_rw("direct_io", &StoreOptions::direct_io)
      .def_rw("preallocate", &StoreOptions::preallocate)
      .def_rw("drop_page_cache", &StoreOptions::drop_page_cache)
      .def_rw("keep_files", &StoreOptions::keep_files);
}

// ShardStore's opening, closing, properties and regions.
void BindShardStoreRegions(nb::class_<ShardStore>& cls) {
  cls.def_static("open",
                 [](const StoreOptions& options, std::shared_ptr<Arena> arena) {
                   std::shared_ptr<ShardStore> store;
                   CheckStatus(ShardStore::Open(options, std::move(arena), &store));
                   return store;
                 })
      .def("close",
           [](ShardStore& s) { CheckWithoutGil([&] { return s.Close(); }); })
      .def_prop_ro("closed", &ShardStore::closed)
      .def_prop_ro("handle", &ShardStore::handle)
      .def_prop_ro("direct_io", &ShardStore::direct_io)
      .def_prop_ro("io_mode_status", &ShardStore::io_mode_status)
      .def_prop_ro("io_engine", &ShardStore::io_engine)
      .def_prop_ro("io_engine_status", &ShardStore::io_engine_status)
      .def_prop_ro("num_regions", &ShardStore::num_regions)
      .def_prop_ro("num_shards", &ShardStore::num_shards)
      .def("shard_path", &ShardStore::shard_path)
      .def("add_region",
           [](ShardStore& s, const std::string& name, int64_t nbytes, bool in_memory) {
             int32_t id = -1;
             CheckStatus(s.AddRegion(name, nbytes, &id, in_memory));
             return id;
           },
           nb::arg("name"), nb::arg("nbytes"), nb::arg("in_memory") = false)
      .def("find_region",
           [](ShardStore& s, const std::string& name) {
             int32_t id = -1;
             CheckStatus(s.FindRegion(name, &id));
             return id;
           })
      .def("region_info",
           [](ShardStore& s, int32_t id) {
             const StoreRegion* r = s.region(id);
             if (!r) RaiseStatus(Status::InvalidArgument("unknown region id " + std::to_string(id)));
             std::vector<std::tuple<int32_t, int64_t, int64_t, int64_t>> extents;
             for (const StoreExtent& e : r->extents) extents.emplace_back(e.shard, e.file_offset, e.region_offset, e.disk_bytes);
             return std::make_tuple(r->name, r->nbytes, r->num_blocks, extents, r->in_memory());
           },
           "(name, nbytes, num_blocks, [(shard, file_offset, region_offset, disk_bytes)], in_memory).");
}

// ShardStore's reads and writes: through arena slots, from and to host bytes, and streamed passes.
void BindShardStoreIo(nb::class_<ShardStore>& cls) {
  cls.def("read_slot",
          [](ShardStore& s, int32_t region, int64_t offset, int64_t nbytes, int32_t slot) {
            SlotIo(s, IoDirection::kRead, region, offset, nbytes, slot);
          })
      .def("write_slot",
           [](ShardStore& s, int32_t region, int64_t offset, int64_t nbytes, int32_t slot) {
             SlotIo(s, IoDirection::kWrite, region, offset, nbytes, slot);
           })
      .def("write",
           [](ShardStore& s, int32_t region, int64_t offset, ConstBytesArg data, bool wait) {
             CheckWithoutGil([&] {
               return s.WriteFromHost(region, offset, data.data(), static_cast<int64_t>(data.shape(0)), wait);
             });
           },
           nb::arg("region"), nb::arg("offset"), nb::arg("data"), nb::arg("wait") = true)
      .def("read",
           [](ShardStore& s, int32_t region, int64_t offset, BytesArg out) {
             CheckWithoutGil(
                 [&] { return s.ReadToHost(region, offset, out.data(), static_cast<int64_t>(out.shape(0))); });
           })
      .def("flush",
           [](ShardStore& s) { CheckWithoutGil([&] { return s.Flush(); }); })
      .def("sync",
           [](ShardStore& s) { CheckWithoutGil([&] { return s.Sync(); }); })
      .def("counters", [](const ShardStore& s) { return CountersDict(s.counters()); })
      .def("stream",
           [](std::shared_ptr<ShardStore> store, const std::vector<std::vector<SegmentTuple>>& chunks,
              std::vector<std::string> slot_classes, int depth) {
             std::vector<std::vector<StreamSegment>> native(chunks.size());
             for (size_t c = 0; c < chunks.size(); ++c) {
               for (const auto& [region, offset, nbytes, read, write, write_region, write_offset] : chunks[c]) {
                 native[c].push_back({region, offset, nbytes, read, write, write_region, write_offset});
               }
             }
             std::unique_ptr<StreamPass> pass;
             CheckStatus(
                 StreamPass::Create(std::move(store), std::move(native), std::move(slot_classes), depth, &pass));
             return pass;
           },
           nb::arg("chunks"), nb::arg("slot_classes"), nb::arg("depth"),
           "chunks: [[(region, offset, nbytes, read, write, write_region, write_offset), ...], ...] (write_region -1: "
           "written back where read); one slot class per segment position.");
}

void BindStreamPass(nb::module_& m) {
  nb::class_<StreamPass>(m, "StreamPass", "A pipelined pass (see ssd_stream_pass.h); use SsdStore.stream().")
      .def("next",
           [](StreamPass& p) {
             bool has = false;
             CheckWithoutGil([&] { return p.Next(&has); });
             return has;
           })
      .def("finish",
           [](StreamPass& p) { CheckWithoutGil([&] { return p.Finish(); }); })
      .def("abort",
           [](StreamPass& p) {
             nb::gil_scoped_release release;
             p.Abort();
           })
      .def("wait_written_through",
           [](StreamPass& p, int64_t k) { CheckWithoutGil([&] { return p.WaitWrittenThrough(k); }); },
           nb::arg("k"), "Waits until every chunk <= k (below the current one) is written back.")
      .def_prop_ro("current", &StreamPass::current)
      .def_prop_ro("written_through", &StreamPass::written_through)
      .def_prop_ro("num_chunks", &StreamPass::num_chunks)
      .def_prop_ro("depth", &StreamPass::depth)
      .def("views",
           [](StreamPass& p) {
             if (p.current() < 0 || p.current() >= p.num_chunks()) {
               throw nb::value_error("stream: no current chunk (call next() first)");
             }
             nb::list out;
             for (int i = 0; i < p.num_segments(); ++i) {
               const ArenaSlot& slot = p.current_slot(i);
               out.append(ArenaView(p.store()->arena(), slot.data, p.current_segment(i).nbytes));
             }
             return out;
           },
           "Zero-copy uint8 views of the current chunk's segments, valid until the next next().");
}

void BindStore(nb::module_& m) {
  BindStoreOptions(m);
  nb::class_<ShardStore> store(m, "ShardStore",
                               "The SSD shard store (see ssd_shard_store.h); use jaxascend.ssd.store.SsdStore.");
  BindShardStoreRegions(store);
  BindShardStoreIo(store);
  BindStreamPass(m);
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindStore);

}  // namespace jaxascend
