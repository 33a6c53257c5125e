// The caching allocator's battery: every case runs on each backend (host always, cuda
// when a GPU exists) and with both segment kinds (expandable ranges and plain segments).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <thread>
#include <tuple>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/forwarding_backend.h"
#include "allocator/size_classes.h"
#include "allocator/tags.h"
#include "test_support.h"
#include "tests/support/stream_gate.h"

namespace tidepool {
namespace {

using Param = test::BackendAndSegments;

class Battery : public ::testing::TestWithParam<Param> {
 public:
  // Fills [p, p+n) with `value` through the backend and checks it reads back.
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

 protected:
  void SetUp() override {
    alloc_ = test::make_allocator(GetParam());
    if (!alloc_) GTEST_SKIP() << "no CUDA device on this machine";
  }
  Backend& backend() { return alloc_->backend(); }

  void fill_and_check(void* p, std::size_t n, int value) { fill_and_check(backend(), p, n, value); }
  void check(void* p, std::size_t n, int value) { check(backend(), p, n, value); }

  std::unique_ptr<CachingAllocator> alloc_;
};

TEST_P(Battery, ZeroBytesGivesNullAndNullFreeIsANoOp) {
  EXPECT_EQ(alloc_->allocate(0), nullptr);
  alloc_->deallocate(nullptr, 0);
  EXPECT_EQ(alloc_->stats().allocations.allocated, 0u);
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
  EXPECT_EQ(s.allocations.allocated, std::size(sizes));
  EXPECT_EQ(s.allocations.freed, std::size(sizes));
}

TEST_P(Battery, FreedMemoryIsReusedOnTheSameStreamWithoutNewBackendMemory) {
  void* a = alloc_->allocate(3 << 20);
  alloc_->deallocate(a, 3 << 20);
  const std::uint64_t acquired = alloc_->stats().segments.allocated;
  void* b = alloc_->allocate(3 << 20);
  EXPECT_EQ(a, b);
  EXPECT_EQ(alloc_->stats().segments.allocated, acquired);
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
  const std::uint64_t acquired = alloc_->stats().segments.allocated;
  void* d = alloc_->allocate(3 * n);
  EXPECT_EQ(d, a);
  EXPECT_EQ(alloc_->stats().segments.allocated, acquired);
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

// The counts are Stats too: live allocations and live backend allocations, with peaks
// that reset_peak_stats brings down to the current value (what PyTorch's
// allocation/segment figures need).
TEST_P(Battery, CountsOfAllocationsAndSegmentsHavePeaks) {
  const AllocatorStats before = alloc_->stats();
  std::vector<void*> live;
  for (int i = 0; i < 3; ++i) live.push_back(alloc_->allocate(5 << 20));
  AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.allocations.current, before.allocations.current + 3);
  EXPECT_EQ(s.allocations.peak, std::max(before.allocations.peak, s.allocations.current));
  EXPECT_EQ(s.allocations.allocated, before.allocations.allocated + 3);
  EXPECT_GT(s.segments.current, 0u);
  EXPECT_EQ(s.segments.current, s.segments.allocated - s.segments.freed);
  EXPECT_GE(s.segments.peak, s.segments.current);
  for (void* p : live) alloc_->deallocate(p, 5 << 20);
  alloc_->empty_cache();
  s = alloc_->stats();
  EXPECT_EQ(s.allocations.current, before.allocations.current);
  EXPECT_EQ(s.allocations.freed, before.allocations.freed + 3);
  EXPECT_GE(s.allocations.peak, before.allocations.current + 3) << "the peak outlives the frees";
  EXPECT_EQ(s.segments.current, s.segments.allocated - s.segments.freed);
  const std::uint64_t segment_peak = s.segments.peak;
  EXPECT_GT(segment_peak, s.segments.current) << "empty_cache gave segments back";
  alloc_->reset_peak_stats();
  s = alloc_->stats();
  EXPECT_EQ(s.allocations.peak, s.allocations.current);
  EXPECT_EQ(s.segments.peak, s.segments.current);
}

// backed_ranges (what PyTorch's memory snapshot shows as segments): every backed byte
// once, in address order, each range tiled by its pieces; live blocks as they were handed
// out, the rest free or pending.
TEST_P(Battery, BackedRangesTileTheReservedMemoryAndShowTheLiveBlocks) {
  const int tag = tag_id("backed_ranges_test");
  std::vector<std::pair<void*, std::size_t>> live;
  {
    TagScope scope(tag);
    constexpr std::size_t mib = std::size_t{1} << 20;
    // Large blocks in one stream's range of 32 MiB slots: [0,3) [3,35) [35,99) [99,107)
    // [107,115) MiB.
    for (std::size_t bytes : {std::size_t{1000}, 3 * mib, std::size_t{700} << 10, 32 * mib,
                              64 * mib, 8 * mib, 8 * mib, std::size_t{64}})
      live.emplace_back(alloc_->allocate(bytes), bytes);
  }
  // Holes: freed blocks, one of them still used by another stream (pending). The free
  // block [35,107) MiB covers the slot [64,96) MiB entirely.
  const Stream other = backend().create_stream();
  alloc_->record_stream(live[1].first, other);
  test_support::StreamGate gate;
  const test_support::StreamGate::OpenOnExit open_on_exit{gate};
  backend().launch_host_func(other, &test_support::StreamGate::wait, &gate);
  for (int freed : {1, 4, 5}) alloc_->deallocate(live[freed].first, live[freed].second);
  const std::vector<std::pair<void*, std::size_t>> kept = {live[0], live[2], live[3], live[6],
                                                           live[7]};

  const auto check_ranges = [&](const char* when) {
    SCOPED_TRACE(when);
    const std::vector<MemoryRange> ranges = alloc_->backed_ranges();
    const AllocatorStats s = alloc_->stats();
    std::size_t reserved = 0, allocated = 0;
    std::uintptr_t previous_end = 0;
    std::set<std::uintptr_t> seen;
    bool pending_seen = false;
    for (const MemoryRange& r : ranges) {
      EXPECT_GE(r.address, previous_end) << "ranges are in address order and disjoint";
      previous_end = r.address + r.size;
      reserved += r.size;
      std::uintptr_t at = r.address;
      for (const MemoryRange::Piece& p : r.pieces) {
        ASSERT_EQ(p.address, at) << "pieces tile the range";
        ASSERT_GT(p.size, 0u);
        at += p.size;
        if (p.state == MemoryRange::State::allocated) {
          allocated += p.size;
          seen.insert(p.address);
          EXPECT_EQ(p.tag, tag);
        }
        pending_seen = pending_seen ||
                       (p.state == MemoryRange::State::pending_free &&
                        p.address == reinterpret_cast<std::uintptr_t>(live[1].first));
      }
      EXPECT_EQ(at, r.address + r.size);
    }
    EXPECT_EQ(reserved, s.reserved.current);
    EXPECT_EQ(allocated, s.allocated.current);
    for (const auto& [p, bytes] : kept) {
      EXPECT_EQ(seen.count(reinterpret_cast<std::uintptr_t>(p)), 1u) << p;
      bool found = false;
      for (const MemoryRange& r : ranges)
        for (const MemoryRange::Piece& piece : r.pieces)
          if (piece.address == reinterpret_cast<std::uintptr_t>(p)) {
            found = true;
            EXPECT_EQ(piece.requested, bytes);
          }
      EXPECT_TRUE(found);
    }
    EXPECT_EQ(seen.size(), kept.size()) << "freed blocks are not shown as allocated";
    EXPECT_TRUE(pending_seen) << "the block the other stream still uses is pending";
  };
  check_ranges("with holes");
  const auto large_ranges = [&] {
    const std::vector<MemoryRange> ranges = alloc_->backed_ranges();
    return std::count_if(ranges.begin(), ranges.end(),
                         [](const MemoryRange& r) { return !r.small; });
  };
  const auto large_before = large_ranges();
  // An expandable range gives the free slot's backing back: its backed memory is then two
  // parts, and the free block spans backed and unbacked memory.
  alloc_->empty_cache();
  check_ranges("after empty_cache");
  if (alloc_->options().expandable_segments) {
    EXPECT_EQ(large_ranges(), large_before + 1);
  }
  gate.open();
  backend().stream_synchronize(other);
  for (const auto& [p, bytes] : kept) alloc_->deallocate(p, bytes);
  alloc_->release_stream(other);
  backend().destroy_stream(other);
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
  EXPECT_GT(s.segments.freed, 0u);
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
  EXPECT_EQ(a.stats().segments.freed, 0u);
  EXPECT_GT(a.stats().reserved.current, 0u);
}

TEST_P(Battery, OwnsAndAllocationSizeKnowLiveBlocksOnly) {
  void* p = alloc_->allocate(777);
  EXPECT_TRUE(alloc_->owns(p));
  EXPECT_EQ(alloc_->allocation_size(p), 777u);
  EXPECT_EQ(alloc_->block_size(p), round_request(777));
  EXPECT_EQ(alloc_->block_size(p), alloc_->stats().allocated.current);
  EXPECT_FALSE(alloc_->owns(static_cast<char*>(p) + 512));
  EXPECT_EQ(alloc_->block_size(static_cast<char*>(p) + 512), 0u);
  alloc_->deallocate(p, 777);
  EXPECT_FALSE(alloc_->owns(p));
  EXPECT_EQ(alloc_->block_size(p), 0u);
}

TEST_P(Battery, FragmentationCountsHolesAndDropsToZeroWhenEmptied) {
  // A multiple of the granule, its own plain segment, and six of them fill whole mapping
  // slots (32 MiB), so no backed memory lies past the last block of a range (that case
  // has its own test below).
  const std::size_t n = 16 << 20;
  std::vector<void*> v;
  for (int i = 0; i < 6; ++i) v.push_back(alloc_->allocate(n));
  EXPECT_EQ(alloc_->largest_free_block(), 0u) << "all six blocks live";
  for (int i = 0; i < 6; i += 2) alloc_->deallocate(v[i], n);  // three separated holes
  EXPECT_GT(alloc_->stats().fragmentation, 0.5);
  EXPECT_EQ(alloc_->largest_free_block(), n) << "one hole";
  for (int i = 1; i < 6; i += 2) alloc_->deallocate(v[i], n);
  if (std::get<1>(GetParam())) {
    // One contiguous range: everything cached is one free block.
    EXPECT_LT(alloc_->stats().fragmentation, 1e-9);
    EXPECT_EQ(alloc_->largest_free_block(), 6 * n);
  }
  alloc_->empty_cache();
  const AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.reserved.current, 0u);
  EXPECT_EQ(s.fragmentation, 0.0);
  EXPECT_EQ(alloc_->largest_free_block(), 0u);
}

TEST_P(Battery, FragmentationCountsTheBackedTailOfTheLastSlotAsFree) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "mapping slots belong to expandable segments";
  // One 4 MiB block backs a whole 32 MiB slot (the default map_slot_bytes); blocks tile
  // the range only up to the end of the last block, so the other 28 MiB lie past it.
  const std::size_t mib = 1 << 20;
  void* a = alloc_->allocate(4 * mib);
  AllocatorStats s = alloc_->stats();
  ASSERT_EQ(s.reserved.current, 32 * mib);
  ASSERT_EQ(s.cached_bytes, 28 * mib);
  EXPECT_LT(s.fragmentation, 1e-9) << "the backed tail is one free range";
  // A free last block and the tail after it are one contiguous free range too.
  void* b = alloc_->allocate(4 * mib);
  alloc_->deallocate(b, 4 * mib);
  s = alloc_->stats();
  ASSERT_EQ(s.cached_bytes, 28 * mib);
  EXPECT_LT(s.fragmentation, 1e-9);
  EXPECT_NE(alloc_->snapshot_json().find("\"state\":\"free\""), std::string::npos);
  alloc_->deallocate(a, 4 * mib);
}

TEST_P(Battery, RecyclingMovesBackingFromAHoleToTheGrowingEnd) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "recycling applies to expandable segments";
  const std::size_t mib = 1 << 20;
  for (const double slack : {-1.0, 0.0}) {
    AllocatorOptions o;
    o.recycle_slack = slack;
    o.move_free_runs = false;  // the release path alone (moves are tested below)
    o.map_slot_bytes = 2 << 20;
    CachingAllocator a(test::make_backend(std::get<0>(GetParam())), o);
    void* hole = a.allocate(8 * mib);
    void* keep = a.allocate(8 * mib);
    a.deallocate(hole, 8 * mib);
    void* grown = a.allocate(12 * mib);  // does not fit the 8 MiB hole: the range grows
    fill_and_check(a.backend(), grown, 12 * mib, 3);
    const AllocatorStats s = a.stats();
    if (slack < 0) {
      EXPECT_EQ(s.reserved.current, 28 * mib) << "without recycling the hole stays backed";
      EXPECT_EQ(s.segments.freed, 0u);
    } else {
      EXPECT_EQ(s.reserved.current, 20 * mib) << "the hole's backing should have moved";
      EXPECT_EQ(s.segments.freed, 8 * mib / o.map_slot_bytes);
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

// Review finding: a recycling scan that found only runs another stream had not finished
// with yet marked itself futile until the next free, so once that stream was done the
// next request made new memory beside the run it could have released.
TEST_P(Battery, RecyclingResumesOnceAnotherStreamIsDoneWithItsFrees) {
  if (!std::get<1>(GetParam())) GTEST_SKIP() << "recycling applies to expandable segments";
  const std::size_t mib = 1 << 20;
  AllocatorOptions o;
  o.recycle_slack = 0.0;
  o.move_free_runs = false;  // the release path alone
  o.map_slot_bytes = 2 << 20;
  CachingAllocator a(test::make_backend(std::get<0>(GetParam())), o);
  const Stream sa = a.backend().create_stream();
  const Stream sb = a.backend().create_stream();
  void* p = a.allocate(64 * mib, sb);
  void* x = nullptr;
  {
    test::StreamHold hold(a.backend(), sb);
    a.deallocate(p, 64 * mib, sb);  // its stream is busy: not settled
    x = a.allocate(64 * mib, sa);   // nothing releasable yet: new memory
    hold.release();
  }
  a.backend().stream_synchronize(sb);
  const std::size_t before = a.stats().reserved.current;
  ASSERT_EQ(before, 128 * mib);
  // Too large for sb's free block (no steal): backing it releases that run first.
  void* y = a.allocate(96 * mib, sa);
  EXPECT_EQ(a.stats().reserved.current, before - 64 * mib + 96 * mib);
  a.deallocate(y, 96 * mib, sa);
  a.deallocate(x, 64 * mib, sa);
  for (const Stream s : {sa, sb}) {
    a.release_stream(s);
    a.backend().destroy_stream(s);
  }
}

// ------------------------------------------------------------------- moving free runs
// Note [Moving free runs] (segments.cpp): a mapping slot lying wholly in free blocks is
// unmapped and mapped where a block needs backing, instead of creating physical memory.
// These run with slots of two granules and moves whenever a free slot exists.
class Moves : public ::testing::TestWithParam<std::string> {
 protected:
  // `wrap`, when given, decorates the backend the allocator gets.
  std::unique_ptr<CachingAllocator> make(
      bool moves = true,
      const std::function<std::unique_ptr<Backend>(std::unique_ptr<Backend>)>& wrap = {}) {
    auto backend = test::make_backend(GetParam());
    if (!backend) return nullptr;
    if (wrap) backend = wrap(std::move(backend));
    slot_ = 2 * backend->granularity();
    AllocatorOptions o;
    o.map_slot_bytes = slot_;
    o.move_free_runs = moves;
    o.move_slack = -1;  // move whenever a free slot exists
    return std::make_unique<CachingAllocator>(std::move(backend), o);
  }
  // Every map is a new or a moved run; every unmap a moved or released one.
  static void expect_mapping_accounts(const CachingAllocator& a) {
    const AllocatorStats s = a.stats();
    const MappingStats m = a.mapping_stats();
    EXPECT_EQ(m.map_calls, s.segments.allocated + m.runs_moved);
    EXPECT_EQ(m.unmap_calls, s.segments.freed + m.runs_moved);
  }
  // Enqueues on s a host function that returns once `go` is true: s runs nothing after
  // it until then.
  static void hold_until(Backend& be, Stream s, std::atomic<bool>& go) {
    be.launch_host_func(
        s, [](void* flag) {
          while (!static_cast<std::atomic<bool>*>(flag)->load()) std::this_thread::yield();
        },
        &go);
  }
  // Defined with the test it serves, below.
  void grow_while_a_freed_slot_is_in_use(bool try_only);
  // One slot was moved in to back z (`bytes`), and the backend had handed out `segments`
  // by then; z's bytes hold.
  void expect_a_slot_moved_into(CachingAllocator& a, void* z, std::size_t bytes,
                                std::uint64_t segments, int seed) {
    EXPECT_EQ(a.mapping_stats().runs_moved, 1u);
    EXPECT_EQ(a.stats().segments.allocated, segments);
    Battery::fill_and_check(a.backend(), z, bytes, seed);
    expect_mapping_accounts(a);
  }
  // z, two slots, was backed by one slot moved and one created (segments acquired before
  // it: `acquired`, and one more for the slot of an earlier block); its bytes hold.
  void expect_one_slot_moved_into(CachingAllocator& a, void* z, std::uint64_t acquired,
                                  int seed) {
    expect_a_slot_moved_into(a, z, 2 * slot_, acquired + 2, seed);
  }
  std::size_t slot_ = 0;
};

#define TIDEPOOL_ALLOCATOR_OR_SKIP(var, ...)                \
  auto var = make(__VA_ARGS__);                             \
  if (!var) {                                               \
    GTEST_SKIP() << "no CUDA device on this machine";      \
  }                                                         \
  static_assert(true)

TEST_P(Moves, AHolesSlotsBackGrowthWithoutNewPhysicalMemory) {
  for (const bool moves : {false, true}) {
    SCOPED_TRACE(moves ? "moves on" : "moves off");
    TIDEPOOL_ALLOCATOR_OR_SKIP(a, moves);
    Backend& be = a->backend();
    char* hole = static_cast<char*>(a->allocate(2 * slot_));
    char* keep = static_cast<char*>(a->allocate(2 * slot_));
    Battery::fill_and_check(be, keep, 2 * slot_, 7);
    a->deallocate(hole, 2 * slot_);
    const std::uint64_t acquired = a->stats().segments.allocated;
    // Does not fit the hole: the range grows by four slots.
    char* grown = static_cast<char*>(a->allocate(4 * slot_));
    EXPECT_EQ(grown, keep + 2 * slot_);
    Battery::fill_and_check(be, grown, 4 * slot_, 9);
    Battery::check(be, keep, 2 * slot_, 7);
    AllocatorStats s = a->stats();
    const MappingStats m = a->mapping_stats();
    EXPECT_EQ(s.reserved.current, (moves ? 6 : 8) * slot_);
    EXPECT_EQ(s.segments.allocated, acquired + (moves ? 2 : 4));
    EXPECT_EQ(m.runs_moved, moves ? 2u : 0u);
    EXPECT_EQ(m.bytes_moved, moves ? 2 * slot_ : 0u);
    EXPECT_EQ(s.segments.freed, 0u);
    expect_mapping_accounts(*a);
    // The hole is backed again when it is reused; the moved memory stays where it went.
    char* again = static_cast<char*>(a->allocate(2 * slot_));
    EXPECT_EQ(again, hole);
    Battery::fill_and_check(be, again, 2 * slot_, 3);
    Battery::check(be, keep, 2 * slot_, 7);
    Battery::check(be, grown, 4 * slot_, 9);
    s = a->stats();
    EXPECT_EQ(s.reserved.current, 8 * slot_);
    EXPECT_EQ(s.reserved.peak, 8 * slot_);
    expect_mapping_accounts(*a);
    a->deallocate(again, 2 * slot_);
    a->deallocate(grown, 4 * slot_);
    a->deallocate(keep, 2 * slot_);
    EXPECT_EQ(a->empty_cache(), 8 * slot_);
    EXPECT_EQ(a->stats().reserved.current, 0u);
  }
}

using test::ReleasesOnSynchronize;

// Stream s frees slot x while work it queued before the free still writes x (the stream is
// held until the allocator synchronizes with it or, if it never does, until the request
// returns); then a request on s grows its range by two slots. allocate moves x's slot
// (after s has passed that work) and creates one. try_allocate waits for nothing (a tiered
// store's prefetch calls it under its own lock): it passes x's slot over and creates two.
void Moves::grow_while_a_freed_slot_is_in_use(bool try_only) {
  std::atomic<bool> go{false};
  auto a = make(true, [&](std::unique_ptr<Backend> inner) {
    return std::unique_ptr<Backend>(std::make_unique<ReleasesOnSynchronize>(std::move(inner), go));
  });
  if (!a) GTEST_SKIP() << "no CUDA device on this machine";
  Backend& be = a->backend();
  const std::size_t slot = slot_;
  const Stream s = be.create_stream();
  char* x = static_cast<char*>(a->allocate(slot, s));
  char* keep = static_cast<char*>(a->allocate(slot, s));
  hold_until(be, s, go);
  be.memset_async(x, 0xAA, slot, s);
  a->deallocate(x, slot, s);
  const std::uint64_t acquired = a->stats().segments.allocated;
  char* y = static_cast<char*>(try_only ? a->try_allocate(2 * slot, s) : a->allocate(2 * slot, s));
  const bool synchronized = go.exchange(true);
  ASSERT_NE(y, nullptr);
  EXPECT_EQ(synchronized, !try_only);
  EXPECT_EQ(a->mapping_stats().runs_moved, try_only ? 0u : 1u);
  EXPECT_EQ(a->mapping_stats().move_syncs, try_only ? 0u : 1u);
  EXPECT_EQ(a->stats().segments.allocated, acquired + (try_only ? 2 : 1));
  be.memset_async(y, 0x55, 2 * slot, s);
  be.stream_synchronize(s);
  Battery::check(be, y, 2 * slot, 0x55);
  expect_mapping_accounts(*a);
  a->deallocate(y, 2 * slot, s);
  a->deallocate(keep, slot, s);
  be.destroy_stream(s);
}

TEST_P(Moves, ASlotIsUnmappedOnlyAfterTheAllocatingStreamsWorkOnIt) {
  grow_while_a_freed_slot_is_in_use(/*try_only=*/false);
}

TEST_P(Moves, TryAllocateMovesNoSlotThatWouldWaitForTheStream) {
  grow_while_a_freed_slot_is_in_use(/*try_only=*/true);
}

TEST_P(Moves, AnotherStreamsSlotMovesOnlyOnceItsFenceHasPassed) {
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  const Stream other = be.create_stream();
  std::atomic<bool> go{false};
  char* x = static_cast<char*>(a->allocate(slot_, other));
  hold_until(be, other, go);
  be.memset_async(x, 0xAA, slot_, other);
  a->deallocate(x, slot_, other);
  // `other` is blocked: its free slot must not move; new memory is created instead.
  const std::uint64_t acquired = a->stats().segments.allocated;
  void* y = a->allocate(slot_);
  EXPECT_EQ(a->mapping_stats().runs_moved, 0u);
  EXPECT_EQ(a->stats().segments.allocated, acquired + 1);
  go = true;
  be.stream_synchronize(other);
  // Now a fence recorded on the idle stream completes at once and the slot can move,
  // from the other stream's range into this one's, without waiting. (Two slots: one
  // would simply reuse x's block in place, Note [Cross-stream reuse].)
  void* z = a->allocate(2 * slot_);
  expect_one_slot_moved_into(*a, z, acquired, 4);
  EXPECT_EQ(a->mapping_stats().move_syncs, 0u);
  a->deallocate(z, 2 * slot_);
  a->deallocate(y, slot_);
  be.destroy_stream(other);
}

// Review finding: the marker that keeps moves off after a search found nothing counted
// deallocate calls, and a block freed before the search (pending on record_stream's
// event) that reached its pool only after it left moves off: new memory was created
// while its slot could have moved.
TEST_P(Moves, ABlockThatReachesItsPoolAfterAFutileSearchCanMove) {
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  const Stream other = be.create_stream();
  const Stream side = be.create_stream();
  std::atomic<bool> go{false};
  char* x = static_cast<char*>(a->allocate(slot_, other));
  a->record_stream(x, side);
  hold_until(be, side, go);
  a->deallocate(x, slot_, other);  // pending until `side` passes
  const std::uint64_t acquired = a->stats().segments.allocated;
  void* y = a->allocate(slot_);  // searches, finds nothing free: new memory
  EXPECT_EQ(a->mapping_stats().runs_moved, 0u);
  EXPECT_EQ(a->stats().segments.allocated, acquired + 1);
  go = true;
  be.stream_synchronize(side);
  be.stream_synchronize(other);
  void* z = a->allocate(2 * slot_);  // x's slot is free now: it moves
  expect_one_slot_moved_into(*a, z, acquired, 5);
  a->deallocate(z, 2 * slot_);
  a->deallocate(y, slot_);
  be.destroy_stream(side);
  be.destroy_stream(other);
}

// After a search found nothing, moves stay off until a free may have made a slot wholly
// free (movable_epoch). A free block shorter than a slot does so in two ways: as the
// last block of its range, whose slot runs on past used_end; and beside a free block of
// another stream, which it does not merge with. Each case below leaves moves off without
// that rule: the slot stays where it is and new memory is created.
TEST_P(Moves, TheLastBlocksSlotMovesAfterAFutileSearch) {
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  const std::size_t granule = slot_ / 2;
  void* keep = a->allocate(slot_);  // searches, finds nothing: moves off
  void* tail = a->allocate(granule);  // the next slot, backed whole; past it, nothing
  a->deallocate(tail, granule);
  be.stream_synchronize({});
  const std::uint64_t acquired = a->stats().segments.allocated;
  const Stream other = be.create_stream();
  void* z = a->allocate(slot_, other);  // a range of its own, backed by tail's slot
  expect_a_slot_moved_into(*a, z, slot_, acquired, 11);
  a->deallocate(z, slot_, other);
  a->deallocate(keep, slot_);
  be.destroy_stream(other);
}

TEST_P(Moves, ASlotFreedByTwoStreamsMovesAfterAFutileSearch) {
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  const std::size_t granule = slot_ / 2;
  const Stream other = be.create_stream();
  char* front = static_cast<char*>(a->allocate(granule));  // searches, finds nothing
  char* back = static_cast<char*>(a->allocate(granule));
  void* keep = a->allocate(slot_);
  ASSERT_EQ(back, front + granule);
  a->deallocate(front, granule);
  be.stream_synchronize({});
  // `other` has no memory: it takes front's block (Note [Cross-stream reuse]).
  void* taken = a->allocate(granule, other);
  ASSERT_EQ(taken, front);
  a->deallocate(back, granule);
  a->deallocate(taken, granule, other);  // beside `back`, free but another stream's
  be.stream_synchronize(other);
  const std::uint64_t acquired = a->stats().segments.allocated;
  void* z = a->allocate(2 * slot_);  // one slot moved from front and back, one created
  expect_a_slot_moved_into(*a, z, 2 * slot_, acquired + 1, 12);
  a->deallocate(z, 2 * slot_);
  a->deallocate(keep, slot_);
  be.destroy_stream(other);
}

// A block that could not be backed goes back to its pool with the slot it already had: the
// search its backing made ran while it was allocated, and found nothing; that slot, wholly
// free again, is found by the next search.
TEST_P(Moves, TheSlotOfABlockThatCouldNotBeBackedCanMove) {
  if (GetParam() != "host") GTEST_SKIP() << "fault injection exists on the host backend only";
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  void* keep = a->allocate(slot_);
  void* tail = a->allocate(slot_);
  a->deallocate(tail, slot_);  // the last block, its slot wholly free
  // Grows tail's block by a slot; its own slot is not free meanwhile, so the search finds
  // nothing, and the new slot is refused, whole and then granule by granule.
  be.inject_fault(FaultPoint::create_physical, 2);
  EXPECT_EQ(a->try_allocate(2 * slot_), nullptr);
  be.stream_synchronize({});
  const std::uint64_t acquired = a->stats().segments.allocated;
  const Stream other = be.create_stream();
  // Too large for the free block (which `other` would take as it is): a range of its own,
  // one of its three slots moved from tail's.
  void* z = a->allocate(3 * slot_, other);
  expect_a_slot_moved_into(*a, z, 3 * slot_, acquired + 2, 14);
  a->deallocate(z, 3 * slot_, other);
  a->deallocate(keep, slot_);
  be.destroy_stream(other);
}

// A small range's slots are single granules, a large range's are longer: a search that
// found no free slot of one length leaves moves on for the other.
TEST_P(Moves, ASearchForOneSlotLengthLeavesTheOtherLengthOn) {
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  constexpr std::size_t kSmall = 4096;
  void* little = a->allocate(kSmall);  // a small range's granule; searches, finds nothing
  a->deallocate(little, kSmall);
  a->flush_thread_caches();  // the block reaches its pool, its granule wholly free
  void* keep = a->allocate(slot_);  // searches for a large slot, finds none
  be.stream_synchronize({});
  const std::uint64_t acquired = a->stats().segments.allocated;
  const Stream other = be.create_stream();
  // Too large for the free block (taking it would need no backing): a small range of its
  // own, whose granule is moved from the free one.
  void* z = a->allocate(2 * kSmall, other);
  expect_a_slot_moved_into(*a, z, 2 * kSmall, acquired, 13);
  a->deallocate(z, 2 * kSmall, other);
  a->deallocate(keep, slot_);
  be.destroy_stream(other);
}

TEST_P(Moves, AFailedMapPutsTheSlotBackOrReleasesIt) {
  if (GetParam() != "host") GTEST_SKIP() << "fault injection exists on the host backend only";
  TIDEPOOL_ALLOCATOR_OR_SKIP(a);
  Backend& be = a->backend();
  void* hole = a->allocate(slot_);
  char* keep = static_cast<char*>(a->allocate(slot_));
  Battery::fill_and_check(be, keep, slot_, 6);
  a->deallocate(hole, slot_);
  // The map at the new place fails; mapping it back where it was succeeds.
  be.inject_fault(FaultPoint::map, 1);
  EXPECT_THROW(a->allocate(2 * slot_), BackendError);
  AllocatorStats s = a->stats();
  EXPECT_EQ(s.reserved.current, 2 * slot_);
  EXPECT_EQ(s.allocated.current, slot_);
  EXPECT_EQ(s.segments.freed, 0u);
  const MappingStats m = a->mapping_stats();
  EXPECT_EQ(m.runs_moved, 0u);
  EXPECT_EQ(m.unmap_calls, 1u);
  EXPECT_EQ(m.map_calls, s.segments.allocated + 1);  // the map back where it was
  // The slot is back: reusing the hole needs no new memory.
  void* again = a->allocate(slot_);
  EXPECT_EQ(again, hole);
  EXPECT_EQ(a->stats().segments.allocated, s.segments.allocated);
  Battery::fill_and_check(be, again, slot_, 2);
  a->deallocate(again, slot_);
  // Both maps fail: the memory goes back to the backend rather than leak.
  be.inject_fault(FaultPoint::map, 2);
  EXPECT_THROW(a->allocate(2 * slot_), BackendError);
  s = a->stats();
  EXPECT_EQ(s.reserved.current, slot_);
  EXPECT_EQ(s.segments.freed, 1u);
  EXPECT_EQ(a->mapping_stats().unmap_calls, 2u);
  Battery::check(be, keep, slot_, 6);
  // Still usable; at the end the backend has every byte back.
  void* big = a->allocate(2 * slot_);
  Battery::fill_and_check(be, big, 2 * slot_, 8);
  a->deallocate(big, 2 * slot_);
  a->deallocate(keep, slot_);
  a->empty_cache();
  EXPECT_EQ(a->stats().reserved.current, 0u);
  const MemInfo mi = be.mem_info();
  EXPECT_EQ(mi.free_bytes, mi.total_bytes);
}

TEST_P(Moves, NearCapacityOnlyTheGranulesABlockNeedsAreBacked) {
  if (GetParam() != "host") GTEST_SKIP() << "needs a small device";
  HostBackendOptions b;
  b.capacity_bytes = 64 << 20;
  AllocatorOptions o;  // default 32 MiB slots: two fill this device
  CachingAllocator a(make_host_backend(0, b), o);
  // A whole slot for the first block would leave too little headroom: 20 MiB backed.
  void* first = a.allocate(20 << 20);
  EXPECT_EQ(a.stats().reserved.current, std::size_t{20} << 20);
  void* second = a.allocate(20 << 20);
  EXPECT_EQ(a.stats().reserved.current, std::size_t{40} << 20);
  // So small blocks still find memory.
  void* small = a.allocate(1000);
  EXPECT_NE(small, nullptr);
  a.deallocate(small, 1000);
  a.deallocate(second, 20 << 20);
  a.deallocate(first, 20 << 20);
}

// An expandable range longer than the device could never be backed past the device's
// size: it is cut to the device's. Sizes near SIZE_MAX used to wrap to a range exactly as
// long as each request (every allocation then reserved a range of its own), and huge ones
// asked the backend for address space it refuses, so no allocation could succeed.
TEST(ExpandableRangeBytes, ALengthPastTheDeviceIsCutToTheDevice) {
  constexpr std::size_t kMiB = std::size_t{1} << 20;
  for (const std::size_t asked : {SIZE_MAX, SIZE_MAX / 2}) {
    SCOPED_TRACE(asked);
    AllocatorOptions o;
    o.expandable_range_bytes = asked;
    CachingAllocator alloc(test::make_backend("host", 64 * kMiB), o);
    void* a = alloc.allocate(4 * kMiB);
    void* b = alloc.allocate(4 * kMiB);
    // One range holds both, back to back.
    EXPECT_EQ(static_cast<char*>(b), static_cast<char*>(a) + 4 * kMiB);
    EXPECT_EQ(alloc.backed_ranges().size(), 1u);
    alloc.deallocate(a, 4 * kMiB);
    alloc.deallocate(b, 4 * kMiB);
  }
}

INSTANTIATE_TEST_SUITE_P(Backends, Moves, TIDEPOOL_ALLOCATOR_TEST_BACKENDS,
                         [](const ::testing::TestParamInfo<std::string>& p) { return p.param; });

INSTANTIATE_TEST_SUITE_P(Backends, Battery, test::backends_and_segment_kinds(),
                         test::backend_and_segments_name);

}  // namespace
}  // namespace tidepool
