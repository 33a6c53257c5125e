// PrefetchPolicy: record the first step's acquire order, replay it for prefetch and
// furthest-next-use eviction, merge in the handles later steps bring and adopt an order
// that changed for good (Note [Adopting a step]), and replay in each step the shape its
// handles' presences predict (Note [Steps of several shapes]). See prefetch_policy.h.
#include "tiering/prefetch_policy.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <unordered_set>
#include <utility>

namespace tidepool {

namespace {

using HandleId = PrefetchPolicy::HandleId;
using Positions = std::unordered_map<HandleId, std::vector<std::size_t>>;

Positions positions_of(const std::vector<HandleId>& order) {
  Positions positions;
  for (std::size_t i = 0; i < order.size(); ++i) positions[order[i]].push_back(i);
  return positions;
}

// The replay position after an acquire at `position` of a handle found at `at` (sorted):
// past its next occurrence, or past its first when none is left (the replay wrapped).
std::size_t resync(const std::vector<std::size_t>& at, std::size_t position) {
  auto next = std::lower_bound(at.begin(), at.end(), position);
  return (next != at.end() ? *next : at.front()) + 1;
}

// `base` with the acquires in `step` of the handles `base` lacks put in where the step
// made them (Note [Adopting a step]): walking `step` with a replay position in `base`,
// moved as on_acquire moves it, each such acquire goes before the acquire of `base` the
// replay expected next (several there: in the step's order).
std::vector<HandleId> merge(const std::vector<HandleId>& base, const std::vector<HandleId>& step) {
  const Positions at = positions_of(base);
  std::vector<std::pair<std::size_t, HandleId>> inserts;  // (goes before base[first], handle)
  std::size_t position = 0;
  for (HandleId h : step) {
    auto it = at.find(h);
    if (it == at.end()) {
      inserts.emplace_back(position, h);
    } else {
      position = resync(it->second, position);
    }
  }
  // A replay that wrapped inserts before an earlier place again.
  std::ranges::stable_sort(inserts, {}, &std::pair<std::size_t, HandleId>::first);
  std::vector<HandleId> merged;
  merged.reserve(base.size() + inserts.size());
  auto insert = inserts.begin();
  for (std::size_t i = 0; i <= base.size(); ++i) {
    for (; insert != inserts.end() && insert->first == i; ++insert) {
      merged.push_back(insert->second);
    }
    if (i < base.size()) merged.push_back(base[i]);
  }
  return merged;
}

// How many times over `v` repeats one sequence (1: it does not). The longest proper
// border of v (a prefix that is also a suffix, Knuth-Morris-Pratt's failure function)
// leaves its shortest period; v repeats that period exactly when it divides v's size.
std::size_t repeats_of(const std::vector<HandleId>& v) {
  if (v.size() < 2) return 1;
  std::vector<std::size_t> border(v.size(), 0);
  for (std::size_t i = 1, k = 0; i < v.size(); ++i) {
    while (k > 0 && v[i] != v[k]) k = border[k - 1];
    if (v[i] == v[k]) ++k;
    border[i] = k;
  }
  const std::size_t period = v.size() - border.back();
  return v.size() % period == 0 ? v.size() / period : 1;
}

}  // namespace

// ---- shapes and presences (Note [Steps of several shapes]) --------------------------------

void PrefetchPolicy::Shape::set(std::vector<HandleId> new_order) {
  order = std::move(new_order);
  positions = positions_of(order);
}

void PrefetchPolicy::Shape::erase(HandleId h, std::size_t* position) {
  if (!positions.contains(h)) return;
  std::vector<HandleId> kept;
  std::size_t kept_before_position = 0;
  for (std::size_t i = 0; i < order.size(); ++i) {
    if (order[i] == h) continue;
    if (position != nullptr && i < *position) kept_before_position++;
    kept.push_back(order[i]);
  }
  set(std::move(kept));
  if (position != nullptr) *position = kept_before_position;
}

bool PrefetchPolicy::predicted_absent(const Presence& p, unsigned ahead) {
  for (unsigned period = 1; period <= kMaxPeriod; ++period) {
    const unsigned window = 2 * period + 1;
    if (p.steps < window) break;  // a longer period needs a longer history still
    // Bits 0 .. window-period-1 against the ones `period` steps further back.
    const std::uint64_t compared = (std::uint64_t{1} << (window - period)) - 1;
    if (((p.bits ^ (p.bits >> period)) & compared) != 0) continue;
    const unsigned back = period - ahead % period;  // the step it repeats, 1..period back
    return ((p.bits >> (back - 1)) & 1) == 0;
  }
  return false;  // no pattern: present, as in the union
}

void PrefetchPolicy::set_all(Schedule& schedule, std::vector<HandleId> all) {
  schedule.all = std::move(all);
  if (!schedule.all.empty()) schedule.steps_empty = false;
  schedule.repeats = repeats_of(schedule.all);
  const std::unordered_set<HandleId> kept(schedule.all.begin(), schedule.all.end());
  std::erase_if(schedule.presence, [&](const auto& entry) { return !kept.contains(entry.first); });
  for (HandleId h : kept) schedule.presence.try_emplace(h);
}

std::vector<PrefetchPolicy::HandleId> PrefetchPolicy::shape_of(const Schedule& schedule,
                                                               bool Presence::*absent) {
  std::vector<HandleId> shape;
  shape.reserve(schedule.all.size());
  for (HandleId h : schedule.all) {
    if (!(schedule.presence.at(h).*absent)) shape.push_back(h);
  }
  return shape;
}

template <typename Acquired>
void PrefetchPolicy::note_step(Schedule& schedule, const Acquired& acquired, bool changed) {
  constexpr unsigned kKept = 64;  // steps a presence holds
  bool unused = false;
  for (auto& [h, p] : schedule.presence) {
    p.bits = (p.bits << 1) | (acquired(h) ? 1u : 0u);
    if (p.steps < kKept) p.steps++;
    unused |= p.steps == kKept && p.bits == 0;
  }
  if (unused) {  // no step the presences hold acquired it: it leaves the schedule
    std::vector<HandleId> kept;
    for (HandleId h : schedule.all) {
      const Presence& p = schedule.presence.at(h);
      if (p.steps < kKept || p.bits != 0) kept.push_back(h);
    }
    set_all(schedule, std::move(kept));
    changed = true;
  }
  bool coming_changed = changed;
  bool after_changed = changed;
  bool after_differs = false;
  // Steps that alternate between two shapes swap them: nothing to rebuild.
  bool swapped = schedule.after_differs && !changed;
  for (auto& [h, p] : schedule.presence) {
    const bool absent_coming = predicted_absent(p, 0);
    const bool absent_after = predicted_absent(p, 1);
    coming_changed |= absent_coming != p.absent_coming;
    after_changed |= absent_after != p.absent_after;
    swapped &= absent_coming == p.absent_after && absent_after == p.absent_coming;
    after_differs |= absent_coming != absent_after;
    p.absent_coming = absent_coming;
    p.absent_after = absent_after;
  }
  if (swapped) {
    std::swap(schedule.coming, schedule.after);
    return;
  }
  if (coming_changed) schedule.coming.set(shape_of(schedule, &Presence::absent_coming));
  if (!after_differs) {
    schedule.after = Shape{};
  } else if (after_changed || !schedule.after_differs) {
    schedule.after.set(shape_of(schedule, &Presence::absent_after));
  }
  schedule.after_differs = after_differs;
}

// ---- steps ----------------------------------------------------------------------------------

void PrefetchPolicy::begin_step(ScheduleKey key) {
  // The key's schedule first, and what else allocates before current_key_ changes: a
  // throw (out of heap) then leaves the previous key current, not one current() cannot
  // find, which made every later acquire throw until the next begin_step.
  const Schedule& schedule = schedules_[key];
  moved();
  if (steps_.size() == kStepsKept) steps_.erase(steps_.begin());
  steps_.push_back(key);
  next_keys_ = predict_next_keys();
  current_key_ = key;
  position_ = 0;
  // An unfinished step's acquires are dropped (Note [Adopting a step]).
  step_acquires_.clear();
  step_overflowed_ = false;
  in_step_ = true;
  recording_ = schedule.all.empty();
}

void PrefetchPolicy::end_step() {
  moved();
  if (in_step_ && !step_overflowed_ && !step_acquires_.empty()) {
    Schedule& schedule = current();
    if (recording_) {
      schedule.deviation.clear();
      set_all(schedule, std::move(step_acquires_));
      note_step(schedule, [](HandleId) { return true; }, /*changed=*/true);
    } else if (!schedule.all.empty()) {  // empty: reset mid-step, the next step records
      follow_step(schedule, step_acquires_);
    }
  } else if (in_step_ && !step_overflowed_ && recording_) {
    current().steps_empty = true;  // a complete step that acquired nothing
  }
  step_acquires_.clear();
  step_overflowed_ = false;
  in_step_ = false;
  recording_ = false;
  position_ = current().coming.order.size();  // what comes next is the next step's
}

void PrefetchPolicy::follow_step(Schedule& schedule, std::vector<HandleId>& acquires) {
  bool followed = acquires == schedule.coming.order;
  if (!followed) {
    // Note [Adopting a step]: a step that repeats one sequence more often than the
    // schedule (a closure run twice) counts as repeating it as often.
    const std::size_t repeats = repeats_of(acquires);
    if (repeats > schedule.repeats && repeats % schedule.repeats == 0) {
      acquires.resize(acquires.size() / repeats * schedule.repeats);
      followed = acquires == schedule.coming.order;
    }
  }
  if (followed) {
    schedule.deviation.clear();
    note_step(schedule, [&](HandleId h) { return schedule.coming.positions.contains(h); },
              /*changed=*/false);
    return;
  }
  const std::unordered_set<HandleId> acquired(acquires.begin(), acquires.end());
  const auto in_step = [&](HandleId h) { return acquired.contains(h); };
  std::vector<HandleId> all;
  if (std::ranges::any_of(acquired, [&](HandleId h) { return !schedule.presence.contains(h); })) {
    all = merge(schedule.all, acquires);  // a new handle: merged in at once
  } else if (acquires == schedule.deviation) {
    all = merge(acquires, schedule.all);  // the order of two steps alike, the rest kept
  } else {
    note_step(schedule, in_step, /*changed=*/false);
    schedule.deviation.swap(acquires);  // the old deviation's buffer serves the next step
    return;
  }
  // The step is at most kMaxStepAcquires long (else it said nothing): taken instead of a
  // merge that would pass the cap, it keeps the schedule within it.
  if (all.size() > kMaxStepAcquires) all = acquires;
  schedule.deviation.clear();
  const bool changed = all != schedule.all;
  if (changed) {
    set_all(schedule, std::move(all));
    adoptions_++;
  }
  note_step(schedule, in_step, changed);
}

void PrefetchPolicy::reset_schedule() {
  moved();
  for (auto& [key, schedule] : schedules_) schedule = Schedule{};
  steps_.clear();
  next_keys_.clear();
  position_ = 0;
}

void PrefetchPolicy::retire(ScheduleKey key) {
  moved();
  // A dead key left in the history would be predicted to run again, and its empty
  // schedule ends the look-ahead there (look_ahead()).
  std::erase(steps_, key);
  std::erase(next_keys_, key);
  if (key == current_key_) {
    current_key_ = 0;
    position_ = 0;
    recording_ = false;
    in_step_ = false;
    step_acquires_.clear();
  }
  if (key == 0) {
    schedules_.at(0) = Schedule{};
  } else {
    schedules_.erase(key);
  }
}

// ---- acquires and handles -------------------------------------------------------------------

void PrefetchPolicy::on_acquire(HandleId h) {
  last_acquire_[h] = ++clock_;
  if (in_step_ && !step_overflowed_) {
    if (step_acquires_.size() < kMaxStepAcquires) {
      step_acquires_.push_back(h);
    } else {
      step_overflowed_ = true;  // the step will change nothing: free its acquires now
      step_acquires_ = {};
    }
  }
  if (recording_) return;
  const Shape& shape = current().coming;
  if (shape.order.empty()) return;
  if (position_ < shape.order.size() && shape.order[position_] == h) {
    position_++;
    if (in_step_) {  // the look-ahead lost its front acquire (Note [Prefetch frontier])
      advances_++;
      if (look_ahead_valid_) look_ahead_.front().begin = position_;
    } else {
      moved();  // between steps the look-ahead's last stretch ends at the position
    }
    return;
  }
  moved();
  off_schedule_++;
  auto it = shape.positions.find(h);
  if (it == shape.positions.end()) return;  // not in the shape: keep the position
  position_ = resync(it->second, position_);
}

void PrefetchPolicy::forget(HandleId h) {
  last_acquire_.erase(h);
  std::erase(step_acquires_, h);
  for (auto& [key, schedule] : schedules_) {
    std::erase(schedule.deviation, h);
    if (!schedule.presence.contains(h)) continue;
    moved();
    std::erase(schedule.all, h);
    schedule.repeats = repeats_of(schedule.all);
    schedule.presence.erase(h);
    // The current shape keeps its position on the same next handle.
    schedule.coming.erase(h, key == current_key_ ? &position_ : nullptr);
    schedule.after.erase(h, nullptr);
  }
}

// ---- the look-ahead -------------------------------------------------------------------------

std::vector<PrefetchPolicy::ScheduleKey> PrefetchPolicy::predict_next_keys() const {
  // The longest suffix of steps_ (up to kContext keys) that also ends earlier, at its
  // latest earlier end j: the steps after j, up to the current one, are taken to repeat.
  constexpr std::size_t kContext = 8;
  const std::size_t n = steps_.size();
  for (std::size_t length = std::min(kContext, n - 1); length >= 1; --length) {
    for (std::size_t j = n - 1; j-- > length - 1;) {
      if (!std::equal(steps_.end() - static_cast<std::ptrdiff_t>(length), steps_.end(),
                      steps_.begin() + static_cast<std::ptrdiff_t>(j + 1 - length))) {
        continue;
      }
      // steps_[j + 1 .. n - 2]: the keys between the current step and its next one.
      return {steps_.begin() + static_cast<std::ptrdiff_t>(j + 1), steps_.end() - 1};
    }
  }
  return {};
}

const std::vector<PrefetchPolicy::Stretch>& PrefetchPolicy::look_ahead() const {
  if (look_ahead_valid_) return look_ahead_;
  const Schedule& now = current();
  look_ahead_.assign({{&now.coming, position_, now.coming.order.size()}});
  for (ScheduleKey key : next_keys_) {
    const Schedule& schedule = schedules_.at(key);
    if (schedule.all.empty()) {
      if (schedule.steps_empty) continue;  // its steps acquire nothing: on to the next
      break;  // not recorded yet: nothing known beyond
    }
    // The current key again (D D G: the second D) steps after the current step.
    const Shape& shape = key == current_key_ ? schedule.next() : schedule.coming;
    look_ahead_.push_back({&shape, 0, shape.order.size()});
  }
  if (in_step_) {
    const Shape& next = now.next();
    look_ahead_.push_back({&next, 0, next.order.size()});
  } else {  // `coming` is the next step's already
    look_ahead_.push_back({&now.coming, 0, position_});
  }
  look_ahead_valid_ = true;
  return look_ahead_;
}

std::size_t PrefetchPolicy::eviction_score(HandleId h) const {
  if (replaying()) {
    std::size_t distance = 0;
    for (const Stretch& stretch : look_ahead()) {
      auto it = stretch.shape->positions.find(h);
      if (it != stretch.shape->positions.end()) {
        auto next = std::lower_bound(it->second.begin(), it->second.end(), stretch.begin);
        if (next != it->second.end() && *next < stretch.end)
          return distance + (*next - stretch.begin);
      }
      distance += stretch.end - stretch.begin;
    }
    return kNever - 1;
  }
  auto it = last_acquire_.find(h);
  if (it == last_acquire_.end()) return kNever - 1;
  return static_cast<std::size_t>(clock_ - it->second);
}

namespace {
constexpr std::uint64_t kNeverUsedKey = std::numeric_limits<std::uint64_t>::max();
}  // namespace

std::uint64_t PrefetchPolicy::eviction_key(HandleId h) const {
  const std::size_t score = eviction_score(h);
  if (score == kNever - 1) return kNeverUsedKey;
  if (replaying()) return advances_ + score;
  return kNeverUsedKey - 1 - (clock_ - score);  // the clock of its last acquire
}

std::size_t PrefetchPolicy::eviction_score_of_key(std::uint64_t key) const {
  if (key == kNeverUsedKey) return kNever - 1;
  if (replaying()) return static_cast<std::size_t>(key - advances_);
  return static_cast<std::size_t>(clock_ - (kNeverUsedKey - 1 - key));
}

std::vector<PrefetchPolicy::HandleId> PrefetchPolicy::upcoming(std::size_t max) const {
  std::vector<HandleId> out;
  if (max == 0) return out;
  std::unordered_set<HandleId> seen;
  visit_upcoming(0, kNever, [&](HandleId h) {
    if (seen.insert(h).second) out.push_back(h);
    return out.size() < max;
  });
  return out;
}

}  // namespace tidepool
