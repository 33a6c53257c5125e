// VmmPool: pointer-stable migration between device and host backing. The address never
// changes, the bytes follow, and every failure at the seam (no memory in the target, a
// map or copy that fails) leaves the data readable at the same address.
#include <cstring>

#include "allocator/c_api.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::first_difference;
using tiering_test::random_bytes;

constexpr int kTag = TIDEPOOL_TAG_OPTIMIZER_STATE;

class VmmMigrationTest : public tiering_test::TieringStreamTest {
 protected:
  void fill(void* ptr, const std::vector<unsigned char>& data) {
    backend().copy_async(ptr, data.data(), data.size(), CopyKind::host_to_device, stream_);
    backend().stream_synchronize(stream_);
  }
  long difference(const void* ptr, const std::vector<unsigned char>& data) {
    const auto seen = read_device(ptr, data.size(), stream_);
    return first_difference(seen.data(), data.data(), data.size());
  }
};

TEST_P(VmmMigrationTest, MigrationKeepsTheAddressAndTheBytes) {
  VmmPool pool(backend());
  const std::size_t n = 3 * backend().granularity() + 777;  // partial last granule
  void* p = pool.allocate(n, kTag);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(pool.size_of(p), 4 * backend().granularity());
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), 4 * backend().granularity());
  const auto data = random_bytes(n, 11);
  fill(p, data);
  pool.record_use(p, stream_);
  pool.migrate(p, MemoryLocation::host);
  EXPECT_EQ(pool.base_of(static_cast<char*>(p) + 5), p);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), 4 * backend().granularity());
  EXPECT_EQ(difference(p, data), -1);
  if (on_host()) {  // the host backend's "device" memory is host-readable
    EXPECT_EQ(first_difference(static_cast<unsigned char*>(p), data.data(), n), -1);
  }
  pool.migrate(p, MemoryLocation::device);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), 4 * backend().granularity());
  EXPECT_EQ(difference(p, data), -1);
  const VmmStats s = pool.stats();
  EXPECT_EQ(s.bytes_to_host, 4 * backend().granularity());
  EXPECT_EQ(s.bytes_to_device, 4 * backend().granularity());
  pool.deallocate(p);
  EXPECT_EQ(pool.stats().ranges, 0u);
}

TEST_P(VmmMigrationTest, MigrationWaitsForTheStreamsThatUsedTheRange) {
  VmmPool pool(backend());
  const std::size_t n = backend().granularity();
  void* p = pool.allocate(n, kTag);
  const auto data = random_bytes(n, 12);
  // Enqueued, not waited for: migrate() must wait for stream_ before copying.
  backend().copy_async(p, data.data(), n, CopyKind::host_to_device, stream_);
  pool.record_use(p, stream_);
  pool.migrate(p, MemoryLocation::host);
  EXPECT_EQ(difference(p, data), -1);
  pool.deallocate(p);
}

TEST_P(VmmMigrationTest, TagMigrationMovesOnlyThatTag) {
  VmmPool pool(backend());
  void* a = pool.allocate(1000, kTag);
  void* b = pool.allocate(1000, TIDEPOOL_TAG_WORKSPACE);
  EXPECT_EQ(pool.migrate_tag(kTag, MemoryLocation::host), 1u);
  EXPECT_EQ(pool.bytes_in(a, MemoryLocation::host), backend().granularity());
  EXPECT_EQ(pool.bytes_in(b, MemoryLocation::device), backend().granularity());
  pool.deallocate(a);
  pool.deallocate(b);
}

TEST_P(VmmMigrationTest, BadInputIsAClearError) {
  VmmPool pool(backend());
  EXPECT_THROW(pool.allocate(0, kTag), TieringError);
  int x = 0;
  EXPECT_THROW(pool.deallocate(&x), TieringError);
  EXPECT_THROW(pool.migrate(&x, MemoryLocation::host), TieringError);
  EXPECT_THROW(pool.record_use(&x, stream_), TieringError);
  void* p = pool.allocate(100, kTag);
  EXPECT_THROW(pool.deallocate(static_cast<char*>(p) + 64), TieringError);  // not the base
  EXPECT_FALSE(pool.owns(&x));
  EXPECT_TRUE(pool.owns(static_cast<char*>(p) + 64));
  pool.deallocate(p);
}

// ---- fault injection (host backend) ------------------------------------------------------

class VmmMigrationFaultTest : public VmmMigrationTest {};

TEST_P(VmmMigrationFaultTest, EveryFailedStepKeepsTheDataAtTheSameAddress) {
  VmmPool pool(backend());
  const std::size_t n = 2 * backend().granularity();
  void* p = pool.allocate(n, kTag);
  const auto data = random_bytes(n, 13);
  fill(p, data);
  // The map of the new backing fails (the seam's injection hits the next map).
  backend().inject_fault(FaultPoint::map, 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n);
  EXPECT_EQ(difference(p, data), -1);

  backend().inject_fault(FaultPoint::create_physical, 1);
  try {
    pool.migrate(p, MemoryLocation::host);
    FAIL() << "expected TieringError";
  } catch (const TieringError& e) {
    EXPECT_NE(std::string(e.what()).find("out of host memory"), std::string::npos) << e.what();
  }
  EXPECT_EQ(difference(p, data), -1);

  backend().inject_fault(FaultPoint::copy, 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), n);
  EXPECT_EQ(difference(p, data), -1);

  EXPECT_EQ(pool.stats().failed_migrations, 3u);
  pool.migrate(p, MemoryLocation::host);  // the faults are spent
  EXPECT_EQ(difference(p, data), -1);
  pool.deallocate(p);
}

TEST_P(VmmMigrationFaultTest, OutOfDeviceMemoryOnAllocateIsNull) {
  VmmPool pool(backend());
  backend().inject_fault(FaultPoint::create_physical, 1);
  EXPECT_EQ(pool.allocate(1000, kTag), nullptr);
  EXPECT_EQ(pool.stats().ranges, 0u);
  void* p = pool.allocate(1000, kTag);
  EXPECT_NE(p, nullptr);
  pool.deallocate(p);
}

INSTANTIATE_TEST_SUITE_P(Backends, VmmMigrationTest, TIDEPOOL_TIERING_BACKENDS,
                         tiering_test::backend_name);
#ifndef TIDEPOOL_TIERING_GPU_BUILD  // fault injection exists on the host backend only
INSTANTIATE_TEST_SUITE_P(Host, VmmMigrationFaultTest, ::testing::Values(BackendKind::host),
                         tiering_test::backend_name);
#else
GTEST_ALLOW_UNINSTANTIATED_PARAMETERIZED_TEST(VmmMigrationFaultTest);
#endif

}  // namespace
}  // namespace tidepool
