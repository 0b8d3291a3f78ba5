// The host arena: one allocation made at start-up (2 MiB-aligned and advised into transparent
// huge pages when it is that large), locked in RAM and, when a CUDA device is present,
// registered as pinned memory, from which every staging buffer of the optimizer and the SSD
// engine is carved.
//
// Huge pages, because of the disk: an O_DIRECT request is split wherever its buffer is not
// physically contiguous, and on 4 KiB pages a 1 MiB block has 256 segments, past the 254 that
// the measured virtio disk takes per request, so every block went out as two requests. On 2 MiB
// pages a block is one or two segments and goes out whole (measured: docs/bench_io.md).
//
// Plan first, then allocate: Create() takes the whole plan (shape class, bytes, count) and
// carves every slot at once, at its exact size rounded only to the 4096-byte I/O alignment
// (no power-of-two classes). Afterwards nothing is allocated or freed: users Acquire() a free
// slot of a shape class and Release() it when done, every step. The arena reports its
// capacity, the bytes carved, the bytes of slots currently acquired and their high-water mark.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "ssd_io_status.h"

namespace jaxascend {

// One line of an arena plan: `count` slots of `nbytes` each for `shape_class`
// (any tag: "embedding", "attention", "mlp", "norm", "ssd_staging", ...).
struct SlotRequest {
  std::string shape_class;
  int64_t nbytes = 0;
  int64_t count = 0;
};

// One carved buffer. Records never move or change after Create().
struct ArenaSlot {
  int32_t id = -1;
  std::string shape_class;
  int64_t offset = 0;    // from the arena base, a multiple of 4096
  int64_t nbytes = 0;    // as planned
  int64_t capacity = 0;  // nbytes rounded up to 4096 (what I/O may touch)
  uint8_t* data = nullptr;
};

struct ArenaOptions {
  int64_t capacity = 0;     // bytes; rounded up to 4096
  bool lock_memory = true;  // mlock the arena (falls back to unlocked, with a status line)
  bool pin_memory = true;   // cudaHostRegister when a CUDA runtime and device are present
  bool huge_pages = true;   // madvise(MADV_HUGEPAGE) before the pages are touched
};

class Arena : public std::enable_shared_from_this<Arena> {
 public:
  // Total bytes a plan carves (each slot rounded up to 4096).
  static int64_t PlanBytes(const std::vector<SlotRequest>& plan);
  // Allocates, locks, pins and carves. A plan that does not fit is kArenaExhausted with
  // the bytes needed and available in the message.
  static Status Create(const ArenaOptions& options, const std::vector<SlotRequest>& plan,
                       std::shared_ptr<Arena>* out);
  ~Arena();
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;

  // Hands out the smallest free slot of `shape_class` whose capacity holds `min_bytes`.
  Status Acquire(const std::string& shape_class, int64_t min_bytes, int32_t* slot_id);
  Status Release(int32_t slot_id);

  const std::vector<ArenaSlot>& slots() const { return slots_; }
  bool valid_slot(int32_t id) const { return id >= 0 && id < static_cast<int32_t>(slots_.size()); }
  bool in_use(int32_t id) const;

  int64_t capacity() const { return capacity_; }
  int64_t carved_bytes() const { return carved_bytes_; }
  int64_t in_use_bytes() const;
  int64_t high_water_bytes() const;
  uint8_t* base() const { return base_; }
  bool locked() const { return locked_; }
  bool pinned() const { return pinned_; }
  const std::string& lock_status() const { return lock_status_; }
  const std::string& pin_status() const { return pin_status_; }
  const std::string& huge_page_status() const { return huge_page_status_; }

 private:
  Arena() = default;
  void LockAndPin(const ArenaOptions& options);

  uint8_t* base_ = nullptr;
  int64_t capacity_ = 0;
  int64_t carved_bytes_ = 0;
  bool locked_ = false;
  bool pinned_ = false;
  std::string lock_status_;
  std::string pin_status_;
  std::string huge_page_status_;
  std::vector<ArenaSlot> slots_;

  mutable std::mutex mu_;  // guards the fields below
  std::vector<char> busy_;
  int64_t in_use_bytes_ = 0;
  int64_t high_water_bytes_ = 0;
};

}  // namespace jaxascend
