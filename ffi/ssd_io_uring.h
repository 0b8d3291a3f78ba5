// The io_uring executor of the SSD engine, through raw syscalls (no liburing).
//
// One ring thread owns the ring: it takes requests from a queue, keeps up to `queue_depth` of
// them in flight, reaps completions, asks again for the rest of a short transfer, and issues the
// sync_file_range of a buffered write as a second SQE. Checksum work never leaves the disk
// idle: while the ring is full, the thread Prepare()s the next queue_depth requests ahead (a
// write's crc32c is computed there), so a freed slot is refilled at once; and it Finish()es
// completed requests (a read's crc32c is verified there) only after the freed slots have been
// refilled and submitted. A caller that submits while the ring thread sleeps in io_uring_enter
// wakes it through an eventfd whose read is kept armed in the ring.
//
// SQEs are submitted at most two per io_uring_enter: from three SQEs on, the kernel plugs the
// batch and the block layer merges adjacent 1 MiB requests into 4 MiB ones, which the measured
// virtio disk served more slowly (docs/bench_io.md).
//
// Create() fails with a Status that says why (ENOSYS: no io_uring in this kernel; EPERM: a
// container's seccomp profile or kernel.io_uring_disabled; an old kernel without
// IORING_OP_READ/WRITE) so that the store can fall back to the thread engine and say so once.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "ssd_io_queue.h"
#include "ssd_io_status.h"

namespace jaxascend {

class UringIoQueue : public IoQueue {
 public:
  static Status Create(int queue_depth, BlockHandler* handler, std::unique_ptr<IoQueue>* out);
  ~UringIoQueue() override;  // finishes queued requests, then stops the ring thread

  void Submit(const BlockRequest* requests, size_t n) override;
  const char* engine() const override { return "io_uring"; }

  struct Ring;  // the mapped submission and completion rings (ssd_io_uring.cc)

 private:
  struct Ready {  // taken from the queue, waiting for a ring slot
    BlockRequest request;
    BlockTransfer transfer;
    bool prepared = false;
    Status status;  // of Prepare(); an error completes the request without I/O
  };
  struct Slot {  // one request in the ring
    BlockRequest request;
    BlockTransfer transfer;
    BlockOutcome outcome;
    bool syncing = false;  // the write is done; its sync_file_range is in flight
    int retries = 0;       // EINTR/EAGAIN completions asked again
  };
  struct Done {  // reaped, waiting for Finish()
    BlockRequest request;
    BlockTransfer transfer;
    BlockOutcome outcome;
    Status status;  // set when Prepare() failed: Finish() is not called
  };

  UringIoQueue(int queue_depth, BlockHandler* handler, std::unique_ptr<Ring> ring, int wake_fd);
  void RingLoop();
  void PrepareReady(Ready& r);
  void FillSlots();
  void QueueTransfer(int slot);
  void QueueSync(int slot);
  void QueueWakeRead();
  bool SubmitQueued(bool wait);  // false: io_uring_enter failed (the queued requests are failed)
  void Reap();
  void FinishDone();

  const int depth_;
  BlockHandler* handler_;
  std::unique_ptr<Ring> ring_;
  const int wake_fd_;

  // Ring-thread state (no lock).
  std::vector<Slot> slots_;
  std::vector<int> free_slots_;
  std::vector<int> queued_slots_;  // SQEs written but not yet submitted, by slot (-1: wake read)
  std::vector<Done> done_;
  std::deque<Ready> ready_;  // in submission order; the first queue_depth Prepare()d ahead
  uint64_t wake_value_ = 0;  // the eventfd read's target
  bool wake_armed_ = false;
  int in_ring_ = 0;  // slots in use

  // Shared with Submit().
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<BlockRequest> pending_;
  bool idle_ = false;      // the ring thread waits on cv_
  bool sleeping_ = false;  // the ring thread waits in io_uring_enter
  bool wake_sent_ = false;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace jaxascend
