// The io_uring executor; see ssd_io_uring.h.
#include "ssd_io_uring.h"

#include <fcntl.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <cstring>

#include "ssd_fault_injection.h"

#if defined(__linux__) && __has_include(<linux/io_uring.h>) && defined(__NR_io_uring_setup)
#include <linux/io_uring.h>
#define JAXASCEND_HAVE_IO_URING 1
#else
#define JAXASCEND_HAVE_IO_URING 0
#endif

namespace jaxascend {

#if JAXASCEND_HAVE_IO_URING

namespace {

constexpr uint64_t kWakeTag = ~uint64_t{0};  // user_data of the eventfd read
constexpr unsigned kMaxSqesPerEnter = 2;      // more makes the kernel plug and merge (see the header)
constexpr int kMaxRetries = 16;               // EINTR/EAGAIN completions asked again

int Setup(unsigned entries, io_uring_params* p) {
  return static_cast<int>(syscall(__NR_io_uring_setup, entries, p));
}

int Enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags) {
  return static_cast<int>(syscall(__NR_io_uring_enter, fd, to_submit, min_complete, flags, nullptr, 0));
}

int Register(int fd, unsigned opcode, void* arg, unsigned nr_args) {
  return static_cast<int>(syscall(__NR_io_uring_register, fd, opcode, arg, nr_args));
}

}  // namespace

struct UringIoQueue::Ring {
  int fd = -1;
  void* sq_map = nullptr;
  size_t sq_map_bytes = 0;
  void* cq_map = nullptr;  // == sq_map with IORING_FEAT_SINGLE_MMAP
  size_t cq_map_bytes = 0;
  io_uring_sqe* sqes = nullptr;
  size_t sqes_bytes = 0;

  std::atomic<unsigned>* sq_head = nullptr;
  std::atomic<unsigned>* sq_tail = nullptr;
  unsigned sq_mask = 0;
  unsigned sq_entries = 0;
  std::atomic<unsigned>* cq_head = nullptr;
  std::atomic<unsigned>* cq_tail = nullptr;
  unsigned cq_mask = 0;
  io_uring_cqe* cqes = nullptr;
  unsigned sq_local_tail = 0;  // SQEs written; published to sq_tail when submitted

  ~Ring() {
    if (sqes) munmap(sqes, sqes_bytes);
    if (cq_map && cq_map != sq_map) munmap(cq_map, cq_map_bytes);
    if (sq_map) munmap(sq_map, sq_map_bytes);
    if (fd >= 0) close(fd);
  }

  Status Map(const io_uring_params& p) {
    auto fail = [](const char* what) {
      const int err = errno;
      return Status::Io(err, std::string("io_uring: cannot mmap the ") + what + ": " + DescribeErrno(err));
    };
    sq_map_bytes = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    cq_map_bytes = p.cq_off.cqes + p.cq_entries * sizeof(io_uring_cqe);
    const bool single = (p.features & IORING_FEAT_SINGLE_MMAP) != 0;
    if (single) sq_map_bytes = cq_map_bytes = std::max(sq_map_bytes, cq_map_bytes);
    sq_map = mmap(nullptr, sq_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQ_RING);
    if (sq_map == MAP_FAILED) {
      sq_map = nullptr;
      return fail("submission ring");
    }
    if (single) {
      cq_map = sq_map;
    } else {
      cq_map = mmap(nullptr, cq_map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_CQ_RING);
      if (cq_map == MAP_FAILED) {
        cq_map = nullptr;
        return fail("completion ring");
      }
    }
    sqes_bytes = p.sq_entries * sizeof(io_uring_sqe);
    void* s = mmap(nullptr, sqes_bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, IORING_OFF_SQES);
    if (s == MAP_FAILED) return fail("submission entries");
    sqes = static_cast<io_uring_sqe*>(s);

    uint8_t* sq = static_cast<uint8_t*>(sq_map);
    uint8_t* cq = static_cast<uint8_t*>(cq_map);
    sq_head = reinterpret_cast<std::atomic<unsigned>*>(sq + p.sq_off.head);
    sq_tail = reinterpret_cast<std::atomic<unsigned>*>(sq + p.sq_off.tail);
    sq_mask = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_mask);
    sq_entries = *reinterpret_cast<unsigned*>(sq + p.sq_off.ring_entries);
    unsigned* array = reinterpret_cast<unsigned*>(sq + p.sq_off.array);
    for (unsigned i = 0; i < sq_entries; ++i) array[i] = i;  // SQE i always sits at ring position i
    cq_head = reinterpret_cast<std::atomic<unsigned>*>(cq + p.cq_off.head);
    cq_tail = reinterpret_cast<std::atomic<unsigned>*>(cq + p.cq_off.tail);
    cq_mask = *reinterpret_cast<unsigned*>(cq + p.cq_off.ring_mask);
    cqes = reinterpret_cast<io_uring_cqe*>(cq + p.cq_off.cqes);
    sq_local_tail = sq_tail->load(std::memory_order_relaxed);
    return Status::Ok();
  }

  // The kernel must be able to do what the engine asks (IORING_OP_READ/WRITE: Linux 5.6).
  Status Probe() {
    const size_t bytes = sizeof(io_uring_probe) + 256 * sizeof(io_uring_probe_op);
    std::vector<uint8_t> buffer(bytes, 0);
    auto* probe = reinterpret_cast<io_uring_probe*>(buffer.data());
    if (Register(fd, IORING_REGISTER_PROBE, probe, 256) < 0) {
      const int err = errno;
      return Status::Io(err, "io_uring: IORING_REGISTER_PROBE failed: " + DescribeErrno(err) +
                                 " (the kernel predates Linux 5.6)");
    }
    for (int op : {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_SYNC_FILE_RANGE}) {
      if (op > probe->last_op || !(probe->ops[op].flags & IO_URING_OP_SUPPORTED)) {
        return Status::Io(EOPNOTSUPP, "io_uring: the kernel does not support opcode " + std::to_string(op) +
                                          " (IORING_OP_READ/WRITE/SYNC_FILE_RANGE are needed)");
      }
    }
    return Status::Ok();
  }

  // A zeroed SQE at the local tail; the ring has room (at most depth + 1 are ever in use).
  io_uring_sqe* Next(uint64_t user_data) {
    io_uring_sqe* sqe = &sqes[sq_local_tail & sq_mask];
    std::memset(sqe, 0, sizeof *sqe);
    sqe->user_data = user_data;
    ++sq_local_tail;
    return sqe;
  }
};

Status UringIoQueue::Create(int queue_depth, BlockHandler* handler, std::unique_ptr<IoQueue>* out) {
  const Fault fault = FaultInjector::Global().Check(FaultOp::kIoUringSetup);
  if (fault.err_no != 0) {
    return Status::Io(fault.err_no, "io_uring_setup failed: " + DescribeErrno(fault.err_no) + " (injected)");
  }
  auto ring = std::make_unique<Ring>();
  io_uring_params p;
  std::memset(&p, 0, sizeof p);
  const unsigned entries = static_cast<unsigned>(queue_depth) + 1;  // + the eventfd read
  ring->fd = Setup(entries, &p);
  if (ring->fd < 0) {
    const int err = errno;
    return Status::Io(err, "io_uring_setup(" + std::to_string(entries) + " entries) failed: " + DescribeErrno(err));
  }
  JAXASCEND_RETURN_IF_ERROR(ring->Map(p));
  JAXASCEND_RETURN_IF_ERROR(ring->Probe());
  const int wake_fd = eventfd(0, EFD_CLOEXEC);
  if (wake_fd < 0) {
    const int err = errno;
    return Status::Io(err, "io_uring: eventfd failed: " + DescribeErrno(err));
  }
  out->reset(new UringIoQueue(queue_depth, handler, std::move(ring), wake_fd));
  return Status::Ok();
}

UringIoQueue::UringIoQueue(int queue_depth, BlockHandler* handler, std::unique_ptr<Ring> ring, int wake_fd)
    : depth_(queue_depth), handler_(handler), ring_(std::move(ring)), wake_fd_(wake_fd) {
  slots_.resize(static_cast<size_t>(depth_));
  for (int i = depth_ - 1; i >= 0; --i) free_slots_.push_back(i);
  queued_slots_.reserve(static_cast<size_t>(depth_) + 1);
  done_.reserve(static_cast<size_t>(depth_));
  thread_ = std::thread([this] { RingLoop(); });
}

UringIoQueue::~UringIoQueue() {
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
    wake = sleeping_ && !wake_sent_;
    wake_sent_ = wake_sent_ || wake;
  }
  cv_.notify_all();
  if (wake) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);
  }
  thread_.join();
  ring_.reset();  // closes the ring; the eventfd read, if armed, goes with it
  close(wake_fd_);
}

void UringIoQueue::Submit(const BlockRequest* requests, size_t n) {
  Begin(requests, n);
  bool wake = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    pending_.insert(pending_.end(), requests, requests + n);
    if (idle_) {
      cv_.notify_one();
    } else if (sleeping_ && !wake_sent_) {
      wake = wake_sent_ = true;
    }
  }
  if (wake) {
    const uint64_t one = 1;
    (void)!write(wake_fd_, &one, sizeof one);  // an eventfd write of 1 cannot fail short of overflow
  }
}

void UringIoQueue::PrepareReady(Ready& r) {
  r.status = handler_->Prepare(r.request, &r.transfer);
  r.prepared = true;
}

// Moves ready requests into free slots, submitting every kMaxSqesPerEnter, so the first goes
// out without waiting for the others.
void UringIoQueue::FillSlots() {
  while (!free_slots_.empty() && !ready_.empty()) {
    Ready r = ready_.front();
    ready_.pop_front();
    if (!r.prepared) PrepareReady(r);
    if (!r.status.ok() || r.transfer.want == 0) {  // no I/O; want 0: a fault left nothing to move
      done_.push_back(Done{r.request, r.transfer, BlockOutcome{}, r.status});
      continue;
    }
    const int s = free_slots_.back();
    free_slots_.pop_back();
    ++in_ring_;
    Slot& slot = slots_[s];
    slot = Slot{};
    slot.request = r.request;
    slot.transfer = r.transfer;
    QueueTransfer(s);
    if (queued_slots_.size() >= kMaxSqesPerEnter) SubmitQueued(/*wait=*/false);
  }
}

void UringIoQueue::QueueTransfer(int s) {
  Slot& slot = slots_[s];
  const BlockTransfer& t = slot.transfer;
  io_uring_sqe* sqe = ring_->Next(static_cast<uint64_t>(s));
  sqe->opcode = slot.request.direction == IoDirection::kWrite ? IORING_OP_WRITE : IORING_OP_READ;
  sqe->fd = t.fd;
  sqe->addr = reinterpret_cast<uint64_t>(slot.request.buffer + slot.outcome.bytes);
  sqe->len = static_cast<uint32_t>(t.want - slot.outcome.bytes);
  sqe->off = static_cast<uint64_t>(t.file_offset + slot.outcome.bytes);
  queued_slots_.push_back(s);
}

void UringIoQueue::QueueSync(int s) {
  Slot& slot = slots_[s];
  slot.syncing = true;
  io_uring_sqe* sqe = ring_->Next(static_cast<uint64_t>(s));
  sqe->opcode = IORING_OP_SYNC_FILE_RANGE;
  sqe->fd = slot.transfer.fd;
  sqe->off = static_cast<uint64_t>(slot.transfer.file_offset);
  sqe->len = static_cast<uint32_t>(slot.request.io_bytes);
  sqe->sync_range_flags = SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER;
  queued_slots_.push_back(s);
}

void UringIoQueue::QueueWakeRead() {
  io_uring_sqe* sqe = ring_->Next(kWakeTag);
  sqe->opcode = IORING_OP_READ;
  sqe->fd = wake_fd_;
  sqe->addr = reinterpret_cast<uint64_t>(&wake_value_);
  sqe->len = sizeof wake_value_;
  sqe->off = 0;
  wake_armed_ = true;
  queued_slots_.push_back(-1);
}

bool UringIoQueue::SubmitQueued(bool wait) {
  const size_t total = queued_slots_.size();
  const unsigned base = ring_->sq_local_tail - static_cast<unsigned>(total);  // ring position of the first
  size_t next = 0;  // SQEs the kernel has consumed
  int busy = 0;
  while (next < total || wait) {
    const unsigned batch = static_cast<unsigned>(std::min<size_t>(total - next, kMaxSqesPerEnter));
    const bool last = next + batch == total;
    const unsigned min_complete = last && wait ? 1 : 0;
    // The kernel consumes SQEs up to the published tail: publish only this batch.
    ring_->sq_tail->store(base + static_cast<unsigned>(next) + batch, std::memory_order_release);
    const int r = Enter(ring_->fd, batch, min_complete, min_complete ? IORING_ENTER_GETEVENTS : 0);
    if (r > 0 || (r == 0 && batch == 0)) {
      // The count consumed, even when the wait that followed was interrupted (RingLoop reaps
      // and comes back).
      next += static_cast<size_t>(r);
      if (last && static_cast<unsigned>(r) == batch) break;
      continue;
    }
    const int err = r < 0 ? errno : EAGAIN;  // 0 of a non-empty batch: try again
    if (err == EINTR && batch == 0) break;
    if (err == EINTR || ((err == EAGAIN || err == EBUSY) && ++busy < 1000)) {
      sched_yield();
      continue;
    }
    // The ring is unusable: fail what it did not take; what it took still completes.
    ring_->sq_tail->store(base + static_cast<unsigned>(next), std::memory_order_release);
    ring_->sq_local_tail = base + static_cast<unsigned>(next);
    for (size_t i = next; i < total; ++i) {
      const int s = queued_slots_[i];
      if (s < 0) {
        wake_armed_ = false;
        continue;
      }
      Slot& slot = slots_[s];
      done_.push_back(Done{slot.request, slot.transfer, slot.outcome,
                           Status::Io(err, "io_uring_enter failed: " + DescribeErrno(err))});
      free_slots_.push_back(s);
      --in_ring_;
    }
    queued_slots_.clear();
    return false;
  }
  queued_slots_.clear();
  return true;
}

void UringIoQueue::Reap() {
  unsigned head = ring_->cq_head->load(std::memory_order_relaxed);
  const unsigned tail = ring_->cq_tail->load(std::memory_order_acquire);
  for (; head != tail; ++head) {
    const io_uring_cqe& cqe = ring_->cqes[head & ring_->cq_mask];
    if (cqe.user_data == kWakeTag) {
      wake_armed_ = false;
      std::lock_guard<std::mutex> lock(mu_);
      wake_sent_ = false;
      continue;
    }
    const int s = static_cast<int>(cqe.user_data);
    Slot& slot = slots_[s];
    const int res = cqe.res;
    if (slot.syncing) {
      if (res < 0) slot.outcome.sync_err = -res;
    } else if ((res == -EINTR || res == -EAGAIN) && slot.retries < kMaxRetries) {
      ++slot.retries;
      QueueTransfer(s);
      continue;
    } else if (res < 0) {
      slot.outcome.err = -res;
    } else {
      slot.outcome.bytes += res;
      if (res > 0 && slot.outcome.bytes < slot.transfer.want) {  // short: ask for the rest
        QueueTransfer(s);
        continue;
      }
      if (slot.request.direction == IoDirection::kWrite && slot.transfer.sync_after &&
          slot.outcome.bytes == slot.request.io_bytes) {
        QueueSync(s);
        continue;
      }
    }
    done_.push_back(Done{slot.request, slot.transfer, slot.outcome, Status::Ok()});
    free_slots_.push_back(s);
    --in_ring_;
  }
  ring_->cq_head->store(head, std::memory_order_release);
}

void UringIoQueue::FinishDone() {
  for (Done& d : done_) {
    const Status status = d.status.ok() ? handler_->Finish(d.request, d.transfer, d.outcome) : d.status;
    End(d.request, status);
  }
  done_.clear();
}

void UringIoQueue::RingLoop() {
  pthread_setname_np(pthread_self(), "ssd-io-uring");  // for top -H / perf; failure is harmless
  const size_t max_ready = 2 * static_cast<size_t>(depth_);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      if (in_ring_ == 0 && done_.empty() && queued_slots_.empty() && ready_.empty()) {
        idle_ = true;
        cv_.wait(lock, [this] { return stopping_ || !pending_.empty(); });
        idle_ = false;
        if (pending_.empty()) return;  // stopping, and everything queued has been executed
      }
      while (!pending_.empty() && ready_.size() < max_ready) {
        ready_.emplace_back();
        ready_.back().request = pending_.front();
        pending_.pop_front();
      }
    }
    FillSlots();
    SubmitQueued(/*wait=*/false);
    // The disk now works on every slot: verify what completed, then checksum what comes next.
    FinishDone();
    size_t ahead = 0;
    for (Ready& r : ready_) {
      if (ahead++ == static_cast<size_t>(depth_)) break;
      if (!r.prepared) PrepareReady(r);
    }
    bool wait = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      const bool more = !ready_.empty() || !pending_.empty();
      wait = in_ring_ > 0 && (free_slots_.empty() || !more);
      sleeping_ = wait;
    }
    if (wait && !wake_armed_) QueueWakeRead();
    SubmitQueued(wait);
    {
      std::lock_guard<std::mutex> lock(mu_);
      sleeping_ = false;
    }
    Reap();
  }
}

#else  // !JAXASCEND_HAVE_IO_URING

struct UringIoQueue::Ring {};

Status UringIoQueue::Create(int, BlockHandler*, std::unique_ptr<IoQueue>*) {
  return Status::Io(ENOSYS, "io_uring is not available in this build (no <linux/io_uring.h>)");
}
UringIoQueue::~UringIoQueue() = default;
void UringIoQueue::Submit(const BlockRequest*, size_t) {}

#endif

}  // namespace jaxascend
