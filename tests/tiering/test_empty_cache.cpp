// Note [empty_cache releases the spares] (tiering/tiering_registry.cpp): the C ABI's
// empty_cache, which torch.cuda.empty_cache() reaches, makes the tiering registry's VMM
// pool give back its spare host backings (Note [Spare host backings] in
// tiering/vmm_backings.cpp), also when called from inside a walk of the registry's stores,
// and the stores unpin their empty host slabs (Note [Empty slabs are unpinned]);
// the ranges keep their addresses and bytes, and the next move to the host creates new
// backings. Runs on the host backend, whose VMM is real (memfd + mmap).
#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/c_api_tiering.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::kMiB;

constexpr std::size_t kRange = 6 * kMiB;  // three 2 MiB granules: one chunk

constexpr int kSparesDevice = 3;

class EmptyCacheSpares : public tiering_test::HostBackendTest<kSparesDevice> {
 protected:
  // A pointer-stable range on the device, filled with `fill`, whose host backing is kept
  // as the pool's one spare: moved to the host and back. nullptr when that failed.
  unsigned char* range_with_a_spare(unsigned char fill) {
    auto* p = static_cast<unsigned char*>(
        tidepool_vmm_malloc(kRange, kDevice, kTagOptimizerState, nullptr));
    EXPECT_NE(p, nullptr) << tidepool_last_error();
    if (p == nullptr) return nullptr;
    std::memset(p, fill, kRange);  // host backend: device memory is host-addressable
    EXPECT_EQ(tidepool_evict_ptr(kDevice, p), 0) << tidepool_last_error();
    EXPECT_EQ(tidepool_prefetch_ptr(kDevice, p, nullptr), 0) << tidepool_last_error();
    EXPECT_EQ(pool().bytes_in(p, MemoryLocation::device), kRange);
    EXPECT_EQ(pool().stats().spare_host_backings, 1u) << "no spare for empty_cache to release";
    return pool().stats().spare_host_backings == 1 ? p : nullptr;
  }
  // After an empty_cache: no spare is left, the range keeps its bytes at its address and
  // moves out and back again (moves_again); then it is freed.
  static void expect_released_and_freed(unsigned char* p, unsigned char fill) {
    expect_no_spares();
    EXPECT_TRUE(holds(p, fill)) << "the range keeps its bytes at its address";
    moves_again(p, fill);
    EXPECT_EQ(tidepool_vmm_free(p, kDevice), 0) << tidepool_last_error();
  }
  static bool holds(const unsigned char* p, unsigned char fill) {
    for (std::size_t i = 0; i < kRange; ++i) {
      if (p[i] != fill) return false;
    }
    return true;
  }
  // The next move to the host still works, creating a backing, and keeps the bytes; and
  // so does the move back.
  static void moves_again(unsigned char* p, unsigned char fill) {
    const std::uint64_t created = pool().stats().backings_created;
    ASSERT_EQ(tidepool_evict_ptr(kDevice, p), 0) << tidepool_last_error();
    EXPECT_EQ(pool().bytes_in(p, MemoryLocation::host), kRange);
    EXPECT_GT(pool().stats().backings_created, created) << "no spare was left to take";
    EXPECT_TRUE(holds(p, fill));
    ASSERT_EQ(tidepool_prefetch_ptr(kDevice, p, nullptr), 0) << tidepool_last_error();
    EXPECT_EQ(pool().bytes_in(p, MemoryLocation::device), kRange);
    EXPECT_TRUE(holds(p, fill));
  }
  static void expect_no_spares() {
    const VmmStats s = pool().stats();
    EXPECT_EQ(s.spare_host_backings, 0u);
    EXPECT_EQ(s.spare_host_bytes, 0u);
    EXPECT_EQ(s.deferred_releases, 0u);
    EXPECT_EQ(c_stats_spare_bytes(), 0u);
  }
  // What the C stats (and tidepool.stats()'s tiering.vmm_spare_host_bytes) report.
  static std::uint64_t c_stats_spare_bytes() {
    tidepool_tiering_stats_v1 s{};
    s.struct_size = sizeof s;
    EXPECT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
    return s.vmm_spare_host_bytes;
  }
  static VmmPool& pool() { return tiering_vmm_pool(kDevice); }
  static constexpr int kDevice = kSparesDevice;
};

TEST_F(EmptyCacheSpares, EmptyCacheReleasesTheSpareHostBackings) {
  unsigned char* p = range_with_a_spare(0x5a);
  ASSERT_NE(p, nullptr);
  ASSERT_EQ(pool().stats().spare_host_bytes, kRange);
  EXPECT_EQ(c_stats_spare_bytes(), kRange);
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  expect_released_and_freed(p, 0x5a);
}

TEST_F(EmptyCacheSpares, EmptyCacheAllReleasesThem) {
  unsigned char* p = range_with_a_spare(0xc3);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(tidepool_empty_cache_all(), 0) << tidepool_last_error();
  expect_released_and_freed(p, 0xc3);
}

// On a thread that holds the registry (a walk of the stores), the hook reads the
// registry under that hold instead of locking it again (Note [Registry re-entry]).
TEST_F(EmptyCacheSpares, EmptyCacheFromInsideAStoreWalkReleasesThem) {
  unsigned char* p = range_with_a_spare(0x3c);
  ASSERT_NE(p, nullptr);
  {
    TieredStore store(device_allocator(kDevice).backend(),
                      tiering_test::test_store_options(8 * kMiB));
    int walked = 0;
    int rc = -2;
    for_each_tiered_store(kDevice, [&](TieredStore&) {
      ++walked;
      rc = tidepool_empty_cache(kDevice);
    });
    ASSERT_EQ(walked, 1);
    EXPECT_EQ(rc, 0) << tidepool_last_error();
  }
  expect_released_and_freed(p, 0x3c);
}

// Note [Empty slabs are unpinned] (tiering/host_arena.h): empty_cache has every tiered
// store of the device unregister its empty pinned slabs; a slab that holds a handle's host
// copy stays, and so do its bytes.
TEST_F(EmptyCacheSpares, EmptyCacheUnpinsTheStoresEmptyHostSlabs) {
  TieredStore store(device_allocator(kDevice).backend(),
                    tiering_test::test_store_options(8 * kMiB));
  const TieredStore::Handle kept = store.create(100 << 10, kTagOptimizerState);
  const TieredStore::Handle gone = store.create(200 << 10, kTagOptimizerState);
  ASSERT_EQ(store.stats().host.slab_count, 1u);
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(store.stats().host.slab_count, 1u) << "a slab holding two handles was released";

  store.destroy(gone);
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(store.stats().host.slab_count, 1u) << "a slab holding a handle was released";
  store.destroy(kept);
  EXPECT_EQ(tidepool_empty_cache_all(), 0) << tidepool_last_error();
  const HostArenaStats s = store.stats().host;
  EXPECT_EQ(s.slab_count, 0u);
  EXPECT_EQ(s.pinned_registered_bytes, 0u);
  EXPECT_EQ(s.slabs_released, 1u);

  // The next host copy takes a parked slab, registered again.
  const TieredStore::Handle next = store.create(100 << 10, kTagOptimizerState);
  EXPECT_EQ(store.stats().host.slab_count, 1u);
  EXPECT_EQ(store.stats().host.pageable_allocs, 0u);
  store.destroy(next);
}

}  // namespace
}  // namespace tidepool
