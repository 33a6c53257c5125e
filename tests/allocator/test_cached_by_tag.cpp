// Cached memory by tag (Note [Cached memory by tag], allocator/snapshot.cpp): the rules
// that say under which tag a free block's memory is kept, each checked on both segment
// kinds, and the per-tag largest free block and fragmentation. The randomized
// differential test checks that the tags' figures always add up to the cached total.
#include <gtest/gtest.h>

#include <algorithm>
#include <initializer_list>
#include <memory>
#include <string>
#include <tuple>

#include "allocator/caching_allocator.h"
#include "allocator/tags.h"
#include "test_support.h"

namespace tidepool {
namespace {

using Param = test::BackendAndSegments;
constexpr std::size_t kMiB = std::size_t{1} << 20;

class CachedByTag : public ::testing::TestWithParam<Param> {
 protected:
  void SetUp() override {
    alloc_ = test::make_allocator(GetParam());
    if (!alloc_) GTEST_SKIP() << "no CUDA device on this machine";
  }
  void TearDown() override {
    if (!alloc_) return;
    alloc_->backend().device_synchronize();
    alloc_->empty_cache();
    EXPECT_EQ(alloc_->stats().reserved.current, 0u) << "a test left memory allocated";
  }

  void* allocate_under(int tag, std::size_t n) {
    TagScope scope(tag);
    return alloc_->allocate(n);
  }
  // The other tags keep nothing cached.
  static void expect_only(const AllocatorStats& s, std::initializer_list<int> holders) {
    for (int t = 0; t < kTagCount; ++t) {
      if (std::find(holders.begin(), holders.end(), t) != holders.end()) continue;
      EXPECT_EQ(s.tags[t].cached_bytes, 0u) << "tag " << t << " (" << tag_name(t) << ")";
    }
  }

  std::unique_ptr<CachingAllocator> alloc_;
};

TEST_P(CachedByTag, AFreedBlockStaysCachedUnderItsTag) {
  void* p = allocate_under(kTagActivation, 16 * kMiB);
  alloc_->deallocate(p, 16 * kMiB);
  const AllocatorStats s = alloc_->stats();
  ASSERT_GT(s.cached_bytes, 0u);
  EXPECT_EQ(s.cached_bytes, s.reserved.current) << "nothing is live";
  const TagStats& act = s.tags[kTagActivation];
  EXPECT_EQ(act.cached_bytes, s.cached_bytes);
  EXPECT_EQ(act.largest_free_block, s.largest_free_block);
  EXPECT_EQ(act.fragmentation, s.fragmentation);
  expect_only(s, {kTagActivation});
}

// Memory new from the backend is the request's: the part of a fresh segment (or of a
// range's new slot) the request leaves free is kept under its tag, not as untagged.
TEST_P(CachedByTag, TheUnusedRestOfNewMemoryIsTheRequestsTag) {
  void* small = allocate_under(kTagWorkspace, 4096);  // a whole small segment for 4 KiB
  void* large = allocate_under(kTagGradient, 3 * kMiB);
  const AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.tags[kTagWorkspace].cached_bytes, s.cached_bytes - s.tags[kTagGradient].cached_bytes);
  EXPECT_GT(s.tags[kTagWorkspace].cached_bytes, 0u) << "the small segment's rest";
  EXPECT_GT(s.tags[kTagGradient].cached_bytes, 0u) << "the large segment's rest";
  expect_only(s, {kTagWorkspace, kTagGradient});
  alloc_->deallocate(small, 4096);
  alloc_->deallocate(large, 3 * kMiB);
}

// A block reused under another tag takes its memory out of the old tag's cache; what a
// split leaves free stays under the tag of the block it was cut from.
TEST_P(CachedByTag, ReuseMovesTheMemoryAndASplitRestKeepsItsTag) {
  void* p = allocate_under(kTagActivation, 16 * kMiB);
  alloc_->deallocate(p, 16 * kMiB);
  const std::uint64_t cached = alloc_->stats().cached_bytes;

  void* q = allocate_under(kTagGradient, 4 * kMiB);  // cut from the free 16 MiB
  AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.reserved.current, cached + 0) << "served from the cache";
  EXPECT_EQ(s.tags[kTagActivation].cached_bytes + s.tags[kTagGradient].cached_bytes,
            s.cached_bytes);
  EXPECT_GE(s.tags[kTagActivation].cached_bytes, 12 * kMiB)
      << "the 12 MiB left of activation's block are still activation's";
  expect_only(s, {kTagActivation, kTagGradient});

  const std::uint64_t activation_before = s.tags[kTagActivation].cached_bytes;
  void* r = allocate_under(kTagOptimizerState, 12 * kMiB);  // the rest, exactly
  s = alloc_->stats();
  EXPECT_EQ(s.reserved.current, cached);
  EXPECT_EQ(s.tags[kTagActivation].cached_bytes, activation_before - 12 * kMiB)
      << "reused by optimizer_state";
  EXPECT_EQ(s.tags[kTagOptimizerState].cached_bytes, 0u);
  alloc_->deallocate(q, 4 * kMiB);
  alloc_->deallocate(r, 12 * kMiB);
}

// Two free neighbours merge into one block kept under the larger part's tag, whichever
// of the two was freed first and whichever comes first in memory.
TEST_P(CachedByTag, AMergedBlockIsKeptUnderTheLargerPartsTag) {
  // A 16 MiB segment (on a range: 16 MiB of blocks, the slot's backed rest past them
  // stays parameter's).
  void* whole = allocate_under(kTagParameter, 16 * kMiB);
  alloc_->deallocate(whole, 16 * kMiB);
  void* front = allocate_under(kTagActivation, 4 * kMiB);
  void* back = allocate_under(kTagGradient, 12 * kMiB);
  ASSERT_EQ(static_cast<char*>(back), static_cast<char*>(front) + 4 * kMiB)
      << "the test needs the two adjacent";
  alloc_->deallocate(front, 4 * kMiB);
  EXPECT_EQ(alloc_->stats().tags[kTagActivation].cached_bytes, 4 * kMiB);
  alloc_->deallocate(back, 12 * kMiB);  // merges with the smaller, earlier activation part
  const AllocatorStats s = alloc_->stats();
  EXPECT_EQ(s.tags[kTagGradient].cached_bytes, 16 * kMiB);
  EXPECT_EQ(s.tags[kTagGradient].cached_bytes + s.tags[kTagParameter].cached_bytes,
            s.cached_bytes);
  expect_only(s, {kTagGradient, kTagParameter});
}

// A tag's largest free block counts its own blocks only: a free neighbour of another tag
// that has not merged (a small block freed into its stream's exact-size list) is part of
// the total's largest free range, not of either tag's.
TEST_P(CachedByTag, ATagsLargestFreeBlockIsMadeOfItsOwnBlocks) {
  void* first = allocate_under(kTagActivation, 4096);  // new small segment: rest is activation's
  void* second = allocate_under(kTagGradient, 4096);   // cut from that rest
  ASSERT_EQ(static_cast<char*>(second), static_cast<char*>(first) + 4096);
  alloc_->deallocate(second, 4096);  // kept unmerged (quick list or thread cache)
  const AllocatorStats s = alloc_->stats();
  const TagStats& act = s.tags[kTagActivation];
  const TagStats& grad = s.tags[kTagGradient];
  EXPECT_EQ(grad.cached_bytes, 4096u);
  EXPECT_EQ(grad.largest_free_block, 4096u);
  EXPECT_EQ(grad.fragmentation, 0.0);
  EXPECT_EQ(act.cached_bytes + grad.cached_bytes, s.cached_bytes);
  EXPECT_EQ(act.largest_free_block, act.cached_bytes) << "the rest is one range";
  EXPECT_EQ(act.fragmentation, 0.0);
  EXPECT_EQ(s.largest_free_block, s.cached_bytes) << "gradient's block and the rest adjoin";
  alloc_->deallocate(first, 4096);
}

TEST_P(CachedByTag, FragmentationOfATagCountsItsHoles) {
  // Three 16 MiB blocks; the first and last freed leave two holes (on an expandable range
  // the last one joins the backed tail after it, also activation's).
  void* a = allocate_under(kTagActivation, 16 * kMiB);
  void* b = allocate_under(kTagParameter, 16 * kMiB);
  void* c = allocate_under(kTagActivation, 16 * kMiB);
  alloc_->deallocate(a, 16 * kMiB);
  alloc_->deallocate(c, 16 * kMiB);
  const AllocatorStats s = alloc_->stats();
  const TagStats& act = s.tags[kTagActivation];
  EXPECT_EQ(act.cached_bytes, s.cached_bytes);
  EXPECT_GE(act.cached_bytes, 32 * kMiB);
  EXPECT_LT(act.largest_free_block, act.cached_bytes) << "two holes";
  EXPECT_GT(act.fragmentation, 0.0);
  EXPECT_DOUBLE_EQ(act.fragmentation,
                   1.0 - static_cast<double>(act.largest_free_block) /
                             static_cast<double>(act.cached_bytes));
  EXPECT_EQ(s.tags[kTagParameter].cached_bytes, 0u) << "its block is live";
  alloc_->deallocate(b, 16 * kMiB);
}

// A request that cannot be backed takes no tag's memory: the address space it tiled
// before failing goes back free under the tag its backed memory had, whether appended
// past a live last block or extending a free one.
TEST_P(CachedByTag, ARequestThatCannotBeBackedTakesNoTagsMemory) {
  if (std::get<0>(GetParam()) != "host" || !std::get<1>(GetParam()))
    GTEST_SKIP() << "needs a host backend's capacity and ranges";
  // 128 MiB of device: ranges of four 32 MiB slots.
  CachingAllocator alloc(test::make_backend("host", 128 * kMiB));
  const Stream other = alloc.backend().create_stream();
  void* keep = nullptr;
  {
    TagScope scope(kTagParameter);
    keep = alloc.allocate(16 * kMiB);  // slot 0; its backed rest is parameter's
  }
  void* hog = alloc.allocate(96 * kMiB, other);  // the other 96 MiB of the device
  const std::uint64_t parameter_cached = alloc.stats().tags[kTagParameter].cached_bytes;
  ASSERT_EQ(parameter_cached, 16 * kMiB) << alloc.snapshot_json();
  for (const std::size_t n : {40 * kMiB, 48 * kMiB}) {  // appended, then extending
    {
      TagScope scope(kTagActivation);
      EXPECT_EQ(alloc.try_allocate(n), nullptr) << "no memory left to back it";
    }
    const AllocatorStats s = alloc.stats();
    EXPECT_EQ(s.tags[kTagParameter].cached_bytes, parameter_cached) << n;
    EXPECT_EQ(s.tags[kTagActivation].cached_bytes, 0u) << n;
  }
  alloc.deallocate(keep, 16 * kMiB);
  alloc.deallocate(hog, 96 * kMiB, other);
  alloc.backend().device_synchronize();
  alloc.empty_cache();
  alloc.backend().destroy_stream(other);
}

// The snapshot says the same: each tag's cached figures, and each free block's last tag.
TEST_P(CachedByTag, TheSnapshotShowsCachedMemoryByTag) {
  void* p = allocate_under(kTagActivation, 16 * kMiB);
  alloc_->deallocate(p, 16 * kMiB);
  const std::string json = alloc_->snapshot_json();
  EXPECT_TRUE(test::JsonChecker::valid(json)) << json;
  const std::uint64_t cached = alloc_->stats().cached_bytes;
  EXPECT_NE(json.find("\"name\":\"activation\",\"bytes\":"), std::string::npos) << json;
  EXPECT_NE(json.find(",\"cached_bytes\":" + std::to_string(cached) + ",\"largest_free_block\":"),
            std::string::npos)
      << json;
  EXPECT_NE(json.find("\"state\":\"free\",\"stream\":\"0x0\",\"last_tag\":\"activation\""),
            std::string::npos)
      << json;
}

INSTANTIATE_TEST_SUITE_P(Backends, CachedByTag, test::backends_and_segment_kinds(),
                         test::backend_and_segments_name);

}  // namespace
}  // namespace tidepool
