// The allocator's tier route into the tiering layer: tidepool_malloc of optimizer state at
// or above tidepool.tier_min_bytes becomes a pointer-stable range of the device's VMM pool,
// freed through tidepool_free, and tidepool_release_stream and
// tidepool_pytorch_record_stream reach those ranges and the device's tiered stores.
#include <atomic>
#include <chrono>
#include <cstring>
#include <future>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/device_registry.h"
#include "allocator/forwarding_backend.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/c_api_tiering.h"
#include "tiering/tiered_store.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::ConfigScope;
using tiering_test::kMiB;

// tidepool_malloc's routing needs a device whose caching allocator and VMM pool are both
// on the host backend (the test reads the memory through the pointers).
constexpr int kRouteDevice = 3;

class TierRouteTest : public tiering_test::HostBackendTest<kRouteDevice> {
 protected:
  void SetUp() override {
    HostBackendTest::SetUp();
    if (IsSkipped()) return;
    set_tier_min_bytes(kDefaultTierMinBytes);
  }
  void TearDown() override { set_tier_min_bytes(kDefaultTierMinBytes); }
  static tidepool_stats_v1 stats() {
    tidepool_stats_v1 s{};
    s.struct_size = sizeof s;
    EXPECT_EQ(tidepool_get_stats_v1(kRouteDevice, &s), 0) << tidepool_last_error();
    return s;
  }
  // tidepool_malloc under optimizer_state.
  static void* malloc_state(std::size_t bytes) {
    EXPECT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
    void* p = tidepool_malloc(static_cast<ssize_t>(bytes), kRouteDevice, nullptr);
    EXPECT_EQ(tidepool_tag_pop(), 0);
    return p;
  }
  static bool routed(void* p) { return tidepool_vmm_owns(p, kRouteDevice) == 1; }
};

TEST_F(TierRouteTest, OptimizerStateAtOrAboveTheThresholdBecomesAPointerStableRange) {
  ASSERT_NE(tier_route(), nullptr) << "libtidepool's tiering layer registers the route at load";
  const tidepool_stats_v1 before = stats();
  void* big = malloc_state(kDefaultTierMinBytes);
  void* small = malloc_state(kDefaultTierMinBytes - 1);
  void* untagged = tidepool_malloc(3 * kMiB, kRouteDevice, nullptr);
  ASSERT_TRUE(big && small && untagged) << tidepool_last_error();
  EXPECT_TRUE(routed(big));
  EXPECT_FALSE(routed(small));
  EXPECT_FALSE(routed(untagged));
  // The caching allocator served the small state and the untagged block only.
  const tidepool_stats_v1 during = stats();
  EXPECT_EQ(during.tags[kTagOptimizerState].count, before.tags[kTagOptimizerState].count + 1);
  EXPECT_EQ(during.requested.current,
            before.requested.current + (kDefaultTierMinBytes - 1) + 3 * kMiB);
  EXPECT_EQ(tidepool_record_stream(big, kRouteDevice, nullptr), 0) << tidepool_last_error();

  // The routed range moves to the host and back at the same address with its bytes.
  std::memset(big, 0x3c, kDefaultTierMinBytes);
  ASSERT_EQ(tidepool_evict_ptr(kRouteDevice, big), 0) << tidepool_last_error();
  EXPECT_EQ(tiering_vmm_pool(kRouteDevice).bytes_in(big, MemoryLocation::device), 0u);
  ASSERT_EQ(tidepool_prefetch_ptr(kRouteDevice, big, nullptr), 0) << tidepool_last_error();
  const auto* bytes = static_cast<const unsigned char*>(big);
  for (std::size_t i = 0; i < kDefaultTierMinBytes; i += 4093) ASSERT_EQ(bytes[i], 0x3c) << i;

  const std::uint64_t ranges = tiering_vmm_pool(kRouteDevice).stats().ranges;
  ::testing::internal::CaptureStderr();
  tidepool_free(big, kDefaultTierMinBytes, kRouteDevice, nullptr);
  tidepool_free(small, kDefaultTierMinBytes - 1, kRouteDevice, nullptr);
  tidepool_free(untagged, 3 * kMiB, kRouteDevice, nullptr);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(tiering_vmm_pool(kRouteDevice).stats().ranges, ranges - 1);
  EXPECT_EQ(stats().requested.current, before.requested.current);
}

TEST_F(TierRouteTest, TheThresholdFollowsTidepoolTierMinBytes) {
  void* kept = nullptr;
  {
    const ConfigScope config("tidepool.tier_min_bytes:0");
    void* tiny = malloc_state(256);
    EXPECT_TRUE(routed(tiny));
    tidepool_free(tiny, 256, kRouteDevice, nullptr);
    kept = malloc_state(256);
    EXPECT_TRUE(routed(kept));
  }
  // Freed under the default threshold again: the free path's size shortcut sends it to
  // the caching allocator first, which rejects it, and the route still takes it back.
  const std::uint64_t ranges = tiering_vmm_pool(kRouteDevice).stats().ranges;
  ::testing::internal::CaptureStderr();
  tidepool_free(kept, 256, kRouteDevice, nullptr);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
  EXPECT_EQ(tiering_vmm_pool(kRouteDevice).stats().ranges, ranges - 1);
  {
    const ConfigScope config("tidepool.tier_min_bytes:8MiB");
    void* p = malloc_state(4 * kMiB);
    EXPECT_FALSE(routed(p));
    tidepool_free(p, 4 * kMiB, kRouteDevice, nullptr);
  }
  EXPECT_EQ(tier_min_bytes(), kDefaultTierMinBytes);  // the default configuration again
}

TEST_F(TierRouteTest, AFreedRangeFreedAgainIsAClearErrorAndChangesNothing) {
  void* p = malloc_state(2 * kMiB);
  ASSERT_TRUE(routed(p));
  tidepool_free(p, 2 * kMiB, kRouteDevice, nullptr);
  const tidepool_stats_v1 before = stats();
  ::testing::internal::CaptureStderr();
  tidepool_free(p, 2 * kMiB, kRouteDevice, nullptr);
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(printed.find("tidepool: "), std::string::npos) << printed;
  EXPECT_EQ(printed, std::string(tidepool_last_error()) + "\n");
  EXPECT_EQ(stats().free_count, before.free_count);
  void* q = malloc_state(2 * kMiB);  // the route and the allocator live on
  EXPECT_TRUE(routed(q));
  tidepool_free(q, 2 * kMiB, kRouteDevice, nullptr);
}

// Review finding: a routed range was freed whatever size the caller handed back, where the
// caching allocator refuses a wrong size; a caller that mixed up two sizes has lost track of
// which memory is which. Larger, and smaller than tier_min_bytes (which asks the caching
// allocator first): refused, said, nothing freed, the data intact.
TEST_F(TierRouteTest, AFreeWithAnotherSizeThanAllocatedIsRefusedAndFreesNothing) {
  const std::size_t bytes = 3 * kMiB + 5;
  auto* p = static_cast<unsigned char*>(malloc_state(bytes));
  ASSERT_TRUE(routed(p));
  std::memset(p, 0x5a, bytes);
  for (const std::size_t wrong : {bytes + 1, 4 * kMiB, std::size_t{8}}) {
    const tidepool_stats_v1 before = stats();
    ::testing::internal::CaptureStderr();
    tidepool_free(p, wrong, kRouteDevice, nullptr);
    const std::string printed = ::testing::internal::GetCapturedStderr();
    const std::string error = tidepool_last_error();
    EXPECT_NE(error.find("free of " + std::to_string(wrong) + " bytes"), std::string::npos)
        << error;
    EXPECT_NE(error.find("allocated with " + std::to_string(bytes) + " bytes"),
              std::string::npos)
        << error;
    EXPECT_NE(error.find("not freed"), std::string::npos) << error;
    EXPECT_EQ(printed, error + "\n");
    EXPECT_TRUE(routed(p)) << wrong;
    EXPECT_EQ(stats().free_count, before.free_count);
  }
  EXPECT_EQ(p[0], 0x5a);
  EXPECT_EQ(p[bytes - 1], 0x5a);
  tidepool_free(p, bytes, kRouteDevice, nullptr);
  EXPECT_FALSE(routed(p));
  // The tiering C ABI's own free takes no size, and needs none.
  void* q = tidepool_vmm_malloc(bytes, kRouteDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(q, nullptr) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_free(q, kRouteDevice), 0) << tidepool_last_error();
}

// TierRoute::live_ranges counts every range however made and freed. Review finding: the
// count was kept by the allocator's route calls only, so a routed range freed through
// tidepool_vmm_free stayed counted for good (every large free then asked the route), and
// a range of the tiering C ABI freed through tidepool_free was never counted.
TEST_F(TierRouteTest, TheLiveRangeCountFollowsEveryWayARangeIsMadeAndFreed) {
  const std::size_t before = tier_route()->live_ranges();
  void* routed_range = malloc_state(2 * kMiB);
  ASSERT_TRUE(routed(routed_range));
  EXPECT_EQ(tier_route()->live_ranges(), before + 1);
  EXPECT_EQ(tidepool_vmm_free(routed_range, kRouteDevice), 0) << tidepool_last_error();
  EXPECT_EQ(tier_route()->live_ranges(), before);
  void* direct = tidepool_vmm_malloc(2 * kMiB, kRouteDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(direct, nullptr) << tidepool_last_error();
  EXPECT_EQ(tier_route()->live_ranges(), before + 1);
  tidepool_free(direct, 2 * kMiB, kRouteDevice, nullptr);
  EXPECT_FALSE(routed(direct)) << tidepool_last_error();
  EXPECT_EQ(tier_route()->live_ranges(), before);
}

// Optimizer state asked for on a device that does not exist, or of a size beyond any
// range, is the caller's error, said as such: it never reaches the route, which took it
// for a failure of its own, said "the tier route failed" and used up its one report of a
// real failure (and left a registry entry for the device).
TEST_F(TierRouteTest, BadDevicesAndAbsurdSizesAreTheCallersErrorsNotTheRoutes) {
  for (const int device : {-1, 99}) {
    EXPECT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
    ::testing::internal::CaptureStderr();
    void* p = tidepool_malloc(static_cast<ssize_t>(2 * kMiB), device, nullptr);
    const std::string printed = ::testing::internal::GetCapturedStderr();
    EXPECT_EQ(tidepool_tag_pop(), 0);
    EXPECT_EQ(p, nullptr);
    EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
        << tidepool_last_error();
    EXPECT_EQ(printed.find("tier route failed"), std::string::npos) << printed;
  }
  ::testing::internal::CaptureStderr();
  void* huge = malloc_state(std::size_t{1} << 47);
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(huge, nullptr);
  EXPECT_EQ(printed.find("tier route failed"), std::string::npos) << printed;
  void* q = malloc_state(2 * kMiB);  // the route lives on
  EXPECT_TRUE(routed(q));
  tidepool_free(q, 2 * kMiB, kRouteDevice, nullptr);
}

TEST_F(TierRouteTest, ARangeFromTheTieringCAbiCanBeFreedThroughTidepoolFree) {
  // The live-range shortcut of the free path must not hide a range it did not count.
  void* p = tidepool_vmm_malloc(2 * kMiB, kRouteDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  const std::uint64_t ranges = tiering_vmm_pool(kRouteDevice).stats().ranges;
  tidepool_free(p, 2 * kMiB, kRouteDevice, nullptr);
  EXPECT_EQ(tiering_vmm_pool(kRouteDevice).stats().ranges, ranges - 1);
}

TEST_F(TierRouteTest, AReleasedStreamIsForgottenByTheRangesThatRecordedIt) {
  // A range allocated and recorded on a stream the program then releases and destroys:
  // moving the range later must not wait on the dead handle.
  Backend& backend = device_allocator(kRouteDevice).backend();
  const Stream s = backend.create_stream();
  ASSERT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
  void* allocated_on_s = tidepool_malloc(2 * kMiB, kRouteDevice, s.handle);
  ASSERT_EQ(tidepool_tag_pop(), 0);
  void* recorded_on_s = tidepool_vmm_malloc(2 * kMiB, kRouteDevice, kTagOptimizerState, nullptr);
  ASSERT_TRUE(allocated_on_s && recorded_on_s) << tidepool_last_error();
  ASSERT_TRUE(routed(allocated_on_s));
  ASSERT_EQ(tidepool_record_stream(recorded_on_s, kRouteDevice, s.handle), 0)
      << tidepool_last_error();
  std::memset(allocated_on_s, 0x5a, 2 * kMiB);

  ASSERT_EQ(tidepool_release_stream(kRouteDevice, s.handle), 0) << tidepool_last_error();
  backend.destroy_stream(s);
  for (void* p : {allocated_on_s, recorded_on_s}) {
    EXPECT_EQ(tidepool_evict_ptr(kRouteDevice, p), 0) << tidepool_last_error();
    EXPECT_EQ(tidepool_prefetch_ptr(kRouteDevice, p, nullptr), 0) << tidepool_last_error();
  }
  const auto* bytes = static_cast<const unsigned char*>(allocated_on_s);
  for (std::size_t i = 0; i < 2 * kMiB; i += 4093) ASSERT_EQ(bytes[i], 0x5a) << i;

  // Released again once destroyed: no range names it any more, so nothing waits on the
  // dead handle (Note [Releasing a stream no range used] in vmm_migration.cpp) and the
  // ranges are untouched.
  EXPECT_EQ(tidepool_release_stream(kRouteDevice, s.handle), 0) << tidepool_last_error();
  EXPECT_EQ(tiering_vmm_pool(kRouteDevice).bytes_in(allocated_on_s, MemoryLocation::device),
            2 * kMiB);
  ::testing::internal::CaptureStderr();
  tidepool_free(allocated_on_s, 2 * kMiB, kRouteDevice, nullptr);
  tidepool_free(recorded_on_s, 2 * kMiB, kRouteDevice, nullptr);
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");
}

TEST_F(TierRouteTest, AReleasedStreamIsForgottenByTheDevicesTieredStoresToo) {
  // Note [Use streams] in tiered_store.h: tidepool_release_stream reaches the stores of
  // the device, so state a stream used is not tied to it once it is destroyed.
  CachingAllocator& allocator = device_allocator(kRouteDevice);
  Backend& backend = allocator.backend();
  TieredStore store(backend, tiering_test::test_store_options(1 << 20),
                    caching_allocator_source(allocator));
  const auto [h, s, dev] = tiering_test::acquire_on_new_stream(store, 4096, kTagOptimizerState);
  backend.stream_synchronize(s);
  std::memset(dev, 0x6b, 4096);  // host backend: device memory is host-addressable
  store.release(h, /*dirty=*/true);
  ASSERT_EQ(tidepool_release_stream(kRouteDevice, s.handle), 0) << tidepool_last_error();
  backend.destroy_stream(s);
  EXPECT_NO_THROW(store.evict(h));
  std::vector<unsigned char> out(4096);
  store.read(h, out.data());
  for (unsigned char c : out) ASSERT_EQ(c, 0x6b);
  store.destroy(h);
}

// record_stream from PyTorch (Note [record_stream from PyTorch], allocator/c_api.h)
// names no device: a pointer-stable range is found through the route, and moving it
// then waits for the recorded stream.
TEST_F(TierRouteTest, PyTorchRecordStreamReachesAPointerStableRange) {
  Backend& backend = device_allocator(kRouteDevice).backend();
  const Stream s = backend.create_stream();
  tiering_test::StreamGate gate;
  const tiering_test::StreamGate::OpenOnExit open_on_exit{gate};
  backend.launch_host_func(s, &tiering_test::StreamGate::wait, &gate);
  void* p = malloc_state(2 * kMiB);
  ASSERT_TRUE(routed(p));
  ASSERT_EQ(tidepool_pytorch_record_stream(p, s.handle), 0) << tidepool_last_error();
  auto evicted =
      std::async(std::launch::async, [&] { return tidepool_evict_ptr(kRouteDevice, p); });
  // Not a timing bound: a wait that ends early is the failure.
  EXPECT_EQ(evicted.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
      << "the range moved while the stream PyTorch recorded was still held";
  gate.open();
  EXPECT_EQ(evicted.get(), 0) << tidepool_last_error();
  EXPECT_EQ(tiering_vmm_pool(kRouteDevice).bytes_in(p, MemoryLocation::device), 0u);
  ASSERT_EQ(tidepool_release_stream(kRouteDevice, s.handle), 0) << tidepool_last_error();
  backend.destroy_stream(s);
  tidepool_free(p, 2 * kMiB, kRouteDevice, nullptr);
}

TEST(TierRouteRegistration, ADifferentRouteOrAnIncompleteOneIsRefused) {
  const TierRoute* installed = tier_route();
  ASSERT_NE(installed, nullptr);
  EXPECT_NO_THROW(register_tier_route(installed));  // the same one again: a no-op
  static const TierRoute other = *installed;
  EXPECT_THROW(register_tier_route(&other), std::logic_error);
  TierRoute incomplete = *installed;
  incomplete.owns = nullptr;
  EXPECT_THROW(register_tier_route(&incomplete), std::invalid_argument);
  incomplete = *installed;
  incomplete.release_stream = nullptr;
  EXPECT_THROW(register_tier_route(&incomplete), std::invalid_argument);
  incomplete = *installed;
  incomplete.live_ranges = nullptr;
  EXPECT_THROW(register_tier_route(&incomplete), std::invalid_argument);
  EXPECT_THROW(register_tier_route(nullptr), std::invalid_argument);
  EXPECT_EQ(tier_route(), installed);
}

// Note [No host backing] (tiering_registry.cpp): on a device whose backend cannot make
// host-NUMA physical memory, optimizer state is not made pointer-stable (it could never
// move to the host, and every eviction would fail); it stays ordinary memory, said once.
constexpr int kNoHostBackingDevice = 6;

class NoHostBackingTest : public tiering_test::HostBackendTest<kNoHostBackingDevice> {};

// An optimizer-state allocation of the smallest tierable size on `device`, through the C ABI.
void* malloc_optimizer_state(int device) {
  EXPECT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
  void* p = tidepool_malloc(static_cast<ssize_t>(kDefaultTierMinBytes), device, nullptr);
  EXPECT_EQ(tidepool_tag_pop(), 0);
  return p;
}

TEST_F(NoHostBackingTest, OptimizerStateStaysOrdinaryMemoryAndThisIsSaidOnce) {
  // The device's backend, refusing host physical memory as cuMemCreate does where
  // CU_DEVICE_ATTRIBUTE_HOST_NUMA_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED is 0. Lives for the
  // process: the registry borrows it.
  struct NoHostPhysical final : ForwardingBackend {
    using ForwardingBackend::ForwardingBackend;
    PhysicalHandle do_create_physical(std::size_t bytes, MemoryLocation where) override {
      if (where == MemoryLocation::host) throw BackendError("no host-NUMA physical memory here");
      return ForwardingBackend::do_create_physical(bytes, where);
    }
  };
  set_tiering_backend(kNoHostBackingDevice,
                      new NoHostPhysical(device_allocator(kNoHostBackingDevice).backend()));
  // With room in the state budget a range would be made on the device, and only its eviction
  // would fail, at every step.
  ConfigScope config("backend:tidepool,tidepool.state_budget:1GiB");
  ::testing::internal::CaptureStderr();
  void* first = malloc_optimizer_state(kNoHostBackingDevice);
  void* second = malloc_optimizer_state(kNoHostBackingDevice);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_TRUE(first && second) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_owns(first, kNoHostBackingDevice), 0);
  EXPECT_EQ(tidepool_vmm_owns(second, kNoHostBackingDevice), 0);
  const std::string line = "device 6 cannot back pointer-stable ranges with host memory";
  ASSERT_NE(said.find(line), std::string::npos) << said;
  EXPECT_EQ(said.find(line, said.find(line) + 1), std::string::npos) << "said twice: " << said;
  EXPECT_NE(said.find("no host-NUMA physical memory here"), std::string::npos) << said;
  EXPECT_EQ(tidepool_evict_tag(kNoHostBackingDevice, kTagOptimizerState), 0)
      << tidepool_last_error();
  tidepool_free(first, kDefaultTierMinBytes, kNoHostBackingDevice, nullptr);
  tidepool_free(second, kDefaultTierMinBytes, kNoHostBackingDevice, nullptr);
}

// The same where host physical memory is made but cannot be mapped for the device: the
// probe maps what it made, as an eviction would.
constexpr int kNoHostMappingDevice = 7;

class NoHostMappingTest : public tiering_test::HostBackendTest<kNoHostMappingDevice> {};

TEST_F(NoHostMappingTest, OptimizerStateStaysOrdinaryMemoryAndNothingOfTheProbeIsLeft) {
  struct NoHostMapping final : ForwardingBackend {
    using ForwardingBackend::ForwardingBackend;
    PhysicalHandle do_create_physical(std::size_t bytes, MemoryLocation where) override {
      const PhysicalHandle h = ForwardingBackend::do_create_physical(bytes, where);
      if (h && where == MemoryLocation::host) {
        std::lock_guard lock(mutex);
        host.insert(h.value);
      }
      return h;
    }
    void do_release_physical(PhysicalHandle h, std::size_t bytes) override {
      ForwardingBackend::do_release_physical(h, bytes);
      std::lock_guard lock(mutex);
      host.erase(h.value);
    }
    void do_map(void* va, std::size_t bytes, PhysicalHandle h) override {
      {
        std::lock_guard lock(mutex);
        if (host.contains(h.value)) throw BackendError("host-NUMA memory cannot be mapped here");
      }
      ForwardingBackend::do_map(va, bytes, h);
    }
    void* do_reserve_address(std::size_t bytes) override {
      ++reserved_live;
      return ForwardingBackend::do_reserve_address(bytes);
    }
    void do_release_address(void* va, std::size_t bytes) override {
      ForwardingBackend::do_release_address(va, bytes);
      --reserved_live;
    }
    std::mutex mutex;
    std::set<std::uint64_t> host;  // the host physical memory not released yet
    std::atomic<int> reserved_live{0};
  };
  auto* backend = new NoHostMapping(device_allocator(kNoHostMappingDevice).backend());
  set_tiering_backend(kNoHostMappingDevice, backend);  // lives for the process
  ConfigScope config("backend:tidepool,tidepool.state_budget:1GiB");
  ::testing::internal::CaptureStderr();
  void* p = malloc_optimizer_state(kNoHostMappingDevice);
  const std::string said = ::testing::internal::GetCapturedStderr();
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_owns(p, kNoHostMappingDevice), 0) << "a range whose evictions would fail";
  EXPECT_NE(said.find("device 7 cannot back pointer-stable ranges with host memory"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("cannot be mapped here"), std::string::npos) << said;
  EXPECT_EQ(backend->host.size(), 0u) << "the probe's host memory was given back";
  EXPECT_EQ(backend->reserved_live.load(), 0) << "the probe's address range was given back";
  tidepool_free(p, kDefaultTierMinBytes, kNoHostMappingDevice, nullptr);
}

}  // namespace
}  // namespace tidepool
