// The tiering C ABI: VMM-backed allocations moved by pointer and by tag, tag operations
// reaching the device's tiered stores, versioned stats, the JSON snapshot, the allocator's
// reclaim hook reaching the stores on an allocator OOM, and errors as return codes with a message.
#include <cstdlib>
#include <cstring>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/device_registry.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/c_api_tiering.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

// A device index of its own, so the process-wide registry state of other tests (and of
// the allocator's device 0) is not shared.
constexpr int kDevice = 5;
constexpr int kTag = TIDEPOOL_TAG_OPTIMIZER_STATE;

class CApiTieringTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    backend_ = make_host_backend(kDevice).release();
    set_tiering_backend(kDevice, backend_);
  }
  static Backend* backend_;  // lives for the process, as the registry borrows it
};
Backend* CApiTieringTest::backend_ = nullptr;

TEST_F(CApiTieringTest, PointerAndTagMigrationKeepTheAddress) {
  auto* p = static_cast<unsigned char*>(tidepool_vmm_malloc(100000, kDevice, kTag, nullptr));
  ASSERT_NE(p, nullptr) << tidepool_tiering_last_error();
  EXPECT_EQ(tidepool_vmm_owns(p + 10, kDevice), 1);
  std::memset(p, 0x5a, 100000);  // host backend: device memory is host-addressable
  ASSERT_EQ(tidepool_evict_ptr(kDevice, p), 0) << tidepool_tiering_last_error();
  VmmPool& pool = tiering_vmm_pool(kDevice);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), pool.size_of(p));
  ASSERT_EQ(tidepool_prefetch_tag(kDevice, kTag, nullptr), 0) << tidepool_tiering_last_error();
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), pool.size_of(p));
  ASSERT_EQ(tidepool_evict_tag(kDevice, kTag), 0);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), pool.size_of(p));
  ASSERT_EQ(tidepool_prefetch_ptr(kDevice, p, nullptr), 0);
  for (int i = 0; i < 100000; i += 997) ASSERT_EQ(p[i], 0x5a);
  EXPECT_EQ(tidepool_vmm_free(p, kDevice), 0);
}

TEST_F(CApiTieringTest, TagOperationsReachTheStoresAndStatsAddThemUp) {
  TieredStoreOptions o;
  o.device_budget_bytes = 1 << 20;
  o.host = tiering_test::test_host_options();
  TieredStore store(*backend_, o);
  auto h = store.create(4096, kTag, Tier::device);
  ASSERT_EQ(tidepool_evict_tag(kDevice, kTag), 0);
  EXPECT_FALSE(store.resident(h));
  ASSERT_EQ(tidepool_prefetch_tag(kDevice, kTag, nullptr), 0);
  EXPECT_TRUE(store.resident(h));
  store.synchronize();

  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_tiering_last_error();
  EXPECT_EQ(s.version, 1u);
  EXPECT_EQ(s.stores, 1u);
  EXPECT_EQ(s.h2d_bytes, 4096u);
  EXPECT_EQ(s.evictions, 1u);
  EXPECT_EQ(s.evictions_clean, 1u);
  EXPECT_EQ(s.device_budget_bytes, std::size_t{1} << 20);

  char* json = tidepool_tiering_snapshot_json(kDevice);
  ASSERT_NE(json, nullptr);
  EXPECT_NE(std::strstr(json, "\"stores\":[{"), nullptr) << json;
  EXPECT_NE(std::strstr(json, "\"vmm\":{"), nullptr) << json;
  std::free(json);
}

TEST(TieringReclaimHook, AnAllocatorOutOfMemoryEvictsReleasedTieredState) {
  // The store takes its device buffers from a caching allocator over a small device; an
  // allocation elsewhere that does not fit makes the allocator run its reclaim hooks,
  // which reach the store through the tiering registry and evict its released state.
  HostBackendOptions bo;
  bo.capacity_bytes = 8 << 20;
  CachingAllocator allocator(make_host_backend(kDevice + 1, bo));
  TieredStoreOptions o;
  o.device_budget_bytes = 6 << 20;
  o.host = tiering_test::test_host_options();
  TieredStore store(allocator.backend(), o, caching_allocator_source(allocator));
  auto a = store.create(3 << 20, kTag, Tier::device);
  auto b = store.create(3 << 20, kTag, Tier::device);
  store.synchronize();
  EXPECT_EQ(allocator.stats().tags[kTag].bytes.current, std::size_t{6} << 20);
  void* big = allocator.allocate(5 << 20);  // fits only once the store lets go
  ASSERT_NE(big, nullptr);
  EXPECT_FALSE(store.resident(a) && store.resident(b));
  EXPECT_GE(store.stats().reclaim_calls, 1u);
  EXPECT_GT(store.stats().reclaimed_bytes, 0u);
  allocator.deallocate(big, 5 << 20);
}

TEST(TieringRegistry, DefaultsToTheDeviceAllocatorsBackend) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "device 7 is a host-backend device index";
  constexpr int kOtherDevice = 7;
  void* p = tidepool_vmm_malloc(4096, kOtherDevice, kTag, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_tiering_last_error();
  EXPECT_EQ(&tiering_vmm_pool(kOtherDevice).backend(), &device_allocator(kOtherDevice).backend());
  EXPECT_EQ(tidepool_vmm_free(p, kOtherDevice), 0);
}

TEST_F(CApiTieringTest, ErrorsAreCodesWithAMessage) {
  int x = 0;
  EXPECT_EQ(tidepool_evict_ptr(kDevice, &x), -1);
  EXPECT_NE(std::strstr(tidepool_tiering_last_error(), "does not own"), nullptr)
      << tidepool_tiering_last_error();
  EXPECT_EQ(tidepool_vmm_free(&x, kDevice), -1);
  EXPECT_EQ(tidepool_vmm_malloc(0, kDevice, kTag, nullptr), nullptr);
  EXPECT_STRNE(tidepool_tiering_last_error(), "");
  tidepool_tiering_stats_v1 s{};
  s.struct_size = 8;
  EXPECT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), -1);
  EXPECT_EQ(tidepool_get_tiering_stats_v1(kDevice, nullptr), -1);
  EXPECT_EQ(tidepool_evict_tag(-1, kTag), -1);
  EXPECT_EQ(tidepool_vmm_free(nullptr, kDevice), 0);  // like free(NULL)
}

}  // namespace
}  // namespace tidepool
