// PrefetchPolicy: the first step is recorded, later steps replay it; eviction follows
// the furthest next use; deviations re-sync; unknown handles and LRU before a schedule;
// each schedule key (an optimizer sharing the store) has its own schedule.
#include <gtest/gtest.h>

#include "tiering/prefetch_policy.h"

namespace tidepool {
namespace {

using Ids = std::vector<PrefetchPolicy::HandleId>;

PrefetchPolicy recorded(const Ids& order) {
  PrefetchPolicy p;
  p.begin_step();
  for (auto h : order) p.on_acquire(h);
  p.end_step();
  return p;
}

TEST(PrefetchPolicy, FirstStepBecomesTheSchedule) {
  PrefetchPolicy p = recorded({1, 2, 3, 2, 4});
  EXPECT_EQ(p.schedule_length(), 5u);
  EXPECT_TRUE(p.replaying());
  p.begin_step();
  EXPECT_EQ(p.upcoming(10), (Ids{1, 2, 3, 4}));
  p.on_acquire(1);
  EXPECT_EQ(p.upcoming(2), (Ids{2, 3}));
}

TEST(PrefetchPolicy, EvictsTheFurthestNextUse) {
  PrefetchPolicy p = recorded({1, 2, 3, 4});
  p.begin_step();
  p.on_acquire(1);
  p.on_acquire(2);
  // Position is at 3: next uses are 3 -> 0, 4 -> 1, 1 -> 2, 2 -> 3.
  EXPECT_EQ(p.eviction_score(3), 0u);
  EXPECT_EQ(p.eviction_score(4), 1u);
  EXPECT_EQ(p.eviction_score(1), 2u);
  EXPECT_EQ(p.eviction_score(2), 3u);
  EXPECT_GT(p.eviction_score(99), p.eviction_score(2));  // not in the schedule: first out
}

TEST(PrefetchPolicy, DeviationResyncsToTheNextOccurrence) {
  PrefetchPolicy p = recorded({1, 2, 3, 4, 5});
  p.begin_step();
  p.on_acquire(1);
  p.on_acquire(4);  // skipped 2 and 3
  EXPECT_EQ(p.off_schedule_acquires(), 1u);
  EXPECT_EQ(p.upcoming(1), (Ids{5}));
}

TEST(PrefetchPolicy, WithoutScheduleEvictsLeastRecentlyUsed) {
  PrefetchPolicy p;
  p.on_acquire(1);
  p.on_acquire(2);
  p.on_acquire(3);
  EXPECT_GT(p.eviction_score(1), p.eviction_score(2));
  EXPECT_GT(p.eviction_score(2), p.eviction_score(3));
  EXPECT_TRUE(p.upcoming(4).empty());
}

TEST(PrefetchPolicy, ForgetRemovesAHandleAndKeepsThePosition) {
  PrefetchPolicy p = recorded({1, 2, 3});
  p.begin_step();
  p.on_acquire(1);
  p.forget(2);
  EXPECT_EQ(p.schedule_length(), 2u);
  EXPECT_EQ(p.upcoming(5), (Ids{3, 1}));
}

TEST(PrefetchPolicy, EmptyStepRecordsNothing) {
  PrefetchPolicy p;
  p.begin_step();
  p.end_step();
  EXPECT_FALSE(p.replaying());
  p.begin_step();
  EXPECT_TRUE(p.recording());
}

TEST(PrefetchPolicy, EachKeyRecordsAndReplaysItsOwnScheduleAndLooksAheadToTheNext) {
  // Two optimizers on one store, stepping in turn: key 1 owns handles 1-3, key 2 owns 7-8.
  PrefetchPolicy p;
  for (int round = 0; round < 3; ++round) {
    p.begin_step(1);
    EXPECT_EQ(p.recording(), round == 0);
    if (round > 0) {
      EXPECT_EQ(p.upcoming(10), (Ids{1, 2, 3, 7, 8}));
      EXPECT_EQ(p.eviction_score(7), 3u);  // after key 1's three acquires
    }
    for (auto h : {1, 2, 3}) p.on_acquire(h);
    if (round > 0) {
      // Key 1's step is done: the look-ahead is key 2's step, then key 1's again.
      EXPECT_EQ(p.upcoming(2), (Ids{7, 8}));
      EXPECT_EQ(p.eviction_score(7), 0u);
      EXPECT_EQ(p.eviction_score(1), 2u);
    }
    p.end_step();
    p.begin_step(2);
    EXPECT_EQ(p.recording(), round == 0);
    if (round > 0) {
      EXPECT_EQ(p.upcoming(10), (Ids{7, 8, 1, 2, 3}));
      EXPECT_EQ(p.eviction_score(8), 1u);
      EXPECT_EQ(p.eviction_score(1), 2u);
      EXPECT_EQ(p.eviction_score(42), PrefetchPolicy::kNever - 1);  // on no schedule
    }
    for (auto h : {7, 8}) p.on_acquire(h);
    p.end_step();
  }
  EXPECT_EQ(p.off_schedule_acquires(), 0u);
  EXPECT_EQ(p.schedule_length(), 2u);  // key 2's, the current one
}

TEST(PrefetchPolicy, OneKeyLooksAheadToItsOwnNextStep) {
  PrefetchPolicy p = recorded({1, 2, 3});
  p.begin_step();
  for (auto h : {1, 2}) p.on_acquire(h);
  EXPECT_EQ(p.upcoming(10), (Ids{3, 1, 2}));
  p.on_acquire(3);
  EXPECT_EQ(p.upcoming(1), (Ids{1}));
  p.end_step();
  EXPECT_EQ(p.upcoming(10), (Ids{1, 2, 3}));
  EXPECT_EQ(p.eviction_score(3), 2u);
}

TEST(PrefetchPolicy, ARepeatingPatternOfStepsIsPredicted) {
  // A critic stepped twice per generator step: D D G D D G ... (D owns 1-2, G owns 9).
  PrefetchPolicy p;
  const std::vector<std::pair<PrefetchPolicy::ScheduleKey, Ids>> cycle = {
      {1, {1, 2}}, {1, {1, 2}}, {2, {9}}};
  std::vector<Ids> upcoming_at_start;
  for (int round = 0; round < 3; ++round) {
    for (const auto& [key, handles] : cycle) {
      p.begin_step(key);
      upcoming_at_start.push_back(p.upcoming(10));
      for (auto h : handles) p.on_acquire(h);
      p.end_step();
    }
  }
  // The last round: each step looks ahead to the one that really follows it.
  EXPECT_EQ(upcoming_at_start[6], (Ids{1, 2, 9}));  // first D: then D, then G
  EXPECT_EQ(upcoming_at_start[7], (Ids{1, 2, 9}));  // second D: then G
  EXPECT_EQ(upcoming_at_start[8], (Ids{9, 1, 2}));  // G: then D
  p.begin_step(1);
  for (auto h : {1, 2}) p.on_acquire(h);
  EXPECT_EQ(p.upcoming(1), (Ids{1}));  // the first D of the cycle: the second D is next
  p.end_step();
  p.begin_step(1);
  for (auto h : {1, 2}) p.on_acquire(h);
  EXPECT_EQ(p.upcoming(1), (Ids{9}));  // the second D: the generator's step is next
  EXPECT_LT(p.eviction_score(9), p.eviction_score(1));
  p.end_step();
}

TEST(PrefetchPolicy, ForgetAndResetReachEveryKey) {
  PrefetchPolicy p;
  p.begin_step(1);
  for (auto h : {1, 2, 3}) p.on_acquire(h);
  p.end_step();
  p.begin_step(2);
  for (auto h : {2, 4}) p.on_acquire(h);
  p.end_step();
  EXPECT_EQ(p.upcoming(10), (Ids{2, 4}));  // between steps: key 2 again (no pattern yet), cached
  p.forget(2);
  EXPECT_EQ(p.upcoming(10), (Ids{4}));  // ...and the cache saw the forget
  EXPECT_EQ(p.schedule_length(), 1u);
  p.begin_step(1);
  EXPECT_EQ(p.upcoming(10), (Ids{1, 3, 4}));  // then key 2's step, as last time
  p.end_step();
  EXPECT_FALSE(p.upcoming(10).empty());
  p.reset_schedule();
  EXPECT_TRUE(p.upcoming(10).empty());
  p.begin_step(2);
  EXPECT_TRUE(p.recording());
  p.end_step();
  p.begin_step(1);
  EXPECT_TRUE(p.recording());
}

TEST(PrefetchPolicy, ARetiredKeyIsNeitherKeptNorPredicted) {
  // Optimizers A (key 1, handles 1-2) and B (key 2, handle 9) step in turn; then B goes.
  PrefetchPolicy p;
  for (int round = 0; round < 3; ++round) {
    p.begin_step(1);
    for (auto h : {1, 2}) p.on_acquire(h);
    p.end_step();
    p.begin_step(2);
    p.on_acquire(9);
    p.end_step();
  }
  EXPECT_EQ(p.schedule_count(), 3u);  // keys 0, 1, 2
  p.forget(9);                        // B's state goes first, then B
  p.retire(2);
  EXPECT_EQ(p.schedule_count(), 2u);
  EXPECT_EQ(p.schedule_length(), 0u);  // key 2 was current: key 0 (empty) is now
  p.begin_step(1);
  EXPECT_FALSE(p.recording());
  // A's history no longer says B comes next: A's own next step does, so the end of
  // A's step looks ahead to its own start (with B in the history, the look-ahead ended
  // at B's empty schedule).
  p.on_acquire(1);
  p.on_acquire(2);
  EXPECT_EQ(p.upcoming(10), (Ids{1, 2}));
  EXPECT_EQ(p.eviction_score(1), 0u);
  p.end_step();
  // A key that steps again after all records anew.
  p.begin_step(2);
  EXPECT_TRUE(p.recording());
  p.on_acquire(5);
  p.end_step();
  EXPECT_EQ(p.schedule_length(), 1u);
  // The store's own key is emptied, not dropped: it stays the fallback.
  p.retire(0);
  EXPECT_EQ(p.schedule_count(), 3u);
  p.begin_step();
  EXPECT_TRUE(p.recording());
  p.end_step();
  EXPECT_EQ(p.off_schedule_acquires(), 0u);
}

}  // namespace
}  // namespace tidepool
