// The caching allocator's battery: every case runs on each backend (host always, cuda
// when a GPU exists) and with both segment kinds (expandable ranges and plain segments).
#include <gtest/gtest.h>

#include <cstring>
#include <set>
#include <tuple>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/size_classes.h"
#include "allocator/tags.h"
#include "test_support.h"

namespace tidepool {
namespace {

using Param = std::tuple<std::string, bool>;  // backend kind, expandable segments

class Battery : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    auto backend = test::make_backend(std::get<0>(GetParam()));
    if (!backend) GTEST_SKIP() << "no CUDA device on this machine";
    AllocatorOptions o;
    o.expandable_segments = std::get<1>(GetParam());
    alloc_ = std::make_unique<CachingAllocator>(std::move(backend), o);
  }
  Backend& backend() { return alloc_->backend(); }

  // Fills [p, p+n) with `value` through the backend and checks it reads back.
  void fill_and_check(void* p, std::size_t n, int value) { fill_and_check(backend(), p, n, value); }
  void check(void* p, std::size_t n, int value) { check(backend(), p, n, value); }
  static void fill_and_check(Backend& b, void* p, std::size_t n, int value) {
    b.memset_async(p, value, n, {});
    check(b, p, n, value);
  }
  static void check(Backend& b, void* p, std::size_t n, int value) {
    std::vector<unsigned char> host(n);
    b.copy_async(host.data(), p, n, CopyKind::device_to_host, {});
    b.stream_synchronize({});
    for (std::size_t i = 0; i < n; ++i)
      ASSERT_EQ(host[i], static_cast<unsigned char>(value)) << "byte " << i << " of " << p;
  }

  std::unique_ptr<CachingAllocator> alloc_;
};

TEST_P(Battery, ZeroBytesGivesNullAndNullFreeIsANoOp) {
  EXPECT_EQ(alloc_->allocate(0), nullptr);
  alloc_->deallocate(nullptr, 0);
  EXPECT_EQ(alloc_->stats().alloc_count, 0u);
}

TEST_P(Battery, AllocationsAreAlignedDisjointAndHoldTheirBytes) {
  const std::size_t sizes[] = {1, 511, 512, 513, 4096, 100000, kSmallMax, kSmallMax + 1,
                               5 << 20, 33 << 20};
  std::vector<std::pair<char*, std::size_t>> live;
  int value = 1;
  for (std::size_t n : sizes) {
    char* p = static_cast<char*>(alloc_->allocate(n));
    ASSERT_NE(p, nullptr);
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(p) % 256, 0u) << n;
    for (auto& [q, m] : live) EXPECT_TRUE(p + n <= q || q + m <= p) << "overlap " << n << "/" << m;
    fill_and_check(p, n, value++);
    live.emplace_back(p, n);
  }
  value = 1;
  for (auto& [p, n] : live) check(p, n, value++);
  for (auto& [p, n] : live) alloc_->deallocate(p, n);
  const AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.allocated.current, 0u);
  EXPECT_EQ(s.alloc_count, std::size(sizes));
  EXPECT_EQ(s.free_count, std::size(sizes));
}

TEST_P(Battery, FreedMemoryIsReusedOnTheSameStreamWithoutNewBackendMemory) {
  void* a = alloc_->allocate(3 << 20);
  alloc_->deallocate(a, 3 << 20);
  const std::uint64_t acquired = alloc_->stats().segments_acquired;
  void* b = alloc_->allocate(3 << 20);
  EXPECT_EQ(a, b);
  EXPECT_EQ(alloc_->stats().segments_acquired, acquired);
  alloc_->deallocate(b, 3 << 20);
}

TEST_P(Battery, NeighboursCoalesceIntoOneFreeBlock) {
  // Three adjacent large blocks; freed, they must serve one request of their total size
  // from the same address.
  const std::size_t n = 4 << 20;
  void* a = alloc_->allocate(n);
  void* b = alloc_->allocate(n);
  void* c = alloc_->allocate(n);
  ASSERT_EQ(static_cast<char*>(b), static_cast<char*>(a) + n);
  ASSERT_EQ(static_cast<char*>(c), static_cast<char*>(b) + n);
  alloc_->deallocate(b, n);
  alloc_->deallocate(a, n);
  alloc_->deallocate(c, n);
  const std::uint64_t acquired = alloc_->stats().segments_acquired;
  void* d = alloc_->allocate(3 * n);
  EXPECT_EQ(d, a);
  EXPECT_EQ(alloc_->stats().segments_acquired, acquired);
  alloc_->deallocate(d, 3 * n);
}

TEST_P(Battery, BestFitPicksTheSmallestHoleThatFits) {
  // Holes of 2, 6 and 3 MiB between live 1 MiB+ separators; a 2.5 MiB request must go to
  // the 3 MiB hole.
  const std::size_t mib = 1 << 20;
  const std::size_t sep = kSmallMax + 512;
  std::vector<std::pair<void*, std::size_t>> keep;
  void* holes[3];
  const std::size_t hole_sizes[3] = {2 * mib, 6 * mib, 3 * mib};
  for (int i = 0; i < 3; ++i) {
    holes[i] = alloc_->allocate(hole_sizes[i]);
    keep.emplace_back(alloc_->allocate(sep), sep);
  }
  for (int i = 0; i < 3; ++i) alloc_->deallocate(holes[i], hole_sizes[i]);
  void* p = alloc_->allocate(2 * mib + mib / 2);
  EXPECT_EQ(p, holes[2]);
  alloc_->deallocate(p, 2 * mib + mib / 2);
  for (auto& [q, n] : keep) alloc_->deallocate(q, n);
}

TEST_P(Battery, StatsFollowAllocationsAndTags) {
  const int tag = tag_id("battery_stats");
  void* a;
  {
    TagScope scope(tag);
    a = alloc_->allocate(1000);
  }
  void* b = alloc_->allocate(3 << 20);
  AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.allocated.current, round_request(1000) + (3u << 20));
  EXPECT_EQ(s.requested.current, 1000u + (3u << 20));
  EXPECT_EQ(s.tags[tag].bytes.current, round_request(1000));
  EXPECT_EQ(s.tags[tag].count, 1u);
  EXPECT_EQ(s.tags[kTagUntagged].count, 1u);
  EXPECT_GE(s.reserved.current, s.allocated.current);
  EXPECT_EQ(s.cached_bytes, s.reserved.current - s.allocated.current);
  alloc_->deallocate(a, 1000);
  s = alloc_->stats();
  EXPECT_EQ(s.tags[tag].bytes.current, 0u);
  EXPECT_EQ(s.tags[tag].bytes.peak, round_request(1000));
  EXPECT_EQ(s.tags[tag].total_count, 1u);
  alloc_->reset_peak_stats();
  EXPECT_EQ(alloc_->stats().tags[tag].bytes.peak, 0u);
  EXPECT_EQ(alloc_->stats().allocated.peak, 3u << 20);
  alloc_->deallocate(b, 3 << 20);
}

TEST_P(Battery, EmptyCacheReturnsFreeMemoryAndKeepsLiveBlocks) {
  void* keep = alloc_->allocate(100);
  fill_and_check(keep, 100, 7);
  std::vector<void*> big;
  for (int i = 0; i < 4; ++i) big.push_back(alloc_->allocate(30 << 20));
  for (void* p : big) alloc_->deallocate(p, 30 << 20);
  const std::uint64_t before = alloc_->stats().reserved.current;
  const std::size_t released = alloc_->empty_cache();
  const AllocatorStats s = alloc_->stats();
  EXPECT_GE(released, std::size_t{100} << 20);
  EXPECT_EQ(s.reserved.current, before - released);
  EXPECT_GT(s.segments_released, 0u);
  EXPECT_GE(s.reserved.current, s.allocated.current);
  check(keep, 100, 7);
  // Memory comes back on demand after empty_cache.
  void* again = alloc_->allocate(30 << 20);
  fill_and_check(again, 30 << 20, 9);
  alloc_->deallocate(again, 30 << 20);
  alloc_->deallocate(keep, 100);
}

TEST_P(Battery, ReleasesDisabledNeverGivesMemoryBack) {
  auto backend = test::make_backend(std::get<0>(GetParam()));
  AllocatorOptions o;
  o.expandable_segments = std::get<1>(GetParam());
  o.allow_release = false;
  CachingAllocator a(std::move(backend), o);
  void* p = a.allocate(8 << 20);
  a.deallocate(p, 8 << 20);
  EXPECT_EQ(a.empty_cache(), 0u);
  EXPECT_EQ(a.stats().segments_released, 0u);
  EXPECT_GT(a.stats().reserved.current, 0u);
}

TEST_P(Battery, OwnsAndAllocationSizeKnowLiveBlocksOnly) {
  void* p = alloc_->allocate(777);
  EXPECT_TRUE(alloc_->owns(p));
  EXPECT_EQ(alloc_->allocation_size(p), 777u);
  EXPECT_FALSE(alloc_->owns(static_cast<char*>(p) + 512));
  alloc_->deallocate(p, 777);
  EXPECT_FALSE(alloc_->owns(p));
}

TEST_P(Battery, FragmentationCountsHolesAndDropsToZeroWhenEmptied) {
  const std::size_t n = 12 << 20;  // a multiple of the granule, and its own plain segment
  std::vector<void*> v;
  for (int i = 0; i < 6; ++i) v.push_back(alloc_->allocate(n));
  for (int i = 0; i < 6; i += 2) alloc_->deallocate(v[i], n);  // three separated holes
  EXPECT_GT(alloc_->stats().fragmentation, 0.5);
  for (int i = 1; i < 6; i += 2) alloc_->deallocate(v[i], n);
  if (std::get<1>(GetParam())) {
    // One contiguous range: everything cached is one free block.
    EXPECT_LT(alloc_->stats().fragmentation, 1e-9);
  }
  alloc_->empty_cache();
  const AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.reserved.current, 0u);
  EXPECT_EQ(s.fragmentation, 0.0);
}

TEST_P(Battery, RecyclingMovesBackingFromAHoleToTheGrowingEnd) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "recycling applies to expandable segments";
  const std::size_t mib = 1 << 20;
  for (const double slack : {-1.0, 0.0}) {
    AllocatorOptions o;
    o.recycle_slack = slack;
    CachingAllocator a(test::make_backend(std::get<0>(GetParam())), o);
    void* hole = a.allocate(8 * mib);
    void* keep = a.allocate(8 * mib);
    a.deallocate(hole, 8 * mib);
    void* grown = a.allocate(12 * mib);  // does not fit the 8 MiB hole: the range grows
    fill_and_check(a.backend(), grown, 12 * mib, 3);
    const AllocatorStats s = a.stats();
    if (slack < 0) {
      EXPECT_EQ(s.reserved.current, 28 * mib) << "without recycling the hole stays backed";
      EXPECT_EQ(s.segments_released, 0u);
    } else {
      EXPECT_EQ(s.reserved.current, 20 * mib) << "the hole's backing should have moved";
      EXPECT_EQ(s.segments_released, 1u);
    }
    // The recycled hole is backed again when it is used.
    void* reuse = a.allocate(8 * mib);
    EXPECT_EQ(reuse, hole);
    fill_and_check(a.backend(), reuse, 8 * mib, 4);
    a.deallocate(reuse, 8 * mib);
    a.deallocate(grown, 12 * mib);
    a.deallocate(keep, 8 * mib);
  }
}

std::string param_name(const ::testing::TestParamInfo<Param>& info) {
  return std::get<0>(info.param) + (std::get<1>(info.param) ? "_expandable" : "_plain");
}

INSTANTIATE_TEST_SUITE_P(Backends, Battery,
                         ::testing::Combine(::testing::Values("host", "cuda"),
                                            ::testing::Bool()),
                         param_name);

}  // namespace
}  // namespace tidepool
