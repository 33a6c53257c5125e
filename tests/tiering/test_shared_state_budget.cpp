// tidepool.state_budget is the device's, shared by every tiered store built from the
// configuration and by the VMM pool (Note [Shared state budget] in
// tiering/device_budget_ledger.h): together they stay within it; an acquire that finds no
// room makes another store give back released handles (their data intact), a prefetch
// never does; acquired handles of one store leave another a clear error; stores given a
// budget of their own keep it; and two threads stepping their own stores under a tight
// shared budget neither deadlock nor lose data (run under TSan as well).
#include <gtest/gtest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "allocator/config.h"
#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/device_budget_ledger.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::contents;
using tiering_test::first_difference;
using tiering_test::random_bytes;

constexpr std::size_t kUnit = std::size_t{64} << 10;  // one handle
constexpr std::size_t kBudget = 4 * kUnit;

class SharedStateBudgetTest : public tiering_test::TieringStreamTest {
 protected:
  void TearDown() override {
    apply_config(Config{});
    TieringStreamTest::TearDown();
  }
  // tidepool.state_budget of `bytes` for this test.
  void configure(std::size_t bytes) {
    apply_config(claim_config("tidepool.state_budget:" + std::to_string(bytes)).config);
  }
  // A store whose budget is the configured one (the default), or `budget` of its own.
  std::unique_ptr<TieredStore> make_store(
      std::size_t budget = TieredStoreOptions::kDeviceBudgetFromConfig) {
    TieredStoreOptions o = tiering_test::test_store_options(budget);
    o.copy.chunk_bytes = 16 << 10;
    return std::make_unique<TieredStore>(backend(), o);
  }
  std::size_t ledger_bytes() {
    const auto ledger = DeviceBudgetLedger::existing(backend().device());
    return ledger ? ledger->charged_bytes() : 0;
  }
  // Acquires `h`, writes `data` through the device pointer, releases it dirty: a later
  // eviction must copy it back.
  void write_on_device(TieredStore& s, TieredStore::Handle h,
                       const std::vector<unsigned char>& data, Stream stream) {
    void* dev = s.acquire(h, stream);
    backend().copy_async(dev, data.data(), data.size(), CopyKind::host_to_device, stream);
    backend().stream_synchronize(stream);
    s.release(h, /*dirty=*/true);
  }
  // `n` handles of kUnit in `s`, each resident, released and dirty with its own data.
  struct Filled {
    std::vector<TieredStore::Handle> handles;
    std::vector<std::vector<unsigned char>> data;
  };
  Filled fill_released(TieredStore& s, int n, std::uint64_t seed) {
    Filled f;
    for (int i = 0; i < n; ++i) {
      f.handles.push_back(s.create(kUnit, kTagOptimizerState));
      f.data.push_back(random_bytes(kUnit, seed + static_cast<std::uint64_t>(i)));
      write_on_device(s, f.handles.back(), f.data.back(), stream_);
    }
    return f;
  }
  // The budget configured, two stores that share it, and `a` filling it with released
  // handles (seeded from `seed`).
  struct TwoStores {
    std::unique_ptr<TieredStore> a, b;
    Filled in_a;
  };
  TwoStores two_stores_a_full(std::uint64_t seed) {
    configure(kBudget);
    TwoStores t{make_store(), make_store(), {}};
    t.in_a = fill_released(*t.a, 4, seed);
    return t;
  }
  void expect_intact(TieredStore& s, const Filled& f) {
    for (std::size_t i = 0; i < f.handles.size(); ++i) {
      EXPECT_EQ(first_difference(contents(s, f.handles[i]).data(), f.data[i].data(), kUnit), -1)
          << "handle " << i;
    }
  }
};

// A randomized sequence over two stores (acquire and write, acquire and check, prefetch,
// evict, read, write, and a handle kept acquired across operations): after every
// operation both stores together, and the ledger, hold no more than the one budget, and
// every read matches a shadow copy.
TEST_P(SharedStateBudgetTest, TwoStoresFromTheConfigurationStayWithinTheOneBudget) {
  constexpr std::size_t kSharedBudget = 1 << 20;
  configure(kSharedBudget);
  std::array<std::unique_ptr<TieredStore>, 2> stores{make_store(), make_store()};
  constexpr std::array<std::size_t, 3> kSizes{64 << 10, 128 << 10, 192 << 10};
  struct Shadow {
    TieredStore::Handle handle;
    std::vector<unsigned char> bytes;
  };
  std::array<std::vector<Shadow>, 2> shadow;
  SCOPED_TRACE(test_support::seed_note());
  std::mt19937_64 rng(test_support::seeded(20261203));
  // Each store alone holds more than the budget less an acquired handle, so that either
  // may need room the other holds (a peer eviction), whatever sizes the seed draws.
  for (std::size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(stores[s]->device_budget_bytes(), kSharedBudget);
    for (std::size_t total = 0; total < kSharedBudget + kSizes.back();) {
      const std::size_t n = kSizes[rng() % kSizes.size()];
      shadow[s].push_back(
          {stores[s]->create(n, kTagOptimizerState), std::vector<unsigned char>(n, 0)});
      total += n;
    }
  }
  // At most one handle per store stays acquired across operations (so the acquired
  // handles always fit: 2 x 192 KiB of 1 MiB), released later.
  std::array<int, 2> held{-1, -1};
  std::uint64_t seed = 1;
  for (int op = 0; op < 3000; ++op) {
    const std::size_t s = rng() % 2;
    TieredStore& store = *stores[s];
    const int i = static_cast<int>(rng() % shadow[s].size());
    Shadow& sh = shadow[s][static_cast<std::size_t>(i)];
    const std::size_t n = sh.bytes.size();
    const unsigned kind = static_cast<unsigned>(rng() % 8);
    if (i == held[s]) {  // the held one: release it (written or not)
      store.release(sh.handle, /*dirty=*/false);
      held[s] = -1;
    } else if (kind <= 1) {  // write on the device
      sh.bytes = random_bytes(n, seed++);
      write_on_device(store, sh.handle, sh.bytes, stream_);
    } else if (kind == 2) {  // check on the device, maybe keep it acquired
      const void* dev = store.acquire(sh.handle, stream_);
      const auto seen = read_device(dev, n, stream_);
      EXPECT_EQ(first_difference(seen.data(), sh.bytes.data(), n), -1) << op;
      if (held[s] < 0) {
        held[s] = i;
      } else {
        store.release(sh.handle, /*dirty=*/false);
      }
    } else if (kind == 3) {
      store.prefetch(sh.handle, stream_);
    } else if (kind == 4) {
      store.evict(sh.handle);
    } else if (kind == 5) {
      EXPECT_EQ(first_difference(contents(store, sh.handle).data(), sh.bytes.data(), n), -1) << op;
    } else if (kind == 6) {
      sh.bytes = random_bytes(n, seed++);
      store.write(sh.handle, sh.bytes.data());
    } else {
      store.synchronize();
    }
    const std::size_t together = stores[0]->device_bytes() + stores[1]->device_bytes();
    ASSERT_LE(together, kSharedBudget) << "after op " << op;
    ASSERT_EQ(ledger_bytes(), together) << "after op " << op;
  }
  for (std::size_t s = 0; s < 2; ++s) {
    if (held[s] >= 0) {
      stores[s]->release(shadow[s][static_cast<std::size_t>(held[s])].handle, false);
    }
    for (const Shadow& sh : shadow[s]) {
      EXPECT_EQ(first_difference(contents(*stores[s], sh.handle).data(), sh.bytes.data(),
                                 sh.bytes.size()),
                -1);
    }
    EXPECT_TRUE(stores[s]->stats().budget_shared);
  }
  EXPECT_GT(stores[0]->stats().peer_evictions + stores[1]->stats().peer_evictions, 0u);
}

TEST_P(SharedStateBudgetTest, AnAcquireEvictsAReleasedHandleOfTheOtherStore) {
  auto [a, b, in_a] = two_stores_a_full(100);
  ASSERT_EQ(a->device_bytes(), kBudget);
  const auto h = b->create(kUnit, kTagOptimizerState);
  const auto mine = random_bytes(kUnit, 200);
  write_on_device(*b, h, mine, stream_);  // room from `a`
  EXPECT_EQ(a->device_bytes() + b->device_bytes(), kBudget);
  EXPECT_EQ(b->device_bytes(), kUnit);
  EXPECT_EQ(ledger_bytes(), kBudget);
  const TieredStoreStats sa = a->stats();
  const TieredStoreStats sb = b->stats();
  EXPECT_EQ(sa.peer_evictions, 1u);
  EXPECT_EQ(sa.peer_evicted_bytes, kUnit);
  EXPECT_EQ(sb.peer_room_requests, 1u);
  EXPECT_EQ(sb.peer_evictions, 0u);
  EXPECT_TRUE(sa.budget_shared);
  EXPECT_EQ(sb.peer_bytes, a->device_bytes());
  expect_intact(*a, in_a);  // the evicted one was copied back first
  EXPECT_EQ(first_difference(contents(*b, h).data(), mine.data(), kUnit), -1);
}

// Note [Shared state budget], step 1: an acquire whose store's released handles are all
// used again later in its step (here the step is 0 1 2 0 1, and 2 comes when 0 and 1 are
// resident) takes room from the other store's idle handles first, keeping its working set;
// with nothing to take there it evicts its own after all, as with a budget of its own.
TEST_P(SharedStateBudgetTest, AStepKeepsWhatItUsesAgainWhileTheOtherStoreCanGiveRoom) {
  configure(kBudget);
  TieredStoreOptions o =
      tiering_test::test_store_options(TieredStoreOptions::kDeviceBudgetFromConfig);
  o.prefetch_lookahead = 0;  // only acquires load: each eviction is the acquire's
  TieredStore a(backend(), o);
  auto b = make_store();
  std::vector<TieredStore::Handle> h;
  for (int i = 0; i < 3; ++i) h.push_back(a.create(kUnit, kTagOptimizerState));
  const auto step = [&] {
    a.begin_step();
    for (int i : {0, 1, 2, 0, 1}) {
      a.acquire(h[static_cast<std::size_t>(i)], stream_);
      a.release(h[static_cast<std::size_t>(i)], /*dirty=*/false);
    }
    a.end_step();
  };
  step();  // recorded, within the budget
  for (auto x : h) a.evict(x);
  a.synchronize();  // their buffers handed back: the ledger holds nothing of a's
  const Filled in_b = fill_released(*b, 2, 300);  // the other optimizer's idle state
  a.begin_step();
  a.acquire(h[0], stream_);
  a.release(h[0], false);
  a.acquire(h[1], stream_);
  a.release(h[1], false);
  ASSERT_EQ(ledger_bytes(), kBudget);
  a.acquire(h[2], stream_);  // 0 and 1 come again in this step: b gives the room
  a.release(h[2], false);
  EXPECT_TRUE(a.resident(h[0]));
  EXPECT_TRUE(a.resident(h[1]));
  EXPECT_EQ(b->stats().peer_evictions, 1u);
  EXPECT_EQ(a.stats().evictions, 3u);  // the three evicted by hand, none by the step
  const std::uint64_t misses = a.stats().misses;
  for (int i : {0, 1}) {
    a.acquire(h[static_cast<std::size_t>(i)], stream_);
    a.release(h[static_cast<std::size_t>(i)], false);
  }
  a.end_step();
  EXPECT_EQ(a.stats().misses, misses);  // both found on the device
  expect_intact(*b, in_b);

  // With nothing left to give (b's last resident handle acquired), the acquire evicts its
  // own handle after asking, and succeeds.
  for (auto x : h) a.evict(x);
  for (auto x : in_b.handles) b->evict(x);
  a.synchronize();
  b->synchronize();
  b->acquire(in_b.handles[0], stream_);
  b->acquire(in_b.handles[1], stream_);
  a.begin_step();
  a.acquire(h[0], stream_);
  a.release(h[0], false);
  const std::uint64_t asked = a.stats().peer_room_requests;
  a.acquire(h[1], stream_);  // a budget of 4 units, b holds 2 and a 1: a fits without asking
  a.release(h[1], false);
  EXPECT_EQ(a.stats().peer_room_requests, asked);
  a.acquire(h[2], stream_);  // asks b, which has nothing released; then evicts 1 of its own
  a.release(h[2], false);
  EXPECT_GT(a.stats().peer_room_requests, asked);
  EXPECT_FALSE(a.resident(h[1]));
  EXPECT_TRUE(a.resident(h[2]));
  a.end_step();
  b->release(in_b.handles[0], false);
  b->release(in_b.handles[1], false);
}

// A handle created on the device gets its room as an acquire does: from the other store's
// released handles, and with none left, the shared budget's clear error, nothing created.
TEST_P(SharedStateBudgetTest, ACreateOnTheDeviceTakesRoomFromTheOtherStore) {
  auto [a, b, in_a] = two_stores_a_full(400);
  const auto h = b->create(kUnit, kTagOptimizerState, Tier::device);
  EXPECT_TRUE(b->resident(h));
  EXPECT_EQ(a->device_bytes(), kBudget - kUnit);
  EXPECT_EQ(a->stats().peer_evictions, 1u);
  EXPECT_EQ(ledger_bytes(), kBudget);
  EXPECT_EQ(first_difference(contents(*b, h).data(), std::vector<unsigned char>(kUnit).data(),
                             kUnit),
            -1);  // zeroed, as a created handle is
  expect_intact(*a, in_a);

  for (const auto held : in_a.handles) {
    if (a->resident(held)) a->acquire(held, stream_);
  }
  b->acquire(h, stream_);  // the whole budget is acquired now
  try {
    b->create(kUnit, kTagOptimizerState, Tier::device);
    ADD_FAILURE() << "a create with no room anywhere in the shared budget succeeded";
  } catch (const TieringError& e) {
    EXPECT_NE(std::string(e.what()).find("the budget is shared"), std::string::npos) << e.what();
  }
  EXPECT_EQ(b->stats().handles, 1u);
  EXPECT_EQ(ledger_bytes(), kBudget);
  b->release(h, false);
  for (const auto held : in_a.handles) {
    if (a->resident(held)) a->release(held, false);
  }
  expect_intact(*a, in_a);
}

TEST_P(SharedStateBudgetTest, APrefetchDoesNotEvictTheOtherStores) {
  auto [a, b, in_a] = two_stores_a_full(300);
  const auto h = b->create(kUnit, kTagOptimizerState);
  b->prefetch(h, stream_);
  EXPECT_FALSE(b->resident(h));
  EXPECT_EQ(b->device_bytes(), 0u);
  EXPECT_EQ(a->device_bytes(), kBudget);
  EXPECT_EQ(b->stats().prefetch_skipped, 1u);
  EXPECT_EQ(a->stats().peer_evictions, 0u);
  // With room freed, the same prefetch goes ahead.
  a->evict(in_a.handles[0]);
  a->synchronize();
  b->prefetch(h, stream_);
  EXPECT_TRUE(b->resident(h));
  EXPECT_EQ(a->device_bytes() + b->device_bytes(), kBudget);
  expect_intact(*a, in_a);
}

TEST_P(SharedStateBudgetTest, AcquiredHandlesOfOneStoreLeaveTheOtherAClearError) {
  auto [a, b, in_a] = two_stores_a_full(400);
  for (auto h : in_a.handles) a->acquire(h, stream_);
  const auto h = b->create(kUnit, kTagOptimizerState);
  const auto mine = random_bytes(kUnit, 500);
  b->write(h, mine.data());
  try {
    b->acquire(h, stream_);
    ADD_FAILURE() << "acquire found room in a budget the other store's acquired handles fill";
  } catch (const TieringError& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("no room"), std::string::npos) << what;
    EXPECT_NE(what.find("shared"), std::string::npos) << what;
    EXPECT_NE(what.find("hold " + std::to_string(kBudget) + " bytes"), std::string::npos) << what;
  }
  EXPECT_FALSE(b->resident(h));
  EXPECT_EQ(b->device_bytes(), 0u);
  EXPECT_EQ(a->device_bytes(), kBudget);
  EXPECT_EQ(a->stats().peer_evictions, 0u);
  for (auto x : in_a.handles) a->release(x, /*dirty=*/false);
  expect_intact(*a, in_a);
  EXPECT_EQ(first_difference(contents(*b, h).data(), mine.data(), kUnit), -1);
  b->acquire(h, stream_);  // room again once released
  b->release(h, false);
}

// A store given a budget of its own keeps it, even with tidepool.state_budget set: it is
// not charged to the device's ledger, and each can fill its own while the store built
// from the configuration fills the shared one.
TEST_P(SharedStateBudgetTest, ExplicitBudgetsAreEachStoresOwn) {
  configure(kBudget);
  auto own1 = make_store(kBudget);
  auto own2 = make_store(kBudget);
  auto shared = make_store();
  std::vector<TieredStore::Handle> acquired;
  for (TieredStore* s : {own1.get(), own2.get(), shared.get()}) {
    for (int i = 0; i < 4; ++i) {
      const auto h = s->create(kUnit, kTagOptimizerState);
      s->acquire(h, stream_);
      acquired.push_back(h);
    }
    EXPECT_EQ(s->device_bytes(), kBudget);
  }
  EXPECT_FALSE(own1->stats().budget_shared);
  EXPECT_FALSE(own2->stats().budget_shared);
  EXPECT_TRUE(shared->stats().budget_shared);
  EXPECT_EQ(ledger_bytes(), kBudget);  // the configured store's only
  EXPECT_EQ(shared->stats().peer_bytes, 0u);
  std::size_t k = 0;
  for (TieredStore* s : {own1.get(), own2.get(), shared.get()}) {
    for (int i = 0; i < 4; ++i) s->release(acquired[k++], false);
  }
}

// The VMM pool's device-backed bytes and a store's share the ledger: a migration to the
// device takes free room only (chunks stay on the host when the store fills the budget),
// and a store never evicts a range: its acquire gets the clear error instead.
TEST_P(SharedStateBudgetTest, AVmmPoolAndAStoreShareTheBudget) {
  const std::size_t g = backend().granularity();
  configure(4 * g);
  VmmPool pool(backend());
  TieredStore store(backend(),
                    tiering_test::test_store_options(TieredStoreOptions::kDeviceBudgetFromConfig));
  std::vector<TieredStore::Handle> handles;
  for (int i = 0; i < 4; ++i) {
    handles.push_back(store.create(g, kTagOptimizerState));
    store.acquire(handles.back(), stream_);
    store.release(handles.back(), /*dirty=*/false);
  }
  ASSERT_EQ(store.device_bytes(), 4 * g);
  void* range = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::host);
  MigrationResult r = pool.migrate(range, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 0u);  // the store fills the budget: the range stays on the host
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(store.stats().peer_evictions, 0u);

  store.evict(handles[0]);
  store.evict(handles[1]);
  store.synchronize();
  r = pool.migrate(range, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(ledger_bytes(), 4 * g);
  const VmmStats v = pool.stats();
  EXPECT_TRUE(v.budget_shared);
  EXPECT_EQ(v.budget_peer_bytes, 2 * g);
  EXPECT_EQ(store.stats().peer_bytes, 2 * g);

  // The store's own released handles give room; the range does not.
  store.acquire(handles[0], stream_);
  store.acquire(handles[1], stream_);
  EXPECT_THROW(store.acquire(handles[2], stream_), TieringError);
  EXPECT_EQ(pool.bytes_in(range, MemoryLocation::device), 2 * g);
  pool.migrate(range, MemoryLocation::host);
  EXPECT_EQ(ledger_bytes(), 2 * g);
  store.acquire(handles[2], stream_);  // room again
  for (int i = 0; i < 3; ++i) store.release(handles[static_cast<std::size_t>(i)], false);
  pool.deallocate(range);
}

// Note [VMM device budget]: a range allocated on the device is never refused, but it
// first makes the stores sharing the budget give back released handles (their data
// written back), so the device stays within the budget; only acquired handles, which
// cannot be given, let it pass.
TEST_P(SharedStateBudgetTest, AVmmAllocationOnTheDeviceTakesRoomFromTheStoresReleasedHandles) {
  const std::size_t g = backend().granularity();
  configure(4 * g);
  VmmPool pool(backend());
  TieredStore store(backend(),
                    tiering_test::test_store_options(TieredStoreOptions::kDeviceBudgetFromConfig));
  Filled f;
  for (int i = 0; i < 4; ++i) {
    f.handles.push_back(store.create(g, kTagOptimizerState));
    f.data.push_back(random_bytes(g, 70 + static_cast<std::uint64_t>(i)));
    write_on_device(store, f.handles.back(), f.data.back(), stream_);
  }
  ASSERT_EQ(ledger_bytes(), 4 * g);

  void* range = pool.allocate(2 * g, kTagOptimizerState, MemoryLocation::device);
  ASSERT_NE(range, nullptr);
  EXPECT_EQ(pool.bytes_in(range, MemoryLocation::device), 2 * g);
  EXPECT_EQ(ledger_bytes(), 4 * g) << "the range took the device past the budget";
  EXPECT_EQ(store.device_bytes(), 2 * g);
  EXPECT_EQ(store.stats().peer_evictions, 2u);
  VmmStats v = pool.stats();
  EXPECT_EQ(v.budget_room_requests, 1u);
  EXPECT_EQ(v.budget_room_given_bytes, 2 * g);
  for (std::size_t i = 0; i < f.handles.size(); ++i) {
    EXPECT_EQ(first_difference(contents(store, f.handles[i]).data(), f.data[i].data(), g), -1)
        << "handle " << i;
  }

  // Nothing left to give: the store's two resident handles are acquired. The allocation
  // still succeeds, past the budget.
  store.acquire(f.handles[2], stream_);
  store.acquire(f.handles[3], stream_);
  ASSERT_EQ(store.device_bytes(), 4 * g - 2 * g);
  void* more = pool.allocate(g, kTagOptimizerState, MemoryLocation::device);
  ASSERT_NE(more, nullptr);
  EXPECT_EQ(ledger_bytes(), 5 * g);
  v = pool.stats();
  EXPECT_EQ(v.budget_room_requests, 2u);
  EXPECT_EQ(v.budget_room_given_bytes, 2 * g);

  // On the host: nothing asked.
  void* on_host = pool.allocate(g, kTagOptimizerState, MemoryLocation::host);
  EXPECT_EQ(pool.stats().budget_room_requests, 2u);
  store.release(f.handles[2], false);
  store.release(f.handles[3], false);
  for (void* p : {range, more, on_host}) pool.deallocate(p);
  EXPECT_EQ(ledger_bytes(), 2 * g);
}

// Two threads, each stepping its own store (4 handles, at most 2 acquired at a time) under
// a budget of 4 handles for both, and evicting its state after most steps: each step's
// room comes from the other's released handles most of the time.
// Neither may deadlock, no acquire may fail (the acquired handles always fit), the ledger
// never goes over, and every handle ends with its last write. Run under TSan too.
TEST_P(SharedStateBudgetTest, TwoThreadsSteppingTheirOwnStoresNeitherDeadlockNorLoseData) {
  configure(kBudget);
  std::array<std::unique_ptr<TieredStore>, 2> stores{make_store(), make_store()};
  const auto ledger = DeviceBudgetLedger::existing(backend().device());
  EXPECT_NE(ledger, nullptr);
  constexpr int kSteps = 150;
  constexpr std::size_t kHandles = 4;
  std::array<std::array<TieredStore::Handle, kHandles>, 2> handles{};
  std::array<std::array<std::vector<unsigned char>, kHandles>, 2> last{};
  for (std::size_t s = 0; s < 2; ++s) {
    for (std::size_t i = 0; i < kHandles; ++i) {
      handles[s][i] = stores[s]->create(kUnit, kTagOptimizerState);
    }
  }
  std::array<std::string, 2> failure;
  auto step_store = [&](std::size_t s) {
    TieredStore& store = *stores[s];
    const Stream stream = backend().create_stream();
    try {
      for (int step = 0; step < kSteps; ++step) {
        store.begin_step();
        TieredStore::Handle previous = 0;
        for (std::size_t i = 0; i < kHandles; ++i) {
          const TieredStore::Handle h = handles[s][i];
          void* dev = store.acquire(h, stream);  // the previous one is still acquired
          std::vector<unsigned char> data =
              random_bytes(kUnit, (s << 32) | (static_cast<std::uint64_t>(step) << 8) | i);
          backend().copy_async(dev, data.data(), kUnit, CopyKind::host_to_device, stream);
          backend().stream_synchronize(stream);
          last[s][i] = std::move(data);
          if (previous != 0) store.release(previous, /*dirty=*/true);
          previous = h;
          if (ledger && ledger->charged_bytes() > kBudget) {
            failure[s] = "the ledger went over the budget";
          }
        }
        store.release(previous, /*dirty=*/true);
        // Most steps end as the optimizer hooks end them, evicting the state, so that the
        // next step's room comes from the other store's released handles.
        if (step % 3 != 2) store.evict_tag(kTagOptimizerState);
        store.end_step();
      }
    } catch (const std::exception& e) {
      failure[s] = e.what();
    }
    store.release_stream(stream);  // Note [Use streams]
    backend().destroy_stream(stream);
  };
  std::thread first(step_store, 0);
  std::thread second(step_store, 1);
  first.join();
  second.join();
  for (std::size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(failure[s], "") << "store " << s;
    for (std::size_t i = 0; i < kHandles; ++i) {
      const auto seen = contents(*stores[s], handles[s][i]);
      EXPECT_EQ(first_difference(seen.data(), last[s][i].data(), kUnit), -1)
          << "store " << s << " handle " << i;
    }
  }
  // The last step keeps its state (step % 3 == 2): both stores hold what the budget let them.
  EXPECT_LE(stores[0]->device_bytes() + stores[1]->device_bytes(), kBudget);
  if (ledger) {
    EXPECT_EQ(ledger->charged_bytes(), stores[0]->device_bytes() + stores[1]->device_bytes());
  }
  EXPECT_GT(stores[0]->stats().peer_evictions + stores[1]->stats().peer_evictions, 0u);
}

INSTANTIATE_TEST_SUITE_P(Backends, SharedStateBudgetTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
