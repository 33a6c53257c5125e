// The tiered store's policy: which handles to prefetch next and which to evict.
//
// Training steps repeat. The first step between begin_step() and end_step() records the
// order in which handles are acquired; every later step replays it:
//   - prefetch: the handles that come next in the schedule, in order, as far ahead as
//     the device budget allows (the store asks upcoming() and stops at the first handle
//     that does not fit: back-pressure);
//   - eviction: Belady's rule on the recorded schedule, the handle whose next use is
//     furthest away goes first (eviction_score() is that distance).
// Before a schedule exists, or for handles the schedule does not contain, eviction falls
// back to least-recently-acquired. An acquire that deviates from the schedule re-syncs
// the position to that handle's next occurrence instead of derailing the replay.
//
// Not thread-safe: the tiered store calls it under its own lock.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <unordered_map>
#include <vector>

#include "allocator/export.h"

namespace tidepool {

class TIDEPOOL_API PrefetchPolicy {
 public:
  using HandleId = std::uint64_t;
  static constexpr std::size_t kNever = std::numeric_limits<std::size_t>::max();

  // Starts a step: records when no schedule exists yet, else replays from the start.
  void begin_step();
  // Ends a step; the first completed step with at least one acquire becomes the schedule.
  void end_step();
  // Drops the schedule; the next step records again.
  void reset_schedule();

  // Notes an acquire of `h` (records it or advances the replay position).
  void on_acquire(HandleId h);
  // The handle is gone: remove it from the schedule and the recency table.
  void forget(HandleId h);

  // Higher = evict sooner: the number of acquires until the next use of `h` in the
  // schedule (kNever-1 when the schedule does not contain it), or, with no schedule, how
  // many acquires ago it was last used.
  std::size_t eviction_score(HandleId h) const;
  // The next `max` distinct handles the schedule expects, in order (at most one cycle).
  std::vector<HandleId> upcoming(std::size_t max) const;

  bool replaying() const { return !schedule_.empty() && !recording_; }
  bool recording() const { return recording_; }
  std::size_t schedule_length() const { return schedule_.size(); }
  std::uint64_t off_schedule_acquires() const { return off_schedule_; }

 private:
  std::vector<HandleId> schedule_;
  std::unordered_map<HandleId, std::vector<std::size_t>> positions_;  // sorted positions
  std::vector<HandleId> recording_buffer_;
  bool recording_ = false;
  bool in_step_ = false;
  std::size_t position_ = 0;  // index of the next expected acquire in schedule_
  std::uint64_t clock_ = 0;
  std::unordered_map<HandleId, std::uint64_t> last_acquire_;
  std::uint64_t off_schedule_ = 0;
};

}  // namespace tidepool
