// VmmPool's accounting of refused migrations (VmmStats::failed_migrations) and its
// destructor when backend calls fail there: a range that queued work may still use is
// kept mapped rather than unmapped under that work, a failed unmap does not stop the
// rest of the teardown, and both are said on stderr and counted (Note [Ranges kept at
// teardown] in vmm_migration.cpp). Host backend only: the failures are chosen calls of a
// wrapper around it (failing_backend.h), which also counts the live physical handles.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "allocator/c_api.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/teardown.h"
#include "tiering/tiered_store.h"  // TieringError
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::FailingBackend;
using tiering_test::random_bytes;

constexpr int kTag = TIDEPOOL_TAG_OPTIMIZER_STATE;

// How the pool's "kept" line names a range.
std::string address_and_bytes(const void* base, std::size_t bytes) {
  char text[64];
  std::snprintf(text, sizeof text, "%p (%zu bytes)", base, bytes);
  return text;
}

class VmmTeardownTest : public ::testing::Test {
 protected:
  VmmTeardownTest() : inner_(make_host_backend(0)), backend_(*inner_) {}

  std::size_t granule() const { return backend_.granularity(); }
  // The host backend's memory is the process's: a test reads a range directly, even after
  // the pool that made it is gone.
  void fill(void* ptr, const std::vector<unsigned char>& data) {
    std::memcpy(ptr, data.data(), data.size());
  }
  // Reads only what is still mapped: an unmapped range would crash the test instead of
  // failing it.
  bool holds(const void* ptr, const std::vector<unsigned char>& data) {
    try {
      inner_->peer_has_access(ptr, inner_->device());  // throws when nothing is mapped there
    } catch (const BackendError& e) {
      ADD_FAILURE() << "not mapped any more: " << e.what();
      return false;
    }
    return std::memcmp(ptr, data.data(), data.size()) == 0;
  }

  // What destroying `pool` reported: the stderr it wrote, the failed steps it counted,
  // and the ranges it kept.
  struct Destruction {
    std::string stderr_text;
    std::uint64_t failed_steps = 0;
    std::uint64_t kept_ranges = 0;
  };
  Destruction destroy(std::unique_ptr<VmmPool>& pool) {
    const std::uint64_t steps_before = teardown_error_count();
    const std::uint64_t kept_before = vmm_ranges_kept_at_teardown();
    testing::internal::CaptureStderr();
    pool.reset();
    Destruction d;
    d.stderr_text = testing::internal::GetCapturedStderr();
    d.failed_steps = teardown_error_count() - steps_before;
    d.kept_ranges = vmm_ranges_kept_at_teardown() - kept_before;
    return d;
  }

  std::unique_ptr<Backend> inner_;
  FailingBackend backend_;
};

// ---- failed_migrations ------------------------------------------------------------------

// Every migrate of a range the pool owns that throws is counted once, whether the pool
// declined it or a step failed, before or after it moved anything; bad input (a pointer
// the pool does not own) and a migration the device budget cut short are not failures.
TEST_F(VmmTeardownTest, FailedMigrationsCountsEveryRefusedMigrateOfARange) {
  VmmPool pool(backend_);
  void* p = pool.allocate(granule(), kTag);
  ASSERT_NE(p, nullptr);
  std::uint64_t failed = 0;

  // A step fails (the new backing's map).
  backend_.fail_calls_to("map", 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.stats().failed_migrations, ++failed);

  // The streams that used the range cannot be waited for: nothing is moved.
  const Stream user = inner_->create_stream();
  pool.record_use(p, user);
  backend_.fail_calls_to("event_synchronize", 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.stats().failed_migrations, ++failed);
  pool.release_stream(user);
  inner_->destroy_stream(user);

  // Declined: a chunk neither backing could be mapped back at (the new one's map and the
  // old one's), and the repair at the start of the next call fails too.
  backend_.fail_calls_to("map", 2, 1);
  EXPECT_THROW(pool.migrate(p, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.stats().failed_migrations, ++failed);
  backend_.fail_calls_to("map", 1);
  try {
    pool.migrate(p, MemoryLocation::host);
    ADD_FAILURE() << "a range with a chunk not mapped back must not migrate";
  } catch (const TieringError& e) {
    EXPECT_NE(std::string(e.what()).find("could not be mapped back"), std::string::npos)
        << e.what();
  }
  EXPECT_EQ(pool.stats().failed_migrations, ++failed);

  // The same through migrate_tag: one failure for the range it stopped at. Its repairs
  // fail again: the one at the start and the one before the range (Note [Repairs between
  // ranges] in vmm_migration.cpp).
  backend_.fail_calls_to("map", 2);
  EXPECT_THROW(pool.migrate_tag(kTag, MemoryLocation::host), TieringError);
  EXPECT_EQ(pool.stats().failed_migrations, ++failed);

  // Not failures of a migration: bad input, and a budget stop.
  int not_ours = 0;
  EXPECT_THROW(pool.migrate(&not_ours, MemoryLocation::host), TieringError);
  EXPECT_NO_THROW(pool.migrate(p, MemoryLocation::host));  // repaired by the call above
  VmmPool budgeted(backend_, VmmPoolOptions{0});
  void* q = budgeted.allocate(granule(), kTag, MemoryLocation::host);
  EXPECT_EQ(budgeted.migrate(q, MemoryLocation::device).bytes_left, granule());
  EXPECT_EQ(budgeted.stats().failed_migrations, 0u);
  EXPECT_EQ(pool.stats().failed_migrations, failed);
  budgeted.deallocate(q);
  pool.deallocate(p);
  EXPECT_EQ(backend_.live_physicals(), 0u);
}

// ---- teardown ------------------------------------------------------------------------------

// A range whose users cannot be waited for is kept whole: mapped, its data readable at the
// same address, its backing alive. The other ranges are released.
TEST_F(VmmTeardownTest, ARangeWhoseUsersCannotBeWaitedForIsKeptMapped) {
  auto pool = std::make_unique<VmmPool>(backend_);
  const std::size_t n = (VmmPool::kChunkGranules + 1) * granule();  // two chunks
  void* used = pool->allocate(n, kTag);
  void* idle = pool->allocate(granule(), kTag);
  ASSERT_TRUE(used && idle);
  const auto data = random_bytes(n, 51);
  fill(used, data);
  const Stream user = inner_->create_stream();
  pool->record_use(used, user);
  backend_.fail_calls_to("event_synchronize", 1);
  const Destruction d = destroy(pool);
  EXPECT_EQ(d.kept_ranges, 1u);
  EXPECT_EQ(d.failed_steps, 1u);
  EXPECT_EQ(backend_.live_physicals(), 2u);  // the kept range's two chunks; idle's released
  EXPECT_TRUE(holds(used, data));
  EXPECT_NE(d.stderr_text.find("tidepool: vmm pool: kept 1 pointer-stable range"),
            std::string::npos) << d.stderr_text;
  // The kept range is named by address and size; the released one is not.
  EXPECT_NE(d.stderr_text.find(address_and_bytes(used, n)), std::string::npos) << d.stderr_text;
  EXPECT_EQ(d.stderr_text.find(address_and_bytes(idle, granule())), std::string::npos)
      << d.stderr_text;
  inner_->destroy_stream(user);
}

// A migration stream that cannot be drained may still copy out of any range (and into the
// scratch range): every range is kept, none unmapped under it.
TEST_F(VmmTeardownTest, AMigrationStreamThatCannotBeDrainedKeepsEveryRange) {
  auto pool = std::make_unique<VmmPool>(backend_);
  void* a = pool->allocate(granule(), kTag);
  void* b = pool->allocate(2 * granule(), kTag);
  ASSERT_TRUE(a && b);
  pool->migrate(b, MemoryLocation::host);
  const auto data_a = random_bytes(granule(), 52);
  const auto data_b = random_bytes(2 * granule(), 53);
  fill(a, data_a);
  fill(b, data_b);
  backend_.fail_calls_to("stream_synchronize", 1);  // the destructor's first call
  const Destruction d = destroy(pool);
  EXPECT_EQ(d.kept_ranges, 2u);
  EXPECT_EQ(d.failed_steps, 1u);  // the drain; nothing else was tried and failed
  EXPECT_EQ(backend_.live_physicals(), 2u);
  EXPECT_TRUE(holds(a, data_a));
  EXPECT_TRUE(holds(b, data_b));
  EXPECT_NE(d.stderr_text.find("tidepool: vmm pool: kept 2 pointer-stable ranges"),
            std::string::npos) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find("draining the migration stream"), std::string::npos)
      << d.stderr_text;
}

// Past the first four, kept ranges are counted, not named: one line stays readable.
TEST_F(VmmTeardownTest, TheKeptLineNamesTheFirstFourRangesAndCountsTheRest) {
  auto pool = std::make_unique<VmmPool>(backend_);
  std::vector<void*> ranges;
  for (int i = 0; i < 6; ++i) {
    ranges.push_back(pool->allocate(granule(), kTag));
    ASSERT_NE(ranges.back(), nullptr);
  }
  backend_.fail_calls_to("stream_synchronize", 1);
  const Destruction d = destroy(pool);
  EXPECT_EQ(d.kept_ranges, 6u);
  std::size_t named = 0;
  for (void* r : ranges) {
    named += d.stderr_text.find(address_and_bytes(r, granule())) != std::string::npos ? 1 : 0;
  }
  EXPECT_EQ(named, 4u) << d.stderr_text;
  EXPECT_NE(d.stderr_text.find(", and 2 more"), std::string::npos) << d.stderr_text;
}

// Failed unmaps: the teardown goes on with every other chunk and range, and reports each
// failure. A range with a chunk still mapped keeps its address reserved (it is not
// released under a live mapping) and is counted as kept.
TEST_F(VmmTeardownTest, FailedUnmapsDoNotStopTheTeardown) {
  // Ranges go in address order, chunks last first: unmap calls are the first range's
  // second chunk, its first, then the second range's. Every range has two chunks, so this
  // holds whichever way the backend hands out addresses (upwards in one build, downwards
  // under TSan).
  struct Case {
    int skip;
    int failures;  // consecutive unmaps after `skip`: here each in a different range
    std::uint64_t kept;
  };
  for (const Case c : {Case{0, 1, 1}, Case{1, 2, 2}}) {
    const std::string where = std::to_string(c.failures) + " after " + std::to_string(c.skip);
    auto pool = std::make_unique<VmmPool>(backend_);
    const std::size_t two_chunks = (VmmPool::kChunkGranules + 1) * granule();
    for (int i = 0; i < 3; ++i) ASSERT_NE(pool->allocate(two_chunks, kTag), nullptr);
    backend_.fail_calls_to("unmap", c.failures, c.skip);
    const Destruction d = destroy(pool);
    EXPECT_EQ(d.failed_steps, static_cast<std::uint64_t>(c.failures)) << where << d.stderr_text;
    EXPECT_EQ(d.kept_ranges, c.kept) << where;
    // A backing whose unmap failed is released all the same (the mapping holds its memory
    // until the process ends); every other chunk is unmapped and released.
    EXPECT_EQ(backend_.live_physicals(), 0u) << where;
    EXPECT_NE(d.stderr_text.find("tidepool: vmm pool: kept " + std::to_string(c.kept) +
                                 " pointer-stable range"),
              std::string::npos) << where << d.stderr_text;
    EXPECT_NE(d.stderr_text.find("vmm pool destroyed with " + std::to_string(c.failures) +
                                 " failed release step"),
              std::string::npos) << where << d.stderr_text;
  }
}

}  // namespace
}  // namespace tidepool
