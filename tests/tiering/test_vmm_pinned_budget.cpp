// Note [Pinned host backings] (tiering/vmm_backings.cpp): the host backings of pointer-stable
// ranges are pinned memory, so they are charged to the pinned budget, by default the
// process's (tidepool.pinned_budget, else a quarter of RAM), which the tiered stores' host
// arenas share. Before, the ranges the Python hooks evict after each step pinned without
// bound: tidepool.pinned_budget bounded the stores alone. A move to the host stops where the
// budget has no room, the rest staying on the device with every byte readable; new state
// goes to the device instead; every backing gives its charge back once released (a deferred
// release keeps it until then).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "tests/support/test_backend.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/host_arena.h"
#include "tiering/c_api_tiering.h"
#include "tiering/pinned_budget.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::ConfigScope;
using tiering_test::kMiB;

constexpr int kStateTag = 7;

// Parameters: the backend, and the threads that create a move's backings ahead
// (BackingSupply): 0, each move creates its own as it goes; 4, helpers create them
// concurrently and a refusal by the budget reaches the move through the supply.
class VmmPinnedBudgetTest
    : public ::testing::TestWithParam<std::tuple<BackendKind, unsigned>> {
 protected:
  void SetUp() override {
    backend_ = test_support::make_test_backend(std::get<0>(GetParam()), std::size_t{1} << 30);
    if (!backend_) GTEST_SKIP() << "no CUDA device";
    stream_ = backend_->create_stream();
  }
  void TearDown() override {
    if (backend_ && stream_.handle) backend_->destroy_stream(stream_);
  }
  Backend& backend() { return *backend_; }
  std::size_t granule() { return backend_->granularity(); }

  // Chunks of one granule unless said: a 4-granule range is 4 chunks.
  VmmPoolOptions options(std::size_t pinned_budget = VmmPoolOptions::kProcessPinnedBudget,
                         std::size_t chunk_granules = 1) {
    VmmPoolOptions o;
    o.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget;
    o.chunk_granules = chunk_granules;
    o.creation_threads = std::get<1>(GetParam());
    o.pinned_budget_bytes = pinned_budget;
    return o;
  }
  // A range of `granules` on the device holding random bytes, which `expected_` keeps.
  void* device_state(VmmPool& pool, std::size_t granules, std::uint64_t seed) {
    const std::size_t bytes = granules * granule();
    void* p = pool.allocate(bytes, kStateTag, MemoryLocation::device);
    EXPECT_NE(p, nullptr);
    if (p == nullptr) return nullptr;
    expected_ = tiering_test::random_bytes(bytes, seed);
    backend_->copy_async(p, expected_.data(), bytes, CopyKind::host_to_device, stream_);
    backend_->stream_synchronize(stream_);
    return p;
  }
  // A range of `granules` moved to the host and back: its host backing is kept as a
  // spare, pinned and charged.
  void* leave_a_spare(VmmPool& pool, std::size_t granules, std::uint64_t seed) {
    void* p = device_state(pool, granules, seed);
    if (p == nullptr) return nullptr;
    EXPECT_EQ(pool.migrate(p, MemoryLocation::host).bytes_moved, granules * granule());
    EXPECT_EQ(pool.migrate(p, MemoryLocation::device).bytes_moved, granules * granule());
    EXPECT_EQ(pool.stats().spare_host_bytes, granules * granule());
    return p;
  }
  // The range at `p` holds expected_ (read through the device pointer, wherever it is).
  bool holds_expected(const void* p) {
    std::vector<unsigned char> now(expected_.size());
    backend_->copy_async(now.data(), p, now.size(), CopyKind::device_to_host, stream_);
    backend_->stream_synchronize(stream_);
    return tiering_test::first_difference(now.data(), expected_.data(), now.size()) < 0;
  }

  std::unique_ptr<Backend> backend_;
  Stream stream_;
  std::vector<unsigned char> expected_;
};

// A pool whose own pinned budget holds 2 of a range's 4 chunks: the move to the host moves
// 2, leaves 2 on the device without an error, and says so; the data is whole at the same
// address; the charge is what is pinned, spares included, and given back with them.
TEST_P(VmmPinnedBudgetTest, AMoveToTheHostStopsWhereThePinnedBudgetHasNoRoom) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(2 * g));
  void* state = device_state(pool, 4, 11);
  ASSERT_NE(state, nullptr);

  MigrationResult r;
  ASSERT_NO_THROW(r = pool.migrate(state, MemoryLocation::host));
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(pool.bytes_in(state, MemoryLocation::host), 2 * g);
  EXPECT_EQ(pool.bytes_in(state, MemoryLocation::device), 2 * g);
  EXPECT_TRUE(holds_expected(state));
  VmmStats s = pool.stats();
  EXPECT_FALSE(s.pinned_budget_shared);
  EXPECT_EQ(s.pinned_budget_bytes, 2 * g);
  EXPECT_EQ(s.pinned_bytes, 2 * g);
  EXPECT_EQ(s.host_backed_bytes, 2 * g);
  EXPECT_EQ(s.pinned_budget_stops, 1u);
  EXPECT_EQ(s.bytes_left_on_device, 2 * g);
  EXPECT_GE(s.pinned_budget_refusals, 1u);
  EXPECT_EQ(s.failed_migrations, 0u);
  EXPECT_EQ(s.budget_stops, 0u) << "a pinned stop is not a device budget stop";

  // Back on the device: the host backings become spares, still pinned, still charged.
  r = pool.migrate(state, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(r.bytes_left, 0u);
  EXPECT_TRUE(holds_expected(state));
  s = pool.stats();
  EXPECT_EQ(s.spare_host_bytes, 2 * g);
  EXPECT_EQ(s.pinned_bytes, 2 * g) << "spares are pinned memory";
  // The next eviction takes the spares, and again stops at the budget.
  r = pool.migrate(state, MemoryLocation::host);
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(r.bytes_left, 2 * g);
  EXPECT_EQ(pool.stats().pinned_bytes, 2 * g);
  EXPECT_TRUE(holds_expected(state));

  pool.deallocate(state);
  EXPECT_EQ(pool.stats().pinned_bytes, 0u);
}

// An eviction by tag goes through the ranges in allocation order and moves what the budget
// holds: 3 granules of room over a 2- and a 4-granule range move the first and one chunk
// of the second, and leave 3 chunks on the device, every byte in place.
TEST_P(VmmPinnedBudgetTest, AnEvictionByTagMovesWhatTheBudgetHoldsAndLeavesTheRest) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(3 * g));
  void* first = device_state(pool, 2, 21);
  const std::vector<unsigned char> first_bytes = expected_;
  void* second = device_state(pool, 4, 22);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);

  MigrationResult r;
  ASSERT_NO_THROW(r = pool.migrate_tag(kStateTag, MemoryLocation::host));
  EXPECT_EQ(r.ranges, 2u);
  EXPECT_EQ(r.bytes_moved, 3 * g);
  EXPECT_EQ(r.bytes_left, 3 * g);
  EXPECT_EQ(pool.bytes_in(first, MemoryLocation::host), 2 * g);
  EXPECT_EQ(pool.bytes_in(second, MemoryLocation::host), g);
  EXPECT_TRUE(holds_expected(second));
  expected_ = first_bytes;
  EXPECT_TRUE(holds_expected(first));
  const VmmStats s = pool.stats();
  EXPECT_EQ(s.pinned_bytes, 3 * g) << "backings created ahead and not taken are given back";
  EXPECT_EQ(s.bytes_left_on_device, 3 * g);
  EXPECT_EQ(s.failed_migrations, 0u);
  pool.deallocate(first);
  pool.deallocate(second);
  EXPECT_EQ(pool.stats().pinned_bytes, 0u);
}

// One budget for the process: a host arena's slab and a pool's host backings draw on the
// same tidepool.pinned_budget, each refused what the other took, and each gives it back.
TEST_P(VmmPinnedBudgetTest, TheProcessBudgetIsSharedWithTheHostArenas) {
  const std::size_t g = granule();
  const std::size_t before = process_pinned_bytes();
  ASSERT_EQ(before, 0u) << "the test needs a process with nothing pinned yet";
  const ConfigScope config("tidepool.pinned_budget:64MiB");
  HostArenaOptions arena_options;
  arena_options.warn_on_pageable_fallback = false;
  auto arena = std::make_unique<HostArena>(backend(), arena_options);
  const HostBlock block = arena->allocate(4096);  // a 64 MiB slab: the whole budget
  ASSERT_EQ(block.tier, HostTier::pinned) << arena->stats().last_fallback_reason;

  VmmPool pool(backend(), options());
  void* state = device_state(pool, 2, 31);
  ASSERT_NE(state, nullptr);
  MigrationResult r = pool.migrate(state, MemoryLocation::host);
  EXPECT_EQ(r.bytes_moved, 0u) << "the arena's slab spent the process's budget";
  EXPECT_EQ(r.bytes_left, 2 * g);
  VmmStats s = pool.stats();
  EXPECT_TRUE(s.pinned_budget_shared);
  EXPECT_EQ(s.pinned_budget_bytes, 64 * kMiB);
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_TRUE(holds_expected(state));

  arena->deallocate(block);
  arena.reset();  // its slab is unregistered: the budget is free again
  r = pool.migrate(state, MemoryLocation::host);
  EXPECT_EQ(r.bytes_moved, 2 * g);
  EXPECT_EQ(r.bytes_left, 0u);
  EXPECT_EQ(pool.stats().pinned_bytes, 2 * g);
  EXPECT_EQ(process_pinned_bytes(), before + 2 * g);
  EXPECT_TRUE(holds_expected(state));

  // Now the pool holds pinned memory an arena cannot have: 64 MiB less 2 granules is
  // less than a slab, and a direct mapping of the rest still fits.
  void* more = pool.allocate(64 * kMiB - 2 * g, kStateTag, MemoryLocation::host);
  ASSERT_NE(more, nullptr);
  HostArena second(backend(), arena_options);
  const HostBlock pageable = second.allocate(4096);
  EXPECT_EQ(pageable.tier, HostTier::pageable) << "the pool's host backings pinned the budget";
  EXPECT_NE(second.stats().last_fallback_reason.find("pointer-stable"), std::string::npos)
      << second.stats().last_fallback_reason;
  second.deallocate(pageable);
  EXPECT_EQ(pool.allocate(g, kStateTag, MemoryLocation::host), nullptr)
      << "a host range past the budget is out of host memory";

  pool.deallocate(more);
  pool.deallocate(state);
  EXPECT_EQ(process_pinned_bytes(), before);
}

// New state placed within the device budget goes to the host past it; where the pinned
// budget has no room either, to the device, past the state budget, rather than failing.
TEST_P(VmmPinnedBudgetTest, NewStateTheHostHasNoRoomForGoesToTheDevice) {
  const std::size_t g = granule();
  VmmPoolOptions o = options(g);
  o.device_budget_bytes = 0;  // all new state on the host, while there is room
  VmmPool pool(backend(), o);
  void* state = pool.allocate_within_budget(3 * g, kStateTag);
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(pool.bytes_in(state, MemoryLocation::host), g);
  EXPECT_EQ(pool.bytes_in(state, MemoryLocation::device), 2 * g);
  const VmmStats s = pool.stats();
  EXPECT_EQ(s.pinned_bytes, g);
  EXPECT_EQ(s.pinned_budget_refusals, 2u);
  pool.deallocate(state);
  EXPECT_EQ(pool.stats().pinned_bytes, 0u);
}

// A host backing whose release fails stays pinned, so it stays charged until the retry
// (Note [Deferred releases] in tiering/vmm_backings.cpp) releases it.
TEST_P(VmmPinnedBudgetTest, ADeferredReleaseKeepsItsChargeUntilItIsReleased) {
  const std::size_t g = granule();
  tiering_test::FailingBackend failing(backend());
  VmmPoolOptions o = options(4 * g);
  o.spare_host_bytes = 0;  // a move back releases the host backings at once
  VmmPool pool(failing, o);
  void* state = pool.allocate(2 * g, kStateTag, MemoryLocation::host);
  ASSERT_NE(state, nullptr);
  EXPECT_EQ(pool.stats().pinned_bytes, 2 * g);

  failing.fail_calls_to("release_physical", 1);
  ASSERT_NO_THROW(pool.migrate(state, MemoryLocation::device));
  VmmStats s = pool.stats();
  EXPECT_EQ(s.host_backed_bytes, 0u);
  EXPECT_EQ(s.deferred_releases, 1u);
  EXPECT_EQ(s.pinned_bytes, g) << "the backing whose release failed is still pinned";

  pool.migrate(state, MemoryLocation::device);  // any later call retries the release
  s = pool.stats();
  EXPECT_EQ(s.deferred_releases, 0u);
  EXPECT_EQ(s.pinned_bytes, 0u);
  EXPECT_EQ(failing.live_physicals(), 2u);  // the two device chunks
  pool.deallocate(state);
  EXPECT_EQ(failing.live_physicals(), 0u);
}

// A pool's spares (pinned, charged) of other sizes than the chunk to move are given back
// for it: a pool whose ranges change shape is not stopped at its budget by the spares the
// old ones left. Chunks of 4 granules, a budget of 4: A's 3-granule spare makes way for B.
TEST_P(VmmPinnedBudgetTest, SparesOfOtherSizesMakeRoomForAMoveToTheHost) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(4 * g, 4));
  void* a = leave_a_spare(pool, 3, 41);
  void* b = device_state(pool, 4, 42);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_EQ(pool.stats().spare_host_bytes, 3 * g);

  const MigrationResult r = pool.migrate(b, MemoryLocation::host);
  EXPECT_EQ(r.bytes_moved, 4 * g);
  EXPECT_EQ(r.bytes_left, 0u);
  EXPECT_TRUE(holds_expected(b));
  const VmmStats s = pool.stats();
  EXPECT_EQ(s.spare_host_bytes, 0u);
  EXPECT_EQ(s.pinned_bytes, 4 * g);
  EXPECT_EQ(s.pinned_budget_stops, 0u);
  EXPECT_EQ(s.pinned_budget_refusals, 0u) << "a refusal the spares made room for is none";
  pool.deallocate(a);
  pool.deallocate(b);
}

// ... but only when they make enough room: spares that could not cover the chunk with
// the budget's room are kept for the moves they fit. Budget 4 granules: a 1-granule spare
// and a 2-granule range on the host leave 1 of room; a 4-granule chunk cannot be had.
TEST_P(VmmPinnedBudgetTest, SparesAreKeptWhenTheyCannotMakeRoomEnough) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(4 * g, 4));
  void* a = leave_a_spare(pool, 1, 51);
  void* c = pool.allocate(2 * g, kStateTag, MemoryLocation::host);
  void* b = device_state(pool, 4, 52);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(pool.stats().spare_host_bytes, g);

  const MigrationResult r = pool.migrate(b, MemoryLocation::host);
  EXPECT_EQ(r.bytes_moved, 0u);
  EXPECT_EQ(r.bytes_left, 4 * g);
  const VmmStats s = pool.stats();
  EXPECT_EQ(s.spare_host_bytes, g) << "a spare given up for a chunk it could not make room for";
  EXPECT_EQ(s.pinned_bytes, 3 * g);
  EXPECT_EQ(s.pinned_budget_refusals, 1u);
  EXPECT_EQ(pool.migrate(a, MemoryLocation::host).bytes_moved, g) << "the spare serves a";
  EXPECT_TRUE(holds_expected(b));
  pool.deallocate(a);
  pool.deallocate(b);
  pool.deallocate(c);
}

std::string param_name(
    const ::testing::TestParamInfo<std::tuple<BackendKind, unsigned>>& info) {
  return std::string(std::get<0>(info.param) == BackendKind::cuda ? "cuda" : "host") + "_" +
         std::to_string(std::get<1>(info.param)) + "_creation_threads";
}

INSTANTIATE_TEST_SUITE_P(BackendsAndCreationThreads, VmmPinnedBudgetTest,
                         ::testing::Combine(TIDEPOOL_TIERING_BACKENDS, ::testing::Values(0u, 4u)),
                         param_name);

// New state through the C ABI (what the tier route of tidepool_malloc makes) that neither
// the host (the pinned budget spent) nor the device (too small) has room for: a null with
// a message that names both, not the error of a cleanup that took the null for a range.
TEST(VmmPinnedBudgetCApi, NewStateWithNoRoomAnywhereIsANullThatSaysWhy) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "device 13 is a host-backend device index";
  constexpr int kDevice = 13;
  HostBackendOptions small;
  small.capacity_bytes = 16 * kMiB;
  static Backend* backend = make_host_backend(kDevice, small).release();  // the registry's
  set_tiering_backend(kDevice, backend);
  const ConfigScope config("tidepool.state_budget:0,tidepool.pinned_budget:4MiB");
  void* p = tidepool_vmm_malloc(32 * kMiB, kDevice, kTagOptimizerState, nullptr);
  EXPECT_EQ(p, nullptr);
  const std::string error = tidepool_last_error();
  EXPECT_NE(error.find("tidepool.pinned_budget"), std::string::npos) << error;
  EXPECT_EQ(error.find("does not own"), std::string::npos) << error;
  // Room on the device once the request fits it: the range is made there.
  void* q = tidepool_vmm_malloc(8 * kMiB, kDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(q, nullptr) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_free(q, kDevice), 0) << tidepool_last_error();
}

}  // namespace
}  // namespace tidepool
