// Python bindings of the SSD engine (jaxascend._native): the exceptions, CRC-32C, fault injection
// and the CUDA runtime lookup here; the arena in ssd_arena_bindings.cc; the shard store and the
// streaming pass in ssd_store_bindings.cc.
//
// The Python owner classes (jaxascend/ssd/arena.py, jaxascend/ssd/store.py) are the public API;
// these bindings are thin. Every native Status becomes a Python exception here:
//   kInvalidArgument, kClosed          -> ValueError
//   kIoError                           -> StoreError(OSError) with .errno
//   kChecksumMismatch                  -> ChecksumError(StoreError), errno EBADMSG
//   kLocked                            -> StoreLockedError(StoreError), errno EBUSY
//   kArenaExhausted                    -> ArenaError(RuntimeError)
// Every call that waits for I/O releases the GIL.
#include "ssd_bindings.h"

#include <nanobind/stl/string.h>

#include <string>

#include "registry.h"
#include "ssd_crc32c.h"
#include "ssd_cuda_host.h"
#include "ssd_fault_injection.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

using ConstBytesArg = nb::ndarray<const uint8_t, nb::ndim<1>, nb::c_contig, nb::device::cpu>;

PyObject* g_store_error = nullptr;
PyObject* g_checksum_error = nullptr;
PyObject* g_locked_error = nullptr;
PyObject* g_arena_error = nullptr;

}  // namespace

[[noreturn]] void RaiseStatus(const Status& s) {
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

const ArenaSlot& ArenaSlotOrRaise(const Arena& arena, int32_t id) {
  if (!arena.valid_slot(id)) RaiseStatus(Status::InvalidArgument("no arena slot with id " + std::to_string(id)));
  return arena.slots()[id];
}

ByteView ArenaView(const std::shared_ptr<Arena>& arena, uint8_t* data, int64_t nbytes) {
  nb::capsule owner(new std::shared_ptr<Arena>(arena),
                    [](void* p) noexcept { delete static_cast<std::shared_ptr<Arena>*>(p); });
  return ByteView(data, {static_cast<size_t>(nbytes)}, owner);
}

namespace {

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
      "arm_fault", [](const std::string& spec) { CheckStatus(FaultInjector::Global().ArmFromSpec(spec)); },
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

void BindSsdEngine(nb::module_& m) {
  BindErrors(m);
  BindUtilities(m);
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindSsdEngine);

}  // namespace jaxascend
