// The tiered store's buffers on their way out (TieredStore::PendingFree): a buffer an
// eviction dropped stays charged to the device budget until the D2H stream has passed
// its write-back, and is then handed back to the memory source. This file holds that
// bookkeeping: reaping the pending frees whose write-backs are done, giving a load room
// from them without waiting (Note [Loads over write-backs] in tiered_store.h), handing
// them back in stream order, and putting back the buffer of a load that failed. The rest
// of the store (tiered_store.cpp) decides when to evict and to load.
//
// Every function here keeps one rule under failure: a buffer is owed to the memory
// source exactly once. A backend call or a deallocate that throws midway (a deallocate
// that throws gave nothing back: DeviceMemorySource in tiered_store.h) leaves the buffers
// already handed back out of pending_frees_ and the rest in it, charged, for a later reap.
#include "tiering/tiered_store.h"

#include <utility>

namespace tidepool {

// Note [Reaping in stream order]
// Every load asks for room, and asking reaps: with the caller's evictions running ahead of
// the D2H stream (a prefetch and eviction pass issues everything at once), tens of frees
// are pending at each load. Those an eviction queued have their event on the D2H stream in
// list order, so once one of them is not done, no later one is: the reap stops asking
// there (it still asks each of the few a failed load put back, whose events are out of
// that order), so a pass makes about one event query per load and free instead of one per
// load and pending free.
// A done free goes back to the memory source on the H2D stream, where the store allocates
// every buffer: the write-back and every use before it are over (its event is done), so
// this is a free on the buffer's own stream, which a caching allocator takes at once, with
// no event of its own (a free on another stream records one there, a D2H stream operation
// between two copy-backs, and the next allocation on the H2D stream must ask it).
void TieredStore::reap_frees_locked(bool wait_all, bool streams_idle) {
  auto keep = pending_frees_.begin();
  auto it = pending_frees_.begin();
  bool d2h_behind = false;  // a D2H-ordered free is not done: no later one is
  try {
    for (; it != pending_frees_.end(); ++it) {
      if (streams_idle) {
        // done: the caller synchronized both copy streams
      } else if (wait_all) {
        copies_.wait_exposed(it->after);
      } else if ((it->in_d2h_order && d2h_behind) || !backend_.event_query(it->after)) {
        d2h_behind = d2h_behind || it->in_d2h_order;
        if (keep != it) *keep = std::move(*it);
        ++keep;
        continue;
      }
      device_.deallocate(it->ptr, it->bytes, copies_.stream(Direction::host_to_device));
      uncharge_locked(it->bytes);
      give_event_locked(it->after);
    }
  } catch (...) {
    // A wait, query or deallocate failed midway: [keep, it) holds buffers already handed
    // back (or moved forward), `it` one not handed back; dropping [keep, it) leaves every
    // buffer still owed exactly once.
    pending_frees_.erase(keep, it);
    throw;
  }
  pending_frees_.erase(keep, pending_frees_.end());
}

// Note [Loads over write-backs] (tiered_store.h), in order of preference: a pending free
// of exactly `bytes` (no allocator traffic, no waste); with a stream-ordered source, the
// oldest pending frees that leave room (their write-backs finish first). With a shared
// budget what the other participants hold counts as held (Note [Shared state budget]).
TieredStore::Room TieredStore::room_from_pending_locked(std::size_t bytes) const {
  for (std::size_t i = 0; i < pending_frees_.size(); ++i) {
    if (pending_frees_[i].bytes == bytes) return {Room::Kind::take_over, i};
  }
  if (device_.stream_ordered) {
    std::size_t held = peer_bytes_locked() + device_bytes_ + reserved_;
    for (std::size_t i = 0; i < pending_frees_.size(); ++i) {
      held -= pending_frees_[i].bytes;
      if (held + bytes <= options_.device_budget_bytes) return {Room::Kind::release_pending, i + 1};
    }
  }
  return {Room::Kind::none, 0};
}

// Hands the first `count` pending frees back to the (stream-ordered) source on the H2D
// stream, after making that stream wait for their write-backs: the source may give their
// memory to the next allocation on the H2D stream at once, and everything the store
// enqueues there from now on runs after those write-backs and the uses before them.
// Each one's charge passes to the reservation of the load it makes room for, rather than
// back to the budget, where another store sharing it could take the room first
// (device_allocate_locked gives back what the load does not need).
// A deallocate that throws gave nothing back (DeviceMemorySource): the buffers handed
// back before it leave the list before the error propagates, the rest stay pending (the
// H2D stream merely waited for their write-backs too), so none is freed twice.
void TieredStore::release_pending_locked(std::size_t count) {
  const Stream h2d = copies_.stream(Direction::host_to_device);
  for (std::size_t i = 0; i < count; ++i) backend_.stream_wait_event(h2d, pending_frees_[i].after);
  std::size_t done = 0;
  try {
    for (; done < count; ++done) {
      const PendingFree& f = pending_frees_[done];
      device_.deallocate(f.ptr, f.bytes, h2d);
      device_bytes_ -= f.bytes;
      reserved_ += f.bytes;
      give_event_locked(f.after);  // the waits are enqueued: the events may be re-recorded
      stats_.frees_stream_ordered++;
    }
  } catch (...) {
    pending_frees_.erase(pending_frees_.begin(), pending_frees_.begin() + static_cast<long>(done));
    throw;
  }
  pending_frees_.erase(pending_frees_.begin(), pending_frees_.begin() + static_cast<long>(count));
}

// Note [A failed load's buffer]
// The buffer of a load that failed goes back once the H2D work enqueued on it is done.
// This runs while the load's own error propagates, so it never throws: a second failure
// here must neither replace that error (the caller would be told the wrong cause) nor
// lose the buffer while it is still charged to the budget (device_bytes_ would stay too
// high for good, shrinking the budget). Whatever fails, the buffer stays the store's:
//   - taken over from a write-back (Note [Loads over write-backs]) whose wait may not
//     have been enqueued (`buf.wait` still held): back to the pending frees, charged
//     until that write-back has read it;
//   - otherwise handed back to the memory source, and uncharged. A deallocate that
//     throws gave nothing back (DeviceMemorySource): the buffer becomes a pending free,
//     and the next reap hands it back, exactly once (pending_frees_ is its only owner);
//   - if the H2D stream cannot be synchronized, a copy may still write the buffer: it
//     becomes a pending free behind an event recorded on the H2D stream after that work
//     (and after the write-back it was taken over from, if any), the store's usual way of
//     freeing a buffer once the streams using it are done.
// Only when not even that event can be recorded (a backend that is going away) is the
// buffer left to the device, still charged: handing back memory a transfer may still
// write is worse than a smaller budget, as at teardown (teardown.h).
void TieredStore::give_back_failed_load_locked(const DeviceBuffer& buf,
                                               std::size_t bytes) noexcept {
  const Stream h2d = copies_.stream(Direction::host_to_device);
  try {
    pending_frees_.reserve(pending_frees_.size() + 1);  // the push_backs below cannot throw
    bool h2d_idle = true;
    try {
      backend_.stream_synchronize(h2d);
    } catch (...) {
      h2d_idle = false;
    }
    if (h2d_idle && buf.wait) {
      // Recorded before frees now ahead of it in the list: asked on its own at each reap.
      pending_frees_.push_back(PendingFree{buf.ptr, bytes, buf.wait, /*in_d2h_order=*/false});
      return;
    }
    if (h2d_idle) {
      try {
        device_.deallocate(buf.ptr, bytes, h2d);
        uncharge_locked(bytes);
        return;
      } catch (...) {
        // Nothing given back: a pending free below, behind an event on the (idle) H2D
        // stream, so the next reap retries it.
      }
    }
    if (buf.wait) backend_.stream_wait_event(h2d, buf.wait);
    const Event after = take_recorded_event_locked(h2d);
    // The wait is enqueued: the write-back's event may be re-recorded (Note [Stream
    // semantics]).
    if (buf.wait) give_event_locked(buf.wait);
    pending_frees_.push_back(PendingFree{buf.ptr, bytes, after, /*in_d2h_order=*/false});
  } catch (...) {
    // Left to the device, charged (above). buf.wait, if any, is lost with it: an event
    // is a few bytes, and one the backend cannot wait on now is better not reused.
  }
}

}  // namespace tidepool
