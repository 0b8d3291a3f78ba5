// The SSD shard store: named regions (one per optimizer-state tensor or gradient) laid out in
// shard files under one locked directory, read and written with O_DIRECT through io_uring (or
// a pread/pwrite worker pool), with a crc32c per block verified on every read.
//
// Layout. Regions are placed one after another in shard-00000.bin, shard-00001.bin, ... (each
// at most shard_bytes), at 4096-aligned offsets; a region larger than the space left in a shard
// continues in the next one, split at a block boundary. A region is a sequence of blocks of
// block_bytes (the last one shorter); I/O addresses a region by byte offset, which must be a
// multiple of block_bytes, and a length that is too, unless it ends at the region's end.
// Shard files are truncated when opened (the directory is scratch space for one run; the
// checksums live in memory) and grown with fallocate when regions are added, so a fresh
// region reads back as zeros and a full disk shows up when regions are added.
//
// Integrity. Each block's crc32c is computed just before its write is issued and recorded only
// after the write succeeded; reads recompute and compare. A failed write leaves the earlier
// checksum in place, so earlier data stays readable and a torn block is detected, not used.
//
// Engines. io_engine "io_uring" (ssd_io_uring.h) keeps queue_depth requests in flight from one
// ring thread; "threads" (ssd_io_queue.h) runs io_threads pread/pwrite workers; "auto" is
// io_uring where the kernel allows it. Where io_uring is refused (ENOSYS, EPERM in a container,
// an old kernel) the store uses the threads and says why in io_engine_status(), once.
//
// I/O modes. O_DIRECT unless the filesystem refuses it (EINVAL, e.g. tmpfs) or the caller
// turns it off; then buffered I/O with sync_file_range + posix_fadvise(DONTNEED) per block, so
// the page cache does not grow with the model (unless drop_page_cache is false: then plain
// page-cache I/O, written back whenever the kernel likes). direct_io() / io_mode_status() say which.
//
// In-memory regions. AddRegion(..., in_memory=true) keeps a region's bytes in this process's
// memory (an anonymous mapping: zeros until written) instead of a shard file: the same names,
// offsets and rules, no extents, no checksums, no I/O queue; a request completes as it is
// submitted (a copy). The gradients use it when they fit in RAM (offload.gradients: host), so
// the sink, the update and their receipts work as with gradients on SSD. The I/O counters count
// the disk only.
//
// For native callers (the gradient sink, the parameter source): ShardStores().Find(handle)
// returns an open store;
// WriteFromHost() copies a host buffer into the store's arena staging slots and queues the
// write, returning once the source may be reused; Flush() surfaces deferred errors.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "handle_table.h"
#include "ssd_arena.h"
#include "ssd_io_queue.h"
#include "ssd_io_status.h"

namespace jaxascend {

constexpr const char* kStagingShapeClass = "ssd_staging";

struct StoreOptions {
  std::string dir;
  int64_t shard_bytes = int64_t{1} << 30;
  int64_t block_bytes = int64_t{1} << 20;   // checksum and request granularity
  int64_t staging_bytes = int64_t{8} << 20;  // each arena staging slot (multiple of block_bytes)
  int staging_slots = 2;
  int io_threads = 4;
  std::string io_engine = "auto";  // auto | io_uring | threads
  int queue_depth = 8;             // io_uring: requests in flight
  bool direct_io = true;
  bool preallocate = true;  // fallocate shard space when a region is added
  // Buffered I/O only: sync + drop each block from the page cache after it is transferred.
  // False keeps every page cached (ZeRO-Infinity's page-cache I/O, an ablation baseline).
  bool drop_page_cache = true;
  // Reopen the shard files as they are (durable steps: a resume reads the state a killed run
  // left) instead of truncating them. Regions must then be added as that run added them; a
  // block's crc32c is unknown until it is first read (adopted then) or written.
  bool keep_files = false;
};

struct ShardFile {
  std::string path;
  int fd = -1;
  int64_t size = 0;
};

struct StoreExtent {
  const ShardFile* file = nullptr;  // stable: shards are never removed while the store is open
  int32_t shard = 0;
  int64_t file_offset = 0;    // where region_offset lies in the shard file
  int64_t region_offset = 0;  // a multiple of block_bytes
  int64_t disk_bytes = 0;     // bytes of the region in this extent (4096-aligned)
};

// An in-memory region's bytes (mmap'd, released with the region).
struct MappedBytes {
  uint8_t* data = nullptr;
  int64_t size = 0;
  MappedBytes() = default;
  MappedBytes(const MappedBytes&) = delete;
  MappedBytes& operator=(const MappedBytes&) = delete;
  ~MappedBytes();
};

struct StoreRegion {
  int32_t id = -1;
  std::string name;
  int64_t nbytes = 0;
  int64_t num_blocks = 0;
  std::vector<StoreExtent> extents;
  std::unique_ptr<std::atomic<uint32_t>[]> crcs;  // one per block, of the last successful write
  std::unique_ptr<std::atomic<uint8_t>[]> crc_known;  // keep_files only: 0 until read or written
  MappedBytes memory;  // in-memory regions only (then no extents and no crcs)
  bool in_memory() const { return memory.data != nullptr; }
};

class ShardStore : private BlockHandler {
 public:
  static Status Open(const StoreOptions& options, std::shared_ptr<Arena> arena,
                     std::shared_ptr<ShardStore>* out);
  ~ShardStore() override;
  ShardStore(const ShardStore&) = delete;
  ShardStore& operator=(const ShardStore&) = delete;

  // Waits for queued I/O, releases the staging slots, closes the files and the lock. Idempotent.
  Status Close();
  bool closed() const { return closed_.load(); }

  int64_t handle() const { return handle_; }
  bool direct_io() const { return direct_io_; }
  const std::string& io_mode_status() const { return io_mode_status_; }
  const std::string& io_engine() const { return io_engine_; }  // "io_uring" or "threads"
  // What runs the I/O and why, e.g. "io_uring, queue depth 8", or the thread pool with the
  // reason io_uring was refused.
  const std::string& io_engine_status() const { return io_engine_status_; }
  const StoreOptions& options() const { return options_; }
  const std::shared_ptr<Arena>& arena() const { return arena_; }

  Status AddRegion(const std::string& name, int64_t nbytes, int32_t* id, bool in_memory = false);
  Status FindRegion(const std::string& name, int32_t* id) const;
  const StoreRegion* region(int32_t id) const;  // nullptr when unknown
  int32_t num_regions() const;
  std::string shard_path(int32_t shard) const;
  int32_t num_shards() const;

  // Checks that [offset, offset + nbytes) of region `id` is a valid request (alignment, bounds).
  Status CheckRange(int32_t id, int64_t offset, int64_t nbytes, const char* op) const;
  // Asynchronous block I/O between a region and `buffer` (4096-aligned, capacity bytes long,
  // e.g. an arena slot). The ticket completes when every block is done.
  Status SubmitRead(int32_t id, int64_t offset, int64_t nbytes, uint8_t* buffer, int64_t capacity,
                    IoTicket* ticket);
  Status SubmitWrite(int32_t id, int64_t offset, int64_t nbytes, uint8_t* buffer, int64_t capacity,
                     IoTicket* ticket);

  // Copies `src` through the staging slots and writes it; `wait`: until the data is on disk.
  // Without `wait` it returns once `src` may be reused; errors surface on the next call or Flush().
  Status WriteFromHost(int32_t id, int64_t offset, const void* src, int64_t nbytes, bool wait);
  // Reads through the staging slots into `dst` (any alignment), after pending staged writes.
  Status ReadToHost(int32_t id, int64_t offset, void* dst, int64_t nbytes);
  // Waits for every queued request; returns the first deferred error of staged writes.
  Status Flush();
  // Flush(), then fdatasync every shard file: what was written survives a power loss.
  Status Sync();

  IoCounters counters() const;

 private:
  ShardStore() = default;
  Status AcquireLock();
  Status OpenShard(int32_t index);
  Status GrowShard(ShardFile& shard, int64_t new_size, const std::string& region_name);
  Status Submit(IoDirection direction, int32_t id, int64_t offset, int64_t nbytes, uint8_t* buffer,
                int64_t capacity, IoTicket* ticket);
  Status StartEngine();
  // BlockHandler: what one request transfers, and what its outcome means.
  Status Prepare(const BlockRequest& request, BlockTransfer* transfer) override;
  Status Finish(const BlockRequest& request, const BlockTransfer& transfer, const BlockOutcome& outcome) override;
  const ShardFile& Locate(const BlockRequest& request, int64_t* file_offset) const;
  std::string Where(const BlockRequest& request) const;
  Status WaitStaging();  // waits every staging slot; first error; caller holds staging_mu_
  Status AddMemoryRegion(StoreRegion& region);
  // An in-memory region's copy: `to_region` copies `host` into it, else out of it.
  Status CopyMemory(int32_t id, int64_t offset, int64_t nbytes, void* host, bool to_region, const char* op);

  StoreOptions options_;
  std::shared_ptr<Arena> arena_;
  int64_t handle_ = 0;
  std::atomic<bool> closed_{false};
  bool direct_io_ = true;
  std::string io_mode_status_;
  std::string io_engine_;
  std::string io_engine_status_;
  int lock_fd_ = -1;
  std::string lock_path_;

  mutable std::mutex layout_mu_;  // guards regions_, shards_ and the placement cursor
  std::vector<std::unique_ptr<StoreRegion>> regions_;
  std::vector<std::unique_ptr<ShardFile>> shards_;
  int32_t cursor_shard_ = 0;
  int64_t cursor_offset_ = 0;

  struct StagingSlot {
    int32_t slot_id = -1;
    uint8_t* data = nullptr;
    int64_t capacity = 0;
    IoTicket ticket;
  };
  std::mutex staging_mu_;  // serializes WriteFromHost / ReadToHost / Flush / Close
  std::vector<std::unique_ptr<StagingSlot>> staging_;
  size_t next_staging_ = 0;

  std::unique_ptr<IoQueue> queue_;
  IoCounters final_counters_;  // the queue's counters when it was shut down
};

// The table of open stores, for native code that receives an integer handle: a store adds itself
// when it opens and removes itself when it closes; the table does not keep it alive.
HandleTable<ShardStore, std::weak_ptr<ShardStore>>& ShardStores();

}  // namespace jaxascend
