// PrefetchPolicy: the first step is recorded, later steps replay it; eviction follows
// the furthest next use; deviations re-sync; unknown handles and LRU before a schedule;
// each schedule key (an optimizer sharing the store) has its own schedule; a schedule
// follows steps that changed for good and ignores one-off ones (Note [Adopting a step]);
// steps of several shapes each replay their own (Note [Steps of several shapes]).
#include <gtest/gtest.h>

#include <algorithm>

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

// One complete step of `key` acquiring `order`.
void step(PrefetchPolicy& p, const Ids& order, PrefetchPolicy::ScheduleKey key = 0) {
  p.begin_step(key);
  for (auto h : order) p.on_acquire(h);
  p.end_step();
}

// What the schedule of the key stepped last looks like from the start of its next step
// (the whole of it, when its handles are distinct).
Ids schedule_at_start(PrefetchPolicy& p, std::size_t max = 10) {
  p.begin_step();
  Ids out = p.upcoming(max);
  p.end_step();  // no acquires: changes nothing
  return out;
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

// Three optimizers on one store step in turn; the second has no gradients, so its steps
// acquire nothing. The look-ahead from the first goes past the second's empty steps to
// the third's: it stopped there, as at a key not recorded yet, so the third's state was
// never prefetched and was the first to be evicted, every step. Once the second's steps
// acquire something, they are recorded and replayed as any key's.
TEST(PrefetchPolicy, AKeyWhoseStepsAcquireNothingDoesNotHideTheKeysAfterIt) {
  PrefetchPolicy p;
  for (int round = 0; round < 3; ++round) {
    p.begin_step(1);
    for (auto h : {1, 2}) p.on_acquire(h);
    if (round > 0) {
      EXPECT_EQ(p.upcoming(2), (Ids{7, 8})) << "round " << round;
      EXPECT_LT(p.eviction_score(7), p.eviction_score(1)) << "round " << round;
    }
    p.end_step();
    step(p, {}, 2);
    step(p, {7, 8}, 3);
  }
  step(p, {1, 2}, 1);
  step(p, {5}, 2);  // the second optimizer's parameters got gradients
  step(p, {7, 8}, 3);
  p.begin_step(1);
  for (auto h : {1, 2}) p.on_acquire(h);
  EXPECT_EQ(p.upcoming(3), (Ids{5, 7, 8}));
  p.end_step();
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

// ---- following the workload (Note [Adopting a step]) --------------------------------

TEST(PrefetchPolicy, AHandleCreatedAfterTheFirstStepJoinsTheSchedule) {
  // State created lazily in step 2 (handle 4, used between 1 and 2 from then on).
  PrefetchPolicy p = recorded({1, 2, 3});
  p.begin_step();
  p.on_acquire(1);
  EXPECT_EQ(p.eviction_score(4), PrefetchPolicy::kNever - 1);  // unknown yet
  for (auto h : {4, 2, 3}) p.on_acquire(h);
  p.end_step();
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(p.schedule_length(), 4u);
  // Step 3 prefetches it and scores it by its next use like any other handle.
  p.begin_step();
  EXPECT_EQ(p.upcoming(10), (Ids{1, 4, 2, 3}));
  EXPECT_EQ(p.eviction_score(4), 1u);
  p.on_acquire(1);
  EXPECT_EQ(p.upcoming(1), (Ids{4}));
  EXPECT_EQ(p.eviction_score(4), 0u);
  for (auto h : {4, 2, 3}) p.on_acquire(h);
  p.end_step();
  EXPECT_EQ(p.off_schedule_acquires(), 1u);  // step 2's acquire of 4 only
  EXPECT_EQ(p.schedule_adoptions(), 1u);
}

TEST(PrefetchPolicy, HandlesReplacingForgottenOnesJoinTheSchedule) {
  // Parameters replaced (an optimizer's param group swapped): 2 and 3 go, 5 and 6 come.
  PrefetchPolicy p = recorded({1, 2, 3});
  p.forget(2);
  p.forget(3);
  EXPECT_EQ(p.schedule_length(), 1u);
  step(p, {1, 5, 6});
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 5, 6}));
}

TEST(PrefetchPolicy, AOneOffStepKeepsTheSchedule) {
  PrefetchPolicy p = recorded({1, 2, 3, 4});
  step(p, {1, 3, 2, 4});              // reordered once
  step(p, {1, 2, 3, 4});
  step(p, {1, 3, 2, 4});              // again, but not in consecutive steps
  step(p, {1, 2, 3, 4, 1, 2, 3, 4});  // a closure that ran twice
  step(p, {2, 1, 3, 4});              // two odd steps in a row, but not alike
  step(p, {1, 2});                    // a step that threw part-way (StepScope ends it)
  EXPECT_EQ(p.schedule_adoptions(), 0u);
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 2, 3, 4}));
  EXPECT_EQ(p.schedule_length(), 4u);
}

TEST(PrefetchPolicy, AStepThatThrewAfterANewHandleAddsItAndKeepsTheRest) {
  // Handle 9 was created in a step that then threw: 9 is merged in where the step
  // acquired it, and the rest of the schedule, which the step never reached, stays...
  PrefetchPolicy p = recorded({1, 2, 3});
  step(p, {1, 9});
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 9, 2, 3}));
  // ...so the next complete step follows it.
  const auto off_before = p.off_schedule_acquires();
  step(p, {1, 9, 2, 3});
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(p.off_schedule_acquires(), off_before);
}

TEST(PrefetchPolicy, APersistentReorderingIsAdoptedAfterTwoSteps) {
  PrefetchPolicy p = recorded({1, 2, 3, 4});
  step(p, {4, 3, 2, 1});
  EXPECT_EQ(p.schedule_adoptions(), 0u);
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 2, 3, 4}));  // one step proves nothing yet
  step(p, {4, 3, 2, 1});
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(schedule_at_start(p), (Ids{4, 3, 2, 1}));
  // The replay now follows it: no more re-syncs.
  const auto off_before = p.off_schedule_acquires();
  step(p, {4, 3, 2, 1});
  step(p, {4, 3, 2, 1});
  EXPECT_EQ(p.off_schedule_acquires(), off_before);
  EXPECT_EQ(p.schedule_adoptions(), 1u);
}

TEST(PrefetchPolicy, StateNoLongerUsedLeavesTheReplayAfterThreeSteps) {
  // Handle 2's parameter was frozen: its state lives on but is not acquired any more.
  // Absent three steps running, it is predicted absent (Note [Steps of several shapes]);
  // two steps without it could be two odd ones.
  PrefetchPolicy p = recorded({1, 2, 3});
  step(p, {1, 3});
  step(p, {1, 3});
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 2, 3}));
  step(p, {1, 3});
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 3}));
  const auto off_before = p.off_schedule_acquires();
  step(p, {1, 3});
  EXPECT_EQ(p.off_schedule_acquires(), off_before);
  // Unused for as many steps as a presence holds, it leaves the schedule itself: back
  // after that, it is a new handle again, merged in (an adoption).
  for (int i = 0; i < 64; ++i) step(p, {1, 3});
  const auto adoptions_before = p.schedule_adoptions();
  step(p, {1, 2, 3});
  EXPECT_EQ(p.schedule_adoptions(), adoptions_before + 1);
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 2, 3}));
}

TEST(PrefetchPolicy, StepsThatSayNothingKeepTheScheduleAndTheDeviation) {
  PrefetchPolicy p = recorded({1, 2, 3});
  step(p, {3, 2, 1});  // a deviation, remembered
  step(p, {});         // no acquires
  // Unfinished: begun again before it ended (with a new handle and the deviation).
  p.begin_step();
  for (auto h : {3, 2, 1, 9}) p.on_acquire(h);
  p.begin_step();
  EXPECT_EQ(p.upcoming(10), (Ids{1, 2, 3}));  // the replay starts over
  p.end_step();                               // this step made no acquire
  EXPECT_EQ(p.schedule_adoptions(), 0u);
  EXPECT_EQ(p.schedule_length(), 3u);
  // None of them broke the pair: the second step like the first is adopted.
  step(p, {3, 2, 1});
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(schedule_at_start(p), (Ids{3, 2, 1}));
}

TEST(PrefetchPolicy, AForgottenHandleLeavesTheRememberedDeviationToo) {
  PrefetchPolicy p = recorded({1, 2, 3});
  step(p, {3, 2, 1});
  p.forget(2);
  step(p, {3, 1});  // the same deviation without the handle that is gone
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(schedule_at_start(p), (Ids{3, 1}));
}

TEST(PrefetchPolicy, ATruncatedFirstRecordingIsReplacedByTheNextCompleteStep) {
  // The first step threw after two acquires; StepScope still ended it.
  PrefetchPolicy p = recorded({1, 2});
  step(p, {1, 2, 3, 4});
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 2, 3, 4}));
}

TEST(PrefetchPolicy, AStepLongerThanTheCapChangesNothing) {
  // A store whose end_step never comes: the step stops recording at the cap. Shorter,
  // the replayed step (new handles, every scheduled one) would have been adopted.
  PrefetchPolicy replayed = recorded({1, 2});
  PrefetchPolicy first;  // no schedule yet: the step would have been the recording
  for (PrefetchPolicy* p : {&replayed, &first}) {
    p->begin_step();
    p->on_acquire(1);
    p->on_acquire(2);
    for (std::size_t i = 0; i < PrefetchPolicy::kMaxStepAcquires; ++i) p->on_acquire(3 + i % 2);
    p->end_step();
  }
  EXPECT_EQ(replayed.schedule_adoptions(), 0u);
  EXPECT_EQ(schedule_at_start(replayed), (Ids{1, 2}));
  EXPECT_FALSE(first.replaying());
  first.begin_step();
  EXPECT_TRUE(first.recording());  // the next step records again
  first.end_step();
}

TEST(PrefetchPolicy, EachKeyFollowsItsOwnStepsAndTheLookAheadSeesIt) {
  // Optimizers A (key 1: 1-3) and B (key 2: 7-8) step in turn. A's order changes for
  // good; B gets a new handle 9. Each is judged on its own steps, B's in between do not
  // break A's pair, and the look-ahead from one key shows the other's new schedule.
  PrefetchPolicy p;
  step(p, {1, 2, 3}, 1);
  step(p, {7, 8}, 2);
  step(p, {3, 2, 1}, 1);
  step(p, {7, 8, 9}, 2);  // adopted at once
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  p.begin_step(1);
  EXPECT_EQ(p.upcoming(10), (Ids{1, 2, 3, 7, 8, 9}));  // A's old order, B's new one
  for (auto h : {3, 2, 1}) p.on_acquire(h);
  p.end_step();  // A's second step like its first: adopted
  EXPECT_EQ(p.schedule_adoptions(), 2u);
  p.begin_step(2);
  EXPECT_EQ(p.upcoming(10), (Ids{7, 8, 9, 3, 2, 1}));
  EXPECT_EQ(p.eviction_score(3), 3u);  // after B's three acquires
  EXPECT_EQ(p.eviction_score(1), 5u);
  for (auto h : {7, 8, 9}) p.on_acquire(h);
  p.end_step();
  EXPECT_EQ(p.schedule_adoptions(), 2u);
}

// ---- steps of several shapes (Note [Steps of several shapes]) ------------------------

// The shape a step of key 0 replays, seen from its start: its own acquires only (the
// look-ahead then goes on to the next step, whose shape may differ).
Ids shape_at_start(PrefetchPolicy& p) {
  p.begin_step();
  Ids out = p.upcoming(p.schedule_length());
  p.end_step();
  return out;
}

TEST(PrefetchPolicy, StepsAlternatingBetweenTwoShapesEachReplayTheirOwn) {
  // A = 1 2, B = 1 3 in turn. A schedule kept from A alone missed 3 on every B step.
  const Ids a{1, 2}, b{1, 3};
  PrefetchPolicy p = recorded(a);
  step(p, b);  // 3 is new: merged in, 2 kept
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  for (int n = 3; n <= 6; ++n) {
    // The union, until the pattern has held five steps: 3 prefetched in B steps too.
    p.begin_step();
    EXPECT_EQ(p.upcoming(10), (Ids{1, 3, 2})) << "step " << n;
    for (auto h : n % 2 == 1 ? a : b) p.on_acquire(h);
    p.end_step();
  }
  // From step 7 on each step replays its own shape: no acquire off it, and what a step
  // does not use is neither prefetched nor scored as needed by it.
  const auto off_before = p.off_schedule_acquires();
  for (int n = 7; n <= 12; ++n) {
    const Ids& shape = n % 2 == 1 ? a : b;
    const Ids& next = n % 2 == 1 ? b : a;
    p.begin_step();
    EXPECT_EQ(p.upcoming(2), shape) << "step " << n;
    for (auto h : shape) p.on_acquire(h);
    // The end of the step looks ahead to the other shape.
    EXPECT_EQ(p.upcoming(10), next) << "step " << n;
    EXPECT_EQ(p.eviction_score(next[1]), 1u);
    EXPECT_EQ(p.eviction_score(shape[1]), PrefetchPolicy::kNever - 1);
    p.end_step();
  }
  EXPECT_EQ(p.off_schedule_acquires(), off_before);
  EXPECT_EQ(p.schedule_adoptions(), 1u);  // new predictions are not adoptions
}

TEST(PrefetchPolicy, APatternOfShapesKeepsEveryShape) {
  // A A B B A A B B ...: an identical pair of steps (A A) is an adopted order. Taking it
  // whole would drop B's handle each time and merge it back the step after; the
  // adoption keeps it, and its presence (period 4) then predicts each step's shape.
  const Ids a{1, 2}, b{1, 3};
  PrefetchPolicy p = recorded(a);
  for (int n = 2; n <= 24; ++n) {
    const Ids& shape = (n - 1) % 4 < 2 ? a : b;
    if (n > 16) {
      EXPECT_EQ(shape_at_start(p), shape) << "step " << n;
    }
    step(p, shape);
  }
  EXPECT_EQ(p.schedule_adoptions(), 1u);  // 3 merged in once
}

TEST(PrefetchPolicy, OneOddStepInAnAlternationKeepsItsHandlesInTheReplay) {
  // A B A B ..., then a B step cut short before it acquired 3, then A: the next B step
  // still replays 3 (the union serves it while its pattern is broken).
  const Ids a{1, 2}, b{1, 3};
  PrefetchPolicy p = recorded(a);
  for (int n = 2; n <= 8; ++n) step(p, n % 2 == 1 ? a : b);
  step(p, {1});  // step 9
  step(p, b);    // step 10
  step(p, a);    // step 11
  const Ids next = shape_at_start(p);
  EXPECT_NE(std::find(next.begin(), next.end(), PrefetchPolicy::HandleId{3}), next.end());
}

TEST(PrefetchPolicy, AClosureRunTwiceThatCreatedAHandleIsMergedOnce) {
  // The step's closure ran twice and created handle 9 in its first run: the step is
  // 1 2 3 9 1 2 3 9. It counts as one run, and 9 is merged in once.
  PrefetchPolicy p = recorded({1, 2, 3});
  step(p, {1, 2, 3, 9, 1, 2, 3, 9});
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(p.schedule_length(), 4u);
  EXPECT_EQ(schedule_at_start(p), (Ids{1, 2, 3, 9}));
  // The next normal step follows it, and a doubled one without a new handle too.
  const auto off_before = p.off_schedule_acquires();
  step(p, {1, 2, 3, 9});
  EXPECT_EQ(p.off_schedule_acquires(), off_before);
  step(p, {1, 2, 3, 9, 1, 2, 3, 9});
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(p.schedule_length(), 4u);
}

TEST(PrefetchPolicy, AScheduleThatRepeatsItselfKeepsItsCount) {
  // An optimizer that passes over its state twice per step (norms, then updates).
  PrefetchPolicy p = recorded({1, 2, 1, 2});
  step(p, {1, 9, 2, 1, 9, 2});  // 9 new, acquired in both passes: merged in both
  EXPECT_EQ(p.schedule_adoptions(), 1u);
  EXPECT_EQ(p.schedule_length(), 6u);
  step(p, {1, 9, 2, 1, 9, 2, 1, 9, 2, 1, 9, 2});  // its closure ran twice: four passes
  EXPECT_EQ(p.schedule_length(), 6u);
  EXPECT_EQ(p.schedule_adoptions(), 1u);
}

}  // namespace
}  // namespace tidepool
