// VmmPool's accounting of refused migrations (VmmStats::failed_migrations). Host backend
// only: the failures are chosen calls of a wrapper around it (failing_backend.h), which
// also counts the live physical handles.
#include <gtest/gtest.h>

#include <memory>
#include <string>

#include "allocator/c_api.h"
#include "tests/tiering/failing_backend.h"
#include "tests/tiering/tiering_test_util.h"
#include "tiering/tiered_store.h"  // TieringError
#include "tiering/vmm_migration.h"

namespace tidepool {
namespace {

using tiering_test::FailingBackend;

constexpr int kTag = TIDEPOOL_TAG_OPTIMIZER_STATE;

class VmmTeardownTest : public ::testing::Test {
 protected:
  VmmTeardownTest() : inner_(make_host_backend(0)), backend_(*inner_) {}

  std::size_t granule() const { return backend_.granularity(); }

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

  // The same through migrate_tag: one failure for the range it stopped at.
  backend_.fail_calls_to("map", 1);  // the repair again
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

}  // namespace
}  // namespace tidepool
