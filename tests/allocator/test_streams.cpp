// Stream ordering rules (Note [Stream contract] in caching_allocator.h), on the host
// backend whose streams really run asynchronously: a stream is held busy by a host
// function that waits for the test's signal, so "work still pending" is real. And the
// largest free block, which counts free blocks of different streams apart.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "allocator/caching_allocator.h"
#include "test_support.h"

namespace tidepool {
namespace {

using test::StreamHold;

class Streams : public ::testing::Test {
 protected:
  Streams() : alloc_(make_host_backend(0)) {
    a_ = alloc_.backend().create_stream();
    b_ = alloc_.backend().create_stream();
  }
  ~Streams() override {
    alloc_.backend().destroy_stream(a_);
    alloc_.backend().destroy_stream(b_);
  }
  CachingAllocator alloc_;
  Stream a_, b_;
};

constexpr std::size_t kSize = 4 << 20;

TEST_F(Streams, SameStreamReusesAFreedBlockAtOnceEvenWithWorkPending) {
  StreamHold hold(alloc_.backend(), a_);
  void* p = alloc_.allocate(kSize, a_);
  alloc_.deallocate(p, kSize, a_);
  EXPECT_EQ(alloc_.allocate(kSize, a_), p);
  alloc_.deallocate(p, kSize, a_);
  hold.release();
  alloc_.backend().stream_synchronize(a_);
}

TEST_F(Streams, OtherStreamWaitsUntilTheFreeingStreamsWorkIsDone) {
  void* p = alloc_.allocate(kSize, a_);
  auto hold = std::make_unique<StreamHold>(alloc_.backend(), a_);  // A's queued work uses p
  alloc_.deallocate(p, kSize, a_);
  void* q = alloc_.allocate(kSize, b_);  // B has nothing cached: it looks at A's pool
  EXPECT_NE(q, p) << "stream B got memory stream A may still be using";
  EXPECT_EQ(alloc_.stats().cross_stream_reuses, 0u);
  hold->release();
  alloc_.backend().stream_synchronize(a_);
  // A has passed the free: B (still holding q, so again with nothing cached) gets p.
  void* r = alloc_.allocate(kSize, b_);
  EXPECT_EQ(r, p);
  EXPECT_EQ(alloc_.stats().cross_stream_reuses, 1u);
  alloc_.deallocate(r, kSize, b_);
  alloc_.deallocate(q, kSize, b_);
}

TEST_F(Streams, RecordStreamHoldsTheBlockUntilThatStreamPassesTheFree) {
  void* p = alloc_.allocate(kSize, a_);
  StreamHold hold(alloc_.backend(), b_);
  alloc_.record_stream(p, b_);  // B's queued work reads p
  alloc_.deallocate(p, kSize, a_);
  // Even stream A must not get p back while B has not passed the free.
  void* q = alloc_.allocate(kSize, a_);
  EXPECT_NE(q, p);
  alloc_.deallocate(q, kSize, a_);
  const std::string snap = alloc_.snapshot_json();
  EXPECT_NE(snap.find("\"pending\""), std::string::npos) << snap;
  hold.release();
  alloc_.backend().stream_synchronize(b_);
  // Events done: the next allocation on A processes them and may reuse p's memory.
  void* r = alloc_.allocate(2 * kSize, a_);
  EXPECT_EQ(alloc_.snapshot_json().find("\"pending\""), std::string::npos);
  alloc_.deallocate(r, 2 * kSize, a_);
}

TEST_F(Streams, FreeOnAnotherStreamActsAsRecordStream) {
  void* p = alloc_.allocate(kSize, a_);
  StreamHold hold(alloc_.backend(), b_);
  alloc_.deallocate(p, kSize, b_);  // B used it last
  void* q = alloc_.allocate(kSize, a_);
  EXPECT_NE(q, p);
  alloc_.deallocate(q, kSize, a_);
  hold.release();
  alloc_.backend().stream_synchronize(b_);
}

TEST_F(Streams, EmptyCacheKeepsBlocksWaitingForEvents) {
  void* p = alloc_.allocate(kSize, a_);
  StreamHold hold(alloc_.backend(), b_);
  alloc_.record_stream(p, b_);
  alloc_.deallocate(p, kSize, a_);
  alloc_.empty_cache();  // must not hand p's memory back while B may still read it
  EXPECT_GE(alloc_.stats().reserved.current, kSize);
  hold.release();
  alloc_.backend().stream_synchronize(b_);
  alloc_.allocate(0, a_);  // no-op
  void* q = alloc_.allocate(512, a_);  // processes the completed events
  alloc_.deallocate(q, 512, a_);
  alloc_.empty_cache();
  EXPECT_LT(alloc_.stats().reserved.current, kSize);
}

// Free neighbours of two streams never merge, and a steal takes one block: the largest
// free block (what PyTorch sizes cuDNN workspaces by) and fragmentation count them apart.
TEST(LargestFreeBlock, FreeNeighboursOfTwoStreamsAreTwoBlocks) {
  AllocatorOptions o;
  o.expandable_segments = false;
  CachingAllocator alloc(make_host_backend(0), o);
  Backend& be = alloc.backend();
  const Stream a = be.create_stream(), b = be.create_stream();
  char* x = static_cast<char*>(alloc.allocate(kSize, a));
  char* y = static_cast<char*>(alloc.allocate(2 * kSize, b));  // B steals the rest of A's
  ASSERT_EQ(y, x + kSize) << "the layout this test needs: one segment, split between A and B";
  ASSERT_EQ(alloc.stats().segments.current, 1u);
  alloc.deallocate(x, kSize, a);
  alloc.deallocate(y, 2 * kSize, b);  // merges with B's rest of the segment
  const AllocatorStats s = alloc.stats();
  EXPECT_EQ(alloc.largest_free_block(), s.reserved.current - kSize);
  EXPECT_GT(s.fragmentation, 0.0);
  be.destroy_stream(a);
  be.destroy_stream(b);
}

TEST_F(Streams, RecordStreamOnAnUnknownPointerIsAClearError) {
  int x = 0;
  EXPECT_THROW(alloc_.record_stream(&x, b_), AllocatorUsageError);
}

}  // namespace
}  // namespace tidepool
