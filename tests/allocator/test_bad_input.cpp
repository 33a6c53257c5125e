// Bad input, through the C++ API and the C ABI: a clear error naming the problem, nothing
// corrupted (the allocator's stats and blocks are unchanged and it keeps working), never
// an abort. Also the legal case that looks suspicious: a free from another thread.
#include <gtest/gtest.h>

#include <string>
#include <thread>

#include "allocator/c_api.h"
#include "allocator/caching_allocator.h"
#include "allocator/device_registry.h"
#include "test_support.h"

namespace tidepool {
namespace {

class BadInput : public ::testing::Test {
 protected:
  BadInput() : alloc_(make_host_backend(0)) {}
  // Runs f, expects AllocatorUsageError whose message contains `needle`.
  template <class F>
  void expect_usage_error(F&& f, const std::string& needle) {
    try {
      f();
      ADD_FAILURE() << "expected AllocatorUsageError mentioning '" << needle << "'";
    } catch (const AllocatorUsageError& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  }
  CachingAllocator alloc_;
};

TEST_F(BadInput, DoubleFreeIsReportedAndChangesNothing) {
  void* p = alloc_.allocate(3 << 20);
  void* keep = alloc_.allocate(3 << 20);  // a live neighbour, so p stays its own block
  alloc_.deallocate(p, 3 << 20);
  const AllocatorStats before = alloc_.stats();
  expect_usage_error([&] { alloc_.deallocate(p, 3 << 20); }, "double free");
  const AllocatorStats after = alloc_.stats();
  EXPECT_EQ(after.allocations.freed, before.allocations.freed);
  EXPECT_EQ(after.allocated.current, before.allocated.current);
  void* again = alloc_.allocate(3 << 20);
  EXPECT_EQ(again, p);
  alloc_.deallocate(again, 3 << 20);
  alloc_.deallocate(keep, 3 << 20);
}

TEST_F(BadInput, DoubleFreeAfterCoalescingIsStillCaught) {
  void* a = alloc_.allocate(3 << 20);
  void* b = alloc_.allocate(3 << 20);
  void* keep = alloc_.allocate(3 << 20);
  alloc_.deallocate(a, 3 << 20);
  alloc_.deallocate(b, 3 << 20);  // merges into a's block: b is no block start any more
  expect_usage_error([&] { alloc_.deallocate(b, 3 << 20); }, "not the start of a live allocation");
  alloc_.deallocate(keep, 3 << 20);
}

TEST_F(BadInput, APointerItNeverGaveOutIsRejected) {
  int on_stack = 0;
  expect_usage_error([&] { alloc_.deallocate(&on_stack, sizeof on_stack); }, "never handed out");
  void* p = alloc_.allocate(4096);
  expect_usage_error([&] { alloc_.deallocate(static_cast<char*>(p) + 512, 512); },
                     "inside a tidepool segment");
  EXPECT_TRUE(alloc_.owns(p));
  alloc_.deallocate(p, 4096);
}

TEST_F(BadInput, AWrongSizeIsRejectedAndTheBlockStaysLive) {
  void* p = alloc_.allocate(1000);
  expect_usage_error([&] { alloc_.deallocate(p, 999); }, "that allocation has 1000 bytes");
  EXPECT_TRUE(alloc_.owns(p));
  EXPECT_EQ(alloc_.stats().allocated.current, 1024u);
  alloc_.deallocate(p, 1000);
  EXPECT_EQ(alloc_.stats().allocated.current, 0u);
}

TEST_F(BadInput, AFreeFromAnotherThreadIsLegal) {
  void* p = alloc_.allocate(5000);
  std::thread([&] { alloc_.deallocate(p, 5000); }).join();
  EXPECT_EQ(alloc_.stats().allocated.current, 0u);
  EXPECT_FALSE(alloc_.owns(p));
}

// ---- the same through the C ABI (process-wide allocators on the host backend) --------

class CBadInput : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { tidepool_set_backend("host"); }
  void SetUp() override { tidepool_clear_error(); }
  static std::string last() { return tidepool_last_error(); }
};

TEST_F(CBadInput, ZeroSizeGivesNullWithoutAnError) {
  EXPECT_EQ(tidepool_malloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(last(), "");
  // Nor an earlier call's: a caller reads the reason for a NULL right after it.
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_malloc(ssize_t{1} << 45, 0, nullptr), nullptr);  // beyond the host's 8 GiB
  ::testing::internal::GetCapturedStderr();
  ASSERT_EQ(tidepool_last_error_is_out_of_memory(), 1) << last();
  EXPECT_EQ(tidepool_malloc(0, 0, nullptr), nullptr);
  EXPECT_EQ(tidepool_last_error_is_out_of_memory(), 0);
  EXPECT_EQ(last(), "");
}

TEST_F(CBadInput, NegativeAndAbsurdSizesGiveNullAndAnError) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_malloc(-5, 0, nullptr), nullptr);
  EXPECT_NE(last().find("negative size -5"), std::string::npos) << last();
  EXPECT_NE(::testing::internal::GetCapturedStderr().find("negative size"), std::string::npos);
  EXPECT_EQ(tidepool_malloc(static_cast<ssize_t>(std::size_t{1} << 60), 0, nullptr), nullptr);
  EXPECT_NE(last().find("not a plausible size"), std::string::npos) << last();
}

TEST_F(CBadInput, UnknownDevicesAreRejected) {
  EXPECT_EQ(tidepool_malloc(100, -1, nullptr), nullptr);
  EXPECT_NE(last().find("device -1 does not exist"), std::string::npos) << last();
  EXPECT_EQ(tidepool_malloc(100, 1000, nullptr), nullptr);
  EXPECT_NE(last().find("device 1000 does not exist"), std::string::npos) << last();
}

TEST_F(CBadInput, DoubleFreeUnknownPointerAndWrongSizeSetTheLastError) {
  void* p = tidepool_malloc(4096, 0, nullptr);
  ASSERT_NE(p, nullptr);
  ::testing::internal::CaptureStderr();
  tidepool_free(p, 4095, 0, nullptr);
  EXPECT_NE(last().find("that allocation has 4096 bytes"), std::string::npos) << last();
  tidepool_clear_error();
  tidepool_free(p, 4096, 0, nullptr);
  EXPECT_EQ(last(), "");
  tidepool_free(p, 4096, 0, nullptr);
  EXPECT_NE(last().find("invalid free"), std::string::npos) << last();
  int x = 0;
  tidepool_free(&x, 4, 0, nullptr);
  EXPECT_NE(last().find("never handed out"), std::string::npos) << last();
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_NE(err.find("tidepool: free of 4095 bytes"), std::string::npos) << err;
  // Still working.
  void* q = tidepool_malloc(4096, 0, nullptr);
  EXPECT_NE(q, nullptr);
  tidepool_free(q, 4096, 0, nullptr);
}

TEST_F(CBadInput, FreeWithTheWrongDeviceNamesTheRightOne) {
  void* p = tidepool_malloc(8192, 0, nullptr);
  void* other = tidepool_malloc(8192, 1, nullptr);  // device 1 exists on the host backend
  ASSERT_NE(p, nullptr);
  ASSERT_NE(other, nullptr);
  ::testing::internal::CaptureStderr();
  tidepool_free(p, 8192, 1, nullptr);
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(last().find("allocated on device 0"), std::string::npos) << last();
  tidepool_clear_error();
  tidepool_free(p, 8192, 0, nullptr);
  tidepool_free(other, 8192, 1, nullptr);
  EXPECT_EQ(last(), "");
}

// Review finding: a free (or record_stream) naming a device tidepool never allocated on
// made an allocator there to answer (on CUDA, a context of hundreds of MiB).
TEST_F(CBadInput, AFreeOnADeviceNeverUsedMakesNoAllocatorThere) {
  constexpr int kUnused = tidepool::kMaxDevices - 1;  // no test allocates there
  ASSERT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  void* p = tidepool_malloc(8192, 0, nullptr);
  ASSERT_NE(p, nullptr);
  ::testing::internal::CaptureStderr();
  tidepool_free(p, 8192, kUnused, nullptr);
  ::testing::internal::GetCapturedStderr();
  EXPECT_NE(last().find("allocated on device 0"), std::string::npos) << last();
  tidepool_clear_error();
  EXPECT_EQ(tidepool_record_stream(p, kUnused, nullptr), -1);
  EXPECT_NE(last().find("never allocated"), std::string::npos) << last();
  EXPECT_EQ(tidepool::existing_device_allocator(kUnused), nullptr);
  tidepool_clear_error();
  tidepool_free(p, 8192, 0, nullptr);
  EXPECT_EQ(last(), "");
}

TEST_F(CBadInput, FreeFromAnotherThreadIsLegal) {
  void* p = tidepool_malloc(100, 0, nullptr);
  std::string error = "not run";
  std::thread([&] {
    tidepool_free(p, 100, 0, nullptr);
    error = tidepool_last_error();
  }).join();
  EXPECT_EQ(error, "");
}

TEST_F(CBadInput, BadCallsAroundTagsStatsAndConfiguration) {
  ::testing::internal::CaptureStderr();
  EXPECT_EQ(tidepool_tag_pop(), -1);
  EXPECT_NE(last().find("empty tag stack"), std::string::npos) << last();
  EXPECT_EQ(tidepool_tag_push(TIDEPOOL_TAG_MAX + 5), -1);
  EXPECT_NE(last().find("unknown tag"), std::string::npos) << last();
  EXPECT_EQ(tidepool_tag_id(nullptr), -1);
  EXPECT_EQ(tidepool_tag_id(""), -1);
  tidepool_stats_v1 s{};
  s.struct_size = 0;
  EXPECT_EQ(tidepool_get_stats_v1(0, &s), -1);
  EXPECT_NE(last().find("struct_size"), std::string::npos) << last();
  EXPECT_EQ(tidepool_get_stats_v1(0, nullptr), -1);
  EXPECT_EQ(tidepool_set_backend("tpu"), -1);
  EXPECT_NE(last().find("'tpu'"), std::string::npos) << last();
  EXPECT_EQ(tidepool_record_stream(&s, 0, nullptr), -1);
  EXPECT_NE(last().find("not a live allocation"), std::string::npos) << last();
  EXPECT_EQ(tidepool_tag_name(-1), nullptr);
  ::testing::internal::GetCapturedStderr();
}

}  // namespace
}  // namespace tidepool
