// The SSD shard store; see ssd_shard_store.h.
#include "ssd_shard_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "ssd_crc32c.h"
#include "ssd_fault_injection.h"
#include "ssd_io_uring.h"

namespace jaxascend {
namespace {

Status ValidateOptions(const StoreOptions& o) {
  auto bad = [](const std::string& what) { return Status::InvalidArgument("shard store: " + what); };
  if (o.dir.empty()) return bad("dir must be a non-empty path");
  if (o.block_bytes < kIoAlignment || o.block_bytes % kIoAlignment != 0) {
    return bad("block_bytes must be a positive multiple of 4096, got " + std::to_string(o.block_bytes));
  }
  if (o.shard_bytes < o.block_bytes || o.shard_bytes % o.block_bytes != 0) {
    return bad("shard_bytes must be a positive multiple of block_bytes (" + std::to_string(o.block_bytes) +
               "), got " + std::to_string(o.shard_bytes));
  }
  if (o.staging_bytes < o.block_bytes || o.staging_bytes % o.block_bytes != 0) {
    return bad("staging_bytes must be a positive multiple of block_bytes (" + std::to_string(o.block_bytes) +
               "), got " + std::to_string(o.staging_bytes));
  }
  if (o.staging_slots < 1) return bad("staging_slots must be >= 1, got " + std::to_string(o.staging_slots));
  if (o.block_bytes > (int64_t{1} << 30)) {
    return bad("block_bytes must be <= 1 GiB (one request), got " + std::to_string(o.block_bytes));
  }
  if (o.io_threads < 1 || o.io_threads > 64) {
    return bad("io_threads must be in [1, 64], got " + std::to_string(o.io_threads));
  }
  if (o.io_engine != "auto" && o.io_engine != "io_uring" && o.io_engine != "threads") {
    return bad("io_engine must be auto, io_uring or threads, got '" + o.io_engine + "'");
  }
  if (o.queue_depth < 1 || o.queue_depth > 256) {
    return bad("queue_depth must be in [1, 256], got " + std::to_string(o.queue_depth));
  }
  return Status::Ok();
}

// mkdir -p; never removes anything.
Status MakeDirs(const std::string& dir) {
  std::string prefix;
  size_t pos = 0;
  while (pos != std::string::npos) {
    pos = dir.find('/', pos + 1);
    prefix = dir.substr(0, pos);
    if (prefix.empty() || prefix == "/") continue;
    if (mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      return Status::Io(errno, "cannot create offload directory " + prefix + ": " + DescribeErrno(errno));
    }
  }
  struct stat st {};
  if (stat(dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode)) {
    return Status::Io(ENOTDIR, "offload directory " + dir + " is not a directory");
  }
  return Status::Ok();
}

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

HandleTable<ShardStore, std::weak_ptr<ShardStore>>& ShardStores() {
  static HandleTable<ShardStore, std::weak_ptr<ShardStore>> table("shard store");
  return table;
}

Status ShardStore::Open(const StoreOptions& options, std::shared_ptr<Arena> arena,
                        std::shared_ptr<ShardStore>* out) {
  JAXASCEND_RETURN_IF_ERROR(ValidateOptions(options));
  JAXASCEND_RETURN_IF_ERROR(FaultInjector::Global().environment_status());
  if (!arena) return Status::InvalidArgument("shard store: an arena is required (for its staging slots)");
  JAXASCEND_RETURN_IF_ERROR(MakeDirs(options.dir));

  std::shared_ptr<ShardStore> store(new ShardStore());
  store->options_ = options;
  store->arena_ = std::move(arena);
  store->direct_io_ = options.direct_io;
  store->io_mode_status_ = options.direct_io ? "O_DIRECT"
                          : options.drop_page_cache
                              ? "buffered I/O with posix_fadvise(POSIX_FADV_DONTNEED) after each block "
                                "(offload.direct_io is false)"
                              : "buffered I/O keeping the page cache (offload.direct_io and "
                                "offload.drop_page_cache are false)";
  // On any failure below, the destructor (via Close) undoes what was done so far.
  JAXASCEND_RETURN_IF_ERROR(store->AcquireLock());
  {
    std::lock_guard<std::mutex> lock(store->layout_mu_);
    JAXASCEND_RETURN_IF_ERROR(store->OpenShard(0));  // decides O_DIRECT vs buffered, once
  }
  for (int i = 0; i < options.staging_slots; ++i) {
    int32_t slot_id = -1;
    const Status s = store->arena_->Acquire(kStagingShapeClass, options.staging_bytes, &slot_id);
    if (!s.ok()) {
      return Status::ArenaExhausted(s.message() + " (the shard store needs " + std::to_string(options.staging_slots) +
                                    " '" + kStagingShapeClass + "' slots of " + std::to_string(options.staging_bytes) +
                                    " bytes in the arena plan)");
    }
    auto staging = std::make_unique<StagingSlot>();
    staging->slot_id = slot_id;
    staging->data = store->arena_->slots()[slot_id].data;
    staging->capacity = store->arena_->slots()[slot_id].capacity;
    store->staging_.push_back(std::move(staging));
  }
  JAXASCEND_RETURN_IF_ERROR(store->StartEngine());
  store->handle_ = ShardStores().Register(store);
  *out = std::move(store);
  return Status::Ok();
}

Status ShardStore::StartEngine() {
  BlockHandler* handler = this;
  const std::string threads = "threads, " + std::to_string(options_.io_threads) + " pread/pwrite workers";
  if (options_.io_engine == "threads") {
    queue_ = std::make_unique<ThreadIoQueue>(options_.io_threads, handler);
    io_engine_status_ = threads + " (offload.io_engine is threads)";
  } else {
    const Status s = UringIoQueue::Create(options_.queue_depth, handler, &queue_);
    if (s.ok()) {
      io_engine_status_ = "io_uring, queue depth " + std::to_string(options_.queue_depth);
    } else {
      queue_ = std::make_unique<ThreadIoQueue>(options_.io_threads, handler);
      io_engine_status_ = threads + " (offload.io_engine is " + options_.io_engine + ", but " + s.message() + ")";
    }
  }
  io_engine_ = queue_->engine();
  return Status::Ok();
}

Status ShardStore::AcquireLock() {
  lock_path_ = options_.dir + "/jaxascend.lock";
  lock_fd_ = open(lock_path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd_ < 0) {
    return Status::Io(errno, "cannot open lock file " + lock_path_ + ": " + DescribeErrno(errno));
  }
  if (flock(lock_fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char pid[32] = {0};
    const ssize_t n = pread(lock_fd_, pid, sizeof pid - 1, 0);
    std::string holder = n > 0 ? std::string(pid, static_cast<size_t>(n)) : std::string("unknown");
    holder.erase(std::remove(holder.begin(), holder.end(), '\n'), holder.end());
    close(lock_fd_);
    lock_fd_ = -1;
    if (err == EWOULDBLOCK) {
      return Status::Locked("offload directory " + options_.dir + " is in use by process " + holder +
                            " (lock file " + lock_path_ + "); give this run its own offload.dir");
    }
    return Status::Io(err, "cannot lock " + lock_path_ + ": " + DescribeErrno(err));
  }
  const std::string pid = std::to_string(getpid()) + "\n";
  if (ftruncate(lock_fd_, 0) != 0 || pwrite(lock_fd_, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    return Status::Io(errno, "cannot write the pid into lock file " + lock_path_ + ": " + DescribeErrno(errno));
  }
  return Status::Ok();
}

Status ShardStore::OpenShard(int32_t index) {
  char name[32];
  std::snprintf(name, sizeof name, "/shard-%05d.bin", index);
  auto shard = std::make_unique<ShardFile>();
  shard->path = options_.dir + name;
  const int flags = O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC;
  int fd = -1;
  if (direct_io_) {
    const Fault fault = FaultInjector::Global().Check(FaultOp::kOpenDirect);
    int err = fault.err_no;
    if (err == 0) {
      fd = open(shard->path.c_str(), flags | O_DIRECT, 0644);
      if (fd < 0) err = errno;
    }
    if (fd < 0 && (err != EINVAL || index != 0)) {
      // Only the first shard may switch the mode: workers read direct_io_ without a lock.
      return Status::Io(err, "cannot open shard file " + shard->path + " with O_DIRECT: " + DescribeErrno(err));
    }
    if (fd < 0) {
      direct_io_ = false;
      io_mode_status_ = "O_DIRECT refused for " + shard->path + ": " + DescribeErrno(err) +
                        (options_.drop_page_cache
                             ? "; using buffered I/O with posix_fadvise(POSIX_FADV_DONTNEED) after each block"
                             : "; using buffered I/O keeping the page cache (offload.drop_page_cache is false)");
    }
  }
  if (fd < 0) {
    fd = open(shard->path.c_str(), flags, 0644);
    if (fd < 0) return Status::Io(errno, "cannot open shard file " + shard->path + ": " + DescribeErrno(errno));
  }
  if (!direct_io_ && options_.drop_page_cache) {
    // Requests are whole blocks that are dropped once done: kernel read-ahead would only
    // cache pages nobody asked for (and nobody drops). Advisory, like the drops themselves.
    posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);
  }
  shard->fd = fd;
  shards_.push_back(std::move(shard));
  return Status::Ok();
}

Status ShardStore::GrowShard(ShardFile& shard, int64_t new_size, const std::string& region_name) {
  if (new_size <= shard.size) return Status::Ok();
  const int64_t grow = new_size - shard.size;
  int err = 0;
  if (options_.preallocate) {
    const Fault fault = FaultInjector::Global().Check(FaultOp::kFallocate);
    err = fault.err_no != 0 ? fault.err_no : (fallocate(shard.fd, 0, shard.size, grow) == 0 ? 0 : errno);
    if (err == EOPNOTSUPP) err = ftruncate(shard.fd, new_size) == 0 ? 0 : errno;  // fs without fallocate
  } else {
    err = ftruncate(shard.fd, new_size) == 0 ? 0 : errno;
  }
  if (err != 0) {
    return Status::Io(err, "cannot reserve " + std::to_string(grow) + " bytes for region '" + region_name + "' in " +
                               shard.path + " at byte offset " + std::to_string(shard.size) + ": " + DescribeErrno(err));
  }
  shard.size = new_size;
  return Status::Ok();
}

Status ShardStore::AddRegion(const std::string& name, int64_t nbytes, int32_t* id) {
  std::lock_guard<std::mutex> lock(layout_mu_);
  if (closed_) return Status::Closed("shard store in " + options_.dir + " is closed");
  if (name.empty()) return Status::InvalidArgument("add_region: the name must be non-empty");
  if (nbytes < 1) {
    return Status::InvalidArgument("add_region '" + name + "': nbytes must be >= 1, got " + std::to_string(nbytes));
  }
  for (const auto& r : regions_) {
    if (r->name == name) return Status::InvalidArgument("add_region: a region named '" + name + "' already exists");
  }
  const int64_t block = options_.block_bytes;
  auto region = std::make_unique<StoreRegion>();
  int32_t shard = cursor_shard_;
  int64_t offset = cursor_offset_;
  int64_t remaining = RoundUpToAlignment(nbytes);
  int64_t region_offset = 0;
  while (remaining > 0) {
    const int64_t left = options_.shard_bytes - offset;
    if (left < std::min(remaining, block)) {  // not even one block fits: next shard
      ++shard;
      offset = 0;
      continue;
    }
    // Split only at block boundaries, so that every block lies in one file.
    const int64_t take = remaining <= left ? remaining : left / block * block;
    StoreExtent e;
    e.shard = shard;
    e.file_offset = offset;
    e.region_offset = region_offset;
    e.disk_bytes = take;
    region->extents.push_back(e);
    offset += take;
    region_offset += take;
    remaining -= take;
  }
  for (StoreExtent& e : region->extents) {
    while (static_cast<int32_t>(shards_.size()) <= e.shard) {
      JAXASCEND_RETURN_IF_ERROR(OpenShard(static_cast<int32_t>(shards_.size())));
    }
    JAXASCEND_RETURN_IF_ERROR(GrowShard(*shards_[e.shard], e.file_offset + e.disk_bytes, name));
    e.file = shards_[e.shard].get();
  }
  cursor_shard_ = shard;
  cursor_offset_ = offset;

  region->id = static_cast<int32_t>(regions_.size());
  region->name = name;
  region->nbytes = nbytes;
  region->num_blocks = (nbytes + block - 1) / block;
  region->crcs.reset(new std::atomic<uint32_t>[region->num_blocks]);
  // Fresh space reads back as zeros (truncated, then grown), so that is what is "written".
  const uint32_t zero_full = Crc32cOfZeros(static_cast<size_t>(block));
  for (int64_t b = 0; b < region->num_blocks; ++b) {
    const int64_t len = std::min(block, nbytes - b * block);
    region->crcs[b].store(len == block ? zero_full : Crc32cOfZeros(static_cast<size_t>(len)));
  }
  *id = region->id;
  regions_.push_back(std::move(region));
  return Status::Ok();
}

Status ShardStore::FindRegion(const std::string& name, int32_t* id) const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  for (const auto& r : regions_) {
    if (r->name == name) {
      *id = r->id;
      return Status::Ok();
    }
  }
  return Status::InvalidArgument("no region named '" + name + "' in the shard store at " + options_.dir);
}

const StoreRegion* ShardStore::region(int32_t id) const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  return id >= 0 && id < static_cast<int32_t>(regions_.size()) ? regions_[id].get() : nullptr;
}

int32_t ShardStore::num_regions() const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  return static_cast<int32_t>(regions_.size());
}

int32_t ShardStore::num_shards() const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  return static_cast<int32_t>(shards_.size());
}

std::string ShardStore::shard_path(int32_t shard) const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  return shard >= 0 && shard < static_cast<int32_t>(shards_.size()) ? shards_[shard]->path : std::string();
}

Status ShardStore::CheckRange(int32_t id, int64_t offset, int64_t nbytes, const char* op) const {
  const StoreRegion* r = region(id);
  if (!r) return Status::InvalidArgument(std::string(op) + ": unknown region id " + std::to_string(id));
  const std::string what = std::string(op) + " of region '" + r->name + "'";
  const int64_t block = options_.block_bytes;
  if (nbytes < 1) return Status::InvalidArgument(what + ": nbytes must be >= 1, got " + std::to_string(nbytes));
  if (offset < 0 || offset % block != 0) {
    return Status::InvalidArgument(what + ": offset " + std::to_string(offset) +
                                   " is not a multiple of the block size " + std::to_string(block));
  }
  if (offset + nbytes > r->nbytes) {
    return Status::InvalidArgument(what + ": bytes [" + std::to_string(offset) + ", " +
                                   std::to_string(offset + nbytes) + ") exceed the region's " +
                                   std::to_string(r->nbytes) + " bytes");
  }
  if (nbytes % block != 0 && offset + nbytes != r->nbytes) {
    return Status::InvalidArgument(what + ": length " + std::to_string(nbytes) + " is not a multiple of the block size " +
                                   std::to_string(block) + " and does not end at the region's end (" +
                                   std::to_string(r->nbytes) + " bytes)");
  }
  return Status::Ok();
}

Status ShardStore::SubmitRead(int32_t id, int64_t offset, int64_t nbytes, uint8_t* buffer, int64_t capacity,
                              IoTicket* ticket) {
  return Submit(IoDirection::kRead, id, offset, nbytes, buffer, capacity, ticket);
}

Status ShardStore::SubmitWrite(int32_t id, int64_t offset, int64_t nbytes, uint8_t* buffer, int64_t capacity,
                               IoTicket* ticket) {
  return Submit(IoDirection::kWrite, id, offset, nbytes, buffer, capacity, ticket);
}

Status ShardStore::Submit(IoDirection direction, int32_t id, int64_t offset, int64_t nbytes, uint8_t* buffer,
                          int64_t capacity, IoTicket* ticket) {
  const char* op = direction == IoDirection::kRead ? "read" : "write";
  JAXASCEND_RETURN_IF_ERROR(CheckRange(id, offset, nbytes, op));
  if (reinterpret_cast<uintptr_t>(buffer) % kIoAlignment != 0) {
    return Status::InvalidArgument(std::string(op) + ": the buffer address is not 4096-aligned (use an arena slot)");
  }
  if (capacity < RoundUpToAlignment(nbytes)) {
    return Status::InvalidArgument(std::string(op) + ": a buffer of " + std::to_string(capacity) +
                                   " bytes cannot hold " + std::to_string(nbytes) + " bytes rounded up to 4096 (" +
                                   std::to_string(RoundUpToAlignment(nbytes)) + ")");
  }
  // Holding layout_mu_ while queueing orders these requests before Close() stops the queue.
  std::lock_guard<std::mutex> lock(layout_mu_);
  if (closed_) return Status::Closed(std::string(op) + ": the shard store in " + options_.dir + " is closed");
  StoreRegion* r = regions_[id].get();
  const int64_t block = options_.block_bytes;
  const int64_t first = offset / block;
  const int64_t last = (offset + nbytes + block - 1) / block;
  ticket->AddPending(last - first);
  // Handed over in batches: one wake-up of the engine per batch, not per block.
  constexpr int64_t kBatch = 64;
  BlockRequest batch[kBatch];
  for (int64_t b = first; b < last;) {
    int64_t n = 0;
    for (; n < kBatch && b < last; ++n, ++b) {
      BlockRequest& req = batch[n];
      req.direction = direction;
      req.region = r;
      req.block = b;
      req.buffer = buffer + (b - first) * block;
      req.io_bytes = RoundUpToAlignment(std::min(block, r->nbytes - b * block));
      req.ticket = ticket;
    }
    queue_->Submit(batch, static_cast<size_t>(n));
  }
  return Status::Ok();
}

const ShardFile& ShardStore::Locate(const BlockRequest& req, int64_t* file_offset) const {
  const StoreRegion& r = *req.region;
  const int64_t region_offset = req.block * options_.block_bytes;
  const StoreExtent* e = &r.extents.front();
  for (const StoreExtent& x : r.extents) {
    if (x.region_offset <= region_offset) e = &x;
  }
  *file_offset = e->file_offset + (region_offset - e->region_offset);
  return *e->file;
}

// Built only on the error paths: the success path allocates nothing.
std::string ShardStore::Where(const BlockRequest& req) const {
  int64_t file_offset = 0;
  const ShardFile& f = Locate(req, &file_offset);
  return f.path + " at byte offset " + std::to_string(file_offset) + " (region '" + req.region->name + "', block " +
         std::to_string(req.block) + ")";
}

Status ShardStore::Prepare(const BlockRequest& req, BlockTransfer* t) {
  StoreRegion& r = *req.region;
  const int64_t logical = std::min(options_.block_bytes, r.nbytes - req.block * options_.block_bytes);
  const int64_t io = req.io_bytes;
  t->fd = Locate(req, &t->file_offset).fd;
  const bool write = req.direction == IoDirection::kWrite;
  if (write) {
    // Zero the alignment padding past the region's end, so the file holds no stale bytes.
    if (io > logical) std::memset(req.buffer + logical, 0, static_cast<size_t>(io - logical));
    t->crc = Crc32c(req.buffer, static_cast<size_t>(logical));
    // Buffered fallback: push each block to disk, then drop it from the page cache, so host
    // memory does not grow with the model. (Without drop_page_cache the block stays cached and
    // dirty, as with ZeRO-Infinity's buffered I/O.)
    t->sync_after = !direct_io_ && options_.drop_page_cache;
  }
  const Fault fault = FaultInjector::Global().Check(write ? FaultOp::kWrite : FaultOp::kRead);
  if (fault.err_no != 0) {
    return Status::Io(fault.err_no, std::string(write ? "write" : "read") + " of " + std::to_string(io) +
                                        " bytes failed: " + DescribeErrno(fault.err_no) +
                                        (write ? ", writing " : ", reading ") + Where(req));
  }
  t->want = fault.short_transfer ? io / 2 / kIoAlignment * kIoAlignment : io;
  return Status::Ok();
}

Status ShardStore::Finish(const BlockRequest& req, const BlockTransfer& t, const BlockOutcome& outcome) {
  StoreRegion& r = *req.region;
  const int64_t logical = std::min(options_.block_bytes, r.nbytes - req.block * options_.block_bytes);
  const int64_t io = req.io_bytes;
  const bool write = req.direction == IoDirection::kWrite;
  if (outcome.err != 0) {
    return Status::Io(outcome.err, std::string(write ? "write" : "read") + " of " + std::to_string(io) +
                                       " bytes failed: " + DescribeErrno(outcome.err) +
                                       (write ? ", writing " : ", reading ") + Where(req));
  }
  if (outcome.bytes < io) {
    return Status::Io(EIO, write ? "short write: wrote " + std::to_string(outcome.bytes) + " of " + std::to_string(io) +
                                       " bytes to " + Where(req)
                                 : "short read: got " + std::to_string(outcome.bytes) + " of " + std::to_string(io) +
                                       " bytes from " + Where(req));
  }
  if (outcome.sync_err != 0) {
    return Status::Io(outcome.sync_err,
                      "sync_file_range failed: " + DescribeErrno(outcome.sync_err) + ", writing " + Where(req));
  }
  if (!direct_io_ && options_.drop_page_cache) {
    posix_fadvise(t.fd, t.file_offset, io, POSIX_FADV_DONTNEED);  // advisory: failure only costs cache
  }
  if (write) {
    r.crcs[req.block].store(t.crc, std::memory_order_release);
    return Status::Ok();
  }
  const uint32_t crc = Crc32c(req.buffer, static_cast<size_t>(logical));
  const uint32_t expected = r.crcs[req.block].load(std::memory_order_acquire);
  if (crc != expected) {
    return Status::Checksum("crc32c mismatch in " + Where(req) + ", " + std::to_string(logical) + " bytes: stored " +
                            Hex32(expected) + ", read back " + Hex32(crc));
  }
  return Status::Ok();
}

Status ShardStore::WaitStaging() {
  Status first;
  for (auto& s : staging_) {
    const Status st = s->ticket.Wait();
    if (first.ok() && !st.ok()) first = st;
  }
  return first;
}

Status ShardStore::WriteFromHost(int32_t id, int64_t offset, const void* src, int64_t nbytes, bool wait) {
  JAXASCEND_RETURN_IF_ERROR(CheckRange(id, offset, nbytes, "write"));
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (closed_) return Status::Closed("write: the shard store in " + options_.dir + " is closed");
  const uint8_t* from = static_cast<const uint8_t*>(src);
  for (int64_t pos = 0; pos < nbytes;) {
    StagingSlot& slot = *staging_[next_staging_];
    next_staging_ = (next_staging_ + 1) % staging_.size();
    // The slot's previous write (possibly from an earlier call) must finish before reuse;
    // its error, if any, is reported now rather than lost.
    JAXASCEND_RETURN_IF_ERROR(slot.ticket.Wait());
    const int64_t piece = std::min(slot.capacity / options_.block_bytes * options_.block_bytes, nbytes - pos);
    std::memcpy(slot.data, from + pos, static_cast<size_t>(piece));
    JAXASCEND_RETURN_IF_ERROR(SubmitWrite(id, offset + pos, piece, slot.data, slot.capacity, &slot.ticket));
    pos += piece;
  }
  return wait ? WaitStaging() : Status::Ok();
}

Status ShardStore::ReadToHost(int32_t id, int64_t offset, void* dst, int64_t nbytes) {
  JAXASCEND_RETURN_IF_ERROR(CheckRange(id, offset, nbytes, "read"));
  std::lock_guard<std::mutex> lock(staging_mu_);
  if (closed_) return Status::Closed("read: the shard store in " + options_.dir + " is closed");
  // Staged writes first: a read after a write sees the written data.
  JAXASCEND_RETURN_IF_ERROR(WaitStaging());
  const size_t n_slots = staging_.size();
  const int64_t piece = staging_[0]->capacity / options_.block_bytes * options_.block_bytes;
  const int64_t pieces = (nbytes + piece - 1) / piece;
  auto piece_bytes = [&](int64_t i) { return std::min(piece, nbytes - i * piece); };
  Status first;
  // Keep every staging slot busy: piece i goes to slot i % n_slots.
  for (int64_t i = 0; i < pieces && i < static_cast<int64_t>(n_slots) && first.ok(); ++i) {
    StagingSlot& slot = *staging_[i];
    first = SubmitRead(id, offset + i * piece, piece_bytes(i), slot.data, slot.capacity, &slot.ticket);
  }
  uint8_t* to = static_cast<uint8_t*>(dst);
  for (int64_t i = 0; i < pieces && first.ok(); ++i) {
    StagingSlot& slot = *staging_[i % n_slots];
    first = slot.ticket.Wait();
    if (!first.ok()) break;
    std::memcpy(to + i * piece, slot.data, static_cast<size_t>(piece_bytes(i)));
    const int64_t next = i + static_cast<int64_t>(n_slots);
    if (next < pieces) first = SubmitRead(id, offset + next * piece, piece_bytes(next), slot.data, slot.capacity, &slot.ticket);
  }
  // After an error, let the other reads land before the slots are reused; their errors are moot.
  next_staging_ = 0;
  const Status rest = WaitStaging();
  return first.ok() ? rest : first;
}

Status ShardStore::Flush() {
  std::lock_guard<std::mutex> lock(staging_mu_);
  const Status staged = WaitStaging();
  if (queue_) queue_->Drain();
  return staged;
}

IoCounters ShardStore::counters() const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  return queue_ ? queue_->counters() : final_counters_;
}

Status ShardStore::Close() {
  {
    std::lock_guard<std::mutex> lock(layout_mu_);
    if (closed_) return Status::Ok();
    closed_ = true;  // no request is queued after this point (Submit checks under layout_mu_)
  }
  Status first;
  {
    std::lock_guard<std::mutex> lock(staging_mu_);
    first = WaitStaging();
  }
  if (queue_) {
    queue_->Drain();
    std::lock_guard<std::mutex> lock(layout_mu_);
    final_counters_ = queue_->counters();
    queue_.reset();  // joins the workers
  }
  for (auto& s : staging_) {
    const Status st = arena_->Release(s->slot_id);
    if (first.ok() && !st.ok()) first = st;
  }
  staging_.clear();
  for (auto& shard : shards_) {
    if (shard->fd >= 0 && close(shard->fd) != 0 && first.ok()) {
      first = Status::Io(errno, "closing " + shard->path + ": " + DescribeErrno(errno));
    }
    shard->fd = -1;
  }
  if (lock_fd_ >= 0) {
    if (ftruncate(lock_fd_, 0) != 0 && first.ok()) {  // the pid no longer holds the directory
      first = Status::Io(errno, "clearing lock file " + lock_path_ + ": " + DescribeErrno(errno));
    }
    close(lock_fd_);  // releases the flock
    lock_fd_ = -1;
  }
  if (handle_ != 0) ShardStores().Remove(handle_);
  return first;
}

ShardStore::~ShardStore() { Close(); }  // errors are reported by an explicit Close()

}  // namespace jaxascend
