// What the caching allocator reports about itself: the stats struct, the OOM message
// (c10-style: the request, the device, memory broken down, per-tag usage, a suggestion),
// the JSON snapshot of segments and blocks, and the public queries (stats, sizes of live
// allocations, backed ranges). JSON is written by hand; every string
// that can come from a user (tag names) is quoted by json_quoted (json_text.h).
#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <exception>
#include <limits>
#include <locale>
#include <sstream>
#include <utility>
#include <vector>

#include "allocator/caching_allocator_impl.h"
#include "allocator/errors.h"
#include "allocator/json_text.h"
#include "allocator/tags.h"
#include "allocator/thread_cache.h"

namespace tidepool {

using detail::Block;
using detail::BlockState;
using detail::Segment;

std::string format_bytes(std::uint64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = static_cast<double>(bytes);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

std::string pytorch_out_of_memory_message(std::size_t bytes, const std::string& tidepool_message) {
  return "CUDA out of memory. Tried to allocate " + format_bytes(bytes) + ". " + tidepool_message;
}

namespace {

// Calls fn(lo, hi) for each backed sub-range of block b.
template <class Fn>
void for_each_backed(const Block* b, std::size_t granule, Fn&& fn) {
  const Segment* seg = b->segment;
  if (!seg->expandable) {
    fn(b->ptr, b->ptr + b->size);
    return;
  }
  const char* end = b->ptr + b->size;
  const char* run_lo = nullptr;
  for (std::size_t g = static_cast<std::size_t>(b->ptr - seg->base) / granule;
       g < seg->run_head.size() && seg->base + g * granule < end; ++g) {
    const char* glo = std::max<const char*>(seg->base + g * granule, b->ptr);
    if (seg->run_head[g] >= 0) {
      if (run_lo == nullptr) run_lo = glo;
    } else if (run_lo != nullptr) {
      fn(run_lo, glo);
      run_lo = nullptr;
    }
  }
  if (run_lo != nullptr) fn(run_lo, end);
}

void json_pointer(std::ostream& os, const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "\"0x%" PRIxPTR "\"", reinterpret_cast<std::uintptr_t>(p));
  os << buf;
}

void json_stat(std::ostream& os, const char* name, const Stat& s) {
  os << '"' << name << "\":{\"current\":" << s.current << ",\"peak\":" << s.peak
     << ",\"allocated\":" << s.allocated << ",\"freed\":" << s.freed << '}';
}

const char* state_name(BlockState s) {
  switch (s) {
    case BlockState::allocated: return "allocated";
    case BlockState::free: return "free";
    case BlockState::quick: return "cached";
    case BlockState::pending: return "pending";
  }
  return "?";
}

}  // namespace

// Note [Cached memory by tag]
// Cached memory belongs to no allocation, yet when reserved is well above allocated the
// question is whose memory the cache holds. Each free block keeps a tag as an allocated
// block does, by these rules:
//   - a freed block keeps the tag of the allocation it held (its last use);
//   - the rest of a split keeps the tag of the block it was cut from;
//   - a new plain segment is the tag of the request it was taken for, so the part of it
//     that request leaves free is its;
//   - the backed part of an expandable range past its last block (the rest of the last
//     mapping slot) is the tag of the request it was backed for (Segment::tail_tag);
//   - blocks that merge take the larger part's tag (ties: the lower address's);
//   - a range backs whole mapping slots, so backing a block may back part of a free
//     neighbour too (the rest of a split, a slot given back earlier): that memory is
//     under the neighbour's tag, as its other bytes are. One tag per block; tags are not
//     kept per byte.
// A request that fails leaves every tag's memory where it was: grow tiles a range's
// address space under the tag its backed memory already had (segments.cpp).
// So every cached byte is under exactly one tag, and the tags' cached figures add up to
// cached_bytes; the per-tag figure is an attribution (a merge hands the smaller part to
// the larger's tag), not a history of every byte. A tag's largest free block is its
// largest run of adjacent free blocks of one stream and that tag; its fragmentation is
// 1 - largest / cached, as the total's. Counted by walking the segments when stats are
// read, as the largest free range already was: nothing on the allocation path.
detail::CacheCensus CachingAllocator::Impl::cache_census() const {
  detail::CacheCensus census;
  // A free range: adjacent cached memory, contiguously backed; `tag` matters for by-tag.
  struct Run {
    const char* lo = nullptr;
    const char* hi = nullptr;
    const StreamPools* owner = nullptr;
    int tag = -1;
    void reset() { *this = Run{}; }
  };
  auto extend = [](Run& run, const char* lo, const char* hi) {
    if (run.hi != lo) run.lo = lo;
    run.hi = hi;
    return static_cast<std::size_t>(run.hi - run.lo);
  };
  for (const auto& [base, seg] : segments) {
    // Adjacent non-allocated blocks of one stream form one free range (quick and pending
    // blocks included: their memory is cached, just not yet merged). Blocks of different
    // streams never merge, and a steal takes one block: such neighbours are two ranges.
    Run any;
    Run same_tag;
    for (const Block* b = seg->first; b != nullptr; b = b->next) {
      // A block parked in a thread cache is allocated to the shared state but cached
      // memory all the same (its holder's mutex is held by the caller).
      if (b->state == BlockState::allocated && !(b->holder != nullptr && b->in_thread_cache)) {
        any.reset();
        same_tag.reset();
        continue;
      }
      if (b->owner != any.owner) any.reset();
      any.owner = b->owner;
      if (b->owner != same_tag.owner || b->tag != same_tag.tag) same_tag.reset();
      same_tag.owner = b->owner;
      same_tag.tag = b->tag;
      for_each_backed(b, granule, [&](const char* lo, const char* hi) {
        census.cached[b->tag] += static_cast<std::uint64_t>(hi - lo);
        census.largest = std::max(census.largest, extend(any, lo, hi));
        census.largest_by_tag[b->tag] =
            std::max<std::uint64_t>(census.largest_by_tag[b->tag], extend(same_tag, lo, hi));
      });
    }
    // A plain segment is tiled whole, but for one whose block could not be made (no heap
    // for it, segments.cpp's grow): cached, and no request can have it until it goes back.
    if (!seg->expandable) {
      census.cached[seg->tail_tag] +=
          static_cast<std::uint64_t>(seg->base + seg->size - seg->used_end);
      continue;
    }
    // An expandable range is backed slot by slot, but blocks tile it only up to used_end:
    // the backed rest of the last slot holds no block yet is free memory, contiguous with
    // a free last block.
    const int tail_tag = seg->tail_tag;
    if (same_tag.tag != tail_tag) same_tag.reset();
    for (std::size_t g = static_cast<std::size_t>(seg->used_end - seg->base) / granule;
         g < seg->run_head.size() && seg->run_head[g] >= 0; ++g) {
      const char* lo = std::max<const char*>(seg->base + g * granule, seg->used_end);
      const char* hi = seg->base + (g + 1) * granule;
      if (lo == hi) continue;
      census.cached[tail_tag] += static_cast<std::uint64_t>(hi - lo);
      census.largest = std::max(census.largest, extend(any, lo, hi));
      census.largest_by_tag[tail_tag] =
          std::max<std::uint64_t>(census.largest_by_tag[tail_tag], extend(same_tag, lo, hi));
    }
  }
  return census;
}

// Pre: the allocator's and every thread cache's mutex held (a parked block's
// in_thread_cache is read).
std::vector<MemoryRange> CachingAllocator::Impl::backed_ranges() const {
  std::vector<MemoryRange> out;
  for (const auto& [base, seg] : segments) {
    // The backed parts of the segment, contiguous runs merged.
    std::vector<std::pair<const char*, const char*>> parts;
    if (!seg->expandable) {
      parts.emplace_back(seg->base, seg->base + seg->size);
    } else {
      for (const std::uint32_t g : seg->mapped_runs) {
        const char* lo = seg->base + static_cast<std::size_t>(g) * granule;
        const char* hi = lo + static_cast<std::size_t>(seg->run_granules[g]) * granule;
        if (!parts.empty() && parts.back().second == lo)
          parts.back().second = hi;
        else
          parts.emplace_back(lo, hi);
      }
    }
    const Block* cursor = seg->first;  // blocks are in address order, as the parts are
    for (const auto& [lo, hi] : parts) {
      MemoryRange r;
      r.address = reinterpret_cast<std::uintptr_t>(lo);
      r.size = static_cast<std::size_t>(hi - lo);
      r.stream = segment_stream(seg);
      r.small = seg->small;
      r.expandable = seg->expandable;
      while (cursor != nullptr && cursor->ptr + cursor->size <= lo) cursor = cursor->next;
      for (const Block* b = cursor; b != nullptr && b->ptr < hi; b = b->next) {
        MemoryRange::Piece piece;
        const char* plo = std::max<const char*>(b->ptr, lo);
        const char* phi = std::min<const char*>(b->ptr + b->size, hi);
        piece.address = reinterpret_cast<std::uintptr_t>(plo);
        piece.size = static_cast<std::size_t>(phi - plo);
        const bool parked = b->holder != nullptr && b->in_thread_cache;
        if (b->state == BlockState::allocated && !parked) {
          piece.state = MemoryRange::State::allocated;
          piece.requested = b->requested;
          piece.tag = b->tag;
        } else if (b->state == BlockState::pending) {
          piece.state = MemoryRange::State::pending_free;
        }
        r.pieces.push_back(piece);
      }
      // Backed memory past the tiled part of an expandable range: free, no block yet.
      if (seg->used_end < hi) {
        MemoryRange::Piece tail;
        const char* tlo = std::max<const char*>(seg->used_end, lo);
        tail.address = reinterpret_cast<std::uintptr_t>(tlo);
        tail.size = static_cast<std::size_t>(hi - tlo);
        r.pieces.push_back(tail);
      }
      out.push_back(std::move(r));
    }
  }
  return out;
}

namespace {

// 1 - largest / cached: how much of the cached memory one request cannot have.
double fragmentation_of(std::uint64_t cached, std::uint64_t largest) {
  if (cached == 0) return 0.0;
  return 1.0 - static_cast<double>(std::min(largest, cached)) / static_cast<double>(cached);
}

}  // namespace

AllocatorStats CachingAllocator::Impl::compute_stats() const {
  AllocatorStats s = stats;
  const detail::CacheCensus census = cache_census();
  s.cached_bytes = s.reserved.current - s.allocated.current;
  s.largest_free_block = census.largest;
  s.fragmentation = fragmentation_of(s.cached_bytes, census.largest);
  for (int t = 0; t < kTagCount; ++t) {
    TagStats& ts = s.tags[t];
    ts.cached_bytes = census.cached[t];
    ts.largest_free_block = census.largest_by_tag[t];
    ts.fragmentation = fragmentation_of(ts.cached_bytes, ts.largest_free_block);
  }
  return s;
}

namespace {

std::string error_text(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown error";
  }
}

}  // namespace

std::string CachingAllocator::Impl::oom_message(std::size_t bytes, std::size_t rounded, Stream s,
                                                std::size_t reclaim_calls,
                                                std::size_t reclaimed) const {
  const AllocatorStats st = compute_stats();
  MemInfo info;
  try {
    info = backend->mem_info();
  } catch (...) {
  }
  std::ostringstream os;
  os << "tidepool: out of memory: cannot allocate " << format_bytes(bytes) << " (" << bytes
     << " bytes, rounded to " << rounded << ") on device " << device << " (" << backend->name()
     << " backend), stream " << s.handle << ". Device: " << format_bytes(info.total_bytes)
     << " total, " << format_bytes(info.free_bytes) << " free";
  const std::size_t limit = backend->device_limit();
  if (limit != std::numeric_limits<std::size_t>::max()) {
    os << ", of which this process may use " << format_bytes(limit) << " (memory fraction; "
       << format_bytes(backend->device_bytes_in_use()) << " in use)";
  }
  os << ". tidepool holds " << format_bytes(st.reserved.current) << " reserved, "
     << format_bytes(st.allocated.current) << " allocated, " << format_bytes(st.cached_bytes)
     << " cached (largest free block "
     << format_bytes(st.largest_free_block) << "). By tag:";
  bool any = false;
  for (int t = 0; t < kTagCount; ++t) {
    const TagStats& ts = st.tags[t];
    if (ts.count == 0 && ts.cached_bytes == 0) continue;
    const char* name = tag_name(t);
    os << (any ? ", " : " ") << (name ? name : "?") << " " << format_bytes(ts.bytes.current)
       << " in " << ts.count << (ts.count == 1 ? " allocation" : " allocations");
    if (ts.cached_bytes != 0) os << " (" << format_bytes(ts.cached_bytes) << " cached)";
    any = true;
  }
  if (!any) os << " nothing allocated";
  // A request that can never fit failed before the cache was emptied or a hook asked
  // (Note [OOM policy] in caching_allocator.cpp).
  if (never_fits(rounded)) {
    os << ". Nothing was freed for it: it cannot fit whatever is freed. ";
  } else {
    os << ". Cache emptied and " << reclaim_calls << " reclaim hook call(s) freed "
       << format_bytes(reclaimed) << ". ";
  }
  if (!unreleased.empty()) {  // Note [Unreleased handles] (segments.cpp)
    std::size_t held = 0;
    for (const auto& handle : unreleased) held += handle.second;
    os << "The backend would not take back " << format_bytes(held) << " in "
       << unreleased.size() << " physical allocation(s) unmapped from tidepool's ranges"
       << " (retried at each release)";
    if (release_error) os << ": " << error_text(release_error);
    os << ". ";
  } else if (release_error) {  // Note [A stream that cannot be waited for] (segments.cpp)
    os << "Giving cached memory back stopped short: " << error_text(release_error) << ". ";
  }
  if (info.total_bytes != 0 && bytes > info.total_bytes)
    os << "The request is larger than the whole device: check the size computation.";
  else if (limit != std::numeric_limits<std::size_t>::max() && bytes > limit)
    os << "The request is larger than this process's share of the device "
          "(torch.cuda.set_per_process_memory_fraction / tidepool_set_memory_fraction).";
  else
    os << "Suggestion: reduce the batch size, free tensors you no longer need, or move "
          "optimizer state to the host with tidepool's tiering (it registers a reclaim hook).";
  return os.str();
}

namespace {

// The snapshot up to its segments: device, backend, options, stats and tags, ending in
// `],` (the "tags" array closed).
void write_snapshot_head(std::ostream& os, int device, const char* backend, bool expandable,
                         const AllocatorStats& st) {
  os.imbue(std::locale::classic());  // a global locale's digit grouping is not JSON
  os << "{\"version\":1,\"device\":" << device << ",\"backend\":";
  os << json_quoted(backend);
  os << ",\"expandable_segments\":" << (expandable ? "true" : "false");
  os << ",\"stats\":{";
  json_stat(os, "allocated", st.allocated);
  os << ',';
  json_stat(os, "requested", st.requested);
  os << ',';
  json_stat(os, "reserved", st.reserved);
  os << ',';
  json_stat(os, "allocations", st.allocations);
  os << ',';
  json_stat(os, "segments", st.segments);
  os << ",\"cached_bytes\":" << st.cached_bytes
     << ",\"segments_acquired\":" << st.segments.allocated
     << ",\"segments_released\":" << st.segments.freed
     << ",\"alloc_count\":" << st.allocations.allocated
     << ",\"free_count\":" << st.allocations.freed << ",\"cache_hits\":" << st.cache_hits
     << ",\"cache_misses\":" << st.cache_misses << ",\"oom_count\":" << st.oom_count
     << ",\"reclaim_calls\":" << st.reclaim_calls << ",\"reclaimed_bytes\":" << st.reclaimed_bytes
     << ",\"cross_stream_reuses\":" << st.cross_stream_reuses
     << ",\"free_device_syncs\":" << st.free_device_syncs
     << ",\"largest_free_block\":" << st.largest_free_block
     << ",\"fragmentation\":" << json_number(st.fragmentation) << "},\"tags\":[";
  bool first = true;
  for (int t = 0; t < tag_count() && t < kTagCount; ++t) {
    const TagStats& ts = st.tags[t];
    if (!first) os << ',';
    first = false;
    os << "{\"id\":" << t << ",\"name\":";
    os << json_quoted(tag_name(t) ? tag_name(t) : "");
    os << ',';
    json_stat(os, "bytes", ts.bytes);
    os << ",\"count\":" << ts.count << ",\"total_count\":" << ts.total_count
       << ",\"cached_bytes\":" << ts.cached_bytes
       << ",\"largest_free_block\":" << ts.largest_free_block
       << ",\"fragmentation\":" << json_number(ts.fragmentation) << '}';
  }
  os << "],";
}

}  // namespace

std::string snapshot_json_of_unused_device(int device, BackendKind kind) {
  std::ostringstream os;
  write_snapshot_head(os, device, kind == BackendKind::cuda ? "cuda" : "host",
                      AllocatorOptions{}.expandable_segments, AllocatorStats{});
  os << "\"segments\":[]}";
  return os.str();
}

std::string CachingAllocator::Impl::snapshot_json() const {
  std::ostringstream os;
  write_snapshot_head(os, device, backend->name(), options.expandable_segments,
                      compute_stats());
  // A released stream's pool has no stream (Note [Released streams]): named "released".
  auto json_stream = [this](std::ostream& out, const detail::StreamPools* sp) {
    if (sp == released.get())
      out << "\"released\"";
    else
      json_pointer(out, sp->stream.handle);
  };
  os << "\"segments\":[";
  bool first = true;
  for (const auto& [base, seg] : segments) {
    if (!first) os << ',';
    first = false;
    os << "{\"address\":";
    json_pointer(os, seg->base);
    os << ",\"size\":" << seg->size << ",\"used\":" << (seg->used_end - seg->base)
       << ",\"backed\":" << seg->mapped_bytes << ",\"expandable\":"
       << (seg->expandable ? "true" : "false") << ",\"pool\":\""
       << (seg->small ? "small" : "large") << "\",\"stream\":";
    json_stream(os, seg->creator);
    os << ",\"blocks\":[";
    for (const Block* b = seg->first; b != nullptr; b = b->next) {
      if (b != seg->first) os << ',';
      os << "{\"address\":";
      json_pointer(os, b->ptr);
      const bool thread_cached = b->holder != nullptr && b->in_thread_cache;
      os << ",\"size\":" << b->size << ",\"state\":\""
         << (thread_cached ? "thread_cached" : state_name(b->state)) << "\",\"stream\":";
      json_stream(os, b->owner);
      // A free block's tag is the one its memory is cached under (Note [Cached memory by
      // tag]): "last_tag", not "tag", which names a live allocation's.
      const bool live = b->state == BlockState::allocated && !thread_cached;
      if (live) os << ",\"requested\":" << b->requested;
      os << (live ? ",\"tag\":" : ",\"last_tag\":");
      os << json_quoted(tag_name(b->tag) ? tag_name(b->tag) : "");
      os << '}';
    }
    os << "]}";
  }
  os << "]}";
  return os.str();
}

// ============================================================================ queries

AllocatorStats CachingAllocator::stats() const {
  std::lock_guard lock(impl_->mutex);
  const auto cache_locks = impl_->lock_thread_caches();
  impl_->fold_locked_thread_caches();
  return impl_->compute_stats();
}

CachingAllocator::BytesInUse CachingAllocator::bytes_in_use() const {
  std::lock_guard lock(impl_->mutex);
  const auto cache_locks = impl_->lock_thread_caches();
  impl_->fold_locked_thread_caches();
  return {impl_->stats.allocated.current, impl_->stats.reserved.current};
}

std::size_t CachingAllocator::largest_free_block() const {
  std::lock_guard lock(impl_->mutex);
  const auto cache_locks = impl_->lock_thread_caches();
  return impl_->largest_free_backed();
}

MappingStats CachingAllocator::mapping_stats() const {
  std::lock_guard lock(impl_->mutex);
  return impl_->mapping;
}

void CachingAllocator::reset_peak_stats() {
  std::lock_guard lock(impl_->mutex);
  const auto cache_locks = impl_->lock_thread_caches();
  impl_->fold_locked_thread_caches();
  AllocatorStats& s = impl_->stats;
  s.allocated.reset_peak();
  s.requested.reset_peak();
  s.reserved.reset_peak();
  s.allocations.reset_peak();
  s.segments.reset_peak();
  for (TagStats& t : s.tags) t.bytes.reset_peak();
}

std::string CachingAllocator::snapshot_json() const {
  std::lock_guard lock(impl_->mutex);
  const auto cache_locks = impl_->lock_thread_caches();
  impl_->fold_locked_thread_caches();
  return impl_->snapshot_json();
}

std::vector<MemoryRange> CachingAllocator::backed_ranges() const {
  std::lock_guard lock(impl_->mutex);
  const auto cache_locks = impl_->lock_thread_caches();
  return impl_->backed_ranges();
}

// The sizes of the live block at ptr, zeros when there is none; impl's mutex held. A
// block parked in a thread cache is free to its callers. Its holder's mutex is taken to
// tell, and the sizes are read under it: the holder's thread rewrites `requested` each
// time its cache hands the block out again.
struct LiveBlockSizes {
  std::size_t requested = 0;
  std::size_t size = 0;
};

static LiveBlockSizes live_block_sizes(const CachingAllocator::Impl& m, const void* ptr) {
  auto it = m.blocks.find(ptr);
  if (it == m.blocks.end() || it->second->state != BlockState::allocated) return {};
  const detail::Block* b = it->second;
  if (b->holder == nullptr) return {b->requested, b->size};
  std::lock_guard cache_lock(b->holder->mutex);
  return b->in_thread_cache ? LiveBlockSizes{} : LiveBlockSizes{b->requested, b->size};
}

std::size_t CachingAllocator::allocation_size(const void* ptr) const {
  std::lock_guard lock(impl_->mutex);
  return live_block_sizes(*impl_, ptr).requested;
}

std::size_t CachingAllocator::block_size(const void* ptr) const {
  std::lock_guard lock(impl_->mutex);
  return live_block_sizes(*impl_, ptr).size;
}

Backend& CachingAllocator::backend() const { return *impl_->backend; }
SegmentEventLog& CachingAllocator::segment_events() const { return impl_->segment_log; }
int CachingAllocator::device() const { return impl_->device; }
const AllocatorOptions& CachingAllocator::options() const { return impl_->options; }

}  // namespace tidepool
