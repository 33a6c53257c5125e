// A tiered handle whose host block fell back to pageable memory moves into pinned memory
// at a later load, once pinned memory has room (Note [Pageable blocks are promoted] in
// tiering/host_promotion.cpp): its contents intact, counted, and asked for again only
// after pinned room was made. Host backend (fault injection for the registration).
#include <cstring>
#include <vector>

#include "allocator/tags.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using tiering_test::contents;
using tiering_test::FailingBackend;
using tiering_test::first_difference;
using tiering_test::random_bytes;

constexpr std::size_t kMiB = std::size_t{1} << 20;

class HostPromotionTest : public tiering_test::TieringStreamTest {
 protected:
  // An arena of its own with room for one 12 MiB direct mapping, not two.
  TieredStoreOptions options() {
    TieredStoreOptions o = tiering_test::small_chunk_store_options(64 * kMiB);
    o.host.pinned_budget_bytes = 16 * kMiB;
    o.host.warn_on_pageable_fallback = false;
    return o;
  }
  // What the device copy of `h` holds after a load (acquired on stream_ and released
  // clean, then evicted).
  std::vector<unsigned char> loaded(TieredStore& store, TieredStore::Handle h) {
    const auto seen = read_device(store.acquire(h, stream_), store.size(h), stream_);
    store.release(h, /*dirty=*/false);
    store.evict(h);
    store.synchronize();
    return seen;
  }
};

TEST_P(HostPromotionTest, APageableBlockIsPinnedAtTheFirstLoadAfterRoomWasMade) {
  TieredStore store(backend(), options());
  const auto first = store.create(12 * kMiB, kTagOptimizerState);
  const auto second = store.create(12 * kMiB, kTagOptimizerState);
  ASSERT_EQ(store.host_tier(first), HostTier::pinned);
  ASSERT_EQ(store.host_tier(second), HostTier::pageable);
  const auto data = random_bytes(12 * kMiB, 31);
  store.write(second, data.data());

  // No room yet: it stays pageable, and nothing is counted.
  EXPECT_EQ(first_difference(loaded(store, second).data(), data.data(), data.size()), -1);
  EXPECT_EQ(store.host_tier(second), HostTier::pageable);
  EXPECT_EQ(store.stats().host_promotions, 0u);

  store.destroy(first);  // what a restored optimizer does with the state it replaced
  EXPECT_EQ(first_difference(loaded(store, second).data(), data.data(), data.size()), -1);
  EXPECT_EQ(store.host_tier(second), HostTier::pinned);
  const TieredStoreStats s = store.stats();
  EXPECT_EQ(s.host_promotions, 1u);
  EXPECT_EQ(s.host_promoted_bytes, 12 * kMiB);
  EXPECT_EQ(s.host.pageable_in_use_bytes, 0u);
  EXPECT_EQ(s.host.pinned_in_use_bytes, 12 * kMiB);
  EXPECT_EQ(first_difference(contents(store, second).data(), data.data(), data.size()), -1);
  EXPECT_NE(store.stats_json().find("\"host_promotions\":1"), std::string::npos);
}

// A block the budget has no room for does not keep a smaller one that fits from moving
// (review finding: one refusal held every promotion of the store until more room came).
TEST_P(HostPromotionTest, ABlockTooLargeForTheRoomDoesNotHoldBackOneThatFits) {
  TieredStore store(backend(), options());
  const auto first = store.create(8 * kMiB, kTagOptimizerState);
  const auto second = store.create(8 * kMiB, kTagOptimizerState);
  const auto large = store.create(10 * kMiB, kTagOptimizerState);
  const auto small = store.create(6 * kMiB, kTagOptimizerState);
  ASSERT_EQ(store.host_tier(second), HostTier::pinned);
  ASSERT_EQ(store.host_tier(large), HostTier::pageable);
  ASSERT_EQ(store.host_tier(small), HostTier::pageable);
  const auto data = random_bytes(6 * kMiB, 35);
  store.write(small, data.data());
  store.destroy(first);  // room for 8 MiB
  loaded(store, large);
  EXPECT_EQ(store.host_tier(large), HostTier::pageable);
  EXPECT_EQ(first_difference(loaded(store, small).data(), data.data(), data.size()), -1);
  EXPECT_EQ(store.host_tier(small), HostTier::pinned);
  store.destroy(second);  // now the large one fits too, asked again at its next load
  loaded(store, large);
  EXPECT_EQ(store.host_tier(large), HostTier::pinned);
  EXPECT_EQ(store.stats().host_promotions, 2u);
}

TEST_P(HostPromotionTest, WhatADirtyEvictionWroteIsWhatMovesToPinnedMemory) {
  TieredStore store(backend(), options());
  const auto first = store.create(12 * kMiB, kTagOptimizerState);
  const auto second = store.create(12 * kMiB, kTagOptimizerState);
  const auto data = random_bytes(12 * kMiB, 32);
  void* dev = store.acquire(second, stream_);
  backend().copy_async(dev, data.data(), data.size(), CopyKind::host_to_device, stream_);
  store.release(second, /*dirty=*/true);
  store.evict(second);  // the copy back lands in the pageable block
  store.synchronize();  // a block a copy still uses is left for a later load
  store.destroy(first);
  EXPECT_EQ(first_difference(loaded(store, second).data(), data.data(), data.size()), -1);
  EXPECT_EQ(store.host_tier(second), HostTier::pinned);
  EXPECT_EQ(first_difference(contents(store, second).data(), data.data(), data.size()), -1);
}

TEST_P(HostPromotionTest, AnAcquireToOverwriteThatFailsKeepsTheContentsItPromoted) {
  FailingBackend failing(backend());
  TieredStore store(failing, options());
  const auto first = store.create(12 * kMiB, kTagOptimizerState);
  const auto second = store.create(12 * kMiB, kTagOptimizerState);
  const auto data = random_bytes(12 * kMiB, 33);
  store.write(second, data.data());
  store.destroy(first);
  // The wait on the caller's stream fails after the skipped load (Note [A failed acquire
  // to overwrite]): the host copy is the latest again, so it must have moved intact.
  failing.fail_calls_to("stream_wait_event", 100);
  EXPECT_THROW(store.acquire_to_overwrite(second, stream_), TieringError);
  failing.fail_calls_to("stream_wait_event", 0);
  EXPECT_EQ(store.host_tier(second), HostTier::pinned);
  EXPECT_EQ(first_difference(contents(store, second).data(), data.data(), data.size()), -1);
}

TEST_P(HostPromotionTest, ARefusalIsNotAskedAgainUntilPinnedRoomIsMade) {
  TieredStore store(backend(), options());
  // Registration fails for the create and for the first promotion; the budget has room.
  backend().inject_fault(FaultPoint::host_register, 2);
  const auto h = store.create(12 * kMiB, kTagOptimizerState);
  ASSERT_EQ(store.host_tier(h), HostTier::pageable);
  const auto data = random_bytes(12 * kMiB, 34);
  store.write(h, data.data());
  loaded(store, h);  // refused: the second injected failure
  EXPECT_EQ(store.host_tier(h), HostTier::pageable);
  // Registration would work now, but no pinned room was made since: not asked again.
  loaded(store, h);
  EXPECT_EQ(store.host_tier(h), HostTier::pageable);
  EXPECT_EQ(store.stats().host.register_failures, 2u);

  const auto small = store.create(64 << 10, kTagOptimizerState);  // a slab, then freed
  store.destroy(small);
  EXPECT_EQ(first_difference(loaded(store, h).data(), data.data(), data.size()), -1);
  EXPECT_EQ(store.host_tier(h), HostTier::pinned);
  EXPECT_EQ(store.stats().host_promotions, 1u);
}

INSTANTIATE_TEST_SUITE_P(Host, HostPromotionTest, ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
