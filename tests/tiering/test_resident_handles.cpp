// Note [Resident handles] (tiering/eviction_order.cpp): the store's list of resident
// handles, which every eviction searches, stays exactly the handles with a device copy
// through every operation that loads, evicts, writes or destroys one (a randomized
// sequence under a tight budget, checked after each operation against resident() of
// every handle); and the search still finds a victim wherever one exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

class ResidentHandlesTest : public tiering_test::TieringStreamTest {};

TEST_P(ResidentHandlesTest, TheResidentListFollowsEveryOperation) {
  constexpr std::size_t kUnit = 16 << 10;
  TieredStoreOptions options = tiering_test::test_store_options(5 * kUnit);
  options.prefetch_lookahead = 4;
  TieredStore store(backend(), options);
  std::vector<TieredStore::Handle> handles;
  std::vector<TieredStore::Handle> acquired;
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(20261203));
  auto pick = [&](const std::vector<TieredStore::Handle>& from) {
    return from[std::uniform_int_distribution<std::size_t>(0, from.size() - 1)(rng)];
  };
  auto is_acquired = [&](TieredStore::Handle h) {
    return std::find(acquired.begin(), acquired.end(), h) != acquired.end();
  };
  std::vector<unsigned char> buffer(2 * kUnit);
  bool in_step = false;
  for (int op = 0; op < 3000; ++op) {
    const int what = std::uniform_int_distribution<int>(0, 11)(rng);
    const std::size_t bytes = kUnit * std::uniform_int_distribution<std::size_t>(1, 2)(rng);
    try {
      if (what == 0 && handles.size() < 16) {
        const Tier tier = rng() % 2 == 0 ? Tier::device : Tier::host;
        handles.push_back(store.create(bytes, kTagOptimizerState, tier));
      } else if (handles.empty()) {
        continue;
      } else if (what == 1) {
        const TieredStore::Handle h = pick(handles);
        if (is_acquired(h)) continue;
        store.destroy(h);
        std::erase(handles, h);
      } else if (what <= 4 && acquired.size() < 2) {
        const TieredStore::Handle h = pick(handles);
        if (is_acquired(h)) continue;
        store.acquire(h, stream_);
        acquired.push_back(h);
      } else if (what <= 6 && !acquired.empty()) {
        const TieredStore::Handle h = pick(acquired);
        store.release(h, rng() % 2 == 0);
        std::erase(acquired, h);
      } else if (what == 7) {
        const TieredStore::Handle h = pick(handles);
        if (!is_acquired(h)) store.evict(h);
      } else if (what == 8) {
        store.prefetch(pick(handles), stream_);
      } else if (what == 9) {
        const TieredStore::Handle h = pick(handles);
        if (is_acquired(h) || store.size(h) > buffer.size()) continue;
        store.write(h, buffer.data());
      } else if (what == 10) {
        const int kind = std::uniform_int_distribution<int>(0, 2)(rng);
        if (kind == 0) {
          store.evict_tag(kTagOptimizerState);
        } else if (kind == 1) {
          store.prefetch_tag(kTagOptimizerState, stream_);
        } else {
          store.reclaim(bytes);  // as the allocator's OOM hook asks
        }
      } else {
        if (in_step) {
          store.end_step();
        } else {
          store.begin_step();
        }
        in_step = !in_step;
      }
    } catch (const TieringError& e) {
      // No room (two acquired handles can fill the budget): the operation changed
      // nothing, which the check below sees too. Any other error is a failure.
      ASSERT_NE(std::string(e.what()).find("no room for"), std::string::npos)
          << "operation " << op << " (kind " << what << "): " << e.what();
    }
    std::size_t resident = 0;
    for (TieredStore::Handle h : handles) resident += store.resident(h) ? 1 : 0;
    const TieredStoreStats s = store.stats();
    ASSERT_EQ(s.resident_handles, resident) << "after operation " << op << " (kind " << what << ")";
    ASSERT_EQ(s.acquired_handles, acquired.size()) << "after operation " << op;
    ASSERT_EQ(s.handles, handles.size());
    ASSERT_LE(s.device_bytes, options.device_budget_bytes);
  }
  for (TieredStore::Handle h : acquired) store.release(h, false);
  // Nothing acquired: an acquire of any handle finds room, evicting what it must.
  for (TieredStore::Handle h : handles) {
    store.acquire(h, stream_);
    store.release(h, false);
  }
  for (TieredStore::Handle h : handles) store.destroy(h);
  EXPECT_EQ(store.stats().resident_handles, 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, ResidentHandlesTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

// A device out of memory below the store's budget (other users hold the rest; here a host
// backend with room for three handles under a budget of eight) makes the store give up
// what the budget would: the handle whose next use is furthest, or before a schedule the
// least recently acquired. It used to give up the first resident handle it found, which
// could be the one needed next.
constexpr std::size_t kOomUnit = 64 << 10;

class DeviceOutOfMemoryTest : public tiering_test::TieringStreamTest {
 protected:
  std::size_t capacity_bytes() const override { return 3 * kOomUnit; }
  void SetUp() override {
    TieringStreamTest::SetUp();
    if (!IsSkipped() && !on_host()) GTEST_SKIP() << "the device's capacity is the host backend's";
  }
  TieredStoreOptions options() const {
    TieredStoreOptions o = tiering_test::test_store_options(8 * kOomUnit);
    o.prefetch_lookahead = 0;  // only acquires load: the test sees each eviction's choice
    return o;
  }
  void use(TieredStore& store, TieredStore::Handle h) {
    store.acquire(h, stream_);
    store.release(h, /*dirty=*/false);
  }
};

TEST_P(DeviceOutOfMemoryTest, BeforeAScheduleEvictsTheLeastRecentlyAcquired) {
  TieredStore store(backend(), options());
  std::vector<TieredStore::Handle> h;
  for (int i = 0; i < 4; ++i) h.push_back(store.create(kOomUnit, kTagOptimizerState, Tier::host));
  for (int i : {0, 1, 2, 0}) use(store, h[i]);
  use(store, h[3]);  // the device holds three: one must go, and h[1] is the least recent
  EXPECT_TRUE(store.resident(h[0]));
  EXPECT_FALSE(store.resident(h[1]));
  EXPECT_TRUE(store.resident(h[2]));
  EXPECT_TRUE(store.resident(h[3]));
  for (auto x : h) store.destroy(x);
}

TEST_P(DeviceOutOfMemoryTest, WithAScheduleEvictsTheFurthestNextUse) {
  TieredStore store(backend(), options());
  std::vector<TieredStore::Handle> h;
  for (int i = 0; i < 4; ++i) h.push_back(store.create(kOomUnit, kTagOptimizerState, Tier::host));
  store.begin_step();  // records 0 1 2 3 (acquiring 3 gives up 0, the least recent)
  for (int i = 0; i < 4; ++i) use(store, h[i]);
  store.end_step();
  ASSERT_FALSE(store.resident(h[0]));
  store.begin_step();
  use(store, h[0]);  // next uses: 1, 2, then 3 furthest; LRU would pick 1
  EXPECT_TRUE(store.resident(h[0]));
  EXPECT_TRUE(store.resident(h[1]));
  EXPECT_TRUE(store.resident(h[2]));
  EXPECT_FALSE(store.resident(h[3]));
  for (int i = 1; i < 4; ++i) use(store, h[i]);
  store.end_step();
  for (auto x : h) store.destroy(x);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceOutOfMemoryTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
