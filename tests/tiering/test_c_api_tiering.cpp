// The tiering C ABI: VMM-backed allocations moved by pointer and by tag, tag operations
// reaching the device's tiered stores, versioned stats, the JSON snapshot, the allocator's
// reclaim hook reaching the stores on an allocator OOM, errors as return codes with a
// message in tidepool_last_error, tag prefetch within tidepool.state_budget, and prefetch
// and evict by pointers (one optimizer's state, in its order, each range once). The
// allocator's tier route into these ranges: test_tier_route.cpp.
#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <iterator>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/config.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
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

class CApiTieringTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {  // once per process: suites derived from this one share it
    if (backend_ != nullptr) return;
    backend_ = make_host_backend(kDevice).release();
    set_tiering_backend(kDevice, backend_);
  }
  static Backend* backend_;  // lives for the process, as the registry borrows it
};
Backend* CApiTieringTest::backend_ = nullptr;

TEST_F(CApiTieringTest, PointerAndTagMigrationKeepTheAddress) {
  auto* p = static_cast<unsigned char*>(
      tidepool_vmm_malloc(100000, kDevice, kTagOptimizerState, nullptr));
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_owns(p + 10, kDevice), 1);
  std::memset(p, 0x5a, 100000);  // host backend: device memory is host-addressable
  ASSERT_EQ(tidepool_evict_ptr(kDevice, p), 0) << tidepool_last_error();
  VmmPool& pool = tiering_vmm_pool(kDevice);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), pool.size_of(p));
  ASSERT_EQ(tidepool_prefetch_tag(kDevice, kTagOptimizerState, nullptr), 0)
      << tidepool_last_error();
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), pool.size_of(p));
  ASSERT_EQ(tidepool_evict_tag(kDevice, kTagOptimizerState), 0);
  EXPECT_EQ(pool.bytes_in(p, MemoryLocation::host), pool.size_of(p));
  ASSERT_EQ(tidepool_prefetch_ptr(kDevice, p, nullptr), 0);
  for (int i = 0; i < 100000; i += 997) ASSERT_EQ(p[i], 0x5a);
  EXPECT_EQ(tidepool_vmm_free(p, kDevice), 0);
}

// Note [prefetch stream] (c_api_tiering.h): each prefetch call waits for the streams
// recorded as the range's users, not for the stream it is given, and the range is in
// place when it returns.
TEST_F(CApiTieringTest, PrefetchesWaitForTheRangesUsersNotForTheirStream) {
  const Stream user = backend_->create_stream();
  const Stream given = backend_->create_stream();
  auto* p = static_cast<unsigned char*>(
      tidepool_vmm_malloc(100000, kDevice, kTagOptimizerState, nullptr));
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  ASSERT_EQ(tidepool_vmm_record_stream(p, kDevice, user.handle), 0) << tidepool_last_error();
  const void* ptrs[] = {p};
  const std::vector<std::pair<const char*, std::function<int()>>> prefetches = {
      {"tidepool_prefetch_ptr", [&] { return tidepool_prefetch_ptr(kDevice, p, given.handle); }},
      {"tidepool_prefetch_ptrs",
       [&] { return tidepool_prefetch_ptrs(kDevice, ptrs, 1, given.handle, nullptr); }},
      {"tidepool_prefetch_tag",
       [&] { return tidepool_prefetch_tag(kDevice, kTagOptimizerState, given.handle); }}};
  VmmPool& pool = tiering_vmm_pool(kDevice);
  for (const auto& [name, prefetch] : prefetches) {
    SCOPED_TRACE(name);
    ASSERT_EQ(tidepool_evict_ptr(kDevice, p), 0) << tidepool_last_error();
    tiering_test::StreamGate user_gate, given_gate;
    const tiering_test::StreamGate::OpenOnExit open_user{user_gate}, open_given{given_gate};
    backend_->launch_host_func(user, &tiering_test::StreamGate::wait, &user_gate);
    backend_->launch_host_func(given, &tiering_test::StreamGate::wait, &given_gate);
    auto done = std::async(std::launch::async, prefetch);
    // Not a timing bound: a prefetch that ends while the recorded user is held is the failure.
    EXPECT_EQ(done.wait_for(std::chrono::milliseconds(200)), std::future_status::timeout)
        << "the range moved while a stream recorded as its user was still held";
    user_gate.open();
    EXPECT_EQ(done.get(), 0) << tidepool_last_error();  // given's gate is still closed
    EXPECT_EQ(pool.bytes_in(p, MemoryLocation::device), pool.size_of(p));
    given_gate.open();
    backend_->stream_synchronize(given);
  }
  EXPECT_TRUE(pool.release_stream(user));
  EXPECT_FALSE(pool.release_stream(given));  // never a user
  EXPECT_EQ(tidepool_vmm_free(p, kDevice), 0) << tidepool_last_error();
  backend_->destroy_stream(user);
  backend_->destroy_stream(given);
}

TEST_F(CApiTieringTest, TagOperationsReachTheStoresAndStatsAddThemUp) {
  TieredStore store(*backend_, tiering_test::test_store_options(1 << 20));
  auto h = store.create(4096, kTagOptimizerState, Tier::device);
  ASSERT_EQ(tidepool_evict_tag(kDevice, kTagOptimizerState), 0);
  EXPECT_FALSE(store.resident(h));
  ASSERT_EQ(tidepool_prefetch_tag(kDevice, kTagOptimizerState, nullptr), 0);
  EXPECT_TRUE(store.resident(h));
  store.synchronize();

  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
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

// Note [A call by tag that fails part-way] (c_api_tiering.cpp): on a device of its own,
// whose backend cannot make host backings, the range's eviction fails; the tiered store's
// handle of the tag is evicted all the same, and the error says what moved. Review
// finding: the first range failure ended the call, the stores were never reached, and the
// message ("data stays where it was") read as if nothing had moved.
TEST(TieringCApi, AnEvictionByTagWhoseRangeFailsStillEvictsTheStoresAndSaysSo) {
  constexpr int device = kDevice + 4;
  static Backend* backend = make_host_backend(device).release();  // the registry borrows it
  set_tiering_backend(device, backend);
  auto* range = static_cast<unsigned char*>(
      tidepool_vmm_malloc(100000, device, kTagOptimizerState, nullptr));
  ASSERT_NE(range, nullptr) << tidepool_last_error();
  std::memset(range, 0x3c, 100000);
  TieredStore store(*backend, tiering_test::test_store_options(1 << 20));
  const auto h = store.create(4096, kTagOptimizerState, Tier::device);
  store.synchronize();
  // Every creation from here on fails (the device and its backend are this test's alone).
  constexpr int kFailures = 1000;
  backend->inject_fault(FaultPoint::create_physical, kFailures);
  EXPECT_EQ(tidepool_evict_tag(device, kTagOptimizerState), -1);
  const std::string error = tidepool_last_error();
  EXPECT_NE(error.find("the tag's tiered-store handles were moved"), std::string::npos) << error;
  EXPECT_FALSE(store.resident(h));
  EXPECT_EQ(range[0], 0x3c);  // whole, on the device
  EXPECT_EQ(range[99999], 0x3c);
  // Prefetch alike: the handle comes back though the (device-backed) range has nothing
  // to do.
  EXPECT_EQ(tidepool_prefetch_tag(device, kTagOptimizerState, nullptr), 0)
      << tidepool_last_error();
  EXPECT_TRUE(store.resident(h));
  store.synchronize();
  store.destroy(h);
  EXPECT_EQ(tidepool_vmm_free(range, device), 0) << tidepool_last_error();
}

// The schedule counters reach the C struct: a handle created after the first step makes
// step 2 deviate (one off-schedule acquire), and is merged into the schedule (one
// adoption, Note [Adopting a step]).
TEST_F(CApiTieringTest, StatsCarryTheStoresScheduleCounters) {
  TieredStore store(*backend_, tiering_test::test_store_options(1 << 20));
  std::vector<TieredStore::Handle> order{store.create(4096, kTagOptimizerState, Tier::host),
                                         store.create(4096, kTagOptimizerState, Tier::host)};
  for (int step = 0; step < 3; ++step) {
    if (step == 1)
      order.insert(order.begin() + 1, store.create(4096, kTagOptimizerState, Tier::host));
    store.begin_step();
    for (auto h : order) {
      store.acquire(h, Stream{});
      store.release(h, false);
    }
    store.end_step();
  }
  store.synchronize();
  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.struct_size, sizeof s);
  EXPECT_EQ(s.off_schedule_acquires, 1u);
  EXPECT_EQ(s.schedule_adoptions, 1u);
}

// Acquires to overwrite that skipped a load (Note [Acquiring to overwrite] in
// tiering/tiered_store.cpp) reach the C struct.
TEST_F(CApiTieringTest, StatsCountTheLoadsAnOverwriteSkipped) {
  TieredStore store(*backend_, tiering_test::test_store_options(1 << 20));
  const TieredStore::Handle on_host = store.create(4096, kTagOptimizerState, Tier::host);
  const TieredStore::Handle resident = store.create(4096, kTagOptimizerState, Tier::device);
  for (const TieredStore::Handle h : {on_host, resident}) {
    store.acquire_to_overwrite(h, Stream{});
    store.release(h, true);
  }
  store.synchronize();
  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.loads_skipped, 1u) << "only the handle on the host needed a load";
  EXPECT_EQ(s.h2d_bytes, 0u);
}


// The reclaim hook's set-up: a caching allocator over an 8 MiB host device (`device`: an
// index of the test's own, sharing no registry state with other tests), and stores with
// a 6 MiB budget taking their device buffers from it.
class SmallDevice {
 public:
  explicit SmallDevice(int device) : allocator_(make_host_backend(device, eight_mib())) {}
  CachingAllocator& allocator() { return allocator_; }
  std::unique_ptr<TieredStore> make_store() {
    return std::make_unique<TieredStore>(allocator_.backend(),
                                         tiering_test::test_store_options(6 << 20),
                                         caching_allocator_source(allocator_));
  }

 private:
  static HostBackendOptions eight_mib() {
    HostBackendOptions o;
    o.capacity_bytes = 8 << 20;
    return o;
  }
  CachingAllocator allocator_;
};

TEST(TieringReclaimHook, AnAllocatorOutOfMemoryEvictsReleasedTieredState) {
  // The store takes its device buffers from a caching allocator over a small device; an
  // allocation elsewhere that does not fit makes the allocator run its reclaim hooks,
  // which reach the store through the tiering registry and evict its released state.
  SmallDevice device(kDevice + 1);
  CachingAllocator& allocator = device.allocator();
  const std::unique_ptr<TieredStore> store = device.make_store();
  auto a = store->create(3 << 20, kTagOptimizerState, Tier::device);
  auto b = store->create(3 << 20, kTagOptimizerState, Tier::device);
  store->synchronize();
  EXPECT_EQ(allocator.stats().tags[kTagOptimizerState].bytes.current, std::size_t{6} << 20);
  void* big = allocator.allocate(5 << 20);  // fits only once the store lets go
  ASSERT_NE(big, nullptr);
  EXPECT_FALSE(store->resident(a) && store->resident(b));
  EXPECT_GE(store->stats().reclaim_calls, 1u);
  EXPECT_GT(store->stats().reclaimed_bytes, 0u);
  allocator.deallocate(big, 5 << 20);
}

TEST(TieringReclaimHook, AStoreOutOfDeviceMemoryGetsAnotherStoresReleasedState) {
  // Store A's load does not fit the device while store B holds released state: the
  // allocator's reclaim hook, run on A's thread while A's lock is held, skips A (Note
  // [Locking] in tiered_store.cpp) and evicts from B.
  SmallDevice device(kDevice + 2);
  CachingAllocator& allocator = device.allocator();
  const std::unique_ptr<TieredStore> a = device.make_store();
  const std::unique_ptr<TieredStore> b = device.make_store();
  const auto b1 = b->create(3 << 20, kTagOptimizerState, Tier::device);
  const auto b2 = b->create(3 << 20, kTagOptimizerState, Tier::device);
  b->synchronize();
  const auto a1 = a->create(4 << 20, kTagOptimizerState);
  const Stream s = allocator.backend().create_stream();
  EXPECT_NO_THROW(a->acquire(a1, s));
  a->release(a1, /*dirty=*/false);
  EXPECT_FALSE(b->resident(b1) && b->resident(b2));
  EXPECT_GE(b->stats().reclaim_calls, 1u);
  EXPECT_EQ(a->stats().reclaimed_bytes, 0u);
  a->synchronize();
  allocator.backend().stream_synchronize(s);
  allocator.release_stream(s);
  allocator.backend().destroy_stream(s);
}

// Aborts the process with `what` unless destroyed within 30 s, so a deadlock fails the
// test run with a message instead of hanging it.
class Watchdog {
 public:
  explicit Watchdog(const char* what)
      : thread_([this, what] {
          std::unique_lock lock(mutex_);
          if (!done_cv_.wait_for(lock, std::chrono::seconds(30), [this] { return done_; })) {
            std::fprintf(stderr, "watchdog: %s\n", what);
            std::abort();
          }
        }) {}
  ~Watchdog() {
    {
      std::lock_guard lock(mutex_);
      done_ = true;
    }
    done_cv_.notify_one();
    thread_.join();
  }

 private:
  std::mutex mutex_;
  std::condition_variable done_cv_;
  bool done_ = false;
  std::thread thread_;
};

// Note [A free's record goes first] (tiering_registry.cpp): a free waiting for the streams
// that used its range does not hold the ranges' mutex, which every device's large
// tidepool_free and record_stream take to ask whether a pointer is a range. Review finding:
// it was held across that wait, so those calls, on any device, waited behind one free's
// kernels. (The device's own pool stays locked while it waits.)
TEST_F(CApiTieringTest, AFreeWaitingForItsStreamsHoldsUpNoOtherRange) {
  void* waiting = tidepool_vmm_malloc(100000, kDevice, kTagOptimizerState, nullptr);
  void* other = tidepool_vmm_malloc(100000, kDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(waiting, nullptr) << tidepool_last_error();
  ASSERT_NE(other, nullptr) << tidepool_last_error();
  const Stream user = backend_->create_stream();
  std::promise<void> release;
  std::shared_future<void> released = release.get_future().share();
  // The user stream runs until the test lets it go: the free waits for it.
  auto* gate = new std::shared_future<void>(released);
  backend_->launch_host_func(
      user,
      [](void* arg) {
        auto* f = static_cast<std::shared_future<void>*>(arg);
        f->wait();
        delete f;
      },
      gate);
  ASSERT_EQ(tidepool_vmm_record_stream(waiting, kDevice, user.handle), 0)
      << tidepool_last_error();
  std::thread freeing([&] { EXPECT_EQ(tidepool_vmm_free(waiting, kDevice), 0); });
  {
    Watchdog watchdog("a free waiting for its stream held up another range's calls");
    while (is_tierable_range(kDevice, waiting)) std::this_thread::yield();  // it is freeing
    EXPECT_TRUE(is_tierable_range(kDevice, other));
    int x = 0;
    EXPECT_FALSE(is_tierable_range(kDevice + 5, &x));
  }
  release.set_value();
  freeing.join();
  EXPECT_EQ(tidepool_vmm_free(other, kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_owns(waiting, kDevice), 0);
  backend_->destroy_stream(user);
}

TEST(TieringReclaimHook, ReenteringTheRegistryFromInsideAReclaimIsRefusedCleanly) {
  // The reclaim hook holds the registry while it calls the stores, and a store calls out
  // (here: its memory source's deallocate) into code that comes back to the registry on
  // the same thread. Note [Registry re-entry] (tiering_registry.cpp): creating a store or
  // walking the stores by tag from there is refused with a clear error, destroying
  // another store is safe (the walk skips it), and none of it deadlocks; afterwards the
  // registry works as before.
  constexpr int device_index = kDevice + 3;
  SmallDevice device(device_index);
  CachingAllocator& allocator = device.allocator();
  std::function<void()> reenter;  // run once, by a's memory source, inside the reclaim
  DeviceMemorySource source = caching_allocator_source(allocator);
  source.deallocate = [inner = source.deallocate, &reenter](void* p, std::size_t n, Stream s) {
    if (reenter) std::exchange(reenter, nullptr)();
    inner(p, n, s);
  };
  auto a = std::make_unique<TieredStore>(
      allocator.backend(), tiering_test::test_store_options(6 << 20), std::move(source));
  std::unique_ptr<TieredStore> b = device.make_store();  // holds nothing: the walk reaches a
  a->create(3 << 20, kTagOptimizerState, Tier::device);
  a->synchronize();
  std::string create_error, evict_tag_error;
  int evict_tag_result = 0;
  bool reentered = false;
  reenter = [&] {
    reentered = true;
    Watchdog watchdog("re-entering the tiering registry from inside a reclaim deadlocked");
    try {
      device.make_store();
    } catch (const TieringError& e) {
      create_error = e.what();
    }
    evict_tag_result = tidepool_evict_tag(device_index, kTagOptimizerState);
    evict_tag_error = tidepool_last_error();
    b.reset();
  };
  void* big = allocator.allocate(6 << 20);  // fits only once a lets go: the hook runs
  ASSERT_NE(big, nullptr);
  allocator.deallocate(big, 6 << 20);
  ASSERT_TRUE(reentered);
  EXPECT_EQ(b, nullptr);
  EXPECT_NE(create_error.find("already holds the tiering registry"), std::string::npos)
      << create_error;
  EXPECT_EQ(evict_tag_result, -1);
  EXPECT_NE(evict_tag_error.find("already holds the tiering registry"), std::string::npos)
      << evict_tag_error;
  EXPECT_GE(a->stats().reclaimed_bytes, std::size_t{3} << 20);
  // Outside the walk everything works again, and b has left the registry.
  EXPECT_EQ(tidepool_evict_tag(device_index, kTagOptimizerState), 0) << tidepool_last_error();
  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(device_index, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.stores, 1u);
  EXPECT_NO_THROW(b = device.make_store());
}

TEST(TieringCApi, AskingAboutAnUnusedDeviceCreatesNothingThere) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "device 11 is a host-backend device index";
  constexpr int kUnusedDevice = 11;
  int x = 0;
  EXPECT_EQ(tidepool_vmm_owns(&x, kUnusedDevice), 0);
  const void* asked[] = {&x};
  std::uint64_t id = 7;
  EXPECT_EQ(tidepool_range_ids(kUnusedDevice, asked, 1, &id), 0) << tidepool_last_error();
  EXPECT_EQ(id, 0u);
  EXPECT_EQ(tidepool_evict_tag(kUnusedDevice, kTagOptimizerState), 0) << tidepool_last_error();
  std::uint64_t left = 1;
  EXPECT_EQ(
      tidepool_prefetch_tag_within_budget(kUnusedDevice, kTagOptimizerState, nullptr, &left), 0)
      << tidepool_last_error();
  EXPECT_EQ(left, 0u);
  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kUnusedDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.stores, 0u);
  EXPECT_EQ(s.vmm_ranges, 0u);
  char* json = tidepool_tiering_snapshot_json(kUnusedDevice);
  ASSERT_NE(json, nullptr) << tidepool_last_error();
  EXPECT_NE(std::string(json).find("\"vmm\":{"), std::string::npos) << json;
  std::free(json);
  // A free or a record of use naming the wrong device is refused without setting it up
  // (review finding: each made the device's pool, streams and, on CUDA, a context first).
  EXPECT_EQ(tidepool_vmm_free(&x, kUnusedDevice), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("is not a pointer-stable range of device 11"),
            std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_record_stream(&x, kUnusedDevice, nullptr), -1);
  EXPECT_EQ(existing_tiering_vmm_pool(kUnusedDevice), nullptr);
  EXPECT_EQ(existing_device_allocator(kUnusedDevice), nullptr);
  // An id naming no tag is an error, not "nothing there".
  for (const int tag : {-1, static_cast<int>(TIDEPOOL_TAG_MAX), tag_count()}) {
    EXPECT_EQ(tidepool_evict_tag(kUnusedDevice, tag), -1);
    EXPECT_NE(std::string(tidepool_last_error()).find("no tag has the id " + std::to_string(tag)),
              std::string::npos)
        << tidepool_last_error();
    left = 7;
    EXPECT_EQ(tidepool_prefetch_tag_within_budget(kUnusedDevice, tag, nullptr, &left), -1);
    EXPECT_EQ(left, 0u);
  }
  const void* ptrs[] = {&x};
  left = 7;
  EXPECT_EQ(tidepool_prefetch_ptrs(kUnusedDevice, ptrs, 1, nullptr, &left), 0)
      << tidepool_last_error();
  EXPECT_EQ(left, 0u);
  EXPECT_EQ(tidepool_evict_ptrs(kUnusedDevice, ptrs, 1), 0) << tidepool_last_error();
  std::size_t count = 7;
  EXPECT_EQ(tidepool_device_ranges_except(kUnusedDevice, kTagOptimizerState, ptrs, 1, nullptr, 0,
                                          &count),
            0)
      << tidepool_last_error();
  EXPECT_EQ(count, 0u);
  EXPECT_EQ(existing_tiering_vmm_pool(kUnusedDevice), nullptr);
  // One pointer: still an error (no range holds it), but found out without a pool.
  tidepool_clear_error();
  EXPECT_EQ(tidepool_prefetch_ptr(kUnusedDevice, &x, nullptr), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not own"), std::string::npos)
      << tidepool_last_error();
  tidepool_clear_error();
  EXPECT_EQ(tidepool_evict_ptr(kUnusedDevice, &x), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not own"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(existing_tiering_vmm_pool(kUnusedDevice), nullptr);
  EXPECT_EQ(existing_device_allocator(kUnusedDevice), nullptr);
  // A device index out of range is still an error, not "nothing there".
  EXPECT_EQ(tidepool_evict_tag(kMaxDevices, kTagOptimizerState), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("tidepool_evict_tag"), std::string::npos)
      << tidepool_last_error();
}

TEST(TieringRegistry, DefaultsToTheDeviceAllocatorsBackend) {
  if (cuda_device_count() > 0) GTEST_SKIP() << "device 7 is a host-backend device index";
  constexpr int kOtherDevice = 7;
  void* p = tidepool_vmm_malloc(4096, kOtherDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  EXPECT_EQ(&tiering_vmm_pool(kOtherDevice).backend(), &device_allocator(kOtherDevice).backend());
  EXPECT_EQ(tidepool_vmm_free(p, kOtherDevice), 0);
}

TEST_F(CApiTieringTest, ErrorsAreCodesWithAMessageInTheAllocatorsErrorSlot) {
  int x = 0;
  tidepool_clear_error();
  EXPECT_EQ(tidepool_evict_ptr(kDevice, &x), -1);
  const std::string message = tidepool_last_error();
  EXPECT_EQ(message.rfind("tidepool_evict_ptr: ", 0), 0u) << message;
  EXPECT_NE(std::strstr(tidepool_last_error(), "does not own"), nullptr) << tidepool_last_error();
  // The deprecated alias reads the same slot.
  EXPECT_STREQ(tidepool_tiering_last_error(), tidepool_last_error());
  tidepool_clear_error();
  EXPECT_EQ(tidepool_vmm_free(&x, kDevice), -1);
  EXPECT_EQ(std::string(tidepool_last_error()).rfind("tidepool_vmm_free: ", 0), 0u);
  tidepool_clear_error();
  EXPECT_EQ(tidepool_vmm_malloc(0, kDevice, kTagOptimizerState, nullptr), nullptr);
  EXPECT_NE(std::strstr(tidepool_last_error(), "allocate(0)"), nullptr) << tidepool_last_error();
  // A tag id no tag has: a range under it could never be evicted or prefetched by tag.
  for (const int tag : {-3, static_cast<int>(TIDEPOOL_TAG_MAX)}) {
    tidepool_clear_error();
    EXPECT_EQ(tidepool_vmm_malloc(4096, kDevice, tag, nullptr), nullptr) << tag;
    EXPECT_NE(std::strstr(tidepool_last_error(), "no tag has the id"), nullptr)
        << tidepool_last_error();
  }
  tidepool_tiering_stats_v1 s{};
  s.struct_size = 8;
  EXPECT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), -1);
  EXPECT_EQ(tidepool_get_tiering_stats_v1(kDevice, nullptr), -1);
  EXPECT_EQ(tidepool_evict_tag(-1, kTagOptimizerState), -1);
  EXPECT_EQ(tidepool_vmm_free(nullptr, kDevice), 0);  // like free(NULL)
  // Prefetch by pointers: no array for n pointers, or a bad device, is an error (and says
  // nothing stayed on the host); no array for none is nothing to do.
  std::uint64_t left = 7;
  tidepool_clear_error();
  EXPECT_EQ(tidepool_prefetch_ptrs(kDevice, nullptr, 3, nullptr, &left), -1);
  EXPECT_EQ(left, 0u);
  EXPECT_EQ(std::string(tidepool_last_error()).rfind("tidepool_prefetch_ptrs: ", 0), 0u)
      << tidepool_last_error();
  EXPECT_NE(std::strstr(tidepool_last_error(), "ptrs is NULL but n is 3"), nullptr)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_prefetch_ptrs(kDevice, nullptr, 0, nullptr, nullptr), 0)
      << tidepool_last_error();
  const void* ptrs[] = {&x};
  EXPECT_EQ(tidepool_prefetch_ptrs(-1, ptrs, 1, nullptr, &left), -1);
  EXPECT_NE(std::strstr(tidepool_last_error(), "tidepool_prefetch_ptrs"), nullptr)
      << tidepool_last_error();
}

// ---- tag prefetch within tidepool.state_budget ------------------------------------------

using tiering_test::ConfigScope;
using tiering_test::kMiB;

class PrefetchBudgetTest : public CApiTieringTest {
 protected:
  // Ranges of `sizes` under a tag of this test's own, evicted to the host.
  void make_evicted(std::initializer_list<std::size_t> sizes) {
    tag_ = tidepool_tag_id("prefetch_budget_test");
    ASSERT_GE(tag_, 0) << tidepool_last_error();
    for (std::size_t n : sizes) {
      void* p = tidepool_vmm_malloc(n, kDevice, tag_, nullptr);
      ASSERT_NE(p, nullptr) << tidepool_last_error();
      ranges_.push_back(p);
    }
    ASSERT_EQ(tidepool_evict_tag(kDevice, tag_), 0) << tidepool_last_error();
  }
  void TearDown() override {
    for (void* p : ranges_) EXPECT_EQ(tidepool_vmm_free(p, kDevice), 0) << tidepool_last_error();
  }
  std::uint64_t prefetch() {
    std::uint64_t left = 12345;
    EXPECT_EQ(tidepool_prefetch_tag_within_budget(kDevice, tag_, nullptr, &left), 0)
        << tidepool_last_error();
    return left;
  }
  std::size_t on_device(int i) const {
    return tiering_vmm_pool(kDevice).bytes_in(ranges_[i], MemoryLocation::device);
  }
  int tag_ = -1;
  std::vector<void*> ranges_;
};

TEST_F(PrefetchBudgetTest, StopsBeforeTheBudgetAndReportsWhatStayedOnTheHost) {
  const ConfigScope config("backend:tidepool,tidepool.state_budget:5MiB");
  make_evicted({2 * kMiB, 2 * kMiB, 2 * kMiB});
  EXPECT_EQ(prefetch(), 2 * kMiB);
  EXPECT_EQ(on_device(0), 2 * kMiB);  // oldest first
  EXPECT_EQ(on_device(1), 2 * kMiB);
  EXPECT_EQ(on_device(2), 0u);
  EXPECT_EQ(tiering_vmm_pool(kDevice).bytes_in(ranges_[2], MemoryLocation::host), 2 * kMiB);
  EXPECT_EQ(prefetch(), 2 * kMiB);  // what is resident counts: nothing more comes back
  EXPECT_EQ(tidepool_prefetch_tag(kDevice, tag_, nullptr), 0);
  EXPECT_EQ(on_device(2), 0u);

  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.vmm_device_budget_bytes, 5 * kMiB);
  EXPECT_GE(s.vmm_budget_stops, 3u);
  EXPECT_GE(s.vmm_bytes_left_on_host, 6 * kMiB);
}

// Two optimizers' state under one tag: prefetching one's by its pointers brings back
// that state only, in the order named (not the tag's allocation order), within the budget.
TEST_F(PrefetchBudgetTest, ByPointersOnlyTheNamedRangesComeBackInTheOrderNamed) {
  const ConfigScope config("backend:tidepool,tidepool.state_budget:5MiB");
  make_evicted({2 * kMiB, 2 * kMiB, 2 * kMiB, 2 * kMiB});
  int not_tiered = 0;  // state under tidepool.tier_min_bytes: ordinary memory
  const char* third = static_cast<const char*>(ranges_[2]);
  const void* ptrs[] = {third + 4096, nullptr, &not_tiered, third, ranges_[0], ranges_[3]};
  std::uint64_t left = 12345;
  ASSERT_EQ(tidepool_prefetch_ptrs(kDevice, ptrs, std::size(ptrs), nullptr, &left), 0)
      << tidepool_last_error();
  EXPECT_EQ(on_device(2), 2 * kMiB);
  EXPECT_EQ(on_device(0), 2 * kMiB);
  EXPECT_EQ(on_device(1), 0u);  // not named: the other optimizer's
  EXPECT_EQ(on_device(3), 0u);  // named, over the budget
  EXPECT_EQ(left, 2 * kMiB);
  // The named ranges are the same, at the same addresses; the tag takes them back.
  ASSERT_EQ(tidepool_evict_tag(kDevice, tag_), 0) << tidepool_last_error();
  EXPECT_EQ(on_device(0) + on_device(2), 0u);
}

// The other half: one optimizer's state evicted by its pointers (a step that ends while
// another thread's step on the device still runs) leaves the other optimizer's state,
// under the same tag, on the device; each range once, unknown pointers skipped.
TEST_F(PrefetchBudgetTest, EvictByPointersMovesOnlyTheNamedRanges) {
  make_evicted({2 * kMiB, 2 * kMiB, 2 * kMiB});
  ASSERT_EQ(tidepool_prefetch_tag(kDevice, tag_, nullptr), 0) << tidepool_last_error();
  int not_tiered = 0;
  const char* second = static_cast<const char*>(ranges_[1]);
  const void* ptrs[] = {second + 4096, nullptr, &not_tiered, second, ranges_[2]};
  ASSERT_EQ(tidepool_evict_ptrs(kDevice, ptrs, std::size(ptrs)), 0) << tidepool_last_error();
  EXPECT_EQ(on_device(0), 2 * kMiB);  // not named: the other thread's step still uses it
  EXPECT_EQ(on_device(1) + on_device(2), 0u);
  const VmmPool& pool = tiering_vmm_pool(kDevice);
  EXPECT_EQ(pool.bytes_in(ranges_[1], MemoryLocation::host), 2 * kMiB);
  EXPECT_EQ(pool.bytes_in(ranges_[2], MemoryLocation::host), 2 * kMiB);
  // Errors and nothing-to-do as tidepool_prefetch_ptrs: no array for n pointers, a bad
  // device; no array for none, an unused device.
  tidepool_clear_error();
  EXPECT_EQ(tidepool_evict_ptrs(kDevice, nullptr, 2), -1);
  EXPECT_EQ(std::string(tidepool_last_error()).rfind("tidepool_evict_ptrs: ", 0), 0u)
      << tidepool_last_error();
  EXPECT_NE(std::strstr(tidepool_last_error(), "ptrs is NULL but n is 2"), nullptr)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_evict_ptrs(kDevice, nullptr, 0), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_evict_ptrs(-1, ptrs, 1), -1);
  EXPECT_EQ(on_device(0), 2 * kMiB);
}

// What is on the device beyond the ranges named (the Python hooks' state kept outside
// optimizer.state): the tag's device-backed ranges holding none of the pointers, oldest
// first, sized by a call with no array, cut to a short array with the count of all.
TEST_F(PrefetchBudgetTest, DeviceRangesExceptListsTheTagsOtherRangesOnTheDevice) {
  make_evicted({2 * kMiB, 2 * kMiB, 2 * kMiB, 2 * kMiB});
  const void* bring[] = {ranges_[3], ranges_[1], ranges_[0]};  // 2 stays on the host
  ASSERT_EQ(tidepool_prefetch_ptrs(kDevice, bring, std::size(bring), nullptr, nullptr), 0)
      << tidepool_last_error();
  int not_tiered = 0;
  const void* except[] = {static_cast<const char*>(ranges_[0]) + 4096, nullptr, &not_tiered};
  std::size_t count = 99;
  ASSERT_EQ(tidepool_device_ranges_except(kDevice, tag_, except, 3, nullptr, 0, &count), 0)
      << tidepool_last_error();
  EXPECT_EQ(count, 2u);
  void* out[4] = {};
  ASSERT_EQ(tidepool_device_ranges_except(kDevice, tag_, except, 3, out, 4, &count), 0)
      << tidepool_last_error();
  ASSERT_EQ(count, 2u);
  EXPECT_EQ(out[0], ranges_[1]);  // oldest first, not in the order they came back
  EXPECT_EQ(out[1], ranges_[3]);
  EXPECT_EQ(out[2], nullptr);
  void* one[1] = {};
  ASSERT_EQ(tidepool_device_ranges_except(kDevice, tag_, except, 3, one, 1, &count), 0);
  EXPECT_EQ(count, 2u);
  EXPECT_EQ(one[0], ranges_[1]);
  // Nothing named: every device-backed range of the tag; another tag lists none of them.
  ASSERT_EQ(tidepool_device_ranges_except(kDevice, tag_, nullptr, 0, out, 4, &count), 0);
  EXPECT_EQ(count, 3u);
  ASSERT_EQ(tidepool_device_ranges_except(kDevice, TIDEPOOL_TAG_WORKSPACE, nullptr, 0, out, 4,
                                          &count),
            0);
  for (std::size_t i = 0; i < std::min<std::size_t>(count, 4); ++i) {
    EXPECT_EQ(std::find(ranges_.begin(), ranges_.end(), out[i]), ranges_.end());
  }
  // Bad arrays and tags are errors, with *count 0.
  const auto fails_with = [&](const char* what, int tag, const void* const* names, std::size_t n,
                              void** into, std::size_t capacity, std::size_t* counted) {
    tidepool_clear_error();
    count = 7;
    EXPECT_EQ(tidepool_device_ranges_except(kDevice, tag, names, n, into, capacity, counted), -1)
        << what;
    EXPECT_EQ(std::string(tidepool_last_error()).rfind("tidepool_device_ranges_except: ", 0), 0u)
        << tidepool_last_error();
    EXPECT_NE(std::strstr(tidepool_last_error(), what), nullptr) << tidepool_last_error();
    if (counted != nullptr) {
      EXPECT_EQ(*counted, 0u) << what;
    }
  };
  fails_with("except is NULL but n_except is 2", tag_, nullptr, 2, out, 4, &count);
  fails_with("out is NULL but capacity is 4", tag_, except, 3, nullptr, 4, &count);
  fails_with("count is NULL", tag_, except, 3, out, 4, nullptr);
  fails_with("no tag has the id -1", -1, except, 3, out, 4, &count);
}

// tidepool_range_ids tells a range from a later one at the same address: an id is never
// given twice, though the pool may hand the address out again (Note [state outside
// optimizer.state] in _state_outside.py relies on it).
TEST_F(CApiTieringTest, RangeIdsAreNeverGivenTwiceThoughAddressesAre) {
  void* first = tidepool_vmm_malloc(3 * kMiB, kDevice, kTagOptimizerState, nullptr);
  void* other = tidepool_vmm_malloc(kMiB, kDevice, kTagOptimizerState, nullptr);
  ASSERT_NE(first, nullptr) << tidepool_last_error();
  ASSERT_NE(other, nullptr) << tidepool_last_error();
  int not_tiered = 0;
  const void* asked[] = {first, static_cast<const char*>(first) + kMiB + 5, other, nullptr,
                         &not_tiered};
  std::uint64_t ids[5] = {9, 9, 9, 9, 9};
  ASSERT_EQ(tidepool_range_ids(kDevice, asked, 5, ids), 0) << tidepool_last_error();
  EXPECT_NE(ids[0], 0u);
  EXPECT_EQ(ids[1], ids[0]);  // an interior pointer names its range
  EXPECT_NE(ids[2], 0u);
  EXPECT_NE(ids[2], ids[0]);
  EXPECT_EQ(ids[3], 0u);
  EXPECT_EQ(ids[4], 0u);
  // Freed: no range holds the address, until a later range may take it; that one's id
  // is new either way. Several tries, so that one lands on the freed address if the pool
  // reuses addresses at all (the host backend's does).
  std::set<std::uint64_t> seen = {ids[0], ids[2]};
  ASSERT_EQ(tidepool_vmm_free(first, kDevice), 0) << tidepool_last_error();
  std::uint64_t id_now = 9;
  ASSERT_EQ(tidepool_range_ids(kDevice, asked, 1, &id_now), 0);
  EXPECT_EQ(id_now, 0u);
  std::vector<void*> later;
  bool address_taken_again = false;
  for (int i = 0; i < 4 && !address_taken_again; ++i) {
    later.push_back(tidepool_vmm_malloc(3 * kMiB, kDevice, kTagOptimizerState, nullptr));
    ASSERT_NE(later.back(), nullptr) << tidepool_last_error();
    const void* named[] = {later.back(), first};
    std::uint64_t now[2] = {};
    ASSERT_EQ(tidepool_range_ids(kDevice, named, 2, now), 0) << tidepool_last_error();
    EXPECT_TRUE(seen.insert(now[0]).second) << "id " << now[0] << " given twice";
    address_taken_again = later.back() == first;
    EXPECT_EQ(now[1], address_taken_again ? now[0] : 0u);
  }
  // Bad arrays: an error that names the call and the array, the ids left alone.
  for (const bool null_ptrs : {true, false}) {
    tidepool_clear_error();
    std::uint64_t untouched[1] = {9};
    EXPECT_EQ(tidepool_range_ids(kDevice, null_ptrs ? nullptr : asked, 1,
                                 null_ptrs ? untouched : nullptr),
              -1);
    EXPECT_EQ(std::string(tidepool_last_error()),
              std::string("tidepool_range_ids: ") + (null_ptrs ? "ptrs" : "ids") +
                  " is NULL but n is 1");
    EXPECT_EQ(untouched[0], 9u);
  }
  EXPECT_EQ(tidepool_range_ids(kDevice, nullptr, 0, nullptr), 0) << tidepool_last_error();
  for (void* p : later) EXPECT_EQ(tidepool_vmm_free(p, kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_free(other, kDevice), 0) << tidepool_last_error();
}

// The shared state budget reaches the C struct (Note [Shared state budget]): two stores
// built from the configuration share it, one's acquire evicts the other's released
// handle, and the bytes charged are both stores'.
TEST_F(CApiTieringTest, StatsCarryTheSharedStateBudget) {
  constexpr std::size_t kUnit = 64 << 10;
  const std::string conf = "backend:tidepool,tidepool.state_budget:" + std::to_string(2 * kUnit);
  const ConfigScope config(conf.c_str());
  const auto options =
      tiering_test::test_store_options(TieredStoreOptions::kDeviceBudgetFromConfig);
  TieredStore a(*backend_, options);
  TieredStore b(*backend_, options);
  for (int i = 0; i < 2; ++i) {
    const auto h = a.create(kUnit, kTagOptimizerState);
    a.acquire(h, Stream{});
    a.release(h, false);
  }
  const auto mine = b.create(kUnit, kTagOptimizerState);
  b.acquire(mine, Stream{});
  b.release(mine, false);
  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.shared_budget_stores, 2u);
  EXPECT_EQ(s.shared_budget_charged_bytes, 2 * kUnit);
  EXPECT_EQ(s.peer_evictions, 1u);
  EXPECT_EQ(s.peer_evicted_bytes, kUnit);
  EXPECT_EQ(s.peer_room_requests, 1u);
}

// The device's state budget is one budget however many stores share it: two stores built
// from the configuration report it once (not twice), and a store with a budget of its own
// adds that budget.
TEST_F(CApiTieringTest, TheSharedStateBudgetIsCountedOnceInTheStats) {
  const ConfigScope config("backend:tidepool,tidepool.state_budget:8MiB");
  const auto from_config =
      tiering_test::test_store_options(TieredStoreOptions::kDeviceBudgetFromConfig);
  TieredStore a(*backend_, from_config);
  TieredStore b(*backend_, from_config);
  TieredStore own(*backend_, tiering_test::test_store_options(3 * kMiB));
  tidepool_tiering_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(s.stores, 3u);
  EXPECT_EQ(s.shared_budget_stores, 2u);
  EXPECT_EQ(s.device_budget_bytes, 8 * kMiB + 3 * kMiB);
}

TEST_F(CApiTieringTest, AnOlderShorterTieringStatsStructGetsItsPrefix) {
  unsigned char buffer[sizeof(tidepool_tiering_stats_v1) + 8];
  std::memset(buffer, 0xAB, sizeof buffer);
  auto* s = reinterpret_cast<tidepool_tiering_stats_v1*>(buffer);
  s->struct_size = TIDEPOOL_TIERING_STATS_V1_MIN_SIZE;
  ASSERT_EQ(tidepool_get_tiering_stats_v1(kDevice, s), 0) << tidepool_last_error();
  EXPECT_EQ(s->struct_size, TIDEPOOL_TIERING_STATS_V1_MIN_SIZE);
  EXPECT_EQ(s->version, 1u);
  for (std::size_t i = TIDEPOOL_TIERING_STATS_V1_MIN_SIZE; i < sizeof buffer; ++i)
    ASSERT_EQ(buffer[i], 0xAB) << i;
  s->struct_size = TIDEPOOL_TIERING_STATS_V1_MIN_SIZE - 1;
  EXPECT_EQ(tidepool_get_tiering_stats_v1(kDevice, s), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("struct_size is less than"), std::string::npos);
}

TEST_F(PrefetchBudgetTest, ARangeThatDoesNotFitIsSkippedForALaterOneThatDoes) {
  const ConfigScope config("backend:tidepool,tidepool.state_budget:7MiB");
  make_evicted({4 * kMiB, 4 * kMiB, 2 * kMiB});
  EXPECT_EQ(prefetch(), 4 * kMiB);
  EXPECT_EQ(on_device(0), 4 * kMiB);
  EXPECT_EQ(on_device(1), 0u);
  EXPECT_EQ(on_device(2), 2 * kMiB);
}

TEST_F(PrefetchBudgetTest, BudgetZeroKeepsEverythingOnTheHost) {
  const ConfigScope config("backend:tidepool");  // state_budget defaults to 0
  make_evicted({2 * kMiB, 4 * kMiB});
  EXPECT_EQ(prefetch(), 6 * kMiB);
  EXPECT_EQ(on_device(0) + on_device(1), 0u);
}

TEST_F(PrefetchBudgetTest, WithoutAConfigurationEverythingComesBack) {
  const ConfigScope config("");  // tidepool not enabled: no budget
  make_evicted({2 * kMiB, 4 * kMiB});
  EXPECT_EQ(prefetch(), 0u);
  EXPECT_EQ(on_device(0), 2 * kMiB);
  EXPECT_EQ(on_device(1), 4 * kMiB);
}

TEST_F(PrefetchBudgetTest, APercentageIsOfTheDevicesMemory) {
  // A percentage that comes to 3 MiB of this device: one 2 MiB range fits, two do not.
  const double total = static_cast<double>(backend_->mem_info().total_bytes);
  char conf[96];
  std::snprintf(conf, sizeof conf, "backend:tidepool,tidepool.state_budget:%.9f%%",
                300.0 * static_cast<double>(kMiB) / total);
  const ConfigScope config(conf);
  make_evicted({2 * kMiB, 2 * kMiB});
  EXPECT_EQ(prefetch(), 2 * kMiB);
  EXPECT_EQ(on_device(0), 2 * kMiB);
}

}  // namespace
}  // namespace tidepool
