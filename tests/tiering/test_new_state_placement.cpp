// VmmPool::allocate_within_budget (Note [New state where the budget puts it] in
// tiering/vmm_migration.cpp): new state is placed chunk by chunk as a prefetch would
// place it, on the device within the device budget and on the host past it or when the
// device is full, at one address, with its bytes readable wherever each chunk lives.
#include <cstddef>
#include <vector>

#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

class NewStatePlacementTest : public tiering_test::TieringStreamTest {
 protected:
  // A host-backend device this small fills up with a few ranges (the cuda backend's
  // device is what it is; tests that fill it skip there).
  std::size_t capacity_bytes() const override { return std::size_t{32} << 20; }
  std::size_t granule() { return backend().granularity(); }
  // One granule per chunk: a range of a few granules is split granule by granule.
  VmmPoolOptions options(std::size_t device_budget) {
    return VmmPoolOptions{.device_budget_bytes = device_budget, .chunk_granules = 1};
  }
  // Writes fresh bytes through `ptr` and says whether they read back.
  bool keeps_bytes(void* ptr, std::size_t bytes, std::uint64_t seed) {
    const auto data = random_bytes(bytes, seed);
    backend().copy_async(ptr, data.data(), bytes, CopyKind::host_to_device, stream_);
    backend().stream_synchronize(stream_);
    const auto seen = read_device(ptr, bytes, stream_);
    return first_difference(seen.data(), data.data(), bytes) == -1;
  }
};

TEST_P(NewStatePlacementTest, WithoutABudgetNewStateIsOnTheDevice) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(VmmPoolOptions::kNoDeviceBudget));
  void* p = pool.allocate_within_budget(3 * g, kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), 3 * g);
  EXPECT_TRUE(keeps_bytes(p, 3 * g, 1));
  pool.deallocate(p);
}

TEST_P(NewStatePlacementTest, ABudgetOfZeroPutsAllNewStateOnTheHost) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(0));
  void* p = pool.allocate_within_budget(3 * g + 1, kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), 4 * g) << "whole granules";
  EXPECT_EQ(pool.stats().device_backed_bytes, 0u);
  EXPECT_TRUE(keeps_bytes(p, 4 * g, 2));
  // Nothing to move after the step: the state is where the eviction would have put it.
  EXPECT_EQ(pool.migrate(p, MemoryLocation::host).bytes_moved, 0u);
  pool.deallocate(p);
  EXPECT_EQ(pool.stats().host_backed_bytes, 0u);
}

TEST_P(NewStatePlacementTest, NewStateFillsTheBudgetChunkByChunkAndTheRestGoesToTheHost) {
  const std::size_t g = granule();
  VmmPool pool(backend(), options(3 * g));
  void* first = pool.allocate_within_budget(2 * g, kTagOptimizerState);
  void* second = pool.allocate_within_budget(3 * g, kTagOptimizerState);
  ASSERT_NE(first, nullptr);
  ASSERT_NE(second, nullptr);
  EXPECT_EQ(pool.bytes_in(first, MemoryLocation::device), 2 * g);
  EXPECT_EQ(pool.bytes_in(second, MemoryLocation::device), g) << "the budget's last granule";
  EXPECT_EQ(pool.bytes_in(second, MemoryLocation::host), 2 * g);
  EXPECT_EQ(pool.stats().device_backed_bytes, 3 * g);
  EXPECT_TRUE(keeps_bytes(first, 2 * g, 3));
  EXPECT_TRUE(keeps_bytes(second, 3 * g, 4)) << "one pointer over both kinds of backing";
  // The budget is full: a prefetch moves nothing more ...
  EXPECT_EQ(pool.migrate(second, MemoryLocation::device).bytes_left, 2 * g);
  // ... and freeing state gives its room to the next new state.
  pool.deallocate(first);
  void* third = pool.allocate_within_budget(2 * g, kTagOptimizerState);
  ASSERT_NE(third, nullptr);
  EXPECT_EQ(pool.bytes_in(third, MemoryLocation::device), 2 * g);
  EXPECT_LE(pool.stats().device_backed_bytes, 3 * g);
  pool.deallocate(second);
  pool.deallocate(third);
}

TEST_P(NewStatePlacementTest, ADeviceWithoutMemoryPutsNewStateOnTheHostInsteadOfFailing) {
  if (!on_host()) GTEST_SKIP() << "fills the device: host backend only";
  const std::size_t g = granule();
  const std::size_t capacity = capacity_bytes();
  VmmPool pool(backend(), options(4 * capacity));  // a budget the device cannot honour
  VmmPool plain(backend(), options(VmmPoolOptions::kNoDeviceBudget));
  EXPECT_EQ(plain.allocate(capacity + g, kTagOptimizerState, MemoryLocation::device), nullptr)
      << "on the device only, it does not fit";
  void* p = pool.allocate_within_budget(capacity + g, kTagOptimizerState);
  ASSERT_NE(p, nullptr);
  EXPECT_GE(pool.bytes_in(p, MemoryLocation::host), g);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device) + pool.bytes_in(p, MemoryLocation::host),
            capacity + g);
  EXPECT_TRUE(keeps_bytes(p, capacity + g, 5));
  pool.deallocate(p);
  EXPECT_EQ(pool.stats().device_backed_bytes, 0u);
  // The device's memory came back: a range that fits is on the device again.
  void* q = pool.allocate_within_budget(2 * g, kTagOptimizerState);
  ASSERT_NE(q, nullptr);
  EXPECT_EQ(pool.bytes_in(q, MemoryLocation::device), 2 * g);
  pool.deallocate(q);
}

TEST_P(NewStatePlacementTest, BadInputIsAClearError) {
  VmmPool pool(backend(), options(0));
  EXPECT_THROW(pool.allocate_within_budget(0, kTagOptimizerState), TieringError);
  EXPECT_THROW(pool.allocate_within_budget(std::size_t{1} << 50, kTagOptimizerState),
               TieringError);
  EXPECT_EQ(pool.stats().ranges, 0u) << "nothing was left half-made";
}

INSTANTIATE_TEST_SUITE_P(Backends, NewStatePlacementTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);

}  // namespace
}  // namespace tidepool
