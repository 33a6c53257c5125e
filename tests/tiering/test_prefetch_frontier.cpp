// Note [Prefetch frontier] (tiering/prefetch_policy.h): a prefetch walk of the look-ahead
// starts where the last one's mark still holds. The policy's side: a mark moves with
// in-order acquires and is dropped by anything else that changes the look-ahead, and a
// walk from it visits exactly what a walk from the front would, past the acquires the
// mark covers. The store's side: an eviction since the mark makes the next walk start at
// the front, so a handle evicted ahead of the current acquire is prefetched again.
#include <gtest/gtest.h>

#include <cstddef>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/prefetch_policy.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using Ids = std::vector<PrefetchPolicy::HandleId>;

void step(PrefetchPolicy& p, const Ids& order) {
  p.begin_step();
  for (auto h : order) p.on_acquire(h);
  p.end_step();
}

// The acquires [from, max) of the look-ahead, and how far the walk got.
struct Walk {
  Ids visited;
  std::size_t covered;
};
Walk walk(const PrefetchPolicy& p, std::size_t from, std::size_t max) {
  Walk w;
  w.covered = p.visit_upcoming(from, max, [&](PrefetchPolicy::HandleId h) {
    w.visited.push_back(h);
    return true;
  });
  return w;
}

TEST(PrefetchFrontier, AWalkFromTheMarkVisitsWhatAWalkFromTheFrontLeavesAfterIt) {
  const Ids order{1, 2, 3, 4, 5, 6, 7, 8};
  PrefetchPolicy p;
  step(p, order);
  p.begin_step();
  PrefetchPolicy::LookAheadMark mark;
  EXPECT_EQ(p.still_covered(mark), 0u);  // no mark: nothing covered
  constexpr std::size_t kAhead = 4;
  for (auto h : order) {
    p.on_acquire(h);
    const std::size_t from = p.still_covered(mark);
    const Walk from_front = walk(p, 0, kAhead);
    const Walk from_mark = walk(p, from, kAhead);
    ASSERT_EQ(from_mark.covered, from_front.covered) << "after acquiring " << h;
    ASSERT_LE(from, from_front.visited.size());
    EXPECT_EQ(from_mark.visited, Ids(from_front.visited.begin() + std::ptrdiff_t(from),
                                     from_front.visited.end()))
        << "after acquiring " << h;
    if (h > 1) {
      EXPECT_EQ(from, kAhead - 1) << "an in-order acquire passes one acquire";
    }
    mark = p.mark(from_mark.covered);
  }
  // The look-ahead goes on into the next step's shape: 8 was followed by 1 2 3 4.
  EXPECT_EQ(walk(p, 0, kAhead).visited, (Ids{1, 2, 3, 4}));
}

TEST(PrefetchFrontier, AWalkStopsWhereRefusedAndVisitsARepeatedHandleEachTime) {
  PrefetchPolicy p;
  step(p, {1, 2, 1, 3});
  p.begin_step();
  // The rest of this step, then the next step's shape.
  EXPECT_EQ(walk(p, 0, 100).visited, (Ids{1, 2, 1, 3, 1, 2, 1, 3}));
  EXPECT_EQ(walk(p, 0, 100).covered, 8u);
  EXPECT_EQ(walk(p, 3, 6).visited, (Ids{3, 1, 2}));
  EXPECT_EQ(walk(p, 3, 6).covered, 6u);
  std::size_t calls = 0;
  const std::size_t refused_at = p.visit_upcoming(0, 100, [&](PrefetchPolicy::HandleId) {
    return ++calls < 3;  // refuses the third
  });
  EXPECT_EQ(refused_at, 2u);
  EXPECT_EQ(walk(p, 0, 0).visited, Ids{});
  // upcoming() is the walk's distinct handles.
  EXPECT_EQ(p.upcoming(10), (Ids{1, 2, 3}));
  EXPECT_EQ(p.upcoming(0), Ids{});
}

TEST(PrefetchFrontier, NothingIsVisitedWhileRecording) {
  PrefetchPolicy p;
  p.begin_step();
  p.on_acquire(1);
  EXPECT_EQ(walk(p, 0, 10).covered, 0u);
  EXPECT_TRUE(walk(p, 0, 10).visited.empty());
}

// The mark after acquiring 1 in a replayed step of 1..6 (4 ahead covered: 2 3 4 5).
PrefetchPolicy::LookAheadMark marked_after_first(PrefetchPolicy& p) {
  step(p, {1, 2, 3, 4, 5, 6});
  p.begin_step();
  p.on_acquire(1);
  return p.mark(walk(p, 0, 4).covered);
}

TEST(PrefetchFrontier, AnyOtherChangeOfTheLookAheadDropsTheMark) {
  {
    PrefetchPolicy p;
    const auto mark = marked_after_first(p);
    EXPECT_EQ(p.still_covered(mark), 4u);
    p.on_acquire(2);
    EXPECT_EQ(p.still_covered(mark), 3u);
    p.on_acquire(5);  // off the shape: re-synced
    EXPECT_EQ(p.still_covered(mark), 0u);
  }
  // Each of these changes the look-ahead other than by an in-order acquire.
  const std::vector<std::pair<const char*, std::function<void(PrefetchPolicy&)>>> changes{
      {"end_step", [](PrefetchPolicy& p) { p.end_step(); }},
      {"begin_step again (an unfinished step)", [](PrefetchPolicy& p) { p.begin_step(); }},
      {"forget of a scheduled handle", [](PrefetchPolicy& p) { p.forget(3); }},
      // Another key's schedule, in no look-ahead, but counted as a change.
      {"retire", [](PrefetchPolicy& p) { p.retire(7); }},
      {"reset_schedule", [](PrefetchPolicy& p) { p.reset_schedule(); }},
  };
  for (const auto& [name, change] : changes) {
    PrefetchPolicy p;
    const auto mark = marked_after_first(p);
    change(p);
    EXPECT_EQ(p.still_covered(mark), 0u) << name;
  }
  {
    PrefetchPolicy p;
    const auto mark = marked_after_first(p);
    p.forget(99);  // in no schedule: the look-ahead is the same
    EXPECT_EQ(p.still_covered(mark), 4u);
  }
  {
    // Between steps the look-ahead ends at the position: an acquire there moves its end.
    PrefetchPolicy p;
    step(p, {1, 2, 3, 4, 5, 6});
    const auto between = p.mark(walk(p, 0, 4).covered);
    EXPECT_EQ(p.still_covered(between), 4u);
    p.on_acquire(1);
    EXPECT_EQ(p.still_covered(between), 0u);
  }
  {
    // A mark covering less than the acquires since covers nothing.
    PrefetchPolicy p;
    step(p, {1, 2, 3, 4, 5, 6});
    p.begin_step();
    p.on_acquire(1);
    const auto mark = p.mark(1);
    p.on_acquire(2);
    p.on_acquire(3);
    EXPECT_EQ(p.still_covered(mark), 0u);
  }
}

// ---- the store ---------------------------------------------------------------------------

class PrefetchFrontierStoreTest : public tiering_test::TieringStreamTest {
 protected:
  // A store of `budget` bytes prefetching `lookahead` acquires ahead, and its eight
  // 64 KiB handles.
  void make_store(std::size_t budget, std::size_t lookahead) {
    TieredStoreOptions options = tiering_test::test_store_options(budget);
    options.prefetch_lookahead = lookahead;
    store_ = std::make_unique<TieredStore>(backend(), options);
    for (int i = 0; i < 8; ++i) hs_.push_back(store_->create(64 << 10, kTagOptimizerState));
  }
  void use(TieredStore::Handle h) {
    store_->acquire(h, stream_);
    store_->release(h, /*dirty=*/false);
  }
  std::unique_ptr<TieredStore> store_;
  std::vector<TieredStore::Handle> hs_;
};

TEST_P(PrefetchFrontierStoreTest, AHandleEvictedAheadOfTheCurrentAcquireIsPrefetchedAgain) {
  make_store(std::size_t{64} << 20, 3);
  TieredStore& store = *store_;
  const std::vector<TieredStore::Handle>& hs = hs_;
  store.begin_step();  // recorded
  for (auto h : hs) use(h);
  store.end_step();
  for (auto h : hs) store.evict(h);
  backend().stream_synchronize(stream_);

  store.begin_step();
  use(hs[0]);  // a miss; the walk prefetches hs[1..3] and marks them covered
  ASSERT_TRUE(store.resident(hs[1]));
  ASSERT_TRUE(store.resident(hs[2]));
  ASSERT_TRUE(store.resident(hs[3]));
  store.evict(hs[2]);  // under the mark
  const TieredStoreStats before = store.stats();
  use(hs[1]);  // an in-order acquire: the mark alone would start the walk past hs[3]
  EXPECT_TRUE(store.resident(hs[2])) << "the evicted handle was not prefetched again";
  EXPECT_TRUE(store.resident(hs[4]));
  use(hs[2]);
  const TieredStoreStats after = store.stats();
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_EQ(after.prefetch_hits, before.prefetch_hits + 2);
  for (std::size_t i = 3; i < hs.size(); ++i) use(hs[i]);
  store.end_step();
  // The rest of the step went by the mark: every acquire after the first was prefetched.
  const TieredStoreStats end = store.stats();
  EXPECT_EQ(end.misses, after.misses);
  EXPECT_EQ(end.prefetch_hits, after.prefetch_hits + (hs.size() - 3));
}

TEST_P(PrefetchFrontierStoreTest, AStepWithBackPressureResumesWhereItStopped) {
  // Room for three handles: the walk stops at the first it cannot load (the one just
  // acquired and the two ahead fill the budget), and the next walk tries it first.
  make_store(std::size_t{192} << 10, 6);
  TieredStore& store = *store_;
  const std::vector<TieredStore::Handle>& hs = hs_;
  for (int s = 0; s < 3; ++s) {
    store.begin_step();
    for (auto h : hs) use(h);
    store.end_step();
  }
  const TieredStoreStats before = store.stats();
  store.begin_step();
  for (auto h : hs) {
    use(h);
    ASSERT_LE(store.device_bytes(), store.device_budget_bytes());
  }
  store.end_step();
  const TieredStoreStats after = store.stats();
  // Every acquire of the replayed step found its handle loaded ahead.
  EXPECT_EQ(after.misses, before.misses);
  EXPECT_EQ(after.prefetch_hits - before.prefetch_hits, hs.size());
}

INSTANTIATE_TEST_SUITE_P(Backends, PrefetchFrontierStoreTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
