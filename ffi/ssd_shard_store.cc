// The SSD shard store's block I/O (ssd_shard_store.h): checking and queueing requests, what
// each block's transfer is and what its outcome means (Prepare/Finish: files and offsets,
// checksums, injected faults, short transfers), and the staged copies to and from host memory.
// Opening the store, its files and its regions are ssd_shard_store_layout.cc.
#include "ssd_shard_store.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>

#include "ssd_crc32c.h"
#include "ssd_fault_injection.h"

namespace jaxascend {
namespace {

std::string Hex32(uint32_t v) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

}  // namespace

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
  if (region(id)->in_memory()) {
    JAXASCEND_RETURN_IF_ERROR(CopyMemory(id, offset, nbytes, buffer, direction == IoDirection::kWrite, op));
    ticket->AddPending(1);
    ticket->Complete(Status::Ok());
    return Status::Ok();
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
    if (r.crc_known) r.crc_known[req.block].store(1, std::memory_order_release);
    return Status::Ok();
  }
  const uint32_t crc = Crc32c(req.buffer, static_cast<size_t>(logical));
  if (r.crc_known && r.crc_known[req.block].load(std::memory_order_acquire) == 0) {
    // A reopened file's block, read for the first time: what it holds is what was written.
    r.crcs[req.block].store(crc, std::memory_order_release);
    r.crc_known[req.block].store(1, std::memory_order_release);
    return Status::Ok();
  }
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
  if (region(id)->in_memory()) return CopyMemory(id, offset, nbytes, const_cast<void*>(src), true, "write");
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
  if (region(id)->in_memory()) return CopyMemory(id, offset, nbytes, dst, false, "read");
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

Status ShardStore::CopyMemory(int32_t id, int64_t offset, int64_t nbytes, void* host, bool to_region,
                              const char* op) {
  if (closed_) return Status::Closed(std::string(op) + ": the shard store in " + options_.dir + " is closed");
  uint8_t* bytes = region(id)->memory.data + offset;  // regions outlive the store's requests
  if (to_region) {
    std::memcpy(bytes, host, static_cast<size_t>(nbytes));
  } else {
    std::memcpy(host, bytes, static_cast<size_t>(nbytes));
  }
  return Status::Ok();
}

Status ShardStore::Flush() {
  std::lock_guard<std::mutex> lock(staging_mu_);
  const Status staged = WaitStaging();
  if (queue_) queue_->Drain();
  return staged;
}

Status ShardStore::Sync() {
  JAXASCEND_RETURN_IF_ERROR(Flush());
  std::lock_guard<std::mutex> lock(layout_mu_);
  for (const auto& shard : shards_) {
    if (fdatasync(shard->fd) != 0) {
      return Status::Io(errno, "cannot sync shard file " + shard->path + ": " + DescribeErrno(errno));
    }
  }
  return Status::Ok();
}

IoCounters ShardStore::counters() const {
  std::lock_guard<std::mutex> lock(layout_mu_);
  return queue_ ? queue_->counters() : final_counters_;
}

}  // namespace jaxascend
