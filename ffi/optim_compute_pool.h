// A small persistent pool of compute threads for element-wise kernels (fused Adam).
//
// Threads are started on first need and kept for the life of the process, so a kernel call
// pays a wake-up, never a thread creation. Several callers may run at once (the GIL is
// released around kernels): their tasks share one queue, and workers never wait on other
// tasks, so concurrent calls cannot deadlock.
#pragma once

#include <cstdint>
#include <functional>

namespace jaxascend {

// Most threads one ParallelFor may use (the caller plus kComputePoolMaxThreads-1 workers).
constexpr int kComputePoolMaxThreads = 256;

// Splits [0, n) into at most `threads` contiguous ranges, each a multiple of `align` elements
// (except the last) and at least `min_per_thread` long, and runs body(begin, end) on each:
// the first range on the calling thread, the others on pool workers. Returns when all are
// done. threads <= 1 (or a small n) runs body(0, n) inline without touching the pool.
// `threads` must be <= kComputePoolMaxThreads (callers validate it and report errors).
void ParallelFor(int64_t n, int threads, int64_t align, int64_t min_per_thread,
                 const std::function<void(int64_t, int64_t)>& body);

// Number of worker threads started so far (for tests and diagnostics).
int ComputePoolWorkers();

}  // namespace jaxascend
