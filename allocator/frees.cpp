// The free path of the caching allocator: deallocate (checked before anything changes),
// the events a free records on the other streams that used the block, the blocks that
// wait in `pending` for them, and empty_cache.
//
// Note [Failed frees]
// A free of a block other streams used records an event on each, which can fail (a
// stream given to record_stream destroyed since, a driver error); it then synchronizes
// the device instead (Note [Free after a lost stream]), which can fail too. So a free
// makes its backend calls first, then changes the block, its hold, its owner and the
// stats: a failed free leaves the allocator as it was, the block allocated, and may be
// retried. After the backend calls nothing needs the C++ heap either: the block goes back
// into its pool through the node it carries (Note [Blocks carry their pool node] in
// block_pool.h), so a free goes through with the heap exhausted.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>

#include "allocator/caching_allocator_impl.h"
#include "allocator/thread_cache.h"
#include "allocator/warn_once.h"

namespace tidepool {

using detail::Block;
using detail::BlockState;
using detail::StreamPools;

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
    give_back_events(events);
    synchronize_instead_of_events(b, e);
    return {};
  } catch (...) {
    give_back_events(events);
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
  if (!warn_once_due(warned_free_sync)) return;
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
  // Each finished block leaves `pending` before it goes back to its pool (the order of
  // `pending` does not matter): a throw part-way (the C++ heap out in a pool's insert)
  // leaves the blocks not handled yet pending, and none handled twice. Erasing them all
  // after the loop left those already freed pending too, and the next call freed them
  // again, while they might have been handed out meanwhile: one block, two users.
  while (finished > 0) {
    Block* b = pending[finished - 1];
    give_back_events(b->pending_events);
    b->pending_events.clear();
    pending[finished - 1] = pending.back();
    pending.pop_back();
    --finished;
    // Note [Segment events]: once it is back in its pool (insert_free may merge it away,
    // so what the event names is read first; a throw there leaves no event), still
    // under the lock, before it can be handed out again.
    const char* const ptr = b->ptr;
    const std::size_t requested = b->requested;
    void* const stream = b->owner->stream.handle;
    insert_free(b, true);
    segment_log.record(SegmentEvent::Kind::block_freed, ptr, requested, stream);
  }
}

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
        // The cache's lock is held: nobody takes the block out of it before this event is
        // queued, so no ALLOC of it comes first (Note [Segment events]).
        m.segment_log.record(SegmentEvent::Kind::block_freed, b->ptr, b->requested,
                             stream.handle);
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
  // Note [Segment events]: once the block is back in its pool, still under the lock,
  // before it can be handed out again (read first: insert_free may merge it away).
  const char* const freed = b->ptr;
  const std::size_t requested = b->requested;
  void* const freed_on = b->owner->stream.handle;
  if (b->segment->small && m.options.quick_lists) {
    b->state = BlockState::quick;
    if (b->owner->quick.push(b)) {
      m.segment_log.record(SegmentEvent::Kind::block_freed, freed, requested, freed_on);
      return;
    }
  }
  m.insert_free(b, true);
  m.segment_log.record(SegmentEvent::Kind::block_freed, freed, requested, freed_on);
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
  // What would not go stays held for the next release to retry; the caller learns of it.
  if (m.release_error) std::rethrow_exception(m.release_error);
  return bytes;
}

}  // namespace tidepool
