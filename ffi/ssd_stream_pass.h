// One pipelined pass over chunks of SSD-resident state, through arena slots.
//
// A chunk is a list of segments (region, offset, nbytes, read?/write?), e.g. the same element
// range of a tensor's fp32 master, m, v (read+write) and gradient (read). A segment is written
// back where it was read, or to a location of its own (write_region, write_offset: copy on
// write, as the durable steps' slot rings move a record to a free slot). The pass holds
// `depth` stages, each with one arena slot per segment position, used round-robin. While the
// consumer works on chunk k, chunk k+1 .. k+depth-2 are being read and chunk k-1 is being
// written back (depth 3: one of each). Slots are acquired once when the pass is created and
// released when it finishes: nothing is allocated per chunk.
//
//   Next()   hands out the next chunk: submits the write-back of the previous one, issues the
//            read-ahead, waits for this chunk's reads. False at the end.
//   Finish() writes back the current chunk if the consumer stopped early, waits for every
//            request, releases the slots, and returns the first error.
//   Abort()  waits for in-flight requests and releases the slots without writing anything more.
//
// written_through() says how far the write-back is known to have landed: a stage's writes are
// awaited before its slots are refilled, so once chunk k's reads are issued, chunks <= k-depth
// are on disk (and after Finish(), all of them). WaitWrittenThrough(k) waits until chunks <= k
// (of those submitted: k < current()) are on disk.
//
// Where bytes are shared between chunks, a pass must never read stale data or let two writes
// race: a byte written by chunk a may be read by chunk b only when b <= a (b's reads have landed
// before a's write is submitted), and no byte is written by two chunks.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "ssd_io_queue.h"
#include "ssd_io_status.h"
#include "ssd_shard_store.h"

namespace jaxascend {

struct StreamSegment {
  int32_t region = -1;
  int64_t offset = 0;
  int64_t nbytes = 0;
  bool read = true;   // filled from disk before the consumer sees it
  bool write = true;  // written back after the consumer is done with it
  int32_t write_region = -1;  // where it is written back: -1, the region and offset it was read from
  int64_t write_offset = 0;

  int32_t target_region() const { return write_region < 0 ? region : write_region; }
  int64_t target_offset() const { return write_region < 0 ? offset : write_offset; }
};

class StreamPass {
 public:
  // Every chunk has slot_classes.size() segments; segment i is staged in slots of
  // shape class slot_classes[i]. Chunks must not overlap where a segment is written.
  static Status Create(std::shared_ptr<ShardStore> store, std::vector<std::vector<StreamSegment>> chunks,
                       std::vector<std::string> slot_classes, int depth, std::unique_ptr<StreamPass>* out);
  ~StreamPass();
  StreamPass(const StreamPass&) = delete;
  StreamPass& operator=(const StreamPass&) = delete;

  Status Next(bool* has_chunk);
  Status Finish();
  void Abort();
  // Waits until every chunk <= k is written back (k below current(): submitted). Raises nothing
  // new: the first error of the pass, as Next() would.
  Status WaitWrittenThrough(int64_t k);

  int64_t current() const { return current_; }  // -1 before the first Next()
  // Every chunk up to this index is written back (on disk): -1 before any is known to be.
  int64_t written_through() const { return written_through_; }
  int64_t num_chunks() const { return static_cast<int64_t>(chunks_.size()); }
  int num_segments() const { return static_cast<int>(slot_classes_.size()); }
  int depth() const { return depth_; }
  // The slot and segment of the current chunk (valid after Next() returned true).
  const ArenaSlot& current_slot(int segment) const;
  const StreamSegment& current_segment(int segment) const { return chunks_[current_][segment]; }
  const std::shared_ptr<ShardStore>& store() const { return store_; }

 private:
  struct Stage {
    std::vector<int32_t> slots;  // arena slot id per segment position
    IoTicket reads;
    IoTicket writes;
  };
  StreamPass() = default;
  Stage& StageOf(int64_t chunk) { return *stages_[chunk % depth_]; }
  Status IssueReads(int64_t chunk);
  Status SubmitWriteBack(int64_t chunk);
  Status WaitAll();
  void ReleaseSlots();
  Status Fail(const Status& s);

  std::shared_ptr<ShardStore> store_;
  std::vector<std::vector<StreamSegment>> chunks_;
  std::vector<std::string> slot_classes_;
  int depth_ = 3;
  std::vector<std::unique_ptr<Stage>> stages_;
  int64_t current_ = -1;
  int64_t next_to_issue_ = 0;
  int64_t written_through_ = -1;
  bool current_written_ = false;
  bool finished_ = false;
  Status error_;
};

}  // namespace jaxascend
