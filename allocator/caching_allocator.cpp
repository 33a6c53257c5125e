// The caching allocator's algorithm and its allocation path: free lists, best fit,
// growth and the OOM policy. The rest of CachingAllocator lives in:
//   frees.cpp           deallocate, record_stream's events and pending blocks, empty_cache
//   stream_ordering.cpp fences between streams, cross-stream reuse, release_stream
//   segments.cpp        getting memory from the backend and giving it back
//   snapshot.cpp        stats, queries, the OOM message and the JSON snapshot
//   thread_cache.cpp    per-thread caches of freed small blocks
//
// How it works, in eight points:
//  1. A request is rounded to 512 B (size_classes.h); <= 1 MiB goes to the small pool,
//     the rest to the large pool. Each stream has its own small and large pool.
//  2. A pool is a set of free blocks ordered by (size, address): best fit is one
//     lower_bound. The chosen block is split; the rest stays free in the pool.
//  3. A free coalesces the block with free neighbours of the same stream, so the pools
//     hold maximal free ranges. Freed small blocks first park in exact-size quick lists
//     (Note [Quick lists]).
//  4. No fit on the stream: take a free block another stream has finished with (Note
//     [Cross-stream reuse], stream_ordering.cpp); else grow: the stream's expandable
//     range gets longer (Note [Expandable segments]) or, with expandable segments off, a
//     new plain segment.
//     New backing is taken from free holes first by moving their mapping runs (Note
//     [Moving free runs], segments.cpp); optionally, holes are also released back to
//     the backend (Note [Recycling free runs]).
//  5. record_stream / a free on a foreign stream records events; the block waits in
//     `pending` until they complete (process_pending, at the next allocation).
//  6. Out of memory (Note [OOM policy]): wait for pending blocks, give every fully free
//     backed range back, retry; wait for the streams whose free blocks would serve it,
//     retry; then run the reclaim hooks with the lock released;
//     retry; then throw OutOfMemoryError with the per-tag breakdown.
//  7. Every block is in `blocks` by address, so a free is checked (unknown pointer,
//     double free, wrong size) before anything changes; so are its backend calls (Note
//     [Failed frees], frees.cpp).
//  8. One mutex guards the shared state; a shared-path call takes it once. Small blocks a
//     thread frees on their own stream park in that thread's cache, whose pairs take
//     only the cache's own, uncontended mutex (Note [Thread caches], thread_cache.cpp).
//
// Note [Quick lists]
// A cached alloc+free pair of one size would otherwise split a free block and merge it
// back each time. Freed small blocks of the allocating stream go to an exact-size LIFO
// (8 per size) instead, uncoalesced; an allocation of that size pops one. Whenever the
// pool misses, the stream's quick lists are flushed into the pool first, so parked
// blocks never cause growth.
//
// Note [OOM policy]
// reuse the cache (steps 2-4) -> free cached memory (pending events waited for, fully
// free ranges released unless options.allow_release is false, streams that last used
// them synchronized) -> retry -> wait for
// the streams whose free blocks would serve it (Note [Waiting for a stream before giving
// up]) -> retry -> reclaim
// hooks (no lock held: hooks free memory through this allocator) -> retry -> throw.
// A request the cache cannot serve and that is larger than the device, or than the
// process's share of it (the backend's device limit, a memory fraction), skips from the
// reuse straight to the throw: new backing for it would have to be held all at once, and
// the backend grants no more than the limit whatever is freed, so emptying the cache
// (which waits for streams) or evicting tiered state would cost without making room.
#include "allocator/caching_allocator.h"

#include <algorithm>
#include <new>
#include <string>
#include <utility>

#include "allocator/caching_allocator_impl.h"
#include "allocator/reclaim.h"
#include "allocator/size_classes.h"
#include "allocator/tags.h"
#include "allocator/thread_cache.h"

namespace tidepool {

using detail::Block;
using detail::BlockState;
using detail::StreamPools;

// ============================================================================ plumbing

CachingAllocator::Impl::Impl(std::unique_ptr<Backend> b, AllocatorOptions o)
    : backend(std::move(b)),
      options(o),
      released(std::make_unique<StreamPools>()),
      id(next_id()) {
  if (!backend) throw std::invalid_argument("tidepool: CachingAllocator needs a backend");
  released->safe_seq = UINT64_MAX;  // Note [Released streams]: no stream to wait for
  device = backend->device();
  granule = backend->granularity();
  device_total = backend->mem_info().total_bytes;
  range_bytes = options.expandable_range_bytes;
  // A range longer than the device could never be backed past the device's size; cut to
  // it, the rounding below cannot wrap (SIZE_MAX used to round to 0).
  if (range_bytes == 0 || (device_total != 0 && range_bytes > device_total))
    range_bytes = device_total;
  range_bytes = round_up(std::max(range_bytes, granule), granule);
  blocks.reserve(4096);
}

StreamPools& CachingAllocator::Impl::pools_for(Stream s) {
  if (last_stream != nullptr && last_stream->stream == s) return *last_stream;
  for (auto& p : streams)
    if (p->stream == s) return *(last_stream = p.get());
  streams.push_back(std::make_unique<StreamPools>());
  streams.back()->stream = s;
  return *(last_stream = streams.back().get());
}

Block* CachingAllocator::Impl::new_block() {
  if (spare_blocks.empty()) return new Block();
  Block* b = spare_blocks.back();
  spare_blocks.pop_back();
  return b;
}

void CachingAllocator::Impl::recycle(Block* b) {
  // Its pool node stays with it for the next block made (Note [Blocks carry their pool
  // node]).
  auto node = std::move(b->pool_node);
  *b = Block();
  b->pool_node = std::move(node);
  try {
    spare_blocks.push_back(b);
  } catch (...) {  // no heap to keep it for reuse: it is no one's any more
    delete b;
  }
}

void CachingAllocator::Impl::give_back_events(std::span<const Event> events) noexcept {
  try {
    spare_events.insert(spare_events.end(), events.begin(), events.end());
    return;
  } catch (const std::bad_alloc&) {
  }
  for (Event e : events) {
    try {
      backend->destroy_event(e);
    } catch (...) {
    }
  }
}

Event CachingAllocator::Impl::take_event() {
  if (spare_events.empty()) return backend->create_event();
  Event e = spare_events.back();
  spare_events.pop_back();
  return e;
}

// ============================================================================ free lists

void CachingAllocator::Impl::merge_into(Block* front, Block* back) {
  if (back->size > front->size) front->tag = back->tag;  // Note [Cached memory by tag]
  front->size += back->size;
  front->next = back->next;
  if (back->next != nullptr)
    back->next->prev = front;
  else
    front->segment->last = front;
  front->free_seq = std::max(front->free_seq, back->free_seq);
  blocks.erase(back->ptr);
  recycle(back);
}

// Puts `b` into its owner's pool, merged with free neighbours of the same owner.
// `is_new_free`: the owner just stopped using it (takes a new free sequence number).
void CachingAllocator::Impl::insert_free(Block* b, bool is_new_free) {
  StreamPools& owner = *b->owner;
  detail::BlockPool& pool = owner.pool(b->segment->small);
  // The only allocation, before anything changes; none for a block that holds its node
  // (Note [Blocks carry their pool node]), as every block handed out does.
  if (b->pool_node.empty()) b->pool_node = detail::BlockPool::make_node(b);
  b->state = BlockState::free;
  if (is_new_free) {
    b->free_seq = ++owner.free_seq;
    ++free_epoch;
  }
  auto mergeable = [&](const Block* n) {
    return n != nullptr && n->state == BlockState::free && n->owner == b->owner;
  };
  if (mergeable(b->prev)) {
    Block* prev = b->prev;
    pool.erase(prev);
    merge_into(prev, b);
    b = prev;
  }
  if (mergeable(b->next)) {
    pool.erase(b->next);
    merge_into(b, b->next);
  }
  if (is_new_free && b->segment->expandable) {
    const auto other_free = [&](const Block* n) {
      return n != nullptr && n->state == BlockState::free && n->owner != b->owner;
    };
    if (b->size >= shortest_slot(b->segment) * granule || b->next == nullptr ||
        other_free(b->prev) || other_free(b->next))
      ++movable_epoch;
  }
  pool.insert(b);
}

// Cuts the last `tail` bytes of b into a new block, which is returned allocated and in no
// pool; b keeps the front. Pre: b is in no pool, b->size - tail >= kMinBlockSize.
Block* CachingAllocator::Impl::carve_tail(Block* b, std::size_t tail) {
  Block* t = new_block();
  // Its pool node made and the block indexed before anything is linked or resized: a
  // heap that cannot give either (std::bad_alloc) leaves b as it was.
  try {
    if (t->pool_node.empty()) t->pool_node = detail::BlockPool::make_node(t);
    blocks.emplace(b->ptr + (b->size - tail), t);
  } catch (...) {
    delete t;
    throw;
  }
  t->size = tail;
  b->size -= tail;
  t->ptr = b->ptr + b->size;
  t->segment = b->segment;
  t->owner = b->owner;
  t->free_seq = b->free_seq;
  t->tag = b->tag;
  t->state = BlockState::allocated;
  t->prev = b;
  t->next = b->next;
  if (b->next != nullptr)
    b->next->prev = t;
  else
    b->segment->last = t;
  b->next = t;
  return t;
}

// Pre: b is allocated and in no pool. Returns what exceeds `size` to the free pool.
void CachingAllocator::Impl::split(Block* b, std::size_t size) {
  const std::size_t rest = b->size - size;
  if (rest < kMinBlockSize) return;
  insert_free(carve_tail(b, rest), false);
}

void CachingAllocator::Impl::flush_quick(StreamPools& sp) {
  sp.quick.drain([this](Block* b) { insert_free(b, true); });
}

void CachingAllocator::Impl::flush_all_quick() {
  for (auto& sp : streams) flush_quick(*sp);
}

// ============================================================================ allocate

// Best fit, except that on expandable segments a fit whose bytes are already backed may
// be preferred over one that would need new backing: always with prefer_backed_fit (Note
// [Recycling free runs]: among the smallest few fits), and with backed_fit_when_moving
// once backing would need moves (among the fits of the best fit's size). The first with
// a backed window at its start or its end wins; `at_end` says which end.
Block* CachingAllocator::Impl::choose_fit(detail::BlockPool& pool, std::size_t size,
                                          bool& at_end) const {
  constexpr int kCandidates = 32;
  at_end = false;
  Block* fallback = nullptr;
  int seen = 0;
  for (auto it = pool.lower_bound(size); it != pool.blocks().end() && seen < kCandidates;
       ++it, ++seen) {
    Block* c = *it;
    if (!c->segment->expandable) return c;
    if (fallback == nullptr) {
      // The best fit. Unless asked to always prefer backed fits, look further only when
      // backing it would need moves (Note [Moving free runs]), and then only at fits as
      // tight as it: its other end, or a free block of the same size. Looser fits would
      // save more moves but pack worse (GPT-2's trace: 1.028 instead of 1.024).
      if (!options.prefer_backed_fit &&
          !(options.move_free_runs && options.backed_fit_when_moving &&
            backing_needs_moves(c->segment, c->ptr, size)))
        return c;
      fallback = c;
    } else if (!options.prefer_backed_fit && c->size != fallback->size) {
      break;
    }
    if (unbacked_bytes(c->segment, c->ptr, c->ptr + size) == 0) return c;
    if (c->size - size >= kMinBlockSize &&
        unbacked_bytes(c->segment, c->ptr + c->size - size, c->ptr + c->size) == 0) {
      at_end = true;
      return c;
    }
  }
  return fallback;
}

Block* CachingAllocator::Impl::try_allocate(StreamPools& sp, std::size_t size, bool small,
                                           int tag) {
  detail::BlockPool& pool = sp.pool(small);
  bool at_end = false;
  Block* b = choose_fit(pool, size, at_end);
  if (b == nullptr && !sp.quick.empty()) {
    flush_quick(sp);
    b = choose_fit(pool, size, at_end);
  }
  if (b == nullptr) b = steal(sp, size, small);
  if (b == nullptr && drain_thread_caches() != 0) {
    // Blocks parked in thread caches never cause growth (Note [Thread caches]).
    b = choose_fit(pool, size, at_end);
    if (b == nullptr) b = steal(sp, size, small);
  }
  if (b == nullptr) b = grow(sp, size, small, tag);
  if (b == nullptr) return nullptr;
  pool.erase(b);
  b->state = BlockState::allocated;  // before splitting: the rest must not merge back
  if (at_end) {
    Block* t = nullptr;
    try {
      t = carve_tail(b, size);  // throws only with b unchanged
    } catch (...) {
      insert_free(b, false);
      throw;
    }
    insert_free(b, false);
    b = t;
  } else {
    try {
      split(b, size);
    } catch (...) {
      insert_free(b, false);  // whole again: a carved rest merges back
      throw;
    }
  }
  // Backed memory past the last block is the request's if backed for it now.
  Segment* const seg = b->segment;
  const bool tail_was_backed = backed_past_used_end(seg);
  // Back in its pool when it cannot be backed: the search for movable slots that backing
  // made ran while b was allocated, and b's own backed slots, wholly free again now, must
  // not stay hidden behind what that search found (movable_epoch).
  const auto back_to_the_pool = [&] {
    insert_free(b, false);
    if (seg->expandable) ++movable_epoch;
  };
  bool backed = false;
  try {
    backed = ensure_backed(b);
  } catch (...) {
    back_to_the_pool();
    throw;
  }
  if (!backed) {
    back_to_the_pool();
    return nullptr;
  }
  if (!tail_was_backed && backed_past_used_end(seg))
    seg->tail_tag = static_cast<std::uint8_t>(tag);
  return b;
}

// try_allocate, and when that fails: wait for pending blocks, give every fully free
// backed range back and try once more; then wait for the streams whose free blocks
// would serve the request and try again (steps 1-2 of Note [OOM policy]).
Block* CachingAllocator::Impl::try_allocate_releasing(StreamPools& sp, std::size_t size,
                                                      bool small, int tag) {
  if (Block* b = try_allocate(sp, size, small, tag)) return b;
  if (never_fits(size)) return nullptr;  // Note [OOM policy]
  drain_thread_caches();
  flush_all_quick();
  process_pending(true);
  // Without release (the replay's baseline) the waits above and below still make free
  // memory usable; only giving it back is left out (review finding: all were skipped).
  if (options.allow_release) release_cached();
  if (Block* b = try_allocate(sp, size, small, tag)) return b;
  if (!settle_streams_with_room(sp, size, small)) return nullptr;
  return try_allocate(sp, size, small, tag);
}

// Note [Waiting for a stream before giving up]: a free block of another stream that would
// serve the request, freed after the last fence that stream was seen past (its work
// before the free may still be queued), is neither stolen (steal needs the fence) nor
// released (its segment or slot still holds live blocks). Without waiting for that stream
// the request failed with OutOfMemoryError while the memory it needed was free, only
// not yet known to be done with; c10 synchronizes before giving up too. Only the streams
// with such a block are waited for; a stream that cannot be waited for (destroyed without
// release_stream) is passed over: its blocks wait for release_stream, as before.
bool CachingAllocator::Impl::settle_streams_with_room(StreamPools& sp, std::size_t size,
                                                      bool small) {
  bool settled = false;
  for (auto& other : streams) {
    if (other.get() == &sp || other->free_seq <= other->safe_seq) continue;
    if (other->pool(small).best_fit(size) == nullptr) continue;
    try {
      backend->stream_synchronize(other->stream);
    } catch (const BackendError&) {
      continue;
    }
    other->safe_seq = other->free_seq;
    settled = true;
  }
  return settled;
}

bool CachingAllocator::Impl::never_fits(std::size_t size) const {
  return (device_total != 0 && size > device_total) || size > backend->device_limit();
}

void* CachingAllocator::Impl::finish_allocation(Block* b, std::size_t bytes, int tag) {
  b->state = BlockState::allocated;
  b->requested = bytes;
  b->tag = static_cast<std::uint8_t>(tag);
  stats.allocated.add(b->size);
  stats.requested.add(bytes);
  stats.allocations.add(1);
  TagStats& t = stats.tags[tag];
  t.bytes.add(b->size);
  ++t.count;
  ++t.total_count;
  return b->ptr;
}

CachingAllocator::CachingAllocator(std::unique_ptr<Backend> backend, AllocatorOptions options)
    : impl_(std::make_unique<Impl>(std::move(backend), options)) {}

CachingAllocator::~CachingAllocator() {
  impl_->detach_thread_caches();
  impl_->destroy_everything();
}

namespace {

void check_plausible(std::size_t bytes, int device) {
  if (bytes > kMaxRequest) {
    throw AllocatorUsageError("tidepool: allocation of " + std::to_string(bytes) +
                              " bytes on device " + std::to_string(device) +
                              " is not a plausible size (limit 2^50; a negative size cast "
                              "to unsigned?)");
  }
}

}  // namespace

void* CachingAllocator::Impl::allocate_locked(std::size_t bytes, std::size_t size, bool small,
                                              int tag, detail::ThreadCache* tc, Stream stream,
                                              bool releasing) {
  if (!pending.empty()) process_pending(false);
  StreamPools& sp = pools_for(stream);
  if (small && options.quick_lists) {
    if (Block* b = sp.quick.pop(size)) {
      ++stats.cache_hits;
      return finish_shared_allocation(b, bytes, tag, tc);
    }
  }
  const std::uint64_t acquired_before = stats.segments.allocated;
  Block* b = releasing ? try_allocate_releasing(sp, size, small, tag)
                       : try_allocate(sp, size, small, tag);
  if (b == nullptr) return nullptr;
  ++(stats.segments.allocated == acquired_before ? stats.cache_hits : stats.cache_misses);
  return finish_shared_allocation(b, bytes, tag, tc);
}

namespace {

// allocate (may_free) and try_allocate: without may_free, nullptr as soon as neither the
// caches nor a new segment serve, before the OOM policy would free anything (Note [OOM
// policy]).
void* allocate_on(CachingAllocator::Impl& m, std::size_t bytes, Stream stream, bool may_free) {
  if (bytes == 0) return nullptr;
  check_plausible(bytes, m.device);
  const std::size_t size = round_request(bytes);
  const bool small = is_small(size);
  const int tag = current_tag();
  detail::ThreadCache* tc = m.find_thread_cache();
  if (small && tc != nullptr && tc->may_have(small_class(size))) {
    // Fast path (Note [Thread caches]): a block this thread freed on `stream`. A class the
    // cache holds no block of goes straight to the shared path, without the cache lock.
    std::lock_guard cache_lock(tc->mutex);
    if (Block* b = tc->pop(stream, size)) {
      tc->note_alloc(b, bytes, tag);
      return b->ptr;
    }
  }
  {
    std::lock_guard lock(m.mutex);
    // try_allocate waits for nothing (a tiered store's prefetch calls it holding its lock).
    m.waits_forbidden = !may_free;
    struct ResetOnExit {
      bool& flag;
      ~ResetOnExit() { flag = false; }
    } const reset{m.waits_forbidden};
    if (void* p = m.allocate_locked(bytes, size, small, tag, tc, stream, may_free)) return p;
    if (!may_free) return nullptr;
    // A request that can never fit fails at once, the cache kept (try_allocate_releasing
    // released nothing for it), no hook asked to evict state (Note [OOM policy]).
    if (m.never_fits(size)) {
      const auto cache_locks = m.lock_thread_caches();
      m.fold_locked_thread_caches();
      ++m.stats.oom_count;
      throw OutOfMemoryError(m.oom_message(bytes, size, stream, 0, 0));
    }
  }
  // Reclaim hooks run without the lock: they free memory through this allocator.
  const detail::ReclaimResult reclaimed = detail::run_reclaim_hooks(m.device, size);
  std::string message;
  {
    std::lock_guard lock(m.mutex);
    m.stats.reclaim_calls += reclaimed.calls;
    m.stats.reclaimed_bytes += reclaimed.bytes;
    const std::uint64_t acquired_before = m.stats.segments.allocated;
    if (Block* b = m.try_allocate_releasing(m.pools_for(stream), size, small, tag)) {
      // Served from what the hooks freed into the cache is a hit (review finding).
      ++(m.stats.segments.allocated == acquired_before ? m.stats.cache_hits
                                                       : m.stats.cache_misses);
      return m.finish_shared_allocation(b, bytes, tag, tc);
    }
    const auto cache_locks = m.lock_thread_caches();
    m.fold_locked_thread_caches();
    ++m.stats.oom_count;
    message = m.oom_message(bytes, size, stream, reclaimed.calls, reclaimed.bytes);
  }
  throw OutOfMemoryError(std::move(message));
}

}  // namespace

void* CachingAllocator::allocate(std::size_t bytes, Stream stream) {
  return allocate_on(*impl_, bytes, stream, /*may_free=*/true);
}

void* CachingAllocator::try_allocate(std::size_t bytes, Stream stream) {
  return allocate_on(*impl_, bytes, stream, /*may_free=*/false);
}

}  // namespace tidepool
