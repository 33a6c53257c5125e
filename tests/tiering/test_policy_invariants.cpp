// The prefetch policy's readers of the look-ahead agree with one another through random
// use: steps of several keys that follow their shapes, deviate, drop or add handles, are
// left unfinished; acquires between steps; handles forgotten, keys retired, schedules
// reset. After every operation, for every handle:
//   - replaying, eviction_score(h) is the index of h's first acquire along the look-ahead
//     visit_upcoming walks (kNever - 1 when it is not there), and rest_of_step() counts the
//     acquires of the current step's part of it;
//   - eviction_score_of_key(eviction_key(h)) is eviction_score(h), and a key taken earlier
//     in the same key epoch, of a handle not acquired since, still gives it (Note
//     [Eviction keys]: the store's heap keeps such keys);
//   - a mark of an earlier walk covers only acquires still at the front of the look-ahead,
//     the ones it walked (Note [Prefetch frontier]);
//   - upcoming(n) lists distinct handles in the order of their first acquire there.
// Size: TIDEPOOL_TEST_SCALE x 20k operations; TIDEPOOL_TEST_SEED draws other sequences.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "tests/support/test_scale.h"
#include "tests/support/test_seed.h"
#include "tiering/prefetch_policy.h"

namespace tidepool {
namespace {

using HandleId = PrefetchPolicy::HandleId;
using Ids = std::vector<HandleId>;

constexpr HandleId kHandles = 14;  // ids 1..kHandles; a forgotten one may come back
constexpr std::size_t kWalkMax = PrefetchPolicy::kNever;  // the whole look-ahead

Ids look_ahead_of(const PrefetchPolicy& p, std::size_t from = 0) {
  Ids seen;
  p.visit_upcoming(from, kWalkMax, [&](HandleId h) {
    seen.push_back(h);
    return true;
  });
  return seen;
}

class PolicyChecker {
 public:
  explicit PolicyChecker(const PrefetchPolicy& p) : p_(p) {}

  // After any operation: every invariant of the top of this file.
  void check(const std::string& where) {
    const Ids ahead = look_ahead_of(p_);
    if (p_.replaying()) {
      ASSERT_LE(p_.rest_of_step(), ahead.size()) << where;
      for (HandleId h = 1; h <= kHandles; ++h) {
        const auto first = std::find(ahead.begin(), ahead.end(), h);
        const std::size_t expected = first == ahead.end()
                                         ? PrefetchPolicy::kNever - 1
                                         : static_cast<std::size_t>(first - ahead.begin());
        ASSERT_EQ(p_.eviction_score(h), expected) << where << ", handle " << h;
      }
    } else {
      ASSERT_TRUE(ahead.empty()) << where << ": a look-ahead while not replaying";
      ASSERT_EQ(p_.rest_of_step(), 0u) << where;
    }
    if (p_.eviction_key_epoch() != epoch_) {
      keys_.clear();
      epoch_ = p_.eviction_key_epoch();
    }
    for (HandleId h = 1; h <= kHandles; ++h) {
      const std::size_t score = p_.eviction_score(h);
      ASSERT_EQ(p_.eviction_score_of_key(p_.eviction_key(h)), score) << where << ", " << h;
      if (auto it = keys_.find(h); it != keys_.end()) {
        ASSERT_EQ(p_.eviction_score_of_key(it->second), score)
            << where << ": the key handle " << h << " had earlier in this epoch";
      } else {
        keys_[h] = p_.eviction_key(h);
      }
    }
    // The mark of the last walk: what it still covers is at the front now.
    const std::size_t covered = p_.still_covered(mark_);
    ASSERT_LE(covered, ahead.size()) << where;
    ASSERT_LE(covered, marked_walk_.size()) << where;
    for (std::size_t i = 0; i < covered; ++i) {
      ASSERT_EQ(ahead[i], marked_walk_[marked_walk_.size() - covered + i])
          << where << ": the mark covers acquire " << i << " of the look-ahead, which changed";
    }
    // A new walk, from the front, up to a random-ish depth, marked for later.
    const std::size_t depth = std::min<std::size_t>(ahead.size(), 1 + checks_++ % 9);
    marked_walk_.assign(ahead.begin(), ahead.begin() + static_cast<std::ptrdiff_t>(depth));
    mark_ = p_.mark(depth);
    const Ids listed = p_.upcoming(5);
    Ids expected_listed;
    for (HandleId h : ahead) {
      if (expected_listed.size() == 5) break;
      if (std::find(expected_listed.begin(), expected_listed.end(), h) == expected_listed.end())
        expected_listed.push_back(h);
    }
    ASSERT_EQ(listed, expected_listed) << where;
  }

  // `h` was acquired: its key changes, the others' hold.
  void acquired(HandleId h) { keys_.erase(h); }

 private:
  const PrefetchPolicy& p_;
  std::uint64_t epoch_ = ~std::uint64_t{0};
  std::map<HandleId, std::uint64_t> keys_;
  PrefetchPolicy::LookAheadMark mark_{};
  Ids marked_walk_;
  std::size_t checks_ = 0;
};

TEST(PolicyInvariants, LookAheadScoresKeysAndMarksAgreeThroughRandomUse) {
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(20261204));
  auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };

  PrefetchPolicy p;
  PolicyChecker checker(p);
  // Each key's usual step, over handles of its own and some shared.
  std::map<PrefetchPolicy::ScheduleKey, Ids> usual{
      {0, {1, 2, 3, 4, 5, 6}}, {1, {7, 8, 3, 9, 10}}, {2, {11, 12, 13, 14, 2, 11}}};
  const long ops = test_support::scaled(20000);
  long op = 0;
  auto acquire = [&](HandleId h) {
    p.on_acquire(h);
    checker.acquired(h);
    checker.check("op " + std::to_string(op) + ": acquire " + std::to_string(h));
  };
  while (op < ops && !::testing::Test::HasFatalFailure()) {
    ++op;
    const std::size_t what = pick(100);
    if (what < 70) {  // a step of one key, mostly in the usual pattern A A B A A B C
      const PrefetchPolicy::ScheduleKey key = chance(80) ? (op % 7 == 6 ? 2 : op % 3 == 2 ? 1 : 0)
                                                         : pick(3);
      Ids order = usual[key];
      if (chance(15) && order.size() > 2) {
        order.erase(order.begin() + static_cast<long>(pick(order.size())));
      }
      if (chance(10)) std::swap(order[pick(order.size())], order[pick(order.size())]);
      if (chance(10)) order.push_back(1 + pick(kHandles));
      if (chance(5) && order.size() <= 8) {  // a second pass over the state
        order.insert(order.end(), order.begin(), order.end());
      }
      if (chance(5) && order.size() >= 3 && order.size() <= 8) usual[key] = order;  // for good
      p.begin_step(key);
      checker.check("op " + std::to_string(op) + ": begin_step " + std::to_string(key));
      const bool unfinished = chance(5);
      const std::size_t n = unfinished ? pick(order.size() + 1) : order.size();
      for (std::size_t i = 0; i < n && !::testing::Test::HasFatalFailure(); ++i) {
        acquire(order[i]);
      }
      if (!unfinished) {
        p.end_step();
        checker.check("op " + std::to_string(op) + ": end_step");
      }
    } else if (what < 85) {  // acquires between steps
      acquire(1 + pick(kHandles));
    } else if (what < 93) {
      const HandleId h = 1 + pick(kHandles);
      p.forget(h);
      checker.acquired(h);  // gone: a key of it taken before says nothing
      checker.check("op " + std::to_string(op) + ": forget " + std::to_string(h));
    } else if (what < 98) {
      const auto key = static_cast<PrefetchPolicy::ScheduleKey>(pick(3));
      p.retire(key);
      checker.check("op " + std::to_string(op) + ": retire " + std::to_string(key));
    } else {
      p.reset_schedule();
      checker.check("op " + std::to_string(op) + ": reset_schedule");
    }
  }
  EXPECT_GT(p.schedule_adoptions(), 0u);  // the workload's changes were followed
  EXPECT_GT(p.off_schedule_acquires(), 0u);
}

}  // namespace
}  // namespace tidepool
