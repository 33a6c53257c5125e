// Segments: where the caching allocator gets memory from the backend and how it gives it
// back. Two kinds (block.h):
//   - plain segments: one Backend::device_alloc each (2 MiB small, 20 MiB for requests up
//     to 10 MiB, else the request rounded to 2 MiB), released whole when fully free;
//   - expandable ranges, see the Note below.
//
// Note [Expandable segments]
// Plain segments fragment: a 20 MiB segment with one live 1 MiB block cannot serve a
// 30 MiB request, so the allocator asks for more while holding free memory. Instead each
// stream reserves one large address range per pool (Backend::reserve_address, the
// device's total size; address space costs nothing) and tiles it with blocks from the
// start. When no free block fits, the range grows at its end: the last block, if free,
// is extended, else a new block is appended; only the granules (2 MiB) under blocks in
// use are backed, by create_physical + map, in runs of up to max_map_run_bytes. Since
// everything a stream frees stays contiguous with its neighbours, free blocks coalesce
// across what would have been segment boundaries, and reserved memory stays within a
// granule of the stream's high-water mark of live bytes plus holes. Under memory
// pressure (and in empty_cache) each mapping run lying wholly inside free blocks is
// unmapped and its physical memory released; the blocks stay and are re-backed on reuse.
// PyTorch's expandable segments (CUDA VMM) are the model.
//
// Note [Recycling free runs]
// A range never shrinks by itself, so reserved memory follows the high-water mark of
// each range, holes included: in GPT-2's trace a 392 MiB hole sits between live 785 MiB
// blocks at the peak (ratio 1.069). Because physical memory is separate from addresses,
// the hole's backing can move: with options.recycle_slack >= 0, before new granules are
// backed while reserved memory would exceed (1 + slack) x peak allocated, mapping runs
// lying wholly in free blocks are released first (only runs whose streams are known to
// be done with them, or the allocating stream's own, which is then synchronized). This
// reaches 1.026 on GPT-2 but costs a release and a create per recycled run, which the
// replay's cost model charges like cudaFree + cudaMalloc; it is off by default.
// choose_fit's optional preference for backed blocks (prefer_backed_fit) keeps
// allocations out of recycled holes while backed free memory fits, so fewer runs bounce
// back and forth, at some cost in packing.
#include <algorithm>
#include <set>

#include "allocator/caching_allocator_impl.h"
#include "allocator/size_classes.h"

namespace tidepool {

using detail::Block;
using detail::BlockState;
using detail::Segment;
using detail::StreamPools;

CachingAllocator::Impl::Segment* CachingAllocator::Impl::create_segment(StreamPools& sp,
                                                                         std::size_t bytes,
                                                                         bool small,
                                                                         bool expandable) {
  void* base = expandable ? backend->reserve_address(bytes) : backend->device_alloc(bytes);
  if (base == nullptr) return nullptr;
  auto* seg = new Segment();
  seg->base = static_cast<char*>(base);
  seg->size = bytes;
  seg->expandable = expandable;
  seg->small = small;
  seg->creator = &sp;
  seg->used_end = seg->base;
  if (expandable) {
    const std::size_t granules = bytes / granule;
    seg->run_head.assign(granules, -1);
    seg->run_handle.assign(granules, PhysicalHandle{});
    seg->run_granules.assign(granules, 0);
  } else {
    seg->mapped_bytes = bytes;
    stats.reserved.add(bytes);
    ++stats.segments_acquired;
  }
  segments.emplace(seg->base, seg);
  return seg;
}

// Appends a free block of `bytes` at the segment's used end, owned by sp, into sp's pool.
static Block* append_block(CachingAllocator::Impl& m, Segment* seg, StreamPools& sp,
                           std::size_t bytes) {
  Block* b = m.new_block();
  b->ptr = seg->used_end;
  b->size = bytes;
  b->segment = seg;
  b->owner = &sp;
  b->prev = seg->last;
  if (seg->last != nullptr)
    seg->last->next = b;
  else
    seg->first = b;
  seg->last = b;
  seg->used_end += bytes;
  m.blocks.emplace(b->ptr, b);
  m.insert_free(b, false);
  return b;
}

Block* CachingAllocator::Impl::grow(StreamPools& sp, std::size_t size, bool small) {
  detail::BlockPool& pool = sp.pool(small);
  if (!options.expandable_segments) {
    Segment* seg = create_segment(sp, plain_segment_size(size), small, false);
    if (seg == nullptr) return nullptr;
    append_block(*this, seg, sp, seg->size);
    return pool.best_fit(size);
  }
  std::vector<Segment*>& ranges = small ? sp.small_ranges : sp.large_ranges;
  if (!ranges.empty()) {
    Segment* seg = ranges.back();
    Block* last = seg->last;
    const bool extend_last =
        last != nullptr && last->state == BlockState::free && last->owner == &sp;
    const std::size_t need = extend_last ? size - std::min(size, last->size) : size;
    if (seg->used_end + need <= seg->base + seg->size) {
      if (!extend_last) return append_block(*this, seg, sp, need);
      pool.erase(last);
      last->size += need;
      seg->used_end += need;
      pool.insert(last);
      return last;
    }
  }
  // A new range for a request the device could never back would only pin address space.
  if (device_total != 0 && size > device_total) return nullptr;
  Segment* seg = create_segment(sp, std::max(range_bytes, round_up(size, granule)), small, true);
  if (seg == nullptr) return nullptr;
  ranges.push_back(seg);
  return append_block(*this, seg, sp, size);
}

bool CachingAllocator::Impl::ensure_backed(Block* b) {
  Segment* seg = b->segment;
  if (!seg->expandable) return true;
  const std::size_t first = static_cast<std::size_t>(b->ptr - seg->base) / granule;
  const std::size_t end =
      (static_cast<std::size_t>(b->ptr - seg->base) + b->size + granule - 1) / granule;
  const std::size_t max_run = std::max<std::size_t>(1, options.max_map_run_bytes / granule);
  if (options.recycle_slack >= 0 && options.allow_release &&
      futile_recycle_at != stats.free_count &&
      stats.reserved.current - stats.allocated.current >= granule) {
    // Note [Recycling free runs]
    const std::size_t unbacked = unbacked_bytes(seg, b->ptr, b->ptr + b->size);
    const double live_peak = static_cast<double>(
        std::max<std::uint64_t>(stats.allocated.peak, stats.allocated.current + b->size));
    const auto budget = static_cast<std::uint64_t>(live_peak * (1.0 + options.recycle_slack));
    const std::uint64_t after = stats.reserved.current + unbacked;
    if (unbacked != 0 && after > budget && release_cached(after - budget, false, b->owner) == 0)
      futile_recycle_at = stats.free_count;
  }
  for (std::size_t g = first; g < end;) {
    if (seg->run_head[g] >= 0) {
      ++g;
      continue;
    }
    std::size_t run_end = g;
    while (run_end < end && seg->run_head[run_end] < 0 && run_end - g < max_run) ++run_end;
    const std::size_t bytes = (run_end - g) * granule;
    PhysicalHandle h = backend->create_physical(bytes, MemoryLocation::device);
    if (!h) return false;
    try {
      backend->map(seg->base + g * granule, bytes, h);
    } catch (...) {
      backend->release_physical(h, bytes);
      throw;
    }
    for (std::size_t i = g; i < run_end; ++i) seg->run_head[i] = static_cast<std::int32_t>(g);
    seg->run_handle[g] = h;
    seg->run_granules[g] = static_cast<std::uint32_t>(run_end - g);
    seg->mapped_bytes += bytes;
    stats.reserved.add(bytes);
    ++stats.segments_acquired;
    g = run_end;
  }
  return true;
}

std::size_t CachingAllocator::Impl::unbacked_bytes(const Segment* seg, const char* lo,
                                                   const char* hi) const {
  std::size_t n = 0;
  const std::size_t end = (static_cast<std::size_t>(hi - seg->base) + granule - 1) / granule;
  for (std::size_t g = static_cast<std::size_t>(lo - seg->base) / granule; g < end; ++g)
    if (seg->run_head[g] < 0) n += granule;
  return n;
}

namespace {

// A piece of backed memory that is wholly free: a plain segment, or one mapping run.
struct Releasable {
  Segment* segment;
  std::size_t head;  // expandable: first granule of the run
};

// True when every block overlapping [lo, hi) is free (not allocated, quick or pending)
// and, if `settled_only`, known to be finished with by its stream (its free is covered by
// a completed fence, Note [Cross-stream reuse]). `cursor` walks forward through the
// segment's blocks across successive calls.
// Blocks of `waitable` (the stream allocating now) qualify too: their stream is waited for.
bool all_free(Block*& cursor, const char* lo, const char* hi, bool settled_only,
              const StreamPools* waitable = nullptr) {
  while (cursor != nullptr && cursor->ptr + cursor->size <= lo) cursor = cursor->next;
  for (Block* b = cursor; b != nullptr && b->ptr < hi; b = b->next) {
    if (b->state != BlockState::free) return false;
    if (settled_only && b->free_seq > b->owner->safe_seq && b->owner != waitable) return false;
  }
  // Granules past used_end hold no blocks; they are free by construction.
  return true;
}

}  // namespace

std::size_t CachingAllocator::Impl::release_cached(std::size_t want, bool wait,
                                                   StreamPools* waitable) {
  if (!options.allow_release) return 0;
  // Without waiting, only memory whose streams are known to be past the frees qualifies:
  // bring every stream's fence up to date first (records at most one event per stream).
  if (!wait)
    for (auto& sp : streams) refresh_fence(*sp);
  std::vector<Releasable> found;
  std::size_t found_bytes = 0;
  std::set<void*> streams_to_sync;
  auto note_owners = [&](const char* lo, const char* hi, Block* from) {
    for (Block* b = from; b != nullptr && b->ptr < hi; b = b->next)
      if (b->ptr + b->size > lo) streams_to_sync.insert(b->owner->stream.handle);
  };
  for (auto& [base, seg] : segments) {
    if (found_bytes >= want) break;
    if (!seg->expandable) {
      // Every block free (blocks of different streams do not merge, so there may be
      // several).
      Block* cursor = seg->first;
      if (all_free(cursor, seg->base, seg->base + seg->size, !wait, waitable)) {
        found.push_back({seg, 0});
        found_bytes += seg->size;
        note_owners(seg->base, seg->base + seg->size, seg->first);
      }
      continue;
    }
    Block* cursor = seg->first;
    for (std::size_t g = 0; g < seg->run_head.size() && found_bytes < want; ++g) {
      if (seg->run_head[g] != static_cast<std::int32_t>(g)) continue;
      const char* lo = seg->base + g * granule;
      const char* hi = lo + seg->run_granules[g] * granule;
      if (!all_free(cursor, lo, hi, !wait, waitable)) continue;
      found.push_back({seg, g});
      found_bytes += seg->run_granules[g] * granule;
      note_owners(lo, hi, cursor);
    }
  }
  if (found.empty()) return 0;
  // Work queued before the frees may still touch the memory: wait for those streams
  // (when not waiting, every block found is already covered by a completed fence).
  if (wait) {
    for (void* s : streams_to_sync) backend->stream_synchronize(Stream{s});
  } else if (waitable != nullptr && streams_to_sync.count(waitable->stream.handle) != 0 &&
             waitable->free_seq > waitable->safe_seq) {
    backend->stream_synchronize(waitable->stream);
    waitable->safe_seq = waitable->free_seq;
  }
  std::size_t released = 0;
  for (const Releasable& r : found) {
    Segment* seg = r.segment;
    if (!seg->expandable) {
      for (Block* b = seg->first; b != nullptr;) {
        Block* next = b->next;
        b->owner->pool(seg->small).erase(b);
        blocks.erase(b->ptr);
        recycle(b);
        b = next;
      }
      segments.erase(seg->base);
      backend->device_free(seg->base, seg->size);
      stats.reserved.sub(seg->size);
      ++stats.segments_released;
      released += seg->size;
      delete seg;
      continue;
    }
    const std::size_t n = seg->run_granules[r.head];
    const std::size_t bytes = n * granule;
    backend->unmap(seg->base + r.head * granule, bytes);
    backend->release_physical(seg->run_handle[r.head], bytes);
    for (std::size_t i = r.head; i < r.head + n; ++i) seg->run_head[i] = -1;
    seg->run_handle[r.head] = PhysicalHandle{};
    seg->run_granules[r.head] = 0;
    seg->mapped_bytes -= bytes;
    stats.reserved.sub(bytes);
    ++stats.segments_released;
    released += bytes;
  }
  return released;
}

void CachingAllocator::Impl::destroy_everything() {
  try {
    backend->device_synchronize();
  } catch (...) {
    // Tear-down continues: the memory goes back either way.
  }
  for (auto& [base, seg] : segments) {
    try {
      if (!seg->expandable) {
        backend->device_free(seg->base, seg->size);
      } else {
        for (std::size_t g = 0; g < seg->run_head.size(); ++g) {
          if (seg->run_head[g] != static_cast<std::int32_t>(g)) continue;
          const std::size_t bytes = seg->run_granules[g] * granule;
          backend->unmap(seg->base + g * granule, bytes);
          backend->release_physical(seg->run_handle[g], bytes);
        }
        backend->release_address(seg->base, seg->size);
      }
    } catch (...) {
      // A failing backend at tear-down must not turn into std::terminate.
    }
    delete seg;
  }
  segments.clear();
  for (auto& [ptr, b] : blocks) {
    for (Event e : b->pending_events) spare_events.push_back(e);
    delete b;
  }
  blocks.clear();
  for (Block* b : spare_blocks) delete b;
  spare_blocks.clear();
  try {
    for (Event e : spare_events) backend->destroy_event(e);
    for (auto& sp : streams)
      if (sp->fence) backend->destroy_event(sp->fence);
  } catch (...) {
  }
}

}  // namespace tidepool
