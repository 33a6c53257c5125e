// Stream ordering in the caching allocator: the lazy fences that tell when a stream is
// past its frees, taking a free block from another stream (cross-stream reuse),
// record_stream, and release_stream, which retires a stream before it is destroyed
// (Note [Stream contract] in caching_allocator.h states what callers must do).
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
// Note [Releasing a stream tidepool never saw]
// A stream the allocator keeps nothing for (no pools, so nothing free, pending or live
// from it; no thread-cache slot; no use named by record_stream) is released at once:
// no synchronize, nothing changed, 0. Not waiting matters to the LD_PRELOAD shim, which
// releases every stream the program destroys (cudaStreamDestroy does not block), most of
// them never used for tidepool memory. Such a stream is not checked either, so releasing
// one that is already destroyed succeeds: there is nothing of it to lose or misuse.
#include <algorithm>
#include <sstream>
#include <string>

#include "allocator/caching_allocator_impl.h"
#include "allocator/thread_cache.h"

namespace tidepool {

using detail::Block;
using detail::BlockState;
using detail::StreamPools;

void CachingAllocator::Impl::refresh_fence(StreamPools& sp) {
  if (sp.fence_in_flight && backend->event_query(sp.fence)) {
    // Never backwards: a synchronize since the fence was recorded (a slot move, an OOM's
    // wait) may have proven later frees safe already.
    sp.safe_seq = std::max(sp.safe_seq, sp.fence_seq);
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
    give_back_events({&sp.fence, 1});  // the stream was synchronized: the fence is done
    sp.fence = Event{};
  }
  sp.fence_in_flight = false;
}

bool CachingAllocator::Impl::keeps_something_of(Stream s) const {
  // Its pools (free, pending and live blocks, fence, quick lists), a thread-cache slot, or
  // a use record_stream named.
  return std::any_of(streams.begin(), streams.end(),
                     [&](const std::unique_ptr<StreamPools>& p) { return p->stream == s; }) ||
         std::any_of(thread_caches.begin(), thread_caches.end(),
                     [&](const auto& c) { return c->has_slot(s); }) ||
         std::any_of(blocks.begin(), blocks.end(), [&](const auto& entry) {
           return std::ranges::find(entry.second->extra_streams, s) !=
                  entry.second->extra_streams.end();
         });
}

std::size_t CachingAllocator::Impl::release_stream_locked(Stream s) {
  if (!keeps_something_of(s)) return 0;  // Note [Releasing a stream tidepool never saw]
  // Work queued on s may still use its blocks: wait first (a stream destroyed already
  // fails here, before anything changed). release_stream waited once already, without
  // the lock (Note [Waiting for a released stream without the lock]): this wait only
  // covers work queued since, and returns at once on an idle stream.
  backend->stream_synchronize(s);
  const auto is_s = [&](const std::unique_ptr<StreamPools>& p) { return p->stream == s; };
  // Blocks parked for s in thread caches and quick lists back into s's pools.
  for (auto& c : thread_caches) {
    c->fold_into(stats);
    c->drain_stream(s, [&](Block* b) {
      release_held(*c, b);
      insert_free(b, true);
    });
  }
  auto it = std::find_if(streams.begin(), streams.end(), is_s);
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
  // The stream is released from here on; what follows only gives cached memory back. A
  // failure there (a kept physical handle that still cannot be released: Note
  // [Unreleased handles] in segments.cpp) stays for a later empty_cache to retry and
  // report: refusing now would tell the caller, about to destroy the stream, that it is
  // still in use, and skip the tiering layer's release of it (c_api.cpp).
  try {
    const std::size_t bytes = release_cached(SIZE_MAX, true, nullptr, released.get());
    drop_empty_released_ranges();
    return bytes;
  } catch (const BackendError&) {
    return 0;
  }
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

void CachingAllocator::require_releasable(int device, Stream stream) {
  if (stream.handle == nullptr) {
    throw AllocatorUsageError("tidepool: release_stream of the default (null) stream on device " +
                              std::to_string(device) +
                              ": the default stream is never destroyed, so it is never released");
  }
}

// Note [Waiting for a released stream without the lock]
// A stream being released may have seconds of work queued (a training step's kernels).
// Waiting for it under the allocator's lock stalled every allocation and free on the
// device, of every thread and stream, for that long. So release_stream waits first with
// no lock held (the caller is about to destroy the stream and queues nothing more on it),
// then retires it under the lock, after a second wait that only covers work queued in
// between (none, by the contract; cheap on an idle stream).
std::size_t CachingAllocator::release_stream(Stream stream) {
  Impl& m = *impl_;
  require_releasable(m.device, stream);
  const auto keeps_something = [&m, stream] {
    std::lock_guard lock(m.mutex);
    const auto cache_locks = m.lock_thread_caches();
    return m.keeps_something_of(stream);
  };
  if (!keeps_something()) return 0;  // Note [Releasing a stream tidepool never saw]
  try {
    m.backend->stream_synchronize(stream);
  } catch (const BackendError&) {
    // Released meanwhile by another thread, and destroyed by its caller: nothing of it is
    // kept any more, as a release that had waited for the lock would have found.
    if (!keeps_something()) return 0;
    throw;
  }
  std::lock_guard lock(m.mutex);
  const auto cache_locks = m.lock_thread_caches();
  return m.release_stream_locked(stream);
}

}  // namespace tidepool
