// The caching allocator's algorithm: allocation, free, stream ordering and the OOM policy.
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
//     [Cross-stream reuse]); else grow: the stream's expandable range gets longer (Note
//     [Expandable segments]) or, with expandable segments off, a new plain segment.
//     New backing is taken from free holes first by moving their mapping runs (Note
//     [Moving free runs], segments.cpp); optionally, holes are also released back to
//     the backend (Note [Recycling free runs]).
//  5. record_stream / a free on a foreign stream records events; the block waits in
//     `pending` until they complete (process_pending, at the next allocation).
//  6. Out of memory (Note [OOM policy]): wait for pending blocks, give every fully free
//     backed range back, retry; then run the reclaim hooks with the lock released;
//     retry; then throw OutOfMemoryError with the per-tag breakdown.
//  7. Every block is in `blocks` by address, so a free is checked (unknown pointer,
//     double free, wrong size) before anything changes; so are its backend calls (Note
//     [Failed frees]).
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
// Note [Cross-stream reuse]
// A block freed on stream A may still be read by work A has queued. Stream B may use it
// only after an event recorded on A after the free has completed. Recording an event on
// every free would cost more than the rest of the free, so fences are lazy: each free
// into A's pools takes a sequence number; when B looks for memory in A's pools, A gets
// one fence event (if none is in flight) covering every free so far, and once it has
// completed, blocks with a sequence number up to the fence's are safe for B. The event
// is recorded no earlier than any free it covers, so this is conservative.
//
// Note [Released streams]
// A stream's pools, fence and thread-cache lists all name its handle, and a backend may
// give a later stream the same handle. So before a stream is destroyed it is released
// (release_stream, Note [Stream contract]): the allocator waits for the stream, moves
// its thread-cached and quick-listed blocks into its pools, and then moves every block
// the stream owns (free, pending, live) to one pool of no stream, `released`, and forgets
// the stream. The stream's work is done, so released free blocks are safe for any stream
// at once: steal() takes them before any other stream's, with no fence. Released memory
// lying wholly in free released blocks goes back to the backend at once (plain segments,
// mapping runs), and released expandable ranges that end up unbacked and empty give
// their address space back, so creating and destroying streams (one per tiered store)
// does not pile up reservations. A block still live at the release is freed later on any
// live stream X, as the contract already says for a free on a foreign stream, with the
// allocating stream's part done: it becomes X's block, freed on X. Recorded uses by the
// released stream are dropped from live blocks (that stream has finished them); pending
// blocks keep their events, which name events, not streams.
//
// Note [OOM policy]
// reuse the cache (steps 2-4) -> free cached memory (pending events waited for, fully
// free ranges released, streams that last used them synchronized) -> retry -> reclaim
// hooks (no lock held: hooks free memory through this allocator) -> retry -> throw.
#include "allocator/caching_allocator.h"

#include <algorithm>
#include <cstdio>
#include <sstream>

#include "allocator/caching_allocator_impl.h"
#include "allocator/config.h"
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
  if (range_bytes == 0) range_bytes = device_total;
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
  *b = Block();
  spare_blocks.push_back(b);
}

Event CachingAllocator::Impl::take_event() {
  if (spare_events.empty()) return backend->create_event();
  Event e = spare_events.back();
  spare_events.pop_back();
  return e;
}

// ============================================================================ free lists

void CachingAllocator::Impl::merge_into(Block* front, Block* back) {
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
  b->state = BlockState::free;
  if (is_new_free) b->free_seq = ++owner.free_seq;
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
  pool.insert(b);
}

// Cuts the last `tail` bytes of b into a new block, which is returned allocated and in no
// pool; b keeps the front. Pre: b is in no pool, b->size - tail >= kMinBlockSize.
Block* CachingAllocator::Impl::carve_tail(Block* b, std::size_t tail) {
  Block* t = new_block();
  t->size = tail;
  b->size -= tail;
  t->ptr = b->ptr + b->size;
  t->segment = b->segment;
  t->owner = b->owner;
  t->free_seq = b->free_seq;
  t->state = BlockState::allocated;
  t->prev = b;
  t->next = b->next;
  if (b->next != nullptr)
    b->next->prev = t;
  else
    b->segment->last = t;
  b->next = t;
  blocks.emplace(t->ptr, t);
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

// ============================================================================ streams

void CachingAllocator::Impl::refresh_fence(StreamPools& sp) {
  if (sp.fence_in_flight && backend->event_query(sp.fence)) {
    sp.safe_seq = sp.fence_seq;
    sp.fence_in_flight = false;
  }
  if (!sp.fence_in_flight && sp.free_seq > sp.safe_seq) {
    if (!sp.fence) sp.fence = backend->create_event();
    backend->record_event(sp.fence, sp.stream);
    sp.fence_seq = sp.free_seq;
    sp.fence_in_flight = true;
    if (backend->event_query(sp.fence)) {  // the stream may be idle already
      sp.safe_seq = sp.fence_seq;
      sp.fence_in_flight = false;
    }
  }
}

// Takes a free block of at least `size` that another stream has finished with, moves it
// into sp's pool and returns the (possibly merged) block now there.
// Released streams' blocks first: they need no fence (Note [Released streams]).
Block* CachingAllocator::Impl::steal(StreamPools& sp, std::size_t size, bool small) {
  StreamPools* from = released.get();
  Block* b = released->pool(small).best_fit(size);
  for (auto& other : streams) {
    if (b != nullptr) break;
    if (other.get() == &sp || other->pool(small).empty()) continue;
    refresh_fence(*other);
    b = other->pool(small).best_fit_freed_before(size, other->safe_seq);
    from = other.get();
  }
  if (b != nullptr) {
    from->pool(small).erase(b);
    b->owner = &sp;
    b->free_seq = 0;
    ++stats.cross_stream_reuses;
    insert_free(b, false);
    return sp.pool(small).best_fit(size);
  }
  return nullptr;
}

void CachingAllocator::Impl::retire_pools(StreamPools& sp) {
  StreamPools* const to = released.get();
  // Free blocks merge with released neighbours; collected first, as merging recycles.
  std::vector<Block*> free_blocks(sp.small.blocks().begin(), sp.small.blocks().end());
  free_blocks.insert(free_blocks.end(), sp.large.blocks().begin(), sp.large.blocks().end());
  for (Block* b : free_blocks) {
    sp.pool(b->segment->small).erase(b);
    b->owner = to;
    b->free_seq = 0;
    insert_free(b, false);
  }
  // Live and pending blocks: their later free or completion lands in `released`.
  for (auto& [ptr, b] : blocks)
    if (b->owner == &sp) b->owner = to;
  for (auto& [base, seg] : segments)
    if (seg->creator == &sp) seg->creator = to;
  sp.small_ranges.clear();
  sp.large_ranges.clear();
  if (sp.fence) {
    spare_events.push_back(sp.fence);  // the stream was synchronized: the fence is done
    sp.fence = Event{};
  }
  sp.fence_in_flight = false;
}

std::size_t CachingAllocator::Impl::release_stream_locked(Stream s) {
  // Work queued on s may still use its blocks: wait first (a stream destroyed already
  // fails here, before anything changed).
  backend->stream_synchronize(s);
  // Blocks parked for s in thread caches and quick lists back into s's pools.
  for (auto& c : thread_caches) {
    c->fold_into(stats);
    c->drain_stream(s, [&](Block* b) {
      release_held(*c, b);
      insert_free(b, true);
    });
  }
  auto it = std::find_if(streams.begin(), streams.end(),
                         [&](const std::unique_ptr<StreamPools>& p) { return p->stream == s; });
  // s has finished the uses record_stream named on other streams' blocks.
  for (auto& [ptr, b] : blocks)
    if (!b->extra_streams.empty()) std::erase(b->extra_streams, s);
  if (it == streams.end()) return 0;
  StreamPools& sp = **it;
  flush_quick(sp);
  retire_pools(sp);
  if (last_stream == &sp) last_stream = nullptr;
  streams.erase(it);
  if (!options.allow_release) return 0;
  const std::size_t bytes = release_cached(SIZE_MAX, true, nullptr, released.get());
  drop_empty_released_ranges();
  return bytes;
}

std::vector<Event> CachingAllocator::Impl::record_free_events(const Block& b, Stream freeing,
                                                             bool foreign) {
  std::vector<Event> events;
  events.reserve(b.extra_streams.size() + 1);
  auto record = [&](Stream s) {
    events.push_back(take_event());  // reserved: cannot throw, so no event is lost
    backend->record_event(events.back(), s);
  };
  try {
    for (Stream s : b.extra_streams) record(s);
    if (foreign) record(freeing);
  } catch (const BackendError& e) {
    // Recorded or not, the events are valid and unused: spares, as if never taken.
    spare_events.insert(spare_events.end(), events.begin(), events.end());
    synchronize_instead_of_events(b, e);
    return {};
  } catch (...) {
    spare_events.insert(spare_events.end(), events.begin(), events.end());
    throw;
  }
  return events;
}

// Note [Free after a lost stream]
// record_stream named a stream that was destroyed since without release_stream (PyTorch's
// Tensor.record_stream on a side stream that goes away: nothing in PyTorch releases it),
// so recording the free's event on it fails. Failing the free would lose the block for
// good, as every retry fails the same way, and PyTorch frees from destructors where an
// error cannot be handled. Freeing it at once is unsafe: cudaStreamDestroy returns while
// work queued on the stream may still run and use the block. A device synchronization
// waits for that work too (it covers every stream of the device, destroyed or not), and
// for every other stream that used the block, so after it the block needs no event at
// all: it is freed as if no other stream had used it. Slow, so said once per allocator
// (unless tidepool.log:off) and counted (AllocatorStats::free_device_syncs). If the
// synchronization fails as well (a sticky device error), the free fails as in Note
// [Failed frees]: the block stays allocated, nothing changed.
void CachingAllocator::Impl::synchronize_instead_of_events(const Block& b,
                                                          const BackendError& record_error) {
  try {
    backend->device_synchronize();
  } catch (const BackendError& e) {
    std::ostringstream os;
    os << "tidepool: free of " << static_cast<const void*>(b.ptr) << " (" << b.requested
       << " bytes) on device " << device << " failed, the block is still allocated: "
       << "recording an event on a stream that used it failed: " << record_error.what()
       << "; synchronizing the device instead failed too: " << e.what();
    throw BackendError(os.str());
  }
  ++stats.free_device_syncs;
  if (warned_free_sync || active_config().log == LogLevel::off) return;
  warned_free_sync = true;
  std::fprintf(stderr,
               "tidepool: a free on device %d could not record an event on a stream that used "
               "the block (%s); it synchronized the whole device instead, which is slow. A "
               "stream given to record_stream was probably destroyed without release_stream "
               "(tidepool_release_stream) first. Said once per allocator; "
               "AllocatorStats::free_device_syncs counts them.\n",
               device, record_error.what());
}

// An event query or wait may throw (a driver error). The first loop only asks the
// backend, moving each finished block to the front of `pending` by swaps, so a throw
// leaves the same blocks pending, none lost or doubled, none changed. The second loop,
// which frees them, makes no backend call.
void CachingAllocator::Impl::process_pending(bool wait) {
  std::size_t finished = 0;
  for (std::size_t i = 0; i < pending.size(); ++i) {
    bool done = true;
    for (Event e : pending[i]->pending_events) {
      if (wait) {
        backend->event_synchronize(e);
      } else if (!backend->event_query(e)) {
        done = false;
        break;
      }
    }
    if (done) std::swap(pending[finished++], pending[i]);
  }
  for (std::size_t i = 0; i < finished; ++i) {
    Block* b = pending[i];
    spare_events.insert(spare_events.end(), b->pending_events.begin(), b->pending_events.end());
    b->pending_events.clear();
    insert_free(b, true);
  }
  pending.erase(pending.begin(), pending.begin() + static_cast<std::ptrdiff_t>(finished));
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

Block* CachingAllocator::Impl::try_allocate(StreamPools& sp, std::size_t size, bool small) {
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
  if (b == nullptr) b = grow(sp, size, small);
  if (b == nullptr) return nullptr;
  pool.erase(b);
  b->state = BlockState::allocated;  // before splitting: the rest must not merge back
  if (at_end) {
    Block* t = carve_tail(b, size);
    insert_free(b, false);
    b = t;
  } else {
    split(b, size);
  }
  bool backed = false;
  try {
    backed = ensure_backed(b);
  } catch (...) {
    insert_free(b, false);
    throw;
  }
  if (!backed) {
    insert_free(b, false);
    return nullptr;
  }
  return b;
}

// try_allocate, and when that fails: wait for pending blocks, give every fully free
// backed range back and try once more (steps 1-2 of Note [OOM policy]).
Block* CachingAllocator::Impl::try_allocate_releasing(StreamPools& sp, std::size_t size,
                                                      bool small) {
  if (Block* b = try_allocate(sp, size, small)) return b;
  if (!options.allow_release) return nullptr;
  drain_thread_caches();
  flush_all_quick();
  process_pending(true);
  release_cached();
  return try_allocate(sp, size, small);
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

void* CachingAllocator::allocate(std::size_t bytes, Stream stream) {
  if (bytes == 0) return nullptr;
  if (bytes > kMaxRequest) {
    throw AllocatorUsageError("tidepool: allocation of " + std::to_string(bytes) +
                              " bytes on device " + std::to_string(impl_->device) +
                              " is not a plausible size (limit 2^50; a negative size cast "
                              "to unsigned?)");
  }
  Impl& m = *impl_;
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
    if (!m.pending.empty()) m.process_pending(false);
    StreamPools& sp = m.pools_for(stream);
    if (small && m.options.quick_lists) {
      if (Block* b = sp.quick.pop(size)) {
        ++m.stats.cache_hits;
        return m.finish_shared_allocation(b, bytes, tag, tc);
      }
    }
    const std::uint64_t acquired_before = m.stats.segments.allocated;
    if (Block* b = m.try_allocate_releasing(sp, size, small)) {
      ++(m.stats.segments.allocated == acquired_before ? m.stats.cache_hits
                                                       : m.stats.cache_misses);
      return m.finish_shared_allocation(b, bytes, tag, tc);
    }
  }
  // A request larger than the whole device can never be met: fail at once instead of
  // asking the reclaim hooks to evict state that could not make room anyway.
  if (m.device_total != 0 && size > m.device_total) {
    std::lock_guard lock(m.mutex);
    const auto cache_locks = m.lock_thread_caches();
    m.fold_locked_thread_caches();
    ++m.stats.oom_count;
    throw OutOfMemoryError(m.oom_message(bytes, size, stream, 0, 0));
  }
  // Reclaim hooks run without the lock: they free memory through this allocator.
  const detail::ReclaimResult reclaimed = detail::run_reclaim_hooks(m.device, size);
  std::string message;
  {
    std::lock_guard lock(m.mutex);
    m.stats.reclaim_calls += reclaimed.calls;
    m.stats.reclaimed_bytes += reclaimed.bytes;
    if (Block* b = m.try_allocate_releasing(m.pools_for(stream), size, small)) {
      ++m.stats.cache_misses;
      return m.finish_shared_allocation(b, bytes, tag, tc);
    }
    const auto cache_locks = m.lock_thread_caches();
    m.fold_locked_thread_caches();
    ++m.stats.oom_count;
    message = m.oom_message(bytes, size, stream, reclaimed.calls, reclaimed.bytes);
  }
  throw OutOfMemoryError(std::move(message));
}

// ============================================================================ free

std::string CachingAllocator::Impl::describe_bad_free(const void* ptr, std::size_t bytes) const {
  std::ostringstream os;
  os << "tidepool: invalid free of " << ptr << " (" << bytes << " bytes) on device " << device
     << ": ";
  auto it = blocks.find(ptr);
  if (it != blocks.end()) {
    os << "double free (the block is already free)";
    return os.str();
  }
  auto seg = segments.upper_bound(static_cast<const char*>(ptr));
  if (seg != segments.begin()) {
    --seg;
    const Segment* s = seg->second;
    if (static_cast<const char*>(ptr) < s->base + s->size) {
      os << "the pointer lies inside a tidepool segment but is not the start of a live "
            "allocation (double free, or a pointer into the middle of a block)";
      return os.str();
    }
  }
  os << "this allocator never handed out that pointer (another allocator's memory, or a "
        "wrong device)";
  return os.str();
}

std::string CachingAllocator::Impl::describe_double_free(const void* ptr,
                                                         std::size_t bytes) const {
  std::ostringstream os;
  os << "tidepool: invalid free of " << ptr << " (" << bytes << " bytes) on device " << device
     << ": double free (the block is already free)";
  return os.str();
}

std::string CachingAllocator::Impl::describe_wrong_size(const void* ptr, std::size_t bytes,
                                                        std::size_t requested) const {
  return "tidepool: free of " + std::to_string(bytes) + " bytes at " +
         std::to_string(reinterpret_cast<std::uintptr_t>(ptr)) + " on device " +
         std::to_string(device) + ", but that allocation has " + std::to_string(requested) +
         " bytes; the block was not freed";
}

// Note [Failed frees]
// A free of a block other streams used records an event on each, which can fail (a
// stream given to record_stream destroyed since, a driver error); it then synchronizes
// the device instead (Note [Free after a lost stream]), which can fail too. So a free
// makes its backend calls first, then changes the block, its hold, its owner and the
// stats: a failed free leaves the allocator as it was, the block allocated, and may be
// retried.
void CachingAllocator::deallocate(void* ptr, std::size_t bytes, Stream stream) {
  if (ptr == nullptr) return;
  Impl& m = *impl_;
  detail::ThreadCache* const tc = m.find_thread_cache();
  if (tc != nullptr && tc->holds_any()) {
    // Fast path (Note [Thread caches]): a block this thread's cache holds, freed on its
    // own stream with no other stream recorded, parks in the cache. A cache holding no
    // block cannot hold ptr: the shared path, without the cache lock.
    std::lock_guard cache_lock(tc->mutex);
    if (Block* b = tc->held.find(ptr)) {
      if (b->in_thread_cache) throw AllocatorUsageError(m.describe_double_free(ptr, bytes));
      if (bytes != b->requested)
        throw AllocatorUsageError(m.describe_wrong_size(ptr, bytes, b->requested));
      if (tc->parking() && b->owner != m.released.get() && stream == b->owner->stream &&
          b->extra_streams.empty() && tc->push(b, stream, m.options.thread_cache_bytes)) {
        tc->note_free(b);
        return;
      }
    }
  }
  std::lock_guard lock(m.mutex);
  // As in finish_shared_allocation, this thread's fast-path deltas first: a peak reached
  // with them must count before this free lowers the shared value (Note [Thread caches]).
  if (tc != nullptr && tc->is_dirty()) {
    std::lock_guard cache_lock(tc->mutex);
    tc->fold_into(m.stats);
  }
  auto it = m.blocks.find(ptr);
  if (it == m.blocks.end() || it->second->state != BlockState::allocated)
    throw AllocatorUsageError(m.describe_bad_free(ptr, bytes));
  Block* b = it->second;
  // A held block's fields are its holder's until the hold ends below.
  std::unique_lock<detail::SpinLock> holder_lock;
  if (b->holder != nullptr) {
    holder_lock = std::unique_lock(b->holder->mutex);
    if (b->in_thread_cache) throw AllocatorUsageError(m.describe_double_free(ptr, bytes));
  }
  if (bytes != b->requested)
    throw AllocatorUsageError(m.describe_wrong_size(ptr, bytes, b->requested));
  // Allocated on a stream released since: it becomes a block of the freeing stream, freed
  // on it (Note [Released streams]).
  StreamPools& owner = b->owner == m.released.get() ? m.pools_for(stream) : *b->owner;
  const bool foreign =
      !(stream == owner.stream) &&
      std::find(b->extra_streams.begin(), b->extra_streams.end(), stream) == b->extra_streams.end();
  // Note [Failed frees]: the backend calls, then nothing that can fail.
  std::vector<Event> events;
  if (foreign || !b->extra_streams.empty()) {
    m.pending.reserve(m.pending.size() + 1);
    events = m.record_free_events(*b, stream, foreign);
  }
  if (detail::ThreadCache* holder = b->holder) {
    holder->fold_into(m.stats);  // the allocation may be counted in its deltas
    Impl::release_held(*holder, b);
  }
  b->owner = &owner;
  m.stats.allocated.sub(b->size);
  m.stats.requested.sub(b->requested);
  m.stats.allocations.sub(1);
  TagStats& t = m.stats.tags[b->tag];
  t.bytes.sub(b->size);
  --t.count;
  b->extra_streams.clear();  // covered by the events, or by a device synchronization
  if (!events.empty()) {  // it waits in `pending` until they complete
    b->pending_events = std::move(events);
    b->state = BlockState::pending;
    m.pending.push_back(b);  // capacity reserved above
    return;
  }
  if (b->segment->small && m.options.quick_lists) {
    b->state = BlockState::quick;
    if (b->owner->quick.push(b)) return;
  }
  m.insert_free(b, true);
}

void CachingAllocator::record_stream(void* ptr, Stream stream) {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  auto it = m.blocks.find(ptr);
  if (it == m.blocks.end() || it->second->state != BlockState::allocated) {
    std::ostringstream os;
    os << "tidepool: record_stream on " << ptr << " (device " << m.device
       << "), which is not a live allocation of this allocator";
    throw AllocatorUsageError(os.str());
  }
  Block* b = it->second;
  std::unique_lock<detail::SpinLock> cache_lock;
  if (b->holder != nullptr) {
    cache_lock = std::unique_lock(b->holder->mutex);
    if (b->in_thread_cache) {
      std::ostringstream os;
      os << "tidepool: record_stream on " << ptr << " (device " << m.device
         << "), which was already freed";
      throw AllocatorUsageError(os.str());
    }
  }
  if (b->owner != m.released.get() && stream == b->owner->stream) return;
  if (std::find(b->extra_streams.begin(), b->extra_streams.end(), stream) ==
      b->extra_streams.end())
    b->extra_streams.push_back(stream);
}

std::size_t CachingAllocator::empty_cache() {
  Impl& m = *impl_;
  std::lock_guard lock(m.mutex);
  if (!m.options.allow_release) return 0;
  m.drain_thread_caches();
  m.flush_all_quick();
  m.process_pending(false);
  const std::size_t bytes = m.release_cached();
  m.drop_empty_released_ranges();
  return bytes;
}

void CachingAllocator::require_releasable(int device, Stream stream) {
  if (stream.handle == nullptr) {
    throw AllocatorUsageError("tidepool: release_stream of the default (null) stream on device " +
                              std::to_string(device) +
                              ": the default stream is never destroyed, so it is never released");
  }
}

std::size_t CachingAllocator::release_stream(Stream stream) {
  Impl& m = *impl_;
  require_releasable(m.device, stream);
  std::lock_guard lock(m.mutex);
  const auto cache_locks = m.lock_thread_caches();
  return m.release_stream_locked(stream);
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

// The live block at ptr, or nullptr; impl's mutex held. A block parked in a thread cache
// is free to its callers (its holder's mutex is taken to tell).
static const detail::Block* live_block(const CachingAllocator::Impl& m, const void* ptr) {
  auto it = m.blocks.find(ptr);
  if (it == m.blocks.end() || it->second->state != BlockState::allocated) return nullptr;
  const detail::Block* b = it->second;
  if (b->holder == nullptr) return b;
  std::lock_guard cache_lock(b->holder->mutex);
  return b->in_thread_cache ? nullptr : b;
}

std::size_t CachingAllocator::allocation_size(const void* ptr) const {
  std::lock_guard lock(impl_->mutex);
  const detail::Block* b = live_block(*impl_, ptr);
  return b != nullptr ? b->requested : 0;
}

std::size_t CachingAllocator::block_size(const void* ptr) const {
  std::lock_guard lock(impl_->mutex);
  const detail::Block* b = live_block(*impl_, ptr);
  return b != nullptr ? b->size : 0;
}

Backend& CachingAllocator::backend() const { return *impl_->backend; }
int CachingAllocator::device() const { return impl_->device; }
const AllocatorOptions& CachingAllocator::options() const { return impl_->options; }

}  // namespace tidepool
