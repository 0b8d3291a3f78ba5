// The SSD engine's request queue: completion tickets, per-direction accounting, and the
// interface both executors implement (ThreadIoQueue here, UringIoQueue in ssd_io_uring.h).
//
// The store splits every read or write into one BlockRequest per checksum block and submits
// them here; the executor keeps several in flight at once (the disk needs queue depth to reach
// its sequential bandwidth). A caller waits on an IoTicket that counts its outstanding requests
// and keeps the first error. What a request transfers, and what its outcome means (checksums,
// injected faults, short transfers), is the store's business: the executor asks a BlockHandler
// to Prepare() the transfer and to Finish() it, and only moves the bytes in between.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "ssd_io_status.h"

namespace jaxascend {

enum class IoDirection { kRead = 0, kWrite = 1 };

// Completion state of one logical operation (any number of requests). Reusable: after
// Wait() returns, the ticket is idle and may be used for the next operation.
class IoTicket {
 public:
  void AddPending(int64_t n);
  void Complete(const Status& status);
  // Blocks until every pending request completed; returns (and clears) the first error.
  Status Wait();
  bool idle() const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  int64_t pending_ = 0;
  Status first_error_;
};

struct StoreRegion;

struct BlockRequest {
  IoDirection direction = IoDirection::kRead;
  StoreRegion* region = nullptr;
  int64_t block = 0;       // block index within the region
  uint8_t* buffer = nullptr;
  int64_t io_bytes = 0;    // bytes moved to/from disk (for accounting)
  IoTicket* ticket = nullptr;
};

// What the store resolved for one request before it is issued.
struct BlockTransfer {
  int fd = -1;
  int64_t file_offset = 0;
  int64_t want = 0;         // bytes to transfer: io_bytes, or fewer when a fault shortens it
  uint32_t crc = 0;         // writes: crc32c of the block, computed before the transfer
  bool sync_after = false;  // buffered writes: sync_file_range after the write
};

// How the transfer went, as the executor saw it.
struct BlockOutcome {
  int64_t bytes = 0;  // bytes transferred (less than want: the kernel stopped short)
  int err = 0;        // errno of the failed read/write, 0 if none
  int sync_err = 0;   // errno of the failed sync_file_range, 0 if none
};

// The store's side of a request.
class BlockHandler {
 public:
  virtual ~BlockHandler() = default;
  // Resolves file and offset, applies injected faults, checksums a write. An error completes
  // the request with that error and no I/O.
  virtual Status Prepare(const BlockRequest& request, BlockTransfer* transfer) = 0;
  // Turns the outcome into a Status (short transfers, a read's checksum) and records a
  // written block's checksum.
  virtual Status Finish(const BlockRequest& request, const BlockTransfer& transfer,
                        const BlockOutcome& outcome) = 0;
};

struct IoCounters {
  int64_t bytes[2] = {0, 0};           // per IoDirection, successful requests only
  double busy_seconds[2] = {0.0, 0.0};  // wall time with >= 1 request of that direction in flight
  int64_t requests[2] = {0, 0};
  int64_t errors[2] = {0, 0};
  int64_t inflight = 0;       // submitted and not yet completed, both directions
  int64_t max_inflight = 0;
};

// The executor interface, with the bookkeeping every executor shares: counters, busy time,
// completing tickets, and Drain().
class IoQueue {
 public:
  virtual ~IoQueue() = default;
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // The caller has already added these requests to their tickets (IoTicket::AddPending).
  virtual void Submit(const BlockRequest* requests, size_t n) = 0;
  void Submit(const BlockRequest& request) { Submit(&request, 1); }
  virtual const char* engine() const = 0;  // "io_uring" or "threads"
  void Drain();  // returns once nothing is queued or executing
  IoCounters counters() const;

 protected:
  IoQueue() = default;
  // Executors call Begin() when requests enter and End() once each is done (any thread).
  void Begin(const BlockRequest* requests, size_t n);
  void End(const BlockRequest& request, const Status& status);

 private:
  using Clock = std::chrono::steady_clock;
  mutable std::mutex mu_;
  std::condition_variable idle_cv_;
  int64_t inflight_by_direction_[2] = {0, 0};
  Clock::time_point busy_since_[2];
  int64_t outstanding_ = 0;  // submitted requests whose ticket has not yet been completed
  IoCounters counters_;
};

// Runs one request synchronously with pread/pwrite (the thread engine's whole job).
Status ExecuteBlockSync(BlockHandler& handler, const BlockRequest& request);

// A pool of `threads` workers, each executing one request at a time with pread/pwrite.
class ThreadIoQueue : public IoQueue {
 public:
  ThreadIoQueue(int threads, BlockHandler* handler);
  ~ThreadIoQueue() override;  // finishes queued requests, then joins the workers

  void Submit(const BlockRequest* requests, size_t n) override;
  const char* engine() const override { return "threads"; }

 private:
  void WorkerLoop();

  BlockHandler* handler_;
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::deque<BlockRequest> queue_;
  bool stopping_ = false;
};

}  // namespace jaxascend
