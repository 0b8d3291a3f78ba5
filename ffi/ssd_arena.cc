// The host arena; see ssd_arena.h.
#include "ssd_arena.h"

#include <sys/mman.h>
#include <sys/resource.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>

#include "ssd_cuda_host.h"
#include "ssd_fault_injection.h"

namespace jaxascend {
namespace {

std::string DescribePlan(const std::vector<SlotRequest>& plan) {
  std::map<std::string, int64_t> per_class;
  for (const SlotRequest& r : plan) per_class[r.shape_class] += RoundUpToAlignment(r.nbytes) * r.count;
  std::string out;
  for (const auto& [name, bytes] : per_class) {
    out += (out.empty() ? "" : ", ") + name + ": " + std::to_string(bytes);
  }
  return out;
}

constexpr int64_t kHugePage = int64_t{2} << 20;

// The kernel's transparent-huge-page mode, e.g. "madvise" from "always [madvise] never".
std::string ThpMode() {
  FILE* f = std::fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
  if (!f) return "unknown";
  char line[128] = {0};
  const bool read = std::fgets(line, sizeof line, f) != nullptr;
  std::fclose(f);
  const char* open = read ? std::strchr(line, '[') : nullptr;
  const char* close = open ? std::strchr(open, ']') : nullptr;
  return close ? std::string(open + 1, close) : std::string("unknown");
}

// Advises [memory, memory + capacity) into huge pages before anything touches it.
std::string AdviseHugePages(void* memory, int64_t capacity, bool requested) {
  if (!requested) return "not requested (offload.huge_pages is false)";
  if (capacity < kHugePage) return "not used: the arena is smaller than one 2 MiB page";
  const int64_t span = capacity / kHugePage * kHugePage;
  if (madvise(memory, static_cast<size_t>(span), MADV_HUGEPAGE) != 0) {
    return "madvise(MADV_HUGEPAGE) failed: " + DescribeErrno(errno) + "; 4 KiB pages";
  }
  const std::string mode = ThpMode();
  if (mode == "never") return "transparent huge pages are disabled on this machine (never); 4 KiB pages";
  return "advised " + DescribeBytes(span) + " into 2 MiB pages (transparent_hugepage: " + mode + ")";
}

Status ValidatePlan(const std::vector<SlotRequest>& plan) {
  for (size_t i = 0; i < plan.size(); ++i) {
    const SlotRequest& r = plan[i];
    const std::string where = "arena plan entry " + std::to_string(i) + " ('" + r.shape_class + "')";
    if (r.shape_class.empty()) return Status::InvalidArgument(where + ": shape_class must be non-empty");
    if (r.nbytes < 1) return Status::InvalidArgument(where + ": nbytes must be >= 1, got " + std::to_string(r.nbytes));
    if (r.count < 1) return Status::InvalidArgument(where + ": count must be >= 1, got " + std::to_string(r.count));
  }
  return Status::Ok();
}

}  // namespace

int64_t Arena::PlanBytes(const std::vector<SlotRequest>& plan) {
  int64_t total = 0;
  for (const SlotRequest& r : plan) total += RoundUpToAlignment(r.nbytes) * r.count;
  return total;
}

Status Arena::Create(const ArenaOptions& options, const std::vector<SlotRequest>& plan,
                     std::shared_ptr<Arena>* out) {
  JAXASCEND_RETURN_IF_ERROR(ValidatePlan(plan));
  if (options.capacity < 1) {
    return Status::InvalidArgument("arena capacity must be >= 1 byte, got " + std::to_string(options.capacity));
  }
  const int64_t capacity = RoundUpToAlignment(options.capacity);
  const int64_t needed = PlanBytes(plan);
  if (needed > capacity) {
    return Status::ArenaExhausted("arena plan needs " + DescribeBytes(needed) + " but the arena capacity is " +
                                  DescribeBytes(capacity) + " (per shape class: " + DescribePlan(plan) + ")");
  }
  void* memory = nullptr;
  const bool huge = options.huge_pages && capacity >= kHugePage;
  const int rc = posix_memalign(&memory, huge ? kHugePage : kIoAlignment, static_cast<size_t>(capacity));
  if (rc != 0) {
    return Status::ArenaExhausted("arena: cannot allocate " + DescribeBytes(capacity) + ": " + DescribeErrno(rc));
  }
  std::shared_ptr<Arena> arena(new Arena());
  arena->base_ = static_cast<uint8_t*>(memory);
  arena->capacity_ = capacity;
  arena->huge_page_status_ = AdviseHugePages(memory, capacity, options.huge_pages);
  // Touch every page now, so the arena's footprint is paid at start-up, not in the I/O path.
  std::memset(memory, 0, static_cast<size_t>(capacity));
  arena->LockAndPin(options);

  int64_t offset = 0;
  for (const SlotRequest& r : plan) {
    for (int64_t k = 0; k < r.count; ++k) {
      ArenaSlot slot;
      slot.id = static_cast<int32_t>(arena->slots_.size());
      slot.shape_class = r.shape_class;
      slot.offset = offset;
      slot.nbytes = r.nbytes;
      slot.capacity = RoundUpToAlignment(r.nbytes);
      slot.data = arena->base_ + offset;
      offset += slot.capacity;
      arena->slots_.push_back(std::move(slot));
    }
  }
  arena->carved_bytes_ = offset;
  arena->busy_.assign(arena->slots_.size(), 0);
  *out = std::move(arena);
  return Status::Ok();
}

void Arena::LockAndPin(const ArenaOptions& options) {
  if (!options.lock_memory) {
    lock_status_ = "not requested (offload.lock_memory is false)";
  } else {
    const Fault fault = FaultInjector::Global().Check(FaultOp::kMlock);
    const int err = fault.err_no != 0 ? fault.err_no : (mlock(base_, capacity_) == 0 ? 0 : errno);
    if (err == 0) {
      locked_ = true;
      lock_status_ = "locked " + DescribeBytes(capacity_) + " in RAM";
    } else {
      struct rlimit limit {};
      getrlimit(RLIMIT_MEMLOCK, &limit);
      const std::string soft = limit.rlim_cur == RLIM_INFINITY ? std::string("unlimited")
                                                               : DescribeBytes(static_cast<int64_t>(limit.rlim_cur));
      lock_status_ = "mlock of " + DescribeBytes(capacity_) + " failed: " + DescribeErrno(err) +
                     "; RLIMIT_MEMLOCK is " + soft + "; the arena is not locked and may be swapped";
    }
  }
  if (!options.pin_memory) {
    pin_status_ = "not requested (offload.pin_memory is false)";
    return;
  }
  const CudaRuntimeApi& cuda = CudaRuntime();
  if (!cuda.loaded || cuda.device_count == 0) {
    pin_status_ = cuda.status;
    return;
  }
  const int err = cuda.host_register(base_, static_cast<size_t>(capacity_), kCudaHostRegisterPortable);
  if (err == 0) {
    pinned_ = true;
    pin_status_ = "registered " + DescribeBytes(capacity_) + " with cudaHostRegister (" + cuda.library + ")";
  } else {
    pin_status_ = "cudaHostRegister of " + DescribeBytes(capacity_) + " failed: " + cuda.ErrorString(err);
  }
}

Arena::~Arena() {
  if (pinned_) CudaRuntime().host_unregister(base_);
  if (locked_) munlock(base_, capacity_);
  std::free(base_);
}

Status Arena::Acquire(const std::string& shape_class, int64_t min_bytes, int32_t* slot_id) {
  std::lock_guard<std::mutex> lock(mu_);
  int32_t best = -1;
  int64_t of_class = 0, big_enough = 0, largest = 0;
  for (const ArenaSlot& s : slots_) {
    if (s.shape_class != shape_class) continue;
    ++of_class;
    largest = std::max(largest, s.capacity);
    if (s.capacity < min_bytes) continue;
    ++big_enough;
    if (!busy_[s.id] && (best < 0 || s.capacity < slots_[best].capacity)) best = s.id;
  }
  if (best < 0) {
    if (of_class == 0) {
      std::string classes;
      for (const ArenaSlot& s : slots_) {
        if (classes.find("'" + s.shape_class + "'") == std::string::npos) {
          classes += (classes.empty() ? "'" : ", '") + s.shape_class + "'";
        }
      }
      return Status::ArenaExhausted("arena has no slots of shape class '" + shape_class +
                                    "' (planned classes: " + (classes.empty() ? "none" : classes) + ")");
    }
    if (big_enough == 0) {
      return Status::ArenaExhausted("arena: no slot of shape class '" + shape_class + "' holds " +
                                    DescribeBytes(min_bytes) + " (largest: " + DescribeBytes(largest) + ")");
    }
    return Status::ArenaExhausted("arena: all " + std::to_string(big_enough) + " slots of shape class '" +
                                  shape_class + "' holding " + DescribeBytes(min_bytes) +
                                  " are in use; plan more slots of that class");
  }
  busy_[best] = 1;
  in_use_bytes_ += slots_[best].capacity;
  high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
  *slot_id = best;
  return Status::Ok();
}

Status Arena::Release(int32_t slot_id) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!valid_slot(slot_id)) {
    return Status::InvalidArgument("arena: no slot with id " + std::to_string(slot_id));
  }
  if (!busy_[slot_id]) {
    return Status::InvalidArgument("arena: slot " + std::to_string(slot_id) + " ('" +
                                   slots_[slot_id].shape_class + "') is not acquired");
  }
  busy_[slot_id] = 0;
  in_use_bytes_ -= slots_[slot_id].capacity;
  return Status::Ok();
}

bool Arena::in_use(int32_t id) const {
  std::lock_guard<std::mutex> lock(mu_);
  return valid_slot(id) && busy_[id];
}

int64_t Arena::in_use_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return in_use_bytes_;
}

int64_t Arena::high_water_bytes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return high_water_bytes_;
}

}  // namespace jaxascend
