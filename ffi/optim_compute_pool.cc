// The compute pool behind ParallelFor (see optim_compute_pool.h).
#include "optim_compute_pool.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

namespace jaxascend {
namespace {

class ComputePool {
 public:
  // Leaked on purpose: workers block on cv_ until the process exits, and a static destructor
  // joining them could run after the interpreter has torn down what they reference.
  // A forked child has none of the parent's workers (and maybe a mutex locked by one), so it
  // starts over with a fresh pool; the parent's copy is leaked in the child.
  static ComputePool& Get() {
    static std::once_flag once;
    std::call_once(once, [] {
      Slot() = new ComputePool();
      pthread_atfork(nullptr, nullptr, [] { Slot() = new ComputePool(); });
    });
    return *Slot();
  }

  // Starts workers until there are at least `count`.
  void EnsureWorkers(int count) {
    std::lock_guard<std::mutex> lock(mu_);
    while (static_cast<int>(workers_.size()) < count) {
      workers_.emplace_back([this] { WorkerLoop(); });
    }
  }

  void Submit(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queue_.push_back(std::move(task));
    }
    cv_.notify_one();
  }

  int Workers() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<int>(workers_.size());
  }

 private:
  void WorkerLoop() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [this] { return !queue_.empty(); });
        task = std::move(queue_.front());
        queue_.pop_front();
      }
      task();
    }
  }

  static ComputePool*& Slot() {
    static ComputePool* pool = nullptr;
    return pool;
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> workers_;
};

// Counts outstanding ranges of one ParallelFor call; lives on the caller's stack.
struct Latch {
  std::mutex mu;
  std::condition_variable cv;
  int pending;

  void CountDown() {
    std::lock_guard<std::mutex> lock(mu);
    if (--pending == 0) cv.notify_all();
  }
  void Wait() {
    std::unique_lock<std::mutex> lock(mu);
    cv.wait(lock, [this] { return pending == 0; });
  }
};

}  // namespace

void ParallelFor(int64_t n, int threads, int64_t align, int64_t min_per_thread,
                 const std::function<void(int64_t, int64_t)>& body) {
  align = std::max<int64_t>(align, 1);
  int64_t parts = std::min<int64_t>(std::max(threads, 1), kComputePoolMaxThreads);
  parts = std::min<int64_t>(parts, std::max<int64_t>(n / std::max<int64_t>(min_per_thread, 1), 1));
  if (parts <= 1) {
    body(0, n);
    return;
  }
  // Equal shares rounded up to `align`, so neighbouring ranges never share a cache line.
  const int64_t share = ((n + parts - 1) / parts + align - 1) / align * align;
  parts = (n + share - 1) / share;
  ComputePool& pool = ComputePool::Get();
  pool.EnsureWorkers(static_cast<int>(parts) - 1);
  Latch latch;
  latch.pending = static_cast<int>(parts) - 1;
  for (int64_t p = 1; p < parts; ++p) {
    const int64_t begin = p * share;
    const int64_t end = std::min(n, begin + share);
    pool.Submit([&body, &latch, begin, end] {
      body(begin, end);
      latch.CountDown();
    });
  }
  body(0, std::min(n, share));
  latch.Wait();
}

int ComputePoolWorkers() { return ComputePool::Get().Workers(); }

}  // namespace jaxascend
