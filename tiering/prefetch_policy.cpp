// PrefetchPolicy: record the first step's acquire order, replay it for prefetch and
// furthest-next-use eviction, and adopt a later step's order when the workload changed
// for good (Note [Adopting a step]). See prefetch_policy.h.
#include "tiering/prefetch_policy.h"

#include <algorithm>
#include <unordered_set>

namespace tidepool {

void PrefetchPolicy::Schedule::set(std::vector<HandleId> new_order) {
  order = std::move(new_order);
  positions.clear();
  for (std::size_t i = 0; i < order.size(); ++i) positions[order[i]].push_back(i);
}

void PrefetchPolicy::begin_step(ScheduleKey key) {
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
  recording_ = schedules_[key].order.empty();
}

void PrefetchPolicy::end_step() {
  moved();
  if (in_step_ && !step_overflowed_ && !step_acquires_.empty()) {
    Schedule& schedule = current();
    if (recording_) {
      schedule.set(std::move(step_acquires_));
    } else if (!schedule.order.empty()) {  // empty: reset mid-step, the next step records
      follow_step(schedule, step_acquires_);
    }
  }
  step_acquires_.clear();
  step_overflowed_ = false;
  in_step_ = false;
  recording_ = false;
  position_ = current().order.size();  // what comes next is the next step's
}

void PrefetchPolicy::follow_step(Schedule& schedule, std::vector<HandleId>& acquires) {
  if (acquires == schedule.order) {
    schedule.deviation.clear();
    return;
  }
  // Note [Adopting a step]: a complete step with a new handle is adopted at once.
  std::unordered_set<HandleId> acquired(acquires.begin(), acquires.end());
  const bool has_new_handle = std::ranges::any_of(
      acquired, [&](HandleId h) { return !schedule.positions.contains(h); });
  const bool has_every_scheduled_handle = std::ranges::all_of(
      schedule.positions, [&](const auto& entry) { return acquired.contains(entry.first); });
  if ((has_new_handle && has_every_scheduled_handle) || acquires == schedule.deviation) {
    schedule.set(std::move(acquires));
    schedule.deviation.clear();
    adoptions_++;
    return;
  }
  schedule.deviation.swap(acquires);  // the old deviation's buffer serves the next step
}

void PrefetchPolicy::reset_schedule() {
  moved();
  for (auto& [key, schedule] : schedules_) {
    schedule.set({});
    schedule.deviation.clear();
  }
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
    schedules_.at(0).set({});
  } else {
    schedules_.erase(key);
  }
}

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
  const Schedule& schedule = current();
  if (schedule.order.empty()) return;
  moved();
  if (position_ < schedule.order.size() && schedule.order[position_] == h) {
    position_++;
    return;
  }
  off_schedule_++;
  auto it = schedule.positions.find(h);
  if (it == schedule.positions.end()) return;  // unknown handle: keep the position
  const auto& pos = it->second;
  auto next = std::lower_bound(pos.begin(), pos.end(), position_);
  position_ = (next != pos.end() ? *next : pos.front()) + 1;
}

void PrefetchPolicy::forget(HandleId h) {
  last_acquire_.erase(h);
  std::erase(step_acquires_, h);
  for (auto& [key, schedule] : schedules_) {
    std::erase(schedule.deviation, h);
    if (!schedule.positions.contains(h)) continue;
    moved();
    // Rebuild the schedule without it; the current one keeps its position on the same
    // next handle.
    std::vector<HandleId> kept;
    std::size_t kept_before_position = 0;
    for (std::size_t i = 0; i < schedule.order.size(); ++i) {
      if (schedule.order[i] == h) continue;
      if (i < position_) kept_before_position++;
      kept.push_back(schedule.order[i]);
    }
    schedule.set(std::move(kept));
    if (key == current_key_) position_ = kept_before_position;
  }
}

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
  look_ahead_.assign({{&now, position_, now.order.size()}});
  for (ScheduleKey key : next_keys_) {
    const Schedule& schedule = schedules_.at(key);
    if (schedule.order.empty()) break;  // not recorded yet: nothing known beyond
    look_ahead_.push_back({&schedule, 0, schedule.order.size()});
  }
  look_ahead_.push_back({&now, 0, position_});
  look_ahead_valid_ = true;
  return look_ahead_;
}

std::size_t PrefetchPolicy::eviction_score(HandleId h) const {
  if (replaying()) {
    std::size_t distance = 0;
    for (const Stretch& stretch : look_ahead()) {
      auto it = stretch.schedule->positions.find(h);
      if (it != stretch.schedule->positions.end()) {
        auto next = std::lower_bound(it->second.begin(), it->second.end(), stretch.begin);
        if (next != it->second.end() && *next < stretch.end) return distance + (*next - stretch.begin);
      }
      distance += stretch.end - stretch.begin;
    }
    return kNever - 1;
  }
  auto it = last_acquire_.find(h);
  if (it == last_acquire_.end()) return kNever - 1;
  return static_cast<std::size_t>(clock_ - it->second);
}

std::vector<PrefetchPolicy::HandleId> PrefetchPolicy::upcoming(std::size_t max) const {
  std::vector<HandleId> out;
  if (!replaying()) return out;
  std::unordered_set<HandleId> seen;
  for (const Stretch& stretch : look_ahead()) {
    for (std::size_t i = stretch.begin; i < stretch.end && out.size() < max; ++i) {
      const HandleId h = stretch.schedule->order[i];
      if (seen.insert(h).second) out.push_back(h);
    }
  }
  return out;
}

}  // namespace tidepool
