// Segment events (Note [Segment events], allocator/segment_events.h): an observer of the
// caching allocator's backing sees plain segments allocated and freed, expandable runs
// mapped and unmapped, and blocks free again, in the order they happened, with address,
// size, stream and the causing thread; nothing while unobserved; and the device registry
// turns the log on for allocators created later. Host backend.
#include <gtest/gtest.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <thread>
#include <vector>

#include "allocator/device_registry.h"
#include "tests/allocator/test_support.h"
#include "tests/support/stream_gate.h"

namespace tidepool {
namespace {

using Kind = SegmentEvent::Kind;
constexpr std::size_t kMiB = std::size_t{1} << 20;

std::unique_ptr<CachingAllocator> host_allocator(bool expandable) {
  AllocatorOptions o;
  o.expandable_segments = expandable;
  o.thread_cache_bytes = 0;  // frees go straight to the pools, so empty_cache sees them
  return std::make_unique<CachingAllocator>(test::make_backend("host"), o);
}

bool covers(const SegmentEvent& e, const void* p, std::size_t bytes) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return e.address <= a && a + bytes <= e.address + e.size;
}

TEST(SegmentEvents, PlainSegmentsAllocatedThenFreedWithTheirStream) {
  auto a = host_allocator(false);
  const Stream s = a->backend().create_stream();
  a->segment_events().set_observed(true);
  void* p = a->allocate(2 * kMiB, s);  // large pool: a 20 MiB segment
  void* q = a->allocate(3 * kMiB, s);  // fits the same segment: no event
  auto events = a->segment_events().take();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].kind, Kind::segment_allocated);
  EXPECT_TRUE(covers(events[0], p, 2 * kMiB));
  EXPECT_TRUE(covers(events[0], q, 3 * kMiB));
  EXPECT_EQ(events[0].size, a->stats().reserved.current);
  EXPECT_EQ(events[0].stream, s.handle);
  EXPECT_EQ(events[0].thread, std::this_thread::get_id());
  EXPECT_TRUE(a->segment_events().take().empty()) << "taken: the log starts over";

  a->deallocate(p, 2 * kMiB, s);
  a->deallocate(q, 3 * kMiB, s);
  // Each block free again (a history's FREE_COMPLETED), and no segment event: a free keeps
  // the segment cached.
  const auto blocks = a->segment_events().take();
  ASSERT_EQ(blocks.size(), 2u);
  for (std::size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(blocks[i].kind, Kind::block_freed);
    EXPECT_EQ(blocks[i].stream, s.handle);
  }
  EXPECT_EQ(blocks[0].address, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(blocks[0].size, 2 * kMiB) << "the size asked for";
  EXPECT_EQ(blocks[1].address, reinterpret_cast<std::uintptr_t>(q));
  EXPECT_EQ(blocks[1].size, 3 * kMiB);
  a->empty_cache();
  const auto freed = a->segment_events().take();
  ASSERT_EQ(freed.size(), 1u);
  EXPECT_EQ(freed[0].kind, Kind::segment_freed);
  EXPECT_EQ(freed[0].address, events[0].address);
  EXPECT_EQ(freed[0].size, events[0].size);
  EXPECT_EQ(freed[0].stream, s.handle);
  a->release_stream(s);
  a->backend().destroy_stream(s);
}

TEST(SegmentEvents, ExpandableRunsMappedThenUnmapped) {
  auto a = host_allocator(true);
  a->segment_events().set_observed(true);
  constexpr std::size_t kBig = 40 * kMiB;  // two 32 MiB slots
  void* p = a->allocate(kBig);
  const auto mapped = a->segment_events().take();
  ASSERT_FALSE(mapped.empty());
  std::map<std::uintptr_t, std::size_t> runs;
  std::size_t bytes = 0;
  for (const SegmentEvent& e : mapped) {
    EXPECT_EQ(e.kind, Kind::mapped);
    EXPECT_EQ(e.stream, nullptr);
    runs[e.address] = e.size;
    bytes += e.size;
  }
  EXPECT_EQ(bytes, a->stats().reserved.current);
  // The runs are contiguous and back the whole block.
  std::uintptr_t at = runs.begin()->first;
  for (const auto& [address, size] : runs) {
    EXPECT_EQ(address, at);
    at += size;
  }
  EXPECT_LE(runs.begin()->first, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_GE(at, reinterpret_cast<std::uintptr_t>(p) + kBig);

  a->deallocate(p, kBig);
  a->empty_cache();
  auto unmapped = a->segment_events().take();
  ASSERT_EQ(unmapped.size(), mapped.size() + 1);
  EXPECT_EQ(unmapped.front().kind, Kind::block_freed) << "the block is free before its unmap";
  EXPECT_EQ(unmapped.front().address, reinterpret_cast<std::uintptr_t>(p));
  unmapped.erase(unmapped.begin());
  for (const SegmentEvent& e : unmapped) {
    EXPECT_EQ(e.kind, Kind::unmapped);
    ASSERT_EQ(runs.count(e.address), 1u);
    EXPECT_EQ(runs[e.address], e.size) << "each mapped run is unmapped whole";
    runs.erase(e.address);
  }
  EXPECT_EQ(a->stats().reserved.current, 0u);
}

// A block another stream still uses (record_stream) is free only once that stream has
// passed it: its block_freed comes when the allocator gives it back to its pool, before
// the release of the segment that frees, not at the free. The stream is held by a gate.
TEST(SegmentEvents, ABlockAnotherStreamUsesIsFreeWhenThatStreamHasPassedIt) {
  auto a = host_allocator(false);
  const Stream s = a->backend().create_stream();
  const Stream side = a->backend().create_stream();
  test_support::StreamGate gate;
  const test_support::StreamGate::OpenOnExit open_on_exit{gate};
  a->backend().launch_host_func(side, &test_support::StreamGate::wait, &gate);
  a->segment_events().set_observed(true);
  void* p = a->allocate(2 * kMiB, s);
  a->record_stream(p, side);
  ASSERT_EQ(a->segment_events().take().size(), 1u);  // the segment
  a->deallocate(p, 2 * kMiB, s);
  EXPECT_TRUE(a->segment_events().take().empty()) << "free before the side stream passed it";
  a->empty_cache();  // looks at the held block: still held
  EXPECT_TRUE(a->segment_events().take().empty());

  gate.open();
  a->backend().stream_synchronize(side);
  a->empty_cache();
  const auto events = a->segment_events().take();
  ASSERT_EQ(events.size(), 2u);
  EXPECT_EQ(events[0].kind, Kind::block_freed);
  EXPECT_EQ(events[0].address, reinterpret_cast<std::uintptr_t>(p));
  EXPECT_EQ(events[0].size, 2 * kMiB);
  EXPECT_EQ(events[1].kind, Kind::segment_freed) << "the release the free enabled comes after";
  a->release_stream(side);
  a->release_stream(s);
  a->backend().destroy_stream(side);
  a->backend().destroy_stream(s);
}

TEST(SegmentEvents, NothingWhileUnobservedAndStoppingDropsTheQueue) {
  auto a = host_allocator(true);
  void* p = a->allocate(8 * kMiB);
  a->deallocate(p, 8 * kMiB);
  a->empty_cache();
  a->segment_events().set_observed(true);
  EXPECT_TRUE(a->segment_events().take().empty()) << "nothing queued while unobserved";
  p = a->allocate(8 * kMiB);
  a->segment_events().set_observed(false);
  EXPECT_TRUE(a->segment_events().take().empty()) << "stopping drops what was queued";
  a->deallocate(p, 8 * kMiB);
  a->empty_cache();
  EXPECT_TRUE(a->segment_events().take().empty());
}

// A moved free run is an unmap where it was and a map where it goes (Note [Moving free
// runs]): the observer's running sum of mapped bytes stays reserved memory.
TEST(SegmentEvents, MappedMinusUnmappedIsReservedUnderConcurrentUse) {
  auto a = host_allocator(true);
  a->segment_events().set_observed(true);
  std::atomic<bool> done{false};
  std::int64_t mapped = 0;
  std::vector<SegmentEvent> seen;
  auto drain = [&] {
    for (const SegmentEvent& e : a->segment_events().take()) {
      seen.push_back(e);
      if (e.kind == Kind::mapped) mapped += static_cast<std::int64_t>(e.size);
      if (e.kind == Kind::unmapped) mapped -= static_cast<std::int64_t>(e.size);
    }
  };
  std::thread observer([&] {
    while (!done.load()) drain();
  });
  std::vector<std::thread> workers;
  for (int t = 0; t < 3; ++t)
    workers.emplace_back([&, t] {
      const Stream s = a->backend().create_stream();
      for (int i = 0; i < test::scaled(40); ++i) {
        const std::size_t bytes = std::size_t(1 + (i + t) % 5) * 12 * kMiB;
        void* p = a->allocate(bytes, s);
        a->deallocate(p, bytes, s);
        if (i % 7 == t) a->empty_cache();
      }
      a->release_stream(s);
      a->backend().destroy_stream(s);
    });
  for (auto& w : workers) w.join();
  done.store(true);
  observer.join();
  drain();
  EXPECT_FALSE(seen.empty());
  EXPECT_EQ(mapped, static_cast<std::int64_t>(a->stats().reserved.current));
}

// The registry's switch reaches allocators created after it (their first growth is not
// missed) and is counted across observers.
TEST(SegmentEvents, TheRegistryObservesAllocatorsCreatedLater) {
  ASSERT_EQ(existing_device_allocator(0), nullptr) << "this test needs a fresh process";
  observe_segment_events(true);
  CachingAllocator& a = device_allocator(0);
  void* p = a.allocate(4 * kMiB);
  const auto events = a.segment_events().take();
  bool backed = false;
  for (const SegmentEvent& e : events) backed = backed || covers(e, p, 4 * kMiB);
  EXPECT_TRUE(backed) << "the new allocator's first growth is seen";
  observe_segment_events(true);   // a second observer
  observe_segment_events(false);  // one of two stops: still observed
  EXPECT_TRUE(a.segment_events().observed());
  observe_segment_events(false);
  EXPECT_FALSE(a.segment_events().observed());
  a.deallocate(p, 4 * kMiB);
  a.empty_cache();
  EXPECT_TRUE(a.segment_events().take().empty());
}

}  // namespace
}  // namespace tidepool
