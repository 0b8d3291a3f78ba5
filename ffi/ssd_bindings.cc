// Python bindings of the arena, the shard store and the streaming pass (jaxascend._native).
//
// The Python owner classes (jaxascend/ssd/arena.py, jaxascend/ssd/store.py) are the public API;
// these bindings are thin. Every native Status becomes a Python exception here:
//   kInvalidArgument, kClosed          -> ValueError
//   kIoError                           -> StoreError(OSError) with .errno
//   kChecksumMismatch                  -> ChecksumError(StoreError), errno EBADMSG
//   kLocked                            -> StoreLockedError(StoreError), errno EBUSY
//   kArenaExhausted                    -> ArenaError(RuntimeError)
// Every call that waits for I/O releases the GIL.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>

#include <tuple>

#include "ssd_arena.h"
#include "ssd_crc32c.h"
#include "ssd_cuda_host.h"
#include "ssd_fault_injection.h"
#include "registry.h"
#include "ssd_shard_store.h"
#include "ssd_stream_pass.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

using ByteView = nb::ndarray<nb::numpy, uint8_t, nb::ndim<1>>;
using ConstBytesArg = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;
using BytesArg = nb::ndarray<uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

PyObject* g_store_error = nullptr;
PyObject* g_checksum_error = nullptr;
PyObject* g_locked_error = nullptr;
PyObject* g_arena_error = nullptr;

[[noreturn]] void Raise(const Status& s) {
  PyObject* type = nullptr;
  switch (s.code()) {
    case StatusCode::kInvalidArgument:
    case StatusCode::kClosed:
      throw nb::value_error(s.message().c_str());
    case StatusCode::kArenaExhausted:
      PyErr_SetString(g_arena_error, s.message().c_str());
      throw nb::python_error();
    case StatusCode::kChecksumMismatch: type = g_checksum_error; break;
    case StatusCode::kLocked: type = g_locked_error; break;
    default: type = g_store_error; break;
  }
  // OSError(errno, message): sets .errno and .strerror; str() is "[Errno N] message".
  PyObject* args = Py_BuildValue("(is)", s.err_no(), s.message().c_str());
  PyErr_SetObject(type, args);
  Py_XDECREF(args);
  throw nb::python_error();
}

inline void Check(const Status& s) {
  if (!s.ok()) Raise(s);
}

// A zero-copy uint8 view of `nbytes` at `data`, keeping the arena alive while it exists.
ByteView ArenaView(const std::shared_ptr<Arena>& arena, uint8_t* data, int64_t nbytes) {
  nb::capsule owner(new std::shared_ptr<Arena>(arena),
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<Arena>*>(p); });
  return ByteView(data, {static_cast<size_t>(nbytes)}, owner);
}

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

// Synchronous zero-copy I/O between a region and an arena slot.
void SlotIo(ShardStore& store, IoDirection dir, int32_t region, int64_t offset, int64_t nbytes, int32_t slot_id) {
  const Arena& arena = *store.arena();
  if (!arena.valid_slot(slot_id)) Raise(Status::InvalidArgument("no arena slot with id " + std::to_string(slot_id)));
  const ArenaSlot& slot = arena.slots()[slot_id];
  if (nbytes > slot.nbytes) {
    Raise(Status::InvalidArgument("slot " + std::to_string(slot_id) + " ('" + slot.shape_class + "') holds " +
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
  Check(s);
}

using SegmentTuple = std::tuple<int32_t, int64_t, int64_t, bool, bool>;  // region, offset, nbytes, read, write

void BindErrors(nb::module_& m) {
  g_store_error = PyErr_NewExceptionWithDoc(
      "jaxascend.ssd.store.StoreError",
      "An SSD engine I/O error (OSError): .errno is set, and the message names the file, offset and operation.",
      PyExc_OSError, nullptr);
  g_checksum_error = PyErr_NewExceptionWithDoc(
      "jaxascend.ssd.store.ChecksumError",
      "A block read back from a shard file does not match its crc32c; the message names the file and offset.",
      g_store_error, nullptr);
  g_locked_error = PyErr_NewExceptionWithDoc(
      "jaxascend.ssd.store.StoreLockedError",
      "The offload directory is locked by another store; the message names the directory and the holder's pid.",
      g_store_error, nullptr);
  g_arena_error = PyErr_NewExceptionWithDoc(
      "jaxascend.ssd.arena.ArenaError",
      "The arena cannot satisfy a plan or a slot request; the message names the bytes needed and available.",
      PyExc_RuntimeError, nullptr);
  m.attr("StoreError") = nb::handle(g_store_error);
  m.attr("ChecksumError") = nb::handle(g_checksum_error);
  m.attr("StoreLockedError") = nb::handle(g_locked_error);
  m.attr("ArenaError") = nb::handle(g_arena_error);
}

void BindUtilities(nb::module_& m) {
  m.def(
      "crc32c",
      [](ConstBytesArg data, uint32_t value, const std::string& implementation) {
        if (implementation == "software") return Crc32cSoftware(data.data(), data.shape(0), value);
        if (implementation == "hardware") {
          if (!Crc32cHardwareAvailable()) throw nb::value_error("crc32c: this CPU has no SSE4.2 crc32 instruction");
          return Crc32cHardware(data.data(), data.shape(0), value);
        }
        if (implementation != "auto") throw nb::value_error("crc32c: implementation must be auto, software or hardware");
        return Crc32c(data.data(), data.shape(0), value);
      },
      nb::arg("data"), nb::arg("value") = 0, nb::arg("implementation") = "auto",
      "CRC-32C of a uint8 array, continuing from `value`.");
  m.def("crc32c_hardware_available", &Crc32cHardwareAvailable);
  m.def(
      "arm_fault", [](const std::string& spec) { Check(FaultInjector::Global().ArmFromSpec(spec)); },
      nb::arg("spec"), "Arms faults from a spec like 'write:3:ENOSPC,read:2:EIO' (see ssd_fault_injection.h).");
  m.def("clear_faults", [] { FaultInjector::Global().Clear(); }, "Disarms every injected fault.");
  m.def("fault_environment_status", [] {
    const Status& s = FaultInjector::Global().environment_status();
    return s.ok() ? std::string() : s.message();
  });
  m.def(
      "cuda_runtime_status",
      [] {
        const CudaRuntimeApi& api = CudaRuntime();
        nb::dict d;
        d["found"] = api.loaded;
        d["library"] = api.library;
        d["device_count"] = api.device_count;
        d["status"] = api.status;
        return d;
      },
      "What the run-time CUDA lookup found: {found, library, device_count, status}.");
}

void BindArena(nb::module_& m) {
  nb::class_<Arena>(m, "Arena", "The pinned host arena (see ssd_arena.h); use jaxascend.ssd.arena.HostArena.")
      .def_static(
          "create",
          [](int64_t capacity, const std::vector<std::tuple<std::string, int64_t, int64_t>>& plan, bool lock_memory,
             bool pin_memory, bool huge_pages) {
            std::vector<SlotRequest> requests;
            for (const auto& [cls, nbytes, count] : plan) requests.push_back({cls, nbytes, count});
            std::shared_ptr<Arena> arena;
            Check(Arena::Create({capacity, lock_memory, pin_memory, huge_pages}, requests, &arena));
            return arena;
          },
          nb::arg("capacity"), nb::arg("plan"), nb::arg("lock_memory") = true, nb::arg("pin_memory") = true,
          nb::arg("huge_pages") = true)
      .def_static("plan_bytes",
                  [](const std::vector<std::tuple<std::string, int64_t, int64_t>>& plan) {
                    std::vector<SlotRequest> requests;
                    for (const auto& [cls, nbytes, count] : plan) requests.push_back({cls, nbytes, count});
                    return Arena::PlanBytes(requests);
                  })
      .def_prop_ro("capacity", &Arena::capacity)
      .def_prop_ro("carved_bytes", &Arena::carved_bytes)
      .def_prop_ro("in_use_bytes", &Arena::in_use_bytes)
      .def_prop_ro("high_water_bytes", &Arena::high_water_bytes)
      .def_prop_ro("locked", &Arena::locked)
      .def_prop_ro("pinned", &Arena::pinned)
      .def_prop_ro("lock_status", &Arena::lock_status)
      .def_prop_ro("pin_status", &Arena::pin_status)
      .def_prop_ro("huge_page_status", &Arena::huge_page_status)
      .def_prop_ro("base_address", [](const Arena& a) { return reinterpret_cast<uintptr_t>(a.base()); })
      .def("slots",
           [](const Arena& a) {
             std::vector<std::tuple<int32_t, std::string, int64_t, int64_t, int64_t>> out;
             for (const ArenaSlot& s : a.slots()) out.emplace_back(s.id, s.shape_class, s.offset, s.nbytes, s.capacity);
             return out;
           },
           "(id, shape_class, offset, nbytes, capacity) per carved slot.")
      .def("acquire",
           [](Arena& a, const std::string& shape_class, int64_t min_bytes) {
             int32_t id = -1;
             Check(a.Acquire(shape_class, min_bytes, &id));
             return id;
           })
      .def("release", [](Arena& a, int32_t id) { Check(a.Release(id)); })
      .def("in_use", &Arena::in_use)
      .def("view", [](Arena& a, int32_t id) {
        if (!a.valid_slot(id)) Raise(Status::InvalidArgument("no arena slot with id " + std::to_string(id)));
        const ArenaSlot& s = a.slots()[id];
        return ArenaView(a.shared_from_this(), s.data, s.nbytes);
      }, "A zero-copy uint8 view of the slot's nbytes.");
}

void BindStore(nb::module_& m) {
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
      .def_rw("drop_page_cache", &StoreOptions::drop_page_cache);

  nb::class_<ShardStore>(m, "ShardStore", "The SSD shard store (see ssd_shard_store.h); use jaxascend.ssd.store.SsdStore.")
      .def_static("open",
                  [](const StoreOptions& options, std::shared_ptr<Arena> arena) {
                    std::shared_ptr<ShardStore> store;
                    Check(ShardStore::Open(options, std::move(arena), &store));
                    return store;
                  })
      .def("close",
           [](ShardStore& s) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = s.Close();
             }
             Check(st);
           })
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
           [](ShardStore& s, const std::string& name, int64_t nbytes) {
             int32_t id = -1;
             Check(s.AddRegion(name, nbytes, &id));
             return id;
           })
      .def("find_region",
           [](ShardStore& s, const std::string& name) {
             int32_t id = -1;
             Check(s.FindRegion(name, &id));
             return id;
           })
      .def("region_info",
           [](ShardStore& s, int32_t id) {
             const StoreRegion* r = s.region(id);
             if (!r) Raise(Status::InvalidArgument("unknown region id " + std::to_string(id)));
             std::vector<std::tuple<int32_t, int64_t, int64_t, int64_t>> extents;
             for (const StoreExtent& e : r->extents) extents.emplace_back(e.shard, e.file_offset, e.region_offset, e.disk_bytes);
             return std::make_tuple(r->name, r->nbytes, r->num_blocks, extents);
           },
           "(name, nbytes, num_blocks, [(shard, file_offset, region_offset, disk_bytes)]).")
      .def("read_slot",
           [](ShardStore& s, int32_t region, int64_t offset, int64_t nbytes, int32_t slot) {
             SlotIo(s, IoDirection::kRead, region, offset, nbytes, slot);
           })
      .def("write_slot",
           [](ShardStore& s, int32_t region, int64_t offset, int64_t nbytes, int32_t slot) {
             SlotIo(s, IoDirection::kWrite, region, offset, nbytes, slot);
           })
      .def("write",
           [](ShardStore& s, int32_t region, int64_t offset, ConstBytesArg data, bool wait) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = s.WriteFromHost(region, offset, data.data(), static_cast<int64_t>(data.shape(0)), wait);
             }
             Check(st);
           },
           nb::arg("region"), nb::arg("offset"), nb::arg("data"), nb::arg("wait") = true)
      .def("read",
           [](ShardStore& s, int32_t region, int64_t offset, BytesArg out) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = s.ReadToHost(region, offset, out.data(), static_cast<int64_t>(out.shape(0)));
             }
             Check(st);
           })
      .def("flush",
           [](ShardStore& s) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = s.Flush();
             }
             Check(st);
           })
      .def("counters", [](const ShardStore& s) { return CountersDict(s.counters()); })
      .def("stream",
           [](std::shared_ptr<ShardStore> store, const std::vector<std::vector<SegmentTuple>>& chunks,
              std::vector<std::string> slot_classes, int depth) {
             std::vector<std::vector<StreamSegment>> native(chunks.size());
             for (size_t c = 0; c < chunks.size(); ++c) {
               for (const auto& [region, offset, nbytes, read, write] : chunks[c]) {
                 native[c].push_back({region, offset, nbytes, read, write});
               }
             }
             std::unique_ptr<StreamPass> pass;
             Check(StreamPass::Create(std::move(store), std::move(native), std::move(slot_classes), depth, &pass));
             return pass;
           },
           nb::arg("chunks"), nb::arg("slot_classes"), nb::arg("depth"),
           "chunks: [[(region, offset, nbytes, read, write), ...], ...]; one slot class per segment position.");

  nb::class_<StreamPass>(m, "StreamPass", "A pipelined pass (see ssd_stream_pass.h); use SsdStore.stream().")
      .def("next",
           [](StreamPass& p) {
             Status st;
             bool has = false;
             {
               nb::gil_scoped_release release;
               st = p.Next(&has);
             }
             Check(st);
             return has;
           })
      .def("finish",
           [](StreamPass& p) {
             Status st;
             {
               nb::gil_scoped_release release;
               st = p.Finish();
             }
             Check(st);
           })
      .def("abort",
           [](StreamPass& p) {
             nb::gil_scoped_release release;
             p.Abort();
           })
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

void BindSsdEngine(nb::module_& m) {
  BindErrors(m);
  BindUtilities(m);
  BindArena(m);
  BindStore(m);
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindSsdEngine);

}  // namespace jaxascend
