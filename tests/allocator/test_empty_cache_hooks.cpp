// Empty-cache hooks (allocator/reclaim.h, Note [Empty-cache hooks] in reclaim.cpp): the
// C ABI's tidepool_empty_cache runs them with the device, before and without the
// allocator's lock, so that what a hook frees through the allocator goes back in the same
// call; a hook that throws is reported and the rest of empty_cache goes on; unregistered
// hooks are not called, not even by a run under way, and an unregister waits for a call
// in flight; tidepool_empty_cache_all asks for every device index and creates
// no allocator; a hook's own empty_cache does not call the hooks again; and
// CachingAllocator::empty_cache (which the tiering layer uses to make device room) runs
// none. Runs on the host backend.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "allocator/reclaim.h"
#include "test_support.h"

namespace tidepool {
namespace {

constexpr std::size_t kBlock = std::size_t{8} << 20;  // a large block: no thread cache

class EmptyCacheHooks : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ASSERT_EQ(tidepool_set_backend("host"), 0); }
  static std::size_t reserved(int device) {
    return device_allocator(device).stats().reserved.current;
  }
};

TEST_F(EmptyCacheHooks, RunWithTheDeviceBeforeTheCacheIsEmptied) {
  constexpr int kDevice = 1;
  // The hook holds a block of the allocator and frees it when asked, as a layer above
  // that caches device memory would: the free takes the allocator's lock (a hook run
  // under it would deadlock here), and the block goes back to the device in this call.
  void* held = tidepool_malloc(kBlock, kDevice, nullptr);
  ASSERT_NE(held, nullptr) << tidepool_last_error();
  std::vector<int> asked;
  test::ScopedEmptyCacheHook guard([&](int device) {
    asked.push_back(device);
    if (held != nullptr) tidepool_free(std::exchange(held, nullptr), kBlock, device, nullptr);
  });
  ASSERT_GE(reserved(kDevice), kBlock);
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(asked, std::vector<int>{kDevice});
  EXPECT_EQ(held, nullptr);
  EXPECT_EQ(reserved(kDevice), 0u) << "what the hook freed went back in the same call";
}

TEST_F(EmptyCacheHooks, AThrowingHookDoesNotStopEmptyCache) {
  constexpr int kDevice = 2;
  std::vector<int> calls;
  test::ScopedEmptyCacheHook first([&](int) {
    calls.push_back(1);
    throw std::runtime_error("a layer that failed to release its cache");
  });
  test::ScopedEmptyCacheHook second([&](int) {
    calls.push_back(2);
    throw 42;  // not a std::exception
  });
  test::ScopedEmptyCacheHook third([&](int) { calls.push_back(3); });
  void* p = tidepool_malloc(kBlock, kDevice, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  tidepool_free(p, kBlock, kDevice, nullptr);
  ASSERT_GE(reserved(kDevice), kBlock);
  testing::internal::CaptureStderr();
  const int rc = tidepool_empty_cache(kDevice);
  const std::string said = testing::internal::GetCapturedStderr();
  EXPECT_EQ(rc, 0) << tidepool_last_error();
  EXPECT_EQ(calls, (std::vector<int>{1, 2, 3})) << "every hook, in registration order";
  EXPECT_EQ(reserved(kDevice), 0u) << "the allocator's cache is emptied all the same";
  EXPECT_NE(said.find("empty-cache hook " + std::to_string(first.id()) +
                      " threw during empty_cache: a layer that failed"),
            std::string::npos)
      << said;
  EXPECT_NE(said.find("empty-cache hook " + std::to_string(second.id()) + " threw a non-"),
            std::string::npos)
      << said;
}

TEST_F(EmptyCacheHooks, UnregisteredHooksAreNotCalled) {
  constexpr int kDevice = 3;
  int calls = 0;
  const int id = register_empty_cache_hook([&](int) { ++calls; });
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(calls, 1);
  unregister_empty_cache_hook(id);
  unregister_empty_cache_hook(id);  // unknown ids are ignored
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(calls, 1);
  EXPECT_THROW(register_empty_cache_hook(EmptyCacheHook{}), std::invalid_argument);
}

// Note [Unregistering a running hook] (reclaim.cpp): a run calls a copy of the list. A hook
// unregistered while a run is inside an earlier hook is not called after the unregister
// returned (its owner may have destroyed what it captures); an unregister waits for a call
// of its hook in flight on another thread; and a hook may unregister itself.
TEST_F(EmptyCacheHooks, AnUnregisteredHookIsNotCalledByARunAlreadyUnderWay) {
  constexpr int kDevice = 4;
  std::atomic<bool> inside{false}, go{false};
  const int first = register_empty_cache_hook([&](int) {
    inside = true;
    while (!go) std::this_thread::yield();
  });
  std::atomic<int> second_calls{0};
  const int second = register_empty_cache_hook([&](int) { ++second_calls; });
  std::thread run([&] { EXPECT_EQ(tidepool_empty_cache(kDevice), 0); });
  while (!inside) std::this_thread::yield();
  unregister_empty_cache_hook(second);  // the run copied the list with it
  go = true;
  run.join();
  EXPECT_EQ(second_calls, 0) << "called after its unregister returned";
  unregister_empty_cache_hook(first);
}

TEST_F(EmptyCacheHooks, UnregisterWaitsForACallInFlight) {
  constexpr int kDevice = 5;
  std::atomic<bool> inside{false}, go{false}, call_over{false};
  const int id = register_empty_cache_hook([&](int) {
    inside = true;
    while (!go) std::this_thread::yield();
    call_over = true;
  });
  std::thread run([&] { EXPECT_EQ(tidepool_empty_cache(kDevice), 0); });
  while (!inside) std::this_thread::yield();
  std::atomic<bool> unregistered{false};
  bool over_when_unregistered = false;
  std::thread unregister([&] {
    unregister_empty_cache_hook(id);
    over_when_unregistered = call_over;
    unregistered = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_FALSE(unregistered) << "returned while the hook was still running";
  go = true;
  unregister.join();
  run.join();
  EXPECT_TRUE(over_when_unregistered);
}

TEST_F(EmptyCacheHooks, AHookMayUnregisterItself) {
  constexpr int kDevice = 6;
  int calls = 0;
  int id = 0;
  id = register_empty_cache_hook([&](int) {
    ++calls;
    unregister_empty_cache_hook(id);  // does not wait for this call
  });
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(calls, 1);
}

TEST_F(EmptyCacheHooks, EmptyCacheAllAsksForEveryDeviceAndCreatesNoAllocator) {
  constexpr int kUnused = 13;
  ASSERT_EQ(existing_device_allocator(kUnused), nullptr);
  std::vector<int> asked;
  test::ScopedEmptyCacheHook guard([&](int device) { asked.push_back(device); });
  EXPECT_EQ(tidepool_empty_cache_all(), 0) << tidepool_last_error();
  std::vector<int> every;
  for (int d = 0; d < kMaxDevices; ++d) every.push_back(d);
  EXPECT_EQ(asked, every);
  EXPECT_EQ(existing_device_allocator(kUnused), nullptr);
}

TEST_F(EmptyCacheHooks, AHooksOwnEmptyCacheDoesNotCallTheHooksAgain) {
  constexpr int kDevice = 4;
  int calls = 0;
  int nested_rc = -2;
  test::ScopedEmptyCacheHook guard([&](int device) {
    ++calls;
    nested_rc = tidepool_empty_cache(device);
  });
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(calls, 1);
  EXPECT_EQ(nested_rc, 0);
  EXPECT_EQ(tidepool_empty_cache(kDevice), 0) << "the thread runs hooks again afterwards";
  EXPECT_EQ(calls, 2);
}

TEST_F(EmptyCacheHooks, ABadDeviceRunsNoHook) {
  int calls = 0;
  test::ScopedEmptyCacheHook guard([&](int) { ++calls; });
  EXPECT_EQ(tidepool_empty_cache(-1), -1);
  EXPECT_EQ(tidepool_empty_cache(kMaxDevices), -1);
  EXPECT_EQ(calls, 0);
}

TEST_F(EmptyCacheHooks, TheAllocatorsOwnEmptyCacheRunsNone) {
  int calls = 0;
  test::ScopedEmptyCacheHook guard([&](int) { ++calls; });
  CachingAllocator allocator(test::make_backend("host"));
  allocator.deallocate(allocator.allocate(kBlock), kBlock);
  EXPECT_GE(allocator.empty_cache(), kBlock);
  EXPECT_EQ(calls, 0);
}

}  // namespace
}  // namespace tidepool
