// Note [Eviction order] (tiering/eviction_order.cpp): the store finds its eviction victim
// in a heap ordered by keys (Note [Eviction keys] in tiering/prefetch_policy.h) instead of
// scoring every resident handle. Its choice must stay Belady's on the policy's scores. A
// randomized sequence of steps (in order, deviating, several schedule keys, unfinished),
// acquires, held handles, prefetches, evictions, creations and destructions runs against
// the store while a second PrefetchPolicy gets the same calls; at every eviction the
// handle the store gave up must have the highest score the shadow policy gives any
// resident, unacquired handle (a prefetch evicts only above the incoming handle's score,
// and loads nothing when no handle scores above it).
// The policy's side alone: keys order handles as scores do through in-order acquires.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/prefetch_policy.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using Ids = std::vector<PrefetchPolicy::HandleId>;

// While the key epoch holds, eviction_score_of_key(eviction_key(h)) is eviction_score(h)
// for every handle, and a key taken earlier in the epoch still gives today's score.
void expect_keys_track_scores(const PrefetchPolicy& p, const Ids& handles,
                              const std::map<PrefetchPolicy::HandleId, std::uint64_t>& earlier,
                              const std::string& where) {
  for (auto h : handles) {
    const std::uint64_t key = p.eviction_key(h);
    ASSERT_EQ(p.eviction_score_of_key(key), p.eviction_score(h)) << where << ", handle " << h;
    if (const auto it = earlier.find(h); it != earlier.end()) {
      ASSERT_EQ(p.eviction_score_of_key(it->second), p.eviction_score(h))
          << where << ": an earlier key of handle " << h << " no longer gives its score";
    }
  }
}

TEST(EvictionKeys, FollowScoresThroughInOrderAcquiresAndChangeEpochOtherwise) {
  PrefetchPolicy p;
  const Ids handles{1, 2, 3, 4, 5, 6};
  // Before a schedule (least recently acquired first).
  std::map<PrefetchPolicy::HandleId, std::uint64_t> earlier;
  for (auto h : Ids{3, 1, 4}) p.on_acquire(h);
  for (auto h : handles) earlier[h] = p.eviction_key(h);
  const std::uint64_t epoch = p.eviction_key_epoch();
  p.on_acquire(5);
  earlier.erase(5);  // the acquired handle's key changes
  ASSERT_EQ(p.eviction_key_epoch(), epoch);
  expect_keys_track_scores(p, handles, earlier, "before a schedule");

  // A recorded step, then a replay whose in-order acquires keep the epoch.
  p.begin_step();
  for (auto h : Ids{1, 2, 3, 4, 5, 6, 2}) p.on_acquire(h);
  p.end_step();
  p.begin_step();
  ASSERT_TRUE(p.replaying());
  earlier.clear();
  for (auto h : handles) earlier[h] = p.eviction_key(h);
  const std::uint64_t replay_epoch = p.eviction_key_epoch();
  for (auto h : Ids{1, 2, 3}) {
    p.on_acquire(h);
    earlier.erase(h);
    ASSERT_EQ(p.eviction_key_epoch(), replay_epoch);
    expect_keys_track_scores(p, handles, earlier, "replaying in order");
  }
  p.on_acquire(6);  // off the order: the keys are recomputed
  EXPECT_NE(p.eviction_key_epoch(), replay_epoch);
  expect_keys_track_scores(p, handles, {}, "after a deviation");
  p.end_step();
}

class EvictionOrderTest : public tiering_test::TieringStreamTest {};

constexpr std::size_t kUnit = 16 << 10;
constexpr std::size_t kBudgetHandles = 6;

TEST_P(EvictionOrderTest, TheStoreEvictsTheHighestScoreTheShadowPolicyGives) {
  TieredStoreOptions options = tiering_test::test_store_options(kBudgetHandles * kUnit);
  options.prefetch_lookahead = 0;  // only acquires and explicit prefetches load
  TieredStore store(backend(), options);
  PrefetchPolicy shadow;
  std::vector<TieredStore::Handle> handles;
  for (int i = 0; i < 20; ++i) handles.push_back(store.create(kUnit, kTagOptimizerState));
  // Each key's usual step: its own order over the handles of its own.
  std::map<std::uint64_t, std::vector<TieredStore::Handle>> usual;
  usual[0] = {handles.begin(), handles.begin() + 14};
  usual[1] = {handles.begin() + 6, handles.end()};
  std::reverse(usual[1].begin(), usual[1].end());
  std::vector<TieredStore::Handle> held;  // acquired, not released yet
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(20261203));
  auto chance = [&](int percent) { return static_cast<int>(rng() % 100) < percent; };
  auto resident_set = [&] {
    std::vector<TieredStore::Handle> r;
    for (auto h : handles) {
      if (store.resident(h)) r.push_back(h);
    }
    return r;
  };
  // The highest score among the resident handles not held.
  auto highest_score = [&](const std::vector<TieredStore::Handle>& resident) {
    std::size_t best = 0;
    bool any = false;
    for (auto h : resident) {
      if (std::find(held.begin(), held.end(), h) != held.end()) continue;
      best = any ? std::max(best, shadow.eviction_score(h)) : shadow.eviction_score(h);
      any = true;
    }
    return std::make_pair(any, best);
  };
  std::size_t evictions_checked = 0;
  std::size_t prefetches_refused = 0;
  // Loads `h` by acquire (or prefetch), checking the victim when the budget is full.
  auto load = [&](TieredStore::Handle h, bool by_prefetch, const std::string& where) {
    const auto before = resident_set();
    const bool full = !store.resident(h) && before.size() == kBudgetHandles;
    const auto [any, best] = highest_score(before);
    const std::size_t incoming = shadow.eviction_score(h);
    std::map<TieredStore::Handle, std::size_t> scores;  // before the load moves them
    for (auto x : before) scores[x] = shadow.eviction_score(x);
    if (by_prefetch) {
      store.prefetch(h, stream_);
    } else {
      store.acquire(h, stream_);
      shadow.on_acquire(h);
    }
    if (!full) return;
    const auto after = resident_set();
    std::vector<TieredStore::Handle> gone;
    for (auto x : before) {
      if (std::find(after.begin(), after.end(), x) == after.end()) gone.push_back(x);
    }
    if (by_prefetch && (!any || best <= incoming)) {  // nothing needed later than h
      ASSERT_TRUE(gone.empty()) << where;
      ASSERT_FALSE(store.resident(h)) << where;
      prefetches_refused++;
      return;
    }
    ASSERT_TRUE(any) << where;
    ASSERT_EQ(gone.size(), 1u) << where;
    ASSERT_EQ(scores[gone[0]], best)
        << where << ": evicted handle " << gone[0] << " does not have the highest score";
    evictions_checked++;
  };

  bool in_step = false;
  std::uint64_t key = 0;
  std::size_t position = 0;
  for (int op = 0; op < 4000; ++op) {
    const std::string where = "operation " + std::to_string(op);
    if (!in_step && chance(10)) {
      key = rng() % 2;
      store.begin_step(key);
      shadow.begin_step(key);
      in_step = true;
      position = 0;
      continue;
    }
    if (in_step && (position == usual[key].size() || chance(2))) {
      if (!chance(5)) {  // else unfinished: begun again later
        store.end_step();
        shadow.end_step();
      }
      in_step = false;
      continue;
    }
    const int what = static_cast<int>(rng() % 100);
    if (what < 3 && !held.empty()) {
      const auto h = held.back();
      held.pop_back();
      store.release(h, chance(50));
    } else if (what < 5 && held.size() < 2) {
      const auto h = handles[rng() % handles.size()];
      if (std::find(held.begin(), held.end(), h) != held.end()) continue;
      load(h, /*by_prefetch=*/false, where + " (held)");
      held.push_back(h);
    } else if (what < 10) {
      const auto h = handles[rng() % handles.size()];
      if (std::find(held.begin(), held.end(), h) != held.end() || store.resident(h)) continue;
      load(h, /*by_prefetch=*/true, where + " (prefetch)");
    } else if (what < 12) {
      const auto h = handles[rng() % handles.size()];
      if (std::find(held.begin(), held.end(), h) == held.end()) store.evict(h);
    } else if (what < 13) {  // a handle replaced by a new one
      const std::size_t i = rng() % handles.size();
      const auto h = handles[i];
      if (std::find(held.begin(), held.end(), h) != held.end()) continue;
      store.destroy(h);
      shadow.forget(h);
      handles[i] = store.create(kUnit, kTagOptimizerState);
      for (auto& [k, order] : usual) std::replace(order.begin(), order.end(), h, handles[i]);
    } else {
      // The step's next handle, or now and then another (a deviation).
      const auto h = in_step && !chance(10) ? usual[key][position++]
                                           : handles[rng() % handles.size()];
      if (std::find(held.begin(), held.end(), h) != held.end()) continue;
      load(h, /*by_prefetch=*/false, where);
      store.release(h, chance(50));
    }
    if (::testing::Test::HasFatalFailure()) return;
  }
  for (auto h : held) store.release(h, false);
  // The sequence reached the cases it is for.
  EXPECT_GT(evictions_checked, 500u);
  EXPECT_GT(prefetches_refused, 5u);
  EXPECT_GT(store.stats().prefetch_issued, 50u);
}

INSTANTIATE_TEST_SUITE_P(Backends, EvictionOrderTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
