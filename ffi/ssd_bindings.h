// What the SSD engine's binding files share (ssd_bindings.cc, ssd_arena_bindings.cc,
// ssd_store_bindings.cc): a native Status turned into its Python exception, and zero-copy
// views of arena memory.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>

#include <cstdint>
#include <memory>

#include "ssd_arena.h"
#include "ssd_io_status.h"

namespace jaxascend {

using ByteView = nanobind::ndarray<nanobind::numpy, uint8_t, nanobind::ndim<1>>;

// Raises the Python exception of a failed Status (the table at the top of ssd_bindings.cc).
[[noreturn]] void RaiseStatus(const Status& s);

inline void CheckStatus(const Status& s) {
  if (!s.ok()) RaiseStatus(s);
}

// Slot `id` of `arena`; raises ValueError when the arena has no such slot.
const ArenaSlot& ArenaSlotOrRaise(const Arena& arena, int32_t id);

// A zero-copy uint8 view of `nbytes` at `data`, keeping the arena alive while it exists.
ByteView ArenaView(const std::shared_ptr<Arena>& arena, uint8_t* data, int64_t nbytes);

}  // namespace jaxascend
