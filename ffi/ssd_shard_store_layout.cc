// The SSD shard store (ssd_shard_store.h): opening and closing it, the lock on its directory,
// the shard files and where regions lie in them. The block I/O is ssd_shard_store.cc.
#include "ssd_shard_store.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>

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
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC | (options_.keep_files ? 0 : O_TRUNC);
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
  if (options_.keep_files) {  // grown only past what the file already holds
    struct stat st;
    if (fstat(fd, &st) == 0) shard->size = static_cast<int64_t>(st.st_size);
  }
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

MappedBytes::~MappedBytes() {
  if (data != nullptr) munmap(data, static_cast<size_t>(size));
}

Status ShardStore::AddMemoryRegion(StoreRegion& region) {
  const int64_t size = RoundUpToAlignment(region.nbytes);
  void* p = mmap(nullptr, static_cast<size_t>(size), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    return Status::Io(err, "add_region '" + region.name + "': keeping " + std::to_string(region.nbytes) +
                               " bytes in memory failed: " + DescribeErrno(err));
  }
  region.memory.data = static_cast<uint8_t*>(p);
  region.memory.size = size;
  return Status::Ok();
}

Status ShardStore::AddRegion(const std::string& name, int64_t nbytes, int32_t* id, bool in_memory) {
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
  if (in_memory) {
    region->name = name;
    region->nbytes = nbytes;
    JAXASCEND_RETURN_IF_ERROR(AddMemoryRegion(*region));
    region->id = static_cast<int32_t>(regions_.size());
    region->num_blocks = (nbytes + block - 1) / block;
    *id = region->id;
    regions_.push_back(std::move(region));
    return Status::Ok();
  }
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
  if (options_.keep_files) {  // a reopened file holds what a run wrote: crcs adopted on first read
    region->crc_known.reset(new std::atomic<uint8_t>[region->num_blocks]);
    for (int64_t b = 0; b < region->num_blocks; ++b) region->crc_known[b].store(0);
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
