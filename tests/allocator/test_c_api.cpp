// The C ABI as PyTorch and the Python package use it: malloc/free with PyTorch's
// signatures, the throwing pair handed to PyTorch, tags, the versioned stats struct, the
// JSON snapshot, empty_cache, record_stream, release_stream, flush_thread_caches and the
// backend selection. Runs on the host backend. (Routing to the tiering layer:
// tests/tiering/test_c_api_tiering.cpp.)
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <future>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "allocator/c_api.h"
#include "allocator/device_registry.h"
#include "test_support.h"
#include "tests/support/stream_gate.h"

namespace {

class CApi : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ASSERT_EQ(tidepool_set_backend("host"), 0); }
  // The allocator of `device`, created now over a host backend of 64 MiB (the capacity is
  // read when a device's allocator is made). Each caller uses a device no other test in
  // this binary touches.
  static tidepool::CachingAllocator& small_device(int device) {
    EXPECT_EQ(tidepool::existing_device_allocator(device), nullptr) << "device " << device;
    EXPECT_EQ(setenv("TIDEPOOL_HOST_CAPACITY_MB", "64", 1), 0);
    tidepool::CachingAllocator& allocator = tidepool::device_allocator(device);
    unsetenv("TIDEPOOL_HOST_CAPACITY_MB");
    return allocator;
  }
  static tidepool_stats_v1 stats(int device = 0) {
    tidepool_stats_v1 s{};
    s.struct_size = sizeof s;
    EXPECT_EQ(tidepool_get_stats_v1(device, &s), 0) << tidepool_last_error();
    return s;
  }
};

TEST_F(CApi, MallocFreeAndStatsStruct) {
  const tidepool_stats_v1 before = stats();
  EXPECT_EQ(before.version, 1u);
  EXPECT_EQ(before.struct_size, sizeof(tidepool_stats_v1));
  EXPECT_EQ(before.backend, 0);
  void* p = tidepool_malloc(3000, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  tidepool_stats_v1 s = stats();
  EXPECT_EQ(s.allocated.current, before.allocated.current + 3072);
  EXPECT_EQ(s.alloc_count, before.alloc_count + 1);
  EXPECT_EQ(s.requested.current, before.requested.current + 3000);
  EXPECT_GE(s.reserved.current, s.allocated.current);
  EXPECT_EQ(s.cached_bytes, s.reserved.current - s.allocated.current);
  tidepool_free(p, 3000, 0, nullptr);
  s = stats();
  EXPECT_EQ(s.allocated.current, before.allocated.current);
  EXPECT_EQ(s.free_count, before.free_count + 1);
  EXPECT_EQ(s.allocations.allocated, s.alloc_count);
  EXPECT_EQ(s.allocations.freed, s.free_count);
  EXPECT_EQ(s.allocations.current, s.alloc_count - s.free_count);
  EXPECT_GE(s.allocations.peak, before.allocations.current + 1);
  EXPECT_EQ(s.segments.allocated, s.segments_acquired);
  EXPECT_EQ(s.segments.freed, s.segments_released);
  EXPECT_EQ(tidepool_reset_peak_stats(0), 0);
  EXPECT_EQ(stats().allocated.peak, stats().allocated.current);
  EXPECT_EQ(stats().allocations.peak, stats().allocations.current);
}

TEST_F(CApi, AnOlderShorterStatsStructGetsItsPrefix) {
  unsigned char buffer[sizeof(tidepool_stats_v1) + 16];
  std::memset(buffer, 0xAB, sizeof buffer);
  auto* s = reinterpret_cast<tidepool_stats_v1*>(buffer);
  const std::uint32_t short_size = offsetof(tidepool_stats_v1, tags);
  s->struct_size = short_size;
  ASSERT_EQ(tidepool_get_stats_v1(0, s), 0);
  EXPECT_EQ(s->struct_size, short_size);
  EXPECT_EQ(s->version, 1u);
  for (std::size_t i = short_size; i < sizeof buffer; ++i) ASSERT_EQ(buffer[i], 0xAB) << i;
}

// Reading a device's stats or snapshot creates no allocator there (on CUDA it made a
// context on a GPU tidepool never used, and marked forked children): its figures are zeros.
TEST_F(CApi, StatsOfAnUnusedDeviceAreZerosAndCreateNothing) {
  constexpr int kDevice = 15;  // no other test in this binary uses it
  ASSERT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
  tidepool_stats_v1 s{};
  s.struct_size = sizeof s;
  ASSERT_EQ(tidepool_get_stats_v1(kDevice, &s), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr) << "reading created one";
  EXPECT_EQ(s.device, kDevice);
  EXPECT_EQ(s.backend, 0);  // host
  EXPECT_EQ(s.reserved.current, 0u);
  EXPECT_EQ(s.alloc_count, 0u);
  EXPECT_EQ(tidepool_get_stats_v1(9999, &s), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
  // Nor does its snapshot: the one a new allocator there would give.
  char* json = tidepool_snapshot_json(kDevice);
  ASSERT_NE(json, nullptr) << tidepool_last_error();
  const std::string text = json;
  tidepool_string_free(json);
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr) << "a snapshot created one";
  EXPECT_EQ(text, tidepool::CachingAllocator(tidepool::make_host_backend(kDevice)).snapshot_json());
  EXPECT_NE(text.find("\"segments\":[]}"), std::string::npos) << text;
  EXPECT_EQ(tidepool_snapshot_json(9999), nullptr);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
}

// Note [PyTorch's view of the stats]: c10's DeviceStats filled from tidepool's stats, its
// running totals counted from the last accumulated reset, tidepool's own totals untouched.
TEST_F(CApi, PyTorchStatsAreTidepoolsInC10sLayout) {
  constexpr int kDevice = 6;  // no other test in this binary uses it
  const auto pytorch_stats = [] {
    tidepool_pytorch_stats_v1 v{};
    v.struct_size = sizeof v;
    EXPECT_EQ(tidepool_get_pytorch_stats_v1(kDevice, &v), 0) << tidepool_last_error();
    return v;
  };
  ASSERT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
  const tidepool_pytorch_stats_v1 unused = pytorch_stats();
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr) << "reading creates nothing";
  EXPECT_EQ(tidepool_reset_peak_stats(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_pytorch_reset_accumulated_stats(kDevice), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr) << "nor do the resets";
  EXPECT_EQ(unused.version, 1u);
  EXPECT_EQ(unused.allocated_bytes[TIDEPOOL_POOL_ALL].current, 0u);
  EXPECT_EQ(unused.max_split_size, -1);

  void* a = tidepool_malloc(3 << 20, kDevice, nullptr);
  void* b = tidepool_malloc(1000, kDevice, nullptr);
  ASSERT_TRUE(a && b) << tidepool_last_error();
  tidepool_free(b, 1000, kDevice, nullptr);
  tidepool_pytorch_stats_v1 v = pytorch_stats();
  tidepool_stats_v1 s = stats(kDevice);
  const auto same = [](const tidepool_stat_v1& x, const tidepool_stat_v1& y) {
    return x.current == y.current && x.peak == y.peak && x.allocated == y.allocated &&
           x.freed == y.freed;
  };
  for (int pool : {TIDEPOOL_POOL_ALL, TIDEPOOL_POOL_LARGE}) {
    EXPECT_TRUE(same(v.allocated_bytes[pool], s.allocated)) << pool;
    EXPECT_TRUE(same(v.active_bytes[pool], s.allocated)) << pool;
    EXPECT_TRUE(same(v.reserved_bytes[pool], s.reserved)) << pool;
    EXPECT_TRUE(same(v.requested_bytes[pool], s.requested)) << pool;
    EXPECT_TRUE(same(v.allocation[pool], s.allocations)) << pool;
    EXPECT_TRUE(same(v.active[pool], s.allocations)) << pool;
    EXPECT_TRUE(same(v.segment[pool], s.segments)) << pool;
  }
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].current, 1u);
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].peak, 2u);
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].allocated, 2u);
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_SMALL].allocated, 0u);
  EXPECT_EQ(v.allocated_bytes[TIDEPOOL_POOL_SMALL].peak, 0u);
  EXPECT_EQ(v.num_device_alloc, s.segments_acquired);
  EXPECT_EQ(v.num_ooms, s.oom_count);

  ASSERT_EQ(tidepool_pytorch_reset_accumulated_stats(kDevice), 0) << tidepool_last_error();
  v = pytorch_stats();
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].allocated, 0u);
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].freed, 0u);
  EXPECT_EQ(v.allocated_bytes[TIDEPOOL_POOL_ALL].allocated, 0u);
  EXPECT_EQ(v.reserved_bytes[TIDEPOOL_POOL_LARGE].allocated, 0u);
  EXPECT_EQ(v.num_device_alloc, 0u);
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].current, 1u) << "currents stay";
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].peak, 2u) << "peaks stay";
  EXPECT_EQ(v.allocated_bytes[TIDEPOOL_POOL_ALL].current, s.allocated.current);
  tidepool_free(a, 3 << 20, kDevice, nullptr);
  v = pytorch_stats();
  EXPECT_EQ(v.allocation[TIDEPOOL_POOL_ALL].freed, 1u) << "counted from the reset on";
  EXPECT_EQ(v.allocated_bytes[TIDEPOOL_POOL_ALL].freed, s.allocated.current);
  EXPECT_EQ(stats(kDevice).alloc_count, 2u) << "tidepool's own totals are not reset";
  EXPECT_EQ(stats(kDevice).free_count, 2u);
}

TEST_F(CApi, PyTorchStatsRejectBadInputAndChangeNothing) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_get_pytorch_stats_v1(0, nullptr), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("NULL"), std::string::npos);
  tidepool_pytorch_stats_v1 v{};
  v.struct_size = 8;
  EXPECT_EQ(tidepool_get_pytorch_stats_v1(0, &v), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("struct_size is less than"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(v.version, 0u) << "nothing written";
  v.struct_size = sizeof v;
  EXPECT_EQ(tidepool_get_pytorch_stats_v1(tidepool::kMaxDevices, &v), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_reset_peak_stats(tidepool::kMaxDevices), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_pytorch_reset_accumulated_stats(-1), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
  ::testing::internal::GetCapturedStderr();
}

TEST_F(CApi, TagsScopeAllocationsPerThread) {
  const int tag = tidepool_tag_id("c_api_test");
  ASSERT_GE(tag, TIDEPOOL_TAG_FIRST_USER);
  EXPECT_EQ(tidepool_tag_id("c_api_test"), tag);
  EXPECT_STREQ(tidepool_tag_name(tag), "c_api_test");
  EXPECT_STREQ(tidepool_tag_name(TIDEPOOL_TAG_OPTIMIZER_STATE), "optimizer_state");
  EXPECT_EQ(tidepool_tag_id("gradient"), TIDEPOOL_TAG_GRADIENT);
  ASSERT_EQ(tidepool_tag_push(tag), 0);
  EXPECT_EQ(tidepool_tag_current(), tag);
  void* p = tidepool_malloc(10000, 0, nullptr);
  ASSERT_EQ(tidepool_tag_pop(), 0);
  EXPECT_EQ(tidepool_tag_current(), TIDEPOOL_TAG_UNTAGGED);
  tidepool_stats_v1 s = stats();
  EXPECT_EQ(s.tags[tag].count, 1u);
  EXPECT_EQ(s.tags[tag].bytes.current, 10240u);
  tidepool_free(p, 10000, 0, nullptr);
  s = stats();
  EXPECT_EQ(s.tags[tag].count, 0u);
  EXPECT_EQ(s.tags[tag].total_count, 1u);
  EXPECT_EQ(s.tags[tag].bytes.peak, 10240u);
  // The freed block (and the rest of the small segment it was cut from) stays cached under
  // the tag (Note [Cached memory by tag]).
  EXPECT_GE(s.tag_cache[tag].cached_bytes, 10240u);
  EXPECT_GE(s.tag_cache[tag].largest_free_block, 10240u);
  EXPECT_LE(s.tag_cache[tag].largest_free_block, s.largest_free_block);
  std::uint64_t cached_under_tags = 0;
  for (const tidepool_tag_cache_v1& c : s.tag_cache) cached_under_tags += c.cached_bytes;
  EXPECT_EQ(cached_under_tags, s.cached_bytes);
}

TEST_F(CApi, SnapshotIsValidJsonWithSegmentsBlocksAndEscapedTagNames) {
  const int tag = tidepool_tag_id("quote\"back\\slash\nnewline");
  ASSERT_GE(tag, 0) << tidepool_last_error();
  tidepool_tag_push(tag);
  void* p = tidepool_malloc(5 << 20, 0, nullptr);
  tidepool_tag_pop();
  char* json = tidepool_snapshot_json(0);
  ASSERT_NE(json, nullptr) << tidepool_last_error();
  const std::string text = json;
  tidepool_string_free(json);
  EXPECT_TRUE(tidepool::test::JsonChecker::valid(text)) << text;
  EXPECT_NE(text.find("\"segments\":[{"), std::string::npos);
  EXPECT_NE(text.find("\"state\":\"allocated\""), std::string::npos);
  EXPECT_NE(text.find("\"requested\":5242880"), std::string::npos);
  EXPECT_NE(text.find("quote\\\"back\\\\slash\\nnewline"), std::string::npos) << text;
  EXPECT_FALSE(tidepool::test::JsonChecker::valid("{\"a\":1,}"));  // the checker can fail
  tidepool_free(p, 5 << 20, 0, nullptr);
}

TEST_F(CApi, EmptyCacheAndRecordStreamWork) {
  void* p = tidepool_malloc(40 << 20, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(tidepool_record_stream(p, 0, nullptr), 0);  // same stream: a no-op
  tidepool_free(p, 40 << 20, 0, nullptr);
  const std::uint64_t reserved = stats().reserved.current;
  EXPECT_EQ(tidepool_empty_cache(0), 0);
  EXPECT_LE(stats().reserved.current + (40u << 20), reserved);
  EXPECT_GT(stats().segments_released, 0u);
}

// Note [record_stream from PyTorch]: PyTorch names no device; the owner of the pointer
// is found, and the block is held back from its allocating stream until the recorded
// stream has passed the call.
TEST_F(CApi, PyTorchRecordStreamFindsTheDeviceAndHoldsTheBlock) {
  constexpr int kDevice = 2;  // not device 0: the owner must be found, not assumed
  constexpr std::size_t kBytes = 6 << 20;
  tidepool::Backend& backend = tidepool::device_allocator(kDevice).backend();
  const tidepool::Stream side = backend.create_stream();
  tidepool::test_support::StreamGate gate;
  const tidepool::test_support::StreamGate::OpenOnExit open_on_exit{gate};
  backend.launch_host_func(side, &tidepool::test_support::StreamGate::wait, &gate);

  void* p = tidepool_malloc(kBytes, kDevice, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  EXPECT_EQ(tidepool_pytorch_record_stream(p, side.handle), 0) << tidepool_last_error();
  tidepool_free(p, kBytes, kDevice, nullptr);
  void* q = tidepool_malloc(kBytes, kDevice, nullptr);
  EXPECT_NE(q, p) << "handed out again while the recorded stream is held";
  gate.open();
  backend.stream_synchronize(side);
  // q stays allocated: only p's block can serve r if it is free again.
  void* r = tidepool_malloc(kBytes, kDevice, nullptr);
  EXPECT_EQ(r, p) << "the held block is free again once the stream passed";
  tidepool_free(r, kBytes, kDevice, nullptr);
  tidepool_free(q, kBytes, kDevice, nullptr);

  // Memory tidepool did not hand out is left alone, as PyTorch's allocator does.
  int outside = 0;
  EXPECT_EQ(tidepool_pytorch_record_stream(&outside, side.handle), 1);
  EXPECT_EQ(tidepool_pytorch_record_stream(nullptr, side.handle), 1);
  EXPECT_EQ(tidepool_release_stream(kDevice, side.handle), 0) << tidepool_last_error();
  backend.destroy_stream(side);
}

TEST_F(CApi, CacheInfoIsTheLargerOfFreeDeviceMemoryAndTheLargestCachedBlock) {
  tidepool::CachingAllocator& allocator = tidepool::device_allocator(0);
  constexpr std::size_t kBlock = std::size_t{16} << 20;
  void* p = tidepool_malloc(kBlock, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  tidepool_free(p, kBlock, 0, nullptr);  // cached: a free block of at least kBlock
  std::size_t largest = 0;
  ASSERT_EQ(tidepool_cache_info(0, &largest), 0) << tidepool_last_error();
  EXPECT_GE(allocator.largest_free_block(), kBlock);
  EXPECT_EQ(largest, std::max(allocator.backend().mem_info().free_bytes,
                              allocator.largest_free_block()));
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_cache_info(0, nullptr), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("NULL largest_block"), std::string::npos);
  largest = 7;
  EXPECT_EQ(tidepool_cache_info(-1, &largest), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("device -1"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(largest, 7u) << "a failed call writes nothing";
  ::testing::internal::GetCapturedStderr();
}

TEST_F(CApi, CacheInfoReportsACachedBlockLargerThanTheFreeDeviceMemory) {
  // A device whose host backend has 64 MiB: after a 48 MiB block is freed, it is cached,
  // and the device has at most 16 MiB free.
  constexpr int kSmall = 12;
  tidepool::CachingAllocator& allocator = small_device(kSmall);
  constexpr std::size_t kBlock = std::size_t{48} << 20;
  void* p = tidepool_malloc(kBlock, kSmall, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  tidepool_free(p, kBlock, kSmall, nullptr);
  ASSERT_LT(allocator.backend().mem_info().free_bytes, kBlock);
  std::size_t largest = 0;
  ASSERT_EQ(tidepool_cache_info(kSmall, &largest), 0) << tidepool_last_error();
  EXPECT_GE(largest, kBlock);
  EXPECT_EQ(largest, allocator.largest_free_block());
  EXPECT_EQ(tidepool_empty_cache(kSmall), 0) << tidepool_last_error();
  ASSERT_EQ(tidepool_cache_info(kSmall, &largest), 0) << tidepool_last_error();
  EXPECT_EQ(largest, allocator.backend().mem_info().free_bytes) << "nothing cached any more";
}

TEST_F(CApi, MemoryFractionCapsTheDeviceAndRejectsBadFractions) {
  // A device with 64 MiB: a fraction of 0.5 leaves 32 MiB to this process.
  constexpr int kCapped = 13;
  tidepool::CachingAllocator& allocator = small_device(kCapped);
  EXPECT_EQ(tidepool_get_memory_fraction(kCapped), 1.0);
  ASSERT_EQ(tidepool_set_memory_fraction(0.5, kCapped), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_get_memory_fraction(kCapped), 0.5);
  EXPECT_EQ(allocator.backend().device_limit(), std::size_t{32} << 20);
  std::size_t largest = 0;
  ASSERT_EQ(tidepool_cache_info(kCapped, &largest), 0) << tidepool_last_error();
  EXPECT_LE(largest, std::size_t{32} << 20) << "cuDNN is offered this process's share only";

  constexpr std::size_t kOver = std::size_t{40} << 20;
  EXPECT_EQ(tidepool_malloc(kOver, kCapped, nullptr), nullptr);
  EXPECT_NE(std::string(tidepool_last_error()).find("memory fraction"), std::string::npos)
      << tidepool_last_error();

  ::testing::internal::CaptureStderr();
  for (const double bad : {-0.1, 1.5, std::nan("")}) {
    EXPECT_EQ(tidepool_set_memory_fraction(bad, kCapped), -1) << bad;
    EXPECT_NE(std::string(tidepool_last_error()).find("outside [0, 1]"), std::string::npos);
  }
  EXPECT_EQ(tidepool_set_memory_fraction(0.5, -1), -1);
  EXPECT_EQ(tidepool_get_memory_fraction(tidepool::kMaxDevices), -1.0);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(tidepool_get_memory_fraction(kCapped), 0.5) << "failed calls change nothing";

  ASSERT_EQ(tidepool_set_memory_fraction(1.0, kCapped), 0) << tidepool_last_error();
  void* p = tidepool_malloc(kOver, kCapped, nullptr);
  EXPECT_NE(p, nullptr) << "1 lifts the limit: " << tidepool_last_error();
  tidepool_free(p, kOver, kCapped, nullptr);
}

TEST_F(CApi, EmptyCacheAllEmptiesEveryDeviceAndCreatesNone) {
  constexpr std::size_t kBytes = 24 << 20;
  for (int device : {0, 4}) {
    void* p = tidepool_malloc(kBytes, device, nullptr);
    ASSERT_NE(p, nullptr) << tidepool_last_error();
    tidepool_free(p, kBytes, device, nullptr);
  }
  const std::uint64_t reserved0 = stats(0).reserved.current;
  const std::uint64_t reserved4 = stats(4).reserved.current;
  ASSERT_GE(reserved0, kBytes);
  ASSERT_GE(reserved4, kBytes);
  ASSERT_EQ(tidepool::existing_device_allocator(11), nullptr);
  EXPECT_EQ(tidepool_empty_cache_all(), 0) << tidepool_last_error();
  EXPECT_LE(stats(0).reserved.current + kBytes, reserved0);
  EXPECT_LE(stats(4).reserved.current + kBytes, reserved4);
  EXPECT_EQ(tidepool::existing_device_allocator(11), nullptr);
}

// Review finding: emptying the cache of a device tidepool never used made its allocator
// (on CUDA a context), which held no cache to empty.
TEST_F(CApi, EmptyCacheOfADeviceWithoutAnAllocatorCreatesNone) {
  constexpr int kUnused = tidepool::kMaxDevices - 2;  // no test in this binary allocates there
  ASSERT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  EXPECT_EQ(tidepool_empty_cache(kUnused), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_empty_cache(tidepool::kMaxDevices), -1);  // still checked
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
}

// A failure that came from a backend call keeps its CUDA error code
// (tidepool_last_error_cuda_code), which the LD_PRELOAD shim answers the program with; any
// other error, and clearing, give 0.
TEST_F(CApi, AFailedCudaCallsErrorCodeReachesTheLastError) {
  tidepool::Backend& backend = tidepool::device_allocator(0).backend();
  backend.inject_fault(tidepool::FaultPoint::map, 1, /*cudaErrorIllegalAddress*/ 700);
  ::testing::internal::CaptureStderr();
  void* p = tidepool_malloc(static_cast<ssize_t>(std::size_t{64} << 20), 0, nullptr);
  const std::string printed = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(p, nullptr);
  EXPECT_NE(std::string(tidepool_last_error()).find("injected fault"), std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 0);
  EXPECT_EQ(tidepool_last_error_cuda_code(), 700);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_malloc(-1, 0, nullptr), nullptr);  // a bad request: no CUDA call
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(tidepool_last_error_cuda_code(), 0);
  backend.inject_fault(tidepool::FaultPoint::map, 1, 700);
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_malloc(static_cast<ssize_t>(std::size_t{64} << 20), 0, nullptr), nullptr);
  ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(tidepool_last_error_cuda_code(), 700);
  tidepool_clear_error();
  EXPECT_EQ(tidepool_last_error_cuda_code(), 0);
  void* q = tidepool_malloc(static_cast<ssize_t>(std::size_t{64} << 20), 0, nullptr);
  EXPECT_NE(q, nullptr) << tidepool_last_error();  // the process and the allocator live on
  tidepool_free(q, std::size_t{64} << 20, 0, nullptr);
}

TEST_F(CApi, OutOfMemoryIsNullWithTheMessageInTheLastError) {
  const std::uint64_t ooms = stats().oom_count;
  ::testing::internal::CaptureStderr();
  void* p = tidepool_malloc(static_cast<ssize_t>(std::size_t{1} << 40), 0, nullptr);  // 1 TiB
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(p, nullptr);
  const std::string message = tidepool_last_error();
  EXPECT_NE(message.find("out of memory: cannot allocate 1.00 TiB"), std::string::npos) << message;
  EXPECT_NE(message.find("device 0 (host backend)"), std::string::npos) << message;
  EXPECT_EQ(err, "") << "OOM is reported through the return value, not on stderr";
  EXPECT_EQ(stats().oom_count, ooms + 1);
  EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 1);
  void* q = tidepool_malloc(100, 0, nullptr);  // the process and the allocator live on
  EXPECT_NE(q, nullptr);
  tidepool_free(q, 100, 0, nullptr);
  // Any other error, and clearing, say "not out of memory".
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_malloc(static_cast<ssize_t>(std::size_t{1} << 60), 0, nullptr), nullptr);
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 0) << "an absurd size is a bad request";
  void* again = tidepool_malloc(static_cast<ssize_t>(std::size_t{1} << 40), 0, nullptr);
  EXPECT_EQ(again, nullptr);
  ASSERT_EQ(tidepool_last_error_is_out_of_memory(), 1);
  tidepool_clear_error();
  EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 0);
}

// Note [OOM into a MemPool] (review finding: pool mode had been given the plain pair, so a
// bad request or a CUDA error reached PyTorch as an out-of-memory it retried and misnamed):
// NULL for running out, tidepool's message thrown for anything else.
TEST_F(CApi, PoolMallocReturnsNullForOutOfMemoryOnlyAndThrowsTheRest) {
  EXPECT_EQ(tidepool_pytorch_pool_malloc(static_cast<ssize_t>(std::size_t{1} << 40), 0, nullptr),
            nullptr);  // 1 TiB: PyTorch frees its cache, retries, raises OutOfMemoryError
  EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 1);
  ::testing::internal::CaptureStderr();  // the negative size is also reported on stderr
  std::string thrown;
  try {
    tidepool_pytorch_pool_malloc(-5, 0, nullptr);
  } catch (const std::runtime_error& e) {
    thrown = e.what();
  }
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(thrown.find("negative size -5"), std::string::npos) << thrown;
  EXPECT_EQ(tidepool_pytorch_pool_malloc(0, 0, nullptr), nullptr);  // size 0: no error
  void* p = tidepool_pytorch_pool_malloc(5000, 0, nullptr);
  ASSERT_NE(p, nullptr);
  tidepool_pytorch_free(p, 5000, 0, nullptr);
}

// Note [OOM into PyTorch]: where tidepool_malloc returns NULL, the PyTorch entry point
// throws a std::runtime_error carrying the same message, an out-of-memory one after c10's
// own opening (pytorch_out_of_memory_message in errors.h), which training tools match.
TEST_F(CApi, PytorchMallocThrowsTidepoolsMessageWhereMallocReturnsNull) {
  std::string thrown;
  try {
    tidepool_pytorch_malloc(static_cast<ssize_t>(std::size_t{1} << 40), 0, nullptr);  // 1 TiB
  } catch (const std::runtime_error& e) {
    thrown = e.what();
  }
  EXPECT_NE(thrown.find("out of memory: cannot allocate 1.00 TiB"), std::string::npos) << thrown;
  EXPECT_EQ(thrown, "CUDA out of memory. Tried to allocate 1.00 TiB. " +
                        std::string(tidepool_last_error()));
  ::testing::internal::CaptureStderr();  // the negative size is also reported on stderr
  EXPECT_THROW(tidepool_pytorch_malloc(-5, 0, nullptr), std::runtime_error);
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(std::string(tidepool_last_error()).find("negative size -5"), std::string::npos);
  EXPECT_EQ(tidepool_pytorch_malloc(0, 0, nullptr), nullptr);  // size 0: no memory, no error

  const tidepool_stats_v1 before = stats();
  void* p = tidepool_pytorch_malloc(5000, 0, nullptr);
  ASSERT_NE(p, nullptr);
  EXPECT_EQ(stats().alloc_count, before.alloc_count + 1);
  EXPECT_EQ(stats().requested.current, before.requested.current + 5000);
  tidepool_pytorch_free(p, 5000, 0, nullptr);
  EXPECT_EQ(stats().free_count, before.free_count + 1);
  EXPECT_EQ(stats().requested.current, before.requested.current);
}

// Note [A last-error slot that outlives thread exit] (allocator/c_api.cpp): a user's
// thread_local made before the thread's first tidepool call is destroyed after
// tidepool's own thread_locals, and its destructor's failing call must still leave its
// message. The slot was a std::string, destroyed by then: the message was written into
// freed memory (ASan: heap-use-after-free).
struct FreesAtThreadExit {
  void* block = nullptr;
  std::string* seen = nullptr;
  ~FreesAtThreadExit() {
    if (block == nullptr) return;
    tidepool_free(block, 1, 0, nullptr);  // the wrong size: refused, with a message
    *seen = tidepool_last_error();
    tidepool_free(block, 4096, 0, nullptr);
  }
};
thread_local FreesAtThreadExit t_frees_at_exit;

TEST_F(CApi, AnErrorInAThreadLocalsDestructorAtThreadExitLeavesItsMessage) {
  std::string seen;
  ::testing::internal::CaptureStderr();  // misuse is also said on stderr
  std::thread([&] {
    t_frees_at_exit.seen = &seen;  // its destructor is registered first: it runs last
    t_frees_at_exit.block = tidepool_malloc(4096, 0, nullptr);
    int on_stack = 0;
    tidepool_free(&on_stack, sizeof on_stack, 0, nullptr);  // an error: the slot is in use
  }).join();
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(seen.find("that allocation has 4096 bytes"), std::string::npos) << seen;
}

// Messages of any length are kept whole (an OOM's names every tag), and cleared.
TEST_F(CApi, ALongErrorMessageIsKeptWhole) {
  const std::string message = "start " + std::string(20000, 'x') + " end";
  tidepool::set_last_error(message);
  EXPECT_EQ(std::string(tidepool_last_error()), message);
  tidepool_clear_error();
  EXPECT_STREQ(tidepool_last_error(), "");
}

using tidepool::test::count_of;

std::size_t thread_cached_blocks(int device = 0) {
  char* json = tidepool_snapshot_json(device);
  EXPECT_NE(json, nullptr) << tidepool_last_error();
  if (json == nullptr) return 0;
  const std::size_t n = count_of(json, "\"thread_cached\"");
  tidepool_string_free(json);
  return n;
}

// Note [Released streams] through the C ABI: the stream's cached memory goes back before
// the stream is destroyed, and blocks still live from it stay usable.
TEST_F(CApi, ReleaseStreamGivesTheStreamsCachedMemoryBack) {
  tidepool::Backend& backend = tidepool::device_allocator(0).backend();
  const tidepool::Stream s = backend.create_stream();
  constexpr std::size_t kBig = std::size_t{24} << 20;  // a segment of its own
  void* big = tidepool_malloc(kBig, 0, s.handle);
  void* small = tidepool_malloc(4096, 0, s.handle);
  void* live = tidepool_malloc(8192, 0, s.handle);
  ASSERT_TRUE(big != nullptr && small != nullptr && live != nullptr) << tidepool_last_error();
  tidepool_free(big, kBig, 0, s.handle);
  tidepool_free(small, 4096, 0, s.handle);  // parks in this thread's cache, for s
  const std::size_t parked = thread_cached_blocks();
  ASSERT_GE(parked, 1u);
  const tidepool_stats_v1 before = stats();

  ASSERT_EQ(tidepool_release_stream(0, s.handle), 0) << tidepool_last_error();
  backend.destroy_stream(s);
  const tidepool_stats_v1 after = stats();
  EXPECT_LE(after.reserved.current + kBig, before.reserved.current);
  EXPECT_GT(after.segments_released, before.segments_released);
  EXPECT_EQ(after.allocated.current, before.allocated.current) << "live blocks stay live";
  EXPECT_EQ(thread_cached_blocks(), parked - 1) << "nothing stays cached for the dead stream";
  tidepool_free(live, 8192, 0, nullptr);  // on a live stream, as the contract says
  EXPECT_EQ(stats().allocated.current, before.allocated.current - 8192);
}

TEST_F(CApi, ReleaseStreamRejectsBadInputAndChangesNothing) {
  tidepool::Backend& backend = tidepool::device_allocator(0).backend();
  const tidepool::Stream s = backend.create_stream();
  void* p = tidepool_malloc(4096, 0, s.handle);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  const tidepool_stats_v1 before = stats();
  const auto fails_with = [](int status, const std::string& expected) {
    EXPECT_EQ(status, -1);
    const std::string message = tidepool_last_error();
    EXPECT_NE(message.find(expected), std::string::npos) << message;
  };

  ::testing::internal::CaptureStderr();
  fails_with(tidepool_release_stream(-1, s.handle), "device -1");
  fails_with(tidepool_release_stream(tidepool::kMaxDevices, s.handle),
             "device " + std::to_string(tidepool::kMaxDevices));
  fails_with(tidepool_release_stream(0, nullptr), "default (null) stream");
  // A destroyed stream tidepool still holds something for (s, once dead) fails; one it
  // holds nothing for is released at once (Note [Releasing a stream tidepool never saw]).
  const tidepool::Stream gone = backend.create_stream();
  backend.destroy_stream(gone);
  EXPECT_EQ(tidepool_release_stream(0, gone.handle), 0) << tidepool_last_error();
  tidepool_record_stream(p, 0, gone.handle);
  fails_with(tidepool_release_stream(0, gone.handle), "unknown stream");
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, "\n"), 4u) << "misuse is printed too:\n" << err;

  const tidepool_stats_v1 after = stats();
  EXPECT_EQ(after.allocated.current, before.allocated.current);
  EXPECT_EQ(after.reserved.current, before.reserved.current);
  tidepool_free(p, 4096, 0, s.handle);  // s is still known: the failed calls released nothing
  EXPECT_EQ(tidepool_release_stream(0, s.handle), 0) << tidepool_last_error();
  backend.destroy_stream(s);
}

TEST_F(CApi, ReleaseStreamOnADeviceWithoutAnAllocatorCreatesNone) {
  constexpr int kUnused = tidepool::kMaxDevices - 1;  // no test in this binary allocates there
  ASSERT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  tidepool::Backend& backend = tidepool::device_allocator(0).backend();
  const tidepool::Stream s = backend.create_stream();
  EXPECT_EQ(tidepool_release_stream(kUnused, s.handle), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  // The checks still hold there.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_release_stream(kUnused, nullptr), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("default (null) stream on device " +
                                                    std::to_string(kUnused)),
            std::string::npos)
      << tidepool_last_error();
  EXPECT_EQ(tidepool_release_stream(tidepool::kMaxDevices, s.handle), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("does not exist"), std::string::npos)
      << tidepool_last_error();
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  EXPECT_EQ(tidepool_release_stream(0, s.handle), 0) << tidepool_last_error();
  backend.destroy_stream(s);
}

// Note [Peer access to mapped ranges] through the C ABI: the caching allocator's
// expandable segments are mapped ranges, and the peer reaches them.
TEST_F(CApi, EnablePeerAccessGrantsTheDevicesMappedMemoryNowAndLater) {
  constexpr int kDevice = 8;  // no other test in this binary uses it
  constexpr std::size_t kBytes = 8 << 20;
  void* before = tidepool_malloc(kBytes, kDevice, nullptr);
  ASSERT_NE(before, nullptr) << tidepool_last_error();
  tidepool::Backend& backend = tidepool::device_allocator(kDevice).backend();
  EXPECT_FALSE(backend.peer_has_access(before, 1));
  EXPECT_EQ(tidepool_enable_peer_access(kDevice, 1), 0) << tidepool_last_error();
  EXPECT_TRUE(backend.peer_has_access(before, 1));
  const std::uint64_t mappings = stats(kDevice).segments_acquired;
  constexpr std::size_t kMore = 96 << 20;  // more than is backed: a new mapping
  void* after = tidepool_malloc(kMore, kDevice, nullptr);
  ASSERT_NE(after, nullptr) << tidepool_last_error();
  ASSERT_GT(stats(kDevice).segments_acquired, mappings);
  EXPECT_TRUE(backend.peer_has_access(after, 1));
  EXPECT_TRUE(backend.peer_has_access(static_cast<char*>(after) + kMore - 1, 1));
  EXPECT_FALSE(backend.peer_has_access(after, 3));
  EXPECT_EQ(tidepool_peer_access_enabled(kDevice, 1), 1);
  EXPECT_EQ(tidepool_peer_access_enabled(kDevice, 3), 0);
  EXPECT_EQ(tidepool_peer_access_enabled(1, kDevice), 0);
  tidepool_free(before, kBytes, kDevice, nullptr);
  tidepool_free(after, kMore, kDevice, nullptr);
}

TEST_F(CApi, EnablePeerAccessOnADeviceWithoutAnAllocatorCreatesNoneAndIsKept) {
  constexpr int kDevice = 9;  // no other test in this binary uses it
  ASSERT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
  EXPECT_EQ(tidepool_peer_access_enabled(kDevice, 3), 0);
  EXPECT_EQ(tidepool_enable_peer_access(kDevice, 3), 0) << tidepool_last_error();
  EXPECT_EQ(tidepool_peer_access_enabled(kDevice, 3), 1);  // remembered
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
  constexpr std::size_t kBytes = 8 << 20;
  void* p = tidepool_malloc(kBytes, kDevice, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  tidepool::Backend& backend = tidepool::device_allocator(kDevice).backend();
  EXPECT_EQ(backend.peers(), std::vector<int>{3});
  EXPECT_TRUE(backend.peer_has_access(p, 3));
  tidepool_free(p, kBytes, kDevice, nullptr);
}

TEST_F(CApi, EnablePeerAccessRejectsBadDevicesAndChangesNothing) {
  constexpr int kDevice = 10;  // no other test in this binary uses it
  const auto fails_with = [](int status, const std::string& text) {
    EXPECT_EQ(status, -1);
    EXPECT_NE(std::string(tidepool_last_error()).find(text), std::string::npos)
        << tidepool_last_error();
  };
  ::testing::internal::CaptureStderr();
  fails_with(tidepool_enable_peer_access(kDevice, kDevice), "cannot be its own peer");
  fails_with(tidepool_enable_peer_access(kDevice, -1), "peer device -1 does not exist");
  fails_with(tidepool_enable_peer_access(kDevice, tidepool::kMaxDevices), "does not exist");
  fails_with(tidepool_enable_peer_access(-1, 1), "device -1 does not exist");
  fails_with(tidepool_peer_access_enabled(kDevice, tidepool::kMaxDevices),
             "16 is not a device index");
  fails_with(tidepool_peer_access_enabled(-1, 1), "-1 is not a device index");
  ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
  EXPECT_TRUE(tidepool::device_allocator(kDevice).backend().peers().empty());
}

TEST_F(CApi, FlushThreadCachesEmptiesEveryThreadsCache) {
  // Another thread parks a block and stays alive (a thread's exit would flush its cache
  // itself) until the flush is done. This thread's block is live meanwhile: an allocation
  // that finds no free block drains every cache first.
  void* p = tidepool_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr) << tidepool_last_error();
  std::promise<void> parked, flushed;
  std::thread other([&] {
    void* q = tidepool_malloc(8192, 0, nullptr);
    tidepool_free(q, 8192, 0, nullptr);
    parked.set_value();
    flushed.get_future().wait();
  });
  parked.get_future().wait();
  tidepool_free(p, 4096, 0, nullptr);
  EXPECT_GE(thread_cached_blocks(), 2u);
  const tidepool_stats_v1 before = stats();

  EXPECT_EQ(tidepool_flush_thread_caches(), 0) << tidepool_last_error();
  // Before the other thread ends: its exit would flush its cache itself.
  EXPECT_EQ(thread_cached_blocks(), 0u) << "a live thread's parked block stayed cached";
  flushed.set_value();
  other.join();
  EXPECT_EQ(thread_cached_blocks(), 0u);
  const tidepool_stats_v1 after = stats();
  EXPECT_EQ(after.allocated.current, before.allocated.current) << "parked blocks stay cached";
  EXPECT_EQ(after.reserved.current, before.reserved.current);
  EXPECT_EQ(tidepool_flush_thread_caches(), 0) << "nothing left to move is no error";
}

// TIDEPOOL_HOST_CAPACITY_MB is shifted into bytes: a count of MiB whose bytes do not fit
// a size_t would wrap to a tiny capacity (2^44 + 1 MiB: 1 MiB). It is an error instead, as
// is a negative count (strtoull would wrap it too), and no allocator is created.
TEST_F(CApi, AHostCapacityBeyondAByteCountIsRejected) {
  constexpr int kDevice = 14;  // no other test in this binary uses it
  ASSERT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
  const auto rejection = [](const char* mib) {
    EXPECT_EQ(setenv("TIDEPOOL_HOST_CAPACITY_MB", mib, 1), 0);
    std::string message;
    try {
      tidepool::device_allocator(kDevice);
    } catch (const tidepool::AllocatorUsageError& e) {
      message = e.what();
    }
    unsetenv("TIDEPOOL_HOST_CAPACITY_MB");
    return message;
  };
  std::string m = rejection("17592186044417");
  EXPECT_NE(m.find("TIDEPOOL_HOST_CAPACITY_MB='17592186044417' is too large"), std::string::npos)
      << m;
  m = rejection("99999999999999999999999");  // beyond unsigned long long as well
  EXPECT_NE(m.find("is too large"), std::string::npos) << m;
  m = rejection("-1");
  EXPECT_NE(m.find("is not a positive number of MiB"), std::string::npos) << m;
  EXPECT_EQ(tidepool::existing_device_allocator(kDevice), nullptr);
}

// Review finding: a device index out of range named a backend, with no error, where the
// rest of the C ABI refuses it.
TEST_F(CApi, BackendNameOfABadDeviceIsAnError) {
  for (const int device : {-1, 1 << 20}) {
    EXPECT_EQ(tidepool_backend_name(device), nullptr) << device;
    EXPECT_NE(std::string(tidepool_last_error()).find("device"), std::string::npos)
        << tidepool_last_error();
  }
  EXPECT_STREQ(tidepool_backend_name(0), "host");
}

TEST_F(CApi, BackendIsFixedOnceAnAllocatorExists) {
  void* p = tidepool_malloc(1, 0, nullptr);
  EXPECT_STREQ(tidepool_backend_name(0), "host");
  EXPECT_EQ(tidepool_set_backend("cuda"), -1);
  EXPECT_NE(std::string(tidepool_last_error()).find("after a device allocator was created"),
            std::string::npos);
  tidepool_free(p, 1, 0, nullptr);
}

}  // namespace
