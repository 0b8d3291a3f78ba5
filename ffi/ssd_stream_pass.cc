// The pipelined streaming pass; see ssd_stream_pass.h.
#include "ssd_stream_pass.h"

#include <algorithm>
#include <tuple>

namespace jaxascend {
namespace {

// A pass reads chunk k+1 before chunk k is written back, so a byte written by chunk a may be
// read only by chunks b <= a (their reads land before a's write is submitted: a read-ahead of a
// later chunk would see stale data), and written by one chunk only.
Status CheckNoWrittenOverlap(const ShardStore& store, const std::vector<std::vector<StreamSegment>>& chunks) {
  struct Span {
    int32_t region;
    int64_t begin, end;
    bool write;  // this span is where a segment is written back (else where it is read)
    size_t chunk, segment;
  };
  std::vector<Span> spans;
  for (size_t c = 0; c < chunks.size(); ++c) {
    for (size_t i = 0; i < chunks[c].size(); ++i) {
      const StreamSegment& s = chunks[c][i];
      const bool in_place = s.write && s.write_region < 0;
      if (s.read || in_place) spans.push_back({s.region, s.offset, s.offset + s.nbytes, in_place, c, i});
      if (s.write && !in_place) spans.push_back({s.write_region, s.write_offset, s.write_offset + s.nbytes, true, c, i});
    }
  }
  std::sort(spans.begin(), spans.end(),
            [](const Span& a, const Span& b) { return std::tie(a.region, a.begin) < std::tie(b.region, b.begin); });
  // Every pair of overlapping spans where one is written: allowed only as a read by an earlier
  // chunk (or the same one) of what a later chunk writes. Spans are short runs per region, so
  // the pairwise scan over the spans still open is cheap.
  std::vector<size_t> open;
  for (size_t i = 0; i < spans.size(); ++i) {
    const Span& b = spans[i];
    std::vector<size_t> still;
    for (size_t j : open) {
      const Span& a = spans[j];
      if (a.region != b.region || a.end <= b.begin) continue;
      still.push_back(j);
      if (!a.write && !b.write) continue;
      const Span& w = a.write ? a : b;
      const Span& r = a.write ? b : a;
      if (!(w.write && r.write) && r.chunk <= w.chunk && !(r.chunk == w.chunk && r.segment != w.segment)) continue;
      const StoreRegion* reg = store.region(a.region);
      return Status::InvalidArgument(
          "stream: chunk " + std::to_string(a.chunk) + " segment " + std::to_string(a.segment) + " and chunk " +
          std::to_string(b.chunk) + " segment " + std::to_string(b.segment) + " overlap in region '" +
          (reg ? reg->name : std::string("?")) + "' at bytes [" + std::to_string(b.begin) + ", " +
          std::to_string(std::min(a.end, b.end)) + ") and " +
          (w.write && r.write ? std::string("both are written back")
                              : "chunk " + std::to_string(r.chunk) + " reads what chunk " + std::to_string(w.chunk) +
                                    " writes before it"));
    }
    still.push_back(i);
    open.swap(still);
  }
  return Status::Ok();
}

}  // namespace

Status StreamPass::Create(std::shared_ptr<ShardStore> store, std::vector<std::vector<StreamSegment>> chunks,
                          std::vector<std::string> slot_classes, int depth, std::unique_ptr<StreamPass>* out) {
  if (!store) return Status::InvalidArgument("stream: no store");
  if (store->closed()) return Status::Closed("stream: the shard store in " + store->options().dir + " is closed");
  if (depth < 2 || depth > 64) {
    return Status::InvalidArgument("stream: depth must be in [2, 64], got " + std::to_string(depth));
  }
  if (slot_classes.empty()) return Status::InvalidArgument("stream: at least one slot class (segment) is needed");
  const size_t n_seg = slot_classes.size();
  std::vector<int64_t> slot_bytes(n_seg, 0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    if (chunks[c].size() != n_seg) {
      return Status::InvalidArgument("stream: chunk " + std::to_string(c) + " has " + std::to_string(chunks[c].size()) +
                                     " segments, expected " + std::to_string(n_seg) + " (one per slot class)");
    }
    for (size_t i = 0; i < n_seg; ++i) {
      const StreamSegment& s = chunks[c][i];
      if (!s.read && !s.write) {
        return Status::InvalidArgument("stream: chunk " + std::to_string(c) + " segment " + std::to_string(i) +
                                       " is neither read nor written");
      }
      JAXASCEND_RETURN_IF_ERROR(store->CheckRange(s.region, s.offset, s.nbytes, "stream"));
      if (s.write && s.write_region >= 0) {
        JAXASCEND_RETURN_IF_ERROR(store->CheckRange(s.write_region, s.write_offset, s.nbytes, "stream"));
      }
      slot_bytes[i] = std::max(slot_bytes[i], RoundUpToAlignment(s.nbytes));
    }
  }
  JAXASCEND_RETURN_IF_ERROR(CheckNoWrittenOverlap(*store, chunks));

  std::unique_ptr<StreamPass> pass(new StreamPass());
  pass->store_ = std::move(store);
  pass->chunks_ = std::move(chunks);
  pass->slot_classes_ = std::move(slot_classes);
  pass->depth_ = depth;
  Arena& arena = *pass->store_->arena();
  for (int d = 0; d < depth; ++d) {
    auto stage = std::make_unique<Stage>();
    pass->stages_.push_back(std::move(stage));
    for (size_t i = 0; i < n_seg && !pass->chunks_.empty(); ++i) {
      int32_t id = -1;
      const Status s = arena.Acquire(pass->slot_classes_[i], slot_bytes[i], &id);
      if (!s.ok()) {
        pass->ReleaseSlots();
        const auto uses = std::count(pass->slot_classes_.begin(), pass->slot_classes_.end(), pass->slot_classes_[i]);
        return Status::ArenaExhausted(s.message() + " (a stream of depth " + std::to_string(depth) + " needs " +
                                      std::to_string(depth * uses) + " slots of class '" + pass->slot_classes_[i] +
                                      "': " + std::to_string(uses) + " per stage)");
      }
      pass->stages_.back()->slots.push_back(id);
    }
  }
  *out = std::move(pass);
  return Status::Ok();
}

StreamPass::~StreamPass() { Abort(); }

const ArenaSlot& StreamPass::current_slot(int segment) const {
  const Stage& st = *stages_[current_ % depth_];
  return store_->arena()->slots()[st.slots[segment]];
}

Status StreamPass::Fail(const Status& s) {
  if (error_.ok()) error_ = s;
  return error_;
}

Status StreamPass::IssueReads(int64_t chunk) {
  Stage& st = StageOf(chunk);
  // The stage last held chunk - depth; its write-back must land before the slots are refilled.
  JAXASCEND_RETURN_IF_ERROR(st.writes.Wait());
  written_through_ = std::max(written_through_, chunk - static_cast<int64_t>(depth_));
  const Arena& arena = *store_->arena();
  for (size_t i = 0; i < chunks_[chunk].size(); ++i) {
    const StreamSegment& s = chunks_[chunk][i];
    if (!s.read) continue;
    const ArenaSlot& slot = arena.slots()[st.slots[i]];
    JAXASCEND_RETURN_IF_ERROR(store_->SubmitRead(s.region, s.offset, s.nbytes, slot.data, slot.capacity, &st.reads));
  }
  return Status::Ok();
}

Status StreamPass::SubmitWriteBack(int64_t chunk) {
  Stage& st = StageOf(chunk);
  const Arena& arena = *store_->arena();
  for (size_t i = 0; i < chunks_[chunk].size(); ++i) {
    const StreamSegment& s = chunks_[chunk][i];
    if (!s.write) continue;
    const ArenaSlot& slot = arena.slots()[st.slots[i]];
    JAXASCEND_RETURN_IF_ERROR(
        store_->SubmitWrite(s.target_region(), s.target_offset(), s.nbytes, slot.data, slot.capacity, &st.writes));
  }
  return Status::Ok();
}

Status StreamPass::Next(bool* has_chunk) {
  *has_chunk = false;
  if (finished_) return Status::Closed("stream: the pass is finished");
  if (!error_.ok()) return error_;
  const int64_t n = num_chunks();
  if (current_ >= 0 && current_ < n && !current_written_) {
    current_written_ = true;
    Status s = SubmitWriteBack(current_);
    if (!s.ok()) return Fail(s);
  }
  if (current_ >= n) return Status::Ok();
  const int64_t k = ++current_;
  current_written_ = false;
  if (k >= n) return Status::Ok();
  const int64_t ahead = std::min(n - 1, k + depth_ - 2);
  while (next_to_issue_ <= ahead) {
    Status s = IssueReads(next_to_issue_++);
    if (!s.ok()) return Fail(s);
  }
  Status s = StageOf(k).reads.Wait();
  if (!s.ok()) return Fail(s);
  *has_chunk = true;
  return Status::Ok();
}

Status StreamPass::WaitWrittenThrough(int64_t k) {
  if (!error_.ok()) return error_;
  // Chunks after written_through_ and before current_ still sit in their stages (a stage is
  // refilled only for a read, after its writes were awaited), their writes submitted.
  const int64_t last = std::min(k, current_ - 1);
  for (int64_t j = written_through_ + 1; j <= last; ++j) {
    const Status s = StageOf(j).writes.Wait();
    if (!s.ok()) return Fail(s);
  }
  written_through_ = std::max(written_through_, last);
  return Status::Ok();
}

Status StreamPass::WaitAll() {
  Status first;
  for (auto& st : stages_) {
    for (IoTicket* t : {&st->reads, &st->writes}) {
      const Status s = t->Wait();
      if (first.ok() && !s.ok()) first = s;
    }
  }
  return first;
}

void StreamPass::ReleaseSlots() {
  Arena& arena = *store_->arena();
  for (auto& st : stages_) {
    // A slot of this pass is always acquired; Release only fails on a bookkeeping bug.
    for (int32_t id : st->slots) arena.Release(id);
    st->slots.clear();
  }
}

Status StreamPass::Finish() {
  if (finished_) return error_;
  if (error_.ok() && current_ >= 0 && current_ < num_chunks() && !current_written_) {
    current_written_ = true;  // the consumer stopped early: keep what it did to this chunk
    Status s = SubmitWriteBack(current_);
    if (!s.ok()) Fail(s);
  }
  const Status waited = WaitAll();
  if (!waited.ok()) Fail(waited);
  if (error_.ok()) written_through_ = num_chunks() - 1;
  ReleaseSlots();
  finished_ = true;
  return error_;
}

void StreamPass::Abort() {
  if (finished_) return;
  WaitAll();  // requests in flight still target the slots; their outcome no longer matters
  ReleaseSlots();
  finished_ = true;
}

}  // namespace jaxascend
