// Per-thread caches (Note [Thread caches], allocator/thread_cache.cpp): a small block a
// thread frees on its own stream parks in that thread's cache and comes back to the same
// thread on the same stream; stats stay exact; parked blocks go back to the shared pools
// on empty_cache, under memory pressure (another thread's cache included) and at thread
// exit; the bad-free checks still hold on the fast path; a cache that keeps missing is
// bypassed for a while. Host backend: its streams run
// asynchronously, so "work still pending" is real.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/size_classes.h"
#include "allocator/tags.h"
#include "allocator/thread_cache.h"
#include "test_support.h"
#include "tests/support/signal.h"

namespace tidepool {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

using test::StreamHold;

// A one-shot signal between two threads.
using test_support::Signal;

using test::count_of;

std::unique_ptr<CachingAllocator> make_allocator(std::size_t thread_cache_bytes,
                                                 std::size_t capacity = std::size_t{1} << 30) {
  HostBackendOptions b;
  b.capacity_bytes = capacity;
  AllocatorOptions o;
  o.thread_cache_bytes = thread_cache_bytes;
  return std::make_unique<CachingAllocator>(make_host_backend(0, b), o);
}

TEST(ThreadCache, APairOnOneStreamReusesTheParkedBlockWithExactStats) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  void* p = a->allocate(4000);
  a->deallocate(p, 4000);
  AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.requested.current, 0u);
  EXPECT_EQ(s.cached_bytes, s.reserved.current) << "a parked block counts as cached";
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 1u);
  EXPECT_FALSE(a->owns(p));
  EXPECT_EQ(a->allocation_size(p), 0u);

  {
    TagScope scope(kTagActivation);
    EXPECT_EQ(a->allocate(4096), p) << "same size class, same stream, same thread";
  }
  EXPECT_EQ(a->allocation_size(p), 4096u);
  s = a->stats();
  EXPECT_EQ(s.allocated.current, 4096u);
  EXPECT_EQ(s.requested.current, 4096u);
  EXPECT_EQ(s.requested.peak, 4096u);
  EXPECT_EQ(s.allocations.allocated, 2u);
  EXPECT_EQ(s.allocations.freed, 1u);
  EXPECT_EQ(s.cache_hits + s.cache_misses, 2u);
  EXPECT_EQ(s.tags[kTagActivation].bytes.current, 4096u);
  EXPECT_EQ(s.tags[kTagActivation].count, 1u);
  EXPECT_EQ(s.tags[kTagActivation].total_count, 1u);
  EXPECT_EQ(s.tags[kTagUntagged].count, 0u);
  EXPECT_EQ(s.tags[kTagUntagged].total_count, 1u);
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 0u);
  a->deallocate(p, 4096);
  EXPECT_EQ(a->stats().allocated.current, 0u);
}

TEST(ThreadCache, PeakCountsOnlyBytesLiveAtTheSameTime) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  // Warm the shared pool (another thread's free takes the shared path), so that nothing
  // below grows the allocator: growth would first drain the parked block.
  void* warm = a->allocate(64 * 1024);
  std::thread([&] { a->deallocate(warm, 64 * 1024); }).join();
  a->reset_peak_stats();
  void* x = a->allocate(4096);
  a->deallocate(x, 4096);                // parked: 0 live
  void* y = a->allocate(8192);           // shared path: 8 KiB live
  EXPECT_EQ(a->stats().allocated.peak, 8192u) << "the parked block is not live";
  void* x2 = a->allocate(4096);          // from the cache: 12 KiB live
  EXPECT_EQ(x2, x);
  EXPECT_EQ(a->stats().allocated.peak, 12288u);
  a->deallocate(x2, 4096);
  a->deallocate(y, 8192);
  a->reset_peak_stats();
  EXPECT_EQ(a->stats().allocated.peak, 0u);
  void* z = a->allocate(4096);  // from the cache again
  EXPECT_EQ(a->stats().allocated.peak, 4096u);
  a->deallocate(z, 4096);
}

// A shared-path free of a block the cache does not hold: the bytes this thread took from
// its cache meanwhile must count towards the peak before the free lowers the shared value.
TEST(ThreadCache, APeakReachedThroughTheCacheCountsBeforeASharedFree) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  const int tag = tag_id("peak_through_cache");
  TagScope scope(tag);
  void* warm = a->allocate(100 * kMiB);  // cached below, so nothing grows (or drains) later
  a->deallocate(warm, 100 * kMiB);
  a->reset_peak_stats();
  void* small = a->allocate(4096);
  a->deallocate(small, 4096);            // parked
  void* large = a->allocate(100 * kMiB);  // shared path, not held
  void* again = a->allocate(4096);       // from the cache: 100 MiB + 4 KiB live
  ASSERT_EQ(again, small);
  a->deallocate(large, 100 * kMiB);      // shared path
  const AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocated.peak, 100 * kMiB + 4096);
  EXPECT_EQ(s.requested.peak, 100 * kMiB + 4096);
  EXPECT_EQ(s.allocations.peak, 2u);
  EXPECT_EQ(s.tags[tag].bytes.peak, 100 * kMiB + 4096);
  EXPECT_EQ(s.allocated.current, 4096u);
  a->deallocate(again, 4096);
}

TEST(ThreadCache, TheAllocationCountsPeakAcrossTheFastPath) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  void* x = a->allocate(4096);
  a->deallocate(x, 4096);  // parked
  a->reset_peak_stats();
  EXPECT_EQ(a->stats().allocations.peak, 0u);
  void* y = a->allocate(4096);  // from the cache: the count moves in the thread's deltas
  ASSERT_EQ(y, x);
  void* z = a->allocate(4096);  // shared path
  AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocations.current, 2u);
  EXPECT_EQ(s.allocations.peak, 2u);
  a->deallocate(z, 4096);
  a->deallocate(y, 4096);
  s = a->stats();
  EXPECT_EQ(s.allocations.current, 0u);
  EXPECT_EQ(s.allocations.peak, 2u);
  EXPECT_EQ(s.allocations.allocated, 3u);
  EXPECT_EQ(s.allocations.freed, 3u);
}

TEST(ThreadCache, OffMeansNoBlockIsEverParked) {
  auto a = make_allocator(0);
  void* p = a->allocate(4096);
  a->deallocate(p, 4096);
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 0u);
  EXPECT_EQ(a->flush_thread_caches(), 0u);
  EXPECT_EQ(a->allocate(4096), p) << "the shared quick list still reuses it";
  a->deallocate(p, 4096);
}

// Note [Thread caches], the miss path: a thread whose cache keeps missing (every request
// a new size class) stops holding and parking blocks, taking the shared path as with
// caches off, keeps exact stats, and after the bypass window parks again.
TEST(ThreadCache, AThreadThatKeepsMissingBypassesItsCacheThenProbesAgain) {
  using detail::ThreadCache;
  auto a = make_allocator(256 * kMiB);  // the budget never limits here
  std::size_t next_class = 1;
  std::uint64_t pairs = 0;
  // Allocates and frees one block of a class not requested for a while (no hit: what is
  // parked is of other classes); true when its free parked it.
  const auto miss_and_parked = [&] {
    const std::size_t bytes = next_class * kMinBlockSize;
    next_class = next_class % 1000 + 1;
    void* p = a->allocate(bytes);
    a->deallocate(p, bytes);
    ++pairs;
    return count_of(a->snapshot_json(),
                    "\"size\":" + std::to_string(bytes) + ",\"state\":\"thread_cached\"") == 1;
  };
  EXPECT_TRUE(miss_and_parked()) << "a fresh cache holds and parks";
  for (std::uint32_t i = 1; i < ThreadCache::kProbeWindow - 1; ++i) miss_and_parked();
  EXPECT_FALSE(miss_and_parked()) << "a window of misses without a hit: bypass";
  a->flush_thread_caches();  // nothing parked is left to hit
  for (std::uint32_t i = 1; i < ThreadCache::kBypassWindow; ++i)
    ASSERT_FALSE(miss_and_parked()) << "bypassing, miss " << i;
  EXPECT_TRUE(miss_and_parked()) << "after the bypass window the cache probes again";
  EXPECT_TRUE(miss_and_parked());

  a->flush_thread_caches();
  const AllocatorStats st = a->stats();
  EXPECT_EQ(st.allocated.current, 0u);
  EXPECT_EQ(st.requested.current, 0u);
  EXPECT_EQ(st.allocations.allocated, pairs);
  EXPECT_EQ(st.allocations.freed, pairs);
  EXPECT_EQ(st.tags[kTagUntagged].count, 0u);
  EXPECT_EQ(st.tags[kTagUntagged].total_count, pairs);
}

TEST(ThreadCache, ParkedBytesStayWithinTheBudget) {
  const std::size_t budget = 3 * kMiB;
  auto a = make_allocator(budget);
  std::vector<void*> v;
  for (int i = 0; i < 6; ++i) v.push_back(a->allocate(kMiB));
  for (void* p : v) a->deallocate(p, kMiB);
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 3u);
  EXPECT_EQ(a->flush_thread_caches(), 3u);
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 0u);
  EXPECT_EQ(a->stats().allocated.current, 0u);
}

TEST(ThreadCache, ABlockFreedOnOneStreamIsNotHandedToAnotherWhileItsWorkIsPending) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  Backend& be = a->backend();
  const Stream s1 = be.create_stream(), s2 = be.create_stream();
  {
    StreamHold hold(be, s1);  // s1's queued work still uses p
    void* p = a->allocate(4096, s1);
    a->deallocate(p, 4096, s1);
    void* q = a->allocate(4096, s2);
    EXPECT_NE(q, p);
    EXPECT_EQ(a->allocate(4096, s1), p) << "s1 itself may reuse it at once";
    a->deallocate(p, 4096, s1);
    a->deallocate(q, 4096, s2);
    hold.release();
    be.stream_synchronize(s1);  // the hold's host function is done with it
  }
  be.stream_synchronize(s2);
  a->flush_thread_caches();
  be.destroy_stream(s1);
  be.destroy_stream(s2);
}

TEST(ThreadCache, RecordedStreamsKeepABlockOutOfTheCache) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  Backend& be = a->backend();
  const Stream s1 = be.create_stream(), s2 = be.create_stream();
  {
    StreamHold hold(be, s2);
    void* p = a->allocate(4096, s1);
    a->record_stream(p, s2);
    a->deallocate(p, 4096, s1);
    const std::string snap = a->snapshot_json();
    EXPECT_EQ(count_of(snap, "\"thread_cached\""), 0u);
    EXPECT_EQ(count_of(snap, "\"pending\""), 1u);
    void* q = a->allocate(4096, s1);
    EXPECT_NE(q, p) << "s2 may still be using p";
    a->deallocate(q, 4096, s1);
    // A free on a foreign stream counts as a recorded stream too.
    void* r = a->allocate(4096, s1);
    a->deallocate(r, 4096, s2);
    EXPECT_EQ(count_of(a->snapshot_json(), "\"pending\""), 2u);
    hold.release();
    be.stream_synchronize(s2);  // the hold's host function is done with it
  }
  be.stream_synchronize(s1);
  a->empty_cache();
  EXPECT_EQ(a->stats().reserved.current, 0u);
  be.destroy_stream(s1);
  be.destroy_stream(s2);
}

TEST(ThreadCache, DoubleFreeAndWrongSizeAreRejectedOnTheFastPath) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  void* p = a->allocate(4096);
  EXPECT_THROW(a->deallocate(p, 4095), AllocatorUsageError);
  EXPECT_EQ(a->allocation_size(p), 4096u) << "a rejected free changes nothing";
  a->deallocate(p, 4096);
  try {
    a->deallocate(p, 4096);
    ADD_FAILURE() << "double free accepted";
  } catch (const AllocatorUsageError& e) {
    EXPECT_NE(std::string(e.what()).find("double free"), std::string::npos) << e.what();
  }
  // Another thread's double free of the parked block: the shared path sees it too.
  std::thread other([&] { EXPECT_THROW(a->deallocate(p, 4096), AllocatorUsageError); });
  other.join();
  EXPECT_THROW(a->record_stream(p, Stream{}), AllocatorUsageError);
  const AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocations.allocated, 1u);
  EXPECT_EQ(s.allocations.freed, 1u);
  EXPECT_EQ(a->allocate(4096), p) << "the parked block is intact";
  a->deallocate(p, 4096);
}

TEST(ThreadCache, AnotherThreadsFreeOfAHeldBlockTakesTheSharedPath) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  void* p = a->allocate(4096);
  std::thread other([&] { a->deallocate(p, 4096); });
  other.join();
  EXPECT_EQ(a->stats().allocated.current, 0u);
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 0u);
  EXPECT_THROW(a->deallocate(p, 4096), AllocatorUsageError) << "it was freed already";
  void* q = a->allocate(4096);
  a->deallocate(q, 4096);
  const AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocations.allocated, 2u);
  EXPECT_EQ(s.allocations.freed, 2u);
}

TEST(ThreadCache, SizeQueriesFromAnotherThreadReadABlockItsCacheKeepsHandingOut) {
  // The owning thread parks the block and takes it back through its cache, rewriting the
  // size it was asked for each time; allocation_size must read that under the cache's
  // lock (TSan reports the race otherwise) and see 0 (parked) or a size asked for.
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  void* p = a->allocate(4096);
  a->deallocate(p, 4096);
  std::atomic<bool> stop{false};
  std::atomic<int> answers_seen{0};
  std::thread reader([&] {
    while (!stop.load()) {
      const std::size_t asked = a->allocation_size(p);
      EXPECT_TRUE(asked == 0 || asked == 4096 || asked == 4000) << asked;
      const std::size_t held = a->block_size(p);
      EXPECT_TRUE(held == 0 || held >= 4096) << held;
      answers_seen.fetch_add(1);
    }
  });
  for (int i = 0; i < 20000 || answers_seen.load() < 100; ++i) {
    const std::size_t bytes = i % 2 == 0 ? 4096 : 4000;
    void* q = a->allocate(bytes);
    EXPECT_EQ(q, p) << "the cache hands the parked block back";
    a->deallocate(q, bytes);
  }
  stop.store(true);
  reader.join();
}

TEST(ThreadCache, ThreadExitReturnsParkedBlocksAndLetsGoOfLiveOnes) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  void* live = nullptr;
  std::thread worker([&] {
    TagScope scope(kTagWorkspace);
    void* x = a->allocate(4096);
    void* y = a->allocate(64 * 1024);
    live = a->allocate(8192);
    a->deallocate(x, 4096);
    a->deallocate(y, 64 * 1024);
  });
  worker.join();
  AllocatorStats s = a->stats();
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 0u)
      << "the dead thread's cache went back to the pools";
  EXPECT_EQ(s.allocated.current, 8192u);
  EXPECT_EQ(s.tags[kTagWorkspace].bytes.current, 8192u);
  EXPECT_EQ(s.tags[kTagWorkspace].count, 1u);
  EXPECT_EQ(s.tags[kTagWorkspace].total_count, 3u);
  EXPECT_EQ(s.allocations.allocated, 3u);
  EXPECT_EQ(s.allocations.freed, 2u);
  EXPECT_EQ(a->allocation_size(live), 8192u);
  a->deallocate(live, 8192);  // the block the dead thread left live
  EXPECT_THROW(a->deallocate(live, 8192), AllocatorUsageError);
  a->empty_cache();
  s = a->stats();
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.reserved.current, 0u) << "every block is back in the pools and released";
}

TEST(ThreadCache, EmptyCacheDrainsTheCachesOfLiveThreads) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  Signal parked, emptied;
  std::thread worker([&] {
    void* x = a->allocate(4096);
    a->deallocate(x, 4096);
    parked.set();
    emptied.wait();
    void* y = a->allocate(4096);  // its cache is empty now: the shared path serves it
    a->deallocate(y, 4096);
  });
  parked.wait();
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 1u);
  EXPECT_GT(a->empty_cache(), 0u);
  EXPECT_EQ(a->stats().reserved.current, 0u);
  emptied.set();
  worker.join();
  const AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocations.allocated, 2u);
  EXPECT_EQ(s.allocations.freed, 2u);
  EXPECT_EQ(s.allocated.current, 0u);
}

TEST(ThreadCache, MemoryPressureReclaimsBlocksParkedInAnotherThreadsCache) {
  // 8 MiB of device: another thread parks three 1 MiB blocks (two granules of small
  // range, 4 MiB); a 6 MiB request then fits only once those are back and released.
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes, 8 * kMiB);
  Signal parked, done;
  std::thread worker([&] {
    std::vector<void*> v;
    for (int i = 0; i < 3; ++i) v.push_back(a->allocate(kMiB));
    for (void* p : v) a->deallocate(p, kMiB);
    parked.set();
    done.wait();
    void* again = a->allocate(kMiB);
    a->deallocate(again, kMiB);
  });
  parked.wait();
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 3u);
  EXPECT_EQ(a->stats().reserved.current, 4 * kMiB);
  void* big = nullptr;
  EXPECT_NO_THROW(big = a->allocate(6 * kMiB));
  EXPECT_EQ(count_of(a->snapshot_json(), "\"thread_cached\""), 0u);
  a->deallocate(big, 6 * kMiB);
  done.set();
  worker.join();
  const AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.allocations.allocated, 5u);
  EXPECT_EQ(s.allocations.freed, 5u);
  EXPECT_EQ(s.oom_count, 0u);
}

TEST(ThreadCache, ThreadsPairingOnTwoStreamsKeepBlocksAndStatsExact) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  Backend& be = a->backend();
  const Stream streams[2] = {be.create_stream(), be.create_stream()};
  constexpr int kThreads = 4;
  SCOPED_TRACE(test_support::seed_note());
  const int ops = test::scaled(20000);
  std::atomic<std::uint64_t> allocs{0};
  std::atomic<int> corrupted{0};
  // Each allocation carries a stamp no other has, checked when it is freed: a block handed
  // to two holders at once (the bug a thread cache could make) shows as a stamp written
  // over. Every thread keeps up to 16 blocks live, so holders overlap for many operations.
  std::atomic<std::uint64_t> next_stamp{1};
  struct Live {
    std::uint64_t* p;
    std::size_t n;
    std::uint64_t stamp;
  };
  std::mutex handoff_mutex;
  std::vector<Live> handoff;  // freed by another thread
  auto worker = [&](int id) {
    std::mt19937 rng(static_cast<std::mt19937::result_type>(
        test_support::seeded(static_cast<unsigned>(id) + 17u)));
    TagScope scope(id % 2 == 0 ? kTagParameter : kTagGradient);
    const Stream s = streams[id % 2];
    std::vector<Live> live;
    const auto free_one = [&](std::size_t k) {
      const Live l = live[k];
      live.erase(live.begin() + static_cast<std::ptrdiff_t>(k));
      if (l.p[0] != l.stamp) corrupted.fetch_add(1);
      a->deallocate(l.p, l.n, s);
    };
    for (int i = 0; i < ops; ++i) {
      std::size_t n = 8 * (1 + rng() % 1024);
      auto* p = static_cast<std::uint64_t*>(a->allocate(n, s));
      const std::uint64_t stamp = next_stamp.fetch_add(1);
      p[0] = stamp;
      allocs.fetch_add(1, std::memory_order_relaxed);
      live.push_back({p, n, stamp});
      if (i % 64 == 0) a->record_stream(p, streams[(id + 1) % 2]);
      if (i % 97 == 0) {
        std::lock_guard l(handoff_mutex);
        handoff.push_back(live.back());
        live.pop_back();
        if (handoff.size() >= 8) {
          live.push_back(handoff.front());
          handoff.erase(handoff.begin());
        }
      }
      if (live.size() > 16) free_one(rng() % live.size());
      if (i % 5000 == 0) a->stats();
    }
    while (!live.empty()) free_one(live.size() - 1);
  };
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) threads.emplace_back(worker, t);
  for (auto& t : threads) t.join();
  for (const Live& l : handoff) {
    if (l.p[0] != l.stamp) corrupted.fetch_add(1);
    a->deallocate(l.p, l.n, streams[0]);
  }
  EXPECT_EQ(corrupted.load(), 0);
  be.stream_synchronize(streams[0]);
  be.stream_synchronize(streams[1]);
  const AllocatorStats s = a->stats();
  EXPECT_EQ(s.allocations.allocated, allocs.load());
  EXPECT_EQ(s.allocations.freed, allocs.load());
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.requested.current, 0u);
  EXPECT_EQ(s.tags[kTagParameter].count + s.tags[kTagGradient].count, 0u);
  EXPECT_EQ(s.tags[kTagParameter].total_count + s.tags[kTagGradient].total_count, allocs.load());
  a->empty_cache();
  EXPECT_EQ(a->stats().reserved.current, 0u);
  be.destroy_stream(streams[0]);
  be.destroy_stream(streams[1]);
}

TEST(ThreadCache, DestroyingTheAllocatorBeforeTheThreadExitsIsSafe) {
  auto a = make_allocator(AllocatorOptions{}.thread_cache_bytes);
  Signal parked, destroyed;
  std::thread worker([&] {
    void* x = a->allocate(4096);
    a->deallocate(x, 4096);
    parked.set();
    destroyed.wait();
    // A new allocator, possibly at the same address, gets a cache of its own.
    auto b = make_allocator(AllocatorOptions{}.thread_cache_bytes);
    void* y = b->allocate(4096);
    b->deallocate(y, 4096);
    EXPECT_EQ(b->stats().allocations.freed, 1u);
  });
  parked.wait();
  a.reset();
  destroyed.set();
  worker.join();
}

}  // namespace
}  // namespace tidepool
