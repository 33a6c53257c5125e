// The caching allocator when the C++ heap runs out part-way through an allocation (its
// bookkeeping: a thread's cache made on its first small allocation, the index of a block
// split off): this binary replaces operator new (tests/support/failing_operator_new.h) and
// sweeps the allocation that fails, n = 0, 1, 2, ..., each on a fresh thread, until the
// allocation goes through. After every failure nothing is handed out or lost: the stats
// say nothing is allocated, every reserved byte is cached, and empty_cache gives all of it
// back; after the success the block frees and the same holds.
#include <gtest/gtest.h>

#include <cstddef>
#include <string>
#include <thread>

#include "allocator/caching_allocator.h"
#include "tests/support/failing_operator_new.h"

namespace tidepool {
namespace {

using test_support::survives;

constexpr long kMaxAllocations = 10000;  // no allocation here allocates nearly this often

void expect_nothing_held(CachingAllocator& a, const std::string& when) {
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.allocated.current, 0u) << when;
  EXPECT_EQ(s.cached_bytes, s.reserved.current) << when;
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved.current, 0u) << when << ": bytes no block holds stay reserved";
}

// A small allocation (thread cache on: the thread's first one makes its cache) and one
// that splits a larger free block (the rest indexed as a block of its own).
class AllocationFailures : public ::testing::TestWithParam<std::size_t> {};

TEST_P(AllocationFailures, AnAllocationThatRunsOutOfHeapLeavesNothingBehind) {
  const std::size_t bytes = GetParam();
  HostBackendOptions backend;
  backend.capacity_bytes = std::size_t{1} << 30;
  CachingAllocator a(make_host_backend(0, backend), AllocatorOptions{});
  long failures = 0;
  for (long n = 0; n < kMaxAllocations; ++n) {
    // A free block to split: what an earlier, larger allocation left cached.
    a.deallocate(a.allocate(8 << 20), 8 << 20);
    void* p = nullptr;
    bool done = false;
    std::thread([&] { done = survives(n, [&] { p = a.allocate(bytes); }); }).join();
    if (done) {
      ASSERT_NE(p, nullptr);
      a.deallocate(p, bytes);
      expect_nothing_held(a, "after the allocation that went through");
      break;
    }
    ++failures;
    expect_nothing_held(a, "after allocation " + std::to_string(n) + " failed");
  }
  EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
}

INSTANTIATE_TEST_SUITE_P(Sizes, AllocationFailures,
                         ::testing::Values(std::size_t{4000}, std::size_t{3} << 20));

}  // namespace
}  // namespace tidepool
