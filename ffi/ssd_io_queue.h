// A pool of pread/pwrite worker threads for the SSD engine, with completion tickets and
// per-direction accounting.
//
// The store splits every read or write into one BlockRequest per checksum block and submits
// them here; `threads` workers execute them concurrently, so that many requests are in flight
// at once (the disk needs queue depth to reach its sequential bandwidth). A caller waits on an
// IoTicket that counts its outstanding requests and keeps the first error. Requests are plain
// structs in a deque: no allocation per request in the steady state.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
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

struct IoCounters {
  int64_t bytes[2] = {0, 0};           // per IoDirection, successful requests only
  double busy_seconds[2] = {0.0, 0.0};  // wall time with >= 1 request of that direction in flight
  int64_t requests[2] = {0, 0};
  int64_t errors[2] = {0, 0};
  int64_t inflight = 0;       // submitted and not yet completed, both directions
  int64_t max_inflight = 0;
};

class IoQueue {
 public:
  using Executor = std::function<Status(const BlockRequest&)>;
  IoQueue(int threads, Executor execute);
  ~IoQueue();  // finishes queued requests, then joins the workers
  IoQueue(const IoQueue&) = delete;
  IoQueue& operator=(const IoQueue&) = delete;

  // The caller has already added this request to its ticket (IoTicket::AddPending).
  void Submit(const BlockRequest& request);
  void Drain();  // returns once nothing is queued or executing
  IoCounters counters() const;

 private:
  using Clock = std::chrono::steady_clock;
  void WorkerLoop();

  Executor execute_;
  std::vector<std::thread> workers_;
  mutable std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<BlockRequest> queue_;
  bool stopping_ = false;
  int64_t inflight_by_direction_[2] = {0, 0};
  Clock::time_point busy_since_[2];
  int64_t outstanding_ = 0;  // submitted requests whose ticket has not yet been completed
  IoCounters counters_;
};

}  // namespace jaxascend
