// SegmentEventLog: the queue of backing changes an observer drains (Note [Segment events]
// in segment_events.h).
#include "allocator/segment_events.h"

#include <utility>

namespace tidepool {

void SegmentEventLog::set_observed(bool on) {
  std::lock_guard lock(mutex_);
  queue_.clear();
  observed_.store(on, std::memory_order_relaxed);
}

void SegmentEventLog::push(SegmentEvent::Kind kind, const void* address, std::size_t size,
                           void* stream) noexcept {
  std::lock_guard lock(mutex_);
  // Re-read under the mutex: an event that raced with set_observed(false) must not
  // outlive the drop.
  if (!observed_.load(std::memory_order_relaxed)) return;
  try {
    queue_.push_back({kind, reinterpret_cast<std::uintptr_t>(address), size, stream,
                      std::this_thread::get_id()});
  } catch (...) {
    // Out of host memory: the observer loses this event. The caller is half-way through
    // a backing change under the allocator's lock, which must not fail for a trace.
  }
}

std::vector<SegmentEvent> SegmentEventLog::take() {
  std::lock_guard lock(mutex_);
  return std::exchange(queue_, {});
}

}  // namespace tidepool
