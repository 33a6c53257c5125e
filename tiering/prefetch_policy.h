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
// workload (Note [Adopting a step]): a handle the schedule lacks is merged in at once,
// where the step acquired it (so a handle created later is prefetched from the next step
// on); another order only when the next step of the same key deviates the same way (a
// one-off step keeps a good schedule). The schedule keeps every handle the key's recent
// steps acquired, and each step replays the part of it that each handle's presence in
// the last steps predicts (Note [Steps of several shapes]): steps that alternate between
// two sets of handles replay each its own. An empty step, an unfinished one (begin_step
// again before end_step) and one that outgrew kMaxStepAcquires change nothing.
//
// Several optimizers may share one store (one device budget): each brackets its steps
// with its own schedule key, and each key records and replays its own schedule. The
// policy also keeps the order in which the keys' steps ran and predicts the steps to
// come from it: the longest run of recent keys that also ran earlier is taken to repeat,
// and the keys that followed it then are the keys to come (A B A B: B follows A; a
// critic stepped twice per generator step, D D G D D G: after the first D comes D, after
// the second G). The look-ahead is the rest of the current step, the schedules of the
// predicted steps, then the current key's next step. So the end of one optimizer's step
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
// and end_step compares them with the shape the step replayed (Note [Steps of several
// shapes]):
//   - the same: nothing changes, and a deviation remembered from the last step is dropped.
//     A step that repeats one sequence more often than the schedule does (a closure run
//     twice: 1 2 3 1 2 3 where the schedule is 1 2 3) counts as that sequence repeated as
//     often as the schedule repeats it: here, once. So it follows the schedule, and a
//     handle it created is merged in once, not twice (adopting it whole would list every
//     handle twice, until two normal steps took the doubled order back). A schedule that
//     repeats itself (an optimizer that passes over its state twice per step) keeps its
//     count: only the surplus is dropped.
//   - a handle the schedule lacks: merged in at once, every acquire of it where the step
//     made it (before the scheduled acquire the step's replay expected next), the rest of
//     the schedule as it was. A new handle is never a one-off: it exists now and the next
//     step acquires it again. A merge cuts nothing off: a step that created a handle and
//     then threw (StepScope's destructor still ends it) adds the handle and keeps the rest,
//     and a step that brings a handle and lacks another (steps 1 2 and 1 3 in turn) leaves
//     both in the schedule, for the presences to sort out.
//   - anything else (the same handles in another order, fewer of them): adopted only when
//     the key's previous completed step deviated with exactly the same acquires, else
//     remembered as the deviation. Adopting takes the step's order and merges back in the
//     scheduled handles it lacked, where the schedule had them: whether those are still
//     used is for their presences to say, so a pattern of shapes (1 2, 1 2, 1 3, 1 3, ...)
//     does not lose a shape each time one repeats. One odd step (a closure that runs twice,
//     a step that threw part-way, an eval step) keeps a good schedule; an order that
//     changed for good is adopted after two steps and stops re-syncing. Only an identical
//     pair counts: two odd steps that differ say nothing about the next one. The previous
//     step is the same key's: optimizers sharing the store interleave.
// Steps that say nothing keep the schedule, the presences and the remembered deviation: a
// step without acquires (an optimizer with nothing to update this time), an unfinished one
// (begin_step again before end_step: its acquires are dropped, as a first recording's
// always were), one that outgrew kMaxStepAcquires.
// schedule_adoptions counts the steps that changed the schedule (a merge, an adopted
// order); a new prediction of the shapes does not count, and off_schedule_acquires counts
// the acquires a replayed shape did not expect. Every end_step puts the position at the
// end of the shape (what comes next is the next step's) and rebuilds the look-ahead, which
// points into the shapes (moved()). forget() removes a handle from the schedule, the
// shapes, the presences and the remembered deviation. Cost per end_step: a comparison with
// the shape and a pass over the key's presences; a step that deviates also a look for
// repeats and a set of its handles; a merge, an adoption or a new prediction rebuilds the
// shapes. All linear in the step or the schedule.

// Note [Steps of several shapes]
// One key's steps need not all acquire the same handles: parameters whose gradient exists
// every other step, two losses stepped in turn, experts a router picks. One recorded order
// cannot serve them: with steps A = 1 2 and B = 1 3 in turn, B lacks 2 and A lacks 3, and
// when this policy adopted only steps that had every scheduled handle, it kept A's order
// and missed 3 on every B step for good. So a key's schedule is the union of what its
// recent steps acquired, in the order merged (Note [Adopting a step]), with each handle's
// presence: one bit for each of the key's last 64 steps that said something (1: the step
// acquired it). A step replays its shape, the schedule less the handles predicted absent
// from it. Presences oldest first:
//   - a handle whose last 2p+1 presences repeat with a period p of at most kMaxPeriod (4)
//     steps, the shortest such p, is predicted by it: 1 0 1 0 1 is absent from the next
//     step and present in the one after; 0 0 0 (unused three steps running) is absent,
//     which is also how state no longer used leaves the replay (a handle unused for all 64
//     steps leaves the schedule too);
//   - any other is predicted present: for a handle new, used irregularly, or with one odd
//     step in its recent history, no pattern refines the union.
// A pattern is trusted once it has held 2p+1 steps: A B A B replays the union from step 3
// (3 prefetched in B steps), and from step 7 on each step replays exactly its own shape
// (no off-schedule acquire, nothing prefetched for nothing). One odd step (a step cut
// short, an eval step) breaks the patterns of the handles it got wrong: they fall back to
// the union, not out of it, until their pattern has held 2p+1 steps again; a handle every
// step acquired keeps its period 1, present. At worst the flipped presence leaves a
// shorter pattern in the window (1 0 1 0 with its last 1 lost reads 1 0 0 0) and one step
// mispredicts: the handle, left out, is loaded when acquired, as a handle new to the
// schedule would be, and its presence then fits no pattern, so the union serves it again.
// The shape of the step after the current one is kept too where it differs (`after`), and
// the look-ahead goes on to it at the end of the current step: the end of an A step
// prefetches B's start, and a handle only B uses is scored by its use there, not as never
// used again.
//
// Prefetching a handle the coming step does not use. The store prefetches in the order
// upcoming() gives and, for a prefetch, evicts only handles whose next use along the same
// look-ahead comes after the incoming one's (make_room_locked in tiered_store.cpp): it
// never evicts a handle the look-ahead needs sooner. Where the shapes are predicted and the
// prediction holds, the look-ahead holds only what the coming steps use, so that rule is
// Belady's and nothing is prefetched for nothing. Where the union stands in for a pattern
// not found, a handle the step does not use may stand before one it does, and its prefetch
// may then evict that one (when the budget cannot hold both); the evicted handle is loaded
// again when prefetched or acquired. This is accepted, not prevented: without a pattern no
// order of those handles is better, and leaving them out of the replay would miss each of
// them on every step that uses it (as before this Note); it costs only while no pattern is
// found (a steady one is within 2p+1 steps) and only when the budget cannot hold the
// look-ahead; and handles every step uses are predicted present by their period 1, so a
// wrong guess about the others costs loads, never a handle missing from the replay.
// Memory, per key: the schedule (kMaxStepAcquires ids at most: a merge that would pass it
// takes the step instead), the shape replayed and, where it differs, the next one, one
// remembered deviation and a presence per handle; and the open step's acquires.

// Not thread-safe: the tiered store calls it under its own lock.
#pragma once

#include <algorithm>
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
  // that key's schedule, and a later one may change it (Note [Adopting a step]).
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

  // Note [Eviction keys]
  // The store evicts the resident handle with the highest eviction_score(). Scoring each
  // resident handle at every eviction cost as much as the store holds resident: 45 us
  // per acquire with 4,096 resident (bench/tiering/many_handles_step.cpp). But between
  // two changes of the look-ahead other than in-order acquires, scores move together:
  //   - replaying, a score is the distance to the handle's next use, and an in-order
  //     acquire takes one off each, but the acquired handle's, whose next use moves on;
  //   - before a schedule, a score is the acquires since the handle's last one, and an
  //     acquire adds one to each, but the acquired handle's, which drops to 0.
  // So a key that leaves out that common shift orders the handles as their scores do,
  // and changes only when the handle itself is acquired: replaying, the in-order
  // acquires so far plus the score; before a schedule, the largest key less one less
  // the clock of its last acquire; a handle never used again (kNever - 1) the largest
  // key of all. Keys are comparable while eviction_key_epoch() stays the same (moved()
  // and a change between replaying and not change it); eviction_score_of_key() turns a
  // key of the current epoch back into the score.
  std::uint64_t eviction_key(HandleId h) const;
  std::uint64_t eviction_key_epoch() const { return version_ * 2 + (replaying() ? 1 : 0); }
  std::size_t eviction_score_of_key(std::uint64_t key) const;
  // The next `max` distinct handles the look-ahead sequence expects, in order (at most
  // one cycle of it).
  std::vector<HandleId> upcoming(std::size_t max) const;

  // Note [Prefetch frontier]
  // The store prefetches after every acquire: it walks the look-ahead from its front and
  // loads what is not on the device, up to prefetch_lookahead acquires ahead. In a step
  // that follows its shape each acquire only drops the front acquire of the look-ahead,
  // so all but the last of the acquires the previous walk passed are still ahead, their
  // handles still loaded: walking them again cost about 2 us per acquire at 64 ahead
  // (bench/tiering/policy_step.cpp). So a walk leaves a mark (how far it got, and where
  // the look-ahead stood), and the next one starts where that mark still holds: at the
  // same place less the in-order acquires since. Anything else that changes the
  // look-ahead (a step begun or ended, an acquire off the shape, a handle forgotten, a
  // schedule adopted or retired) starts the next walk at the front, and so does, in the
  // store, any device copy dropped since the mark (an eviction, or the discard of a
  // destroy or a write: a handle it passed may be gone). What a mark skips is exactly
  // what the walk would find loaded, so prefetching does what it did; a walk that stops
  // (back-pressure) marks the handle it stopped at, which the next one tries first, as
  // before.
  struct LookAheadMark {
    std::uint64_t version = ~std::uint64_t{0};  // none: nothing is covered
    std::uint64_t advances = 0;
    std::size_t covered = 0;  // leading acquires of the look-ahead the walk passed
  };
  // A mark for a walk that passed the first `covered` acquires of the look-ahead now.
  LookAheadMark mark(std::size_t covered) const { return {version_, advances_, covered}; }
  // How many leading acquires of the look-ahead now `mark`'s walk passed: its count less
  // the in-order acquires since, or 0 when the look-ahead changed otherwise.
  std::size_t still_covered(const LookAheadMark& mark) const {
    if (mark.version != version_) return 0;
    const std::uint64_t advanced = advances_ - mark.advances;
    return mark.covered > advanced ? mark.covered - static_cast<std::size_t>(advanced) : 0;
  }
  // Calls visit(h) for the acquires [from, max) of the look-ahead sequence, in order (a
  // handle acquired twice there is visited twice), while it returns true; returns how
  // many leading acquires are then passed: the index of the one visit refused, else
  // max or the sequence's end. Nothing when not replaying.
  template <typename Visit>
  std::size_t visit_upcoming(std::size_t from, std::size_t max, Visit&& visit) const {
    if (!replaying()) return 0;
    std::size_t index = 0;  // of the stretch's first acquire in the sequence
    for (const Stretch& stretch : look_ahead()) {
      const std::size_t length = stretch.end - stretch.begin;
      for (std::size_t at = std::max(from, index); at < index + length; ++at) {
        if (at >= max) return max;
        if (!visit(stretch.shape->order[stretch.begin + (at - index)])) return at;
      }
      index += length;
    }
    return std::min(std::max(from, index), max);
  }

  bool replaying() const { return !current().coming.order.empty() && !recording_; }
  // The acquires the replayed step still expects (0 between steps or not replaying): a
  // handle whose eviction_score() is below it is used again in this step.
  std::size_t rest_of_step() const {
    if (!in_step_ || !replaying()) return 0;
    const std::size_t size = current().coming.order.size();
    return position_ < size ? size - position_ : 0;
  }
  bool recording() const { return recording_; }
  // The acquires the current key's step replays (or, between steps, its next one will).
  std::size_t schedule_length() const { return current().coming.order.size(); }
  // Keys with a schedule (recorded or not), the store's key 0 included.
  std::size_t schedule_count() const { return schedules_.size(); }
  std::uint64_t off_schedule_acquires() const { return off_schedule_; }
  // Replayed steps that changed their key's schedule: a handle merged in, an order
  // adopted (Note [Adopting a step]). First recordings and new predictions of the
  // shapes (Note [Steps of several shapes]) are not counted.
  std::uint64_t schedule_adoptions() const { return adoptions_; }

  // Acquires one step records at most (8 MiB of ids). Past it the step stops recording
  // and ends changing nothing: a store whose end_step never comes holds no more than
  // this, and a step that long is not a training step the replay could follow anyway.
  static constexpr std::size_t kMaxStepAcquires = std::size_t{1} << 20;
  // The longest period of a handle's presence a shape is predicted from (Note [Steps of
  // several shapes]): its pattern must have held 2 * kMaxPeriod + 1 steps.
  static constexpr unsigned kMaxPeriod = 4;

 private:
  // A sequence of acquires the replay follows.
  struct Shape {
    std::vector<HandleId> order;
    std::unordered_map<HandleId, std::vector<std::size_t>> positions;  // sorted positions
    void set(std::vector<HandleId> new_order);
    // Drops `h`; `position`, when given, moves with the handle it points at.
    void erase(HandleId h, std::size_t* position);
  };
  // Which of the key's last steps that said something acquired a handle (Note [Steps of
  // several shapes]): bit i, the step i + 1 steps back; `steps` of them are known.
  struct Presence {
    std::uint64_t bits = 0;
    unsigned steps = 0;
    bool absent_coming = false;  // left out of Schedule::coming
    bool absent_after = false;   // left out of Schedule::after
  };
  struct Schedule {
    // Every handle the key's recent steps acquired, in the order merged (Note [Adopting
    // a step]): what the shapes are cut from. Empty: the next step records.
    std::vector<HandleId> all;
    std::size_t repeats = 1;  // `all` is one sequence this many times over
    std::unordered_map<HandleId, Presence> presence;  // one per handle of `all`
    Shape coming;  // the current step's shape, or between steps the next one's
    Shape after;   // the step after `coming`'s, when its shape differs; else empty
    bool after_differs = false;
    // The acquires of this key's last completed step when they differed from its shape
    // without being adopted; empty when that step followed it. A second step like it
    // is adopted (Note [Adopting a step]).
    std::vector<HandleId> deviation;
    // A step of this key ended, while nothing was recorded, without acquiring anything
    // (an optimizer whose parameters have no gradients): the look-ahead goes past its
    // empty steps to the keys after it, instead of stopping as at a key not recorded yet.
    bool steps_empty = false;
    // The shape of the step after the coming one.
    const Shape& next() const { return after_differs ? after : coming; }
  };
  // A stretch of the look-ahead sequence: order[begin, end) of one shape.
  struct Stretch {
    const Shape* shape;
    std::size_t begin, end;
  };
  const Schedule& current() const { return schedules_.at(current_key_); }
  Schedule& current() { return schedules_.at(current_key_); }
  // The rest of the current step, the shapes of the predicted steps, then the current
  // key's next step: during a step the whole of its shape, between steps (the coming
  // shape is then the next step's) its coming shape up to the position. Cached until the
  // position, the key or a schedule changes: the store scores every resident handle
  // against it when it needs room.
  const std::vector<Stretch>& look_ahead() const;
  // The look-ahead changed other than by an in-order acquire (Note [Prefetch frontier]).
  void moved() {
    look_ahead_valid_ = false;
    version_++;
  }
  // The keys of the steps expected between this step and the current key's next one,
  // from steps_ (see the top of this file).
  std::vector<ScheduleKey> predict_next_keys() const;
  // end_step of a replayed step: keeps `schedule`, or merges in or adopts `acquires`
  // (the step's), and notes its presences (Note [Adopting a step]). Takes `acquires`
  // over when it keeps them as the deviation; else leaves them, so the next step reuses
  // their capacity.
  void follow_step(Schedule& schedule, std::vector<HandleId>& acquires);
  // Notes a step's presences (`acquired(h)`: whether it acquired h), drops the handles
  // no step a presence holds acquired, and predicts the shapes anew; `changed`: `all`
  // changed, so the shapes are rebuilt whatever the prediction.
  template <typename Acquired>
  static void note_step(Schedule& schedule, const Acquired& acquired, bool changed);
  // Makes `all` the schedule: a presence for each handle new to it, none for those gone.
  static void set_all(Schedule& schedule, std::vector<HandleId> all);
  // `schedule.all` less the handles whose presence says `absent`.
  static std::vector<HandleId> shape_of(const Schedule& schedule, bool Presence::*absent);
  // Whether `p` predicts the handle absent from the key's step `ahead` steps after the
  // coming one (0: the coming one).
  static bool predicted_absent(const Presence& p, unsigned ahead);

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
  // Index of the next expected acquire in current().coming; its size once the step has
  // made all the acquires it expects (then the look-ahead goes on to the next key's).
  std::size_t position_ = 0;
  std::uint64_t clock_ = 0;
  std::unordered_map<HandleId, std::uint64_t> last_acquire_;
  std::uint64_t off_schedule_ = 0;
  std::uint64_t adoptions_ = 0;
  mutable std::vector<Stretch> look_ahead_;
  mutable bool look_ahead_valid_ = false;
  // Note [Prefetch frontier]: bumped by moved(); in-order acquires of a step.
  std::uint64_t version_ = 0;
  std::uint64_t advances_ = 0;
};

}  // namespace tidepool
