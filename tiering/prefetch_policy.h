// The tiered store's policy: which handles to prefetch next and which to evict.
//
// Training steps repeat. The first step between begin_step() and end_step() records the
// order in which handles are acquired; every later step replays it:
//   - prefetch: the handles that come next in the schedule, in order, as far ahead as
//     the device budget allows (the store asks upcoming() and stops at the first handle
//     that does not fit: back-pressure);
//   - eviction: Belady's rule on the recorded schedule, the handle whose next use is
//     furthest away goes first (eviction_score() is that distance).
// Before a schedule exists, eviction is least-recently-acquired. An acquire that deviates
// from the schedule re-syncs the position to that handle's next occurrence instead of
// derailing the replay; a handle the schedules do not contain (one created after the
// step that recorded them) scores as never used again and is loaded when acquired.
// A replayed step records its acquires too, and at end_step the schedule follows the
// workload (Note [Adopting a step]): a step that acquired a handle the schedule lacks and
// every handle it has becomes the schedule at once (so a handle created later is
// prefetched from the next step on); any other deviating step only when the next step of
// the same key deviates the same way (a one-off step keeps a good schedule). An empty
// step, an unfinished one (begin_step again before end_step) and one that outgrew
// kMaxStepAcquires change nothing.
//
// Several optimizers may share one store (one device budget): each brackets its steps
// with its own schedule key, and each key records and replays its own schedule. The
// policy also keeps the order in which the keys' steps ran and predicts the steps to
// come from it: the longest run of recent keys that also ran earlier is taken to repeat,
// and the keys that followed it then are the keys to come (A B A B: B follows A; a
// critic stepped twice per generator step, D D G D D G: after the first D comes D, after
// the second G). The look-ahead is the rest of the current step, the schedules of the
// predicted steps, then the current schedule again. So the end of one optimizer's step
// prefetches the start of the next one's, and eviction scores count acquires along that
// same sequence (a handle no schedule on it contains scores as never used again).
// Steps of different keys follow one another; they do not run at the same time.
//
// Note [Adopting a step]
// A schedule recorded once goes stale when the workload changes for good: state created
// lazily in a later step, parameters added to the optimizer later, a history that grows
// (handles the schedule lacks: scored as never used again, so evicted first and never
// prefetched, a miss on every step), an order that changed (every step re-syncs), state
// no longer used (prefetched for nothing). So a replayed step records its acquires too,
// and end_step compares them with the key's schedule:
//   - the same: nothing changes, and a deviation remembered from the last step is dropped;
//   - a handle the schedule lacks, and every handle it has: adopted at once. A new handle
//     is never a one-off: it exists now and the next step acquires it again. Asking for
//     every scheduled handle too tells a complete step from a truncated one: a step that
//     throws still ends (StepScope's destructor calls end_step), and its prefix must not
//     cut off the rest of the schedule. (A first recording truncated that way is replaced
//     by the next complete step, which has the handles the prefix missed.)
//   - anything else (the same handles in another order, fewer of them, or new handles with
//     some scheduled ones missing): adopted only when the key's previous completed step
//     deviated with exactly the same acquires, else remembered as the deviation. One odd
//     step (a closure that runs twice, a step that threw part-way) keeps a good schedule;
//     an order that changed for good is adopted after two steps and stops re-syncing.
//     Only an identical pair counts: two odd steps that differ say nothing about the next
//     one. The previous step is the same key's: optimizers sharing the store interleave.
// Steps that say nothing keep the schedule and the remembered deviation: a step without
// acquires (an optimizer with nothing to update this time), an unfinished one (begin_step
// again before end_step: its acquires are dropped, as a first recording's always were),
// one that outgrew kMaxStepAcquires.
// Adopting replaces the key's schedule, puts the position at its end (what comes next is
// the next step's) and rebuilds the look-ahead, which points into the schedules
// (moved()). forget() removes a handle from the remembered deviations as from the
// schedules. Cost: one comparison per end_step, linear in the step; memory: the open
// step's acquires and one remembered deviation per key.
// Not followed: a step that every time both adds handles and skips scheduled ones, each
// time differently (no two alike), keeps its old schedule; its new handles are loaded
// when acquired, as before.
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

  using ScheduleKey = std::uint64_t;

  PrefetchPolicy() = default;
  // The cached look-ahead points into schedules_: a copy would point into the original.
  PrefetchPolicy(const PrefetchPolicy&) = delete;
  PrefetchPolicy& operator=(const PrefetchPolicy&) = delete;
  PrefetchPolicy(PrefetchPolicy&&) = default;  // map nodes move with the map
  PrefetchPolicy& operator=(PrefetchPolicy&&) = default;

  // Starts a step of `key`'s schedule: records when that schedule does not exist yet,
  // else replays it from the start. Until the next begin_step, `key`'s schedule is the
  // current one (prefetch and eviction follow it, also between steps).
  void begin_step(ScheduleKey key = 0);
  // Ends a step; the first completed step of a key with at least one acquire becomes
  // that key's schedule, and a later one may replace it (Note [Adopting a step]).
  void end_step();
  // Drops every schedule; the next step of each key records again.
  void reset_schedule();
  // `key` will not step again (its optimizer is gone): drops its schedule and its steps
  // from the history the next keys are predicted from. A key that does step again later
  // records anew. The store's own key 0 is only emptied. When `key` is the current one,
  // key 0 becomes current.
  void retire(ScheduleKey key);

  // Notes an acquire of `h` (records it or advances the replay position).
  void on_acquire(HandleId h);
  // The handle is gone: remove it from the schedule and the recency table.
  void forget(HandleId h);

  // Higher = evict sooner: the number of acquires until the next use of `h` along the
  // look-ahead sequence (kNever-1 when no schedule on it contains `h`), or, with no
  // schedule, how many acquires ago it was last used.
  std::size_t eviction_score(HandleId h) const;
  // The next `max` distinct handles the look-ahead sequence expects, in order (at most
  // one cycle of it).
  std::vector<HandleId> upcoming(std::size_t max) const;

  bool replaying() const { return !current().order.empty() && !recording_; }
  bool recording() const { return recording_; }
  // The current key's schedule.
  std::size_t schedule_length() const { return current().order.size(); }
  // Keys with a schedule (recorded or not), the store's key 0 included.
  std::size_t schedule_count() const { return schedules_.size(); }
  std::uint64_t off_schedule_acquires() const { return off_schedule_; }
  // Schedules replaced by a replayed step (Note [Adopting a step]); first recordings
  // are not counted.
  std::uint64_t schedule_adoptions() const { return adoptions_; }

  // Acquires one step records at most (8 MiB of ids). Past it the step stops recording
  // and ends changing nothing: a store whose end_step never comes holds no more than
  // this, and a step that long is not a training step the replay could follow anyway.
  static constexpr std::size_t kMaxStepAcquires = std::size_t{1} << 20;

 private:
  struct Schedule {
    std::vector<HandleId> order;
    std::unordered_map<HandleId, std::vector<std::size_t>> positions;  // sorted positions
    // The acquires of this key's last completed step when they differed from `order`
    // without being adopted; empty when that step followed it. A second step like it
    // is adopted (Note [Adopting a step]).
    std::vector<HandleId> deviation;
    void set(std::vector<HandleId> new_order);
  };
  // A stretch of the look-ahead sequence: order[begin, end) of one schedule.
  struct Stretch {
    const Schedule* schedule;
    std::size_t begin, end;
  };
  const Schedule& current() const { return schedules_.at(current_key_); }
  Schedule& current() { return schedules_.at(current_key_); }
  // The rest of the current step, the recorded schedules of the predicted steps, then
  // the current schedule up to the position. Cached until the position, the key or a
  // schedule changes: the store scores every resident handle against it when it needs
  // room.
  const std::vector<Stretch>& look_ahead() const;
  void moved() { look_ahead_valid_ = false; }
  // The keys of the steps expected between this step and the current key's next one,
  // from steps_ (see the top of this file).
  std::vector<ScheduleKey> predict_next_keys() const;
  // end_step of a replayed step: keeps `schedule`, or adopts `acquires` (the step's)
  // when the deviation will persist (Note [Adopting a step]). Takes `acquires` over
  // when it keeps them (adopted or remembered); when the step followed the schedule it
  // is left as it is, so the next step reuses its capacity.
  void follow_step(Schedule& schedule, std::vector<HandleId>& acquires);

  std::unordered_map<ScheduleKey, Schedule> schedules_{{0, Schedule{}}};
  ScheduleKey current_key_ = 0;  // always in schedules_
  // The open step's acquires, in order (recording or replaying); cleared when it passes
  // kMaxStepAcquires (step_overflowed_) and at every begin_step and end_step.
  std::vector<HandleId> step_acquires_;
  bool in_step_ = false;  // between begin_step and end_step
  bool step_overflowed_ = false;
  // The keys of the last kStepsKept steps begun, oldest first; the last is current_key_.
  static constexpr std::size_t kStepsKept = 64;
  std::vector<ScheduleKey> steps_;
  std::vector<ScheduleKey> next_keys_;  // predict_next_keys() at the last begin_step
  bool recording_ = false;
  // Index of the next expected acquire in current().order; its size once the step has
  // made all the acquires it expects (then the look-ahead goes on to the next key's).
  std::size_t position_ = 0;
  std::uint64_t clock_ = 0;
  std::unordered_map<HandleId, std::uint64_t> last_acquire_;
  std::uint64_t off_schedule_ = 0;
  std::uint64_t adoptions_ = 0;
  mutable std::vector<Stretch> look_ahead_;
  mutable bool look_ahead_valid_ = false;
};

}  // namespace tidepool
