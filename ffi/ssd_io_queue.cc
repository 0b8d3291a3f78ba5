// Tickets, shared accounting and the thread engine; see ssd_io_queue.h.
#include "ssd_io_queue.h"

#include <fcntl.h>
#include <pthread.h>
#include <unistd.h>

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

void IoQueue::Begin(const BlockRequest* requests, size_t n) {
  std::lock_guard<std::mutex> lock(mu_);
  for (size_t i = 0; i < n; ++i) {
    const int d = static_cast<int>(requests[i].direction);
    if (inflight_by_direction_[d]++ == 0) busy_since_[d] = Clock::now();
  }
  counters_.inflight += static_cast<int64_t>(n);
  counters_.max_inflight = std::max(counters_.max_inflight, counters_.inflight);
  outstanding_ += static_cast<int64_t>(n);
}

void IoQueue::End(const BlockRequest& request, const Status& status) {
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
  std::lock_guard<std::mutex> lock(mu_);
  if (--outstanding_ == 0) idle_cv_.notify_all();
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

Status ExecuteBlockSync(BlockHandler& handler, const BlockRequest& request) {
  BlockTransfer t;
  JAXASCEND_RETURN_IF_ERROR(handler.Prepare(request, &t));
  BlockOutcome outcome;
  const bool write = request.direction == IoDirection::kWrite;
  // The kernel may stop short (a signal, a buffered transfer); ask again for the rest until
  // it moves nothing or fails.
  while (outcome.bytes < t.want) {
    const size_t n = static_cast<size_t>(t.want - outcome.bytes);
    const int64_t off = t.file_offset + outcome.bytes;
    const ssize_t r = write ? pwrite(t.fd, request.buffer + outcome.bytes, n, off)
                            : pread(t.fd, request.buffer + outcome.bytes, n, off);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      outcome.err = errno;
      break;
    }
    if (r == 0) break;
    outcome.bytes += r;
  }
  if (write && t.sync_after && outcome.err == 0 && outcome.bytes == request.io_bytes &&
      sync_file_range(t.fd, t.file_offset, request.io_bytes,
                      SYNC_FILE_RANGE_WAIT_BEFORE | SYNC_FILE_RANGE_WRITE | SYNC_FILE_RANGE_WAIT_AFTER) != 0) {
    outcome.sync_err = errno;
  }
  return handler.Finish(request, t, outcome);
}

ThreadIoQueue::ThreadIoQueue(int threads, BlockHandler* handler) : handler_(handler) {
  for (int i = 0; i < std::max(1, threads); ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ThreadIoQueue::~ThreadIoQueue() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadIoQueue::Submit(const BlockRequest* requests, size_t n) {
  Begin(requests, n);
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.insert(queue_.end(), requests, requests + n);
  }
  if (n == 1) {
    work_cv_.notify_one();
  } else {
    work_cv_.notify_all();
  }
}

void ThreadIoQueue::WorkerLoop() {
  pthread_setname_np(pthread_self(), "ssd-io-thread");  // for top -H / perf; failure is harmless
  for (;;) {
    BlockRequest request;
    {
      std::unique_lock<std::mutex> lock(mu_);
      work_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything queued has been executed
      request = queue_.front();
      queue_.pop_front();
    }
    End(request, ExecuteBlockSync(*handler_, request));
  }
}

}  // namespace jaxascend
