// PrefetchPolicy: record the first step's acquire order, replay it for prefetch and
// furthest-next-use eviction. See prefetch_policy.h.
#include "tiering/prefetch_policy.h"

#include <algorithm>
#include <unordered_set>

namespace tidepool {

void PrefetchPolicy::begin_step() {
  in_step_ = true;
  position_ = 0;
  if (schedule_.empty()) {
    recording_ = true;
    recording_buffer_.clear();
  }
}

void PrefetchPolicy::end_step() {
  if (recording_ && !recording_buffer_.empty()) {
    schedule_ = std::move(recording_buffer_);
    positions_.clear();
    for (std::size_t i = 0; i < schedule_.size(); ++i) positions_[schedule_[i]].push_back(i);
  }
  recording_buffer_.clear();
  recording_ = false;
  in_step_ = false;
  position_ = 0;
}

void PrefetchPolicy::reset_schedule() {
  schedule_.clear();
  positions_.clear();
  position_ = 0;
}

void PrefetchPolicy::on_acquire(HandleId h) {
  last_acquire_[h] = ++clock_;
  if (recording_) {
    recording_buffer_.push_back(h);
    return;
  }
  if (schedule_.empty()) return;
  if (schedule_[position_] == h) {
    position_ = (position_ + 1) % schedule_.size();
    return;
  }
  off_schedule_++;
  auto it = positions_.find(h);
  if (it == positions_.end()) return;  // unknown handle: keep the position
  const auto& pos = it->second;
  auto next = std::lower_bound(pos.begin(), pos.end(), position_);
  const std::size_t at = next != pos.end() ? *next : pos.front();
  position_ = (at + 1) % schedule_.size();
}

void PrefetchPolicy::forget(HandleId h) {
  last_acquire_.erase(h);
  std::erase(recording_buffer_, h);
  if (positions_.erase(h) == 0) return;
  // Rebuild the schedule without it, keeping the position on the same next handle.
  std::vector<HandleId> kept;
  std::size_t new_position = 0;
  for (std::size_t i = 0; i < schedule_.size(); ++i) {
    if (i == position_) new_position = kept.size();
    if (schedule_[i] != h) kept.push_back(schedule_[i]);
  }
  schedule_ = std::move(kept);
  positions_.clear();
  for (std::size_t i = 0; i < schedule_.size(); ++i) positions_[schedule_[i]].push_back(i);
  position_ = schedule_.empty() ? 0 : new_position % schedule_.size();
}

std::size_t PrefetchPolicy::eviction_score(HandleId h) const {
  if (!schedule_.empty() && !recording_) {
    auto it = positions_.find(h);
    if (it == positions_.end()) return kNever - 1;
    const auto& pos = it->second;
    auto next = std::lower_bound(pos.begin(), pos.end(), position_);
    if (next != pos.end()) return *next - position_;
    return schedule_.size() - position_ + pos.front();
  }
  auto it = last_acquire_.find(h);
  if (it == last_acquire_.end()) return kNever - 1;
  return static_cast<std::size_t>(clock_ - it->second);
}

std::vector<PrefetchPolicy::HandleId> PrefetchPolicy::upcoming(std::size_t max) const {
  std::vector<HandleId> out;
  if (!replaying()) return out;
  std::unordered_set<HandleId> seen;
  for (std::size_t k = 0; k < schedule_.size() && out.size() < max; ++k) {
    const HandleId h = schedule_[(position_ + k) % schedule_.size()];
    if (seen.insert(h).second) out.push_back(h);
  }
  return out;
}

}  // namespace tidepool
