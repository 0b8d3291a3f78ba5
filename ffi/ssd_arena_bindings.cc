// Python bindings of the pinned host arena (ssd_arena.h); the owner class is
// jaxascend/ssd/arena.py (HostArena). A failed Status raises as ssd_bindings.cc says.
#include <nanobind/nanobind.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <string>
#include <tuple>
#include <vector>

#include "registry.h"
#include "ssd_arena.h"
#include "ssd_bindings.h"

namespace nb = nanobind;

namespace jaxascend {
namespace {

void BindArena(nb::module_& m) {
  nb::class_<Arena>(m, "Arena", "The pinned host arena (see ssd_arena.h); use jaxascend.ssd.arena.HostArena.")
      .def_static(
          "create",
          [](int64_t capacity, const std::vector<std::tuple<std::string, int64_t, int64_t>>& plan, bool lock_memory,
             bool pin_memory, bool huge_pages) {
            std::vector<SlotRequest> requests;
            for (const auto& [cls, nbytes, count] : plan) requests.push_back({cls, nbytes, count});
            std::shared_ptr<Arena> arena;
            CheckStatus(Arena::Create({capacity, lock_memory, pin_memory, huge_pages}, requests, &arena));
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
             CheckStatus(a.Acquire(shape_class, min_bytes, &id));
             return id;
           })
      .def("release", [](Arena& a, int32_t id) { CheckStatus(a.Release(id)); })
      .def("in_use", &Arena::in_use)
      .def("view", [](Arena& a, int32_t id) {
        const ArenaSlot& s = ArenaSlotOrRaise(a, id);
        return ArenaView(a.shared_from_this(), s.data, s.nbytes);
      }, "A zero-copy uint8 view of the slot's nbytes.");
}

}  // namespace

JAXASCEND_REGISTER_BINDINGS(BindArena);

}  // namespace jaxascend
