// A prefetch is a hint (tiered_store.h): on a device that is full, it is skipped. It must
// not run the caching allocator's out-of-memory policy, whose reclaim hook evicts every
// other store's released state (and waits for it) and which counts an OOM: two optimizers
// prefetching their next steps would evict each other's working sets. A host-backend
// device of 64 MiB stands in for a full GPU.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "allocator/caching_allocator.h"
#include "allocator/tags.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"

namespace tidepool {
namespace {

using tiering_test::kMiB;

class PrefetchBackPressureTest : public ::testing::Test {
 protected:
  PrefetchBackPressureTest() {
    HostBackendOptions o;
    o.capacity_bytes = 64 * kMiB;
    allocator_ = std::make_unique<CachingAllocator>(make_host_backend(0, o));
    stream_ = allocator_->backend().create_stream();
  }
  ~PrefetchBackPressureTest() override {
    for (void* p : filler_) allocator_->deallocate(p, 4 * kMiB, stream_);
    allocator_->release_stream(stream_);
    allocator_->backend().destroy_stream(stream_);
  }
  std::unique_ptr<TieredStore> new_store() {
    return std::make_unique<TieredStore>(allocator_->backend(),
                                         tiering_test::test_store_options(32 * kMiB),
                                         caching_allocator_source(*allocator_));
  }
  // Allocates 4 MiB blocks until the device has no room for another.
  void fill_the_device() {
    TagScope scope(kTagActivation);
    while (void* p = allocator_->try_allocate(4 * kMiB, stream_)) filler_.push_back(p);
  }
  std::unique_ptr<CachingAllocator> allocator_;
  Stream stream_;
  std::vector<void*> filler_;
};

TEST_F(PrefetchBackPressureTest, APrefetchOnAFullDeviceIsSkippedWithoutTouchingOtherStores) {
  const std::unique_ptr<TieredStore> a = new_store();
  const std::unique_ptr<TieredStore> b = new_store();
  // B's working set: acquired and released, so it stays on the device, evictable.
  const TieredStore::Handle b_state = b->create(16 * kMiB, kTagOptimizerState, Tier::device);
  b->acquire(b_state, stream_);
  b->release(b_state, /*dirty=*/true);
  fill_the_device();
  ASSERT_FALSE(filler_.empty());
  const AllocatorStats before = allocator_->stats();

  const TieredStore::Handle a_state = a->create(16 * kMiB, kTagOptimizerState, Tier::host);
  a->prefetch(a_state, stream_);

  EXPECT_EQ(b->stats().evictions, 0u) << "A's hint evicted B's state";
  EXPECT_EQ(a->stats().prefetch_skipped, 1u);
  const AllocatorStats after = allocator_->stats();
  EXPECT_EQ(after.oom_count, before.oom_count) << "a skipped hint was counted as an OOM";
  EXPECT_EQ(after.reclaim_calls, before.reclaim_calls);
  EXPECT_EQ(after.reserved.current, before.reserved.current);

  // An acquire is a demand: it makes room, here by asking B for its released state.
  EXPECT_NE(a->acquire(a_state, stream_), nullptr);
  a->release(a_state, /*dirty=*/false);
  EXPECT_EQ(b->stats().evictions, 1u);
}

// The allocator's side: try_allocate takes memory that is free now and gives up at once.
TEST_F(PrefetchBackPressureTest, TryAllocateNeverRunsTheOutOfMemoryPolicy) {
  fill_the_device();
  void* cached = filler_.back();
  filler_.pop_back();
  allocator_->deallocate(cached, 4 * kMiB, stream_);  // cached on stream_, not released
  const AllocatorStats before = allocator_->stats();
  EXPECT_EQ(allocator_->try_allocate(8 * kMiB, stream_), nullptr);
  const AllocatorStats after = allocator_->stats();
  EXPECT_EQ(after.oom_count, before.oom_count);
  EXPECT_EQ(after.reclaim_calls, before.reclaim_calls);
  EXPECT_EQ(after.reserved.current, before.reserved.current) << "the cache was released";
  void* again = allocator_->try_allocate(4 * kMiB, stream_);  // the cached block
  EXPECT_EQ(again, cached);
  filler_.push_back(again);
  EXPECT_THROW(allocator_->allocate(8 * kMiB, stream_), std::bad_alloc);
  EXPECT_EQ(allocator_->stats().oom_count, before.oom_count + 1);
}

}  // namespace
}  // namespace tidepool
