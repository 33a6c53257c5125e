// Note [State pushed out under pressure] (tiering/tiering_registry.cpp): when the device
// runs out, optimizer state in pointer-stable ranges moves to the host, at the same
// addresses and with its bytes, so that a new range or an ordinary allocation still gets
// device memory: the state a step needs all at once fits under a cap below its size.
// A host-backend device of 64 MiB stands in for a GPU under a memory cap.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/device_registry.h"
#include "allocator/tags.h"
#include "allocator/tier_routing.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/c_api_tiering.h"
#include "tiering/tiering_registry.h"
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::kMiB;

constexpr int kSmallDevice = 5;
constexpr std::size_t kCapacity = 64 * kMiB;
constexpr std::size_t kRange = 8 * kMiB;  // above tier_min_bytes: routed

class StatePressureTest : public tiering_test::HostBackendTest<kSmallDevice> {
 protected:
  void SetUp() override {
    HostBackendTest::SetUp();
    if (IsSkipped()) return;
    if (existing_device_allocator(kSmallDevice) == nullptr) {
      ASSERT_EQ(setenv("TIDEPOOL_HOST_CAPACITY_MB", "64", 1), 0);
      device_allocator(kSmallDevice);
      unsetenv("TIDEPOOL_HOST_CAPACITY_MB");
    }
    ASSERT_EQ(device_allocator(kSmallDevice).backend().mem_info().total_bytes, kCapacity);
    set_tier_min_bytes(kDefaultTierMinBytes);
    ASSERT_GE(kRange, tier_min_bytes());
  }
  void TearDown() override {
    for (void* p : state_) tidepool_free(p, kRange, kSmallDevice, nullptr);
    state_.clear();
    tidepool_empty_cache(kSmallDevice);
  }
  // tidepool_malloc under optimizer_state, filled with a byte of its own.
  void* new_state(unsigned char fill) {
    EXPECT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
    void* p = tidepool_malloc(static_cast<ssize_t>(kRange), kSmallDevice, nullptr);
    EXPECT_EQ(tidepool_tag_pop(), 0);
    if (p != nullptr) {
      std::memset(p, fill, kRange);
      state_.push_back(p);
    }
    return p;
  }
  static bool holds(const void* p, unsigned char fill) {
    const auto* bytes = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < kRange; ++i) {
      if (bytes[i] != fill) return false;
    }
    return true;
  }
  static VmmPool& pool() { return tiering_vmm_pool(kSmallDevice); }
  std::vector<void*> state_;
};

TEST_F(StatePressureTest, NewStateBeyondTheDevicePushesTheOldestStateToTheHost) {
  // Twice the device's memory in state: every range is created, each is pointer-stable
  // and keeps its bytes, and the oldest went to the host to make room.
  constexpr int kRanges = static_cast<int>(2 * kCapacity / kRange);
  for (int i = 0; i < kRanges; ++i) {
    void* p = new_state(static_cast<unsigned char>(i + 1));
    ASSERT_NE(p, nullptr) << "range " << i << ": " << tidepool_last_error();
    ASSERT_EQ(tidepool_vmm_owns(p, kSmallDevice), 1) << "range " << i << " is pointer-stable";
  }
  for (int i = 0; i < kRanges; ++i) {
    EXPECT_TRUE(holds(state_[static_cast<std::size_t>(i)], static_cast<unsigned char>(i + 1)))
        << "range " << i;
  }
  EXPECT_EQ(pool().bytes_in(state_.front(), MemoryLocation::device), 0u)
      << "the oldest range made room";
  EXPECT_EQ(pool().bytes_in(state_.back(), MemoryLocation::device), kRange)
      << "the newest is on the device";
  EXPECT_GE(pool().stats().bytes_to_host, kCapacity);
}

TEST_F(StatePressureTest, AnOrdinaryAllocationOnAFullDeviceMovesStateOut) {
  // State fills the device; an untagged block then needs room the caching allocator does
  // not have: its OOM policy's reclaim hook moves state to the host.
  for (int i = 0; i < static_cast<int>(kCapacity / kRange); ++i) {
    ASSERT_NE(new_state(static_cast<unsigned char>(0x40 + i)), nullptr) << tidepool_last_error();
  }
  const std::size_t on_device_before = pool().stats().device_backed_bytes;
  void* block = tidepool_malloc(static_cast<ssize_t>(3 * kRange), kSmallDevice, nullptr);
  ASSERT_NE(block, nullptr) << tidepool_last_error();
  EXPECT_EQ(tidepool_vmm_owns(block, kSmallDevice), 0) << "an ordinary block";
  EXPECT_LE(pool().stats().device_backed_bytes + 3 * kRange, on_device_before + kRange)
      << "state left the device for it";
  for (int i = 0; i < static_cast<int>(state_.size()); ++i) {
    EXPECT_TRUE(holds(state_[static_cast<std::size_t>(i)], static_cast<unsigned char>(0x40 + i)))
        << "range " << i;
  }
  tidepool_free(block, 3 * kRange, kSmallDevice, nullptr);
}

// Note [Steps of other threads] (tiering/steps_in_flight.cpp): while another thread's
// optimizer step is in flight on the device, an OOM here moves none of the state that step
// may be using; the thread's own step does not hold it back.
TEST_F(StatePressureTest, AnotherThreadsStepInFlightKeepsTheStateWhereItIs) {
  for (int i = 0; i < static_cast<int>(kCapacity / kRange); ++i) {
    ASSERT_NE(new_state(static_cast<unsigned char>(0x50 + i)), nullptr) << tidepool_last_error();
  }
  const std::size_t on_device = pool().stats().device_backed_bytes;
  std::promise<void> began, finish;
  std::thread stepping([&] {
    EXPECT_EQ(tidepool_step_begin(kSmallDevice), 0);
    began.set_value();
    finish.get_future().wait();
    EXPECT_EQ(tidepool_step_end(kSmallDevice), 0);
  });
  began.get_future().wait();
  EXPECT_EQ(tidepool_steps_in_flight(kSmallDevice), 1);
  void* block = tidepool_malloc(static_cast<ssize_t>(3 * kRange), kSmallDevice, nullptr);
  EXPECT_EQ(block, nullptr) << "state was moved under another thread's step";
  EXPECT_EQ(pool().stats().device_backed_bytes, on_device);
  ASSERT_EQ(tidepool_step_begin(kSmallDevice), 0);  // this thread's own step too
  EXPECT_EQ(tidepool_malloc(static_cast<ssize_t>(3 * kRange), kSmallDevice, nullptr), nullptr)
      << "the other thread's step still counts";
  std::thread([] { EXPECT_EQ(tidepool_step_end(kSmallDevice), 0); }).join();
  EXPECT_EQ(tidepool_steps_in_flight(kSmallDevice), 2) << "an end without its begin counted";
  finish.set_value();
  stepping.join();
  // Alone now, its own step does not hold the state back: it moves and the block fits.
  block = tidepool_malloc(static_cast<ssize_t>(3 * kRange), kSmallDevice, nullptr);
  ASSERT_NE(block, nullptr) << tidepool_last_error();
  EXPECT_LT(pool().stats().device_backed_bytes, on_device);
  for (int i = 0; i < static_cast<int>(state_.size()); ++i) {
    EXPECT_TRUE(holds(state_[static_cast<std::size_t>(i)], static_cast<unsigned char>(0x50 + i)))
        << "range " << i;
  }
  tidepool_free(block, 3 * kRange, kSmallDevice, nullptr);
  ASSERT_EQ(tidepool_step_end(kSmallDevice), 0);
  EXPECT_EQ(tidepool_steps_in_flight(kSmallDevice), 0);
  EXPECT_EQ(tidepool_step_begin(-1), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("device -1"), std::string::npos);
  // A thread that ends with a step still counted (its scope never closed) is counted out.
  std::thread([] { EXPECT_EQ(tidepool_step_begin(kSmallDevice), 0); }).join();
  EXPECT_EQ(tidepool_steps_in_flight(kSmallDevice), 0) << "a finished thread's step counts";
}

TEST_F(StatePressureTest, WhatCannotFitEvenWithAllStateOnTheHostIsStillAClearOom) {
  ASSERT_NE(new_state(0x11), nullptr) << tidepool_last_error();
  void* too_big = tidepool_malloc(static_cast<ssize_t>(2 * kCapacity), kSmallDevice, nullptr);
  EXPECT_EQ(too_big, nullptr);
  EXPECT_NE(std::string(tidepool_last_error()).find("out of memory"), std::string::npos)
      << tidepool_last_error();
  EXPECT_TRUE(holds(state_.front(), 0x11)) << "the state is intact wherever it is";
}

// New state larger than the device itself cannot be made room for: the state already
// on the device stays there (it was all pushed to the host first, in vain).
TEST_F(StatePressureTest, StateLargerThanTheDeviceMovesNoOtherStateOut) {
  for (int i = 0; i < 4; ++i) {
    ASSERT_NE(new_state(static_cast<unsigned char>(0x70 + i)), nullptr) << tidepool_last_error();
  }
  const std::size_t on_device_before = pool().stats().device_backed_bytes;
  EXPECT_EQ(tidepool_tag_push(kTagOptimizerState), 0);
  void* too_big = tidepool_malloc(static_cast<ssize_t>(2 * kCapacity), kSmallDevice, nullptr);
  EXPECT_EQ(tidepool_tag_pop(), 0);
  EXPECT_EQ(too_big, nullptr);
  EXPECT_NE(std::string(tidepool_last_error()).find("out of memory"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(pool().stats().device_backed_bytes, on_device_before) << "state was pushed out";
}

// Note [New state where the budget puts it] (tiering/vmm_migration.cpp): with tidepool
// configured, the budget places new state, so none of it has to be pushed out.
TEST_F(StatePressureTest, ConfiguredWithTheDefaultBudgetNewStateIsMadeOnTheHost) {
  const tiering_test::ConfigScope config("backend:tidepool");  // state_budget 0
  const VmmStats before = pool().stats();
  constexpr int kRanges = static_cast<int>(2 * kCapacity / kRange);
  for (int i = 0; i < kRanges; ++i) {
    void* p = new_state(static_cast<unsigned char>(0x60 + i));
    ASSERT_NE(p, nullptr) << "range " << i << ": " << tidepool_last_error();
    EXPECT_EQ(pool().bytes_in(p, MemoryLocation::host), kRange) << "range " << i;
  }
  for (int i = 0; i < kRanges; ++i) {
    EXPECT_TRUE(holds(state_[static_cast<std::size_t>(i)], static_cast<unsigned char>(0x60 + i)))
        << "range " << i;
  }
  const VmmStats after = pool().stats();
  EXPECT_EQ(after.device_backed_bytes, before.device_backed_bytes);
  EXPECT_EQ(after.bytes_to_host, before.bytes_to_host) << "nothing had to be moved";
}

TEST_F(StatePressureTest, ConfiguredWithABudgetTheFirstStateIsMadeOnTheDevice) {
  const tiering_test::ConfigScope config("backend:tidepool,tidepool.state_budget:16MiB");
  const VmmStats before = pool().stats();
  for (int i = 0; i < 4; ++i) {
    void* p = new_state(static_cast<unsigned char>(0x70 + i));
    ASSERT_NE(p, nullptr) << "range " << i << ": " << tidepool_last_error();
    EXPECT_EQ(pool().bytes_in(p, i < 2 ? MemoryLocation::device : MemoryLocation::host), kRange)
        << "range " << i << ": two fit in the budget";
  }
  EXPECT_EQ(pool().stats().device_backed_bytes, before.device_backed_bytes + 2 * kRange);
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(holds(state_[static_cast<std::size_t>(i)], static_cast<unsigned char>(0x70 + i)))
        << "range " << i;
  }
}

}  // namespace
}  // namespace tidepool
