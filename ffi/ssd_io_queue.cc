// Worker pool and tickets; see ssd_io_queue.h.
#include "ssd_io_queue.h"

#include <algorithm>

namespace jaxascend {

void IoTicket::AddPending(int64_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  pending_ += n;
}

void IoTicket::Complete(const Status& status) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!status.ok() && first_error_.ok()) first_error_ = status;
  if (--pending_ == 0) cv_.notify_all();
}

Status IoTicket::Wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return pending_ == 0; });
  Status out = first_error_;
  first_error_ = Status::Ok();
  return out;
}

bool IoTicket::idle() const {
  std::lock_guard<std::mutex> lock(mu_);
  return pending_ == 0;
}

IoQueue::IoQueue(int threads, Executor execute) : execute_(std::move(execute)) {
  for (int i = 0; i < std::max(1, threads); ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

IoQueue::~IoQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void IoQueue::Submit(const BlockRequest& request) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int d = static_cast<int>(request.direction);
    if (inflight_by_direction_[d]++ == 0) busy_since_[d] = Clock::now();
    counters_.inflight += 1;
    counters_.max_inflight = std::max(counters_.max_inflight, counters_.inflight);
    outstanding_ += 1;
    queue_.push_back(request);
  }
  work_cv_.notify_one();
}

void IoQueue::Drain() {
  std::unique_lock<std::mutex> lock(mu_);
  idle_cv_.wait(lock, [this] { return outstanding_ == 0; });
}

IoCounters IoQueue::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  IoCounters out = counters_;
  // Include the current busy period, so a reading taken mid-stream is not stale.
  const Clock::time_point now = Clock::now();
  for (int d = 0; d < 2; ++d) {
    if (inflight_by_direction_[d] > 0) {
      out.busy_seconds[d] += std::chrono::duration<double>(now - busy_since_[d]).count();
    }
  }
  return out;
}

void IoQueue::WorkerLoop() {
  for (;;) {
    BlockRequest request;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has been executed
      request = queue_.front();
      queue_.pop_front();
    }
    const Status status = execute_(request);
    {
      std::lock_guard<std::mutex> lock(mu_);
      const int d = static_cast<int>(request.direction);
      counters_.requests[d] += 1;
      if (status.ok()) {
        counters_.bytes[d] += request.io_bytes;
      } else {
        counters_.errors[d] += 1;
      }
      if (--inflight_by_direction_[d] == 0) {
        counters_.busy_seconds[d] += std::chrono::duration<double>(Clock::now() - busy_since_[d]).count();
      }
      counters_.inflight -= 1;
    }
    // The counters are updated before the ticket completes, so a waiter that wakes up sees
    // them current; Drain() waits for `outstanding_`, released only after the ticket is done
    // with, so a drained caller may destroy its tickets.
    request.ticket->Complete(status);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (--outstanding_ == 0) idle_cv_.notify_all();
    }
  }
}

}  // namespace jaxascend
