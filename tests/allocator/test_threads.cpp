// Concurrency: 8 threads x 100k mixed operations (scaled by TIDEPOOL_TEST_SCALE) on one
// allocator, including frees of blocks another thread allocated. Checks: no deadlock
// (the test finishes), every block keeps the stamp its owner wrote, and the stats add up
// once all threads are done.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <random>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/size_classes.h"
#include "allocator/tags.h"
#include "test_support.h"

namespace tidepool {
namespace {

TEST(Threads, EightThreadsOfMixedOperationsKeepBlocksAndStatsConsistent) {
  HostBackendOptions o;
  o.capacity_bytes = std::size_t{2} << 30;
  CachingAllocator alloc(make_host_backend(0, o));
  constexpr int kThreads = 8;
  SCOPED_TRACE(test_support::seed_note());
  const int ops = test::scaled(100000);
  // Blocks handed between threads: a shared exchange that any thread may free from.
  std::mutex exchange_mutex;
  std::vector<std::pair<std::uint64_t*, std::size_t>> exchange;
  std::atomic<std::uint64_t> allocs{0}, frees{0};
  std::atomic<int> corrupted{0};

  auto stamp_ok = [](std::uint64_t* p, std::size_t n) {
    return p[0] == reinterpret_cast<std::uintptr_t>(p) && p[n / 8 - 1] == ~p[0];
  };
  auto worker = [&](int id) {
    std::mt19937_64 rng(test_support::seeded(static_cast<unsigned>(id) * 7919u + 1u));
    std::vector<std::pair<std::uint64_t*, std::size_t>> mine;
    TagScope scope(id % 2 == 0 ? kTagActivation : kTagGradient);
    for (int i = 0; i < ops; ++i) {
      const int dice = static_cast<int>(rng() % 100);
      if ((dice < 50 && mine.size() < 200) || mine.empty()) {
        const std::size_t n = rng() % 8 == 0 ? (1 << 20) + rng() % (3 << 20) : 16 + rng() % 8192;
        auto* p = static_cast<std::uint64_t*>(alloc.allocate(n));
        // Host backend memory is host-addressable: stamp the first and last word.
        p[0] = reinterpret_cast<std::uintptr_t>(p);
        p[n / 8 - 1] = ~p[0];
        mine.emplace_back(p, n);
        allocs.fetch_add(1, std::memory_order_relaxed);
      } else if (dice < 90) {
        const std::size_t k = rng() % mine.size();
        auto [p, n] = mine[k];
        mine[k] = mine.back();
        mine.pop_back();
        if (!stamp_ok(p, n)) corrupted.fetch_add(1);
        alloc.deallocate(p, n);
        frees.fetch_add(1, std::memory_order_relaxed);
      } else {
        // Hand one block to the exchange, or free one another thread handed over.
        std::lock_guard lock(exchange_mutex);
        if (!exchange.empty() && (rng() % 2 == 0 || exchange.size() > 256)) {
          auto [p, n] = exchange.back();
          exchange.pop_back();
          if (!stamp_ok(p, n)) corrupted.fetch_add(1);
          alloc.deallocate(p, n);
          frees.fetch_add(1, std::memory_order_relaxed);
        } else {
          exchange.push_back(mine.back());
          mine.pop_back();
        }
      }
      if (i % 20000 == 19999) alloc.stats();  // readers interleave with writers
    }
    for (auto [p, n] : mine) {
      if (!stamp_ok(p, n)) corrupted.fetch_add(1);
      alloc.deallocate(p, n);
      frees.fetch_add(1, std::memory_order_relaxed);
    }
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  for (auto [p, n] : exchange) {
    if (!stamp_ok(p, n)) corrupted.fetch_add(1);
    alloc.deallocate(p, n);
    frees.fetch_add(1);
  }
  EXPECT_EQ(corrupted.load(), 0);
  const AllocatorStats s = alloc.stats();
  EXPECT_EQ(s.allocations.allocated, allocs.load());
  EXPECT_EQ(s.allocations.freed, frees.load());
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.tags[kTagActivation].count + s.tags[kTagGradient].count, 0u);
  EXPECT_EQ(s.tags[kTagActivation].total_count + s.tags[kTagGradient].total_count, allocs.load());
  EXPECT_EQ(s.cache_hits + s.cache_misses, allocs.load());
  alloc.empty_cache();
  EXPECT_EQ(alloc.stats().reserved.current, 0u);
}

}  // namespace
}  // namespace tidepool
