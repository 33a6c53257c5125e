// Note [A device with no room for a prefetch] (tiering/vmm_migration.cpp): a move of
// pointer-stable state to the device whose budget has room but whose device is full of
// other memory moves what fits, leaves the rest on the host (counted as left there), and
// goes on to the next range, instead of throwing: the Python pre-step hook prefetches by
// tag or by pointers before every step, and a throw there failed optimizer.step(). A
// host-backend device of 16 MiB stands in for a full GPU.
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include "allocator/backend.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

constexpr int kStateTag = 3;
constexpr int kOtherTag = 4;

class VmmFullDeviceTest : public ::testing::Test {
 protected:
  VmmFullDeviceTest() {
    HostBackendOptions o;
    o.capacity_bytes = std::size_t{16} << 20;
    backend_ = make_host_backend(0, o);
    granule_ = backend_->granularity();
    VmmPoolOptions po;
    po.device_budget_bytes = VmmPoolOptions::kNoDeviceBudget;
    po.chunk_granules = 1;  // one granule per chunk: a 4-granule range is 4 chunks
    pool_ = std::make_unique<VmmPool>(*backend_, po);
  }
  // A range on the host holding `fill` in every byte.
  void* host_state(std::size_t granules, unsigned char fill) {
    void* p = pool_->allocate(granules * granule_, kStateTag, MemoryLocation::host);
    EXPECT_NE(p, nullptr);
    std::memset(p, fill, granules * granule_);
    return p;
  }
  // Fills the device but for `free_granules` granules.
  void leave_free(std::size_t free_granules) {
    const std::size_t total = backend_->mem_info().total_bytes;
    other_ = pool_->allocate(total - free_granules * granule_, kOtherTag, MemoryLocation::device);
    ASSERT_NE(other_, nullptr);
  }
  static bool holds(const void* p, std::size_t bytes, unsigned char fill) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < bytes; ++i) {
      if (b[i] != fill) return false;
    }
    return true;
  }
  std::unique_ptr<Backend> backend_;
  std::size_t granule_ = 0;
  std::unique_ptr<VmmPool> pool_;
  void* other_ = nullptr;
};

TEST_F(VmmFullDeviceTest, AMoveToAFullDeviceMovesWhatFitsAndLeavesTheRestOnTheHost) {
  void* state = host_state(4, 0x5a);
  leave_free(2);
  MigrationResult r;
  ASSERT_NO_THROW(r = pool_->migrate(state, MemoryLocation::device));
  EXPECT_EQ(r.bytes_moved, 2 * granule_);
  EXPECT_EQ(r.bytes_left, 2 * granule_);
  EXPECT_EQ(pool_->bytes_in(state, MemoryLocation::device), 2 * granule_);
  EXPECT_EQ(pool_->bytes_in(state, MemoryLocation::host), 2 * granule_);
  EXPECT_TRUE(holds(state, 4 * granule_, 0x5a));
  const VmmStats s = pool_->stats();
  EXPECT_EQ(s.failed_migrations, 0u);
  EXPECT_EQ(s.budget_stops, 1u);
  EXPECT_EQ(s.bytes_left_on_host, 2 * granule_);
  // Once the device has room, the next prefetch brings the rest.
  pool_->deallocate(other_);
  r = pool_->migrate(state, MemoryLocation::device);
  EXPECT_EQ(r.bytes_moved, 2 * granule_);
  EXPECT_EQ(r.bytes_left, 0u);
  EXPECT_TRUE(holds(state, 4 * granule_, 0x5a));
  pool_->deallocate(state);
}

// Note [A failed creation is taken last] (tiering/vmm_moves.cpp): the helper threads
// create a move's device backings concurrently, so the one creation that fails (out of
// memory, as far as the move can tell) may come before or after others were made. Every
// backing made is taken: the move moves one chunk per backing created, and stops only
// when none is left. It stopped at the failed slot when that came first, moving nothing
// and giving back what was made for the rest. (The test above, a device with room for two
// of four, raced the same way: it failed about once in five runs.)
TEST_F(VmmFullDeviceTest, EveryBackingCreatedAheadOfAFailedOneIsMovedInto) {
  for (int run = 0; run < 64; ++run) {
    const auto fill = static_cast<unsigned char>(0x30 + run);
    void* state = host_state(4, fill);
    const std::uint64_t created_before = pool_->stats().backings_created;
    backend_->inject_fault(FaultPoint::create_physical, 1);
    MigrationResult r;
    ASSERT_NO_THROW(r = pool_->migrate(state, MemoryLocation::device));
    const std::uint64_t created = pool_->stats().backings_created - created_before;
    EXPECT_EQ(r.bytes_moved, created * granule_) << "run " << run;
    EXPECT_EQ(r.bytes_moved + r.bytes_left, 4 * granule_) << "run " << run;
    EXPECT_EQ(pool_->bytes_in(state, MemoryLocation::device), r.bytes_moved);
    EXPECT_TRUE(holds(state, 4 * granule_, fill));
    // Nothing created for the move stays behind: the next one brings the rest.
    r = pool_->migrate(state, MemoryLocation::device);
    EXPECT_EQ(r.bytes_left, 0u);
    EXPECT_EQ(backend_->mem_info().free_bytes, backend_->mem_info().total_bytes - 4 * granule_);
    EXPECT_TRUE(holds(state, 4 * granule_, fill));
    pool_->deallocate(state);
  }
}

TEST_F(VmmFullDeviceTest, APrefetchByTagGoesOnToTheRangesAfterOneTheDeviceHasNoRoomFor) {
  void* big = host_state(3, 0x11);
  void* small = host_state(1, 0x22);
  leave_free(1);
  MigrationResult r;
  ASSERT_NO_THROW(r = pool_->migrate_tag(kStateTag, MemoryLocation::device));
  EXPECT_EQ(r.ranges, 2u);
  // The oldest range takes the one free granule; the rest of it, and the newer range,
  // stay on the host.
  EXPECT_EQ(r.bytes_moved, granule_);
  EXPECT_EQ(r.bytes_left, 3 * granule_);
  EXPECT_TRUE(holds(big, 3 * granule_, 0x11));
  EXPECT_TRUE(holds(small, granule_, 0x22));
  const void* ptrs[] = {small, big};
  ASSERT_NO_THROW(r = pool_->migrate_ranges_holding(ptrs, MemoryLocation::device));
  EXPECT_EQ(r.ranges, 2u);
  EXPECT_EQ(r.bytes_moved, 0u);
  EXPECT_EQ(r.bytes_left, 3 * granule_);
  pool_->deallocate(big);
  pool_->deallocate(small);
  pool_->deallocate(other_);
}

}  // namespace
}  // namespace tidepool
