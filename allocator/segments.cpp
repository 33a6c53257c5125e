// Segments: where the caching allocator gets memory from the backend and how it gives it
// back. Two kinds (block.h):
//   - plain segments: one Backend::device_alloc each (2 MiB small, 20 MiB for requests up
//     to 10 MiB, else the request rounded to 2 MiB), released whole when fully free;
//   - expandable ranges, see the Note below.
// Each backing change is also queued for an observer if one is listening (Note [Segment
// events] in segment_events.h): a plain segment allocated or freed, a run mapped or
// unmapped.
//
// Note [Expandable segments]
// Plain segments fragment: a 20 MiB segment with one live 1 MiB block cannot serve a
// 30 MiB request, so the allocator asks for more while holding free memory. Instead each
// stream reserves one large address range per pool (Backend::reserve_address, the
// device's total size; address space costs nothing) and tiles it with blocks from the
// start. When no free block fits, the range grows at its end: the last block, if free,
// is extended, else a new block is appended. Only the slots under blocks in use are
// backed: a large-pool range is cut into slots of map_slot_bytes (32 MiB), a small-pool
// range into granules (2 MiB), and each slot is backed whole by one create_physical +
// map. Since everything a stream frees stays contiguous with its neighbours, free blocks
// coalesce across what would have been segment boundaries. Under memory pressure (and in
// empty_cache) each mapping run lying wholly inside free blocks is unmapped and its
// physical memory released; the blocks stay and are re-backed on reuse. PyTorch's
// expandable segments (CUDA VMM) are the model. Near the device's capacity or the
// process's memory-fraction limit (less than four slots' worth left of either), or when
// the backend refuses a whole slot, a slot is backed only in the granules the block
// needs, so that a mostly free slot cannot pin memory another request needs.
//
// Note [Moving free runs]
// A range never shrinks by itself, so without more its backing would follow the
// high-water mark of the range, holes included: in GPT-2's trace a 392 MiB hole sits
// between live 785 MiB blocks at the peak (1.069 reserved per live byte). Physical
// memory is separate from addresses, so a hole's backing can move instead: before a slot
// is backed with new physical memory while reserved memory would exceed
// (1 + move_slack) x the peak of allocated memory, a slot lying wholly in free blocks
// elsewhere (any range of the device, any stream) is unmapped there and its handle
// mapped here. Only free blocks' memory moves, so no live byte changes address or
// content; reserved memory (the physical memory held, all of it mapped) stays the same;
// the backend sees an unmap and a map, no allocation. Slots all have one size, so any
// free slot fits any unmapped one (a handle maps whole: there is no offset); smaller
// slots waste less around live data but need more backend allocations (GPT-2: 16 MiB
// 1.020, 32 MiB 1.024, 64 MiB 1.040). New physical memory is then created only when no
// slot anywhere is wholly free, so peak reserved is the peak of the bytes of slots
// touched by live blocks. Safety as for releases: a slot qualifies once a completed
// fence covers the frees in it (Note [Cross-stream reuse]); a slot the allocating stream
// itself freed may also move after that stream is synchronized (counted in
// MappingStats::move_syncs; slots needing no synchronization are taken first). To cut
// the moves, choose_fit places a block at whichever end of its best fit is already
// backed once backing would need moves (backed_fit_when_moving): 76 moves instead of 176
// over GPT-2's trace, same packing.
// What the moves cost: each is an unmap and a map (23 + 37 us on the H200) where a new
// slot is a create and a map (16.8 + 37 us), so moves pay off only for slots that are
// never needed again where they were. On GPT-2's trace the 76 moves save 11 slots at the
// peak (1.024 instead of 1.069 reserved per live byte) and cost 1.25x the no-release
// replay's time at those costs. The moves come while the working set grows over the
// first four steps, and most go back and forth as each step's large blocks land higher
// in the range: even a budget set by the trace's own final peak (moves only above 1.03x
// of it, an oracle) took 49 moves (1.16x), and so did choosing which free slot moves with
// the future known (the slot next touched last, Belady's rule, in a model of this
// placement): 55 moves for 250 slots, 49 for 251, 26 only at 252 (1.032). Fewer moves need
// a placement that keeps the large blocks where they were, not a different slack or pick.
//
// Note [Recycling free runs]
// The older alternative, off by default: with options.recycle_slack >= 0, before new
// slots are backed while reserved memory would exceed (1 + slack) x peak allocated,
// mapping runs lying wholly in free blocks are released to the backend first (only runs
// whose streams are known to be done with them, or the allocating stream's own, which
// is then synchronized). It packs like moving but costs a release and a create per run,
// which the replay's cost model charges like cudaFree + cudaMalloc.
// choose_fit's optional preference for backed blocks (prefer_backed_fit) keeps
// allocations out of released holes while backed free memory fits, so fewer runs bounce
// back and forth, at some cost in packing.
//
// Note [Unreleased handles]
// A run is unmapped before its physical handle goes back (release_cached, or a move or a
// new run whose map failed), and release_physical can fail after the unmap succeeded.
// Forgetting the handle then would leak its memory for the life of the process; keeping
// it in the run tables would map nothing at its address. So the handle goes to
// `unreleased`: it backs nothing of ours, so reserved memory and segments no longer
// count it (they count what backs the allocator's ranges), but the backend still holds
// it, and every release_cached (empty_cache, the OOM policy, release_stream) first
// retries those releases, as does the destructor. Each handle is listed once and leaves
// the list only when its release succeeded, so it is neither leaked nor released twice.
// Room in the list is reserved before the unmap, so listing it cannot fail. A handle that
// still will not go stops nothing else (review finding: its retry threw at the top of
// every release_cached, so one bad handle ended all giving back, the OOM policy's
// included): release_cached releases what it can and keeps the first error in
// release_error, which empty_cache reports and an OOM message counts.
//
// Note [Bookkeeping before backing]
// Memory the backend hands over must be recorded without fail: a segment missing from
// `segments`, a range missing from its stream's list or a run missing from mapped_runs
// is memory (or address space) that no empty_cache, no move and no destructor ever gives
// back, and whose bytes escape reserved memory and the memory-fraction accounting. So
// whatever can throw std::bad_alloc (the Segment, its run tables, its node in `segments`,
// room in the list, the run's entry in mapped_runs) is made before the backend call, and
// what follows the call cannot fail; a block is indexed in `blocks` before it is linked.
//
// Note [Failed backing]
// A block is backed slot by slot, and near the device's capacity or the process's limit a
// later slot can be refused after earlier ones were created. The request fails and the
// block goes back to its pool; the runs created for it would stay, backing free memory
// for a request that is not there (a too-large request retried in a loop would pin its
// size less one slot). So ensure_backed gives back the runs it created when it fails or
// throws: reserved memory is as it was. Runs moved in stay (a move changes no reserved
// byte), as do runs released for recycling (Note [Recycling free runs]).
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
  // Everything that can throw comes before the backend call (Note [Bookkeeping before
  // backing]).
  auto seg = std::make_unique<Segment>();
  seg->size = bytes;
  seg->expandable = expandable;
  seg->small = small;
  seg->creator = &sp;
  if (expandable) {
    const std::size_t granules = bytes / granule;
    // Small ranges hold at most a few MiB of small blocks: granule slots waste least.
    seg->slot_granules = small ? 1 : std::max<std::size_t>(1, options.map_slot_bytes / granule);
    seg->run_head.assign(granules, -1);
    seg->run_handle.assign(granules, PhysicalHandle{});
    seg->run_granules.assign(granules, 0);
    seg->slot_mapped.assign((granules + seg->slot_granules - 1) / seg->slot_granules, 0);
  }
  // The map node, made in a scratch map: inserting a node handle allocates nothing.
  decltype(segments) scratch;
  auto node = scratch.extract(scratch.emplace(nullptr, seg.get()).first);
  void* base = expandable ? backend->reserve_address(bytes) : backend->device_alloc(bytes);
  if (base == nullptr) return nullptr;
  seg->base = static_cast<char*>(base);
  seg->used_end = seg->base;
  node.key() = seg->base;
  segments.insert(std::move(node));
  if (!expandable) {
    seg->mapped_bytes = bytes;
    stats.reserved.add(bytes);
    stats.segments.add(1);
    // Note [Segment events]; a range's address space is no event
    segment_log.record(SegmentEvent::Kind::segment_allocated, base, bytes,
                       segment_stream(seg.get()));
  }
  return seg.release();
}

// Appends a free block of `bytes` at the segment's used end, owned by sp, into sp's pool,
// under `tag` (Note [Cached memory by tag]).
// A throw (std::bad_alloc) changes nothing: a last block missing from `blocks` or from
// the pool would be extended and handed out by the next grow, then refused by deallocate.
static Block* append_block(CachingAllocator::Impl& m, Segment* seg, StreamPools& sp,
                           std::size_t bytes, int tag) {
  Block* b = m.new_block();
  try {
    m.blocks.emplace(seg->used_end, b);  // indexed before it is linked
  } catch (...) {
    delete b;
    throw;
  }
  b->ptr = seg->used_end;
  b->size = bytes;
  b->tag = static_cast<std::uint8_t>(tag);
  b->segment = seg;
  b->owner = &sp;
  b->prev = seg->last;
  if (seg->last != nullptr)
    seg->last->next = b;
  else
    seg->first = b;
  seg->last = b;
  seg->used_end += bytes;
  try {
    // Nothing to merge with (grow extends a free last block of sp instead of appending),
    // so only the pool's insert can throw, with b not in the pool.
    m.insert_free(b, false);
  } catch (...) {
    seg->last = b->prev;
    if (b->prev != nullptr)
      b->prev->next = nullptr;
    else
      seg->first = nullptr;
    seg->used_end -= bytes;
    m.blocks.erase(b->ptr);
    delete b;
    throw;
  }
  return b;
}

// Note [Cached memory by tag]: a new plain segment is the request's (`tag`). On a range,
// grow only tiles address space, which the request's block backs once it is handed out
// (try_allocate moves tail_tag then); until then what grow tiled keeps the tag its backed
// memory had, so that a request that cannot be backed takes no tag's memory: an appended
// block takes the tag of the backed memory past the last block, when there is some, and
// an extended last block keeps its own.
Block* CachingAllocator::Impl::grow(StreamPools& sp, std::size_t size, bool small, int tag) {
  detail::BlockPool& pool = sp.pool(small);
  if (!options.expandable_segments) {
    Segment* seg = create_segment(sp, plain_segment_size(size), small, false);
    if (seg == nullptr) return nullptr;
    // Should the append throw, the segment stays, empty and cached under the request's
    // tag (its memory lies past used_end): release_cached gives it back.
    seg->tail_tag = static_cast<std::uint8_t>(tag);
    append_block(*this, seg, sp, seg->size, tag);
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
      if (!extend_last)
        return append_block(*this, seg, sp, need,
                            backed_past_used_end(seg) ? int{seg->tail_tag} : tag);
      pool.erase(last);
      last->size += need;
      seg->used_end += need;
      pool.insert(last);
      return last;
    }
  }
  // A new range for a request the device could never back would only pin address space.
  if (device_total != 0 && size > device_total) return nullptr;
  // Room in the list first (Note [Bookkeeping before backing]): a range no list holds would
  // never grow again, and keep its address space until the allocator is destroyed.
  ranges.reserve(ranges.size() + 1);
  Segment* seg = create_segment(sp, std::max(range_bytes, round_up(size, granule)), small, true);
  if (seg == nullptr) return nullptr;
  ranges.push_back(seg);
  // Should the append throw, the range stays, empty: the next grow appends to it.
  return append_block(*this, seg, sp, size, tag);
}

bool CachingAllocator::Impl::ensure_backed(Block* b) {
  Segment* seg = b->segment;
  if (!seg->expandable) return true;
  const std::size_t offset = static_cast<std::size_t>(b->ptr - seg->base);
  const std::size_t first = offset / granule;
  const std::size_t end = (offset + b->size + granule - 1) / granule;
  if (options.recycle_slack >= 0 && options.allow_release && !waits_forbidden &&
      futile_recycle_at != free_epoch &&
      stats.reserved.current - stats.allocated.current >= granule) {
    // Note [Recycling free runs]
    const std::size_t unbacked = unbacked_bytes(seg, b->ptr, b->ptr + b->size);
    const std::uint64_t budget = reserved_budget(b->size, options.recycle_slack);
    const std::uint64_t after = stats.reserved.current + unbacked;
    if (unbacked != 0 && after > budget &&
        release_cached(after - budget, false, b->owner) == 0 && !release_skipped_unsettled)
      futile_recycle_at = free_epoch;
  }
  // The runs this call creates, given back if it fails (Note [Failed backing]). Each holds
  // at least one granule of b that was unmapped, so there are at most end - first; room
  // is made before the first (no allocation when b is backed already).
  std::vector<std::size_t> created;
  // The peaks as they were: runs made for a request that then failed held memory for no
  // allocation, and a caught OOM must not leave max_memory_reserved near the device's
  // capacity (review finding; c10 counts a segment only once it is mapped whole).
  const std::uint64_t reserved_peak = stats.reserved.peak;
  const std::uint64_t segments_peak = stats.segments.peak;
  const auto give_back = [&]() noexcept {
    give_back_runs(seg, created);
    stats.reserved.peak = std::max(reserved_peak, stats.reserved.current);
    stats.segments.peak = std::max(segments_peak, stats.segments.current);
  };
  try {
    if (back_block(b, first, end, created)) return true;
  } catch (...) {
    give_back();
    throw;
  }
  give_back();
  return false;
}

bool CachingAllocator::Impl::back_block(Block* b, std::size_t first, std::size_t end,
                                        std::vector<std::size_t>& created) {
  Segment* seg = b->segment;
  // Note [Moving free runs]: moves start once new backing would take reserved memory
  // past (1 + move_slack) x the peak of allocated memory. Movable slots are looked for
  // once per call and slot length, and not at all while no free since a search for that
  // length found none could have made a slot wholly free (movable_epoch).
  const std::uint64_t move_above = reserved_budget(b->size, options.move_slack);
  std::size_t searched_length = 0;  // the slot length `movable` holds runs of
  std::vector<FreeRun> movable;
  const std::size_t per_slot = seg->slot_granules;
  for (std::size_t head = first / per_slot * per_slot; head < end; head += per_slot) {
    const std::size_t length = slot_length(seg, head);
    const std::size_t mapped = seg->slot_mapped[head / per_slot];
    if (mapped == length) continue;  // backed whole
    const std::size_t lo = std::max(head, first);
    const std::size_t hi = std::min(head + length, end);
    const bool empty = mapped == 0;  // no granule of the slot is mapped
    bool needed = empty;             // some granule under b is unmapped
    for (std::size_t g = lo; g < hi && !needed; ++g) needed = seg->run_head[g] < 0;
    if (!needed) continue;
    if (created.capacity() == 0) created.reserve(end - first);
    const std::size_t bytes = length * granule;
    const bool futile = futile_move_at == movable_epoch && futile_move_granules == length;
    if (empty && options.move_free_runs && stats.reserved.current + bytes > move_above &&
        (searched_length == length || !futile)) {
      if (searched_length != length) {
        searched_length = length;
        bool unsettled = false;
        movable = find_free_runs(*b->owner, length, unsettled);
        if (movable.empty() && !unsettled) {
          futile_move_at = movable_epoch;
          futile_move_granules = length;
        }
      }
      if (move_free_run(seg, head, length, movable, *b->owner)) continue;
    }
    // A block larger than the device or the process's share can be backed by moves alone:
    // the backend refuses the new run that would take what it holds past the limit, so
    // the runs made before it would be made for nothing (Note [OOM policy]).
    if (never_fits(b->size)) return false;
    // A whole slot refused (memory taken by another user since mem_info) may still leave
    // room for the granules b needs: try those before calling it out of memory.
    if (empty && whole_slot_affordable(bytes) && create_run(seg, head, length)) {
      created.push_back(head);
      continue;
    }
    // Near the device's capacity or limit (or in a slot already backed piecewise), back
    // only the granules b needs: a whole slot would pin memory no other request could use.
    for (std::size_t g = lo; g < hi;) {
      if (seg->run_head[g] >= 0) {
        ++g;
        continue;
      }
      std::size_t run_end = g;
      while (run_end < hi && seg->run_head[run_end] < 0) ++run_end;
      if (!create_run(seg, g, run_end - g)) return false;
      created.push_back(g);
      g = run_end;
    }
  }
  return true;
}

void CachingAllocator::Impl::give_back_runs(Segment* seg,
                                            const std::vector<std::size_t>& heads) noexcept {
  // Nothing used these runs (the block they back was never handed out), so no stream
  // needs waiting for.
  for (const std::size_t head : heads) {
    try {
      release_run(seg, head);
    } catch (...) {
      // The unmap (or room to list its handle) failed: the run stays mapped, counted and
      // free, cached memory that empty_cache retries. Or the release did: the handle is
      // listed for a retry (Note [Unreleased handles]).
    }
  }
}

std::uint64_t CachingAllocator::Impl::reserved_budget(std::size_t size, double slack) const {
  const double live_peak = static_cast<double>(
      std::max<std::uint64_t>(stats.allocated.peak, stats.allocated.current + size));
  return static_cast<std::uint64_t>(std::max(0.0, live_peak * (1.0 + slack)));
}

bool CachingAllocator::Impl::backing_needs_moves(const Segment* seg, const char* ptr,
                                                 std::size_t size) const {
  const std::size_t unbacked = unbacked_bytes(seg, ptr, ptr + size);
  return unbacked != 0 &&
         stats.reserved.current + unbacked > reserved_budget(size, options.move_slack);
}

bool CachingAllocator::Impl::whole_slot_affordable(std::size_t bytes) {
  // Headroom factor: a slot may be created whole while the device has at least this many
  // slots' worth free; below that, backing goes granule by granule.
  constexpr std::size_t kWholeSlotHeadroom = 4;
  std::size_t room = backend->mem_info().free_bytes;
  // A memory fraction (Backend::set_device_limit) lets create_physical grant less than
  // the device has free; mem_info does not know about it.
  const std::size_t limit = backend->device_limit();
  const std::size_t in_use = backend->device_bytes_in_use();
  room = std::min(room, limit > in_use ? limit - in_use : 0);
  return room / kWholeSlotHeadroom >= bytes;
}

bool CachingAllocator::Impl::create_run(Segment* seg, std::size_t head, std::size_t granules) {
  const std::size_t bytes = granules * granule;
  unreleased.reserve(unreleased.size() + 1);  // Note [Unreleased handles]
  const PhysicalHandle h = backend->create_physical(bytes, MemoryLocation::device);
  if (!h) return false;
  try {
    map_run(seg, head, granules, h);
  } catch (...) {
    try {
      release_unmapped(h, bytes);
    } catch (...) {  // kept for a retry; the map's error is the one to report
    }
    throw;
  }
  stats.reserved.add(bytes);
  stats.segments.add(1);
  return true;
}

void CachingAllocator::Impl::map_run(Segment* seg, std::size_t head, std::size_t granules,
                                     PhysicalHandle h) {
  const std::size_t bytes = granules * granule;
  // Listed before the map (Note [Bookkeeping before backing]).
  seg->mapped_runs.insert(static_cast<std::uint32_t>(head));
  try {
    backend->map(seg->base + head * granule, bytes, h);
  } catch (...) {
    seg->mapped_runs.erase(static_cast<std::uint32_t>(head));
    throw;
  }
  ++mapping.map_calls;
  for (std::size_t i = head; i < head + granules; ++i)
    seg->run_head[i] = static_cast<std::int32_t>(head);
  // A run never crosses a slot boundary: slots are backed whole or granule by granule.
  seg->slot_mapped[head / seg->slot_granules] += static_cast<std::uint32_t>(granules);
  seg->run_handle[head] = h;
  seg->run_granules[head] = static_cast<std::uint32_t>(granules);
  seg->mapped_bytes += bytes;
  segment_log.record(SegmentEvent::Kind::mapped, seg->base + head * granule, bytes,
                     segment_stream(seg));
}

PhysicalHandle CachingAllocator::Impl::unmap_run(Segment* seg, std::size_t head) {
  const std::size_t granules = seg->run_granules[head];
  const std::size_t bytes = granules * granule;
  backend->unmap(seg->base + head * granule, bytes);
  ++mapping.unmap_calls;
  const PhysicalHandle h = seg->run_handle[head];
  for (std::size_t i = head; i < head + granules; ++i) seg->run_head[i] = -1;
  seg->slot_mapped[head / seg->slot_granules] -= static_cast<std::uint32_t>(granules);
  seg->run_handle[head] = PhysicalHandle{};
  seg->run_granules[head] = 0;
  seg->mapped_runs.erase(static_cast<std::uint32_t>(head));
  seg->mapped_bytes -= bytes;
  segment_log.record(SegmentEvent::Kind::unmapped, seg->base + head * granule, bytes,
                     segment_stream(seg));
  return h;
}

std::size_t CachingAllocator::Impl::unbacked_bytes(const Segment* seg, const char* lo,
                                                   const char* hi) const {
  // As ensure_backed would back it: an empty slot whole, else its missing granules.
  const std::size_t per_slot = seg->slot_granules;
  const std::size_t first = static_cast<std::size_t>(lo - seg->base) / granule;
  const std::size_t end = (static_cast<std::size_t>(hi - seg->base) + granule - 1) / granule;
  std::size_t n = 0;
  for (std::size_t head = first / per_slot * per_slot; head < end; head += per_slot) {
    const std::size_t length = slot_length(seg, head);
    const std::size_t mapped = seg->slot_mapped[head / per_slot];
    if (mapped == length) continue;
    if (mapped == 0) {  // the slot overlaps [lo, hi), so some granule of it is missing
      n += length * granule;
      continue;
    }
    std::size_t missing = 0;
    for (std::size_t g = std::max(head, first); g < std::min(head + length, end); ++g)
      missing += seg->run_head[g] < 0 ? 1 : 0;
    n += missing * granule;
  }
  return n;
}

namespace {

// A piece of backed memory that is wholly free: a plain segment, or one mapping run.
struct Releasable {
  Segment* segment;
  std::size_t head;  // expandable: first granule of the run
  const char* lo;    // [lo, hi): its addresses
  const char* hi;
  Block* from;  // a block at or before the first one overlapping [lo, hi)
};

// True when every block overlapping [lo, hi) is free (not allocated, quick or pending)
// and, if `settled_only`, known to be finished with by its stream (its free is covered by
// a completed fence, Note [Cross-stream reuse]). `cursor` walks forward through the
// segment's blocks across successive calls.
// Blocks of `waitable` (the stream allocating now) qualify too: their stream is waited for.
// `only_owner`: every block must belong to that pool.
bool all_free(Block*& cursor, const char* lo, const char* hi, bool settled_only,
              const StreamPools* waitable = nullptr, const StreamPools* only_owner = nullptr) {
  while (cursor != nullptr && cursor->ptr + cursor->size <= lo) cursor = cursor->next;
  for (Block* b = cursor; b != nullptr && b->ptr < hi; b = b->next) {
    if (b->state != BlockState::free) return false;
    if (only_owner != nullptr && b->owner != only_owner) return false;
    if (settled_only && b->free_seq > b->owner->safe_seq && b->owner != waitable) return false;
  }
  // Granules past used_end hold no blocks; they are free by construction.
  return true;
}

}  // namespace

std::vector<CachingAllocator::Impl::FreeRun> CachingAllocator::Impl::find_free_runs(
    StreamPools& allocating, std::size_t granules, bool& unsettled) {
  unsettled = false;
  // Runs of other streams qualify once a completed fence covers their frees (no wait);
  // bring every stream's fence up to date first (at most one event per stream).
  for (auto& sp : streams) refresh_fence(*sp);
  std::vector<FreeRun> found;
  for (auto& [base, seg] : segments) {
    if (!seg->expandable || seg->mapped_runs.empty()) continue;
    if (seg->slot_granules < granules) continue;  // a small range: granule slots
    Block* cursor = seg->first;
    for (const std::uint32_t g : seg->mapped_runs) {
      if (seg->run_granules[g] != granules || g % seg->slot_granules != 0 ||
          slot_length(seg, g) != granules)
        continue;  // not a whole slot of that length
      const char* lo = seg->base + g * granule;
      const char* hi = lo + seg->run_granules[g] * granule;
      if (!all_free(cursor, lo, hi, false)) continue;
      if (!all_free(cursor, lo, hi, true, &allocating)) {
        // Free, but another stream may still use it: a later search may find it settled.
        unsettled = true;
        continue;
      }
      bool needs_sync = false;
      for (const Block* b = cursor; b != nullptr && b->ptr < hi; b = b->next)
        needs_sync = needs_sync || b->free_seq > b->owner->safe_seq;
      found.push_back({seg, g, granules, needs_sync});
    }
  }
  return found;
}

bool CachingAllocator::Impl::move_free_run(Segment* seg, std::size_t head,
                                           std::size_t granules, std::vector<FreeRun>& movable,
                                           StreamPools& allocating) {
  // A physical handle maps whole (Backend::map has no offset), so only a whole slot of
  // the same length fits. Among those, one that needs no stream synchronization, and
  // among those the one found last: scans go in address order, so that is the free slot
  // highest in its range, the least likely to be reused soon. A try_allocate takes none
  // that needs the synchronization.
  // Whether moving `r` must first wait for work the allocating stream queued before its
  // frees, which may still use the run's memory through the old addresses.
  const auto must_wait = [&](const FreeRun& r) {
    return r.needs_sync && allocating.free_seq > allocating.safe_seq;
  };
  std::size_t pick = movable.size();
  for (std::size_t i = movable.size(); i-- > 0;) {
    const FreeRun& r = movable[i];
    if (r.granules != granules) continue;
    if (waits_forbidden && must_wait(r)) continue;
    if (pick == movable.size()) pick = i;
    if (!r.needs_sync) {
      pick = i;
      break;
    }
  }
  if (pick == movable.size()) return false;
  const FreeRun run = movable[pick];
  movable.erase(movable.begin() + static_cast<std::ptrdiff_t>(pick));
  if (must_wait(run)) {
    backend->stream_synchronize(allocating.stream);
    allocating.safe_seq = allocating.free_seq;
    ++mapping.move_syncs;
  }
  unreleased.reserve(unreleased.size() + 1);  // Note [Unreleased handles]
  const PhysicalHandle h = unmap_run(run.segment, run.head);
  try {
    map_run(seg, head, run.granules, h);
  } catch (...) {
    // Put the memory back where it was; if even that fails, give it to the backend so
    // that nothing leaks and reserved stays true.
    try {
      map_run(run.segment, run.head, run.granules, h);
    } catch (...) {
      stats.reserved.sub(run.granules * granule);  // unmapped: not ours, whatever follows
      stats.segments.sub(1);
      try {
        release_unmapped(h, run.granules * granule);
      } catch (...) {  // kept for a retry; the first map's error is the one to report
      }
    }
    throw;
  }
  ++mapping.runs_moved;
  mapping.bytes_moved += run.granules * granule;
  return true;
}

std::size_t CachingAllocator::Impl::release_cached(std::size_t want, bool wait,
                                                   StreamPools* waitable,
                                                   const StreamPools* only_owner) {
  release_error = nullptr;
  release_skipped_unsettled = false;
  retry_unreleased();
  if (!options.allow_release) return 0;
  // Without waiting, only memory whose streams are known to be past the frees qualifies:
  // bring every stream's fence up to date first (records at most one event per stream).
  if (!wait)
    for (auto& sp : streams) refresh_fence(*sp);
  std::vector<Releasable> found;
  std::size_t found_bytes = 0;
  std::set<void*> streams_to_sync;
  // The streams of the blocks in a piece found. Released streams' blocks are settled and
  // their streams gone: nothing to wait for.
  const auto for_each_owner = [&](const Releasable& r, const auto& fn) {
    for (const Block* b = r.from; b != nullptr && b->ptr < r.hi; b = b->next)
      if (b->ptr + b->size > r.lo && b->owner != released.get()) fn(b->owner->stream.handle);
  };
  const auto note_owners = [&](const Releasable& r) {
    for_each_owner(r, [&](void* s) { streams_to_sync.insert(s); });
  };
  // Whether [lo, hi), which is not releasable now, would be once its streams are done.
  const auto free_but_unsettled = [&](Block* from, const char* lo, const char* hi) {
    return !wait && all_free(from, lo, hi, false, waitable, only_owner);
  };
  for (auto& [base, seg] : segments) {
    if (found_bytes >= want) break;
    if (!seg->expandable) {
      // Every block free (blocks of different streams do not merge, so there may be
      // several).
      Block* cursor = seg->first;
      if (all_free(cursor, seg->base, seg->base + seg->size, !wait, waitable, only_owner)) {
        found.push_back({seg, 0, seg->base, seg->base + seg->size, seg->first});
        found_bytes += seg->size;
        note_owners(found.back());
      } else if (free_but_unsettled(seg->first, seg->base, seg->base + seg->size)) {
        release_skipped_unsettled = true;
      }
      continue;
    }
    Block* cursor = seg->first;
    for (const std::uint32_t g : seg->mapped_runs) {
      if (found_bytes >= want) break;
      const char* lo = seg->base + g * granule;
      const char* hi = lo + seg->run_granules[g] * granule;
      Block* const from = cursor;
      if (!all_free(cursor, lo, hi, !wait, waitable, only_owner)) {
        if (free_but_unsettled(from, lo, hi)) release_skipped_unsettled = true;
        continue;
      }
      found.push_back({seg, g, lo, hi, cursor});
      found_bytes += seg->run_granules[g] * granule;
      note_owners(found.back());
    }
  }
  if (found.empty()) return 0;
  // Work queued before the frees may still touch the memory: wait for those streams
  // (when not waiting, every block found is already covered by a completed fence).
  // Note [A stream that cannot be waited for]
  // A stream the backend will not synchronize (destroyed behind record_stream's back, a
  // driver error) keeps only the memory its blocks are in: the rest goes back as usual,
  // and the first such error is kept in release_error, as a refused release is (Note
  // [Unreleased handles]). Throwing instead stopped every release at that one stream, the
  // OOM policy's included.
  std::set<void*> unsynced;
  const auto synchronize = [&](Stream s) {
    try {
      backend->stream_synchronize(s);
      return true;
    } catch (...) {
      if (!release_error) release_error = std::current_exception();
      unsynced.insert(s.handle);
      return false;
    }
  };
  if (wait) {
    for (void* s : streams_to_sync) synchronize(Stream{s});
  } else if (waitable != nullptr && streams_to_sync.count(waitable->stream.handle) != 0 &&
             waitable->free_seq > waitable->safe_seq) {
    if (synchronize(waitable->stream)) waitable->safe_seq = waitable->free_seq;
  }
  if (!unsynced.empty()) {
    std::erase_if(found, [&](const Releasable& r) {
      bool owned_by_unsynced = false;
      for_each_owner(r, [&](void* s) { owned_by_unsynced |= unsynced.count(s) != 0; });
      return owned_by_unsynced;
    });
  }
  unreleased.reserve(unreleased.size() + found.size());  // Note [Unreleased handles]
  std::size_t released_bytes = 0;
  for (const Releasable& r : found) {
    Segment* seg = r.segment;
    try {
      if (seg->expandable) {
        released_bytes += release_run(seg, r.head);
        continue;
      }
      // The backend first: if it fails, the segment and its free blocks stay as they were.
      backend->device_free(seg->base, seg->size);
    } catch (...) {
      if (!release_error) release_error = std::current_exception();
      continue;
    }
    for (Block* b = seg->first; b != nullptr;) {
      Block* next = b->next;
      b->owner->pool(seg->small).erase(b);
      blocks.erase(b->ptr);
      recycle(b);
      b = next;
    }
    segments.erase(seg->base);
    segment_log.record(SegmentEvent::Kind::segment_freed, seg->base, seg->size,
                       segment_stream(seg));
    stats.reserved.sub(seg->size);
    stats.segments.sub(1);
    released_bytes += seg->size;
    delete seg;
  }
  return released_bytes;
}

std::size_t CachingAllocator::Impl::release_run(Segment* seg, std::size_t head) {
  const std::size_t bytes = seg->run_granules[head] * granule;
  unreleased.reserve(unreleased.size() + 1);  // Note [Unreleased handles]
  // A failed unmap changes nothing. Once unmapped, the run backs nothing of ours: it
  // leaves the stats even if releasing its handle then fails (Note [Unreleased handles]).
  const PhysicalHandle h = unmap_run(seg, head);
  stats.reserved.sub(bytes);
  stats.segments.sub(1);
  release_unmapped(h, bytes);
  return bytes;
}

void CachingAllocator::Impl::release_unmapped(PhysicalHandle h, std::size_t bytes) {
  try {
    backend->release_physical(h, bytes);
  } catch (...) {
    unreleased.push_back({h, bytes});  // room reserved by the caller: cannot throw
    throw;
  }
}

void CachingAllocator::Impl::retry_unreleased() noexcept {
  std::erase_if(unreleased, [&](const std::pair<PhysicalHandle, std::size_t>& handle) {
    try {
      backend->release_physical(handle.first, handle.second);
      return true;
    } catch (...) {
      if (!release_error) release_error = std::current_exception();
      return false;
    }
  });
}

std::size_t CachingAllocator::Impl::drop_empty_released_ranges() {
  std::size_t dropped = 0;
  for (auto it = segments.begin(); it != segments.end();) {
    Segment* seg = it->second;
    Block* cursor = seg->first;
    // Only ranges a released stream created: a live stream's range stays on its list of
    // ranges to grow even when released blocks fill it. Its free blocks may be live
    // streams' (a block live at the release becomes the freeing stream's, and steal takes
    // released blocks): they go too (review finding: such a range stayed reserved for
    // good). Unbacked, they hold no memory, and what was unmapped was done with.
    if (!seg->expandable || seg->creator != released.get() || !seg->mapped_runs.empty() ||
        !all_free(cursor, seg->base, seg->used_end, false)) {
      ++it;
      continue;
    }
    backend->release_address(seg->base, seg->size);  // first: a throw changes nothing
    for (Block* b = seg->first; b != nullptr;) {
      Block* next = b->next;
      b->owner->pool(seg->small).erase(b);
      blocks.erase(b->ptr);
      recycle(b);
      b = next;
    }
    it = segments.erase(it);
    delete seg;
    ++dropped;
  }
  return dropped;
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
        for (const std::uint32_t g : seg->mapped_runs) {
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
  for (const auto& [h, bytes] : unreleased) {
    try {
      backend->release_physical(h, bytes);
    } catch (...) {
    }
  }
  unreleased.clear();
  for (auto& [ptr, b] : blocks) {
    give_back_events(b->pending_events);
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
