// The tiered store's events: a pool of them taken and given back (a backend event is
// costly to create on CUDA, and every eviction, load and acquire needs a few for ordering
// the copy streams and the streams that used a handle), and the recording of one on a use
// stream, which is how the copy streams and a new user are ordered after earlier users.
// Every event a store takes goes back to the pool, also when the call using it fails, so
// that the store's destructor destroys each one it created.
#include <string>

#include "tiering/tiered_store.h"

namespace tidepool {

Event TieredStore::take_event_locked() {
  if (free_events_.empty()) return backend_.create_event();
  Event ev = free_events_.back();
  free_events_.pop_back();
  return ev;
}

void TieredStore::give_event_locked(Event e) noexcept {
  try {
    free_events_.push_back(e);
  } catch (...) {  // no heap to keep it: destroyed now (if even that fails, one event leaks)
    try {
      backend_.destroy_event(e);
    } catch (...) {
    }
  }
}

Event TieredStore::take_recorded_event_locked(Stream s) {
  const Event ev = take_event_locked();
  try {
    backend_.record_event(ev, s);
  } catch (...) {
    give_event_locked(ev);
    throw;
  }
  return ev;
}

Event TieredStore::record_use_event_locked(Stream s) {
  try {
    return take_recorded_event_locked(s);
  } catch (const BackendError& err) {
    throw TieringError(std::string("tiered store: cannot wait for a stream that used this "
                                   "state (destroyed without TieredStore::release_stream, "
                                   "or tidepool_release_stream?): ") + err.what());
  }
}

void TieredStore::order_after_use_locked(Stream waiter, Stream used) {
  const Event ev = record_use_event_locked(used);
  try {
    backend_.stream_wait_event(waiter, ev);  // captures the point now: the event is free again
  } catch (...) {
    give_event_locked(ev);  // else a failed wait loses it: never destroyed with the store
    throw;
  }
  give_event_locked(ev);
}

}  // namespace tidepool
