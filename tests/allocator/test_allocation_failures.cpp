// The caching allocator when the C++ heap runs out part-way through an allocation (its
// bookkeeping: a thread's cache made on its first small allocation, the index of a block
// split off): this binary replaces operator new (tests/support/failing_operator_new.h) and
// sweeps the allocation that fails, n = 0, 1, 2, ..., each on a fresh thread, until the
// allocation goes through. After every failure nothing is handed out or lost: the stats
// say nothing is allocated, every reserved byte is cached (under a tag), and empty_cache
// gives all of it back; after the success the block frees and the same holds. The same from a fresh
// allocator, where the failure may hit making the first segment, range, block or mapping:
// nothing the backend gave may be left unrecorded, and the allocator keeps working.
#include <gtest/gtest.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/forwarding_backend.h"
#include "allocator/tags.h"
#include "tests/support/failing_operator_new.h"

namespace tidepool {
namespace {

using test_support::survives;
using test_support::survives_exhaustion;

constexpr long kMaxAllocations = 10000;  // no allocation here allocates nearly this often

void expect_nothing_held(CachingAllocator& a, const std::string& when) {
  const AllocatorStats s = a.stats();
  EXPECT_EQ(s.allocated.current, 0u) << when;
  EXPECT_EQ(s.cached_bytes, s.reserved.current) << when;
  // Note [Cached memory by tag]: each cached byte is under a tag, a segment whose block
  // could not be made too.
  std::uint64_t under_tags = 0;
  for (const TagStats& t : s.tags) under_tags += t.cached_bytes;
  EXPECT_EQ(under_tags, s.cached_bytes) << when << ": cached memory under no tag";
  a.empty_cache();
  EXPECT_EQ(a.stats().reserved.current, 0u) << when << ": bytes no block holds stay reserved";
}

// A small allocation (thread cache on: the thread's first one makes its cache) and one
// that splits a larger free block (the rest indexed as a block of its own); the heap
// failing once, or staying exhausted from then on (then putting the block back must not
// need the heap: it lost the block, whose segment empty_cache could no longer give back).
class AllocationFailures : public ::testing::TestWithParam<std::tuple<std::size_t, bool>> {};

TEST_P(AllocationFailures, AnAllocationThatRunsOutOfHeapLeavesNothingBehind) {
  const auto [bytes, exhausted] = GetParam();
  HostBackendOptions backend;
  backend.capacity_bytes = std::size_t{1} << 30;
  CachingAllocator a(make_host_backend(0, backend), AllocatorOptions{});
  // Larger than the request, in the same (small or large) pool.
  const std::size_t cached = bytes < (std::size_t{1} << 20) ? 64 << 10 : 8 << 20;
  long failures = 0;
  for (long n = 0; n < kMaxAllocations; ++n) {
    // A free block to split: what an earlier, larger allocation left cached.
    a.deallocate(a.allocate(cached), cached);
    void* p = nullptr;
    bool done = false;
    std::thread([&] {
      const auto allocate = [&] { p = a.allocate(bytes); };
      done = exhausted ? survives_exhaustion(n, allocate) : survives(n, allocate);
    }).join();
    if (done) {
      ASSERT_NE(p, nullptr);
      a.deallocate(p, bytes);
      expect_nothing_held(a, "after the allocation that went through");
      break;
    }
    ++failures;
    const std::string when = "after allocation " + std::to_string(n) + " failed";
    // The free block the failed allocation took is back in its free list: the same
    // request is served from it (a block left in no list is only found by empty_cache).
    const std::size_t reserved = a.stats().reserved.current;
    void* again = a.allocate(bytes);
    EXPECT_EQ(a.stats().reserved.current, reserved) << when << ": the cached block was lost";
    a.deallocate(again, bytes);
    expect_nothing_held(a, when);
  }
  EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
}

INSTANTIATE_TEST_SUITE_P(
    SizesAndExhaustion, AllocationFailures,
    ::testing::Combine(::testing::Values(std::size_t{4000}, std::size_t{3} << 20),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<std::size_t, bool>>& param) {
      return std::to_string(std::get<0>(param.param)) + "Bytes" +
             (std::get<1>(param.param) ? "HeapStaysExhausted" : "OneFailure");
    });

// Note [Failed frees]: a free on the block's own stream needs no heap. With none left at
// all, every free goes through — next to free neighbours (merged) and not (each block
// between two allocated ones), small and large, quick lists on and off — and afterwards
// nothing is held and empty_cache gives every byte back. (A free whose block merged with
// nothing needed a free-list node from the heap: it threw, after the stats had counted
// the block free, and the block was in no list.)
TEST(FreeFailures, AFreeOnItsOwnStreamNeedsNoHeap) {
  for (const bool quick_lists : {false, true}) {
    for (const std::size_t bytes : {std::size_t{4096}, std::size_t{3} << 20}) {
      const std::string when = std::to_string(bytes) + " bytes, quick lists " +
                               (quick_lists ? "on" : "off");
      HostBackendOptions host;
      host.capacity_bytes = std::size_t{1} << 30;
      AllocatorOptions options;
      options.quick_lists = quick_lists;
      options.thread_cache_bytes = 0;
      CachingAllocator a(make_host_backend(0, host), options);
      std::vector<void*> blocks;
      for (int i = 0; i < 8; ++i) blocks.push_back(a.allocate(bytes));
      // Every other block first (neighbours allocated: no merge), then the rest (both
      // neighbours free: two merges).
      for (const int parity : {0, 1}) {
        std::thread([&] {
          for (std::size_t i = parity; i < blocks.size(); i += 2) {
            EXPECT_TRUE(survives_exhaustion(0, [&] { a.deallocate(blocks[i], bytes); }))
                << when << ": the free of block " << i << " threw";
          }
        }).join();
      }
      expect_nothing_held(a, when);
    }
  }
}

// A block whose free waited on an event is given back at the next allocation, its event
// kept as a spare. With no heap left at all, that allocation goes through, served by the
// block given back (an exact fit: a split would need a new block, and so the heap).
// Review findings: keeping the event needed the heap, so with none left every allocation
// threw, though the block given back could serve it; and before that, a failure part-way
// through giving blocks back left those already given back listed as waiting too, and the
// next call gave them back again while one was in use (nothing there needs the heap now,
// so that part-way failure cannot happen any more).
TEST(PendingFreeFailures, ABlockGivenBackFromWaitingNeedsNoHeap) {
  constexpr std::size_t kBytes = std::size_t{3} << 20;  // large: no quick list
  HostBackendOptions host;
  host.capacity_bytes = std::size_t{1} << 30;
  AllocatorOptions options;
  options.thread_cache_bytes = 0;  // a thread's first allocation would make its cache
  CachingAllocator a(make_host_backend(0, host), options);
  Backend& backend = a.backend();
  const Stream side = backend.create_stream();
  void* p = a.allocate(kBytes);
  a.record_stream(p, side);
  a.deallocate(p, kBytes);  // waits on an event recorded on `side`
  backend.stream_synchronize(side);
  void* again = nullptr;
  bool done = false;
  std::thread([&] {
    done = survives_exhaustion(0, [&] { again = a.allocate(kBytes); });
  }).join();
  EXPECT_TRUE(done) << "the allocation needed the heap";
  EXPECT_EQ(again, p);
  if (done) a.deallocate(again, kBytes);
  a.release_stream(side);
  backend.destroy_stream(side);
  expect_nothing_held(a, "after the block was given back");
}

// Counts the address ranges reserved through it and not released yet. The count outlives
// the backend, so a test can check once the allocator is gone that it left none reserved.
class ReservationCounter final : public ForwardingBackend {
 public:
  explicit ReservationCounter(std::unique_ptr<Backend> inner)
      : ForwardingBackend(std::move(inner)) {}
  std::shared_ptr<const std::atomic<int>> live() const { return live_; }

 private:
  void* do_reserve_address(std::size_t bytes) override {
    void* va = ForwardingBackend::do_reserve_address(bytes);
    live_->fetch_add(1);
    return va;
  }
  void do_release_address(void* va, std::size_t bytes) override {
    ForwardingBackend::do_release_address(va, bytes);
    live_->fetch_sub(1);
  }

  std::shared_ptr<std::atomic<int>> live_ = std::make_shared<std::atomic<int>>(0);
};

// (request bytes, expandable segments)
class FreshAllocationFailures
    : public ::testing::TestWithParam<std::tuple<std::size_t, bool>> {};

// The first allocation of a fresh allocator, failing at each of its heap allocations in
// turn. After a failure, what the allocator reserves is exactly what the backend holds for
// it (a segment or mapping the backend made but no table records would differ), the same
// request is served, backed by memory reserved counts, and freed (a block half-linked
// into a range would be handed out and then refused as a "free of no live allocation"),
// and empty_cache gives every byte back.
// Once the allocator is gone, no address range is left reserved.
TEST_P(FreshAllocationFailures, AFirstAllocationThatRunsOutOfHeapLeavesNothingBehind) {
  const auto [bytes, expandable] = GetParam();
  long failures = 0;
  for (long n = 0; n < kMaxAllocations; ++n) {
    const std::string when = "allocation " + std::to_string(n);
    HostBackendOptions host;
    host.capacity_bytes = std::size_t{1} << 30;
    auto counter = std::make_unique<ReservationCounter>(make_host_backend(0, host));
    const std::shared_ptr<const std::atomic<int>> live_ranges = counter->live();
    AllocatorOptions options;
    options.expandable_segments = expandable;
    bool done = false;
    {
      CachingAllocator a(std::move(counter), options);
      Backend& backend = a.backend();
      void* p = nullptr;
      std::thread([&] { done = survives(n, [&] { p = a.allocate(bytes); }); }).join();
      if (done) {
        ASSERT_NE(p, nullptr);
        a.deallocate(p, bytes);
      } else {
        ++failures;
        EXPECT_EQ(a.stats().allocated.current, 0u) << when << " failed";
        // Note [Cached memory by tag]: a segment whose block could not be made is cached
        // memory, under the request's tag like the rest of a new segment.
        const AllocatorStats s = a.stats();
        EXPECT_EQ(s.tags[kTagUntagged].cached_bytes, s.cached_bytes) << when << " failed";
        EXPECT_EQ(a.stats().reserved.current, backend.device_bytes_in_use())
            << when << " failed: reserved memory is not what the backend holds for us";
        a.empty_cache();
        EXPECT_EQ(a.stats().reserved.current, 0u) << when << " failed";
        EXPECT_EQ(backend.device_bytes_in_use(), 0u)
            << when << " failed: device memory that empty_cache cannot give back";
        void* again = a.allocate(bytes);
        // Every byte under a live block is mapped memory that reserved counts.
        EXPECT_GE(a.stats().reserved.current, bytes) << when << " failed";
        EXPECT_EQ(a.stats().reserved.current, backend.device_bytes_in_use()) << when << " failed";
        // One stream, one pool: one range, the failed allocation's if it made one.
        EXPECT_LE(live_ranges->load(), 1) << when << " failed: a range no stream grows";
        EXPECT_NO_THROW(a.deallocate(again, bytes)) << when << " failed";
      }
      a.empty_cache();
      EXPECT_EQ(a.stats().reserved.current, 0u) << when << (done ? " went through" : "");
      EXPECT_EQ(backend.device_bytes_in_use(), 0u) << when << (done ? " went through" : "");
    }
    EXPECT_EQ(live_ranges->load(), 0) << when << ": an address range outlived the allocator";
    if (done) break;
  }
  EXPECT_GT(failures, 0) << "no allocation to fail: the sweep tested nothing";
}

INSTANTIATE_TEST_SUITE_P(
    SizesAndSegments, FreshAllocationFailures,
    ::testing::Combine(::testing::Values(std::size_t{40} << 20, std::size_t{3} << 20),
                       ::testing::Bool()),
    [](const ::testing::TestParamInfo<std::tuple<std::size_t, bool>>& param) {
      return std::to_string(std::get<0>(param.param) >> 20) + "MiB" +
             (std::get<1>(param.param) ? "Expandable" : "Plain");
    });

// The same with the thread caches on (the default): a small block a thread allocated is
// parked in its cache when it frees it, and the cache's first parking on a stream makes
// that slot's lists. Review findings: without heap the free threw instead of taking the
// shared path; and a heap that failed once, between the slot's two lists, left one made
// and the other not, dereferenced (a segfault) at the slot's next use.
TEST(FreeFailures, AFreeIntoTheThreadsCacheNeedsNoHeapEither) {
  for (const bool exhausted : {true, false}) {
    // The free's own allocations, if any, are among its first few: each fails in turn.
    for (long n = 0; n < 4; ++n) {
      const std::string when = std::string(exhausted ? "heap exhausted" : "one failure") +
                               " from allocation " + std::to_string(n);
      HostBackendOptions host;
      host.capacity_bytes = std::size_t{1} << 30;
      CachingAllocator a(make_host_backend(0, host), AllocatorOptions{});
      bool went_through = false;
      std::thread([&] {
        void* p = a.allocate(4096);
        const auto free_it = [&] { a.deallocate(p, 4096); };
        went_through = exhausted ? survives_exhaustion(n, free_it) : survives(n, free_it);
        if (!went_through) a.deallocate(p, 4096);
        // The slot is claimed again, and used.
        for (int i = 0; i < 3; ++i) a.deallocate(a.allocate(4096), 4096);
      }).join();
      EXPECT_TRUE(went_through) << when << ": the free threw";
      expect_nothing_held(a, when);
    }
  }
}

}  // namespace
}  // namespace tidepool
