// Note [A busy registry in an OOM] (tiering/tiering_registry.cpp): an allocation that runs
// out of device memory while another thread holds the tiering registry (a walk of the
// stores: an eviction or prefetch by tag, the tiering stats, a stream release, another
// OOM) still gets the room tiered state can give. The reclaim hook used to try the
// registry once and give nothing when it was busy, so the allocation failed or not by
// timing. Here another thread holds the registry inside for_each_tiered_store while the
// allocation runs out of memory:
//   - held for the whole allocation: the pointer-stable state is still pushed to the host
//     (the pool is found without the registry);
//   - let go once the hook waits for it: the stores' released state is evicted as well.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"

namespace tidepool {
namespace {

using tiering_test::kMiB;

// Holds the tiering registry of `device` on a thread of its own, inside a walk of its
// stores (the device needs one), until `let_go()` returns true or a minute has passed
// (a test that fails must not hang).
class RegistryHolder {
 public:
  RegistryHolder(int device, std::function<bool()> let_go)
      : thread_([this, device, let_go = std::move(let_go)] {
          for_each_tiered_store(device, [&](TieredStore&) {
            if (holding_.exchange(true)) return;  // the first store is enough
            const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(1);
            while (!let_go() && std::chrono::steady_clock::now() < give_up) {
              std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
          });
        }) {
    const auto give_up = std::chrono::steady_clock::now() + std::chrono::minutes(1);
    while (!holding_ && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
  }
  ~RegistryHolder() { thread_.join(); }
  RegistryHolder(const RegistryHolder&) = delete;
  RegistryHolder& operator=(const RegistryHolder&) = delete;
  bool holding() const { return holding_; }

 private:
  std::atomic<bool> holding_{false};
  std::thread thread_;
};

// An allocator over an 8 MiB host-backend device of its own, and tiered stores over it.
class EightMiBDevice {
 public:
  explicit EightMiBDevice(int device) : allocator(make_host_backend(device, eight_mib())) {}
  std::unique_ptr<TieredStore> store(std::size_t budget) {
    return std::make_unique<TieredStore>(allocator.backend(),
                                         tiering_test::test_store_options(budget),
                                         caching_allocator_source(allocator));
  }
  CachingAllocator allocator;

 private:
  static HostBackendOptions eight_mib() {
    HostBackendOptions o;
    o.capacity_bytes = 8 * kMiB;
    return o;
  }
};

// Acquires and releases `h`; what it threw, or "".
std::string acquire_and_release(TieredStore& store, TieredStore::Handle h) {
  try {
    store.acquire(h, {});
    store.release(h, /*dirty=*/false);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

// Pointer-stable state fills a 64 MiB host-backend device; an untagged block then needs
// room, while another thread holds the registry throughout.
constexpr int kRangesDevice = 9;
constexpr std::size_t kCapacity = 64 * kMiB;
constexpr std::size_t kRange = 8 * kMiB;  // above tier_min_bytes: routed

class BusyRegistryRanges : public tiering_test::HostBackendTest<kRangesDevice> {};

TEST_F(BusyRegistryRanges, StateIsPushedToTheHostWhileAnotherThreadHoldsTheRegistry) {
  if (existing_device_allocator(kRangesDevice) == nullptr) {
    ASSERT_EQ(setenv("TIDEPOOL_HOST_CAPACITY_MB", "64", 1), 0);
    device_allocator(kRangesDevice);
    unsetenv("TIDEPOOL_HOST_CAPACITY_MB");
  }
  Backend& backend = device_allocator(kRangesDevice).backend();
  ASSERT_EQ(backend.mem_info().total_bytes, kCapacity);
  set_tier_min_bytes(kDefaultTierMinBytes);
  // The holder walks this store; it keeps no device memory.
  TieredStore store(backend, tiering_test::test_store_options(8 * kMiB));
  std::vector<void*> state;
  for (std::size_t i = 0; i < kCapacity / kRange; ++i) {
    ASSERT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
    void* p = tidepool_malloc(static_cast<ssize_t>(kRange), kRangesDevice, nullptr);
    ASSERT_EQ(tidepool_tag_pop(), 0);
    ASSERT_NE(p, nullptr) << tidepool_last_error();
    std::memset(p, static_cast<int>(0x60 + i), kRange);
    state.push_back(p);
  }
  std::atomic<bool> allocated{false};
  void* block = nullptr;
  {
    RegistryHolder holder(kRangesDevice, [&] { return allocated.load(); });
    ASSERT_TRUE(holder.holding());
    block = tidepool_malloc(static_cast<ssize_t>(3 * kRange), kRangesDevice, nullptr);
    allocated = true;
  }
  EXPECT_NE(block, nullptr) << tidepool_last_error();
  for (std::size_t i = 0; i < state.size(); ++i) {
    const auto* bytes = static_cast<const unsigned char*>(state[i]);
    EXPECT_EQ(bytes[0], 0x60 + i) << "range " << i;
    EXPECT_EQ(bytes[kRange - 1], 0x60 + i) << "range " << i;
  }
  if (block != nullptr) tidepool_free(block, 3 * kRange, kRangesDevice, nullptr);
  for (void* p : state) tidepool_free(p, kRange, kRangesDevice, nullptr);
  tidepool_empty_cache(kRangesDevice);
}

// A store's released state fills most of an 8 MiB device; an allocation elsewhere fits
// only once the store lets go, while another thread holds the registry until the
// allocation's reclaim hook has found it busy.
TEST(BusyRegistryStores, AnOomWaitsForTheRegistryAndEvictsTheStoresState) {
  constexpr int kStoresDevice = 10;
  EightMiBDevice device(kStoresDevice);
  CachingAllocator& allocator = device.allocator;
  const std::unique_ptr<TieredStore> owned = device.store(6 * kMiB);
  TieredStore& store = *owned;
  const auto a = store.create(3 * kMiB, kTagOptimizerState, Tier::device);
  const auto b = store.create(3 * kMiB, kTagOptimizerState, Tier::device);
  store.synchronize();
  const std::uint64_t busy_before = detail::reclaims_that_found_the_registry_busy();
  std::atomic<bool> allocated{false};
  void* big = nullptr;
  std::string error;
  {
    RegistryHolder holder(kStoresDevice, [&] {
      return allocated || detail::reclaims_that_found_the_registry_busy() > busy_before;
    });
    ASSERT_TRUE(holder.holding());
    try {
      big = allocator.allocate(5 * kMiB);  // fits only once the store lets go
    } catch (const std::exception& e) {
      error = e.what();
    }
    allocated = true;
  }
  EXPECT_NE(big, nullptr) << error;
  EXPECT_GT(detail::reclaims_that_found_the_registry_busy(), busy_before);
  EXPECT_FALSE(store.resident(a) && store.resident(b));
  EXPECT_GT(store.stats().reclaimed_bytes, 0u);
  if (big != nullptr) allocator.deallocate(big, 5 * kMiB);
}

// Note [One wait for a busy registry per store operation]: a store that makes room on a
// full device one victim at a time asks the allocator after each eviction, each ask
// through the OOM path. With the registry held all along, every ask waited 500 ms for it;
// now the operation waits once, and its later OOMs only try.
TEST(BusyRegistryStores, AStoreOperationWaitsForTheRegistryOnceWhateverItsOoms) {
  EightMiBDevice device(11);
  CachingAllocator& allocator = device.allocator;
  const std::unique_ptr<TieredStore> owned = device.store(8 * kMiB);
  TieredStore& store = *owned;
  // The device full, the store's two 2 MiB buffers apart: [v1][x1][v2][x2].
  const auto v1 = store.create(2 * kMiB, kTagOptimizerState, Tier::device);
  void* x1 = allocator.allocate(2 * kMiB);
  const auto v2 = store.create(2 * kMiB, kTagOptimizerState, Tier::device);
  void* x2 = allocator.allocate(2 * kMiB);
  store.synchronize();
  const auto wanted = store.create(4 * kMiB, kTagOptimizerState);  // on the host
  const std::uint64_t busy_before = detail::reclaims_that_found_the_registry_busy();
  const std::uint64_t waits_before = detail::reclaims_that_waited_for_the_registry();
  std::atomic<bool> done{false};
  std::string error;
  {
    RegistryHolder holder(11, [&] { return done.load(); });
    ASSERT_TRUE(holder.holding());
    error = acquire_and_release(store, wanted);  // room only once both victims are gone
    done = true;
  }
  EXPECT_EQ(error, "");
  EXPECT_FALSE(store.resident(v1) || store.resident(v2));
  EXPECT_GE(detail::reclaims_that_found_the_registry_busy() - busy_before, 2u)
      << "the test needs an operation with several OOMs";
  EXPECT_EQ(detail::reclaims_that_waited_for_the_registry() - waits_before, 1u);
  allocator.deallocate(x1, 2 * kMiB);
  allocator.deallocate(x2, 2 * kMiB);
}

// The last ask of a store with nothing left to evict waits for the registry again: the
// holder here is only busy (it waits for nothing of this thread's) and lets go once that
// ask has found it busy; the other store's released state then makes the room.
TEST(BusyRegistryStores, AStoresLastAskWaitsAgainForTheOtherStoresRoom) {
  EightMiBDevice device(12);
  CachingAllocator& allocator = device.allocator;
  const std::unique_ptr<TieredStore> asking_store = device.store(8 * kMiB);
  const std::unique_ptr<TieredStore> other_store = device.store(8 * kMiB);
  TieredStore& asking = *asking_store;
  TieredStore& other = *other_store;
  // The device full: [asking's 2 MiB][other's 2 + 2 MiB][2 MiB held].
  const auto own = asking.create(2 * kMiB, kTagOptimizerState, Tier::device);
  const auto u1 = other.create(2 * kMiB, kTagOptimizerState, Tier::device);
  const auto u2 = other.create(2 * kMiB, kTagOptimizerState, Tier::device);
  void* held = allocator.allocate(2 * kMiB);
  asking.synchronize();
  other.synchronize();
  const auto wanted = asking.create(4 * kMiB, kTagOptimizerState);  // on the host
  const std::uint64_t busy_before = detail::reclaims_that_found_the_registry_busy();
  std::atomic<bool> done{false};
  std::string error;
  {
    // Let go once a third OOM found the registry busy: the first waited in vain, the
    // second (after the own victim) only tried, the third is the last ask.
    RegistryHolder holder(12, [&] {
      return done || detail::reclaims_that_found_the_registry_busy() - busy_before >= 3;
    });
    ASSERT_TRUE(holder.holding());
    error = acquire_and_release(asking, wanted);
    done = true;
  }
  EXPECT_EQ(error, "");
  EXPECT_FALSE(asking.resident(own));
  EXPECT_FALSE(other.resident(u1) && other.resident(u2)) << "the other store gave room";
  allocator.deallocate(held, 2 * kMiB);
}

}  // namespace
}  // namespace tidepool
